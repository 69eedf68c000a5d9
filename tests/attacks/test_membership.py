"""Known answers of the membership attacks (attacks/membership.py), through real runs the attacker can see.

- an overfitted FedAvg client model (few samples, many local epochs) leaks membership, a well
  generalised one (many samples, one epoch) hardly: both mia-loss and mia-lira show it in AUC;
- a FedRE run (extractor knowledge + head broadcast) is attacked through its stored extractor and head;
- a gradient (FedSGD) and a probe readout (DRDFL) are refused in one line;
- through the runner: roc.png and metrics.json with AUC and TPR at 1 % FPR.
"""

from __future__ import annotations

import ast
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import attacks.membership as membership
from attacks import Selection, create_attack, run_attack
from attacks.base import Queries, Target
from privfl.capture import Message
from privfl.errors import ConfigError
from privfl.fl.method import Client
from privfl.methods import FLMethod
from privfl.run import Run
from privfl.train import main as train_main
from tests.helpers import FMNIST, MIA_COMMON, MIA_OVERFIT, one_line

DRDFL_NARROW = ["--width", "4", "--persona-width", "4", "--decoder-width", "4", "--latent-dim", "8", "--persona-dim", "6"]
#: run name -> privfl.train arguments
RUNS = {
    # 50 training samples per client seen 30 times: an overfitted client model
    "overfit": MIA_OVERFIT,
    # 500 training samples per client seen once: a well generalised one
    "general": ["fedavg", "--num-clients", "4", "--subsample", "4000", "--train-fraction", "0.5", "--local-epochs", "1", "--batch-size", "10"],
    "fedre": ["fedre", "--num-clients", "2", "--subsample", "300", "--batch-size", "32"],
    "fedsgd": ["fedsgd", "--num-clients", "2", "--subsample", "120", "--batch-size", "8"],
    "drdfl": ["drdfl", "--num-clients", "4", "--subsample", "240", "--batch-size", "32", *DRDFL_NARROW],
    "fednova": ["fednova", "--num-clients", "2", "--subsample", "160", "--batch-size", "16"],
    "fedmrl": ["fedmrl", "--num-clients", "2", "--subsample", "160", "--batch-size", "16"],
    # a layer's start-of-round value is known from round 1 on (layer replay): two rounds
    "fedfree": ["fedfree", "--num-clients", "2", "--subsample", "160", "--batch-size", "16", "--rounds", "2"],
    # per-sample logits of 250 training samples per client after 3 local epochs (see PredictionSharing)
    "logits": ["tests.attacks.test_membership:PredictionSharing", "--num-clients", "4", "--subsample", "2000", "--train-fraction", "0.5",
               "--local-epochs", "3", "--batch-size", "16"],
}  # fmt: skip


class PredictionSharing(FLMethod):
    """A user's method (test only): each client trains its own model, then uploads its logits on every
    training sample, client 0 as per-class means (FD-style), client 1 per-sample without labels, the
    others per-sample with their labels."""

    sends = {"logits": "up"}
    paper = "a test method"

    def run_round(self, rnd: int, selected: list[Client]) -> dict[str, float]:
        for c in selected:
            self.local_train(rnd, c)
            x, y = self.env.data.batch(c.train_idx)
            c.model.eval()
            with torch.no_grad():
                logits, y = c.model(x).cpu(), y.cpu()
            if c.index == 0:
                cls = torch.unique(y)
                tensors = {"logits": torch.stack([logits[y == k].mean(0) for k in cls]), "classes": cls}
            else:
                tensors = {"logits": logits, **({"labels": y} if c.index > 1 else {})}
            self.send(Message(rnd, c.name, "server", "logits", tensors), {"indices": c.train_idx.cpu()})
        return {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Run]]:
    """Each run of RUNS trained once (one round unless it says), on first use; the dataset is read once for the module."""
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    import privfl.data

    out = tmp_path_factory.mktemp("membership")
    cache: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in cache:
            rounds = [] if "--rounds" in RUNS[name] else ["--rounds", "1"]
            assert train_main([*RUNS[name], *MIA_COMMON, *rounds, "--out-dir", str(out), "--run-name", name]) == 0
            cache[name] = Run.open(out / name)  # one Run per name: its ground truth is read once too
        return cache[name]

    with pytest.MonkeyPatch.context() as mp:  # training and scoring read the same dataset: read it once
        mp.setattr(privfl.data, "load_dataset", functools.lru_cache(maxsize=2)(privfl.data.load_dataset))
        yield get


