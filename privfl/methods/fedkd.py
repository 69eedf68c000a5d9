"""FedKD: communication-efficient federated learning via adaptive mutual knowledge distillation.

Wu, Wu, Lyu, Huang, Xie, "Communication-efficient federated learning via knowledge distillation",
Nat. Commun. 13, 2032 (2022), arXiv 2108.13323; heterogeneous variant as HtFLlib
(``TsingZ0/HtFLlib``: ``clients/clientkd.py``, ``servers/serverkd.py``) and the FedRE paper's tables
(FedRE, CVPR 2026, Tables 1 and 11).

Each client k holds (:class:`FedKDModel`):

- its private **mentor** ``local``: its own :class:`~privfl.models.SplitModel` (any architecture);
- a shared, homogeneous **mentee** ``mentee``: a SplitModel of client 0's architecture (HtFLlib:
  ``BaseHeadSplit(args, 0)``; ``mentee_arch`` names another);
- ``w_h``: a private Linear(d -> d) without bias that maps the mentee's representation onto the
  mentor's for the hidden loss (HtFLlib ``W_h``; d = ``--rep-dim``).

Local objective (paper Eqs. 1-6 without the attention term, which needs transformers; HtFLlib
``clientKD.train``), per batch, with CE_t, CE_s the mentor's and mentee's cross-entropies:

    L_t = CE_t + KL(p_s || p_t) / (CE_t + CE_s) + MSE(H_t, W_h H_s) / (CE_t + CE_s)   (mentor)
    L_s = CE_s + KL(p_t || p_s) / (CE_t + CE_s) + MSE(H_t, W_h H_s) / (CE_t + CE_s)   (mentee)

(the adaptive distillation: both distillation terms are divided by the sum of the two task losses).
HtFLlib backpropagates ``L_t`` and then ``L_s`` into the same gradient buffers, with nothing detached,
so every part receives the gradient of L_t + L_s; that sum is the objective here, through the shared
trainer. Parameter groups: the mentor and ``w_h`` at ``--lr``, the mentee at ``mentee_lr`` (HtFLlib
``--mentee_learning_rate``, default 0.01); each part's gradient is clipped to norm ``grad_clip`` (10,
as HtFLlib, "to prevent divergency"). KL uses ``nn.KLDivLoss()``'s default reduction, the mean over
all B*C entries, as HtFLlib (``kl_reduction=batchmean`` is the textbook KL, C times larger).

Per round t (energy threshold T(t) below):

1. each selected client trains (above) and uploads its mentee's **parameters** SVD-compressed at
   energy T(t) (kind ``svd_model``, up; meta ``num_samples``, ``lr`` = mentee lr, ``energy``,
   ``local_steps``, ``conv_svd``);
2. the server decodes the uploads (:func:`privfl.codecs.svd_decode`), averages them (uniformly over the
   received uploads, as HtFLlib: ``1/len(uploaded_ids)``; ``weighting=samples`` weights by
   ``num_samples``), re-compresses the average at the same T(t) and broadcasts it to every client
   (``svd_model``, down, HtFLlib ``send_parameters``); each client loads the decoded mentee.

Before round 0 the server sends its initial mentee to every client once (``svd_model``, meta
``phase=setup``, energy 1: every singular value is kept, so the copy is exact up to float rounding;
HtFLlib copies the server's initial ``global_model`` into each client without a message).

What is sent, per client per round: its mentee up and the global mentee down, each
sum over factored tensors of B*r*(m+n+1) plus the numel of the tensors sent whole (biases, and any
weight with one row), where a factored (m x n) matrix keeps r singular values and B is the number of
matrices (out*in for a conv weight under ``conv_svd=htfllib``, 1 otherwise). The count depends on the
data and on the round (Table 11 lists it as data-dependent: hete 3353.68e3 on CIFAR-10 for 10
clients). The capture keeps the factors, so ``upload_scalars``/``broadcast_scalars`` are the
compressed counts; receivers and attackers see the decoded tensors.

Decisions where the paper is open or HtFLlib differs:

- **What is compressed.** The paper compresses the local *gradients* (updates) and their aggregate;
  HtFLlib compresses the mentee's *parameters*, both ways. Parameters are the default here, for parity
  with the FedRE tables. Compressing updates is not offered: an SVD update would be a message of form
  ``update``, which the ``svd_model`` kind (form ``parameters``) does not declare. Only parameters are
  sent (``named_parameters``, as HtFLlib): buffers of a BatchNorm mentee stay on each client.
- **Energy schedule.** HtFLlib's round i (i = 0..R, R = ``global_rounds``: it runs R+1 rounds) uses
  T = T_start + (i/R)(T_end - T_start): it starts at T_start and sets ``T_start + (1+i)/R (...)`` at the
  *end* of round i for round i+1. privfl uses the same T(t) = T_start + t/R (T_end - T_start) for its
  rounds t = 0..R-1 (R = ``--rounds``), so round 0 uses T_start and the last round
  T_start + (R-1)/R (T_end - T_start); HtFLlib's extra round R, the only one at T_end, has no
  counterpart. Clients and server use the same T in a round (HtFLlib sets both).
- **Rank rule.** :func:`privfl.codecs.svd_rank`: the smallest r whose kept energy exceeds T times the
  total. HtFLlib's search stops one singular value short and then keeps *zero* (the tensor is sent as
  zeros: for a 1x1 conv, or whenever only all values exceed T); here all are kept instead.
- **Conv weights.** ``conv_svd=htfllib`` (default, for the Table-11 comparison) factors a 4-d weight
  over its last two dimensions (out*in kh x kw matrices, one common rank chosen on their pooled energy),
  which for 5x5 kernels rarely compresses; ``conv_svd=reshape`` factors the (out, in*kh*kw) matrix and
  sends ``NAME@shape`` (bookkeeping, not counted) to restore the shape.
- **Mentee initialisation.** The server draws the initial mentee (client 0's architecture, its own
  seed) and sends it at setup; HtFLlib gives every client a copy without a message.
- **Evaluation.** The private mentor (HtFLlib's ``test_metrics`` uses ``model``); the mentee is the
  part a download overwrites (``personal_parts = ("mentee",)``), so ``--eval personal`` and ``global``
  score the same model.

Gradient leakage (``privfl.attack dlg|idlg|ig --artifact svd_model``, ``FedKD.leakage``): the attacker
(the server) differentiates the mentee alone, from the decoded mentee it last sent the client; the
upload's tensors are the decoded mentee parameters. Two approximations, both reported as the note: the
true local loss also distils from the private mentor (whose parameters and output the attacker lacks),
and the upload is SVD-truncated full parameters, whose truncation error is usually far larger than one
round's update, so the "update" the attacker sees is mostly compression error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from privfl.capture.message import Message
from privfl.codecs import CONV_SVD, svd_aux, svd_encode
from privfl.config import opt
from privfl.errors import ConfigError
from privfl.fl.method import METHODS, Client, ClientReply, FLMethod, LeakageContext, ModelRequest
from privfl.kinds import KINDS
from privfl.models.split import SplitModel
from privfl.seeding import seed_global

KIND = "svd_model"


@dataclass
class FedKDOptions:
    """FedKD's hyperparameters (defaults: HtFLlib ``main.py``); the shared ones are run options."""

    mentee_arch: str = opt("client0", "the shared mentee's architecture: client0 = client 0's (HtFLlib), or a model name (privfl.models.MODELS)")
    mentee_lr: float = opt(0.01, "mentee learning rate (HtFLlib --mentee_learning_rate 0.01); the mentor and W_h use --lr", min_exclusive=0)
    t_start: float = opt(0.95, "SVD energy threshold of round 0 (HtFLlib --T_start)", min=0, max=1)
    t_end: float = opt(
        0.98, "SVD energy threshold the schedule heads for (HtFLlib --T_end): round t uses T_start + t/R (T_end - T_start)", min=0, max=1
    )
    conv_svd: str = opt("htfllib", "conv weights: htfllib = SVD of each kh x kw slice (HtFLlib), reshape = SVD of (out, in*kh*kw)", choices=CONV_SVD)
    weighting: str = opt("uniform", "server average: uniform over the uploads (HtFLlib) or samples (by num_samples)", choices=("uniform", "samples"))
    grad_clip: float = opt(10.0, "max gradient norm, clipped separately for mentor, mentee and W_h (HtFLlib: 10; 0: off)", min=0)
    kl_reduction: str = opt(
        "mean", "KL reduction: mean over B*C entries (HtFLlib's nn.KLDivLoss()) or batchmean (the textbook KL)", choices=("mean", "batchmean")
    )

    def __post_init__(self) -> None:
        for key in ("t_start", "t_end"):
            value = getattr(self, key)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"option {key} must lie in [0, 1], got {value}")
        if self.mentee_lr <= 0:
            raise ConfigError(f"option mentee_lr must be positive, got {self.mentee_lr}")
        if self.grad_clip < 0:
            raise ConfigError(f"option grad_clip must be >= 0 (0: off), got {self.grad_clip}")


