"""FedALA (Jianqing Zhang, Yang Hua, Hao Wang, Tao Song, Zhengui Xue, Ruhui Ma, Haibing Guan, "FedALA:
Adaptive Local Aggregation for Personalized Federated Learning", AAAI 2023, arXiv 2212.01197): FedAvg
whose clients merge the global model into their own by learned element-wise weights.

The server is FedAvg's: clients upload their full models (kind ``model``, up; meta ``num_samples``), the
server averages them weighted by sample count and broadcasts the result (kind ``model``, down). What
changes is how a client takes a received global model Theta into its local model Theta_i: Adaptive
Local Aggregation (ALA, the paper's Sec. "Adaptive Local Aggregation" and Algorithm 1; numbered here, not
by the paper's equation numbers, which this file does not rely on):

    (A1)  Theta_i <- Theta_i + (Theta - Theta_i) (.) [1^{|Theta_i| - p}; W_i^p],

that is, the lower layers take the global values (their weight is fixed to 1) and the top p layers take
``Theta_i + (Theta - Theta_i) * W`` with element-wise weights W_i in [0, 1]. W_i starts at ones and is
learned on a random s% of the client's train set by gradient descent on the local loss of the merged
model, (A2) ``W <- clamp(W - eta * grad_theta L * (Theta - Theta_i), 0, 1)`` (the factor is the chain
rule through the merge), recomputing the merged top layers after each batch. The first time a client
runs ALA, W is trained until the standard deviation of the last ``num_pre_loss`` recorded losses falls
below ``threshold``; afterwards one epoch per round, starting from the client's previous W (the paper's
"reuse W"). Local training then starts from the merged model.

What is sent, per client per round: the full model up and the global model down, as FedAvg: |Theta|
scalars each way. homo-cnn4 on Fashion-MNIST: 582,026; the same CNN on CIFAR-10 / CIFAR-100 (3x32x32):
878,538 / 924,708, which are FedRE's Table 11 FedALA rows 8785.38e3 / 9247.08e3 for 10 clients. ALA
itself sends nothing: it runs on the client's own data after the broadcast.

Decisions where the paper is open or PFLlib (``utils/ALA.py``, ``clientala.py``, ``serverala.py``, by
the paper's first author) decides:

- **When ALA runs, and what is evaluated.** PFLlib's server calls every client's ALA in
  ``send_models`` (all clients, selected or not) and then evaluates, so the accuracy it reports (and
  FedRE's table) is each client's merged model before local training. Here a client runs ALA when the
  global model reaches it, for every client at the end of each round, so ``--eval global`` scores the
  merged models exactly as PFLlib does (its round t+1 evaluation is this round t). The paper's
  Algorithm 1 runs ALA for the selected clients at the start of their training; with full participation
  (the default, and FedRE's setting) the two orders produce the same models. At setup the clients load
  the initial global model whole: PFLlib's clients start from one shared model and ALA skips its first
  call because local and global are then equal.
- **personal_parts = the whole model.** The broadcast does change the client model (lower layers
  replaced, top layers merged), so ``--eval personal`` scores each client's model as it was after its own
  local training, before the next merge: the paper's personalised model after training.
- **p.** ``layer_idx`` counts parameter tensors from the end of ``model.parameters()`` as PFLlib's ``-p``
  does (default 2: the head's weight and bias, the paper's p = 1 layer; 0 = every tensor).
- **Sample.** PFLlib takes a contiguous window of s% of the client's stored train set at a random offset;
  here a seeded uniform random s% subset (the paper's "randomly sample s%"), at least one sample, redrawn
  each round, iterated in one order for all epochs of that ALA call (PFLlib's loader does not shuffle).
- **Convergence test.** As PFLlib: one loss per epoch (that of its last batch), and the first ALA
  stops once more than ``num_pre_loss`` are recorded and the population std of the last ``num_pre_loss``
  is below ``threshold``. PFLlib has no cap; ``max_ala_epochs`` (default 100) bounds it so a run ends.
- **Buffers.** ALA mixes parameters only. Buffers (BatchNorm statistics) take the received global values,
  as privfl's FedAvg loads them (PFLlib never aggregates buffers), so that with W fixed at 1 (``eta=0``)
  FedALA is exactly privfl's FedAvg. The merge uses ``torch.lerp(local, global, W)``, which equals the
  paper's formula and returns the global value exactly where W = 1.
- **Model mode.** The merged model is in train mode while W learns (PFLlib deep-copies the model left
  in train mode by local training); W is learned through the shared :class:`LocalTrainer` loop (a
  projected-SGD optimizer on W alone, every model parameter frozen), seeded per (round, client).
- **State.** W (one tensor per mixed parameter) is the client's own: ALA runs where the client receives
  the global model (:meth:`receive`), and W is kept in its :meth:`client_state` under ``ala/NAME``
  (checkpoints, a Flower node's state); a client with a stored W has finished its first, converging ALA.
  ``ala_epochs`` is reported by each client with :meth:`note` and averaged over the clients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from privfl.capture.message import Message
from privfl.config import opt
from privfl.fl.method import METHODS, Client
from privfl.methods.fedrep import frozen
from privfl.methods.simple import FedAvg
from privfl.seeding import numpy_rng

#: client_state keys of a client's ALA weights: ``ala/PARAMETER`` (older checkpoints: server state ``ala/CLIENT/PARAMETER``)
STATE_PREFIX = "ala/"


@dataclass
class FedALAOptions:
    #: the quick CPU default of ``python -m privfl.train fedala`` (flags override it)
    run_defaults: ClassVar[dict[str, Any]] = {"model_group": "homo-cnn4", "subsample": 6000, "rounds": 5}

    eta: float = opt(1.0, "learning rate of the ALA weights W (paper and PFLlib: 1.0; 0 keeps W at 1: FedAvg)", min=0)
    rand_percent: int = opt(80, "share s of the local train set, in percent, that W is learned on (paper and PFLlib: 80)", min=1, max=100)
    layer_idx: int = opt(
        2, "parameter tensors, counted from the model's last, that ALA mixes (PFLlib -p: 2 = the head's weight and bias; 0 = all)", min=0
    )
    threshold: float = opt(0.1, "the first ALA stops once the std of the last num_pre_loss epoch losses is below this (PFLlib: 0.1)", min=0)
    num_pre_loss: int = opt(10, "how many recorded epoch losses the convergence test looks at (PFLlib: 10)", min=1)
    max_ala_epochs: int = opt(100, "cap on the epochs of a client's first ALA (PFLlib has none)", min=1)


class ClampedSGD(torch.optim.SGD):
    """Plain gradient descent projected back onto [0, 1] after each step: the update of the ALA weights."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = super().step(closure)
        for group in self.param_groups:
            for w in group["params"]:
                w.clamp_(0.0, 1.0)
        return loss


