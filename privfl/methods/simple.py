"""Local (no communication) and FedAvg (McMahan et al., AISTATS 2017; homogeneous models only)."""

from __future__ import annotations

import torch

from privfl.capture.message import Message
from privfl.methods.base import METHODS, Client, FLMethod, GlobalModelServer, module_tensors


@METHODS.register("local")
class Local(FLMethod):
    """Each client trains alone: the baseline every FL method should beat."""

    name = "local"
    sends = {}
    paper = "local training baseline"

    def run_round(self, rnd: int, selected: list[Client]) -> dict[str, float]:
        losses = [self.local_train(rnd, client) for client in selected]
        return {"train_loss": sum(losses) / max(len(losses), 1)}


@METHODS.register("fedavg")
class FedAvg(GlobalModelServer):
    """Clients upload full models; the server averages them weighted by train-set size and
    broadcasts the result to every client. Integer buffers (BatchNorm's counters) are averaged and
    rounded."""

    name = "fedavg"
    sends = {"model": "up/down"}
    requires_homogeneous = True
    paper = "McMahan et al., FedAvg, AISTATS 2017"

    def run_round(self, rnd: int, selected: list[Client]) -> dict[str, float]:
        total_weight = 0.0
        acc: dict[str, torch.Tensor] = {}
        losses = []
        for client in selected:
            losses.append(self.local_train(rnd, client))
            msg = Message(
                rnd, client.name, "server", "model", module_tensors(client.model), {"arch": client.arch, "num_samples": len(client.train_idx)}
            )
            received = self.send(msg, {"indices": client.train_idx.cpu()})
            w = float(len(client.train_idx))
            total_weight += w
            for k, v in received.tensors.items():
                v = v.to(self.env.device, torch.float64) * w
                acc[k] = acc[k] + v if k in acc else v
        reference = self.global_model.state_dict()
        averaged = {}
        for k, v in acc.items():
            mean = v / total_weight
            averaged[k] = mean.round().to(reference[k].dtype) if not reference[k].is_floating_point() else mean.to(reference[k].dtype)
        self.global_model.load_state_dict(averaged)
        self.broadcast(rnd)
        return {"train_loss": sum(losses) / max(len(losses), 1)}
