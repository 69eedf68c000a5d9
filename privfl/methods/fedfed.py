"""FedFed: federated feature distillation.

Yang, Zhang, Zheng, Tian, Peng, Liu, Han, "FedFed: Feature Distillation against Data Heterogeneity in
Federated Learning", NeurIPS 2023, arXiv 2310.05077; official code github.com/visitworld123/FedFed
(``algorithms_standalone/basePS``, ``model/FL_VAE.py``, ``config.yaml``). A baseline of DRDFL's Tables I
and II (App. VII-B3). The paper's text was not available: the objective,
the defaults and the message structure below are read from the official code, which the paper points
to, so the terms are named after the code's variables rather than the paper's equation numbers, and
every choice the code leaves open is an option.

Each input splits into a performance-robust part x_r, produced by a generative model G (a VAE) from x,
and the performance-sensitive rest x_s = x - x_r: what a classifier needs once x_r is gone. G is
trained so that x_r reconstructs x as well as it can (x_s small: little information) while a classifier
f still predicts y from x_s under Gaussian noise (x_s sufficient and robust), the information-bottleneck
reading of the paper. Only x_s + n ever leaves a client, as data.

1. **Feature distillation** (the first ``distill_rounds`` rounds; the official VAE_comm_round = 15).
   Every client holds a *distiller* D = (G, f). Each selected client trains D locally, on the [0, 1]
   pixel scale of its images x, minimising (official ``train_whole_process``)

       L = a_rec * MSE(x_r, x) + a_ce * CE(f(x_s + n_l), y) over the noise levels l
           + a_kl * KL(q(z|x) || N(0, I)) / (3 B d_z) + a_x * CE(f(x), y),   n_l ~ N(0, sigma_l^2 I)

   with x_r = G(x) and z the VAE's latent; it uploads D (kind ``shared_model``); the server averages
   the uploads weighted by sample count (FedAvg) and broadcasts the average to every client.
2. **Sharing** (end of the last distillation round, once). With the global distiller (latent mean, no
   sampling), every client computes x_s for each of its training samples, adds fresh noise once per noise
   level, and uploads the rows with their labels (kind ``shared_features``, up). The server concatenates
   the uploads in client order into the shared dataset and sends it to every client (``shared_features``,
   down).
3. **Federated learning** (the remaining rounds): FedAvg of the client's ordinary classifier (kind
   ``model``), where each local batch of B own samples is trained together with B rows of every noise
   level drawn from the shared dataset (one CE over the (1 + L) B rows, 3B with the default two levels;
   official ``train_mix_dataloader``).
   Each epoch the client draws, per noise level, as many rows as it has samples, class-balanced (n_k // C
   per class, the remainder uniformly; official ``sample_iid_data_from_share_dataset``).

What is sent (N clients, K selected per round, |D| = |G| + |F| scalars of the distiller's state dict,
|F| of the classifier's, L noise levels, n_k client k's training samples, C x H x W an image):

- setup (before round 0): ``shared_model`` and ``model`` down, N (|D| + |F|);
- a distillation round: ``shared_model`` up K |D|, down N |D|;
- the sharing step, on top of the last distillation round: ``shared_features`` up sum_k L n_k C H W, down
  N L (sum_k n_k) C H W (labels and levels are aux tensors, left out of the paper-style counts);
- a federated round: ``model`` up K |F|, down N |F|.

|G| (state dict, BatchNorm buffers included) for C channels, an S x S image, width w, latent d_z, h = w/2
and s = S/4 is 32 C h + 32 h w (the four 4x4 convolutions, no bias) + 4 (10 w^2 + 2 w) (the convolutions
of four residual blocks) + 8 (4 w + 1) + 2 (4 h + 1) + (4 C + 1) (eleven BatchNorms: weight, bias, two
running statistics per channel and a counter) + 3 w s^2 d_z + 2 d_z + w s^2 (the three linear layers).
At the official shapes (C = 3, S = 32, w = 32, d_z = 2048) |G| = 12,649,367, and the official distiller
with its CIFAR ResNet-18 classifier (11,183,595) is 23,832,962 scalars. DRDFL Table I/II's #Comm of
FedFed, 454.58M, is exactly 20 clients x 23,832,962 / 2^20: one upload of the distiller per client per
round, "M" meaning 2^20 scalars (the same unit gives FedNova's 213.46M = 20 x 11,191,262 / 2^20, a
torchvision ResNet-18 with 10 classes, and FedRep's 213.36M = the same without its head). So the table
counts FedFed at its distillation-phase message, a generator plus a whole classifier, which is why it is
about twice a model; the federated rounds that follow send a plain classifier (about FedNova's count),
and the one-off shared dataset is not in the table at all.

The quick default (``python -m privfl.train fedfed``: 10 cnn4 clients on 3,000 Fashion-MNIST images, w = 32,
d_z = 128, 2 distillation + 3 federated rounds) has |G| = 663,215 and |F| = 582,026: 12.45e6 scalars each
way in a distillation round, 3.52e6 up and 35.2e6 down on top for the shared dataset, 5.82e6 each way in
a federated round.

Decisions (where the paper or the code leave a choice, what was taken and why):

- **Kinds.** The distiller travels as ``shared_model`` (a second homogeneous model every client holds next
  to its FL classifier, averaged by the server), apart from the classifier's ``model`` so that each has its
  own :class:`LeakageContext`; not ``generator``, because it holds a classifier trained on the client's
  data, which gradient-leakage and membership attacks should see. The shared rows are per-sample,
  image-shaped data, which no built-in kind declares (``rep`` holds (n, d) vectors): ``shared_features``,
  registered here, in the per-sample representation family, so ``repnoise`` defends it and the label
  attack reads its labels; the sample ids behind every row (both ways) go to the ground truth.

- **Rounds.** ``--rounds`` counts both phases: the first ``distill_rounds`` rounds distil, the rest run
  FedAvg (the official code runs its 15 VAE rounds before its ``comm_round`` FL rounds). At most
  ``--rounds`` - 1 rounds distil (and at least one does), so every run reaches the federated phase;
  ``--rounds 2`` is one round of each.
- **Scale.** The distiller works on the [0, 1] pixel scale, as the official code (its images are
  ``ToTensor()`` without normalisation): x_r comes out of a sigmoid, the noise std is in pixel units and
  ``shared_features`` carry x_s + n on that scale, image-shaped, so an attacker sees them as the images
  they are. The classifiers take privfl's normalised input, so a shared row v enters them as (v - mean) /
  std, the map every image gets (the official classifier sees raw v through its own input BatchNorm).
- **Noise.** ``noise_std`` = 0.2 and ``noise_std2`` = 0.25: two noisy copies of every x_s, as the
  official ``config.yaml`` (VAE_std1, VAE_std2; ``configs/default.py`` has 0.15 for the first);
  ``noise_std2`` none shares one copy. The paper's Gaussian mechanism draws fresh noise per released sample
  (``noise_group`` = 1, the default). The official code draws one noise image per batch and adds it to every
  row of the batch (``torch.normal(size=xi[0].shape)``, 64 rows when sharing): ``noise_group`` = 64. That
  variant is weaker than it looks: the rows of a group differ by their x_s alone, and their mean estimates
  the shared noise. x_s is not clipped, so no epsilon is claimed (as ``repnoise``).
- **Distiller.** G is the official FL_CVAE_cifar generator (width ``width`` = 32, latent ``latent_dim`` =
  2048, two stride-2 4x4 convolutions with residual blocks, three linear layers, a mirrored decoder ending
  in BatchNorm and a sigmoid), written for any image side divisible by 4 (Fashion-MNIST's 28 gives a 7 x 7
  grid; the official code resizes to 32). f is a second model of the client's architecture (the official
  distiller carries its own ResNet-18, the same network as the FL classifier), separate from the FL
  classifier, which starts from the server's own initialisation (as the official code: its FL model is not
  initialised from the distiller).
- **Distillation training.** One local epoch per round (VAE_local_epoch), the run's ``--batch-size``
  (official: 32), AdamW (lr 1e-3, betas (0.9, 0.999), weight decay 1e-6) made fresh every round as every
  privfl optimizer (the official optimizer keeps its moments across rounds); the loss weights are the
  official a_rec = 5 (VAE_re), a_ce = 2, a_kl = 0.005, a_x = 0.4, with the official curriculum (a_rec x 10
  in local epochs 1-9 and x 5 in 10-19, counted from 1 in each round: with one epoch, always x 10) and the
  official adaptive weights (VAE_adaptive: a client with fewer than 0.2 N/K samples weighs rec x 5 and kl x
  0.5; otherwise, one whose largest class holds more than 70 % of its samples weighs ce, kl and x_ce x 5;
  N/K is the federation's training-set size per client, which the official code hands every client as
  configuration). The KL is summed and divided by 3 B d_z (3 for every dataset, as the official code).
  Left out: the official mixup epoch of f and the mosaic-augmented reconstruction epoch that precede each
  distillation epoch, and all data augmentation (privfl's trainer augments nothing).
- **Participation.** The engine's client selection (``--join-ratio``) governs both phases (the official
  distillation trains all 10 clients while FL samples 5); every client shares its features.
- **Shared dataset.** Sent to every client once and kept (each client trains on the copy it received;
  identical copies are stored once in the checkpoint). Rows stay in client order and carry their labels
  (the official code shares the labels; without them the rows could not be trained on) and their noise
  level (the official code keeps the two levels as two tensors). A class with fewer rows than a draw
  needs is drawn with replacement (the official code fails).
- **Evaluation.** During distillation the score is the distiller's classifier on clean test images (the
  official ``test_on_server_by_vae``); from the first federated round on, the FL classifier. ``--eval
  personal`` scores each client's own parts after its last local training (``personal_parts``).
- **FedAvg weights.** Uploads are averaged by training-set size (the official FedAvg client reports its
  test-set size).

Gradient leakage (``leakage``): an upload of ``model`` holds the FL classifier (the client model's
``classifier``); its batches also held 2B shared rows that the attacker's loss leaves out. An upload of
``shared_model`` holds the distiller; the attacker differentiates CE of f on the noise-free x_s (what the
distiller's forward computes), while the client's loss also has the noise, the reconstruction, the KL and
the clean-image term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from privfl.capture.message import Message
from privfl.config import opt
from privfl.data.datasets import PFLLIB_MEAN_STD
from privfl.errors import ConfigError
from privfl.fl.method import METHODS, Client, ClientReply, FLMethod, LeakageContext, ModelRequest, mean_metrics, module_tensors
from privfl.fl.trainer import Objective, batches_per_epoch, min_train_batch
from privfl.methods.fedmrl import weighted_average
from privfl.models.split import SplitModel
from privfl.seeding import numpy_rng, seed_global, torch_generator

#: the kind of the shared dataset's messages (declared in privfl.kinds)
SHARED_FEATURES = "shared_features"


# ------------------------------------------------------------------------------------------ the distiller
class _Residual(nn.Module):
    """x + conv1x1(lrelu(bn(conv3x3(lrelu(x))))): the official VAE's residual block (with BatchNorm)."""

    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.LeakyReLU(),
            nn.Conv2d(channels, channels, 3, 1, 1),
            nn.BatchNorm2d(channels),
            nn.LeakyReLU(),
            nn.Conv2d(channels, channels, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x)


