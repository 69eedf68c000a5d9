"""FedAvg + DBE: FedAvg with the Domain Bias Eliminator (Zhang, Hua, Cao, Wang, Song, Xue, Ma, Guan,
"Eliminating Domain Bias for Federated Learning in Representation Space", NeurIPS 2023,
arXiv 2311.14975; authors' code TsingZ0/DBE, also PFLlib's ``clientdbe.py``/``serverdbe.py``).

The model is split into a shared feature extractor g (privfl: features + RM) and a shared head h.
DBE adds two things to every client i:

- **PRBM** (personalized representation bias memory): a trainable vector r_i^p of the representation's
  size d, initialised to zero, that never leaves the client. The head sees r = g(x) + r_i^p, in
  training and at inference; g(x) is the "global" part of the representation.
- **MR** (mean regularization): during local training the client keeps a running mean of g(x) over
  its batches, m_i <- (1 - mu) m_i + mu mean_batch(g(x)) (restarted every round, the previous value
  detached), and adds kappa * MR(m_i, G) to its cross-entropy, with MR = mean over the d coordinates
  of (m_i - G)^2 / 2 and G the consensus global mean.

Protocol (FedAvg otherwise, the authors' ``serverDBE.py``):

- **setup** (the paper's initialization period): the server broadcasts the initial model (``model``,
  down); every client trains one local pass of plain CE from it (no PRBM, no MR) while keeping its
  running mean, uploads that mean (``mean_rep``, up, d scalars; meta ``num_samples``) and drops the
  pass's weights again (in the authors' code the round-0 broadcast overwrites them; here the client
  reloads the copy it received, which is the same state without a second broadcast). The server takes
  the sample-weighted mean G = sum_i n_i m_i / sum_i n_i and broadcasts it (``mean_rep``, down); each
  client keeps it (a buffer ``global_mean`` of its model, so a resumed run has it). G is computed this
  once and fixed for the whole run, as in the authors' code.
- **each round**: every selected client trains its whole model and PRBM with CE(h(g(x) + r_i^p), y)
  + kappa MR for ``--local-epochs``, uploads the shared part of its model (``model``, up: every tensor
  except ``prbm`` and ``global_mean``; meta ``num_samples``, ``lr``, ``tau``); the server averages the
  uploads weighted by ``num_samples`` (FedAvg) and broadcasts the average (``model``, down) to every
  client, which overwrites its shared part and keeps its PRBM.

What is sent: per client per round the shared model up and down, P scalars each way, P = the plain
model's state dict. HtFLlib's/PFLlib's 4-layer CNN on CIFAR-10 (FedAvgCNN, privfl's ``cnn4`` at
3x32x32) has P = 878,538, so 10 clients send 8,785.38e3 scalars each way per round, as FedAvg does
(FedRE [001] Table 11 / [000] Table 9 give FedAvgDBE exactly FedAvg's counts). The one-off setup
exchange comes on top and is left out of the per-round counts, as the table does: d scalars up per
client, d down per client (d = 512 for that CNN), plus the setup model broadcast.

Decisions where the paper is open or the references differ:

- **kappa and mu.** Defaults kappa = 50 and mu = 1.0: the authors' ``run_me.sh`` (``-klw 50 -mo 1``).
  With mu = 1 the running mean is the mean representation of the current batch, and the uploaded
  mean is that of the client's last batch of the setup pass. PFLlib's ``main.py`` defaults are
  ``-mo 0.1 -klw 0`` (MR off); FedRE's papers do not say which values their FedAvgDBE row used.
- **MR's form.** As the authors' code: the mean over coordinates of (m - G)^2 / 2, with the running
  mean's gradient flowing through the current batch only (the previous value is detached).
- **Where the representation is taken.** DBE's g(x) is the input of the last linear layer (PFLlib's
  ``model.base``); here it is ``represent(x)`` (features + RM), which for ``cnn4`` is that input.
- **PRBM's optimiser.** The authors step PRBM with its own plain SGD at the local learning rate; here
  the run's optimiser trains it with the model (same lr; ``--momentum`` and ``--weight-decay`` apply
  to it as to the model, both 0 by default, which is the authors' setting).
  PRBM is not trained in the setup pass (it does not take part there, as in the authors' code).
- **Setup pass seeds.** The pass runs the shared seeded loop with round key -1 (:data:`SETUP_ROUND`),
  so that its shuffling differs from round 0's.
- **Evaluation.** The authors score h(g(x) + r_i^p) with the latest broadcast and the client's own
  PRBM: ``--eval global``. ``personal_parts`` are the broadcast-overwritten parts (features, mapping,
  head): ``--eval personal`` scores them as they were after the client's last local training, with
  the same PRBM.
- **Truth of a mean upload.** The client's whole train split (with mu < 1 every seen sample has some
  weight; with mu = 1 only the last batch does, a subset).

Leakage: a ``model`` upload is full parameters of the shared part; its previous state is the last
``model`` the client received. The attacker's rebuilt client model holds PRBM at zero (its value at
setup: the client never sends it) and its loss is CE only (MR is left out). The extractor knowledge
(``exposes``) is the one that produced the setup means: the client's extractor during the last batch
of its setup pass, stored at round 0 when the run keeps knowledge of round 0 (``--knowledge-rounds 0``,
or a one-round run); no later round sends a representation. (``AttackerView.messages`` leaves out
every setup message at present, uploads included, so the means reach an attack only once it keeps the
setup messages that carry client data.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from privfl.capture.message import Message
from privfl.config import opt
from privfl.errors import ConfigError
from privfl.fl.method import METHODS, Client, ClientReply, GlobalModelServer, LeakageContext, ModelRequest, module_tensors
from privfl.fl.trainer import Objective
from privfl.methods.fedmrl import weighted_average
from privfl.models.split import SplitModel

#: the seeded loop's round key of the setup pass (the initialization period comes before round 0)
SETUP_ROUND = -1
#: client-model tensors that never cross the wire inside a ``model`` message
PRIVATE = ("prbm", "global_mean")


class DBEModel(SplitModel):
    """A :class:`SplitModel` with DBE's two per-client tensors: ``prbm`` (PRBM, trained, private) and the
    buffer ``global_mean`` (G as received at setup). Same parameter names as the plain model otherwise,
    so its shared part loads into and from the server's global model unchanged."""

    global_mean: Tensor  # a buffer (typed for mypy: nn.Module's attribute access is untyped)

    def __init__(self, base: SplitModel):
        super().__init__(base.arch, base.features, base.feature_dim, base.mapping, base.head, base.spec)
        d = int(base.spec["rep_dim"])
        self.prbm = nn.Parameter(torch.zeros(d))
        self.register_buffer("global_mean", torch.zeros(d))

    def forward(self, x: Tensor) -> Tensor:
        """h(g(x) + r^p): the client's prediction, in training and at inference."""
        return self.head(self.represent(x) + self.prbm)


