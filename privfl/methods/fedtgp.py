"""FedTGP: trainable global prototypes (Zhang, Liu, Hua, Cao, AAAI 2024, arXiv 2401.03230).

What is sent, per client and round:

- **up** (``proto``): the client's per-class prototypes, the mean mapped representation of each class
  present on it (train split, eval mode, after local training; :func:`prototype_message`), with their
  class ids and sample counts as bookkeeping. Paper-style count: (classes present) * d.
- **down** (``global_proto``): the C global prototypes the server's generator outputs, one per class,
  every class (also those no client uploaded: the generator produces them all, as HtFLlib does).
  Count: C * d per client, like FedProto (FedRE Table 11: 51.20 / 512.00 / 4096.00 for 10 clients).

Server. It keeps a trainable prototype generator (:class:`PrototypeGenerator`, HtFLlib's
``Trainable_Global_Prototypes``): an embedding of the C classes into R^d, then Linear(d, h) + ReLU and
Linear(h, d), h = d by default. Each round it trains the generator for ``server_epochs`` epochs over the
received (prototype, class) pairs, in shuffled batches of ``server_batch_size``, with plain SGD (a
fresh optimizer each round, no state) on the adaptive-margin-enhanced contrastive loss (ACL)::

    L = CE(-(dist(p, G) + delta * onehot(y)), y),  dist = Euclidean distance to each global prototype

which asks every client prototype p of class y to be nearer its own global prototype than any other
one by at least delta. The margin is (the paper's adaptive margin; HtFLlib ``receive_protos``)::

    delta = min( max_c min_{c' != c} || Q_c - Q_c' ||,  margin_threshold ),

Q_c being the unweighted mean over clients of the received prototypes of class c (classes received
this round only). Note the max over classes of the per-class minimum: the largest separation any class
already has among the clients, capped by the threshold (with fewer than two classes the cap alone).
After training, the generator's outputs for the C classes are broadcast.

Clients. Local loss CE + lambda * MSE(rep, global prototype of y) (mean over the batch's n * d entries,
rows of classes without a global prototype count as zero, as HtFLlib's ``proto_new``), with the
shared seeded trainer; plain CE in round 0, before any global prototype arrived. Inference is by the
nearest received global prototype (HtFLlib ``test_metrics`` takes the argmin of the MSE to each;
its ordering is the L2 distance's), and the local head until a broadcast arrived.

Defaults are HtFLlib's and the FedTGP repository's run scripts (``system/total.sh``,
``run_me.sh``: ``-lam 10 -se 100 -mart 100 -lr 0.01 -lbs 10``):

- ``lamda`` 10 (the argparse default is 1; the client code notes 10 follows FedProto's code);
- ``server_epochs`` 100 (the FedTGP repository's argparse default is 1000, its scripts pass 100);
- ``server_lr`` 0.01: HtFLlib's server actually uses ``-lr`` (the *local* lr, 0.01 in its scripts)
  and ignores ``-slr``, whose default is also 0.01; here it is its own option;
- ``server_batch_size`` 10: HtFLlib batches the server's prototype set by ``-lbs`` (local batch 10);
- ``margin_threshold`` 100 (``-mart``); ``hidden_dim`` = d (``server_hidden_dim = feature_dim``).

The FedTGP README warns that the server loss needs 1000+ rounds to drop below 1e-3 (FedTGP #2).

Server state kept for ``--resume``: the generator's parameters and what each client last received.
Everything random is seeded from the run seed: the generator's initialisation
(``seed, "init", "fedtgp-generator"``) and the server's shuffling (``seed, "fedtgp-server", round``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from privfl.capture.message import Message
from privfl.config import opt
from privfl.fl.method import METHODS, Client, ClientReply
from privfl.fl.prototypes import GlobalPrototypeReceiver, prototype_round, stacked_prototypes
from privfl.seeding import seed_global, torch_generator


@dataclass
class FedTGPOptions:
    lamda: float = opt(10.0, "weight lambda of the MSE to the global prototype (HtFLlib scripts: 10)", min=0)
    server_lr: float = opt(0.01, "server SGD learning rate of the prototype generator", min_exclusive=0)
    server_epochs: int = opt(100, "epochs the server trains the generator each round", min=1)
    server_batch_size: int = opt(10, "batch of (prototype, class) pairs on the server (HtFLlib: the local batch, 10)", min=1)
    margin_threshold: float = opt(100.0, "cap tau of the adaptive margin", min=0)
    hidden_dim: int | None = opt(None, "hidden width of the generator's MLP (None: d, as HtFLlib)", min=1)


class PrototypeGenerator(nn.Module):
    """The trainable global prototypes: class embedding (C, d) -> Linear(d, h) -> ReLU -> Linear(h, d)."""

    def __init__(self, num_classes: int, dim: int, hidden: int):
        super().__init__()
        self.embedding = nn.Embedding(num_classes, dim)
        self.middle = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU())
        self.fc = nn.Linear(hidden, dim)

    def forward(self, classes: torch.Tensor | None = None) -> torch.Tensor:
        """The global prototypes of ``classes`` (default: all C, in class order)."""
        emb = self.embedding.weight if classes is None else self.embedding(classes)
        return self.fc(self.middle(emb))


def adaptive_margin(protos: torch.Tensor, classes: torch.Tensor, threshold: float) -> float:
    """min(max_c min_{c' != c} ||Q_c - Q_c'||, threshold), Q_c the unweighted mean of the class-c rows."""
    present = torch.unique(classes)
    if len(present) < 2:
        return float(threshold)
    centres = torch.stack([protos[classes == c].mean(0) for c in present])
    dist = torch.cdist(centres.double(), centres.double())
    dist.fill_diagonal_(float("inf"))
    return float(min(dist.min(1).values.max().item(), threshold))


def acl_loss(generator: PrototypeGenerator, protos: torch.Tensor, classes: torch.Tensor, margin: float) -> torch.Tensor:
    """The adaptive-margin-enhanced contrastive loss of a batch of (prototype, class) pairs."""
    dist = torch.cdist(protos, generator())  # (b, C)
    dist = dist + margin * F.one_hot(classes, dist.shape[1]).to(dist.dtype)
    return F.cross_entropy(-dist, classes)


def train_generator(
    generator: PrototypeGenerator,
    protos: torch.Tensor,
    classes: torch.Tensor,
    margin: float,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    shuffle: torch.Generator,
) -> list[float]:
    """Train the generator with ACL on the received pairs (SGD, shuffled batches, the last partial one
    kept); returns the mean batch loss of each epoch."""
    optimizer = torch.optim.SGD(generator.parameters(), lr=lr)
    generator.train()
    losses = []
    n = len(classes)
    for _ in range(epochs):
        order = torch.randperm(n, generator=shuffle).to(protos.device)
        total, batches = 0.0, 0
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            loss = acl_loss(generator, protos[idx], classes[idx], margin)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
        losses.append(total / max(batches, 1))
    generator.eval()
    return losses


@METHODS.register("fedtgp")
class FedTGP(GlobalPrototypeReceiver):
    name = "fedtgp"
    parallel_clients = True
    sends = {"proto": "up", "global_proto": "down"}
    exposes = ("extractor",)
    Options = FedTGPOptions
    paper = "Zhang et al., FedTGP: Trainable Global Prototypes with Adaptive-Margin-Enhanced Contrastive Learning, AAAI 2024"

    def __init__(self, env):
        super().__init__(env)
        c, d = env.num_classes, self.cfg.rep_dim
        seed_global(self.cfg.seed, "init", "fedtgp-generator")
        self.generator = PrototypeGenerator(c, d, self.opts.hidden_dim or d).to(env.device)

    def objective(self, client: Client):
        """CE + lambda * MSE(rep, received global prototype of y) (plain CE before any arrived)."""
        protos, known = self.received[client.name]
        lamda = self.opts.lamda

        def loss(model, x, y):
            reps = model.represent(x)
            ce = F.cross_entropy(model.head(reps), y)
            if not known.any():
                return ce
            target = torch.where(known[y].unsqueeze(1), protos[y], reps.detach())
            mse = F.mse_loss(reps, target)
            return ce + lamda * mse, {"ce": ce, "proto_mse": mse}

        return loss

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        return prototype_round(self, rnd, client, self.objective(client))

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """Train the prototype generator on what was received (adaptive margin), then broadcast its output."""
        p, y = stacked_prototypes(self, uploads)
        margin = adaptive_margin(p, y, self.opts.margin_threshold)
        server_losses = train_generator(
            self.generator,
            p,
            y,
            margin,
            epochs=self.opts.server_epochs,
            batch_size=self.opts.server_batch_size,
            lr=self.opts.server_lr,
            shuffle=torch_generator(self.cfg.seed, "fedtgp-server", rnd),
        )
        with torch.no_grad():
            global_protos = self.generator().detach()
        c = self.env.num_classes
        tensors = {"protos": global_protos, "classes": torch.arange(c, device=global_protos.device)}
        self.deliver(self.channel.broadcast(rnd, self.client_names(), "global_proto", tensors, aux=("classes",)))
        return {"margin": margin, "server_loss": server_losses[-1]}

    @torch.no_grad()
    def predict(self, client: Client, x: torch.Tensor) -> torch.Tensor:
        """Minus the L2 distance to each received global prototype (nearest wins, as HtFLlib infers);
        the local head until any arrived."""
        protos, known = self.received[client.name]
        if not known.any():
            return client.model(x)
        dist = torch.cdist(client.model.represent(x), protos)
        dist[:, ~known] = float("inf")
        return -dist

    def predict_personal(self, client: Client, x: torch.Tensor) -> torch.Tensor:
        """``--eval personal``: the client's own head (never overwritten; a client whose representations
        sit far from the global prototypes can score far better with it, FedTGP issue #6)."""
        return client.model(x)

    def server_state(self) -> dict[str, torch.Tensor]:
        out = {f"generator.{k}": v.detach() for k, v in self.generator.state_dict().items()}
        for name, (protos, known) in self.received.items():
            out[f"received.{name}.protos"], out[f"received.{name}.known"] = protos, known
        return out

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.load_state_dict({k.removeprefix("generator."): v for k, v in state.items() if k.startswith("generator.")})
        for name, (protos, known) in self.received.items():
            protos.copy_(state[f"received.{name}.protos"])
            known.copy_(state[f"received.{name}.known"])
