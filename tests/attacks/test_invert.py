"""Deep-image-prior inversion: it works, it cannot see ground truth, and bad input fails cleanly."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from attacks.dip import DIPConfig, invert
from attacks.metrics import psnr
from attacks.priors import LEAKS, NO_EVIDENCE, PRIORS
from privfl.attack import main as attack_main
from privfl.cli import run_cli
from privfl.train import main as train_main
from tests.helpers import FMNIST

SMALL = DIPConfig(
    steps=300,
    lr=0.01,
    input_depth=8,
    channels_down=(8, 16, 32),
    channels_up=(8, 16, 32),
    channels_skip=(4, 4, 4),
    filters_down=(3, 3, 3),
    filters_up=(3, 3, 3),
)


def camera(size: int = 32) -> torch.Tensor:
    from skimage import data

    img = torch.from_numpy(data.camera()).float().div(255).view(1, 1, 512, 512)
    return F.interpolate(img, size=(size, size), mode="area")  # (1, 1, 32, 32) in [0,1]


def test_dip_inverts_a_known_extractor_well_above_chance():
    truth = camera()
    extractor = lambda x: F.avg_pool2d(x, 2).flatten(1)  # noqa: E731  (known, simple: 2x2 average pooling)
    target = extractor((truth - 0.5) / 0.5)
    result = invert(extractor, target, (1, 32, 32), (0.5,), (0.5,), SMALL, [0])
    from skimage import data

    other = F.interpolate(torch.from_numpy(data.moon()).float().div(255).view(1, 1, 512, 512), size=(32, 32), mode="area")
    chance = psnr(other, truth).item()  # a different real image
    got = psnr(result.images, truth).item()
    assert got > 20.0 and got > chance + 8, (got, chance)
    assert result.images.shape == (1, 1, 32, 32) and result.images.min() >= 0 and result.images.max() <= 1


DESIGNS: list[dict[str, Any]] = [
    {},
    {"downsample": "stride"},
    {"upsample": "bilinear"},
    {"padding": "reflect"},
    {"pad_to_power_of_two": False},
    {"downsample": "stride", "upsample": "bilinear", "padding": "reflect", "pad_to_power_of_two": False},
]


@pytest.mark.parametrize("design", DESIGNS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default")
def test_batched_generators_start_exactly_as_single_ones(design):
    extractor = lambda x: x.flatten(1)  # noqa: E731
    targets = torch.rand(3, 28 * 28)
    cfg = DIPConfig(**{**SMALL.__dict__, "steps": 0, **design})
    batched = invert(extractor, targets, (1, 28, 28), (0.5,), (0.5,), cfg, [5, 6, 7])
    for i, seed in enumerate([5, 6, 7]):
        single = invert(extractor, targets[i : i + 1], (1, 28, 28), (0.5,), (0.5,), cfg, [seed])
        assert torch.allclose(batched.images[i], single.images[0], atol=1e-5)


def test_generator_designs_keep_the_image_size_and_refuse_unknown_choices():
    """A native 28 px canvas halves to 14, 7 and 4 (strided) or 3 (pooled) and comes back to 28 through
    the skips; the levels follow the canvas (32 px and 28 px: 3)."""
    from privfl.errors import ConfigError

    for design in DESIGNS:
        cfg = DIPConfig(**{**SMALL.__dict__, "steps": 1, **design})
        result = invert(lambda x: x.flatten(1), torch.rand(2, 28 * 28), (1, 28, 28), (0.5,), (0.5,), cfg, [1, 2], snapshot_steps=[1])
        assert result.images.shape == (2, 1, 28, 28) and result.snapshots[1].shape == (2, 1, 28, 28)
        assert cfg.depth_for(cfg.canvas(28, 28)) == 3
    refused: list[dict[str, Any]] = [{"downsample": "max"}, {"upsample": "bicubic"}, {"padding": "circular"}]
    for bad in refused:
        with pytest.raises(ConfigError, match=f"^DIP {next(iter(bad))} must be one of"):
            DIPConfig(**bad)


def test_each_target_draws_its_own_input_noise_whatever_its_batch(monkeypatch):
    """With --reg-noise-std the noise added to generator b's input comes from seeds[b] (it came from the
    first target's seed for the whole batch): generator b sees, step by step, the input it sees alone."""
    from attacks import dip

    seen: list[torch.Tensor] = []
    forward = dip.SkipGenerator.forward

    def recording(self, x):
        seen.append(x.detach().clone())
        return forward(self, x)

    monkeypatch.setattr(dip.SkipGenerator, "forward", recording)
    extractor = lambda x: F.avg_pool2d(x, 2).flatten(1)  # noqa: E731
    targets = torch.rand(3, 14 * 14)
    cfg = DIPConfig(**{**SMALL.__dict__, "steps": 3, "reg_noise_std": 0.05})
    invert(extractor, targets, (1, 28, 28), (0.5,), (0.5,), cfg, [5, 6, 7])
    batched, depth = list(seen), cfg.input_depth
    for i, seed in enumerate([5, 6, 7]):
        seen.clear()
        invert(extractor, targets[i : i + 1], (1, 28, 28), (0.5,), (0.5,), cfg, [seed])
        assert len(seen) == len(batched) == cfg.steps + 1
        for step, (mine, alone) in enumerate(zip(batched, seen)):
            assert torch.equal(mine[:, i * depth : (i + 1) * depth], alone), (i, step)


