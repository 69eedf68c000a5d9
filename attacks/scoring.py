"""Scoring reconstructions against ground truth, by the artifact's family (metrics side only).

Which true images a reconstruction is compared with is :mod:`attacks.matching`'s rule. Every image
result is scored beside the attacker's priors (:mod:`attacks.priors`: blank, population mean, the class
mean of what the message reveals), with identification rates, bootstrap intervals and a verdict
(:mod:`attacks.calibration`), so that a failed attack never reads as protection.

:class:`RepresentationScorer` and :class:`BatchScorer` turn a list of reconstructions into per-image
rows, a summary, and what the gallery shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch

from attacks.base import Reconstruction, Target
from attacks.calibration import Item, calibrate, headline_fields, identification_item
from attacks.matching import MEAN_SSIM_LIMIT, Candidates, candidates, headline, sample_ids, score
from attacks.metrics import best_match, hungarian_match, score_images, summarize
from attacks.priors import PriorBank, one_hot, revealed_classes
from privfl.kinds import Family
from privfl.run import GroundTruth


@dataclass
class Scored:
    """Per-image (or per-message) rows, the summary, and the picture: an image gallery (truth images
    above rows of reconstructions) or, for label inference, a clients x classes grid."""

    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    truth_images: torch.Tensor | None
    gallery_rows: list[tuple[str, torch.Tensor]]
    captions: list[str]
    labels: dict[str, list[str]] = field(default_factory=dict)
    rule: str = ""
    headline_metric: str = "psnr"
    label_grid: list[tuple[str, list[int], list[int]]] | None = None  # (client, true classes, recovered classes)
    roc_curves: list[tuple[str, list[float], list[float]]] | None = None  # (label, FPR, TPR) per membership target


class RepresentationScorer:
    """Exact / best / weighted-mean scores of one image per target (representation families), beside the
    attacker's priors, with identification, intervals and a verdict."""

    rule = "per-sample: its own image; aggregates: best match and (weighted) mean over the aggregate's images"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def score(self, recons: list[Reconstruction], truth: GroundTruth, title: str, seconds: float) -> Scored:
        rows: list[dict[str, Any]] = []
        truth_images: list[torch.Tensor] = []
        captions: list[str] = []
        labels: list[str] = []
        items: list[Item] = []
        num_classes = len(truth.dataset.class_names)
        for r in recons:
            cand = candidates(truth, r.target)
            s = score(r.image, cand)
            h = headline(s)
            truth_images.append(cand.images[cast(int, cand.exact if h == "exact" else s["best_index"])])
            captions.append(f"{r.target.client} {r.target.label[:18]}")
            labels.append(f"PSNR {s[h + '_psnr255']:.2f} dB")
            t = r.target
            rows.append(
                {
                    "target": t.key,
                    "kind": t.kind,
                    "client": t.client,
                    "round": t.round,
                    "label": t.label,
                    "counterfactual": t.counterfactual,
                    "ground_truth": cand.description,
                    "feature_mse": r.loss,
                    "seconds": r.seconds,
                    **s,
                    "headline": h,
                }
            )
            ident = identification_item(truth, t.client, cand.indices)
            items.append(Item(r.image, cand, h, t.client, s, revealed_classes(t, num_classes), ident))
        summary: dict[str, Any] = {
            "targets": len(rows),
            "seconds_total": round(seconds, 2),
            "seconds_per_target": round(seconds / max(len(rows), 1), 3),
        }
        for prefix in ("exact", "best", "mean"):
            per = {m: [row[f"{prefix}_{m}"] for row in rows if f"{prefix}_{m}" in row] for m in ("psnr255", "mse255", "psnr", "mse", "ssim", "lpips")}
            summary.update({f"{prefix}_{k}": v for k, v in summarize({m: v for m, v in per.items() if v}).items()})
        cal = calibrate(items, truth, PriorBank(truth, self.seed), self.seed)
        for row, extra in zip(rows, cal.rows):
            row.update(extra)
        summary.update(headline_fields(cal.summary))
        summary["calibration"] = cal.summary
        images = torch.stack([r.image for r in recons])
        return Scored(
            rows,
            summary,
            torch.stack(truth_images),
            [(title, images), *cal.gallery],
            captions,
            {title: labels, **cal.labels},
            self.rule,
            "exact_psnr255" if "exact_psnr255" in summary else "best_psnr255",
        )


