"""privfl.attack dlg|idlg|ig on captured FedSGD/FedNova/FedAvg messages, and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from privfl.attack import main as attack_main
from privfl.cli import run_cli
from privfl.train import main as train_main

FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    out = tmp_path_factory.mktemp("gl")
    common = ["--subsample", "600", "--partition", "iid", "--rounds", "1", "--no-progress", "--model-group", "homo-cnn4", "--out-dir", str(out)]
    for method, extra in (("fedsgd", ["--batch-size", "1"]), ("fednova", []), ("fedavg", []), ("fedre", [])):
        assert train_main([method, *common, *extra, "--run-name", method]) == 0
    return out


def test_dlg_on_a_fedsgd_gradient_recovers_the_image(runs):
    assert attack_main(["dlg", "--artifact", "grad", "--run", str(runs / "fedsgd"), "--clients", "0", "--steps", "15", "--no-progress"]) == 0
    data = json.loads((runs / "fedsgd" / "attacks" / "dlg-grad-r0" / "metrics.json").read_text())
    assert data["summary"]["psnr"] > 15 and data["images"][0]["matching"].startswith("hungarian")
    assert data["protocol"]["threat_model"] == "curious-server-previous-state"


@pytest.mark.parametrize("variant,method,kind", [("idlg", "fednova", "update"), ("ig", "fedavg", "model")])
def test_variants_run_on_updates_and_models(runs, variant, method, kind):
    assert (
        attack_main(
            [variant, "--artifact", kind, "--run", str(runs / method), "--clients", "1", "--steps", "3", "--batch-size", "2", "--no-progress"]
        )
        == 0
    )
    folder = runs / method / "attacks" / f"{variant}-{kind}-r0"
    data = json.loads((folder / "metrics.json").read_text())
    assert len(data["images"]) == 2 and (folder / "gallery.png").exists()


def test_bad_input(runs, capsys):
    def err(argv):
        code = run_cli("privfl.attack", lambda: attack_main(argv))
        text = capsys.readouterr().err.strip()
        assert code == 2 and len(text.splitlines()) == 1, text
        return text

    assert "grad" in err(["dlg", "--artifact", "ent_rep", "--run", str(runs / "fedsgd")])
    assert "accepted: (none)" in err(["dlg", "--artifact", "update", "--run", str(runs / "fedre")])
    assert "round 5" in err(["ig", "--artifact", "model", "--round", "5", "--run", str(runs / "fedavg")])


def test_a_leakage_module_named_unlike_the_messages_is_refused(runs, capsys, monkeypatch):
    """A method whose declared leakage module does not carry its messages' tensor names must not be attacked
    from random weights: one line, exit 2, before any optimisation."""
    from privfl.methods import LeakageContext
    from privfl.methods.fedsgd import FedSGD

    monkeypatch.setattr(FedSGD, "leakage", {"grad": LeakageContext(previous="model", prefix="backbone.")})
    code = run_cli(
        "privfl.attack",
        lambda: attack_main(["dlg", "--artifact", "grad", "--run", str(runs / "fedsgd"), "--clients", "0", "--steps", "2", "--no-progress"]),
    )
    text = capsys.readouterr().err.strip()
    assert code == 2 and "shares no tensor names" in text and len(text.splitlines()) == 1, text


def test_a_module_partly_never_transmitted_is_attacked_with_a_warning(tmp_path):
    """FedFree uploads single layers: the rest of the module DLG differentiates is the attacker's own
    initialisation, so the result carries a warning saying it is a guess (never a silent random head)."""
    from attacks import run_attack
    from privfl.run import Run

    argv = ["fedfree", "--subsample", "160", "--num-clients", "2", "--partition", "iid", "--rounds", "2", "--batch-size", "16"]
    assert train_main([*argv, "--no-progress", "--model-group", "homo-cnn4", "--out-dir", str(tmp_path), "--run-name", "ff"]) == 0
    report = run_attack(Run.open(tmp_path / "ff"), "dlg", kind="layer", round=1, clients=[0], options={"steps": 1, "lbfgs_max_iter": 2}, write=False)
    (warning,) = report.protocol["warnings"]
    assert "never transmitted" in warning and "a guess" in warning and "\n" not in warning
    assert all(r.notes["warning"] == warning for r in report.reconstructions)
