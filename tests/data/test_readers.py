"""Dataset readers on tiny files written in the real on-disk formats (no network needed)."""

from __future__ import annotations

import gzip
import os
import pickle
import struct
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from privfl.data import DATASETS, ImageDataset, load_dataset, read_idx
from privfl.data import datasets as ds
from privfl.errors import ConfigError, DataMissingError, UnknownNameError

# ------------------------------------------------------------------------------------------ helpers


def write_idx(path: Path, array: np.ndarray, gz: bool = True) -> None:
    """IDX: two zero bytes, dtype code 0x08 (ubyte), ndim, big-endian uint32 dims, then the data."""
    payload = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload += np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)


def make_idx_set(folder: Path, n_train: int = 5, n_test: int = 3, gz: bool = True) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, size=(n_train + n_test, 28, 28), dtype=np.uint8)
    labels = (np.arange(n_train + n_test) % 10).astype(np.uint8)
    write_idx(folder / "train-images-idx3-ubyte", imgs[:n_train], gz)
    write_idx(folder / "train-labels-idx1-ubyte", labels[:n_train], gz)
    write_idx(folder / "t10k-images-idx3-ubyte", imgs[n_train:], gz)
    write_idx(folder / "t10k-labels-idx1-ubyte", labels[n_train:], gz)
    return imgs, labels


def cifar_rows(n: int, start: int) -> np.ndarray:
    """(n, 3072) uint8 rows whose R, G, B planes hold distinct known values."""
    rows = np.zeros((n, 3072), dtype=np.uint8)
    for i in range(n):
        rows[i, :1024], rows[i, 1024:2048], rows[i, 2048:] = start + i, 100 + start + i, 200 + start + i
    return rows


