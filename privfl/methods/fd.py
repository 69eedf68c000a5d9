"""FD, federated distillation (Jeong et al., "Communication-efficient On-device Machine Learning: Federated
Distillation and Augmentation under Non-IID Private Data", arXiv 1811.11479, 2018), as HtFLlib runs it
(``serverfd.py``/``clientfd.py``; a baseline of FedMRL's tables). FAug, the paper's GAN augmentation,
is not part of it.

Clients exchange per-class average logits instead of parameters, so any architectures work. Per round:

1. each selected client trains its whole model on CE + lambda * a distillation term that pulls the
   logits of each sample towards the global average logit of the sample's class (the last global
   logits it received; none in round 0, and none for a class they do not cover);
2. it uploads, for each of the k classes in its train split, the average of its logits over the
   samples of that class (kind ``logits``: ``logits`` (k, C), aux ``classes`` (k,));
3. the server averages each class's logits over the clients that uploaded that class, unweighted
   (HtFLlib's ``proto_aggregation``; the message carries no sample counts), and broadcasts the m
   classes it has (kind ``logits``, down: ``logits`` (m, C), aux ``classes`` (m,)) to every client,
   which replaces its global logits with them.

What is sent, per client per round: k*C scalars up (k = classes in the client's train split) and
m*C down (m = classes any selected client holds; m = C once the clients cover every class); the class
ids are bookkeeping (``aux``) that the papers' counts leave out. Nothing is sent at setup.

Decisions where the paper is open or HtFLlib differs:

- **When logits are collected** (``collect``). The paper's Algorithm 1 accumulates the outputs of the
  local training steps and so does HtFLlib (``clientfd.train``: every training batch's ``output``, in
  train mode, before the step, over all local epochs): ``collect=during``, the default. ``after``
  averages the logits of the trained model in eval mode over the train split, a pure function of the
  uploaded model state (a deterministic target for an attacker or a test).
- **The distillation term** (``distill_loss``), averaged over the batch (rows without a global logit
  count as zero):

  - ``soft_ce`` (default): CE between the output and softmax(global logit), i.e. KL up to a constant.
    The paper's regulariser is the cross-entropy to the global logit, and HtFLlib used exactly this from
    2024-04-22 (commit bf60d9a) until 2025-11-29, so also in the snapshot the FedRE code (2025-09) ran on;
  - ``raw_ce``: HtFLlib's HEAD (commit ca3e29a, 2025-11-29) dropped the softmax and passes the raw
    global logits to ``nn.CrossEntropyLoss`` as if they were probabilities. The target is then not a
    distribution and the term is unbounded below whenever a global logit has a negative entry, which
    logits almost always have; kept as an option, not the default;
  - ``mse``: HtFLlib before 2024-04-22 (``clientdistill.py``): MSE between output and global logit
    (mean over the C entries).

  HtFLlib's rows whose class has no global logit yet distil towards the sample's own detached output;
  that has zero gradient under ``soft_ce`` and ``mse`` and is left out here (under ``raw_ce`` it is a
  spurious term, left out too).
- **lambda** (``lamda``) 1.0: HtFLlib's default ``-lam 1.0`` and its FD script (``total.sh``: ``-lam 1``).
- **Whose average a client distils towards** (``global_logits``). In the paper's Algorithm 1 each
  device's global average leaves its own local average out (sum minus own, over the other devices);
  HtFLlib broadcasts one average over all uploading clients: ``all`` (default). ``others`` sends each
  client its own leave-one-out average (one message per client, still m*C scalars).
- **Which global logits a client keeps.** As in HtFLlib, each broadcast replaces the previous one
  (a class that no selected client held this round has no teacher until it comes back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from privfl.capture.message import Message
from privfl.config import opt
from privfl.fl.layout import compute_layout
from privfl.fl.method import METHODS, Client, ClientReply, FLMethod, class_prototypes

DISTILL_LOSSES = ("soft_ce", "raw_ce", "mse")


def logits_message(rnd: int, sender: str, receiver: str, classes: torch.Tensor, logits: torch.Tensor, meta: dict[str, Any] | None = None) -> Message:
    """One ``logits`` message: per-class logits (k, C) and their class ids (k,) as aux (k*C paper scalars)."""
    return Message(rnd, sender, receiver, "logits", {"logits": logits, "classes": classes}, dict(meta or {}), aux=("classes",))


class LogitAccumulator:
    """Per-class sums of the logits seen during local training (``collect=during``)."""

    def __init__(self, num_classes: int, device: torch.device):
        self.sums = torch.zeros(num_classes, num_classes, dtype=torch.float64, device=device)
        self.counts = torch.zeros(num_classes, dtype=torch.long, device=device)

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.sums.index_add_(0, labels, logits.detach().double())
        self.counts.index_add_(0, labels, torch.ones_like(labels))

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(classes seen (k,), their mean logits (k, C) as float32)."""
        present = torch.nonzero(self.counts, as_tuple=False).flatten()
        return present, (self.sums[present] / self.counts[present].unsqueeze(1).double()).float()


