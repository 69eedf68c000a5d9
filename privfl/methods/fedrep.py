"""FedRep (Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared Representations for Personalized
Federated Learning", ICML 2021, arXiv 2102.07078): one shared representation, a personal head per client.

The client model is split as privfl's :class:`~privfl.models.split.SplitModel`: the **body** is the
representation phi = extractor + representation mapping (``features.*``, ``mapping.*``), the **head**
h_i is ``head.*``. The head never leaves the client. The objective is
min_phi (1/n) sum_i min_{h_i} f_i(h_i o phi). Per round t (the paper's Algorithm 1; the step numbers
below are ours, the paper writes them as lines of the algorithm, not as numbered equations):

1. each selected client i starts from the global body phi^t it last received and its own head h_i;
2. it trains the head with the body frozen for ``head_epochs`` (the head update
   ``h_i <- GRD(f_i(h_i, phi^t), h_i, alpha)``, repeated), then the body with that new head frozen for
   ``body_epochs`` (the representation update ``phi_i <- GRD(f_i(h_i, phi_i), phi_i, alpha)``, repeated);
3. it uploads phi_i (kind ``model``, up; meta ``num_samples``);
4. the server averages the bodies, phi^{t+1} = sum_i (n_i / sum_j n_j) phi_i over the selected clients
   (``weighting=samples``, as PFLlib; the paper's Algorithm 1 averages uniformly over the selected
   clients: ``weighting=uniform``), and broadcasts phi^{t+1} (kind ``model``, down) to every client,
   which loads it under its own head.

What is sent, per client per round: its body up and the global body down, each ``|phi|`` scalars: the
parameter count of features + mapping. homo-cnn4 on Fashion-MNIST: 832 + 51,264 + 524,800 = 576,896;
the same CNN on CIFAR (3x32x32): 873,408; torchvision ResNet-18 without its fc (privfl's ``resnet18``,
3 channels; DRDFL's tables use a ResNet-18): 11,176,512. The setup broadcast of the initial body
(round 0, meta ``phase=setup``) comes once on top.

Decisions where the paper is open or the references differ:

- **Epochs per phase.** The authors' code (lgcollins/FedRep) runs ``local_ep`` = 10 epochs, the last
  ``local_rep_ep`` = 1 of them on the body (so 9 head + 1 body); PFLlib's ``clientrep.py`` runs
  ``plocal_epochs`` (default 1) head epochs, then ``local_epochs`` (default 1) body epochs; DRDFL's
  Tables I/II run 4 body + 1 head epochs (the DRDFL paper's experiment settings). Here ``head_epochs`` defaults to 1
  (PFLlib and DRDFL) and ``body_epochs`` defaults to ``--local-epochs`` (PFLlib's mapping, which also keeps
  the run's ``local_epochs`` equal to the steps behind an upload for gradient-leakage attacks); DRDFL's
  setting is ``--local-epochs 4`` (or ``--body-epochs 4``) with ``--head-epochs 1``.
- **Freezing.** Each phase trains through the shared :class:`~privfl.fl.trainer.LocalTrainer`
  with ``parameters=`` the trained part and the other part's ``requires_grad`` off (as PFLlib), so no
  gradient is computed for it. Both phases use the run's optimizer (PFLlib: plain SGD with the same lr
  for both). The trainer seeds each call from (seed, round, client, epoch), so the head's epoch e and the
  body's epoch e see the same batch order; PFLlib's shuffling loader draws a new order each epoch.
- **What the body message holds.** Parameters only, under the client model's names. Buffers
  (BatchNorm running statistics of resnet-style bodies) stay with each client: PFLlib's
  ``set_parameters`` and its server average copy ``parameters()`` only, and DRDFL counts parameters.
  The model is in train mode in both phases (as PFLlib), so a BatchNorm body's running statistics also
  move during the head epochs; its parameters do not.
- **Initial body.** The server builds the client architecture with its own seed (as
  :class:`~privfl.fl.method.GlobalModelServer`) and broadcasts its body at setup; heads start from
  each client's own initialisation (PFLlib: one shared initial model; heads then diverge anyway).
- **Evaluation.** PFLlib's FedRep evaluates right after ``send_models``: each client's model with the
  received global body and its own head, which is ``--eval global`` here. ``personal_parts`` = the body:
  ``--eval personal`` scores each client with its own body as it was after its last local training.
- **Leakage context.** An upload's tensors are the body's parameters named as in the client model; the
  state they were trained from is the last ``model`` (global body) the client received. The attacker's
  module is ``features`` (prefix ``features.``) with a random ``probe`` classifier in place of the private
  head. With the default parameter-free mappings (``ap``/``mp``) that module holds every transmitted
  tensor; with ``--mapping fc`` the ``mapping.*`` tensors are sent but lie outside the attacker's module.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from privfl.capture.message import Message
from privfl.config import opt
from privfl.errors import ConfigError
from privfl.fl.method import METHODS, Client, ClientReply, FLMethod, LeakageContext
from privfl.fl.trainer import batches_per_epoch, min_train_batch
from privfl.methods.lgfedavg import average_heads
from privfl.seeding import seed_global

#: the client-model prefixes of the shared representation (features + representation mapping)
BODY_PREFIXES = ("features.", "mapping.")


def body_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The body's parameters (features + mapping) under the client model's names."""
    return {k: p for k, p in model.named_parameters() if k.startswith(BODY_PREFIXES)}


