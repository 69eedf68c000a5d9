"""Client models that alias one copy of a broadcast until they train (copy-on-write).

Why: in a FedAvg-style method every client holds the same broadcast model between rounds. Keeping a
copy per client costs one model per client (2.3 MB for cnn4: 23 GB at 10,000 clients) for values that
are all equal. Instead, a client model is *bound* to one :class:`SharedTensors` (its parameters and
buffers become views of the shared tensors), and it takes its own copy only when it is about to change
(:func:`own_tensors`, called by :meth:`LocalTrainer.fit <privfl.fl.trainer.LocalTrainer.fit>` and
:func:`privfl.fl.method.load_module_tensors`).

Torch has no read-only tensors, so a write that bypasses :func:`own_tensors` (a method editing a bound
model in place) would change every client's model at once. Each parameter made here shares the
version counter of its shared tensor, so any in-place write bumps the shared tensor's ``_version``;
:meth:`SharedTensors.check` compares it with the value at creation and turns such a write into a
one-line :class:`~privfl.errors.PrivflError` (the engine checks after every round, and every bind and
copy checks first), never a silently wrong number.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from privfl.errors import PrivflError

#: attribute a bound module carries: the SharedTensors it aliases
_BOUND = "_privfl_shared"


class SharedTensors:
    """One copy of a state dict that many client models alias; ``tensors`` must not be written."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors
        self._versions = {k: v._version for k, v in tensors.items()}

    def __deepcopy__(self, memo: dict) -> None:
        """A deep copy of a bound model owns copies of its tensors: it is bound to nothing."""
        return None

    def check(self) -> None:
        """Raise if any shared tensor was written in place since it was shared."""
        for key, value in self.tensors.items():
            if value._version != self._versions[key]:
                raise PrivflError(
                    f"the broadcast tensor {key!r} that several client models share was modified in place: a method changed a "
                    "client model without taking its own copy first (call privfl.fl.shared.own_tensors(model) before writing "
                    "to it, or set stateless_clients = False)"
                )


def bind_shared(module: nn.Module, shared: SharedTensors) -> None:
    """Make every parameter and buffer of ``module`` a view of ``shared`` (the keys of its state dict).

    ``load_state_dict(assign=True)`` wraps each shared tensor in a new parameter (same ``requires_grad``),
    which shares the tensor's storage and version counter; a missing key or a shape that differs is a
    one-line error."""
    shared.check()
    try:
        module.load_state_dict(shared.tensors, strict=True, assign=True)
    except RuntimeError as exc:
        raise PrivflError(f"cannot share a broadcast that does not match the model: {' '.join(str(exc).split())[:300]}") from None
    setattr(module, _BOUND, shared)


def own_tensors(module: nn.Module) -> None:
    """Give a bound ``module`` its own copy of every tensor (before training or loading into it); no-op otherwise.

    New parameter objects replace the shared views, so an optimizer must be made after this call."""
    shared: SharedTensors | None = getattr(module, _BOUND, None)
    if shared is None:
        return
    shared.check()
    module.load_state_dict({k: v.detach().clone() for k, v in module.state_dict().items()}, assign=True)
    setattr(module, _BOUND, None)


def check_bound(modules: Iterable[nn.Module]) -> None:
    """:meth:`SharedTensors.check` of every distinct shared state these modules alias (the engine, after each round)."""
    seen: set[int] = set()
    for module in modules:
        shared = getattr(module, _BOUND, None)
        if shared is not None and id(shared) not in seen:
            seen.add(id(shared))
            shared.check()


__all__ = ["SharedTensors", "bind_shared", "check_bound", "own_tensors"]
