"""Known answers of the strongest membership attacks (RMIA, online LiRA, scores over rounds) and of the
low-FPR reporting rule, on the overfitted FedAvg fixture of tests/attacks/test_membership.py trained for two rounds.

- RMIA (attacks/membership_rmia.py) against offline LiRA on the very same shadow models: RMIA's AUC is
  at least LiRA's; its score is checked against the definition computed pair by pair;
- online LiRA (IN and OUT shadows) beats chance;
- ``rounds="all"`` scores every round's model of a client and averages the scores; the other clients'
  models of a round serve as RMIA's references (``references="clients"``, FedMIA);
- :func:`attacks.scoring.roc`: a TPR at a low FPR is reported only where its threshold rests on >= 10
  false positives, at the FPR it really reaches; the runner pools every target's queries.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from attacks import create_attack, run_attack
from attacks.membership import ShadowTraining
from attacks.membership_rmia import rmia_scores
from attacks.scoring import bootstrap_auc, roc
from privfl.errors import ConfigError
from privfl.run import Run
from privfl.train import main as train_main
from tests.helpers import FMNIST, MIA_COMMON, MIA_OVERFIT

#: two clients, so that the whole file stays within ~40 s on one thread
CLIENTS = [0, 1]


@pytest.fixture(scope="module")
def overfit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """tests/attacks/test_membership.py's overfitted FedAvg run (50 samples per client, 30 local epochs), two rounds."""
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    import privfl.data

    out = tmp_path_factory.mktemp("membership-sota")
    with pytest.MonkeyPatch.context() as mp:  # training and scoring read the same dataset: read it once
        mp.setattr(privfl.data, "load_dataset", functools.lru_cache(maxsize=2)(privfl.data.load_dataset))
        assert train_main([*MIA_OVERFIT, *MIA_COMMON, "--rounds", "2", "--out-dir", str(out), "--run-name", "overfit"]) == 0
        yield Run.open(out / "overfit")


def aucs(report) -> str:
    return ", ".join(f"{r['client']} {r['auc']:.3f}" for r in report.rows)


# ------------------------------------------------------------------------------------------ RMIA
def test_rmia_is_at_least_as_strong_as_offline_lira_on_the_same_shadows(overfit: Run) -> None:
    lira, rmia = create_attack("mia-lira", shadows=2), create_attack("mia-rmia", shadows=2)
    assert isinstance(lira, ShadowTraining) and isinstance(rmia, ShadowTraining)
    lira_report = run_attack(overfit, lira, clients=CLIENTS, device="cpu", write=False)
    rmia.cache = lira.cache  # same seed, same key: the very shadow models LiRA trained (no second training)
    rmia_report = run_attack(overfit, rmia, clients=CLIENTS, device="cpu", write=False)
    print(
        f"offline LiRA AUC {lira_report.summary['pooled_auc']:.3f} ({aucs(lira_report)}); "
        f"RMIA AUC {rmia_report.summary['pooled_auc']:.3f} ({aucs(rmia_report)}), 2 shadows"
    )
    assert all(r["shadows_cached"] == 1 and r["shadows"] == 2 for r in rmia_report.rows)
    assert rmia_report.protocol["paper"].startswith("Zarifzadeh") and rmia_report.rows[0]["population_z"] > 0
    assert rmia_report.summary["pooled_auc"] >= lira_report.summary["pooled_auc"] > 0.7
    assert rmia_report.summary["auc"] >= lira_report.summary["auc"]


