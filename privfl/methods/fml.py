"""FML: federated mutual learning.

Shen, Wang, Lv, Zhang, Yuan, Li, Xu, Wu, "Federated Mutual Learning", arXiv 2006.16765, 2020. A baseline
of FedMRL (FedMRL Sec. 5.1: its shared small model is CNN-1 in the homogeneous setting and
CNN-5 in the heterogeneous one).

Each client k holds two models:
- its **private (local) model**: its :class:`~privfl.models.SplitModel` of the assigned architecture
  (any model group, heterogeneous included), which never leaves the client;
- a **meme model**: one homogeneous architecture for every client, the only thing transmitted.

Local training is deep mutual learning (Zhang et al., CVPR 2018) of the pair on the client's data, one
loss per model, each updating only its own model (the other model's output is a fixed target):

    L_local = alpha * CE(p_local, y) + (1 - alpha) * KL(p_meme || p_local)
    L_meme  = beta  * CE(p_meme, y)  + (1 - beta)  * KL(p_local || p_meme)

with p the softmax of each model's logits. Both are minimised together (one summed loss through the
shared trainer; the stopped gradients keep the two updates apart), every gradient clipped per model
(``--grad-clip``, HtFLlib: 10).

Per round: the selected clients train, then upload their meme models (kind ``shared_model``, meta:
sample count, lr, local steps and the other SGD settings); the server averages them weighted by sample
count over the uploads it received and broadcasts the average to every client (``shared_model``, down),
which overwrites its meme model only. Before round 0 the server's initial meme model is broadcast once
(meta phase=setup), so every client starts from the same meme. Inference is the private model
(``--inference local``; ``meme`` scores the meme model instead).

What is sent, per round (N clients, K selected, |theta| = the meme model's parameter count, buffers
included): upload K |theta|, broadcast N |theta| (N = K at full participation: upload == broadcast per
client). Defaults: CNN-5 of FedMRL's Table 2 (FC2 = 500 and an FC3 header) with heterogeneous clients,
670,058 scalars on 3x32x32 with 10 classes and 525,258 on Fashion-MNIST; CNN-1 with identical clients,
2,621,558 on CIFAR-10. The private model, its architecture (no ``arch`` in the meta) and the client's
data never leave the client.

Gradient leakage (``privfl.attack dlg|idlg|ig --artifact shared_model``, declared in ``FML.leakage``): the
server holds the meme it sent and the meme the client returned. The attacker differentiates the meme
model alone, CE on its own output; the client's real loss also has the (1 - beta) KL term towards the
private model's softened output, which the attacker cannot compute (it lacks the private model). With
beta = 1 the attacker's loss is exact.

Decisions where the paper is open, and what HtFLlib (TsingZ0/HtFLlib, ``clientfml.py``/``serverfml.py``)
does:
- alpha = beta = 0.5, an even split of CE and KL, as HtFLlib's run script (``total.sh``: ``-al 0.5
  -bt 0.5``); HtFLlib's argparse default is 1.0, which turns the KL terms off (two models trained
  independently), so it is not taken;
- KL per sample (``batchmean``), the paper's D_KL; HtFLlib's ``nn.KLDivLoss()`` averages over samples
  *and* classes, i.e. scales the KL term by 1/C;
- the other model's output is a fixed target (detached), as in deep mutual learning and the official
  FedAPEN code; HtFLlib does not detach it, so each model also receives the gradient of the other's
  KL term;
- the meme architecture (``--shared-arch``): ``auto`` follows FedMRL's comparison (CNN-1 if every client
  has the same architecture, else CNN-5); ``client0`` is HtFLlib's choice (the architecture of client
  0, built as a SplitModel with the run's ``--rep-dim`` and ``--mapping``);
- uploads are averaged weighted by sample count (the paper's FedAvg); HtFLlib takes the plain mean;
- one fresh optimizer per client per round over both models at ``--lr`` (HtFLlib: two SGD optimizers at
  the same lr, which is the same for SGD);
- the server broadcasts the new meme to every client at the end of a round (HtFLlib's clients read the
  server's model at the start of their training: the same at full participation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch.nn.functional as F
from torch import Tensor, nn

from privfl.capture.message import Message
from privfl.config import opt
from privfl.errors import ConfigError
from privfl.fl.method import METHODS, Client, ClientReply, FLMethod, LeakageContext, ModelRequest, load_module_tensors, module_tensors
from privfl.methods.fedmrl import weighted_average
from privfl.models.fedmrl_zoo import CNN_TABLE, FC2_DIM, MRLConvNet
from privfl.models.split import SplitModel
from privfl.seeding import seed_global

#: ``--shared-arch`` choices: auto (FedMRL's comparison), FedMRL's CNN-j, or client 0's architecture (HtFLlib)
SHARED_ARCHS = ("auto", *(f"cnn{v}" for v in CNN_TABLE), "client0")


def shared_arch_name(req: ModelRequest) -> str:
    """The shared model's architecture as a model-zoo name: ``mrl-cnnJ`` or client 0's architecture.
    ``auto``: CNN-1 if every client of the run has the same architecture, else CNN-5 (FedMRL Sec. 5.1)."""
    from privfl.models import assign_archs

    choice = req.opts.shared_arch
    archs = assign_archs(req.cfg.model_group, req.cfg.num_clients)
    if choice == "client0":
        return archs[0]
    if choice == "auto":
        choice = "cnn1" if len(set(archs)) == 1 else "cnn5"
    return f"mrl-{choice}"


def build_shared_model(req: ModelRequest) -> nn.Module:
    """The homogeneous shared model of this run (the same on every client, the server and an attacker's
    side): images -> logits. FedMRL's CNN-j with FC2 = 500 and its FC3 header (parameters ``conv1.weight``
    ... ``fc3.bias``), or a SplitModel of client 0's architecture."""
    from privfl.models import build_model

    name = shared_arch_name(req)
    if name.startswith("mrl-cnn"):
        variant = int(name.removeprefix("mrl-cnn"))
        try:
            return MRLConvNet(variant, req.in_channels, req.image_size, rep_dim=FC2_DIM, num_classes=req.num_classes)
        except ConfigError as exc:
            raise ConfigError(
                f"{exc} (the shared model, --shared-arch {req.opts.shared_arch}); --shared-arch client0 takes client 0's architecture"
            ) from None
    return build_model(
        name, in_channels=req.in_channels, num_classes=req.num_classes, image_size=req.image_size, rep_dim=req.cfg.rep_dim, mapping=req.cfg.mapping
    )


