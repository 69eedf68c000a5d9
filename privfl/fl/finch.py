"""FINCH: parameter-free clustering by first-neighbour relations (Sarfraz, Sharma, Stiefelhagen, CVPR 2019).

Each point is linked to its first (nearest) neighbour; the FINCH adjacency (paper Eq. 1)

    A(i, j) = 1  if  j = kappa_i  or  i = kappa_j  or  kappa_i = kappa_j

joins two points when one is the other's first neighbour or both share one, and the connected
components of A are the first partition. The clusters' means (of the original points) are then
clustered the same way, recursively, giving a hierarchy of ever coarser partitions; it stops when a
step would leave a single cluster (that step is not kept) or merges nothing. Every step at least halves
the number of clusters, because every cluster joins its first neighbour's component.

Written here with numpy/scipy (no FINCH package is installed); it follows the reference algorithm as
FPL calls it (RethinkFL ``utils/finch.py`` with ``ensure_early_exit=False`` and no requested number of
clusters): exact first neighbours, ties to the lowest index, cosine distance 1 - cos (a zero vector is
at distance 1 from everything, as scikit-learn's ``pairwise_distances`` has it) or Euclidean distance.
The optional early exit, the approximate neighbours for > 70,000 points and the ``req_clust`` refinement
of the reference are not implemented (FPL uses none of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

DISTANCES = ("cosine", "euclidean")


@dataclass(frozen=True)
class FinchResult:
    """``partitions[:, j]``: the cluster of each point in step j (0 = the finest); ``num_clusters[j]``."""

    partitions: np.ndarray  # (n, P) int
    num_clusters: list[int]

    def labels(self, step: int = -1) -> np.ndarray:
        """The labels of partition ``step`` (Python indexing; clamped to the partitions there are)."""
        count = self.partitions.shape[1]
        step = max(-count, min(step, count - 1))
        return self.partitions[:, step]


def pairwise_distances(x: np.ndarray, distance: str = "cosine") -> np.ndarray:
    """(n, n) distances between the rows of ``x``."""
    x = np.asarray(x, dtype=np.float64)
    if distance == "cosine":
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        unit = x / np.where(norms == 0, 1.0, norms)
        return np.clip(1.0 - unit @ unit.T, 0.0, 2.0)
    if distance == "euclidean":
        sq = (x * x).sum(1)
        return np.sqrt(np.maximum(sq[:, None] - 2 * x @ x.T + sq[None, :], 0.0))
    raise ValueError(f"FINCH distance must be one of {DISTANCES}, got {distance!r}")


def first_neighbours(x: np.ndarray, distance: str = "cosine") -> np.ndarray:
    """Index of each row's nearest other row (itself when it is alone)."""
    dist = pairwise_distances(x, distance)
    np.fill_diagonal(dist, np.inf)
    if len(x) == 1:
        return np.zeros(1, dtype=np.int64)
    return np.argmin(dist, axis=1)


def first_neighbour_partition(x: np.ndarray, distance: str = "cosine") -> tuple[np.ndarray, int]:
    """Labels (0..k-1) of the connected components of the FINCH adjacency of the rows of ``x``, and k."""
    n = len(x)
    kappa = first_neighbours(x, distance)
    # the components of A are those of the undirected first-neighbour graph i - kappa_i (a shared first
    # neighbour joins i and j through it), so the sparse graph of those n edges suffices
    graph = coo_matrix((np.ones(n), (np.arange(n), kappa)), shape=(n, n))
    k, labels = connected_components(graph, directed=True, connection="weak")
    return labels.astype(np.int64), int(k)


def cluster_means(x: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(k, d) mean of the rows of each cluster 0..k-1."""
    k = int(labels.max()) + 1
    sums = np.zeros((k, x.shape[1]), dtype=np.float64)
    np.add.at(sums, labels, x)
    return sums / np.bincount(labels, minlength=k)[:, None]


def finch(x: np.ndarray, distance: str = "cosine") -> FinchResult:
    """The FINCH hierarchy of the rows of ``x`` (n >= 1)."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or len(x) == 0:
        raise ValueError(f"FINCH clusters the rows of a non-empty (n, d) array, got shape {x.shape}")
    labels, k = first_neighbour_partition(x, distance)
    partitions, counts = [labels], [k]
    while k > 1:
        merged, k_next = first_neighbour_partition(cluster_means(x, labels), distance)
        if k_next == 1 or k_next >= k:  # a single cluster, or nothing merged: stop without that step
            break
        labels, k = merged[labels], k_next
        partitions.append(labels)
        counts.append(k)
    return FinchResult(np.stack(partitions, axis=1), counts)


__all__ = ["DISTANCES", "FinchResult", "cluster_means", "finch", "first_neighbour_partition", "first_neighbours", "pairwise_distances"]
