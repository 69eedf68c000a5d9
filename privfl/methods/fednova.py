"""FedNova (Wang et al., NeurIPS 2020, "Tackling the objective inconsistency problem in
heterogeneous federated optimization"): normalised averaging of local updates.

Client k starts from the broadcast global model x, runs ``local_epochs`` of local SGD (tau_k steps,
the last partial batch counted) and uploads ``update``: the normalised update
d_k = (x - x_k) / a_k, where a_k = tau_k for plain SGD and, for SGD with momentum rho,
a_k = [tau_k - rho (1 - rho^tau_k) / (1 - rho)] / (1 - rho) (the paper's Sec. 4 / Appendix). d_k
includes the learning rate, so an attacker who knows x (the capture holds every ``model`` broadcast)
and the meta ``a`` rebuilds the client's local model exactly: x_k = x - a_k d_k (up to float32
rounding).

The server runs vanilla FedNova: with p_k = n_k / sum_j n_j over the selected clients and
tau_eff = sum_k p_k a_k, x_new = x - tau_eff * sum_k p_k d_k, then broadcasts ``model`` to every
client. With one client this is exactly that client's local training.
"""

from __future__ import annotations

import math

import torch

from privfl.capture.message import Message
from privfl.errors import ConfigError
from privfl.fl.method import METHODS, Client, ClientReply, GlobalModelServer, module_tensors


def local_steps(num_samples: int, batch_size: int, local_epochs: int) -> int:
    """tau_k: optimizer steps of :meth:`FLMethod.local_train` (the last partial batch is kept)."""
    return local_epochs * math.ceil(num_samples / batch_size)


def normalizer(tau: int, momentum: float = 0.0) -> float:
    """a_k = ||a||_1 of the paper: tau for plain SGD, the momentum-corrected sum otherwise."""
    rho = float(momentum)
    if rho == 0.0:
        return float(tau)
    return (tau - rho * (1.0 - rho**tau) / (1.0 - rho)) / (1.0 - rho)


@METHODS.register("fednova")
class FedNova(GlobalModelServer):
    """Clients upload normalised updates d_k (every floating tensor of the state dict); the server
    takes the tau_eff-scaled weighted step on parameters and broadcasts the full ``model``.

    Buffers: floating buffers (BatchNorm statistics) are sent normalised like parameters, so the
    same x - a_k d_k rebuilds them, but the server sets them to the sample-weighted mean of the
    rebuilt client values (FedAvg), because extrapolating running variances by tau_eff / a_k could
    make them negative. Non-floating buffers (BatchNorm's step counters) cannot be divided: the
    client's value is sent as is under the same key and the server averages and rounds it.
    Only SGD has the paper's a_k; weight decay is part of the local gradient as in the paper's code.
    """

    parallel_clients = True
    name = "fednova"
    sends = {"update": "up", "model": "down"}
    exposes = ()
    paper = "Wang et al., FedNova, NeurIPS 2020"
    stateless_clients = True  # the broadcast replaces each whole client model (its aggregate reads the uploads twice: no streaming)

    def __init__(self, env):
        super().__init__(env)
        if self.cfg.optimizer != "sgd":
            raise ConfigError(f"fednova needs --optimizer sgd (its normaliser a_k is defined for SGD), got {self.cfg.optimizer}")
        if not 0.0 <= self.cfg.momentum < 1.0:
            raise ConfigError(f"fednova needs 0 <= --momentum < 1, got {self.cfg.momentum}")

    def client_update(self, rnd: int, client: Client) -> tuple[Message, float]:
        """Local training from the received global model, then the normalised update message."""
        start = {k: v.clone() for k, v in module_tensors(client.model).items()}  # the broadcast it holds
        loss = self.local_train(rnd, client)
        n = len(client.train_idx)
        tau = local_steps(n, self.cfg.batch_size, self.cfg.local_epochs)
        a = normalizer(tau, self.cfg.momentum)
        tensors = {}
        for k, v in module_tensors(client.model).items():
            tensors[k] = (start[k] - v) / a if v.is_floating_point() else v.clone()
        meta = {"arch": client.arch, "tau": tau, "a": a, "lr": self.cfg.lr, "momentum": self.cfg.momentum, "num_samples": n}
        return Message(rnd, client.name, "server", "update", tensors, meta), loss

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        msg, loss = self.client_update(rnd, client)
        return ClientReply([(msg, {"indices": client.train_idx.cpu()})], {"train_loss": loss})

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        self.aggregate(uploads)
        self.broadcast(rnd)
        return {}

    @torch.no_grad()
    def aggregate(self, received: list[Message]) -> None:
        """Vanilla FedNova on parameters; FedAvg of rebuilt values on buffers (see class docstring)."""
        total = float(sum(m.meta["num_samples"] for m in received))
        p = [m.meta["num_samples"] / total for m in received]
        a = [float(m.meta["a"]) for m in received]
        tau_eff = sum(pk * ak for pk, ak in zip(p, a))
        params = {k for k, _ in self.global_model.named_parameters()}
        new = {}
        for k, x in self.global_model.state_dict().items():
            x64 = x.to(torch.float64)
            ds = [m.tensors[k].to(x.device, torch.float64) for m in received]
            if k in params:
                value = x64 - tau_eff * sum(pk * d for pk, d in zip(p, ds))
            elif x.is_floating_point():
                value = sum(pk * (x64 - ak * d) for pk, ak, d in zip(p, a, ds))
            else:
                value = sum(pk * d for pk, d in zip(p, ds)).round()
            new[k] = value.to(x.dtype)
        self.global_model.load_state_dict(new)
