"""FedGen: data-free knowledge distillation through a server-trained generator.

Zhu, Hong, Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated Learning", ICML 2021,
arXiv 2105.10056 (official code: zhuangdizhu/FedGen); heterogeneous variant as HtFLlib
(``TsingZ0/HtFLlib``: ``clients/clientgen.py``, ``servers/servergen.py``) and the FedRE paper's tables
(FedRE, CVPR 2026, Tables 1 and 11).

Every client keeps its own body (features + RM, any architecture) and shares its head, a
``Linear(d, C)`` of the same shape everywhere. The server owns the global head and a lightweight
**generator** G(noise, y) -> a d-dim representation (HtFLlib/official ``Generator``:
Linear(noise_dim + C -> hidden) + BatchNorm1d + ReLU, then Linear(hidden -> d); noise ~ U[0, 1)^noise_dim,
as both codes draw it, although their comment says Gaussian).

Setup (once, meta ``phase=setup``): every client uploads its label counts (kind ``label_counts``, up;
HtFLlib computes ``sample_per_class`` once, at client creation); the server sums them and sends the
global counts to every client (``label_counts``, down: HtFLlib hands every client the server's
``qualified_labels``, the global label list; with ``client_labels=local`` each client uses its own
counts and nothing goes down); the server sends its initial head (``head``, down).

Per round t:

1. from round 1 on, the server sends its generator to the selected clients (kind ``generator``, down;
   a state dict incl. BatchNorm buffers);
2. each selected client trains body + head on CE(model(x), y) plus, from round 1,
   ``gen_weight`` * CE(head(G(noise, y')), y') per batch, y' drawn from the label distribution
   (``client_labels``) in batches of ``gen_batch_size`` (HtFLlib: weight 1, the client batch size;
   G in train mode, not trained by the client);
3. it uploads its head (kind ``head``, up; meta ``num_samples``, ``lr``, ``local_steps``);
4. the server trains the generator for ``server_epochs`` Adam steps (lr ``generator_lr``, fresh each
   round, as HtFLlib) on batches y ~ p(y), p proportional to the label counts of the clients that
   uploaded, minimising CE(sum_k w_k(y) head_k(G(noise, y)), y) + ``diversity_weight`` * L_div,
   where head_k are the received heads (the paper's Eq. 4: the generator's outputs must be
   classified as y by the ensemble of the clients' heads);
5. the server averages the received heads, weighted by ``num_samples`` (HtFLlib), and broadcasts the
   average to every client (``head``, down); each overwrites its head with it.

What is sent, per client per round: its head up and the global head down, d*C + C scalars each way
(as LG-FedAvg: K*(dC + C) = 51.30e3 for d=512, C=10, K=10, 513.00e3 for C=100; Table 11 hete), plus
the generator down to each selected client from round 1 on ((noise_dim + C + 1) * hidden + 4 * hidden + 1
+ (hidden + 1) * d scalars incl. BatchNorm buffers: 532,481 at the defaults with d = 512, C = 10), which
the FedRE paper does not count: ``comm['down:generator']`` reports it apart from
``comm['down:head']``. The label counts (C integers each way) travel once, at setup.

Decisions where the paper is open or HtFLlib differs:

- **Ensemble weights.** ``ensemble_weighting=samples`` (default, HtFLlib): w_k = n_k / sum_j n_j, the
  weights of the head average, so the teacher ensemble *is* the global head the clients then hold and
  regularise with. ``label`` (the official code's ``label_weights``): head k's logits weigh
  w_k(y) = n_k(y) / sum_j n_j(y) over the clients that uploaded. Either way the teacher is a weighted
  sum of logits (HtFLlib and the paper's Eq. 4; the official code sums per-teacher weighted
  cross-entropies instead). ``label`` is not the default because it diverges with heterogeneous heads
  and non-IID data: each label is then taught by the few heads that hold it, the generator grows its
  outputs' norm until those heads are confident, the global head disagrees with them, and the
  clients' regulariser explodes (Fashion-MNIST, Dir(0.1), 12,000 samples, lr 0.06: round-1 generator
  CE 5.2e3 and accuracy 0.10 by round 2 with ``label``; 0.006 and 0.81 with ``samples``).
- **Diversity loss.** The paper's (official ``DiversityLoss``): exp(-mean_ij ||eps_i - eps_j||^2_mean *
  |G_i - G_j|_1,mean), weight ``diversity_weight`` = 1 (official ``ensemble_eta``); HtFLlib has none
  (``diversity_weight=0``).
- **Label distribution.** The server draws y' from the counts of the clients that uploaded (with every
  client selected: HtFLlib's global ``qualified_labels``); clients draw from the global counts they
  received (HtFLlib, ``client_labels=global``) or uniformly over their own labels (official
  ``available_labels``, ``client_labels=local``).
- **Round 0.** The generator is untrained before the first server step; the official code turns the
  regulariser off in round 0 (``regularization = glob_iter > 0``), which is followed here, so the
  generator is first sent in round 1. HtFLlib uses the random generator in round 0.
- **Client regulariser.** HtFLlib's: CE of the client's head on generated representations, weight 1
  (the official code adds a KL term on the client's own data and decays both weights).
- **What a client shares** (``share``). The FedRE paper's Table 11 counts FedGen as LG-FedAvg in the
  model-heterogeneous setting and as FedAvg in the homogeneous one (8785.38e3 both ways for HtFLlib's
  CIFAR-10 CNN, 10 clients; spec fedre.md Table 11 and its artifact table): with identical models
  FedGen's paper and PFLlib's ``serverGen``/``clientGen`` average and send the whole model (kind
  ``model``, weighted by ``num_samples`` as FedAvg) and the generator is trained against the ensemble
  of the uploaded models' heads. ``share=auto`` (default) takes that variant when every client has the
  same architecture and the head variant otherwise; ``head`` or ``model`` force one (``model`` refuses a
  heterogeneous group). In the model variant the setup sends the server's initial model (built as
  FedAvg's, from client 0's spec) instead of the head, and the whole model is the personal part.
- **Tensor names.** A head message names its tensors as in the client model (``head.weight``,
  ``head.bias``), so gradient-leakage attacks rebuild its context on the whole client model, the body
  at the attacker's random initialisation (``leakage``).
- **Randomness.** Every draw (labels, noise) comes from a generator seeded from the run seed, the
  round and the client (:mod:`privfl.seeding`); the server's generator, the received per-client label
  counts and the head are in ``server_state``, so a killed run resumes exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from privfl.capture.message import Message
from privfl.config import opt
from privfl.errors import ConfigError
from privfl.fl.method import (
    METHODS,
    Client,
    ClientReply,
    FLMethod,
    LeakageContext,
    average_states,
    load_module_tensors,
    module_tensors,
)
from privfl.seeding import seed_global, torch_generator

#: what a head message puts before the head's own parameter names (the client model's names)
HEAD_PREFIX = "head."


@dataclass
class FedGenOptions:
    """FedGen's hyperparameters (defaults: HtFLlib ``main.py`` and the official code)."""

    noise_dim: int = opt(512, "generator noise dimension (HtFLlib --noise_dim)", min=1)
    hidden_dim: int = opt(512, "generator hidden width (HtFLlib --hidden_dim)", min=1)
    generator_lr: float = opt(0.005, "server Adam learning rate of the generator (HtFLlib --generator_learning_rate)", min_exclusive=0)
    server_epochs: int = opt(100, "generator steps per round on the server (HtFLlib --server_epochs)", min=0)
    gen_batch_size: int | None = opt(None, "labels drawn per generator step, server and client (default: --batch-size, as HtFLlib)", min=2)
    gen_weight: float = opt(1.0, "weight of the client's CE on generated representations (HtFLlib: 1)", min=0)
    diversity_weight: float = opt(1.0, "weight of the generator's diversity loss (paper/official eta: 1; HtFLlib: 0)", min=0)
    ensemble_weighting: str = opt(
        "samples", "teacher weights: samples (HtFLlib: n_k/n, as the head average) or label (official: n_k(y)/n(y))", choices=("samples", "label")
    )
    share: str = opt(
        "auto",
        "what a client uploads and receives: head (heterogeneous, HtFLlib), model (the whole model, FedGen's paper and PFLlib "
        "with identical models), auto: model when every client has the same architecture",
        choices=("auto", "head", "model"),
    )
    client_labels: str = opt(
        "global",
        "labels a client draws: global (HtFLlib: the global counts, sent at setup) or local (official: its own labels)",
        choices=("global", "local"),
    )

    def __post_init__(self) -> None:
        for key in ("noise_dim", "hidden_dim"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"option {key} must be a positive integer, got {value!r}")
        if self.server_epochs < 0 or self.gen_weight < 0 or self.diversity_weight < 0 or self.generator_lr <= 0:
            raise ConfigError("options server_epochs, gen_weight and diversity_weight must be >= 0 and generator_lr > 0")


