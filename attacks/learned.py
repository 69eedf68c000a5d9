"""Learned representation inversion: a decoder trained through the client's extractor on population data.

Threat model (``curious-server-whitebox-extractor-population``): an honest-but-curious server that
holds the attacked client's extractor as it was when it produced the message (FedRE [000] Sec. 3) and
samples of the data distribution that the client never trained on (other clients' held-out samples,
handed over by the runner). It never sees the client's data.

The attack follows the black-box attack of He, Zhang and Lee ("Model inversion attacks against
collaborative inference", ACSAC 2019), an inverse network: pass auxiliary images through the model the attacker can
evaluate, learn the map from representation back to image, and apply it to what was captured. The
white-box extractor makes the "queries" free, and the population representations are computed once
(the extractor is frozen, so no gradient flows through it while the decoder trains). Their white-box
attack (regularised maximum likelihood estimation: match the representation, with a total-variation
prior) is available as an optional refinement started from the decoder's output.

The decoder is a transposed-convolution network from standardised representations to pixels trained
with a pixel MSE (``decoder=linear``: a closed-form ridge regression instead, faster and weaker). The
training pairs copy the construction of the message the
decoder is for, read from the kind's declaration (:attr:`privfl.kinds.ArtifactKind.aggregation`):

- ``sample`` (``rep``): each population image (and shifted copies of it) and its representation;
- ``class_mean`` (``proto``, ``global_proto``): the mean representation of ``members`` random
  population images of one class, paired with the mean of those images (``class_image=mean``) or one
  of them (``member``);
- ``weighted_mixture`` (``ent_rep``): class means mixed with class weights, half of them the soft
  labels of the messages being attacked (FedRE's RAP weighs each class's mean by u_c, [001] Eq. 12,
  and the entangled label carries exactly those weights), half random RAP-style draws;
- ``mean`` (``mean_rep``): the mean of ``members`` random population images of any class.

Aggregate decoders also see the per-sample pairs (``construction_share`` weighs the two sets). One
decoder is trained per client, round and kind and shared by all of its targets.

:class:`SubstituteInversion` (``invert-substitute``) attacks prototypes without the client's extractor.
FORA (Xu et al., CVPR 2024, Fig. 3) trains a substitute of the client's model on auxiliary data so that
its features are distributed like the captured ones (a discriminator and MK-MMD), SDAR (Zhu et al.,
NDSS 2025) a simulator with adversarial regularisation, and both then train an inverse network through
it. Prototype messages carry class-conditional means, not a sample of features, so the substitute here
is fitted to them: every population image of class c is mapped onto the captured prototype of class c
(FedProto's prototype regulariser, Tan et al., AAAI 2022, as the whole objective). The decoder is then
trained through the substitute as above.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attacks.base import AttackNotApplicable, Progress, Queries, Reconstruction, Selection, Target, register_attack
from attacks.invert import VectorTargets
from attacks.threat import Knowledge
from privfl.errors import ConfigError
from privfl.kinds import AGGREGATIONS, KINDS, ArtifactKind, Family
from privfl.run import AttackerView, client_of
from privfl.seeding import derive_seed, torch_generator

__all__ = [
    "ConvDecoder",
    "Decoder",
    "DecoderAttack",
    "LearnedInversion",
    "LearnedInversionConfig",
    "SubstituteConfig",
    "SubstituteInversion",
    "construction_of",
    "fit_decoder",
    "population_of",
    "training_pairs",
]

Represent = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LearnedInversionConfig:
    """How the decoder is trained and used; recorded with every result (defaults measured in docs/attacks.md)."""

    population: int = 4000  # population images asked of the runner (all it has when fewer)
    shifts: int = 3  # shifted copies of every population image added to the per-sample pairs
    shift_pixels: int = 1  # largest shift of a copy, in pixels (edges replicated)
    decoder: str = "conv"  # conv: the transposed-convolution decoder; linear: ridge regression in closed form (faster, weaker)
    steps: int = 800  # training steps of the convolutional decoder
    width: int = 32  # channels of its smallest feature map (halved at each doubling)
    batch_size: int = 64
    lr: float = 5e-3  # Adam, one-cycle schedule
    ridge: float = 10.0  # L2 penalty of the linear decoder (on standardised representations)
    members: int = 32  # population images averaged into one class-mean pair (fewer when the class has fewer)
    bank: int = 256  # class-mean pairs drawn per class (mixtures combine them)
    class_image: str = "mean"  # the image of a class-mean pair: the mean of its members, or one member
    construction_share: float = 0.5  # weight of the aggregate's pairs against the per-sample ones
    #: the decoder also reads what the message says about classes (a class id, a soft label); measured: -0.5 dB on
    #: per-sample reps, +0.1 to +0.2 dB on prototypes and entangled representations (docs/attacks.md)
    condition: bool = False
    #: the convolutional decoder corrects the class-mean image of what the message says (:class:`Prior`) instead of
    #: drawing the image whole; measured as ``condition``
    prior: bool = False
    refine_steps: int = 0  # optimisation of the decoded pixels against the target representation (0: none)
    refine_lr: float = 0.1  # Adam, on the pixels' logits
    tv_weight: float = 0.01  # refinement's total-variation prior
    proximity: float = 1.0  # refinement's pull towards the decoder's output (mean squared pixel distance)
    aggregation: str = "auto"  # the pairs' construction; auto: the kind's declaration

    def __post_init__(self) -> None:
        if self.decoder not in ("conv", "linear"):
            raise ConfigError(f"decoder must be conv or linear, got {self.decoder!r}")
        for name in ("population", "members", "bank", "batch_size", "width", "shifts", "steps"):
            if int(getattr(self, name)) < (0 if name == "shifts" else 1):
                raise ConfigError(f"{name} must be >= {0 if name == 'shifts' else 1}, got {getattr(self, name)}")
        for name in ("refine_steps", "shift_pixels"):
            if int(getattr(self, name)) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("ridge", "tv_weight", "proximity"):
            if float(getattr(self, name)) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "refine_lr"):
            if not float(getattr(self, name)) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= float(self.construction_share) < 1:
            raise ConfigError(f"construction_share must be in [0, 1), got {self.construction_share}")
        if self.class_image not in ("mean", "member"):
            raise ConfigError(f"class_image must be mean or member, got {self.class_image!r}")
        if self.aggregation != "auto" and self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"aggregation must be auto or one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")


def construction_of(kind: ArtifactKind, override: str = "auto") -> str:
    """The construction a kind's messages follow: the override, the kind's declaration, or (for a kind
    that declares none) what its family and declared tensors imply."""
    if override != "auto":
        return override
    if kind.aggregation is not None:
        return kind.aggregation
    if kind.family is Family.PER_SAMPLE_REPRESENTATION:
        return "sample"
    if kind.soft_label is not None:
        return "weighted_mixture"
    return "class_mean" if kind.classes is not None else "mean"


# ------------------------------------------------------------------------------------------ training pairs
@dataclass
class Pairs:
    """Training pairs: representations (N, d), what a message would say about their classes (N, K: a
    one-hot class, class weights, or zeros), the images they should decode to (N, C, H, W) and row
    weights (N,)."""

    reps: torch.Tensor
    classes: torch.Tensor
    images: torch.Tensor
    weights: torch.Tensor


def shifted(images: torch.Tensor, pixels: int, generator: torch.Generator) -> torch.Tensor:
    """Each image moved by a random (dy, dx) in [-pixels, pixels]^2, its edges replicated."""
    if pixels == 0:
        return images.clone()
    n, _, h, w = images.shape
    padded = F.pad(images, (pixels,) * 4, mode="replicate")
    dy = torch.randint(0, 2 * pixels + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * pixels + 1, (n,), generator=generator)
    out = torch.empty_like(images)
    for a in range(2 * pixels + 1):
        for b in range(2 * pixels + 1):
            sel = ((dy == a) & (dx == b)).to(images.device)
            out[sel] = padded[sel, :, a : a + h, b : b + w]
    return out


@torch.no_grad()
def represent_all(represent: Represent, images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Representations of images in [0, 1] (normalised as the client's model sees its data), in chunks."""
    return torch.cat([represent((images[i : i + chunk] - mean) / std).float() for i in range(0, len(images), chunk)])


