"""Finding a named submodule of any client model and the spatial map it produces.

Grad-CAM needs a layer whose output is a (B, C, h, w) map. Users name modules the way
``named_modules()`` does (``features``, ``features.3``, or a method's own parts such as ``learngene``).
Many named modules end in a vector (a SplitModel's ``features`` ends with Flatten; an encoder may end
with its mean/variance heads), so a name whose own output is not spatial stands for the *last*
module inside it that outputs a spatial map during the forward pass, the usual "last conv layer of
the encoder" choice. The lookup is done by running one real batch with hooks on every module,
so it follows what the model actually computes and needs no knowledge of any method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from privfl.errors import ConfigError

MAX_LISTED = 40


@dataclass(frozen=True)
class Traced:
    """A module's output during one forward: its shape (None unless a tensor) and when it finished."""

    shape: tuple[int, ...] | None
    order: int

    @property
    def spatial(self) -> bool:
        return self.shape is not None and len(self.shape) == 4 and self.shape[2] * self.shape[3] >= 1


def trace_outputs(model: nn.Module, forward: Callable[[torch.Tensor], object], x: torch.Tensor) -> dict[str, Traced]:
    """Output shape of every named submodule that runs in ``forward(x)`` (the last call wins)."""
    seen: dict[str, Traced] = {}
    finished = [0]  # hooks fire when a module returns: children before their container
    hooks = []

    def hook_for(name: str):
        def hook(_module, _inputs, output) -> None:
            finished[0] += 1
            seen[name] = Traced(tuple(output.shape) if isinstance(output, torch.Tensor) else None, finished[0])

        return hook

    for name, module in model.named_modules():
        if name:
            hooks.append(module.register_forward_hook(hook_for(name)))
    try:
        with torch.no_grad():
            forward(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def spatial_candidates(model: nn.Module, traced: dict[str, Traced]) -> list[str]:
    """Names that resolve to a spatial map: modules with one, and the containers around them."""
    spatial = [n for n, t in traced.items() if t.spatial]
    out = []
    for name, _ in model.named_modules():
        if name and any(s == name or s.startswith(name + ".") for s in spatial):
            out.append(name)
    return out


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_LISTED])
    return shown + (f", ... ({len(names) - MAX_LISTED} more)" if len(names) > MAX_LISTED else "") if names else "(none)"


def resolve_spatial_module(model: nn.Module, traced: dict[str, Traced], name: str, owner: str) -> tuple[str, nn.Module]:
    """(resolved dotted name, module) for ``name``: itself if its output is a map, else its last
    spatial descendant in execution order. ``owner`` names the model in errors (``client3 (cnn4)``)."""
    modules = dict(model.named_modules())
    candidates = spatial_candidates(model, traced)
    if name not in modules or not name:
        raise ConfigError(f"unknown module {name!r} in {owner}'s model; modules with spatial outputs: {_listing(candidates)}")
    if name in traced and traced[name].spatial:
        return name, modules[name]
    inside = [(t.order, n) for n, t in traced.items() if t.spatial and n.startswith(name + ".")]
    if not inside:
        if name not in traced:
            why = "does not run when the class scores are computed"
        else:
            shape = traced[name].shape
            why = f"outputs {'a non-tensor' if shape is None else tuple(shape)} and contains no module with a (B, C, h, w) output"
        raise ConfigError(f"module {name!r} of {owner} {why}; modules with spatial outputs: {_listing(candidates)}")
    resolved = max(inside)[1]
    return resolved, modules[resolved]


__all__ = ["Traced", "resolve_spatial_module", "spatial_candidates", "trace_outputs"]
