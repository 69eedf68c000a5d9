"""Every bad input is one line and exit status 2, found before anything is created: option ranges (CLI,
config file, Python), devices, --data-root, --run/--resume parsing, full disks and refused writes, and
output into a closed pipe. Nothing here trains except the one full-disk round trip."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from privfl.cli import run_cli
from privfl.config import TrainConfig, build_config
from privfl.errors import ConfigError
from privfl.methods import METHODS
from privfl.train import main as train_main
from privfl.train import train as train_api  # what privfl.train(...) calls
from tests.helpers import FMNIST, pythonpath


def cli_error(capsys, prog: str, main, argv: list[str]) -> str:
    code = run_cli(prog, lambda: main(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"{prog}: error: "), err
    return err.removeprefix(f"{prog}: error: ")


# ---------------------------------------------------------------------------------------- option ranges
TRAIN_BAD = [
    (["--batch-size", "0"], "option batch_size: must be >= 1, got 0"),
    (["--lr", "-1"], "option lr: must be > 0, got -1.0"),
    (["--lr", "0"], "option lr: must be > 0, got 0.0"),
    (["--seed", "-1"], "option seed: must be >= 0, got -1"),
    (["--subsample", "-5"], "option subsample: must be >= 1, got -5"),
    (["--subsample", "0"], "option subsample: must be >= 1, got 0"),
    (["--local-epochs", "0"], "option local_epochs: must be >= 1, got 0"),
    (["--eval-batch-size", "0"], "option eval_batch_size: must be >= 1, got 0"),
    (["--num-clients", "0"], "option num_clients: must be >= 1, got 0"),
    (["--rounds", "0"], "option rounds: must be >= 1, got 0"),
    (["--alpha", "0"], "option alpha: must be > 0, got 0.0"),
    (["--alpha", "-0.5"], "option alpha: must be > 0, got -0.5"),
    (["--train-fraction", "0"], "option train_fraction: must be > 0 and < 1, got 0.0"),
    (["--train-fraction", "1"], "option train_fraction: must be > 0 and < 1, got 1.0"),
    (["--train-fraction", "1.5"], "option train_fraction: must be > 0 and < 1, got 1.5"),
    (["--join-ratio", "0"], "option join_ratio: must be > 0 and <= 1, got 0.0"),
    (["--classes-per-client", "0"], "option classes_per_client: must be >= 1, got 0"),
    (["--imbalance-factor", "0.5"], "option imbalance_factor: must be >= 1, got 0.5"),
    (["--momentum", "-1"], "option momentum: must be >= 0, got -1.0"),
    (["--weight-decay", "-1"], "option weight_decay: must be >= 0, got -1.0"),
    (["--knowledge-every", "-1"], "option knowledge_every: must be >= 0, got -1"),
    (["--min-samples", "-1"], "option min_samples: must be >= 0, got -1"),
    (["--rep-dim", "0"], "option rep_dim: must be >= 1, got 0"),
    (["--server-lr", "0"], "option server_lr: must be > 0, got 0.0"),  # fedre's own options: the same checks
    (["--server-batch", "0"], "option server_batch: must be >= 1, got 0"),
    (["--device", "meta"], "unknown device 'meta'; accepted: auto, cpu, cuda, cuda:N"),
    (["--device", "cpu:0"], "unknown device 'cpu:0'; accepted: auto, cpu, cuda, cuda:N"),
    (["--device", "cuda:x"], "unknown device 'cuda:x'; accepted: auto, cpu, cuda, cuda:N"),
    (["--run-name", "../escape"], "--run-name must be a plain folder name (no '/', not starting with '.'), got '../escape'"),
]


@pytest.mark.parametrize("bad,message", TRAIN_BAD, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_train_values_out_of_range_are_one_line_before_anything_exists(tmp_path, capsys, bad, message):
    out = tmp_path / "runs"
    assert cli_error(capsys, "privfl.train", train_main, ["fedre", *bad, "--out-dir", str(out)]) == message
    assert not out.exists() and not (tmp_path / "escape").exists()


def test_a_data_root_that_does_not_exist_is_named(tmp_path, capsys):
    """Fashion-MNIST's standard place would otherwise be used silently whatever --data-root says."""
    out, missing = tmp_path / "runs", tmp_path / "no-such-data"
    err = cli_error(capsys, "privfl.train", train_main, ["fedre", "--data-root", str(missing), "--out-dir", str(out)])
    assert err == f"fashionmnist: data folder {missing} does not exist (--data-root)"
    assert not out.exists() and not missing.exists()


