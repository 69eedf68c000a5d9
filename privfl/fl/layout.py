"""The memory layout a client model computes in (``--memory-format``): channels-last on CPU by default.

Why: on a CPU, oneDNN's convolutions and PyTorch's max pooling are much faster on NHWC tensors than on
NCHW ones. Measured on this project's 2-core machine, one thread (``python -m experiments.bench.layout`` in
``make bench``, 2026-11-26): a training step of ``cnn4`` takes 0.81x the time at batch 10 and 0.74x at
batch 64, an evaluation forward of 512 images 0.47x (the cpu5 models: 0.74-0.84x and 0.33-0.79x; NCHW
max pooling alone is 10x slower than NHWC). The values are the same; the order of the floating-point sums
inside a convolution differs, so numbers differ from a contiguous run in the last bits (then, as
training is chaotic, in more), and each layout repeats itself exactly.

A model is converted for the duration of its local training (:meth:`LocalTrainer.fit
<privfl.fl.trainer.LocalTrainer.fit>`) and of its evaluation (:func:`privfl.engine.client_hits`)
and converted back afterwards: everywhere else (messages, capture, checkpoints, aggregation, attacks)
its tensors are contiguous as before. Converting is a copy of the 4-D weights (a few hundred kB for
``cnn4``), small beside one epoch. A model that aliases a shared broadcast (stateless clients) is bound
to it again afterwards, so it keeps no copy.

``auto`` (the default) computes channels-last on CPU when every submodule is one whose forward does not
depend on the layout: a class from ``torch``, ``torchvision`` or ``privfl``. A user's own module may
reshape an activation with ``.view``, which a channels-last tensor refuses, so a model containing one
stays contiguous unless ``--memory-format channels_last`` is asked for. On CUDA ``auto`` stays contiguous
(channels-last pays off there with mixed precision, which privfl does not use; not measured).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from privfl.config import MEMORY_FORMATS
from privfl.fl.shared import _BOUND, bind_shared

#: module packages whose forwards are layout-agnostic (auto converts models made only of these)
_KNOWN_PACKAGES = ("torch.", "torchvision.", "privfl.")


def _has_4d(module: nn.Module) -> bool:
    return any(t.dim() == 4 for t in module.parameters()) or any(t.dim() == 4 for t in module.buffers())


def wants_channels_last(module: nn.Module, memory_format: str) -> bool:
    """Whether ``module`` computes in channels-last under ``--memory-format`` (see the module docstring)."""
    if memory_format == "contiguous" or not _has_4d(module):
        return False
    if memory_format == "channels_last":
        return True
    first = next(iter(module.parameters()), None)
    if first is not None and first.device.type != "cpu":
        return False
    return all(type(m).__module__.startswith(_KNOWN_PACKAGES) for m in module.modules())


@contextmanager
def compute_layout(module: nn.Module, memory_format: str) -> Iterator[None]:
    """Within the block, ``module``'s 4-D parameters and buffers are channels-last (when
    :func:`wants_channels_last`); afterwards contiguous again, or bound again to the broadcast it aliased.

    Parameter objects stay the same (their data is replaced), so an optimizer or a parameter list made
    before the block remains valid; gradients are converted with them."""
    if not wants_channels_last(module, memory_format):
        yield
        return
    shared = getattr(module, _BOUND, None)
    module.to(memory_format=torch.channels_last)
    try:
        yield
    finally:
        if shared is not None:
            bind_shared(module, shared)  # views of the one shared copy again (its tensors were only read)
        else:
            module.to(memory_format=torch.contiguous_format)


__all__ = ["MEMORY_FORMATS", "compute_layout", "wants_channels_last"]
