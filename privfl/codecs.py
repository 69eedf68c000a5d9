"""Compressed encodings of parameter messages, and their decoders.

A kind whose messages travel compressed declares a decoder (``ArtifactKind.decode``); the receiver and
the attacker (``AttackerView.load``) see the decoded, dense tensors, while the capture keeps exactly
what crossed the wire (the factors), so communication is counted on the compressed form.

Truncated SVD (FedKD, Wu et al., Nat. Commun. 13, 2032, 2022, Sec. "Dynamic gradients
approximation"): a tensor ``W`` named ``NAME`` is sent as three tensors ``NAME@u`` (..., m, r),
``NAME@s`` (..., r) and ``NAME@v`` (..., r, n) with ``W ~= (u * s[..., None, :]) @ v``; a tensor sent
whole keeps its name. Leading dimensions are batch dimensions: HtFLlib's FedKD decomposes a 4-d
convolution weight (out, in, kh, kw) as out*in separate kh x kw matrices, and that layout decodes here
unchanged. A tensor factored after a reshape to a matrix (``svd_encode(..., conv="reshape")``: a conv
weight as (out, in*kh*kw)) also carries ``NAME@shape``, its original shape (1-d int64, bookkeeping: the
sender lists it in the message's ``aux``), and decodes to that shape.

:func:`svd_encode` is the encoder (HtFLlib's ``decomposition`` rule, with the rank decision below);
:func:`svd_rank` is its rank rule and :func:`svd_scalars` the payload count of an encoded state.

Sparse models (DisPFL, Dai et al., ICML 2022): a tensor ``NAME`` sent at a mask is ``NAME@values`` (1-d,
the entries where the mask is set, in row-major order), ``NAME@mask`` (the mask as packed bits, uint8,
most significant bit first, ceil(n/8) bytes) and ``NAME@shape`` (int64); mask and shape are bookkeeping
(aux). :func:`sparse_encode` / :func:`sparse_decode` are the pair, :func:`sparse_masks` reads the masks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping

import torch

SVD_PARTS = ("u", "s", "v")
SVD_SEPARATOR = "@"
#: optional fourth part: the original shape of a tensor factored after a reshape to a matrix
SVD_SHAPE = "shape"
#: how :func:`svd_encode` factors a tensor of more than two dimensions (a conv weight)
CONV_SVD = ("htfllib", "reshape")


def svd_name(name: str, part: str) -> str:
    """The tensor name of factor ``part`` (u, s, v, or the optional shape) of the tensor ``name``."""
    if part not in (*SVD_PARTS, SVD_SHAPE):
        raise ValueError(f"SVD factor must be one of {(*SVD_PARTS, SVD_SHAPE)}, got {part!r}")
    return f"{name}{SVD_SEPARATOR}{part}"


def svd_decode(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dense tensors from a message whose factored tensors follow :func:`svd_name`; others pass as they are.

    Raises ``ValueError`` for an incomplete factor triple or factors whose shapes do not compose."""
    out: dict[str, torch.Tensor] = {}
    factored: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        base, sep, part = key.rpartition(SVD_SEPARATOR)
        if sep and part in (*SVD_PARTS, SVD_SHAPE):
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
        dense = (u * s.unsqueeze(-2)) @ v
        if SVD_SHAPE in parts:
            shape = parts[SVD_SHAPE]
            if shape.dim() != 1 or shape.is_floating_point() or math.prod(int(d) for d in shape.tolist()) != dense.numel():
                raise ValueError(f"SVD shape of {base!r} ({shape.tolist()}) does not fit its {dense.numel()} decoded entries")
            dense = dense.reshape([int(d) for d in shape.tolist()])
        out[base] = dense
    return out


