"""Kill and resume: a run killed mid-round (a real ``os._exit`` in its own process) resumes to identical
metrics and stores, and defenses' state (the DP accountant) survives a resume."""

from __future__ import annotations

import json

from privfl.capture import TensorStore
from privfl.methods import METHODS
from tests.helpers import QUICK, needs_fmnist, train


def test_killed_run_resumes_to_identical_metrics_and_capture(assert_resumes_exactly):
    # on the CPU, where privfl promises the same numbers: three processes on a GPU pick their kernels each
    # (the in-process resume checks run deterministic kernels there, tests/conftest.py)
    assert_resumes_exactly(["fedre", *QUICK, "--rounds", "3", "--device", "cpu"], kill_round=1, kill_after=7, real_kill=True)


@needs_fmnist
def test_defenses_apply_through_the_channel_and_survive_resume(tmp_path):
    from privfl.config import build_config, load_saved_config
    from privfl.engine import Trainer

    run = train(
        tmp_path,
        "fedavg",
        *QUICK,
        "--rounds",
        "2",
        "--model-group",
        "homo-cnn4",
        "--defense",
        "dp:max_norm=1.0,noise_multiplier=1.0",
        "--defense",
        "quantize:bits=8",
    )
    summary = json.loads((run / "summary.json").read_text())
    dp = next(v for k, v in summary["defenses"].items() if k.startswith("dp:"))
    assert set(dp["epsilon"]) == {f"client{k}" for k in range(10)} and all(e > 0 for e in dp["epsilon"].values())
    assert all(n == 2 for n in dp["steps"].values())
    # the capture holds defended uploads: every update relative to the broadcast has norm <= 1 + noise
    capture = TensorStore(run / "capture", "capture")
    recs = capture.records()
    broadcast = capture.load([r for r in recs if r["direction"] == "down" and r["round"] == 0 and r["meta"].get("phase") == "setup"][0])
    up = capture.load([r for r in recs if r["direction"] == "up" and r["round"] == 0][0])
    quantised = up["features.0.weight"] - broadcast["features.0.weight"]
    assert len(quantised.unique()) <= 256  # quantize:bits=8 ran after dp
    # resume restores the accountant exactly
    cfg = build_config(load_saved_config(run), METHODS.get("fedavg").Options)
    trainer = Trainer(cfg, run, resume=True)
    trainer.load_checkpoint()
    restored = next(d for d in trainer.defenses if d.name == "dp").report()
    assert restored["epsilon"] == dp["epsilon"] and restored["steps"] == dp["steps"]
