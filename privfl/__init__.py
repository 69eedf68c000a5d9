"""privfl: federated-learning training with exact capture of every transmitted artifact.

The public API (stable; see docs/extending.md):

- ``privfl.train(cfg_or_method, **options) -> Run``: train a method (the module ``privfl.train`` is
  callable; ``python -m privfl.train`` is its CLI);
- ``privfl.Run``: a run directory as one object (``Run.open(path)``), with its attacker view, ground
  truth and models;
- ``privfl.TrainConfig``, ``privfl.TrainCallback`` (hooks into a run); the registries ``privfl.methods.METHODS``, ``privfl.kinds.KINDS``,
  ``privfl.models.MODELS``/``MODEL_GROUPS``, ``privfl.data.DATASETS``/``PARTITIONS``; the method
  contract ``privfl.methods.FLMethod`` with ``LeakageContext`` and ``LocalTrainer``; the kind
  vocabulary ``privfl.kinds`` (``ArtifactKind``, ``register_kind``).

Attacks and defenses are the sibling packages ``attacks`` (``attacks.run_attack``) and ``defenses``.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.2.0"
__all__ = ["Run", "TrainCallback", "TrainConfig", "__version__", "train"]


def __getattr__(name: str) -> Any:
    # lazy, so that `import privfl` stays light and `python -m privfl.train` does not import itself twice
    if name == "Run":
        from privfl.run import Run

        return Run
    if name == "TrainCallback":
        from privfl.engine import TrainCallback

        return TrainCallback
    if name == "TrainConfig":
        from privfl.config import TrainConfig

        return TrainConfig
    if name == "train":
        import importlib

        return importlib.import_module("privfl.train")
    raise AttributeError(f"module 'privfl' has no attribute {name!r}")
