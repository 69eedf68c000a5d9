"""FedAvg: the broadcast is the sample-weighted mean of the captured uploads."""

from __future__ import annotations

import torch

from privfl.capture import TensorStore
from tests.helpers import QUICK, needs_fmnist, train


@needs_fmnist
def test_fedavg_averages_by_sample_count(tmp_path):
    run = train(tmp_path, "fedavg", *QUICK, "--model-group", "homo-cnn4", "--partition", "dir", "--alpha", "0.5", "--min-samples", "10")
    capture = TensorStore(run / "capture", "capture")
    recs = capture.records()
    ups = [r for r in recs if r["direction"] == "up"]
    down = [r for r in recs if r["direction"] == "down" and r["meta"].get("phase") == "train"][0]
    weights = torch.tensor([r["meta"]["num_samples"] for r in ups], dtype=torch.float64)
    key = "features.0.weight"
    stacked = torch.stack([capture.load(r)[key].double() for r in ups])
    expected = (stacked * (weights / weights.sum()).view(-1, *[1] * (stacked.dim() - 1))).sum(0)
    assert torch.allclose(capture.load(down)[key].double(), expected, atol=1e-6)