@pytest.fixture(scope="module")
def fedre_run(tmp_path_factory) -> Path:
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    out = tmp_path_factory.mktemp("runs")
    assert (
        train_main(["fedre", "--subsample", "600", "--partition", "iid", "--rounds", "2", "--no-progress", "--out-dir", str(out), "--run-name", "r"])
        == 0
    )
    return out / "r"


def test_attack_code_never_reads_ground_truth(fedre_run, monkeypatch):
    from attacks import Selection, create_attack
    from attacks import invert as invert_mod
    from privfl.capture import store
    from privfl.run import Run

    original = store.TensorStore.__init__

    def guarded(self, root, role, **kw):
        assert role != "truth", "the attack opened the ground-truth store"
        original(self, root, role, **kw)

    monkeypatch.setattr(store.TensorStore, "__init__", guarded)
    view = Run.open(fedre_run).attacker
    attack = create_attack("invert", config=invert_mod.InversionConfig(**{**SMALL.__dict__, "steps": 3}))
    plan = attack.plan(view, Selection(kind="ent_rep", rounds=[1], clients=["client0"]))
    recons = attack.run_batch(plan.targets)
    assert len(recons) == 1 and recons[0].image.shape == (1, 28, 28) and recons[0].target.label
    # and statically: no attack-side module imports the ground-truth or partition code
    for name in ("base", "context", "dip", "invert", "gradleak", "view", "threat"):
        tree = ast.parse((Path(invert_mod.__file__).parent / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
        }
        assert not any(m and ("groundtruth" in m or "privfl.data" in m or "compare" in m or "scoring" in m) for m in imported), name
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert "GroundTruth" not in names, name


def test_every_registered_attack_declares_needs_and_consumes():
    from attacks import ATTACKS, Attack
    from attacks.threat import THREAT_MODELS, Knowledge
    from privfl.kinds import KINDS, Family

    families = {str(f) for f in Family}
    for name in ATTACKS.names():
        cls = ATTACKS.get(name)
        assert issubclass(cls, Attack) and cls.name == name and cls.paper
        assert isinstance(cls.needs, Knowledge) and cls.threat_model in THREAT_MODELS
        assert cls.consumes and cls.consumes <= families | set(KINDS.names())


def test_cli_invert_and_compare_write_results(fedre_run, capsys):
    assert attack_main(["invert", "--artifact", "ent_rep", "--run", str(fedre_run), "--steps", "3", "--no-progress", "--clients", "0,1"]) == 0
    folder = fedre_run / "attacks" / "invert-ent_rep-r1"
    data = json.loads((folder / "metrics.json").read_text())
    assert len(data["images"]) == 2 and data["protocol"]["threat_model"] == "curious-server-whitebox-extractor"
    assert data["protocol"]["lpips"].startswith(("computed", "unavailable"))
    assert {"best_psnr255", "mean_mse255", "best_ssim"} <= set(data["summary"])
    # every image result is shown against the attacker's prior, with an interval and a verdict
    summary = data["summary"]
    assert summary["verdict"] in (LEAKS, NO_EVIDENCE) and summary["strongest_prior"] in PRIORS
    assert summary["gain_psnr_low"] <= summary["gain_psnr"] <= summary["gain_psnr_high"]
    assert set(summary["calibration"]["prior"]) == set(PRIORS) and "prior_label_mixture_psnr255" in data["images"][0]
    assert (folder / "gallery.png").stat().st_size > 0 and "gallery.png" in (folder / "index.html").read_text()
    assert attack_main(["invert", "--compare", "rep,proto,ent_rep", "--run", str(fedre_run), "--steps", "3", "--no-progress", "--samples", "3"]) == 0
    folder = next((fedre_run / "attacks").glob("compare-*"))
    data = json.loads((folder / "metrics.json").read_text())
    assert data["protocol"]["counterfactual"] == {"rep": True, "proto": True, "ent_rep": False}
    assert len(data["images"]) == 9 and "ordering" in data["summary"]
    assert all(data["summary"][f"{k}_verdict"] in (LEAKS, NO_EVIDENCE) for k in ("rep", "proto", "ent_rep"))
    assert "prior: " in (folder / "index.html").read_text() or (folder / "gallery.png").exists()
    if not data["summary"]["ordering_meaningful"]:  # 3 DIP steps fail: the ordering must say it compares failures
        assert "not evidence that an artifact leaks less" in data["summary"]["ordering_note"]
    # each target's final feature error is recorded, so convergence can be checked from the outputs
    assert all(row["feature_mse"] >= 0 for row in data["images"])
    assert all(data["summary"][f"{k}_feature_mse"] >= 0 for k in ("rep", "proto", "ent_rep"))
    assert "counterfactual" in (folder / "index.html").read_text()


def test_cli_settings_start_from_privfl_or_the_dip_papers_and_explicit_options_win(fedre_run):
    from attacks.dip import PAPER_SETTINGS, DIPConfig
    from privfl.attack import build_parser, invert_options

    def resolved(*extra: str) -> dict[str, Any]:
        args = build_parser().parse_args(["invert", "--artifact", "ent_rep", *extra])
        return {k: invert_options(args)[k] for k in ("steps", "lr", "upsample")}

    d = DIPConfig()
    assert resolved() == {"steps": d.steps, "lr": d.lr, "upsample": d.upsample}
    assert resolved("--settings", "paper") == PAPER_SETTINGS == {"steps": 3100, "lr": 1e-3, "upsample": "nearest"}
    assert resolved("--settings", "paper", "--steps", "7") == {**PAPER_SETTINGS, "steps": 7}
    assert resolved("--upsample", "nearest")["upsample"] == "nearest"
    # what ran is recorded with the result
    argv = ["invert", "--artifact", "ent_rep", "--run", str(fedre_run), "--no-progress", "--clients", "0", "--max-targets", "1"]
    assert attack_main([*argv, "--settings", "paper", "--steps", "2"]) == 0
    data = json.loads((fedre_run / "attacks" / "invert-ent_rep-r1" / "metrics.json").read_text())
    assert {k: data["protocol"]["dip"][k] for k in ("steps", "lr", "upsample")} == {**PAPER_SETTINGS, "steps": 2}


def _err(capsys, argv) -> str:
    code = run_cli("privfl.attack", lambda: attack_main(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


def test_cli_errors(fedre_run, tmp_path, capsys):
    import shutil

    run = str(fedre_run)
    err = _err(capsys, ["invert", "--artifact", "proto", "--run", run])
    assert "'proto'" in err and "ent_rep" in err  # lists the kinds this run can offer
    assert "ent_rep" in _err(capsys, ["invert", "--artifact", "weights", "--run", run])
    assert "--knowledge-every" in _err(capsys, ["invert", "--artifact", "ent_rep", "--round", "0", "--run", run, "--steps", "1"])
    # a run without the knowledge the attack needs
    bare = tmp_path / "bare"
    shutil.copytree(fedre_run, bare)
    shutil.rmtree(bare / "knowledge")
    assert "needs extractor" in _err(capsys, ["invert", "--artifact", "ent_rep", "--run", str(bare), "--steps", "1"])
    # a corrupt capture
    from privfl.capture import TensorStore

    store = TensorStore(bare / "capture", "capture")
    rec = [r for r in store.records() if r["kind"] == "ent_rep" and r["round"] == 1][0]
    blob = store.blob_path(rec["sha256"])
    raw = bytearray(blob.read_bytes())
    raw[-1] ^= 0x55
    blob.write_bytes(bytes(raw))
    shutil.copytree(fedre_run / "knowledge", bare / "knowledge")
    assert "checksum" in _err(capsys, ["invert", "--artifact", "ent_rep", "--run", str(bare), "--steps", "1", "--clients", rec["sender"]])
    assert "not a privfl run" in _err(capsys, ["invert", "--artifact", "ent_rep", "--run", str(tmp_path)])


def test_bootstrap_intervals_and_chance_have_known_answers():
    from math import comb

    from attacks.priors import bootstrap_mean, chance

    iv = bootstrap_mean([1.0, 2.0, 3.0, 4.0], seed=0)
    assert iv["mean"] == 2.5 and 1.0 <= iv["low"] < 2.5 < iv["high"] <= 4.0 and iv["n"] == 4
    assert bootstrap_mean([1.0, 2.0, 3.0, 4.0], seed=0) == iv  # seeded
    wide = bootstrap_mean([0.0, 10.0] * 4, ["a", "a", "b", "b", "c", "c", "d", "d"], seed=1)
    narrow = bootstrap_mean([5.0] * 8, ["a", "a", "b", "b", "c", "c", "d", "d"], seed=1)
    assert wide["low"] < 5.0 < wide["high"] and narrow["low"] == narrow["high"] == 5.0
    # clients whose targets all agree: the cluster bootstrap's interval is set by the spread between clients
    clustered = bootstrap_mean([0.0] * 10 + [10.0] * 10, ["a"] * 10 + ["b"] * 10, seed=2)
    flat = bootstrap_mean([0.0] * 10 + [10.0] * 10, seed=2)
    assert clustered["high"] - clustered["low"] > flat["high"] - flat["low"]
    assert bootstrap_mean([3.0])["low"] == 3.0 and bootstrap_mean([float("nan")])["n"] == 0
    for k, m, pool in ((1, 1, 50), (5, 1, 50), (5, 3, 20), (2, 19, 20), (1, 20, 20)):
        assert chance(k, m, pool) == pytest.approx(1 - comb(pool - m, k) / comb(pool, k))


def test_calibration_reads_the_truth_as_leaking_and_the_prior_itself_as_not(fedre_run):
    """Known answers: the true images themselves leak beyond every prior and are identified; the strongest
    prior handed in as the 'reconstruction' shows no gain; a grey image below the prior is flagged failed."""
    from attacks.calibration import Item, calibrate, identification_item
    from attacks.matching import Candidates, score
    from attacks.priors import PriorBank, one_hot
    from privfl.run import Run

    truth = Run.open(fedre_run).ground_truth()
    bank = PriorBank(truth, seed=0)
    pools = {c: truth.client_train(c)[:3] for c in ("client0", "client1")}

    def items(pick) -> list[Item]:
        out = []
        for client, idx in pools.items():
            for i in idx:
                one = i.view(1)
                cand = Candidates(truth.images(one), torch.ones(1), 0, "own", one)
                weights = one_hot(int(truth.labels[i]), 10)
                image = pick(client, truth.images(one)[0], weights)
                out.append(Item(image, cand, "exact", client, score(image, cand), weights, identification_item(truth, client, one)))
        return out

    exact = calibrate(items(lambda c, x, w: x), truth, bank).summary
    assert exact["verdict"] == LEAKS and exact["gain"]["psnr255"]["low"] > 20 and not exact["failed"]
    for space in ("pixel", "feature"):
        assert exact["identification"][space]["top1"]["mean"] == 1.0
        assert exact["identification"][space]["chance_top1"] == pytest.approx(1 / len(truth.client_train("client0")), rel=0.2)
    strongest = exact["strongest_prior"]
    itself = calibrate(items(lambda c, x, w: bank.images(c, w)[strongest]), truth, bank).summary
    assert itself["gain"]["psnr255"]["mean"] == 0.0 and itself["verdict"] == NO_EVIDENCE and not itself["failed"]
    grey = calibrate(items(lambda c, x, w: torch.full_like(x, 0.5)), truth, bank).summary
    assert grey["failed"] and grey["verdict"] == NO_EVIDENCE and "it failed" in grey["verdict_detail"]
