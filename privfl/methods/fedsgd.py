"""FedSGD (McMahan et al., AISTATS 2017): one gradient per client per round, the server steps.

This is the maximal-leakage setting of gradient inversion (DLG, Zhu et al., NeurIPS 2019): each
upload is the gradient of the mean cross-entropy of ONE batch of ``batch_size`` training samples at
the global model, and the attacker (the server) knows that model because it broadcast it (the
``model`` messages are in the capture; the setup broadcast is round 0's starting point).

Built on :class:`~privfl.fl.method.GlobalModelServer`, the part FedSGD, FedNova and FedAvg share: a server-held global
model, broadcast as ``model`` before round 0 (meta ``phase=setup``) and after every round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from privfl.capture.message import Message
from privfl.config import opt
from privfl.fl.method import METHODS, Client, ClientReply, GlobalModelServer
from privfl.seeding import seed_global, torch_generator


@dataclass
class FedSGDOptions:
    server_lr: float | None = opt(None, "server SGD step size on the averaged gradient (default: --lr)", min_exclusive=0)


@METHODS.register("fedsgd")
class FedSGD(GlobalModelServer):
    """Each selected client uploads ``grad``: d mean-CE / d theta on one seeded batch at the global
    model (keys = parameter names, e.g. ``features.0.weight``). The server averages the gradients
    weighted by batch size, takes one SGD step and broadcasts the ``model`` to all clients.

    Attacker knowledge: nothing beyond the capture (``exposes = ()``): the global model the gradient
    was taken at is the server's own broadcast. The gradient is computed in train mode (dropout as in
    training, seeded); BatchNorm running statistics are NOT updated by FedSGD: the client's buffers
    are restored after the forward pass, so only the server's step changes the model.
    """

    parallel_clients = True
    name = "fedsgd"
    sends = {"grad": "up", "model": "down"}
    exposes = ()
    Options = FedSGDOptions
    paper = "McMahan et al., FedSGD, AISTATS 2017 (DLG setting: Zhu et al., NeurIPS 2019)"

    def batch_indices(self, rnd: int, client: Client) -> torch.Tensor:
        """The ``batch_size`` samples (global indices, without replacement) behind this round's gradient."""
        gen = torch_generator(self.cfg.seed, "fedsgd-batch", rnd, client.index)
        n = len(client.train_idx)
        pick = torch.randperm(n, generator=gen)[: min(self.cfg.batch_size, n)]
        return client.train_idx[pick.to(client.train_idx.device)]

    def client_gradient(self, rnd: int, client: Client) -> tuple[dict[str, torch.Tensor], float, torch.Tensor, torch.Tensor]:
        """(gradient per parameter, loss, batch indices, batch labels) at the client's current model."""
        model = client.model
        model.train()
        seed_global(self.cfg.seed, "local", rnd, client.index)  # dropout, if any
        buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
        idx = self.batch_indices(rnd, client)
        x, y = self.env.data.batch(idx)
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads = {k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p.detach())) for k, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        with torch.no_grad():  # FedSGD does not move BatchNorm statistics
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
        return grads, float(loss.item()), idx, y

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        grads, loss, idx, y = self.client_gradient(rnd, client)
        meta = {"arch": client.arch, "batch_size": len(idx), "num_samples": len(client.train_idx)}
        msg = Message(rnd, client.name, "server", "grad", grads, meta)
        return ClientReply([(msg, {"indices": idx.cpu(), "labels": y.cpu()})], {"train_loss": loss})

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """One SGD step of the global model on the batch-size-weighted mean gradient, then the broadcast."""
        acc: dict[str, torch.Tensor] = {}
        total = 0.0
        for received in uploads:
            w = float(received.meta["batch_size"])
            total += w
            for k, g in received.tensors.items():
                g = g.to(self.env.device, torch.float64) * w
                acc[k] = acc[k] + g if k in acc else g
        lr = self.cfg.lr if self.opts.server_lr is None else self.opts.server_lr
        with torch.no_grad():
            for k, p in self.global_model.named_parameters():
                if k in acc:
                    p.copy_((p.double() - lr * acc[k] / total).to(p.dtype))
        self.broadcast(rnd)
        return {}
