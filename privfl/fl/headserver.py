"""The server shared by FedRE, FedAllRep and FedGH: it owns one global head and broadcasts it.

Each round every selected client trains locally, uploads one message (what it is, is the method's:
entangled representations, all representations, prototypes) and the server trains the global head on
what it received for a few SGD epochs (FedRE paper: lr 0.01, batch 10, one epoch), then broadcasts the
head to every client, which loads it as its own head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from privfl.capture.message import Message
from privfl.config import opt
from privfl.fl.method import Client, ClientReply, FLMethod, load_module_tensors, module_tensors
from privfl.seeding import seed_global, torch_generator


@dataclass
class HeadServerOptions:
    """Server settings of every method whose server trains one global head (FedRE paper: SGD lr 0.01,
    batch 10, one epoch per round)."""

    server_lr: float = opt(0.01, "server SGD learning rate for the global head", min_exclusive=0)
    server_batch: int = opt(10, "server batch size", min=1)
    server_epochs: int = opt(1, "server epochs over the uploads per round", min=0)


class GlobalHeadServer(FLMethod):
    """Shared part of the methods whose server owns one global head it broadcasts to every client.

    ``--eval global`` scores each client with the broadcast head (HtFLlib); ``personal`` with the head
    it trained itself this round (the broadcast overwrites it)."""

    personal_parts = ("head",)

    def __init__(self, env):
        super().__init__(env)
        seed_global(self.cfg.seed, "init", "server-head")
        self.head = nn.Linear(self.cfg.rep_dim, env.num_classes).to(env.device)

    def setup(self) -> None:
        self.broadcast_head(0, phase="setup")

    def broadcast_head(self, rnd: int, phase: str = "train") -> None:
        self.deliver(self.channel.broadcast(rnd, self.client_names(), "head", module_tensors(self.head), meta={"phase": phase}))

    def receive(self, client: Client, msg: Message) -> None:
        load_module_tensors(client.model.head, msg.tensors)

    def train_head(self, rnd: int, inputs: torch.Tensor, targets: torch.Tensor, *, lr: float, batch: int, epochs: int, loss_fn) -> float:
        """A few SGD epochs of the global head on server-side (input, target) pairs."""
        self.head.train()
        opt = torch.optim.SGD(self.head.parameters(), lr=lr)
        total, steps = 0.0, 0
        for epoch in range(epochs):
            order = torch.randperm(len(inputs), generator=torch_generator(self.cfg.seed, "server", rnd, epoch))
            for start in range(0, len(inputs), batch):
                idx = order[start : start + batch].to(inputs.device)
                loss = loss_fn(self.head(inputs[idx]), targets[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += loss.item()
                steps += 1
        return total / max(steps, 1)

    # ---- the round shared by FedRE, FedAllRep and FedGH: upload, train the head, broadcast it
    def upload(self, rnd: int, client: Client) -> tuple[Message, dict[str, torch.Tensor]]:
        """The client's message after local training, and the ground truth behind it."""
        raise NotImplementedError

    def head_data(self, received: list[Message]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) the server trains the global head on."""
        raise NotImplementedError

    def head_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, targets)

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        loss = self.local_train(rnd, client)
        msg, truth = self.upload(rnd, client)
        self.env.knowledge.record_extractor(rnd, client)
        return ClientReply([(msg, truth)], {"train_loss": loss})

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        inputs, targets = self.head_data(uploads)
        o = self.opts
        server_loss = self.train_head(
            rnd,
            inputs.to(self.env.device),
            targets.to(self.env.device),
            lr=o.server_lr,
            batch=o.server_batch,
            epochs=o.server_epochs,
            loss_fn=self.head_loss,
        )
        self.broadcast_head(rnd)
        return {"server_loss": server_loss}

    def server_state(self) -> dict[str, torch.Tensor]:
        return {f"head.{k}": v for k, v in module_tensors(self.head).items()}

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        load_module_tensors(self.head, {k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")})


__all__ = ["GlobalHeadServer", "HeadServerOptions"]
