"""Fedcvae: DRDFL's own decentralised CVAE baseline (Guo, Lv, Geng, "Harmonizing Generalization and
Personalization in Ring-topology Decentralized Federated Learning", IEEE-format preprint, 2025; App.
VII-B3 and rows "FedCVAE" of Tables I/II). The CVAE is Sohn, Lee, Yan, "Learning Structured Output
Representation using Deep Conditional Generative Models", NeurIPS 2015 (DRDFL ref. [36]).

Everything the paper says about it (App. VII-B3): "Each client uses its private dataset trains a
pretrained model g_phi(.) to obtain the prior distribution and the CVAE model f_w(.) and a classifier
C_omega(.) until convergence. The CVAE consists of an encoder E_phi(.), a decoder D_theta(.) with
parameters denoted as w = [phi, theta]. Collaborative learning among clients is achieved by using the
pretrained model as the shared interaction information." Sec. II-B: a CVAE "introduces label vectors
as inputs to both the encoder and decoder". Tables I/II: "Full model" in the personalised-parameters
column, #Comm 63.44M. There is no code; decisions: docs/methods/personalised.md.

Client m holds (``FedcvaeModel``):

- ``prior``, g_phi: x -> (mu_p, log sigma_p^2) of the prior p(z|x) (Sohn's "prior network"); the only
  module that leaves a node;
- ``encoder``, E: (x, y) -> (mu_q, log sigma_q^2) of the recognition model q(z|x, y), private;
- ``decoder``, D_theta: z -> x', private;
- ``classifier``, C_omega: images -> logits, private (the client's ``--model-group`` model, or the
  paper's CIFAR ResNet-18).

Per batch (the CVAE bound, Sohn Eq. 4 with the image as the generated variable, and DRDFL's classifier
loss, its Eq. 12)::

    z ~ q(z|x, y), z_p ~ p_phi(z|x) (reparameterised)     x' = D(z)     x_p = D(z_p) + n, n ~ N(0, noise_std^2)
    L_elbo = ||x - x'||^2 + kl_weight * KL(q(z|x, y) || p_phi(z|x))         (negative ELBO)
    L_ce   = CE(C(x), y) + CE(C(sg[x_p]), y)                                 (sg: no gradient)
    loss   = L_elbo + L_ce

Inference (the CVAE path, as DRDFL's f_omega(theta(...)), spec 1.8): y_hat = argmax C(D(mu_p(x))): the
label is unknown at test time, so the latent comes from the prior network (Sohn's test-time rule).

Rounds. ``pretrain_rounds`` = ceil(pretrain_fraction * rounds) rounds of pretraining: every live node
trains all four modules for ``--local-epochs``, then sends its g_phi to each out-neighbour of the round's
graph (kind ``shared_model``, peer) and mixes what it received:
g_phi <- (g_phi + sum_{j in N_in} g_phi~_j) / (1 + |N_in|), which on DRDFL's unidirectional ring (the
default topology) is DRDFL's phi <- (phi~ + phi)/2 (Alg. 1 line 7). Afterwards g_phi is frozen (out of
the optimiser; the KL term still uses it) and nothing crosses the wire; E, D and C go on training locally.

Communication: one message per live edge and pretraining round, every tensor of g_phi:
|g_phi| = 9cw + w + 18w^2 + 2w + 72w^2 + 4w + 144w^2 + 4w + 22w (GroupNorm affine) + 4w s^2 2d + 2d, for
c input channels, width w = ``prior_width``, latent d = ``latent_dim``, s = the side after three stride-2
convs (4 for 28 and 32 px). At the quick default (FMNIST, c = 1, w = 8, d = 64) that is 80,976 scalars.

Decisions (the paper leaves all of this open):

- **What is shared: g_phi, every tensor of it, nothing else.** "the pretrained model as the shared
  interaction information". The #Comm of Table I fixes its size: read as per-round totals over the 20
  clients of one message each (the reading under which DisPFL's 106.65M is half of DFedPGP's 213.36M,
  i.e. its 50% masks), Fedcvae sends 63.44M / 20 = 3.17M scalars per message, 0.297 x what DFedPGP sends
  (a ResNet-18 body, 11.18M in privfl's count, so 3.32M on that scale; DFedPGP's own 10.67M per message
  is 4.6% under a ResNet-18, so the table's counts are not exact). That is far less than the CVAE plus a
  ResNet-18 classifier ("Full model" in the personalised column then means that every trained module
  stays private), and the same order as an encoder. The paper writes phi for both g_phi and the CVAE
  encoder E_phi and for DRDFL's shared Learngene, so g_phi is built as DRDFL's Learngene
  (:class:`privfl.methods.drdfl.Learngene`: conv w, 2w, 4w, 4w + GroupNorm, FC -> 2d). The paper-scale
  widths ``--prior-width 88 --latent-dim 128`` give |g_phi| = 3,259,424 per message at 3x32x32, 65.2M over
  20 clients (63.44M reported: +2.8%; -2.0% against the 3.32M reading). DRDFL's own paper widths (32,
  64) give 0.50M. GroupNorm, no BatchNorm: no running statistics to mix or leak.
- **"Pretrained".** Read as a first phase of the run in which g_phi is trained with the CVAE and gossiped
  on the ring, then frozen as the shared prior ("trains a pretrained model g_phi ... until convergence";
  "using the pretrained model as the shared interaction information"). ``pretrain_fraction`` (default
  0.5; 1: never frozen, g_phi exchanged every round) sets its length. Whether the paper's #Comm is a
  per-round figure of that phase or averaged over the run is not said; privfl reports per round.
- **The CVAE.** The label enters the encoder q(z|x, y) (Sec. II-B: label vectors as inputs to the
  encoder); the prior is x-conditional, p(z|x) = g_phi(x), as Sohn's prior network, which is what
  "g_phi gives the prior distribution" needs to be usable at test time. The decoder takes z only: a
  decoder that also needs y could not run at inference, where y is what is predicted. KL between the
  two diagonal Gaussians in closed form; during pretraining it trains both E and g_phi. z_q sampled with
  one draw; reconstruction error summed over pixels, mean over the batch (as DRDFL, ``rec_reduction``).
  The encoder: DRDFL's conv trunk (:class:`privfl.methods.drdfl.ConvEncoder`) at ``encoder_width``, its
  flattened maps concatenated with one-hot y, FC -> 2d; the decoder: DRDFL's
  (:class:`privfl.methods.drdfl.Decoder`, tanh output on the [-1, 1] input scale) at ``decoder_width``.
- **How C_omega uses the CVAE.** As DRDFL's classifier: trained on x and on a noisy reconstruction x_p
  (noise std 0.1, DRDFL's default), with x_p detached (DRDFL's default routing ``elbo``: the classifier
  loss trains the classifier only), and inference on the reconstruction from the prior mean
  (``infer=reconstruction``; ``infer=direct`` scores C(x) instead). Unlike DRDFL, whose x' needs no
  label, the ELBO's x' = D(z ~ q(z|x, y)) has seen y, which inference never has; so by default x_p is
  decoded from a sample of the prior, the path inference takes (Sohn et al. Sec. 4.2 train through the
  prior network for the same recognition/prior gap). ``classifier_input=posterior`` uses the ELBO's x'
  (DRDFL's x_p = x' + n). On the FMNIST quick runs the two score alike (a few points apart either way).
- **Mixing and timing.** Uniform mean of own and received copies (DRDFL's rule, extended to any number
  of in-neighbours, unweighted as DRDFL's). The exchange closes a pretraining round (train, send, mix)
  rather than opening it, so that every message carries trained weights and the frozen prior is the
  mixed one; the round's evaluation (``--eval global``) sees the mixed g_phi, ``--eval personal`` the one
  after local training (``personal_parts = ("prior",)``). A down node trains, sends and receives nothing
  (:class:`privfl.topology.Graph`); a node without in-neighbours keeps its own g_phi.
- **Initialisation.** g_phi from one shared seed on every node (``shared_init``, as DRDFL's Learngene);
  E, D and C from each client's own seed.
- **Optimiser.** Adam, lr 0.001 (DRDFL's stated lr, read here as Adam's), fresh each round, all
  loss weights 1 (``kl_weight`` 1). ``local_optimizer=run`` uses the run's --optimizer/--lr instead.
- **Leakage.** An out-neighbour attacking a g_phi message differentiates g_phi (tensors ``prior.*``)
  followed by a random classifier of its own on mu_p (``readout=probe``: it never sees C, E or D). Its
  previous state is the copy the sender received in round ``previous_round`` (meta); the sender really
  started from the mean of that copy and its own previous g_phi, which the note in ``leakage`` records.

Reuses DRDFL's building blocks (``Learngene``, ``ConvEncoder``, ``Decoder``, ``cifar_resnet18``) rather
than copies; the losses here are new (:func:`kl_gaussians`, :func:`cvae_losses`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from privfl.capture.message import Message
from privfl.config import opt
from privfl.fl.method import METHODS, Client, FLMethod, LeakageContext, ModelRequest
from privfl.methods.drdfl import ConvEncoder, Decoder, Learngene, cifar_resnet18
from privfl.seeding import derive_seed
from privfl.topology import Graph, GraphOptions, build_graph

#: what a g_phi message puts before g_phi's own tensor names (the client model's names)
PRIOR_PREFIX = "prior."


@dataclass
class FedcvaeOptions(GraphOptions):
    #: the quick CPU default of ``python -m privfl.train fedcvae`` without --config (flags override it),
    #: as DRDFL's: a seeded 6k-image subset of Fashion-MNIST, 5 rounds (3 of pretraining), narrow modules
    run_defaults: ClassVar[dict[str, Any]] = {"subsample": 6000, "rounds": 5}

    pretrain_fraction: float = opt(
        0.5,
        "share of the rounds (rounded up) in which g_phi is trained and exchanged; then it is frozen and nothing is sent (1: never frozen)",
        min_exclusive=0,
        max=1,
    )
    latent_dim: int = opt(64, "d: CVAE latent size (paper-scale #Comm: 128)", min=1)
    prior_width: int = opt(8, "g_phi conv channels w, 2w, 4w, 4w (DRDFL's Learngene shape; paper-scale #Comm: 88)", min=1)
    encoder_width: int = opt(8, "E(x, y) conv channels, same trunk shape (DRDFL paper widths: 32)", min=1)
    decoder_width: int = opt(8, "decoder channels 4w -> 2w -> w (DRDFL paper widths: 32)", min=1)
    classifier: str = opt("zoo", "C_omega: the client's --model-group model (zoo) or CIFAR ResNet-18 (paper)", choices=("zoo", "resnet18-cifar"))
    kl_weight: float = opt(1.0, "weight of KL(q(z|x,y) || g_phi(x)) in the negative ELBO (paper: none, so 1)", min=0)
    noise_std: float = opt(0.1, "std of the noise n in x_p = D(z) + n the classifier also trains on (DRDFL's default)", min=0)
    rec_reduction: str = opt("sum", "reconstruction error: sum over pixels or mean, then mean over the batch", choices=("sum", "mean"))
    classifier_input: str = opt(
        "prior",
        "which reconstruction C also trains on: from z ~ g_phi(x) (prior, the test-time path) or z ~ q(z|x,y) (posterior, DRDFL's x')",
        choices=("prior", "posterior"),
    )
    infer: str = opt("reconstruction", "inference: C(D(mu_p(x))) (the CVAE path) or C(x) (direct)", choices=("reconstruction", "direct"))
    local_optimizer: str = opt("adam", "adam at --adam-lr (DRDFL's) or run (the run's --optimizer/--lr/--momentum)", choices=("adam", "run"))
    adam_lr: float = opt(0.001, "Adam learning rate (DRDFL paper: 0.001) when local_optimizer=adam", min_exclusive=0)
    shared_init: bool = opt(True, "g_phi starts from one shared seed on every node")


# -------------------------------------------------------------------------------------------------
# losses (module-level so tests can check them on known inputs)
# -------------------------------------------------------------------------------------------------


def kl_gaussians(mu_q: torch.Tensor, lv_q: torch.Tensor, mu_p: torch.Tensor, lv_p: torch.Tensor) -> torch.Tensor:
    """KL(N(mu_q, diag e^lv_q) || N(mu_p, diag e^lv_p)), summed over dimensions, mean over the batch:
    1/2 sum (lv_p - lv_q + (e^lv_q + (mu_q - mu_p)^2) / e^lv_p - 1)."""
    return 0.5 * (lv_p - lv_q + (lv_q.exp() + (mu_q - mu_p).pow(2)) / lv_p.exp() - 1).sum(-1).mean()


def mix_states(own: dict[str, torch.Tensor], received: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """(own + r_1 + ... + r_n) / (1 + n) per floating tensor, added in that order (non-float tensors kept):
    DRDFL's (phi~ + phi)/2 for one in-neighbour."""
    out = {}
    for k, v in own.items():
        if not v.is_floating_point():
            out[k] = v.clone()
            continue
        total = v.clone()
        for r in received:
            total = total + r[k].to(v)
        out[k] = total / (1 + len(received))
    return out


