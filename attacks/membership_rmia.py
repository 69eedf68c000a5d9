"""RMIA: membership inference by a likelihood ratio against population records (Zarifzadeh, Liu, Shokri, ICML 2024).

The game, the two ways to the client's model (captured parameters, or a stored extractor + the
broadcast head) and the reference models are those of :mod:`attacks.membership`; only the score differs.

Low-Cost High-Power Membership Inference Attacks (Zarifzadeh et al., ICML 2024, Sec. 3): with
``Pr(x | theta)`` the target model's softmax probability of the query's label and ``Pr(x)`` the same
probability averaged over reference models, the pairwise likelihood ratio of a query ``x`` against a
population record ``z`` is

    LR(x, z) = (Pr(x | theta) / Pr(x)) / (Pr(z | theta) / Pr(z)),

and the score of ``x`` is the fraction of population records it dominates, ``Pr_z(LR(x, z) >= gamma)``
(``gamma`` 1 by default, as in the paper). Dividing by ``Pr(x)`` cancels how easy the record is for any
model; comparing with many ``z`` calibrates against what the target model does to records it never saw.

- **offline** references (``online=False``, the paper's low-cost setting): shadows trained on population
  records only, as offline LiRA's, never on a query. ``Pr(x)`` is then the mean over OUT models, which
  underestimates the mixture over IN and OUT models that the ratio needs; the paper's offline
  approximation models the IN mean as linear in the OUT mean and takes
  ``Pr(x) = ((1 + a) Pr_OUT(x) + (1 - a)) / 2``, ``a`` = ``offline_a`` (0.3, the authors' code default; the
  paper tunes it per dataset on one reference model). Each population record ``z`` is averaged over the
  shadows that did not train on it (a record every shadow trained on is left out) and corrected alike;
- **online** references (``online=True``): the shadows of online LiRA, each trained on population
  records plus a random half of the queries (each query IN for exactly half of them); ``Pr(x)`` and
  ``Pr(z)`` are plain means over all of them, no ``a``.

``rounds="all"`` scores the queries on the client's model of every round the attacker can rebuild and
averages the per-round scores (FedMIA's temporal aggregation, Zhu et al. 2024; see
:meth:`attacks.membership.MembershipAttack.run`); the reference models are trained once, for the
client's whole training (``local_epochs x rounds`` epochs, capped), and serve every round.

Attack side only: this module never opens the ground truth; everything is seeded from (attack seed, client).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attacks.base import AttackNotApplicable, Progress, Queries, Selection, Target, register_attack
from attacks.membership import (
    _PATH_A,
    _PATH_B,
    CapturedModelMembership,
    ExtractorHeadMembership,
    ReferenceSignals,
    ShadowTraining,
    check_rounds,
    predict,
)
from attacks.threat import Knowledge
from privfl.errors import ConfigError
from privfl.run import client_of

#: where RMIA's reference models come from (see RMIAConfig.references)
REFERENCES = ("shadows", "clients")


@dataclass
class RMIAConfig:
    """RMIA with the reference models of LiRA (same field names, same shadows for the same seed)."""

    queries: int = 200  # the challenger hands over up to this many members and as many non-members
    population: int = 1000  # population records handed over: reference-model training data and the z of the ratio
    shadows: int = 4  # reference models (the paper: strong from 1-2 on; online needs an even number)
    #: epochs each reference model trains (0: local_epochs x rounds, capped at max_shadow_epochs)
    shadow_epochs: int = 0
    max_shadow_epochs: int = 5
    shadow_size: int = 0  # records per reference model (0: the sender's num_samples, at most half the population)
    online: bool = False  # reference models also train on a random half of the queries (IN and OUT models)
    #: shadows: models the attacker trains (LiRA's); clients: the other clients' models of the same round,
    #: rebuilt from their uploads as the target's is (FedMIA's "all for one": none trained on the target's
    #: records, so all are OUT references, and no training at all)
    references: str = "shadows"
    offline_a: float = 0.3  # Pr(x) = ((1 + a) Pr_OUT(x) + (1 - a)) / 2 with offline references (the paper's offline RMIA)
    gamma: float = 1.0  # x dominates z when LR(x, z) >= gamma (paper: 1)
    rounds: str = "last"  # last: the planned round's model; all: the mean score over every round of the client (FedMIA)
    eval_batch: int = 512

    def __post_init__(self) -> None:
        if self.shadows < 1:
            raise ConfigError(f"RMIA needs at least 1 reference model, got shadows={self.shadows}")
        if self.references not in REFERENCES:
            raise ConfigError(f"references must be one of {', '.join(REFERENCES)}, got {self.references!r}")
        if self.online and self.references != "shadows":
            raise ConfigError("online references are shadows trained on half of the queries: online=True needs references='shadows'")
        if self.online and self.shadows % 2:
            raise ConfigError(f"online RMIA needs an even number of reference models (each query IN for half of them), got {self.shadows}")
        if not 0.0 <= self.offline_a <= 1.0:
            raise ConfigError(f"offline_a must lie in [0, 1], got {self.offline_a}")
        if not self.gamma > 0:
            raise ConfigError(f"gamma must be > 0, got {self.gamma}")
        check_rounds(self.rounds)


def label_log_probability(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log Pr(x | model) = log softmax(logits)_y in float64, over any leading dimensions of ``logits`` (..., N, C)."""
    logp = F.log_softmax(logits.double(), dim=-1)
    return logp.gather(-1, y.expand(*logp.shape[:-1]).unsqueeze(-1)).squeeze(-1)


