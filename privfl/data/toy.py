"""``toy2d``: the two-dimensional toy data of FedRE [001] Fig. 2 and Table 8 (FS vs RS), generated, no files.

The paper says only "300 training and 200 test two-dimensional samples distributed across two
clients", that FedGH uploads "4 prototypes" and FedRE "2 entangled representations". Our reading
(``experiments/papers/fedre/toy2d.py`` documents it): four classes, two per client (the pathological
partition, ``pat`` with ``classes_per_client = 2``, ``balanced``), so the two clients send 4
(client, class) prototypes between them and one entangled representation each; 500 points, 125 per
class, and a 60 % train share per client give 150 + 150 training and 100 + 100 test points.

The classes are isotropic Gaussians around the corners (+-1, +-1) of a square (:data:`TOY2D_CENTERS`)
with a standard deviation of 2 (:data:`TOY2D_STD`). They overlap so much that the best possible
accuracy on a client's two classes is about 71 % (Bayes: 69 % for neighbouring corners, 76 % for
opposite ones), in the range of the paper's 60-64 %, which says its toy was about as hard.

A point (x, y) is stored as the 2x2 grey image [[x, y], [x, y]] (the point on both rows): privfl keeps
every dataset as square uint8 images, and a square image lets the existing ``mlp`` extractor read it
(four inputs carrying the two coordinates; group ``toy2d`` in ``privfl/models/toy.py``). Each
coordinate is clipped to +-:data:`TOY2D_RANGE` (7; 3 of the 500 points of seed 0 lie beyond) and
quantised to uint8, a step of 14/255 = 0.055, a fortieth of the standard deviation; with privfl's
mean = std = 0.5 normalisation the model sees ``coordinate / TOY2D_RANGE`` in [-1, 1].
:func:`toy2d_points` undoes the quantisation for plots and :func:`model_input` maps any points (a
plotting grid) to model inputs. The registered ``toy2d`` is :func:`make_toy2d` with seed 0 (one fixed
toy set, as the paper's one figure; a run's ``--seed`` still draws its partition, split and
initialisation); other draws are ``make_toy2d(seed)``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from privfl.data.datasets import DATASETS, PFLLIB_MEAN_STD, ImageDataset

TOY2D_CLASSES = ("A", "B", "C", "D")
TOY2D_CENTERS = ((-1.0, -1.0), (1.0, -1.0), (1.0, 1.0), (-1.0, 1.0))
TOY2D_STD = 2.0
TOY2D_PER_CLASS = 125
TOY2D_RANGE = 7.0


def _as_images(values: np.ndarray) -> np.ndarray:
    """(N, 2) -> (N, 1, 2, 2): the pair on both rows of a 2x2 one-channel image."""
    return np.repeat(values.reshape(-1, 1, 1, 2), 2, axis=2)


def to_uint8(points: np.ndarray) -> np.ndarray:
    """(N, 2) coordinates -> uint8 (N, 1, 2, 2) images (clipped to +-TOY2D_RANGE, 256 levels)."""
    scaled = (np.clip(np.asarray(points, dtype=np.float64), -TOY2D_RANGE, TOY2D_RANGE) + TOY2D_RANGE) / (2 * TOY2D_RANGE)
    return _as_images(np.rint(scaled * 255.0).astype(np.uint8))


def toy2d_points(images: torch.Tensor | np.ndarray) -> np.ndarray:
    """uint8 (N, 1, 2, 2) images -> (N, 2) float coordinates (the quantised points)."""
    arr = images.numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    return arr[:, 0, 0, :].astype(np.float64) / 255.0 * (2 * TOY2D_RANGE) - TOY2D_RANGE


def model_input(points: np.ndarray) -> torch.Tensor:
    """(N, 2) coordinates -> the normalised (N, 1, 2, 2) model input, as privfl's data view makes it."""
    scaled = (np.clip(np.asarray(points, dtype=np.float64), -TOY2D_RANGE, TOY2D_RANGE) + TOY2D_RANGE) / (2 * TOY2D_RANGE)
    x = torch.as_tensor(_as_images(scaled), dtype=torch.float32)
    return (x - PFLLIB_MEAN_STD) / PFLLIB_MEAN_STD


def make_toy2d(seed: int = 0, per_class: int = TOY2D_PER_CLASS) -> ImageDataset:
    """The toy set drawn with ``seed``: ``per_class`` points of each of the four classes, in a seeded order."""
    rng = np.random.default_rng([int(seed), 2])
    labels = np.repeat(np.arange(len(TOY2D_CLASSES)), per_class)
    points = np.asarray(TOY2D_CENTERS)[labels] + TOY2D_STD * rng.standard_normal((len(labels), 2))
    order = rng.permutation(len(labels))
    return ImageDataset(
        name="toy2d" if seed == 0 else f"toy2d-s{seed}",
        images=torch.from_numpy(to_uint8(points[order])),
        labels=torch.from_numpy(labels[order].astype(np.int64)),
        class_names=TOY2D_CLASSES,
        mean=(PFLLIB_MEAN_STD,),
        std=(PFLLIB_MEAN_STD,),
    )


@DATASETS.register("toy2d")
def _load_toy2d(root: Path | None, download: bool) -> ImageDataset:
    """Generated (no files: ``--data-root`` and ``--download`` are not used)."""
    return make_toy2d(0)


__all__ = ["TOY2D_CENTERS", "TOY2D_CLASSES", "TOY2D_PER_CLASS", "TOY2D_RANGE", "TOY2D_STD", "make_toy2d", "model_input", "to_uint8", "toy2d_points"]
