"""Local (no communication) and FedAvg (McMahan et al., AISTATS 2017; homogeneous models only)."""

from __future__ import annotations

from privfl.capture.message import Message
from privfl.fl.method import METHODS, Client, ClientReply, FLMethod, GlobalModelServer, average_states, module_tensors


@METHODS.register("local")
class Local(FLMethod):
    """Each client trains alone: the baseline every FL method should beat."""

    parallel_clients = True
    name = "local"
    sends = {}
    paper = "local training baseline"

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        return ClientReply([], {"train_loss": self.local_train(rnd, client)})

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        return {}


@METHODS.register("fedavg")
class FedAvg(GlobalModelServer):
    """Clients upload full models; the server averages them weighted by train-set size and
    broadcasts the result to every client. Integer buffers (BatchNorm's counters) are averaged and
    rounded."""

    parallel_clients = True
    name = "fedavg"
    sends = {"model": "up/down"}
    requires_homogeneous = True
    paper = "McMahan et al., FedAvg, AISTATS 2017"
    stateless_clients = True  # the broadcast replaces each whole client model: one copy shared, not one per client
    streams_uploads = True  # average_states reads the uploads once: one client's upload in memory at a time

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        loss = self.local_train(rnd, client)
        msg = Message(rnd, client.name, "server", "model", module_tensors(client.model), {"arch": client.arch, "num_samples": len(client.train_idx)})
        return ClientReply([(msg, {"indices": client.train_idx.cpu()})], {"train_loss": loss})

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """Average the uploads weighted by ``num_samples`` (in float64), then broadcast."""
        self.global_model.load_state_dict(average_states(uploads, self.global_model.state_dict()))
        self.broadcast(rnd)
        return {}
