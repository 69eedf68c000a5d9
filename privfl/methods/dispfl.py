"""DisPFL: personalised sparse models gossiped on a neighbour graph (Dai, Shen, He, Tian, Tao, "DisPFL:
Towards Communication-Efficient Personalized Federated Learning via Decentralized Sparse Training",
ICML 2022, arXiv 2206.00187; official code rong-dai/DisPFL). DRDFL's reference [16] and the row
"DisPFL | Masked model | 106.65M" of its Tables I/II (DRDFL App. VII-B3).

Each client k keeps a personalised binary mask m_k over every parameter of its model (initial density
from Erdos-Renyi-Kernel, ``density`` 0.5 overall) and a model w_k that is zero outside the mask it was
trained under. One round t (synchronous, as DRDFL's ring):

1. every live node sends its sparse model as it stands after round t-1 (kind ``sparse_model``, direction
   ``peer``): per parameter, the values at its mask and the mask itself (see the codec below);
2. it aggregates elementwise over the clients whose masks cover each weight (official ``_aggregate_func``):
   w~ = (sum_j w_j) / (sum_j m_j) over j in {k} + in(k), 0 where no mask covers the weight, then keeps its
   own current mask: w_k <- w~ * m_k;
3. it trains w_k for ``--local-epochs`` with the mask applied to every step (only masked-in weights move;
   the official code multiplies the weights by the mask after each step, here the gradient is masked
   before it, which keeps masked-out weights at exactly 0 under SGD, momentum, weight decay and Adam);
4. it evolves its mask (official ``fire_mask``/``regrow_mask``): per layer, the ceil(alpha_t * |m|)
   active weights of smallest magnitude are pruned and as many inactive ones regrown, those with the
   largest gradient magnitude on one batch (RigL), with the cosine-annealed rate
   alpha_t = (anneal/2)(1 + cos(pi t / T)).
   The weights stay masked by the mask they were trained under; they are sent in round t+1 with it, and
   the new mask takes effect at that round's aggregation (official code: ``mask_pers_shared`` is the old
   mask, ``mask_pers_local`` the new one).

What crosses the wire (kind ``sparse_model``, registered here): per parameter NAME, ``NAME@values``
(float, 1-d: the weights at the mask, in row-major order), ``NAME@mask`` (uint8, 1-d: the mask as packed
bits, most significant bit first, as ``numpy.packbits``) and ``NAME@shape`` (int64, 1-d). The mask and
the shape are bookkeeping (``aux``), so the paper-style count is the number of weights sent, |m_k| (the
official code counts ``count_nonzero`` of what it sends; the mask it leaves out); the full count adds
ceil(n/8) mask bytes and the shape entries, and ``bytes`` is the honest wire size (4 per value, 1 per 8
mask bits). The receiver and an attacker (``AttackerView.load``) see the dense, zero-filled tensors.
homo-cnn4 on Fashion-MNIST (582,026 parameters, ERK at 0.5: biases, conv1 and the head dense, conv2 at
0.359, fc1 at 0.508) sends 291,012 values per message; torchvision ResNet-18 at 3x32x32 (11,181,642
parameters, BatchNorm weights dense) 5,590,818. On DRDFL's 20-node ring that is 20 x 5,590,818 / 2^20 =
106.64 "M", against the table's 106.65M (its DFedPGP 213.36M is 20 x the body state / 2^20 the same way):
half of the model, the mask not counted.

Decisions where the paper is open or its code differs:

- **Graph.** The default ``--topology ring`` is DRDFL's ring. The paper's own graph is time-varying:
  each of 100 clients picks 10 random neighbours per round (the official scripts: ``cs=random``,
  ``frac`` 0.1): ``--topology random --degree 10``; ``ring2`` is its ``cs=ring``, ``full`` its ``cs=full``.
- **Initial masks.** ERK with ``erk_power_scale`` 1 and ``density`` 0.5 (the paper's sparsity 0.5), a
  different random mask per client (``initial_masks=different``: the official scripts'
  ``--different_initial``; ``same`` is the code's default). ``mask_init=uniform`` gives every layer the
  same density. Weights start from one model drawn from a seed every node knows (``shared_init``; the
  official code copies one initial model to every client), times the client's mask.
- **Regrowth.** By gradient (``regrow=gradient``: the paper, and the official code without its flag; the
  gradient of the cross-entropy on one seeded batch of the client's data at its trained weights, model in
  eval mode, as ``screen_gradients``) or at random (``regrow=random``: the official scripts'
  ``--dis_gradient_check``).
  ``mask_evolution=false`` keeps the initial masks (the code's ``--static``). Candidates for regrowth are
  the weights inactive before pruning (as the code), and a layer prunes at most as many weights as it has
  inactive ones, so every layer keeps its density exactly: a dense layer stays dense (the code would regrow
  from nothing there: random regrowth fails on an empty draw, gradient regrowth lets the layer shrink).
- **What is masked, what is sent.** Every parameter is masked and sent sparse. Buffers (BatchNorm running
  statistics of resnet-style models) stay local and are not sent: the paper's ResNet-18 uses GroupNorm and
  has none, and DRDFL's 106.65M matches the parameters alone (with the 9,620 buffer entries of
  torchvision's ResNet-18 it would be 106.82).
- **Optimiser.** The run's ``--lr``, ``--momentum``, ``--weight-decay`` (the official scripts: lr 0.1
  decayed by 0.998 per round, momentum 0, weight decay 5e-4; no decay here, as DRDFL's other rows), with
  the official code's gradient clipping at norm 10 (``max_grad_norm``; 0: off).
- **Failures.** A down node neither sends, receives nor trains in that round (the official code's
  inactive clients skip the aggregation but still train); it sends its last state when it comes back.
- **Evaluation.** After local training, with the mask it trained under (the official code's
  "old_mask_test_acc"); nothing is overwritten after training, so both protocols score the same model.
- **Leakage context.** The dense tensors are the whole client model's parameters. The state a sparse model
  was trained from is the sender's aggregate of round ``previous_round`` (meta; its own message of that
  round and the received ones, averaged per weight over the covering masks, times its mask), which no
  single message holds; ``previous_rule="last-received"`` takes the last sparse model the sender received
  in that round instead (see the note).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from privfl.capture.message import Message
from privfl.codecs import pack_mask, sparse_aux, sparse_decode, sparse_encode, sparse_masks, unpack_mask
from privfl.config import opt
from privfl.errors import ConfigError
from privfl.fl.method import METHODS, Client, FLMethod, LeakageContext, ModelRequest
from privfl.kinds import KINDS
from privfl.seeding import derive_seed, torch_generator
from privfl.topology import Graph, GraphOptions, build_graph

KIND = "sparse_model"


# ------------------------------------------------------------------------------------------ masks
def erk_densities(shapes: Mapping[str, Sequence[int]], density: float, power: float = 1.0) -> dict[str, float]:
    """Per-layer densities of Erdos-Renyi-Kernel (Evci et al., RigL, 2020; DisPFL's ``calculate_sparsities``):
    density_l = eps * ((sum of dims) / (product of dims))^power, eps fixed so that the kept weights total
    ``density`` of all; a layer that would exceed 1 is made dense and eps found again for the rest."""
    sizes = {k: math.prod(s) for k, s in shapes.items()}
    raw = {k: (sum(s) / sizes[k]) ** power for k, s in shapes.items()}
    dense: set[str] = set()
    while True:
        rest = [k for k in shapes if k not in dense]
        if not rest:
            return dict.fromkeys(shapes, 1.0)
        rhs = sum(density * sizes[k] for k in rest) - sum((1 - density) * sizes[k] for k in dense)
        eps = rhs / sum(raw[k] * sizes[k] for k in rest)
        top = max(raw[k] for k in rest)
        if top * eps <= 1:
            return {k: 1.0 if k in dense else eps * raw[k] for k in shapes}
        dense |= {k for k in rest if raw[k] == top}


def init_masks(params: Mapping[str, torch.Tensor], densities: Mapping[str, float], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A random mask per parameter keeping int(density * n) entries (DisPFL's ``init_masks``), seeded."""
    out = {}
    for name, p in params.items():
        n = p.numel()
        keep = int(densities[name] * n) if densities[name] < 1 else n
        flat = torch.zeros(n, dtype=torch.bool)
        flat[torch.randperm(n, generator=generator)[:keep]] = True
        out[name] = flat.reshape(p.shape).to(p.device)
    return out


def drop_rate(rnd: int, rounds: int, anneal: float) -> float:
    """alpha_t = (anneal / 2) (1 + cos(pi t / T)) (the official ``fire_mask``)."""
    return anneal / 2 * (1 + math.cos(rnd * math.pi / rounds))


def evolve_mask(
    mask: torch.Tensor, weight: torch.Tensor, rate: float, grad: torch.Tensor | None = None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Prune the ceil(rate * |mask|) active weights of smallest magnitude and regrow as many inactive ones (inactive
    before pruning): the largest |grad| when a gradient is given, else uniformly at random. At most as many as
    are inactive, so the density stays exactly the same."""
    flat = mask.reshape(-1)
    active = int(flat.sum())
    k = min(math.ceil(rate * active), flat.numel() - active)
    if k <= 0:
        return mask.clone()
    new = flat.clone()
    score = torch.where(flat, weight.detach().reshape(-1).abs(), torch.full_like(flat, math.inf, dtype=weight.dtype))
    new[torch.topk(score, k, largest=False, sorted=False).indices] = False
    if grad is not None:
        gscore = torch.where(flat, torch.full_like(flat, -math.inf, dtype=grad.dtype), grad.detach().reshape(-1).abs())
        new[torch.topk(gscore, k, sorted=False).indices] = True
    else:
        candidates = torch.nonzero(~flat).flatten()
        new[candidates[torch.randperm(len(candidates), generator=generator)[:k].to(candidates.device)]] = True
    return new.reshape(mask.shape)


def aggregate_sparse(states: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Elementwise mean over the states whose masks cover each weight (DisPFL's ``_aggregate_func``):
    sum_j w_j / sum_j m_j, 0 where no mask covers it. ``states`` are (dense weights zero outside the mask, mask)."""
    out = {}
    for name, ref in states[0][0].items():
        total = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device)
        count = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device)
        for dense, mask in states:
            covered = mask[name].to(ref.device, torch.float64)
            total += dense[name].double() * covered
            count += covered
        out[name] = torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total)).to(ref.dtype)
    return out


