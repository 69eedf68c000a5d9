"""Head and last-layer leakage: the per-class features a classifier's gradient holds, and the attack on a real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attacks.headleak import class_features
from attacks.priors import LEAKS, NO_EVIDENCE
from privfl.train import main as train_main
from tests.helpers import FMNIST


def test_one_samples_gradient_holds_its_features_exactly_and_a_batch_a_weighted_mean():
    torch.manual_seed(0)
    head = nn.Linear(16, 5)
    f = torch.randn(1, 16).relu()
    gw, gb = torch.autograd.grad(F.cross_entropy(head(f), torch.tensor([3])), [head.weight, head.bias])
    classes, vectors, how = class_features(gw, gb)
    assert classes.tolist()[0] == 3 and "dW_c / db_c" in how
    assert torch.allclose(vectors[0], f[0], atol=1e-5)
    # a batch: each present class's vector is the mean of the batch's features weighted by (p_ic - y_ic)
    feats, y = torch.randn(4, 16).relu(), torch.tensor([1, 1, 4, 1])
    gw, gb = torch.autograd.grad(F.cross_entropy(head(feats), y, reduction="sum"), [head.weight, head.bias])
    classes, vectors, _ = class_features(gw, gb)
    assert set(classes.tolist()) == {1, 4} and classes.tolist()[0] == 1  # the class the batch holds most of first
    coeff = (F.softmax(head(feats), 1) - F.one_hot(y, 5)).detach()
    for c, v in zip(classes.tolist(), vectors):
        w = coeff[:, c] / coeff[:, c].sum()
        assert torch.allclose(v, (w[:, None] * feats).sum(0), atol=1e-4)
    # without a bias only the direction is known: the negated row
    classes, vectors, how = class_features(gw, None)
    assert "direction only" in how and torch.allclose(vectors[0], -gw[classes[0]])


@pytest.fixture(scope="module")
def fedsgd_run(tmp_path_factory) -> Path:
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    out = tmp_path_factory.mktemp("runs")
    argv = ["fedsgd", "--subsample", "1200", "--num-clients", "3", "--rounds", "2", "--batch-size", "1", "--model-group", "homo-cnn4"]
    assert train_main([*argv, "--no-progress", "--out-dir", str(out), "--run-name", "r"]) == 0
    return out / "r"


def test_invert_head_reads_a_one_sample_gradient_and_is_read_against_its_prior(fedsgd_run):
    from attacks import run_attack

    small = {"steps": 60, "shifts": 0, "population": 300, "refine_steps": 0}
    report = run_attack(fedsgd_run, "invert-head", kind="grad", clients=[0, 1], options=small, device="cpu")
    s = report.summary
    assert s["images"] == 2 and s["verdict"] in (LEAKS, NO_EVIDENCE) and s["strongest_prior"] == "class_mean"
    rows = report.rows
    # one image per message: its class was read off the gradient's rows, and it is scored among that class's samples
    assert all(r["label_recovered"] is not None and r["matching"].startswith("best match among") for r in rows)
    assert report.folder is not None
    data = json.loads((report.folder / "metrics.json").read_text())
    assert data["protocol"]["threat_model"] == "curious-server-previous-state-population"
    assert all(r.notes["rule"].startswith("dW_c / db_c") for r in report.reconstructions)