def make_cifar10(folder: Path, per_batch: int = 2) -> None:
    folder.mkdir(parents=True)
    for b, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
        batch = {
            b"batch_label": name.encode(),
            b"labels": [(b * per_batch + i) % 10 for i in range(per_batch)],
            b"data": cifar_rows(per_batch, b * per_batch),
            b"filenames": [b"x.png"] * per_batch,
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    names = [n.encode() for n in ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": names, b"num_vis": 3072, b"num_cases_per_batch": per_batch}, f)


def make_tiny(base: Path) -> None:
    """2-class tiny-imagenet-200 tree: 3 train JPEGs per class, 2 val JPEGs (solid colours)."""
    wnids = ["n01443537", "n01629819"]
    colours = {wnids[0]: (250, 10, 10), wnids[1]: (10, 10, 250)}
    (base / "val" / "images").mkdir(parents=True)
    (base / "test" / "images").mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    (base / "words.txt").write_text("n01443537\tgoldfish, Carassius auratus\nn01629819\tEuropean fire salamander\nn99999999\tunused\n")
    for w in wnids:
        folder = base / "train" / w / "images"
        folder.mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (64, 64), colours[w]).save(folder / f"{w}_{i}.JPEG", quality=95)
    Image.new("L", (64, 64), 128).save(base / "val" / "images" / "val_0.JPEG")  # greyscale: converted to RGB
    Image.new("RGB", (64, 64), colours[wnids[0]]).save(base / "val" / "images" / "val_1.JPEG", quality=95)
    (base / "val" / "val_annotations.txt").write_text(f"val_0.JPEG\t{wnids[1]}\t0\t0\t63\t63\nval_1.JPEG\t{wnids[0]}\t1\t1\t60\t60\n")
    Image.new("RGB", (64, 64)).save(base / "test" / "images" / "test_0.JPEG")


class Evil:
    def __reduce__(self):  # unpickling this would run os.system
        return (os.system, ("echo should-never-run",))


# --------------------------------------------------------------------------------------------- IDX


def test_registered_names() -> None:
    assert set(DATASETS.names()) >= {"fashionmnist", "mnist", "cifar10", "cifar100", "tinyimagenet"}


def test_fashionmnist_from_root_gz(tmp_path: Path) -> None:
    imgs, labels = make_idx_set(tmp_path / "fashion-mnist")
    d = load_dataset("fashionmnist", tmp_path)
    assert isinstance(d, ImageDataset) and d.name == "fashionmnist"
    assert d.images.shape == (8, 1, 28, 28) and d.images.dtype == torch.uint8
    assert d.labels.dtype == torch.int64
    assert np.array_equal(d.images[:, 0].numpy(), imgs)  # train first, then test
    assert np.array_equal(d.labels.numpy(), labels)
    assert d.num_classes == 10 and d.channels == 1 and d.image_size == 28 and len(d) == 8
    assert d.class_names[0] == "T-shirt/top" and d.class_names[9] == "Ankle boot"
    assert d.mean == (0.5,) and d.std == (0.5,)


def test_idx_raw_in_torchvision_layout_and_case_insensitive_name(tmp_path: Path) -> None:
    imgs, _ = make_idx_set(tmp_path / "MNIST" / "raw", gz=False)
    d = load_dataset("MNIST", str(tmp_path))
    assert np.array_equal(d.images[:, 0].numpy(), imgs)
    assert d.class_names == tuple("0123456789")


def test_read_idx_rejects_bad_magic_and_size(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x08\x01" + struct.pack(">I", 3) + b"abc")
    with pytest.raises(DataMissingError, match="magic"):
        read_idx(bad)
    short = tmp_path / "short"
    short.write_bytes(b"\x00\x00\x08\x01" + struct.pack(">I", 5) + b"abc")
    with pytest.raises(DataMissingError, match="payload"):
        read_idx(short)
    write_idx(tmp_path / "labels", np.arange(4, dtype=np.uint8), gz=False)
    with pytest.raises(DataMissingError, match="dimensions"):
        read_idx(tmp_path / "labels", expect_ndim=3)


@pytest.mark.skipif(not ds.DEBIAN_FASHION_MNIST.is_dir(), reason="dataset-fashion-mnist not installed")
def test_debian_fashionmnist() -> None:
    d = load_dataset("fashionmnist")
    assert d.images.shape == (70000, 1, 28, 28)
    assert d.labels.min() == 0 and d.labels.max() == 9
    assert torch.bincount(d.labels).tolist() == [7000] * 10


def test_missing_data_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ds, "DEBIAN_FASHION_MNIST", tmp_path / "no-debian")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataMissingError) as info:
        load_dataset("fashionmnist", tmp_path / "empty")
    msg = str(info.value)
    assert "\n" not in msg
    assert str(tmp_path / "empty") in msg and "no-debian" in msg
    assert "apt-get install dataset-fashion-mnist" in msg and "--data-root" in msg and "--download" in msg
    for name in ("cifar10", "cifar100", "tinyimagenet"):
        with pytest.raises(DataMissingError, match="--data-root") as info:
            load_dataset(name, tmp_path)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["fashionmnist", "cifar10"])
def test_a_data_root_that_is_not_a_folder_is_named_in_one_line(tmp_path: Path, name: str) -> None:
    """A --data-root the user named is never silently replaced by the standard places (Fashion-MNIST's
    Debian folder would otherwise be used whatever the typo)."""
    with pytest.raises(DataMissingError) as info:
        load_dataset(name, tmp_path / "no-such-folder")
    assert str(info.value) == f"{name}: data folder {tmp_path / 'no-such-folder'} does not exist (--data-root)"
    (tmp_path / "file").write_text("")
    with pytest.raises(DataMissingError, match="is not a folder"):
        load_dataset(name, tmp_path / "file")


def test_download_goes_through_torchvision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in torchvision.datasets module: the real import takes seconds and downloading needs a network.
    torchvision = types.ModuleType("torchvision")
    torchvision.datasets = types.ModuleType("torchvision.datasets")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision", torchvision)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", torchvision.datasets)
    monkeypatch.setattr(ds, "DEBIAN_MNIST", tmp_path / "no-debian")
    calls: list[str] = []

    def fake_mnist(root: str, train: bool = True, download: bool = False) -> None:
        calls.append(root)
        make_idx_set(Path(root) / "MNIST" / "raw")

    monkeypatch.setattr(torchvision.datasets, "MNIST", fake_mnist, raising=False)
    assert len(load_dataset("mnist", tmp_path, download=True)) == 8
    assert calls == [str(tmp_path)]

    def offline(root: str, train: bool = True, download: bool = False) -> None:
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz:\nno network")

    monkeypatch.setattr(torchvision.datasets, "MNIST", offline)
    with pytest.raises(DataMissingError, match=r"download into .* failed") as info:
        load_dataset("mnist", tmp_path / "other", download=True)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="--data-root"):
        load_dataset("mnist", None, download=True)


