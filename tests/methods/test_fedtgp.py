"""FedTGP: the adaptive margin and the server's generator training on constructed prototypes, the
paper-shape broadcast count, on tiny real data a margin computed from what the server received, and an exact
resume after a crash."""

from __future__ import annotations

import itertools

import pytest
import torch

from privfl.capture import TensorStore
from privfl.methods.fedtgp import PrototypeGenerator, adaptive_margin, train_generator
from tests.fakedata import write_cifar100
from tests.helpers import QUICK, prototype_uploads, read_metrics, train

TINY = [*QUICK, "--rounds", "2"]  # --subsample 600 --partition iid --batch-size 32, cpu5 heterogeneous models


# ------------------------------------------------------------------------------------------ FedTGP server
def test_adaptive_margin_is_the_largest_nearest_centre_distance_capped():
    # class centres (means over clients) at 0, 3 and 10 on a line: nearest-other distances 3, 3, 7 -> 7
    protos = torch.tensor([[-1.0, 0], [1.0, 0], [3.0, 1], [3.0, -1], [10.0, 0]])
    classes = torch.tensor([0, 0, 1, 1, 2])
    assert adaptive_margin(protos, classes, 100.0) == pytest.approx(7.0)
    assert adaptive_margin(protos, classes, 5.0) == 5.0  # capped by the threshold
    assert adaptive_margin(protos[:2], classes[:2], 4.0) == 4.0  # one class: the cap alone


def test_generator_training_lowers_the_acl_loss_and_separates_classes_by_the_margin():
    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 16, generator=gen) * 3
    protos = (centres.repeat_interleave(5, 0) + 0.1 * torch.randn(20, 16, generator=gen)).float()
    classes = torch.arange(4).repeat_interleave(5)
    margin = adaptive_margin(protos, classes, threshold=2.0)
    assert margin == 2.0  # the centres are further apart than the cap
    torch.manual_seed(0)
    tgp = PrototypeGenerator(4, 16, 16)
    losses = train_generator(tgp, protos, classes, margin, epochs=60, batch_size=10, lr=0.05, shuffle=torch.Generator().manual_seed(1))
    assert len(losses) == 60 and losses[-1] < 0.05 * losses[0]
    assert sum(b < a for a, b in itertools.pairwise(losses)) >= 50  # nearly every epoch lowers it
    with torch.no_grad():
        g = tgp()
    dist = torch.cdist(protos, g)
    own = dist[torch.arange(20), classes]
    others = dist.masked_fill(torch.nn.functional.one_hot(classes, 4).bool(), float("inf")).min(1).values
    assert (own + margin < others).all()  # every client prototype keeps the margin ...
    gap = torch.cdist(g, g) + torch.eye(4) * 1e9
    assert gap.min() >= margin  # ... so, by the triangle inequality, the global prototypes are >= margin apart


# ------------------------------------------------------------------------------------------ real runs
@pytest.fixture(scope="module")
def fedtgp_run(tmp_path_factory):
    """One two-round FedTGP run on tiny real data (10 server epochs, to stay quick)."""
    from tests.helpers import FMNIST

    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    out = tmp_path_factory.mktemp("fedtgp")
    return train(out, "fedtgp", *TINY, "--server-epochs", "10", name="fedtgp")


def test_fedtgp_counts_and_the_margin_comes_from_what_was_received(fedtgp_run):
    run = fedtgp_run
    capture = TensorStore(run / "capture", "capture")
    for entry in read_metrics(run):
        rnd = entry["round"]
        protos, classes, ups = prototype_uploads(capture, rnd)
        assert entry["upload_scalars"] == len(classes) * 512  # (client, class present) pairs * d
        assert len(ups) == 10 and all(r["kind"] == "proto" for r in ups)
        assert entry["broadcast_scalars"] == 10 * 10 * 512  # C * d per client
        assert entry["margin"] == pytest.approx(adaptive_margin(protos, classes, 100.0), rel=1e-6)
        down = [r for r in capture.records() if r["direction"] == "down" and r["round"] == rnd]
        assert len(down) == 10 and all(r["kind"] == "global_proto" and r["tensors"]["protos"]["shape"] == [10, 512] for r in down)
        sent = [capture.load(r) for r in down]
        assert all(torch.equal(s["protos"], sent[0]["protos"]) and s["classes"].tolist() == list(range(10)) for s in sent)
    assert 0.0 <= read_metrics(run)[-1]["acc"] <= 1.0 and read_metrics(run)[-1]["proto_mse"] > 0


def test_fedtgp_broadcast_is_c_times_d_at_cifar100_shape(tmp_path):
    write_cifar100(tmp_path / "data")
    run = train(tmp_path, "fedtgp", "--dataset", "cifar100", "--data-root", str(tmp_path / "data"), *QUICK, "--server-epochs", "1", name="c100")
    m = read_metrics(run)[-1]
    _, classes, _ = prototype_uploads(TensorStore(run / "capture", "capture"), 0)
    assert m["broadcast_scalars"] == 10 * 100 * 512 == 512_000  # FedRE Table 11: 512.00e3
    assert m["upload_scalars"] == len(classes) * 512


def test_a_crashed_run_resumes_exactly(assert_resumes_exactly):
    """Stopped after 3 uploads and 1 download of round 1 and resumed: the same metrics and stores as an unbroken run."""
    args = ["fedtgp", "--subsample", "300", "--num-clients", "3", "--partition", "iid", "--rounds", "2", "--rep-dim", "32", "--server-epochs", "5"]
    assert_resumes_exactly(args, kill_round=1, kill_after=4)