class Generator(nn.Module):
    """The VAE G that produces the performance-robust part x_r of an image on the [0, 1] scale.

    Encoder: two 4x4 stride-2 convolutions (C -> w/2 -> w) with BatchNorm/ReLU and two residual blocks,
    flattened to the latent's mean and log-variance (``d_z`` each); decoder: a linear layer back to the
    (w, S/4, S/4) grid, two residual blocks, two 4x4 stride-2 transposed convolutions (w -> w/2 -> C, a
    tanh between them) and a BatchNorm before the sigmoid (official FL_CVAE_cifar)."""

    def __init__(self, channels: int, image_size: int, width: int = 32, latent_dim: int = 2048):
        super().__init__()
        if image_size % 4 or width % 2:
            raise ConfigError(f"fedfed's distiller needs an image side divisible by 4 and an even width, got {image_size} and {width}")
        self.channels, self.image_size, self.latent_dim = channels, image_size, latent_dim
        half, self.side, self.width = width // 2, image_size // 4, width
        flat = width * self.side**2
        self.encoder = nn.Sequential(
            nn.Conv2d(channels, half, 4, 2, 1, bias=False),
            nn.BatchNorm2d(half),
            nn.ReLU(),
            nn.Conv2d(half, width, 4, 2, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            _Residual(width),
            nn.BatchNorm2d(width),
            _Residual(width),
        )
        self.to_mu = nn.Linear(flat, latent_dim)
        self.to_logvar = nn.Linear(flat, latent_dim)
        self.from_latent = nn.Linear(latent_dim, flat)
        self.decoder = nn.Sequential(
            _Residual(width),
            nn.BatchNorm2d(width),
            _Residual(width),
            nn.BatchNorm2d(width),
            nn.ConvTranspose2d(width, half, 4, 2, 1, bias=False),
            nn.BatchNorm2d(half),
            nn.LeakyReLU(),
            nn.Tanh(),
            nn.ConvTranspose2d(half, channels, 4, 2, 1, bias=False),
            nn.BatchNorm2d(channels),
            nn.Sigmoid(),
        )

    def forward(self, x01: Tensor, sample: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """(x_r, mu, logvar) of images on the [0, 1] scale; z is sampled (reparameterised) when ``sample``."""
        h = self.encoder(x01).flatten(1)
        mu, logvar = self.to_mu(h), self.to_logvar(h)
        # without sampling, eps = 0 gives z = mu (the official eval path) and keeps logvar in the graph, so a
        # gradient-leakage replay differentiates every parameter a message holds (with zero gradient there)
        eps = torch.randn_like(mu) if sample else torch.zeros_like(mu)
        z = mu + eps * (0.5 * logvar).exp()
        x_r = self.decoder(self.from_latent(z).view(-1, self.width, self.side, self.side))
        return x_r, mu, logvar


class FeatureDistiller(nn.Module):
    """D = (G, f): splits a (normalised) image into x_r = G(x) and x_s = x - x_r on the [0, 1] scale; f
    is the classifier that keeps x_s informative. Its state dict (``generator.*``, ``classifier.*``) is
    what a ``shared_model`` message carries. ``forward``: f's logits on the noise-free x_s (latent mean),
    the differentiable path a gradient-leakage attacker replays."""

    def __init__(self, generator: Generator, classifier: nn.Module, mean: float = PFLLIB_MEAN_STD, std: float = PFLLIB_MEAN_STD):
        super().__init__()
        self.generator = generator
        self.classifier = classifier
        self.mean, self.std = float(mean), float(std)  # privfl's input normalisation (every dataset: 0.5, 0.5)

    def pixels(self, x: Tensor) -> Tensor:
        """Normalised model input -> the [0, 1] pixel scale."""
        return x * self.std + self.mean

    def model_input(self, v: Tensor) -> Tensor:
        """A [0, 1]-scale tensor (an image, or a shared x_s + n) -> the classifiers' normalised input."""
        return (v - self.mean) / self.std

    def split(self, x: Tensor, sample: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(x_s, x_r, mu, logvar) of normalised images, x_s = x - x_r on the [0, 1] scale."""
        x01 = self.pixels(x)
        x_r, mu, logvar = self.generator(x01, sample)
        return x01 - x_r, x_r, mu, logvar

    def forward(self, x: Tensor) -> Tensor:
        x_s = self.split(x)[0]
        return cast(Tensor, self.classifier(self.model_input(x_s)))


class FedFedModel(nn.Module):
    """One client's models: ``classifier`` (the FL model, FedAvg'd) and ``distiller`` (shared during
    feature distillation). ``forward`` is the FL classifier."""

    def __init__(self, classifier: SplitModel, distiller: FeatureDistiller):
        super().__init__()
        self.arch = classifier.arch
        self.classifier = classifier
        self.distiller = distiller

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.classifier(x))


def grouped_noise(
    rows: int, shape: tuple[int, ...], std: float, group: int = 1, *, generator: torch.Generator | None = None, device: Any = None
) -> Tensor:
    """N(0, std^2) noise for ``rows`` rows of ``shape``, one draw per ``group`` consecutive rows (1: every row
    its own; the official code: one per batch). From ``generator`` (on the CPU) or the global RNG on ``device``."""
    draws = -(-rows // group)
    if generator is not None:
        noise = torch.randn((draws, *shape), generator=generator).to(device)
    else:
        noise = torch.randn((draws, *shape), device=device)
    return (std * noise).repeat_interleave(group, dim=0)[:rows]


def balanced_draw(labels: np.ndarray, count: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` row indices into ``labels``: count // C per class (with replacement only where a class has
    fewer rows; an absent class's share goes to the remainder), the remainder uniformly, shuffled."""
    per = count // num_classes
    rest = count - per * num_classes
    picks = []
    for c in range(num_classes):
        members = np.flatnonzero(labels == c)
        if len(members) == 0:
            rest += per
        elif per:
            picks.append(rng.choice(members, per, replace=len(members) < per))
    if rest:
        picks.append(rng.choice(len(labels), rest, replace=len(labels) < rest))
    out = np.concatenate(picks) if picks else np.zeros(0, dtype=np.int64)
    rng.shuffle(out)
    return out


@dataclass
class FedFedOptions:
    """FedFed's hyperparameters (defaults: the official code); lr, batch size and local epochs of the
    federated phase are run options."""

    #: the quick CPU default of ``python -m privfl.train fedfed`` without --config (flags override it): identical
    #: cnn4 clients on a seeded 3k-image subset, 2 distillation rounds with a 128-d latent, then 3 FedAvg rounds
    run_defaults: ClassVar[dict[str, Any]] = {"model_group": "homo-cnn4", "subsample": 3000, "rounds": 5, "distill_rounds": 2, "latent_dim": 128}

    distill_rounds: int = opt(15, "feature-distillation rounds before FedAvg (official VAE_comm_round: 15); at most --rounds - 1 run", min=1)
    distill_epochs: int = opt(1, "local epochs of distiller training per round (official VAE_local_epoch: 1)", min=1)
    distill_lr: float = opt(1e-3, "AdamW learning rate of the distiller (official: 1e-3)", min_exclusive=0)
    distill_weight_decay: float = opt(1e-6, "AdamW weight decay of the distiller (official: 1e-6)", min=0)
    width: int = opt(32, "generator channels w (encoder C -> w/2 -> w; official VAE_d: 32)", min=2)
    latent_dim: int = opt(2048, "generator latent size d_z (official VAE_z: 2048)", min=1)
    rec_weight: float = opt(5.0, "a_rec on MSE(x_r, x) (official VAE_re: 5)", min=0)
    ce_weight: float = opt(2.0, "a_ce on CE(f(x_s + n), y) over the noise levels (official VAE_ce: 2)", min=0)
    kl_weight: float = opt(0.005, "a_kl on the VAE's KL term (official VAE_kl: 0.005)", min=0)
    x_ce_weight: float = opt(0.4, "a_x on CE(f(x), y), the clean images (official VAE_x_ce: 0.4)", min=0)
    curriculum: bool = opt(True, "a_rec x 10 in local epochs 1-9, x 5 in 10-19 (official VAE_curriculum)")
    adaptive: bool = opt(True, "official VAE_adaptive: re-weight the loss of quantity- and label-skewed clients")
    noise_std: float = opt(0.2, "sigma_1 of the first shared copy, [0, 1] pixel units (official config.yaml VAE_std1: 0.2)", min=0)
    noise_std2: float | None = opt(0.25, "sigma_2 of the second shared copy (official VAE_std2: 0.25); none: one copy", min=0)
    noise_group: int = opt(1, "rows sharing one noise draw: 1 = fresh noise per row (the paper's mechanism); 64 = the official code", min=1)


@METHODS.register("fedfed")
class FedFed(FLMethod):
    """Feature distillation, one exchange of noisy x_s, then FedAvg on local + shared data (module docstring)."""

    name = "fedfed"
    sends = {"shared_model": "up/down", SHARED_FEATURES: "up/down", "model": "up/down"}
    requires_homogeneous = True
    Options = FedFedOptions
    #: broadcasts overwrite the FL classifier (federated rounds) and the distiller (distillation rounds)
    personal_parts = ("classifier", "distiller")
    leakage = {
        "model": LeakageContext(
            previous="model",
            module="classifier",
            note="the client's batches also held 2B rows drawn from the shared dataset, which the attacker's loss leaves out",
        ),
        "shared_model": LeakageContext(
            previous="shared_model",
            module="distiller",
            note="CE of the distiller's classifier on the noise-free x_s; the client's loss adds the noise, reconstruction, KL and clean-image terms",
        ),
    }
    paper = "Yang, Zhang, Zheng, Tian, Peng, Liu, Han, FedFed: Feature Distillation against Data Heterogeneity in Federated Learning, NeurIPS 2023"

    @classmethod
    def build_client_model(cls, req: ModelRequest) -> FedFedModel:
        o = req.opts
        classifier = cast(SplitModel, super().build_client_model(req))  # first: the same init as other methods' client models
        distiller = FeatureDistiller(Generator(req.in_channels, req.image_size, o.width, o.latent_dim), super().build_client_model(req))
        return FedFedModel(classifier, distiller)  # the distiller is overwritten by the setup broadcast

    def __init__(self, env):
        super().__init__(env)
        o, data = self.opts, env.data
        template = cast(FedFedModel, env.clients[0].model)
        expected = torch.tensor([template.distiller.mean, template.distiller.std])
        if not all(torch.allclose(stat.cpu(), value) for stat, value in zip((data.mean, data.std), expected)):
            raise ConfigError(f"fedfed's distiller assumes privfl's input normalisation (mean = std = {PFLLIB_MEAN_STD}); this dataset uses another")
        self.levels = [float(o.noise_std)] + ([] if o.noise_std2 is None else [float(o.noise_std2)])
        self.distill_rounds = max(1, min(o.distill_rounds, self.cfg.rounds - 1))
        #: server side: the federation's training-set size (official: dataset_num), which clients get as
        #: configuration (:meth:`plan_round`), not as a message
        self.train_total = sum(len(c.train_idx) for c in env.clients)
        from privfl.models import build_model

        seed_global(self.cfg.seed, "init", "server-model")  # the same initial global model as FedAvg's
        self.global_classifier = build_model(**template.classifier.spec).to(env.device)
        seed_global(self.cfg.seed, "init", "server-distiller")
        self.global_distiller = FeatureDistiller(
            Generator(template.distiller.generator.channels, template.distiller.generator.image_size, o.width, o.latent_dim),
            build_model(**template.classifier.spec),
        ).to(env.device)
        #: server side: the shared dataset as the server pooled it (None before the sharing step)
        self.pool: dict[str, Tensor] | None = None
        #: client side: each client's copy of the shared dataset, and the clients in the federated phase
        #: (they have received a trained FL classifier: evaluation switches from the distiller's classifier)
        self.client_pools: dict[str, dict[str, Tensor]] = {}
        self.federated: set[str] = set()

    # -------------------------------------------------------------- protocol, in roles
    def setup(self) -> None:
        self.broadcast(0, "shared_model", "setup")
        self.broadcast(0, "model", "setup")

    def broadcast(self, rnd: int, kind: str, phase: str = "train") -> None:
        """The global distiller (``shared_model``) or FL classifier (``model``) to every client (:meth:`receive`)."""
        source = self.global_distiller if kind == "shared_model" else self.global_classifier
        self.deliver(self.channel.broadcast(rnd, self.client_names(), kind, module_tensors(source), meta={"phase": phase}))

    def receive(self, client: Client, msg: Message) -> None:
        """Client side: a global distiller or classifier replaces its own; the shared dataset is kept."""
        if msg.kind == SHARED_FEATURES:
            self.keep_pool(client.name, msg.tensors)
            return
        module = client.model.get_submodule("distiller" if msg.kind == "shared_model" else "classifier")
        module.load_state_dict({k: v.to(self.env.device) for k, v in msg.tensors.items()})
        if msg.kind == "model" and msg.meta.get("phase") != "setup":
            self.federated.add(client.name)

    def plan_round(self, rnd: int, selected: list[Client]) -> dict[str, dict[str, Any]]:
        """The federation's size, configuration for the adaptive loss weights (as the official code hands it)."""
        return {c.name: {"train_total": self.train_total} for c in selected}

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        """Client side: a distillation round (the distiller up) or a federated round (the classifier up)."""
        if rnd < self.distill_rounds:
            return self.distill_client(rnd, client)
        return self.fl_client(rnd, client)

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """Server side: average what was received and broadcast it; after the last distillation round, the
        sharing step (every client's noisy x_s up, the pool down)."""
        if rnd < self.distill_rounds:
            self.global_distiller.load_state_dict(weighted_average(uploads))  # what the server received, after defenses
            self.broadcast(rnd, "shared_model")
            return self.share(rnd) if rnd == self.distill_rounds - 1 else {}
        self.global_classifier.load_state_dict(weighted_average(uploads))
        self.broadcast(rnd, "model")
        return {}

    def client_metrics(self, rnd: int, rows: list[dict[str, float]]) -> dict[str, float]:
        """Means, but the shared rows trained on are the round's total."""
        out = mean_metrics([{k: v for k, v in row.items() if k != "shared_rows_trained"} for row in rows])
        if rnd >= self.distill_rounds:
            out["shared_rows_trained"] = float(sum(int(row["shared_rows_trained"]) for row in rows))
        return out

    # -------------------------------------------------------------- 1. feature distillation
    def loss_weights(self, client: Client) -> tuple[float, float, float, float]:
        """(a_rec, a_ce, a_kl, a_x) of ``client``, with the official adaptive re-weighting when enabled."""
        o = self.opts
        w = [o.rec_weight, o.ce_weight, o.kl_weight, o.x_ce_weight]
        if o.adaptive:
            n = len(client.train_idx)
            share = float(self.plan(client)["train_total"]) / self.cfg.num_clients * 0.2
            largest = int(torch.bincount(self.env.data.labels[client.train_idx]).max()) if n else 0
            if n < share:  # quantity skew
                w = [5 * w[0], w[1], 0.5 * w[2], w[3]]
            elif n > share and largest > 0.7 * n:  # label skew
                w = [w[0], 5 * w[1], 5 * w[2], 5 * w[3]]
        return w[0], w[1], w[2], w[3]

    def distill_objective(self, client: Client) -> Objective:
        """The distiller's loss (module docstring, step 1) for ``client``; counts steps for the curriculum."""
        o = self.opts
        a_rec, a_ce, a_kl, a_x = self.loss_weights(client)
        n, b = len(client.train_idx), self.cfg.batch_size
        per_epoch = max(1, batches_per_epoch(n, b, self.cfg.drop_last, min_train_batch(client.model, self.cfg)))
        step = [0]

        def objective(model: FedFedModel, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            epoch = 1 + step[0] // per_epoch  # counted from 1 in each round, as the official code
            step[0] += 1
            factor = (10.0 if epoch < 10 else 5.0 if epoch < 20 else 1.0) if o.curriculum else 1.0
            d = model.distiller
            x_s, x_r, mu, logvar = d.split(x, sample=True)
            noisy = [d.model_input(x_s + grouped_noise(len(x), tuple(x.shape[1:]), s, o.noise_group, device=x.device)) for s in self.levels]
            logits = d.classifier(torch.cat([*noisy, x]))
            ce = F.cross_entropy(logits[: len(noisy) * len(x)], y.repeat(len(noisy)))
            x_ce = F.cross_entropy(logits[len(noisy) * len(x) :], y)
            rec = F.mse_loss(x_r, d.pixels(x))
            kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / (len(x) * 3 * mu.shape[1])
            loss = factor * a_rec * rec + a_ce * ce + a_kl * kl + a_x * x_ce
            return loss, {"rec": rec.detach(), "ce_noisy": ce.detach(), "kl": kl.detach(), "ce_clean": x_ce.detach()}

        return objective

    def distiller_optimizer(self, model: FedFedModel) -> torch.optim.Optimizer:
        o = self.opts
        return torch.optim.AdamW(model.distiller.parameters(), lr=o.distill_lr, betas=(0.9, 0.999), weight_decay=o.distill_weight_decay)

    def distill_client(self, rnd: int, client: Client) -> ClientReply:
        """Client side of a distillation round: train the distiller, upload it."""
        st = self.fit(rnd, client, self.distill_objective(client), optimizer=self.distiller_optimizer, epochs=self.opts.distill_epochs)
        meta = {"num_samples": len(client.train_idx), "lr": self.opts.distill_lr, "local_steps": st.steps, "arch": client.arch}
        msg = Message(rnd, client.name, "server", "shared_model", module_tensors(client.model.distiller), meta)
        stats = st.as_dict()
        return ClientReply([(msg, {"indices": client.train_idx.cpu()})], {k: stats[k] for k in ("train_loss", "rec", "ce_noisy", "kl", "ce_clean")})

    # -------------------------------------------------------------- 2. sharing
    @torch.no_grad()
    def noisy_features(self, rnd: int, client: Client) -> dict[str, Tensor]:
        """The client's upload: x_s of every training sample under its (global) distiller, latent mean, plus
        fresh noise once per level; rows level-major (all samples at sigma_1, then at sigma_2)."""
        d = cast(FedFedModel, client.model).distiller
        d.eval()
        parts, labels = [], []
        for x, y in self.env.data.batches(client.train_idx, self.cfg.eval_batch_size):
            parts.append(d.split(x)[0])
            labels.append(y)
        x_s, y = torch.cat(parts), torch.cat(labels)
        gen = torch_generator(self.cfg.seed, "fedfed-share-noise", rnd, client.index)
        shape = tuple(x_s.shape[1:])
        features = [x_s + grouped_noise(len(x_s), shape, s, self.opts.noise_group, generator=gen, device=x_s.device) for s in self.levels]
        level = torch.arange(len(self.levels), device=y.device).repeat_interleave(len(y))
        return {"features": torch.cat(features), "labels": y.repeat(len(self.levels)), "level": level}

    def client_step(self, rnd: int, client: Client, step: str) -> list[tuple[Message, dict[str, Tensor] | None]]:
        """Client side of the sharing step: its noisy x_s under the distiller it has just received."""
        if step != "share":
            return super().client_step(rnd, client, step)
        idx = client.train_idx.cpu().repeat(len(self.levels))  # row i is sample idx[i]
        meta = {"num_samples": len(client.train_idx), "noise_std": list(self.levels)}
        return [(Message(rnd, client.name, "server", SHARED_FEATURES, self.noisy_features(rnd, client), meta), {"indices": idx})]

    def share(self, rnd: int) -> dict[str, float]:
        """Server side: every client uploads its noisy x_s; the server pools the uploads and sends the pool to everyone."""
        uploads = self.request(rnd, self.client_names(), "share")
        pool = {k: torch.cat([m.tensors[k] for m in uploads]) for k in ("features", "labels", "level")}
        self.pool = pool
        # the pool's ground truth (simulation bookkeeping, never sent): the sample id of each row, in client order
        truth = torch.cat([c.train_idx.cpu().repeat(len(self.levels)) for c in self.env.clients])
        for name in self.client_names():
            got = self.send(Message(rnd, "server", name, SHARED_FEATURES, pool, {"noise_std": list(self.levels)}), truth={"indices": truth})
            self.deliver({name: got})
        return {"shared_rows": float(len(pool["labels"]))}

    def keep_pool(self, name: str, tensors: dict[str, Tensor]) -> None:
        """A client's copy of the shared dataset. In one process, a copy equal to the server's pool is kept as
        that pool (once in memory); on its own node a client keeps what it received."""
        same = (
            self.pool is not None
            and set(tensors) == set(self.pool)
            and all(torch.equal(tensors[k].to(self.pool[k].device), self.pool[k]) for k in tensors)
        )
        self.client_pools[name] = self.pool if same and self.pool is not None else {k: v.to(self.env.device) for k, v in tensors.items()}

    # -------------------------------------------------------------- 3. federated learning
    def mixed_objective(self, rnd: int, client: Client) -> tuple[Objective, list[int]]:
        """CE of the FL classifier on each local batch together with as many rows of every noise level of
        the client's shared dataset (module docstring, step 3); the second value counts the rows used."""
        pool = self.client_pools[client.name]
        labels, level = pool["labels"].cpu().numpy(), pool["level"].cpu().numpy()
        n, epochs = len(client.train_idx), self.cfg.local_epochs
        rng = numpy_rng(self.cfg.seed, "fedfed-draw", rnd, client.index)
        draws = []
        for lv in range(len(self.levels)):
            rows = np.flatnonzero(level == lv)
            epoch_draws = [rows[balanced_draw(labels[rows], n, self.env.num_classes, rng)] for _ in range(epochs)]
            draws.append(torch.as_tensor(np.concatenate(epoch_draws), device=pool["features"].device))
        cursor, used = [0], [0]
        d = cast(FedFedModel, client.model).distiller

        def objective(model: FedFedModel, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            start, b = cursor[0], len(x)
            cursor[0] += b
            rows = [draw[start : start + b] for draw in draws]
            inputs = torch.cat([x, *(d.model_input(pool["features"][r]) for r in rows)])
            targets = torch.cat([y, *(pool["labels"][r].to(y.device) for r in rows)])
            used[0] += sum(len(r) for r in rows)
            logits = model.classifier(inputs)
            local = F.cross_entropy(logits[:b].detach(), y)
            return F.cross_entropy(logits, targets), {"ce_local": local}

        return objective, used

    def fl_client(self, rnd: int, client: Client) -> ClientReply:
        """Client side of a federated round: the classifier on local + shared rows, uploaded."""
        if client.name not in self.client_pools:
            raise RuntimeError(f"fedfed: {client.name} reached the federated phase without a shared dataset")
        objective, count = self.mixed_objective(rnd, client)
        st = self.fit(rnd, client, objective, parameters=client.model.classifier.parameters())
        meta = {"num_samples": len(client.train_idx), "lr": self.cfg.lr, "arch": client.arch}
        msg = Message(rnd, client.name, "server", "model", module_tensors(client.model.classifier), meta)
        return ClientReply([(msg, {"indices": client.train_idx.cpu()})], {"train_loss": st.loss, "shared_rows_trained": float(count[0])})

    # -------------------------------------------------------------- inference and state
    def predict(self, client: Client, x: Tensor) -> Tensor:
        """The distiller's classifier on clean images while distilling, then the FL classifier."""
        model = cast(FedFedModel, client.model)
        return cast(Tensor, model.classifier(x) if client.name in self.federated else model.distiller.classifier(x))

    def client_state(self, client: Client) -> dict[str, Tensor]:
        """Its phase, and its copy of the shared dataset unless it is the server's pool (one process holds both)."""
        state = {**super().client_state(client), "fedfed.federated": torch.tensor(client.name in self.federated)}
        own = self.client_pools.get(client.name)
        if own is not None and own is not self.pool:
            state.update({f"fedfed.pool.{k}": v for k, v in own.items()})
        return state

    def load_client_state(self, client: Client, state: dict[str, Tensor]) -> None:
        super().load_client_state(client, state)
        if bool(state.get("fedfed.federated", torch.tensor(False))):
            self.federated.add(client.name)
        own = {k.removeprefix("fedfed.pool."): v.to(self.env.device) for k, v in state.items() if k.startswith("fedfed.pool.")}
        if own:
            self.client_pools[client.name] = own

    def server_state(self) -> dict[str, Tensor]:
        state = {f"classifier.{k}": v for k, v in module_tensors(self.global_classifier).items()}
        state.update({f"distiller.{k}": v for k, v in module_tensors(self.global_distiller).items()})
        if self.pool is not None:
            state.update({f"pool.{k}": v for k, v in self.pool.items()})
        return state

    def load_server_state(self, state: dict[str, Tensor]) -> None:
        def part(prefix: str) -> dict[str, Tensor]:
            return {k.removeprefix(prefix): v.to(self.env.device) for k, v in state.items() if k.startswith(prefix)}

        self.global_classifier.load_state_dict(part("classifier."))
        self.global_distiller.load_state_dict(part("distiller."))
        pool = part("pool.")
        self.pool = pool or None
        self.client_pools = {}
        if self.pool is not None:  # in one process, each client's copy is the server's pool unless its client_state has its own
            for client in self.env.clients:
                own = part(f"pool@{client.name}.")  # (checkpoints written before client_state kept differing copies here)
                self.client_pools[client.name] = own or self.pool


__all__ = [
    "SHARED_FEATURES",
    "FeatureDistiller",
    "FedFed",
    "FedFedModel",
    "FedFedOptions",
    "Generator",
    "balanced_draw",
    "grouped_noise",
]
