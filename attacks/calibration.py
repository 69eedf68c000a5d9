"""An image attack's scores beside its priors, its identification rates, intervals and verdict.

:func:`calibrate` is what every image scorer (:mod:`attacks.scoring`, the FedRE comparison in
:mod:`attacks.compare`) calls after it has scored the reconstructions: it scores the priors of
:mod:`attacks.priors` with the same rule against the same images, identifies the reconstructions and
the priors among the client's training images, and turns the per-target differences into bootstrap
intervals and one verdict. Metrics side only: it reads ground truth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from attacks.matching import Candidates, score
from attacks.priors import (
    LEAKS,
    LEVEL,
    NO_EVIDENCE,
    PRIOR_TEXT,
    RESAMPLES,
    IdentificationItem,
    PriorBank,
    bootstrap_mean,
    identify,
    interval_text,
)
from privfl.run import GroundTruth

#: when a prior needs a class the message does not reveal, the attacker falls back to the next one
FALLBACK = {"label_mixture": "class_mean", "class_mean": "population_mean"}
#: the metrics compared with the priors, and whether higher is better
METRICS = {"psnr255": True, "ssim": True, "lpips": False}
SPACES = ("pixel", "feature")


@dataclass
class Item:
    """One reconstruction to calibrate: the image, what it is scored against (and with which prefix of
    :func:`attacks.matching.score`), its scores, the client, what the message reveals about its class,
    and (optional) the client's images to identify it among."""

    image: torch.Tensor  # (C, H, W)
    cand: Candidates
    prefix: str  # "exact" or "best"
    client: str
    scores: dict[str, Any]
    class_weights: torch.Tensor | None = None
    identification: IdentificationItem | None = None


@dataclass
class Calibration:
    rows: list[dict[str, Any]]  # per item: the priors' scores, gains and identification ranks
    summary: dict[str, Any]
    gallery: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # the prior images, one row per prior shown
    labels: dict[str, list[str]] = field(default_factory=dict)


def identification_item(truth: GroundTruth, client: str, indices: torch.Tensor | None) -> IdentificationItem | None:
    """The client's training images as the pool, ``indices`` (pool indices behind the target) as the truth."""
    if indices is None:
        return None
    pool = truth.client_train(client)
    return IdentificationItem(client, pool, torch.isin(pool, indices.long()))


def _value(scores: dict[str, Any], prefix: str, metric: str) -> float:
    v = scores.get(f"{prefix}_{metric}")
    return float(v) if v is not None else float("nan")


