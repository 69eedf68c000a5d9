"""Federated methods, one module each, registered by name in :data:`METHODS`, and the method contract."""

from privfl.methods.base import (
    METHODS,
    Client,
    ClientReply,
    DataView,
    FLEnv,
    FLMethod,
    KnowledgeRecorder,
    LeakageContext,
    ModelRequest,
    check_method_class,
    resolve_method,
)
from privfl.methods.trainer import LocalStats, LocalTrainer

__all__ = [
    "METHODS",
    "Client",
    "ClientReply",
    "DataView",
    "FLEnv",
    "FLMethod",
    "KnowledgeRecorder",
    "LeakageContext",
    "LocalStats",
    "LocalTrainer",
    "ModelRequest",
    "check_method_class",
    "resolve_method",
]
