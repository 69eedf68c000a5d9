"""What an attacker knows without the message, scored exactly like the attack (metrics side only).

A reconstruction is evidence of leakage only where it beats what the attacker could have drawn without
the message. An all-black image already scores about 7.7 dB PSNR against Fashion-MNIST images and the
mean image of the right class about 13 dB, so a 10 dB reconstruction of a prototype says nothing by
itself. Every image result is therefore scored beside its **priors**, by the same scorer and against the
same ground truth:

- ``blank``: an all-zero image;
- ``population_mean``: the mean of the population images (see :class:`PriorBank`);
- ``class_mean``: the mean population image of the class the message reveals (a prototype's class id, a
  per-sample row's label, the top class of an entangled representation's soft label, the label a
  gradient attack recovered from the message);
- ``label_mixture``: where the message reveals a soft label (FedRE's entangled label), the class means
  mixed with those weights.

The **strongest prior** of a measure is the one with the best mean over a result's targets in that
measure: one fixed strategy the attacker could have followed for every target (choosing per target with
the ground truth in hand would be an oracle). ``strongest_prior`` names the PSNR one, the headline.
Each attack is reported as its **gain** over the strongest prior of each measure, paired per target
(PSNR and SSIM higher is better, LPIPS lower; identification top-1), with a bootstrap interval.

**Identification** asks whether a reconstruction picks out its own image among the attacked client's K
training images: the rank of the nearest true image among all K by distance to the reconstruction, in
pixel space (MSE) and in a feature space fitted on the population (PCA with whitening, so every
principal direction of the data counts alike). Top-1 and top-5 rates are reported against chance (1/K
and 5/K for one true image; for an aggregate over m of the K images, the chance that k random picks
include one of them) and against the strongest prior's own rates. An aggregate built from every image
of the client (an entangled representation with all weights positive) has chance 1: identification is
reported as not informative there.

The **verdict** is ``leaks beyond the prior`` when the interval of any gain (PSNR, SSIM, LPIPS,
identification top-1 in either space) lies above zero, else ``no evidence beyond the prior at this
budget``; an attack whose mean falls below its prior is flagged as failed, never read as protection.
Intervals are percentile bootstraps over targets, resampling clients first and targets within them
(:func:`bootstrap_mean`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from privfl.kinds import KINDS
from privfl.run import GroundTruth

PRIORS = ("blank", "population_mean", "class_mean", "label_mixture")
#: what each prior is, for reports
PRIOR_TEXT = {
    "blank": "an all-zero image",
    "population_mean": "the mean population image",
    "class_mean": "the mean population image of the class the message reveals",
    "label_mixture": "the population class means mixed with the message's soft label",
}
LEAKS = "leaks beyond the prior"
NO_EVIDENCE = "no evidence beyond the prior at this budget"
#: population images kept per excluded client (a seeded subset beyond this: means and PCA are stable well before)
POPULATION_LIMIT = 10_000
FEATURE_COMPONENTS = 64
RESAMPLES = 2000
LEVEL = 0.95


# --------------------------------------------------------------------------------------- intervals
def bootstrap_mean(
    values: Sequence[float], clusters: Sequence[Hashable] | None = None, *, seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL
) -> dict[str, Any]:
    """Mean of ``values`` with a percentile bootstrap interval: ``{"mean", "low", "high", "n"}``.

    With ``clusters`` naming two or more groups (clients, seeds), the resampling is hierarchical: groups
    with replacement, then values within each drawn group, because targets of one client share its
    extractor and are not independent. One value gives no interval (low = high = the value, ``n`` 1);
    the caller says so. NaNs are dropped first."""
    v = np.asarray(values, dtype=np.float64)
    keep = np.isfinite(v)
    v = v[keep]
    n = int(v.size)
    if n == 0:
        return {"mean": float("nan"), "low": float("nan"), "high": float("nan"), "n": 0}
    mean = float(v.mean())
    if n == 1:
        return {"mean": mean, "low": mean, "high": mean, "n": 1}
    rng = np.random.default_rng(seed)
    groups: list[np.ndarray] = []
    if clusters is not None:
        labels = [c for c, k in zip(clusters, keep) if k]
        order: dict[Hashable, list[int]] = {}
        for i, c in enumerate(labels):
            order.setdefault(c, []).append(i)
        groups = [v[idx] for idx in order.values()]
    if len(groups) >= 2:
        means = np.empty(resamples)
        for r in range(resamples):
            picked = rng.integers(0, len(groups), len(groups))
            drawn = [groups[g][rng.integers(0, len(groups[g]), len(groups[g]))] for g in picked]
            means[r] = np.concatenate(drawn).mean()
    else:
        means = v[rng.integers(0, n, (resamples, n))].mean(1)
    alpha = (1 - level) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return {"mean": mean, "low": float(low), "high": float(high), "n": n}


def interval_text(iv: dict[str, Any], unit: str = "", digits: int = 2) -> str:
    """``+3.10 dB [1.20, 4.90]`` (or ``+3.10 dB (one target, no interval)``)."""
    if iv["n"] == 0 or not math.isfinite(iv["mean"]):
        return "n/a"
    head = f"{iv['mean']:+.{digits}f}{unit}"
    return f"{head} (one target, no interval)" if iv["n"] == 1 else f"{head} [{iv['low']:+.{digits}f}, {iv['high']:+.{digits}f}]"


# --------------------------------------------------------------------------------------- population
@dataclass
class Population:
    """Images an attacker has without the message, their mean, class means and a fitted feature space."""

    images: torch.Tensor  # (P, C, H, W) in [0, 1]
    labels: torch.Tensor  # (P,)
    description: str
    seed: int
    _pca: Any = field(default=None, repr=False)

    @property
    def mean(self) -> torch.Tensor:
        return self.images.mean(0)

    def class_mean(self, c: int) -> torch.Tensor | None:
        members = self.images[self.labels == c]
        return members.mean(0) if len(members) else None

    def features(self, images: torch.Tensor) -> np.ndarray:
        """Images -> the population's whitened PCA coordinates (fitted on first use)."""
        from sklearn.decomposition import PCA

        if self._pca is None:
            flat = self.images.flatten(1).double().numpy()
            k = max(1, min(FEATURE_COMPONENTS, flat.shape[0] - 1, flat.shape[1]))
            self._pca = PCA(n_components=k, whiten=True, random_state=self.seed).fit(flat)
        return cast(np.ndarray, self._pca.transform(images.flatten(1).double().numpy()))


