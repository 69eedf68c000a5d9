"""A run directory as one object: :class:`Run`, and the three views the three-way split asks for.

``Run.open(path)`` reads what a run is (``config.json``, ``run.json``) and opens each store once,
on first use: the capture (what crossed the wire), the knowledge store (what the run grants an
attacker beyond the messages) and the ground truth (the samples behind each message, for scoring
only). It hands them out as views that keep the split:

- :attr:`Run.attacker` (:class:`AttackerView`): captured messages, stored knowledge, the run's public
  description and the client model *architectures* (:meth:`AttackerView.model_request`), never truth;
- :meth:`Run.ground_truth` (:class:`GroundTruth`): the partition and per-message sample ids; only the
  attack runner and the metrics call it;
- :meth:`Run.models` (:class:`privfl.analysis.RunModels`): the checkpointed client models, for analysis.

Opening a run reads JSON and safetensors only; it never unpickles, and it imports no code named in the
run's files (a user's ``pkg.mod:Class`` method is resolved only when a model must be rebuilt).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from privfl.analysis.loading import RunModels
from privfl.errors import CaptureError, ConfigError
from privfl.runfiles import (
    ALIASES_KEY,
    GroundTruth,
    MessageView,
    RunFiles,
    checkpoint_aliases,
    client_index,
    client_of,
    load_checkpoint_state,
    load_partition,
    load_pool,
    read_checkpoint,
)

if TYPE_CHECKING:
    from privfl.config import TrainConfig
    from privfl.fl.method import FLMethod, LeakageContext, ModelRequest


class Run(RunFiles):
    """One run directory (see the module docstring). Use :meth:`open`; training returns one too."""

    @cached_property
    def method_cls(self) -> type[FLMethod]:
        """The method's class, resolved by name (a registered method, or an importable ``pkg.mod:Class``)."""
        from privfl.methods import resolve_method

        return resolve_method(self.method, source=f"{self.path}/config.json")

    @cached_property
    def cfg(self) -> TrainConfig:
        """The resolved :class:`~privfl.config.TrainConfig`."""
        from privfl.config import build_config, saved_run_values

        return build_config(saved_run_values(self.config), getattr(self.method_cls, "Options", None))

    @cached_property
    def attacker(self) -> AttackerView:
        """What an attacker sees of this run: messages and granted knowledge, never ground truth."""
        return AttackerView(self)

    def models(self, round: int | None = None, *, data_root: str | None = None, device: torch.device | str = "cpu") -> RunModels:
        """The client models of a round (the checkpoint keeps the latest round only) and their data."""
        from privfl.analysis.loading import RunModels

        models = RunModels(self, data_root, torch.device(device))
        if round is not None and round != models.round:
            raise ConfigError(f"{self.path} keeps the models of round {models.round} only (checkpoints hold the latest round)")
        return models

    def model_request(self, index: int) -> ModelRequest:
        """What client ``index``'s model is built from: architecture, data shape, run options."""
        from privfl.methods import ModelRequest

        if not 0 <= index < self.num_clients:
            raise ConfigError(f"client {index} does not exist; the run has clients 0..{self.num_clients - 1}")
        archs, ds = self.info.get("archs"), self.dataset
        sizes = [ds.get(k) for k in ("channels", "num_classes", "image_size")]
        if not (
            isinstance(self.info.get("method"), str)
            and isinstance(archs, list)
            and index < len(archs)
            and isinstance(archs[index], str)
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)
        ):
            raise CaptureError(f"{self.path}/run.json does not describe client {index}'s model (method, archs; dataset channels, classes, size)")
        return ModelRequest.from_run(self.info, self.config, index)


class AttackerView(MessageView):
    """The attacker's view of a run: its captured messages and the knowledge it stores, nothing else.

    It opens ``capture/`` and ``knowledge/``, never ``truth/``: the ground truth reaches only the attack
    runner's scoring, after an attack.
    """

    run: Run

    def __init__(self, run: Run | str | Path):
        super().__init__(run if isinstance(run, Run) else Run(run))

    @property
    def method_cls(self) -> type[FLMethod]:
        return self.run.method_cls

    def leakage_context(self, kind: str) -> LeakageContext | None:
        """What the method declares an attacker needs to rebuild a ``kind`` message's context."""
        return self.method_cls.leakage_context(kind)

    def model_request(self, client: str) -> ModelRequest:
        """What the attacker knows of a client's model: architecture, dataset shape, run options."""
        return self.run.model_request(client_index(client))

    def extractor(self, client: str, round: int, device: torch.device | str = "cpu"):
        """The client's extractor (a SplitModel with its features and mapping loaded), frozen, eval mode."""
        from privfl.models import build_model

        recs = self.extractor_records()
        match = [r for r in recs if r["client"] == client and r["round"] == round]
        if not match:
            have = sorted({(r["client"], r["round"]) for r in recs})
            where = ", ".join(f"{c}@r{n}" for c, n in have[:12]) or "none"
            raise CaptureError(
                f"the run stores no extractor of {client} at round {round} (it has: {where}); retrain with --knowledge-every N to keep more rounds"
            )
        rec = match[0]
        assert self.knowledge_store is not None  # a record was found in it
        model = build_model(**rec["spec"])
        model.load_extractor_state(self.knowledge_store.load(rec))
        model.eval().to(device)
        for p in model.parameters():
            p.requires_grad_(False)
        return model


__all__ = [
    "ALIASES_KEY",
    "AttackerView",
    "GroundTruth",
    "Run",
    "checkpoint_aliases",
    "client_index",
    "client_of",
    "load_checkpoint_state",
    "load_partition",
    "load_pool",
    "read_checkpoint",
]
