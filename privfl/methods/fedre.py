"""FedRE: entangled representations for model-heterogeneous FL.

[000] "Rethinking Client Knowledge for Federated Learning: An Entangled Representation Perspective"
(NeurIPS 2025 submission); [001] Yao et al., "FedRE: A Representation Entanglement Framework for
Model-Heterogeneous Federated Learning" (CVPR 2026, arXiv 2511.22265). Spec: shared/specs/fedre.md.

Per round ([001] Alg. 1): each selected client sets its head to the received global classifier,
trains extractor + head with plain CE (Eq. 1), maps every train sample through its extractor and RM
in eval mode, entangles them with the RE mechanism (default RAP, weights re-drawn every round) and
uploads one ``ent_rep`` message: the d-dim entangled representation and its dense C-dim entangled
label (decision 8: the label is sent as ``aux``; the papers' scalar counts leave it out, the capture
counts it in ``scalars``). The server trains the global head on the K uploads with the soft-label CE
(Eq. 3; SGD lr 0.01, batch 10, one epoch, summed over the batch as in the official code) and
broadcasts it to all clients. Upload = K*d scalars, broadcast = K*(d*C + C).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from privfl.capture.message import Message
from privfl.config import opt
from privfl.methods.base import METHODS, Client, FLMethod, load_module_tensors, module_tensors
from privfl.methods.entangle import (
    DISTRIBUTIONS,
    MECHANISMS,
    NEGATIVES,
    entangle,
    random_draws,
    sample_weights,
    soft_label_loss,
)
from privfl.seeding import seed_global, torch_generator


@dataclass
class HeadServerOptions:
    """Server settings of every method whose server trains one global head (FedRE paper: SGD lr 0.01,
    batch 10, one epoch per round)."""

    server_lr: float = opt(0.01, "server SGD learning rate for the global head")
    server_batch: int = opt(10, "server batch size")
    server_epochs: int = opt(1, "server epochs over the uploads per round")


@dataclass
class FedREOptions(HeadServerOptions):
    re: str = opt("rap", "RE mechanism", choices=MECHANISMS)
    weight_dist: str = opt("uniform", "distribution of random RE weights ([001] Table 7)", choices=DISTRIBUTIONS)
    negatives: str = opt("abs", "how negative gaussian/laplace draws are normalised", choices=NEGATIVES)
    sampling: str = opt("resample", "resample: new weights every round; fixed: drawn once ([001] Table 8)", choices=("resample", "fixed"))
    server_reduction: str = opt("sum", "server loss reduction over a batch: sum (official code) or mean", choices=("sum", "mean"))


class GlobalHeadServer(FLMethod):
    """Shared part of the methods whose server owns one global head it broadcasts to every client."""

    def __init__(self, env):
        super().__init__(env)
        seed_global(self.cfg.seed, "init", "server-head")
        self.head = nn.Linear(self.cfg.rep_dim, env.num_classes).to(env.device)

    def setup(self) -> None:
        self.broadcast_head(0, phase="setup")

    def broadcast_head(self, rnd: int, phase: str = "train") -> None:
        delivered = self.channel.broadcast(rnd, self.client_names(), "head", module_tensors(self.head), meta={"phase": phase})
        for client in self.env.clients:
            load_module_tensors(client.model.head, delivered[client.name].tensors)

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

    def run_round(self, rnd: int, selected: list[Client]) -> dict[str, float]:
        received, losses = [], []
        for client in selected:
            losses.append(self.local_train(rnd, client))
            received.append(self.send(*self.upload(rnd, client)))
            self.env.knowledge.record_extractor(rnd, client)
        inputs, targets = self.head_data(received)
        o = self.opts
        server_loss = self.train_head(
            rnd, inputs.to(self.env.device), targets.to(self.env.device),
            lr=o.server_lr, batch=o.server_batch, epochs=o.server_epochs, loss_fn=self.head_loss,
        )
        self.broadcast_head(rnd)
        return {"train_loss": sum(losses) / max(len(losses), 1), "server_loss": server_loss}

    def server_state(self) -> dict[str, torch.Tensor]:
        return {f"head.{k}": v for k, v in module_tensors(self.head).items()}

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        load_module_tensors(self.head, {k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")})


@METHODS.register("fedre")
class FedRE(GlobalHeadServer):
    name = "fedre"
    sends = {"ent_rep": "up", "head": "down"}
    exposes = ("extractor",)
    Options = FedREOptions
    paper = "Yao et al., FedRE, CVPR 2026 (arXiv 2511.22265)"

    def upload(self, rnd: int, client: Client) -> tuple[Message, dict[str, torch.Tensor]]:
        """One entangled representation + label; truth = the sample ids and per-sample weights."""
        o = self.opts
        reps, labels = self.representations(client)  # (n, d), (n,)
        key = ("re", rnd, client.index) if o.sampling == "resample" else ("re-fixed", client.index)
        draws = random_draws(o.re, labels, self.env.num_classes, o.weight_dist, torch_generator(self.cfg.seed, *key))
        weights = sample_weights(o.re, labels, self.env.num_classes, draws, o.negatives)  # (n,)
        rep, label = entangle(reps, labels, self.env.num_classes, weights)
        meta = {"re": o.re, "rm": self.cfg.mapping, "weight_dist": o.weight_dist, "sampling": o.sampling, "arch": client.arch}
        msg = Message(rnd, client.name, "server", "ent_rep", {"rep": rep, "label": label}, meta, aux=("label",))
        return msg, {"indices": client.train_idx.cpu(), "weights": weights}

    def head_data(self, received: list[Message]) -> tuple[torch.Tensor, torch.Tensor]:
        # (K, d) entangled representations and their (K, C) soft labels
        return torch.stack([m.tensors["rep"] for m in received]), torch.stack([m.tensors["label"] for m in received])

    def head_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return soft_label_loss(logits, targets, self.opts.server_reduction)