def mutual_loss(own: Tensor, other: Tensor, y: Tensor, ce_weight: float, kl_weight: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, CE, KL) of one model in deep mutual learning: ``ce_weight * CE(own, y) + kl_weight *
    KL(softmax(other) || softmax(own))``, the KL per sample (batchmean); ``other`` is a fixed target
    (detached), so the loss updates only the model that produced ``own``. ``kl_weight`` defaults to
    ``1 - ce_weight`` (FML's alpha/beta)."""
    ce = F.cross_entropy(own, y)
    kl = F.kl_div(F.log_softmax(own, dim=1), F.softmax(other.detach(), dim=1), reduction="batchmean")
    w = 1.0 - ce_weight if kl_weight is None else kl_weight
    return ce_weight * ce + w * kl, ce, kl


def clip_parts(parts: tuple[nn.Module, ...], max_norm: float) -> None:
    """Clip each module's gradient norm separately (HtFLlib clips the private and the shared model); 0: off."""
    if max_norm > 0:
        for part in parts:
            nn.utils.clip_grad_norm_(part.parameters(), max_norm)


@dataclass
class FMLOptions:
    """FML's hyperparameters; lr, batch size, local epochs, momentum and weight decay are run options."""

    local_alpha: float = opt(
        0.5, "alpha: CE weight of the private model's loss, 1 - alpha on KL(p_meme || p_local) (HtFLlib's run script: 0.5)", min=0, max=1
    )
    meme_beta: float = opt(
        0.5, "beta: CE weight of the meme model's loss, 1 - beta on KL(p_local || p_meme) (HtFLlib's run script: 0.5)", min=0, max=1
    )
    shared_arch: str = opt(
        "auto",
        "meme model: auto = FedMRL's CNN-1 if every client has the same architecture, else CNN-5; cnnJ = FedMRL's CNN-J; "
        "client0 = client 0's architecture (HtFLlib)",
        choices=SHARED_ARCHS,
    )
    grad_clip: float = opt(10.0, "max gradient norm, clipped per model (HtFLlib: 10; 0: off)", min=0)
    inference: str = opt(
        "local", "model scored at evaluation: local = the private model (paper, HtFLlib), meme = the meme model", choices=("local", "meme")
    )


class FMLModel(nn.Module):
    """One client's pair: ``local`` (private SplitModel) and ``meme`` (shared); its state_dict (``local.*``,
    ``meme.*``) is what checkpoints save. ``forward`` is the private model."""

    def __init__(self, local: SplitModel, meme: nn.Module):
        super().__init__()
        self.arch = getattr(local, "arch", type(local).__name__)
        self.local = local  # private: never sent
        self.meme = meme  # shared: sent as `shared_model`

    def infer(self, x: Tensor, inference: str = "local") -> Tensor:
        return self.meme(x) if inference == "meme" else self.local(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.local(x)


class MutualLearningServer(FLMethod):
    """What FML and FedAPEN share: a server that owns the global shared model, broadcasts it to every
    client (before round 0 and after each round's averaging), and averages the selected clients'
    ``shared_model`` uploads weighted by sample count. ``shared_part`` names the client-model submodule."""

    shared_part: ClassVar[str] = "meme"
    sends = {"shared_model": "up/down"}

    def __init__(self, env):
        super().__init__(env)
        seed_global(self.cfg.seed, "init", f"server-{self.shared_part}")
        template = cast(nn.Module, env.clients[0].model.get_submodule(self.shared_part))
        self.global_shared = self._fresh_like(template).to(env.device)  # theta^0

    @staticmethod
    def _fresh_like(template: nn.Module) -> nn.Module:
        """A freshly initialised module of ``template``'s architecture (under the current global seed)."""
        if isinstance(template, MRLConvNet):
            return MRLConvNet(**cast(dict[str, Any], template.config))
        if isinstance(template, SplitModel):
            from privfl.models import build_model

            return build_model(**template.spec)
        raise TypeError(f"cannot rebuild a shared model of type {type(template).__name__}")

    def shared(self, client: Client) -> nn.Module:
        return cast(nn.Module, client.model.get_submodule(self.shared_part))

    # -------------------------------------------------------------- protocol
    def setup(self) -> None:
        self.broadcast(0, "setup")

    def broadcast(self, rnd: int, phase: str = "train") -> None:
        """Send the global shared model to every client; each loads its copy into its shared part (:meth:`receive`)."""
        self.deliver(self.channel.broadcast(rnd, self.client_names(), "shared_model", module_tensors(self.global_shared), meta={"phase": phase}))

    def receive(self, client: Client, msg: Message) -> None:
        load_module_tensors(self.shared(client), msg.tensors)

    def upload(self, rnd: int, client: Client, trained_on: Tensor, steps: int) -> tuple[Message, dict[str, Tensor]]:
        """Client side: its shared model after local training, with the ids of the samples it trained on."""
        meta: dict[str, Any] = {
            "num_samples": len(trained_on),
            "lr": self.cfg.lr,
            "local_steps": steps,
            "local_epochs": self.cfg.local_epochs,
            "batch_size": self.cfg.batch_size,
            "momentum": self.cfg.momentum,
            "weight_decay": self.cfg.weight_decay,
            "grad_clip": self.opts.grad_clip,
            "shared_arch": self.shared_arch(),
        }
        msg = Message(rnd, client.name, "server", "shared_model", module_tensors(self.shared(client)), meta)
        return msg, {"indices": trained_on.cpu()}

    def shared_arch(self) -> str:
        template = self.global_shared
        return f"mrl-cnn{template.variant}" if isinstance(template, MRLConvNet) else str(getattr(template, "arch", type(template).__name__))

    def aggregate(self, received: list[Message]) -> None:
        """theta = sum_k (n_k / n) theta_k over what the server received (never the clients' own models)."""
        self.global_shared.load_state_dict(weighted_average(received))

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """Server side: the sample-weighted average of the received shared models, to every client."""
        self.aggregate(uploads)
        self.broadcast(rnd)
        return {}

    def server_state(self) -> dict[str, Tensor]:
        return {f"{self.shared_part}.{k}": v for k, v in module_tensors(self.global_shared).items()}

    def load_server_state(self, state: dict[str, Tensor]) -> None:
        prefix = f"{self.shared_part}."
        load_module_tensors(self.global_shared, {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})


@METHODS.register("fml")
class FML(MutualLearningServer):
    """See the module docstring. Server state: the global meme model (checkpointed for --resume)."""

    parallel_clients = True
    name = "fml"
    shared_part = "meme"
    sends = {"shared_model": "up/down"}
    personal_parts = ("meme",)  # the broadcast overwrites the meme model only
    Options = FMLOptions
    #: the attacker differentiates the meme model alone (images -> meme logits), whose parameter names are
    #: the `shared_model` tensors'; the KL term of the client's loss needs the private model (docstring)
    leakage = {
        "shared_model": LeakageContext(
            previous="shared_model",
            module="meme",
            note="CE on the meme model's own output; the true loss adds (1 - beta) KL(p_local || p_meme), which needs the private model",
        )
    }
    paper = "Shen et al., Federated Mutual Learning, arXiv 2006.16765 (2020)"

    @classmethod
    def build_client_model(cls, req: ModelRequest) -> FMLModel:
        local = cast(SplitModel, super().build_client_model(req))  # first: the same init as other methods' client models
        meme = build_shared_model(req)  # overwritten by the setup broadcast
        return FMLModel(local, meme)

    def train_client(self, rnd: int, client: Client) -> dict[str, float]:
        """E local epochs of mutual learning of the private and the meme model (one summed loss)."""
        o = self.opts

        def objective(model: FMLModel, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            out_local, out_meme = model.local(x), model.meme(x)
            loss_local, ce_local, _ = mutual_loss(out_local, out_meme, y, o.local_alpha)
            loss_meme, ce_meme, _ = mutual_loss(out_meme, out_local, y, o.meme_beta)
            return loss_local + loss_meme, {"loss_local": loss_local, "loss_meme": loss_meme, "ce_local": ce_local, "ce_meme": ce_meme}

        stats = self.fit(rnd, client, objective, before_step=lambda m: clip_parts((m.local, m.meme), o.grad_clip))
        return {**stats.as_dict("loss"), "steps": stats.steps}

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        """Client side: mutual learning, then the meme model up."""
        out = self.train_client(rnd, client)
        metrics = {"train_loss": out["loss"], **{k: out[k] for k in ("loss_local", "loss_meme", "ce_local", "ce_meme")}}
        return ClientReply([self.upload(rnd, client, client.train_idx, int(out["steps"]))], metrics)

    def predict(self, client: Client, x: Tensor) -> Tensor:
        return client.model.infer(x, self.opts.inference)


__all__ = ["FML", "SHARED_ARCHS", "FMLModel", "FMLOptions", "MutualLearningServer", "build_shared_model", "mutual_loss", "shared_arch_name"]
