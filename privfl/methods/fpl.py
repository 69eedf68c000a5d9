"""FPL: Federated Prototypes Learning (Huang, Ye, Shi, Li, Du, "Rethinking Federated Learning with Domain
Shift: A Prototype View", CVPR 2023; official code WenkeHuang/RethinkFL ``models/fpl.py``).

What is sent, per client and round:

- **up** (``proto``): the client's per-class prototypes (:func:`prototype_message`: train split, eval
  mode, after local training), with class ids and counts as bookkeeping. Count: (classes present) * d.
- **down** (``global_proto``, two messages per client, told apart by ``meta["role"]``):
  ``role="cluster"``, the cluster prototypes, several rows per class (``classes`` says whose), and
  ``role="unbiased"``, one unbiased prototype per class received. Count: (#cluster rows + #unbiased
  rows) * d per client, which depends on the data (FedRE Table 11, model-heterogeneous: 112.64e3 /
  1182.72e3 / 10567.68e3 for 10 clients, i.e. 22 / 231 / 516 rows per client on CIFAR-10 / CIFAR-100 /
  TinyImageNet with d = 512 / 512 / 2048, of which 10 / 100 / 200 are unbiased prototypes).

Server (RethinkFL ``proto_aggregation``). For each class, the received prototypes of
that class are clustered with FINCH (:mod:`privfl.fl.finch`, cosine distance); each cluster's
prototype is the unweighted mean of its members, and a class received from one client
keeps that prototype as its only cluster. The **partition** is the last FINCH step, the coarsest one
that still has more than one cluster (RethinkFL takes ``c[:, -1]``; the paper only says FINCH
clusters them); ``finch_step`` picks another (0: the finest). The unbiased prototype of a class is the
unweighted mean of its cluster prototypes, so a large group of similar clients counts once.

Clients. Local loss (RethinkFL ``_train_net``), per sample z of class y whose class is
among the received ones::

    L_CPCL = -log( sum_{c in P_y} exp(cos(z, c) / tau) / sum_{c in P} exp(cos(z, c) / tau) )   (Eq. 6)
    L_UPCR = MSE(z, u_y)  (mean over the d entries)                                             (Eq. 9)

P_y the cluster prototypes of y, P all of them, u_y the unbiased prototype; the two are summed over
those samples and divided by the batch size (RethinkFL's ``/ i``), then added to CE with weight 1.
Round 0 trains CE alone (nothing received yet). ``tau`` defaults to RethinkFL's ``--infoNCET`` 0.02.
Inference is the client's own model (its head); RethinkFL scores its FedAvg global net's classifier.

Where this differs from RethinkFL, and why:

- RethinkFL is homogeneous: besides the prototypes it averages the client networks with FedAvg every
  round (``aggregate_nets``). Here, as in FedRE's model-heterogeneous comparison, only prototypes
  travel (FedRE Table 11 counts 257.02e3 up for CIFAR-100, the prototypes alone), so no model is sent.
- RethinkFL's local prototypes are means of the training-mode features of the last local epoch's
  batches, taken before each optimizer step; here they are computed after local training in eval mode
  over the whole train split, as for FedProto, FedGH and FedTGP (docs/decisions.md, FedProto).
- RethinkFL trains with its own SGD (momentum 0.9, weight decay 1e-5, lr 0.01, 10 local epochs); here
  the run's shared optimizer settings apply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from privfl.capture.message import Message
from privfl.config import opt
from privfl.fl.finch import DISTANCES, finch
from privfl.fl.method import METHODS, Client, ClientReply, FLMethod
from privfl.fl.prototypes import prototype_round, stacked_prototypes


@dataclass
class FPLOptions:
    tau: float = opt(0.02, "temperature of the cluster prototype contrastive loss (RethinkFL --infoNCET)", min_exclusive=0)
    finch_step: int = opt(-1, "FINCH partition per class: -1 the last, coarsest (RethinkFL), 0 the finest; clamped")
    finch_distance: str = opt("cosine", "FINCH distance (RethinkFL: cosine)", choices=DISTANCES)


def cluster_prototypes(protos: torch.Tensor, classes: torch.Tensor, *, step: int = -1, distance: str = "cosine") -> tuple[torch.Tensor, torch.Tensor]:
    """Per class (ascending), FINCH's clusters of that class's rows at partition ``step``, each as the
    mean of its members: (M, d) prototypes and their (M,) classes."""
    rows, owners = [], []
    for c in torch.unique(classes).tolist():
        members = protos[classes == c]
        if len(members) == 1:
            centres = members
        else:
            labels = torch.from_numpy(finch(members.detach().cpu().double().numpy(), distance).labels(step)).to(members.device)
            centres = torch.stack([members[labels == k].mean(0) for k in range(int(labels.max()) + 1)])
        rows.append(centres)
        owners.append(torch.full((len(centres),), c, dtype=torch.long, device=protos.device))
    return torch.cat(rows), torch.cat(owners)


def unbiased_prototypes(cluster: torch.Tensor, cluster_classes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The unweighted mean of each class's cluster prototypes: (m, d) and the (m,) classes, ascending."""
    present = torch.unique(cluster_classes)
    return torch.stack([cluster[cluster_classes == c].mean(0) for c in present.tolist()]), present


