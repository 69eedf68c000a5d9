"""DFedPGP: decentralised partial personalisation on a neighbour graph (Liu, Shi, Li, Wu, Wang, Shen,
"Decentralized Directed Collaboration for Personalized Federated Learning", CVPR 2024, arXiv 2405.17876).

DRDFL's reference [18] and the row "DFedPGP | Output layer | 213.36M" of its Tables I/II
(DRDFL App. VII-B3, Tables I and II). The arXiv number 2305.15157 sometimes quoted for it is the same
group's earlier paper (Shi et al., "Towards More Suitable Personalization in Federated Learning via
Decentralized Partial Model Training", which proposes DFedAlt/DFedSalt); DFedPGP is the CVPR 2024
follow-up that adds directed, asymmetric links with push-sum de-biasing ("Partial Gradient Push").

Each client i holds a shared part u_i, the body (``features.*`` + ``mapping.*`` of the privfl
:class:`~privfl.models.split.SplitModel`), and a personal part v_i, the head (``head.*``, DRDFL's
"Output layer"). The head never leaves the client. One round t (synchronous, as DRDFL's ring rounds,
its Alg. 1):

1. every live node sends its body as it stands after round t-1 to each of its out-neighbours of round t
   (kind ``model``, direction ``peer``; meta ``num_samples``, ``lr``, ``local_steps``, ``previous_round``,
   ``push_weight`` mu_i and ``out_degree`` d_i);
2. it mixes: with push-sum (the paper's de-biasing on directed graphs, ``mixing=push-sum``), node i
   weighs each body z_j of j in {i} + in(i) by a_j = mu_j / (d_j + 1), sets
   z_i <- sum_j a_j z_j / sum_j a_j and mu_i <- sum_j a_j (the column-stochastic push of x_j = mu_j z_j
   and of mu_j, divided out: z = x / mu). With ``mixing=mean`` (the public code's pull average) every
   a_j = 1. On a regular graph (every live node sends to and receives from the same number of nodes: the
   ring, with or without failures, the bidirectional ring, a k-regular or a complete graph without
   failures) mu stays 1 and both give the plain mean of the own and the received bodies;
3. it updates the personal part for K_v = ``head_epochs`` epochs with the body frozen
   (v <- v - eta_v grad_v F_i(u, v)), then the shared part for K_u = ``body_epochs`` epochs with the new
   head frozen (u <- u - eta_u grad_u F_i(u, v)), both through the shared seeded
   :class:`~privfl.fl.trainer.LocalTrainer`.

What is sent, per directed live link per round: the body's state, |u| scalars (parameters and buffers of
features + mapping; no aux). homo-cnn4 on Fashion-MNIST: 576,896; torchvision ResNet-18 without its fc
at 3x32x32: 11,176,512 parameters + 9,620 BatchNorm buffer entries = 11,186,132. On DRDFL's 20-node ring
(20 links) that is 20 x 11,186,132 = 223.72e6 scalars per round, i.e. 213.36 x 2^20: DRDFL's "#Comm"
213.36M is exactly this count in units of 2^20 (its FedNova, 213.46M, is the full state dict the same
way, 20 x 11,191,262 / 2^20).

Reference code: the public implementation in SafeAI-Wshuai/pDFL (``fedml_api/standalone/dfedpgp``, built on
DisPFL's code base; its launcher names the project DFedPGP), called "the public code" below; no PFLlib or
HtFLlib version exists.

Decisions where the paper is open or its code differs:

- **Graph.** The default ``--topology ring`` is DRDFL's unidirectional ring (its Sec. VII-B3 runs the
  decentralised baselines on it). The paper's own setting is a directed, time-varying graph in which each
  of 100 clients pulls from 10 random others per round: ``--topology random --degree 10`` (the public
  code's ``cs=random``); ``ring2`` is its ``cs=ring``.
- **Mixing.** ``push-sum`` (default: the paper's gradient push; mu_i is kept per node in the checkpoint)
  or ``mean`` (the public code averages the pulled models uniformly, a row-stochastic mix that is biased
  on directed graphs). The push-sum weight of a node is applied to what it mixes, not to its gradient
  step: local SGD runs on the de-biased body z_i, as the public code trains its model directly.
- **What the body message holds.** The body's state dict, BatchNorm running statistics included (the
  public code mixes the whole state dict except the head, and DRDFL's 213.36M counts them); integer
  buffers (``num_batches_tracked``) are mixed and rounded.
- **Local steps.** ``head_epochs`` (K_v) defaults to 1 and ``body_epochs`` (K_u) to ``--local-epochs``
  (the public code: one epoch each); ``head_lr`` (eta_v) defaults to the run's ``--lr`` (eta_u; the public
  code's defaults are 0.001 for the head and 0.1 for the body, ``--head-lr 0.001 --lr 0.1``). Its lr decay
  (0.99 per round) is left out so that DRDFL's rows share one schedule; its momentum 0.9 and weight decay
  5e-4 are the run's ``--momentum`` and ``--weight-decay``, and its gradient clipping at norm 10 is not
  in the paper and not applied.
- **Initialisation.** ``shared_init`` (default on): every client starts from one model drawn from a seed
  all nodes know (the public code copies one initial model to every client), so no message is needed.
- **Failures.** A node that is down (``--failures``, ``--failure-rate``) neither sends, receives nor
  trains in that round (the graph has no link to it); it sends its last state when it comes back.
- **Evaluation.** Nothing overwrites a client's parts after its local training in a round, so
  ``--eval global`` and ``--eval personal`` score the same model (``personal_parts`` is empty).
- **Leakage context.** A body message holds the body's tensors under the client model's names; the
  attacker differentiates ``features`` with a random probe classifier for the private head. The state the
  body was trained from is the sender's *mixed* body of round ``previous_round`` (meta), which the
  capture determines (the sender's own message of that round and the ones it received, weighed as in
  step 2) but no single message holds; ``previous_rule="last-received"`` takes the last body the sender
  received in that round instead: on a ring its previous state is off by half the difference between that
  received body and the sender's own body before mixing (see the note).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from privfl.capture.message import Message
from privfl.config import opt
from privfl.errors import ConfigError
from privfl.fl.method import METHODS, Client, FLMethod, LeakageContext, ModelRequest, mean_metrics
from privfl.methods.fedrep import frozen
from privfl.seeding import derive_seed
from privfl.topology import Graph, GraphOptions, build_graph

#: the client-model prefixes of the shared part (features + representation mapping); the rest is the head
BODY_PREFIXES = ("features.", "mapping.")


def body_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the body's state (parameters and buffers): what a body message carries."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith(BODY_PREFIXES)}


def part_parameters(model: nn.Module, body: bool) -> list[nn.Parameter]:
    """The body's parameters (``body=True``) or the head's (every other parameter)."""
    return [p for k, p in model.named_parameters() if k.startswith(BODY_PREFIXES) == body]


@torch.no_grad()
def load_body(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Overwrite the body's state with ``tensors`` (exactly the body's keys); the head is kept."""
    own = {k: v for k, v in model.state_dict().items() if k.startswith(BODY_PREFIXES)}
    if set(tensors) != set(own):
        raise ValueError(f"a body must hold exactly the body's state; differs in {sorted(set(tensors) ^ set(own))[:5]}")
    for k, v in tensors.items():
        own[k].copy_(v.to(own[k]))


