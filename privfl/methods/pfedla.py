"""pFedLA (Ma, Zhang, Guo, Xu, "Layer-wised Model Aggregation for Personalized Federated Learning",
CVPR 2022): a server-side hypernetwork per client learns, layer by layer, how much of every client's
model goes into that client's personalised model.

The server keeps each client's last uploaded model theta_j and, per client i, a hypernetwork HN_i with
its own embedding v_i. HN_i(v_i; psi_i) gives one row of non-negative scores over the N clients per
layer l; normalised to sum to 1 they are the aggregation weights alpha_i^l (the paper's alpha_i, an
L x N matrix). Client i's personalised model is, layer by layer,

    theta_bar_i^l = sum_j alpha_ij^l theta_j^l.

Per round (the paper's Fig. 2 workflow; equation numbers are not cited: the paper's text was not
available here):

1. every client holds the theta_bar_i it last received (kind ``model``, down; the setup sends one to
   each client before round 0);
2. each selected client trains it with plain CE for ``--local-epochs`` (the shared seeded loop) and
   uploads the trained model theta_i (kind ``model``, up; meta ``num_samples``, ``lr``, ``tau``);
3. for each upload the server updates HN_i by the chain rule through the aggregation:
   psi_i <- psi_i - eta_h (d alpha_i / d psi_i)^T (d theta_bar_i / d alpha_i)^T (theta_bar_i - theta_i),
   the same for v_i, where theta_bar_i is recomputed from the stored models and HN_i exactly as it was
   sent (neither has changed since); (d theta_bar_i^l / d alpha_ij^l)^T r^l = <theta_j^l, r^l> per layer;
4. it stores theta_i <- the upload, then computes every client's theta_bar_i with the updated HN_i and
   the new models and sends each client its own (``model``, down, one different message per client).

What is sent, per round: each selected client's full model up, and to every client its personalised
full model down, P scalars per message (P = parameters + buffers of the state dict; for homo-cnn4 on
Fashion-MNIST P = 832 + 51,264 + 524,800 + 5,130 = 582,026), as FedAvg. The setup round sends N models
(meta ``phase=setup``) once on top. Hypernetworks, embeddings and weights never leave the server.

Decisions where the paper is open or the references differ (no PFLlib/HtFLlib implementation exists;
the references are KarhouTam/pFedLA, not the authors' code by its own README, and KarhouTam/FL-bench's
``pfedla.py``, by the same author):

- **Hypernetwork.** As both references: embedding dim 100 (a learned vector per client, N(0, 1)
  initialised as ``nn.Embedding``), an MLP of three Linear layers of width 100 with ReLU, and one
  ``Linear(100, N)`` per layer with U(0, 1) weights and zero bias (the references' fix for all-zero
  rows under the default initialisation), ReLU; each row is divided by its sum. A row that is all zero
  falls back to the client's own model (one-hot; FL-bench). Every HN_i is seeded by
  (seed, "init", "pfedla-hypernet", i).
- **Hypernetwork step.** Plain SGD with lr ``hn_lr`` = 0.005 (FedFree Table A2; both references'
  default), no momentum, so there is no optimizer state. Its direction: the local update theta_i -
  theta_bar_i estimates minus the local loss's gradient at theta_bar_i, so descent uses
  theta_bar_i - theta_i as the output gradient (``hn_sign=descent``, the convention of pFedHN's code,
  on which pFedLA builds). The paper's update, and both references' code, use theta_i - theta_bar_i
  with the same minus sign, which moves theta_bar_i away from the trained model; ``hn_sign=fl-bench``
  reproduces that.
- **What a layer is.** A module that owns parameters (``features.0``: its weight and bias share one
  row of weights). KarhouTam groups by the first name component, FL-bench by parameter tensor.
  Buffers (BatchNorm statistics, counters) are not aggregated: each client gets its own (both
  references).
- **Stored models.** theta_i is the last upload (what the paper's server keeps: theta_bar_i + delta
  theta_i is exactly the trained model). FL-bench adds the update to its earlier stored model
  instead. All theta_j start as the server's initial model (seed "init", "server-model", the same as
  FedAvg's), so the setup sends every client that model; KarhouTam initialises each client apart,
  FL-bench from one model, as here.
- **Timing.** HN updates use the models stored before this round's uploads (the ones every theta_bar_i
  of the last download was built from); the references update client by client within a round, so a
  later client's aggregate already mixes in an earlier client's fresh upload. Here the round is
  synchronous, as in the paper's workflow figure. Every client, selected or not, is sent its new
  theta_bar_i at the end of the round.
- **Downlink defenses.** The server's residual uses the theta_bar_i it computed; a defense on the
  downlink changes what the client trained from, which the server does not see.
- **HeurpFedLA** (``k`` > 0, the paper's heuristic variant): for client i the k layers with the largest
  own score alpha_ii^l (before normalisation, as both references) take the client's own layer
  (one-hot weights) and get no hypernetwork gradient. The paper saves communication by not sending
  those layers; privfl sends the full model (their values are the client's own last upload), so the
  counts are pFedLA's.
- **Evaluation.** The references score theta_bar_i, the model each client received: ``--eval global``.
  ``--eval personal`` scores the model after the client's own last local training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from privfl.capture.message import Message
from privfl.config import opt
from privfl.errors import ConfigError
from privfl.fl.method import METHODS, Client, ClientReply, FLMethod, load_module_tensors, module_tensors
from privfl.seeding import seed_global


class LayerWeightNet(nn.Module):
    """HN_i: client i's embedding v_i -> MLP -> one row of non-negative scores over the N clients per layer."""

    def __init__(self, num_clients: int, num_layers: int, embedding_dim: int = 100, hidden_dim: int = 100):
        super().__init__()
        self.embedding = nn.Parameter(torch.randn(embedding_dim))
        self.mlp = nn.Sequential(
            nn.Linear(embedding_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
        )
        heads = [nn.Linear(hidden_dim, num_clients) for _ in range(num_layers)]
        for head in heads:  # U(0, 1) weights on non-negative features: rows start positive
            nn.init.uniform_(head.weight)
            nn.init.zeros_(head.bias)
        self.heads = nn.ModuleList(heads)

    def forward(self) -> torch.Tensor:
        """(L, N) scores, ReLU'd."""
        feature = self.mlp(self.embedding)
        return torch.stack([F.relu(head(feature)) for head in self.heads])


def layer_weights(scores: torch.Tensor, own: int, retain: int = 0) -> torch.Tensor:
    """alpha_i: each row of ``scores`` divided by its sum (rows sum to 1); an all-zero row, and with
    ``retain`` = K > 0 the K rows of largest own score (HeurpFedLA), become one-hot on ``own``."""
    onehot = torch.zeros_like(scores[0])
    onehot[own] = 1.0
    sums = scores.sum(dim=1, keepdim=True)
    keep = (sums.squeeze(1) <= 0).clone()
    if retain > 0:
        keep[torch.topk(scores[:, own].detach(), retain).indices] = True
    normalised = scores / sums.clamp_min(torch.finfo(scores.dtype).tiny)
    return torch.where(keep.unsqueeze(1), onehot.expand_as(scores), normalised)


def parameter_layers(model: nn.Module) -> dict[str, list[str]]:
    """Layer (the module owning parameters) -> its parameter names, in the model's order."""
    layers: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        layers.setdefault(name.rpartition(".")[0], []).append(name)
    return layers


@dataclass
class PFedLAOptions:
    #: the quick CPU default of ``python -m privfl.train pfedla`` (flags override it)
    run_defaults: ClassVar[dict[str, Any]] = {"model_group": "homo-cnn4", "subsample": 6000, "rounds": 5}

    hn_lr: float = opt(0.005, "hypernetwork (and embedding) learning rate (FedFree Table A2: 0.005; 0 freezes the weights)", min=0)
    embedding_dim: int = opt(100, "size of each client's embedding v_i (references: 100)", min=1)
    hidden_dim: int = opt(100, "width of the hypernetwork's three hidden layers (references: 100)", min=1)
    k: int = opt(0, "HeurpFedLA: layers each client keeps as its own (largest self-weight); 0: pFedLA", min=0)
    hn_sign: str = opt(
        "descent",
        "descent: step along -(d theta_bar/d psi)^T (theta_bar - theta_uploaded); fl-bench: the opposite sign, as KarhouTam/pFedLA and FL-bench",
        choices=("descent", "fl-bench"),
    )


@METHODS.register("pfedla")
class PFedLA(FLMethod):
    """Per-client hypernetworks weight every client's layers into a personalised model (module docstring)."""

    parallel_clients = True
    name = "pfedla"
    sends = {"model": "up/down"}
    Options = PFedLAOptions
    requires_homogeneous = True
    #: the download overwrites the whole model: ``--eval personal`` scores the locally trained one
    personal_parts = ("",)
    paper = "Ma, Zhang, Guo, Xu, Layer-wised Model Aggregation for Personalized Federated Learning (pFedLA), CVPR 2022"

    def __init__(self, env):
        super().__init__(env)
        from privfl.models import build_model

        n = self.cfg.num_clients
        if any(not 0 <= c.index < n for c in env.clients):
            raise ConfigError(f"pfedla needs clients numbered 0..{n - 1} (one weight column per client)")
        seed_global(self.cfg.seed, "init", "server-model")  # FedAvg's initial model
        initial = build_model(**env.clients[0].model.spec).to(env.device)
        self.layers = parameter_layers(initial)
        self.layer_of = {name: i for i, names in enumerate(self.layers.values()) for name in names}
        if self.opts.k > len(self.layers):
            raise ConfigError(f"pfedla: k = {self.opts.k} exceeds the model's {len(self.layers)} layers")
        #: theta_j: each client's last uploaded state, stacked (N, *shape) per state-dict entry
        self.stacked = {k: v.unsqueeze(0).repeat(n, *([1] * v.dim())).contiguous() for k, v in module_tensors(initial).items()}
        self.hypernets = []
        for i in range(n):
            seed_global(self.cfg.seed, "init", "pfedla-hypernet", i)
            self.hypernets.append(LayerWeightNet(n, len(self.layers), self.opts.embedding_dim, self.opts.hidden_dim).to(env.device))

    # -------------------------------------------------------------- aggregation
    def weights(self, i: int) -> torch.Tensor:
        """alpha_i, (L, N), rows summing to 1 (with the graph to HN_i)."""
        return layer_weights(self.hypernets[i](), i, self.opts.k)

    def aggregate(self, i: int, alpha: torch.Tensor) -> dict[str, torch.Tensor]:
        """theta_bar_i under ``alpha``: each parameter the alpha-weighted sum of the stored models' layer,
        each buffer client i's own."""
        out = {}
        for name, stack in self.stacked.items():
            layer = self.layer_of.get(name)
            if layer is None:
                out[name] = stack[i].clone()
            else:
                out[name] = torch.tensordot(alpha[layer].to(stack.dtype), stack, dims=1)
        return out

    def hypernet_grads(self, i: int, upload: dict[str, torch.Tensor]) -> list[torch.Tensor | None]:
        """The gradient on HN_i's parameters (v_i included) from client i's upload (step 3): the output
        gradient theta_bar_i - theta_i (``hn_sign=descent``) taken to alpha_i in closed form, then back
        through the hypernetwork by autograd."""
        alpha = self.weights(i)
        sign = 1.0 if self.opts.hn_sign == "descent" else -1.0
        with torch.no_grad():
            sent = self.aggregate(i, alpha.detach())  # what client i received and trained from
            grad_alpha = torch.zeros(alpha.shape, dtype=torch.float64, device=alpha.device)
            for name, layer in self.layer_of.items():
                stack = self.stacked[name]
                residual = sign * (sent[name] - upload[name].to(stack))
                grad_alpha[layer] += (stack.reshape(len(stack), -1) @ residual.reshape(-1)).double()
        grads = torch.autograd.grad(alpha, list(self.hypernets[i].parameters()), grad_outputs=grad_alpha.to(alpha.dtype), allow_unused=True)
        return list(grads)

    def update_hypernet(self, i: int, upload: dict[str, torch.Tensor]) -> None:
        """One plain SGD step of HN_i (and v_i) with lr ``hn_lr``."""
        grads = self.hypernet_grads(i, upload)
        with torch.no_grad():
            for p, g in zip(self.hypernets[i].parameters(), grads):
                if g is not None:
                    p.sub_(self.opts.hn_lr * g)

    def send_personalised(self, rnd: int, phase: str = "train") -> dict[str, float]:
        """Each client its own theta_bar_i (one message each); each overwrites its model with its copy (:meth:`receive`)."""
        own = []
        for c in self.env.clients:
            with torch.no_grad():
                alpha = self.weights(c.index)
                tensors = self.aggregate(c.index, alpha)
            own.append(float(alpha[:, c.index].mean()))
            self.deliver({c.name: self.send(Message(rnd, "server", c.name, "model", tensors, {"phase": phase}))})
        return {"self_weight": sum(own) / len(own)}

    def receive(self, client: Client, msg: Message) -> None:
        load_module_tensors(client.model, msg.tensors)

    # -------------------------------------------------------------- protocol
    def setup(self) -> None:
        self.send_personalised(0, "setup")

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        """Client side: plain CE from the theta_bar it received, the model up."""
        stats = self.fit(rnd, client)
        meta = {"arch": client.arch, "num_samples": len(client.train_idx), "lr": self.cfg.lr, "tau": stats.steps}
        msg = Message(rnd, client.name, "server", "model", module_tensors(client.model), meta)
        return ClientReply([(msg, {"indices": client.train_idx.cpu()})], {"train_loss": stats.loss})

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """Server side: HN steps from the uploads (which see the models of the last download), then the
        uploads replace the stored models, then each client's theta_bar_i down."""
        index = {c.name: c.index for c in self.env.clients}
        if self.opts.hn_lr > 0:
            for msg in uploads:
                self.update_hypernet(index[msg.sender], msg.tensors)
        with torch.no_grad():
            for msg in uploads:
                for name, stack in self.stacked.items():
                    stack[index[msg.sender]] = msg.tensors[name].to(stack)
        return self.send_personalised(rnd)

    def server_state(self) -> dict[str, torch.Tensor]:
        state = {f"theta.{k}": v for k, v in self.stacked.items()}
        for i, hypernet in enumerate(self.hypernets):
            state.update({f"hn{i}.{k}": v.detach() for k, v in hypernet.state_dict().items()})
        return state

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        for k in self.stacked:
            self.stacked[k] = state[f"theta.{k}"].to(self.stacked[k]).clone()
        for i, hypernet in enumerate(self.hypernets):
            prefix = f"hn{i}."
            hypernet.load_state_dict({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})


__all__ = ["LayerWeightNet", "PFedLA", "PFedLAOptions", "layer_weights", "parameter_layers"]
