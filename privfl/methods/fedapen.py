"""FedAPEN: personalized cross-silo FL with a learned adaptive ensemble.

Qin, Deng, Shen, Yang, Wang, Li, Li, "FedAPEN: Personalized Cross-silo Federated Learning with
Adaptability to Statistical Heterogeneity", KDD 2023 (official code: zhenqincn/FedAPEN). A baseline of
FedMRL (FedMRL Sec. 5.1; shared model CNN-1 with identical clients, CNN-5 otherwise).

Each client k holds a **private model** (its :class:`~privfl.models.SplitModel`, any architecture; never
sent), a **shared model** (one architecture for all, the only thing transmitted) and an **ensemble
weight** lambda_k in [0, 1]. It predicts with the lambda-weighted ensemble

    p(x) = lambda_k p_shared(x) + (1 - lambda_k) p_private(x)            (``--mix probs``)

returned as log p (class scores whose softmax is the mix); ``--mix logits`` mixes the logits instead,
as the official code does. lambda_k is a buffer of the client model (``shared_weight``), so checkpoints
save it and ``--resume`` continues with it.

Each round (two steps, "learning for ensemble" and "learning for adaptability" in the official code):

1. **Local training** of the selected clients on their training split less a held-out part: mutual
   learning of the two models, each with CE, KL to the other model's softened output (a fixed target)
   and CE of the lambda_k-weighted ensemble in which the other model's output is fixed (so each term
   trains one model only):

       L_private = CE(p_pri, y) + kl * KL(p_sha || p_pri) + ens * CE(mix(lambda_k; p_sha fixed, p_pri), y)
       L_shared  = CE(p_sha, y) + kl * KL(p_pri || p_sha) + ens * CE(mix(lambda_k; p_sha, p_pri fixed), y)

   (kl = ens = 1 as the official code; ``--ensemble-loss-weight 0`` is plain mutual learning). The
   client uploads its shared model (kind ``shared_model``, meta: samples trained on, lr, local steps).
2. The server averages the uploads weighted by sample count and broadcasts the average to every
   client (``shared_model``, down), which overwrites its shared model. Then each selected client
   **fits lambda_k** on its held-out samples with both models frozen (the received shared model and its
   private model, as the official code does after aggregation): ``--lambda-epochs`` epochs of SGD on
   CE(mix(lambda; p_sha, p_pri), y) over batches of ``--batch-size``, lr ``--lambda-lr``, lambda clipped
   to [0, 1] after every step, starting from its previous value (``--lambda-init`` before the first fit).
   The new lambda_k weights the ensemble at evaluation and in the next round's training term
   (``--eval personal`` scores the ensemble of the client's own shared model after local training
   with that same lambda_k).

The held-out part (``--holdout-fraction``, official ``ratio_train_adaptability``: 5%) is a fixed, seeded
subset of the client's training split (at least 1 sample, at most all but 1); it is never trained on
and never sent; ``num_samples`` and the truth of an upload are the remaining samples. Fraction 0 fits
lambda on the training samples themselves.

What is sent, per round (N clients, K selected, |theta| = the shared model's parameter count): upload K
|theta|, broadcast N |theta| (equal at full participation), plus one setup broadcast before round 0.
Default shared models as FML (``privfl.methods.fml``): CNN-5 (670,058 scalars at 3x32x32, 10 classes;
525,258 on Fashion-MNIST) or CNN-1 (2,621,558). lambda_k, the private model, its architecture and the
held-out samples stay on the client.

Gradient leakage (``--artifact shared_model``, ``FedAPEN.leakage``): the attacker differentiates the
shared model alone, CE on its own output; the true loss adds the KL term and the ensemble CE, both of
which need the private model's output and lambda_k (neither is sent).

Decisions where the paper is open, and what the official code does:
- lambda weights the *shared* model here (brief, and p = lambda p_sha + (1-lambda) p_pri); the official
  code's learned weight multiplies the private model: its w is our 1 - lambda. Both start at 0.5;
- the mix is of probabilities by default (an ensemble of the two predictive distributions); the official
  code mixes logits (``--mix logits``);
- lambda fitting: the official code's values (SGD lr 1e-3, 10 epochs over the held-out 5%, clip to
  [0, 1]), after aggregation, on the selected clients only (the official code has every client take
  part in every round); clients not selected keep their lambda;
- uploads averaged weighted by sample count (the official code takes the plain mean, with equal-sized
  clients); no gradient clipping by default (the official code has none: ``--grad-clip``);
- the official code decays the lr by 0.99 per round and trains 5 local epochs at batch 64; here lr,
  epochs and batch size are the run's options, and the optimizer is fresh every round, as there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from privfl.capture.message import Message
from privfl.config import opt
from privfl.fl.method import METHODS, Client, ClientReply, LeakageContext, ModelRequest
from privfl.methods.fml import SHARED_ARCHS, MutualLearningServer, build_shared_model, clip_parts, mutual_loss
from privfl.models.split import SplitModel
from privfl.seeding import torch_generator

MIXES = ("probs", "logits")


def ensemble(shared_logits: Tensor, local_logits: Tensor, weight: Tensor | float, mix: str = "probs") -> Tensor:
    """Class scores of the lambda-weighted ensemble: log(lambda p_sha + (1 - lambda) p_pri) (``probs``; its
    softmax is the mix, and CE on it is the mixture's negative log-likelihood), or lambda z_sha + (1 -
    lambda) z_pri (``logits``)."""
    if mix == "logits":
        return weight * shared_logits + (1 - weight) * local_logits
    if mix != "probs":
        raise ValueError(f"unknown mix {mix!r}; accepted: {', '.join(MIXES)}")
    p = weight * F.softmax(shared_logits, dim=1) + (1 - weight) * F.softmax(local_logits, dim=1)
    return p.clamp_min(1e-12).log()


def fit_shared_weight(
    weight: float,
    shared_logits: Tensor,
    local_logits: Tensor,
    y: Tensor,
    *,
    lr: float,
    epochs: int,
    batch_size: int,
    mix: str = "probs",
    generator: Callable[[int], torch.Generator] | None = None,
) -> float:
    """lambda after ``epochs`` of SGD on CE(ensemble(lambda), y) over batches of the frozen models' logits,
    clipped to [0, 1] after every step. ``generator(epoch)`` shuffles each epoch (None: in order)."""
    w = torch.tensor(float(weight), device=shared_logits.device, requires_grad=True)
    sgd = torch.optim.SGD([w], lr=lr)
    s, p = shared_logits.detach(), local_logits.detach()
    n = len(y)
    for epoch in range(epochs):
        order = torch.randperm(n, generator=generator(epoch)) if generator is not None else torch.arange(n)
        order = order.to(y.device)
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            loss = F.cross_entropy(ensemble(s[idx], p[idx], w, mix), y[idx])
            sgd.zero_grad(set_to_none=True)
            loss.backward()
            sgd.step()
            with torch.no_grad():
                w.clamp_(0.0, 1.0)
    return float(w.detach())


@dataclass
class FedAPENOptions:
    """FedAPEN's hyperparameters; lr, batch size, local epochs, momentum and weight decay are run options."""

    kl_weight: float = opt(1.0, "weight of KL(other || own) in each model's loss (official code: 1)", min=0)
    ensemble_loss_weight: float = opt(
        1.0, "weight of CE of the lambda-weighted ensemble in each model's loss (official code: 1; 0: plain mutual learning)", min=0
    )
    mix: str = opt("probs", "what lambda mixes: probs = lambda p_shared + (1 - lambda) p_private; logits = the logits (official code)", choices=MIXES)
    lambda_init: float = opt(0.5, "lambda before the first fit (official: 0.5)", min=0, max=1)
    lambda_lr: float = opt(1e-3, "SGD learning rate of lambda (official: 1e-3)", min_exclusive=0)
    lambda_epochs: int = opt(10, "epochs of lambda fitting over the held-out samples per round (official: 10; 0: lambda stays fixed)", min=0)
    holdout_fraction: float = opt(
        0.05,
        "share of each client's training split held out to fit lambda, never trained on (official: 0.05; 0: fit on the training split)",
        min=0,
        max_exclusive=1,
    )
    shared_arch: str = opt(
        "auto",
        "shared model: auto = FedMRL's CNN-1 if every client has the same architecture, else CNN-5; cnnJ = FedMRL's CNN-J; "
        "client0 = client 0's architecture",
        choices=SHARED_ARCHS,
    )
    grad_clip: float = opt(0.0, "max gradient norm, clipped per model (official code: none; 0: off)", min=0)


