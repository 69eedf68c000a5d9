"""Small sets of real images that ship inside installed packages, for attacks' tests and benchmarks.

foolbox 3.3.4 (MIT, PyPI) carries the first 20 CIFAR-10 test images (and 20 of CIFAR-100, MNIST,
Fashion-MNIST, ImageNet) as ``foolbox/data/<dataset>_<idx>_<label>.png``; they are read directly
(foolbox itself is never imported).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from privfl.errors import DataMissingError


def packaged_images(dataset: str = "cifar10", count: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (N, C, H, W) in [0, 1], labels (N,)) of the first ``count`` packaged test images."""
    spec = importlib.util.find_spec("foolbox")
    if spec is None or not spec.submodule_search_locations:
        raise DataMissingError("the packaged test images need foolbox==3.3.4 (pip install 'privfl[test]')")
    folder = Path(list(spec.submodule_search_locations)[0]) / "data"
    files = sorted(folder.glob(f"{dataset}_*_*.png"), key=lambda p: int(p.stem.split("_")[1]))[:count]
    if not files:
        raise DataMissingError(f"no packaged {dataset} images in {folder}")
    imgs, labels = [], []
    for f in files:
        arr = np.array(Image.open(f))
        arr = arr[..., None] if arr.ndim == 2 else arr[..., :3]
        imgs.append(torch.from_numpy(arr).permute(2, 0, 1).float() / 255.0)
        labels.append(int(f.stem.split("_")[2]))
    return torch.stack(imgs), torch.tensor(labels)
