"""Gradient matching with linear layers' weight gradients left factored.

Over ``N`` rows (the batch times any leading dimensions) a ``nn.Linear`` layer's weight gradient is
``A^T X``: ``A`` (N x out) is the loss's gradient at the layer's output, ``X`` (N x in) its input. A
gradient-leakage objective only needs that matrix's distance to, or inner product with, the observed
``G``, and both follow from ``A`` and ``X`` alone::

    <A^T X, G>       = sum(A * (X G^T))
    ||A^T X||^2      = sum((A A^T) * (X X^T))
    ||A^T X - G||^2  = ||A^T X||^2 - 2 <A^T X, G> + ||G||^2

For a small reconstructed batch and a wide layer (DLG on ``cnn4``: N = 1, a 512 x 1024 layer holding
90 % of the parameters) this skips building the out x in gradient, its difference to ``G``, their
squares and the second-order pass back through all of them: the matrix work becomes one product
with ``G``. The expansion subtracts large terms to get a small one, so it is evaluated in float64
(``G`` is kept in float64 once per target): each term is then exact to far below the float32
rounding of the materialised difference it replaces.

The observed ``G`` itself is usually of low rank: a victim's one-step gradient on ``B`` samples is a sum
of ``B`` outer products (rank 1 for DLG's single image). Where a rank-``r`` factorisation ``G ~ U V^T``
leaves a residual under ``rtol`` of ``G``'s norm (:func:`low_rank`; ``rtol`` = gradient leakage's
``low_rank_rtol``, 1e-6 by default: the float32 rounding of a rank-1 gradient leaves about 3e-8), the inner
product is taken through the factors, ``<A^T X, U V^T> = sum((A U) * (X V))``, and ``G`` (out x in, in
float64: 4 MiB per target for ``cnn4``, read twice per evaluation) is not touched while optimising. The
objective then differs from the one against ``G`` by at most ``2 ||A^T X|| rtol ||G||`` (Cauchy-Schwarz),
while ``||G||^2`` still comes from ``G``. A gradient with noise added (a DP defense) has no such
factorisation and is matched through ``G`` as before.

A layer is factored only where that is exact: a plain ``nn.Linear`` (its own ``forward``), a weight
that no other module uses, a module the forward pass calls at least once (as often in every pass),
one step of the victim (the unrolled multi-step update of ``local_steps > 1`` is not a single
``A^T X``); and where it pays: fewer rows than the layer's narrower side, past which the Gram products
cost more than the matrix, and at least ``min_weights`` weights (gradient leakage's
``factor_min_weights``, chosen from measurements in docs/attacks.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple, cast

import torch
from torch import nn

#: the dtype the factored terms are summed in (see the module docstring)
GRAM_DTYPE = torch.float64


class Factored(NamedTuple):
    """A linear layer's weight gradient ``grad_out^T inputs``, not multiplied out."""

    grad_out: torch.Tensor  # N x out (any leading dims)
    inputs: torch.Tensor  # N x in (same leading dims)


@dataclass(frozen=True)
class LinearTap:
    """A ``nn.Linear`` whose weight gradient is matched in factored form."""

    path: str  # the module's path in the model
    weight: str  # its weight's parameter name
    out_shapes: tuple[tuple[int, ...], ...]  # the output's shape at each call of one forward pass


def _plain_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def find_linear_taps(model: nn.Module, names: Sequence[str], example: torch.Tensor, local_steps: int = 1, min_weights: int = 0) -> list[LinearTap]:
    """The linear layers of ``model`` with at least ``min_weights`` weights (among ``names``) that can be
    matched factored, found by one forward pass on ``example`` (the reconstructed batch's shape) that
    records each call's shape."""
    if local_steps != 1:
        return []
    holders: dict[int, set[int]] = {}  # parameter id -> the distinct modules holding it
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(id(p), set()).add(id(module))
    wanted = set(names)
    candidates = {
        path: m
        for path, m in model.named_modules()
        if _plain_linear(m)
        and f"{path}.weight" in wanted
        and cast(nn.Linear, m).weight.numel() >= min_weights
        and len(holders[id(cast(nn.Linear, m).weight)]) == 1
    }
    if not candidates:  # nothing to count: spare the forward pass (DLG's LeNet, below factor_min_weights)
        return []
    shapes: dict[str, list[tuple[int, ...]]] = {path: [] for path in candidates}
    hooks = [m.register_forward_hook(lambda _m, _i, out, path=path: shapes[path].append(tuple(out.shape))) for path, m in candidates.items()]
    try:
        with torch.no_grad():
            model(example)
    finally:
        for h in hooks:
            h.remove()
    taps = []
    for path, m in candidates.items():
        lin = cast(nn.Linear, m)
        rows = sum(math.prod(s[:-1]) for s in shapes[path])
        if shapes[path] and rows < min(lin.in_features, lin.out_features):
            taps.append(LinearTap(path, f"{path}.weight", tuple(shapes[path])))
    return taps


