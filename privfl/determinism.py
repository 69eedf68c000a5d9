"""Bit-reproducible arithmetic on a GPU (``--deterministic``).

On a CPU privfl's runs repeat to the bit with one ``--seed``. On a CUDA GPU they do not by default: cuDNN
picks its convolution algorithms per call, cuBLAS may split reductions differently, matmuls run in TF32,
and some backward kernels add with atomics. Measured on an H200 (docs/scale.md "On a GPU"), two runs of
the FedRE paper configuration with one seed differed from round 0 on. ``--deterministic`` asks torch for
its deterministic kernels (``torch.use_deterministic_algorithms``), turns cuDNN's autotuner and TF32 off,
computes attention with its plain (math) kernel instead of the fused ones, and gives cuBLAS the fixed
workspace its reproducibility needs (``CUBLAS_WORKSPACE_CONFIG``), at some cost in speed.

Two decisions: an operation that has no deterministic CUDA kernel warns (torch names it, once per process)
instead of failing the run (``warn_only``), since it may be a model's only way to train; and the settings
hold while a run trains and are restored afterwards, so that ``privfl.train`` called from a user's
process leaves torch as it found it. cuBLAS reads its workspace setting when this process first uses it,
so where CUDA was already used without the variable the run is refused before anything is created.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from privfl.errors import ConfigError

#: the workspace setting NVIDIA documents for reproducible cuBLAS results (":16:8" is the other one)
CUBLAS_WORKSPACE = ":4096:8"
_REPRODUCIBLE_WORKSPACES = (":4096:8", ":16:8")


def prepare_cublas(device: torch.device) -> None:
    """Set ``CUBLAS_WORKSPACE_CONFIG`` for a deterministic run on ``device`` before CUDA is used, or refuse
    (a one-line :class:`ConfigError`) where this process has used CUDA already without it."""
    if device.type != "cuda" or os.environ.get("CUBLAS_WORKSPACE_CONFIG") in _REPRODUCIBLE_WORKSPACES:
        return
    if torch.cuda.is_initialized():
        raise ConfigError(
            f"--deterministic: this process used CUDA before the run without CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} "
            "(cuBLAS reads it once); set it in the environment before the process starts"
        )
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE


def _current() -> dict[str, Any]:
    return {
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "sdp_flash": torch.backends.cuda.flash_sdp_enabled(),
        "sdp_mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "sdp_cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        "sdp_math": torch.backends.cuda.math_sdp_enabled(),
    }


def _apply(state: dict[str, Any]) -> None:
    torch.use_deterministic_algorithms(state["algorithms"], warn_only=state["warn_only"])
    torch.backends.cudnn.deterministic = state["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = state["cudnn_benchmark"]
    torch.backends.cuda.matmul.allow_tf32 = state["matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = state["cudnn_tf32"]
    torch.backends.cuda.enable_flash_sdp(state["sdp_flash"])
    torch.backends.cuda.enable_mem_efficient_sdp(state["sdp_mem_efficient"])
    torch.backends.cuda.enable_cudnn_sdp(state["sdp_cudnn"])
    torch.backends.cuda.enable_math_sdp(state["sdp_math"])


DETERMINISTIC = {
    "algorithms": True,
    "warn_only": True,
    "cudnn_deterministic": True,
    "cudnn_benchmark": False,
    "matmul_tf32": False,
    "cudnn_tf32": False,
    # attention (ViT's scaled_dot_product_attention) by its plain math kernel: the fused ones' backward adds
    # with atomics (torch warned "Memory Efficient attention defaults to a non-deterministic algorithm" on an H200)
    "sdp_flash": False,
    "sdp_mem_efficient": False,
    "sdp_cudnn": False,
    "sdp_math": True,
}


def set_deterministic_kernels() -> dict[str, Any]:
    """Switch torch to its deterministic kernels for the rest of the process (a Flower node's process
    belongs to its run); returns the settings it replaced."""
    previous = _current()
    _apply(DETERMINISTIC)
    return previous


@contextmanager
def deterministic_kernels(enabled: bool) -> Iterator[None]:
    """Deterministic kernels while the block runs (nothing changes when ``enabled`` is false); torch's
    previous settings come back afterwards, also when the block raises."""
    if not enabled:
        yield
        return
    previous = set_deterministic_kernels()
    try:
        yield
    finally:
        _apply(previous)


__all__ = ["CUBLAS_WORKSPACE", "deterministic_kernels", "prepare_cublas", "set_deterministic_kernels"]
