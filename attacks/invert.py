"""The representation-inversion attack: DIP generators matched to captured representations.

Threat model (DESIGN.md, FedRE [000] Sec. 3): an honest-but-curious server that sees the captured
message and holds the client's extractor (incl. RM) as it was when it produced the artifact. It does
not see the client's data: this module never opens the ground-truth store.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attacks.dip import DIPConfig, invert
from attacks.targets import Target
from attacks.threat import Knowledge
from attacks.view import AttackerView
from privfl.errors import CaptureError
from privfl.registry import Registry
from privfl.seeding import derive_seed

ATTACKS: Registry[type] = Registry("attack")


@dataclass
class Reconstruction:
    target: Target
    image: torch.Tensor  # (C, H, W) in [0, 1]
    feature_loss: float
    seconds: float  # wall time of its batch divided by the batch size


@ATTACKS.register("invert")
class RepresentationInversion:
    name = "invert"
    consumes = frozenset({"rep", "proto", "global_proto", "ent_rep"})
    needs = Knowledge(extractor=True)
    threat_model = "curious-server-whitebox-extractor"
    paper = "Ulyanov et al., Deep Image Prior, CVPR 2018; used by FedRE [000] Q3 / [001] Q2"

    def __init__(self, cfg: DIPConfig, *, seed: int = 0, device: torch.device | str = "cpu", batch: int = 16):
        self.cfg, self.seed, self.device, self.batch = cfg, seed, torch.device(device), batch

    def check(self, view: AttackerView, targets: list[Target] = ()) -> None:
        """Refuse before optimising anything: missing capability, or no extractor for some target."""
        missing = self.needs.missing(view.available())
        if missing:
            raise CaptureError(
                f"attack {self.name} needs {', '.join(missing)}, which run {view.run_dir} does not store "
                "(train with capture on; the method must expose client extractors)"
            )
        for t in targets:
            if t.kind not in self.consumes:
                raise CaptureError(f"attack {self.name} does not take {t.kind}; it takes {', '.join(sorted(self.consumes))}")
        stored = {(r["client"], r["round"]) for r in view.extractor_records()}
        for client, rnd in sorted({(t.client, t.round) for t in targets}):
            if (client, rnd) not in stored:
                view.extractor(client, rnd)  # raises with the list of what is stored

    def reconstruct(
        self, targets: list[Target], view: AttackerView, progress: Callable[[str, int, int, float], None] | None = None
    ) -> list[Reconstruction]:
        """Invert every target through its client's extractor, several targets per optimisation."""
        self.check(view, targets)
        ds = view.dataset
        shape = (ds["channels"], ds["image_size"], ds["image_size"])
        groups: dict[tuple[str, int], list[Target]] = defaultdict(list)
        for t in targets:
            groups[(t.client, t.round)].append(t)
        out: list[Reconstruction] = []
        for (client, rnd), members in groups.items():
            model = view.extractor(client, rnd, self.device)
            for start in range(0, len(members), self.batch):
                chunk = members[start : start + self.batch]
                label = f"{client} r{rnd} targets {start + 1}-{start + len(chunk)}/{len(members)}"
                hook = (lambda step, loss, label=label: progress(label, step, self.cfg.steps, loss)) if progress else None
                result = invert(
                    model.represent,
                    torch.stack([t.vector.float() for t in chunk]),
                    shape, ds["mean"], ds["std"], self.cfg,
                    [derive_seed(self.seed, "dip", t.key) for t in chunk],
                    device=self.device, progress=hook,
                )
                for i, t in enumerate(chunk):
                    out.append(Reconstruction(t, result.images[i], float(result.feature_loss[i]), result.seconds / len(chunk)))
        return out


PARAMETER_KINDS = frozenset({"grad", "update", "model"})


@dataclass
class Leak:
    record: dict
    images: torch.Tensor  # (B, C, H, W) in [0, 1]
    labels: torch.Tensor
    snapshots: list[tuple[int, torch.Tensor]]  # in [0, 1]
    seconds: float
    label_source: str
    batch_size: int
    target_note: str


