"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in Heterogeneous
Networks", MLSys 2020): FedAvg with a proximal term in the local objective.

Per round t (the paper's Algorithm 2):

1. the server holds w^t and every client holds the copy it received (kind ``model``, down; the
   setup broadcast for t = 0);
2. each selected client k approximately minimises the proximal local objective (Eq. 2)
   h_k(w; w^t) = F_k(w) + mu/2 ||w - w^t||^2, here with ``--local-epochs`` of the shared seeded SGD
   loop (the paper's gamma-inexact solution), F_k = cross-entropy on its train split;
3. it uploads its whole state dict w_k^{t+1} (kind ``model``, up; meta ``num_samples``, ``lr``,
   ``tau`` = its local steps, ``mu``);
4. the server averages the received states weighted by ``num_samples`` and broadcasts the result
   (``model``, down) to every client, which overwrites its model with it.

What is sent, per client per round: the full model up and the full model down, P scalars each way
(P = parameters + floating and integer buffers of the state dict). HtFLlib's 4-layer CNN on CIFAR-10
(FedAvgCNN: 3x32x32 input, conv 5x5 32 and 64, Linear(1600, 512), Linear(512, 10)) has
P = 2,432 + 51,264 + 819,712 + 5,130 = 878,538, so 10 clients send 8,785.38e3 scalars each way per
round (FedRE [001] Table 11), as FedAvg does. The setup broadcast (round 0, meta ``phase=setup``)
comes once on top.

Decisions where the paper is open or the references differ:

- **mu.** 0.01 by default: FedFree's Table A2 (the HmFL block of its Table 1 runs FedProx with
  mu = 0.01). The paper tunes mu in {0.001, 0.01, 0.1, 1}; PFLlib's ``-mu`` defaults to 0.
- **Where the proximal term acts.** Through the shared trainer's objective hook: the loss is
  CE + mu/2 sum_p ||p - p^t||^2 over the model's *parameters* (buffers such as BatchNorm statistics
  have no gradient). For plain SGD this is exactly PFLlib's and the authors' PerturbedGradientDescent
  step p <- p - lr (grad + mu (p - p^t)); with momentum or weight decay the term goes through the
  run's optimizer like the rest of the loss, which is the objective the paper writes down.
  ``w^t`` is the client's model as it received it (cloned before training), never read from the server.
- **Aggregation.** Weighted by ``num_samples`` over the clients that uploaded, as the authors' code
  (``fedbase.aggregate``), PFLlib's ``Server.aggregate_parameters`` and privfl's FedAvg do. The
  paper's Algorithm 2 samples devices with p_k and averages uniformly; with the engine's uniform
  client selection, sample weighting is the unbiased counterpart. Integer buffers are averaged and
  rounded, as FedAvg does, so that mu = 0 is exactly FedAvg (a test checks tensor equality).
- **Variable local work** (the paper's systems heterogeneity, optional, off by default): with
  ``stragglers`` = s > 0, each round round(m (1 - s)) of the m selected clients, drawn by the server
  (which alone sees the selection; :meth:`plan_round`) from (seed, "fedprox-stragglers", round), run
  ``--local-epochs`` E; the others run a number of epochs drawn uniformly from [1, E) as the authors'
  code does (``np.random.randint(1, E)``; E = 1 leaves them at 1 epoch, so it needs E >= 2 to matter). Their partial solutions are aggregated like the
  others: that is FedProx's point (the paper's FedAvg baseline drops them; privfl's ``fedavg`` has no
  stragglers). The uploaded meta ``tau`` gives each client's actual local steps.
- **Reported losses.** ``train_loss`` is the mean of the whole objective over local steps, with its
  parts ``ce`` and ``prox`` (the mean ||w - w^t||^2 at each step, before mu/2).

