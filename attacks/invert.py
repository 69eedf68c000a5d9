"""The representation-inversion attack: DIP generators matched to captured representations.

Threat model (the 2025 FedRE version, "Rethinking Client Knowledge for Federated Learning", Sec. 3
"Threat Model"): an honest-but-curious server that sees the captured message and holds the client's
extractor (incl. RM) as it was when it produced the artifact. It does not see the client's data: this
module never opens the ground-truth store.

It takes every kind of the per-sample and aggregate representation families (``rep``, ``proto``,
``global_proto``, ``ent_rep`` and any kind a user registers there): each row of the kind's declared
``vectors`` tensor is one target, inverted through the extractor of the client it belongs to (the
sender, or the receiver of a server's broadcast).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from attacks.base import Attack, AttackNotApplicable, Progress, Reconstruction, Selection, Target, register_attack
from attacks.dip import DIPConfig, invert
from attacks.threat import Knowledge
from privfl.kinds import KINDS, Family
from privfl.run import AttackerView, client_of
from privfl.seeding import derive_seed

__all__ = ["InversionConfig", "RepresentationInversion", "VectorTargets", "resolve_vector", "soft_label_text"]


@dataclass
class InversionConfig(DIPConfig):
    """The DIP settings (:class:`attacks.dip.DIPConfig`) plus how many targets share one optimisation."""

    batch: int = 16  # targets of one extractor optimised together, as one grouped network

    def dip(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("batch")
        return out


def resolve_vector(target: Target) -> torch.Tensor:
    """The target's vector (d,) from its message (cached in ``payload["vector"]``), filling in what the
    message says about its class: ``class_id`` and ``label`` for per-class rows, ``payload["soft_label"]``
    and a ``label`` text for a soft label. Shared by every attack that inverts representation rows."""
    if "vector" in target.payload:
        return target.payload["vector"]
    spec = KINDS.get(target.kind)
    assert target.record is not None and spec.vectors is not None  # a captured message of a kind with vectors
    tensors = target.view.load(target.record)
    names = target.view.dataset["class_names"]
    vectors = tensors[spec.vectors]
    row = target.row or 0
    vector = vectors if vectors.dim() == 1 else vectors[row]
    if spec.classes and spec.classes in tensors and vectors.dim() == 2:
        target.class_id = int(tensors[spec.classes][row])
        target.label = names[target.class_id]
    elif spec.soft_label and spec.soft_label in tensors:
        target.payload["soft_label"] = tensors[spec.soft_label].float().cpu()
        target.label = soft_label_text(tensors[spec.soft_label], names)
    target.payload["vector"] = vector
    return vector


def soft_label_text(label: torch.Tensor, class_names: Sequence[str], top: int = 3) -> str:
    values, idx = label.float().topk(min(top, len(label)))
    return " + ".join(f"{v:.2f} {class_names[i]}" for v, i in zip(values.tolist(), idx.tolist()) if v > 0)


class VectorTargets(Attack):
    """What every attack that inverts representation rows does with its targets: each target's vector (and
    what its message says of the class) is read before anything runs, so a damaged capture fails in one
    line; one target runs as a batch of one."""

    def resolve(self, target: Target) -> torch.Tensor:
        return resolve_vector(target)

    def prepare(self, targets: Sequence[Target]) -> None:
        for t in targets:
            self.resolve(t)

    def run(self, target: Target, progress: Progress | None = None) -> Reconstruction:
        return self.run_batch([target], progress)[0]


@register_attack("invert")
class RepresentationInversion(VectorTargets):
    consumes = frozenset({str(Family.PER_SAMPLE_REPRESENTATION), str(Family.AGGREGATE_REPRESENTATION)})
    needs = Knowledge(extractor=True)
    threat_model = "curious-server-whitebox-extractor"
    paper = "Ulyanov et al., Deep Image Prior, CVPR 2018; used by FedRE [000] Q3 / [001] Q2"
    Config = InversionConfig

    def plan_messages(self, view: AttackerView, kind: str, rnd: int, records: list[dict[str, Any]], selection: Selection) -> list[Target]:
        """One target per row of the kind's vectors (at most ``selection.max_targets`` per message), for
        the clients whose extractor of that round the run stores."""
        spec = KINDS.get(kind)
        stored = {(r["client"], r["round"]) for r in view.extractor_records()}
        targets, missing = [], []
        for rec in records:
            client = client_of(rec)
            if (client, rnd) not in stored:
                missing.append(client)
                continue
            shape = rec["tensors"][spec.vectors]["shape"]
            rows = [None] if len(shape) == 1 else range(min(selection.max_targets, shape[0]))
            for row in rows:
                targets.append(Target(kind, rnd, client, rec, view, row=0 if row is None else row))
        if not targets:
            try:
                view.extractor(missing[0], rnd)  # raises with the list of what is stored
            except Exception as exc:
                raise AttackNotApplicable(
                    str(exc), f"store extractors of round {rnd} too: --knowledge-rounds {rnd} (or --knowledge-every N)"
                ) from None
        return targets

    def steps_for(self, targets: Sequence[Target]) -> int:
        groups: dict[tuple[str, int], int] = defaultdict(int)
        for t in targets:
            groups[(t.client, t.round)] += 1
        return sum(-(-n // self.config.batch) for n in groups.values()) * self.config.steps

    def run_batch(self, targets: Sequence[Target], progress: Progress | None = None) -> list[Reconstruction]:
        """Invert every target through its client's extractor, several targets per optimisation."""
        groups: dict[tuple[str, int], list[Target]] = defaultdict(list)
        for t in targets:
            groups[(t.client, t.round)].append(t)
        out: list[Reconstruction] = []
        cfg = self.config
        for (client, rnd), members in groups.items():
            view = members[0].view
            ds = view.dataset
            shape = (ds["channels"], ds["image_size"], ds["image_size"])
            model = view.extractor(client, rnd, self.device)
            for start in range(0, len(members), cfg.batch):
                chunk = members[start : start + cfg.batch]
                label = f"{client} r{rnd} targets {start + 1}-{start + len(chunk)}/{len(members)}"
                hook = (lambda step, loss, label=label: progress(label, step, cfg.steps, loss)) if progress else None
                result = invert(
                    model.represent,
                    torch.stack([self.resolve(t).float() for t in chunk]),
                    shape,
                    ds["mean"],
                    ds["std"],
                    cfg,
                    [derive_seed(self.seed, "dip", t.key) for t in chunk],
                    device=self.device,
                    progress=hook,
                )
                for i, t in enumerate(chunk):
                    loss = float(result.feature_loss[i])
                    out.append(Reconstruction(t, result.images[i : i + 1], loss, result.seconds / len(chunk), notes={"feature_mse": loss}))
        return out

    def protocol(self) -> dict[str, Any]:
        return {"dip": self.config.dip(), "batch": self.config.batch}

    def levels_used(self, image_size: int) -> int:
        return self.config.depth_for(self.config.canvas(image_size, image_size))