def svd_rank(s: torch.Tensor, energy: float) -> int:
    """How many singular values to keep: the smallest r whose kept energy strictly exceeds ``energy`` times
    the total, sum_{i<r} s_i^2 > energy * sum_i s_i^2 (HtFLlib ``decomposition``, after FedKD's
    ``run.py``), with the energies of the same index pooled over leading (batch) dimensions, so one rank
    serves every matrix of a batched tensor, as in HtFLlib.

    Where HtFLlib keeps 0 singular values (the threshold is only exceeded by all of them: its search
    stops one short, so an ``energy`` of 1, or a rank-1 tensor such as a 1x1 convolution, would send
    zeros), this keeps all of them: the reconstruction is then exact instead of zero. r >= 1 always."""
    if s.dim() < 1 or s.shape[-1] < 1:
        raise ValueError(f"singular values must have a last dimension of at least 1, got shape {tuple(s.shape)}")
    e = s.detach().double().pow(2).reshape(-1, s.shape[-1]).sum(0)  # (k,): energy per index, batch pooled
    cum = e.cumsum(0)
    above = torch.nonzero(cum > energy * cum[-1]).flatten()
    return int(above[0]) + 1 if len(above) else int(e.numel())


def factored(tensor: torch.Tensor) -> bool:
    """Whether :func:`svd_encode` factors ``tensor``: floating, more than one dimension and more than one
    row (HtFLlib: ``shape[0] > 1 and len(shape) > 1``); biases and (1, n) weights are sent whole."""
    return tensor.is_floating_point() and tensor.dim() > 1 and tensor.shape[0] > 1


def svd_encode(state: Mapping[str, torch.Tensor], energy: float, *, conv: str = "htfllib") -> dict[str, torch.Tensor]:
    """``state`` as an ``svd_model`` payload: each :func:`factored` tensor as its truncated SVD
    ``NAME@u``, ``NAME@s``, ``NAME@v`` keeping :func:`svd_rank` singular values, every other tensor whole.

    ``conv`` says how a tensor of more than two dimensions (a conv weight (out, in, kh, kw)) is factored:
    ``htfllib`` over its last two dimensions, out*in separate kh x kw matrices with one common rank
    (HtFLlib's layout: ``u`` (out, in, kh, r), ``s`` (out, in, r), ``v`` (out, in, r, kw)); ``reshape``
    as the (out, in*kh*kw) matrix, with ``NAME@shape`` (aux) to restore the shape. A tensor whose
    singular values are all zero is sent whole (as HtFLlib does).

    The SVD runs in float64 on the tensor's device; the factors keep the tensor's dtype. The kept energy
    of each factored tensor exceeds ``energy`` times its total (pooled over the matrices of a batched
    one), so its relative squared reconstruction error is below ``1 - energy`` (Eckart-Young), up to the
    rounding of the factors to the tensor's dtype."""
    if not 0.0 <= energy <= 1.0:
        raise ValueError(f"SVD energy threshold must lie in [0, 1], got {energy}")
    if conv not in CONV_SVD:
        raise ValueError(f"conv must be one of {CONV_SVD}, got {conv!r}")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if SVD_SEPARATOR in name:
            raise ValueError(f"tensor name {name!r} contains {SVD_SEPARATOR!r}, which names SVD factors")
        t = tensor.detach()
        if not factored(t):
            out[name] = t.clone()
            continue
        work = t.double()
        reshaped = t.dim() > 2 and conv == "reshape"
        if reshaped:
            work = work.reshape(t.shape[0], -1)
        u, s, vh = torch.linalg.svd(work, full_matrices=False)
        if not bool((s > 0).any()):
            out[name] = t.clone()
            continue
        r = svd_rank(s, energy)
        out[svd_name(name, "u")] = u[..., :r].to(t.dtype).contiguous()
        out[svd_name(name, "s")] = s[..., :r].to(t.dtype).contiguous()
        out[svd_name(name, "v")] = vh[..., :r, :].to(t.dtype).contiguous()
        if reshaped:
            out[svd_name(name, SVD_SHAPE)] = torch.tensor(list(t.shape), dtype=torch.int64, device=t.device)
    return out


