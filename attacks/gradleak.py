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

import contextlib
import dataclasses
import math
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from attacks.base import KNOWLEDGE_FIXES, Attack, AttackNotApplicable, Progress, Reconstruction, Selection, Target, register_attack
from attacks.context import context_of, leakage_module, module_tensor_names, previous_state
from attacks.gradmatch import Factored, LinearTap, Observed, distance, factored, find_linear_taps, observe, tapping, zero_probes
from attacks.lbfgs import LBFGS, LockstepLBFGS
from attacks.threat import Knowledge
from privfl.errors import ConfigError
from privfl.kinds import KINDS, Family, ParamForm
from privfl.run import AttackerView
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
    #: > 1: the observed tensors are an update of that many local SGD steps, unrolled by the attack;
    #: "auto" (attacks on a run): the steps the message's meta or the run's config imply
    local_steps: int | str = 1
    local_lr: float = 0.1  # the unrolled steps' lr (attacks on a run use the message's lr, else the run's)
    max_batch: int = 8  # attacks on a run: the largest batch rebuilt from one message
    #: attacks on a run: targets optimised together by :func:`leak_batch` (1: one at a time with :func:`leak`).
    #: On a CPU an evaluation's cost is mostly per operator launched, paid once per batch, so larger batches
    #: cost less per target (cnn4, 32 images, 30 steps, one thread: 8 at a time 3.63 s, 32 at once 2.44 s
    #: per image; docs/attacks.md); every target's model and observed gradient are held by the attack anyway, so a
    #: batch adds one stacked copy of at most this many states.
    batch: int = 32
    #: idlg/ig with batch > 1: "last-layer" reads the labels off the last layer's gradient first
    #: (:func:`batch_labels`), "joint" optimises soft labels with the data as DLG does
    batch_label_rule: str = "last-layer"
    #: match wide linear layers' weight gradients without multiplying them out (:mod:`attacks.gradmatch`):
    #: the same objective, summed in float64; False: materialise every gradient
    factor_linear: bool = True
    #: the weights a linear layer needs to be factored: cnn4's 1024 x 512 layer (524,288) made DLG's closure
    #: 1.8x faster, DLG's LeNet's 768 x 100 (76,800) only 1.1x, so below this the objective stays operation
    #: for operation the materialised one (and the original papers')
    factor_min_weights: int = 262_144
    #: a factored layer's observed gradient is matched through a low-rank factorisation where one leaves a
    #: residual under this fraction of its norm (:func:`attacks.gradmatch.low_rank`; 0: always through the
    #: full matrix). DLG on cnn4, 32 images at once: 0.62-0.69 -> 0.46-0.53 s per image (docs/attacks.md)
    low_rank_rtol: float = 1e-6
    #: one target at a time (:func:`leak`) on a CPU, a model whose convolutions all have at most this many
    #: input and output channels runs them on PyTorch's native kernels instead of oneDNN's, whose fixed cost
    #: per call dominates such small ones: DLG's sigmoid LeNet (12 channels), one closure 1.80 -> 1.08 ms;
    #: cnn4 (32 and 64) is slower that way (2.42 -> 2.87 s per image), and so are :func:`leak_batch`'s
    #: grouped convolutions, which are left alone. 0: always oneDNN (docs/attacks.md)
    native_conv_max_channels: int = 16
    #: one target at a time (:func:`leak`): the closure (the dummy gradient, its distance and that distance's
    #: gradient in the dummies) compiled by ``torch.compile``, which fuses its small operators: DLG's LeNet,
    #: one closure 1.08 -> 0.52 ms on a CPU. The compiling is paid once per process and model shape (seconds;
    #: more on a cold cache) and the rounding differs from the eager closure's, so it is off by default. An
    #: attack on a run with it optimises its targets one at a time, whatever ``batch`` says
    compile: bool = False
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


def idlg_label(grads: Mapping[str, torch.Tensor], last_weight: str) -> int:
    """iDLG: the class whose last-layer weight-gradient row sums to the most negative value."""
    return int(grads[last_weight].sum(dim=1).argmin())


def batch_labels(grads: Mapping[str, torch.Tensor], last_weight: str, batch_size: int) -> torch.Tensor:
    """Labels of a batch read off the last layer (Yin et al., "See through Gradients", CVPR 2021):
    with non-negative features, the row of a class present in the batch has a negative minimum, so the
    ``batch_size`` rows with the most negative minima are the batch's labels. Exact when the labels are
    distinct (their assumption); a repeated label shows up as a wrong extra class."""
    rows = grads[last_weight].min(dim=1).values
    return torch.argsort(rows)[:batch_size].sort().values


def _soft_ce(logits: torch.Tensor, y_soft: torch.Tensor) -> torch.Tensor:
    """The victim's loss with a soft label (DLG optimises the label as a distribution)."""
    return -(y_soft * F.log_softmax(logits, dim=1)).sum(1).mean()