class GradientLeakage:
    """DLG / iDLG / Inverting Gradients on a captured gradient, update or model message.

    Knowledge: the model architecture and the parameters the attacker (the server) broadcast last,
    both available to a server, plus the local hyperparameters it set. What is matched:
    - ``grad`` (FedSGD): the gradient itself, batch size from the message;
    - ``update`` (FedNova's normalised update d = (x - x_k)/a): d / lr, the mean local gradient
      (exact for one local step);
    - ``model`` (FedAvg): (x_prev - x_k) / (lr * tau), the mean local gradient over tau steps.
    For updates and models the batch is the client's data (``--batch-size`` caps it).
    """

    consumes = PARAMETER_KINDS
    needs = Knowledge(previous_state=True, local_hyperparameters=True)
    threat_model = "curious-server-previous-state"
    paper = ""

    def __init__(self, variant: str, cfg, *, seed: int = 0, device="cpu", max_batch: int = 8):
        self.variant, self.cfg, self.seed, self.device, self.max_batch = variant, cfg, seed, torch.device(device), max_batch
        self.name = variant
        self.paper = {"dlg": "Zhu et al., NeurIPS 2019", "idlg": "Zhao et al., arXiv 2001.02610", "ig": "Geiping et al., NeurIPS 2020"}[variant]

    def check(self, view: AttackerView) -> None:
        missing = self.needs.missing(view.available())
        if missing:
            raise CaptureError(f"attack {self.name} needs {', '.join(missing)}, which run {view.run_dir} does not provide")

    def target(self, view: AttackerView, record: dict) -> tuple[dict[str, torch.Tensor], int, str]:
        tensors = view.load(record)
        meta, cfg = record.get("meta", {}), view.config
        if record["kind"] == "grad":
            return tensors, int(meta.get("batch_size", cfg["batch_size"])), "the gradient as sent"
        n = int(meta.get("num_samples", cfg["batch_size"]))
        lr = float(meta.get("lr", cfg["lr"]))
        if record["kind"] == "update":
            return {k: v.float() / lr for k, v in tensors.items() if v.is_floating_point()}, n, "update d / lr (mean local gradient)"
        _, prev = view.previous_state(record)
        tau = max(1, cfg["local_epochs"] * -(-n // cfg["batch_size"]))
        grads = {k: (prev[k].float() - v.float()) / (lr * tau) for k, v in tensors.items() if v.is_floating_point()}
        return grads, n, f"(previous model - model) / (lr * {tau} local steps)"

    def run(self, view: AttackerView, record: dict, progress=None) -> Leak:
        from attacks.gradleak import leak

        self.check(view)
        _, prev = view.previous_state(record)
        model = view.model_for(record["sender"])
        model.load_state_dict(prev)
        target, n, note = self.target(view, record)
        names = {n_ for n_, _ in model.named_parameters()}
        target = {k: v for k, v in target.items() if k in names}
        batch = max(1, min(n, self.max_batch))
        ds = view.dataset
        mean = torch.tensor(ds["mean"]).view(1, -1, 1, 1)
        std = torch.tensor(ds["std"]).view(1, -1, 1, 1)
        box = ((0 - mean) / std, (1 - mean) / std)
        result = leak(model, target, (ds["channels"], ds["image_size"], ds["image_size"]), ds["num_classes"], self.cfg,
                      batch_size=batch, box=box, seed=derive_seed(self.seed, self.variant, record["seq"]), device=self.device,
                      progress=progress)
        to01 = lambda x: (x * std + mean).clamp(0, 1)  # noqa: E731
        return Leak(record, to01(result.images), result.labels, [(s, to01(x)) for s, x in result.snapshots], result.seconds,
                    result.label_source, batch, note)


for _variant in ("dlg", "idlg", "ig"):
    ATTACKS.register(_variant, GradientLeakage)
