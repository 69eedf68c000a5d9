"""Client partitions: determinism, disjointness, scheme shapes, bounded failure, 3:1 split, plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from privfl.data import (
    PARTITIONS,
    ClientSplit,
    default_min_samples,
    longtail_class_sizes,
    partition_indices,
    plot_partition,
    split_train_test,
)
from privfl.errors import ConfigError, PartitionError, UnknownNameError

LABELS = np.repeat(np.arange(10), 300)  # 3,000 samples, 10 balanced classes
np.random.default_rng(1).shuffle(LABELS)
FULL = ("iid", "dir", "pat", "exdir")  # schemes that hand out every sample


def scheme_kwargs(scheme: str) -> dict:
    # exdir / longtail with the default alpha=0.1 are very skewed; milder settings keep the fixture valid.
    return {"exdir": {"alpha": 0.5}, "longtail": {"alpha": 1.0, "imbalance_factor": 10.0}}.get(scheme, {})


def test_registered() -> None:
    assert set(PARTITIONS.names()) >= {"iid", "dir", "pat", "exdir", "longtail"}
    with pytest.raises(UnknownNameError, match=r"accepted: .*dir"):
        partition_indices(LABELS, 5, "nope", 0)


@pytest.mark.parametrize("scheme", ["iid", "dir", "pat", "exdir", "longtail"])
def test_deterministic(scheme: str) -> None:
    kw = scheme_kwargs(scheme)
    a = partition_indices(LABELS, 10, scheme, 7, **kw)
    b = partition_indices(LABELS, 10, scheme, 7, **kw)
    c = partition_indices(LABELS, 10, scheme, 8, **kw)
    assert len(a) == 10 and all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    assert all(x.dtype == np.int64 and np.all(np.diff(x) > 0) for x in a)  # sorted, no duplicates


@pytest.mark.parametrize("scheme", ["iid", "dir", "pat", "exdir", "longtail"])
def test_disjoint_and_coverage(scheme: str) -> None:
    parts = partition_indices(LABELS, 10, scheme, 0, **scheme_kwargs(scheme))
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat)  # every index used at most once
    assert flat.min() >= 0 and flat.max() < len(LABELS)
    if scheme in FULL:
        assert len(flat) == len(LABELS)
    assert min(len(p) for p in parts) >= default_min_samples(len(flat), 10) or scheme == "exdir"


def test_iid_even_sizes() -> None:
    sizes = [len(p) for p in partition_indices(LABELS[:2999], 10, "iid", 0)]
    assert max(sizes) - min(sizes) <= 1


def test_dir_is_skewed() -> None:
    parts = partition_indices(LABELS, 10, "dir", 0, alpha=0.1)
    per_client_classes = [len(np.unique(LABELS[p])) for p in parts]
    assert min(per_client_classes) < 10  # with alpha=0.1 some client misses classes


@pytest.mark.parametrize("k", [1, 2, 3])
def test_pat_exact_classes(k: int) -> None:
    parts = partition_indices(LABELS, 10, "pat", 3, classes_per_client=k)
    assert all(len(np.unique(LABELS[p])) == k for p in parts)
    assert sum(len(p) for p in parts) == len(LABELS)


def test_pat_drops_unheld_classes() -> None:
    # 4 clients x 2 classes = 8 slots for 10 classes: two classes have no holder (as in PFLlib).
    parts = partition_indices(LABELS, 4, "pat", 0, classes_per_client=2)
    assert len(np.unique(LABELS[np.concatenate(parts)])) == 8


def test_pat_balanced_and_errors() -> None:
    parts = partition_indices(LABELS, 5, "pat", 0, classes_per_client=2, balanced=True)
    assert sorted({len(p) for p in parts}) == [600]  # each class held by one client, 300 + 300
    with pytest.raises(PartitionError, match="classes_per_client=11"):
        partition_indices(LABELS, 5, "pat", 0, classes_per_client=11)
    with pytest.raises(PartitionError, match="min_samples"):
        partition_indices(LABELS, 10, "pat", 0, classes_per_client=1, min_samples=500)


def test_exdir_holds_at_most_k_classes() -> None:
    parts = partition_indices(LABELS, 20, "exdir", 2, alpha=0.5, classes_per_client=3)
    assert all(1 <= len(np.unique(LABELS[p])) <= 3 for p in parts)
    with pytest.raises(PartitionError, match="cannot cover"):
        partition_indices(LABELS, 3, "exdir", 0, classes_per_client=2)


def test_longtail_profile() -> None:
    sizes = longtail_class_sizes([300] * 10, 100.0)
    assert sizes[0] == 300 and sizes[-1] == 3 and np.all(np.diff(sizes) <= 0)
    parts = partition_indices(LABELS, 4, "longtail", 0, alpha=1.0, imbalance_factor=100.0, min_samples=5)
    counts = np.bincount(LABELS[np.concatenate(parts)], minlength=10)
    assert np.array_equal(counts, sizes)
    assert counts[0] == counts.max() and counts[-1] == pytest.approx(300 / 100, abs=1)
    # exponential profile: class c keeps 300 * 100^(-c/9)
    expected = np.floor(300 * 100.0 ** (-np.arange(10) / 9) + 1e-6)
    assert np.array_equal(counts, expected.astype(int))


def test_dir_impossible_raises_quickly() -> None:
    # 3,000 samples over 300 clients with alpha=0.001: most clients get nothing; max_tries bounds it.
    with pytest.raises(PartitionError) as info:
        partition_indices(LABELS, 300, "dir", 0, alpha=0.001, min_samples=5, max_tries=20)
    msg = str(info.value)
    assert "\n" not in msg and "after 20 tries" in msg and "alpha" in msg and "min-samples" in msg


def test_bad_options() -> None:
    with pytest.raises(ConfigError):
        partition_indices(LABELS, 5, "dir", 0, alpha=0.0)
    with pytest.raises(ConfigError):
        partition_indices(LABELS, 0, "iid", 0)
    with pytest.raises(ConfigError):
        partition_indices(LABELS.astype(float), 5, "iid", 0)
    with pytest.raises(PartitionError, match="only 3 samples"):
        partition_indices(LABELS[:3], 5, "iid", 0)


def test_default_min_samples() -> None:
    assert default_min_samples(70000, 20) == 40  # PFLlib: ceil(10 / 0.25)
    assert default_min_samples(1000, 50) == 10  # half a fair share
    assert default_min_samples(10, 10) == 2  # never below one train + one test sample


def test_torch_labels_and_plugin_scheme() -> None:
    parts = partition_indices(torch.from_numpy(LABELS), 3, "iid", 0)
    assert sum(len(p) for p in parts) == len(LABELS)
    if "test_halves" not in PARTITIONS:

        @PARTITIONS.register("test_halves")
        def halves(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
            return list(np.array_split(np.arange(len(labels)), num_clients))

    assert [len(p) for p in partition_indices(LABELS, 2, "test_halves", 0, alpha=3.0)] == [1500, 1500]


def test_split_train_test_3_to_1() -> None:
    parts = partition_indices(LABELS, 10, "iid", 0)
    split = split_train_test(parts, seed=0)
    for idx, tr, te in zip(parts, split.train, split.test):
        assert len(tr) == 225 and len(te) == 75
        assert np.array_equal(np.sort(np.concatenate([tr, te])), idx)
        assert np.all(np.diff(tr) > 0) and tr.dtype == np.int64
    again = split_train_test(parts, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(split.train, again.train))
    other = split_train_test(parts, seed=1)
    assert not all(np.array_equal(a, b) for a, b in zip(split.train, other.train))
    assert [len(t) for t in split_train_test([np.arange(7)]).train] == [5]  # floor(0.75 * 7)
    with pytest.raises(PartitionError, match="client 1 has 1 samples"):
        split_train_test([np.arange(10), np.arange(10, 11)])
    with pytest.raises(ConfigError):
        split_train_test(parts, train_fraction=1.0)


def test_client_split_counts_and_tensors(tmp_path: Path) -> None:
    split = split_train_test(partition_indices(LABELS, 5, "pat", 0, classes_per_client=2), seed=0)
    counts = split.counts(LABELS, 10)
    assert counts.shape == (5, 10) and counts.sum() == len(LABELS)
    assert all((row > 0).sum() == 2 for row in counts)
    save_file(split.to_tensors(), tmp_path / "split.safetensors")
    back = ClientSplit.from_tensors(load_file(tmp_path / "split.safetensors"))
    assert back.num_clients == 5
    assert all(np.array_equal(a, b) for a, b in zip(back.train + back.test, split.train + split.test))
    tensors = split.to_tensors()
    del tensors["test_4"]
    with pytest.raises(ConfigError, match="test_4"):
        ClientSplit.from_tensors(tensors)


def test_plot_partition(tmp_path: Path) -> None:
    split = split_train_test(partition_indices(LABELS, 12, "dir", 0), seed=0)
    out = tmp_path / "plots" / "partition.png"
    plot_partition(split.counts(LABELS, 10), out, class_names=[f"c{i}" for i in range(10)], title="dir 0.1")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
