"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020): FedAvg on the MAML objective.

Each client's objective is F_i(w) = f_i(w - alpha grad f_i(w)): the loss after one gradient step of
size alpha on its own data; the server seeks the w minimising their mean. Per round (Algorithm 1;
equation numbers are not cited: the paper's text was not available here):

1. every client holds the global model w (kind ``model``, down; the setup broadcast for round 0);
2. each selected client runs ``--local-epochs`` of meta steps. One step draws independent batches
   D, D' (and D'' for HF) and computes
   the temporary step        w' = w - alpha grad f(w; D)
   FO  (first order)         w <- w - beta grad f(w'; D')           (the stochastic gradient of F_i without
                                                                     its Hessian factor I - alpha H f(w))
   HF  (Hessian free)        w <- w - beta [grad f(w'; D') - alpha d]
   where d is the Hessian-vector product H f(w; D'') grad f(w'; D'), approximated in the paper's HF by
   the central difference [grad f(w + delta v; D'') - grad f(w - delta v; D'')] / (2 delta) with
   v = grad f(w'; D'), or computed exactly by double back-propagation (``hf_delta`` = 0);
3. it uploads its whole state dict (kind ``model``, up; meta ``num_samples``, ``lr`` = beta, ``tau`` =
   its meta steps, ``inner_lr`` = alpha, ``variant``);
4. the server averages the uploads and broadcasts the result (``model``, down) to every client.

Evaluation. The personalised model of client i is the global model after ``adapt_steps`` (default 1)
gradient steps of size alpha on batches of its own *train* split (the paper evaluates each user's
model after one step on its own data; PFLlib's ``evaluate_one_step``/``train_one_step`` adapt on train
data too). After each round's
broadcast, every client's adapted copy is computed on a copy of its model and kept as its personal
part (``personal_parts = ("",)``), so ``--eval personal`` scores the adapted model and ``--eval global``
the global one the client holds. The adaptation never touches the client's model or the training: its
batches come from generators seeded by (seed, "perfedavg-adapt", round, client, step), and it is
checkpointed with the other personal parts, so a resumed run scores the same.

What is sent, per client per round: the full model up and the full model down, P scalars each way
(P = parameters + buffers of the state dict), as FedAvg. homo-cnn4 on Fashion-MNIST (conv 5x5 1->32,
conv 5x5 32->64, Linear(1024, 512), head Linear(512, 10)) has P = 832 + 51,264 + 524,800 + 5,130 =
582,026; the setup broadcast (round 0, meta ``phase=setup``) comes once on top.

Decisions where the paper is open or the references differ:

- **Step sizes.** alpha (``inner_lr``) is the run's ``--lr`` unless set; beta defaults to 0.01, FedFree's
  Table A2 (its HmFL block runs Per-FedAvg with local lr 0.01 and meta step 0.01). PFLlib ignores its
  ``-bt`` flag and sets beta = the local learning rate, which is the same number in FedFree's setting.
  The temporary step is a plain gradient step (the paper's; PFLlib's ``PerAvgOptimizer``); the meta step
  goes through the run's optimizer with lr beta (plain SGD by default, the paper's; ``--momentum`` and
  ``--weight-decay`` then act on it only).
- **Batches.** As PFLlib: the loader draws batches of k * ``--batch-size`` samples (k = 2 for FO, 3
  for HF) and each is split into k consecutive parts, B samples each for a full batch; a step therefore
  uses ``--batch-size`` samples per role, an epoch visits every sample once and has ceil(n / kB) meta
  steps. The last, partial batch is kept (privfl's default; PFLlib drops it, ``--drop-last`` does too)
  and split into k near-equal parts; a batch of fewer than k samples serves every role. FL-bench draws
  the k batches separately, one after another, from a B-sized loader, which is the same data use.
- **Through the shared trainer.** The double step is the trainer's objective hook: the objective
  computes g = grad f(w; D) (no graph), evaluates f at w' = w - alpha g with ``torch.func.functional_call``
  and returns it; since dw'/dw = I (g is a constant), the trainer's ``backward`` leaves exactly
  grad f(w'; D') on w, and its optimizer (lr beta) takes the meta step. For HF the objective adds
  -alpha (<w, d> - <w, d>.detach()), whose value is 0 and whose gradient is -alpha d. The trainer is the
  run's seeded ``LocalTrainer`` built over the same config with batch size kB (the trainer has no
  batch-size hook), so batching, shuffling and seeding are the shared loop's own.
