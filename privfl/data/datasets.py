"""Image datasets read from their standard on-disk formats, with no network needed.

Every loader returns the ORIGINAL train and test sets merged (train first, then test) because the
FL pipeline (as PFLlib / HtFLlib do) re-partitions the whole pool over clients and then splits each
client's share 3:1 itself. Readers are written here rather than going through torchvision so that
data already installed elsewhere (e.g. the Debian ``dataset-fashion-mnist`` package) works offline;
torchvision is only imported for ``download=True``.

Normalisation: every dataset uses mean = std = 0.5 per channel (the PFLlib / HtFLlib convention),
so models see inputs in [-1, 1] and attacks can invert it exactly with :meth:`ImageDataset.denormalize`.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import math
import os
import pickle
import tempfile
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from privfl.errors import ConfigError, DataMissingError
from privfl.registry import Registry

__all__ = [
    "DATASETS",
    "DEBIAN_FASHION_MNIST",
    "DEBIAN_MNIST",
    "ImageDataset",
    "RestrictedUnpickler",
    "load_dataset",
    "read_idx",
    "restricted_pickle_load",
]

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
DEBIAN_MNIST = Path("/usr/share/datasets/mnist")

FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
MNIST_CLASSES = tuple(str(d) for d in range(10))
PFLLIB_MEAN_STD = 0.5  # per channel, for every dataset (PFLlib / HtFLlib transforms.Normalize)


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors element-wise has no truth value
class ImageDataset:
    """A whole labelled image pool kept as uint8 so it is small and exactly reproducible."""

    name: str
    images: torch.Tensor  # uint8, (N, C, H, W), C = 1 or 3
    labels: torch.Tensor  # int64, (N,)
    class_names: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        # Fail at construction, not deep inside training, when a reader produced something odd.
        if self.images.dtype != torch.uint8 or self.images.dim() != 4 or self.images.shape[1] not in (1, 3):
            raise ValueError(f"{self.name}: images must be uint8 (N, 1|3, H, W), got {self.images.dtype} {tuple(self.images.shape)}")
        if self.labels.dtype != torch.int64 or self.labels.shape != (self.images.shape[0],):
            raise ValueError(
                f"{self.name}: labels must be int64 (N,), got {self.labels.dtype} {tuple(self.labels.shape)} for {self.images.shape[0]} images"
            )
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(f"{self.name}: mean/std need one value per channel ({self.channels})")
        if len(self.labels) and (int(self.labels.min()) < 0 or int(self.labels.max()) >= len(self.class_names)):
            raise ValueError(f"{self.name}: labels outside 0..{len(self.class_names) - 1}")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def channels(self) -> int:
        return int(self.images.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.images.shape[2])

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.channels, 1, 1)
        mean = torch.tensor(self.mean, dtype=torch.float32, device=like.device).view(shape)
        std = torch.tensor(self.std, dtype=torch.float32, device=like.device).view(shape)
        return mean, std

    def normalize(self, images_uint8: torch.Tensor) -> torch.Tensor:
        """uint8 (…, C, H, W) -> float32 model input ``(x/255 - mean)/std``."""
        mean, std = self._stats(images_uint8)
        return (images_uint8.to(torch.float32) / 255.0 - mean) / std

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        """Model-space tensor -> float image in [0, 1] (clamped), e.g. for attack reconstructions."""
        mean, std = self._stats(x)
        return (x.to(torch.float32) * std + mean).clamp(0.0, 1.0)


Loader = Callable[[Path | None, bool], ImageDataset]
DATASETS: Registry[Loader] = Registry("dataset", discover=["privfl.data"])  # a built-in dataset is one module in privfl.data (toy.py)


def load_dataset(name: str, root: str | Path | None = None, download: bool = False) -> ImageDataset:
    """Load a registered dataset (original train + test merged); raises DataMissingError if absent."""
    key = name.lower() if name.lower() in DATASETS else name
    loader = DATASETS.get(key)
    path = Path(root).expanduser() if root is not None else None
    if path is not None and not path.is_dir() and not (download and not path.exists()):
        # a folder the user named is where they mean the data to be: never fall back to the standard places
        what = "is not a folder" if path.exists() else "does not exist"
        raise DataMissingError(f"{key}: data folder {path} {what} (--data-root)")
    return loader(path, download)


def _make(name: str, images: np.ndarray, labels: np.ndarray, class_names: Sequence[str]) -> ImageDataset:
    channels = images.shape[1]
    return ImageDataset(
        name=name,
        images=torch.from_numpy(np.ascontiguousarray(images, dtype=np.uint8)),
        labels=torch.from_numpy(np.asarray(labels, dtype=np.int64)),
        class_names=tuple(class_names),
        mean=(PFLLIB_MEAN_STD,) * channels,
        std=(PFLLIB_MEAN_STD,) * channels,
    )


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _download_via_torchvision(cls_name: str, root: Path | None, name: str) -> None:
    """Let torchvision fetch the standard files into ``root``; any failure becomes DataMissingError."""
    if root is None:
        raise ConfigError(f"downloading {name} needs a target folder: pass --data-root")
    try:
        import torchvision.datasets as tvd

        getattr(tvd, cls_name)(str(root), train=True, download=True)
    except Exception as exc:  # no network, disk full, checksum mismatch: all user-fixable
        raise DataMissingError(f"{name}: download into {root} failed ({_one_line(exc)})") from exc


# ---------------------------------------------------------------------------------------------- IDX

_IDX_DTYPES: dict[int, np.dtype[Any]] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


_MAX_IDX_BYTES = 1 << 32  # 4 GiB: far above any IDX dataset; a .gz header claiming more is refused before inflating it


def _read_at_most(fh: Any, n: int, chunk: int = 1 << 24) -> bytes:
    """Up to ``n`` bytes of ``fh``, read in chunks: ``fh.read(n)`` would allocate all ``n`` at once, whatever the file holds."""
    out = bytearray()
    while len(out) < n:
        part = fh.read(min(chunk, n - len(out)))
        if not part:
            break
        out += part
    return bytes(out)


def read_idx(path: Path, expect_ndim: int | None = None) -> np.ndarray:
    """Parse one IDX file (raw or .gz): magic = 0, 0, dtype code, ndim; then big-endian dims.

    The payload is read only up to the size the dims declare (+1 byte to see that nothing follows), so a
    gzip stream that inflates to more than its header says never fills memory."""
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as fh:
            head = fh.read(4)
            if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] not in _IDX_DTYPES:
                raise DataMissingError(f"{path}: not an IDX file (bad magic number {head.hex()})")
            ndim = head[3]
            if expect_ndim is not None and ndim != expect_ndim:
                raise DataMissingError(f"{path}: IDX file has {ndim} dimensions, expected {expect_ndim}")
            header = fh.read(4 * ndim)
            if len(header) < 4 * ndim:
                raise DataMissingError(f"{path}: truncated IDX header")
            dims = tuple(int(d) for d in np.frombuffer(header, dtype=">u4"))
            dtype = np.dtype(_IDX_DTYPES[head[2]])
            expected = math.prod(dims) * dtype.itemsize  # Python ints: 255 dims of 2**32 cannot overflow
            if expected > _MAX_IDX_BYTES:
                raise DataMissingError(f"{path}: IDX dims {dims[:8]} declare {expected} bytes, more than any IDX dataset")
            payload = _read_at_most(fh, expected + 1)
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise DataMissingError(f"{path}: {'corrupt gzip' if path.suffix == '.gz' else 'unreadable IDX file'} ({_one_line(exc)})") from exc
    if len(payload) != expected:
        size = f"more than {expected}" if len(payload) > expected else str(len(payload))
        raise DataMissingError(f"{path}: IDX payload is {size} bytes, dims {dims[:8]} need {expected}")
    return np.frombuffer(payload, dtype=dtype).reshape(dims)


def _find_idx_dir(candidates: Sequence[Path]) -> dict[str, Path] | None:
    """First folder holding all four IDX files (uncompressed preferred, else .gz)."""
    for folder in candidates:
        found: dict[str, Path] = {}
        for stem in _IDX_STEMS:
            for fname in (stem, stem + ".gz"):
                if (folder / fname).is_file():
                    found[stem] = folder / fname
                    break
        if len(found) == len(_IDX_STEMS):
            return found
    return None


def _load_idx_dataset(
    name: str, root: Path | None, download: bool, subdirs: Sequence[str], debian: Path, tv_class: str, class_names: Sequence[str], how: str
) -> ImageDataset:
    def candidates() -> list[Path]:
        dirs = [root, *(root / s for s in subdirs)] if root is not None else []
        return [*dirs, debian]

    files = _find_idx_dir(candidates())
    if files is None and download:
        _download_via_torchvision(tv_class, root, name)
        files = _find_idx_dir(candidates())
    if files is None:
        looked = ", ".join(str(p) for p in candidates())
        raise DataMissingError(f"{name} IDX files not found (looked in: {looked}); {how}")
    parts = []
    for split in ("train", "t10k"):
        imgs = read_idx(files[f"{split}-images-idx3-ubyte"], expect_ndim=3)
        labs = read_idx(files[f"{split}-labels-idx1-ubyte"], expect_ndim=1)
        if imgs.dtype != np.uint8 or labs.dtype != np.uint8 or len(imgs) != len(labs):
            raise DataMissingError(f"{name}: {split} images/labels do not match ({imgs.shape}, {labs.shape})")
        parts.append((imgs, labs))
    if parts[0][0].shape[1:] != parts[1][0].shape[1:]:
        raise DataMissingError(f"{name}: train images are {parts[0][0].shape[1:]}, test images {parts[1][0].shape[1:]}")
    images = np.concatenate([p[0] for p in parts])[:, None, :, :]
    labels = np.concatenate([p[1] for p in parts]).astype(np.int64)
    if labels.max(initial=0) >= len(class_names):
        raise DataMissingError(f"{name}: label {labels.max()} outside 0..{len(class_names) - 1}")
    return _make(name, images, labels, class_names)


@DATASETS.register("fashionmnist")
def _load_fashionmnist(root: Path | None, download: bool) -> ImageDataset:
    """Fashion-MNIST, 70,000 grey 28x28 images (60k train + 10k test), 10 classes."""
    how = "install it with `apt-get install dataset-fashion-mnist`, put the IDX files under --data-root, or pass --download where a network exists"
    return _load_idx_dataset(
        "fashionmnist",
        root,
        download,
        ("fashionmnist", "FashionMNIST/raw", "fashion-mnist"),
        DEBIAN_FASHION_MNIST,
        "FashionMNIST",
        FASHION_MNIST_CLASSES,
        how,
    )


@DATASETS.register("mnist")
def _load_mnist(root: Path | None, download: bool) -> ImageDataset:
    """MNIST, 70,000 grey 28x28 digits (60k train + 10k test)."""
    how = "put the IDX files under --data-root, or pass --download where a network exists"
    return _load_idx_dataset("mnist", root, download, ("mnist", "MNIST/raw"), DEBIAN_MNIST, "MNIST", MNIST_CLASSES, how)


# ------------------------------------------------------------------------------------------- CIFAR


def _numpy_globals() -> dict[tuple[str, str], Any]:
    """The only globals a CIFAR batch may name; numpy 1.x pickles say ``numpy.core``, 2.x ``numpy._core``."""
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]  # the same function, numpy 1.x's path
    return {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler for the CIFAR python format: plain containers plus numpy arrays, nothing callable else.

    Pickle can run arbitrary code through ``find_class``; CIFAR batches only need numpy's array
    reconstruction, so every other global (``os.system``, ``builtins.eval`` …) is refused.
    """

    _allowed = MappingProxyType(_numpy_globals())

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"forbidden global {module}.{name} in pickle") from None


