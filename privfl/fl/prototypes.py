"""Prototype methods: FedProto and FedGH. Clients upload per-class prototypes (``proto``).

A prototype message carries ``protos`` (k, d) for the k classes present on the client plus their
``classes`` and sample ``counts`` as aux tensors, so the paper-style count is (client-class pairs) * d.

- FedProto (Tan et al., AAAI 2022): the server averages each class's prototypes over clients,
  weighted by sample counts (the paper's |D_k,c|/N_c; HtFLlib averages unweighted: ``weighting``),
  and broadcasts them (``global_proto``); clients add lambda * MSE(rep, global prototype of y) to CE
  and classify by the nearest global prototype. lambda is tuned per dataset in the paper and differs
  between paper and code (HtFLlib #12: 0.1 vs 10); we default to 1.0. Which representations a
  client's prototype averages is ``prototypes``: by default one eval-mode forward pass over the train
  split after local training (Eq. 4 of the paper, f_i with the trained phi_i); ``training`` averages the
  representations the training steps themselves computed, over every local epoch, as HtFLlib's
  ``clientProto.train`` does, which saves that pass (a forward over the train split per client and round).
- FedGH (Yi et al., ACM MM 2023): the server trains the shared global head on the (prototype, class)
  pairs with CE and broadcasts it; clients replace their head with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from privfl.capture.message import Message
from privfl.config import opt
from privfl.fl.headserver import GlobalHeadServer, HeadServerOptions
from privfl.fl.method import METHODS, Client, ClientReply, FLMethod, class_prototypes, present_class_means


class TrainingPrototypes:
    """Per-class sums of the representations a client's training steps computed (FedProto's
    ``prototypes=training``): the mean over every step of every local epoch, with the weights of that
    step, in train mode; a sample seen in two epochs counts twice, a sample of a dropped last batch
    (``--drop-last``) not at all."""

    def __init__(self, num_classes: int, dim: int, device: torch.device):
        self.num_classes = num_classes
        self.sums = torch.zeros(num_classes, dim, device=device)
        self.seen = torch.zeros(num_classes, dtype=torch.long, device=device)

    def add(self, reps: torch.Tensor, labels: torch.Tensor) -> None:
        self.sums.index_add_(0, labels, reps.detach().to(self.sums.dtype))
        self.seen += torch.bincount(labels, minlength=self.num_classes)

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(classes seen, their mean representation (k, d))."""
        return present_class_means(self.sums, self.seen)


def prototype_message(
    method: FLMethod, rnd: int, client: Client, from_training: TrainingPrototypes | None = None
) -> tuple[Message, dict[str, torch.Tensor]]:
    """Prototypes of the client's train split after local training (eval mode), or the means
    ``from_training`` collected, and the truth behind them. ``counts`` is each class's number of
    samples in the train split either way (the |D_i,j| the server's weighting reads)."""
    if from_training is None:
        reps, labels = method.representations(client)
        classes, protos, counts = class_prototypes(reps, labels, method.env.num_classes)
    else:
        labels = method.env.data.labels[client.train_idx]
        classes, protos = from_training.means()
        counts = torch.bincount(labels, minlength=method.env.num_classes)[classes]
    msg = Message(
        rnd,
        client.name,
        "server",
        "proto",
        {"protos": protos, "classes": classes, "counts": counts},
        {"arch": client.arch},
        aux=("classes", "counts"),
    )
    return msg, {"indices": client.train_idx.cpu(), "labels": labels.cpu()}


def prototype_round(method: FLMethod, rnd: int, client: Client, objective: Any) -> ClientReply:
    """The client half of a prototype round (FedTGP, FPL): train with ``objective``, then upload the
    prototypes; the metrics are ``train_loss`` and the loss parts the objective reported."""
    stats = method.fit(rnd, client, objective)
    msg, truth = prototype_message(method, rnd, client)
    method.env.knowledge.record_extractor(rnd, client)
    return ClientReply([(msg, truth)], {"train_loss": stats.loss, **stats.parts})