def mix_states(states: Sequence[dict[str, torch.Tensor]], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """sum_j w_j s_j / sum_j w_j per tensor, in float64, returned in each tensor's dtype (integers rounded)."""
    if not states or len(states) != len(weights) or not sum(weights) > 0:
        raise ValueError("mix_states needs as many positive-sum weights as states")
    total = float(sum(weights))
    out = {}
    for k, v in states[0].items():
        acc = torch.zeros(v.shape, dtype=torch.float64, device=v.device)
        for w, s in zip(weights, states):
            acc += float(w) * s[k].to(v.device, torch.float64)
        mean = acc / total
        out[k] = mean.to(v.dtype) if v.is_floating_point() else mean.round().to(v.dtype)
    return out


@dataclass
class DFedPGPOptions(GraphOptions):
    #: the quick CPU default of ``python -m privfl.train dfedpgp`` (flags override it)
    run_defaults: ClassVar[dict[str, Any]] = {"model_group": "homo-cnn4", "subsample": 6000, "rounds": 5}
    #: the paper's own graph: each of 100 clients pulls from 10 random others per round (--topology random --degree 10)
    paper_topology: ClassVar[str] = "random"

    mixing: str = opt(
        "push-sum", "push-sum (the paper's de-biased directed mixing) or mean (the public code's pull average)", choices=("push-sum", "mean")
    )
    head_epochs: int = opt(1, "K_v: epochs on the personal head with the body frozen, first (public code: 1)", min=0)
    body_epochs: int | None = opt(None, "K_u: epochs on the shared body with the head frozen, second (default: --local-epochs)", min=0)
    head_lr: float | None = opt(None, "eta_v, the head's learning rate (default: the run's --lr)", min_exclusive=0)
    shared_init: bool = opt(True, "every client starts from one model drawn from a seed all nodes know (public code: one initial model)")


@METHODS.register("dfedpgp")
class DFedPGP(FLMethod):
    """Bodies gossiped and mixed along the graph, heads kept; head then body trained each round (module docstring)."""

    parallel_clients = True
    name = "dfedpgp"
    sends = {"model": "peer"}
    Options = DFedPGPOptions
    requires_homogeneous = True  # one body architecture to mix
    leakage = {
        "model": LeakageContext(
            previous="model",
            module="features",
            prefix="features.",
            readout="probe",
            note="the private head is replaced by the attacker's random probe; the body was trained from the sender's mixed body "
            "of round previous_round (its own message and the received ones, weighed), not from the single last received body "
            "used here; with --mapping fc the sent mapping.* tensors are outside the attacker's module",
        )
    }
    paper = (
        "Liu, Shi, Li, Wu, Wang, Shen, Decentralized Directed Collaboration for Personalized Federated Learning (DFedPGP), "
        "CVPR 2024, arXiv 2405.17876"
    )

    @classmethod
    def build_client_model(cls, req: ModelRequest) -> nn.Module:
        """The client's model; with ``shared_init`` every client's is drawn from one public seed."""
        if req.opts is None or not req.opts.shared_init:
            return super().build_client_model(req)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(req.cfg.seed, "init", "dfedpgp-shared"))
            return super().build_client_model(req)

    @classmethod
    def build_topology(cls, cfg: Any, opts: DFedPGPOptions) -> Graph:
        return build_graph(cfg, opts)

    def __init__(self, env):
        super().__init__(env)
        if self.opts.head_epochs == 0 and self.body_epochs == 0:
            raise ConfigError("dfedpgp: --head-epochs and --body-epochs are both 0, so no client would train anything")
        self.topology: Graph = env.topology if isinstance(env.topology, Graph) else self.build_topology(self.cfg, self.opts)
        n = self.cfg.num_clients  # (on a Flower node env.clients holds only its own client)
        self.push_weight = torch.ones(n, dtype=torch.float64)  # mu_i of push-sum (stays 1 with mixing=mean)
        self.last_trained = torch.full((n,), -1, dtype=torch.int64)  # the round a node last trained (-1: never)
        self.trained_from = torch.full((n,), -1, dtype=torch.int64)  # the round whose received bodies it mixed in then (-1: none)
        self.body_steps = torch.zeros(n, dtype=torch.int64)  # optimiser steps of its last body phase

    @property
    def body_epochs(self) -> int:
        return self.cfg.local_epochs if self.opts.body_epochs is None else self.opts.body_epochs

    # ------------------------------------------------------------------ what crosses the wire
    def _meta(self, client: Client, out_degree: int) -> dict[str, Any]:
        i = client.index
        return {
            "num_samples": len(client.train_idx),
            "lr": self.cfg.lr,
            "local_steps": int(self.body_steps[i]),
            "state_after_round": int(self.last_trained[i]),
            "previous_round": int(self.trained_from[i]),
            "push_weight": float(self.push_weight[i]),
            "out_degree": out_degree,
            "mixing": self.opts.mixing,
        }

    def _share(self, mu: float, out_degree: int) -> float:
        """The weight a_j of a body in the mix: mu_j / (d_j + 1) with push-sum, 1 with the mean."""
        return mu / (out_degree + 1) if self.opts.mixing == "push-sum" else 1.0

    # ------------------------------------------------------------------ rounds (gossip roles: send, then mix and train)
    def gossip_send(self, rnd: int, client: Client) -> list[tuple[Message, dict[str, torch.Tensor] | None]]:
        """The body as it stands after round t-1, to each out-neighbour of round t."""
        i = client.index
        outs = self.topology.out_neighbors(i, rnd)
        own = body_state(client.model)
        truth = {"indices": client.train_idx.cpu()} if int(self.last_trained[i]) >= 0 else None
        meta = self._meta(client, len(outs))
        return [(Message(rnd, client.name, f"client{r}", "model", own, dict(meta)), truth) for r in sorted(outs)]

    def gossip_round(self, rnd: int, client: Client, received: list[Message]) -> dict[str, float]:
        """Mix the own body with the received ones (after defenses), then head and body epochs."""
        i = client.index
        weights = [self._share(float(self.push_weight[i]), len(self.topology.out_neighbors(i, rnd)))]
        weights += [self._share(float(m.meta["push_weight"]), int(m.meta["out_degree"])) for m in received]
        load_body(client.model, mix_states([body_state(client.model), *(m.tensors for m in received)], weights))
        if self.opts.mixing == "push-sum":
            self.push_weight[i] = sum(weights)
        self.trained_from[i] = rnd if received else -1
        row = self.train_client(rnd, client)
        self.last_trained[i] = rnd
        return {**row, "body_scalars": float(max([0, *(m.paper_scalars for m in received)])), "push_weight": float(self.push_weight[i])}

    def client_metrics(self, rnd: int, rows: list[dict[str, float]]) -> dict[str, float]:
        """Losses averaged over the nodes that report them; the live count, the largest body received, the
        smallest push-sum weight."""
        own = ("body_scalars", "push_weight")
        out = mean_metrics([{k: v for k, v in row.items() if k not in own} for row in rows])
        out = {k: out[k] for k in sorted(out)}
        out["live_nodes"] = float(len(rows))
        out["body_scalars"] = float(max([0.0, *(row["body_scalars"] for row in rows)]))
        out["push_weight_min"] = float(min(row["push_weight"] for row in rows)) if rows else 1.0
        return out

    def train_client(self, rnd: int, client: Client) -> dict[str, float]:
        """K_v head epochs with the body frozen, then K_u body epochs with the new head frozen."""
        model = client.model
        out: dict[str, float] = {}
        if self.opts.head_epochs > 0:
            head = part_parameters(model, body=False)
            lr = self.opts.head_lr
            factory = (lambda m: self.trainer.make_optimizer(head, lr=lr)) if lr is not None else None
            with frozen(part_parameters(model, body=True)):
                out["head_loss"] = self.fit(rnd, client, parameters=head, optimizer=factory, epochs=self.opts.head_epochs).loss
        if self.body_epochs > 0:
            with frozen(part_parameters(model, body=False)):
                stats = self.fit(rnd, client, parameters=part_parameters(model, body=True), epochs=self.body_epochs)
            out["body_loss"] = stats.loss
            self.body_steps[client.index] = stats.steps
        else:
            self.body_steps[client.index] = 0
        out["train_loss"] = out.get("body_loss", out.get("head_loss", float("nan")))
        return out

    # ------------------------------------------------------------------ checkpoint
    def server_state(self) -> dict[str, torch.Tensor]:
        """Not a server: each node's push-sum weight and its bookkeeping for the message meta."""
        return {
            "push_weight": self.push_weight.clone(),
            "last_trained": self.last_trained.clone(),
            "trained_from": self.trained_from.clone(),
            "body_steps": self.body_steps.clone(),
        }

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        self.push_weight = state["push_weight"].cpu().to(torch.float64).clone()
        self.last_trained = state["last_trained"].cpu().clone()
        self.trained_from = state["trained_from"].cpu().clone()
        self.body_steps = state["body_steps"].cpu().clone()

    _NODE_STATE = ("push_weight", "last_trained", "trained_from", "body_steps")

    def client_state(self, client: Client) -> dict[str, torch.Tensor]:
        """A node's own entries of the bookkeeping above (what its Flower node keeps between messages)."""
        i = client.index
        return {**super().client_state(client), **{f"dfedpgp.{k}": getattr(self, k)[i : i + 1].clone() for k in self._NODE_STATE}}

    def load_client_state(self, client: Client, state: dict[str, torch.Tensor]) -> None:
        super().load_client_state(client, state)
        for k in self._NODE_STATE:
            if f"dfedpgp.{k}" in state:
                getattr(self, k)[client.index] = state[f"dfedpgp.{k}"].cpu()[0]


__all__ = ["BODY_PREFIXES", "DFedPGP", "DFedPGPOptions", "body_state", "frozen", "load_body", "mix_states", "part_parameters"]
