"""FedTGP and FPL: FINCH on constructed points, the adaptive margin and the server's generator training,
FPL's losses and prototypes against the papers' equations, paper-shape scalar counts, a server that
uses what it received, and an exact resume after a kill."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from privfl.capture import TensorStore
from privfl.engine import TrainCallback
from privfl.fl.finch import finch
from privfl.methods.fedtgp import PrototypeGenerator, adaptive_margin, train_generator
from privfl.methods.fpl import cluster_prototypes, fpl_terms, unbiased_prototypes
from privfl.train import main as train_main
from tests.fakedata import write_cifar100
from tests.test_train import QUICK, metrics, needs_fmnist, train

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
def runs(tmp_path_factory):
    """One two-round run per method on tiny real data (FedTGP with 10 server epochs to stay quick)."""
    from tests.conftest import FMNIST

    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    out = tmp_path_factory.mktemp("runs")
    return {
        "fedtgp": train(out, "fedtgp", *TINY, "--server-epochs", "10", name="fedtgp"),
        "fpl": train(out, "fpl", *TINY, name="fpl"),
    }


def uploads_of(capture: TensorStore, rnd: int) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    ups = [r for r in capture.records() if r["direction"] == "up" and r["round"] == rnd]
    loaded = [capture.load(r) for r in ups]
    return torch.cat([t["protos"] for t in loaded]).float(), torch.cat([t["classes"] for t in loaded]).long(), ups


def test_fedtgp_counts_and_the_margin_comes_from_what_was_received(runs):
    run = runs["fedtgp"]
    capture = TensorStore(run / "capture", "capture")
    for entry in metrics(run):
        rnd = entry["round"]
        protos, classes, ups = uploads_of(capture, rnd)
        assert entry["upload_scalars"] == len(classes) * 512  # (client, class present) pairs * d
        assert len(ups) == 10 and all(r["kind"] == "proto" for r in ups)
        assert entry["broadcast_scalars"] == 10 * 10 * 512  # C * d per client
        assert entry["margin"] == pytest.approx(adaptive_margin(protos, classes, 100.0), rel=1e-6)
        down = [r for r in capture.records() if r["direction"] == "down" and r["round"] == rnd]
        assert len(down) == 10 and all(r["kind"] == "global_proto" and r["tensors"]["protos"]["shape"] == [10, 512] for r in down)
        sent = [capture.load(r) for r in down]
        assert all(torch.equal(s["protos"], sent[0]["protos"]) and s["classes"].tolist() == list(range(10)) for s in sent)
    assert 0.0 <= metrics(run)[-1]["acc"] <= 1.0 and metrics(run)[-1]["proto_mse"] > 0


def test_fpl_broadcast_rows_are_finch_clusters_of_the_uploads_and_their_means(runs):
    run = runs["fpl"]
    capture = TensorStore(run / "capture", "capture")
    for entry in metrics(run):
        rnd = entry["round"]
        protos, classes, _ = uploads_of(capture, rnd)
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
    assert metrics(run)[-1]["cpcl"] > 0 and metrics(run)[-1]["upcr"] > 0


def test_fedtgp_broadcast_is_c_times_d_at_cifar100_shape(tmp_path):
    write_cifar100(tmp_path / "data")
    run = train(tmp_path, "fedtgp", "--dataset", "cifar100", "--data-root", str(tmp_path / "data"), *QUICK, "--server-epochs", "1", name="c100")
    m = metrics(run)[-1]
    _, classes, _ = uploads_of(TensorStore(run / "capture", "capture"), 0)
    assert m["broadcast_scalars"] == 10 * 100 * 512 == 512_000  # FedRE Table 11: 512.00e3
    assert m["upload_scalars"] == len(classes) * 512


class Crash(Exception):
    pass


class CrashAfter(TrainCallback):
    """Raise after ``count`` messages of round ``rnd``: the run is left as a kill leaves it (checkpoint of the round before)."""

    def __init__(self, rnd: int, count: int):
        self.rnd, self.count, self.seen = rnd, count, 0

    def on_message(self, message, record) -> None:
        if message.round == self.rnd:
            self.seen += 1
            if self.seen == self.count:
                raise Crash


@needs_fmnist
@pytest.mark.parametrize("method", ["fedtgp", "fpl"])
def test_a_crashed_run_resumes_exactly(tmp_path: Path, method):
    args = [method, "--subsample", "300", "--num-clients", "3", "--partition", "iid", "--rounds", "2", "--rep-dim", "32", "--no-progress"]
    args += ["--server-epochs", "5"] if method == "fedtgp" else []
    full = train(tmp_path, *args, name="full")
    with pytest.raises(Crash):
        train_main([*args, "--out-dir", str(tmp_path), "--run-name", "crashed"], callbacks=[CrashAfter(1, 4)])  # 3 uploads, 1 download
    assert len(metrics(tmp_path / "crashed")) == 1
    assert train_main(["--resume", str(tmp_path / "crashed"), "--no-progress"]) == 0

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]

    assert strip(metrics(full)) == strip(metrics(tmp_path / "crashed"))
    a, b = TensorStore(full / "capture", "capture"), TensorStore(tmp_path / "crashed" / "capture", "capture")
    assert [r["sha256"] for r in a.records()] == [r["sha256"] for r in b.records()]
