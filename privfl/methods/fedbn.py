"""FedBN (Li, Jiang, Zhang, Kamp, Dou, "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", ICLR 2021): FedAvg in which every BatchNorm layer stays with its client.

Per round (the paper's Algorithm 1):

1. each client holds the shared (non-BN) weights it last received and its own BN layers;
2. each selected client trains its whole model with plain CE for ``--local-epochs`` (the shared seeded
   loop, nothing added): its BN affine parameters and running statistics move with its own data;
3. it uploads the non-BN part of its state dict (kind ``model``, up; meta ``num_samples``, ``lr``,
   ``tau``): BN weights, biases, running means, running variances and step counters never leave it;
4. the server averages each received tensor over the clients, weighted by ``num_samples``
   (``weighting``), and broadcasts the averaged non-BN part (``model``, down) to every client, which
   overwrites exactly those tensors and keeps its BN layers.

What is sent, per client per round: the model's state dict without its BN layers, each way,
P - sum_BN (4 c + 1) scalars, where P counts the whole state dict and a BatchNorm over c channels holds
weight, bias, running mean and running variance (c each) and one step counter. privfl's
``resnet-tiny`` (BN over 16, 32, 32, 32, 64, 64, 64 channels) leaves 4 * 304 + 7 = 1,223 scalars local;
torchvision's ResNet-18 with a 10-class head (20 BN layers, 4,800 channels) leaves 19,220 local and
sends 11,191,262 - 19,220 = 11,172,042, its parameters without the BN affine ones. On a model without
BatchNorm (``homo-cnn4``) FedBN sends and computes exactly what FedAvg does.

Decisions where the paper is open or the references differ:

- **Which tensors are BN.** By module type, not by name: every submodule that is an
  ``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm`` or a lazy BatchNorm (found with ``named_modules``)
  contributes all its state-dict entries (affine parameters and running statistics, the counter too).
  The authors' code (med-air/FedBN ``communication``) and PFLlib's ``clientBN.set_parameters`` keep
  tensors whose *name* contains ``bn`` local, which misses BN layers named by position: in
  ``resnet-tiny`` the stem's ``features.1`` and the shortcut ``downsample.1`` would be averaged.
  Other normalisations (GroupNorm, LayerNorm) are shared, as in the paper, which is about BN only.
- **What goes up.** Only the non-BN tensors. The authors' code and PFLlib have each client hand over
  its whole model and skip BN at aggregation (authors) or at loading (PFLlib); sending BN would give
  the server exactly the per-client statistics FedBN keeps local, so here they never cross the wire.
- **Weighting.** ``samples`` (default): as FedAvg here and PFLlib's ``aggregate_parameters``;
  ``uniform``: the authors' code (``client_weights = 1/client_num``; their clients hold equal-size
  shares, where both agree).
- **Initialisation.** The server builds its global model with its own seed (as FedAvg does) and
  broadcasts its non-BN part at setup; every client starts from its own BN layers at their
  initialisation (weight 1, bias 0, running mean 0, variance 1: the same on every client).
- **Evaluation.** ``--eval global`` scores each client with the averaged shared weights it received
  and its own BN layers (the paper's evaluation: each client tests its model on its own test split);
  ``personal_parts = ("",)``: ``--eval personal`` scores the whole model as it was after the client's
  local training (the broadcast overwrites the non-BN part only, so its BN layers are the same in both).
- **State across rounds.** The local BN layers live in the client models, which the engine's
  checkpoints hold: ``--resume`` continues with them (a test kills and resumes a run).

Leakage: an upload is the non-BN part of the whole client model, computed from the last ``model`` the
client received. An attacker (the server) knows neither the client's BN affine parameters nor its
running statistics: gradient-leakage and membership attacks rebuild the client model with BN at its
initialisation, say so in their warnings (tensors never transmitted), and the ``LeakageContext`` note
names what the reconstruction leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from privfl.capture.message import Message
from privfl.config import opt
from privfl.fl.method import METHODS, Client, ClientReply, GlobalModelServer, LeakageContext, average_states, module_tensors

#: the module types whose parameters and buffers FedBN keeps local
BN_TYPES: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
)


def bn_tensor_names(model: nn.Module) -> frozenset[str]:
    """State-dict names of every BatchNorm submodule's parameters and buffers, found by module type."""
    names: set[str] = set()
    for path, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, BN_TYPES):
            prefix = f"{path}." if path else ""
            names.update(prefix + key for key in module.state_dict())
    return frozenset(names)