def test_ranges_hold_for_config_files_and_python_calls(tmp_path, capsys):
    (tmp_path / "c.toml").write_text("method = 'fedre'\nbatch_size = 0\n")
    err = cli_error(capsys, "privfl.train", train_main, ["--config", str(tmp_path / "c.toml"), "--out-dir", str(tmp_path / "o")])
    assert err == "option batch_size: must be >= 1, got 0"
    with pytest.raises(ConfigError, match=r"^option batch_size: must be >= 1, got 0$"):
        train_api("fedre", batch_size=0, out_dir=str(tmp_path / "o"))
    with pytest.raises(ConfigError, match=r"^option batch_size: must be >= 1, got 0$"):
        train_api(TrainConfig(batch_size=0, out_dir=str(tmp_path / "o")))  # a TrainConfig built by hand is checked too
    with pytest.raises(ConfigError, match=r"^option server_lr: must be > 0, got -1.0$"):
        train_api(TrainConfig(options={"server_lr": -1.0}, out_dir=str(tmp_path / "o")))
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not FMNIST.exists(), reason="apt-get install dataset-fashion-mnist")
@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["fedavg", "--model-group", "cpu5"],
            "fedavg needs identical client models, got cnn3x3, cnn4, cnn4-narrow, mlp, resnet-tiny; use --model-group homo-cnn4",
        ),
        (
            ["fedgen", "--share", "model", "--model-group", "cpu5"],
            "fedgen share=model needs identical client models, got cnn3x3, cnn4, cnn4-narrow, mlp, resnet-tiny; use share=head",
        ),
    ],
)
def test_a_refusal_while_setting_up_leaves_no_folder_it_made(tmp_path, capsys, argv, message):
    """Found only once the data and models exist (the method's own checks), after the run folder was
    claimed: the folder goes, and so do the --out-dir folders this call made; one that was there stays."""
    nested = tmp_path / "new" / "runs"
    assert cli_error(capsys, "privfl.train", train_main, [*argv, "--subsample", "300", "--out-dir", str(nested)]) == message
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    assert cli_error(capsys, "privfl.train", train_main, [*argv, "--subsample", "300", "--out-dir", str(kept / "runs")]) == message
    assert kept.is_dir() and list(kept.iterdir()) == []
    # through '..': "new/../kept" is kept itself once new exists, and must survive the clean-up
    through = tmp_path / "new" / ".." / "kept" / "runs"
    assert cli_error(capsys, "privfl.train", train_main, [*argv, "--subsample", "300", "--out-dir", str(through)]) == message
    assert kept.is_dir() and list(kept.iterdir()) == [] and not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "method,key,value,message",
    [
        ("fedfree", "k", 0, "option k: must be >= 1, got 0"),
        ("fedfree", "average_rate", 1.5, "option average_rate: must be > 0 and <= 1, got 1.5"),
        ("drdfl", "failure_rate", 1.0, "option failure_rate: must be >= 0 and < 1, got 1.0"),
        ("drdfl", "min_var", 0.0, "option min_var: must be > 0, got 0.0"),
        ("fedmrl", "small_lr", 0.0, "option small_lr: must be > 0, got 0.0"),
        ("fedproto", "lamda", -1.0, "option lamda: must be >= 0, got -1.0"),
        ("fedsgd", "server_lr", -0.1, "option server_lr: must be > 0, got -0.1"),
    ],
)
def test_method_options_declare_their_ranges(method, key, value, message):
    with pytest.raises(ConfigError) as info:
        build_config({"method": method, key: value}, METHODS.get(method).Options)
    assert str(info.value) == message


