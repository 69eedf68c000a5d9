"""FedProc: prototypical contrastive federated learning, written outside privfl as a user would.

Mu, Shen, Cheng, Geng, Fu, Zhang, Zhang, "FedProc: Prototypical Contrastive Federated Learning on
Non-IID data", Future Generation Computer Systems 143 (2023), arXiv 2109.12273.

Each round every selected client starts from the global model, trains with
``(1 - alpha) * CE + alpha * L_pc``, where ``L_pc`` is a contrastive loss that pulls a sample's
representation towards the global prototype of its class and away from the other classes' prototypes
(cosine similarity over a temperature, a softmax over the classes the client has received), and alpha
grows with the round (``alpha = t / T`` as in the paper). It uploads its model (``model``) and the
mean representation of each class it holds (``proto``, with the classes and their sample counts);
the server averages the models weighted by sample count (FedAvg) and the prototypes per class weighted
by count, and broadcasts both.

Why it is here: it is the worked example of docs/audit.md. It sends two kinds, so an audit attacks it
in two ways: its ``model`` uploads with gradient leakage, label inference and membership inference, its
``proto`` uploads with label inference (the classes and counts travel in the clear). It does not expose
client extractors, so prototype inversion does not apply, and ``--check`` says which declaration would
change that. Audit it from the repository root with (``examples`` on the path; the name
``examples.fedproc`` would not do, opacus installs a top-level package called ``examples``)::

    PYTHONPATH=examples python -m privfl.audit fedproc:FedProc --train model_group=homo-cnn4
    PYTHONPATH=examples python -m privfl.audit fedproc:FedProc --check --train model_group=homo-cnn4
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from privfl.capture import Message
from privfl.config import opt
from privfl.fl.method import GlobalModelServer, class_prototypes, module_tensors
from privfl.methods import Client


@dataclass
class FedProcOptions:
    temperature: float = opt(0.5, "tau of the prototypical contrastive loss (paper: 0.5)")
    alpha_schedule: str = opt("linear", "alpha = t/T (linear, the paper's) or constant alpha_max", choices=("linear", "constant"))
    alpha_max: float = opt(1.0, "the largest weight of the contrastive loss")


class FedProc(GlobalModelServer):
    """See the module docstring. One architecture for every client (the model is averaged)."""

    name = "fedproc"
    sends = {"model": "up/down", "proto": "up", "global_proto": "down"}
    Options = FedProcOptions
    paper = "Mu et al., FedProc, FGCS 2023 (arXiv 2109.12273)"

    def __init__(self, env):
        super().__init__(env)
        c, d = env.num_classes, self.cfg.rep_dim
        self.protos = torch.zeros(c, d, device=env.device)  # the global prototypes the clients last received
        self.known = torch.zeros(c, dtype=torch.bool, device=env.device)

    def alpha(self, rnd: int) -> float:
        o = self.opts
        return o.alpha_max * (rnd / max(self.cfg.rounds - 1, 1) if o.alpha_schedule == "linear" else 1.0)

    def objective(self, alpha: float):
        """(1 - alpha) CE + alpha L_pc on one batch (L_pc only for samples whose class has a prototype)."""
        tau, protos, known = self.opts.temperature, self.protos, self.known

        def loss(model, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            reps = model.represent(x)  # (B, d)
            ce = F.cross_entropy(model.head(reps), y)
            mask = known[y]
            if alpha == 0 or not mask.any():
                return ce, {"ce": ce.detach()}
            sims = F.normalize(reps[mask], dim=1) @ F.normalize(protos, dim=1).T / tau  # (b, C)
            sims = sims.masked_fill(~known.unsqueeze(0), float("-inf"))  # only classes with a prototype compete
            pc = F.cross_entropy(sims, y[mask])
            return (1 - alpha) * ce + alpha * pc, {"ce": ce.detach(), "proto_contrast": pc.detach()}

        return loss

    def run_round(self, rnd: int, selected: list[Client]) -> dict[str, float]:
        c, device = self.env.num_classes, self.env.device
        models: dict[str, torch.Tensor] = {}
        proto_sums, proto_counts = torch.zeros_like(self.protos), torch.zeros(c, device=device)
        total, losses = 0.0, []
        for client in selected:
            stats = self.fit(rnd, client, self.objective(self.alpha(rnd)))
            losses.append(stats.loss)
            n = len(client.train_idx)
            truth = {"indices": client.train_idx.cpu()}
            got = self.send(Message(rnd, client.name, "server", "model", module_tensors(client.model), {"num_samples": n}), truth)
            reps, labels = self.representations(client)
            classes, protos, counts = class_prototypes(reps, labels, c)
            sent = self.send(Message(rnd, client.name, "server", "proto", {"protos": protos, "classes": classes, "counts": counts}), truth)
            total += n
            for k, v in got.tensors.items():
                v = v.to(device, torch.float64) * n
                models[k] = models[k] + v if k in models else v
            cls, cnt = sent.tensors["classes"].to(device), sent.tensors["counts"].to(device).float()
            proto_sums.index_add_(0, cls, sent.tensors["protos"].to(device) * cnt.unsqueeze(1))
            proto_counts.index_add_(0, cls, cnt)
        reference = self.global_model.state_dict()
        self.global_model.load_state_dict(
            {k: (v / total).round().to(reference[k].dtype) if not reference[k].is_floating_point() else (v / total).to(reference[k].dtype)
             for k, v in models.items()}
        )  # fmt: skip
        self.broadcast(rnd)
        present = torch.nonzero(proto_counts).flatten()
        delivered = self.channel.broadcast(
            rnd, self.client_names(), "global_proto", {"protos": proto_sums[present] / proto_counts[present].unsqueeze(1), "classes": present}
        )
        first = next(iter(delivered.values()))  # every client receives the same prototypes
        cls = first.tensors["classes"].to(device)
        self.protos[cls] = first.tensors["protos"].to(device)
        self.known[cls] = True
        return {"train_loss": sum(losses) / max(len(losses), 1), "alpha": self.alpha(rnd)}

    def server_state(self) -> dict[str, torch.Tensor]:
        return {**super().server_state(), "fedproc.protos": self.protos, "fedproc.known": self.known}

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        self.protos.copy_(state.pop("fedproc.protos"))
        self.known.copy_(state.pop("fedproc.known"))
        super().load_server_state(state)
