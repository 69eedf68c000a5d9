"""LG-FedAvg: local representations, a global head (Liang et al., "Think Locally, Act Globally:
Federated Learning with Local and Global Representations", arXiv 2001.01523, 2020).

The heterogeneous variant that HtFLlib (``serverlg.py``/``clientlg.py``) and the FedRE paper's tables
use: every client keeps its own body (features + RM, any architecture) and shares only its head, a
``Linear(d, C)`` of the same shape on every client.

Per round:

1. each selected client trains its whole model (body + head) with plain CE for ``--local-epochs``,
   starting from the global head it last received (the shared seeded loop, nothing added);
2. it uploads its head (kind ``head``, up; meta ``num_samples`` = its train-set size and ``arch``);
3. the server averages the received heads, weighted by ``num_samples`` (``weighting``), and
   broadcasts the average (kind ``head``, down) to every client, selected or not; each client
   overwrites its head with it.

What is sent, per client per round: its head up and the global head down, d*C + C scalars each way
(no labels, no aux). With K = 10 clients, FedRE [001] Table 11 / [000] Table 9 count
K*(d*C + C) = 51.30e3 (d=512, C=10), 513.00e3 (d=512, C=100) and 4098.00e3 (d=2048, C=200) both ways,
the same for homogeneous and heterogeneous models. The setup broadcast of the initial head (round 0,
meta ``phase=setup``) comes once on top.

Decisions where the paper is open or HtFLlib differs:

- **Weighting.** HtFLlib weights each head by the client's train-sample count over the selected
  clients (``Server.receive_ids``: ``train_samples / tot_samples``); that is the default
  (``weighting=samples``). The authors' code (pliang279/LG-FedAvg ``main_lg.py``) averages the global
  layers uniformly over the m selected clients (``torch.div(w_glob[k], m)``): ``weighting=uniform``.
- **Which layers are global.** The paper keeps the top ``num_layers_keep`` layers global (and starts
  from a FedAvg-pretrained model); with heterogeneous bodies only the head has one shape everywhere,
  so here (as in HtFLlib) the global part is exactly the head.
- **Initial head.** HtFLlib's server starts from client 0's initial head and sends it to every client
  at the start of round 0 (``send_parameters`` runs at the start of every round, before training).
  privfl's server builds its own ``Linear(d, C)`` with its own seed (as :class:`GlobalHeadServer`
  does, so that nothing crosses without a message) and broadcasts it at setup; it then broadcasts at
  the end of each round, which is the same sequence of heads.
- **Evaluation.** HtFLlib evaluates right after ``send_parameters``: each body with the global head,
  which is ``--eval global`` here. ``personal_parts = ("head",)``: ``--eval personal`` scores each
  client with its own head as it was after its last local training.
- **Tensor names.** A head message names its tensors as in the client model (``head.weight``,
  ``head.bias``), both ways, so gradient-leakage attacks rebuild its context on the whole client model
  (``leakage``): the head is known to the server, the body never crosses the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from privfl.capture.message import Message
from privfl.config import opt
from privfl.fl.method import METHODS, Client, ClientReply, FLMethod, LeakageContext, module_tensors
from privfl.seeding import seed_global

#: what a head message puts before the head's own parameter names (the client model's names)
HEAD_PREFIX = "head."


def head_state(head: nn.Module) -> dict[str, torch.Tensor]:
    """A head's parameters and buffers under the client model's names (``head.weight``, ``head.bias``)."""
    return {HEAD_PREFIX + k: v for k, v in module_tensors(head).items()}


def load_head_state(head: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load a head message's tensors (``head.*``) into ``head``, on its device and dtype."""
    own = head.state_dict()
    head.load_state_dict({k.removeprefix(HEAD_PREFIX): v.to(own[k.removeprefix(HEAD_PREFIX)]) for k, v in tensors.items()})


def head_message(rnd: int, sender: str, receiver: str, head: nn.Module, meta: dict[str, Any] | None = None) -> Message:
    """One ``head`` message carrying ``head``'s state (d*C + C scalars for a ``Linear(d, C)``)."""
    return Message(rnd, sender, receiver, "head", head_state(head), dict(meta or {}))


def average_heads(received: list[Message], weighting: str = "samples") -> dict[str, torch.Tensor]:
    """The mean of the received heads, weighted by their ``num_samples`` (``samples``) or not (``uniform``),
    computed in float64 and returned in each tensor's dtype."""
    weights = [float(m.meta["num_samples"]) if weighting == "samples" else 1.0 for m in received]
    total = sum(weights)
    out = {}
    for k, v in received[0].tensors.items():
        mean = torch.stack([w * m.tensors[k].double() for w, m in zip(weights, received)]).sum(0) / total
        out[k] = mean.to(v.dtype) if v.is_floating_point() else mean.round().to(v.dtype)
    return out


@dataclass
class LGFedAvgOptions:
    weighting: str = opt(
        "samples",
        "head average: samples (HtFLlib: weighted by train-set size) or uniform (the authors' code)",
        choices=("samples", "uniform"),
    )


@METHODS.register("lgfedavg")
class LGFedAvg(FLMethod):
    """Clients keep their bodies, share their heads; the server averages the heads (module docstring)."""

    parallel_clients = True
    name = "lgfedavg"
    sends = {"head": "up/down"}
    Options = LGFedAvgOptions
    personal_parts = ("head",)
    #: an upload holds the head's parameters under the client model's names; the state it was trained
    #: from is the last global head the client received
    leakage = {
        "head": LeakageContext(
            previous="head",
            note="only the head crosses the wire: the client's body (features + RM) stays at the attacker's random initialisation",
        )
    }
    paper = "Liang et al., Think Locally, Act Globally: Federated Learning with Local and Global Representations (LG-FedAvg), arXiv 2001.01523"

    def __init__(self, env):
        super().__init__(env)
        seed_global(self.cfg.seed, "init", "server-head")  # the same initial head as GlobalHeadServer's
        self.head = nn.Linear(self.cfg.rep_dim, env.num_classes).to(env.device)

    def setup(self) -> None:
        self.broadcast_head(0, phase="setup")

    def broadcast_head(self, rnd: int, phase: str = "train") -> None:
        """The global head to every client (one message each); each overwrites its head with its copy."""
        self.deliver(self.channel.broadcast(rnd, self.client_names(), "head", head_state(self.head), meta={"phase": phase}))

    def receive(self, client: Client, msg: Message) -> None:
        load_head_state(client.model.head, msg.tensors)

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        loss = self.fit(rnd, client).loss  # plain CE on body + head, from the received head
        msg = head_message(rnd, client.name, "server", client.model.head, {"num_samples": len(client.train_idx), "arch": client.arch})
        return ClientReply([(msg, {"indices": client.train_idx.cpu()})], {"train_loss": loss})

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        # the server uses what it received (after defenses), nothing else
        load_head_state(self.head, average_heads(uploads, self.opts.weighting))
        self.broadcast_head(rnd)
        return {}

    def server_state(self) -> dict[str, torch.Tensor]:
        return head_state(self.head)

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        load_head_state(self.head, {k: v for k, v in state.items() if k.startswith(HEAD_PREFIX)})


__all__ = ["LGFedAvg", "LGFedAvgOptions", "average_heads", "head_message", "head_state", "load_head_state"]
