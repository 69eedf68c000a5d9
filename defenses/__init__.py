"""Transforms applied by the channel to outgoing messages (noise, clipping, pruning, quantisation)."""

from defenses.accounting import ClientAccountant
from defenses.base import (
    DEFENSES,
    DIRECTIONS,
    FULL_PARAMETER_KINDS,
    PARAMETER_KINDS,
    REPRESENTATION_KINDS,
    Defense,
    DefenseParams,
    build_defenses,
    parse_defense,
    register_defense,
)
from defenses.transforms import ClientDP, Clip, GaussianNoise, Quantize, RepNoise, TopK

__all__ = [
    "DEFENSES",
    "DIRECTIONS",
    "FULL_PARAMETER_KINDS",
    "PARAMETER_KINDS",
    "REPRESENTATION_KINDS",
    "ClientAccountant",
    "ClientDP",
    "Clip",
    "Defense",
    "DefenseParams",
    "GaussianNoise",
    "Quantize",
    "RepNoise",
    "TopK",
    "build_defenses",
    "parse_defense",
    "register_defense",
]
