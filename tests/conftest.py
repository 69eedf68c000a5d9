"""Fixtures for the whole suite: the real dataset it trains on, and the kill-and-resume check written once.
Plain helpers are in tests/helpers.py; fixtures that only one folder uses are in that folder's conftest.py.

The suite runs on every core with pytest-xdist (``-n auto --dist loadfile``: one test file per worker,
so a module's fixtures are built once). Each worker, and every subprocess a test starts, uses one
torch thread: workers sharing the cores with several threads each slow each other down 10-30x.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import FMNIST, ROOT, metrics_without_time, pythonpath, read_metrics

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


def _deterministic_gpu() -> None:
    """On a machine with a CUDA GPU (CI has none): deterministic kernels and no TF32, so that the tests
    comparing two runs bit for bit (resume, workers, a method reduced to another) compare the same
    arithmetic. A plain privfl run on a GPU is not bit-reproducible (cuDNN picks kernels per call, TF32
    matmuls) unless it is given ``--deterministic``; privfl promises identical numbers on the CPU.
    ``warn_only``: an operation without a deterministic CUDA kernel warns (and names itself) instead of
    failing the test."""
    import torch

    if not torch.cuda.is_available():
        return
    from privfl.determinism import CUBLAS_WORKSPACE, set_deterministic_kernels

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # inherited by the subprocesses tests start
    set_deterministic_kernels()  # privfl's --deterministic, for the whole session


_deterministic_gpu()


@pytest.fixture
def fmnist() -> Path:
    """Skip unless Fashion-MNIST is installed (``apt-get install dataset-fashion-mnist``; make setup does it)."""
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    return FMNIST


@pytest.fixture
def assert_resumes_exactly(tmp_path: Path, fmnist: Path) -> Callable[..., list[dict]]:
    """``check(argv, kill_round, kill_after, real_kill=False)``: train ``argv`` (``privfl.train`` arguments) to
    the end; train it again stopped right after message ``kill_after`` of round ``kill_round``; resume the
    stopped run with ``--resume``; assert identical metrics and identical capture, knowledge and truth
    stores. Returns the capture records. ``real_kill``: every part in its own one-thread process and the
    stop an ``os._exit(137)`` (no cleanup, as SIGKILL), as tests/engine/test_resume.py checks once; otherwise the
    three parts run in this (one-thread) process and the stop is an exception at the same point, which
    costs no torch imports. Either way all parts compute on one thread, so float reductions agree bit for bit."""
    from privfl.capture import TensorStore

    env = {**os.environ, "PYTHONPATH": pythonpath(), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

    def run(cmd: list[str], expect: int = 0) -> None:
        done = subprocess.run([sys.executable, *cmd], check=False, env=env, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == expect, done.stderr[-3000:]

    def check(argv: list[str], kill_round: int, kill_after: int, real_kill: bool = False) -> list[dict]:
        out = ["--out-dir", str(tmp_path), "--no-progress"]
        full, killed = tmp_path / "full", tmp_path / "killed"
        if real_kill:
            run(["-m", "privfl.train", *argv, *out, "--run-name", "full"])
            run(["-m", "tests.killer", str(kill_round), str(kill_after), *argv, *out, "--run-name", "killed"], expect=137)
        else:
            import torch

            from privfl.train import main
            from tests.killer import InterruptAfter, Interrupted

            torch.set_num_threads(1)
            assert main([*argv, *out, "--run-name", "full"]) == 0
            with pytest.raises(Interrupted):
                main([*argv, *out, "--run-name", "killed"], callbacks=[InterruptAfter(kill_round, kill_after)])
        assert len(read_metrics(killed)) == kill_round  # it died inside round kill_round
        if real_kill:
            run(["-m", "privfl.train", "--resume", str(killed), "--no-progress"])
        else:
            assert main(["--resume", str(killed), "--no-progress"]) == 0
        from privfl.verify import verify_run

        report = verify_run(killed)
        assert report.ok, report.lines()

        assert metrics_without_time(full) == metrics_without_time(killed)
        for store in ("capture", "knowledge", "truth"):
            a = TensorStore(full / store, store).records()
            assert a == TensorStore(killed / store, store).records(), store
        return TensorStore(full / "capture", "capture").records()

    return check
