"""FedAllRep: every per-sample representation and its label goes up; the server trains the head.

The FedRE papers' ablation ([000] Table 3 / [001] Table 4): the upper bound on what representations
can teach the global classifier, and the worst case for representation inversion. Server settings
follow FedRE's (SGD lr 0.01, batch 10, one epoch) but with the loss averaged over a batch, since a
hard-label batch has no weights summing to one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from privfl.capture.message import Message
from privfl.fl.headserver import GlobalHeadServer, HeadServerOptions
from privfl.fl.method import METHODS, Client


@dataclass
class FedAllRepOptions(HeadServerOptions):
    """FedRE's server settings; the hard-label loss is averaged over a batch."""


@METHODS.register("fedallrep")
class FedAllRep(GlobalHeadServer):
    name = "fedallrep"
    parallel_clients = True
    sends = {"rep": "up", "head": "down"}
    exposes = ("extractor",)
    Options = FedAllRepOptions
    paper = "FedRE [000] Table 3 / [001] Table 4 ablation"

    def upload(self, rnd: int, client: Client) -> tuple[Message, dict[str, torch.Tensor]]:
        reps, labels = self.representations(client)  # (n, d), (n,)
        msg = Message(rnd, client.name, "server", "rep", {"reps": reps, "labels": labels}, {"arch": client.arch}, aux=("labels",))
        return msg, {"indices": client.train_idx.cpu()}

    def head_data(self, received: list[Message]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([m.tensors["reps"] for m in received]), torch.cat([m.tensors["labels"] for m in received])