def calibrate(items: Sequence[Item], truth: GroundTruth, bank: PriorBank, seed: int = 0) -> Calibration:
    """Score every item's priors like the item, identify them, and summarise with intervals and a verdict."""
    clients = [it.client for it in items]
    prior_images: list[dict[str, torch.Tensor]] = []
    prior_scores: list[dict[str, dict[str, Any]]] = []
    for it in items:
        imgs = bank.images(it.client, it.class_weights)
        for name, fallback in reversed(FALLBACK.items()):  # class_mean first, then label_mixture
            if name not in imgs:
                imgs[name] = imgs[fallback]
        prior_images.append(imgs)
        prior_scores.append({name: score(img, it.cand) for name, img in imgs.items()})
    names = list(PRIOR_TEXT)
    rows: list[dict[str, Any]] = [{} for _ in items]
    summary: dict[str, Any] = {}

    # -- the priors, scored like the attack; the strongest in each measure is one fixed strategy for every target
    prior_means: dict[str, dict[str, float]] = {}
    for name in names:
        per = {m: [_value(prior_scores[i][name], it.prefix, m) for i, it in enumerate(items)] for m in METRICS}
        prior_means[name] = {m: float(np.nanmean(v)) for m, v in per.items() if np.isfinite(v).any()}
        for i in range(len(items)):
            for m in METRICS:
                if np.isfinite(per[m][i]):
                    rows[i][f"prior_{name}_{m}"] = per[m][i]
    strongest = max(names, key=lambda n: prior_means[n]["psnr255"])
    summary["prior"] = prior_means
    summary["strongest_prior"] = strongest
    summary["strongest_prior_text"] = PRIOR_TEXT[strongest]
    summary["population"] = bank.population(items[0].client).description if items else ""

    # -- the attack and its gain over the strongest prior, paired per target
    summary["attack"] = {}
    summary["gain"] = {}
    summary["strongest_prior_by_measure"] = {}
    for m, higher in METRICS.items():
        a = [_value(it.scores, it.prefix, m) for it in items]
        if not np.isfinite(a).any():
            continue
        # each measure against the prior strongest in that measure (the blank image can win on PSNR and lose on SSIM)
        usable = [n for n in names if m in prior_means[n]]
        own = (max if higher else min)(usable, key=lambda n: prior_means[n][m]) if usable else strongest
        summary["strongest_prior_by_measure"][m] = own
        p = [_value(prior_scores[i][own], it.prefix, m) for i, it in enumerate(items)]
        gain = [(x - y) if higher else (y - x) for x, y in zip(a, p)]
        for i in range(len(items)):
            rows[i][f"gain_{m}"] = gain[i]
        summary["attack"][m] = bootstrap_mean(a, clients, seed=seed)
        summary["gain"][m] = bootstrap_mean(gain, clients, seed=seed)

    # -- identification among the client's training images
    targets = [it.identification for it in items if it.identification is not None]
    if items and len(targets) == len(items):
        found = identify(torch.stack([it.image for it in items]), targets, truth, bank)
        by_prior = {name: identify(torch.stack([imgs[name] for imgs in prior_images]), targets, truth, bank) for name in names}
        informative = [i for i, f in enumerate(found) if f.get("informative")]
        ident: dict[str, Any] = {
            "targets": len(informative),
            "pool": float(np.mean([found[i]["pool"] for i in informative])) if informative else None,
            "members": float(np.mean([found[i]["members"] for i in informative])) if informative else None,
        }
        for i, f in enumerate(found):
            if f.get("informative"):
                rows[i].update({f"ident_{s}_rank": f[f"{s}_rank"] for s in SPACES})
                rows[i]["ident_pool"] = f["pool"]
                rows[i]["ident_members"] = f["members"]
        if informative:
            sub = [clients[i] for i in informative]
            for space in SPACES:
                hits = {k: [float(found[i][f"{space}_rank"] < k) for i in informative] for k in (1, 5)}
                prior_hits = {name: {k: [float(by_prior[name][i][f"{space}_rank"] < k) for i in informative] for k in (1, 5)} for name in names}
                # the prior that identifies best, as for every other measure (one fixed strategy over the targets)
                best = max(names, key=lambda n: (np.mean(prior_hits[n][1]), np.mean(prior_hits[n][5])))
                ident[space] = {
                    "top1": bootstrap_mean(hits[1], sub, seed=seed),
                    "top5": bootstrap_mean(hits[5], sub, seed=seed),
                    "chance_top1": float(np.mean([found[i]["chance_top1"] for i in informative])),
                    "chance_top5": float(np.mean([found[i]["chance_top5"] for i in informative])),
                    "prior": best,
                    "prior_top1": float(np.mean(prior_hits[best][1])),
                    "prior_top5": float(np.mean(prior_hits[best][5])),
                    "gain_top1": bootstrap_mean([x - y for x, y in zip(hits[1], prior_hits[best][1])], sub, seed=seed),
                }
        else:
            ident["note"] = "not informative: every target is built from all of its client's training images (chance 1)"
        summary["identification"] = ident

    summary.update(verdict(summary))
    summary["interval"] = f"{LEVEL:.0%} percentile bootstrap over targets (clients, then targets within them), {RESAMPLES} resamples, seed {seed}"

    # -- what the gallery shows: the priors an attacker has without the message (blank is not worth a row)
    gallery, labels = [], {}
    for name in names[1:]:
        if name in FALLBACK and all(imgs[name] is imgs[FALLBACK[name]] for imgs in prior_images):
            continue  # nothing revealed: the same picture as the row above
        label = f"prior: {name.replace('_', ' ')}"
        gallery.append((label, torch.stack([imgs[name] for imgs in prior_images])))
        labels[label] = [f"PSNR {_value(prior_scores[i][name], it.prefix, 'psnr255'):.2f} dB" for i, it in enumerate(items)]
    return Calibration(rows, summary, gallery, labels)


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    """``leaks beyond the prior`` when any gain's interval lies above zero (one target: its value), else
    ``no evidence beyond the prior at this budget``; ``failed`` when the attack's mean PSNR is below the
    strongest prior's. Under-reporting leakage is the failure to avoid, so any one measure suffices."""
    evidence: list[str] = []
    checks: list[tuple[str, dict[str, Any], str]] = [(f"{m} gain", iv, " dB" if m == "psnr255" else "") for m, iv in summary.get("gain", {}).items()]
    ident = summary.get("identification", {})
    checks += [(f"{space} identification top-1 gain", ident[space]["gain_top1"], "") for space in SPACES if space in ident]
    for what, iv, unit in checks:
        if iv["n"] >= 1 and (iv["low"] > 0 if iv["n"] > 1 else iv["mean"] > 0):
            evidence.append(f"{what} {interval_text(iv, unit)}")
    gains = summary.get("gain", {})
    strongest = summary.get("strongest_prior", "")
    primary = next(iter(gains), None)  # psnr255 for images, f1 for labels: what "below the prior" is judged on
    failed = bool(primary is not None and gains[primary]["mean"] < 0)
    if primary is None:
        head = "no gain measured"
    else:
        unit = " dB" if primary == "psnr255" else ""
        name = "PSNR" if primary == "psnr255" else primary.upper()
        value = summary.get("prior", {}).get(strongest, {}).get(primary, float("nan"))
        head = f"{name} gain over {strongest.replace('_', ' ')} ({value:.2f}{unit}): {interval_text(gains[primary], unit)}"
    if evidence:
        detail = f"{LEAKS}: " + "; ".join(evidence)
    elif failed:
        detail = f"{NO_EVIDENCE}: the attack scored below its prior ({head}): it failed; this is not evidence of protection"
    else:
        detail = f"{NO_EVIDENCE}: {head}; no interval of a gain lies above zero"
    return {"verdict": LEAKS if evidence else NO_EVIDENCE, "verdict_detail": detail, "failed": failed}