def shared_state(model: nn.Module) -> dict[str, Tensor]:
    """The tensors a ``model`` message carries: the client model's state without PRBM and G."""
    return {k: v for k, v in module_tensors(model).items() if k not in PRIVATE}


def load_shared_state(model: nn.Module, tensors: dict[str, Tensor]) -> None:
    """Overwrite the shared part of ``model`` with a received ``model`` message; PRBM and G stay."""
    own = model.state_dict()
    missing = set(own) - set(tensors) - set(PRIVATE)
    unexpected = set(tensors) - set(own)
    if missing or unexpected or set(tensors) & set(PRIVATE):
        raise ConfigError(f"a model message does not fit the DBE client model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict({k: v.to(own[k].device) for k, v in tensors.items()}, strict=False)


class RunningMean:
    """m <- (1 - mu) m + mu mean_batch(rep), from m = 0; the stored value is detached, so the returned
    one carries the gradient of the current batch only (the authors' ``running_mean``)."""

    def __init__(self, momentum: float):
        self.momentum = float(momentum)
        self.value: Tensor | None = None

    def update(self, rep: Tensor) -> Tensor:
        previous = torch.zeros_like(rep[0]).detach() if self.value is None else self.value
        new = (1.0 - self.momentum) * previous + self.momentum * rep.mean(dim=0)
        self.value = new.detach()
        return new


def mean_regularizer(running: Tensor, global_mean: Tensor) -> Tensor:
    """MR: the mean over coordinates of (m - G)^2 / 2."""
    return (0.5 * (running - global_mean) ** 2).mean()


def dbe_objective(kappa: float, momentum: float, train_prbm: bool = True) -> Objective:
    """CE(h(g(x) + r^p), y) + kappa MR(m, G) with a running mean m restarted for this local training;
    reports ``ce`` and ``mr`` (before kappa). The MR term stays in the graph for kappa = 0 (exact zeros),
    so kappa = 0 runs the same code."""
    running = RunningMean(momentum)

    def objective(model: DBEModel, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        rep = model.represent(x)
        mr = mean_regularizer(running.update(rep), model.global_mean)
        prbm = model.prbm if train_prbm else model.prbm.detach()
        ce = F.cross_entropy(model.head(rep + prbm), y)
        return ce + kappa * mr, {"ce": ce.detach(), "mr": mr.detach()}

    return objective


@dataclass
class FedAvgDBEOptions:
    #: the quick CPU default of ``python -m privfl.train fedavgdbe`` (flags override it): identical client
    #: models, a seeded 6k-image subset, 5 rounds (about a minute on two cores)
    run_defaults: ClassVar[dict[str, Any]] = {"model_group": "homo-cnn4", "subsample": 6000, "rounds": 5}

    kappa: float = opt(50.0, "MR weight kappa (authors' run_me.sh: 50; PFLlib's default 0 turns MR off)", min=0)
    mean_momentum: float = opt(
        1.0,
        "momentum mu of the running mean of representations (authors' run_me.sh: 1 = the current batch's mean; PFLlib default 0.1)",
        min_exclusive=0,
        max=1,
    )
    train_prbm: bool = opt(True, "train the PRBM vector (off: it stays zero; with kappa 0 the method is FedAvg)")


@METHODS.register("fedavgdbe")
class FedAvgDBE(GlobalModelServer):
    """FedAvg whose clients add a private PRBM vector to the representation and regularise their running
    mean of representations towards the global mean computed once at setup (module docstring)."""

    parallel_clients = True
    name = "fedavgdbe"
    sends = {"model": "up/down", "mean_rep": "up/down"}
    exposes = ("extractor",)
    Options = FedAvgDBEOptions
    requires_homogeneous = True
    #: the broadcast overwrites these; PRBM (and G) stay the client's own. (The ignore: mypy infers
    #: GlobalModelServer's unannotated ("",) as tuple[str]; FLMethod declares tuple[str, ...].)
    personal_parts = ("features", "mapping", "head")
    leakage = {
        "model": LeakageContext(
            previous="model",
            note="PRBM never leaves the client: the attacker's client model holds it at zero, and its loss is CE without DBE's mean regulariser",
        )
    }
    paper = "Zhang et al., Eliminating Domain Bias for Federated Learning in Representation Space (DBE), NeurIPS 2023 (arXiv 2311.14975)"

    @classmethod
    def build_client_model(cls, req: ModelRequest) -> DBEModel:
        base = super().build_client_model(req)
        if not isinstance(base, SplitModel):
            raise ConfigError(f"fedavgdbe needs a SplitModel client model, got {type(base).__name__}")
        return DBEModel(base)  # PRBM and G are zeros: the RNG draws are those of the plain model

    def __init__(self, env):
        super().__init__(env)
        self.global_mean = torch.zeros(int(self.cfg.rep_dim), device=env.device)  # G, known after setup

    # -------------------------------------------------------------- protocol, in roles
    def broadcast(self, rnd: int, phase: str = "train") -> None:
        """The global model to every client; each overwrites its shared part and keeps PRBM and G (:meth:`receive`)."""
        self.deliver(self.channel.broadcast(rnd, self.client_names(), "model", module_tensors(self.global_model), meta={"phase": phase}))

    def receive(self, client: Client, msg: Message) -> None:
        """Client side: a global model replaces the shared part; the global mean G is kept in the model's buffer."""
        if msg.kind == "mean_rep":
            client.model.global_mean.copy_(msg.tensors["rep"])
        else:
            load_shared_state(client.model, msg.tensors)

    # The initialization period (all captured as round 0, meta ``phase=setup``): the model down (setup),
    # one plain-CE pass per client with its running mean and the mean up (client_setup), G down (server_setup).

    def client_setup(self, client: Client) -> list[tuple[Message, dict[str, Tensor] | None]]:
        """Client side: the setup pass from the received model, its mean of representations up."""
        mean = self.setup_pass(client)
        meta = {"phase": "setup", "num_samples": len(client.train_idx), "momentum": float(self.opts.mean_momentum), "arch": client.arch}
        return [(Message(0, client.name, "server", "mean_rep", {"rep": mean}, meta), {"indices": client.train_idx.cpu()})]

    def server_setup(self, uploads: list[Message]) -> None:
        """Server side: G, the sample-weighted mean of the received means, to every client."""
        self.global_mean = weighted_average(uploads)["rep"].to(self.env.device)
        self.deliver(self.channel.broadcast(0, self.client_names(), "mean_rep", {"rep": self.global_mean}, meta={"phase": "setup"}))

    def setup_pass(self, client: Client) -> Tensor:
        """One local pass of plain CE on the shared parameters from the received model, tracking the
        running mean; returns the mean and puts the received model back. Files the extractor of the
        last batch as round-0 knowledge when the run keeps it."""
        model: DBEModel = client.model
        received = {k: v.clone() for k, v in shared_state(model).items()}
        running = RunningMean(self.opts.mean_momentum)
        keep = self.env.knowledge.wants(0)
        last: dict[str, dict[str, Tensor]] = {}

        def objective(m: DBEModel, x: Tensor, y: Tensor) -> Tensor:
            rep = m.represent(x)
            running.update(rep)
            if keep:  # the extractor that computes this batch (the last one is what produced the mean)
                last["extractor"] = m.extractor_state()
            return F.cross_entropy(m.head(rep), y)

        shared = [p for name, p in model.named_parameters() if name not in PRIVATE]
        self.trainer.fit(SETUP_ROUND, client, objective, parameters=shared)  # not self.fit: no personal copy
        if keep and last:
            model.load_extractor_state(last["extractor"])
            self.env.knowledge.record_extractor(0, client)
        load_shared_state(model, received)
        if running.value is None:  # no batch (an empty split, or --drop-last with fewer samples than a batch)
            return torch.zeros_like(model.global_mean)
        return running.value.clone()

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        """Client side: local training with PRBM and the mean regulariser; the shared part up."""
        o = self.opts
        params = [p for name, p in client.model.named_parameters() if name != "global_mean" and (name != "prbm" or o.train_prbm)]
        stats = self.fit(rnd, client, dbe_objective(o.kappa, o.mean_momentum, o.train_prbm), parameters=params)
        meta = {"arch": client.arch, "num_samples": len(client.train_idx), "lr": self.cfg.lr, "tau": stats.steps}
        msg = Message(rnd, client.name, "server", "model", shared_state(client.model), meta)
        return ClientReply([(msg, {"indices": client.train_idx.cpu()})], stats.as_dict())

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """Server side: FedAvg of the received shared parts (weighted by num_samples), broadcast."""
        self.global_model.load_state_dict(weighted_average(uploads))
        self.broadcast(rnd)
        return {}

    # -------------------------------------------------------------- state
    def server_state(self) -> dict[str, Tensor]:
        return {**module_tensors(self.global_model), "dbe.global_mean": self.global_mean}

    def load_server_state(self, state: dict[str, Tensor]) -> None:
        self.global_model.load_state_dict({k: v for k, v in state.items() if k != "dbe.global_mean"})
        if "dbe.global_mean" in state:
            self.global_mean = state["dbe.global_mean"].to(self.env.device)


__all__ = [
    "PRIVATE",
    "SETUP_ROUND",
    "DBEModel",
    "FedAvgDBE",
    "FedAvgDBEOptions",
    "RunningMean",
    "dbe_objective",
    "load_shared_state",
    "mean_regularizer",
    "shared_state",
]
