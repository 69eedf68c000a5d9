"""Learned representation inversion: it beats the image a labelled message gives for free, takes every
representation family, repeats itself for a seed, and refuses in one line what it cannot attack."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from attacks import AttackNotApplicable, run_attack
from attacks.scoring import candidates, score
from privfl.attack import main as attack_main
from privfl.cli import run_cli
from privfl.train import main as train_main
from tests.helpers import FMNIST

#: a quick decoder (the defaults train 800 steps on up to 4000 population images and 3 shifted copies of each)
QUICK: dict[str, Any] = {"steps": 300, "shifts": 3, "bank": 32}


def _train(out: Path, method: str, *extra: str) -> Path:
    argv = [method, "--subsample", "1200", "--num-clients", "3", "--partition", "iid", "--no-progress", "--out-dir", str(out), "--run-name", method]
    assert train_main([*argv, *extra]) == 0
    return out / method


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    out = tmp_path_factory.mktemp("runs")
    return {
        "rep": _train(out, "fedallrep", "--rounds", "2"),
        "ent_rep": _train(out, "fedre", "--rounds", "1"),
        "proto": _train(out, "fedproto", "--rounds", "1"),
    }


def _class_mean_images(report) -> torch.Tensor:
    """The mean population image of each target's class: what its labelled message hands the attacker."""
    out = []
    for r in report.reconstructions:
        pop = r.target.payload["population"]
        ds = r.target.view.dataset
        images = pop.x * torch.tensor(ds["std"]).view(1, -1, 1, 1) + torch.tensor(ds["mean"]).view(1, -1, 1, 1)
        out.append(images[pop.y == r.target.class_id].mean(0))
    return torch.stack(out)


def test_the_decoder_beats_the_class_mean_image_and_an_untrained_decoder_does_not(runs):
    from privfl.run import Run

    run = Run.open(runs["rep"])
    truth = run.ground_truth()
    got = {}
    for name, steps in (("trained", QUICK["steps"]), ("untrained", 1)):
        report = run_attack(
            run, "invert-learned", kind="rep", clients=[0], max_targets=8, options={**QUICK, "steps": steps}, write=False, device="cpu"
        )
        got[name] = report.summary["exact_psnr255"]
    baseline = sum(score(img, candidates(truth, r.target))["exact_psnr255"] for img, r in zip(_class_mean_images(report), report.reconstructions)) / 8
    # the margin that separates them: an untrained decoder stays at (or below) the prior it starts from
    assert got["trained"] > baseline + 1.0, (got, baseline)
    assert got["untrained"] < baseline + 1.0, (got, baseline)
    assert report.protocol["threat_model"] == "curious-server-whitebox-extractor-population"
    assert {"extractor", "population"} <= set(report.protocol["knowledge_used"])


@pytest.mark.parametrize("kind", ["ent_rep", "proto", "global_proto"])
def test_aggregates_are_inverted_on_their_own_construction_and_repeat_for_a_seed(runs, kind):
    run = runs["proto" if "proto" in kind else kind]
    opts = {**QUICK, "steps": 20}

    def attack(seed: int):
        return run_attack(run, "invert-learned", kind=kind, clients=[1], max_targets=2, options=opts, seed=seed, write=False, device="cpu")

    first, again, other = attack(0), attack(0), attack(1)
    construction = {"ent_rep": "weighted_mixture", "proto": "class_mean", "global_proto": "class_mean"}[kind]
    for a, b in zip(first.reconstructions, again.reconstructions):
        assert a.notes["construction"] == construction
        assert a.image.shape == (1, 28, 28) and float(a.image.min()) >= 0 and float(a.image.max()) <= 1
        assert torch.equal(a.image, b.image)
    assert not torch.equal(first.reconstructions[0].image, other.reconstructions[0].image)
    assert 0 < first.summary["best_psnr255"] < 100 and 0 <= first.reconstructions[0].notes["outside_training_range"] <= 1


