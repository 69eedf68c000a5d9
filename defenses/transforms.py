"""The registered defenses: Gaussian noise, clipping, client-level DP, top-k pruning, quantisation and
noise on representations.

Each acts on what :class:`~defenses.base.Defense` hands it: the update of a full-parameter message
(relative to what the sender last received), the tensors of an ``update``/``grad`` message, or the
non-aux tensors of a representation message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from defenses.accounting import ClientAccountant
from defenses.base import (
    PARAMETER_FAMILIES,
    REPRESENTATION_FAMILIES,
    Defense,
    DefenseParams,
    check_range,
    register_defense,
)
from privfl.capture import Message
from privfl.kinds import Family


def global_norm(tensors: dict[str, torch.Tensor]) -> float:
    """L2 norm over all entries of all tensors, as if they were one flat vector."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors.values()))


def clip_to(tensors: dict[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    """Scale by ``min(1, max_norm / norm)``: small updates are left exactly as they are."""
    norm = global_norm(tensors)
    if norm <= max_norm:
        return dict(tensors)
    scale = max_norm / norm
    return {k: t * scale for k, t in tensors.items()}


# --- gaussian ------------------------------------------------------------------------------------


@dataclass
class GaussianParams(DefenseParams):
    sigma: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("sigma", self.sigma, low=0.0)


@register_defense
class GaussianNoise(Defense):
    """Additive Gaussian noise N(0, sigma^2) on every float entry of the update.

    The noise defense evaluated against gradient inversion in Zhu et al., "Deep Leakage from
    Gradients" (NeurIPS 2019, Sec. 5), there on gradients; here on whatever parameter message is sent,
    taken as an update so that sigma is on the scale of one round's change. No clipping, so this gives
    no formal guarantee (use ``dp`` for that). Noise is seeded per (seed, round, sender, kind, tensor)
    so that runs are reproducible.
    """

    name: ClassVar[str] = "gaussian"
    paper: ClassVar[str] = "Zhu et al., Deep Leakage from Gradients, NeurIPS 2019 (noise defense)"
    families: ClassVar[frozenset[Family]] = PARAMETER_FAMILIES
    Params: ClassVar[type] = GaussianParams

    def transform(self, updates: dict[str, torch.Tensor], msg: Message) -> dict[str, torch.Tensor]:
        p = self.params
        if p.sigma == 0:
            return dict(updates)
        return {k: u + self.noise(msg, k, u, p.sigma, p.seed) for k, u in updates.items()}


# --- clip ----------------------------------------------------------------------------------------


@dataclass
class ClipParams(DefenseParams):
    max_norm: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("max_norm", self.max_norm, low=0.0, low_open=True)


@register_defense
class Clip(Defense):
    """Scale the update so that its global L2 norm is at most ``max_norm``.

    The clipping step of DP-FedAvg (McMahan et al., ICLR 2018), also used alone as a norm-bounding
    defense. The norm is global over all float non-aux tensors of the message (flat clipping), so the
    direction of the update is kept.
    """

    name: ClassVar[str] = "clip"
    paper: ClassVar[str] = "McMahan et al., Learning Differentially Private Recurrent Language Models, ICLR 2018"
    families: ClassVar[frozenset[Family]] = PARAMETER_FAMILIES
    Params: ClassVar[type] = ClipParams

    def transform(self, updates: dict[str, torch.Tensor], msg: Message) -> dict[str, torch.Tensor]:
        return clip_to(updates, self.params.max_norm)


# --- dp ------------------------------------------------------------------------------------------


@dataclass
class DPParams(DefenseParams):
    max_norm: float = 1.0
    noise_multiplier: float = 1.0
    delta: float = 1e-5
    sample_rate: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("max_norm", self.max_norm, low=0.0, low_open=True)
        # zero noise is infinite epsilon: use `clip` to clip without noise
        check_range("noise_multiplier", self.noise_multiplier, low=0.0, low_open=True)
        check_range("delta", self.delta, low=0.0, high=1.0, low_open=True, high_open=True)
        check_range("sample_rate", self.sample_rate, low=0.0, high=1.0, low_open=True)


@register_defense
class ClientDP(Defense):
    """Client-level differential privacy: clip the update to ``max_norm``, add N(0, (z * max_norm)^2).

    DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR 2018)
    applied at the client, i.e. each client perturbs its own update before it leaves (the server need
    not be trusted). Epsilon per client is tracked with opacus' RDP accountant (see
    :mod:`defenses.accounting`): one step per round in which the client sent a defended message.
    ``sample_rate`` is the fraction of clients selected per round (default 1.0, i.e. no amplification
    by sampling); the caller may set it to the run's join ratio.
    """

    name: ClassVar[str] = "dp"
    paper: ClassVar[str] = "McMahan et al., Learning Differentially Private Recurrent Language Models, ICLR 2018"
    families: ClassVar[frozenset[Family]] = PARAMETER_FAMILIES
    Params: ClassVar[type] = DPParams

    def __init__(self, **params: Any):
        super().__init__(**params)
        p = self.params
        self.accountant = ClientAccountant(p.noise_multiplier, p.sample_rate, p.delta)

    def transform(self, updates: dict[str, torch.Tensor], msg: Message) -> dict[str, torch.Tensor]:
        p = self.params
        std = p.noise_multiplier * p.max_norm
        clipped = clip_to(updates, p.max_norm)
        return {k: u + self.noise(msg, k, u, std, p.seed) for k, u in clipped.items()}

    def after_defended(self, msg: Message) -> None:
        self.accountant.record(msg.sender, msg.round)

    def state(self) -> dict[str, Any]:
        return {**super().state(), "rounds": {c: sorted(r) for c, r in self.accountant._rounds.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        """Replay the recorded (client, round) steps into fresh accountants."""
        super().load_state(state)
        for client, rounds in state.get("rounds", {}).items():
            for rnd in rounds:
                self.accountant.record(client, int(rnd))

    def report(self) -> dict[str, Any]:
        clients = sorted(self.accountant.epsilons())
        return {
            "epsilon": self.accountant.epsilons(),
            "delta": self.params.delta,
            "accountant": ClientAccountant.name,
            "steps": {c: self.accountant.steps(c) for c in clients},
            **super().report(),
        }


# --- topk ----------------------------------------------------------------------------------------


@dataclass
class TopKParams(DefenseParams):
    keep: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("keep", self.keep, low=0.0, high=1.0, low_open=True)


@register_defense
class TopK(Defense):
    """Keep the ``keep`` fraction of largest-magnitude entries of each tensor of the update.

    Gradient pruning, the defense found most effective against DLG in Zhu et al., "Deep Leakage from
    Gradients" (NeurIPS 2019, Sec. 5). Per tensor (not global) so that every layer keeps some signal;
    ``ceil(keep * numel)`` entries are kept, so at least one per tensor, and ties are broken by
    ``torch.topk`` so the count is exact.
    """

    name: ClassVar[str] = "topk"
    paper: ClassVar[str] = "Zhu et al., Deep Leakage from Gradients, NeurIPS 2019 (gradient pruning)"
    families: ClassVar[frozenset[Family]] = PARAMETER_FAMILIES
    Params: ClassVar[type] = TopKParams

    @staticmethod
    def kept(numel: int, keep: float) -> int:
        # the small epsilon keeps e.g. 0.1 * 1000 from becoming 101 through float error
        return min(numel, max(1, math.ceil(keep * numel - 1e-9)))

    def transform(self, updates: dict[str, torch.Tensor], msg: Message) -> dict[str, torch.Tensor]:
        out = {}
        for k, u in updates.items():
            n = u.numel()
            k_keep = self.kept(n, self.params.keep) if n else 0
            if k_keep >= n:
                out[k] = u.clone()
                continue
            flat = u.reshape(-1)
            idx = flat.abs().topk(k_keep, sorted=False).indices
            pruned = torch.zeros_like(flat)
            pruned[idx] = flat[idx]
            out[k] = pruned.reshape(u.shape)
        return out


# --- quantize ------------------------------------------------------------------------------------


@dataclass
class QuantizeParams(DefenseParams):
    bits: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("bits", self.bits, low=1, high=16)


@register_defense
class Quantize(Defense):
    """Uniform quantisation of each tensor of the update to ``2**bits`` levels between its min and max.

    Reduced precision as a leakage defense, as in the defense study of Zhu et al., "Deep Leakage from
    Gradients" (NeurIPS 2019, Sec. 5, half precision / int8), generalised to ``bits`` bits with a
    per-tensor range. Rounding is deterministic (to the nearest level, unlike QSGD's stochastic
    rounding), so the error per entry is at most half a step and runs are reproducible; the min and
    max are themselves levels, as a real codec would send them.
    """

    name: ClassVar[str] = "quantize"
    paper: ClassVar[str] = "Zhu et al., Deep Leakage from Gradients, NeurIPS 2019 (reduced precision)"
    families: ClassVar[frozenset[Family]] = PARAMETER_FAMILIES
    Params: ClassVar[type] = QuantizeParams

    def transform(self, updates: dict[str, torch.Tensor], msg: Message) -> dict[str, torch.Tensor]:
        levels = 2**self.params.bits - 1
        out = {}
        for k, u in updates.items():
            if u.numel() == 0:
                out[k] = u.clone()
                continue
            lo, hi = u.min(), u.max()
            if not bool(hi > lo):
                out[k] = u.clone()
                continue
            step = (hi - lo) / levels
            index = torch.round((u - lo) / step).clamp_(0, levels)
            out[k] = lo + index * step
        return out


# --- repnoise ------------------------------------------------------------------------------------


@dataclass
class RepNoiseParams(DefenseParams):
    sigma: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("sigma", self.sigma, low=0.0)


@register_defense
class RepNoise(Defense):
    """Gaussian noise N(0, sigma^2) on shared representations, prototypes and their statistics.

    The Gaussian mechanism (Dwork & Roth, "The Algorithmic Foundations of Differential Privacy",
    2014, App. A) applied to what representation-sharing methods send instead of parameters. There is
    no clipping, so sigma is on the scale of the representations and no epsilon is claimed. Tensors
    are noised directly (a representation has no "previous state" to take an update against). Labels,
    class ids and counts (``aux``) are not changed: they are bookkeeping, and noising them would only
    break training.
    """

    name: ClassVar[str] = "repnoise"
    paper: ClassVar[str] = "Dwork & Roth, The Algorithmic Foundations of Differential Privacy, 2014 (Gaussian mechanism)"
    families: ClassVar[frozenset[Family]] = REPRESENTATION_FAMILIES
    Params: ClassVar[type] = RepNoiseParams

    def transform(self, updates: dict[str, torch.Tensor], msg: Message) -> dict[str, torch.Tensor]:
        p = self.params
        if p.sigma == 0:
            return dict(updates)
        return {k: u + self.noise(msg, k, u, p.sigma, p.seed) for k, u in updates.items()}


__all__ = ["ClientDP", "Clip", "GaussianNoise", "Quantize", "RepNoise", "TopK", "clip_to", "global_norm"]
