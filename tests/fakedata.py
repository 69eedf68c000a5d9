"""Tiny datasets written in the standard on-disk formats (no network in tests)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
from PIL import Image


def write_cifar100(root: Path, per_class: int = 4, seed: int = 0) -> Path:
    """``root/cifar-100-python`` with ``per_class`` train images of each of the 100 classes."""
    rng = np.random.default_rng(seed)
    base = root / "cifar-100-python"
    base.mkdir(parents=True)
    labels = [c for c in range(100) for _ in range(per_class)]
    for name, labs in (("train", labels), ("test", labels[:100])):
        with open(base / name, "wb") as f:
            pickle.dump(
                {b"data": rng.integers(0, 256, (len(labs), 3072), dtype=np.uint8), b"fine_labels": labs, b"coarse_labels": [0] * len(labs)},
                f,
                protocol=4,
            )
    with open(base / "meta", "wb") as f:
        pickle.dump({b"fine_label_names": [f"c{i}".encode() for i in range(100)]}, f, protocol=4)
    return root


def write_tinyimagenet(root: Path, num_classes: int = 200, per_class: int = 2, seed: int = 0) -> Path:
    """``root/tiny-imagenet-200`` with ``per_class`` random 64x64 JPEGs per class (train) and none in val."""
    rng = np.random.default_rng(seed)
    base = root / "tiny-imagenet-200"
    wnids = [f"n{i:08d}" for i in range(num_classes)]
    (base / "val" / "images").mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    (base / "words.txt").write_text("".join(f"{w}\tclass {i}\n" for i, w in enumerate(wnids)))
    (base / "val" / "val_annotations.txt").write_text("")
    for w in wnids:
        folder = base / "train" / w / "images"
        folder.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(folder / f"{w}_{i}.JPEG")
    return root