class BatchScorer:
    """Images rebuilt from a gradient or parameter message, matched to the samples behind it, beside the
    attacker's priors (the class prior from the labels the attack recovered from the message)."""

    rule = "hungarian matching over an exact batch; otherwise each image's best match in the message's samples"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def score(self, recons: list[Reconstruction], truth: GroundTruth, title: str, seconds: float) -> Scored:
        rows: list[dict[str, Any]] = []
        truth_row: list[torch.Tensor] = []
        final_row: list[torch.Tensor] = []
        snap_rows: dict[int, list[torch.Tensor]] = {}
        labels: list[str] = []
        items: list[Item] = []
        num_classes = len(truth.dataset.class_names)
        for r in recons:
            seq = r.target.message_seq
            assert seq is not None  # gradients and parameters are attacked in captured messages only
            t = truth.message_truth(seq)
            ids = sample_ids(t, seq)
            images = r.images
            assert images is not None  # image attacks only (scorer_for routes label-only attacks elsewhere)
            if r.notes.get("aggregate") and r.labels is not None and len(images) == 1:
                # one image read for a class (a classifier row): its class's samples, like a prototype's
                same = truth.labels[ids] == int(r.labels[0])
                ids = ids[same] if bool(same.any()) else ids
            cand = truth.images(ids)
            batch = int(r.notes.get("batch_size", len(images)))
            exact = len(ids) == batch and not r.notes.get("aggregate")
            pairs = hungarian_match(images, cand) if exact else [(i, best_match(images[i], cand)[0]) for i in range(len(images))]
            matching = "hungarian over the exact batch" if exact else "best match in the client's data"
            if r.notes.get("aggregate"):
                matching = "best match among the message's samples of its class"
            for i, j in pairs:
                s = {k: v[0] for k, v in score_images(images[i : i + 1], cand[j : j + 1]).items()}
                rows.append(
                    {
                        "client": r.target.client,
                        "round": r.target.round,
                        "message_seq": r.target.message_seq,
                        "image": i,
                        "matched_truth": int(ids[j]),
                        "matching": matching,
                        "label_recovered": int(r.labels[i]) if r.labels is not None else None,
                        "label_source": r.notes.get("label_source", ""),
                        "seconds": r.seconds / len(pairs),
                        **s,
                    }
                )
                truth_row.append(cand[j])
                final_row.append(images[i])
                labels.append(f"PSNR {s['psnr']:.1f} dB")
                for step, x in r.snapshots[:-1]:
                    snap_rows.setdefault(step, []).append(x[i])
                # the same rule for the priors: the matched image of an exact batch, else the best of the message's samples
                c = (
                    Candidates(cand[j : j + 1], torch.ones(1), 0, "its matched image", ids[j : j + 1])
                    if exact
                    else Candidates(cand, torch.full((len(cand),), 1.0 / len(cand)), None, "the message's samples", ids)
                )
                prefix = "exact" if exact else "best"
                label = int(r.labels[i]) if r.labels is not None else None
                ident = identification_item(truth, r.target.client, c.indices)
                prefixed = {f"{prefix}_{k}": v for k, v in s.items()}
                items.append(Item(images[i], c, prefix, r.target.client, prefixed, one_hot(label, num_classes), ident))
        summary: dict[str, Any] = {
            "images": len(rows),
            "messages": len({r.target.message_seq for r in recons}),
            "seconds_per_message": round(sum(r.seconds for r in recons) / max(len({r.target.message_seq for r in recons}), 1), 2),
            **summarize({m: [row[m] for row in rows] for m in ("psnr", "mse", "psnr255", "mse255", "ssim")}),
        }
        cal = calibrate(items, truth, PriorBank(truth, self.seed), self.seed)
        for row, extra in zip(rows, cal.rows):
            row.update(extra)
        summary.update(headline_fields(cal.summary))
        summary["calibration"] = cal.summary
        steps = sorted(snap_rows)
        shown = [steps[i] for i in sorted({0, len(steps) // 2, len(steps) - 1})] if steps else []
        gallery = [(f"step {st}", torch.stack(snap_rows[st])) for st in shown if len(snap_rows[st]) == len(final_row)]
        gallery.append((title, torch.stack(final_row)))
        gallery += cal.gallery
        return Scored(rows, summary, torch.stack(truth_row), gallery, [row["client"] for row in rows], {title: labels, **cal.labels}, self.rule)


def true_classes(truth: GroundTruth, target: Target) -> torch.Tensor:
    """Labels of the samples behind a message: the message's own truth when it has samples behind it,
    every client's training samples for a server's broadcast, else the client's training split."""
    t = truth.message_truth(target.message_seq) if target.message_seq is not None and truth.has_message(target.message_seq) else {}
    if "labels" in t:
        return t["labels"].long()
    if "indices" in t:
        return truth.labels[t["indices"]].long()
    if target.record is not None and target.record["sender"] == "server":  # a broadcast: built from every client's uploads
        return truth.labels[torch.cat(list(truth.train.values()))].long()
    return truth.labels[truth.client_train(target.client)].long()


class LabelScorer:
    """Label inference: the classes (and shares) an attack says are behind a message against those that are.

    Per message: precision (named classes that are really there), recall (present classes named), F1,
    whether the sets are equal, and the L1 distance between the normalised class histograms (0: exact
    proportions, 2: disjoint); an attack that names a set without shares is scored as uniform over it.
    The summary averages over messages.

    The prior is what an attacker says without the message: every class, in the population's class
    shares (other clients' held-out samples). Its F1 and L1 are scored the same way, and the attack is
    reported as its gain (F1 higher, L1 lower) with bootstrap intervals and a verdict."""

    rule = "recovered classes and shares against the label histogram of the samples behind the message"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def score(self, recons: list[Reconstruction], truth: GroundTruth, title: str, seconds: float) -> Scored:
        rows: list[dict[str, Any]] = []
        grid: list[tuple[str, list[int], list[int]]] = []
        num_classes = len(truth.dataset.class_names)
        bank = PriorBank(truth, self.seed)
        for r in recons:
            labels = true_classes(truth, r.target)
            hist = torch.bincount(labels, minlength=num_classes).double()
            hist = hist / hist.sum().clamp_min(1)
            true = set(torch.nonzero(hist).flatten().tolist())
            found = set(r.labels.tolist()) if r.labels is not None else set()
            if r.label_distribution is not None:
                est = r.label_distribution.double().clamp_min(0)
                if not found:
                    found = set(torch.nonzero(est > 0).flatten().tolist())
            else:
                est = torch.zeros(num_classes, dtype=torch.float64)
                if found:
                    est[sorted(found)] = 1.0
            est = est / est.sum() if est.sum() > 0 else est
            hit = len(found & true)
            precision = hit / len(found) if found else 1.0
            recall = hit / len(true) if true else 1.0
            f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
            prior = label_prior(bank, r.target, num_classes)
            prior_f1 = 2 * (len(true) / num_classes) / (len(true) / num_classes + 1) if true else 0.0  # every class named: recall 1
            prior_l1 = float((prior - hist).abs().sum())
            rows.append(
                {
                    "client": r.target.client,
                    "round": r.target.round,
                    "kind": r.target.kind,
                    "message_seq": r.target.message_seq,
                    "prior_f1": prior_f1,
                    "prior_l1": prior_l1,
                    "gain_f1": f1 - prior_f1,
                    "gain_l1": prior_l1 - float((est - hist).abs().sum()),
                    "recovered": sorted(found),
                    "true": sorted(true),
                    "precision": precision,
                    "recall": recall,
                    "f1": f1,
                    "exact": found == true,
                    "l1": float((est - hist).abs().sum()),
                    "estimate": [round(v, 4) for v in est.tolist()],
                    "histogram": [round(v, 4) for v in hist.tolist()],
                    "seconds": r.seconds,
                    **{k: v for k, v in r.notes.items() if isinstance(v, (str, int, float))},
                }
            )
            grid.append((r.target.client, sorted(true), sorted(found)))
        summary = {
            "messages": len(rows),
            "seconds_per_message": round(seconds / max(len(rows), 1), 3),
            **summarize({m: [float(row[m]) for row in rows] for m in ("precision", "recall", "f1", "exact", "l1")}),
        }
        summary.update(label_verdict(rows, self.seed))
        return Scored(rows, summary, None, [], [], rule=self.rule, headline_metric="recall", label_grid=grid)


def label_prior(bank: PriorBank, target: Target, num_classes: int) -> torch.Tensor:
    """The class shares an attacker assumes without the message: the population's (C,), float64."""
    client = target.client if target.record is None or target.record["sender"] != "server" else None
    labels = bank.population(client).labels
    hist = torch.bincount(labels, minlength=num_classes).double()
    return hist / hist.sum().clamp_min(1)


def label_verdict(rows: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """Gains of label inference over its prior (naming every class in the population's shares), with
    intervals over messages (clients, then messages), and the verdict."""
    from attacks.calibration import verdict
    from attacks.priors import bootstrap_mean

    clients = [row["client"] for row in rows]
    gain = {m: bootstrap_mean([row[f"gain_{m}"] for row in rows], clients, seed=seed) for m in ("f1", "l1")}
    prior = {"every_class": {m: float(sum(row[f"prior_{m}"] for row in rows) / max(len(rows), 1)) for m in ("f1", "l1")}}
    cal = {"prior": prior, "strongest_prior": "every_class", "gain": gain}
    cal.update(verdict(cal))
    return {"verdict": cal["verdict"], "gain_f1": gain["f1"]["mean"], "gain_l1": gain["l1"]["mean"], "calibration": cal}


#: the low false-positive rates a membership result reports the TPR at, by key suffix
LOW_FPRS: dict[str, float] = {"1pct": 0.01, "0.1pct": 0.001}
#: a TPR at a low FPR is reported only when the threshold that reaches it rests on at least this many false positives
MIN_FALSE_POSITIVES = 10
#: resamples of the percentile bootstrap interval of the pooled AUC (over queries)
AUC_RESAMPLES = 1000


@dataclass
class LowFPR:
    """The TPR at the threshold whose FPR is the largest not above ``level``: the FPR it reaches, the false
    positives it rests on, and ``tpr`` None (unavailable) when those are fewer than :data:`MIN_FALSE_POSITIVES`."""

    level: float
    tpr: float | None
    fpr_reached: float
    false_positives: int
    non_members: int
    note: str

    def fields(self, suffix: str, prefix: str = "") -> dict[str, Any]:
        return {
            f"{prefix}tpr_{suffix}": self.tpr,
            f"{prefix}fpr_reached_{suffix}": self.fpr_reached,
            f"{prefix}false_positives_{suffix}": self.false_positives,
            f"{prefix}tpr_{suffix}_note": self.note,
        }


@dataclass
class ROC:
    """A membership result's ROC: AUC, advantage max(TPR - FPR), the TPR at each of :data:`LOW_FPRS`, the
    curve (for the picture), and ``tpr_at_1pct_fpr``, the TPR at FPR <= 1 % whatever it rests on (the
    key callers have always read; ``low["1pct"]`` says whether it can be trusted)."""

    auc: float
    advantage: float
    tpr_at_1pct_fpr: float
    low: dict[str, LowFPR]
    fpr: list[float]
    tpr: list[float]
    members: int
    non_members: int


def low_fpr(fpr: torch.Tensor, tpr: torch.Tensor, non_members: int, level: float) -> LowFPR:
    """The point of a full ROC curve (``drop_intermediate=False``, FPR nondecreasing) with the largest FPR
    not above ``level``, counted in false positives so that no rounding moves it (LeakPro's pitfall: a
    TPR labelled with a FPR it does not reach)."""
    false_positives = torch.round(fpr.double() * non_members).long()
    allowed = int(level * non_members + 1e-9)  # floor: the most false positives the level allows
    i = int(torch.searchsorted(false_positives, torch.tensor([allowed]), right=True)[0]) - 1
    fp, reached, rate = int(false_positives[i]), float(fpr[i]), float(tpr[i])
    rests = f"rests on {fp} false positive{'s' if fp != 1 else ''} of {non_members} non-members"
    if fp < MIN_FALSE_POSITIVES:
        need = round(MIN_FALSE_POSITIVES / level)
        return LowFPR(level, None, reached, fp, non_members, f"unavailable: {rests} (needs >= {MIN_FALSE_POSITIVES}, i.e. >= {need} non-members)")
    return LowFPR(level, rate, reached, fp, non_members, f"TPR {rate:.4f} at FPR {reached:.4f} reached (level {level:g}); {rests}")


def roc(scores: torch.Tensor, members: torch.Tensor) -> ROC:
    """The ROC of membership scores (higher: member) against the membership bits. TPR at a low FPR is what
    the membership-inference literature reports (Carlini et al., S&P 2022): the attack's confidence on
    the records it is surest about. sklearn sorts the scores and places a threshold at each distinct one."""
    from sklearn.metrics import roc_auc_score, roc_curve

    y, s = members.numpy().astype(int), scores.double().numpy()
    if y.min() == y.max():
        raise ValueError("membership scoring needs members and non-members")
    fpr, tpr, _ = roc_curve(y, s, drop_intermediate=False)
    non_members = int((y == 0).sum())
    low = {key: low_fpr(torch.from_numpy(fpr), torch.from_numpy(tpr), non_members, level) for key, level in LOW_FPRS.items()}
    legacy = float(tpr[fpr <= 0.01].max())
    shown_fpr, shown_tpr, _ = roc_curve(y, s)  # the corners only, for the picture
    return ROC(float(roc_auc_score(y, s)), float((tpr - fpr).max()), legacy, low, shown_fpr.tolist(), shown_tpr.tolist(), int(y.sum()), non_members)


def bootstrap_auc(
    scores: torch.Tensor, members: torch.Tensor, *, seed: int = 0, resamples: int = AUC_RESAMPLES, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the AUC, resampling (score, bit) pairs with replacement; seeded.

    Each resample is a vector of multiplicities over the sorted scores, so its AUC (the Mann-Whitney
    statistic, ties counted half) is a weighted sum computed for a block of resamples at once."""
    import numpy as np

    s, y = scores.double().numpy(), members.numpy().astype(bool)
    if y.all() or not y.any():
        raise ValueError("a bootstrap AUC needs members and non-members")
    order = np.argsort(s, kind="stable")
    s, y = s[order], y[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])  # first index of each run of tied scores
    rng = np.random.default_rng(seed)
    n, aucs = len(s), []
    for done in range(0, resamples, 100):
        block = min(100, resamples - done)
        drawn = rng.integers(0, n, size=(block, n)) + n * np.arange(block)[:, None]
        weight = np.bincount(drawn.ravel(), minlength=block * n).reshape(block, n).astype(np.float64)
        pos = np.add.reduceat(weight * y, starts, axis=1)
        neg = np.add.reduceat(weight * ~y, starts, axis=1)
        below = np.cumsum(neg, axis=1) - neg
        with np.errstate(invalid="ignore", divide="ignore"):
            aucs.append((pos * (below + 0.5 * neg)).sum(1) / (pos.sum(1) * neg.sum(1)))
    values = np.concatenate(aucs)
    values = values[np.isfinite(values)]
    low, high = np.percentile(values, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return float(low), float(high)


class MembershipScorer:
    """Membership inference: each target's scores on its queries against the hidden membership bits, and
    all targets' (score, bit) pairs pooled (one threshold for all: more non-members under each low FPR).

    Per target and pooled: AUC, advantage, and at 1 % and 0.1 % FPR the TPR at the threshold reaching
    the largest FPR not above the level, that FPR, and the false positives it rests on; the TPR is
    unavailable (None, with the reason) below :data:`MIN_FALSE_POSITIVES`. The pooled AUC has a
    percentile bootstrap interval over queries. ``auc``, ``tpr_at_1pct_fpr`` and ``advantage`` stay the
    means over targets that callers read (``tpr_at_1pct_fpr`` unchecked: see ``tpr_1pct_note``)."""

    rule = "queries: the client's training samples (members) and as many of its held-out samples (non-members)"

    def __init__(self, membership: dict[str, torch.Tensor], seed: int = 0):
        self.membership = membership
        self.seed = seed

    def score(self, recons: list[Reconstruction], truth: GroundTruth, title: str, seconds: float) -> Scored:
        rows: list[dict[str, Any]] = []
        curves: list[tuple[str, list[float], list[float]]] = []
        pooled_scores, pooled_bits = [], []
        for r in recons:
            members = self.membership.get(r.target.key)
            if r.scores is None or members is None or len(r.scores) != len(members):
                raise ValueError(f"{r.target.key}: a membership attack returns one score per query")
            result = roc(r.scores, members)
            rows.append(
                {
                    "client": r.target.client,
                    "round": r.target.round,
                    "kind": r.target.kind,
                    "message_seq": r.target.message_seq,
                    "queries": len(members),
                    "members": result.members,
                    "non_members": result.non_members,
                    "auc": result.auc,
                    "tpr_at_1pct_fpr": result.tpr_at_1pct_fpr,
                    "advantage": result.advantage,
                    **{k: v for key, low in result.low.items() for k, v in low.fields(key).items()},
                    "seconds": r.seconds,
                    **{k: v for k, v in r.notes.items() if isinstance(v, (str, int, float))},
                }
            )
            curves.append((f"{r.target.client} r{r.target.round}", result.fpr, result.tpr))
            pooled_scores.append(r.scores.double())
            pooled_bits.append(members.bool())
        summary: dict[str, Any] = {
            "targets": len(rows),
            "seconds_per_target": round(seconds / max(len(rows), 1), 3),
            **summarize({m: [float(row[m]) for row in rows] for m in ("auc", "tpr_at_1pct_fpr", "advantage")}),
        }
        if rows:
            scores, bits = torch.cat(pooled_scores), torch.cat(pooled_bits)
            pooled = roc(scores, bits)
            low_ci, high_ci = bootstrap_auc(scores, bits, seed=self.seed)
            summary.update(
                {
                    "pooled_queries": len(bits),
                    "pooled_members": pooled.members,
                    "pooled_non_members": pooled.non_members,
                    "pooled_auc": pooled.auc,
                    "pooled_auc_low": low_ci,
                    "pooled_auc_high": high_ci,
                    "pooled_auc_interval": f"95 % percentile bootstrap over the pooled queries, {AUC_RESAMPLES} resamples, seed {self.seed}",
                    "pooled_advantage": pooled.advantage,
                    **{k: v for key, low in pooled.low.items() for k, v in low.fields(key, "pooled_").items()},
                    **{f"targets_with_tpr_{key}": sum(row[f"tpr_{key}"] is not None for row in rows) for key in LOW_FPRS},
                }
            )
            if len(rows) > 1:
                curves.append(("pooled", pooled.fpr, pooled.tpr))
            summary.update(membership_verdict(summary))
        return Scored(rows, summary, None, [], [], rule=self.rule, headline_metric="auc", roc_curves=curves)


def membership_verdict(summary: dict[str, Any]) -> dict[str, Any]:
    """Against the prior AUC 0.5 (a guess): leaks when the pooled AUC's interval lies above 0.5; an AUC
    whose interval lies below it means the attack's scores point the wrong way, a failed attack."""
    from attacks.priors import LEAKS, NO_EVIDENCE

    auc, low, high = summary["pooled_auc"], summary["pooled_auc_low"], summary["pooled_auc_high"]
    where = f"pooled AUC {auc:.3f} [{low:.3f}, {high:.3f}] over {summary['pooled_queries']} queries against 0.5"
    if low > 0.5:
        return {"verdict": LEAKS, "verdict_detail": f"{LEAKS}: {where}", "failed": False}
    if high < 0.5:
        detail = f"{NO_EVIDENCE}: {where}: the attack scored below its prior (it failed); this is not evidence of protection"
        return {"verdict": NO_EVIDENCE, "verdict_detail": detail, "failed": True}
    return {"verdict": NO_EVIDENCE, "verdict_detail": f"{NO_EVIDENCE}: {where}: the interval contains chance", "failed": False}


def scorer_for(
    family: Family, produces: frozenset[str] = frozenset({"images"}), membership: dict[str, torch.Tensor] | None = None, seed: int = 0
) -> RepresentationScorer | BatchScorer | LabelScorer | MembershipScorer:
    """The scoring rule for an attack's output on a kind of ``family`` (``seed``: the priors' population
    subset and the bootstrap intervals)."""
    if "membership" in produces:
        return MembershipScorer(membership or {}, seed)
    if "images" not in produces:
        return LabelScorer(seed)
    if family in (Family.PER_SAMPLE_REPRESENTATION, Family.AGGREGATE_REPRESENTATION):
        return RepresentationScorer(seed)
    if family in (Family.GRADIENT, Family.PARAMETERS):
        return BatchScorer(seed)
    raise ValueError(f"no image scoring rule for the {family} family yet")


__all__ = [
    "MEAN_SSIM_LIMIT",
    "BatchScorer",
    "Candidates",
    "LabelScorer",
    "MembershipScorer",
    "RepresentationScorer",
    "Scored",
    "candidates",
    "headline",
    "roc",
    "sample_ids",
    "score",
    "scorer_for",
    "true_classes",
]
