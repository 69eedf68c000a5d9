"""FedAllRep: every per-sample representation and its label goes up; the server trains the head.

The FedRE papers' ablation ([000] Table 3 / [001] Table 4): the upper bound on what representations
can teach the global classifier, and the worst case for representation inversion. Server settings
follow FedRE's (SGD lr 0.01, batch 10, one epoch) but with the loss averaged over a batch, since a
hard-label batch has no weights summing to one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from privfl.capture.message import Message
from privfl.config import opt
from privfl.methods.base import METHODS, Client
from privfl.methods.fedre import GlobalHeadServer


@dataclass
class FedAllRepOptions:
    server_lr: float = opt(0.01, "server SGD learning rate for the global head")
    server_batch: int = opt(10, "server batch size")
    server_epochs: int = opt(1, "server epochs over all uploaded representations per round")


@METHODS.register("fedallrep")
class FedAllRep(GlobalHeadServer):
    name = "fedallrep"
    sends = {"rep": "up", "head": "down"}
    exposes = ("extractor",)
    Options = FedAllRepOptions
    paper = "FedRE [000] Table 3 / [001] Table 4 ablation"

    def run_round(self, rnd: int, selected: list[Client]) -> dict[str, float]:
        reps, labels, losses = [], [], []
        for client in selected:
            losses.append(self.local_train(rnd, client))
            r, y = self.representations(client)  # (n, d), (n,)
            msg = Message(rnd, client.name, "server", "rep", {"reps": r, "labels": y}, {"arch": client.arch}, aux=("labels",))
            received = self.send(msg, {"indices": client.train_idx.cpu()})
            self.env.knowledge.record_extractor(rnd, client)
            reps.append(received.tensors["reps"])
            labels.append(received.tensors["labels"])
        o = self.opts
        server_loss = self.train_head(
            rnd, torch.cat(reps).to(self.env.device), torch.cat(labels).to(self.env.device),
            lr=o.server_lr, batch=o.server_batch, epochs=o.server_epochs, loss_fn=F.cross_entropy,
        )
        self.broadcast_head(rnd)
        return {"train_loss": sum(losses) / max(len(losses), 1), "server_loss": server_loss}