def test_help_shows_the_ranges(capsys):
    with pytest.raises(SystemExit):
        train_main(["fedre", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "local batch size (default: 64); >= 1" in out and "(default: 0.75); > 0 and < 1" in out
    assert "server SGD learning rate for the global head (default: 0.01); > 0" in out


def test_every_numeric_run_option_has_a_range():
    """A new numeric TrainConfig field must say what it accepts (or be listed here with the reason)."""
    from dataclasses import fields

    from privfl.config import field_types, range_text

    types = field_types(TrainConfig)
    assert [f.name for f in fields(TrainConfig) if types[f.name] in (int, float) and not range_text(f.metadata)] == []


# ---------------------------------------------------------------------------------------- --run / --resume
def test_run_without_resume_and_two_runs_are_refused(tmp_path, capsys):
    err = cli_error(capsys, "privfl.train", train_main, ["--run", str(tmp_path / "r")])
    assert err == f"--run names the run to resume: add --resume (python -m privfl.train --resume --run {tmp_path / 'r'})"
    err = cli_error(capsys, "privfl.train", train_main, ["--resume", "a", "--run", "b"])
    assert err == "--resume a and --run b name two runs; give one"
    err = cli_error(capsys, "privfl.train", train_main, ["--resume", "--run", str(tmp_path / "none")])
    assert str(tmp_path / "none") in err and "not a privfl run" in err  # the run named with --run, not --run-name


def test_abbreviations_are_refused_in_one_line(tmp_path, capsys):
    from privfl.analyze import main as analyze_main
    from privfl.attack import main as attack_main
    from privfl.audit import main as audit_main

    err = cli_error(capsys, "privfl.train", train_main, ["fedre", "--run-n", "x", "--out-dir", str(tmp_path)])
    assert err.startswith("unrecognized arguments: --run-n") and err.endswith("(see python -m privfl.train --help)")
    assert "unrecognized arguments: --ru" in cli_error(capsys, "privfl.attack", attack_main, ["list", "--ru", str(tmp_path)])
    assert "unrecognized arguments: --ru" in cli_error(capsys, "privfl.analyze", analyze_main, ["tsne", "--ru", str(tmp_path)])
    assert "unrecognized arguments: --pro" in cli_error(capsys, "privfl.audit", audit_main, ["fedre", "--pro", "quick"])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("before", [True, False], ids=["before", "after"])
def test_analyze_and_attack_take_run_before_or_after_the_subcommand(tmp_path, capsys, before):
    from privfl.analyze import main as analyze_main
    from privfl.attack import main as attack_main

    run = ["--run", str(tmp_path / "nope")]
    for prog, main, sub in (("privfl.attack", attack_main, ["list"]), ("privfl.analyze", analyze_main, ["gradcam", "--module", "features"])):
        err = cli_error(capsys, prog, main, [*run, *sub] if before else [*sub, *run])
        assert f"{tmp_path / 'nope'} is not a privfl run" in err, err
    err = cli_error(capsys, "privfl.analyze", analyze_main, [*run, "tsne"] if before else ["tsne", *run])
    assert f"{tmp_path / 'nope'} is not a privfl run" in err  # tsne: --run is one run, as --runs


# ---------------------------------------------------------------------------------------- disk full, permissions
@pytest.mark.parametrize(
    "exc,line",
    [
        (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/x/metrics.jsonl"), "No space left on device (ENOSPC): /runs/x/metrics.jsonl"),
        (OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/q"), f"{os.strerror(errno.EDQUOT)} (EDQUOT): /q"),
        (OSError(errno.EROFS, os.strerror(errno.EROFS), "/ro/a", None, "/ro/b"), f"{os.strerror(errno.EROFS)} (EROFS): /ro/a -> /ro/b"),
        (PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/secret"), "Permission denied (EACCES): /secret"),
        (OSError(errno.EPERM, os.strerror(errno.EPERM)), f"{os.strerror(errno.EPERM)} (EPERM) (the path was not reported)"),
    ],
)
def test_disk_and_permission_errors_are_one_line(capsys, exc, line):
    def main() -> int:
        raise exc

    code = run_cli("privfl.attack", main)
    assert (code, capsys.readouterr().err) == (2, f"privfl.attack: error: {line}\n")


def test_safetensors_io_errors_are_one_line_and_other_errors_keep_their_traceback(capsys):
    class SafetensorError(Exception):  # what safetensors raises for an I/O error, by name
        pass

    def full() -> int:
        raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28) at path "/runs/x/c.safetensors"')

    assert run_cli("privfl.train", full) == 2
    assert capsys.readouterr().err == "privfl.train: error: No space left on device (ENOSPC): /runs/x/c.safetensors\n"

    def missing() -> int:
        raise FileNotFoundError(errno.ENOENT, "gone", "/x")  # a bug of ours, not a full disk

    with pytest.raises(FileNotFoundError):
        run_cli("privfl.train", missing)


@pytest.mark.parametrize("saved", [True, False], ids=["run-kept", "nothing-kept"])
def test_train_says_how_to_resume_after_a_full_disk(tmp_path, capsys, monkeypatch, saved):
    import privfl.train as privfl_train

    def fake_train(cfg, *, callbacks=()):
        run = Path(cfg.out_dir) / cfg.run_name
        if saved:
            run.mkdir(parents=True)
            (run / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a write() fails: no path reported

    monkeypatch.setattr(privfl_train, "train_config", fake_train)
    err = cli_error(capsys, "privfl.train", train_main, ["fedavg", "--out-dir", str(tmp_path), "--run-name", "r"])
    if saved:
        hint = f"the run keeps its last complete round: python -m privfl.train --resume --run {tmp_path / 'r'} continues it"
    else:
        hint = "no round was saved, so there is nothing to resume: train again once that is fixed"
    assert err == f"No space left on device (ENOSPC) (the path was not reported); {hint}"


@pytest.mark.skipif(not FMNIST.exists(), reason="apt-get install dataset-fashion-mnist")
def test_a_run_stopped_by_a_full_disk_resumes_with_resume_run(tmp_path, capsys, monkeypatch):
    """The disk fills while round 1's checkpoint is written: one line, status 2; the run keeps round 0,
    and ``--resume --run RUN`` (the command the line gives) finishes it."""
    from privfl.engine import Trainer

    argv = ["fedavg", "--subsample", "200", "--num-clients", "2", "--partition", "iid", "--rounds", "2", "--batch-size", "32"]
    argv += ["--model-group", "homo-cnn4", "--no-progress", "--out-dir", str(tmp_path), "--run-name", "r"]
    real = Trainer.save_checkpoint

    def save_checkpoint(self, rnd: int) -> None:
        if rnd == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.run_dir / "checkpoint" / "state.tmp"))
        real(self, rnd)

    monkeypatch.setattr(Trainer, "save_checkpoint", save_checkpoint)
    err = cli_error(capsys, "privfl.train", train_main, argv)
    resume = f"python -m privfl.train --resume --run {tmp_path / 'r'}"
    where = tmp_path / "r" / "checkpoint" / "state.tmp"
    assert err == f"No space left on device (ENOSPC): {where}; the run keeps its last complete round: {resume} continues it"
    monkeypatch.setattr(Trainer, "save_checkpoint", real)
    assert train_main(resume.split()[3:]) == 0
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2


# ---------------------------------------------------------------------------------------- closed pipes
@pytest.mark.parametrize(
    "argv",
    [
        ["privfl.train", "--help"],
        pytest.param(["privfl.audit", "--help"], marks=pytest.mark.slow),  # the same run_cli path: 12 s each in the default suite
        pytest.param(["privfl.analyze", "tsne", "--help"], marks=pytest.mark.slow),
    ],
)
def test_output_into_a_closed_pipe_ends_quietly(tmp_path, argv):
    """``| head -1`` and a reader that is gone before anything is written (``| true``): no traceback, no
    'Exception ignored' at exit, status 0. PYTHONUNBUFFERED is unset: the final flush is what fails."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(PYTHONPATH=pythonpath(), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = " ".join([sys.executable, "-m", *argv])
    for reader in ("head -1", "true"):
        proc = subprocess.run(
            ["bash", "-c", f"{command} | {reader}; exit ${{PIPESTATUS[0]}}"], check=False, env=env, cwd=tmp_path, capture_output=True, text=True
        )
        assert (proc.returncode, proc.stderr) == (0, ""), (reader, proc.stderr)
        if reader.startswith("head"):
            assert proc.stdout.startswith("usage: python -m privfl.")


def test_an_error_with_stdout_closed_is_still_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(PYTHONPATH=pythonpath())
    cmd = f"{sys.executable} -m privfl.train fedre --batch-size 0 | true; exit ${{PIPESTATUS[0]}}"
    proc = subprocess.run(["bash", "-c", cmd], check=False, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert (proc.returncode, proc.stderr) == (2, "privfl.train: error: option batch_size: must be >= 1, got 0\n")
    assert not any(tmp_path.iterdir())
