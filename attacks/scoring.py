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
        summary = {
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


def roc(scores: torch.Tensor, members: torch.Tensor) -> tuple[float, float, float, list[float], list[float]]:
    """(AUC, TPR at 1 % FPR, advantage max(TPR - FPR), FPR curve, TPR curve) of membership scores
    (higher: member). TPR at a low FPR is what the membership-inference literature reports (Carlini et
    al., S&P 2022): the attack's confidence on the records it is surest about."""
    from sklearn.metrics import roc_auc_score, roc_curve

    y, s = members.numpy().astype(int), scores.double().numpy()
    if y.min() == y.max():
        raise ValueError("membership scoring needs members and non-members")
    fpr, tpr, _ = roc_curve(y, s)
    low = tpr[fpr <= 0.01]
    return float(roc_auc_score(y, s)), float(low.max()) if len(low) else 0.0, float((tpr - fpr).max()), fpr.tolist(), tpr.tolist()


class MembershipScorer:
    """Membership inference: each target's scores on its queries against the hidden membership bits."""

    rule = "queries: the client's training samples (members) and as many of its held-out samples (non-members)"

    def __init__(self, membership: dict[str, torch.Tensor]):
        self.membership = membership

    def score(self, recons: list[Reconstruction], truth: GroundTruth, title: str, seconds: float) -> Scored:
        rows: list[dict[str, Any]] = []
        curves: list[tuple[str, list[float], list[float]]] = []
        for r in recons:
            members = self.membership.get(r.target.key)
            if r.scores is None or members is None or len(r.scores) != len(members):
                raise ValueError(f"{r.target.key}: a membership attack returns one score per query")
            auc, tpr1, adv, fpr, tpr = roc(r.scores, members)
            rows.append(
                {
                    "client": r.target.client,
                    "round": r.target.round,
                    "kind": r.target.kind,
                    "message_seq": r.target.message_seq,
                    "queries": len(members),
                    "members": int(members.sum()),
                    "auc": auc,
                    "tpr_at_1pct_fpr": tpr1,
                    "advantage": adv,
                    "seconds": r.seconds,
                    **{k: v for k, v in r.notes.items() if isinstance(v, (str, int, float))},
                }
            )
            curves.append((f"{r.target.client} r{r.target.round}", fpr, tpr))
        summary = {
            "targets": len(rows),
            "seconds_per_target": round(seconds / max(len(rows), 1), 3),
            **summarize({m: [float(row[m]) for row in rows] for m in ("auc", "tpr_at_1pct_fpr", "advantage")}),
        }
        return Scored(rows, summary, None, [], [], rule=self.rule, headline_metric="auc", roc_curves=curves)


def scorer_for(
    family: Family, produces: frozenset[str] = frozenset({"images"}), membership: dict[str, torch.Tensor] | None = None, seed: int = 0
) -> RepresentationScorer | BatchScorer | LabelScorer | MembershipScorer:
    """The scoring rule for an attack's output on a kind of ``family`` (``seed``: the priors' population
    subset and the bootstrap intervals)."""
    if "membership" in produces:
        return MembershipScorer(membership or {})
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