Leakage: the upload is a full model whose previous state is the ``model`` the sender last received
(privfl's default for a full-parameter kind). The gradient-leakage attacks match (w^t - w_k)/(lr tau)
against the cross-entropy gradient only; the proximal part mu (w - w^t) is left out (declared in the
``LeakageContext`` note), which is small for mu = 0.01.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from privfl.capture.message import Message
from privfl.config import opt
from privfl.fl.method import METHODS, Client, ClientReply, GlobalModelServer, LeakageContext, average_states, module_tensors
from privfl.fl.trainer import Objective, cross_entropy
from privfl.seeding import numpy_rng


def proximal_objective(anchor: dict[str, torch.Tensor], mu: float) -> Objective:
    """CE + mu/2 ||w - anchor||^2 over the model's parameters (Eq. 2), reporting both parts.

    ``anchor`` maps parameter names to the state the client received this round. The term is kept in
    the graph even for mu = 0 (it then adds exact zeros), so that mu = 0 runs the same code as mu > 0."""

    def objective(model: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ce = cross_entropy(model, x, y)
        prox = torch.stack([(p - anchor[name]).pow(2).sum() for name, p in model.named_parameters()]).sum()
        return ce + (mu / 2) * prox, {"ce": ce.detach(), "prox": prox.detach()}

    return objective


@dataclass
class FedProxOptions:
    #: the quick CPU default of ``python -m privfl.train fedprox`` (flags override it): FedProx needs
    #: identical client models, and a seeded 6k-image subset for 5 rounds trains in about a minute
    run_defaults: ClassVar[dict[str, Any]] = {"model_group": "homo-cnn4", "subsample": 6000, "rounds": 5}

    mu: float = opt(0.01, "proximal weight mu of mu/2 ||w - w_global||^2 (FedFree Table A2: 0.01; 0: FedAvg)", min=0)
    stragglers: float = opt(
        0.0,
        "share of the selected clients that run a random number of epochs in [1, E) each round (the paper's systems heterogeneity)",
        min=0,
        max=1,
    )


@METHODS.register("fedprox")
class FedProx(GlobalModelServer):
    """FedAvg whose clients minimise CE + mu/2 ||w - w_received||^2 (module docstring)."""

    parallel_clients = True
    name = "fedprox"
    sends = {"model": "up/down"}
    Options = FedProxOptions
    requires_homogeneous = True
    leakage = {
        "model": LeakageContext(
            previous="model",
            note="the client minimised CE + mu/2 ||w - w_received||^2; the attacker's loss is CE only (the proximal part of the update is left in)",
        )
    }
    paper = "Li et al., Federated Optimization in Heterogeneous Networks (FedProx), MLSys 2020"
    stateless_clients = True  # as FedAvg: the broadcast replaces each whole client model
    streams_uploads = True  # average_states reads the uploads once

    def local_epochs(self, rnd: int, selected: list[Client]) -> dict[str, int]:
        """Epochs of each selected client this round: E, or for the stragglers a draw from [1, E)."""
        epochs = {c.name: self.cfg.local_epochs for c in selected}
        share = float(self.opts.stragglers)
        if share <= 0 or not selected:
            return epochs
        rng = numpy_rng(self.cfg.seed, "fedprox-stragglers", rnd)
        active = round(len(selected) * (1 - share))
        order = rng.permutation(len(selected))
        for i in sorted(int(j) for j in order[active:]):
            epochs[selected[i].name] = int(rng.integers(1, max(self.cfg.local_epochs, 2)))
        return epochs

    def plan_round(self, rnd: int, selected: list[Client]) -> dict[str, dict[str, Any]]:
        """Server side: who straggles depends on the whole selection, so the server draws each client's epochs."""
        return {name: {"epochs": epochs} for name, epochs in self.local_epochs(rnd, selected).items()}

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        """Client side: proximal local training from the model as this client received it, then its upload."""
        # w^t: the model as this client received it (its own copy of the last broadcast)
        anchor = {name: p.detach().clone() for name, p in client.model.named_parameters()}
        epochs = int(self.plan(client).get("epochs", self.cfg.local_epochs))
        stats = self.fit(rnd, client, proximal_objective(anchor, self.opts.mu), epochs=epochs)
        meta = {"arch": client.arch, "num_samples": len(client.train_idx), "lr": self.cfg.lr, "tau": stats.steps, "mu": self.opts.mu}
        msg = Message(rnd, client.name, "server", "model", module_tensors(client.model), meta)
        return ClientReply([(msg, {"indices": client.train_idx.cpu()})], stats.as_dict())

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """Server side: the sample-weighted mean of what it received (after defenses), broadcast to every client."""
        self.global_model.load_state_dict(average_states(uploads, self.global_model.state_dict()))
        self.broadcast(rnd)
        return {}


__all__ = ["FedProx", "FedProxOptions", "average_states", "proximal_objective"]