def class_bank(
    reps: torch.Tensor, images: torch.Tensor, labels: torch.Tensor, members: int, per_class: int, class_image: str, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``per_class`` class-mean pairs of every class the population holds: (classes (K,), reps (K, B, d),
    images (K, B, C, H, W)); each pair averages ``members`` random images of its class (all of them when
    the class has fewer), its image is their mean or the first of them."""
    classes = labels.unique()
    bank_reps, bank_images = [], []
    for c in classes.tolist():
        pool = torch.nonzero(labels == c).flatten()
        k = min(members, len(pool))
        picks = torch.stack([pool[torch.randperm(len(pool), generator=generator)[:k]] for _ in range(per_class)])  # (B, k)
        bank_reps.append(reps[picks].mean(1))
        bank_images.append(images[picks].mean(1) if class_image == "mean" else images[picks[:, 0]])
    return classes, torch.stack(bank_reps), torch.stack(bank_images)


def mixture_weights(count: int, classes: torch.Tensor, soft_labels: list[torch.Tensor], generator: torch.Generator) -> torch.Tensor:
    """(count, K) class weights over the population's classes: the first half cycles through the
    messages' own soft labels (renormalised on the classes the population holds), the rest are RAP-style
    draws (u_c ~ U(0, 1) on a random subset of classes, normalised; FedRE [001] Eq. 12)."""
    k = len(classes)
    out = torch.zeros(count, k)
    own = [s.float()[classes.cpu()] for s in soft_labels if float(s.float()[classes.cpu()].sum()) > 0]
    start = 0
    if own:
        start = count // 2
        for i in range(start):
            out[i] = own[i % len(own)]
    sizes = torch.randint(1, k + 1, (count - start,), generator=generator)
    for i, size in zip(range(start, count), sizes.tolist()):
        chosen = torch.randperm(k, generator=generator)[:size]
        out[i, chosen] = torch.rand(size, generator=generator)
    return out / out.sum(1, keepdim=True).clamp_min(1e-12)


def training_pairs(
    construction: str,
    samples: Pairs,
    labels: torch.Tensor,
    cfg: LearnedInversionConfig,
    generator: torch.Generator,
    soft_labels: Sequence[torch.Tensor] = (),
) -> Pairs:
    """The per-sample pairs, plus (for an aggregate construction) pairs built the way the message was,
    weighted so that the two sets weigh ``1 - construction_share`` and ``construction_share``."""
    if construction == "sample":
        return samples
    num_classes = samples.classes.shape[1]
    if construction == "mean":
        labels = torch.zeros_like(labels)
    classes, bank_reps, bank_images = class_bank(samples.reps, samples.images, labels, cfg.members, cfg.bank, cfg.class_image, generator)
    if construction == "weighted_mixture":
        count = bank_reps.shape[0] * bank_reps.shape[1]
        weights = mixture_weights(count, classes, list(soft_labels), generator).to(bank_reps.device)
        said = torch.zeros(count, num_classes, device=bank_reps.device).index_copy_(1, classes.to(bank_reps.device), weights)
        pick = torch.randint(0, bank_reps.shape[1], (count, len(classes)), generator=generator).to(bank_reps.device)
        reps = torch.zeros(count, bank_reps.shape[-1], device=bank_reps.device)
        images = torch.zeros(count, *bank_images.shape[2:], device=bank_images.device)
        for j in range(len(classes)):
            w = weights[:, j]
            reps += w[:, None] * bank_reps[j, pick[:, j]]
            images += w.view(-1, 1, 1, 1) * bank_images[j, pick[:, j]]
    else:  # class_mean, mean
        reps, images = bank_reps.flatten(0, 1), bank_images.flatten(0, 1)
        ids = classes.to(reps.device).repeat_interleave(bank_reps.shape[1])
        said = F.one_hot(ids, num_classes).float() if construction == "class_mean" else torch.zeros(len(reps), num_classes, device=reps.device)
    n, m = len(samples.reps), len(reps)
    share = cfg.construction_share
    w = torch.cat([torch.full((n,), (1 - share) * (n + m) / n), torch.full((m,), share * (n + m) / m)]).to(reps.device)
    return Pairs(torch.cat([samples.reps, reps]), torch.cat([samples.classes, said]), torch.cat([samples.images, images]), w)


# ------------------------------------------------------------------------------------------ the decoder
class ConvDecoder(nn.Module):
    """Representation -> image: a linear layer to a (width, s0, s0) map, transposed convolutions (4x4,
    stride 2) that double the side and halve the channels (at least 8), and a last doubling by a 3x3
    convolution to 4 x channels rearranged into pixels (sub-pixel convolution, Shi et al., CVPR 2016:
    as good as a transposed convolution here, and faster on a CPU), a sigmoid, cropped to the image
    (28 px: 7 -> 14 -> 28; 32 px: 8 -> 16 -> 32; 64 px: 8 -> 16 -> 32 -> 64)."""

    def __init__(self, dim: int, channels: int, size: int, width: int):
        super().__init__()
        levels = max(1, math.ceil(math.log2(size / 8)))
        self.start, self.width, self.size = math.ceil(size / 2**levels), width, size
        self.project = nn.Linear(dim, width * self.start**2)
        layers: list[nn.Module] = []
        ch = width
        for _ in range(levels - 1):
            out = max(ch // 2, 8)
            layers += [nn.LeakyReLU(0.2), nn.ConvTranspose2d(ch, out, 4, stride=2, padding=1)]
            ch = out
        layers += [nn.LeakyReLU(0.2), nn.Conv2d(ch, 4 * channels, 3, padding=1), nn.PixelShuffle(2)]
        self.body = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
        """Images (B, C, H, W) in [0, 1]; ``base``: logits the network's output is added to (a prior image)."""
        y = self.body(self.project(z).view(len(z), self.width, self.start, self.start))
        top = (y.shape[-1] - self.size) // 2
        y = y[..., top : top + self.size, top : top + self.size]
        return torch.sigmoid(y if base is None else y + base)


class Prior:
    """The image a message's class information gives for free: the population's mean image of the
    named class, the class means mixed by a soft label, or the population's mean image when the
    message names no class. The decoder learns its correction from the representation."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, num_classes: int):
        self.overall = images.mean(0)
        self.templates = torch.stack([images[labels == c].mean(0) if bool((labels == c).any()) else self.overall for c in range(num_classes)])

    def __call__(self, classes: torch.Tensor) -> torch.Tensor:
        total = classes.sum(1)
        mixed = (classes @ self.templates.flatten(1)) / total.clamp_min(1e-12)[:, None]
        out = torch.where((total > 0)[:, None], mixed, self.overall.flatten()[None])
        return out.view(len(classes), *self.overall.shape)

    def logits(self, classes: torch.Tensor) -> torch.Tensor:
        return torch.logit(self(classes).clamp(1e-3, 1 - 1e-3))


class Decoder:
    """Representation -> image in [0, 1], through the population's standardisation: the ridge map
    (``decoder=linear``) or the convolutional decoder. A standardised input is clipped to the range the
    training pairs spanned in each dimension: a target from another space (a global prototype averaged
    over other clients' extractors) can be far outside it in a dimension this extractor never uses."""

    def __init__(
        self,
        mean: torch.Tensor,
        scale: torch.Tensor,
        shape: tuple[int, ...],
        linear: torch.Tensor | None = None,
        net: ConvDecoder | None = None,
        prior: Prior | None = None,
        bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        self.mean, self.scale, self.shape, self.linear, self.net, self.prior = mean, scale, shape, linear, net, prior
        self.bounds = bounds

    def outside(self, reps: torch.Tensor) -> torch.Tensor:
        """Per representation, the share of its dimensions outside the training pairs' range (B,): a
        target far from what the decoder was trained on is decoded from a clipped copy of itself."""
        if self.bounds is None:
            return torch.zeros(len(reps))
        z = (reps.float() - self.mean) / self.scale
        return ((z < self.bounds[0]) | (z > self.bounds[1])).float().mean(1).cpu()

    def inputs(self, reps: torch.Tensor, classes: torch.Tensor | None) -> torch.Tensor:
        """Standardised representations, followed by what the message says about classes (when conditioned)."""
        z = (reps.float() - self.mean) / self.scale
        if self.bounds is not None:
            z = torch.maximum(torch.minimum(z, self.bounds[1]), self.bounds[0])
        return z if classes is None else torch.cat([z, classes.float()], 1)

    @torch.no_grad()
    def __call__(self, reps: torch.Tensor, classes: torch.Tensor | None = None) -> torch.Tensor:
        z = self.inputs(reps, classes)
        if self.net is not None:
            if self.prior is None:
                return self.net(z)
            said = classes if classes is not None else torch.zeros(len(z), len(self.prior.templates), device=z.device)
            return self.net(z, self.prior.logits(said.float()))
        assert self.linear is not None
        return (torch.cat([z, torch.ones(len(z), 1, device=z.device)], 1) @ self.linear).view(len(z), *self.shape).clamp(0, 1)


def fit_decoder(
    pairs: Pairs,
    shape: tuple[int, int, int],
    cfg: LearnedInversionConfig,
    seed: int,
    *,
    standardise_on: torch.Tensor | None = None,
    conditioned: bool = False,
    prior: Prior | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> Decoder:
    """The linear decoder in closed form (ridge, float64, rows weighted), or the convolutional one
    trained for ``cfg.steps`` Adam steps (one-cycle schedule) on batches drawn by the row weights,
    seeded by ``seed``. Representations are standardised by ``standardise_on`` (default: the pairs');
    ``conditioned``: the decoder also reads the pairs' class vectors (what a message says about classes);
    ``prior``: the convolutional decoder corrects the prior image of those class vectors (zeros when not
    conditioned: the population's mean image)."""
    device = pairs.reps.device
    basis = pairs.reps if standardise_on is None else standardise_on
    std = basis.std(0)
    mean, scale = basis.mean(0), std.clamp_min(1e-3 * float(std.mean()) + 1e-8)
    z = (pairs.reps - mean) / scale
    bounds = (z.min(0).values, z.max(0).values)
    if conditioned:
        z = torch.cat([z, pairs.classes], 1)
    if cfg.decoder == "linear":
        root = pairs.weights.double().sqrt()[:, None]
        x = torch.cat([z.double(), torch.ones(len(z), 1, dtype=torch.float64, device=device)], 1) * root
        y = pairs.images.flatten(1).double() * root
        gram = x.T @ x + cfg.ridge * torch.eye(x.shape[1], dtype=torch.float64, device=device)
        linear = torch.linalg.solve(gram, x.T @ y).float()
        if progress is not None:
            progress(0, float("nan"))
        return Decoder(mean, scale, shape, linear=linear, bounds=bounds)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "decoder-init"))
        net = ConvDecoder(z.shape[1], shape[0], shape[1], cfg.width).to(device)
    gen = torch_generator(seed, "decoder-batches")
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr, foreach=True)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=cfg.steps)
    probs = pairs.weights.float().cpu()
    base = None
    if prior is not None:
        base = prior.logits(pairs.classes if conditioned else torch.zeros_like(pairs.classes))
    for step in range(cfg.steps):
        idx = torch.multinomial(probs, cfg.batch_size, replacement=True, generator=gen).to(device)
        loss = F.mse_loss(net(z[idx], None if base is None else base[idx]), pairs.images[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
        if progress is not None:
            progress(step, float(loss.detach()))
    net.eval()
    for p in net.parameters():
        p.requires_grad_(False)
    return Decoder(mean, scale, shape, net=net, prior=prior, bounds=bounds)


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Anisotropic TV per image, (B,)."""
    return (x[..., 1:, :] - x[..., :-1, :]).abs().flatten(1).mean(1) + (x[..., :, 1:] - x[..., :, :-1]).abs().flatten(1).mean(1)


def feature_error(represent: Represent, images: torch.Tensor, targets: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Mean squared error between the representations of ``images`` and ``targets``, per image (B,)."""
    return ((represent((images - mean) / std) - targets) ** 2).mean(1)


def refine(
    represent: Represent,
    start: torch.Tensor,
    targets: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    cfg: LearnedInversionConfig,
    progress: Callable[[int, float], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """He et al. 2019's white-box attack (rMLE) started from the decoder's images: Adam on the pixels'
    logits to match the target representation (MSE relative to the target's energy), plus the TV prior
    and the pull towards ``start``. Returns (images, their feature error, which targets improved): an
    image replaces its decoder output only where it lowers the feature error."""
    with torch.no_grad():
        before = feature_error(represent, start, targets, mean, std)
    energy = (targets**2).mean(1).clamp_min(1e-12)
    logits = torch.logit(start.clamp(1e-3, 1 - 1e-3)).clone().requires_grad_(True)
    opt = torch.optim.Adam([logits], lr=cfg.refine_lr)
    for step in range(cfg.refine_steps):
        x = torch.sigmoid(logits)
        feat = feature_error(represent, x, targets, mean, std) / energy
        loss = (feat + cfg.tv_weight * total_variation(x) + cfg.proximity * ((x - start) ** 2).flatten(1).mean(1)).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if progress is not None:
            progress(step, float(feat.detach().mean()))
    with torch.no_grad():
        refined = torch.sigmoid(logits)
        after = feature_error(represent, refined, targets, mean, std)
    better = after < before
    images = torch.where(better.view(-1, 1, 1, 1), refined, start)
    return images, torch.where(better, after, before), better


# ------------------------------------------------------------------------------------------ the attack
def said_about_classes(target: Target, num_classes: int) -> torch.Tensor | None:
    """What the target's message says about its class: a one-hot class, its soft label, or None."""
    if target.class_id is not None:
        return F.one_hot(torch.tensor(target.class_id), num_classes).float()
    soft = target.payload.get("soft_label")
    return None if soft is None else soft.float().flatten()[:num_classes]


def population_of(targets: Sequence[Target], attack: str) -> Queries:
    """The population the runner handed over with the targets, or a one-line refusal."""
    pop = targets[0].payload.get("population")
    if not isinstance(pop, Queries) or len(pop.y) == 0:
        raise AttackNotApplicable(
            f"{attack} needs population data (other clients' held-out samples) for {targets[0].client}, and none was handed over: "
            "run it through attacks.run_attack / python -m privfl.attack on a run whose other clients hold test samples"
        )
    return pop


class DecoderAttack(VectorTargets):
    """What the decoder attacks share (learned, substitute, head): targets, their vectors, population pairs, one decoder per group."""

    Config = LearnedInversionConfig

    def plan_messages(self, view: AttackerView, kind: str, rnd: int, records: list[dict[str, Any]], selection: Selection) -> list[Target]:
        """One target per row of the kind's vectors (at most ``selection.max_targets`` per message)."""
        spec = KINDS.get(kind)
        if spec.vectors is None:
            raise AttackNotApplicable(f"kind {kind} declares no vectors tensor to invert (ArtifactKind(..., vectors=...))")
        targets: list[Target] = []
        for rec in records:
            shape = rec["tensors"][spec.vectors]["shape"]
            if len(shape) > 2:
                raise AttackNotApplicable(f"{kind} carries images ({spec.vectors} of shape {tuple(shape)}), not representations to invert")
            rows = [0] if len(shape) == 1 else range(min(selection.max_targets, shape[0]))
            targets.extend(Target(kind, rnd, client_of(rec), rec, view, row=row) for row in rows)
        return targets

    def groups(self, targets: Sequence[Target]) -> dict[tuple[str, int, str], list[Target]]:
        out: dict[tuple[str, int, str], list[Target]] = defaultdict(list)
        for t in targets:
            out[(t.client, t.round, t.kind)].append(t)
        return out

    def group_steps(self) -> int:
        return (1 if self.config.decoder == "linear" else self.config.steps) + self.config.refine_steps

    def steps_for(self, targets: Sequence[Target]) -> int:
        return len(self.groups(targets)) * self.group_steps()

    def normalisation(self, view: AttackerView) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
        ds = view.dataset
        mean = torch.tensor(ds["mean"], device=self.device).view(1, -1, 1, 1)
        std = torch.tensor(ds["std"], device=self.device).view(1, -1, 1, 1)
        return mean, std, (int(ds["channels"]), int(ds["image_size"]), int(ds["image_size"]))

    def population_pairs(
        self, represent: Represent, pop: Queries, mean: torch.Tensor, std: torch.Tensor, generator: torch.Generator, num_classes: int | None = None
    ) -> tuple[Pairs, torch.Tensor]:
        """The per-sample pairs: population images and ``shifts`` shifted copies, with their representations
        and one-hot classes (``num_classes`` wide; default: the largest class id present + 1); and their class ids."""
        images = (pop.x.to(self.device) * std + mean).clamp(0, 1)
        copies = [images] + [shifted(images, self.config.shift_pixels, generator) for _ in range(self.config.shifts)]
        all_images = torch.cat(copies)
        labels = pop.y.to(self.device).repeat(len(copies))
        reps = represent_all(represent, all_images, mean, std)
        classes = F.one_hot(labels, int(num_classes or int(labels.max()) + 1)).float()
        return Pairs(reps, classes, all_images, torch.ones(len(reps), device=self.device)), labels

    def invert_group(
        self,
        represent: Represent,
        members: list[Target],
        pairs: Pairs,
        labels: torch.Tensor,
        label: str,
        seed: int,
        progress: Progress | None,
        construction: str | None = None,
    ) -> list[Reconstruction]:
        """Train the group's decoder on ``construction`` (default: the one of its kind, :func:`construction_of`),
        decode (and refine) every target."""
        cfg = self.config
        start = time.perf_counter()
        view = members[0].view
        mean, std, shape = self.normalisation(view)
        construction = construction or construction_of(KINDS.get(members[0].kind), cfg.aggregation)
        soft = [t.payload["soft_label"] for t in members if "soft_label" in t.payload]
        gen = torch_generator(seed, "pairs", construction)
        training = training_pairs(construction, pairs, labels, cfg, gen, soft)
        total = self.group_steps()
        hook = (lambda step, loss: progress(label, step, total, loss)) if progress is not None else None
        said = [said_about_classes(t, int(view.dataset["num_classes"])) for t in members]
        conditioned = cfg.condition and all(c is not None for c in said)
        prior = Prior(pairs.images, labels, int(view.dataset["num_classes"])) if cfg.prior else None
        decoder = fit_decoder(training, shape, cfg, seed, standardise_on=pairs.reps, conditioned=conditioned, prior=prior, progress=hook)
        vectors = torch.stack([self.resolve(t).float() for t in members]).to(self.device)
        images = decoder(vectors, torch.stack([c for c in said if c is not None]).to(self.device) if conditioned else None)
        with torch.no_grad():
            loss = feature_error(represent, images, vectors, mean, std)
        outside = decoder.outside(vectors)
        refined = torch.zeros(len(members), dtype=torch.bool)
        if cfg.refine_steps:
            step0 = 1 if cfg.decoder == "linear" else cfg.steps
            rhook = (lambda step, value: progress(label, step0 + step, total, value)) if progress is not None else None
            images, loss, refined = refine(represent, images, vectors, mean, std, cfg, rhook)
        seconds = (time.perf_counter() - start) / len(members)
        notes = {"construction": construction, "training_pairs": len(training.reps), "conditioned": conditioned}
        return [
            Reconstruction(
                t,
                images[i : i + 1].detach().float().cpu(),
                float(loss[i]),
                seconds,
                notes={**notes, "feature_mse": float(loss[i]), "refined": bool(refined[i]), "outside_training_range": float(outside[i])},
            )
            for i, t in enumerate(members)
        ]

    def protocol(self) -> dict[str, Any]:
        return {"decoder": asdict(self.config)}


@register_attack("invert-learned")
class LearnedInversion(DecoderAttack):
    consumes = frozenset({str(Family.PER_SAMPLE_REPRESENTATION), str(Family.AGGREGATE_REPRESENTATION)})
    needs = Knowledge(extractor=True, population=True)
    threat_model = "curious-server-whitebox-extractor-population"
    paper = "He, Zhang, Lee, Model inversion attacks against collaborative inference, ACSAC 2019 (the inverse network; rMLE as refinement)"
    Config = LearnedInversionConfig

    def plan_messages(self, view: AttackerView, kind: str, rnd: int, records: list[dict[str, Any]], selection: Selection) -> list[Target]:
        """Targets of the clients whose extractor of that round the run stores."""
        stored = {(r["client"], r["round"]) for r in view.extractor_records()}
        kept = [rec for rec in records if (client_of(rec), rnd) in stored]
        if not kept:
            try:
                view.extractor(client_of(records[0]), rnd)  # raises with the list of what is stored
            except Exception as exc:
                raise AttackNotApplicable(
                    str(exc), f"store extractors of round {rnd} too: --knowledge-rounds {rnd} (or --knowledge-every N)"
                ) from None
        return super().plan_messages(view, kind, rnd, kept, selection)

    def run_batch(self, targets: Sequence[Target], progress: Progress | None = None) -> list[Reconstruction]:
        """One decoder per (client, round, kind), trained on that client's population through its extractor."""
        out: list[Reconstruction] = []
        for (client, rnd, kind), members in self.groups(targets).items():
            pop = population_of(members, self.name)
            view = members[0].view
            model = view.extractor(client, rnd, self.device)
            seed = derive_seed(self.seed, "learned", client, rnd, kind)
            mean, std, _ = self.normalisation(view)
            classes = int(view.dataset["num_classes"])
            pairs, labels = self.population_pairs(model.represent, pop, mean, std, torch_generator(seed, "shifts"), classes)
            out.extend(self.invert_group(model.represent, members, pairs, labels, f"{client} r{rnd} {kind}", seed, progress))
        return out


# ------------------------------------------------------------------------------------------ substitute extractor
@dataclass
class SubstituteConfig(LearnedInversionConfig):
    """The decoder's settings plus the substitute extractor's."""

    substitute_steps: int = 600  # Adam steps fitting the substitute to the anchors
    substitute_width: int = 16  # channels of its first convolution (doubled twice)
    substitute_lr: float = 2e-3
    #: where the class anchors come from (:func:`class_anchors`): ``auto`` (a broadcast target: ``global``;
    #: an upload: ``own``), ``global``, ``own`` or ``uploads``
    anchors: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.substitute_steps < 1 or self.substitute_width < 1 or not self.substitute_lr > 0:
            raise ConfigError("substitute_steps and substitute_width must be >= 1 and substitute_lr > 0")
        if self.anchors not in ("auto", "global", "own", "uploads"):
            raise ConfigError(f"anchors must be auto, global, own or uploads, got {self.anchors!r}")


class SubstituteExtractor(nn.Module):
    """The attacker's own small CNN: three stride-2 3x3 convolutions (width, 2 width, 4 width), a 2x2
    average pool and a linear map to the prototypes' dimension."""

    def __init__(self, channels: int, dim: int, width: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, width, 3, stride=2, padding=1),
            nn.LeakyReLU(0.2),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.LeakyReLU(0.2),
            nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1),
            nn.LeakyReLU(0.2),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * width, dim),
        )

    def represent(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def class_anchors(view: AttackerView, rnd: int, client: str, source: str) -> tuple[dict[int, torch.Tensor], str]:
    """Per-class anchors the captured messages give an eavesdropper, and where they came from:

    - ``global``: the prototypes the server broadcast to ``client`` in the latest round <= ``rnd``
      (the rows of a class averaged: FPL sends several per class);
    - ``own``: the client's own class-labelled uploads up to ``rnd``, the latest of each class (they
      live in its extractor's space, which a heterogeneous client's global prototypes do not);
    - ``uploads``: every client's uploads of round ``rnd`` averaged per class (FedProto's server rule).
    """
    aggregates = [k for k in view.kinds() if KINDS.get(k).family is Family.AGGREGATE_REPRESENTATION and KINDS.get(k).classes]
    records: list[dict[str, Any]] = []
    where = ""
    if source == "global":
        down = [r for k in aggregates for r in view.messages(k, None, [client]) if r["sender"] == "server" and r["round"] <= rnd]
        if down:
            latest = max(r["round"] for r in down)
            records = [r for r in down if r["round"] == latest]
            where = f"{records[0]['kind']} broadcast to {client} in round {latest}"
    elif source == "own":
        records = sorted(
            (r for k in aggregates for r in view.messages(k, None, [client]) if r["sender"] == client and r["round"] <= rnd), key=lambda r: r["seq"]
        )
        where = f"{client}'s own uploads up to round {rnd}, the latest of each class"
    else:
        records = [r for k in aggregates for r in view.messages(k, rnd) if r["sender"] != "server"]
        where = f"{len(records)} class-labelled uploads of round {rnd}, averaged per class"
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = defaultdict(int)
    for rec in records:
        spec = KINDS.get(rec["kind"])
        assert spec.vectors is not None and spec.classes is not None
        tensors = view.load(rec)
        for vector, c in zip(tensors[spec.vectors].float(), tensors[spec.classes].tolist()):
            if source == "own":  # a later upload replaces the class's earlier one
                sums[c], counts[c] = vector, 1
                continue
            sums[c] = sums.get(c, torch.zeros_like(vector)) + vector
            counts[c] += 1
    return {c: v / counts[c] for c, v in sums.items()}, where


def fit_substitute(
    pop: Queries,
    anchors: dict[int, torch.Tensor],
    cfg: SubstituteConfig,
    seed: int,
    device: torch.device,
    progress: Callable[[int, float], None] | None,
) -> SubstituteExtractor:
    """Train the substitute so that every population image of class c maps onto class c's anchor
    (FedProto's prototype regulariser, Tan et al. AAAI 2022, as the whole objective)."""
    keep = torch.tensor([int(y) in anchors for y in pop.y.tolist()], dtype=torch.bool)
    x, y = pop.x[keep].to(device), pop.y[keep]
    if len(y) == 0:
        raise AttackNotApplicable("no population image belongs to a class the captured prototypes name")
    goal = torch.stack([anchors[int(c)] for c in y.tolist()]).to(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "substitute-init"))
        net = SubstituteExtractor(x.shape[1], goal.shape[1], cfg.substitute_width).to(device)
    gen = torch_generator(seed, "substitute-batches")
    opt = torch.optim.Adam(net.parameters(), lr=cfg.substitute_lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.substitute_lr, total_steps=cfg.substitute_steps)
    for step in range(cfg.substitute_steps):
        idx = torch.randint(0, len(y), (cfg.batch_size,), generator=gen).to(device)
        loss = F.mse_loss(net.represent(x[idx]), goal[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
        if progress is not None:
            progress(step, float(loss.detach()))
    net.eval()
    for p in net.parameters():
        p.requires_grad_(False)
    return net


@register_attack("invert-substitute")
class SubstituteInversion(DecoderAttack):
    consumes = frozenset({str(Family.AGGREGATE_REPRESENTATION)})
    needs = Knowledge(population=True)
    threat_model = "eavesdropper-population"
    paper = (
        "substitute model: Xu et al., FORA, CVPR 2024 (Fig. 3) and Zhu et al., SDAR, NDSS 2025, here fitted to the captured "
        "prototypes; inverse network: He, Zhang, Lee, ACSAC 2019"
    )
    Config = SubstituteConfig

    def plan_messages(self, view: AttackerView, kind: str, rnd: int, records: list[dict[str, Any]], selection: Selection) -> list[Target]:
        """Class-labelled aggregate rows only: the substitute is fitted to class anchors."""
        if KINDS.get(kind).classes is None:
            raise AttackNotApplicable(f"{kind} names no class per row (ArtifactKind(..., classes=...)): no class anchors to fit a substitute to")
        return super().plan_messages(view, kind, rnd, records, selection)

    def group_steps(self) -> int:
        return self.config.substitute_steps + super().group_steps()

    def run_batch(self, targets: Sequence[Target], progress: Progress | None = None) -> list[Reconstruction]:
        """Per (client, round, kind): fit the substitute to the anchors, then decode through it."""
        cfg = self.config
        out: list[Reconstruction] = []
        for (client, rnd, kind), members in self.groups(targets).items():
            pop = population_of(members, self.name)
            view = members[0].view
            broadcast = members[0].record is not None and members[0].record["sender"] == "server"
            source = ("global" if broadcast else "own") if cfg.anchors == "auto" else cfg.anchors
            anchors, where = class_anchors(view, rnd, client, source)
            if not anchors:
                raise AttackNotApplicable(f"the capture holds no class-labelled prototypes for {client} up to round {rnd} ({source} anchors)")
            seed = derive_seed(self.seed, "substitute", client, rnd, kind)
            label = f"{client} r{rnd} {kind}"
            hook = (lambda step, loss, label=label: progress(label, step, self.group_steps(), loss)) if progress is not None else None
            net = fit_substitute(pop, anchors, cfg, seed, self.device, hook)
            mean, std, _ = self.normalisation(view)
            pairs, labels = self.population_pairs(net.represent, pop, mean, std, torch_generator(seed, "shifts"), int(view.dataset["num_classes"]))
            recons = self.invert_group(net.represent, members, pairs, labels, label, seed, progress)
            for r in recons:
                r.notes["anchors"] = where
            out.extend(recons)
        return out