class MergedModel(nn.Module):
    """The client model with its top parameters replaced by ``lerp(local, global, W)``; W is learnable.

    Only W are parameters of this module's own; the client model is called with the merged tensors in
    place of its top parameters (:func:`torch.func.functional_call`), so the trainer's loop can learn W."""

    def __init__(self, model: nn.Module, local: dict[str, torch.Tensor], glob: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]):
        super().__init__()
        self.model = model
        self.names = list(weights)
        self.local, self.glob = local, glob
        self.weights = nn.ParameterList([nn.Parameter(weights[n].clone()) for n in self.names])

    def merged(self) -> dict[str, torch.Tensor]:
        return {n: torch.lerp(self.local[n], self.glob[n], w) for n, w in zip(self.names, self.weights)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, self.merged(), (x,))

    def weight_state(self) -> dict[str, torch.Tensor]:
        return {n: w.detach().clone() for n, w in zip(self.names, self.weights)}


@METHODS.register("fedala")
class FedALA(FedAvg):
    """FedAvg whose clients merge each received global model by Adaptive Local Aggregation (module docstring)."""

    parallel_clients = True
    name = "fedala"
    sends = {"model": "up/down"}
    Options = FedALAOptions
    requires_homogeneous = True
    paper = (
        "Zhang, Hua, Wang, Song, Xue, Ma, Guan, FedALA: Adaptive Local Aggregation for Personalized Federated Learning, AAAI 2023 (arXiv 2212.01197)"
    )
    # personal_parts = ("",) (GlobalModelServer's): the broadcast changes the whole model, see the docstring
    stateless_clients = False  # a client merges each broadcast into its own model (ALA): it keeps state between rounds

    def __init__(self, env):
        super().__init__(env)
        #: client side: client name -> {parameter name: W}; present once the client's first ALA has converged
        self.weights: dict[str, dict[str, torch.Tensor]] = {}

    def mixed_names(self, model: nn.Module) -> list[str]:
        """The top ``layer_idx`` parameter tensors ALA mixes (all of them for 0)."""
        names = [n for n, _ in model.named_parameters()]
        k = self.opts.layer_idx
        return names if k == 0 else names[-k:]

    def receive(self, client: Client, msg: Message) -> None:
        """Client side: the setup model is loaded; every later global model is merged by ALA, whose epochs
        the client reports (``ala_epochs``, the mean over clients, in the round of the broadcast)."""
        if msg.meta.get("phase") == "setup":
            super().receive(client, msg)
            return
        self.note(client, {"ala_epochs": float(self.adaptive_local_aggregation(msg.round, client, msg.tensors))})

    def ala_sample(self, rnd: int, client: Client) -> torch.Tensor:
        """A seeded random ``rand_percent``% of the client's train indices (at least one), in stored order."""
        n = len(client.train_idx)
        k = max(1, int(self.opts.rand_percent / 100 * n))
        pick = np.sort(numpy_rng(self.cfg.seed, "ala-sample", rnd, client.index).choice(n, k, replace=False))
        return client.train_idx[torch.as_tensor(pick, device=client.train_idx.device)]

    def adaptive_local_aggregation(self, rnd: int, client: Client, received: dict[str, torch.Tensor]) -> int:
        """Merge ``received`` into ``client.model`` (lower layers and buffers: global; top: lerp by W).
        Returns the epochs W was trained (0 when the local model already equals the global one)."""
        model = client.model
        own = model.state_dict()
        glob = {k: v.to(own[k]) for k, v in received.items()}
        params = dict(model.named_parameters())
        if all(torch.equal(p, glob[n]) for n, p in params.items()):  # nothing to merge (PFLlib skips this call)
            model.load_state_dict(glob)
            return 0
        top = self.mixed_names(model)
        local = {n: params[n].detach().clone() for n in top}
        model.load_state_dict({**glob, **local})  # lower layers take the global values before W is learned
        start = client.name not in self.weights
        weights = self.weights.get(client.name) or {n: torch.ones_like(local[n]) for n in top}
        merged = MergedModel(model, local, {n: glob[n] for n in top}, weights)
        sample = Client(client.index, client.arch, merged, self.ala_sample(rnd, client), client.test_idx)
        last: list[float] = []

        def objective(m: MergedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(m(x), y)
            last.append(float(loss.detach()))
            return loss

        def optimizer(m: MergedModel) -> torch.optim.Optimizer:
            return ClampedSGD(m.weights.parameters(), lr=self.opts.eta)

        losses: list[float] = []
        with frozen(params.values()):  # W is all that learns; no gradient for the model's own parameters
            while True:
                stats = self.trainer.fit(rnd, sample, objective, optimizer=optimizer, epochs=1)
                if stats.steps == 0:  # --drop-last with a sample smaller than a batch: nothing to learn W on
                    break
                losses.append(last[-1])
                if not start or len(losses) >= self.opts.max_ala_epochs:
                    break
                if len(losses) > self.opts.num_pre_loss and float(np.std(losses[-self.opts.num_pre_loss :])) < self.opts.threshold:
                    break
        self.weights[client.name] = merged.weight_state()
        with torch.no_grad():
            result = {n: t.detach().clone() for n, t in merged.merged().items()}
        model.load_state_dict({**glob, **result})  # buffers back to the global values (W learning ran in train mode)
        return len(losses)

    def client_state(self, client: Client) -> dict[str, torch.Tensor]:
        """Its ALA weights W beside its model (once learned)."""
        state = super().client_state(client)
        state.update({f"{STATE_PREFIX}{n}": w for n, w in self.weights.get(client.name, {}).items()})
        return state

    def load_client_state(self, client: Client, state: dict[str, torch.Tensor]) -> None:
        super().load_client_state(client, state)
        weights = {k.removeprefix(STATE_PREFIX): v.to(self.env.device) for k, v in state.items() if k.startswith(STATE_PREFIX)}
        if weights:
            self.weights[client.name] = weights

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        super().load_server_state({k: v for k, v in state.items() if not k.startswith(STATE_PREFIX)})
        for key, value in state.items():  # checkpoints written before W moved to each client's state kept it here
            if key.startswith(STATE_PREFIX):
                client, name = key.removeprefix(STATE_PREFIX).split("/", 1)
                self.weights.setdefault(client, {})[name] = value.to(self.env.device)


__all__ = ["ClampedSGD", "FedALA", "FedALAOptions", "MergedModel"]