def model_gradient(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y_soft: torch.Tensor,
    local_steps: int = 1,
    local_lr: float = 0.1,
    taps: Sequence[LinearTap] = (),
) -> dict[str, torch.Tensor | Factored]:
    """Gradient of the soft-label CE at ``params`` (differentiable in x and y), or for
    ``local_steps`` > 1 the unrolled update ``(params_0 - params_T) / local_lr``. The weights of
    ``taps`` (one step only) come back :class:`attacks.gradmatch.Factored`."""
    names = list(params)
    current = dict(params)
    own = dict(model.named_parameters())
    direct = local_steps == 1 and all(own.get(n) is t for n, t in params.items())
    if taps:
        tapped = {t.weight for t in taps}
        dense = [n for n in names if n not in tapped]
        probes = zero_probes(taps, x)
        flat = [p.requires_grad_(True) for t in taps for p in probes[t.path]]
        with tapping(model, taps, probes) as inputs:
            logits = model(x) if direct else functional_call(model, current, (x,))
        loss = _soft_ce(logits, y_soft)
        grads = torch.autograd.grad(loss, [current[n] for n in dense] + flat, create_graph=True)
        rest = iter(grads[len(dense) :])
        probe_grads = {t.path: [next(rest) for _ in t.out_shapes] for t in taps}
        return {**dict(zip(dense, grads[: len(dense)])), **factored(taps, probe_grads, inputs)}
    for _ in range(local_steps):
        # a single step through the module's own parameters skips functional_call's per-call overhead
        logits = model(x) if direct else functional_call(model, current, (x,))
        loss = _soft_ce(logits, y_soft)
        grads = torch.autograd.grad(loss, [current[n] for n in names], create_graph=True)
        if local_steps == 1:
            return dict(zip(names, grads))
        current = {n: current[n] - local_lr * g for n, g in zip(names, grads)}
    return {n: (params[n] - current[n]) / local_lr for n in names}


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
    _check_compile(cfg, device)
    model = model.to(device).eval()
    names = [n for n in _param_names_all(model) if n in target]
    if not names:
        raise ConfigError("the observed message shares no parameter names with the model")
    own = dict(model.named_parameters())
    for n, p in own.items():
        p.requires_grad_(n in names)
    params = {n: own[n] for n in names}  # differentiated through, never stepped
    target = {n: target[n].to(device).float() for n in names}
    labels, label_source = _read_labels(target, names, labels, cfg, batch_size, num_classes)
    local_steps = cast(int, cfg.local_steps)  # an attack on a run resolves "auto" before calling leak()
    taps = _taps(model, names, (batch_size, *input_shape), local_steps, cfg, device)
    observed = observe(target, names, taps, cfg.low_rank_rtol)
    start = time.perf_counter()
    best: LeakResult | None = None
    native = torch.device(device).type == "cpu" and _small_convolutions(model, cfg.native_conv_max_channels)
    compiled = _compiled_objective(model, params, names, local_steps, cfg, taps) if cfg.compile else None
    for restart in range(max(1, cfg.restarts)):
        gen = torch.Generator().manual_seed((seed * 1000 + restart) % (2**63))
        x_var = torch.randn((batch_size, *input_shape), generator=gen).to(device).contiguous().requires_grad_(True)
        joint = labels is None
        y_var = torch.randn((batch_size, num_classes), generator=gen).to(device).contiguous().requires_grad_(True)
        variables = [x_var, y_var] if joint else [x_var]
        y_fixed = None if labels is None else F.one_hot(labels.to(device), num_classes).float()  # None iff joint

        # objective and closure are called only within this restart, so binding its variables late is intended
        def objective() -> torch.Tensor:
            y = F.softmax(y_var, dim=1) if y_fixed is None else y_fixed  # noqa: B023
            dummy = model_gradient(model, params, x_var, y, local_steps, cfg.local_lr, taps)  # noqa: B023
            loss = distance(dummy, observed, cosine=cfg.variant == "ig")
            if cfg.tv_weight > 0:
                loss = loss + cfg.tv_weight * _tv(x_var)  # noqa: B023
            return loss

        def loss_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
            """The objective and its gradient in each variable."""
            if compiled is not None:
                (gx, gy), loss = compiled(x_var.detach(), y_var.detach(), y_fixed, observed)  # noqa: B023
                return loss, [gx, gy][: len(variables)]  # noqa: B023
            loss = objective()
            # the dummies' gradient only: backward() would also accumulate one into every model parameter
            return loss, list(torch.autograd.grad(loss, variables))  # noqa: B023

        snaps: list[tuple[int, torch.Tensor]] = []
        every = max(1, cfg.steps // max(1, cfg.snapshots))
        with _onednn_off() if native else contextlib.nullcontext():
            if cfg.variant in ("dlg", "idlg"):
                # torch.optim.LBFGS's iteration (tests/attacks/test_lbfgs.py), its history handled in a compact form and its
                # bookkeeping in Python numbers: a third of the cost per iteration of torch's (docs/attacks.md)
                opt = LBFGS(variables, lr=cfg.lr, max_iter=cfg.lbfgs_max_iter)

                def closure() -> torch.Tensor:
                    loss, grads = loss_and_grads()
                    for v, g in zip(variables, grads):  # noqa: B023
                        v.grad = g
                    return loss

                last_good = [v.detach().clone() for v in variables]
                for step in range(cfg.steps):
                    start_loss = opt.step(closure)
                    if not (math.isfinite(start_loss) and all(bool(torch.isfinite(v).all()) for v in variables)):
                        # L-BFGS diverged (DLG does on some starts and on noisy targets): keep the last finite
                        # iterate, so the result is the attack's best effort rather than NaN
                        with torch.no_grad():
                            for v, good in zip(variables, last_good):
                                v.copy_(good)
                        break
                    last_good = [v.detach().clone() for v in variables]
                    if progress:
                        progress(step, start_loss)
                    if step % every == 0 or step == cfg.steps - 1:
                        snaps.append((step, x_var.detach().cpu().clone()))
            else:  # ig
                adam, sched = _signed_adam(variables, cfg)
                for step in range(cfg.steps):
                    ig_loss, grads = loss_and_grads()
                    _signed_adam_step(adam, sched, variables, grads, x_var, box)
                    if progress:
                        progress(step, float(ig_loss.detach()))
                    if step % every == 0 or step == cfg.steps - 1:
                        snaps.append((step, x_var.detach().cpu().clone()))
            with torch.enable_grad():
                final = float(objective().detach())
        recovered = (F.softmax(y_var, 1).argmax(1) if labels is None else labels).detach().cpu()
        result = LeakResult(x_var.detach().cpu(), recovered, final, 0.0, snaps, "joint (DLG)" if joint else label_source)
        if best is None or final < best.loss:
            best = result
    assert best is not None  # at least one restart ran
    best.seconds = time.perf_counter() - start
    return best


def cxx_compiler() -> str | None:
    """The C++ compiler ``compile=True`` would find on a CPU ($CXX, else g++, c++, clang++), or None."""
    for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++"):
        found = shutil.which(name) if name else None
        if found:
            return found
    return None


def _check_compile(cfg: GradLeakConfig, device: torch.device | str) -> None:
    if cfg.compile and torch.device(device).type == "cpu" and cxx_compiler() is None:
        raise ConfigError("compile=True needs a C++ compiler on a CPU (torch.compile's inductor): none found (g++, c++, clang++ or $CXX)")


def _compiled_objective(
    model: nn.Module, params: Mapping[str, torch.Tensor], names: Sequence[str], local_steps: int, cfg: GradLeakConfig, taps: Sequence[LinearTap]
) -> Callable[..., tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """:func:`leak`'s objective and its gradient in the dummies ``(x, y_logit)``, in ``torch.func`` form
    (:func:`functional_gradient`, so no autograd graph is kept between calls) and compiled; ``y_fixed``
    None: the label is ``softmax(y_logit)``."""
    state = {n: p.detach() for n, p in params.items()}
    cosine, tv_weight, local_lr = cfg.variant == "ig", cfg.tv_weight, cfg.local_lr

    def loss(x: torch.Tensor, y_logit: torch.Tensor, y_fixed: torch.Tensor | None, observed: Observed) -> torch.Tensor:
        y = F.softmax(y_logit, dim=1) if y_fixed is None else y_fixed
        dummy = functional_gradient(model, state, names, x, y, local_steps, local_lr, taps)
        value = distance(dummy, observed, cosine=cosine)
        return value + tv_weight * _tv(x) if tv_weight > 0 else value

    return torch.compile(torch.func.grad_and_value(loss, argnums=(0, 1)))


def _small_convolutions(model: nn.Module, max_channels: int) -> bool:
    """Whether every convolution of ``model`` (it has one) has at most ``max_channels`` channels in and out."""
    convs = [m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)]
    return bool(convs) and all(max(m.in_channels, m.out_channels) <= max_channels for m in convs)


@contextlib.contextmanager
def _onednn_off() -> Iterator[None]:
    """oneDNN off for the block, its other settings (deterministic, TF32) untouched, then as it was."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # a ContextProp: assigning sets the flag
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


def _signed_adam(variables: list[torch.Tensor], cfg: GradLeakConfig) -> tuple[torch.optim.Adam, torch.optim.lr_scheduler.MultiStepLR]:
    """Inverting Gradients' optimiser: Adam at ``cfg.lr``, decayed x0.1 at 3/8, 5/8 and 7/8 of the steps."""
    adam = torch.optim.Adam(variables, lr=cfg.lr)
    return adam, torch.optim.lr_scheduler.MultiStepLR(adam, [cfg.steps * 3 // 8, cfg.steps * 5 // 8, cfg.steps * 7 // 8], 0.1)


def _signed_adam_step(
    adam: torch.optim.Adam,
    sched: torch.optim.lr_scheduler.MultiStepLR,
    variables: list[torch.Tensor],
    grads: Sequence[torch.Tensor],
    x: torch.Tensor,
    box: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """One step on the sign of ``grads`` (the loss's gradient in each variable), then ``x`` clamped into
    ``box`` (per channel)."""
    for v, g in zip(variables, grads, strict=True):
        v.grad = g.sign()
    adam.step()
    sched.step()
    if box is not None:
        with torch.no_grad():
            x.data = torch.max(torch.min(x, box[1].to(x.device)), box[0].to(x.device))


def _taps(
    model: nn.Module, names: Sequence[str], shape: tuple[int, ...], local_steps: int, cfg: GradLeakConfig, device: torch.device | str
) -> list[LinearTap]:
    """The linear layers matched factored (none when ``cfg.factor_linear`` is off)."""
    if not cfg.factor_linear:
        return []
    return find_linear_taps(model, names, torch.zeros(shape, device=device), local_steps, cfg.factor_min_weights)


def _param_names_all(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]


def _read_labels(
    target: Mapping[str, torch.Tensor], names: list[str], labels: torch.Tensor | None, cfg: GradLeakConfig, batch_size: int, num_classes: int
) -> tuple[torch.Tensor | None, str]:
    """The labels the variant reads off the observed last layer before optimising (None: DLG's joint
    optimisation), and where they came from."""
    if labels is not None:
        return labels, "given"
    last_weights = [n for n in names if target[n].dim() == 2 and target[n].shape[0] == num_classes]
    if cfg.variant in ("idlg", "ig") and last_weights:
        if batch_size == 1:
            return torch.tensor([idlg_label(target, last_weights[-1])]), "idlg (last-layer gradient sign)"
        if cfg.batch_label_rule == "last-layer" and batch_size <= num_classes:
            return batch_labels(target, last_weights[-1], batch_size), "last-layer row minima (Yin et al. 2021; assumes distinct labels)"
    return None, "given"


def functional_gradient(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    names: Sequence[str],
    x: torch.Tensor,
    y_soft: torch.Tensor,
    local_steps: int,
    local_lr: float,
    taps: Sequence[LinearTap] = (),
) -> dict[str, torch.Tensor | Factored]:
    """:func:`model_gradient` written with ``torch.func`` so that :func:`torch.func.vmap` can run it for
    many problems at once: the gradient of the soft-label CE in the parameters ``names`` of ``state``
    (the rest of ``state``, e.g. BatchNorm buffers, is held fixed), or for ``local_steps`` > 1 the
    unrolled update ``(params_0 - params_T) / local_lr``; the weights of ``taps`` come back factored."""
    if taps:
        tapped = {t.weight for t in taps}
        held = {n: t for n, t in state.items() if n not in names or n in tapped}

        def tapped_loss(params: dict[str, torch.Tensor], probes: dict[str, list[torch.Tensor]]) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
            with tapping(model, taps, probes) as inputs:
                logits = functional_call(model, {**held, **params}, (x,))
            return _soft_ce(logits, y_soft), inputs

        dense = {n: state[n] for n in names if n not in tapped}
        (grads, probe_grads), inputs = torch.func.grad(tapped_loss, argnums=(0, 1), has_aux=True)(dense, zero_probes(taps, x))
        return {**grads, **factored(taps, probe_grads, inputs)}
    fixed = {n: t for n, t in state.items() if n not in names}

    def loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = functional_call(model, {**fixed, **params}, (x,))
        return _soft_ce(logits, y_soft)

    start = {n: state[n] for n in names}
    current = start
    for _ in range(local_steps):
        grads = torch.func.grad(loss)(current)
        if local_steps == 1:
            return grads
        current = {n: current[n] - local_lr * grads[n] for n in names}
    return {n: (start[n] - current[n]) / local_lr for n in names}


def leak_batch(
    model: nn.Module,
    targets: Sequence[Mapping[str, torch.Tensor]],
    input_shape: tuple[int, int, int],
    num_classes: int,
    cfg: GradLeakConfig,
    *,
    seeds: Sequence[int],
    states: Sequence[Mapping[str, torch.Tensor]] | None = None,
    batch_size: int = 1,
    box: tuple[torch.Tensor, torch.Tensor] | None = None,
    device: torch.device | str = "cpu",
    progress: Callable[[int, float], None] | None = None,
) -> list[LeakResult]:
    """:func:`leak` for several targets (and all their restarts) in one vectorised optimisation.

    Every (target, restart) pair is an independent problem with the initial dummies :func:`leak` draws
    for it (same seed, same draws); one closure evaluates all of them with ``torch.func.vmap``, so its
    per-operator overhead, which dominates these small double-backward graphs on a CPU, is paid once.
    The optimiser keeps each problem apart: DLG/iDLG use :class:`attacks.lbfgs.LockstepLBFGS`
    (``torch.optim.LBFGS``'s iteration, state and history per problem),
    Inverting Gradients Adam on the sign of the gradient, which is element-wise and so exactly
    per-problem. A problem whose iterate stops being finite keeps its last finite iterate and stops,
    as in :func:`leak`. ``states``: each target's model state (parameters and buffers, e.g. the
    previous global model its sender received); None: ``model``'s own for every target. Results come
    back in target order, each with the lowest-loss restart and ``seconds`` = the batch's time / targets.
    """
    if cfg.variant not in VARIANTS:
        raise ConfigError(f"unknown gradient-leakage variant {cfg.variant!r}; accepted: {', '.join(VARIANTS)}")
    if cfg.batch_label_rule not in BATCH_LABEL_RULES:
        raise ConfigError(f"unknown batch_label_rule {cfg.batch_label_rule!r}; accepted: {', '.join(BATCH_LABEL_RULES)}")
    if cfg.compile:
        raise ConfigError("compile=True compiles leak()'s one-target closure; leak_batch has none to compile: call leak() per target")
    if len(seeds) != len(targets) or (states is not None and len(states) != len(targets)):
        raise ValueError("leak_batch needs one seed (and one state, when given) per target")
    model = model.to(device).eval()
    names = [n for n in _param_names_all(model) if all(n in t for t in targets)]
    if not names:
        raise ConfigError("the observed messages share no parameter names with the model")
    restarts = max(1, cfg.restarts)
    problems = [(t, r) for t in range(len(targets)) for r in range(restarts)]
    observed = [{n: targets[t][n].to(device).float() for n in names} for t in range(len(targets))]
    read = [_read_labels(obs, names, None, cfg, batch_size, num_classes) for obs in observed]
    joint = torch.tensor([read[t][0] is None for t, _ in problems], device=device)
    xs, ys = [], []
    for t, r in problems:
        gen = torch.Generator().manual_seed((seeds[t] * 1000 + r) % (2**63))
        xs.append(torch.randn((batch_size, *input_shape), generator=gen))
        ys.append(torch.randn((batch_size, num_classes), generator=gen))
    x = torch.stack(xs).to(device).contiguous().requires_grad_(True)
    y_logit = torch.stack(ys).to(device).contiguous().requires_grad_(bool(joint.any()))
    fixed_soft = torch.stack(
        [
            F.one_hot(lab.to(device), num_classes).float() if lab is not None else torch.zeros(batch_size, num_classes, device=device)
            for lab, _ in (read[t] for t, _ in problems)
        ]
    )
    local_steps = cast(int, cfg.local_steps)
    taps = _taps(model, names, (batch_size, *input_shape), local_steps, cfg, device)
    prepared = [observe(obs, names, taps, cfg.low_rank_rtol) for obs in observed]
    target_stack = Observed.stack([prepared[t] for t, _ in problems])
    del prepared, observed  # the stack holds what the objective reads (not G where factors replace it)
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    if states is None:
        state: dict[str, torch.Tensor] = {n: v.detach() for n, v in own.items()}
        state_dim: int | None = None
    else:
        state = {n: torch.stack([states[t][n].to(device) if n in states[t] else own[n].detach() for t, _ in problems]) for n in own}
        state_dim = 0
    cosine = cfg.variant == "ig"
    joint_mask = joint.view(-1, 1, 1)

    def per_problem(st: dict[str, torch.Tensor], xp: torch.Tensor, yp: torch.Tensor, tp: Observed) -> torch.Tensor:
        dummy = functional_gradient(model, st, names, xp, yp, local_steps, cfg.local_lr, taps)
        loss = distance(dummy, tp, cosine=cosine)
        if cfg.tv_weight > 0:
            loss = loss + cfg.tv_weight * _tv(xp)
        return loss

    batched = torch.func.vmap(per_problem, in_dims=(state_dim, 0, 0, 0))
    everyone = torch.ones(len(problems), dtype=torch.bool, device=device)

    def objective(needed: torch.Tensor = everyone) -> torch.Tensor:
        """Every needed problem's loss (the others 0): L-BFGS asks for the problems still iterating only."""
        if bool(needed.all()):
            y_soft = torch.where(joint_mask, F.softmax(y_logit, dim=2), fixed_soft)
            return batched(state, x, y_soft, target_stack)
        idx = torch.nonzero(needed).flatten()
        y_soft = torch.where(joint_mask[idx], F.softmax(y_logit[idx], dim=2), fixed_soft[idx])
        sub_state = state if state_dim is None else {n: v[idx] for n, v in state.items()}
        losses = batched(sub_state, x[idx], y_soft, target_stack.rows(idx))
        return torch.zeros(len(problems), dtype=losses.dtype, device=device).index_put((idx,), losses)

    variables = [x, y_logit] if bool(joint.any()) else [x]
    every = max(1, cfg.steps // max(1, cfg.snapshots))
    snaps: list[list[tuple[int, torch.Tensor]]] = [[] for _ in problems]
    start = time.perf_counter()
    if cfg.variant in ("dlg", "idlg"):
        opt = LockstepLBFGS(variables, lr=cfg.lr, max_iter=cfg.lbfgs_max_iter)

        def closure(needed: torch.Tensor) -> torch.Tensor:
            losses = objective(needed)
            losses.sum().backward()
            return losses

        last_good = [v.detach().clone() for v in variables]
        for step in range(cfg.steps):
            losses = opt.step(closure)
            finite = torch.isfinite(losses)
            for v in variables:
                finite &= torch.isfinite(v.detach().flatten(1)).all(1)
            bad = ~finite & ~opt.frozen
            if bool(bad.any()):  # L-BFGS diverged on these problems: back to their last finite iterate, for good
                with torch.no_grad():
                    for v, good in zip(variables, last_good):
                        v[bad] = good[bad]
                opt.freeze(bad)
            if bool(opt.frozen.all()):
                break
            live = ~opt.frozen
            for v, good in zip(variables, last_good):
                good[live] = v.detach()[live]
            if progress:
                progress(step, float(losses[live].mean()))
            if step % every == 0 or step == cfg.steps - 1:
                for i in torch.nonzero(live).flatten().tolist():
                    snaps[i].append((step, x[i].detach().cpu().clone()))
    else:  # ig
        adam, sched = _signed_adam(variables, cfg)
        for step in range(cfg.steps):
            losses = objective()
            grads = torch.autograd.grad(losses.sum(), variables)  # the problems are independent: sum = each one's own
            _signed_adam_step(adam, sched, variables, grads, x, box)
            if progress:
                progress(step, float(losses.detach().mean()))
            if step % every == 0 or step == cfg.steps - 1:
                for i in range(len(problems)):
                    snaps[i].append((step, x[i].detach().cpu().clone()))
    with torch.enable_grad():
        final = objective().detach().cpu()
    seconds = (time.perf_counter() - start) / len(targets)
    results: list[LeakResult] = []
    for t in range(len(targets)):
        best_i = -1
        for i, (tt, _) in enumerate(problems):  # restarts in order; the first of equal losses wins, as in leak()
            if tt == t and (best_i < 0 or float(final[i]) < float(final[best_i])):
                best_i = i
        labels, source = read[t]
        recovered = F.softmax(y_logit[best_i], 1).argmax(1) if labels is None else labels
        results.append(
            LeakResult(
                x[best_i].detach().cpu(),
                recovered.detach().cpu(),
                float(final[best_i]),
                seconds,
                snaps[best_i],
                "joint (DLG)" if labels is None else source,
            )
        )
    return results


@dataclass
class _Problem:
    """One target, resolved (:meth:`GradientLeakage.problem`)."""

    target: Target
    model: nn.Module
    observed: dict[str, torch.Tensor]
    batch: int
    cfg: GradLeakConfig
    note: str
    seed: int


def _box(ds: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel range of valid images in the normalised input space."""
    mean = torch.tensor(ds["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(ds["std"]).view(1, -1, 1, 1)
    return (0 - mean) / std, (1 - mean) / std


class GradientLeakage(Attack):
    """DLG / iDLG / Inverting Gradients on a captured parameter-like message (gradients, updates, models,
    shared sub-models, layers).

    Knowledge: the model architecture and the state the sender last received (both in the server's
    hands, or a ring neighbour's), plus the local hyperparameters the server set. What the method
    declares (:class:`privfl.methods.LeakageContext`) says which received message is the previous state
    and which module the tensors parameterise. What is matched, by the kind's form
    (:class:`privfl.kinds.ParamForm`):

    - gradient (``grad``, FedSGD): the gradient itself; the batch is the message's ``batch_size``;
    - update (``update``, FedNova's d = (x - x_k) / a): d * a / (lr * tau), the mean local gradient
      (d / lr when a = tau, plain SGD), or d * a / lr against ``local_steps`` unrolled steps;
    - parameters (``model``, ``small_model``, ``layer``, ``learngene``...): (x_prev - x_k) / (lr * tau),
      the mean local gradient over tau = local_epochs * ceil(n / batch_size) steps, or (x_prev - x_k) / lr
      against ``local_steps`` unrolled steps (Inverting Gradients' FedAvg variant).

    For updates and parameters the batch is the client's data (``max_batch`` caps the images rebuilt).
    """

    consumes = frozenset({str(Family.GRADIENT), str(Family.PARAMETERS)})
    needs = Knowledge(previous_state=True, local_hyperparameters=True)
    threat_model = "curious-server-previous-state"
    Config = GradLeakConfig
    variant: ClassVar[str] = "dlg"

    def __init__(self, config: GradLeakConfig | None = None, **kwargs) -> None:
        super().__init__(config, **kwargs)
        _check_compile(self.config, self.device)  # before the attack creates anything

    @classmethod
    def default_config(cls) -> GradLeakConfig:
        return GradLeakConfig.preset(cls.variant)

    def messages_of(self, view: AttackerView, kind: str, rnd: int | None = None, clients=None) -> list[dict]:
        """Only what clients send (uploads and peer messages): a server's broadcast has no client data."""
        return [r for r in super().messages_of(view, kind, rnd, clients) if r["direction"] in ("up", "peer")]

    def plan_messages(self, view: AttackerView, kind: str, rnd: int, records: list[dict], selection: Selection) -> list[Target]:
        spec = KINDS.get(kind)
        key = "batch_size" if spec.form is ParamForm.GRADIENT else "num_samples"
        targets, reasons, fixes = [], [], []
        names_by_client: dict[str, set[str]] = {}
        for rec in records:
            if key not in rec.get("meta", {}):
                reasons.append(f"message {rec['seq']} has no meta {key!r}: the batch behind it is unknown")
                fixes.append(f"send meta[{key!r}] with every {kind} upload")
                continue
            try:
                _, prev = previous_state(view, rec)
            except AttackNotApplicable as exc:
                reasons.append(str(exc))
                fixes.append(exc.fix or KNOWLEDGE_FIXES["previous_state"])
                continue
            client = rec["sender"]
            if client not in names_by_client:
                names_by_client[client] = module_tensor_names(view, rec)
            module_names = names_by_client[client]
            ctx = context_of(view, kind)
            where = f"module {ctx.module!r}" if ctx.module else "the whole client model"
            if not module_names & set(prev):
                reasons.append(
                    f"the previous state of {kind} message {rec['seq']} shares no tensor names with {where} that "
                    f"{view.info['method']} declares for it (prefix {ctx.prefix!r}): nothing to attack but random weights"
                )
                fixes.append(
                    f"declare leakage = {{{kind!r}: LeakageContext(module=..., prefix=...)}} naming the submodule whose parameters it carries"
                )
                continue
            target = Target(kind, rnd, client, rec, view)
            known = module_names & (set(prev) | set(rec["tensors"]))
            if known != module_names:  # part of the differentiated module was never transmitted: a guess, said so
                target.payload["warning"] = (
                    f"{len(module_names - known)} of {len(module_names)} tensors of {where} were never transmitted to the attacker "
                    "and stay at its random initialisation: the reconstruction is a guess"
                )
            targets.append(target)
        if not targets:
            unique = list(dict.fromkeys(reasons))
            raise AttackNotApplicable(unique[0] if len(unique) == 1 else "; ".join(unique), fixes[0] if fixes else "")
        return targets

    def steps_for(self, targets) -> int:
        return len(targets) * self.config.steps

    def prepare(self, targets) -> None:
        for t in targets:
            t.view.load(t.record)
            previous_state(t.view, t.record)

    def _local_steps(self, record: dict, cfg: dict, n: int) -> int:
        steps = self.config.local_steps
        if steps == "auto":
            meta = record.get("meta", {})
            tau = meta.get("local_steps", meta.get("tau"))
            return int(tau) if isinstance(tau, int) and tau > 0 else max(1, cfg["local_epochs"] * -(-n // cfg["batch_size"]))
        return int(steps)

    def observation(
        self, view: AttackerView, record: dict, prev: dict[str, torch.Tensor], local_steps: int
    ) -> tuple[dict[str, torch.Tensor], int, float, str]:
        """(the gradient-like tensors to match, the batch they stand for, the lr, how they were derived)."""
        tensors = view.load(record)
        meta, cfg = record.get("meta", {}), view.config
        form = KINDS.get(record["kind"]).form
        lr = float(meta.get("lr", cfg["lr"]))
        if form is ParamForm.GRADIENT:
            return tensors, int(meta["batch_size"]), lr, "the gradient as sent"
        n = int(meta["num_samples"])
        tau = max(1, cfg["local_epochs"] * -(-n // cfg["batch_size"]))
        floats = {k: v.float() for k, v in tensors.items() if v.is_floating_point()}
        if form is ParamForm.UPDATE:
            a = float(meta.get("a", 1.0))
            if local_steps > 1:  # the unrolled objective models the steps itself: match (prev - new) / lr = d * a / lr
                return {k: v * (a / lr) for k, v in floats.items()}, n, lr, f"update d * a / lr, matched by {local_steps} unrolled steps"
            scale = a / float(meta.get("tau", tau))
            if scale == 1.0:
                return {k: v / lr for k, v in floats.items()}, n, lr, "update d / lr (mean local gradient)"
            return {k: v * (scale / lr) for k, v in floats.items()}, n, lr, "update d * a / (lr * tau) (mean local gradient)"
        kind = record["kind"]
        if local_steps > 1:
            return (
                {k: (prev[k].float() - v) / lr for k, v in floats.items() if k in prev},
                n,
                lr,
                f"(previous {kind} - {kind}) / lr, matched by {local_steps} unrolled steps",
            )
        return (
            {k: (prev[k].float() - v) / (lr * tau) for k, v in floats.items() if k in prev},
            n,
            lr,
            f"(previous {kind} - {kind}) / (lr * {tau} local steps)",
        )

    def problem(self, target: Target) -> _Problem:
        """Everything one target's optimisation needs: its module at the sender's previous state, the
        tensors to match, the batch they stand for, and the resolved local steps and lr."""
        view, record = target.view, target.record
        assert record is not None  # plan_messages makes targets of captured messages only
        _, prev = previous_state(view, record)
        model = leakage_module(view, record, self.seed)
        own = model.state_dict()
        shared = {k: v for k, v in model.to_module_names(prev).items() if k in own}
        model.load_state_dict(shared, strict=False)
        meta = record.get("meta", {})
        local_steps = self._local_steps(record, view.config, int(meta.get("batch_size", meta.get("num_samples", 1))))
        observed, n, lr, note = self.observation(view, record, prev, local_steps)
        names = {n_ for n_, _ in model.named_parameters()}
        observed = {k: v for k, v in model.to_module_names(observed).items() if k in names}
        cfg = dataclasses.replace(self.config, local_steps=local_steps, local_lr=lr)
        return _Problem(
            target, model, observed, max(1, min(n, self.config.max_batch)), cfg, note, derive_seed(self.seed, self.variant, record["seq"])
        )

    def run(self, target: Target, progress: Progress | None = None) -> Reconstruction:
        return self._run_one(self.problem(target), progress)

    def _run_one(self, prob: _Problem, progress: Progress | None) -> Reconstruction:
        target, ds = prob.target, prob.target.view.dataset
        hook = (lambda step, loss: progress(target.client, step, prob.cfg.steps, loss)) if progress else None
        result = leak(
            prob.model,
            prob.observed,
            (ds["channels"], ds["image_size"], ds["image_size"]),
            ds["num_classes"],
            prob.cfg,
            batch_size=prob.batch,
            box=_box(ds),
            seed=prob.seed,
            device=self.device,
            progress=hook,
        )
        return self._reconstruction(prob, result)

    def run_batch(self, targets: Sequence[Target], progress: Progress | None = None) -> list[Reconstruction]:
        """Targets that share a module structure, batch, local steps and lr are optimised ``config.batch``
        at a time by :func:`leak_batch` (each from its own previous state, every restart a problem of its
        own); a target alone with one restart, and every target with ``compile``, goes through :func:`leak`."""
        if self.config.batch <= 1 or self.config.compile or (len(targets) <= 1 and self.config.restarts <= 1):
            return [self.run(t, progress) for t in targets]
        groups: dict[tuple, list[_Problem]] = defaultdict(list)
        for t in targets:
            prob = self.problem(t)
            layout = tuple((k, tuple(v.shape), str(v.dtype)) for k, v in prob.model.state_dict().items())
            groups[(type(prob.model).__qualname__, layout, prob.batch, prob.cfg.local_steps, prob.cfg.local_lr)].append(prob)
        done: dict[int, Reconstruction] = {}
        for members in groups.values():
            for begin in range(0, len(members), self.config.batch):
                chunk = members[begin : begin + self.config.batch]
                if len(chunk) == 1 and self.config.restarts <= 1:  # nothing to optimise together
                    done[id(chunk[0].target)] = self._run_one(chunk[0], progress)
                    continue
                first, ds = chunk[0], chunk[0].target.view.dataset
                label = f"{len(chunk)} targets ({', '.join(sorted({p.target.client for p in chunk}))})"

                def hook(step: int, loss: float, label: str = label, n: int = len(chunk), steps: int = first.cfg.steps) -> None:
                    for _ in range(n):  # the bar counts steps per target
                        assert progress is not None
                        progress(label, step, steps, loss)

                results = leak_batch(
                    first.model,
                    [p.observed for p in chunk],
                    (ds["channels"], ds["image_size"], ds["image_size"]),
                    ds["num_classes"],
                    first.cfg,
                    seeds=[p.seed for p in chunk],
                    states=[p.model.state_dict() for p in chunk],
                    batch_size=first.batch,
                    box=_box(ds),
                    device=self.device,
                    progress=hook if progress else None,
                )
                for prob, result in zip(chunk, results):
                    done[id(prob.target)] = self._reconstruction(prob, result, together=len(chunk))
        return [done[id(t)] for t in targets]

    def _reconstruction(self, prob: _Problem, result: LeakResult, together: int = 1) -> Reconstruction:
        target, ds = prob.target, prob.target.view.dataset
        assert target.record is not None  # plan_messages makes targets of captured messages only
        mean = torch.tensor(ds["mean"]).view(1, -1, 1, 1)
        std = torch.tensor(ds["std"]).view(1, -1, 1, 1)
        to01 = lambda x: (x * std + mean).clamp(0, 1)  # noqa: E731
        ctx = context_of(target.view, target.record["kind"])
        return Reconstruction(
            target,
            to01(result.images),
            result.loss,
            result.seconds,
            result.labels,
            [(s, to01(x)) for s, x in result.snapshots],
            {
                "label_source": result.label_source,
                "batch_size": prob.batch,
                "target_note": prob.note,
                "local_steps": prob.cfg.local_steps,
                "optimised_with": together,
                **({"approximation": ctx.note} if ctx.note else {}),
                **({"warning": target.payload["warning"]} if "warning" in target.payload else {}),
            },
        )

    def protocol(self) -> dict:
        return {"config": self.config.as_dict()}


@register_attack("dlg")
class DLG(GradientLeakage):
    __doc__ = GradientLeakage.__doc__
    variant = "dlg"
    paper = "Zhu et al., Deep Leakage from Gradients, NeurIPS 2019"


@register_attack("idlg")
class IDLG(GradientLeakage):
    __doc__ = GradientLeakage.__doc__
    variant = "idlg"
    paper = "Zhao et al., iDLG, arXiv 2001.02610"


@register_attack("ig")
class InvertingGradients(GradientLeakage):
    __doc__ = GradientLeakage.__doc__
    variant = "ig"
    paper = "Geiping et al., Inverting Gradients, NeurIPS 2020"


__all__ = [
    "DLG",
    "IDLG",
    "GradLeakConfig",
    "GradientLeakage",
    "InvertingGradients",
    "LeakResult",
    "batch_labels",
    "functional_gradient",
    "idlg_label",
    "leak",
    "leak_batch",
    "model_gradient",
]