class FedAPENModel(nn.Module):
    """One client's ``local`` (private SplitModel), ``shared`` model and ensemble weight ``shared_weight``
    (lambda, a buffer: checkpointed, never trained by the local optimizer). ``forward`` is the ensemble."""

    shared_weight: Tensor

    def __init__(self, local: SplitModel, shared: nn.Module, weight: float = 0.5, mix: str = "probs"):
        super().__init__()
        if mix not in MIXES:
            raise ValueError(f"unknown mix {mix!r}; accepted: {', '.join(MIXES)}")
        self.arch = getattr(local, "arch", type(local).__name__)
        self.local = local  # private: never sent
        self.shared = shared  # sent as `shared_model`
        self.mix = mix
        self.register_buffer("shared_weight", torch.tensor(float(weight)))

    def scores(self, shared_logits: Tensor, local_logits: Tensor) -> Tensor:
        return ensemble(shared_logits, local_logits, self.shared_weight, self.mix)

    def forward(self, x: Tensor) -> Tensor:
        return self.scores(self.shared(x), self.local(x))


@METHODS.register("fedapen")
class FedAPEN(MutualLearningServer):
    """See the module docstring. Server state: the global shared model (checkpointed for --resume)."""

    parallel_clients = True
    name = "fedapen"
    shared_part = "shared"
    sends = {"shared_model": "up/down"}
    personal_parts = ("shared",)  # the broadcast overwrites the shared model only (lambda and the private model stay)
    Options = FedAPENOptions
    leakage = {
        "shared_model": LeakageContext(
            previous="shared_model",
            module="shared",
            note="CE on the shared model's own output; the true loss adds KL to the private model and CE of the lambda-weighted ensemble",
        )
    }
    paper = "Qin et al., FedAPEN: Personalized Cross-silo Federated Learning with Adaptability to Statistical Heterogeneity, KDD 2023"

    @classmethod
    def build_client_model(cls, req: ModelRequest) -> FedAPENModel:
        local = cast(SplitModel, super().build_client_model(req))  # first: the same init as other methods' client models
        shared = build_shared_model(req)  # overwritten by the setup broadcast
        return FedAPENModel(local, shared, req.opts.lambda_init, req.opts.mix)

    def __init__(self, env):
        super().__init__(env)
        #: client side: the round each client last trained in
        self.trained_in: dict[str, int] = {}

    def split(self, client: Client) -> tuple[Tensor, Tensor]:
        """(samples trained on, held-out samples for lambda) of the client's training split: a fixed seeded
        subset of ``round(fraction * n)`` samples, at least 1 and at most n - 1; no hold-out (both the
        whole split) when the fraction is 0 or the client has fewer than 2 samples."""
        idx = client.train_idx
        n, frac = len(idx), self.opts.holdout_fraction
        if frac == 0 or n < 2:
            return idx, idx
        m = min(n - 1, max(1, round(frac * n)))
        perm = torch.randperm(n, generator=torch_generator(self.cfg.seed, "fedapen-holdout", client.index)).to(idx.device)
        return idx[perm[m:]].sort().values, idx[perm[:m]].sort().values

    def train_client(self, rnd: int, client: Client, train_idx: Tensor) -> dict[str, float]:
        o = self.opts

        def objective(model: FedAPENModel, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            out_local, out_shared = model.local(x), model.shared(x)
            loss_local, _, _ = mutual_loss(out_local, out_shared, y, 1.0, o.kl_weight)
            loss_shared, _, _ = mutual_loss(out_shared, out_local, y, 1.0, o.kl_weight)
            ens_local = F.cross_entropy(model.scores(out_shared.detach(), out_local), y)  # trains the private model
            ens_shared = F.cross_entropy(model.scores(out_shared, out_local.detach()), y)  # trains the shared model
            loss_local = loss_local + o.ensemble_loss_weight * ens_local
            loss_shared = loss_shared + o.ensemble_loss_weight * ens_shared
            return loss_local + loss_shared, {"loss_local": loss_local, "loss_shared": loss_shared, "ce_ensemble": ens_local}

        part = dataclasses.replace(client, train_idx=train_idx)  # the same client and model, minus its held-out samples
        stats = self.fit(rnd, part, objective, before_step=lambda m: clip_parts((m.local, m.shared), o.grad_clip))
        return {**stats.as_dict("loss"), "steps": stats.steps}

    @torch.no_grad()
    def logits(self, client: Client, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(shared logits, private logits, labels) of samples ``idx``, eval mode."""
        model = client.model
        model.eval()
        shared, local, labels = [], [], []
        for x, y in self.env.data.batches(idx, self.cfg.eval_batch_size):
            shared.append(model.shared(x))
            local.append(model.local(x))
            labels.append(y)
        return torch.cat(shared), torch.cat(local), torch.cat(labels)

    def fit_lambda(self, rnd: int, client: Client, held: Tensor) -> float:
        """Learning for adaptability: lambda on the held-out samples, both models frozen (module docstring)."""
        o = self.opts
        model = client.model
        if o.lambda_epochs == 0 or len(held) == 0:
            return float(model.shared_weight)
        s, p, y = self.logits(client, held)
        lam = fit_shared_weight(
            float(model.shared_weight),
            s,
            p,
            y,
            lr=o.lambda_lr,
            epochs=o.lambda_epochs,
            batch_size=self.cfg.batch_size,
            mix=o.mix,
            generator=lambda epoch: torch_generator(self.cfg.seed, "fedapen-lambda", rnd, client.index, epoch),
        )
        model.shared_weight.fill_(lam)
        return lam

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        """Client side: mutual + ensemble learning on its samples minus the held-out ones, the shared model up."""
        train_idx, _ = self.split(client)
        out = self.train_client(rnd, client, train_idx)
        self.trained_in[client.name] = rnd
        metrics = {"train_loss": out["loss"], **{k: out[k] for k in ("loss_local", "loss_shared", "ce_ensemble")}}
        return ClientReply([self.upload(rnd, client, train_idx, int(out["steps"]))], metrics)

    def receive(self, client: Client, msg: Message) -> None:
        """Client side: load the global shared model; after a round in which it trained, fit lambda on its
        held-out samples with it. Every client reports its lambda (``shared_weight``, the mean over clients)."""
        super().receive(client, msg)
        if msg.meta.get("phase") == "setup":
            return
        if self.trained_in.get(client.name) == msg.round:
            self.fit_lambda(msg.round, client, self.split(client)[1])
        self.note(client, {"shared_weight": float(client.model.shared_weight)})

    def client_state(self, client: Client) -> dict[str, Tensor]:
        """The round it last trained in (lambda is fitted when that round's broadcast arrives)."""
        return {**super().client_state(client), "fedapen.trained_in": torch.tensor(self.trained_in.get(client.name, -1))}

    def load_client_state(self, client: Client, state: dict[str, Tensor]) -> None:
        super().load_client_state(client, state)
        if "fedapen.trained_in" in state:
            self.trained_in[client.name] = int(state["fedapen.trained_in"])

    def predict(self, client: Client, x: Tensor) -> Tensor:
        return client.model(x)


__all__ = ["MIXES", "FedAPEN", "FedAPENModel", "FedAPENOptions", "ensemble", "fit_shared_weight"]
