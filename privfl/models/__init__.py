"""Client models: backbones (zoo), representation mappings and the extractor/RM/head split."""

from privfl.models.split import MAPPINGS, AvgPoolMapping, MaxPoolMapping, SplitModel, build_model
from privfl.models.zoo import MODEL_GROUPS, MODELS, assign_archs, count_parameters

__all__ = [
    "MAPPINGS",
    "MODELS",
    "MODEL_GROUPS",
    "AvgPoolMapping",
    "MaxPoolMapping",
    "SplitModel",
    "assign_archs",
    "build_model",
    "count_parameters",
]