def marginal(log_ref: torch.Tensor, trained_on: torch.Tensor, online: bool, a: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log Pr(record) from the reference models' log Pr(record | model) (S, M): the mean over all of them
    (online), else over those that did not train on the record, corrected by the offline approximation
    ``((1 + a) mean + (1 - a)) / 2``. Also the mask of records that have such a mean."""
    if online:
        return torch.logsumexp(log_ref, 0) - torch.log(torch.tensor(float(log_ref.shape[0]), dtype=torch.float64)), torch.ones(
            log_ref.shape[1], dtype=torch.bool
        )
    out = ~trained_on
    count = out.sum(0)
    mean_out = (log_ref.exp() * out).sum(0) / count.clamp_min(1)
    return torch.log((1 + a) / 2 * mean_out + (1 - a) / 2), count > 0


def rmia_scores(
    target_x: torch.Tensor,
    reference_x: torch.Tensor,
    x_trained_on: torch.Tensor,
    target_z: torch.Tensor,
    reference_z: torch.Tensor,
    z_trained_on: torch.Tensor,
    *,
    online: bool,
    a: float,
    gamma: float,
) -> tuple[torch.Tensor, int]:
    """RMIA's score of each query: the fraction of population records z with LR(x, z) >= gamma (Sec. 3).

    Inputs are log Pr(. | model): ``target_x`` (N,), ``reference_x`` (S, N), ``target_z`` (P,),
    ``reference_z`` (S, P); ``*_trained_on`` (S, N) / (S, P) say which reference model trained on which
    record. Returns the scores (N,) and the number of z used."""
    px, _ = marginal(reference_x, x_trained_on, online, a)
    pz, usable = marginal(reference_z, z_trained_on, online, a)
    if not usable.any():
        raise ConfigError("every population record was trained on by every reference model: no z to compare with (more shadows or population)")
    ratio_x = target_x - px  # log(Pr(x | theta) / Pr(x))
    ratio_z = torch.sort(target_z[usable] - pz[usable]).values
    # LR(x, z) >= gamma  <=>  ratio_z <= ratio_x - log(gamma): count them in the sorted z ratios
    dominated = torch.searchsorted(ratio_z, ratio_x - torch.log(torch.tensor(gamma, dtype=torch.float64)), right=True)
    return dominated.double() / len(ratio_z), int(usable.sum())


class RMIAScoring(ShadowTraining):
    """RMIA's score on the reference models of :class:`~attacks.membership.ShadowTraining` (see the module docstring)."""

    paper = "Zarifzadeh, Liu, Shokri, Low-Cost High-Power Membership Inference Attacks, ICML 2024 (RMIA)"
    Config = RMIAConfig
    config: RMIAConfig

    def steps_for(self, targets: Sequence[Target]) -> int:
        return len(targets) * (self.config.shadows if self.config.references == "shadows" else 1)

    def client_references(self, target: Target, queries: Queries, population: Queries, progress: Progress | None) -> ReferenceSignals:
        """The other clients' models of the target's round as OUT reference models (FedMIA, Zhu et al. 2024):
        planned and rebuilt as the target's own model is; none trained on a query or a population record."""
        view = target.view
        records = [r for r in self.messages_of(view, target.kind, target.round) if client_of(r) != target.client]
        reason = f"no other client's {target.kind} in round {target.round}"
        try:
            planned = self.plan_messages(view, target.kind, target.round, records, Selection(target.kind, [target.round])) if records else []
        except AttackNotApplicable as exc:
            planned, reason = [], f"{reason} can be rebuilt: {exc}"
        others = list({t.client: t for t in planned if t.client != target.client}.values())
        if not others:
            raise AttackNotApplicable(f"{target.key}: {reason}, so references='clients' has no reference model (use references='shadows')")
        on_queries, on_population = [], []
        for other in others:
            model = self.target_model(other)[0].to(self.device).eval()
            on_queries.append(predict(model, queries.x, self.config.eval_batch, self.device))
            on_population.append(predict(model, population.x, self.config.eval_batch, self.device))
        if progress:
            progress(f"{target.client} references", 0, 1, 0.0)
        s = len(others)
        who = f"the other {s} clients' models" if s > 1 else "the other client's model"
        info = {"shadows": 0, "population": len(population.y), "references": f"{who} of round {target.round}"}
        return ReferenceSignals(
            torch.stack(on_queries),
            torch.stack(on_population),
            torch.zeros(s, len(queries.y), dtype=torch.bool),
            torch.zeros(s, len(population.y), dtype=torch.bool),
            info,
        )

    def score(self, target: Target, model: nn.Module, queries: Queries, progress: Progress | None) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.config
        population = self.handed(target, "population")
        if cfg.references == "clients":
            refs = self.client_references(target, queries, population, progress)
        else:
            refs = self.reference_signals(target, queries, population, progress)
        logits = predict(model, queries.x, cfg.eval_batch, self.device)
        on_population = predict(model, population.x, cfg.eval_batch, self.device)
        target_x = label_log_probability(logits, queries.y)
        scores, used = rmia_scores(
            target_x,
            label_log_probability(refs.queries, queries.y),
            refs.queries_in,
            label_log_probability(on_population, population.y),
            label_log_probability(refs.population, population.y),
            refs.population_in,
            online=cfg.online,
            a=cfg.offline_a,
            gamma=cfg.gamma,
        )
        return scores, {
            **refs.info,
            "target_loss": float(-target_x.mean()),
            "score": f"Pr_z(LR(x, z) >= {cfg.gamma:g}), LR = (Pr(x|theta)/Pr(x)) / (Pr(z|theta)/Pr(z))",
            "pr_x": "mean over IN and OUT reference models" if cfg.online else f"((1 + a) Pr_OUT(x) + (1 - a)) / 2, a = {cfg.offline_a:g}",
            "population_z": used,
        }


@register_attack("mia-rmia")
class RMIAMIA(RMIAScoring, CapturedModelMembership):
    __doc__ = f"RMIA membership inference on {_PATH_A}."
    needs = Knowledge(previous_state=True, local_hyperparameters=True, candidates=True, population=True)


@register_attack("mia-rmia-extractor")
class RMIAMIAExtractor(RMIAScoring, ExtractorHeadMembership):
    __doc__ = f"RMIA membership inference on {_PATH_B}."
    needs = Knowledge(extractor=True, local_hyperparameters=True, candidates=True, population=True)


__all__ = ["RMIAMIA", "RMIAConfig", "RMIAMIAExtractor", "RMIAScoring", "label_log_probability", "marginal", "rmia_scores"]
