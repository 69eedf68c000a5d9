"""FedProto and FedGH: an upload is one d-vector per (client, class) pair, and FedProto's ``--prototypes
training`` averages the representations its training steps computed."""

from __future__ import annotations

import pytest
import torch

from privfl.capture import TensorStore
from tests.helpers import QUICK, needs_fmnist, read_metrics, train


@needs_fmnist
@pytest.mark.parametrize("method", ["fedgh", "fedproto"])
def test_prototype_upload_is_client_class_pairs_times_d(tmp_path, method):
    run = train(tmp_path, method, "--subsample", "1000", "--alpha", "0.3", "--rounds", "1", "--no-progress", "--min-samples", "8")
    from safetensors.torch import load_file

    split = load_file(str(run / "truth" / "partition.safetensors"))
    labels = None
    capture = TensorStore(run / "capture", "capture")
    ups = [r for r in capture.records() if r["direction"] == "up"]
    from privfl.data import load_dataset

    labels = load_dataset("fashionmnist").labels[split["subset"]]
    pairs = sum(len(labels[split[f"train_{k}"]].unique()) for k in range(10))
    assert read_metrics(run)[-1]["upload_scalars"] == pairs * 512
    assert sum(r["tensors"]["protos"]["shape"][0] for r in ups) == pairs
    down = [r for r in capture.records() if r["direction"] == "down" and r["round"] == 0 and r["meta"].get("phase") != "setup"]
    if method == "fedproto":
        assert all(r["kind"] == "global_proto" for r in down) and read_metrics(run)[-1]["broadcast_scalars"] == 10 * 10 * 512
    else:
        assert all(r["kind"] == "head" for r in down)


@needs_fmnist
def test_fedproto_training_prototypes_are_the_steps_representations(tmp_path):
    """``--prototypes training`` averages what the training steps computed: with a step size too small to
    move the weights (and cnn4's train and eval forwards being the same function) that is the pass's mean,
    over one epoch or two (each sample counted once per epoch); ``counts`` stays the split's class sizes
    even when ``--drop-last`` leaves samples out; at the usual step size the two differ."""
    common = ["fedproto", *QUICK, "--model-group", "homo-cnn4", "--partition", "dir", "--alpha", "0.5", "--min-samples", "10"]

    def uploads(name: str, *extra: str) -> list[dict[str, torch.Tensor]]:
        store = TensorStore(train(tmp_path, *common, *extra, name=name) / "capture", "capture")
        return [store.load(r) for r in store.records() if r["kind"] == "proto"]

    tiny = ("--lr", "1e-12")
    passed = uploads("pass", *tiny)
    for name, extra in (("one", ()), ("two", ("--local-epochs", "2")), ("drop", ("--drop-last", "--batch-size", "7"))):
        got = uploads(name, *tiny, *extra, "--prototypes", "training")
        assert len(got) == len(passed) == 10
        missing, moved_by_drop = 0, 0
        for a, b in zip(passed, got, strict=True):
            if name != "drop":
                assert torch.equal(a["classes"], b["classes"]) and torch.equal(a["counts"], b["counts"]), name
                assert torch.allclose(a["protos"], b["protos"], atol=1e-5), name
                continue
            # a class whose every sample fell in a dropped last batch has no prototype; the others keep their split's count
            at = torch.searchsorted(a["classes"], b["classes"])
            assert torch.equal(a["classes"][at], b["classes"]) and torch.equal(a["counts"][at], b["counts"])
            missing += len(a["classes"]) - len(b["classes"])
            moved_by_drop += not torch.allclose(a["protos"][at], b["protos"], rtol=1e-3, atol=1e-6)  # fewer samples averaged
        assert name != "drop" or (missing > 0 and moved_by_drop > 0)  # both cases occur in this partition
    moved = uploads("moved", "--prototypes", "training")
    assert not torch.allclose(moved[0]["protos"], uploads("moved-pass")[0]["protos"], atol=1e-3)
