"""FedMRL: federated model-heterogeneous Matryoshka representation learning.

Yi, Yu, Ren, Wang, Liu, Li, "Federated Model Heterogeneous Matryoshka Representation Learning",
NeurIPS 2024, arXiv 2406.00488.

Each client k holds three parts, trained jointly from one loss (Sec. 3, Eqs. 2-10):
- G = G^hd o G^ex, the **shared homogeneous small model** (the only thing transmitted): a CNN of
  Table 2 with FC2 = d1 and its own FC3, the *global header* (CNN-5 in the model-heterogeneous and
  CNN-1 in the model-homogeneous setting; ``--small-model``);
- F_k = F_k^hd o F_k^ex, the client's **heterogeneous model**: its :class:`~privfl.models.SplitModel`
  (features + RM -> d2 = ``--rep-dim``; head = the *local header*), so any model group works;
- P_k, the **private projector**: Linear(d1 + d2 -> d2) with bias, no activation.

Forward (Eqs. 2-7): R^G = G^ex(x) (d1), R^F = F_k^ex(x) (d2), R = [R^G, R^F] (splice, small first),
R~ = P_k(R) (d2); its Matryoshka slices are R~[:d1] (coarse) and R~[:d2] = R~ (fine);
y^G = G^hd(R~[:d1]), y^F = F_k^hd(R~). Loss (Eqs. 8-9): m^G CE(y^G, y) + m^F CE(y^F, y), m = 1.
Inference (Sec. 3, App. C.3): "mix-large" = G^ex + F_k^ex + P_k + F_k^hd (no global header).

Per round (Alg. 1): the server sends the global small model to the K selected clients
(``small_model``, down); each loads it, trains G, F_k and P_k on its data, uploads its small model
(``small_model``, up, meta: sample count, lr, local steps); the server averages the K uploads weighted
by sample count over the selected clients (Sec. 3.3). F_k and P_k never leave the client; nor does
the client's architecture (no ``arch`` in the meta, unlike other methods: structure privacy is a claim
of the paper, App. D). Per round: 2 K |theta| scalars.

Gradient leakage (``privfl.attack dlg|idlg|ig --artifact small_model``, declared in ``FedMRL.leakage``):
the attacker (the server) needs the small model it sent the client that round (in the capture), the
small model's architecture (the run's options) and the local lr and step count (message meta / run config). It
matches the upload as (theta_prev - theta_k) / (lr * steps) against the gradient of CE on the small
model's *own* output G^hd(G^ex(x)). That is an approximation: the real local loss is the fused one,
whose gradient reaches G^ex through the private projector P_k and G^hd through R~[:d1], both of which
the attacker lacks (docs/methods/fedmrl.md).

Decisions where the paper is open (docs/methods/fedmrl.md has the reasons): uploads weighted by the
client's train-sample count, normalised over the selected clients; fresh optimizer state for every
client every round (the official code leaks momentum across clients); separate global and local
headers (the official homogeneous script overwrites one with the other); every upload really averaged
(the official code ends up with the last client's model); each client evaluates with the small model
it last trained (the official code evaluates right after local training).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from privfl.capture.message import Message
from privfl.config import opt
from privfl.errors import ConfigError
from privfl.fl.method import METHODS, Client, ClientReply, FLMethod, LeakageContext, ModelRequest, load_module_tensors, module_tensors
from privfl.models.fedmrl_zoo import CNN_TABLE, MRLConvNet, small_model
from privfl.models.split import SplitModel
from privfl.seeding import seed_global

SMALL_MODELS = ("auto", *(f"cnn{v}" for v in CNN_TABLE))
INFERENCE = ("mix-large", "mix-small", "single-large", "single-small")


@dataclass
class FedMRLOptions:
    """FedMRL's hyperparameters; the shared ones (lr, batch size, local epochs, momentum, weight decay)
    are run options. Paper values: docs/methods/fedmrl.md "Reproducing the paper"."""

    d1: int = opt(
        200,
        "Matryoshka/small-model representation dimension d1 <= d2 = --rep-dim (paper grid 100..500, Fig. 6: best 200 on CIFAR-10, 100 on CIFAR-100)",
        min=1,
    )
    small_model: str = opt(
        "auto",
        "small model G: CNN-j of Table 2 with FC2 = d1; auto = cnn1 if every client has the "
        "same architecture (Table 3 setting), else cnn5 (Table 1 setting)",
        choices=SMALL_MODELS,
    )
    loss_weight_global: float = opt(1.0, "m^G, weight of CE(global header(R~[:d1])) (Eq. 9; paper: 1)", min=0)
    loss_weight_local: float = opt(1.0, "m^F, weight of CE(local header(R~)) (Eq. 9; paper: 1)", min=0)
    small_lr: float | None = opt(None, "eta_theta for the small model (Eq. 10; default --lr, as the paper)", min_exclusive=0)
    projector_lr: float | None = opt(None, "eta_phi for the projector (Eq. 10; default --lr, as the paper)", min_exclusive=0)
    grad_clip: float = opt(50.0, "max gradient norm, clipped separately for G, F_k and P_k (official code: 50; 0: off)", min=0)
    projector_bias: bool = opt(True, "projector Linear(d1+d2 -> d2) has a bias (official code: yes)")
    inference: str = opt("mix-large", "inference model (App. C.3, Fig. 7): mix-large is the paper's default", choices=INFERENCE)

    def __post_init__(self) -> None:
        if isinstance(self.d1, bool) or not isinstance(self.d1, int) or self.d1 < 1:
            raise ConfigError(f"option d1 must be a positive integer, got {self.d1!r}")
        if self.loss_weight_global < 0 or self.loss_weight_local < 0 or self.loss_weight_global + self.loss_weight_local == 0:
            raise ConfigError("options loss_weight_global and loss_weight_local must be >= 0 and not both 0")
        for key in ("small_lr", "projector_lr"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"option {key} must be positive, got {value}")
        if self.grad_clip < 0:
            raise ConfigError(f"option grad_clip must be >= 0 (0: off), got {self.grad_clip}")


def matryoshka_slices(rep: Tensor, dims: tuple[int, ...]) -> list[Tensor]:
    """Nested prefixes ``rep[:, :d]`` for increasing ``dims`` (Eq. 5: coarse R~[:d1] inside fine R~[:d2])."""
    if any(b <= a for a, b in itertools.pairwise(dims)) or not dims or dims[0] < 1 or dims[-1] > rep.shape[1]:
        raise ValueError(f"Matryoshka dims {dims} must increase within 1..{rep.shape[1]}")
    return [rep[:, :d] for d in dims]


class FedMRLModel(nn.Module):
    """One client's whole model W_k = (G o F_k | P_k); its state_dict (``small.*``, ``local.*``,
    ``projector.*``) is what checkpoints save."""

    def __init__(self, small: MRLConvNet, local: SplitModel, d1: int, *, projector_bias: bool = True):
        super().__init__()
        d2 = cast(nn.Linear, local.head).in_features
        if small.rep_dim != d1 or small.fc3 is None:
            raise ConfigError(f"the small model must end in FC2 = d1 = {d1} and a header")
        if d1 > d2:
            raise ConfigError(f"FedMRL needs d1 <= d2: option d1 = {d1} exceeds --rep-dim {d2}")
        self.d1, self.d2 = d1, d2
        self.arch = getattr(local, "arch", type(local).__name__)
        self.small = small  # G: shared, transmitted
        self.local = local  # F_k: private SplitModel (features + RM = F_k^ex, head = F_k^hd)
        self.projector = nn.Linear(d1 + d2, d2, bias=projector_bias)  # P_k: private

    def fuse(self, x: Tensor) -> Tensor:
        """R~ = P_k([G^ex(x), F_k^ex(x)]) (Eqs. 2-4): (B, d2)."""
        r_small = self.small.represent(x)  # (B, d1)
        r_local = self.local.represent(x)  # (B, d2)
        return self.projector(torch.cat((r_small, r_local), dim=1))  # (B, d1 + d2) -> (B, d2)

    represent = fuse

    def heads(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(y^G, y^F): the global header on the coarse slice, the local header on the fine one (Eqs. 5-7)."""
        coarse, fine = matryoshka_slices(self.fuse(x), (self.d1, self.d2))
        assert self.small.fc3 is not None  # checked in __init__
        return self.small.fc3(coarse), self.local.head(fine)

    def infer(self, x: Tensor, inference: str = "mix-large") -> Tensor:
        """Logits of one of the four inference models of App. C.3."""
        if inference == "mix-large":
            return self.local.head(self.fuse(x))
        if inference == "mix-small":
            assert self.small.fc3 is not None  # checked in __init__
            return self.small.fc3(self.fuse(x)[:, : self.d1])
        if inference == "single-large":
            return self.local(x)
        if inference == "single-small":
            return self.small(x)
        raise ConfigError(f"unknown inference model {inference!r}; accepted: {', '.join(INFERENCE)}")

    def forward(self, x: Tensor) -> Tensor:
        return self.infer(x)


