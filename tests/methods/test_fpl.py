"""FPL: FINCH on constructed points, FPL's losses and prototypes against the paper's equations, on tiny
real data broadcast rows that are FINCH clusters of the uploads and their means, and an exact resume after a
crash."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from privfl.capture import TensorStore
from privfl.fl.finch import finch
from privfl.methods.fpl import cluster_prototypes, fpl_terms, unbiased_prototypes
from tests.helpers import QUICK, prototype_uploads, read_metrics, train

TINY = [*QUICK, "--rounds", "2"]  # --subsample 600 --partition iid --batch-size 32, cpu5 heterogeneous models


def same_partition(a: np.ndarray, b: list[int]) -> bool:
    """Equal up to the names of the clusters."""
    pairs = set(zip(a.tolist(), b))
    return len(pairs) == len(set(a.tolist())) == len(set(b))


def on_circle(degrees: list[float], dim: int = 2) -> np.ndarray:
    out = np.zeros((len(degrees), dim))
    out[:, 0], out[:, 1] = np.cos(np.radians(degrees)), np.sin(np.radians(degrees))
    return out


# ------------------------------------------------------------------------------------------ FINCH
def test_finch_finds_three_blobs_at_the_last_partition_fpl_uses():
    rng = np.random.default_rng(0)
    axes = np.eye(3, 8) * 5.0
    points, truth = [], []
    for blob in range(3):  # each blob: two tight pairs, the pairs a little apart
        for shift in (0.0, 0.6):
            for _ in range(2):
                points.append(axes[blob] + shift * np.roll(axes[blob], 1) / 5 + rng.normal(0, 0.01, 8))
                truth.append(blob)
    result = finch(np.stack(points))  # cosine, as FPL
    assert result.num_clusters == [6, 3]  # pairs first, then the blobs; one cluster (the next step) is not kept
    assert same_partition(result.labels(-1), truth) and same_partition(result.labels(), truth)
    assert len(set(result.labels(0).tolist())) == 6 and np.array_equal(result.labels(5), result.labels(-1))  # clamped


def test_finch_first_neighbour_chains_merge():
    # cosine: 0, 1, 3, 7, 15 degrees: each point's first neighbour is the previous one, so the chain is one
    # cluster although its ends are 15 degrees apart; 120 degrees away, a second chain 120, 122, 126
    chain = on_circle([0, 1, 3, 7, 15, 120, 122, 126])
    result = finch(chain)
    assert result.num_clusters == [2]
    assert same_partition(result.labels(), [0, 0, 0, 0, 0, 1, 1, 1])
    # euclidean, on a line: 7's first neighbour is 3, 3's is 1, 1 and 0 are each other's
    line = np.array([[0.0], [1.0], [3.0], [7.0], [100.0], [101.0]])
    assert same_partition(finch(line, "euclidean").labels(0), [0, 0, 0, 0, 1, 1])
    # the coarser step clusters the means: two pairs near each other and one pair far away
    pairs = np.array([[0.0], [0.1], [1.0], [1.1], [50.0], [50.1], [52.0], [52.1]])
    r = finch(pairs, "euclidean")
    assert r.num_clusters == [4, 2] and same_partition(r.labels(), [0, 0, 0, 0, 1, 1, 1, 1])
    # degenerate sizes: one point is its own cluster; two points are one (a single partition is kept)
    assert finch(np.ones((1, 3))).partitions.tolist() == [[0]]
    assert finch(np.eye(2)).num_clusters == [1]


# ------------------------------------------------------------------------------------------ FPL
def test_fpl_losses_are_the_papers_equations():
    gen = torch.Generator().manual_seed(0)
    reps = torch.randn(5, 6, generator=gen)
    y = torch.tensor([0, 1, 2, 1, 0])
    cluster = torch.randn(5, 6, generator=gen)
    cluster_classes = torch.tensor([0, 0, 1, 3, 3])  # class 2 has no prototype: it adds nothing
    unbiased = torch.zeros(4, 6)
    known = torch.tensor([True, True, False, True])
    for c in (0, 1, 3):
        unbiased[c] = cluster[cluster_classes == c].mean(0)
    tau = 0.02
    cpcl, upcr = fpl_terms(reps, y, cluster, cluster_classes, unbiased, known, tau)
    want_c, want_u = 0.0, 0.0
    for z, label in zip(reps, y.tolist()):  # RethinkFL's per-sample loop, Eqs. 6 and 9
        if not known[label]:
            continue
        s = torch.exp(F.cosine_similarity(z.unsqueeze(0), cluster) / tau)
        want_c += -math.log(s[cluster_classes == label].sum() / s.sum())
        want_u += float(((z - unbiased[label]) ** 2).mean())
    assert cpcl.item() == pytest.approx(want_c / 5, rel=1e-4) and upcr.item() == pytest.approx(want_u / 5, rel=1e-5)
    reps.requires_grad_(True)
    a, b = fpl_terms(reps, y, cluster, cluster_classes, unbiased, known, tau)
    (a + b).backward()
    assert reps.grad is not None and torch.isfinite(reps.grad).all() and reps.grad[2].abs().sum() == 0  # the unknown class's sample


def test_fpl_cluster_prototypes_are_cluster_means_and_unbiased_their_mean():
    # class 0 from five clients: three near one direction, two near another; class 4 from one client
    protos = torch.tensor(on_circle([0, 1, 2, 90, 91, 45]), dtype=torch.float32)
    classes = torch.tensor([0, 0, 0, 0, 0, 4])
    cluster, owners = cluster_prototypes(protos, classes)
    assert owners.tolist() == [0, 0, 4]
    means = torch.stack([protos[:3].mean(0), protos[3:5].mean(0)])  # FINCH: {0, 1, 2} and {90, 91} degrees
    assert torch.allclose(cluster[:2], means) or torch.allclose(cluster[:2], means.flip(0))
    assert torch.equal(cluster[2], protos[5])  # one client: its own prototype
    unbiased, present = unbiased_prototypes(cluster, owners)
    assert present.tolist() == [0, 4]
    assert torch.allclose(unbiased[0], cluster[:2].mean(0)) and not torch.allclose(unbiased[0], protos[:5].mean(0))


# ------------------------------------------------------------------------------------------ real runs
@pytest.fixture(scope="module")
def fpl_run(tmp_path_factory):
    """One two-round FPL run on tiny real data."""
    from tests.helpers import FMNIST

    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    out = tmp_path_factory.mktemp("fpl")
    return train(out, "fpl", *TINY, name="fpl")


def test_fpl_broadcast_rows_are_finch_clusters_of_the_uploads_and_their_means(fpl_run):
    run = fpl_run
    capture = TensorStore(run / "capture", "capture")
    for entry in read_metrics(run):
        rnd = entry["round"]
        protos, classes, _ = prototype_uploads(capture, rnd)
        assert entry["upload_scalars"] == len(classes) * 512
        down = [r for r in capture.records() if r["direction"] == "down" and r["round"] == rnd]
        roles = [r["meta"]["role"] for r in down]
        assert roles.count("cluster") == roles.count("unbiased") == 10  # two messages per client
        rows = sum(r["tensors"]["protos"]["shape"][0] for r in down) // 10
        assert entry["broadcast_scalars"] == 10 * rows * 512 and rows == entry["cluster_rows"] + 10
        sent = {r["meta"]["role"]: capture.load(r) for r in down if r["receiver"] == "client3"}
        cluster, owners = sent["cluster"]["protos"], sent["cluster"]["classes"]
        expected, expected_owners = cluster_prototypes(protos, classes)  # FINCH again, on what the server received
        assert torch.equal(owners, expected_owners) and torch.allclose(cluster, expected, atol=1e-6)
        assert sent["unbiased"]["classes"].tolist() == list(range(10))
        for c in range(10):  # the unbiased prototype is the mean of the class's cluster prototypes
            assert torch.allclose(sent["unbiased"]["protos"][c], cluster[owners == c].mean(0), atol=1e-6)
    assert read_metrics(run)[-1]["cpcl"] > 0 and read_metrics(run)[-1]["upcr"] > 0


def test_a_crashed_run_resumes_exactly(assert_resumes_exactly):
    """Stopped after 3 uploads and 1 download of round 1 and resumed: the same metrics and stores as an unbroken run."""
    args = ["fpl", "--subsample", "300", "--num-clients", "3", "--partition", "iid", "--rounds", "2", "--rep-dim", "32"]
    assert_resumes_exactly(args, kill_round=1, kill_after=4)