def svd_aux(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """The bookkeeping tensors of an encoded state (``NAME@shape``): what its message lists as ``aux``."""
    return tuple(k for k in tensors if k.endswith(SVD_SEPARATOR + SVD_SHAPE))


def svd_scalars(tensors: Mapping[str, torch.Tensor]) -> int:
    """Payload scalars of an encoded state: r*(m+n+1) per factored matrix (times its batch size) plus
    the numel of every tensor sent whole; ``NAME@shape`` is bookkeeping and left out."""
    aux = set(svd_aux(tensors))
    return sum(t.numel() for k, t in tensors.items() if k not in aux)


__all__ = [
    "CONV_SVD",
    "SVD_PARTS",
    "SVD_SEPARATOR",
    "SVD_SHAPE",
    "factored",
    "svd_aux",
    "svd_decode",
    "svd_encode",
    "svd_name",
    "svd_rank",
    "svd_scalars",
]


# ------------------------------------------------------------------------------------------ sparse (DisPFL)
SPARSE_SEPARATOR = "@"
SPARSE_PARTS = ("values", "mask", "shape")
_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask as packed bits (uint8, 1-d, ceil(n/8) bytes, most significant bit first)."""
    flat = mask.reshape(-1).to(torch.uint8).cpu()
    pad = (-len(flat)) % 8
    if pad:
        flat = torch.cat([flat, torch.zeros(pad, dtype=torch.uint8)])
    return (flat.view(-1, 8) * _BITS).sum(1).to(torch.uint8)


def unpack_mask(bits: torch.Tensor, numel: int) -> torch.Tensor:
    """The flat boolean mask of ``numel`` entries that :func:`pack_mask` packed."""
    flat = (bits.reshape(-1, 1).to(torch.uint8) & _BITS.to(bits.device)) != 0
    return flat.reshape(-1)[:numel]


def sparse_name(name: str, part: str) -> str:
    if part not in SPARSE_PARTS:
        raise ValueError(f"sparse part must be one of {SPARSE_PARTS}, got {part!r}")
    return f"{name}{SPARSE_SEPARATOR}{part}"


def sparse_encode(tensors: Mapping[str, torch.Tensor], masks: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor with a mask as its values at the mask, the packed mask and its shape; others as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name not in masks:
            out[name] = t.detach().clone()
            continue
        m = masks[name].reshape(-1).to(t.device)
        out[sparse_name(name, "values")] = t.detach().reshape(-1)[m].clone()
        out[sparse_name(name, "mask")] = pack_mask(masks[name])
        out[sparse_name(name, "shape")] = torch.tensor(list(t.shape), dtype=torch.int64)
    return out


def _groups(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    parts: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    plain: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        base, sep, part = key.rpartition(SPARSE_SEPARATOR)
        if sep and part in SPARSE_PARTS:
            parts[base][part] = value
        else:
            plain[key] = value
    for base, got in parts.items():
        missing = [p for p in SPARSE_PARTS if p not in got]
        if missing:
            raise ValueError(f"sparse tensor {base!r} lacks {', '.join(missing)}")
    return parts, plain


def sparse_masks(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The boolean masks of a sparse message, by tensor name, in each tensor's shape."""
    parts, _ = _groups(tensors)
    out = {}
    for base, p in parts.items():
        shape = [int(d) for d in p["shape"].tolist()]
        numel = math.prod(shape)
        if p["mask"].numel() != -(-numel // 8):
            raise ValueError(f"sparse mask of {base!r} has {p['mask'].numel()} bytes, expected {-(-numel // 8)} for shape {shape}")
        out[base] = unpack_mask(p["mask"], numel).reshape(shape).to(p["values"].device)
    return out


def sparse_decode(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The dense tensors of a sparse message: the values at their masks, zeros elsewhere (ValueError if inconsistent)."""
    parts, plain = _groups(tensors)
    masks = sparse_masks(tensors)
    out = dict(plain)
    for base, p in parts.items():
        mask, values = masks[base], p["values"]
        if values.dim() != 1 or values.numel() != int(mask.sum()):
            raise ValueError(f"sparse tensor {base!r} has {values.numel()} values for a mask of {int(mask.sum())} entries")
        dense = torch.zeros(mask.numel(), dtype=values.dtype, device=values.device)
        dense[mask.reshape(-1).to(values.device)] = values
        out[base] = dense.reshape(mask.shape)
    return out


def sparse_aux(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """The bookkeeping tensors of an encoded message (masks and shapes): left out of the paper-style count."""
    return tuple(k for k in tensors if k.endswith((SPARSE_SEPARATOR + "mask", SPARSE_SEPARATOR + "shape")))
