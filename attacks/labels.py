"""Label inference: which classes a client holds, and in what proportion, from what it sends.

Two attacks, both ``produces = {"labels"}`` (scored by :class:`attacks.scoring.LabelScorer`: class
precision/recall against the label histogram of the samples behind the message, and the L1 distance
of the normalised histograms):

``labels`` (eavesdropper: the messages and nothing else) reads what a message reveals by itself.

- Representations (per-sample and aggregate families) and logits, by the kind's declaration
  (:class:`privfl.kinds.ArtifactKind` ``classes`` / ``soft_label`` / aux tensors), never by kind name:
  per-row class ids of per-sample rows (``rep`` labels, per-sample ``logits`` with ``labels``) give the
  exact histogram; the class ids of per-class rows (prototypes, per-class logits) give the set of
  classes present, and with an aux ``counts`` tensor the exact histogram; a soft label (FedRE's
  entangled label, [001] Eq. 6) is nonzero exactly on the classes whose samples got weight, but its
  values are random RE weights, not class shares, so only the set is claimed; per-sample logits with
  no labels give the histogram of their argmax, an estimate (as good as the model's accuracy).
- Gradients and updates (``grad``, ``update`` and any kind of those forms), self-contained, see
  "The classifier-row rules" below.

``labels-delta`` (curious server holding the previous state): full-parameter uploads (``model``,
``head``, ``small_model``, ``learngene``-like kinds) read as previous - new, which is lr times the sum
of the local gradients under plain SGD, with the same rules.

The classifier-row rules
------------------------
The classifier is the message's last 2-D float tensor with C rows (C = the dataset's classes) whose
name ends in ``weight``, with its bias when one of shape (C,) sits beside it. For softmax cross-entropy
over a batch of B samples with features h_i before the classifier, the gradient of row c is
``dW_c = sum_i (p_ic - y_ic) h_i / B`` and of its bias ``db_c = mean_i p_ic - n_c / B``.

- Presence (iDLG, Zhao et al., arXiv 2001.02610, 2020, for one sample; the batch form of Yin et al.,
  "See through Gradients", CVPR 2021): when the features are non-negative (a ReLU before the head;
  ``cnn4`` and the ``ap``/``mp`` mappings keep it), every entry of dW_c is >= 0 unless class c is in the
  batch, so a row with a negative entry proves class c present. A negative bias entry proves it too,
  and needs only softmax cross-entropy (db_c < 0 means n_c / B > mean_i p_ic > 0). Plain SGD keeps both
  signs over any number of local steps (each step moves an absent class's row one way), so the rules
  read a FedNova update d = (prev - new) / a (the gradient direction is d: a > 0) and prev - new of a
  full-parameter upload alike. They never name an absent class under those assumptions; they may miss
  a present class whose row stays non-negative (a class with few samples the model already predicts).
  SGD momentum, weight decay, a proximal term, noise (a defense), a learned linear mapping or a
  normalisation layer before the head void the no-false-positive guarantee.
- Proportions, a count estimator after the label-leakage literature (the bias rule of Geng et al.,
  "Towards General Deep Leakage in Federated Learning", 2021; the weight-row "impact" of Wainakh et
  al., "User-Level Label Leakage from Gradients in Federated Learning" (LLG), PoPETs 2022; see also
  Dang et al., "Revealing and Protecting Labels in Distributed Training", NeurIPS 2021, on how the
  last layer's gradient reveals a batch's labels): ``n_c / B = pbar_c - db_c``, with pbar
  the mean softmax output over the batch, unknown to the attacker, who holds no model here. Our
  estimate (``mean_probs="interpolated"``, the default) assumes pbar moves from uniform (an untrained
  model) towards the client's class shares as it trains, ``pbar = alpha / C + (1 - alpha) * shares``,
  which gives ``shares_c = 1/C - db_c / alpha``. alpha is fitted where pbar is observable: on a class
  the sign rules call absent n_c = 0, so pbar_c = db_c and alpha = C * mean of db over those classes
  (alpha = 1 when every class is present). At an untrained model alpha is about 1 and the rule is
  the literature's pbar = 1/C (``mean_probs="uniform"``); a trained model's bias gradient shrinks
  towards 0 (its mean prediction approaches the shares) and dividing by alpha undoes that shrinkage
  as far as the linear model holds. Shares are clamped at 0, restricted to the classes proven present
  and normalised; with the batch size (or the upload's sample count) known, ``integer_counts``
  rounds them to counts of at least one per present class (largest remainders). Without a bias the
  row sums stand in for db, divided by an estimated feature scale (LLG's "impact"): the one that
  gives the absent classes a mean probability of 1/C (so alpha is 1 by construction); with no absent
  class that scale is unknown and only the set is claimed.
  alpha absorbs any positive factor on the rows, so with an absent class the estimate needs neither
  the learning rate nor the number of local steps; with every class present (alpha = 1) it needs the
  mean local gradient: d * a / (lr * tau) for an update (lr and tau from the message's meta; an
  eavesdropper has no other source, so without them only the set is claimed), (prev - new) /
  (lr * tau) for ``labels-delta`` (lr and tau from the meta, else the run's local hyperparameters).
  Over an epoch the bias row of the mean local gradient is mean_t pbar^(t) - n_c / n,
  so the same rule estimates the shares of the client's whole training split. Every proportion is an
  estimate: the report says how each was made (notes ``rule`` and ``proportions``); the known-answer
  tests (tests/attacks/test_label_inference.py) measure it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from attacks.base import Attack, AttackNotApplicable, Progress, Reconstruction, Selection, Target, register_attack
from attacks.context import context_of, previous_record, previous_state
from attacks.gradleak import batch_labels
from attacks.threat import Knowledge
from privfl.errors import ConfigError
from privfl.kinds import KINDS, ArtifactKind, Family, ParamForm
from privfl.run import AttackerView, client_of

MEAN_PROBS = ("interpolated", "uniform")
_CLASSIFIER_PAPERS = (
    "Zhao et al., iDLG, arXiv 2001.02610 (sign rule); Yin et al., See through Gradients, CVPR 2021 (batch form); "
    "Wainakh et al., LLG, PoPETs 2022 and Geng et al. 2021 (counts from the bias gradient)"
)


@dataclass
class LabelConfig:
    #: a classifier row counts as negative below -tolerance * max |entry| (0: any negative entry; raise it
    #: against noise, at the cost of recall)
    tolerance: float = 0.0
    #: the mean softmax output pbar the count estimator needs: interpolated (alpha/C + (1 - alpha) * the
    #: shares, alpha fitted on the absent classes) or uniform (1/C, an untrained model)
    mean_probs: str = "interpolated"
    #: with the batch size (or the upload's sample count) known, round shares to integer counts, at
    #: least one per class proven present
    integer_counts: bool = True
    #: ``grad`` with meta batch_size B <= C: name the B rows with the most negative minima instead of
    #: the sign rule (Yin et al.; exact for distinct labels, a wrong extra class for each repeat)
    batch_rule: bool = False
    #: soft labels: an entry counts as a class present above soft_tolerance * max entry
    soft_tolerance: float = 0.0


@dataclass
class LabelEstimate:
    """What one message says about the classes behind it."""

    labels: torch.Tensor  # (k,) classes claimed present
    distribution: torch.Tensor | None  # (C,) shares summing to 1, or None (only the set is claimed)
    rule: str  # how the set was read
    proportions: str  # how the shares were read, or why none are claimed
    warning: str = ""  # what voids a guarantee in this message's setting
    approximation: str = ""  # what the method's declared context says the module's loss leaves out


# ------------------------------------------------------------------------------------------ index helpers
def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "half", "double"))


def _is_int(dtype: str) -> bool:
    return dtype.startswith(("int", "uint", "long", "short"))


def classifier_layer(tensors: Mapping[str, Mapping[str, Any]], num_classes: int) -> tuple[str, str | None] | None:
    """(weight name, bias name or None) of the classifier in an index record's ``tensors`` (name ->
    shape, dtype): the last 2-D float tensor with ``num_classes`` rows whose name ends in ``weight``,
    and the (C,) float tensor named like it with ``bias``; None when there is none."""
    weights = [
        n for n, t in tensors.items() if n.endswith("weight") and len(t["shape"]) == 2 and t["shape"][0] == num_classes and _is_float(str(t["dtype"]))
    ]
    if not weights:
        return None
    weight = weights[-1]
    bias = weight[: -len("weight")] + "bias"
    b = tensors.get(bias)
    ok = b is not None and list(b["shape"]) == [num_classes] and _is_float(str(b["dtype"]))
    return weight, bias if ok else None


def _int_rows(tensors: Mapping[str, Mapping[str, Any]], name: str | None) -> bool:
    t = tensors.get(name) if name is not None else None
    return t is not None and len(t["shape"]) == 1 and _is_int(str(t["dtype"]))


def representation_reading(spec: ArtifactKind, tensors: Mapping[str, Mapping[str, Any]], num_classes: int) -> dict[str, str]:
    """How a representation or logits message names its classes, from the kind's declaration and the
    message's tensor names/shapes: ``{"read": histogram|counts|set|soft|argmax, "rows": tensor, ...}``.
    Raises :class:`AttackNotApplicable` (one line) when it names none."""
    aux_ints = [n for n in spec.aux_names if n != spec.classes and n != "counts" and _int_rows(tensors, n)]
    counts = "counts" if "counts" in spec.aux_names and _int_rows(tensors, "counts") else None
    has_classes = _int_rows(tensors, spec.classes)
    vectors = tensors.get(spec.vectors) if spec.vectors is not None else None
    if spec.family is Family.PER_SAMPLE_REPRESENTATION:
        rows = spec.classes if has_classes else (aux_ints[0] if aux_ints else None)
        if rows is not None:
            return {"read": "histogram", "rows": rows}
    elif spec.family is Family.LOGITS and aux_ints and vectors is not None and len(vectors["shape"]) == 2:
        rows_per_sample = [n for n in aux_ints if tensors[n]["shape"][0] == vectors["shape"][0]]
        if rows_per_sample:
            return {"read": "histogram", "rows": rows_per_sample[0]}
    if spec.family is not Family.PER_SAMPLE_REPRESENTATION and has_classes:
        assert spec.classes is not None  # has_classes says it is present
        if counts is not None and tensors[counts]["shape"] == tensors[spec.classes]["shape"]:
            return {"read": "counts", "rows": spec.classes, "counts": counts}
        return {"read": "set", "rows": spec.classes}
    if spec.soft_label is not None and spec.soft_label in tensors:
        return {"read": "soft", "rows": spec.soft_label}
    if spec.family is Family.LOGITS and vectors is not None and len(vectors["shape"]) == 2 and vectors["shape"][1] == num_classes:
        assert spec.vectors is not None
        return {"read": "argmax", "rows": spec.vectors}
    named = [n for n in (spec.classes, spec.soft_label) if n is not None]
    what = f"none of its class tensors ({', '.join(named)})" if named else "no class ids, counts or soft label (its kind declares none)"
    raise AttackNotApplicable(f"{spec.name} messages carry {what}: nothing in them names a class")


# ------------------------------------------------------------------------------------------ the rules
def read_representation(
    tensors: Mapping[str, torch.Tensor], reading: Mapping[str, str], num_classes: int, soft_tolerance: float = 0.0
) -> LabelEstimate:
    """The classes (and shares) a representation or logits message states (see the module docstring)."""
    read, rows = reading["read"], tensors[reading["rows"]]
    hist = torch.zeros(num_classes, dtype=torch.float64)
    if read in ("histogram", "argmax"):
        ids = (rows.argmax(dim=1) if read == "argmax" else rows).long().flatten()
        ids = ids[(ids >= 0) & (ids < num_classes)]
        hist += torch.bincount(ids, minlength=num_classes)[:num_classes].double()
        rule = "argmax of per-sample logits" if read == "argmax" else f"per-sample class ids ({reading['rows']})"
        how = "histogram of the argmax: an estimate, as good as the model's accuracy" if read == "argmax" else "exact histogram"
        return _estimate(hist, rule, how, "argmax labels are the model's predictions, not the labels" if read == "argmax" else "")
    if read == "counts":
        ids, counts = rows.long().flatten(), tensors[reading["counts"]].double().flatten()
        keep = (ids >= 0) & (ids < num_classes)
        hist.index_add_(0, ids[keep], counts[keep].clamp_min(0))
        return _estimate(hist, f"per-class rows ({reading['rows']}) with their counts", "exact histogram from the counts")
    if read == "set":
        ids = rows.long().flatten()
        ids = ids[(ids >= 0) & (ids < num_classes)]
        return LabelEstimate(
            torch.unique(ids), None, f"per-class rows ({reading['rows']})", "none: per-class rows name the classes, not their shares"
        )
    if read == "soft":
        s = rows.double().flatten()[:num_classes]
        labels = torch.nonzero(s > soft_tolerance * float(s.abs().max().clamp_min(0))).flatten()
        return LabelEstimate(
            labels,
            None,
            f"nonzero entries of the soft label ({reading['rows']})",
            "none: the soft label's values are random weights, not class shares",
        )
    raise ValueError(f"unknown reading {read!r}")


def _estimate(hist: torch.Tensor, rule: str, proportions: str, warning: str = "") -> LabelEstimate:
    labels = torch.nonzero(hist > 0).flatten()
    dist = hist / hist.sum() if hist.sum() > 0 else None
    return LabelEstimate(labels, dist, rule, proportions, warning)


def present_rows(weight: torch.Tensor, bias: torch.Tensor | None, tolerance: float = 0.0) -> torch.Tensor:
    """(C,) bool: classes whose classifier row (of a gradient, or of prev - new) has a negative entry,
    or whose bias entry is negative (iDLG's sign rule, batch form; see the module docstring)."""
    w = weight.double()
    found = w.min(dim=1).values < -tolerance * float(w.abs().max())
    if bias is not None:
        b = bias.double()
        found |= b < -tolerance * float(b.abs().max())
    return found


def class_shares(
    weight: torch.Tensor, bias: torch.Tensor | None, present: torch.Tensor, mean_probs: str = "interpolated", scale: float | None = 1.0
) -> tuple[torch.Tensor | None, str]:
    """Estimated class shares (C,) from classifier rows in gradient direction, and how they were made
    (None and the reason when no estimate can be made). ``scale`` turns the rows into the *mean* local
    gradient (None: unknown). ``n_c / B = pbar_c - db_c`` (see the module docstring); the interpolated
    estimate does not depend on the scale when some class is absent (alpha absorbs it)."""
    if mean_probs not in MEAN_PROBS:
        raise ConfigError(f"unknown mean_probs {mean_probs!r}; accepted: {', '.join(MEAN_PROBS)}")
    c = len(present)
    if not present.any():
        return None, "none: no class proven present"
    absent = ~present
    if bias is not None:
        signal, source = bias.double() * (1.0 if scale is None else scale), "bias gradient"
    else:
        sums = weight.double().sum(dim=1)
        fitted = float(sums[absent].sum()) * c / max(int(absent.sum()), 1)
        if not absent.any() or fitted <= 0:
            return None, "none: no bias, and with every class present the feature scale of the row sums is unknown"
        signal, source, scale = sums / fitted, "row sums / feature scale fitted to mean probability 1/C on the absent classes (LLG's impact)", 1.0
    if mean_probs == "interpolated" and absent.any() and float(signal[absent].mean()) > 0:
        # pbar = alpha / C + (1 - alpha) * shares; on an absent class pbar_c = db_c, which fits alpha
        alpha = float(signal[absent].mean()) * c
        share = (1.0 / c - signal / alpha).clamp_min(0) * present
        how = f"1/C - {source} / alpha, alpha fitted on the absent classes" + (
            f" ({alpha:.3g})" if scale is not None else " (absorbs the unknown scale)"
        )
    elif scale is None:
        return None, "none: the scale of the mean local gradient (lr, steps) is unknown and no absent class calibrates it"
    else:
        share, how = (1.0 / c - signal).clamp_min(0) * present, f"pbar_c - {source} with pbar = 1/C"
    if float(share.sum()) <= 0:
        return present.double() / int(present.sum()), f"{how} left nothing: uniform over the present classes"
    return share / share.sum(), f"n_c/B = {how}, clamped at 0, normalised"


def integer_counts(share: torch.Tensor, present: torch.Tensor, total: int) -> torch.Tensor | None:
    """Shares rounded to ``total`` integer counts, at least one per present class (largest remainders);
    None when there are more present classes than samples."""
    k = int(present.sum())
    if total < k or k == 0:
        return None
    rest = total - k
    extra = (share * total - present.double()).clamp_min(0) * present
    extra = extra / extra.sum() * rest if float(extra.sum()) > 0 else present.double() * rest / k
    counts = extra.floor()
    left = rest - int(counts.sum())
    frac = torch.where(present, extra - counts, torch.full_like(extra, -1.0))
    counts[torch.argsort(frac, descending=True)[:left]] += 1
    return counts + present.double()


def read_classifier(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    mean_scale: float | None,
    total: int | None,
    config: LabelConfig,
    batch_size: int | None = None,
    source: str = "gradient",
) -> LabelEstimate:
    """Classes and shares from a classifier's rows in gradient direction (a gradient, an update d, or
    prev - new). ``mean_scale`` turns them into the mean local gradient (None: unknown);
    ``total`` is the number of samples behind it (for integer counts); ``batch_size`` enables the
    ``batch_rule`` for a one-batch gradient."""
    present = present_rows(weight, bias, config.tolerance)
    rule = f"rows of the {source} with a negative entry" + (" or a negative bias" if bias is not None else "")
    c = len(present)
    if config.batch_rule and batch_size is not None and batch_size <= c:
        present = torch.zeros(c, dtype=torch.bool)
        present[batch_labels({"weight": weight.double()}, "weight", batch_size)] = True
        rule = f"the {batch_size} rows of the {source} with the most negative minima (distinct labels assumed)"
    labels = torch.nonzero(present).flatten()
    share, how = class_shares(weight, bias, present, config.mean_probs, mean_scale)
    if share is not None and config.integer_counts and total is not None:
        counts = integer_counts(share, present, total)
        if counts is not None:
            share, how = counts / counts.sum(), f"{how}; rounded to {total} samples, >= 1 per present class"
    return LabelEstimate(labels, share, rule, how)


# ------------------------------------------------------------------------------------------ the attacks
class _LabelAttack(Attack):
    """What both label attacks share: one target per message, the estimate as a Reconstruction."""

    produces = frozenset({"labels"})
    Config = LabelConfig
    #: families whose messages are read only when a client sent them (up or peer)
    client_families: ClassVar[frozenset[Family]] = frozenset({Family.GRADIENT, Family.PARAMETERS})

    def __init__(self, config: Any = None, **kwargs: Any):
        super().__init__(config, **kwargs)
        if self.config.mean_probs not in MEAN_PROBS:
            raise ConfigError(f"unknown mean_probs {self.config.mean_probs!r} for attack {self.name}; accepted: {', '.join(MEAN_PROBS)}")

    def messages_of(self, view: AttackerView, kind: str, rnd: int | None = None, clients: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Gradients and parameters: what clients send (a server's broadcast holds no client's batch)."""
        records = super().messages_of(view, kind, rnd, clients)
        if KINDS.get(kind).family in self.client_families:
            return [r for r in records if r["direction"] in ("up", "peer")]
        return records

    def prepare(self, targets: Sequence[Target]) -> None:
        for t in targets:
            assert t.record is not None  # label attacks read captured messages only
            t.view.load(t.record)

    def estimate(self, target: Target) -> LabelEstimate:
        raise NotImplementedError

    def run(self, target: Target, progress: Progress | None = None) -> Reconstruction:
        start = time.perf_counter()
        est = self.estimate(target)
        if progress is not None:
            progress(target.client, 0, 1, 0.0)
        notes: dict[str, Any] = {"rule": est.rule, "proportions": est.proportions}
        if est.warning:
            notes["warning"] = est.warning
        if est.approximation:
            notes["approximation"] = est.approximation
        return Reconstruction(
            target,
            images=None,
            loss=0.0,
            seconds=time.perf_counter() - start,
            labels=est.labels.long(),
            label_distribution=None if est.distribution is None else est.distribution.float(),
            notes=notes,
        )


def _sgd_warning(meta: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> str:
    """Which setting of the message (or the run) voids the sign rule's no-false-positive guarantee."""
    cfg = config or {}
    found = [f"{k} {v}" for k in ("momentum", "weight_decay") if (v := meta.get(k, cfg.get(k, 0.0))) and float(v) != 0.0]
    if cfg.get("optimizer", "sgd") != "sgd":
        found.append(f"optimizer {cfg['optimizer']}")
    return f"{', '.join(found)}: the sign rule's guarantee (plain SGD) does not hold" if found else ""


@register_attack("labels")
class LabelInference(_LabelAttack):
    """Which classes a message's sender holds and in what shares, from the message alone: class ids,
    counts and soft labels of representations and logits; the classifier rows of gradients and
    updates (sign rule and count estimator). See the :mod:`attacks.labels` module docstring."""

    consumes = frozenset({str(Family.GRADIENT), str(Family.PER_SAMPLE_REPRESENTATION), str(Family.AGGREGATE_REPRESENTATION), str(Family.LOGITS)})
    needs = Knowledge()
    threat_model = "eavesdropper"
    paper = f"{_CLASSIFIER_PAPERS}; class ids, counts and soft labels as declared by each kind"

    def plan_messages(self, view: AttackerView, kind: str, rnd: int, records: list[dict[str, Any]], selection: Selection) -> list[Target]:
        spec = KINDS.get(kind)
        num_classes = int(view.dataset["num_classes"])
        if spec.family is Family.GRADIENT:
            if spec.form is ParamForm.PARAMETERS:
                raise AttackNotApplicable(f"{kind} messages are full parameters: read them with labels-delta (it needs the previous state)")
            targets = []
            for rec in records:
                layer = classifier_layer(rec["tensors"], num_classes)
                if layer is not None:
                    targets.append(Target(kind, rnd, rec["sender"], rec, view, payload={"weight": layer[0], "bias": layer[1]}))
            if not targets:
                raise AttackNotApplicable(_no_classifier(kind, num_classes))
            return targets
        targets = []
        reasons = []
        for rec in records:
            try:
                reading = representation_reading(spec, rec["tensors"], num_classes)
            except AttackNotApplicable as exc:
                reasons.append(str(exc))
                continue
            targets.append(Target(kind, rnd, client_of(rec), rec, view, payload={"reading": reading}))
        if not targets:
            raise AttackNotApplicable("; ".join(dict.fromkeys(reasons)))
        return targets

    def estimate(self, target: Target) -> LabelEstimate:
        view, rec = target.view, target.record
        assert rec is not None
        tensors = view.load(rec)
        num_classes = int(view.dataset["num_classes"])
        if "reading" in target.payload:
            return read_representation(tensors, target.payload["reading"], num_classes, self.config.soft_tolerance)
        weight, bias = tensors[target.payload["weight"]], None if target.payload["bias"] is None else tensors[target.payload["bias"]]
        meta = rec.get("meta", {})
        if KINDS.get(target.kind).form is ParamForm.UPDATE:  # d = (prev - new) / a: the mean local gradient is d * a / (lr * tau)
            a, lr, tau = float(meta.get("a", 1.0)), meta.get("lr"), meta.get("tau", meta.get("local_steps"))
            scale = a / (float(lr) * int(tau)) if lr and tau and a > 0 else None
            est = read_classifier(weight, bias, mean_scale=scale, total=meta.get("num_samples"), config=self.config, source="update d")
        else:  # one batch's gradient (a gradient-family kind that declares no form is read as one)
            batch = meta.get("batch_size")
            est = read_classifier(weight, bias, mean_scale=1.0, total=batch, config=self.config, batch_size=batch, source="gradient")
        est.warning = _sgd_warning(meta)
        return est


@register_attack("labels-delta")
class LabelDelta(_LabelAttack):
    """Which classes a client trained on and in what shares, from a full-parameter upload read against
    the state it started from (previous - new = lr * the sum of the local gradients under plain SGD),
    with the sign rule and count estimator of :mod:`attacks.labels`."""

    consumes = frozenset({str(Family.PARAMETERS)})
    needs = Knowledge(previous_state=True, local_hyperparameters=True)  # lr, batch size, epochs for the shares' scale
    threat_model = "curious-server-previous-state"
    paper = _CLASSIFIER_PAPERS

    def plan_messages(self, view: AttackerView, kind: str, rnd: int, records: list[dict[str, Any]], selection: Selection) -> list[Target]:
        num_classes = int(view.dataset["num_classes"])
        ctx = context_of(view, kind)
        targets, reasons = [], []
        for rec in records:
            layer = classifier_layer(rec["tensors"], num_classes)
            if layer is None:
                reasons.append(_no_classifier(kind, num_classes))
                continue
            prev = previous_record(view, rec)
            if prev is None:
                reasons.append(f"{rec['sender']} received no {ctx.previous} before its {kind} message {rec['seq']}: no previous state to subtract")
                continue
            if ctx.previous_rule == "last-received" and layer[0] not in prev["tensors"]:
                reasons.append(f"the previous {ctx.previous} of {kind} message {rec['seq']} has no {layer[0]!r}: nothing to subtract the rows from")
                continue
            if ctx.previous_rule != "last-received":
                try:
                    _, state = previous_state(view, rec)
                except AttackNotApplicable as exc:
                    reasons.append(str(exc))
                    continue
                if layer[0] not in state:
                    reasons.append(f"the attacker does not know the start-of-round value of {layer[0]!r} in {kind} message {rec['seq']}")
                    continue
            targets.append(Target(kind, rnd, rec["sender"], rec, view, payload={"weight": layer[0], "bias": layer[1]}))
        if not targets:
            raise AttackNotApplicable(reasons[0] if len(set(reasons)) == 1 else "; ".join(dict.fromkeys(reasons)))
        return targets

    def prepare(self, targets: Sequence[Target]) -> None:
        super().prepare(targets)
        for t in targets:
            assert t.record is not None
            previous_state(t.view, t.record)

    def estimate(self, target: Target) -> LabelEstimate:
        view, rec = target.view, target.record
        assert rec is not None
        tensors = view.load(rec)
        _, prev = previous_state(view, rec)
        w_name, b_name = target.payload["weight"], target.payload["bias"]
        weight = prev[w_name].double() - tensors[w_name].double()
        bias = prev[b_name].double() - tensors[b_name].double() if b_name is not None and b_name in prev else None
        meta, cfg = rec.get("meta", {}), view.config
        n = meta.get("num_samples")
        lr = float(meta.get("lr", cfg.get("lr", 0.0)))
        tau = meta.get("tau", meta.get("local_steps"))
        if tau is None and n is not None and cfg.get("batch_size"):
            tau = int(cfg.get("local_epochs", 1)) * -(-int(n) // int(cfg["batch_size"]))
        scale = 1.0 / (lr * int(tau)) if lr > 0 and tau else None
        est = read_classifier(weight, bias, mean_scale=scale, total=n, config=self.config, source=f"previous {target.kind} - {target.kind}")
        est.warning = _sgd_warning(meta, cfg)
        est.approximation = context_of(view, target.kind).note
        return est


def _no_classifier(kind: str, num_classes: int) -> str:
    return f"{kind} messages carry no ({num_classes}, d) float tensor named '*weight': no classifier rows to read labels from"


__all__ = [
    "MEAN_PROBS",
    "LabelConfig",
    "LabelDelta",
    "LabelEstimate",
    "LabelInference",
    "class_shares",
    "classifier_layer",
    "integer_counts",
    "present_rows",
    "read_classifier",
    "read_representation",
    "representation_reading",
]