class Generator(nn.Module):
    """G(noise, y) -> representation: Linear(noise + C -> hidden) + BatchNorm1d + ReLU, Linear(hidden -> d)
    (HtFLlib's ``Generator``, after the official code). The noise is an argument: callers draw it from
    their own seeded generator (:meth:`draw`)."""

    def __init__(self, noise_dim: int, num_classes: int, hidden_dim: int, rep_dim: int):
        super().__init__()
        self.noise_dim, self.num_classes = noise_dim, num_classes
        self.fc1 = nn.Sequential(nn.Linear(noise_dim + num_classes, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.ReLU())
        self.fc = nn.Linear(hidden_dim, rep_dim)

    def forward(self, labels: Tensor, noise: Tensor) -> Tensor:
        y = F.one_hot(labels, self.num_classes).to(noise.dtype)
        return self.fc(self.fc1(torch.cat((noise, y), dim=1)))

    def draw(self, probs: Tensor, n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        """(n labels ~ ``probs``, their U[0, 1) noise), on the generator's device, from ``gen`` (CPU)."""
        device = self.fc.weight.device
        labels = torch.multinomial(probs.double().cpu(), n, replacement=True, generator=gen)
        noise = torch.rand(n, self.noise_dim, generator=gen)
        return labels.to(device), noise.to(device)


def diversity_loss(noise: Tensor, out: Tensor) -> Tensor:
    """The official ``DiversityLoss('l1')``: exp(-mean_ij d2(eps_i, eps_j) * d1(G_i, G_j)), d2 the mean
    squared and d1 the mean absolute difference: small when distinct noises give distinct outputs."""
    out = out.flatten(1)
    layer = (out.unsqueeze(0) - out.unsqueeze(1)).abs().mean(2)
    noise_d = (noise.unsqueeze(0) - noise.unsqueeze(1)).pow(2).mean(2)
    return torch.exp(-(noise_d * layer).mean())


def ensemble_logits(z: Tensor, labels: Tensor, weights: Tensor, heads: Tensor, biases: Tensor) -> Tensor:
    """sum_k w_k(y_i) (W_k z_i + b_k): ``weights`` (K, C) per teacher and label, ``heads`` (K, C, d),
    ``biases`` (K, C); returns (B, C)."""
    logits = torch.einsum("bd,kcd->kbc", z, heads) + biases.unsqueeze(1)  # (K, B, C)
    return (weights[:, labels].unsqueeze(-1) * logits).sum(0)


def teacher_weights(counts: Tensor, samples: Tensor, how: str) -> Tensor:
    """(K, C) weights of K teachers: per label n_k(y)/sum_j n_j(y) (``label``; labels nobody holds: 1/K),
    or n_k/sum_j n_j for every label (``samples``)."""
    counts = counts.double()
    if how == "samples":
        w = samples.double() / samples.double().sum()
        return w.unsqueeze(1).expand_as(counts).clone()
    total = counts.sum(0, keepdim=True)
    return torch.where(total > 0, counts / total.clamp_min(1), torch.full_like(counts, 1.0 / counts.shape[0]))


def train_generator(
    generator: Generator,
    heads: Tensor,
    biases: Tensor,
    weights: Tensor,
    probs: Tensor,
    *,
    steps: int,
    batch: int,
    lr: float,
    diversity_weight: float,
    gen: torch.Generator,
) -> float:
    """``steps`` Adam steps of the generator against the weighted ensemble of heads (module docstring);
    returns the mean loss. A fresh optimizer, as HtFLlib's ``train_generator``."""
    generator.train()
    opt = torch.optim.Adam(generator.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)
    w, h, b = weights.to(heads), heads.detach(), biases.detach()
    total = 0.0
    for _ in range(steps):
        labels, noise = generator.draw(probs, batch, gen)
        z = generator(labels, noise)
        loss = F.cross_entropy(ensemble_logits(z, labels, w, h, b), labels)
        if diversity_weight > 0:
            loss = loss + diversity_weight * diversity_loss(noise, z)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += loss.item()
    return total / max(steps, 1)


def head_state(head: nn.Module) -> dict[str, Tensor]:
    """A head's tensors under the client model's names (``head.weight``, ``head.bias``)."""
    return {HEAD_PREFIX + k: v for k, v in module_tensors(head).items()}


def load_head_state(head: nn.Module, tensors: dict[str, Tensor]) -> None:
    own = head.state_dict()
    head.load_state_dict({k.removeprefix(HEAD_PREFIX): v.to(own[k.removeprefix(HEAD_PREFIX)]) for k, v in tensors.items()})


@METHODS.register("fedgen")
class FedGen(FLMethod):
    """See the module docstring. Server state: global head, generator, the label counts received at setup;
    client state: the counts it draws generated labels from."""

    name = "fedgen"
    sends = {"head": "up/down", "model": "up/down", "label_counts": "up/down", "generator": "down"}
    Options = FedGenOptions
    personal_parts = ("head",)
    leakage = {
        "head": LeakageContext(
            previous="head",
            note="only the head crosses the wire: the client's body (features + RM) stays at the attacker's random initialisation; "
            "the local loss also has the generator term",
        ),
        "model": LeakageContext(previous="model", note="the local loss also has the generator term (homogeneous variant, share=model)"),
    }
    paper = "Zhu et al., Data-Free Knowledge Distillation for Heterogeneous Federated Learning (FedGen), ICML 2021 (arXiv 2105.10056)"

    def __init__(self, env):
        super().__init__(env)
        o, c = self.opts, env.num_classes
        if self.gen_batch < 2:
            raise ConfigError(f"fedgen draws generator batches of {self.gen_batch}: BatchNorm needs at least 2 (set gen_batch_size)")
        archs = {client.arch for client in env.clients}
        #: "head" or "model": what crosses the wire (option ``share``, module docstring)
        self.share = o.share if o.share != "auto" else ("model" if len(archs) == 1 else "head")
        if self.share == "model" and len(archs) > 1:
            raise ConfigError(f"fedgen share=model needs identical client models, got {', '.join(sorted(archs))}; use share=head")
        seed_global(self.cfg.seed, "init", "server-head")
        self.head = nn.Linear(self.cfg.rep_dim, c).to(env.device)
        #: the server's whole model (share=model only); its head is ``self.head``'s role there
        self.global_model: nn.Module | None = None
        if self.share == "model":
            from privfl.models import build_model

            seed_global(self.cfg.seed, "init", "server-model")
            self.global_model = build_model(**env.clients[0].model.spec).to(env.device)
            self.personal_parts = ("",)  # type: ignore[misc]  # per run: the broadcast overwrites the whole model
        seed_global(self.cfg.seed, "init", "fedgen-generator")
        self.generator = Generator(o.noise_dim, c, o.hidden_dim, self.cfg.rep_dim).to(env.device)
        #: label counts the server received from each client at setup (server side)
        self.counts = torch.zeros(self.cfg.num_clients, c, dtype=torch.int64)
        #: client side: the counts each client draws its generated labels from (the global ones it
        #: received, or its own), by client name; kept between rounds through client_state
        self.client_counts: dict[str, Tensor] = {}
        #: client side: the generator a selected client received this round, until its training uses it
        self.received_generator: dict[str, dict[str, Tensor]] = {}

    @property
    def gen_batch(self) -> int:
        return self.opts.gen_batch_size or self.cfg.batch_size

    # -------------------------------------------------------------- protocol, in roles
    def client_setup(self, client: Client) -> list[tuple[Message, dict[str, Tensor] | None]]:
        """Client side, at setup: its label counts up (with ``client_labels=local`` it also keeps the
        uniform distribution over its own labels, as the official code)."""
        own = torch.bincount(self.env.data.labels[client.train_idx], minlength=self.env.num_classes).cpu()
        if self.opts.client_labels == "local":
            self.client_counts[client.name] = (own > 0).long()
        msg = Message(0, client.name, "server", "label_counts", {"counts": own}, {"phase": "setup"})
        return [(msg, {"indices": client.train_idx.cpu()})]

    def server_setup(self, uploads: list[Message]) -> None:
        """Server side, at setup: keep each client's counts; the global counts down (``client_labels=global``),
        then the initial head."""
        for got in uploads:
            self.counts[int(got.sender.removeprefix("client"))] = got.tensors["counts"].cpu()
        if self.opts.client_labels == "global":
            self.deliver(self.channel.broadcast(0, self.client_names(), "label_counts", {"counts": self.counts.sum(0)}, meta={"phase": "setup"}))
        self.broadcast_shared(0, "setup")

    def broadcast_shared(self, rnd: int, phase: str = "train") -> None:
        """The global head (share=head) or the global model (share=model) to every client."""
        if self.global_model is not None:
            self.deliver(self.channel.broadcast(rnd, self.client_names(), "model", module_tensors(self.global_model), meta={"phase": phase}))
        else:
            self.deliver(self.channel.broadcast(rnd, self.client_names(), "head", head_state(self.head), meta={"phase": phase}))

    def receive(self, client: Client, msg: Message) -> None:
        """Client side: the global head (or model) replaces its own; global label counts and the generator are kept."""
        if msg.kind == "head":
            load_head_state(client.model.head, msg.tensors)
        elif msg.kind == "model":
            load_module_tensors(client.model, msg.tensors)
        elif msg.kind == "label_counts":
            self.client_counts[client.name] = msg.tensors["counts"].cpu()
        elif msg.kind == "generator":
            self.received_generator[client.name] = msg.tensors

    def open_round(self, rnd: int, selected: list[Client]) -> None:
        """Server side: from round 1 on (the generator has been trained), the generator to the selected clients."""
        if rnd > 0:
            names = [c.name for c in selected]
            self.deliver(self.channel.broadcast(rnd, names, "generator", module_tensors(self.generator), meta={"phase": "train"}))

    def objective(self, rnd: int, client: Client, generator: Generator | None):
        """CE on the client's data, plus gen_weight * CE(head(G(noise, y')), y') once a generator exists."""
        if generator is None:
            return None  # the trainer's default: CE(head(represent(x)), y)
        probs = self.client_counts.get(client.name, torch.zeros(self.env.num_classes, dtype=torch.int64)).double()
        if probs.sum() <= 0:
            raise ConfigError(f"{client.name} holds no label distribution to draw generated labels from")
        draws = torch_generator(self.cfg.seed, "fedgen-client", rnd, client.index)
        weight, batch = self.opts.gen_weight, self.gen_batch
        generator.train()  # batch statistics, as the server trained it (HtFLlib)

        def loss(model, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            ce = F.cross_entropy(model(x), y)
            labels, noise = generator.draw(probs, batch, draws)
            with torch.no_grad():
                z = generator(labels, noise)
            reg = F.cross_entropy(model.head(z), labels)
            return ce + weight * reg, {"ce": ce, "gen": reg}

        return loss

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        """Client side: train with the generator it received this round (none in round 0), upload its head
        (or its whole model, share=model)."""
        generator = None
        tensors = self.received_generator.pop(client.name, None)
        if tensors is not None:
            o = self.opts
            generator = Generator(o.noise_dim, self.env.num_classes, o.hidden_dim, self.cfg.rep_dim).to(self.env.device)
            generator.load_state_dict(tensors)
        st = self.fit(rnd, client, self.objective(rnd, client, generator))
        meta = {"num_samples": len(client.train_idx), "lr": self.cfg.lr, "local_steps": st.steps, "arch": client.arch}
        if self.share == "model":
            msg = Message(rnd, client.name, "server", "model", module_tensors(client.model), meta)
        else:
            msg = Message(rnd, client.name, "server", "head", head_state(client.model.head), meta)
        metrics = {"train_loss": st.loss}
        if rnd > 0:
            metrics["gen_loss"] = st.parts.get("gen", 0.0)
        return ClientReply([(msg, {"indices": client.train_idx.cpu()})], metrics)

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """Server side: train the generator on the received heads, average them, broadcast the global head."""
        server_loss = self.server_update(rnd, uploads)
        self.broadcast_shared(rnd)
        return {"server_loss": server_loss}

    def server_update(self, rnd: int, received: list[Message]) -> float:
        """Train the generator on the received heads, then average them into the global head (share=model:
        the whole models into the global model); uses only the messages (and the label counts received
        at setup)."""
        o = self.opts
        heads = torch.stack([m.tensors[HEAD_PREFIX + "weight"] for m in received]).to(self.env.device).float()
        biases = torch.stack([m.tensors[HEAD_PREFIX + "bias"] for m in received]).to(self.env.device).float()
        counts = self.counts[[int(m.sender.removeprefix("client")) for m in received]]
        samples = torch.tensor([float(m.meta["num_samples"]) for m in received])
        probs = counts.sum(0).double()
        loss = 0.0
        if o.server_epochs > 0 and probs.sum() > 0:
            loss = train_generator(
                self.generator,
                heads,
                biases,
                teacher_weights(counts, samples, o.ensemble_weighting),
                probs,
                steps=o.server_epochs,
                batch=self.gen_batch,
                lr=o.generator_lr,
                diversity_weight=o.diversity_weight,
                gen=torch_generator(self.cfg.seed, "fedgen-server", rnd),
            )
        if self.global_model is not None:
            averaged = average_states(received, self.global_model.state_dict())
            self.global_model.load_state_dict(averaged)
            load_head_state(self.head, {k: v for k, v in averaged.items() if k.startswith(HEAD_PREFIX)})
            return loss
        w = (samples / samples.sum()).double()
        avg = {k: sum(wi * m.tensors[k].double() for wi, m in zip(w.tolist(), received)) for k in received[0].tensors}
        load_head_state(self.head, {k: v.float() for k, v in avg.items()})
        return loss

    # -------------------------------------------------------------- state
    def client_state(self, client: Client) -> dict[str, Tensor]:
        state = super().client_state(client)
        if client.name in self.client_counts:
            state["fedgen.label_counts"] = self.client_counts[client.name].clone()
        return state

    def load_client_state(self, client: Client, state: dict[str, Tensor]) -> None:
        super().load_client_state(client, state)
        if "fedgen.label_counts" in state:
            self.client_counts[client.name] = state["fedgen.label_counts"].cpu()

    def server_state(self) -> dict[str, Tensor]:
        model = {} if self.global_model is None else {f"model.{k}": v for k, v in module_tensors(self.global_model).items()}
        return {
            **model,
            **{f"head.{k}": v for k, v in module_tensors(self.head).items()},
            **{f"generator.{k}": v for k, v in module_tensors(self.generator).items()},
            "label_counts": self.counts.clone(),
        }

    def load_server_state(self, state: dict[str, Tensor]) -> None:
        self.head.load_state_dict({k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")})
        if self.global_model is not None:
            self.global_model.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
        self.generator.load_state_dict({k.removeprefix("generator."): v for k, v in state.items() if k.startswith("generator.")})
        self.counts.copy_(state["label_counts"].cpu())
        if "client_label_counts" in state:  # a checkpoint written before FedGen was in roles kept the clients' counts here
            for k, row in enumerate(state["client_label_counts"].cpu()):
                self.client_counts[f"client{k}"] = row


__all__ = [
    "FedGen",
    "FedGenOptions",
    "Generator",
    "diversity_loss",
    "ensemble_logits",
    "head_state",
    "load_head_state",
    "teacher_weights",
    "train_generator",
]
