"""Splitting a labelled pool over FL clients (iid, dir, pat, exdir, longtail) and each client 3:1.

All schemes are deterministic functions of a numpy ``Generator`` seeded from one integer, return
disjoint global indices (sorted int64) per client, and either satisfy ``min_samples`` per client or
raise :class:`~privfl.errors.PartitionError` after a bounded number of redraws (never loop forever).

Scheme notes (decisions documented here because the papers leave them open):

* ``dir`` follows the Hsu et al. / Yurochkin et al. recipe as used by PFLlib: per class, client
  shares ~ Dirichlet(alpha); clients already holding more than N/num_clients samples get share 0
  for later classes (keeps sizes from exploding); redraw everything while a client is below
  ``min_samples``.
* ``pat`` gives every client ``classes_per_client`` classes taken consecutively from a cycle over a
  shuffled class list, so every class is used whenever ``num_clients * classes_per_client >= C``
  (otherwise the classes nobody holds are dropped, as in PFLlib). Each class is split among its
  holders with random sizes (weights ~ U(0.1, 1), up to 10x apart like PFLlib's "varying sample
  sizes"), or equally with ``balanced=True``.
* ``exdir`` (Li et al., arXiv 2311.03154; PFLlib PR #185): each client draws ``classes_per_client``
  distinct labels at random (redrawn until every label has at least
  ``max(classes_per_client * num_clients // C // 2, 1)`` holders), then each class is split by
  Dirichlet(alpha) among its holders only, with the same size cap as ``dir``; as in PFLlib the
  default ``min_samples`` here is at most 10 (the sharper skew makes dir's 40 rarely reachable).
* ``longtail`` (spec decision #15; FedRE cites a long-tail setting without defining it): each class
  c = 0..C-1 (sorted label order) is first subsampled to n_c = n_max * IF^(-c/(C-1)), n_max being
  the smallest class count so every n_c is available, then the kept samples go through ``dir``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from privfl.errors import ConfigError, PartitionError
from privfl.registry import Registry

__all__ = [
    "PARTITIONS",
    "ClientSplit",
    "default_min_samples",
    "longtail_class_sizes",
    "partition_indices",
    "plot_partition",
    "split_train_test",
]

PartitionFn = Callable[..., list[np.ndarray]]
PARTITIONS: Registry[PartitionFn] = Registry("partition scheme")

DEFAULT_BATCH_SIZE = 10  # PFLlib's batch size, which sets its minimum client size
DEFAULT_TRAIN_FRACTION = 0.75  # "local samples are split in a 3:1 ratio" (FedRE / PFLlib)
EXDIR_MIN_SAMPLES = 10  # PFLlib's exdir floor (its second level), lower than dir's 40
_HINT = "use a larger --alpha, fewer clients or a smaller --min-samples"


def default_min_samples(
    num_samples: int, num_clients: int, batch_size: int = DEFAULT_BATCH_SIZE, train_fraction: float = DEFAULT_TRAIN_FRACTION
) -> int:
    """PFLlib's floor: one batch of training data after the split, but at most half a fair share.

    ``min(ceil(batch/(1-train_fraction)), N/num_clients/2)`` (= 40 for batch 10, 3:1 split), and
    never below 2 so that every client can have one train and one test sample.
    """
    per_batch = math.ceil(batch_size / (1.0 - train_fraction) - 1e-9)
    return max(2, min(per_batch, num_samples // max(num_clients, 1) // 2))


def _resolve_min(min_samples: int | None, num_samples: int, num_clients: int) -> int:
    return default_min_samples(num_samples, num_clients) if min_samples is None else int(min_samples)


def _concat(parts: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    return [np.sort(np.concatenate(p)).astype(np.int64) if len(p) else np.empty(0, np.int64) for p in parts]


def _check_min(parts: list[np.ndarray], min_samples: int, scheme: str, hint: str) -> list[np.ndarray]:
    sizes = [len(p) for p in parts]
    smallest = min(sizes)
    if smallest < min_samples:
        raise PartitionError(f"{scheme} partition: client {sizes.index(smallest)} gets {smallest} samples (< min_samples={min_samples}); {hint}")
    return parts


def _by_class(labels: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    classes = np.unique(labels)
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], classes, side="left")
    ends = np.append(bounds[1:], len(labels))
    return classes, [order[b:e] for b, e in zip(bounds, ends)]


def _split_by_weights(idx: np.ndarray, weights: np.ndarray) -> list[np.ndarray]:
    total = float(weights.sum())
    if not np.isfinite(total) or total <= 0:
        weights, total = np.ones_like(weights), float(len(weights))
    cuts = (np.cumsum(weights)[:-1] / total * len(idx)).astype(np.int64)
    return np.split(idx, cuts)


def _dirichlet_with_retries(
    scheme: str,
    by_class: Sequence[np.ndarray],
    holders: Sequence[np.ndarray],
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_samples: int,
    max_tries: int,
    cap: float | None,
    hint: str = _HINT,
) -> list[np.ndarray]:
    """Split each class by Dirichlet(alpha) over its holders; redraw all while a client is too small."""
    best = -1
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx, who in zip(by_class, holders):
            if len(who) == 0:
                continue
            idx = rng.permutation(idx)
            weights = rng.dirichlet(np.full(len(who), alpha))
            if cap is not None:
                masked = weights * (sizes[who] < cap)
                if masked.sum() > 0:  # else every holder is full: keep the raw shares
                    weights = masked
            for client, chunk in zip(who, _split_by_weights(idx, weights)):
                parts[client].append(chunk)
                sizes[client] += len(chunk)
        smallest = int(sizes.min())
        if smallest >= min_samples:
            return _concat(parts)
        best = max(best, smallest)
    raise PartitionError(
        f"{scheme} partition: after {max_tries} tries the smallest client still has {best} samples (< min_samples={min_samples}); {hint}"
    )


@PARTITIONS.register("iid")
def iid_partition(labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, min_samples: int | None = None) -> list[np.ndarray]:
    """Shuffle everything and deal it out in (almost) equal parts."""
    perm = rng.permutation(len(labels))
    parts = _concat([[c] for c in np.array_split(perm, num_clients)])
    return _check_min(parts, _resolve_min(min_samples, len(labels), num_clients), "iid", "use fewer clients or a smaller --min-samples")


@PARTITIONS.register("dir")
def dirichlet_partition(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, alpha: float = 0.1, min_samples: int | None = None, max_tries: int = 100
) -> list[np.ndarray]:
    """Label skew: per class, client shares ~ Dirichlet(alpha) (small alpha = more skew)."""
    _, by_class = _by_class(labels)
    everyone = np.arange(num_clients)
    return _dirichlet_with_retries(
        "dir",
        by_class,
        [everyone] * len(by_class),
        num_clients,
        alpha,
        rng,
        _resolve_min(min_samples, len(labels), num_clients),
        max_tries,
        cap=len(labels) / num_clients,
    )


@PARTITIONS.register("pat")
def pathological_partition(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    classes_per_client: int = 2,
    balanced: bool = False,
    min_samples: int | None = None,
) -> list[np.ndarray]:
    """Pathological skew: every client sees exactly ``classes_per_client`` classes."""
    classes, by_class = _by_class(labels)
    k = classes_per_client
    if k > len(classes):
        raise PartitionError(f"pat partition: classes_per_client={k} exceeds the {len(classes)} classes")
    order = rng.permutation(len(classes))
    holders: list[list[int]] = [[] for _ in classes]
    for client in range(num_clients):
        for j in range(k):
            holders[order[(client * k + j) % len(classes)]].append(client)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for idx, who in zip(by_class, holders):
        if not who:
            continue  # more classes than client slots: nobody holds it (PFLlib drops these too)
        idx = rng.permutation(idx)
        weights = np.ones(len(who)) if balanced else rng.uniform(0.1, 1.0, len(who))
        for client, chunk in zip(who, _split_by_weights(idx, weights)):
            parts[client].append(chunk)
    return _check_min(
        _concat(parts),
        _resolve_min(min_samples, len(labels), num_clients),
        "pat",
        "use fewer clients, more --classes-per-client, --balanced or a smaller --min-samples",
    )


@PARTITIONS.register("exdir")
def extended_dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: float = 0.1,
    classes_per_client: int = 2,
    min_samples: int | None = None,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Extended Dirichlet: ``classes_per_client`` random labels per client, Dirichlet over holders."""
    classes, by_class = _by_class(labels)
    num_classes, k = len(classes), classes_per_client
    if k > num_classes:
        raise PartitionError(f"exdir partition: classes_per_client={k} exceeds the {num_classes} classes")
    if k * num_clients < num_classes:
        raise PartitionError(
            f"exdir partition: {num_clients} clients x {k} classes cannot cover all "
            f"{num_classes} classes; use more clients or more --classes-per-client"
        )
    need = max(k * num_clients // num_classes // 2, 1)
    for _ in range(max_tries):
        picks = [rng.choice(num_classes, size=k, replace=False) for _ in range(num_clients)]
        held = np.bincount(np.concatenate(picks), minlength=num_classes)
        if held.min() >= need:
            break
    else:
        raise PartitionError(
            f"exdir partition: after {max_tries} tries some class still has fewer than {need} holders; use more clients or more --classes-per-client"
        )
    holders = [np.array([i for i, p in enumerate(picks) if c in p], dtype=np.int64) for c in range(num_classes)]
    if min_samples is None:
        min_samples = min(EXDIR_MIN_SAMPLES, default_min_samples(len(labels), num_clients))
    return _dirichlet_with_retries("exdir", by_class, holders, num_clients, alpha, rng, int(min_samples), max_tries, cap=len(labels) / num_clients)


def longtail_class_sizes(class_counts: Sequence[int], imbalance_factor: float) -> np.ndarray:
    """Exponential long-tail profile n_c = n_max * IF^(-c/(C-1)), n_max = smallest available class count."""
    counts = np.asarray(class_counts, dtype=np.int64)
    num_classes = len(counts)
    n_max = int(counts.min())
    if num_classes == 1:
        return counts[:1].copy()
    exps = -np.arange(num_classes) / (num_classes - 1)
    sizes = np.floor(n_max * np.power(float(imbalance_factor), exps) + 1e-6).astype(np.int64)
    return np.clip(sizes, 1, counts)


@PARTITIONS.register("longtail")
def longtail_partition(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: float = 0.1,
    imbalance_factor: float = 100.0,
    min_samples: int | None = None,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Global long tail (class c keeps n_max * IF^(-c/(C-1)) samples), then Dirichlet over clients."""
    _, by_class = _by_class(labels)
    sizes = longtail_class_sizes([len(i) for i in by_class], imbalance_factor)
    kept = [rng.choice(idx, size=int(n), replace=False) for idx, n in zip(by_class, sizes)]
    total = int(sizes.sum())
    everyone = np.arange(num_clients)
    return _dirichlet_with_retries(
        "longtail",
        kept,
        [everyone] * len(kept),
        num_clients,
        alpha,
        rng,
        _resolve_min(min_samples, total, num_clients),
        max_tries,
        cap=total / num_clients,
        hint=_HINT.replace("--alpha", "--alpha, a smaller --imbalance-factor"),
    )


def partition_indices(
    labels: np.ndarray | torch.Tensor | Sequence[int],
    num_clients: int,
    scheme: str,
    seed: int,
    *,
    alpha: float = 0.1,
    classes_per_client: int = 2,
    imbalance_factor: float = 100.0,
    min_samples: int | None = None,
    balanced: bool = False,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Global sample indices per client (sorted int64, disjoint) for one registered scheme.

    ``min_samples=None`` means :func:`default_min_samples` of the (possibly subsampled) pool.
    Each scheme only receives the options it declares, so plugin schemes may take a subset.
    """
    arr = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ConfigError(f"labels must be a 1-D integer array, got {arr.dtype} {arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    if num_clients < 1:
        raise ConfigError(f"num_clients must be >= 1, got {num_clients}")
    if not (alpha > 0 and math.isfinite(alpha)):
        raise ConfigError(f"alpha must be a positive number, got {alpha}")
    if classes_per_client < 1:
        raise ConfigError(f"classes_per_client must be >= 1, got {classes_per_client}")
    if not (imbalance_factor >= 1 and math.isfinite(imbalance_factor)):
        raise ConfigError(f"imbalance_factor must be >= 1, got {imbalance_factor}")
    if max_tries < 1:
        raise ConfigError(f"max_tries must be >= 1, got {max_tries}")
    if min_samples is not None and min_samples < 0:
        raise ConfigError(f"min_samples must be >= 0, got {min_samples}")
    if num_clients > len(arr):
        raise PartitionError(f"{num_clients} clients but only {len(arr)} samples; use fewer clients")
    fn = PARTITIONS.get(scheme)
    options: dict[str, Any] = {
        "alpha": alpha,
        "classes_per_client": classes_per_client,
        "imbalance_factor": imbalance_factor,
        "min_samples": min_samples,
        "balanced": balanced,
        "max_tries": max_tries,
    }
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        options = {k: v for k, v in options.items() if k in params}
    parts = fn(arr, num_clients, np.random.default_rng(seed), **options)
    parts = [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    if len(parts) != num_clients:
        raise RuntimeError(f"partition scheme {scheme!r} returned {len(parts)} clients, not {num_clients}")
    flat = np.concatenate(parts) if parts else np.empty(0, np.int64)
    if len(np.unique(flat)) != len(flat) or (len(flat) and (flat.min() < 0 or flat.max() >= len(arr))):
        raise RuntimeError(f"partition scheme {scheme!r} returned overlapping or out-of-range indices")
    return parts


@dataclass
class ClientSplit:
    """Per-client train / test global indices (sorted int64), the unit saved beside a run."""

    train: list[np.ndarray]
    test: list[np.ndarray]

    def __post_init__(self) -> None:
        if len(self.train) != len(self.test):
            raise ValueError(f"{len(self.train)} train but {len(self.test)} test index lists")
        self.train = [np.sort(np.asarray(t, dtype=np.int64)) for t in self.train]
        self.test = [np.sort(np.asarray(t, dtype=np.int64)) for t in self.test]

    @property
    def num_clients(self) -> int:
        return len(self.train)

    def counts(self, labels: np.ndarray | torch.Tensor, num_classes: int) -> np.ndarray:
        """(clients, classes) sample counts of train + test, e.g. for :func:`plot_partition`."""
        arr = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels, dtype=np.int64)
        out = np.zeros((self.num_clients, num_classes), dtype=np.int64)
        for i, (tr, te) in enumerate(zip(self.train, self.test)):
            out[i] = np.bincount(arr[np.concatenate([tr, te])], minlength=num_classes)[:num_classes]
        return out

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat ``{"train_0": ..., "test_0": ...}`` int64 tensors, the shape safetensors stores."""
        out: dict[str, torch.Tensor] = {}
        for i, (tr, te) in enumerate(zip(self.train, self.test)):
            out[f"train_{i}"] = torch.from_numpy(tr.copy())
            out[f"test_{i}"] = torch.from_numpy(te.copy())
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> ClientSplit:
        """Inverse of :meth:`to_tensors`; rejects gaps or stray keys instead of guessing."""
        ids = [int(k.split("_", 1)[1]) for k in tensors if k.startswith(("train_", "test_")) and k.split("_", 1)[1].isdigit()]
        n = max(ids) + 1 if ids else 0
        if n > len(tensors):  # a client id beyond what the file holds: refuse before listing the gaps
            raise ConfigError(f"client split tensors are malformed: client {n - 1} named, {len(tensors)} tensors held")
        expected = {f"{kind}_{i}" for kind in ("train", "test") for i in range(n)}
        missing, stray = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        if missing or stray or n == 0:
            raise ConfigError(
                f"client split tensors are malformed (missing: {', '.join(missing[:5]) or '-'}; "
                f"unexpected: {', '.join(stray[:5]) or '-'}; clients found: {n})"
            )
        for key, t in tensors.items():
            if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex:
                raise ConfigError(f"client split tensor {key} must be 1-D integer, got {t.dtype} {tuple(t.shape)}")
        return cls(train=[tensors[f"train_{i}"].cpu().numpy() for i in range(n)], test=[tensors[f"test_{i}"].cpu().numpy() for i in range(n)])


def split_train_test(client_indices: Sequence[np.ndarray], train_fraction: float = DEFAULT_TRAIN_FRACTION, seed: int = 0) -> ClientSplit:
    """Per client: shuffle, first floor(train_fraction * n) are train, the rest test (3:1 by default)."""
    if not 0.0 < train_fraction < 1.0:
        raise ConfigError(f"train_fraction must be in (0, 1), got {train_fraction}")
    rng = np.random.default_rng(seed)
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for i, idx in enumerate(client_indices):
        idx = np.asarray(idx, dtype=np.int64)
        n = len(idx)
        n_train = int(math.floor(train_fraction * n + 1e-9))
        if n_train == 0 or n_train == n:
            raise PartitionError(
                f"client {i} has {n} samples: a {train_fraction:g} train split leaves {n_train} train / {n - n_train} test; give clients more samples"
            )
        perm = rng.permutation(idx)
        train.append(perm[:n_train])
        test.append(perm[n_train:])
    return ClientSplit(train=train, test=test)


#: above this many clients the partition is drawn as a heat map: a bubble per (client, class) is
#: unreadable there and took seconds to draw (3.6 s at 1,000 clients, 8 s at 10,000)
BUBBLE_CHART_MAX_CLIENTS = 100


def plot_partition(counts: np.ndarray, path: str | Path, class_names: Sequence[str] | None = None, title: str | None = None) -> None:
    """Bubble chart clients x classes, circle area ~ samples (as FedRE Figs. 7-8), written as PNG; a heat
    map of the same counts beyond :data:`BUBBLE_CHART_MAX_CLIENTS` clients.

    Uses the Agg canvas directly (no pyplot) so it works headless and leaves global state alone.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    counts = np.asarray(counts)
    if counts.ndim != 2:
        raise ValueError(f"counts must be (clients, classes), got shape {counts.shape}")
    num_clients, num_classes = counts.shape
    many = num_clients > BUBBLE_CHART_MAX_CLIENTS
    fig = Figure(figsize=(min(max(4.0, 0.35 * num_clients + 1.5), 12.0 if many else 30.0), min(max(3.0, 0.3 * num_classes + 1.2), 30.0)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if many:
        extent = (-0.5, num_clients - 0.5, -0.5, num_classes - 0.5)
        image = ax.imshow(counts.T, aspect="auto", origin="lower", interpolation="nearest", cmap="Reds", extent=extent)
        fig.colorbar(image, ax=ax, label="samples")
    else:
        client_ids, class_ids = np.nonzero(counts > 0)
        peak = float(counts.max()) if counts.size and counts.max() > 0 else 1.0
        ax.scatter(client_ids, class_ids, s=counts[client_ids, class_ids] / peak * 300.0, color="tab:red", alpha=0.6, edgecolors="none")
    ax.set_xlim(-0.7, num_clients - 0.3)
    ax.set_ylim(-0.7, num_classes - 0.3)
    step_x = max(1, math.ceil(num_clients / 25))
    ax.set_xticks(range(0, num_clients, step_x))
    step_y = max(1, math.ceil(num_classes / 25))
    ax.set_yticks(range(0, num_classes, step_y))
    if class_names is not None and len(class_names) == num_classes:
        ax.set_yticklabels([class_names[i] for i in range(0, num_classes, step_y)], fontsize=7)
    ax.set_xlabel("Client ID")
    ax.set_ylabel("Class")
    if title:
        ax.set_title(title)
    ax.grid(True, linestyle=":", linewidth=0.5, alpha=0.5)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=120)


@PARTITIONS.register("dominant")
def dominant_share_partition(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, balanced: bool = False, min_samples: int | None = None
) -> list[np.ndarray]:
    """FedFree's non-IID1 as privfl reads its Secs. 4.1 and 4.3 (which differ): client i holds a dominant class (group) i mod G
    for 80% of its samples and the next two for 10% each (8:1:1; ``balanced=True`` gives 6:2:2, the
    paper's non-IID2). Classes come in G = min(C, 10) groups (CIFAR-100: groups of 10 classes). Client
    sizes are equal, n = N/num_clients, drawn without replacement; the rotation balances class demand."""
    classes = np.unique(labels)
    n_groups = min(len(classes), 10)
    groups = np.array_split(classes, n_groups)
    shares = (0.6, 0.2, 0.2) if balanced else (0.8, 0.1, 0.1)
    pools = {g: list(rng.permutation(np.flatnonzero(np.isin(labels, groups[g])))) for g in range(n_groups)}
    per_client = len(labels) // num_clients
    parts = []
    for i in range(num_clients):
        take = []
        for offset, share in enumerate(shares):
            g = (i + offset) % n_groups
            want = int(round(share * per_client))
            got, pools[g] = pools[g][:want], pools[g][want:]
            take.extend(got)
        parts.append(np.array(take, dtype=np.int64))
    return _check_min(parts, _resolve_min(min_samples, len(labels), num_clients), "dominant", "use fewer clients or more data")
