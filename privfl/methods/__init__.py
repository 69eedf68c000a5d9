"""Federated methods, one module each, registered by name in :data:`METHODS`.

The contract they are written against and the machinery they share live in :mod:`privfl.fl`; its public
names are re-exported here, so ``from privfl.methods import FLMethod`` keeps working."""

import sys as _sys

# the module paths of the contract before it moved to privfl.fl (plug-ins written against them still import)
from privfl.fl import method as _method
from privfl.fl import trainer as _trainer
from privfl.fl.method import (
    METHODS,
    Client,
    ClientReply,
    DataView,
    FLEnv,
    FLMethod,
    GlobalModelServer,
    KnowledgeRecorder,
    LeakageContext,
    ModelRequest,
    check_method_class,
    resolve_method,
)
from privfl.fl.trainer import LocalStats, LocalTrainer

_sys.modules.setdefault("privfl.methods.base", _method)
_sys.modules.setdefault("privfl.methods.trainer", _trainer)

__all__ = [
    "METHODS",
    "Client",
    "ClientReply",
    "DataView",
    "FLEnv",
    "FLMethod",
    "GlobalModelServer",
    "KnowledgeRecorder",
    "LeakageContext",
    "LocalStats",
    "LocalTrainer",
    "ModelRequest",
    "check_method_class",
    "resolve_method",
]