def small_variant(req: ModelRequest) -> int:
    """The CNN-j of the small model: explicit, or by the setting (homogeneous group -> CNN-1, else CNN-5)."""
    from privfl.models import assign_archs

    choice = req.opts.small_model
    if choice != "auto":
        return int(choice.removeprefix("cnn"))
    return 1 if len(set(assign_archs(req.cfg.model_group, req.cfg.num_clients))) == 1 else 5


def build_small_model(req: ModelRequest) -> MRLConvNet:
    """G for this run (the same on every client, on the server and in an attacker's hands)."""
    return small_model(small_variant(req), in_channels=req.in_channels, image_size=req.image_size, d1=req.opts.d1, num_classes=req.num_classes)


def weighted_average(messages: list[Message]) -> dict[str, Tensor]:
    """theta = sum_k (n_k / n) theta_k over the received uploads, n = sum of their ``num_samples``
    (Sec. 3.3), accumulated in float64. Uses only what the messages carry."""
    if not messages:
        raise ValueError("no uploads to average")
    keys = set(messages[0].tensors)
    total = 0.0
    acc: dict[str, Tensor] = {}
    for msg in messages:
        if set(msg.tensors) != keys:
            raise ValueError(f"upload from {msg.sender} carries different tensors")
        w = float(msg.meta["num_samples"])
        if w <= 0:
            raise ValueError(f"upload from {msg.sender} has num_samples {w}")
        total += w
        for k, v in msg.tensors.items():
            acc[k] = acc[k] + w * v.double() if k in acc else w * v.double()
    first = messages[0].tensors
    return {k: (v / total).to(first[k].dtype) if first[k].is_floating_point() else (v / total).round().to(first[k].dtype) for k, v in acc.items()}