def test_unknown_name_lists_accepted() -> None:
    with pytest.raises(UnknownNameError) as info:
        load_dataset("imagenet-21k")
    for name in ("cifar10", "fashionmnist", "tinyimagenet"):
        assert name in str(info.value)


# ------------------------------------------------------------------------------------------- CIFAR


def test_cifar10(tmp_path: Path) -> None:
    make_cifar10(tmp_path / "cifar-10-batches-py")
    for root in (tmp_path, tmp_path / "cifar-10-batches-py"):
        d = load_dataset("cifar10", root)
        assert d.images.shape == (12, 3, 32, 32) and d.channels == 3 and d.image_size == 32
        assert d.labels.tolist() == [i % 10 for i in range(12)]
        assert d.images[5, :, 7, 9].tolist() == [5, 105, 205]  # R, G, B planes in that order
        assert d.class_names[0] == "airplane" and d.num_classes == 10
        assert d.mean == (0.5, 0.5, 0.5)


def test_cifar100(tmp_path: Path) -> None:
    base = tmp_path / "cifar-100-python"
    base.mkdir()
    for name, n in (("train", 4), ("test", 2)):
        with open(base / name, "wb") as f:
            pickle.dump({b"data": cifar_rows(n, 0), b"fine_labels": [99 - i for i in range(n)], b"coarse_labels": [0] * n}, f)
    with open(base / "meta", "wb") as f:
        pickle.dump({b"fine_label_names": [f"c{i}".encode() for i in range(100)], b"coarse_label_names": [b"x"] * 20}, f)
    d = load_dataset("cifar100", tmp_path)
    assert d.images.shape == (6, 3, 32, 32) and d.num_classes == 100
    assert d.labels.tolist() == [99, 98, 97, 96, 99, 98]
    assert d.class_names[99] == "c99"


def test_restricted_unpickler_rejects_globals(tmp_path: Path) -> None:
    make_cifar10(tmp_path / "cifar-10-batches-py")
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_3", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(DataMissingError, match=r"forbidden global posix.system|forbidden global os.system"):
        load_dataset("cifar10", tmp_path)
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps([eval, print]))
    with pytest.raises(DataMissingError, match=r"forbidden global builtins.eval"):
        ds.restricted_pickle_load(evil)
    with open(evil, "rb") as f, pytest.raises(pickle.UnpicklingError):
        ds.RestrictedUnpickler(f, encoding="bytes").load()


def test_restricted_unpickler_accepts_numpy1_names(tmp_path: Path) -> None:
    with open(os.devnull, "rb") as f:
        unpickler = ds.RestrictedUnpickler(f)
    assert callable(unpickler.find_class("numpy.core.multiarray", "_reconstruct"))
    assert unpickler.find_class("numpy", "ndarray") is np.ndarray
    with pytest.raises(pickle.UnpicklingError):
        unpickler.find_class("numpy", "load")
    # The real CIFAR files: Python 2 protocol-2 pickles of numpy 1.x arrays (GLOBAL numpy.core..., BINSTRING).
    arr = (
        b"cnumpy.core.multiarray\n_reconstruct\nq\x01cnumpy\nndarray\nq\x02K\x00\x85U\x01b\x87Rq\x03"
        b"(K\x01K\x03\x85cnumpy\ndtype\nq\x04U\x02u1K\x00K\x01\x87Rq\x05(K\x03U\x01|NNNJ\xff\xff\xff\xff"
        b"J\xff\xff\xff\xffK\x00tb\x89U\x03\x01\x02\x03tb"
    )
    py2 = tmp_path / "py2_batch"
    py2.write_bytes(b"\x80\x02}q\x00(U\x04data" + arr + b"U\x06labels]q\x06K\x07au.")
    batch = ds.restricted_pickle_load(py2)
    assert batch[b"labels"] == [7]
    assert batch[b"data"].dtype == np.uint8 and batch[b"data"].tolist() == [1, 2, 3]