def stacked_prototypes(method: FLMethod, uploads: list[Message]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every received prototype (n, d) and its class id (n,), concatenated in upload order on the method's device."""
    device = method.env.device
    return torch.cat([m.tensors["protos"].to(device) for m in uploads]).float(), torch.cat([m.tensors["classes"].to(device) for m in uploads]).long()


@dataclass
class FedGHOptions(HeadServerOptions):
    """The server trains the global head on (prototype, class) pairs."""


@METHODS.register("fedgh")
class FedGH(GlobalHeadServer):
    name = "fedgh"
    parallel_clients = True
    sends = {"proto": "up", "head": "down"}
    exposes = ("extractor",)
    Options = FedGHOptions
    paper = "Yi et al., FedGH, ACM MM 2023"

    def upload(self, rnd: int, client: Client) -> tuple[Message, dict[str, torch.Tensor]]:
        return prototype_message(self, rnd, client)

    def head_data(self, received: list[Message]) -> tuple[torch.Tensor, torch.Tensor]:
        # every (prototype, class) pair of every client
        return torch.cat([m.tensors["protos"] for m in received]), torch.cat([m.tensors["classes"] for m in received])


class GlobalPrototypeReceiver(FLMethod):
    """A method whose clients keep the last global prototype of each class they received (FedProto,
    FedTGP): ``received[client] = (protos (C, d), known (C,))``, filled by ``global_proto`` messages and
    kept between rounds as client state."""

    def __init__(self, env):
        super().__init__(env)
        c, d = env.num_classes, self.cfg.rep_dim
        self.received = {cl.name: (torch.zeros(c, d, device=env.device), torch.zeros(c, dtype=torch.bool, device=env.device)) for cl in env.clients}

    def receive(self, client: Client, msg: Message) -> None:
        protos, known = self.received[client.name]
        cls = msg.tensors["classes"].to(self.env.device)
        protos[cls] = msg.tensors["protos"].to(self.env.device)
        known[cls] = True

    def client_state(self, client: Client) -> dict[str, torch.Tensor]:
        protos, known = self.received[client.name]
        return {**super().client_state(client), "received.protos": protos, "received.known": known}

    def load_client_state(self, client: Client, state: dict[str, torch.Tensor]) -> None:
        super().load_client_state(client, state)
        protos, known = self.received[client.name]
        protos.copy_(state["received.protos"])
        known.copy_(state["received.known"])


@dataclass
class FedProtoOptions:
    lamda: float = opt(1.0, "weight of the prototype regulariser (lambda)", min=0)
    weighting: str = opt("samples", "global prototype average: samples (paper) or uniform (HtFLlib)", choices=("samples", "uniform"))
    prototypes: str = opt(
        "pass",
        "what a client's prototypes average: pass (a forward over the train split after training, Eq. 4) "
        "or training (the training steps' representations, HtFLlib)",
        choices=("pass", "training"),
    )


@METHODS.register("fedproto")
class FedProto(GlobalPrototypeReceiver):
    name = "fedproto"
    parallel_clients = True
    sends = {"proto": "up", "global_proto": "down"}
    exposes = ("extractor",)
    Options = FedProtoOptions
    paper = "Tan et al., FedProto, AAAI 2022"

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        """Local CE + lambda * MSE to the global prototypes this client last received, then its prototypes."""
        protos, known = self.received[client.name]
        collected = TrainingPrototypes(self.env.num_classes, self.cfg.rep_dim, self.env.device) if self.opts.prototypes == "training" else None

        def proto_term(reps, logits, y):
            if collected is not None:
                collected.add(reps, y)
            mask = known[y]
            if not mask.any():
                return reps.new_zeros(())
            return self.opts.lamda * F.mse_loss(reps[mask], protos[y[mask]])

        loss = self.local_train(rnd, client, proto_term)
        msg, truth = prototype_message(self, rnd, client, collected)
        self.env.knowledge.record_extractor(rnd, client)
        return ClientReply([(msg, truth)], {"train_loss": loss})

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """Global prototypes: per class, the (sample- or uniformly) weighted mean of the received ones."""
        c, d = self.env.num_classes, self.cfg.rep_dim
        sums = torch.zeros(c, d, device=self.env.device)
        weights = torch.zeros(c, device=self.env.device)
        for received in uploads:
            cls = received.tensors["classes"].to(self.env.device)
            w = (
                received.tensors["counts"].to(self.env.device).float()
                if self.opts.weighting == "samples"
                else torch.ones(len(cls), device=self.env.device)
            )
            sums.index_add_(0, cls, received.tensors["protos"].to(self.env.device) * w.unsqueeze(1))
            weights.index_add_(0, cls, w)
        present = torch.nonzero(weights, as_tuple=False).flatten()
        global_protos = sums[present] / weights[present].unsqueeze(1)  # (m, d)
        tensors = {"protos": global_protos, "classes": present}
        self.deliver(self.channel.broadcast(rnd, self.client_names(), "global_proto", tensors, aux=("classes",)))
        return {}

    def predict(self, client: Client, x: torch.Tensor) -> torch.Tensor:
        """Nearest received global prototype (L2), as FedProto infers; the local head until any arrive."""
        protos, known = self.received[client.name]
        if not known.any():
            return client.model(x)
        reps = client.model.represent(x)
        dist = torch.cdist(reps, protos)
        dist[:, ~known] = float("inf")
        return -dist

    def predict_personal(self, client: Client, x: torch.Tensor) -> torch.Tensor:
        """``--eval personal``: the client's own head (FedProto never overwrites it)."""
        return client.model(x)

    def server_state(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, (protos, known) in self.received.items():
            out[f"{name}.protos"], out[f"{name}.known"] = protos, known
        return out

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, (protos, known) in self.received.items():
            protos.copy_(state[f"{name}.protos"])
            known.copy_(state[f"{name}.known"])