def test_rmia_scores_are_the_definition_pair_by_pair() -> None:
    """Fraction of z with LR(x, z) >= gamma, offline Pr(x) = ((1 + a) Pr_OUT(x) + (1 - a)) / 2 over the
    references that did not train on the record, against a brute-force (N, P) ratio matrix."""
    gen = torch.Generator().manual_seed(0)
    n, p, s, a = 30, 50, 3, 0.3
    log_prob = lambda *shape: torch.log(torch.rand(*shape, generator=gen, dtype=torch.float64) * 0.98 + 0.01)  # noqa: E731
    tx, rx, tz, rz = log_prob(n), log_prob(s, n), log_prob(p), log_prob(s, p)
    z_in = torch.rand(s, p, generator=gen) < 0.4
    z_in[:, 0] = True  # a record every reference trained on: left out of the z
    x_in = torch.zeros(s, n, dtype=torch.bool)
    for gamma in (1.0, 2.0):
        got, used = rmia_scores(tx, rx, x_in, tz, rz, z_in, online=False, a=a, gamma=gamma)
        out_z = ~z_in
        pr_z = (1 + a) / 2 * (rz.exp() * out_z).sum(0) / out_z.sum(0).clamp_min(1) + (1 - a) / 2
        pr_x = (1 + a) / 2 * rx.exp().mean(0) + (1 - a) / 2
        lr = (tx.exp() / pr_x)[:, None] / (tz.exp() / pr_z)[None, :]
        keep = out_z.any(0)
        assert used == int(keep.sum()) < p
        assert torch.allclose(got, (lr[:, keep] >= gamma).double().mean(1))
    online, _ = rmia_scores(tx, rx, x_in, tz, rz, z_in, online=True, a=a, gamma=1.0)
    lr = (tx.exp() / rx.exp().mean(0))[:, None] / (tz.exp() / rz.exp().mean(0))[None, :]
    assert torch.allclose(online, (lr >= 1).double().mean(1))


def test_rmia_is_attack_side_only() -> None:
    """Statically: the RMIA module imports neither the ground truth nor the scoring (only the runner scores)."""
    import ast
    from pathlib import Path

    import attacks.membership_rmia as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not any("groundtruth" in m or "privfl.data" in m or "scoring" in m for m in imported) and "GroundTruth" not in names


def test_bad_options_are_one_line_errors() -> None:
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("mia-rmia", {"offline_a": 1.5}, "offline_a"),
        ("mia-rmia", {"online": True, "shadows": 3}, "even number"),
        ("mia-rmia", {"rounds": "some"}, "rounds must be one of"),
        ("mia-lira", {"online": True, "shadows": 2}, ">= 4"),
        ("mia-rmia", {"online": True, "references": "clients"}, "needs references='shadows'"),
    ]
    for name, options, words in cases:
        with pytest.raises(ConfigError, match=words) as info:
            create_attack(name, **options)
        assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------ online LiRA
def test_online_lira_beats_chance(overfit: Run) -> None:
    report = run_attack(overfit, "mia-lira", clients=CLIENTS, options={"online": True}, device="cpu", write=False)
    print(f"online LiRA (4 shadows, 2 IN / 2 OUT per query) AUC {report.summary['pooled_auc']:.3f} ({aucs(report)})")
    assert all(r["references"].startswith("online") and r["shadows"] == 4 for r in report.rows)
    assert report.summary["pooled_auc"] > 0.55 and report.summary["pooled_auc_low"] > 0.5


# ------------------------------------------------------------------------------------------ rounds
def test_scores_over_every_round_of_a_client(overfit: Run) -> None:
    attack, last = create_attack("mia-rmia", shadows=2, rounds="all"), create_attack("mia-rmia", shadows=2)
    assert isinstance(attack, ShadowTraining) and isinstance(last, ShadowTraining)
    report = run_attack(overfit, attack, clients=CLIENTS, device="cpu", write=False)
    last.cache = attack.cache  # same shadows: only the rounds differ
    only_last = run_attack(overfit, last, clients=CLIENTS, device="cpu", write=False)
    print(f"RMIA over rounds 0-1 AUC {report.summary['pooled_auc']:.3f} ({aucs(report)}); last round only {only_last.summary['pooled_auc']:.3f}")
    assert report.round == 1 and all(r["rounds_scored"] == "0,1" and "mean of the per-round scores" in r["aggregation"] for r in report.rows)
    assert "rounds_scored" not in only_last.rows[0]
    both, one = report.reconstructions[0].scores, only_last.reconstructions[0].scores
    assert both is not None and one is not None and not torch.equal(both, one)
    assert report.summary["pooled_auc"] > 0.7


def test_the_other_clients_models_serve_as_references(overfit: Run) -> None:
    """FedMIA's "all for one": the other clients' uploads of the round are OUT references, no shadow trained."""
    report = run_attack(overfit, "mia-rmia", clients=CLIENTS, options={"references": "clients", "rounds": "all"}, device="cpu", write=False)
    print(f"RMIA, the other clients' models as references, rounds 0-1: AUC {report.summary['pooled_auc']:.3f} ({aucs(report)})")
    assert all(r["references"] == "the other 3 clients' models of round 1" for r in report.rows)  # the planned round reports
    assert all(r["shadows"] == 0 and r["rounds_scored"] == "0,1" for r in report.rows)
    assert report.summary["pooled_auc"] > 0.7