def fpl_terms(
    reps: torch.Tensor, y: torch.Tensor, cluster: torch.Tensor, cluster_classes: torch.Tensor, unbiased: torch.Tensor, known: torch.Tensor, tau: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_CPCL, L_UPCR) of a batch: summed over the samples whose class was received, divided by the batch size.
    ``unbiased`` is (C, d), indexed by class; ``known`` (C,) says which classes were received."""
    sim = F.normalize(reps, dim=1, eps=1e-8) @ F.normalize(cluster, dim=1, eps=1e-8).T / tau  # (b, M)
    positive = cluster_classes.unsqueeze(0) == y.unsqueeze(1)
    has = known[y] & positive.any(1)
    # rows without a positive keep all their terms (loss 0, finite gradients) and are masked out below
    positives = torch.where(has.unsqueeze(1), sim.masked_fill(~positive, float("-inf")), sim)
    cpcl = torch.logsumexp(sim, 1) - torch.logsumexp(positives, 1)
    upcr = (reps - unbiased[y]).pow(2).mean(1)
    zero = reps.new_zeros(())
    b = len(y)
    return torch.where(has, cpcl, zero).sum() / b, torch.where(has, upcr, zero).sum() / b


@METHODS.register("fpl")
class FPL(FLMethod):
    name = "fpl"
    parallel_clients = True
    sends = {"proto": "up", "global_proto": "down"}
    exposes = ("extractor",)
    Options = FPLOptions
    paper = "Huang et al., Rethinking Federated Learning with Domain Shift: A Prototype View (FPL), CVPR 2023"

    def __init__(self, env):
        super().__init__(env)
        c, d = env.num_classes, self.cfg.rep_dim
        dev = env.device
        # what each client last received: cluster prototypes (M, d) with their classes (M,), and the
        # unbiased prototypes by class (C, d) with which of them exist (C,)
        self.received: dict[str, dict[str, torch.Tensor]] = {
            cl.name: {
                "cluster": torch.zeros(0, d, device=dev),
                "cluster_classes": torch.zeros(0, dtype=torch.long, device=dev),
                "unbiased": torch.zeros(c, d, device=dev),
                "known": torch.zeros(c, dtype=torch.bool, device=dev),
            }
            for cl in env.clients
        }

    def objective(self, client: Client):
        got = self.received[client.name]
        tau = self.opts.tau

        def loss(model, x, y):
            reps = model.represent(x)
            ce = F.cross_entropy(model.head(reps), y)
            if not got["known"].any():
                return ce
            cpcl, upcr = fpl_terms(reps, y, got["cluster"], got["cluster_classes"], got["unbiased"], got["known"], tau)
            return ce + cpcl + upcr, {"ce": ce, "cpcl": cpcl, "upcr": upcr}

        return loss

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        return prototype_round(self, rnd, client, self.objective(client))

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """FINCH-cluster the received prototypes per class, average each class's clusters (unbiased), send both."""
        protos, classes = stacked_prototypes(self, uploads)
        cluster, cluster_classes = cluster_prototypes(protos, classes, step=self.opts.finch_step, distance=self.opts.finch_distance)
        unbiased, unbiased_classes = unbiased_prototypes(cluster, cluster_classes)
        names = self.client_names()
        cluster_msg = {"protos": cluster, "classes": cluster_classes}
        self.deliver(self.channel.broadcast(rnd, names, "global_proto", cluster_msg, meta={"role": "cluster"}, aux=("classes",)))
        unbiased_msg = {"protos": unbiased, "classes": unbiased_classes}
        self.deliver(self.channel.broadcast(rnd, names, "global_proto", unbiased_msg, meta={"role": "unbiased"}, aux=("classes",)))
        return {"cluster_rows": float(len(cluster))}

    def receive(self, client: Client, msg: Message) -> None:
        """The cluster prototypes replace the last ones; the unbiased ones replace them by class."""
        mine = self.received[client.name]
        if msg.meta.get("role") == "cluster":
            mine["cluster"] = msg.tensors["protos"].to(self.env.device)
            mine["cluster_classes"] = msg.tensors["classes"].to(self.env.device).long()
            return
        c, d = self.env.num_classes, self.cfg.rep_dim
        mine["unbiased"] = torch.zeros(c, d, device=self.env.device)
        mine["known"] = torch.zeros(c, dtype=torch.bool, device=self.env.device)
        cls = msg.tensors["classes"].to(self.env.device).long()
        mine["unbiased"][cls] = msg.tensors["protos"].to(self.env.device)
        mine["known"][cls] = True

    def client_state(self, client: Client) -> dict[str, torch.Tensor]:
        return {**super().client_state(client), **{f"received.{k}": t for k, t in self.received[client.name].items()}}

    def load_client_state(self, client: Client, state: dict[str, torch.Tensor]) -> None:
        super().load_client_state(client, state)
        mine = self.received[client.name]
        for key in mine:
            mine[key] = state[f"received.{key}"].to(self.env.device)

    def server_state(self) -> dict[str, torch.Tensor]:
        return {f"received.{name}.{key}": t for name, got in self.received.items() for key, t in got.items()}

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, got in self.received.items():
            for key in got:
                got[key] = state[f"received.{name}.{key}"].to(self.env.device)
