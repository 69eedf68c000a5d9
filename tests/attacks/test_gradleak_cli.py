"""privfl.attack dlg|idlg|ig on captured FedSGD/FedNova/FedAvg messages, and its errors."""

from __future__ import annotations

import json
import shutil

import pytest

from attacks.gradleak import cxx_compiler
from privfl.attack import main as attack_main
from privfl.cli import run_cli
from privfl.train import main as train_main
from tests.helpers import FMNIST


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


@pytest.mark.parametrize("batch", [1, 2])
def test_messages_of_one_round_are_attacked_together_or_one_at_a_time(runs, batch):
    name = f"together-{batch}"
    argv = ["dlg", "--artifact", "model", "--run", str(runs / "fedavg"), "--clients", "0,1", "--steps", "2", "--batch-size", "1"]
    assert attack_main([*argv, "--batch", str(batch), "--name", name, "--no-progress"]) == 0
    data = json.loads((runs / "fedavg" / "attacks" / name / "metrics.json").read_text())
    assert data["protocol"]["optimised_together"] == batch and data["protocol"]["config"]["batch"] == batch
    assert len(data["images"]) == 2 and all(row["psnr"] == row["psnr"] for row in data["images"])  # two finite scores


@pytest.mark.skipif(cxx_compiler() is None, reason="torch.compile on a CPU needs a C++ compiler")
def test_compile_attacks_the_messages_one_at_a_time(runs):
    """compile=True compiles leak()'s one-target closure, so an attack on a run with it optimises every target
    alone whatever --batch says, and records so."""
    argv = ["run", "dlg", "--artifact", "model", "--run", str(runs / "fedavg"), "--clients", "0,1", "--name", "compiled", "--no-progress"]
    options = ["steps=2", "max_batch=1", "batch=2", "compile=true"]
    assert attack_main([*argv, *[a for o in options for a in ("--option", o)]]) == 0
    data = json.loads((runs / "fedavg" / "attacks" / "compiled" / "metrics.json").read_text())
    assert data["protocol"]["optimised_together"] == 1 and data["protocol"]["config"]["compile"] is True
    assert len(data["images"]) == 2 and all(row["psnr"] == row["psnr"] for row in data["images"])


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


def test_output_names_and_foreign_folders_are_refused_before_the_attack_runs(runs, capsys, monkeypatch):
    """--name is one plain folder name; a folder privfl did not write (no marker) is never replaced, and
    both are refused before any optimisation; privfl's own result is replaced by a re-run."""
    import attacks.runner
    from privfl.runs import OUTPUT_MARKER

    def err(argv):
        code = run_cli("privfl.attack", lambda: attack_main(argv))
        text = capsys.readouterr().err.strip()
        assert code == 2 and len(text.splitlines()) == 1, text
        return text.removeprefix("privfl.attack: error: ")

    run = runs / "fedsgd"
    base = ["dlg", "--artifact", "grad", "--run", str(run), "--clients", "0", "--steps", "1", "--no-progress"]
    for name in (".", "..", "../../X", "a/b", ".hidden"):
        assert err([*base, "--name", name]) == f"--name must be a plain folder name (no '/', not '.', '..' or starting with '.'), got {name!r}"
    for bad, text in (
        (["--restarts", "-1"], "--restarts must be >= 1, got -1"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--lr", "0"], "--lr must be > 0, got 0.0"),
        (["--batch-size", "-2"], "--batch-size must be >= 1, got -2"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--round", "-1"], "--round must be >= 0, got -1"),
    ):
        assert err([*base, *bad]) == text
    mine = run / "attacks" / "mine"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("a user's file\n")
    default = run / "attacks" / "idlg-grad-r0"  # the name the attack would choose itself
    default.mkdir()
    called = []
    monkeypatch.setattr(attacks.runner, "execute", lambda *a, **k: called.append(1))
    assert err([*base, "--name", "mine"]) == (
        f"{mine} already exists and is not a privfl output (no .privfl-output.json); privfl replaces only folders it wrote: "
        "remove it or choose another name"
    )
    assert "idlg-grad-r0 already exists and is not a privfl output" in err(["idlg", *base[1:]])
    link = run / "attacks" / "link"
    link.symlink_to(mine)
    assert "link is a symbolic link" in err([*base, "--name", "link"])
    assert called == [] and (mine / "notes.txt").read_text() == "a user's file\n" and not any(default.iterdir())
    monkeypatch.undo()
    assert attack_main([*base, "--name", "again"]) == 0
    assert attack_main([*base, "--name", "again"]) == 0  # its own output: replaced
    assert json.loads((run / "attacks" / "again" / OUTPUT_MARKER).read_text())["written_by"] == "privfl.attack dlg"
    assert not [p for p in (run / "attacks").iterdir() if p.name.startswith(".")]  # no temp or old folder left
    link.unlink()
    for folder in (mine, default, run / "attacks" / "again"):
        shutil.rmtree(folder)