def restricted_pickle_load(path: Path) -> Any:
    """Load a CIFAR-style pickle (``encoding="bytes"``, the format's own) with the restricted unpickler."""
    try:
        with open(path, "rb") as f:
            return RestrictedUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise DataMissingError(f"{path}: not a valid CIFAR pickle ({_one_line(exc)})") from exc


def _cifar_dir(root: Path | None, folder: str, marker: str) -> Path | None:
    if root is None:
        return None
    for cand in (root, root / folder):
        if (cand / marker).is_file():
            return cand
    return None


def _cifar_arrays(batch: Any, path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        raise DataMissingError(f"{path}: CIFAR batch lacks b'data' or {label_key!r}")
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
        raise DataMissingError(f"{path}: CIFAR data must be uint8 (n, 3072) with n labels, got {data.dtype} {data.shape} and {labels.shape}")
    return data.reshape(-1, 3, 32, 32), labels  # rows are R plane, G plane, B plane, each 32x32 row-major


def _names(meta: Any, key: bytes, path: Path) -> list[str]:
    if not isinstance(meta, dict) or key not in meta:
        raise DataMissingError(f"{path}: meta file lacks {key!r}")
    return [n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in meta[key]]


def _load_cifar(
    name: str,
    root: Path | None,
    download: bool,
    folder: str,
    batches: Sequence[str],
    meta_file: str,
    label_key: bytes,
    names_key: bytes,
    tv_class: str,
) -> ImageDataset:
    base = _cifar_dir(root, folder, meta_file)
    if base is None and download:
        _download_via_torchvision(tv_class, root, name)
        base = _cifar_dir(root, folder, meta_file)
    if base is None:
        looked = f"{root}, {root / folder}" if root is not None else "(no --data-root given)"
        raise DataMissingError(
            f"{name} python-format files not found (looked in: {looked}); put the "
            f"{folder}/ folder under --data-root, or pass --download where a network exists"
        )
    missing = [b for b in batches if not (base / b).is_file()]
    if missing:
        raise DataMissingError(f"{name}: {base} lacks {', '.join(missing)}")
    parts = [_cifar_arrays(restricted_pickle_load(base / b), base / b, label_key) for b in batches]
    class_names = _names(restricted_pickle_load(base / meta_file), names_key, base / meta_file)
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    if len(labels) and (labels.min() < 0 or labels.max() >= len(class_names)):
        raise DataMissingError(f"{name}: labels outside 0..{len(class_names) - 1}")
    return _make(name, images, labels, class_names)


@DATASETS.register("cifar10")
def _load_cifar10(root: Path | None, download: bool) -> ImageDataset:
    """CIFAR-10, 60,000 colour 32x32 images (data_batch_1..5 then test_batch)."""
    batches = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    return _load_cifar("cifar10", root, download, "cifar-10-batches-py", batches, "batches.meta", b"labels", b"label_names", "CIFAR10")


@DATASETS.register("cifar100")
def _load_cifar100(root: Path | None, download: bool) -> ImageDataset:
    """CIFAR-100 with its 100 fine labels, 60,000 colour 32x32 images (train then test)."""
    return _load_cifar("cifar100", root, download, "cifar-100-python", ["train", "test"], "meta", b"fine_labels", b"fine_label_names", "CIFAR100")


# ------------------------------------------------------------------------------------ Tiny-ImageNet

TINY_CACHE = "tinyimagenet_uint8.safetensors"
_TINY_CACHE_FORMAT = "privfl-tinyimagenet-v1"


def _tiny_dir(root: Path | None) -> Path | None:
    if root is None:
        return None
    for cand in (root, root / "tiny-imagenet-200"):
        if (cand / "wnids.txt").is_file():
            return cand
    return None


def _tiny_file_list(base: Path, wnids: list[str]) -> tuple[list[Path], list[int]]:
    """Train images (by wnid order, sorted names) then the labelled val images (annotation order)."""
    index = {w: i for i, w in enumerate(wnids)}
    files: list[Path] = []
    labels: list[int] = []
    for wnid in wnids:
        folder = base / "train" / wnid / "images"
        if not folder.is_dir():
            raise DataMissingError(f"tinyimagenet: missing {folder}")
        imgs = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpeg", ".jpg"))
        files += imgs
        labels += [index[wnid]] * len(imgs)
    annotations = base / "val" / "val_annotations.txt"
    if not annotations.is_file():
        raise DataMissingError(f"tinyimagenet: missing {annotations}")
    for line in annotations.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) < 2:
            continue
        if fields[1] not in index:
            raise DataMissingError(f"tinyimagenet: {annotations} names unknown class {fields[1]!r}")
        files.append(base / "val" / "images" / fields[0])
        labels.append(index[fields[1]])
    return files, labels


