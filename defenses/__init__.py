"""Transforms applied by the channel to outgoing messages (noise, clipping, pruning, quantisation)."""

from defenses.accounting import ClientAccountant
from defenses.base import (
    DEFENSES,
    DIRECTIONS,
    PARAMETER_FAMILIES,
    REPRESENTATION_FAMILIES,
    Defense,
    DefenseParams,
    build_defenses,
    is_full_parameters,
    parse_defense,
    register_defense,
)
from defenses.transforms import ClientDP, Clip, GaussianNoise, Quantize, RepNoise, TopK

__all__ = [
    "DEFENSES",
    "DIRECTIONS",
    "PARAMETER_FAMILIES",
    "REPRESENTATION_FAMILIES",
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
    "is_full_parameters",
    "parse_defense",
    "register_defense",
]