# ------------------------------------------------------------------------------------------ the method
@dataclass
class DisPFLOptions(GraphOptions):
    #: the quick CPU default of ``python -m privfl.train dispfl`` (flags override it)
    run_defaults: ClassVar[dict[str, Any]] = {"model_group": "homo-cnn4", "subsample": 6000, "rounds": 5}
    #: the paper's own graph: each of 100 clients picks 10 random neighbours per round (--topology random --degree 10)
    paper_topology: ClassVar[str] = "random"

    density: float = opt(0.5, "share of each model's weights kept (the paper's sparsity 0.5; official dense_ratio)", min_exclusive=0, max=1)
    mask_init: str = opt("erk", "per-layer densities: erk (Erdos-Renyi-Kernel, the paper) or uniform", choices=("erk", "uniform"))
    erk_power_scale: float = opt(1.0, "ERK exponent on (sum of dims / product of dims) (official: 1)", min_exclusive=0)
    initial_masks: str = opt("different", "a different random mask per client (official scripts) or the same for all", choices=("different", "same"))
    anneal_factor: float = opt(0.5, "initial prune/regrow rate alpha_0, cosine-annealed to 0 over the rounds (official: 0.5)", min=0, max=1)
    regrow: str = opt(
        "gradient", "regrow by gradient magnitude on one batch (the paper) or at random (official scripts)", choices=("gradient", "random")
    )
    mask_evolution: bool = opt(True, "prune and regrow each mask after local training (--no-mask-evolution: static masks)")
    max_grad_norm: float = opt(10.0, "clip each step's gradient norm (official code: 10; 0: off)", min=0)
    shared_init: bool = opt(True, "every client starts from one model drawn from a seed all nodes know (official: one initial model)")