# -------------------------------------------------------------------------------------------------
# modules
# -------------------------------------------------------------------------------------------------


class LabelEncoder(nn.Module):
    """E: (x, one-hot y) -> (mu_q, log sigma_q^2): DRDFL's conv trunk, its flattened maps joined with y, FC -> 2d."""

    def __init__(self, in_channels: int, image_size: int, width: int, num_classes: int, latent_dim: int):
        super().__init__()
        self.trunk = ConvEncoder(in_channels, image_size, width, 1)
        flat = self.trunk.fc.in_features
        self.trunk.fc = nn.Identity()  # type: ignore[assignment]  # the trunk returns its flattened maps
        self.fc = nn.Linear(flat + num_classes, 2 * latent_dim)

    def forward(self, x: torch.Tensor, y_onehot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, log_var = self.fc(torch.cat([self.trunk(x), y_onehot], 1)).chunk(2, dim=1)
        return mu, log_var.clamp(-10.0, 10.0)


class FedcvaeModel(nn.Module):
    """One client's modules; ``forward(x)`` is the inference: C(D(mu_p(x))) (or C(x), ``infer=direct``)."""

    def __init__(self, prior: Learngene, encoder: LabelEncoder, decoder: Decoder, classifier: nn.Module, num_classes: int, infer: str):
        super().__init__()
        self.prior, self.encoder, self.decoder, self.classifier = prior, encoder, decoder, classifier
        self.num_classes, self.infer = num_classes, infer

    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        """x' from the prior mean: the label-free path used at test time."""
        mu_p, _ = self.prior(x)
        return self.decoder(mu_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(x if self.infer == "direct" else self.reconstruct(x))


def cvae_losses(model: FedcvaeModel, x: torch.Tensor, y: torch.Tensor, o: FedcvaeOptions, train_prior: bool = True) -> dict[str, torch.Tensor]:
    """Every loss on one batch (module docstring): ``train_loss`` = L_rec + kl_weight * L_kl + L_ce, plus
    ``loss_elbo`` (= L_rec + kl_weight * L_kl, the negative ELBO) and the parts. With ``train_prior`` False
    (after pretraining) g_phi runs without a graph: the KL trains E only."""
    mu_q, lv_q = model.encoder(x, F.one_hot(y, model.num_classes).to(x.dtype))
    z = mu_q + (0.5 * lv_q).exp() * torch.randn_like(mu_q)
    if train_prior:
        mu_p, lv_p = model.prior(x)
    else:
        with torch.no_grad():
            mu_p, lv_p = model.prior(x)
    l_kl = kl_gaussians(mu_q, lv_q, mu_p, lv_p)
    x_rec = model.decoder(z)
    err = (x - x_rec).pow(2)
    l_rec = (err.sum((1, 2, 3)) if o.rec_reduction == "sum" else err.mean((1, 2, 3))).mean()
    if o.classifier_input == "prior":  # the path inference takes, with a sample of the prior (Sohn's GSNN path)
        with torch.no_grad():
            x_c = model.decoder(mu_p + (0.5 * lv_p).exp() * torch.randn_like(mu_p))
    else:
        x_c = x_rec
    x_p = (x_c + o.noise_std * torch.randn_like(x_c)).detach()
    l_ce = F.cross_entropy(model.classifier(x), y) + F.cross_entropy(model.classifier(x_p), y)
    elbo = l_rec + o.kl_weight * l_kl
    return {"train_loss": elbo + l_ce, "loss_elbo": elbo, "loss_rec": l_rec, "loss_kl": l_kl, "loss_ce": l_ce}


def build_prior(req: ModelRequest) -> Learngene:
    """g_phi; from one seed for every client when ``shared_init``."""
    o: FedcvaeOptions = req.opts
    if not o.shared_init:
        return Learngene(req.in_channels, req.image_size, o.prior_width, o.latent_dim)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(req.cfg.seed, "init", "fedcvae-prior"))
        return Learngene(req.in_channels, req.image_size, o.prior_width, o.latent_dim)


def prior_tensors(model: FedcvaeModel) -> dict[str, torch.Tensor]:
    """g_phi's state dict under the client model's names (``prior.*``): a message's whole payload."""
    return {PRIOR_PREFIX + k: v.detach().clone() for k, v in model.prior.state_dict().items()}


# -------------------------------------------------------------------------------------------------
# the method
# -------------------------------------------------------------------------------------------------


@METHODS.register("fedcvae")
class Fedcvae(FLMethod):
    name = "fedcvae"
    sends = {"shared_model": "peer"}
    exposes = ()
    Options = FedcvaeOptions
    paper = "Guo, Lv, Geng, DRDFL App. VII-B3: Fedcvae, CVAE (Sohn et al. 2015) with a pretrained prior network g_phi shared on the ring"
    #: a received g_phi is mixed into the node's own; --eval personal scores the one after local training
    personal_parts = ("prior",)
    #: an out-neighbour attacking a g_phi message differentiates g_phi (tensors ``prior.*``) followed by
    #: a random classifier of its own on mu_p; its previous state is the g_phi the sender received in the
    #: round the message's meta names (``previous_round``)
    leakage = {
        "shared_model": LeakageContext(
            previous="shared_model",
            module="prior",
            prefix=PRIOR_PREFIX,
            output=0,
            readout="probe",
            probe_hidden=128,
            note=(
                "the sender started from the mean of its own previous g_phi and what it received, not the received copy alone; "
                "the neighbour's random classifier on mu_p stands in for the sender's private CVAE losses"
            ),
        )
    }

    @classmethod
    def build_client_model(cls, req: ModelRequest) -> FedcvaeModel:
        o: FedcvaeOptions = req.opts
        prior = build_prior(req)
        encoder = LabelEncoder(req.in_channels, req.image_size, o.encoder_width, req.num_classes, o.latent_dim)
        decoder = Decoder(o.latent_dim, req.in_channels, req.image_size, o.decoder_width)
        if o.classifier == "resnet18-cifar":
            classifier = cifar_resnet18(req.in_channels, req.num_classes)
        else:  # the client's --model-group model, built as every method builds it
            classifier = super().build_client_model(req)
        return FedcvaeModel(prior, encoder, decoder, classifier, req.num_classes, o.infer)

    @classmethod
    def build_topology(cls, cfg: Any, opts: FedcvaeOptions) -> Graph:
        return build_graph(cfg, opts)

    def __init__(self, env):
        super().__init__(env)
        self.topology: Graph = env.topology if isinstance(env.topology, Graph) else self.build_topology(self.cfg, self.opts)
        self.pretrain_rounds = pretrain_rounds(self.cfg.rounds, self.opts.pretrain_fraction)

    # ------------------------------------------------------------------ rounds, as gossip
    def gossip_send(self, rnd: int, client: Client) -> list[tuple[Message, dict[str, torch.Tensor] | None]]:
        """Local training first (its losses are noted: :meth:`note`), then, while pretraining, g_phi to each
        out-neighbour of the round's graph."""
        pretraining = rnd < self.pretrain_rounds
        self.note(client, self.train_client(rnd, client, pretraining))
        if not pretraining:
            return []
        return [self.prior_message(rnd, client, f"client{r}") for r in sorted(self.topology.out_neighbors(client.index, rnd))]

    def gossip_round(self, rnd: int, client: Client, received: list[Message]) -> dict[str, float]:
        """Mix what it received into its g_phi (all nodes mix at once, after every node has sent)."""
        if received:
            self.mix(client, [{k.removeprefix(PRIOR_PREFIX): v for k, v in m.tensors.items()} for m in received])
        return {"prior_scalars": float(max([0, *(m.paper_scalars for m in received)]))}

    def client_metrics(self, rnd: int, rows: list[dict[str, float]]) -> dict[str, float]:
        """Whether the round pretrained, the g_phi message size (the largest received), the live count; the
        training losses come as the nodes' notes."""
        return {
            "pretraining": float(rnd < self.pretrain_rounds),
            "prior_scalars": max([0.0, *(r["prior_scalars"] for r in rows)]),
            "live_nodes": float(len(rows)),
        }

    def prior_message(self, rnd: int, sender: Client, receiver: str) -> tuple[Message, dict[str, torch.Tensor]]:
        """One peer message of g_phi after the sender's local training (truth: its training samples)."""
        # the state it trained from was mixed at the end of round rnd-1 if it received anything then
        prev = rnd - 1 if rnd > 0 and self.topology.in_neighbors(sender.index, rnd - 1) else -1
        meta = {
            "num_samples": len(sender.train_idx),
            "lr": self.local_lr(),
            "local_epochs": self.cfg.local_epochs,
            "batch_size": self.cfg.batch_size,
            "previous_round": prev,
        }
        msg = Message(rnd, sender.name, receiver, "shared_model", prior_tensors(sender.model), meta)
        return msg, {"indices": sender.train_idx.cpu()}

    @torch.no_grad()
    def mix(self, client: Client, received: list[dict[str, torch.Tensor]]) -> None:
        """g_phi <- (own + sum of the received copies) / (1 + their number)."""
        prior = client.model.prior
        prior.load_state_dict(mix_states(prior.state_dict(), received))

    def local_lr(self) -> float:
        return self.opts.adam_lr if self.opts.local_optimizer == "adam" else self.cfg.lr

    def train_client(self, rnd: int, client: Client, train_prior: bool) -> dict[str, float]:
        """``local_epochs`` of the CVAE + classifier objective through the shared trainer; g_phi is in the
        optimiser only while pretraining. Optimisers are fresh each round (resume stays exact)."""
        model: FedcvaeModel = client.model
        params = [p for n, p in model.named_parameters() if train_prior or not n.startswith(PRIOR_PREFIX)]

        def objective(model: FedcvaeModel, x: torch.Tensor, y: torch.Tensor):
            losses = cvae_losses(model, x, y, self.opts, train_prior)
            total = losses.pop("train_loss")
            return total, {k: v.detach() for k, v in losses.items()}

        def optimizer(model: FedcvaeModel) -> torch.optim.Optimizer:
            if self.opts.local_optimizer == "adam":
                return self.trainer.make_optimizer(params, lr=self.opts.adam_lr, optimizer="adam")
            return self.make_optimizer(params)

        return self.fit(rnd, client, objective, optimizer=optimizer).as_dict("train_loss")


def pretrain_rounds(rounds: int, fraction: float) -> int:
    """Rounds of pretraining (g_phi trained and exchanged): ceil(fraction * rounds), at least 1."""
    return max(1, min(rounds, math.ceil(fraction * rounds - 1e-9)))


__all__ = [
    "Fedcvae",
    "FedcvaeModel",
    "FedcvaeOptions",
    "LabelEncoder",
    "build_prior",
    "cvae_losses",
    "kl_gaussians",
    "mix_states",
    "pretrain_rounds",
    "prior_tensors",
]
