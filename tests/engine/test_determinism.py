"""``--deterministic``: torch's deterministic kernels while a run trains, torch's settings restored after it,
the same numbers as without it on the CPU, a one-line refusal where cuBLAS can no longer be made
reproducible; and, where a CUDA GPU is present, two runs in fresh processes that agree to the bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from privfl import determinism
from privfl.config import load_saved_config
from privfl.determinism import deterministic_kernels, prepare_cublas
from privfl.engine import TrainCallback
from privfl.errors import ConfigError
from privfl.run import Run
from privfl.train import build_parser
from tests.helpers import ROOT, metrics_without_time, needs_fmnist

TINY = ["--subsample", "240", "--partition", "iid", "--num-clients", "3", "--batch-size", "32", "--rounds", "2", "--no-progress"]


def _settings() -> dict:
    return determinism._current()


def test_the_kernels_are_deterministic_inside_the_block_and_restored_after_it_also_on_error() -> None:
    before = _settings()
    with deterministic_kernels(False):
        assert _settings() == before
    seen: list[dict] = []

    def fail_inside() -> None:
        with deterministic_kernels(True):
            seen.append(_settings())
            raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        fail_inside()
    assert seen == [determinism.DETERMINISTIC]
    assert _settings() == before


def test_cublas_is_given_its_workspace_before_cuda_starts_and_refused_after(monkeypatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    prepare_cublas(torch.device("cpu"))  # nothing to prepare on a CPU
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    prepare_cublas(torch.device("cuda"))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == determinism.CUBLAS_WORKSPACE
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the other reproducible setting is kept
    prepare_cublas(torch.device("cuda"))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ConfigError, match="CUBLAS_WORKSPACE_CONFIG=:4096:8"):
        prepare_cublas(torch.device("cuda"))


def test_the_train_flag_is_off_unless_given() -> None:
    assert vars(build_parser(None).parse_args(["--deterministic"]))["deterministic"] is True
    assert "deterministic" not in vars(build_parser(None).parse_args([]))


class _SeeKernels(TrainCallback):
    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_round_end(self, rnd: int, entry: dict) -> None:
        self.seen.append(torch.are_deterministic_algorithms_enabled())


@needs_fmnist
def test_a_deterministic_cpu_run_trains_with_the_kernels_on_and_gives_the_plain_runs_numbers(tmp_path: Path) -> None:
    from privfl.config import build_config
    from privfl.methods import resolve_method
    from privfl.train import train_config as engine_train

    values = {"method": "fedavg", "subsample": 240, "partition": "iid", "num_clients": 3, "batch_size": 32, "rounds": 2}
    values |= {"model_group": "homo-cnn4", "progress": False, "device": "cpu", "out_dir": str(tmp_path)}
    options = resolve_method("fedavg").Options
    before = _settings()
    plain = engine_train(build_config({**values, "run_name": "plain"}, options)).path
    spy = _SeeKernels()
    run = engine_train(build_config({**values, "run_name": "det", "deterministic": True}, options), callbacks=[spy])
    assert spy.seen == [True, True]
    assert _settings() == before  # privfl.train leaves torch as it found it
    assert load_saved_config(run.path)["deterministic"] is True
    assert load_saved_config(plain)["deterministic"] is False
    assert metrics_without_time(run.path) == metrics_without_time(plain)


def _capture_hashes(run: Path) -> list[str]:
    return [record["sha256"] for record in Run.open(run).capture.records()]


@needs_fmnist
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_deterministic_gpu_runs_in_fresh_processes_agree_to_the_bit(tmp_path: Path) -> None:
    """FedRE with BatchNorm models (ResNet among them) on the GPU, each run in its own process whose
    environment lacks CUBLAS_WORKSPACE_CONFIG (privfl must set it): metrics and every captured message equal."""
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    args = ["fedre", *TINY, "--num-clients", "5", "--model-group", "cpu5", "--device", "cuda", "--deterministic", "--out-dir", str(tmp_path)]
    runs = []
    for name in ("a", "b"):
        argv = [sys.executable, "-m", "privfl.train", *args, "--run-name", name]
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(tmp_path / name)
    assert metrics_without_time(runs[0]) == metrics_without_time(runs[1])
    assert _capture_hashes(runs[0]) == _capture_hashes(runs[1])
    assert json.loads((runs[0] / "config.json").read_text())["deterministic"] is True


@needs_fmnist
def test_an_attack_runs_with_the_kernels_on_records_it_and_matches_the_plain_attack_on_the_cpu(tmp_path: Path, monkeypatch) -> None:
    from attacks import ATTACKS, compare_artifacts, run_attack
    from privfl.attack import main as attack_main
    from privfl.train import main as train_main

    argv = ["fedre", *TINY, "--rounds", "1", "--device", "cpu", "--out-dir", str(tmp_path), "--run-name", "r"]
    assert train_main(argv) == 0
    run = tmp_path / "r"
    seen: list[bool] = []
    invert_cls = ATTACKS.get("invert")
    original = invert_cls.run_batch

    def spy(self, targets, hook):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return original(self, targets, hook)

    before = _settings()
    common: dict[str, Any] = {"kind": "ent_rep", "max_targets": 2, "options": {"steps": 3}, "device": "cpu", "write": False}
    plain = run_attack(run, "invert", **common)
    monkeypatch.setattr(invert_cls, "run_batch", spy)
    det = run_attack(run, "invert", **common, deterministic=True)
    monkeypatch.undo()
    assert seen == [True] and _settings() == before
    assert det.protocol["deterministic"] is True and plain.protocol["deterministic"] is False
    timing = ("seconds_per_target", "seconds_total")
    assert {k: v for k, v in det.summary.items() if k not in timing} == {k: v for k, v in plain.summary.items() if k not in timing}
    compared = compare_artifacts(run, ["rep", "ent_rep"], samples=1, options={"steps": 2}, device="cpu", write=False, deterministic=True)
    assert compared.protocol["deterministic"] is True
    # the CLI flag reaches the report
    assert attack_main(["invert", "--artifact", "ent_rep", "--run", str(run), "--steps", "2", "--no-progress", "--deterministic", "--name", "d"]) == 0
    assert json.loads((run / "attacks" / "d" / "metrics.json").read_text())["protocol"]["deterministic"] is True