def shared_state(model: nn.Module, local: frozenset[str]) -> dict[str, torch.Tensor]:
    """``model``'s state dict without the ``local`` (BN) names: what FedBN sends."""
    return {k: v for k, v in module_tensors(model).items() if k not in local}


def load_shared_state(model: nn.Module, tensors: dict[str, torch.Tensor], local: frozenset[str]) -> None:
    """Overwrite the non-BN tensors of ``model`` with ``tensors``, keeping its BN layers; anything but
    exactly the non-BN names is refused (a message that would touch BN, or leave a shared tensor stale)."""
    stray = sorted(set(tensors) & local)
    missing = sorted(set(model.state_dict()) - local - set(tensors))
    if stray or missing:
        raise RuntimeError(f"FedBN shared state mismatch: BN tensors {stray[:3]} sent, non-BN tensors {missing[:3]} missing")
    device = next(iter(model.state_dict().values())).device
    model.load_state_dict({k: v.to(device) for k, v in tensors.items()}, strict=False)


@dataclass
class FedBNOptions:
    #: the quick CPU default of ``python -m privfl.train fedbn`` (flags override it): the homogeneous
    #: BatchNorm ResNet, a seeded 6k-image subset, 5 rounds (about a minute on two cores)
    run_defaults: ClassVar[dict[str, Any]] = {"model_group": "homo-resnet-tiny", "subsample": 6000, "rounds": 5}

    weighting: str = opt(
        "samples",
        "average of the shared tensors: samples (FedAvg, PFLlib) or uniform (the authors' code)",
        choices=("samples", "uniform"),
    )


@METHODS.register("fedbn")
class FedBN(GlobalModelServer):
    """FedAvg of every tensor but the BatchNorm layers', which stay with each client (module docstring)."""

    parallel_clients = True
    name = "fedbn"
    sends = {"model": "up/down"}
    Options = FedBNOptions
    requires_homogeneous = True
    #: the broadcast overwrites the non-BN tensors only, so the whole model after local training is the
    #: client's own (its BN layers are unchanged by the broadcast)
    personal_parts = ("",)
    leakage = {
        "model": LeakageContext(
            previous="model",
            note=(
                "BatchNorm layers never cross the wire: the attacker's model keeps BN at its initialisation (weight 1, bias 0, "
                "running mean 0, variance 1) in eval mode, while the client trained with batch statistics and its own BN weights"
            ),
        )
    }
    paper = "Li et al., FedBN: Federated Learning on Non-IID Features via Local Batch Normalization, ICLR 2021"

    def __init__(self, env):
        super().__init__(env)
        #: the BN names of the (homogeneous) client models: never sent, never overwritten
        self.local_names = bn_tensor_names(self.global_model)

    def broadcast(self, rnd: int, phase: str = "train") -> None:
        """The averaged non-BN tensors to every client (each applies them in :meth:`receive`)."""
        tensors = shared_state(self.global_model, self.local_names)
        self.deliver(self.channel.broadcast(rnd, self.client_names(), "model", tensors, meta={"phase": phase}))

    def receive(self, client: Client, msg: Message) -> None:
        """Overwrite the non-BN tensors; the client keeps its BN layers."""
        load_shared_state(client.model, msg.tensors, self.local_names)

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        stats = self.fit(rnd, client)  # plain CE on the whole model, BN included
        meta = {"arch": client.arch, "num_samples": len(client.train_idx), "lr": self.cfg.lr, "tau": stats.steps}
        msg = Message(rnd, client.name, "server", "model", shared_state(client.model, self.local_names), meta)
        return ClientReply([(msg, {"indices": client.train_idx.cpu()})], {"train_loss": stats.loss})

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        # the server uses what it received (after defenses), nothing else; its own BN layers are never used
        averaged = average_states(uploads, self.global_model.state_dict(), self.opts.weighting)
        load_shared_state(self.global_model, averaged, self.local_names)
        self.broadcast(rnd)
        return {}


__all__ = ["BN_TYPES", "FedBN", "FedBNOptions", "bn_tensor_names", "load_shared_state", "shared_state"]
