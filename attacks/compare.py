"""The FedRE Figure-4 comparison: one client, one extractor, the same images, three artifacts.

For each chosen sample of a client the comparison inverts (1) its per-sample representation, (2) its
class prototype and (3) the client's entangled representation, and scores every reconstruction
against that same sample (the per-sample rule, docs/decisions.md "FedRE") and against the best-matching image
of the aggregate (rule (b)). Artifacts the run's method really transmitted are taken from the
capture; the others are computed here from the client's stored extractor and its training images,
and marked ``counterfactual`` in every output. This module is experimenter code: it reads ground
truth to choose samples and build counterfactual targets. The attack itself still gets only the
target vectors and the extractor; it runs through the attack runner's :func:`~attacks.runner.execute`
and :func:`~attacks.runner.write_report` (:func:`compare_artifacts`).
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from attacks.base import Reconstruction, Target, create_attack
from attacks.invert import RepresentationInversion, soft_label_text
from attacks.runner import AttackReport
from attacks.scoring import Candidates, candidates
from privfl.errors import CaptureError, ConfigError
from privfl.fl.entangle import entangle, random_draws, sample_weights
from privfl.run import AttackerView, GroundTruth, Run
from privfl.seeding import numpy_rng, torch_generator

COMPARABLE = ("rep", "proto", "ent_rep")


@dataclass
class ComparisonPlan:
    client: str
    round: int
    samples: torch.Tensor  # (N,) dataset indices (within the run's data) of the chosen images
    classes: list[int]
    targets: dict[str, list[Target]]  # kind -> one target per sample (aggregates repeat the same target)
    candidates: dict[str, Candidates]  # target key -> its aggregate's images (rule b)


def choose_samples(truth: GroundTruth, client: str, n: int, seed: int) -> torch.Tensor:
    """One random training image from each of the client's n most frequent classes (fewer if it has
    fewer classes; then more images of its top classes)."""
    pool = truth.client_train(client)
    labels = truth.labels[pool]
    classes, counts = labels.unique(return_counts=True)
    order = classes[torch.argsort(counts, descending=True)].tolist()
    rng = numpy_rng(seed, "compare-samples", client)
    chosen: list[int] = []
    while len(chosen) < min(n, len(pool)):
        for c in order:
            options = [int(i) for i in pool[labels == c] if int(i) not in chosen]
            if options and len(chosen) < n:
                chosen.append(options[int(rng.integers(len(options)))])
    return torch.tensor(chosen)


def plan(view: AttackerView, truth: GroundTruth, kinds: list[str], client: str, rnd: int, n: int, seed: int) -> ComparisonPlan:
    bad = [k for k in kinds if k not in COMPARABLE]
    if bad:
        raise ConfigError(f"--compare accepts {', '.join(COMPARABLE)}; got {', '.join(bad)}")
    names = truth.dataset.class_names
    num_classes = len(names)
    model = view.extractor(client, rnd)
    samples = choose_samples(truth, client, n, seed)
    classes = truth.labels[samples].tolist()
    pool = truth.client_train(client)
    mean = torch.tensor(view.dataset["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(view.dataset["std"]).view(1, -1, 1, 1)

    def represent(idx: torch.Tensor) -> torch.Tensor:
        out = []
        with torch.no_grad():
            for s in range(0, len(idx), 512):
                out.append(model.represent((truth.images(idx[s : s + 512]) - mean) / std))
        return torch.cat(out)

    targets: dict[str, list[Target]] = {}
    cands: dict[str, Candidates] = {}
    for kind in kinds:
        sent = view.messages(kind, rnd, [client])
        if kind == "rep":
            if sent:
                rec = sent[0]
                rows = truth.message_truth(rec["seq"])["indices"]
                tensors = view.load(rec)
                pos = [int((rows == s).nonzero()[0]) for s in samples]
                ts = [Target("rep", rnd, client, rec, view, p, names[c], c, payload={"vector": tensors["reps"][p]}) for p, c in zip(pos, classes)]
            else:
                vecs = represent(samples)
                ts = [
                    Target("rep", rnd, client, None, view, i, names[c], c, counterfactual=True, payload={"vector": vecs[i]})
                    for i, c in enumerate(classes)
                ]
            for t, s in zip(ts, samples):
                cands[t.key] = Candidates(truth.images(s.view(1)), torch.ones(1), 0, "its own image", s.view(1))
        elif kind == "proto":
            by_class: dict[int, Target] = {}
            if sent:
                rec = sent[0]
                tensors = view.load(rec)
                for row, c in enumerate(tensors["classes"].tolist()):
                    by_class[c] = Target("proto", rnd, client, rec, view, row, names[c], c, payload={"vector": tensors["protos"][row]})
            else:
                for c in sorted(set(classes)):
                    members = pool[truth.labels[pool] == c]
                    by_class[c] = Target(
                        "proto", rnd, client, None, view, c, names[c], c, counterfactual=True, payload={"vector": represent(members).mean(0)}
                    )
            ts = [by_class[c] for c in classes]
            for t in by_class.values():
                members = pool[truth.labels[pool] == t.class_id]
                cands[t.key] = Candidates(truth.images(members), torch.full((len(members),), 1 / len(members)), None, "class images", members)
        else:  # ent_rep
            if sent:
                rec = sent[0]
                tensors = view.load(rec)
                t = Target("ent_rep", rnd, client, rec, view, 0, soft_label_text(tensors["label"], list(names)), payload={"vector": tensors["rep"]})
                cands[t.key] = candidates(truth, t)
            else:
                reps = represent(pool)
                labels = truth.labels[pool]
                draws = random_draws("rap", labels, num_classes, "uniform", torch_generator(seed, "compare-rap", client))
                w = sample_weights("rap", labels, num_classes, draws)
                vec, label = entangle(reps.double(), labels, num_classes, w)
                t = Target(
                    "ent_rep",
                    rnd,
                    client,
                    None,
                    view,
                    0,
                    soft_label_text(label, list(names)),
                    counterfactual=True,
                    payload={"vector": vec.float(), "soft_label": label.float()},
                )
                keep = w > 0
                cands[t.key] = Candidates(truth.images(pool[keep]), (w[keep] / w[keep].sum()).float(), None, "RE-weighted images", pool[keep])
            ts = [t] * len(samples)
        targets[kind] = ts
    return ComparisonPlan(client, rnd, samples, classes, targets, cands)


def compare_artifacts(
    run: Run | str | Path,
    kinds: Sequence[str] = COMPARABLE,
    *,
    client: str | int | None = None,
    round: int | None = None,
    samples: int = 4,
    options: dict[str, Any] | None = None,
    seed: int = 0,
    device: str | torch.device = "auto",
    name: str | None = None,
    write: bool = True,
    progress: bool = False,
    data_root: str | None = None,
    deterministic: bool = False,
    learned: bool = False,
    learned_options: dict[str, Any] | None = None,
) -> AttackReport:
    """The Figure-4 comparison on one client (default: the first with a stored extractor) at one round
    (default: the last stored): invert each artifact through the runner's ``invert`` attack and score
    every reconstruction against the same sample images (rule a) and its aggregate's best match (rule b).
    ``deterministic``: torch's deterministic kernels while the inversions run (``--deterministic``).
    ``learned``: also invert every target with ``invert-learned`` (``learned_options``), its own gallery
    rows, scores and verdicts; each kind is then ordered and judged by its strongest attack."""
    from attacks.calibration import Item, calibrate, headline_fields, identification_item
    from attacks.metrics import score_images, summarize
    from attacks.priors import LEAKS, PriorBank, revealed_classes
    from attacks.runner import base_protocol, client_names, execute, output_folder, resolve_attack_device, write_report
    from attacks.scoring import Scored, score

    run = run if isinstance(run, Run) else Run.open(run)
    if write and name is not None:
        output_folder(run, name)  # a bad or foreign output folder is refused before the inversions run
    kinds = list(kinds)
    view = run.attacker
    ext = view.extractor_records()
    if not ext:
        raise CaptureError(f"run {run.path} stores no client extractors: the comparison needs them")
    if client is None:
        client = cast(str, sorted({r["client"] for r in ext}, key=lambda c: int(c[6:]))[0])
    else:
        client = client_names([client])[0]
    rounds = sorted({r["round"] for r in ext if r["client"] == client})
    if not rounds:
        raise CaptureError(f"the run stores no extractor of {client}")
    rnd = rounds[-1] if round is None else round
    attack = cast(RepresentationInversion, create_attack("invert", seed=seed, device=resolve_attack_device(device, deterministic), **(options or {})))
    reason = attack.missing_knowledge(view)
    if reason:
        raise CaptureError(reason)
    name = name or f"compare-{'-'.join(kinds)}-{client}-r{rnd}"
    if write:
        output_folder(run, name)
    truth = run.ground_truth(data_root)
    p = plan(view, truth, kinds, client, rnd, samples, seed)
    unique = list({t.key: t for ts in p.targets.values() for t in ts}.values())
    recons, seconds = execute(attack, unique, progress=progress, desc=f"compare {', '.join(kinds)} on {client} r{rnd}", deterministic=deterministic)
    found: dict[str, dict[str, Reconstruction]] = {"": {r.target.key: r for r in recons}}
    times = {"": seconds}
    if learned:  # the learned inversion on the same targets: population data handed over as the runner's challenger does
        from attacks.runner import hand_over

        decoder = create_attack("invert-learned", seed=seed, device=attack.device, **(learned_options or {}))
        hand_over(truth, run.dataset, unique, decoder)
        lrecons, times["learned"] = execute(
            decoder, unique, progress=progress, desc=f"learned inversion on {client} r{rnd}", deterministic=deterministic
        )
        found["learned"] = {r.target.key: r for r in lrecons}
    sample_images = truth.images(p.samples)
    bank = PriorBank(truth, seed)
    num_classes = len(truth.dataset.class_names)
    prior_rows: dict[str, tuple[list[str], torch.Tensor, list[str]]] = {}  # the strongest prior per kind, shared rows merged
    rows, gallery_rows, labels = [], [], {}
    summary: dict[str, Any] = {
        "targets": len(unique),
        "seconds_total": builtins.round(seconds, 2),
        "seconds_per_target": builtins.round(seconds / len(unique), 3),
    }
    if learned:
        summary["learned_seconds_per_target"] = builtins.round(times["learned"] / len(unique), 3)
    for kind in kinds:
        for tag, by_key in found.items():
            pre = f"{kind}_{tag}_" if tag else f"{kind}_"
            images = torch.stack([by_key[t.key].image for t in p.targets[kind]])
            per = score_images(images, sample_images)  # rule (a): against the same sample
            cf = p.targets[kind][0].counterfactual
            row_label = f"{kind}{' (counterfactual)' if cf else ''}{f' ({tag})' if tag else ''}"
            gallery_rows.append((row_label, images))
            labels[row_label] = [f"PSNR {v:.2f} dB" for v in per["psnr255"]]
            best = {t.key: score(by_key[t.key].image, p.candidates[t.key]) for t in {t.key: t for t in p.targets[kind]}.values()}
            # the priors under rule (a): what the attacker has without this kind's message, against the same sample
            items = []
            for i, t in enumerate(p.targets[kind]):
                own = Candidates(sample_images[i : i + 1], torch.ones(1), 0, "the sample", p.samples[i : i + 1])
                scores = {f"exact_{m}": v[i] for m, v in per.items()}
                ident = identification_item(truth, client, own.indices)
                items.append(Item(by_key[t.key].image, own, "exact", client, scores, revealed_classes(t, num_classes), ident))
            cal = calibrate(items, truth, bank, seed)
            strongest = f"prior: {cal.summary['strongest_prior'].replace('_', ' ')}"
            if strongest in cal.labels:  # not the blank image
                imgs = dict(cal.gallery)[strongest]
                same = next((key for key, (_, other, _) in prior_rows.items() if torch.equal(other, imgs)), None)
                if same is None:
                    prior_rows[f"{kind}.{strongest}"] = ([kind], imgs, cal.labels[strongest])
                elif kind not in prior_rows[same][0]:
                    prior_rows[same][0].append(kind)
            for i, t in enumerate(p.targets[kind]):
                rows.append(
                    {
                        "kind": kind,
                        "attack": "invert-learned" if tag else "invert",
                        "counterfactual": cf,
                        "client": client,
                        "round": rnd,
                        "sample": int(p.samples[i]),
                        "class": truth.dataset.class_names[p.classes[i]],
                        "target": t.key,
                        **{f"sample_{m}": v[i] for m, v in per.items()},
                        **{k: v for k, v in best[t.key].items() if k.startswith("best_")},
                        # the inversion's own final objective (extractor(G(z)) vs the target): convergence is checkable
                        "feature_mse": by_key[t.key].loss,
                        **cal.rows[i],
                    }
                )
            summary.update({f"{pre}sample_{k}": v for k, v in summarize(per).items()})
            summary[f"{pre}feature_mse"] = float(sum(by_key[t.key].loss for t in p.targets[kind]) / len(p.targets[kind]))
            summary[f"{kind}_counterfactual"] = cf
            summary.update({f"{pre}{k}": v for k, v in headline_fields(cal.summary).items()})
            summary[f"{pre}calibration"] = cal.summary
        # the kind is judged by its strongest attack (the larger gain over the prior)
        tags = sorted(found, key=lambda tag: summary.get(f"{kind}_{tag}_gain_psnr" if tag else f"{kind}_gain_psnr", float("-inf")))
        top = tags[-1]
        summary[f"{kind}_strongest_attack"] = "invert-learned" if top else "invert"
        for key in ("verdict", "failed", "sample_psnr255"):
            summary[f"{kind}_strongest_{key}"] = summary[f"{kind}_{top}_{key}" if top else f"{kind}_{key}"]
    for key, (shown_for, imgs, captions) in prior_rows.items():
        label = f"{key.split('.', 1)[1]} ({', '.join(shown_for)})"
        gallery_rows.append((label, imgs))
        labels[label] = captions
    order = [summary[f"{k}_strongest_sample_psnr255"] for k in kinds]
    summary["ordering"] = " > ".join(f"{k} ({v:.2f} dB)" for k, v in sorted(zip(kinds, order), key=lambda kv: -kv[1]))
    if kinds == ["rep", "proto", "ent_rep"]:
        summary["paper_ordering_holds"] = bool(order[0] > order[1] > order[2])
    # an attack below its prior failed: ranking it says nothing about how much its artifact leaks
    failed = [k for k in kinds if summary.get(f"{k}_strongest_failed")]
    unproven = [k for k in kinds if summary.get(f"{k}_strongest_verdict") != LEAKS and k not in failed]
    summary["ordering_meaningful"] = not failed and not unproven
    if failed or unproven:
        why = []
        if failed:
            why.append(f"the attack on {', '.join(failed)} scored below its prior (it failed)")
        if unproven:
            why.append(f"{', '.join(unproven)} showed no evidence beyond the prior")
        summary["ordering_note"] = (
            f"the ordering is not evidence that an artifact leaks less: {'; '.join(why)}. Read each kind's verdict, not its rank."
        )
    rule = "(a) each reconstruction against the same sample image; (b) best match in the artifact's aggregate"
    protocol = {
        **base_protocol(attack, run, deterministic),
        **attack.protocol(),
        "dip_levels_used": attack.levels_used(run.dataset["image_size"]),
        "compare": kinds,
        "attacks": ["invert", "invert-learned"] if learned else ["invert"],
        **({"learned": decoder.protocol()} if learned else {}),
        "client": client,
        "round": rnd,
        "samples": p.samples.tolist(),
        "counterfactual": {k: p.targets[k][0].counterfactual for k in kinds},
        "ground_truth_rule": rule,
        "psnr_convention": "per image, then averaged; MSE on [0,1] and on 0-255 (FedRE papers' scale) averaged separately",
    }
    report = AttackReport("compare", ",".join(kinds), rnd, protocol, summary, rows, recons)
    if write:
        scored = Scored(rows, summary, sample_images, gallery_rows, [truth.dataset.class_names[c] for c in p.classes], labels, rule)
        report.folder = write_report(
            run,
            name,
            scored,
            protocol,
            title=f"Representation vs prototype vs entangled representation ({run.method})",
            heading=f"{client}, round {rnd}",
            gallery_title=f"{run.method}: {client}, round {rnd}: what each artifact reveals",
            reconstructions={f"{k}.{i}": by_key[t.key].image.unsqueeze(0) for k in kinds for i, t in enumerate(p.targets[k])},
            text="Rows marked counterfactual were not transmitted by this method; they were computed from the client's stored extractor and data.",
        )
    return report