# ------------------------------------------------------------------------------------------ known answers
@pytest.mark.parametrize("attack", ["mia-loss", "mia-lira"])
def test_an_overfitted_model_leaks_membership_a_generalised_one_hardly(runs, attack):
    overfit = run_attack(runs("overfit"), attack, device="cpu", write=False)
    general = run_attack(runs("general"), attack, device="cpu", write=False)
    for label, report in (("overfit", overfit), ("general", general)):
        s = report.summary
        print(
            f"{attack} {label}: AUC {s['auc']:.3f} (per client {', '.join(format(r['auc'], '.3f') for r in report.rows)}), "
            f"TPR@1%FPR {s['tpr_at_1pct_fpr']:.3f}, advantage {s['advantage']:.3f}, {s['seconds_per_target']:.2f} s/target"
        )
        assert report.kind == "model" and s["targets"] == 4 and all(r["coverage"] == 1.0 for r in report.rows)
    assert overfit.summary["auc"] > 0.7
    assert general.summary["auc"] < 0.6 and general.summary["auc"] < overfit.summary["auc"] - 0.15
    if attack == "mia-lira":
        row = overfit.rows[0]
        assert row["shadows"] == 4 and row["shadow_size"] == 50 and row["population"] == 150 and row["variance"] == "global"


def test_the_runner_writes_the_roc_and_the_metrics(runs):
    run = runs("overfit")
    report = run_attack(run, "mia-loss", kind="model", clients=[0], device="cpu")
    assert report.folder is not None and (report.folder / "roc.png").stat().st_size > 0
    saved = json.loads((report.folder / "metrics.json").read_text())
    assert {"auc", "tpr_at_1pct_fpr", "advantage"} <= set(saved["summary"])
    assert saved["protocol"]["knowledge_used"] == ["previous_state", "candidates"]
    assert saved["protocol"]["threat_model"] == "curious-server-membership"
    (row,) = saved["images"]
    assert row["client"] == "client0" and row["queries"] == 100 and row["members"] == 50 and 0 <= row["tpr_at_1pct_fpr"] <= 1
    assert "roc.png" in (report.folder / "index.html").read_text()


def test_lira_reuses_its_shadows_and_is_seeded(runs):
    """Shadows are trained once per (architecture, request, population, queries) in one attack instance;
    the same seed gives the same scores."""
    run = runs("overfit")
    attack = create_attack("mia-lira", seed=3, shadows=2, max_shadow_epochs=2)
    first = run_attack(run, attack, clients=[1], device="cpu", write=False)
    again = run_attack(run, attack, clients=[1], device="cpu", write=False)
    assert first.rows[0]["shadows_cached"] == 0 and again.rows[0]["shadows_cached"] == 1
    assert first.reconstructions[0].scores is not None and again.reconstructions[0].scores is not None
    assert torch.equal(first.reconstructions[0].scores, again.reconstructions[0].scores)
    fresh = run_attack(run, create_attack("mia-lira", seed=3, shadows=2, max_shadow_epochs=2), clients=[1], device="cpu", write=False)
    assert fresh.reconstructions[0].scores is not None and torch.equal(fresh.reconstructions[0].scores, first.reconstructions[0].scores)


@pytest.mark.parametrize("method, kind", [("fednova", "update"), ("fedmrl", "small_model"), ("fedfree", "layer")])
def test_every_parameter_form_is_attacked_and_partial_coverage_is_a_reported_guess(runs, method, kind):
    report = run_attack(runs(method), "mia-loss", device="cpu", write=False)
    assert report.kind == kind and report.summary["targets"] == 2 and all(0 <= r["auc"] <= 1 for r in report.rows)
    coverage = [r["coverage"] for r in report.rows]
    print(f"{method} {kind}: AUC {report.summary['auc']:.3f}, coverage {coverage}")
    if method == "fedfree":  # layers never transmitted are stale or random: run, but say so
        assert all(c < 1 for c in coverage) and all("are a guess" in r["warning"] for r in report.rows)
        assert "are a guess" in report.protocol["approximation"]
    else:
        assert coverage == [1.0, 1.0] and all("warning" not in r for r in report.rows)
    if method == "fedmrl":  # the declared note of the small model travels with the result
        assert "private projector" in report.protocol["approximation"]


