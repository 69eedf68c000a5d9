"""Gradient leakage: rebuild a client's training images from a gradient or a model update.

- ``dlg``: Deep Leakage from Gradients (Zhu, Liu, Han, NeurIPS 2019): dummy data and a dummy soft
  label optimised jointly with L-BFGS (lr 1, 300 iterations of ``step``) so that their gradient
  matches the observed one in squared L2 distance.
- ``idlg``: improved DLG (Zhao, Mopuri, Bilen, 2020): the label of a single image is read off the
  last layer's weight gradient (its row for the true class is the only one with a negative sum when
  the features are non-negative), then only the data is optimised. For a batch, ``idlg`` and ``ig``
  read the labels off the same layer by Yin et al.'s row-minimum rule (:func:`batch_labels`) unless
  ``batch_label_rule="joint"``.
- ``ig``: Inverting Gradients (Geiping et al., NeurIPS 2020): cosine distance between gradients plus a
  total-variation prior, Adam on the *sign* of the gradient, the image boxed to the data range after
  every step, learning-rate drops at 3/8, 5/8 and 7/8 of the steps, several restarts of which the
  lowest final loss wins. ``local_steps > 1`` unrolls that many SGD steps of the victim so a
  FedAvg-style update (not a single gradient) is matched.

Every optimisation is seeded. Images live in the model's normalised input space; callers undo the
normalisation for metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from attacks.base import ATTACKS, require_knowledge
from attacks.threat import Knowledge
from attacks.view import AttackerView
from privfl.errors import ConfigError
from privfl.seeding import derive_seed

VARIANTS = ("dlg", "idlg", "ig")
BATCH_LABEL_RULES = ("last-layer", "joint")


@dataclass
class GradLeakConfig:
    variant: str = "dlg"
    steps: int = 300  # DLG: optimizer.step calls (each up to `lbfgs_max_iter` L-BFGS iterations)
    lr: float = 1.0
    lbfgs_max_iter: int = 20
    restarts: int = 1
    tv_weight: float = 0.0
    snapshots: int = 6  # images kept along the optimisation, for galleries
    local_steps: int = 1  # > 1: the observed tensors are an update of that many local SGD steps
    local_lr: float = 0.1
    #: idlg/ig with batch > 1: "last-layer" reads the labels off the last layer's gradient first
    #: (:func:`batch_labels`), "joint" optimises soft labels with the data as DLG does
    batch_label_rule: str = "last-layer"
    extra: dict = field(default_factory=dict)

    @classmethod
    def preset(cls, variant: str, **overrides) -> GradLeakConfig:
        """Faithful defaults per variant (each paper's own settings)."""
        if variant in ("dlg", "idlg"):
            base = cls(variant=variant, steps=300, lr=1.0)
        elif variant == "ig":
            base = cls(variant="ig", steps=4800, lr=0.1, tv_weight=1e-1, restarts=1)
        else:
            raise ConfigError(f"unknown gradient-leakage variant {variant!r}; accepted: {', '.join(VARIANTS)}")
        for k, v in overrides.items():
            setattr(base, k, v)
        return base

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class LeakResult:
    images: torch.Tensor  # (B, C, H, W) normalised input space
    labels: torch.Tensor  # (B,) recovered (or given) labels
    loss: float
    seconds: float
    snapshots: list[tuple[int, torch.Tensor]]  # (step, images) along the best restart
    label_source: str


def idlg_label(grads: dict[str, torch.Tensor], last_weight: str) -> int:
    """iDLG: the class whose last-layer weight-gradient row sums to the most negative value."""
    return int(grads[last_weight].sum(dim=1).argmin())


def batch_labels(grads: dict[str, torch.Tensor], last_weight: str, batch_size: int) -> torch.Tensor:
    """Labels of a batch read off the last layer (Yin et al., "See through Gradients", CVPR 2021):
    with non-negative features, the row of a class present in the batch has a negative minimum, so the
    ``batch_size`` rows with the most negative minima are the batch's labels. Exact when the labels are
    distinct (their assumption); a repeated label shows up as a wrong extra class."""
    rows = grads[last_weight].min(dim=1).values
    return torch.argsort(rows)[:batch_size].sort().values


def model_gradient(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y_soft: torch.Tensor,
                   local_steps: int = 1, local_lr: float = 0.1) -> dict[str, torch.Tensor]:
    """Gradient of the soft-label CE at ``params`` (differentiable in x and y), or for
    ``local_steps`` > 1 the unrolled update ``(params_0 - params_T) / local_lr``."""
    names = list(params)
    current = dict(params)
    own = dict(model.named_parameters())
    direct = local_steps == 1 and all(own.get(n) is t for n, t in params.items())
    for _ in range(local_steps):
        # a single step through the module's own parameters skips functional_call's per-call overhead
        logits = model(x) if direct else functional_call(model, current, (x,))
        loss = -(y_soft * F.log_softmax(logits, dim=1)).sum(1).mean()
        grads = torch.autograd.grad(loss, [current[n] for n in names], create_graph=True)
        if local_steps == 1:
            return dict(zip(names, grads))
        current = {n: current[n] - local_lr * g for n, g in zip(names, grads)}
    return {n: (params[n] - current[n]) / local_lr for n in names}


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], cosine: bool) -> torch.Tensor:
    if cosine:
        dot = sum((a[k] * b[k]).sum() for k in b)
        na = sum(a[k].pow(2).sum() for k in b).sqrt()
        nb = sum(b[k].pow(2).sum() for k in b).sqrt()
        return 1 - dot / (na * nb + 1e-12)
    return sum((a[k] - b[k]).pow(2).sum() for k in b)