# ------------------------------------------------------------------------------------ Tiny-ImageNet


def test_tinyimagenet_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "tiny-imagenet-200"
    make_tiny(base)
    d = load_dataset("tinyimagenet", tmp_path)
    assert d.images.shape == (8, 3, 64, 64) and d.images.dtype == torch.uint8
    assert d.labels.tolist() == [0, 0, 0, 1, 1, 1, 1, 0]  # train (wnid order) then val (annotation order)
    assert d.class_names == ("goldfish", "European fire salamander")
    means = d.images.float().mean(dim=(2, 3))
    assert means[0, 0] > 200 and means[0, 2] < 50  # red stays red: channel order is RGB
    assert means[3, 2] > 200 and means[3, 0] < 50
    assert torch.allclose(means[6], torch.full((3,), 128.0), atol=2)  # grey val image -> 3 equal channels
    cache = base / ds.TINY_CACHE
    assert cache.is_file()
    assert not [p for p in base.iterdir() if p.name.endswith(".tmp")]

    def no_decode(files):  # second load must come from the cache
        raise AssertionError("decoded JPEGs despite a fresh cache")

    monkeypatch.setattr(ds, "_decode_jpegs", no_decode)
    again = load_dataset("tinyimagenet", base)
    assert torch.equal(again.images, d.images) and torch.equal(again.labels, d.labels)

    # wnids.txt newer than the cache: the cache is stale and the JPEGs are decoded again
    future = cache.stat().st_mtime + 100
    os.utime(base / "wnids.txt", (future, future))
    monkeypatch.undo()
    decoded: list[int] = []
    real_decode = ds._decode_jpegs

    def counting_decode(files):
        decoded.append(len(files))
        return real_decode(files)

    monkeypatch.setattr(ds, "_decode_jpegs", counting_decode)
    rebuilt = load_dataset("tinyimagenet", tmp_path)
    assert decoded == [8] and torch.equal(rebuilt.images, d.images)


def test_tinyimagenet_read_only_folder_skips_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_tiny(tmp_path / "tiny-imagenet-200")

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(ds.tempfile, "mkstemp", read_only)
    d = load_dataset("tinyimagenet", tmp_path, download=True)
    assert len(d) == 8
    assert not (tmp_path / "tiny-imagenet-200" / ds.TINY_CACHE).exists()


def test_tinyimagenet_corrupt_cache_is_ignored(tmp_path: Path) -> None:
    base = tmp_path / "tiny-imagenet-200"
    make_tiny(base)
    (base / ds.TINY_CACHE).write_bytes(b"garbage")
    os.utime(base / ds.TINY_CACHE, (1e10, 1e10))
    assert len(load_dataset("tinyimagenet", base)) == 8


# ---------------------------------------------------------------------------------------- ImageDataset


def test_normalize_roundtrip_and_validation() -> None:
    imgs = torch.tensor([[[[0, 128, 255]]], [[[1, 2, 3]]]], dtype=torch.uint8).expand(2, 3, 1, 3).contiguous()
    d = ImageDataset("t", imgs, torch.tensor([0, 1]), ("a", "b"), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    x = d.normalize(d.images)
    assert x.dtype == torch.float32 and x.min() == -1.0 and x.max() == 1.0
    assert torch.equal((d.denormalize(x) * 255).round().to(torch.uint8), imgs)
    assert d.denormalize(torch.full((3, 1, 1), 5.0)).max() == 1.0  # clamped
    assert d.normalize(imgs[0]).shape == (3, 1, 3)  # a single (C, H, W) image works too
    with pytest.raises(ValueError):
        ImageDataset("t", imgs.float(), torch.tensor([0, 1]), ("a", "b"), (0.5,) * 3, (0.5,) * 3)
    with pytest.raises(ValueError):
        ImageDataset("t", imgs, torch.tensor([0, 2]), ("a", "b"), (0.5,) * 3, (0.5,) * 3)
    with pytest.raises(ValueError):
        ImageDataset("t", imgs, torch.tensor([0, 1]), ("a", "b"), (0.5,), (0.5,))
