"""FedRE: entangled representations for model-heterogeneous FL.

[000] "Rethinking Client Knowledge for Federated Learning: An Entangled Representation Perspective"
(NeurIPS 2025 submission); [001] Yao et al., "FedRE: A Representation Entanglement Framework for
Model-Heterogeneous Federated Learning" (CVPR 2026, arXiv 2511.22265). Decisions: docs/decisions.md.

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

from privfl.capture.message import Message
from privfl.config import opt
from privfl.fl.entangle import (
    DISTRIBUTIONS,
    MECHANISMS,
    NEGATIVES,
    entangle,
    random_draws,
    sample_weights,
    soft_label_loss,
)
from privfl.fl.headserver import GlobalHeadServer, HeadServerOptions
from privfl.fl.method import METHODS, Client
from privfl.seeding import torch_generator


@dataclass
class FedREOptions(HeadServerOptions):
    re: str = opt("rap", "RE mechanism", choices=MECHANISMS)
    weight_dist: str = opt("uniform", "distribution of random RE weights ([001] Table 7)", choices=DISTRIBUTIONS)
    negatives: str = opt("abs", "how negative gaussian/laplace draws are normalised", choices=NEGATIVES)
    sampling: str = opt("resample", "resample: new weights every round; fixed: drawn once ([001] Table 8)", choices=("resample", "fixed"))
    server_reduction: str = opt("sum", "server loss reduction over a batch: sum (official code) or mean", choices=("sum", "mean"))


@METHODS.register("fedre")
class FedRE(GlobalHeadServer):
    name = "fedre"
    parallel_clients = True
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
