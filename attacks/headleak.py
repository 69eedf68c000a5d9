"""Head and last-layer leakage: per-class feature directions read off a classifier's update, then inverted.

For a classifier layer ``z = W f + b`` trained with cross-entropy, one sample's gradient is
``dL/dW_c = (p_c - y_c) f`` and ``dL/db_c = p_c - y_c``. Over a batch, row c of ``dW`` is
``sum_i (p_ic - y_ic) f_i`` and ``dW_c / db_c`` is a weighted mean of the batch's features, the weights
``(p_ic - y_ic) / sum_j (p_jc - y_jc)`` summing to one: for a batch of one it is exactly that sample's
feature (the observation behind Geiping et al., "Inverting Gradients", NeurIPS 2020, Sec. 4, and Phong
et al., "Privacy-Preserving Deep Learning via Additively Homomorphic Encryption", IEEE TIFS 2018, Sec. 3);
for a class c in the batch, its own samples dominate (their weight ``1 - p_ic`` against the others'
``p_ic``). ``dW`` has rank at most C: C directions, one per class, are all it holds about the features. A
full-parameter upload after several local steps gives ``previous - new = lr * sum of the steps' gradients``
under plain SGD, so the same ratio is a weighted mean of the class's features over the local training, at
the states the model passed through: a prototype the client never meant to send. Recovering per-class
features from head gradients and inverting them is the attack of "Maui" (2025, arXiv 2509.11451).

The recovered vector of class c is inverted through the feature map that produced it (everything before
the classifier layer, at the state the client started from) with the learned decoder of
:mod:`attacks.learned`, trained on population data on the class-mean construction. A classifier row
without a bias gives a direction only; it is scaled to the mean norm of the class's population features
(reported). Classes are those the row's signs prove present (:func:`attacks.labels.present_rows`), the
most strongly present first.

Scored like the message's family (gradients and parameters): each image against its best match among the
message's samples of its class, beside the priors (the class mean of the class it was read for).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attacks.base import AttackNotApplicable, Progress, Reconstruction, Selection, Target, register_attack
from attacks.context import leakage_module, previous_record, previous_state
from attacks.labels import classifier_layer, present_rows
from attacks.learned import DecoderAttack, LearnedInversionConfig, population_of
from attacks.threat import Knowledge
from privfl.errors import ConfigError
from privfl.kinds import KINDS, Family, ParamForm
from privfl.run import AttackerView
from privfl.seeding import derive_seed, torch_generator

__all__ = ["HeadFeatureInversion", "HeadInversionConfig", "class_features"]

FEATURES_FROM = ("previous", "new")


@dataclass
class HeadInversionConfig(LearnedInversionConfig):
    """The learned decoder's settings (:class:`attacks.learned.LearnedInversionConfig`) on the class-mean
    construction, plus which model state the features are read through."""

    #: auto: ``sample`` for a one-sample gradient (the ratio is that sample's feature), else ``class_mean``
    aggregation: str = "auto"
    #: ``previous``: the state the client started from (exact for a one-batch gradient); ``new``: the
    #: state it uploaded (full parameters only)
    features_from: str = "previous"
    #: a bias entry closer to zero than this share of the largest one gives no ratio (its weights' sum vanishes)
    bias_tolerance: float = 1e-3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.features_from not in FEATURES_FROM:
            raise ConfigError(f"features_from must be one of {', '.join(FEATURES_FROM)}, got {self.features_from!r}")


def class_features(weight: torch.Tensor, bias: torch.Tensor | None, tolerance: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(classes (k,), feature vectors (k, d), how) from classifier rows in gradient direction (a gradient,
    or previous - new): the classes proven present, most negative bias (or row minimum) first, and
    ``dW_c / db_c`` for each; without a usable bias, the negated row (a direction, scaled by the caller)."""
    w = weight.double()
    present = present_rows(w, bias)
    if bias is not None:
        b = bias.double()
        usable = present & (b.abs() > tolerance * float(b.abs().max()))  # the weights sum to one whatever db_c's sign
        order = torch.argsort(b)  # most negative first: the classes the batch holds most of
        classes = torch.tensor([int(c) for c in order if usable[c]], dtype=torch.long)
        if len(classes):
            return classes, (w[classes] / b[classes, None]).float(), "dW_c / db_c (a weighted mean of the class's features)"
    order = torch.argsort(w.min(dim=1).values)
    classes = torch.tensor([int(c) for c in order if present[c]], dtype=torch.long)
    return classes, (-w[classes]).float(), "-dW_c (direction only: no usable bias)"