def test_the_substitute_inverts_prototypes_without_the_extractor(runs):
    report = run_attack(
        runs["proto"],
        "invert-substitute",
        kind="proto",
        clients=[0],
        max_targets=2,
        options={**QUICK, "steps": 20, "substitute_steps": 20},
        write=False,
        device="cpu",
    )
    assert report.protocol["threat_model"] == "eavesdropper-population" and report.protocol["knowledge_used"] == ["population"]
    notes = report.reconstructions[0].notes
    assert notes["anchors"].startswith("client0's own uploads") and notes["construction"] == "class_mean"
    down = run_attack(
        runs["proto"], "invert-substitute", kind="global_proto", clients=[0], max_targets=1, options=report.protocol["decoder"], write=False
    )
    assert down.reconstructions[0].notes["anchors"].startswith("global_proto broadcast to client0")
    # and it refuses a kind that names no class per row
    with pytest.raises(AttackNotApplicable, match="names no class per row"):
        run_attack(runs["ent_rep"], "invert-substitute", kind="ent_rep", options=QUICK, write=False, device="cpu")


def test_refuses_in_one_line_without_an_extractor_or_population(runs, tmp_path, capsys):
    from attacks import Selection, create_attack
    from privfl.run import Run

    bare = tmp_path / "bare"
    shutil.copytree(runs["ent_rep"], bare)
    shutil.rmtree(bare / "knowledge")
    code = run_cli("privfl.attack", lambda: attack_main(["run", "invert-learned", "--artifact", "ent_rep", "--run", str(bare), "--no-progress"]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "needs extractor" in err, err
    # called without the runner, nobody hands over population data
    attack = create_attack("invert-learned", **QUICK)
    plan = attack.plan(Run.open(runs["ent_rep"]).attacker, Selection(kind="ent_rep", clients=["client0"]))
    with pytest.raises(AttackNotApplicable, match="needs population data"):
        attack.run_batch(plan.targets)


def test_decoder_shapes_and_options():
    from attacks import create_attack
    from attacks.learned import ConvDecoder
    from privfl.errors import ConfigError

    for channels, size in ((1, 28), (3, 32), (3, 64)):
        net = ConvDecoder(16, channels, size, 32)
        assert net(torch.randn(2, 16)).shape == (2, channels, size, size)
    with pytest.raises(ConfigError, match="decoder must be conv or linear"):
        create_attack("invert-learned", decoder="mlp")
    with pytest.raises(ConfigError, match="aggregation must be auto or one of sample"):
        create_attack("invert-learned", aggregation="median")


def test_kinds_declare_their_aggregation():
    from attacks.learned import construction_of
    from privfl.kinds import AGGREGATIONS, KINDS, ArtifactKind, Family, TensorSpec

    declared = {k: KINDS.get(k).aggregation for k in ("rep", "proto", "global_proto", "ent_rep", "mean_rep")}
    assert declared == {"rep": "sample", "proto": "class_mean", "global_proto": "class_mean", "ent_rep": "weighted_mixture", "mean_rep": "mean"}
    assert all(a in AGGREGATIONS for a in declared.values()) and KINDS.get("ent_rep").describe()["aggregation"] == "weighted_mixture"
    with pytest.raises(ValueError, match="aggregation must be one of"):
        ArtifactKind("sketch2", Family.AGGREGATE_REPRESENTATION, "x", (TensorSpec("v", ndim=2),), vectors="v", aggregation="median")
    soft = ArtifactKind("mix2", Family.AGGREGATE_REPRESENTATION, "x", (TensorSpec("v", ndim=1), TensorSpec("w", ndim=1)), vectors="v", soft_label="w")
    assert construction_of(soft) == "weighted_mixture" and construction_of(soft, "sample") == "sample"


def test_colour_images_run_end_to_end(tmp_path):
    """32 px RGB (CIFAR-100's format, random pixels): the decoder is sized from the dataset."""
    from tests.fakedata import write_cifar100

    write_cifar100(tmp_path / "data", per_class=8)
    argv = ["fedallrep", "--dataset", "cifar100", "--data-root", str(tmp_path / "data"), "--num-clients", "3", "--partition", "iid"]
    assert train_main([*argv, "--rounds", "1", "--batch-size", "32", "--no-progress", "--out-dir", str(tmp_path), "--run-name", "c100"]) == 0
    report = run_attack(tmp_path / "c100", "invert-learned", kind="rep", clients=[0], max_targets=2, options={"steps": 20, "shifts": 1}, write=False)
    assert report.reconstructions[0].image.shape == (3, 32, 32) and report.summary["exact_psnr255"] > 0