- **Forward passes and BatchNorm.** The passes on D and D' run in train mode on the client's model
  (running statistics updated, as PFLlib's two forward passes do); the passes on D'' (HF) run on copies
  of the buffers, as FL-bench's ``model_plus``/``model_minus`` copies do.
- **Rounds.** PFLlib calls ``client.train()`` twice per round (``serverperavg.py``); privfl trains once,
  ``--local-epochs`` epochs, as Algorithm 1 (tau local steps per round) and FL-bench do.
- **Aggregation.** Weighted by ``num_samples`` (``weighting=samples``, PFLlib's ``receive_models``);
  Algorithm 1 averages uniformly over the selected clients (``weighting=uniform``, also FL-bench's).
- **HF's delta.** 0.001, FL-bench's default for the central difference; the paper analyses a generic
  delta. ``hf_delta`` = 0 takes the exact Hessian-vector product instead.
- **Evaluation order.** PFLlib evaluates at the start of each round, right after the broadcast;
  privfl evaluates at the end of the round, after the broadcast, which is the same sequence of models.

Leakage: an upload is a full model whose previous state is the ``model`` the sender last received
(privfl's default). Each local step moved it by beta times the gradient at the adapted point w', not
at w, which the gradient-leakage attacks' loss at w leaves out (declared in the note).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from privfl.capture.message import Message
from privfl.config import opt
from privfl.fl.method import METHODS, Client, ClientReply, GlobalModelServer, LeakageContext, module_tensors
from privfl.fl.trainer import LocalStats, LocalTrainer, Objective
from privfl.methods.lgfedavg import average_heads
from privfl.seeding import seed_global, torch_generator


def split_batch(x: torch.Tensor, y: torch.Tensor, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One loader batch as the k batches of a meta step: consecutive near-equal parts (B each for a
    full batch of kB); a batch of fewer than k samples serves every role."""
    if len(x) < k:
        return [(x, y)] * k
    return list(zip(x.tensor_split(k), y.tensor_split(k)))


def _loss_at(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, *, keep_buffers: bool) -> torch.Tensor:
    """CE of ``model`` evaluated with ``params`` instead of its parameters; ``keep_buffers`` runs it on
    copies of the buffers, so a train-mode pass leaves the model's running statistics alone."""
    tensors = dict(params)
    if keep_buffers:
        tensors.update({name: b.clone() for name, b in model.named_buffers()})
    return F.cross_entropy(functional_call(model, tensors, (x,)), y)


def hessian_vector(
    model: nn.Module, params: dict[str, torch.Tensor], v: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor, delta: float
) -> list[torch.Tensor]:
    """H f(w; (x, y)) v at w = ``params``: the central difference of gradients at w +- delta v (the
    paper's HF), or with ``delta`` = 0 the exact product by double back-propagation. Detached."""
    names = list(params)
    if delta == 0:
        leaves = {n: p.detach().requires_grad_(True) for n, p in params.items()}
        grads = torch.autograd.grad(_loss_at(model, leaves, x, y, keep_buffers=True), list(leaves.values()), create_graph=True)
        dot = torch.stack([(g * vi).sum() for g, vi in zip(grads, v)]).sum()
        return [h.detach() for h in torch.autograd.grad(dot, list(leaves.values()))]
    out = []
    for sign in (1.0, -1.0):
        shifted = {n: (params[n].detach() + sign * delta * vi).requires_grad_(True) for n, vi in zip(names, v)}
        out.append(torch.autograd.grad(_loss_at(model, shifted, x, y, keep_buffers=True), list(shifted.values())))
    return [(gp - gm) / (2 * delta) for gp, gm in zip(*out)]


def meta_objective(inner_lr: float, variant: str = "fo", hf_delta: float = 0.001) -> Objective:
    """The trainer objective of one Per-FedAvg step on a batch of k parts (module docstring): its
    gradient on w is grad f(w'; D') (FO) or grad f(w'; D') - alpha H f(w; D'') grad f(w'; D') (HF);
    its value is f(w'; D'). Reports ``inner_loss`` = f(w; D)."""
    if variant not in ("fo", "hf"):
        raise ValueError(f"variant must be fo or hf, got {variant!r}")
    k = 3 if variant == "hf" else 2

    def objective(model: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batches = split_batch(x, y, k)
        params = dict(model.named_parameters())
        (x0, y0), (x1, y1) = batches[0], batches[1]
        inner = F.cross_entropy(model(x0), y0)
        grads = torch.autograd.grad(inner, list(params.values()))
        # w' = w - alpha g with g a constant: dw'/dw = I, so backward through it is the gradient at w'
        adapted = {n: p - inner_lr * g for (n, p), g in zip(params.items(), grads)}
        outer = _loss_at(model, adapted, x1, y1, keep_buffers=False)
        parts = {"inner_loss": inner.detach()}
        if variant == "fo":
            return outer, parts
        v = torch.autograd.grad(outer, list(params.values()), retain_graph=True)
        x2, y2 = batches[2]
        hv = hessian_vector(model, params, v, x2, y2, hf_delta)
        linear = torch.stack([(p * h).sum() for p, h in zip(params.values(), hv)]).sum()
        return outer - inner_lr * (linear - linear.detach()), parts

    return objective


@dataclass
class PerFedAvgOptions:
    #: the quick CPU default of ``python -m privfl.train perfedavg`` (flags override it)
    run_defaults: ClassVar[dict[str, Any]] = {"model_group": "homo-cnn4", "subsample": 6000, "rounds": 5}

    variant: str = opt("fo", "fo: first-order meta step (PFLlib's); hf: Hessian-free, a Hessian-vector term on a third batch", choices=("fo", "hf"))
    inner_lr: float | None = opt(None, "alpha, the temporary and the personalisation step size (default: --lr)", min_exclusive=0)
    beta: float = opt(0.01, "beta, the meta step size (FedFree Table A2: 0.01; PFLlib uses --lr)", min_exclusive=0)
    hf_delta: float = opt(0.001, "HF: delta of the central difference (FL-bench: 0.001); 0: the exact Hessian-vector product", min=0)
    adapt_steps: int = opt(1, "gradient steps on the client's own train data that make its personalised model (--eval personal)", min=0)
    weighting: str = opt("samples", "average: samples (PFLlib, weighted by train-set size) or uniform (Algorithm 1)", choices=("samples", "uniform"))


@METHODS.register("perfedavg")
class PerFedAvg(GlobalModelServer):
    """FedAvg whose clients take MAML meta steps; personalised by one step on own data (module docstring)."""

    parallel_clients = True
    name = "perfedavg"
    sends = {"model": "up/down"}
    Options = PerFedAvgOptions
    requires_homogeneous = True
    leakage = {
        "model": LeakageContext(
            previous="model",
            note="each local step moved w by beta * grad f(w'; D') at the adapted point w' = w - alpha grad f(w; D), not at w",
        )
    }
    paper = (
        "Fallah, Mokhtari, Ozdaglar, Personalized Federated Learning with Theoretical Guarantees: "
        "A Model-Agnostic Meta-Learning Approach (Per-FedAvg), NeurIPS 2020"
    )

    def __init__(self, env):
        super().__init__(env)
        self.parts = 3 if self.opts.variant == "hf" else 2
        # the shared seeded loop over batches of k * B (k parts of B per meta step)
        self.meta_trainer = LocalTrainer(dataclasses.replace(self.cfg, batch_size=self.parts * self.cfg.batch_size), env.data)

    @property
    def inner_lr(self) -> float:
        return float(self.opts.inner_lr if self.opts.inner_lr is not None else self.cfg.lr)

    def local_update(self, rnd: int, client: Client) -> LocalStats:
        """``--local-epochs`` of meta steps on the client's model, through the shared trainer."""
        objective = meta_objective(self.inner_lr, self.opts.variant, self.opts.hf_delta)
        return self.meta_trainer.fit(
            rnd, client, objective, optimizer=lambda model: self.trainer.make_optimizer(model.parameters(), lr=self.opts.beta)
        )

    def adapted_state(self, rnd: int, client: Client) -> dict[str, torch.Tensor]:
        """The client's personalised model: its current (global) model after ``adapt_steps`` gradient
        steps of size alpha, each on a seeded random batch of its train split, taken on a copy."""
        model = copy.deepcopy(client.model)
        model.train()
        seed_global(self.cfg.seed, "perfedavg-adapt", rnd, client.index)  # dropout, if any
        params = list(model.parameters())
        for step in range(self.opts.adapt_steps):
            gen = torch_generator(self.cfg.seed, "perfedavg-adapt", rnd, client.index, step)
            x, y = next(iter(self.env.data.batches(client.train_idx, self.cfg.batch_size, gen)))
            grads = torch.autograd.grad(F.cross_entropy(model(x), y), params)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p.sub_(self.inner_lr * g)
        return {k: v.clone() for k, v in module_tensors(model).items()}

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        """Client side: ``--local-epochs`` of meta steps, the model up."""
        stats = self.local_update(rnd, client)
        meta = {
            "arch": client.arch,
            "num_samples": len(client.train_idx),
            "lr": self.opts.beta,
            "tau": stats.steps,
            "inner_lr": self.inner_lr,
            "variant": self.opts.variant,
        }
        msg = Message(rnd, client.name, "server", "model", module_tensors(client.model), meta)
        return ClientReply([(msg, {"indices": client.train_idx.cpu()})], stats.as_dict())

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """Server side: the average of what it received (after defenses), to every client."""
        self.global_model.load_state_dict(average_heads(uploads, self.opts.weighting))
        self.broadcast(rnd)
        return {}

    def receive(self, client: Client, msg: Message) -> None:
        """Client side: load the global model; after a round's broadcast, also make the personalised model
        from it (evaluation only)."""
        super().receive(client, msg)
        if msg.meta.get("phase") != "setup":
            self.personal[client.name] = {"": self.adapted_state(msg.round, client)}


__all__ = ["PerFedAvg", "PerFedAvgOptions", "hessian_vector", "meta_objective", "split_batch"]