def _classifier_module(module: nn.Module, prefix: str, weight_name: str) -> nn.Module:
    """The submodule of a LeakageModule that owns the message's classifier weight."""
    path = "body." + weight_name[len(prefix) :].removesuffix(".weight").removesuffix("weight").rstrip(".")
    try:
        return module.get_submodule(path)
    except AttributeError:
        raise AttackNotApplicable(f"the classifier {weight_name!r} is not a module of the declared model") from None


class FeatureMap:
    """Normalised images -> the input of the classifier layer, through a module at a known state."""

    def __init__(self, module: nn.Module, classifier: nn.Module):
        self.module, self.classifier = module, classifier

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        seen: list[torch.Tensor] = []
        handle = self.classifier.register_forward_hook(lambda _m, inputs, _out: seen.append(inputs[0]))
        try:
            self.module(x)
        finally:
            handle.remove()
        return seen[-1].flatten(1)


@register_attack("invert-head")
class HeadFeatureInversion(DecoderAttack):
    """Per-class features from a client's classifier update, inverted with a decoder trained on population
    data through the model the update was computed at (module docstring)."""

    consumes = frozenset({str(Family.GRADIENT), str(Family.PARAMETERS)})
    needs = Knowledge(previous_state=True, population=True)
    threat_model = "curious-server-previous-state-population"
    paper = (
        "Geiping et al., Inverting Gradients, NeurIPS 2020, Sec. 4 (features of a biased linear layer from its gradient); "
        "Maui, arXiv 2509.11451 (head updates -> features -> images); He, Zhang, Lee, ACSAC 2019 (learned inversion)"
    )
    Config = HeadInversionConfig

    def messages_of(self, view: AttackerView, kind: str, rnd: int | None = None, clients: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """What clients send (a server's broadcast holds no client's batch)."""
        return [r for r in super().messages_of(view, kind, rnd, clients) if r["direction"] in ("up", "peer")]

    def plan_messages(self, view: AttackerView, kind: str, rnd: int, records: list[dict[str, Any]], selection: Selection) -> list[Target]:
        """One target per class the message's classifier rows prove present (at most ``max_targets``)."""
        num_classes = int(view.dataset["num_classes"])
        targets: list[Target] = []
        reasons: list[str] = []
        for rec in records:
            layer = classifier_layer(rec["tensors"], num_classes)
            if layer is None:
                reasons.append(f"{kind} message {rec['seq']} carries no classifier layer ({num_classes} rows, named '...weight')")
                continue
            if previous_record(view, rec) is None:
                reasons.append(f"the state {rec['sender']} trained from before message {rec['seq']} was never captured")
                continue
            classes, vectors, how = self.directions(view, rec, layer)
            single = KINDS.get(kind).form is ParamForm.GRADIENT and rec.get("meta", {}).get("batch_size") == 1
            for c, v in list(zip(classes.tolist(), vectors))[: selection.max_targets]:
                name = view.dataset["class_names"][c]
                payload = {"vector": v, "weight": layer[0], "rule": how, "single": single}
                targets.append(Target(kind, rnd, rec["sender"], rec, view, row=c, label=name, class_id=c, payload=payload))
        if not targets and reasons:
            raise AttackNotApplicable("; ".join(dict.fromkeys(reasons)))
        return targets

    def directions(self, view: AttackerView, rec: dict[str, Any], layer: tuple[str, str | None]) -> tuple[torch.Tensor, torch.Tensor, str]:
        """The classes and feature vectors of one message's classifier, in gradient direction."""
        tensors = view.load(rec)
        weight, bias = layer
        form = KINDS.get(rec["kind"]).form
        w, b = tensors[weight], None if bias is None else tensors[bias]
        if form is ParamForm.PARAMETERS:
            _, prev = previous_state(view, rec)
            if weight not in prev:
                raise AttackNotApplicable(f"the previous state of message {rec['seq']} lacks {weight!r}")
            w = prev[weight].to(w.dtype) - w
            b = None if b is None or bias not in prev else prev[bias].to(b.dtype) - b
        return class_features(w, b, self.config.bias_tolerance)

    def resolve(self, target: Target) -> torch.Tensor:
        return target.payload["vector"]

    def feature_map(self, target: Target) -> FeatureMap:
        """The module before the classifier, at the state the config names (previous: the state received)."""
        view, rec = target.view, target.record
        assert rec is not None
        module = leakage_module(view, rec, self.seed)
        _, prev = previous_state(view, rec)
        state = dict(prev)
        if self.config.features_from == "new":
            if KINDS.get(rec["kind"]).form is not ParamForm.PARAMETERS:
                raise ConfigError(f"features_from=new needs full parameters; {rec['kind']} is a {KINDS.get(rec['kind']).form}")
            state.update(view.load(rec))
        own = module.state_dict()
        mapped = {k: v for k, v in module.to_module_names(state).items() if k in own}
        body = [n for n, _ in module.named_parameters() if n.startswith("body.")]
        unknown = [n for n in body if n not in mapped]
        if unknown:
            raise AttackNotApplicable(
                f"{len(unknown)} of the model's {len(body)} parameters before and around the classifier never crossed the wire "
                f"(e.g. {unknown[0].removeprefix('body.')}): the features cannot be computed (a head-only upload needs the client's body)"
            )
        module.load_state_dict(mapped, strict=False)
        module.to(self.device).eval()
        for p in module.parameters():
            p.requires_grad_(False)
        ctx = view.leakage_context(rec["kind"])
        return FeatureMap(module, _classifier_module(module, ctx.prefix if ctx else "", target.payload["weight"]))

    def run_batch(self, targets: Sequence[Target], progress: Progress | None = None) -> list[Reconstruction]:
        """One decoder per message (its feature map), shared by the message's classes."""
        out: list[Reconstruction] = []
        by_message: dict[int, list[Target]] = {}
        for t in targets:
            by_message.setdefault(int(t.message_seq or 0), []).append(t)
        for seq, members in by_message.items():
            pop = population_of(members, self.name)
            feature_map = self.feature_map(members[0])
            mean, std, _ = self.normalisation(members[0].view)
            seed = derive_seed(self.seed, "head", seq)
            pairs, labels = self.population_pairs(feature_map, pop, mean, std, torch_generator(seed, "shifts"))
            if members[0].payload["rule"].startswith("-dW_c"):  # a direction only: give it the class's feature norm
                for t in members:
                    own = pairs.reps[labels == t.class_id]
                    norm = float(own.norm(dim=1).mean()) if len(own) else float(pairs.reps.norm(dim=1).mean())
                    t.payload["vector"] = t.payload["vector"] / t.payload["vector"].norm().clamp_min(1e-12) * norm
            label = f"{members[0].client} r{members[0].round} seq{seq}"
            construction = self.config.aggregation
            if construction == "auto":
                construction = "sample" if members[0].payload["single"] else "class_mean"
            recons = self.invert_group(feature_map, members, pairs, labels, label, seed, progress, construction=construction)
            for r in recons:
                r.labels = torch.tensor([int(r.target.class_id or 0)])
                r.notes.update(rule=r.target.payload["rule"], aggregate=True, features_from=self.config.features_from)
            out.extend(recons)
        return out
