"""``privfl.train`` on the command line: every bad input is one line and exit status 2 before anything is
written (unknown names, bad options, run names that are not plain folder names, a folder that is not a run,
retired method hooks), in this process and in real processes; ``--help`` lists the catalogue."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from privfl.train import main as train_main
from tests.helpers import QUICK, cli_error, pythonpath


def test_retired_hooks_and_bad_declarations_fail_when_loaded(tmp_path, monkeypatch, capsys):
    """Earlier releases' attacker hooks on a method are refused with one line before anything is created."""
    (tmp_path / "legacy_fl.py").write_text(
        "from privfl.methods import FLMethod\n"
        "class Hook(FLMethod):\n"
        "    sends = {'model': 'up/down'}\n"
        "    @classmethod\n"
        "    def leakage_module(cls, kind, req):\n"
        "        return None\n"
        "class Unknown(FLMethod):\n"
        "    sends = {'weights': 'up'}\n"
        "class Exposes(FLMethod):\n"
        "    sends = {'rep': 'up'}\n"
        "    exposes = ('weights',)\n"
        "class Legacy(FLMethod):\n"
        "    sends = {'small_model': 'up/down'}\n"
        "    parameter_kinds = {'small_model': 'small_model'}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = ["--out-dir", str(tmp_path), "--run-name", "x", *QUICK]
    err = cli_error(capsys, train_main, ["legacy_fl:Hook", *out])
    assert "leakage_module is no longer called" in err and "LeakageContext" in err
    err = cli_error(capsys, train_main, ["legacy_fl:Exposes", *out])
    assert "exposes names 'weights'" in err and "accepted: extractor" in err
    err = cli_error(capsys, train_main, ["legacy_fl:Unknown", *out])
    assert "unknown kind 'weights'" in err and "register_kind" in err
    assert not (tmp_path / "x").exists()
    from privfl.methods import resolve_method

    legacy = resolve_method("legacy_fl:Legacy")  # the earlier {kind: previous kind} declaration still works
    ctx = legacy.leakage_context("small_model")
    assert ctx is not None and ctx.previous == "small_model"


def test_bad_input_gives_one_line_and_status_2(tmp_path, capsys):
    err = cli_error(capsys, train_main, ["fedrex"])
    assert "unknown method 'fedrex'" in err and "fedre" in err and "fedproto" in err
    assert "accepted" in cli_error(capsys, train_main, ["fedre", "--dataset", "svhn"])
    err = cli_error(capsys, train_main, ["fedre", "--dataset", "cifar10", "--data-root", str(tmp_path), "--out-dir", str(tmp_path)])
    assert "cifar" in err.lower() and "--download" in err
    err = cli_error(capsys, train_main, ["fedre", "--model-group", "huge"])
    assert "cpu5" in err and "htm10" in err
    err = cli_error(capsys, train_main, ["fedre", "--re", "xyz", "--out-dir", str(tmp_path)])
    assert "rap" in err
    (tmp_path / "bad.toml").write_text("roundz = 3\n")
    assert "roundz" in cli_error(capsys, train_main, ["--config", str(tmp_path / "bad.toml")])
    assert "not a valid int" in cli_error(capsys, train_main, ["fedre", "--rounds", "many"])
    assert not list(tmp_path.glob("fedre-*"))  # nothing half-written


def test_help_lists_catalogue(capsys):
    with pytest.raises(SystemExit):
        train_main(["--help"])
    out = capsys.readouterr().out
    for word in ("fedre", "fedallrep", "fashionmnist", "tinyimagenet", "htm10", "cpu5", "dir", "longtail", "--join-ratio"):
        assert word in out, word
    with pytest.raises(SystemExit):
        train_main(["fedre", "--help"])
    out = capsys.readouterr().out
    assert "--re " in out and "--weight-dist" in out and "--sampling" in out


def test_real_processes_exit_2_with_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    for argv in (["privfl.train", "fedrex"], ["privfl.capture", "--run", str(tmp_path / "none"), "verify"]):
        proc = subprocess.run([sys.executable, "-m", *argv], check=False, env=env, cwd=tmp_path, capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(argv[0]), proc.stderr


@pytest.mark.parametrize("bad", [["--knowledge-rounds", "0,7"], ["--partition", "nope"], ["--knowledge-rounds", "first"]])
def test_bad_run_options_are_refused_before_the_output_folder_exists(tmp_path, capsys, bad):
    out = tmp_path / "not-yet"
    err = cli_error(capsys, train_main, ["fedavg", "--rounds", "2", "--out-dir", str(out), *bad])
    assert "\n" not in err.strip() and ("--knowledge-rounds" in err or "partition scheme" in err)
    assert not out.exists()


@pytest.mark.parametrize("name", ["..", "../outside", "a/b", ".hidden"])
def test_a_run_name_that_is_not_a_plain_folder_name_is_refused(tmp_path, capsys, name):
    out = tmp_path / "runs"
    err = cli_error(capsys, train_main, ["fedavg", "--rounds", "1", "--out-dir", str(out), "--run-name", name])
    assert "--run-name must be a plain folder name" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_existing_folder_that_is_not_a_run_is_never_written_into_or_removed(tmp_path, capsys):
    """A failed setup removes the run folder, so the run folder must be one this invocation creates."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's file\n")
    err = cli_error(capsys, train_main, ["fedavg", "--partition", "nope", "--out-dir", str(tmp_path), "--run-name", "mine"])
    assert "already exists and is not a run" in err
    assert (mine / "notes.txt").read_text() == "a user's file\n"