@METHODS.register("dispfl")
class DisPFL(FLMethod):
    """Sparse personalised models gossiped, aggregated over covering masks, masks evolved (module docstring)."""

    parallel_clients = True
    name = "dispfl"
    sends = {KIND: "peer"}
    Options = DisPFLOptions
    requires_homogeneous = True  # masks and weights aligned across clients
    leakage = {
        KIND: LeakageContext(
            previous=KIND,
            note="the sparse model was trained from the sender's aggregate of round previous_round (its own message and the "
            "received ones, averaged over the covering masks, times its mask), not from the single last received model used here",
        )
    }
    paper = (
        "Dai, Shen, He, Tian, Tao, DisPFL: Towards Communication-Efficient Personalized Federated Learning via Decentralized "
        "Sparse Training, ICML 2022"
    )

    @classmethod
    def build_client_model(cls, req: ModelRequest) -> nn.Module:
        """The client's model; with ``shared_init`` every client's is drawn from one public seed."""
        if req.opts is None or not req.opts.shared_init:
            return super().build_client_model(req)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(req.cfg.seed, "init", "dispfl-shared"))
            return super().build_client_model(req)

    @classmethod
    def build_topology(cls, cfg: Any, opts: DisPFLOptions) -> Graph:
        return build_graph(cfg, opts)

    def __init__(self, env):
        super().__init__(env)
        self.topology: Graph = env.topology if isinstance(env.topology, Graph) else self.build_topology(self.cfg, self.opts)
        n = self.cfg.num_clients  # per-node bookkeeping, indexed by client (a Flower node holds one client)
        params = dict(env.clients[0].model.named_parameters())
        o = self.opts
        shapes = {k: tuple(p.shape) for k, p in params.items()}
        if o.mask_init == "erk":
            self.densities = erk_densities(shapes, o.density, o.erk_power_scale)
        else:
            self.densities = dict.fromkeys(shapes, o.density)
        #: per client: the mask its next training uses, and the mask its current weights were trained under (sent)
        self.masks: dict[int, dict[str, torch.Tensor]] = {}
        self.sent_masks: dict[int, dict[str, torch.Tensor]] = {}
        for c in env.clients:
            key = "same" if o.initial_masks == "same" else c.index
            mask = init_masks(dict(c.model.named_parameters()), self.densities, torch_generator(self.cfg.seed, "dispfl-mask", key))
            self.masks[c.index] = mask
            self.sent_masks[c.index] = {k: v.clone() for k, v in mask.items()}
            apply_masks(c.model, mask)
        if sum(int(m.sum()) for m in self.masks[env.clients[0].index].values()) == 0:
            raise ConfigError(f"dispfl: --density {o.density} keeps no weight of this model")
        self.last_trained = torch.full((n,), -1, dtype=torch.int64)
        self.trained_from = torch.full((n,), -1, dtype=torch.int64)
        self.steps = torch.zeros(n, dtype=torch.int64)

    # ------------------------------------------------------------------ what crosses the wire
    def sparse_state(self, client: Client) -> dict[str, torch.Tensor]:
        """The client's parameters at the mask they were trained under, encoded (values, packed mask, shape)."""
        params = {k: p.detach() for k, p in client.model.named_parameters()}
        return sparse_encode(params, self.sent_masks[client.index])

    def _meta(self, client: Client) -> dict[str, Any]:
        i = client.index
        return {
            "num_samples": len(client.train_idx),
            "lr": self.cfg.lr,
            "local_steps": int(self.steps[i]),
            "state_after_round": int(self.last_trained[i]),
            "previous_round": int(self.trained_from[i]),
            "density": sum(int(m.sum()) for m in self.sent_masks[i].values()) / sum(m.numel() for m in self.sent_masks[i].values()),
        }

    # ------------------------------------------------------------------ rounds, as gossip
    def gossip_send(self, rnd: int, client: Client) -> list[tuple[Message, dict[str, torch.Tensor] | None]]:
        """Its sparse model as it stands after round t-1, to each out-neighbour of round t."""
        own = self.sparse_state(client)
        truth = {"indices": client.train_idx.cpu()} if int(self.last_trained[client.index]) >= 0 else None
        meta = self._meta(client)
        outs = sorted(self.topology.out_neighbors(client.index, rnd))
        return [(Message(rnd, client.name, f"client{r}", KIND, own, dict(meta), sparse_aux(own)), truth) for r in outs]

    def gossip_round(self, rnd: int, client: Client, received: list[Message]) -> dict[str, float]:
        """Aggregate over the covering masks (its own state and what it received), mask, train, evolve the mask."""
        spec = KINDS.get(KIND)
        i = client.index
        states = [(spec.dense(t), sparse_masks(t)) for t in (self.sparse_state(client), *(m.tensors for m in received))]
        aggregate = aggregate_sparse(states)
        with torch.no_grad():
            for k, p in client.model.named_parameters():
                p.copy_((aggregate[k].to(p.device) * self.masks[i][k]).to(p.dtype))
        self.sent_masks[i] = {k: v.clone() for k, v in self.masks[i].items()}
        self.trained_from[i] = rnd if received else -1
        row = {"train_loss": self.train_client(rnd, client)}
        self.last_trained[i] = rnd
        if self.opts.mask_evolution:
            before = self.masks[i]
            self.masks[i] = self.evolved_masks(rnd, client)
            flips = sum(int((before[k] != self.masks[i][k]).sum()) for k in before)
            row["mask_changed"] = flips / sum(m.numel() for m in before.values())
        row["received_scalars"] = float(sum(m.paper_scalars for m in received))
        row["received_messages"] = float(len(received))
        row["density"] = self.density_of(i)
        return row

    def client_metrics(self, rnd: int, rows: list[dict[str, float]]) -> dict[str, float]:
        """Mean loss, the live count, the mean sparse message received, the mean density and mask change."""
        out = {"train_loss": sum(r["train_loss"] for r in rows) / max(len(rows), 1), "live_nodes": float(len(rows))}
        messages = sum(int(r["received_messages"]) for r in rows)
        out["sparse_scalars"] = float(sum(int(r["received_scalars"]) for r in rows) / messages) if messages else 0.0
        out["density"] = float(np.mean([r["density"] for r in rows])) if rows else 0.0
        changed = [r["mask_changed"] for r in rows if "mask_changed" in r]
        if changed:
            out["mask_changed"] = float(np.mean(changed))
        out["drop_rate"] = drop_rate(rnd, self.cfg.rounds, self.opts.anneal_factor) if self.opts.mask_evolution else 0.0
        return out

    def density_of(self, index: int) -> float:
        masks = self.masks[index]
        return sum(int(m.sum()) for m in masks.values()) / sum(m.numel() for m in masks.values())

    def train_client(self, rnd: int, client: Client) -> float:
        """``--local-epochs`` of masked training: gradients outside the mask are zeroed before each step."""
        mask = self.masks[client.index]
        named = dict(client.model.named_parameters())
        clip = self.opts.max_grad_norm

        def before_step(model: nn.Module) -> None:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            for k, p in named.items():
                if p.grad is not None:
                    p.grad.mul_(mask[k])

        stats = self.fit(rnd, client, before_step=before_step)
        apply_masks(client.model, mask)  # a no-op unless the optimiser moved a zero-gradient weight
        self.steps[client.index] = stats.steps
        return stats.loss

    def screen_gradients(self, rnd: int, client: Client) -> dict[str, torch.Tensor]:
        """Dense gradients of the cross-entropy on one seeded batch of the client's data, model in eval mode."""
        model = client.model
        model.eval()
        gen = torch_generator(self.cfg.seed, "dispfl-screen", rnd, client.index)
        x, y = next(iter(self.env.data.batches(client.train_idx, self.cfg.batch_size, gen)))
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        grads = {k: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for k, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return grads

    def evolved_masks(self, rnd: int, client: Client) -> dict[str, torch.Tensor]:
        """Every layer's mask after pruning by magnitude and regrowing (module docstring, step 4)."""
        rate = drop_rate(rnd, self.cfg.rounds, self.opts.anneal_factor)
        grads = self.screen_gradients(rnd, client) if self.opts.regrow == "gradient" else None
        gen = torch_generator(self.cfg.seed, "dispfl-regrow", rnd, client.index)
        out = {}
        for k, p in client.model.named_parameters():
            out[k] = evolve_mask(self.masks[client.index][k], p, rate, None if grads is None else grads[k], gen)
        return out

    # ------------------------------------------------------------------ state
    _NODE_STATE = ("last_trained", "trained_from", "steps")

    def client_state(self, client: Client) -> dict[str, torch.Tensor]:
        """A node's two masks (the next, and the one its weights were trained under) and its bookkeeping."""
        i = client.index
        state = {**super().client_state(client), **{f"dispfl.{k}": getattr(self, k)[i : i + 1].clone() for k in self._NODE_STATE}}
        state.update({f"dispfl.mask.{k}": v for k, v in self.masks[i].items()})
        state.update({f"dispfl.sent.{k}": v for k, v in self.sent_masks[i].items()})
        return state

    def load_client_state(self, client: Client, state: dict[str, torch.Tensor]) -> None:
        super().load_client_state(client, state)
        i, device = client.index, self.env.device
        if f"dispfl.{self._NODE_STATE[0]}" not in state:
            return
        for k in self._NODE_STATE:
            getattr(self, k)[i] = state[f"dispfl.{k}"].cpu()[0]
        self.masks[i] = {k: state[f"dispfl.mask.{k}"].to(device).bool() for k in self.masks[i]}
        self.sent_masks[i] = {k: state[f"dispfl.sent.{k}"].to(device).bool() for k in self.sent_masks[i]}

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        """Checkpoints written before the masks were each node's client state kept them here."""
        if "last_trained" not in state:
            return
        self.last_trained = state["last_trained"].cpu().clone()
        self.trained_from = state["trained_from"].cpu().clone()
        self.steps = state["steps"].cpu().clone()
        device = self.env.device
        for c in self.env.clients:
            i = c.index
            self.masks[i] = {k: state[f"mask.{i}.{k}"].to(device).bool() for k in self.masks[i]}
            self.sent_masks[i] = {k: state[f"sent.{i}.{k}"].to(device).bool() for k in self.sent_masks[i]}


@torch.no_grad()
def apply_masks(model: nn.Module, masks: Mapping[str, torch.Tensor]) -> None:
    """Zero every parameter outside its mask."""
    for k, p in model.named_parameters():
        if k in masks:
            p.mul_(masks[k].to(p.device))


__all__ = [
    "KIND",
    "DisPFL",
    "DisPFLOptions",
    "aggregate_sparse",
    "apply_masks",
    "drop_rate",
    "erk_densities",
    "evolve_mask",
    "init_masks",
    "pack_mask",
    "sparse_aux",
    "sparse_decode",
    "sparse_encode",
    "sparse_masks",
    "unpack_mask",
]