def energy_at(rnd: int, rounds: int, t_start: float, t_end: float) -> float:
    """T(t) = T_start + t/R (T_end - T_start), HtFLlib's threshold of round t (module docstring)."""
    return t_start + rnd / rounds * (t_end - t_start)


class FedKDModel(nn.Module):
    """One client's models: the private mentor ``local``, the shared ``mentee`` and the private ``w_h``.
    Its state_dict (``local.*``, ``mentee.*``, ``w_h.*``) is what checkpoints save; ``forward`` is the mentor."""

    def __init__(self, local: SplitModel, mentee: SplitModel):
        super().__init__()
        d, d_mentee = cast(nn.Linear, local.head).in_features, cast(nn.Linear, mentee.head).in_features
        if d != d_mentee:
            raise ConfigError(f"FedKD: mentor and mentee representations differ ({d} vs {d_mentee})")
        self.arch = local.arch
        self.spec = local.spec
        self.local = local  # the mentor: private, evaluated
        self.mentee = mentee  # shared: transmitted SVD-compressed
        self.w_h = nn.Linear(d_mentee, d, bias=False)  # private: mentee representation -> mentor's

    def represent(self, x: Tensor) -> Tensor:
        return self.local.represent(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.local(x)


def mentee_arch(req: ModelRequest) -> str:
    """The mentee's architecture: client 0's (HtFLlib) or the named one."""
    from privfl.models import assign_archs

    name = req.opts.mentee_arch
    return assign_archs(req.cfg.model_group, req.cfg.num_clients)[0] if name == "client0" else name


def build_mentee(req: ModelRequest) -> SplitModel:
    from privfl.models import build_model

    return build_model(
        mentee_arch(req),
        in_channels=req.in_channels,
        num_classes=req.num_classes,
        image_size=req.image_size,
        rep_dim=req.cfg.rep_dim,
        mapping=req.cfg.mapping,
    )


def kl(log_input: Tensor, log_target: Tensor, reduction: str) -> Tensor:
    """KL(target || input) from log-probabilities, as ``nn.KLDivLoss(reduction)(log_input, target.exp())``."""
    target = log_target.exp()
    pointwise = target * (log_target - log_input)
    return pointwise.mean() if reduction == "mean" else pointwise.sum() / log_input.shape[0]


def mentee_parameters(model: FedKDModel) -> dict[str, Tensor]:
    """What a mentee message carries: its parameters (not buffers, as HtFLlib's ``named_parameters``)."""
    return {k: p.detach() for k, p in model.mentee.named_parameters()}


@torch.no_grad()
def load_mentee(model: FedKDModel, dense: dict[str, Tensor]) -> None:
    """Overwrite the mentee's parameters with decoded ones (every parameter, each of its own shape)."""
    params = dict(model.mentee.named_parameters())
    if set(dense) != set(params):
        raise ValueError(f"mentee message carries {sorted(set(dense) ^ set(params))[:4]} unlike the mentee's parameters")
    for k, p in params.items():
        p.copy_(dense[k].reshape(p.shape).to(p))


def average(received: list[Message], weighting: str) -> dict[str, Tensor]:
    """The mean of the decoded uploads, uniform (HtFLlib) or weighted by ``num_samples``, in float64."""
    spec = KINDS.get(KIND)
    dense = [spec.dense(m.tensors) for m in received]
    weights = [float(m.meta["num_samples"]) if weighting == "samples" else 1.0 for m in received]
    total = sum(weights)
    out = {}
    for k, v in dense[0].items():
        acc = torch.zeros_like(v, dtype=torch.float64)
        for w, d in zip(weights, dense):
            acc += w * d[k].double()
        out[k] = (acc / total).to(v.dtype)
    return out


@METHODS.register("fedkd")
class FedKD(FLMethod):
    """See the module docstring. No server state: each round's global mentee is the average of that
    round's uploads, and the energy threshold is a function of the round."""

    parallel_clients = True
    name = "fedkd"
    sends = {KIND: "up/down"}
    Options = FedKDOptions
    personal_parts = ("mentee",)
    leakage = {
        KIND: LeakageContext(
            previous=KIND,
            module="mentee",
            note="CE on the mentee alone: the true loss also distils from the private mentor (KL and hidden MSE through W_h); "
            "the upload is SVD-truncated parameters, whose truncation error dominates one round's update",
        )
    }
    paper = "Wu et al., Communication-efficient federated learning via knowledge distillation (FedKD), Nat. Commun. 13, 2032 (2022)"

    @classmethod
    def build_client_model(cls, req: ModelRequest) -> FedKDModel:
        local = cast(SplitModel, super().build_client_model(req))  # the caller seeded this client's draw
        mentee = build_mentee(req)  # overwritten by the setup download
        return FedKDModel(local, mentee)

    def energy(self, rnd: int) -> float:
        return energy_at(rnd, self.cfg.rounds, self.opts.t_start, self.opts.t_end)

    def broadcast_mentee(self, rnd: int, tensors: dict[str, Tensor], energy: float, phase: str) -> None:
        meta = {"phase": phase, "energy": energy, "conv_svd": self.opts.conv_svd}
        self.deliver(self.channel.broadcast(rnd, self.client_names(), KIND, tensors, meta=meta, aux=svd_aux(tensors)))

    def receive(self, client: Client, msg: Message) -> None:
        """Client side: the decoded global mentee replaces its own."""
        load_mentee(client.model, KINDS.get(KIND).dense(msg.tensors))

    def setup(self) -> None:
        """The server's initial mentee to every client, every singular value kept (energy 1)."""
        from privfl.models import build_model

        seed_global(self.cfg.seed, "init", "server-mentee")
        mentee = build_model(**cast(FedKDModel, self.env.clients[0].model).mentee.spec).to(self.env.device)
        params = {k: p.detach() for k, p in mentee.named_parameters()}
        self.broadcast_mentee(0, svd_encode(params, 1.0, conv=self.opts.conv_svd), 1.0, "setup")

    def train_client(self, rnd: int, client: Client) -> dict[str, float]:
        """E local epochs of mutual distillation (module docstring), one summed objective."""
        o = self.opts

        def optimizer(model: FedKDModel) -> torch.optim.Optimizer:
            return self.trainer.make_optimizer(
                [
                    {"params": list(model.local.parameters())},  # --lr
                    {"params": list(model.mentee.parameters()), "lr": o.mentee_lr},
                    {"params": list(model.w_h.parameters())},  # --lr
                ]
            )

        def objective(model: FedKDModel, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            rep, rep_s = model.local.represent(x), model.mentee.represent(x)
            out, out_s = model.local.head(rep), model.mentee.head(rep_s)
            ce, ce_s = F.cross_entropy(out, y), F.cross_entropy(out_s, y)
            task = ce + ce_s
            logp, logp_s = F.log_softmax(out, dim=1), F.log_softmax(out_s, dim=1)
            kd = kl(logp, logp_s, o.kl_reduction) / task  # mentor learns from the mentee
            kd_s = kl(logp_s, logp, o.kl_reduction) / task  # mentee learns from the mentor
            hidden = F.mse_loss(rep, model.w_h(rep_s)) / task
            loss = (ce + kd + hidden) + (ce_s + kd_s + hidden)
            return loss, {"ce_mentor": ce, "ce_mentee": ce_s, "kd": kd + kd_s, "hidden": hidden}

        def clip(model: FedKDModel) -> None:
            if o.grad_clip > 0:
                for part in (model.local, model.mentee, model.w_h):
                    nn.utils.clip_grad_norm_(part.parameters(), o.grad_clip)

        stats = self.fit(rnd, client, objective, optimizer=optimizer, before_step=clip)
        return {**stats.as_dict("loss"), "steps": stats.steps}

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        """Client side: mutual distillation, then its mentee SVD-compressed at this round's energy, up."""
        energy = self.energy(rnd)
        out = self.train_client(rnd, client)
        tensors = svd_encode(mentee_parameters(client.model), energy, conv=self.opts.conv_svd)
        meta = {
            "num_samples": len(client.train_idx),
            "lr": self.opts.mentee_lr,
            "energy": energy,
            "local_steps": int(out["steps"]),
            "conv_svd": self.opts.conv_svd,
        }
        msg = Message(rnd, client.name, "server", KIND, tensors, meta, svd_aux(tensors))
        metrics = {"train_loss": out["loss"], **{k: out[k] for k in ("ce_mentor", "ce_mentee", "kd", "hidden")}}
        return ClientReply([(msg, {"indices": client.train_idx.cpu()})], metrics)

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """Server side, from what it received only: decode, average, re-compress at this round's threshold, broadcast."""
        energy = self.energy(rnd)
        self.broadcast_mentee(rnd, svd_encode(average(uploads, self.opts.weighting), energy, conv=self.opts.conv_svd), energy, "train")
        return {"energy": energy}

    def predict(self, client: Client, x: Tensor) -> Tensor:
        return client.model.local(x)


__all__ = ["FedKD", "FedKDModel", "FedKDOptions", "average", "energy_at", "kl", "load_mentee", "mentee_parameters"]
