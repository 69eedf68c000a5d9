"""DRDFL: decoupled representations on a ring (Guo, Lv, Geng, "Harmonizing Generalization and
Personalization in Ring-topology Decentralized Federated Learning");
every open point and its default is listed in docs/methods/drdfl.md.

Client m holds ``learngene`` (phi: x -> (mu, log sigma^2) of q(z_l|x), shared), ``personanet``
(psi: x -> z_p, private), class Gaussians {(mu_k, Sigma_k)} in z_p space (``gaussians``, shared),
``decoder`` (theta: [z_p; z_l] -> x', private), ``classifier`` (omega: images -> logits, private) and
an adversarial classifier ``adversary`` (vartheta: z_l -> logits, private). Losses (Eqs. 4-12):
L_PR = L_cls + L_log (Gaussian-mixture loss), L_GL = L_kl + L_adv^u (+ L_adv for vartheta, alternating
by default), L_rec = ||x - x'||^2, L_ce = CE(f(x), y) + CE(f(x' + n), y). Inference runs the
reconstruction path: argmax f(theta([psi(x); mu_l(x)])).

The ring (``privfl.topology.Ring``): node m sends ``learngene`` (every tensor of phi) and
``gaussians`` (mu, diagonal Sigma) to its next live node, as peer messages; the receiver mixes
phi <- (phi~ + phi)/2 and mu, Sigma <- alpha * own + (1 - alpha) * received (alpha 0.99). Nothing
else leaves a client. ``schedule=sync`` (default, Alg. 1): every live node sends its state at the
start of round t (its state after round t-1), then all mix and train. ``schedule=token``: the model
passes around the ring within a round, each node mixing, training, then sending. ``topology`` other than
``ring`` (privfl.topology.Graph: ring2, kregular, random, full; sync schedule only) is an extension: a node
receives from every in-neighbour and mixes the mean of their states by the same rules.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from privfl.capture.message import Message
from privfl.config import opt
from privfl.errors import ConfigError
from privfl.fl.method import METHODS, Client, FLMethod, LeakageContext, ModelRequest, mean_metrics
from privfl.seeding import derive_seed
from privfl.topology import GRAPH_SHAPES, Graph, Ring, build_graph, parse_failures

LOG_2PI = math.log(2 * math.pi)


@dataclass
class DRDFLOptions:
    #: the quick CPU default of ``python -m privfl.train drdfl`` without --config (flags override it):
    #: a seeded 6k-image subset of Fashion-MNIST, 5 rounds, narrow modules (the option defaults); the
    #: paper's settings (width 32 everywhere, CIFAR ResNet-18, 300 rounds) are in experiments/papers/drdfl/
    run_defaults: ClassVar[dict[str, Any]] = {"subsample": 6000, "rounds": 5}

    schedule: str = opt("sync", "ring schedule: sync (Alg. 1, all nodes in parallel) or token (model passed node to node)", choices=("sync", "token"))
    topology: str = opt(
        "ring", "neighbour graph (privfl.topology): ring (the paper's), or ring2/kregular/random/full with schedule=sync", choices=GRAPH_SHAPES
    )
    degree: int = opt(2, "neighbours per node for topology kregular (even) and random", min=1)
    failures: str = opt("", "ring node outages NODE@ROUND (down from then on) or NODE@FIRST-LAST, comma separated")
    failure_rate: float = opt(0.0, "seeded per-round probability that a node is down (transient)", min=0, max_exclusive=1)
    latent_dim: int = opt(64, "d_l: Learngene latent size", min=1)
    persona_dim: int = opt(64, "d_p: PersonaNet latent size (class Gaussians live here)", min=1)
    width: int = opt(8, "Learngene conv channels w, 2w, 4w, 4w (spec/paper configs: 32 -> about 0.50M parameters)", min=1)
    persona_width: int = opt(8, "PersonaNet conv channels, same shape as the Learngene (paper configs: 32)", min=1)
    decoder_width: int = opt(8, "decoder channels 4w -> 2w -> w (spec/paper configs: 32, FC -> 128x4x4)", min=1)
    classifier: str = opt("zoo", "f_omega: the client's --model-group model (zoo) or CIFAR ResNet-18 (paper)", choices=("zoo", "resnet18-cifar"))
    ema: float = opt(0.99, "alpha of the class-Gaussian EMA with the received ones (paper: 0.99)", min=0, max=1)
    ema_on: str = opt("var", "EMA on the variance (paper's Sigma) or on its log", choices=("var", "log_var"))
    adversarial: str = opt(
        "alternate", "alternate: vartheta steps on L_adv, then phi on L_adv^u; grl: gradient reversal on L_adv", choices=("alternate", "grl")
    )
    grl_lambda: float = opt(1.0, "gradient-reversal scale (adversarial=grl)")
    routing: str = opt("elbo", "which losses reach the encoders (spec 1.6)", choices=("elbo", "strict_alg1", "full_joint"))
    noise_std: float = opt(0.1, "std of the noise n in x_p = x' + n, on the [-1, 1] input scale", min=0)
    infer_noise: bool = opt(False, "add the noise at inference too")
    infer_sample: bool = opt(False, "sample z_l at inference (default: its mean)")
    prior: str = opt("uniform", "class prior p(k) of the Gaussian mixture", choices=("uniform", "local"))
    margin: float = opt(0.0, "L-GM margin on the true class's Mahalanobis term (paper: none)")
    log_weight: float = opt(1.0, "weight lambda of L_log (paper: 1)")
    min_var: float = opt(0.01, "floor of the class variances (keeps L_log bounded below)", min_exclusive=0)
    rec_reduction: str = opt("sum", "L_rec: sum over pixels (spec) or mean, then mean over the batch", choices=("sum", "mean"))
    ablation: str = opt("none", "Table III: drop L_PR (no_pr) or L_GL (no_gl)", choices=("none", "no_pr", "no_gl"))
    local_optimizer: str = opt("adam", "adam at --adam-lr (spec) or run (the run's --optimizer/--lr/--momentum)", choices=("adam", "run"))
    adam_lr: float = opt(0.001, "Adam learning rate (paper: 0.001) when local_optimizer=adam", min_exclusive=0)
    shared_init: bool = opt(True, "round 0: every client's Learngene and Gaussians from one shared seed")
    join_adopt: bool = opt(True, "a node that never trained takes a trained neighbour's Learngene and Gaussians as its own (Fig. 8)")
    global_test_samples: int = opt(1000, "Global-T on a fixed seeded subset of the union of local test sets (0: all)", min=0)


# -------------------------------------------------------------------------------------------------
# losses (module-level so tests can check them on known inputs)
# -------------------------------------------------------------------------------------------------


def gaussian_log_density(z: torch.Tensor, mu: torch.Tensor, log_var: torch.Tensor) -> torch.Tensor:
    """log N(z; mu_k, diag exp(log_var_k)) for every class: (B, D), (K, D), (K, D) -> (B, K)."""
    diff2 = (z.unsqueeze(1) - mu.unsqueeze(0)).pow(2)  # (B, K, D)
    return -0.5 * ((diff2 / log_var.exp().unsqueeze(0)) + log_var.unsqueeze(0) + LOG_2PI).sum(-1)


def gm_logits(
    z: torch.Tensor, mu: torch.Tensor, log_var: torch.Tensor, log_prior: torch.Tensor, y: torch.Tensor | None = None, margin: float = 0.0
) -> torch.Tensor:
    """l_k = log N(z; mu_k, Sigma_k) + log p(k) (Eq. 6's logits); with a label and margin > 0 the
    true class's Mahalanobis term is scaled by (1 + margin) as in L-GM."""
    diff2 = (z.unsqueeze(1) - mu.unsqueeze(0)).pow(2) / log_var.exp().unsqueeze(0)  # (B, K, D)
    maha = 0.5 * diff2.sum(-1)  # (B, K)
    if y is not None and margin:
        maha = maha * (1 + margin * F.one_hot(y, mu.shape[0]).to(maha.dtype))
    return -maha - 0.5 * (log_var.sum(-1) + mu.shape[1] * LOG_2PI).unsqueeze(0) + log_prior.unsqueeze(0)


def persona_loss(
    z: torch.Tensor, y: torch.Tensor, mu: torch.Tensor, log_var: torch.Tensor, log_prior: torch.Tensor, margin: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_cls, L_log): CE over the mixture posterior (Eq. 6) and -log N(z; mu_y, Sigma_y) (Eq. 7)."""
    l_cls = F.cross_entropy(gm_logits(z, mu, log_var, log_prior, y, margin), y)
    l_log = -gaussian_log_density(z, mu, log_var).gather(1, y.unsqueeze(1)).mean()
    return l_cls, l_log


def kl_standard_normal(mu: torch.Tensor, log_var: torch.Tensor) -> torch.Tensor:
    """Eq. 8: KL(N(mu, diag sigma^2) || N(0, I)) = 1/2 sum (sigma^2 + mu^2 - 1 - log sigma^2), batch mean."""
    return 0.5 * (log_var.exp() + mu.pow(2) - 1 - log_var).sum(-1).mean()


def uniform_confusion(logits: torch.Tensor) -> torch.Tensor:
    """Eq. 10: cross-entropy against the uniform label, -(1/K) sum_k log q(k|z_l), batch mean."""
    return -F.log_softmax(logits, dim=1).mean(1).mean()


def ema_mix(own: torch.Tensor, received: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * own + (1 - alpha) * received (Alg. 1 lines 6-7)."""
    return alpha * own + (1 - alpha) * received


class _GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


def grad_reverse(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Identity forward, -scale * gradient backward (Ganin & Lempitsky's GRL)."""
    return _GradReverse.apply(x, scale)


# -------------------------------------------------------------------------------------------------
# modules
# -------------------------------------------------------------------------------------------------


def _norm(ch: int) -> nn.GroupNorm:
    # GroupNorm, not BatchNorm: the shared Learngene then has no running statistics to mix or leak
    return nn.GroupNorm(min(8, ch), ch)


class ConvEncoder(nn.Module):
    """conv3x3 c->w (s1), w->2w, 2w->4w, 4w->4w (s2), GroupNorm + ReLU, then FC. ``features`` keeps
    the spatial maps (Grad-CAM hooks its last conv); 28 and 32 px inputs both end at 4x4."""

    def __init__(self, in_channels: int, image_size: int, width: int, out_dim: int):
        super().__init__()
        chans, layers, cin = (width, 2 * width, 4 * width, 4 * width), [], in_channels
        for i, cout in enumerate(chans):
            layers += [nn.Conv2d(cin, cout, 3, stride=1 if i == 0 else 2, padding=1), _norm(cout), nn.ReLU(inplace=True)]
            cin = cout
        self.features = nn.Sequential(*layers)
        side = image_size
        for _ in range(3):
            side = (side - 1) // 2 + 1
        self.fc = nn.Linear(cin * side * side, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).flatten(1))


class Learngene(ConvEncoder):
    """phi: x -> (mu, log sigma^2) of q_phi(z_l | x); the only network that crosses the wire."""

    def __init__(self, in_channels: int, image_size: int, width: int, latent_dim: int):
        super().__init__(in_channels, image_size, width, 2 * latent_dim)

    # (mu, log_var) instead of one tensor: a Learngene is never used where a plain ConvEncoder is expected
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        mu, log_var = super().forward(x).chunk(2, dim=1)
        return mu, log_var.clamp(-10.0, 10.0)


class PersonaNet(ConvEncoder):
    """psi: x -> z_p, the deterministic "mean output" scored by the class Gaussians."""


class ClassGaussians(nn.Module):
    """{(mu_k, diag Sigma_k)} in z_p space, learnable; Sigma as log-variance, floored at ``min_var``."""

    log_prior: torch.Tensor  # a buffer (register_buffer below)

    def __init__(self, num_classes: int, dim: int, min_var: float):
        super().__init__()
        self.mu = nn.Parameter(torch.randn(num_classes, dim))
        self.log_var = nn.Parameter(torch.zeros(num_classes, dim))
        self.register_buffer("log_prior", torch.full((num_classes,), -math.log(num_classes)))
        self.min_log_var = math.log(min_var)

    def effective_log_var(self) -> torch.Tensor:
        return self.log_var.clamp(min=self.min_log_var)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        return gm_logits(z, self.mu, self.effective_log_var(), self.log_prior)


class Decoder(nn.Module):
    """theta: [z_p; z_l] -> x' in [-1, 1]: FC -> 4w x s x s, three stride-2 ConvTranspose, tanh;
    centre-cropped to the image size (28 px: 32 -> 28)."""

    def __init__(self, in_dim: int, out_channels: int, image_size: int, width: int):
        super().__init__()
        self.side, self.image_size, self.width = -(-image_size // 8), image_size, width
        self.fc = nn.Linear(in_dim, 4 * width * self.side * self.side)
        self.net = nn.Sequential(
            nn.ConvTranspose2d(4 * width, 2 * width, 4, 2, 1),
            _norm(2 * width),
            nn.ReLU(inplace=True),
            nn.ConvTranspose2d(2 * width, width, 4, 2, 1),
            _norm(width),
            nn.ReLU(inplace=True),
            nn.ConvTranspose2d(width, out_channels, 4, 2, 1),
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.net(F.relu(self.fc(z)).view(len(z), 4 * self.width, self.side, self.side))
        off = (x.shape[-1] - self.image_size) // 2
        return x[..., off : off + self.image_size, off : off + self.image_size]


class _Classifier(nn.Module):
    def __init__(self, features: nn.Module, dim: int, num_classes: int):
        super().__init__()
        self.features, self.head = features, nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def cifar_resnet18(in_channels: int, num_classes: int) -> nn.Module:
    """ResNet-18 with the CIFAR stem (3x3 conv, no max-pool), from torchvision's BasicBlock."""
    from torchvision.models.resnet import BasicBlock  # imported when used (about 2 s a process)

    def stage(cin: int, cout: int, stride: int) -> list[nn.Module]:
        down = None if stride == 1 and cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        return [BasicBlock(cin, cout, stride, down), BasicBlock(cout, cout)]

    features = nn.Sequential(
        nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        *stage(64, 64, 1),
        *stage(64, 128, 2),
        *stage(128, 256, 2),
        *stage(256, 512, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )
    for m in features.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return _Classifier(features, 512, num_classes)


class DRDFLModel(nn.Module):
    """One client's modules; ``forward(x)`` is the paper's inference: f_omega(theta([psi(x); mu_l(x)]))."""

    def __init__(
        self,
        learngene: Learngene,
        personanet: PersonaNet,
        decoder: Decoder,
        classifier: nn.Module,
        gaussians: ClassGaussians,
        adversary: nn.Module,
        opts: DRDFLOptions,
    ):
        super().__init__()
        self.learngene, self.personanet, self.decoder, self.classifier = learngene, personanet, decoder, classifier
        self.gaussians, self.adversary = gaussians, adversary
        self.noise_std, self.infer_noise, self.infer_sample = opts.noise_std, opts.infer_noise, opts.infer_sample

    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        z_p = self.personanet(x)
        mu, log_var = self.learngene(x)
        z_l = mu + (0.5 * log_var).exp() * torch.randn_like(mu) if self.infer_sample else mu
        return self.decoder(torch.cat([z_p, z_l], 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_rec = self.reconstruct(x)
        if self.infer_noise:
            x_rec = x_rec + self.noise_std * torch.randn_like(x_rec)
        return self.classifier(x_rec)


def batch_losses(
    model: DRDFLModel, x: torch.Tensor, y: torch.Tensor, o: DRDFLOptions, opt_adv: torch.optim.Optimizer | None
) -> dict[str, torch.Tensor]:
    """Every loss of Sec. III on one batch, routed as ``o.routing`` says; ``train_loss`` is their sum,
    whose backward gives each module its own losses. With ``opt_adv`` (alternating mode) the
    adversary first takes its step on L_adv with z_l detached; in grl mode L_adv is in the sum with
    z_l behind a gradient reversal. L_adv^u always sees the adversary's weights frozen."""
    g = model.gaussians
    z_p = model.personanet(x)
    l_cls, l_log = persona_loss(z_p, y, g.mu, g.effective_log_var(), g.log_prior, o.margin)
    mu_l, lv_l = model.learngene(x)
    z_l = mu_l + (0.5 * lv_l).exp() * torch.randn_like(mu_l)
    l_kl = kl_standard_normal(mu_l, lv_l)
    if opt_adv is not None:  # (a) the adversary learns to read y off z_l (phi untouched)
        l_adv = F.cross_entropy(model.adversary(z_l.detach()), y)
        opt_adv.zero_grad(set_to_none=True)
        l_adv.backward()
        opt_adv.step()
        adv_term = z_l.new_zeros(())
    else:  # grl: the adversary minimises L_adv, phi receives its reversed gradient
        l_adv = adv_term = F.cross_entropy(model.adversary(grad_reverse(z_l, o.grl_lambda)), y)
    frozen = {k: v.detach() for k, v in model.adversary.named_parameters()}
    l_advu = uniform_confusion(functional_call(model.adversary, frozen, (z_l,)))  # (b) phi confuses it
    dec_in = torch.cat([z_p, z_l], 1) if o.routing != "strict_alg1" else torch.cat([z_p.detach(), z_l.detach()], 1)
    x_rec = model.decoder(dec_in)
    err = (x - x_rec).pow(2)
    l_rec = (err.sum((1, 2, 3)) if o.rec_reduction == "sum" else err.mean((1, 2, 3))).mean()
    x_p = x_rec + o.noise_std * torch.randn_like(x_rec)
    if o.routing != "full_joint":
        x_p = x_p.detach()
    l_ce = F.cross_entropy(model.classifier(x), y) + F.cross_entropy(model.classifier(x_p), y)
    l_pr = l_cls + o.log_weight * l_log if o.ablation != "no_pr" else z_p.new_zeros(())
    l_gl = l_kl + l_advu + adv_term if o.ablation != "no_gl" else z_p.new_zeros(())
    return {
        "train_loss": l_pr + l_gl + l_rec + l_ce,
        "loss_cls": l_cls,
        "loss_log": l_log,
        "loss_kl": l_kl,
        "loss_adv": l_adv.detach(),
        "loss_adv_u": l_advu,
        "loss_rec": l_rec,
        "loss_ce": l_ce,
    }


def _build_learngene(req: ModelRequest, o: DRDFLOptions) -> tuple[Learngene, ClassGaussians]:
    """The shared parts; from one seed for every client when ``shared_init`` (spec: shared seed)."""
    if not o.shared_init:
        return (Learngene(req.in_channels, req.image_size, o.width, o.latent_dim), ClassGaussians(req.num_classes, o.persona_dim, o.min_var))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(req.cfg.seed, "init", "learngene"))
        return (Learngene(req.in_channels, req.image_size, o.width, o.latent_dim), ClassGaussians(req.num_classes, o.persona_dim, o.min_var))


# -------------------------------------------------------------------------------------------------
# the method
# -------------------------------------------------------------------------------------------------


@METHODS.register("drdfl")
class DRDFL(FLMethod):
    name = "drdfl"
    sends = {"learngene": "peer", "gaussians": "peer"}
    exposes = ()
    Options = DRDFLOptions
    paper = "Guo, Lv, Geng, DRDFL: ring-topology decentralized FL (Learngene + PersonaNet)"
    #: a ring neighbour attacking a Learngene message differentiates the Learngene (the message's
    #: tensors, named ``learngene.*``) followed by a classifier of its own on the latent mean, shaped like
    #: the private adversarial classifier (d_l -> 128 -> K) it never sees; its previous state is the
    #: Learngene the sender received in the round named by the message's ``previous_round``
    leakage = {
        "learngene": LeakageContext(
            previous="learngene",
            module="learngene",
            prefix="learngene.",
            output=0,
            readout="probe",
            probe_hidden=128,
            note="the neighbour's own random classifier on mu_l stands in for the sender's private losses",
        )
    }

    @classmethod
    def build_client_model(cls, req: ModelRequest) -> DRDFLModel:
        o = req.opts
        learngene, gaussians = _build_learngene(req, o)
        personanet = PersonaNet(req.in_channels, req.image_size, o.persona_width, o.persona_dim)
        decoder = Decoder(o.persona_dim + o.latent_dim, req.in_channels, req.image_size, o.decoder_width)
        if o.classifier == "resnet18-cifar":
            classifier = cifar_resnet18(req.in_channels, req.num_classes)
        else:  # the client's --model-group model, built as every method builds it
            classifier = super().build_client_model(req)
        adversary = nn.Sequential(nn.Linear(o.latent_dim, 128), nn.ReLU(), nn.Linear(128, req.num_classes))
        return DRDFLModel(learngene, personanet, decoder, classifier, gaussians, adversary, o)

    @classmethod
    def build_topology(cls, cfg: Any, opts: DRDFLOptions) -> Ring | Graph:
        """The paper's ring, or any neighbour graph on the sync schedule (a node then mixes the mean of
        the states it receives: phi <- (mean phi~ + phi)/2, the Gaussians' EMA towards their mean)."""
        if opts.topology == "ring":
            return Ring(cfg.num_clients, parse_failures(opts.failures, cfg.num_clients), opts.failure_rate, cfg.seed)
        if opts.schedule != "sync":
            raise ConfigError(f"drdfl: schedule={opts.schedule} passes one model around a ring; topology {opts.topology} needs schedule=sync")
        return build_graph(cfg, opts)

    @classmethod
    def flower_limits(cls, cfg: Any, opts: DRDFLOptions) -> str | None:
        if opts.schedule == "token":
            return "--schedule token passes one state node to node within a round (use --schedule sync on Flower)"
        return None

    @classmethod
    def global_test_size(cls, cfg: Any, opts: DRDFLOptions) -> int:
        """The paper's Local-T/Global-T every round: ``--global-test`` when given, else ``global_test_samples``
        (0: the whole union), scored by the engine on every client (both protocols with ``--eval both``)."""
        if cfg.global_test > 0:
            return int(cfg.global_test)
        return opts.global_test_samples if opts.global_test_samples > 0 else sys.maxsize

    def __init__(self, env):
        super().__init__(env)
        n, K = self.cfg.num_clients, env.num_classes  # per-node bookkeeping, by client index
        self.topology: Ring | Graph = env.topology if isinstance(env.topology, Ring | Graph) else self.build_topology(self.cfg, self.opts)
        if self.opts.prior == "local":
            for c in env.clients:
                counts = torch.bincount(env.data.labels[c.train_idx], minlength=K).float() + 1.0  # Laplace smoothing
                c.model.gaussians.log_prior.copy_((counts / counts.sum()).log())
        # per node: round of the received state its current state was trained from (-1: none), and
        # the last round it trained (-1: never); both go into message meta and the checkpoint
        self.trained_from = torch.full((n,), -1, dtype=torch.int64)
        self.last_trained = torch.full((n,), -1, dtype=torch.int64)
        self.inbox: dict[int, tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}  # token schedule

    # ------------------------------------------------------------------ what crosses the wire
    @staticmethod
    def learngene_tensors(model: DRDFLModel) -> dict[str, torch.Tensor]:
        return {f"learngene.{k}": v.detach().clone() for k, v in model.learngene.state_dict().items()}

    @staticmethod
    def gaussian_tensors(model: DRDFLModel) -> dict[str, torch.Tensor]:
        g = model.gaussians
        return {"mu": g.mu.detach().clone(), "var": g.effective_log_var().detach().exp()}

    def state_messages(self, rnd: int, sender: Client, receiver: str, meta: dict[str, Any]) -> list[tuple[Message, dict[str, torch.Tensor] | None]]:
        """Two peer messages, Learngene then Gaussians, each with its truth: the samples behind a trained state."""
        trained = int(self.last_trained[sender.index]) >= 0
        meta = {
            **meta,
            "trained": trained,
            "num_samples": len(sender.train_idx),
            "lr": self.local_lr(),
            "local_epochs": self.cfg.local_epochs,
            "batch_size": self.cfg.batch_size,
            "schedule": self.opts.schedule,
            "previous_round": int(self.trained_from[sender.index]),
        }
        truth = {"indices": sender.train_idx.cpu()} if trained else None
        return [
            (Message(rnd, sender.name, receiver, "learngene", self.learngene_tensors(sender.model), meta), truth),
            (Message(rnd, sender.name, receiver, "gaussians", self.gaussian_tensors(sender.model), dict(meta)), truth),
        ]

    @torch.no_grad()
    def absorb_all(self, client: Client, received: list[tuple[Message, Message]]) -> None:
        """Mix the states of one round's in-neighbours: their mean as the received state (on the paper's
        ring there is one, and this is :meth:`absorb` of it). A node that never trained adopts the mean
        of the trained ones when ``join_adopt``; untrained senders count only when nobody trained."""
        trained = [(lg, ga) for lg, ga in received if lg.meta["trained"]]
        use = trained or received

        def mean(tensors: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
            return {k: torch.stack([t[k] for t in tensors]).mean(0) if v.is_floating_point() else v for k, v in tensors[0].items()}

        self.absorb(client, mean([lg.tensors for lg, _ in use]), mean([ga.tensors for _, ga in use]), bool(trained))

    @torch.no_grad()
    def absorb(self, client: Client, learngene: dict[str, torch.Tensor], gaussians: dict[str, torch.Tensor], trained: bool) -> None:
        """Mix a received state in: phi <- (phi~ + phi)/2, Gaussians by EMA; a node that never trained
        adopts a trained neighbour's state outright when ``join_adopt`` (new clients, Fig. 8)."""
        model, o = client.model, self.opts
        adopt = o.join_adopt and trained and int(self.last_trained[client.index]) < 0
        own = model.learngene.state_dict()
        mixed = {}
        for k, v in own.items():
            got = learngene[f"learngene.{k}"].to(v.device)
            if adopt:
                mixed[k] = got.clone()
            else:
                mixed[k] = (got + v) / 2 if v.is_floating_point() else v
        model.learngene.load_state_dict(mixed)
        g = model.gaussians
        mu, var = gaussians["mu"].to(g.mu.device), gaussians["var"].to(g.mu.device)
        if adopt:
            g.mu.copy_(mu)
            g.log_var.copy_(var.log())
        else:
            g.mu.copy_(ema_mix(g.mu, mu, o.ema))
            if o.ema_on == "var":
                g.log_var.copy_(ema_mix(g.effective_log_var().exp(), var, o.ema).log())
            else:
                g.log_var.copy_(ema_mix(g.effective_log_var(), var.log(), o.ema))

    # ------------------------------------------------------------------ rounds, as gossip
    # sync (Alg. 1): every live node sends its state after round t-1 to its out-neighbours (ring: the next
    # live node), then all mix what they received and train. token: one state passes node to node within
    # the round (ring order from the lowest live node), each node mixing it in, training, passing it on;
    # a sequential pass, run in gossip_round with the channel at hand (in-process only).

    def gossip_send(self, rnd: int, client: Client) -> list[tuple[Message, dict[str, torch.Tensor] | None]]:
        """sync: its state after round t-1 to each out-neighbour; token: nothing before training."""
        if self.opts.schedule != "sync":
            return []
        meta = {"state_after_round": rnd - 1}
        return [msg for r in sorted(self.topology.out_neighbors(client.index, rnd)) for msg in self.state_messages(rnd, client, f"client{r}", meta)]

    def gossip_round(self, rnd: int, client: Client, received: list[Message]) -> dict[str, float]:
        """Mix the received states in, train; on the token schedule, then pass the state on."""
        i = client.index
        if self.opts.schedule == "sync":
            if received:
                pairs = list(zip(received[0::2], received[1::2]))  # (learngene, gaussians) per in-neighbour, in edge order
                self.absorb_all(client, pairs)
                self.trained_from[i] = rnd
            else:
                self.trained_from[i] = -1  # alone on the ring: trained from its own state only
            row = self.train_client(rnd, client)
            self.last_trained[i] = rnd
            return {**row, **self._sizes(received)}
        got = self.inbox.pop(i, None)
        if got is not None:
            src_round, lgt, gat = got
            self.absorb(client, lgt, gat, trained=True)  # a token is always a trained state
            self.trained_from[i] = src_round
        else:
            self.trained_from[i] = -1
        row = self.train_client(rnd, client)
        self.last_trained[i] = rnd
        assert isinstance(self.topology, Ring)  # build_topology refuses the token schedule on other graphs
        succ = self.topology.successor(i, rnd)
        if succ is None:
            return row
        lg, ga = (self.send(msg, truth) for msg, truth in self.state_messages(rnd, client, f"client{succ}", {"state_after_round": rnd}))
        self.inbox[succ] = (rnd, lg.tensors, ga.tensors)
        return {**row, **self._sizes([lg, ga])}

    @staticmethod
    def _sizes(messages: list[Message]) -> dict[str, float]:
        return {f"{m.kind}_scalars": float(m.paper_scalars) for m in messages}

    def client_metrics(self, rnd: int, rows: list[dict[str, float]]) -> dict[str, float]:
        """Losses averaged over the live nodes, their count, and the size of each kind of state message."""
        sizes = ("learngene_scalars", "gaussians_scalars")
        out = mean_metrics([{k: v for k, v in r.items() if k not in sizes} for r in rows])
        out["live_nodes"] = float(len(rows))
        for key in sizes:
            seen = [r[key] for r in rows if key in r]
            if seen:
                out[key] = seen[-1]
        return out

    def local_lr(self) -> float:
        return self.opts.adam_lr if self.opts.local_optimizer == "adam" else self.cfg.lr

    def _optimizer(self, params) -> torch.optim.Optimizer:
        if self.opts.local_optimizer == "adam":
            return self.trainer.make_optimizer(params, lr=self.opts.adam_lr, optimizer="adam")
        return self.make_optimizer(params)

    def train_client(self, rnd: int, client: Client) -> dict[str, float]:
        """``local_epochs`` of Alg. 1's local update; optimizers fresh each round (resume stays exact).
        Per batch the adversary first takes its own step (alternating mode, inside the objective), then
        one backward of the summed loss trains every other module."""
        model: DRDFLModel = client.model
        alternate = self.opts.adversarial == "alternate"
        opt_adv = self._optimizer(model.adversary.parameters()) if alternate else None

        def objective(model: DRDFLModel, x: torch.Tensor, y: torch.Tensor):
            losses = batch_losses(model, x, y, self.opts, opt_adv)
            total = losses.pop("train_loss")
            return total, {k: v.detach() for k, v in losses.items()}

        main = [p for n, p in model.named_parameters() if not (alternate and n.startswith("adversary."))]
        return self.fit(rnd, client, objective, optimizer=lambda m: self._optimizer(main)).as_dict("train_loss")

    # ------------------------------------------------------------------ state
    def client_state(self, client: Client) -> dict[str, torch.Tensor]:
        """A node's own ring bookkeeping (what its Flower node keeps between messages)."""
        i = client.index
        return {
            **super().client_state(client),
            "drdfl.trained_from": self.trained_from[i : i + 1].clone(),
            "drdfl.last_trained": self.last_trained[i : i + 1].clone(),
        }

    def load_client_state(self, client: Client, state: dict[str, torch.Tensor]) -> None:
        super().load_client_state(client, state)
        if "drdfl.trained_from" in state:
            self.trained_from[client.index] = state["drdfl.trained_from"].cpu()[0]
            self.last_trained[client.index] = state["drdfl.last_trained"].cpu()[0]

    def server_state(self) -> dict[str, torch.Tensor]:
        """Not a server: the ring bookkeeping and, on the token schedule, messages not yet mixed in."""
        state = {"trained_from": self.trained_from.clone(), "last_trained": self.last_trained.clone()}
        for m, (src, lg, ga) in self.inbox.items():
            state[f"inbox.{m}.round"] = torch.tensor(src)
            state.update({f"inbox.{m}.lg.{k}": v for k, v in lg.items()})
            state.update({f"inbox.{m}.ga.{k}": v for k, v in ga.items()})
        return state

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        self.trained_from = state["trained_from"].cpu().clone()
        self.last_trained = state["last_trained"].cpu().clone()
        self.inbox = {}
        for key, v in state.items():
            if key.startswith("inbox.") and key.endswith(".round"):
                m = int(key.split(".")[1])
                lg = {k[len(f"inbox.{m}.lg.") :]: t for k, t in state.items() if k.startswith(f"inbox.{m}.lg.")}
                ga = {k[len(f"inbox.{m}.ga.") :]: t for k, t in state.items() if k.startswith(f"inbox.{m}.ga.")}
                self.inbox[m] = (int(v), lg, ga)


__all__ = [
    "DRDFL",
    "DRDFLModel",
    "DRDFLOptions",
    "batch_losses",
    "cifar_resnet18",
    "ema_mix",
    "gaussian_log_density",
    "gm_logits",
    "grad_reverse",
    "kl_standard_normal",
    "persona_loss",
    "uniform_confusion",
]
