"""Compressed encodings of parameter messages, and their decoders.

A kind whose messages travel compressed declares a decoder (``ArtifactKind.decode``); the receiver and
the attacker (``AttackerView.load``) see the decoded, dense tensors, while the capture keeps exactly
what crossed the wire (the factors), so communication is counted on the compressed form.

Truncated SVD (FedKD, Wu et al., Nat. Commun. 13, 2032, 2022, Sec. "Dynamic gradients
approximation"): a tensor ``W`` named ``NAME`` is sent as three tensors ``NAME@u`` (..., m, r),
``NAME@s`` (..., r) and ``NAME@v`` (..., r, n) with ``W ~= (u * s[..., None, :]) @ v``; a tensor sent
whole keeps its name. Leading dimensions are batch dimensions: HtFLlib's FedKD decomposes a 4-d
convolution weight (out, in, kh, kw) as out*in separate kh x kw matrices, and that layout decodes here
unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

SVD_PARTS = ("u", "s", "v")
SVD_SEPARATOR = "@"


def svd_name(name: str, part: str) -> str:
    """The tensor name of factor ``part`` (u, s or v) of the tensor ``name``."""
    if part not in SVD_PARTS:
        raise ValueError(f"SVD factor must be one of {SVD_PARTS}, got {part!r}")
    return f"{name}{SVD_SEPARATOR}{part}"


def svd_decode(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dense tensors from a message whose factored tensors follow :func:`svd_name`; others pass as they are.

    Raises ``ValueError`` for an incomplete factor triple or factors whose shapes do not compose."""
    out: dict[str, torch.Tensor] = {}
    factored: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        base, sep, part = key.rpartition(SVD_SEPARATOR)
        if sep and part in SVD_PARTS:
            factored.setdefault(base, {})[part] = value
        else:
            out[key] = value
    for base, parts in factored.items():
        missing = [p for p in SVD_PARTS if p not in parts]
        if missing:
            raise ValueError(f"SVD factors of {base!r} lack {', '.join(missing)}")
        u, s, v = parts["u"], parts["s"], parts["v"]
        if u.dim() < 2 or v.dim() != u.dim() or s.dim() != u.dim() - 1 or u.shape[-1] != s.shape[-1] or v.shape[-2] != s.shape[-1]:
            raise ValueError(f"SVD factors of {base!r} do not compose: u {tuple(u.shape)}, s {tuple(s.shape)}, v {tuple(v.shape)}")
        out[base] = (u * s.unsqueeze(-2)) @ v
    return out


__all__ = ["SVD_PARTS", "SVD_SEPARATOR", "svd_decode", "svd_name"]