def _decode_jpegs(files: list[Path]) -> np.ndarray:
    """Decode all images into one (N, 3, H, W) uint8 array; threads help because PIL frees the GIL."""
    from PIL import Image

    def decode(path: Path) -> np.ndarray:
        try:
            with Image.open(path) as im:
                return np.asarray(im.convert("RGB"))
        except (OSError, ValueError) as exc:
            raise DataMissingError(f"tinyimagenet: cannot read {path} ({_one_line(exc)})") from exc

    first = decode(files[0])
    h, w = first.shape[:2]
    out = np.empty((len(files), 3, h, w), dtype=np.uint8)

    def put(i: int) -> None:
        arr = first if i == 0 else decode(files[i])
        if arr.shape != (h, w, 3):
            raise DataMissingError(f"tinyimagenet: {files[i]} is {arr.shape[1]}x{arr.shape[0]}, expected {w}x{h}")
        out[i] = arr.transpose(2, 0, 1)

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        for _ in pool.map(put, range(len(files))):
            pass
    return out


def _read_tiny_cache(path: Path, wnids_path: Path, digest: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Cached tensors if the cache is newer than wnids.txt and was built from the same class list."""
    from safetensors import safe_open

    try:
        if path.stat().st_mtime < wnids_path.stat().st_mtime:
            return None
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != _TINY_CACHE_FORMAT or meta.get("wnids_sha256") != digest:
                return None
            images, labels = f.get_tensor("images"), f.get_tensor("labels")
    except Exception:  # unreadable / truncated / foreign cache: rebuild from the JPEGs
        return None
    if images.dtype != torch.uint8 or images.dim() != 4 or labels.dtype != torch.int64 or len(labels) != len(images):
        return None
    return images, labels


def _write_tiny_cache(path: Path, images: torch.Tensor, labels: torch.Tensor, digest: str) -> None:
    """Atomic write (temp file + os.replace); a read-only data folder just means no cache."""
    from safetensors.torch import save_file

    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tinyimagenet_", suffix=".tmp", dir=path.parent)
        os.close(fd)
        save_file(
            {"images": images.contiguous(), "labels": labels.contiguous()}, tmp, metadata={"format": _TINY_CACHE_FORMAT, "wnids_sha256": digest}
        )
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@DATASETS.register("tinyimagenet")
def _load_tinyimagenet(root: Path | None, download: bool) -> ImageDataset:
    """Tiny-ImageNet train + labelled val (110,000 colour 64x64 images, 200 classes); test has no labels."""
    base = _tiny_dir(root)
    if base is None:
        looked = f"{root}, {root / 'tiny-imagenet-200'}" if root is not None else "(no --data-root given)"
        extra = " (there is no automatic download for it)" if download else ""
        raise DataMissingError(
            f"tinyimagenet folder not found (looked in: {looked}){extra}; download "
            "http://cs231n.stanford.edu/tiny-imagenet-200.zip and unzip it under --data-root"
        )
    wnids_path = base / "wnids.txt"
    wnids_text = wnids_path.read_text()
    wnids = [w.strip() for w in wnids_text.splitlines() if w.strip()]
    if not wnids:
        raise DataMissingError(f"tinyimagenet: {wnids_path} is empty")
    words: dict[str, str] = {}
    if (base / "words.txt").is_file():
        for line in (base / "words.txt").read_text().splitlines():
            wnid, _, text = line.partition("\t")
            words[wnid.strip()] = text.split(",")[0].strip()
    class_names = tuple(words.get(w) or w for w in wnids)

    digest = hashlib.sha256(wnids_text.encode()).hexdigest()
    cache = base / TINY_CACHE
    cached = _read_tiny_cache(cache, wnids_path, digest) if cache.is_file() else None
    if cached is not None:
        images, labels = cached
    else:
        files, label_list = _tiny_file_list(base, wnids)
        if not files:
            raise DataMissingError(f"tinyimagenet: no images under {base}")
        images = torch.from_numpy(_decode_jpegs(files))
        labels = torch.tensor(label_list, dtype=torch.int64)
        _write_tiny_cache(cache, images, labels, digest)
    mean = (PFLLIB_MEAN_STD,) * 3
    return ImageDataset("tinyimagenet", images, labels, class_names, mean, mean)
