"""The local trainer every method shares: one seeded loop, customised through hooks.

What makes a run reproducible and resumable lives here once: the model is put in train mode, the
global RNG (dropout, noise) is seeded from (seed, "local", round, client), a fresh optimizer is made
for the round (plain SGD carries no state between rounds; Adam's state is per round too, so a
resumed run repeats it exactly), and each epoch's batches are shuffled by a generator seeded from
(seed, "shuffle", round, client, epoch). The last partial batch is kept. ``--no-shuffle --drop-last``
gives HtFLlib's data order instead (fixed order, last partial batch dropped) for parity runs.

A method changes *what* is minimised, not the loop:

- ``objective(model, x, y)`` returns the loss, or ``(loss, {name: value})`` to also report parts of it
  (FedMRL's two cross-entropies, DRDFL's eight losses); the default is cross-entropy of
  ``model.head(model.represent(x))``;
- ``parameters``/``optimizer``: which parameters to train, or a factory ``model -> optimizer`` for
  parameter groups with their own learning rates (FedMRL) or another optimizer (DRDFL's Adam);
- ``before_step(model)``: runs between ``backward`` and ``step`` (gradient clipping).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from privfl.errors import UnknownNameError
from privfl.fl.layout import compute_layout
from privfl.fl.shared import own_tensors
from privfl.seeding import seed_global, torch_generator

if TYPE_CHECKING:
    from privfl.models.split import SplitModel

ObjectiveResult = torch.Tensor | tuple[torch.Tensor, Mapping[str, torch.Tensor | float]]
# the model argument is the client's model: a SplitModel, or a method's own class (FedMRLModel, DRDFL's)
Objective = Callable[[Any, torch.Tensor, torch.Tensor], ObjectiveResult]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


@dataclass
class LocalStats:
    """What one client's local training did: mean loss per batch, mean of each reported part, steps."""

    loss: float
    parts: dict[str, float] = field(default_factory=dict)
    steps: int = 0

    def as_dict(self, loss_key: str = "train_loss") -> dict[str, float]:
        return {loss_key: self.loss, **self.parts}


def cross_entropy(model: SplitModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The default objective (FedRE Eq. 1): CE of the head on the mapped representation."""
    return F.cross_entropy(model.head(model.represent(x)), y)


def with_representation_term(extra: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> Objective:
    """CE plus ``extra(reps, logits, y)``, a regulariser on the representations (FedProto's term)."""

    def objective(model: SplitModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        reps = model.represent(x)
        logits = model.head(reps)
        return F.cross_entropy(logits, y) + extra(reps, logits, y)

    return objective


def batches_per_epoch(n: int, batch_size: int, drop_last: bool = False, min_batch: int = 1) -> int:
    """How many batches :meth:`DataView.batches` yields over ``n`` samples: every full batch, and the last
    partial one unless ``drop_last`` or it holds fewer than ``min_batch`` samples (:func:`min_train_batch`)."""
    full, rest = divmod(n, batch_size)
    return full + (1 if rest and not drop_last and rest >= min_batch else 0)


def min_train_batch(model: nn.Module, cfg: Any) -> int:
    """The smallest last batch ``model`` trains on: ``--batchnorm-min-batch`` (default 2) for a model with
    BatchNorm layers, else 1. Why: BatchNorm cannot normalise a batch of one sample wherever its feature map
    is 1x1 (torch raises "Expected more than 1 value per channel"; ResNets and MobileNetV2 reach 1x1 on 32x32
    inputs), and over one sample its batch statistics are that sample's own anyway. So by default an epoch's
    last batch of a single sample is skipped for such models, as HtFLlib skips every partial last batch
    (``drop_last=True``); it crashed a paper-scale run (HtM10) whenever a client's train split was one more
    than a multiple of the batch size. Runs saved before the option train on every batch (``SAVED_RUN_DEFAULTS``)."""
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return int(getattr(cfg, "batchnorm_min_batch", 2)) if has_batchnorm else 1


class LocalTrainer:
    """The seeded local loop (see the module docstring). One per run, shared by the method's clients."""

    def __init__(self, cfg: Any, data: Any):
        self.cfg, self.data = cfg, data
        self.shuffle = bool(getattr(cfg, "shuffle", True))
        self.drop_last = bool(getattr(cfg, "drop_last", False))

    def make_optimizer(self, params: Iterable[Any], *, lr: float | None = None, optimizer: str | None = None) -> torch.optim.Optimizer:
        """The run's optimizer (``--optimizer``, ``--lr``, ``--momentum``, ``--weight-decay``) over ``params``
        (tensors or param-group dicts, each group may set its own lr)."""
        cfg = self.cfg
        name = optimizer or cfg.optimizer
        lr = cfg.lr if lr is None else lr
        if name == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        if name == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay)
        raise UnknownNameError("optimizer", name, ["sgd", "adam"])

    def fit(
        self,
        rnd: int,
        client: Any,
        objective: Objective | None = None,
        *,
        parameters: Iterable[nn.Parameter] | None = None,
        optimizer: OptimizerFactory | None = None,
        before_step: Callable[[Any], None] | None = None,
        epochs: int | None = None,
    ) -> LocalStats:
        """``epochs`` (default ``--local-epochs``) of local training of ``client.model`` on its train split."""
        model = client.model
        own_tensors(model)  # a model aliasing a shared broadcast (stateless clients) trains its own copy
        with compute_layout(model, getattr(self.cfg, "memory_format", "contiguous")):
            model.train()
            seed_global(self.cfg.seed, "local", rnd, client.index)
            if optimizer is not None:
                opt = optimizer(model)
            else:
                opt = self.make_optimizer(model.parameters() if parameters is None else parameters)
            objective = objective or cross_entropy
            total, steps = 0.0, 0
            parts: dict[str, float] = {}
            min_batch = min_train_batch(model, self.cfg)
            for epoch in range(self.cfg.local_epochs if epochs is None else epochs):
                gen = torch_generator(self.cfg.seed, "shuffle", rnd, client.index, epoch) if self.shuffle else None
                for x, y in self.data.batches(client.train_idx, self.cfg.batch_size, gen, drop_last=self.drop_last, min_batch=min_batch):
                    out = objective(model, x, y)
                    loss, extra = (out, {}) if isinstance(out, torch.Tensor) else out
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    if before_step is not None:
                        before_step(model)
                    opt.step()
                    total += loss.item()
                    for k, v in extra.items():
                        parts[k] = parts.get(k, 0.0) + (v.item() if isinstance(v, torch.Tensor) else float(v))
                    steps += 1
            # the last step's gradients are never read again (every step starts with zero_grad): dropping them
            # frees one model's worth of memory per client between rounds (2.3 MB for cnn4, x clients)
            model.zero_grad(set_to_none=True)
            n = max(steps, 1)
            return LocalStats(total / n, {k: v / n for k, v in parts.items()}, steps)


__all__ = ["LocalStats", "LocalTrainer", "Objective", "batches_per_epoch", "cross_entropy", "min_train_batch", "with_representation_term"]
