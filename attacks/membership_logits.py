"""Membership inference from transmitted logits: which candidate records are behind a client's per-sample prediction rows.

A client that sends per-sample logits of its own training samples (a ``logits`` message of N rows,
with or without their labels) hands over its model's output on every member, but not the inputs.
The attacker holds no model of the client, so it cannot compute a candidate's logits under that
model. It builds one (our design; the membership literature queries the target model directly,
e.g. Shokri et al., S&P 2017, and we keep its game and scores, Carlini et al., S&P 2022):

1. a reference model of the client's architecture trained on population data only, with the run's
   local hyperparameters (as offline LiRA's OUT shadows);
2. ``matching_rounds`` times: predict every candidate with it, match candidates to transmitted rows
   one to one (minimum total L2 distance in log-softmax space, within each label when the rows carry
   labels; :func:`scipy.optimize.linear_sum_assignment`), then distil the reference model on the
   matched pairs (KL to the row's softmax, ``distill_epochs``). Each round the model moves towards
   the client's, and members, whose own rows are among the transmitted ones, match closer;
3. the score of a candidate is minus the distance to its matched row; an unmatched candidate (there
   are fewer rows than candidates, or it lost its row to another) scores below every matched one,
   ordered by its nearest row.

``matching_rounds=0`` scores by the nearest row under the population-only reference (no matching, no
distillation): the baseline the matching improves on (see the note of issue 12 for both numbers).
Not applicable: per-class logits (FD-style class means: each row averages a class's samples, no row
belongs to one record), a server's broadcast (no one client's training samples), a single row.
The runner reports AUC and TPR at 1 % FPR as for the other membership attacks. Attack side only:
this module never opens the ground truth; everything is seeded from (attack seed, client).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attacks.base import AttackNotApplicable, Progress, Queries, Reconstruction, Selection, Target, register_attack
from attacks.labels import representation_reading
from attacks.membership import ShadowTraining, make_optimizer, predict
from attacks.threat import Knowledge
from privfl.errors import ConfigError
from privfl.kinds import KINDS, Family
from privfl.run import AttackerView
from privfl.seeding import torch_generator


@dataclass
class LogitsMIAConfig:
    """The reference model (trained as a LiRA shadow: same field names) and the matching."""

    queries: int = 200  # the challenger hands over up to this many members and as many non-members
    population: int = 1000  # population samples handed over for the reference model
    #: epochs the reference trains on population data (0: local_epochs x rounds, capped at max_shadow_epochs)
    shadow_epochs: int = 0
    max_shadow_epochs: int = 5
    shadow_size: int = 0  # population samples it trains on (0: as many as the message has rows; at most half)
    matching_rounds: int = 6  # match-then-distil rounds (0: nearest row under the population-only reference)
    distill_epochs: int = 5  # epochs of distillation on the matched pairs per round
    eval_batch: int = 512

    def __post_init__(self) -> None:
        if self.matching_rounds < 0 or self.distill_epochs < 0:
            raise ConfigError("matching_rounds and distill_epochs must be >= 0")


@register_attack("mia-logits")
class LogitsMIA(ShadowTraining):
    """Membership inference on per-sample logits: candidates matched to the rows by a reference model distilled on the matches."""

    consumes = frozenset({str(Family.LOGITS)})
    needs = Knowledge(local_hyperparameters=True, candidates=True, population=True)
    threat_model = "eavesdropper-membership"
    paper = "match-and-distil on transmitted prediction vectors (privfl); reference model as offline LiRA's OUT shadows, Carlini et al., S&P 2022"
    Config = LogitsMIAConfig
    config: LogitsMIAConfig

    def plan_messages(self, view: AttackerView, kind: str, rnd: int, records: list[dict[str, Any]], selection: Selection) -> list[Target]:
        """One target per message of per-sample rows (index only: the tensors' names and shapes)."""
        spec = KINDS.get(kind)
        num_classes = int(view.dataset["num_classes"])
        targets, reasons = [], []
        for rec in records:
            reading = representation_reading(spec, rec["tensors"], num_classes)  # one line when nothing names a class
            if reading["read"] not in ("histogram", "argmax") or spec.vectors is None:
                reasons.append(
                    f"{kind} message {rec['seq']} holds per-class rows ({reading['rows']}): each averages a class's samples, "
                    "no row belongs to one record"
                )
                continue
            if int(rec["tensors"][spec.vectors]["shape"][0]) < 2:
                reasons.append(f"{kind} message {rec['seq']} holds a single row: nothing to match candidates against")
                continue
            targets.append(Target(kind, rnd, rec["sender"], rec, view, payload={"reading": reading}))
        if not targets:
            raise AttackNotApplicable("; ".join(dict.fromkeys(reasons)))
        return targets

    def prepare(self, targets: Sequence[Target]) -> None:
        """Load every message first, so a damaged capture fails in one line before any reference model trains."""
        for t in targets:
            assert t.record is not None  # planned on captured messages only
            t.view.load(t.record)

    # -------------------------------------------------- the reference models (LiRA's shadow training)
    def fresh_model(self, target: Target, seed: int) -> nn.Module:
        view = target.view
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return view.method_cls.build_client_model(view.model_request(target.client))

    def steps_for(self, targets: Sequence[Target]) -> int:
        return len(targets) * (1 + self.config.matching_rounds)

    # -------------------------------------------------- the score
    def run(self, target: Target, progress: Progress | None = None) -> Reconstruction:
        start = time.perf_counter()
        assert target.record is not None  # planned on captured messages only
        cfg = self.config
        queries, population = self.handed(target, "queries"), self.handed(target, "population")
        spec = KINDS.get(target.kind)
        assert spec.vectors is not None  # plan kept only kinds with vectors
        reading = target.payload["reading"]
        tensors = target.view.load(target.record)
        logits = tensors[spec.vectors].float()
        rows = F.log_softmax(logits.double(), dim=1)
        row_labels = tensors[reading["rows"]].long().flatten() if reading["read"] == "histogram" else None
        epochs, _, hp = self.shadow_plan(target, population)  # raises when the population is too small
        size = max(1, min(cfg.shadow_size or len(rows), len(population.y) // 2))
        with torch.random.fork_rng(devices=[]):
            model, last = self.train_shadow(target, 0, population, epochs, size, hp)
            if progress:
                progress(f"{target.client} reference", 0, 1 + cfg.matching_rounds, last)
            gen = torch_generator(self.seed, "mia-logits-distil", target.client)
            opt = make_optimizer(model.parameters(), hp)
            matched: list[float] = []
            for r in range(cfg.matching_rounds):
                distances = torch.cdist(self.log_probs(model, queries), rows)
                pairs = match(distances, queries.y, row_labels)
                matched.append(float(distances[pairs[0], pairs[1]].mean()))
                last = distil(
                    model, opt, queries.x[pairs[0]], F.softmax(logits[pairs[1]], dim=1), cfg.distill_epochs, hp["batch_size"], gen, self.device
                )
                if progress:
                    progress(f"{target.client} match {r + 1}/{cfg.matching_rounds}", r + 1, 1 + cfg.matching_rounds, last)
            reference = self.log_probs(model, queries)
        distances = torch.cdist(reference, rows)
        nearest = nearest_distance(reference, queries.y, rows, row_labels)
        notes: dict[str, Any] = {
            "transmitted_rows": len(rows),
            "rows_labelled": row_labels is not None,
            "reference_epochs": epochs,
            "reference_size": size,
            "population": len(population.y),
            "matching_rounds": cfg.matching_rounds,
        }
        if cfg.matching_rounds:
            qi, ri = match(distances, queries.y, row_labels)
            scores = -(nearest + float(distances[torch.isfinite(distances)].max()) + 1.0)  # unmatched: below every match
            scores[qi] = -distances[qi, ri]
            notes["score"] = "-(distance to the matched row) after match-and-distil rounds; unmatched candidates below, by nearest row"
            notes["mean_matched_distance"] = [round(d, 4) for d in matched]
        else:
            scores = -nearest
            notes["score"] = "-(distance to the nearest transmitted row of the label) under the population-only reference"
        if row_labels is None:
            notes["approximation"] = "the rows carry no labels: rows of every class compete for every candidate"
        return Reconstruction(target, None, float(nearest.mean()), time.perf_counter() - start, scores=scores.float(), notes=notes)

    def log_probs(self, model: nn.Module, queries: Queries) -> torch.Tensor:
        return F.log_softmax(predict(model, queries.x, self.config.eval_batch, self.device).double(), dim=1)


def match(distances: torch.Tensor, labels: torch.Tensor, row_labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One-to-one matching of candidates to rows of minimum total distance (within each label when
    rows have labels): (candidate indices, row indices)."""
    from scipy.optimize import linear_sum_assignment

    cost = distances.clone()
    if row_labels is not None:
        cost[labels.view(-1, 1) != row_labels.view(1, -1)] = float(cost.max()) * 10 + 1e6  # never chosen over a same-label row
    qi, ri = linear_sum_assignment(cost.numpy())
    qt, rt = torch.as_tensor(qi, dtype=torch.long), torch.as_tensor(ri, dtype=torch.long)
    if row_labels is not None:
        keep = labels[qt] == row_labels[rt]
        qt, rt = qt[keep], rt[keep]
    return qt, rt


def distil(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    soft: torch.Tensor,
    epochs: int,
    batch: int,
    gen: torch.Generator,
    device: torch.device,
) -> float:
    """``epochs`` of KL(soft || model(x)) on the matched pairs; the last batch's loss."""
    model.train()
    last = 0.0
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), batch):
            idx = order[i : i + batch]
            loss = F.kl_div(F.log_softmax(model(x[idx].to(device)), dim=1), soft[idx].to(device), reduction="batchmean")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            last = float(loss.detach())
    return last


def nearest_distance(reference: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor, row_labels: torch.Tensor | None) -> torch.Tensor:
    """Per query, the L2 distance from its reference prediction to the nearest row (of its label, when rows have labels).
    A label no row has gives the distance to the nearest row of any label (such a query is unlikely a member)."""
    d = torch.cdist(reference, rows)  # (N queries, R rows)
    if row_labels is not None:
        same = labels.view(-1, 1) == row_labels.view(1, -1)
        has = same.any(1)
        d = torch.where(same | ~has.view(-1, 1), d, torch.full_like(d, float("inf")))
    return d.min(1).values


__all__ = ["LogitsMIA", "LogitsMIAConfig", "distil", "match", "nearest_distance"]
