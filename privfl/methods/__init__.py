"""Federated methods, one module each, registered by name in :data:`METHODS`."""

from privfl.methods import fedallrep, fedmrl, fednova, fedre, fedsgd, prototypes, simple  # noqa: F401  (registration)
from privfl.methods import fedfree  # noqa: F401  (registration)
from privfl.methods import drdfl  # noqa: F401  (registration)
from privfl.methods.base import METHODS, Client, DataView, FLEnv, FLMethod, KnowledgeRecorder, ModelRequest, resolve_method

__all__ = ["METHODS", "Client", "DataView", "FLEnv", "FLMethod", "KnowledgeRecorder", "ModelRequest", "resolve_method"]