@METHODS.register("fedmrl")
class FedMRL(FLMethod):
    """See the module docstring. Server state: the global small model (checkpointed for --resume)."""

    parallel_clients = True
    name = "fedmrl"
    sends = {"small_model": "up/down"}
    exposes = ()
    Options = FedMRLOptions
    #: the attacker differentiates the small model G alone (images -> G^hd(G^ex(x))), whose parameter
    #: names are the ``small_model`` tensors'; an approximation of the fused local loss (module docstring)
    leakage = {
        "small_model": LeakageContext(
            previous="small_model",
            module="small",
            note="CE on the small model's own output; the true local loss also passes through the private projector and header",
        )
    }
    paper = "Yi et al., FedMRL, NeurIPS 2024 (arXiv 2406.00488)"

    # -------------------------------------------------------------- models
    @classmethod
    def build_client_model(cls, req: ModelRequest) -> FedMRLModel:
        small = build_small_model(req)  # overwritten by the first download; built first for a fixed init order
        local = cast(SplitModel, super().build_client_model(req))  # FLMethod's default client model
        return FedMRLModel(small, local, req.opts.d1, projector_bias=req.opts.projector_bias)

    def __init__(self, env):
        super().__init__(env)
        seed_global(self.cfg.seed, "init", "server-small-model")
        self.global_small = MRLConvNet(**env.clients[0].model.small.config).to(env.device)  # theta^0

    # -------------------------------------------------------------- protocol
    def lrs(self) -> tuple[float, float]:
        o = self.opts
        return (self.cfg.lr if o.small_lr is None else o.small_lr), (self.cfg.lr if o.projector_lr is None else o.projector_lr)

    def train_client(self, rnd: int, client: Client) -> dict[str, float]:
        """E local epochs of SGD on G, F_k and P_k from one summed loss (Eq. 10; Alg. 1), fresh optimizer,
        each part's gradient clipped separately."""
        o = self.opts
        small_lr, proj_lr = self.lrs()

        def optimizer(model: FedMRLModel) -> torch.optim.Optimizer:
            return self.trainer.make_optimizer(
                [
                    {"params": list(model.small.parameters()), "lr": small_lr},
                    {"params": list(model.local.parameters())},  # eta_omega = --lr
                    {"params": list(model.projector.parameters()), "lr": proj_lr},
                ]
            )

        def objective(model: FedMRLModel, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            logits_g, logits_f = model.heads(x)
            loss_g, loss_f = F.cross_entropy(logits_g, y), F.cross_entropy(logits_f, y)
            return o.loss_weight_global * loss_g + o.loss_weight_local * loss_f, {"loss_global": loss_g, "loss_local": loss_f}

        def clip(model: FedMRLModel) -> None:
            if o.grad_clip > 0:
                for part in (model.small, model.local, model.projector):
                    nn.utils.clip_grad_norm_(part.parameters(), o.grad_clip)

        stats = self.fit(rnd, client, objective, optimizer=optimizer, before_step=clip)
        return {**stats.as_dict("loss"), "steps": stats.steps}

    def open_round(self, rnd: int, selected: list[Client]) -> None:
        """Server side: theta^{t-1} down to the selected clients only (Alg. 1; Sec. 3 step 1)."""
        names = [c.name for c in selected]
        self.deliver(self.channel.broadcast(rnd, names, "small_model", module_tensors(self.global_small), meta={"phase": "train"}))

    def receive(self, client: Client, msg: Message) -> None:
        """Client side: the global small model replaces its own."""
        load_module_tensors(client.model.small, msg.tensors)

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        """Client side: the fused local training (Eq. 10), then the small model up."""
        out = self.train_client(rnd, client)
        small_lr, _ = self.lrs()
        meta = {
            "num_samples": len(client.train_idx),
            "lr": small_lr,
            "local_steps": out["steps"],
            "local_epochs": self.cfg.local_epochs,
            "batch_size": self.cfg.batch_size,
            "momentum": self.cfg.momentum,
            "weight_decay": self.cfg.weight_decay,
            "grad_clip": self.opts.grad_clip,
            "small_model": f"cnn{client.model.small.variant}",
            "d1": client.model.d1,
        }
        msg = Message(rnd, client.name, "server", "small_model", module_tensors(client.model.small), meta)
        metrics = {"train_loss": out["loss"], "loss_global": out["loss_global"], "loss_local": out["loss_local"]}
        return ClientReply([(msg, {"indices": client.train_idx.cpu()})], metrics)

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """Server side: the sample-weighted average of the received small models (uses only what it received)."""
        self.global_small.load_state_dict(weighted_average(uploads))
        return {}

    def predict(self, client: Client, x: Tensor) -> Tensor:
        return client.model.infer(x, self.opts.inference)

    def server_state(self) -> dict[str, Tensor]:
        return {f"small.{k}": v for k, v in module_tensors(self.global_small).items()}

    def load_server_state(self, state: dict[str, Tensor]) -> None:
        load_module_tensors(self.global_small, {k.removeprefix("small."): v for k, v in state.items() if k.startswith("small.")})
