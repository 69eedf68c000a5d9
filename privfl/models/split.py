"""Client models split as extractor -> representation mapping (RM) -> head (FedRE / HtFLlib).

Heterogeneous backbones produce vectors of different sizes (64 ... 2048); the RM maps each to a
common ``rep_dim`` so that methods can exchange per-sample representations and share one
homogeneous ``nn.Linear(rep_dim, num_classes)`` head. What an attacker is assumed to know about a
client ("its extractor incl. RM") is exactly :meth:`SplitModel.extractor_state`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn

from privfl.errors import ConfigError
from privfl.models.zoo import MODELS
from privfl.registry import Registry

MappingFactory = Callable[[int, int], nn.Module]

MAPPINGS: Registry[MappingFactory] = Registry("representation mapping")

_EXTRACTOR_PREFIXES = ("features.", "mapping.")


class _Pool1dMapping(nn.Module):
    """Adaptive 1-D pooling over a flat (B, D) vector: parameter-free RM (HtFLlib's replacement head).

    ``AdaptiveAvgPool1d(rep_dim)`` averages contiguous channel groups (2048 -> 512: groups of 4), is
    the identity when ``D == rep_dim`` and repeats values when ``D < rep_dim``.
    """

    def __init__(self, pool: nn.Module, in_dim: int, rep_dim: int):
        super().__init__()
        self.pool = pool
        self.in_dim, self.rep_dim = in_dim, rep_dim

    def forward(self, x: Tensor) -> Tensor:
        return self.pool(x.unsqueeze(1)).squeeze(1)

    def extra_repr(self) -> str:
        return f"in_dim={self.in_dim}, rep_dim={self.rep_dim}"


class AvgPoolMapping(_Pool1dMapping):
    """``ap``: channel-group mean (FedRE/HtFLlib default)."""

    def __init__(self, in_dim: int, rep_dim: int):
        super().__init__(nn.AdaptiveAvgPool1d(rep_dim), in_dim, rep_dim)


class MaxPoolMapping(_Pool1dMapping):
    """``mp``: channel-group max."""

    def __init__(self, in_dim: int, rep_dim: int):
        super().__init__(nn.AdaptiveMaxPool1d(rep_dim), in_dim, rep_dim)


MAPPINGS.register("ap", AvgPoolMapping)
MAPPINGS.register("mp", MaxPoolMapping)
# ``fc``: a learned projection, trained jointly with the local cross-entropy.
MAPPINGS.register("fc", nn.Linear)  # called as (in_dim, rep_dim)


class SplitModel(nn.Module):
    """features -> mapping -> head, with the extractor (features + mapping) separable for attacks."""

    def __init__(
        self,
        arch: str,
        features: nn.Module,
        feature_dim: int,
        mapping: nn.Module,
        head: nn.Module,
        spec: dict[str, Any],
    ):
        super().__init__()
        self.arch = arch
        self.feature_dim = feature_dim
        self.features = features
        self.mapping = mapping
        self.head = head
        self.spec = dict(spec)

    def represent(self, x: Tensor) -> Tensor:
        """Per-sample representation (B, rep_dim): what representation-sharing methods upload."""
        return self.mapping(self.features(x))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.represent(x))

    def extractor_state(self) -> dict[str, Tensor]:
        """A detached copy of the features + mapping state (params and buffers), no head keys.

        Cloned so that a snapshot taken as attacker knowledge does not change with later training.
        """
        return {k: v.detach().clone() for k, v in self.state_dict().items() if k.startswith(_EXTRACTOR_PREFIXES)}

    def load_extractor_state(self, state: Mapping[str, Tensor]) -> None:
        """Load an :meth:`extractor_state` (strict: exactly the extractor keys and shapes)."""
        expected = {k for k in self.state_dict() if k.startswith(_EXTRACTOR_PREFIXES)}
        got = set(state)
        if got != expected:
            missing, unexpected = sorted(expected - got), sorted(got - expected)
            raise ConfigError(
                f"extractor state does not fit {self.arch} ({self.spec}): "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
            )
        parts: dict[str, dict[str, Tensor]] = {"features": {}, "mapping": {}}
        for k, v in state.items():
            part, _, rest = k.partition(".")
            parts[part][rest] = v
        try:
            self.features.load_state_dict(parts["features"], strict=True)
            self.mapping.load_state_dict(parts["mapping"], strict=True)
        except RuntimeError as e:  # shape mismatch: same keys, different architecture args
            raise ConfigError(f"extractor state does not fit {self.arch} ({self.spec}): {e}") from None


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def build_model(
    arch: str,
    *,
    in_channels: int,
    num_classes: int,
    image_size: int,
    rep_dim: int = 512,
    mapping: str = "ap",
) -> SplitModel:
    """Build a client model; deterministic given ``torch.manual_seed`` set by the caller.

    Construction order (features, mapping, head) is fixed so the same seed gives the same weights.
    """
    factory = MODELS.get(arch)
    mapping_factory = MAPPINGS.get(mapping)
    _positive_int("in_channels", in_channels)
    _positive_int("num_classes", num_classes)
    _positive_int("image_size", image_size)
    _positive_int("rep_dim", rep_dim)
    spec = {
        "arch": arch,
        "in_channels": in_channels,
        "num_classes": num_classes,
        "image_size": image_size,
        "rep_dim": rep_dim,
        "mapping": mapping,
    }
    features, feature_dim = factory(in_channels, image_size)
    rm = mapping_factory(feature_dim, rep_dim)
    head = nn.Linear(rep_dim, num_classes)
    return SplitModel(arch, features, feature_dim, rm, head, spec)


__all__ = ["MAPPINGS", "AvgPoolMapping", "MaxPoolMapping", "SplitModel", "build_model"]