@torch.no_grad()
def class_mean_logits(model: Any, data: Any, idx: torch.Tensor, num_classes: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(classes present in ``idx`` (k,), the mean of ``model``'s logits over each class's samples (k, C)),
    in eval mode (``collect=after``)."""
    model.eval()
    logits, labels = [], []
    for x, y in data.batches(idx, batch_size):
        logits.append(model(x))
        labels.append(y)
    classes, means, _ = class_prototypes(torch.cat(logits), torch.cat(labels), num_classes)
    return classes, means


def distill_term(logits: torch.Tensor, target: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-row distillation loss of ``logits`` (n, C) towards the global logits ``target`` (n, C)."""
    if kind == "soft_ce":
        return -(target.softmax(1) * logits.log_softmax(1)).sum(1)
    if kind == "raw_ce":
        return -(target * logits.log_softmax(1)).sum(1)
    if kind == "mse":
        return (logits - target).pow(2).mean(1)
    raise ValueError(f"distill_loss must be one of {DISTILL_LOSSES}, got {kind!r}")


def aggregate_logits(received: list[Message], num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class sums (C, C) float64 and the number of clients holding each class (C,)."""
    device = received[0].tensors["logits"].device if received else None
    sums = torch.zeros(num_classes, num_classes, dtype=torch.float64, device=device)
    holders = torch.zeros(num_classes, dtype=torch.long, device=device)
    for msg in received:
        cls = msg.tensors["classes"].to(sums.device)
        sums.index_add_(0, cls, msg.tensors["logits"].to(sums.device).double())
        holders.index_add_(0, cls, torch.ones_like(cls))
    return sums, holders


def global_logits(sums: torch.Tensor, holders: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(classes held by some client (m,), their mean logits over those clients (m, C) as float32)."""
    present = torch.nonzero(holders, as_tuple=False).flatten()
    return present, (sums[present] / holders[present].unsqueeze(1).double()).float()


@dataclass
class FDOptions:
    lamda: float = opt(1.0, "weight of the distillation term (lambda; HtFLlib -lam 1.0)", min=0)
    distill_loss: str = opt(
        "soft_ce",
        "distillation term: soft_ce (CE to softmax(global logit): the paper, HtFLlib 2024-04..2025-11), "
        "raw_ce (HtFLlib HEAD: CE with raw logits as target) or mse (HtFLlib before 2024-04)",
        choices=DISTILL_LOSSES,
    )
    collect: str = opt(
        "during",
        "uploaded logits: during (of the local training steps; paper, HtFLlib) or after (of the trained model, eval mode)",
        choices=("during", "after"),
    )
    global_logits: str = opt(
        "all",
        "what a client distils towards: all (one average of every upload; HtFLlib) or others (its own left out; paper Alg. 1)",
        choices=("all", "others"),
    )


@METHODS.register("fd")
class FD(FLMethod):
    """Federated distillation: per-class average logits up, their per-class averages down (module docstring)."""

    parallel_clients = True
    name = "fd"
    sends = {"logits": "up/down"}
    Options = FDOptions
    personal_parts = ()  # nothing a client holds is overwritten by what it receives
    paper = "Jeong et al., Communication-Efficient On-Device ML: Federated Distillation and Augmentation (FD), arXiv 1811.11479"

    def __init__(self, env):
        super().__init__(env)
        c = env.num_classes
        # client side: what each client last received: global logits (C, C) and which classes they exist for (C,)
        self.received = {cl.name: (torch.zeros(c, c, device=env.device), torch.zeros(c, dtype=torch.bool, device=env.device)) for cl in env.clients}
        #: client side: the round of each client's last delivery (None: a checkpoint that predates this, trusted as is)
        self.received_in: dict[str, int | None] = {}

    def objective(self, client: Client, acc: LogitAccumulator | None) -> Callable[..., Any]:
        """CE + lambda * distillation towards the client's global logits; feeds ``acc`` when collecting during training."""
        target, known = self.received[client.name]
        lamda, kind = self.opts.lamda, self.opts.distill_loss

        def loss(model, x, y):
            logits = model(x)  # (B, C)
            if acc is not None:
                acc.add(logits, y)
            ce = F.cross_entropy(logits, y)
            mask = known[y]
            if lamda == 0 or not bool(mask.any()):
                return ce, {"ce": ce, "distill": 0.0}
            distill = distill_term(logits[mask], target[y[mask]], kind).sum() / len(y)
            return ce + lamda * distill, {"ce": ce, "distill": distill}

        return loss

    def upload(self, rnd: int, client: Client) -> tuple[float, float, Message]:
        """Local training, then the client's per-class average logits message: (loss, distill loss, message)."""
        acc = LogitAccumulator(self.env.num_classes, self.env.device) if self.opts.collect == "during" else None
        stats = self.fit(rnd, client, self.objective(client, acc))
        if acc is not None:
            classes, logits = acc.means()
        else:
            with compute_layout(client.model, self.cfg.memory_format):
                classes, logits = class_mean_logits(client.model, self.env.data, client.train_idx, self.env.num_classes, self.cfg.eval_batch_size)
        msg = logits_message(rnd, client.name, "server", classes, logits, {"arch": client.arch})
        return stats.loss, stats.parts.get("distill", 0.0), msg

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        """Client side: local training towards the global logits of the last round (each delivery replaces the
        previous one, as HtFLlib; a client the last round sent nothing distils towards nothing), then its
        per-class average logits up."""
        last = self.received_in.get(client.name, -1)
        if last is not None and last != rnd - 1:
            self.received[client.name][1].zero_()
        loss, distill, msg = self.upload(rnd, client)
        truth = {"indices": client.train_idx.cpu(), "labels": self.env.data.labels[client.train_idx].cpu()}
        return ClientReply([(msg, truth)], {"train_loss": loss, "distill_loss": distill})

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """Server side: per-class averages of the received logits, to every client (or, with ``others``, each
        client's average without its own upload, to the clients for which it holds any class)."""
        received = {msg.sender: msg for msg in uploads}
        sums, holders = aggregate_logits(uploads, self.env.num_classes)
        if self.opts.global_logits == "all":
            classes, logits = global_logits(sums, holders)
            self.deliver(self.channel.broadcast(rnd, self.client_names(), "logits", {"logits": logits, "classes": classes}, aux=("classes",)))
            return {}
        for name in self.client_names():  # leave-one-out: each client's own upload is taken out of its average
            own = received.get(name)
            s, h = sums.clone(), holders.clone()
            if own is not None:
                cls = own.tensors["classes"].to(s.device)
                s.index_add_(0, cls, -own.tensors["logits"].to(s.device).double())
                h.index_add_(0, cls, -torch.ones_like(cls))
            classes, logits = global_logits(s, h)
            if len(classes):
                self.deliver({name: self.send(logits_message(rnd, "server", name, classes, logits))})
        return {}

    def receive(self, client: Client, msg: Message) -> None:
        """Client side: the delivered logits replace what it held."""
        target, known = self.received[client.name]
        known.zero_()
        cls = msg.tensors["classes"].to(known.device)
        target[cls] = msg.tensors["logits"].to(target)
        known[cls] = True
        self.received_in[client.name] = msg.round

    def client_state(self, client: Client) -> dict[str, torch.Tensor]:
        target, known = self.received[client.name]
        last = self.received_in.get(client.name, -1)
        return {**super().client_state(client), "fd.logits": target, "fd.known": known, "fd.received_in": torch.tensor(-2 if last is None else last)}

    def load_client_state(self, client: Client, state: dict[str, torch.Tensor]) -> None:
        super().load_client_state(client, state)
        if "fd.logits" in state:
            target, known = self.received[client.name]
            target.copy_(state["fd.logits"])
            known.copy_(state["fd.known"])
            last = int(state["fd.received_in"])
            self.received_in[client.name] = None if last == -2 else last

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, (target, known) in self.received.items():  # checkpoints written before this state was the clients'
            if f"{name}.logits" in state:
                target.copy_(state[f"{name}.logits"])
                known.copy_(state[f"{name}.known"])
                self.received_in[name] = None


__all__ = ["FD", "FDOptions", "LogitAccumulator", "aggregate_logits", "class_mean_logits", "distill_term", "global_logits", "logits_message"]
