"""The FedRE Figure-4 comparison: one client, one extractor, the same images, three artifacts.

For each chosen sample of a client the comparison inverts (1) its per-sample representation, (2) its
class prototype and (3) the client's entangled representation, and scores every reconstruction
against that same sample (rule (a) of shared/specs/fedre.md §2.4) and against the best-matching image
of the aggregate (rule (b)). Artifacts the run's method really transmitted are taken from the
capture; the others are computed here from the client's stored extractor and its training images,
and marked ``counterfactual`` in every output. This module is experimenter code: it reads ground
truth to choose samples and build counterfactual targets. The attack itself still gets only the
target vectors and the extractor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attacks.groundtruth import Candidates, GroundTruth
from attacks.targets import Target, soft_label_text
from attacks.view import AttackerView
from privfl.errors import ConfigError
from privfl.methods.entangle import entangle, random_draws, sample_weights
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
                ts = [Target("rep", rnd, client, tensors["reps"][p], names[c], rec["seq"], p, c) for p, c in zip(pos, classes)]
            else:
                vecs = represent(samples)
                ts = [Target("rep", rnd, client, vecs[i], names[c], None, i, c, counterfactual=True) for i, c in enumerate(classes)]
            for t, s in zip(ts, samples):
                cands[t.key] = Candidates(truth.images(s.view(1)), torch.ones(1), 0, "its own image")
        elif kind == "proto":
            by_class: dict[int, Target] = {}
            if sent:
                rec = sent[0]
                tensors = view.load(rec)
                for row, c in enumerate(tensors["classes"].tolist()):
                    by_class[c] = Target("proto", rnd, client, tensors["protos"][row], names[c], rec["seq"], row, c)
            else:
                for c in sorted(set(classes)):
                    members = pool[truth.labels[pool] == c]
                    by_class[c] = Target("proto", rnd, client, represent(members).mean(0), names[c], None, c, c, counterfactual=True)
            ts = [by_class[c] for c in classes]
            for t in by_class.values():
                members = pool[truth.labels[pool] == t.class_id]
                cands[t.key] = Candidates(truth.images(members), torch.full((len(members),), 1 / len(members)), None, "class images")
        else:  # ent_rep
            if sent:
                rec = sent[0]
                tensors = view.load(rec)
                t = Target("ent_rep", rnd, client, tensors["rep"], soft_label_text(tensors["label"], list(names)), rec["seq"], 0)
                cands[t.key] = truth.candidates(t)
            else:
                reps = represent(pool)
                labels = truth.labels[pool]
                draws = random_draws("rap", labels, num_classes, "uniform", torch_generator(seed, "compare-rap", client))
                w = sample_weights("rap", labels, num_classes, draws)
                vec, label = entangle(reps.double(), labels, num_classes, w)
                t = Target("ent_rep", rnd, client, vec.float(), soft_label_text(label, list(names)), None, 0, counterfactual=True)
                keep = w > 0
                cands[t.key] = Candidates(truth.images(pool[keep]), (w[keep] / w[keep].sum()).float(), None, "RE-weighted images")
            ts = [t] * len(samples)
        targets[kind] = ts
    return ComparisonPlan(client, rnd, samples, classes, targets, cands)