def headline_fields(summary: dict[str, Any]) -> dict[str, Any]:
    """The few flat keys audits and tables read: verdict, strongest prior and the PSNR gain with its interval."""
    out: dict[str, Any] = {k: summary[k] for k in ("verdict", "failed", "strongest_prior") if k in summary}
    gain = summary.get("gain", {}).get("psnr255")
    if gain is not None:
        out.update(gain_psnr=gain["mean"], gain_psnr_low=gain["low"], gain_psnr_high=gain["high"])
        out["prior_psnr"] = summary["prior"][summary["strongest_prior"]]["psnr255"]
    ident = summary.get("identification", {}).get("pixel")
    if ident:
        out.update(ident_top1=ident["top1"]["mean"], ident_chance_top1=ident["chance_top1"], ident_prior_top1=ident["prior_top1"])
    return out


def describe(summary: dict[str, Any], indent: str = "  ") -> list[str]:
    """Lines for a terminal: the priors, the gains with intervals, identification and the verdict."""
    if "strongest_prior" not in summary:
        return []
    priors = summary["prior"]
    strongest = summary["strongest_prior"]
    if "psnr255" in priors[strongest]:
        listed = ", ".join(f"{n.replace('_', ' ')} {v['psnr255']:.2f}" for n, v in priors.items())
        lines = [f"{indent}prior: {strongest.replace('_', ' ')} {priors[strongest]['psnr255']:.2f} dB, the strongest of ({listed} dB)"]
    else:
        lines = [f"{indent}prior: {strongest.replace('_', ' ')} (" + ", ".join(f"{m} {v:.3f}" for m, v in priors[strongest].items()) + ")"]
    gains = summary.get("gain", {})
    parts = [
        f"{m.replace('255', '').upper()} {interval_text(iv, ' dB', 2) if m == 'psnr255' else interval_text(iv, '', 3)}" for m, iv in gains.items()
    ]
    if parts:
        lines.append(f"{indent}gain over the prior: {', '.join(parts)}")
    ident = summary.get("identification", {})
    for space in SPACES:
        if space in ident:
            d = ident[space]
            top1 = d["top1"]
            lines.append(
                f"{indent}identified ({space}, {ident['targets']} target(s) among ~{ident['pool']:.0f} images): top-1 {top1['mean']:.2f} "
                f"[{top1['low']:.2f}, {top1['high']:.2f}], top-5 {d['top5']['mean']:.2f}; chance {d['chance_top1']:.3f} / {d['chance_top5']:.3f}; "
                f"prior ({d['prior'].replace('_', ' ')}) {d['prior_top1']:.2f} / {d['prior_top5']:.2f}"
            )
    if ident.get("note"):
        lines.append(f"{indent}identification {ident['note']}")
    lines.append(f"{indent}verdict: {summary['verdict_detail']}")
    return lines


__all__ = ["Calibration", "Item", "calibrate", "describe", "headline_fields", "identification_item", "verdict"]