class PriorBank:
    """Populations per attacked client, built from the ground truth once per scoring call.

    The population of client k is every other client's held-out split (what the membership game hands
    an attacker as population data, never trained on by anyone); a run without held-out samples falls
    back to the other clients' training samples. A server's broadcast (no one client excluded) uses every
    client's held-out split. At most :data:`POPULATION_LIMIT` images, a seeded subset."""

    def __init__(self, truth: GroundTruth, seed: int = 0):
        self.truth = truth
        self.seed = seed
        self._cache: dict[str | None, Population] = {}
        #: per client: its training images and their population features, shared by every identify() call
        self.pools: dict[str, tuple[torch.Tensor, np.ndarray]] = {}

    def population(self, client: str | None) -> Population:
        if client not in self._cache:
            others = [c for c in self.truth.clients() if c != client]
            parts = [self.truth.test.get(f"test_{c.removeprefix('client')}", torch.zeros(0, dtype=torch.long)) for c in others]
            idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
            what = "the other clients' held-out samples" if client else "every client's held-out samples"
            if len(idx) == 0:
                idx = torch.cat([self.truth.client_train(c) for c in others]) if others else torch.zeros(0, dtype=torch.long)
                what = "the other clients' training samples (the run holds out none)"
            if len(idx) == 0:
                raise ValueError("no population images: the run has a single client and no held-out samples")
            if len(idx) > POPULATION_LIMIT:
                from privfl.seeding import torch_generator

                idx = idx[torch.randperm(len(idx), generator=torch_generator(self.seed, "prior-population", str(client)))[:POPULATION_LIMIT]]
            self._cache[client] = Population(self.truth.images(idx), self.truth.labels[idx].long(), f"{what} ({len(idx)})", self.seed)
        return self._cache[client]

    def images(self, client: str | None, class_weights: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The prior images for a target of ``client`` whose message reveals ``class_weights`` (C,) or nothing."""
        pop = self.population(client)
        out = {"blank": torch.zeros_like(pop.mean), "population_mean": pop.mean}
        if class_weights is None or float(class_weights.sum()) <= 0:
            return out
        w = class_weights.double().clamp_min(0)
        top = pop.class_mean(int(w.argmax()))
        if top is not None:
            out["class_mean"] = top
        present = [(c, float(w[c])) for c in torch.nonzero(w).flatten().tolist()]
        if len(present) > 1:
            found = [(pop.class_mean(c), wc) for c, wc in present]
            means = [(m, wc) for m, wc in found if m is not None]
            total = sum(wc for _, wc in means)
            if means and total > 0:
                out["label_mixture"] = torch.stack([m * (wc / total) for m, wc in means]).sum(0)
        return out


def revealed_classes(target: Any, num_classes: int) -> torch.Tensor | None:
    """Class weights (C,) a representation message reveals about one target, read from what the attacker
    sees: a soft label (weights), a row's class id (one-hot), or None. Counterfactual targets carry them
    in ``payload["soft_label"]`` / ``class_id``."""
    soft = target.payload.get("soft_label")
    if soft is None and target.record is not None:
        spec = KINDS.get(target.kind)
        if spec.soft_label:
            tensors = target.view.load(target.record)
            soft = tensors.get(spec.soft_label)
    if soft is not None and soft.numel() == num_classes:
        return soft.double().flatten().clamp_min(0)
    if target.class_id is not None and 0 <= int(target.class_id) < num_classes:
        return torch.nn.functional.one_hot(torch.tensor(int(target.class_id)), num_classes).double()
    return None


def one_hot(label: int | None, num_classes: int) -> torch.Tensor | None:
    return None if label is None or not 0 <= int(label) < num_classes else torch.nn.functional.one_hot(torch.tensor(int(label)), num_classes).double()


# ---------------------------------------------------------------------------------- identification
def chance(k: int, members: int, pool: int) -> float:
    """Probability that ``k`` distinct random picks among ``pool`` include one of ``members``."""
    if members >= pool:
        return 1.0
    k = min(k, pool)
    miss = 1.0
    for i in range(k):
        miss *= (pool - members - i) / (pool - i)
    return 1.0 - max(miss, 0.0)


def nearest_member_rank(distances: np.ndarray, members: np.ndarray) -> int:
    """How many pool images are strictly closer than the closest member (0: the nearest image is one)."""
    best = distances[members].min()
    return int((distances < best).sum())


@dataclass
class IdentificationItem:
    """One image to identify: the client whose training images form the pool, and which of them are true."""

    client: str
    pool: torch.Tensor  # (K,) pool indices of the client's training images
    members: torch.Tensor  # (K,) bool: the images the reconstruction is about


def identify(images: torch.Tensor, items: Sequence[IdentificationItem], truth: GroundTruth, bank: PriorBank) -> list[dict[str, Any]]:
    """Per image: the nearest true image's rank among the client's K training images in pixel and in
    feature space, and the chance of a top-1 / top-5 hit (None where the images behind it are all K)."""
    out: list[dict[str, Any]] = []
    pools = bank.pools  # the client's images and their features, computed once per scoring call
    for x, item in zip(images, items):
        k, m = len(item.pool), int(item.members.sum())
        row: dict[str, Any] = {"pool": k, "members": m}
        if m == 0 or m >= k:
            out.append({**row, "informative": False})
            continue
        if item.client not in pools:
            pool_images = truth.images(item.pool)
            pools[item.client] = (pool_images, bank.population(item.client).features(pool_images))
        pool_images, pool_feats = pools[item.client]
        members = item.members.numpy()
        pixel = (pool_images.double() - x.double()).pow(2).flatten(1).mean(1).numpy()
        feat = ((pool_feats - bank.population(item.client).features(x.unsqueeze(0))) ** 2).sum(1)
        row.update(
            informative=True,
            pixel_rank=nearest_member_rank(pixel, members),
            feature_rank=nearest_member_rank(feat, members),
            chance_top1=chance(1, m, k),
            chance_top5=chance(5, m, k),
        )
        out.append(row)
    return out


__all__ = [
    "LEAKS",
    "NO_EVIDENCE",
    "PRIORS",
    "PRIOR_TEXT",
    "IdentificationItem",
    "Population",
    "PriorBank",
    "bootstrap_mean",
    "chance",
    "identify",
    "interval_text",
    "nearest_member_rank",
    "one_hot",
    "revealed_classes",
]
