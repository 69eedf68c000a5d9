"""Representation entanglement (RE): the per-sample weights of FedRE's six mechanisms.

FedRE [001] Eq. (6): ``r~ = sum_i w_i r_i`` and ``y~ = sum_i w_i y_i`` over one client's mapped
representations r_i (n, d) and one-hot labels y_i (n, C), with the weights of App. A:

- ``rsr`` Random Select Representation, Eq. (7): w_i = 1 for one random sample, else 0.
- ``var`` Vanilla Average Representation, Eq. (8): w_i = 1/n.
- ``rar`` Random Average Representation, Eq. (9): w_i = u_i / sum_j u_j.
- ``rsp`` Random Select Prototype, Eq. (10): one random present class c, w_i = 1/n_c on its samples.
- ``vap`` Vanilla Average Prototype, Eq. (11): w_i = 1/(|C_k| n_c), |C_k| = classes on the client.
- ``rap`` Random Average Prototype, Eq. (12) as corrected in [001]: w_i = u_c / (n_c sum_j u_j).
  This equals the weighted prototype sum of [000] Eq. (2). FedRE's default.

Draws ``u`` come from ``uniform`` U(0,1) (the papers' default), ``gaussian`` N(0,1) or ``laplace``
L(0,1) ([001] Table 7). The papers do not say how negative Gaussian/Laplace draws were normalised
(spec decision 14); we take ``negatives="abs"`` (fold: |u|, then divide by the sum) by default, so
weights stay in [0,1] and sum to 1 as Eq. (6) requires; ``negatives="softmax"`` is the alternative.
"""

from __future__ import annotations

import torch

from privfl.errors import UnknownNameError

MECHANISMS = ("rsr", "var", "rar", "rsp", "vap", "rap")
DISTRIBUTIONS = ("uniform", "gaussian", "laplace")
NEGATIVES = ("abs", "softmax")


def draw(n: int, distribution: str, generator: torch.Generator) -> torch.Tensor:
    """n raw draws from the chosen distribution (float64 for exact sums)."""
    if distribution == "uniform":
        return torch.rand(n, generator=generator, dtype=torch.float64)
    if distribution == "gaussian":
        return torch.randn(n, generator=generator, dtype=torch.float64)
    if distribution == "laplace":
        # inverse CDF of L(0, 1) from uniform draws, so the torch.Generator controls it
        u = torch.rand(n, generator=generator, dtype=torch.float64) - 0.5
        return -torch.sign(u) * torch.log1p(-2 * u.abs())
    raise UnknownNameError("weight distribution", distribution, DISTRIBUTIONS)


def normalise(u: torch.Tensor, negatives: str = "abs") -> torch.Tensor:
    if negatives == "abs":
        u = u.abs()
        total = u.sum()
        return u / total if total > 0 else torch.full_like(u, 1.0 / len(u))
    if negatives == "softmax":
        return torch.softmax(u, dim=0)
    raise UnknownNameError("negative-weight rule", negatives, NEGATIVES)


def random_draws(mechanism: str, labels: torch.Tensor, num_classes: int, distribution: str, generator: torch.Generator) -> torch.Tensor:
    """The random part of a mechanism, drawn once (fixed sampling) or every round (re-sampling).

    Per sample for rar, per class (all C, only present ones used) for rap, a uniform draw that picks
    the sample/class for rsr/rsp; empty for the deterministic var/vap.
    """
    if mechanism == "rar":
        return draw(len(labels), distribution, generator)
    if mechanism == "rap":
        return draw(num_classes, distribution, generator)
    if mechanism in ("rsr", "rsp"):
        return torch.rand(1, generator=generator, dtype=torch.float64)
    if mechanism in ("var", "vap"):
        return torch.empty(0, dtype=torch.float64)
    raise UnknownNameError("RE mechanism", mechanism, MECHANISMS)


def sample_weights(mechanism: str, labels: torch.Tensor, num_classes: int, draws: torch.Tensor, negatives: str = "abs") -> torch.Tensor:
    """Per-sample weights w (n,), summing to 1, for ``labels`` (n,) given the mechanism's draws."""
    labels = labels.cpu()
    n = len(labels)
    counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
    present = torch.nonzero(counts, as_tuple=False).flatten()
    if mechanism == "var":
        return torch.full((n,), 1.0 / n, dtype=torch.float64)
    if mechanism == "rar":
        return normalise(draws, negatives)
    if mechanism == "rsr":
        w = torch.zeros(n, dtype=torch.float64)
        w[min(int(draws[0] * n), n - 1)] = 1.0
        return w
    if mechanism == "rsp":
        chosen = present[min(int(draws[0] * len(present)), len(present) - 1)]
        return (labels == chosen).to(torch.float64) / counts[chosen]
    if mechanism == "vap":
        return 1.0 / (len(present) * counts[labels])
    if mechanism == "rap":
        class_w = torch.zeros(num_classes, dtype=torch.float64)
        class_w[present] = normalise(draws[present], negatives)
        return class_w[labels] / counts[labels]
    raise UnknownNameError("RE mechanism", mechanism, MECHANISMS)


def entangle(reps: torch.Tensor, labels: torch.Tensor, num_classes: int, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r~, y~) = (R^T w, Y^T w)``: one (d,) representation and its dense (C,) entangled label.

    Cost O(n(d + C)), as [001] notes.
    """
    w = weights.to(device=reps.device, dtype=reps.dtype)
    rep = reps.T @ w  # (d,)
    label = torch.zeros(num_classes, dtype=reps.dtype, device=reps.device)
    label.index_add_(0, labels, w)  # (C,) = Y^T w
    return rep, label


def soft_label_loss(logits: torch.Tensor, soft_labels: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """CE against entangled labels, [001] Eq. (3). Equal to [000] Eq. (3)'s weighted hard-label CEs
    when each label sums to 1 (CE is linear in the target). ``sum`` over the batch matches the
    official code (spec decision 9); ``mean`` is the alternative."""
    per_sample = -(soft_labels * torch.log_softmax(logits, dim=1)).sum(dim=1)
    if reduction == "sum":
        return per_sample.sum()
    if reduction == "mean":
        return per_sample.mean()
    raise UnknownNameError("loss reduction", reduction, ["sum", "mean"])