def head_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every other parameter of the client model: the personal head."""
    return {k: p for k, p in model.named_parameters() if not k.startswith(BODY_PREFIXES)}


def body_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the body's parameters: what a body message carries."""
    return {k: p.detach().clone() for k, p in body_parameters(model).items()}


@torch.no_grad()
def load_body(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Overwrite the body's parameters with a body message's tensors (the head and buffers are kept)."""
    params = body_parameters(model)
    if set(tensors) != set(params):
        raise ValueError(f"a body message must hold exactly the body's parameters; differs in {sorted(set(tensors) ^ set(params))[:5]}")
    for k, v in tensors.items():
        params[k].copy_(v.to(params[k]))


@contextmanager
def frozen(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """Turn ``requires_grad`` off for ``params`` inside the block (no gradient computed, none stored)."""
    params = list(params)
    before = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(params, before):
            p.requires_grad_(flag)


@dataclass
class FedRepOptions:
    #: the quick CPU default of ``python -m privfl.train fedrep`` (flags override it)
    run_defaults: ClassVar[dict[str, Any]] = {"model_group": "homo-cnn4", "subsample": 6000, "rounds": 5}

    head_epochs: int = opt(1, "epochs on the personal head with the body frozen, first (PFLlib plocal_epochs; DRDFL: 1)", min=0)
    body_epochs: int | None = opt(
        None, "epochs on the shared body with the head frozen, second (default: --local-epochs, as PFLlib; DRDFL: 4)", min=0
    )
    weighting: str = opt(
        "samples", "body average: samples (PFLlib: weighted by train-set size) or uniform (the paper's Algorithm 1)", choices=("samples", "uniform")
    )


@METHODS.register("fedrep")
class FedRep(FLMethod):
    """Shared body averaged by the server, personal head trained first with the body frozen (module docstring)."""

    parallel_clients = True
    name = "fedrep"
    sends = {"model": "up/down"}
    Options = FedRepOptions
    requires_homogeneous = True  # one body architecture to average
    personal_parts = ("features", "mapping")  # the broadcast overwrites the body; the head is the client's
    leakage = {
        "model": LeakageContext(
            previous="model",
            module="features",
            prefix="features.",
            readout="probe",
            note="the client's private head is replaced by the attacker's random probe; with --mapping fc the sent mapping.* "
            "tensors are outside the attacker's module",
        )
    }
    paper = "Collins, Hassani, Mokhtari, Shakkottai, Exploiting Shared Representations for Personalized Federated Learning (FedRep), ICML 2021"

    def __init__(self, env):
        super().__init__(env)
        from privfl.models import build_model

        if self.opts.head_epochs == 0 and self.body_epochs == 0:
            raise ConfigError("fedrep: --head-epochs and --body-epochs are both 0, so no client would train anything")
        seed_global(self.cfg.seed, "init", "server-model")  # the same initial weights as GlobalModelServer's model
        self.body = body_state(build_model(**env.clients[0].model.spec).to(env.device))

    @property
    def body_epochs(self) -> int:
        return self.cfg.local_epochs if self.opts.body_epochs is None else self.opts.body_epochs

    def setup(self) -> None:
        self.broadcast_body(0, phase="setup")

    def broadcast_body(self, rnd: int, phase: str = "train") -> None:
        """The global body to every client (one message each); each loads its copy under its own head (:meth:`receive`)."""
        self.deliver(self.channel.broadcast(rnd, self.client_names(), "model", self.body, meta={"phase": phase}))

    def receive(self, client: Client, msg: Message) -> None:
        load_body(client.model, msg.tensors)

    def train_client(self, rnd: int, client: Client) -> dict[str, float]:
        """The head phase with the body frozen, then the body phase with the head frozen."""
        model = client.model
        out: dict[str, float] = {}
        if self.opts.head_epochs > 0:
            head = list(head_parameters(model).values())
            with frozen(body_parameters(model).values()):
                out["head_loss"] = self.fit(rnd, client, parameters=head, epochs=self.opts.head_epochs).loss
        if self.body_epochs > 0:
            body = list(body_parameters(model).values())
            with frozen(head_parameters(model).values()):
                out["body_loss"] = self.fit(rnd, client, parameters=body, epochs=self.body_epochs).loss
        out["train_loss"] = out.get("body_loss", out.get("head_loss", float("nan")))  # the last phase's mean batch loss
        return out

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        """Client side: head then body training, the body up."""
        metrics = self.train_client(rnd, client)
        n = len(client.train_idx)
        steps = self.body_epochs * batches_per_epoch(n, self.cfg.batch_size, self.cfg.drop_last, min_train_batch(client.model, self.cfg))
        meta = {"arch": client.arch, "num_samples": n, "local_steps": steps}
        msg = Message(rnd, client.name, "server", "model", body_state(client.model), meta)
        return ClientReply([(msg, {"indices": client.train_idx.cpu()})], metrics)

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """Server side: the average of the received bodies (after defenses), to every client."""
        self.body = average_heads(uploads, self.opts.weighting)
        self.broadcast_body(rnd)
        return {}

    def server_state(self) -> dict[str, torch.Tensor]:
        return dict(self.body)

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        self.body = {k: v.to(self.env.device) for k, v in state.items()}


__all__ = ["BODY_PREFIXES", "FedRep", "FedRepOptions", "body_parameters", "body_state", "frozen", "head_parameters", "load_body"]