def zero_probes(taps: Sequence[LinearTap], like: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """One zero tensor per tapped call, added to the layer's output: the loss's gradient at a probe is the
    gradient at that output (``A``), whatever in-place operation follows the layer."""
    return {t.path: [torch.zeros(s, dtype=like.dtype, device=like.device) for s in t.out_shapes] for t in taps}


@contextmanager
def tapping(model: nn.Module, taps: Sequence[LinearTap], probes: Mapping[str, Sequence[torch.Tensor]]) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Within the block, each tapped layer's output gets its call's probe added and its input is recorded
    (yielded: path -> inputs in call order)."""
    inputs: dict[str, list[torch.Tensor]] = {t.path: [] for t in taps}

    def hook(_module: nn.Module, args: tuple, out: torch.Tensor, *, path: str) -> torch.Tensor:
        calls = inputs[path]
        if len(calls) == len(probes[path]):
            raise RuntimeError(f"layer {path!r} ran more often than when its calls were counted; attack with factor_linear=False")
        calls.append(args[0])
        return out + probes[path][len(calls) - 1]

    handles = [model.get_submodule(t.path).register_forward_hook(functools.partial(hook, path=t.path)) for t in taps]
    try:
        yield inputs
    finally:
        for h in handles:
            h.remove()


def factored(
    taps: Sequence[LinearTap], probe_grads: Mapping[str, Sequence[torch.Tensor]], inputs: Mapping[str, Sequence[torch.Tensor]]
) -> dict[str, Factored]:
    """Each tapped weight's gradient as ``Factored`` (all calls' rows stacked)."""
    out = {}
    for t in taps:
        a = torch.cat([g.reshape(-1, g.shape[-1]) for g in probe_grads[t.path]])
        x = torch.cat([v.reshape(-1, v.shape[-1]) for v in inputs[t.path]])
        out[t.weight] = Factored(a, x)
    return out


class Observed(NamedTuple):
    """The observed gradient, prepared once: the tensors matched as they are, float64 copies and squared
    norms of the factored ones, and low-rank factors of those that have them (a pytree, so ``vmap`` can
    batch it over targets). :func:`distance` uses a weight's factors where ``low_u`` holds them, else ``gram``."""

    dense: dict[str, torch.Tensor]
    dense_sq: torch.Tensor  # sum of the dense tensors' squares
    gram: dict[str, torch.Tensor]
    gram_sq: dict[str, torch.Tensor]
    low_u: dict[str, torch.Tensor]  # out x r: G ~ low_u @ low_v.T (float64)
    low_v: dict[str, torch.Tensor]  # in x r

    @staticmethod
    def stack(many: Sequence[Observed]) -> Observed:
        """One :class:`Observed` whose tensors have a leading dimension over ``many`` (for ``vmap``). A
        weight is matched through factors only where every problem has them (padded with zero columns to
        the largest rank), otherwise through every problem's ``G``; the other form is dropped."""
        first = many[0]
        low = [n for n in first.gram if all(n in o.low_u for o in many)]
        ranks = {n: max(o.low_u[n].shape[-1] for o in many) for n in low}

        def padded(t: torch.Tensor, r: int) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, r - t.shape[-1]))

        return Observed(
            {n: torch.stack([o.dense[n] for o in many]) for n in first.dense},
            torch.stack([o.dense_sq for o in many]),
            {n: torch.stack([o.gram[n] for o in many]) for n in first.gram if n not in low},
            {n: torch.stack([o.gram_sq[n] for o in many]) for n in first.gram_sq},
            {n: torch.stack([padded(o.low_u[n], ranks[n]) for o in many]) for n in low},
            {n: torch.stack([padded(o.low_v[n], ranks[n]) for o in many]) for n in low},
        )

    def rows(self, index: torch.Tensor) -> Observed:
        """The stacked problems at ``index``."""

        def pick(part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {n: v[index] for n, v in part.items()}

        return Observed(pick(self.dense), self.dense_sq[index], pick(self.gram), pick(self.gram_sq), pick(self.low_u), pick(self.low_v))


#: the ranks :func:`low_rank` tries, doubling, up to an eighth of the layer's narrower side
FIRST_RANK = 8


def low_rank(g: torch.Tensor, rtol: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(U, V)`` with ``||g - U V^T||_F <= rtol ||g||_F`` and as few columns as that allows, or None when
    no rank up to an eighth of ``g``'s narrower side does it (past that the factors save little), ``g``
    is not finite, or ``rtol`` is 0. A randomised range finder (Halko, Martinsson and Tropp, SIAM Review
    2011) with a fixed sketch, so the same ``g`` gives the same factors: ``Q`` spans ``g``'s range from
    ``g`` times a Gaussian ``in x k`` matrix, ``k`` doubling from 8 until ``g - Q Q^T g`` is small enough;
    an SVD of the small ``Q^T g`` then keeps the fewest columns whose dropped part still fits."""
    if rtol <= 0 or g.ndim != 2:
        return None
    norm = torch.linalg.matrix_norm(g)
    if not bool(torch.isfinite(norm)):
        return None
    budget = float(rtol * norm) ** 2
    limit = min(g.shape) // 8
    k = min(FIRST_RANK, limit)
    sketch_gen = torch.Generator().manual_seed(0)
    while k >= 1:
        omega = torch.randn(g.shape[1], k, generator=sketch_gen, dtype=g.dtype).to(g.device)
        q = torch.linalg.qr(g @ omega).Q
        b = q.T @ g  # k x in
        residual = float(torch.linalg.matrix_norm(g - q @ b)) ** 2
        if residual <= budget:
            ub, sv, vh = torch.linalg.svd(b, full_matrices=False)
            dropped = sv.pow(2).flip(0).cumsum(0).flip(0)  # dropped[i]: the energy of columns i, i+1, ...
            keep = max(1, int((residual + dropped > budget).sum()))  # the fewest columns whose tail still fits
            return (q @ ub[:, :keep]) * sv[:keep], vh[:keep].T.contiguous()
        if k == limit:
            return None
        k = min(2 * k, limit)
    return None


def observe(target: Mapping[str, torch.Tensor], names: Sequence[str], taps: Sequence[LinearTap] = (), low_rank_rtol: float = 0.0) -> Observed:
    """``target`` split into what :func:`distance` matches materialised and what it matches factored;
    with ``low_rank_rtol`` > 0 the factored weights' :func:`low_rank` factors where they have them."""
    factored_names = {t.weight for t in taps}
    dense = {n: target[n] for n in names if n not in factored_names}
    gram = {n: target[n].to(GRAM_DTYPE) for n in names if n in factored_names}
    like = target[names[0]]
    lows = {n: low_rank(g, low_rank_rtol) for n, g in gram.items()}
    factors = {n: f for n, f in lows.items() if f is not None}
    return Observed(
        dense,
        _sum((t.pow(2).sum() for t in dense.values()), like),
        gram,
        {n: g.pow(2).sum() for n, g in gram.items()},
        {n: u for n, (u, _) in factors.items()},
        {n: v for n, (_, v) in factors.items()},
    )


def _sum(terms: Iterable[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``0 + t1 + t2 + ...`` in order (the rounding of the objective before factoring), or a zero."""
    total = None
    for t in terms:
        total = t if total is None else total + t
    return torch.zeros((), dtype=like.dtype, device=like.device) if total is None else total


def distance(grads: Mapping[str, torch.Tensor | Factored], observed: Observed, cosine: bool) -> torch.Tensor:
    """DLG's squared L2 distance, or Inverting Gradients' ``1 - cosine``, between the dummy gradient
    (``grads``, some entries :class:`Factored`) and the observed one, in the dummy's dtype. Without
    factored entries this is the materialised objective, operation for operation."""
    dense = {n: cast(torch.Tensor, grads[n]) for n in observed.dense}
    if not observed.gram_sq:
        if cosine:
            inner = _sum(((dense[n] * t).sum() for n, t in observed.dense.items()), observed.dense_sq)
            norm = _sum((dense[n].pow(2).sum() for n in observed.dense), observed.dense_sq).sqrt()
            return 1 - inner / (norm * observed.dense_sq.sqrt() + 1e-12)
        return _sum(((dense[n] - t).pow(2).sum() for n, t in observed.dense.items()), observed.dense_sq)
    out_dtype = cast(Factored, grads[next(iter(observed.gram_sq))]).grad_out.dtype
    zero = torch.zeros((), dtype=GRAM_DTYPE, device=observed.dense_sq.device)
    sq: list[torch.Tensor] = []  # factored: ||A^T X||^2, in float64
    dot: list[torch.Tensor] = []  # and <A^T X, G>
    for n in observed.gram_sq:
        f = cast(Factored, grads[n])
        a, x = f.grad_out.to(GRAM_DTYPE), f.inputs.to(GRAM_DTYPE)
        sq.append(((a @ a.T) * (x @ x.T)).sum())
        if n in observed.low_u:
            dot.append(((a @ observed.low_u[n]) * (x @ observed.low_v[n])).sum())
        else:
            dot.append((a * (x @ observed.gram[n].T)).sum())
    if cosine:
        total_dot = _sum(((dense[n] * t).sum().to(GRAM_DTYPE) for n, t in observed.dense.items()), zero) + _sum(dot, zero)
        total_sq = _sum((dense[n].pow(2).sum().to(GRAM_DTYPE) for n in observed.dense), zero) + _sum(sq, zero)
        target_sq = observed.dense_sq.to(GRAM_DTYPE) + _sum(observed.gram_sq.values(), zero)
        return (1 - total_dot / (total_sq.sqrt() * target_sq.sqrt() + 1e-12)).to(out_dtype)
    dense_part = _sum(((dense[n] - t).pow(2).sum() for n, t in observed.dense.items()), zero.to(out_dtype))
    gram_part = _sum((s - 2 * d + observed.gram_sq[n] for s, d, n in zip(sq, dot, observed.gram_sq)), zero)
    return (dense_part.to(GRAM_DTYPE) + gram_part).to(out_dtype)


__all__ = [
    "FIRST_RANK",
    "GRAM_DTYPE",
    "Factored",
    "LinearTap",
    "Observed",
    "distance",
    "factored",
    "find_linear_taps",
    "low_rank",
    "observe",
    "tapping",
    "zero_probes",
]