def test_transmitted_logits_leak_membership_by_matching_rows(runs):
    """Per-sample rows are attacked (labelled rows matched within their label), per-class rows refused in one line."""
    run = runs("logits")
    plan = create_attack("mia-logits").plan(run.attacker)
    assert {t.client for t in plan.targets} == {"client1", "client2", "client3"}
    per_class = create_attack("mia-logits").plan(run.attacker, Selection(clients=["client0"]))
    assert not per_class and "no row belongs to one record" in one_line(per_class.reason)
    report = run_attack(run, "mia-logits", device="cpu", write=False)
    rows = {r["client"]: r for r in report.rows}
    print(
        f"mia-logits: AUC {report.summary['auc']:.3f} (unlabelled client1 {rows['client1']['auc']:.3f}, labelled "
        f"{rows['client2']['auc']:.3f}, {rows['client3']['auc']:.3f}), TPR@1%FPR {report.summary['tpr_at_1pct_fpr']:.3f}"
    )
    assert report.protocol["threat_model"] == "eavesdropper-membership"
    assert rows["client1"]["rows_labelled"] is False and rows["client2"]["rows_labelled"] is True
    # labelled rows leak; unlabelled ones are near chance (0.507 with 2 threads, 0.498 with 1: float order)
    assert min(rows["client2"]["auc"], rows["client3"]["auc"]) > 0.6 and 0.4 < rows["client1"]["auc"] < min(
        rows["client2"]["auc"], rows["client3"]["auc"]
    )
    baseline = run_attack(run, "mia-logits", clients=[2, 3], options={"matching_rounds": 0}, device="cpu", write=False)
    print(f"mia-logits nearest row, no matching: AUC {baseline.summary['auc']:.3f}")
    labelled = (rows["client2"]["auc"] + rows["client3"]["auc"]) / 2
    assert baseline.summary["auc"] < labelled - 0.05  # matching and distilling is what makes it work


# ------------------------------------------------------------------------------------------ the extractor path
def test_fedre_is_attacked_through_its_stored_extractor_and_head(runs):
    run = runs("fedre")
    view = run.attacker
    plan = create_attack("mia-loss").plan(view)
    assert "mia-loss-extractor" in one_line(plan.reason)  # its models are not captured parameters: pointed to the right attack
    plan = create_attack("mia-loss-extractor").plan(view)
    assert plan.kinds == ["head"] and {t.client for t in plan.targets} == {"client0", "client1"}
    assert all(t.record is not None and t.record["receiver"] == t.client and t.round == 0 for t in plan.targets)
    report = run_attack(run, "mia-loss-extractor", device="cpu")
    print(f"fedre mia-loss-extractor AUC {report.summary['auc']:.3f}")
    assert report.summary["targets"] == 2 and 0 <= report.summary["auc"] <= 1
    assert report.protocol["knowledge_used"] == ["extractor", "candidates"] and "never transmitted" in report.protocol["approximation"]
    assert report.protocol["threat_model"] == "curious-server-extractor-membership"
    report = run_attack(run, "mia-lira-extractor", clients=[0], options={"shadows": 2, "max_shadow_epochs": 1}, device="cpu", write=False)
    assert report.summary["targets"] == 1 and 0 < report.rows[0]["population"] < 150  # client1's held-out samples
    print(f"fedre mia-lira-extractor AUC {report.summary['auc']:.3f}")
    plan = create_attack("mia-loss-extractor").plan(runs("overfit").attacker)
    assert "needs extractor" in one_line(plan.reason)


# ------------------------------------------------------------------------------------------ refusals
def test_a_gradient_and_a_probe_readout_are_refused_in_one_line(runs):
    for name in ("mia-loss", "mia-lira"):
        attack = create_attack(name)
        reason = one_line(attack.plan(runs("fedsgd").attacker, Selection(kind="grad")).reason)
        assert "gradient" in reason and "carries no trained model" in reason
        reason = one_line(attack.plan(runs("drdfl").attacker, Selection(kind="learngene")).reason)
        assert "probe readout" in reason and "random" in reason
        assert not attack.plan(runs("fedsgd").attacker)  # the model broadcasts hold no one client's training


def test_a_direct_run_without_the_challenger_is_one_line(runs):
    view = runs("overfit").attacker
    (target,) = create_attack("mia-loss").plan(view, Selection(clients=["client0"])).targets
    with pytest.raises(ConfigError, match=r"run through attacks\.run_attack") as info:
        create_attack("mia-loss").run(target)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------ attacker side only
def test_the_attacks_never_open_the_ground_truth(runs, monkeypatch):
    from privfl.capture import store

    run = runs("fedre")
    view = Run.open(run.path).attacker
    original = store.TensorStore.__init__

    def guarded(self, root, role, **kw):
        assert role != "truth", "the attack opened the ground-truth store"
        original(self, root, role, **kw)

    monkeypatch.setattr(store.TensorStore, "__init__", guarded)
    gen = torch.Generator().manual_seed(0)
    records = Queries(torch.randn(12, 1, 28, 28, generator=gen), torch.randint(0, 10, (12,), generator=gen))
    attack = create_attack("mia-lira-extractor", shadows=2, max_shadow_epochs=1)
    (target,) = attack.plan(view, Selection(clients=["client1"])).targets
    target.payload.update(queries=records, population=records)
    (recon,) = attack.run_batch([target])
    assert recon.scores is not None and recon.scores.shape == (12,) and torch.isfinite(recon.scores).all()
    tree = ast.parse(Path(membership.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert not any(m and ("groundtruth" in m or "privfl.data" in m or "scoring" in m) for m in imported)
    assert isinstance(target, Target)
