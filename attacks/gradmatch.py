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
    norms of the factored ones (a pytree, so ``vmap`` can batch it over targets)."""

    dense: dict[str, torch.Tensor]
    dense_sq: torch.Tensor  # sum of the dense tensors' squares
    gram: dict[str, torch.Tensor]
    gram_sq: dict[str, torch.Tensor]

    @staticmethod
    def stack(many: Sequence[Observed]) -> Observed:
        """One :class:`Observed` whose tensors have a leading dimension over ``many`` (for ``vmap``)."""
        first = many[0]
        return Observed(
            {n: torch.stack([o.dense[n] for o in many]) for n in first.dense},
            torch.stack([o.dense_sq for o in many]),
            {n: torch.stack([o.gram[n] for o in many]) for n in first.gram},
            {n: torch.stack([o.gram_sq[n] for o in many]) for n in first.gram_sq},
        )

    def rows(self, index: torch.Tensor) -> Observed:
        """The stacked problems at ``index``."""
        return Observed(
            {n: v[index] for n, v in self.dense.items()},
            self.dense_sq[index],
            {n: v[index] for n, v in self.gram.items()},
            {n: v[index] for n, v in self.gram_sq.items()},
        )


def observe(target: Mapping[str, torch.Tensor], names: Sequence[str], taps: Sequence[LinearTap] = ()) -> Observed:
    """``target`` split into what :func:`distance` matches materialised and what it matches factored."""
    factored_names = {t.weight for t in taps}
    dense = {n: target[n] for n in names if n not in factored_names}
    gram = {n: target[n].to(GRAM_DTYPE) for n in names if n in factored_names}
    like = target[names[0]]
    return Observed(dense, _sum((t.pow(2).sum() for t in dense.values()), like), gram, {n: g.pow(2).sum() for n, g in gram.items()})


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
    if not observed.gram:
        if cosine:
            inner = _sum(((dense[n] * t).sum() for n, t in observed.dense.items()), observed.dense_sq)
            norm = _sum((dense[n].pow(2).sum() for n in observed.dense), observed.dense_sq).sqrt()
            return 1 - inner / (norm * observed.dense_sq.sqrt() + 1e-12)
        return _sum(((dense[n] - t).pow(2).sum() for n, t in observed.dense.items()), observed.dense_sq)
    out_dtype = cast(Factored, grads[next(iter(observed.gram))]).grad_out.dtype
    zero = torch.zeros((), dtype=GRAM_DTYPE, device=observed.dense_sq.device)
    sq: list[torch.Tensor] = []  # factored: ||A^T X||^2, in float64
    dot: list[torch.Tensor] = []  # and <A^T X, G>
    for n, g in observed.gram.items():
        f = cast(Factored, grads[n])
        a, x = f.grad_out.to(GRAM_DTYPE), f.inputs.to(GRAM_DTYPE)
        sq.append(((a @ a.T) * (x @ x.T)).sum())
        dot.append((a * (x @ g.T)).sum())
    if cosine:
        total_dot = _sum(((dense[n] * t).sum().to(GRAM_DTYPE) for n, t in observed.dense.items()), zero) + _sum(dot, zero)
        total_sq = _sum((dense[n].pow(2).sum().to(GRAM_DTYPE) for n in observed.dense), zero) + _sum(sq, zero)
        target_sq = observed.dense_sq.to(GRAM_DTYPE) + _sum(observed.gram_sq.values(), zero)
        return (1 - total_dot / (total_sq.sqrt() * target_sq.sqrt() + 1e-12)).to(out_dtype)
    dense_part = _sum(((dense[n] - t).pow(2).sum() for n, t in observed.dense.items()), zero.to(out_dtype))
    gram_part = _sum((s - 2 * d + observed.gram_sq[n] for s, d, n in zip(sq, dot, observed.gram)), zero)
    return (dense_part.to(GRAM_DTYPE) + gram_part).to(out_dtype)


__all__ = ["GRAM_DTYPE", "Factored", "LinearTap", "Observed", "distance", "factored", "find_linear_taps", "observe", "tapping", "zero_probes"]