# ------------------------------------------------------------------------------------------ the low-FPR rule
def separated(non_members: int, members: int = 200, shift: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(non_members)
    scores = torch.cat([torch.randn(members, generator=gen) + shift, torch.randn(non_members, generator=gen)])
    bits = torch.cat([torch.ones(members, dtype=torch.bool), torch.zeros(non_members, dtype=torch.bool)])
    order = torch.randperm(len(bits), generator=gen)  # unsorted on purpose
    return scores[order], bits[order]


def test_a_tpr_at_a_low_fpr_needs_ten_false_positives() -> None:
    few = roc(*separated(200))
    assert few.non_members == 200 and few.low["1pct"].tpr is None and few.low["1pct"].false_positives == 2
    assert "rests on 2 false positives of 200 non-members" in few.low["1pct"].note
    assert few.low["0.1pct"].tpr is None and few.low["0.1pct"].false_positives == 0
    many = roc(*separated(2000))
    one = many.low["1pct"]
    assert one.tpr is not None and one.false_positives == 20 and one.fpr_reached == pytest.approx(0.01)
    assert one.tpr == pytest.approx(many.tpr_at_1pct_fpr) and 0 < one.tpr < 1
    assert many.low["0.1pct"].tpr is None and "rests on 2 false positives of 2000 non-members" in many.low["0.1pct"].note


def test_the_reported_fpr_is_the_one_the_threshold_reaches() -> None:
    """25 non-members tie with 100 members at the top. No threshold through the tie reaches 1 % of 2000
    non-members (20): the last one allowed lies above it, at FPR 0 on 0 false positives, so the TPR is
    unavailable; at a level of 1.25 % the tie fits, and every member (the other 100 lie between the tie
    and the remaining non-members) is found on exactly those 25 false positives."""
    from sklearn.metrics import roc_curve

    from attacks.scoring import low_fpr

    scores = torch.cat([torch.full((100,), 10.0), torch.rand(100), torch.full((25,), 10.0), torch.rand(1975) - 1.5])
    bits = torch.cat([torch.ones(200, dtype=torch.bool), torch.zeros(2000, dtype=torch.bool)])
    result = roc(scores.flip(0), bits.flip(0))
    low = result.low["1pct"]
    assert low.fpr_reached == 0.0 and low.false_positives == 0 and low.tpr is None and result.tpr_at_1pct_fpr == 0.0
    fpr, tpr, _ = roc_curve(bits.numpy(), scores.numpy(), drop_intermediate=False)
    wider = low_fpr(torch.from_numpy(fpr), torch.from_numpy(tpr), 2000, 0.0125)
    assert wider.false_positives == 25 and wider.fpr_reached == 0.0125 and wider.tpr == 1.0


def test_the_runner_pools_the_targets_and_bounds_the_auc(overfit: Run) -> None:
    report = run_attack(overfit, "mia-loss", device="cpu", write=False)
    s = report.summary
    print(f"mia-loss pooled AUC {s['pooled_auc']:.3f} [{s['pooled_auc_low']:.3f}, {s['pooled_auc_high']:.3f}] over {s['pooled_queries']} queries")
    assert s["targets"] == 4 and s["pooled_queries"] == sum(r["queries"] for r in report.rows) == 400
    assert s["pooled_non_members"] == 200 and s["pooled_tpr_1pct"] is None and "of 200 non-members" in s["pooled_tpr_1pct_note"]
    assert s["pooled_auc_low"] < s["pooled_auc"] < s["pooled_auc_high"] and s["pooled_auc_high"] - s["pooled_auc_low"] < 0.2
    assert {"auc", "tpr_at_1pct_fpr", "advantage"} <= set(s) and all(r["tpr_1pct"] is None for r in report.rows)
    assert all(r["false_positives_1pct"] == 0 and r["non_members"] == 50 for r in report.rows)  # 1 % of 50 allows none
    scores, bits = separated(200)
    assert bootstrap_auc(scores, bits, seed=1) == bootstrap_auc(scores, bits, seed=1) != bootstrap_auc(scores, bits, seed=2)  # seeded