def _tv(x: torch.Tensor) -> torch.Tensor:
    return (x[..., 1:, :] - x[..., :-1, :]).abs().mean() + (x[..., :, 1:] - x[..., :, :-1]).abs().mean()


def leak(
    model: nn.Module,
    target: dict[str, torch.Tensor],
    input_shape: tuple[int, int, int],
    num_classes: int,
    cfg: GradLeakConfig,
    *,
    batch_size: int = 1,
    labels: torch.Tensor | None = None,
    box: tuple[torch.Tensor, torch.Tensor] | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    progress: Callable[[int, float], None] | None = None,
) -> LeakResult:
    """Rebuild ``batch_size`` inputs whose gradient (or update) matches ``target`` (name -> tensor).

    ``labels``: known labels (skips label recovery); ``box``: per-channel (low, high) of the
    normalised image range, used by ``ig`` to clamp.
    """
    if cfg.variant not in VARIANTS:
        raise ConfigError(f"unknown gradient-leakage variant {cfg.variant!r}; accepted: {', '.join(VARIANTS)}")
    if cfg.batch_label_rule not in BATCH_LABEL_RULES:
        raise ConfigError(f"unknown batch_label_rule {cfg.batch_label_rule!r}; accepted: {', '.join(BATCH_LABEL_RULES)}")
    model = model.to(device).eval()
    names = [n for n in _param_names_all(model) if n in target]
    if not names:
        raise ConfigError("the observed message shares no parameter names with the model")
    own = dict(model.named_parameters())
    for n, p in own.items():
        p.requires_grad_(n in names)
    params = {n: own[n] for n in names}  # differentiated through, never stepped
    target = {n: target[n].to(device).float() for n in names}
    label_source = "given"
    last_weights = [n for n in names if target[n].dim() == 2 and target[n].shape[0] == num_classes]
    if labels is None and cfg.variant in ("idlg", "ig") and last_weights:
        if batch_size == 1:
            labels = torch.tensor([idlg_label(target, last_weights[-1])])
            label_source = "idlg (last-layer gradient sign)"
        elif cfg.batch_label_rule == "last-layer" and batch_size <= num_classes:
            labels = batch_labels(target, last_weights[-1], batch_size)
            label_source = "last-layer row minima (Yin et al. 2021; assumes distinct labels)"
    start = time.perf_counter()
    best: LeakResult | None = None
    for restart in range(max(1, cfg.restarts)):
        gen = torch.Generator().manual_seed((seed * 1000 + restart) % (2**63))
        x = torch.randn((batch_size, *input_shape), generator=gen).to(device).contiguous().requires_grad_(True)
        joint = labels is None
        y_logit = torch.randn((batch_size, num_classes), generator=gen).to(device).contiguous().requires_grad_(True)
        variables = [x, y_logit] if joint else [x]
        y_fixed = None if joint else F.one_hot(labels.to(device), num_classes).float()

        def objective() -> torch.Tensor:
            y = F.softmax(y_logit, dim=1) if joint else y_fixed
            dummy = model_gradient(model, params, x, y, cfg.local_steps, cfg.local_lr)
            loss = _distance(dummy, target, cosine=cfg.variant == "ig")
            if cfg.tv_weight > 0:
                loss = loss + cfg.tv_weight * _tv(x)
            return loss

        snaps: list[tuple[int, torch.Tensor]] = []
        every = max(1, cfg.steps // max(1, cfg.snapshots))
        if cfg.variant in ("dlg", "idlg"):
            opt = torch.optim.LBFGS(variables, lr=cfg.lr, max_iter=cfg.lbfgs_max_iter)

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = objective()
                loss.backward()
                return loss

            last_good = [v.detach().clone() for v in variables]
            for step in range(cfg.steps):
                loss = opt.step(closure)
                if not (torch.isfinite(loss) and all(bool(torch.isfinite(v).all()) for v in variables)):
                    # L-BFGS diverged (DLG does on some starts and on noisy targets): keep the last finite
                    # iterate, so the result is the attack's best effort rather than NaN
                    with torch.no_grad():
                        for v, good in zip(variables, last_good):
                            v.copy_(good)
                    break
                last_good = [v.detach().clone() for v in variables]
                if progress:
                    progress(step, float(loss.detach()))
                if step % every == 0 or step == cfg.steps - 1:
                    snaps.append((step, x.detach().cpu().clone()))
        else:  # ig
            opt = torch.optim.Adam(variables, lr=cfg.lr)
            sched = torch.optim.lr_scheduler.MultiStepLR(opt, [cfg.steps * 3 // 8, cfg.steps * 5 // 8, cfg.steps * 7 // 8], 0.1)
            for step in range(cfg.steps):
                opt.zero_grad()
                loss = objective()
                loss.backward()
                for v in variables:
                    v.grad.sign_()
                opt.step()
                sched.step()
                if box is not None:
                    with torch.no_grad():
                        x.data = torch.max(torch.min(x, box[1].to(device)), box[0].to(device))
                if progress:
                    progress(step, float(loss.detach()))
                if step % every == 0 or step == cfg.steps - 1:
                    snaps.append((step, x.detach().cpu().clone()))
        with torch.enable_grad():
            final = float(objective().detach())
        recovered = (F.softmax(y_logit, 1).argmax(1) if joint else labels).detach().cpu()
        result = LeakResult(x.detach().cpu(), recovered, final, 0.0, snaps, "joint (DLG)" if joint else label_source)
        if best is None or final < best.loss:
            best = result
    best.seconds = time.perf_counter() - start
    return best


def _param_names_all(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]


#: every kind a method may declare in ``FLMethod.parameter_kinds`` (what `attack list` offers gradient leakage for)
PARAMETER_KINDS = frozenset({"grad", "update", "model", "small_model", "layer", "learngene"})


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
        require_knowledge(self, view)

    def target(self, view: AttackerView, record: dict, prev: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int, str]:
        """The gradient-like tensors to match, the batch they stand for, and how they were derived."""
        tensors = view.load(record)
        meta, cfg = record.get("meta", {}), view.config
        if record["kind"] == "grad":
            return tensors, int(meta.get("batch_size", cfg["batch_size"])), "the gradient as sent"
        n = int(meta.get("num_samples", cfg["batch_size"]))
        lr = float(meta.get("lr", cfg["lr"]))
        if record["kind"] == "update":
            return {k: v.float() / lr for k, v in tensors.items() if v.is_floating_point()}, n, "update d / lr (mean local gradient)"
        tau = max(1, cfg["local_epochs"] * -(-n // cfg["batch_size"]))
        if self.cfg.local_steps > 1:  # the unrolled objective models the steps itself: match prev - new, per lr
            return ({k: (prev[k].float() - v.float()) / lr for k, v in tensors.items() if v.is_floating_point() and k in prev}, n,
                    f"(previous {record['kind']} - {record['kind']}) / lr, matched by {self.cfg.local_steps} unrolled steps")
        grads = {k: (prev[k].float() - v.float()) / (lr * tau) for k, v in tensors.items() if v.is_floating_point() and k in prev}
        return grads, n, f"(previous {record['kind']} - {record['kind']}) / (lr * {tau} local steps)"

    def run(self, view: AttackerView, record: dict, progress=None) -> Leak:
        """Attack one message; call :meth:`check` once before."""
        _, prev = view.previous_state(record)
        model = view.model_for(record["sender"], record["kind"])
        own = model.state_dict()
        shared = {k: v for k, v in prev.items() if k in own}
        if not shared:  # a method whose leakage module does not name its tensors like its messages
            raise ConfigError(f"the previous state of {record['kind']} message {record['seq']} shares no tensor names with "
                              f"{type(model).__name__}, the module {view.info['method']} declares for it")
        model.load_state_dict(shared, strict=False)
        target, n, note = self.target(view, record, prev)
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


for _variant in VARIANTS:
    ATTACKS.register(_variant, GradientLeakage)
