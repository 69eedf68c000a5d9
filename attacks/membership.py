"""Membership inference on every client model an attacker can see: a loss threshold and LiRA (offline or online).

The membership game (Shokri et al., S&P 2017; Carlini et al., S&P 2022): the runner, acting as the
challenger, hands every target ``queries`` (some of the client's training samples and as many of its
held-out samples, shuffled, membership hidden) and, for shadow models, ``population`` data (other
clients' held-out samples, never trained on by anyone); an attack returns one score per query, higher
meaning "member", and the runner reports AUC and TPR at 1 % and 0.1 % FPR per target and pooled over
targets, each TPR only where it rests on enough false positives (:class:`attacks.scoring.MembershipScorer`).
RMIA, on the same reference models, lives in :mod:`attacks.membership_rmia`.

Two ways an attacker gets a client's trained model, hence two families of registered attacks (one
:class:`~attacks.threat.Knowledge` declaration cannot say "previous state *or* extractor"):

- **captured parameters** (``mia-loss``, ``mia-lira``): a client's upload (direction up or peer) of a
  parameter-like kind, rebuilt by :func:`attacks.context.trained_module` as the declared module after
  local training: full parameters (FedAvg ``model``, FedMRL ``small_model`` with its own head, FedFree
  ``layer``) or an update applied to the previous state (FedNova ``update``). Needs the previous state.
  A gradient (FedSGD ``grad``) carries no trained model and a ``probe`` readout (DRDFL ``learngene``)
  would classify with the attacker's own random classifier: both are refused in one line. A module the
  message covers only in part (FedFree: layers never transmitted are stale or random) is attacked with
  a warning in the notes (``coverage``, ``approximation``): the result is a guess;
- **extractor knowledge + head broadcast** (``mia-loss-extractor``, ``mia-lira-extractor``): runs that
  store client extractors (FedRE, FedGH, FedAllRep) and broadcast a global ``head``. The model is the
  stored extractor of (client, round) followed by the head the server broadcast to that client in that
  round. Targets are planned on the ``head`` kind (the message whose tensors the attack reads; its
  record is a capture record of that client and round). An approximation: the client's own head after
  local training is never transmitted; the broadcast head, trained by the server on that round's
  uploads, stands in for it (reported as ``approximation``).

Scores:

- loss threshold (Yeom et al., CSF 2018): ``-CE(model(x), y)`` per query;
- offline LiRA (Carlini et al., S&P 2022, Sec. IV-C/VI): ``shadows`` models of the target's
  architecture trained on random subsets of the population data only (never on the queries: every
  shadow is an OUT model), with the run's local hyperparameters; per query the logit-scaled confidence
  ``phi = log(p_y / (1 - p_y))`` (computed as ``z_y - logsumexp(z_{j != y})``, exact in float64) under
  each shadow and under the target; a Gaussian fitted to the shadows' ``phi`` per query (a global
  variance below 64 shadows, as the paper advises, else per example); the score is the one-sided
  z-score ``(phi_target - mu_out) / sigma_out`` (monotone in the paper's ``Phi(z)``, so the same ROC,
  without saturating for confident members). Shadows are cached per (architecture, model request,
  population, queries) within one attack instance, so several rounds of one client reuse them;
- online LiRA (``online=True``; Carlini et al., Sec. IV-B): the attacker holds the candidates, so each
  shadow also trains on a random half of the queries (each query IN for exactly half of the shadows,
  on top of ``shadow_size`` minus that many population records); per query a Gaussian of the IN
  shadows' ``phi`` and one of the OUT shadows' (one shared global variance below 64 shadows, so the
  ratio stays monotone in ``phi``); the score is the log likelihood ratio
  ``log N(phi; mu_in, sigma_in) - log N(phi; mu_out, sigma_out)``.

Scores over rounds (``rounds="all"``, LiRA and RMIA): the queries are scored on the client's model of
every round the attacker can rebuild up to the planned one, and the per-round scores are averaged
(FedMIA's temporal aggregation, Zhu et al., "FedMIA: An Effective Membership Inference Attack
Exploiting 'All for One' Principle in Federated Learning", 2024); the shadows are trained once and
serve every round. The result is reported at the planned round, with the rounds it read.

Everything is seeded from (attack seed, client). Attack side only: this module never opens the ground truth.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attacks.base import Attack, AttackNotApplicable, Plan, Progress, Queries, Reconstruction, Selection, Target, register_attack
from attacks.context import LeakageModule, context_of, previous_record, previous_state, trained_module
from attacks.threat import Knowledge
from privfl.errors import ConfigError
from privfl.kinds import KINDS, Family, ParamForm
from privfl.run import AttackerView
from privfl.seeding import derive_seed, torch_generator

VARIANCES = ("auto", "global", "per-example")
#: below this many shadows LiRA estimates one global variance (Carlini et al. 2022, Sec. VI-A)
GLOBAL_VARIANCE_BELOW = 64
#: which of a client's models a score reads: the planned round's, or every round's up to it (averaged)
ROUNDS = ("last", "all")


# ------------------------------------------------------------------------------------------ configs
@dataclass
class LossConfig:
    """Loss threshold: no options beyond the game's size."""

    queries: int = 200  # the challenger hands over up to this many members and as many non-members
    eval_batch: int = 512


@dataclass
class LiRAConfig:
    """Offline LiRA. The defaults are the quick preset (seconds per target on the cpu5 models at 28x28);
    ``LiRAConfig.preset("standard")`` is closer to the paper (which uses 64-256 shadows)."""

    queries: int = 200
    population: int = 1000  # population samples handed over for the shadows
    shadows: int = 4
    #: epochs each shadow trains (0: what a client's data gets in the whole run, local_epochs x rounds,
    #: capped at max_shadow_epochs)
    shadow_epochs: int = 0
    max_shadow_epochs: int = 5
    #: samples per shadow (0: the sender's num_samples when its message gives it, else half the
    #: population); at most half the population, so the shadows' training sets differ
    shadow_size: int = 0
    variance: str = "auto"  # auto (global below 64 shadows), global, per-example
    #: online LiRA (Carlini et al. 2022, Sec. IV-B): every shadow also trains on a random half of the
    #: queries, so each query has IN and OUT shadows; needs an even number of shadows, at least 4
    online: bool = False
    rounds: str = "last"  # last: the planned round's model; all: the mean score over every round of the client (FedMIA)
    eval_batch: int = 512

    def __post_init__(self) -> None:
        if self.variance not in VARIANCES:
            raise ConfigError(f"LiRA variance must be one of {', '.join(VARIANCES)}, got {self.variance!r}")
        if self.shadows < 2:
            raise ConfigError(f"LiRA needs at least 2 shadow models to fit a Gaussian, got shadows={self.shadows}")
        if self.online and (self.shadows < 4 or self.shadows % 2):
            raise ConfigError(
                f"online LiRA needs an even number of shadows >= 4 (each query IN for half of them, a variance from >= 2 per side), "
                f"got {self.shadows}"
            )
        check_rounds(self.rounds)

    @classmethod
    def preset(cls, level: str, **overrides: Any) -> LiRAConfig:
        """``quick`` (4 shadows, at most 5 epochs) or ``standard`` (16 shadows, at most 20 epochs)."""
        presets = {"quick": {"shadows": 4, "max_shadow_epochs": 5}, "standard": {"shadows": 16, "max_shadow_epochs": 20}}
        if level not in presets:
            raise ConfigError(f"unknown LiRA preset {level!r}; accepted: {', '.join(presets)}")
        return cls(**{**presets[level], **overrides})


# ------------------------------------------------------------------------------------------ helpers
def check_rounds(rounds: str) -> None:
    if rounds not in ROUNDS:
        raise ConfigError(f"rounds must be one of {', '.join(ROUNDS)}, got {rounds!r}")


def logit_confidence(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """LiRA's phi = log(p_y / (1 - p_y)) = z_y - logsumexp(z_j, j != y), in float64 (no saturation)."""
    z = logits.double()
    own = z.gather(1, y.view(-1, 1)).squeeze(1)
    others = z.scatter(1, y.view(-1, 1), float("-inf"))
    return own - torch.logsumexp(others, dim=1)


@torch.no_grad()
def predict(model: nn.Module, x: torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """Logits of ``model`` (eval mode) on ``x``, on the CPU."""
    model.eval()
    return torch.cat([model(x[i : i + batch].to(device)).float().cpu() for i in range(0, len(x), batch)])


def fingerprint(q: Queries) -> str:
    """A cheap identity of handed-over records (cache key)."""
    return f"{tuple(q.x.shape)}:{float(q.x.double().sum()):.6e}:{int(q.y.sum())}"


def hyperparameters(view: AttackerView, record: dict[str, Any] | None) -> dict[str, Any]:
    """The sender's local hyperparameters: the message's meta where it states them, else the run's config."""
    meta: dict[str, Any] = record.get("meta", {}) if record is not None and record.get("sender") != "server" else {}
    cfg = view.config

    def pick(key: str, default: float) -> Any:
        return meta.get(key, cfg.get(key, default))

    return {
        "lr": float(pick("lr", 0.06)),
        "batch_size": int(pick("batch_size", 64)),
        "optimizer": str(cfg.get("optimizer", "sgd")),
        "momentum": float(pick("momentum", 0.0)),
        "weight_decay": float(pick("weight_decay", 0.0)),
        "local_epochs": int(pick("local_epochs", 1)),
        "rounds": int(cfg.get("rounds", 1)),
    }


def make_optimizer(params: Any, hp: dict[str, Any]) -> torch.optim.Optimizer:
    if hp["optimizer"] == "adam":
        return torch.optim.Adam(params, lr=hp["lr"], weight_decay=hp["weight_decay"])
    if hp["optimizer"] != "sgd":
        raise ConfigError(f"shadow models know the optimizers sgd and adam, the run uses {hp['optimizer']!r}")
    return torch.optim.SGD(params, lr=hp["lr"], momentum=hp["momentum"], weight_decay=hp["weight_decay"])


# ------------------------------------------------------------------------------------------ the attacks
class MembershipAttack(Attack):
    """What every membership attack here shares: the game's hand-over, the target model and its notes.

    Subclasses say where the target model comes from (:meth:`target_model`, :meth:`fresh_model`,
    :meth:`architecture_key`) and how queries are scored (:meth:`score`)."""

    produces = frozenset({"membership"})
    threat_model = "curious-server-membership"

    # -------------------------------------------------- where the model comes from (path)
    def target_model(self, target: Target) -> tuple[nn.Module, dict[str, Any]]:
        """The client's model as the attacker rebuilds it (eval mode, logits out) and notes about it."""
        raise NotImplementedError

    def fresh_model(self, target: Target, seed: int) -> nn.Module:
        """A randomly initialised model of the target's architecture (for shadows), seeded."""
        raise NotImplementedError

    def architecture_key(self, target: Target) -> str:
        raise NotImplementedError

    # -------------------------------------------------- how queries are scored
    def score(self, target: Target, model: nn.Module, queries: Queries, progress: Progress | None) -> tuple[torch.Tensor, dict[str, Any]]:
        raise NotImplementedError

    # -------------------------------------------------- shared
    #: whose messages carry the target model: ``clients`` (uploads and peer messages; a server's broadcast
    #: holds no one client's training) or ``server`` (the head broadcast to the client whose extractor is stored)
    reads_from = "clients"

    def messages_of(self, view: AttackerView, kind: str, rnd: int | None = None, clients: Sequence[str] | None = None) -> list[dict[str, Any]]:
        records = super().messages_of(view, kind, rnd, clients)
        if self.reads_from == "server":
            return [r for r in records if r["sender"] == "server"]
        return [r for r in records if r["direction"] in ("up", "peer")]

    @staticmethod
    def handed(target: Target, what: str) -> Queries:
        got = target.payload.get(what)
        if not isinstance(got, Queries):
            raise ConfigError(
                f"{target.key}: no {what} handed over; membership attacks run through attacks.run_attack, "
                f"whose challenger puts them in target.payload[{what!r}]"
            )
        return got

    def run(self, target: Target, progress: Progress | None = None) -> Reconstruction:
        """Score the queries on the client's model; with ``rounds="all"`` on its model of every round the
        attacker can rebuild up to the planned one, and average the per-round scores (FedMIA's temporal
        aggregation, Zhu et al. 2024: a member leaves its trace in every round the client trained on it)."""
        start = time.perf_counter()
        queries = self.handed(target, "queries")
        rounds = self.rounds_of(target)
        per_round: list[torch.Tensor] = []
        notes: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for i, t in enumerate(rounds):
            model, notes = self.target_model(t)
            model = model.to(self.device).eval()
            scores, extra = self.score(t, model, queries, progress if i == 0 else None)  # shadows report once
            per_round.append(scores.double())
        loss = float(extra.pop("target_loss"))  # the planned round's (scored last)
        if len(rounds) > 1 or getattr(self.config, "rounds", "last") == "all":
            extra["rounds_scored"] = ",".join(str(t.round) for t in rounds)
            extra["aggregation"] = f"mean of the per-round scores over {len(rounds)} round(s) of the client's model"
        combined = torch.stack(per_round).mean(0)
        return Reconstruction(target, None, loss, time.perf_counter() - start, scores=combined.float(), notes={**notes, **extra})

    def rounds_of(self, target: Target) -> list[Target]:
        """The targets whose models are scored, the planned one last: with ``rounds="all"`` the same client's
        message of the same kind in every earlier round whose model can be rebuilt (one per round), planned
        as the attack plans any message, with the planned target's hand-over."""
        if getattr(self.config, "rounds", "last") == "last":
            return [target]
        view, client = target.view, target.client
        earlier: list[Target] = []
        for rnd in sorted({r["round"] for r in self.messages_of(view, target.kind, None, [client])}):
            if rnd >= target.round:
                continue
            records = self.messages_of(view, target.kind, rnd, [client])
            try:
                planned = self.plan_messages(view, target.kind, rnd, records, Selection(target.kind, [rnd], [client]))
            except AttackNotApplicable:
                continue  # e.g. no previous state yet in round 0: that round is not scored
            mine = [t for t in planned if t.client == client]
            if mine:
                earlier.append(dataclasses.replace(mine[0], payload=target.payload))
        return [*earlier, target]

    def prepare(self, targets: Sequence[Target]) -> None:
        """Load what every scored model needs (every round's with ``rounds="all"``), so a damaged capture
        fails in one line before any shadow trains."""
        for t in targets:
            for each in self.rounds_of(t):
                self.load_model_inputs(each)

    def load_model_inputs(self, target: Target) -> None:
        raise NotImplementedError

    def per_query_loss(self, model: nn.Module, queries: Queries) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, cross-entropy per query in float64) of ``model`` on the queries."""
        logits = predict(model, queries.x, self.config.eval_batch, self.device)
        return logits, F.cross_entropy(logits.double(), queries.y, reduction="none")


class CapturedModelMembership(MembershipAttack):
    """Path (a): the sender's declared module after local training, rebuilt from its upload."""

    consumes = frozenset({str(Family.PARAMETERS), str(Family.GRADIENT)})

    def plan(self, view: AttackerView, selection: Selection | None = None) -> Plan:
        plan = super().plan(view, selection)
        if not plan and "extractor" in view.granted() and any(ExtractorHeadMembership.takes(k) for k in view.kinds()):
            plan.reason += f"; this run stores client extractors and broadcasts a head: try {self.name}-extractor"
        return plan

    def plan_messages(self, view: AttackerView, kind: str, rnd: int, records: list[dict[str, Any]], selection: Selection) -> list[Target]:
        """One target per upload whose trained module the attacker can rebuild (index only, except
        FedFree-style layer replay, whose check needs the earlier layers)."""
        spec = KINDS.get(kind)
        if spec.form is ParamForm.GRADIENT:
            raise AttackNotApplicable(f"a {kind} message is one batch's gradient at the state the sender received: it carries no trained model")
        ctx = context_of(view, kind)
        if ctx.readout == "probe":
            where = f"module {ctx.module!r}" if ctx.module else "the client model"
            raise AttackNotApplicable(
                f"{kind} parameterises {where}, whose outputs are features ({view.info['method']} declares a probe readout): "
                "its classifier would be the attacker's own random one, so its loss says nothing of membership"
            )
        targets, reasons = [], []
        for rec in records:
            try:
                found = previous_state(view, rec)[0] if ctx.previous_rule == "layer-replay" else previous_record(view, rec)
            except AttackNotApplicable as exc:
                reasons.append(str(exc))
                continue
            if found is None:
                reasons.append(f"no {ctx.previous} was sent to {rec['sender']} before message {rec['seq']}: its trained module cannot be rebuilt")
                continue
            targets.append(Target(kind, rnd, rec["sender"], rec, view))
        if not targets:
            raise AttackNotApplicable("; ".join(dict.fromkeys(reasons)))
        return targets

    def load_model_inputs(self, target: Target) -> None:
        """The upload and its previous state."""
        assert target.record is not None  # planned on captured messages only
        target.view.load(target.record)
        previous_state(target.view, target.record)

    def target_model(self, target: Target) -> tuple[nn.Module, dict[str, Any]]:
        assert target.record is not None  # planned on captured messages only
        module, known = trained_module(target.view, target.record, derive_seed(self.seed, "mia-target", target.client))
        if known["readout"] == "probe":  # plan refuses these; a direct call must not score a random classifier
            raise AttackNotApplicable(f"{target.kind}: a probe readout is the attacker's own random classifier")
        ctx = context_of(target.view, target.kind)
        notes: dict[str, Any] = {"coverage": round(float(known["coverage"]), 4), "model": f"{target.kind} as sent, after local training"}
        parts = [ctx.note] if ctx.note else []
        if known["coverage"] < 1:
            unknown = known["unknown"]
            shown = ", ".join(unknown[:4]) + (", ..." if len(unknown) > 4 else "")
            notes["warning"] = (
                f"only {100 * known['coverage']:.0f} % of the module's parameters are known ({len(unknown)} never transmitted: {shown}); "
                "the rest are stale or the attacker's random initialisation, so the scores are a guess"
            )
            parts.append(notes["warning"])
        if parts:
            notes["approximation"] = "; ".join(parts)
        return module, notes

    def fresh_model(self, target: Target, seed: int) -> nn.Module:
        view = target.view
        ctx = context_of(view, target.kind)
        ds = view.dataset
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = view.method_cls.build_client_model(view.model_request(target.client))
            body = model.get_submodule(ctx.module) if ctx.module else model
            example = torch.zeros(2, ds["channels"], ds["image_size"], ds["image_size"])
            return LeakageModule(body, ctx, int(ds["num_classes"]), example)

    def architecture_key(self, target: Target) -> str:
        req = target.view.model_request(target.client)
        ctx = context_of(target.view, target.kind)
        return f"{target.view.info['method']}|module={ctx.module}|{req.arch}|{req.in_channels}x{req.image_size}|{req.num_classes}|{target.client}"


class ExtractorHeadMembership(MembershipAttack):
    """Path (b): the stored extractor of (client, round) followed by the head broadcast to it in that round."""

    consumes = frozenset({"head"})
    threat_model = "curious-server-extractor-membership"
    reads_from = "server"

    def plan_messages(self, view: AttackerView, kind: str, rnd: int, records: list[dict[str, Any]], selection: Selection) -> list[Target]:
        stored = {(r["client"], r["round"]) for r in view.extractor_records()}
        targets = [Target(kind, rnd, r["receiver"], r, view) for r in records if (r["receiver"], rnd) in stored]
        if not targets:
            have = sorted({n for _, n in stored})
            raise AttackNotApplicable(
                f"the run stores no extractor of the clients that received {kind} in round {rnd} (extractors stored for rounds "
                f"{', '.join(map(str, have)) or 'none'}); choose one of those rounds or retrain with --knowledge-every N"
            )
        return targets

    def load_model_inputs(self, target: Target) -> None:
        """The head and the extractor it completes."""
        assert target.record is not None  # planned on captured messages only
        target.view.load(target.record)
        target.view.extractor(target.client, target.round)

    def _spec(self, target: Target) -> dict[str, Any]:
        rec = next(r for r in target.view.extractor_records() if r["client"] == target.client and r["round"] == target.round)
        return dict(rec["spec"])

    def target_model(self, target: Target) -> tuple[nn.Module, dict[str, Any]]:
        assert target.record is not None  # planned on captured messages only
        model = target.view.extractor(target.client, target.round)
        head = getattr(model, "head", None)
        if not isinstance(head, nn.Module):
            raise AttackNotApplicable(
                f"the stored extractor of {target.client} is a {type(model).__name__} without a head to load the {target.kind} into"
            )
        tensors = target.view.load(target.record)
        try:
            head.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in tensors.items()})
        except RuntimeError as exc:
            raise AttackNotApplicable(
                f"{target.kind} message {target.record['seq']} does not fit {target.client}'s head: {str(exc).splitlines()[0]}"
            ) from None
        notes = {
            "model": f"stored extractor r{target.round} + {target.kind} broadcast r{target.round}",
            "approximation": (
                f"the client's own head after local training is never transmitted: the global {target.kind} broadcast to it "
                f"after round {target.round} stands in for it, on top of its stored extractor"
            ),
        }
        return model, notes

    def fresh_model(self, target: Target, seed: int) -> nn.Module:
        from privfl.models import build_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return build_model(**self._spec(target))

    def architecture_key(self, target: Target) -> str:
        return f"{target.view.info['method']}|extractor+head|{json.dumps(self._spec(target), sort_keys=True)}|{target.client}"


class LossScoring(MembershipAttack):
    """Yeom et al.'s loss threshold: members have lower loss."""

    paper = "Yeom et al., Privacy Risk in Machine Learning: Analyzing the Connection to Overfitting, CSF 2018"
    Config = LossConfig

    def score(self, target: Target, model: nn.Module, queries: Queries, progress: Progress | None) -> tuple[torch.Tensor, dict[str, Any]]:
        logits, ce = self.per_query_loss(model, queries)
        if progress:
            progress(target.client, 0, 1, float(ce.mean()))
        acc = float((logits.argmax(1) == queries.y).double().mean())
        return -ce, {"target_loss": float(ce.mean()), "score": "-CE(model(x), y)", "query_accuracy": acc}


@dataclass
class ReferenceSignals:
    """What the reference (shadow) models say about the records: their logits on the queries and on the
    population, and which of those records each one trained on (its IN records)."""

    queries: torch.Tensor  # (S, N, C) logits on the queries
    population: torch.Tensor  # (S, P, C) logits on the population
    queries_in: torch.Tensor  # (S, N) bool: shadow s trained on query n (online shadows only)
    population_in: torch.Tensor  # (S, P) bool: shadow s trained on population record p
    info: dict[str, Any]


class ShadowTraining(MembershipAttack):
    """Training models of the target's architecture with the sender's local hyperparameters: LiRA's and
    RMIA's reference models, the logits attack's reference model. The config names ``shadows``,
    ``shadow_epochs``, ``max_shadow_epochs``, ``shadow_size`` (and ``online`` for reference signals)."""

    def __init__(self, config: Any = None, **kw: Any):
        super().__init__(config, **kw)
        #: (architecture key, population, queries, epochs, size, online) -> the reference models' signals
        self.cache: dict[tuple[str, str, str, int, int, bool], ReferenceSignals] = {}

    def shadow_plan(self, target: Target, population: Queries) -> tuple[int, int, dict[str, Any]]:
        """(epochs, samples per shadow, hyperparameters)."""
        cfg = self.config
        hp = hyperparameters(target.view, target.record)
        epochs = cfg.shadow_epochs or max(1, min(cfg.max_shadow_epochs, hp["local_epochs"] * hp["rounds"]))
        half = len(population.y) // 2
        if half < 1:
            raise AttackNotApplicable(f"{target.key}: {len(population.y)} population sample(s) are too few for shadow models")
        sent = (target.record or {}).get("meta", {}).get("num_samples") if target.record and target.record["sender"] != "server" else None
        size = cfg.shadow_size or (int(sent) if isinstance(sent, int) and sent > 0 else half)
        return epochs, max(1, min(size, half)), hp

    def shadow_draw(self, target: Target, index: int, available: int, size: int) -> tuple[torch.Generator, torch.Tensor]:
        """Shadow ``index``'s generator and the ``size`` population records it trains on (the generator
        goes on to shuffle its epochs)."""
        gen = torch_generator(self.seed, "mia-shadow-data", target.client, index)
        return gen, torch.randperm(available, generator=gen)[:size]

    def fit_shadow(
        self, target: Target, index: int, x: torch.Tensor, y: torch.Tensor, epochs: int, hp: dict[str, Any], gen: torch.Generator
    ) -> tuple[nn.Module, float]:
        """A fresh model of the target's architecture trained on (x, y) as the sender trains: (model in eval mode, last batch loss)."""
        model = self.fresh_model(target, derive_seed(self.seed, "mia-shadow-init", target.client, index)).to(self.device).train()
        opt = make_optimizer(model.parameters(), hp)
        torch.manual_seed(derive_seed(self.seed, "mia-shadow-train", target.client, index))  # dropout, if any
        last = 0.0
        for _ in range(epochs):
            order = torch.randperm(len(y), generator=gen)
            for i in range(0, len(y), hp["batch_size"]):
                idx = order[i : i + hp["batch_size"]]
                loss = F.cross_entropy(model(x[idx].to(self.device)), y[idx].to(self.device))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                last = float(loss.detach())
        return model.eval(), last

    def train_shadow(self, target: Target, index: int, population: Queries, epochs: int, size: int, hp: dict[str, Any]) -> tuple[nn.Module, float]:
        """An OUT shadow: trained on ``size`` random population records only."""
        gen, subset = self.shadow_draw(target, index, len(population.y), size)
        return self.fit_shadow(target, index, population.x[subset], population.y[subset], epochs, hp, gen)

    def online_membership(self, target: Target, shadows: int, queries: int) -> torch.Tensor:
        """(S, N) bool: which queries each online shadow trains on, each query IN for exactly half of the
        shadows (Carlini et al.'s balanced split), seeded by (attack seed, client)."""
        gen = torch_generator(self.seed, "mia-online-split", target.client)
        ranks = torch.rand(shadows, queries, generator=gen).argsort(0).argsort(0)
        return ranks < shadows // 2

    def reference_signals(self, target: Target, queries: Queries, population: Queries, progress: Progress | None) -> ReferenceSignals:
        """The shadows' logits on the queries and the population, trained once per key.

        Offline (``online=False``): ``shadows`` models each trained on ``shadow_size`` random population
        records, never on a query. Online: each also trains on its half of the queries (the attacker holds
        the candidates, so it may), on top of ``shadow_size`` minus that many population records."""
        cfg = self.config
        online = bool(getattr(cfg, "online", False))
        epochs, size, hp = self.shadow_plan(target, population)
        key = (self.architecture_key(target), fingerprint(population), fingerprint(queries), epochs, size, online)
        info = {
            "shadows": cfg.shadows,
            "shadow_epochs": epochs,
            "shadow_size": size,
            "population": len(population.y),
            "shadow_lr": hp["lr"],
            "references": "online (IN and OUT shadows)" if online else "offline (OUT shadows)",
        }
        if key in self.cache:
            if progress:
                for s in range(cfg.shadows):
                    progress(f"{target.client} shadows (cached)", s, cfg.shadows, 0.0)
            return dataclasses.replace(self.cache[key], info={**info, "shadows_cached": 1})
        n, p = len(queries.y), len(population.y)
        queries_in = self.online_membership(target, cfg.shadows, n) if online else torch.zeros(cfg.shadows, n, dtype=torch.bool)
        population_in = torch.zeros(cfg.shadows, p, dtype=torch.bool)
        on_queries, on_population = [], []
        with torch.random.fork_rng(devices=[]):
            for s in range(cfg.shadows):
                mine = queries_in[s]
                gen, subset = self.shadow_draw(target, s, p, max(0, size - int(mine.sum())) if online else size)
                population_in[s, subset] = True
                x = torch.cat([population.x[subset], queries.x[mine]])
                y = torch.cat([population.y[subset], queries.y[mine]])
                model, last = self.fit_shadow(target, s, x, y, epochs, hp, gen)
                on_queries.append(predict(model, queries.x, cfg.eval_batch, self.device))
                on_population.append(predict(model, population.x, cfg.eval_batch, self.device))
                if progress:
                    progress(f"{target.client} shadow {s + 1}/{cfg.shadows}", s, cfg.shadows, last)
        signals = ReferenceSignals(torch.stack(on_queries), torch.stack(on_population), queries_in, population_in, info)
        self.cache[key] = signals
        return dataclasses.replace(signals, info={**info, "shadows_cached": 0})


class LiRAScoring(ShadowTraining):
    """LiRA, offline (OUT shadows only) or online (IN and OUT shadows); see the module docstring."""

    paper = "Carlini et al., Membership Inference Attacks From First Principles, S&P 2022 (LiRA: online Sec. IV-B, offline Sec. IV-C)"
    Config = LiRAConfig
    config: LiRAConfig

    def steps_for(self, targets: Sequence[Target]) -> int:
        return len(targets) * self.config.shadows

    def variance_rule(self) -> str:
        variance = self.config.variance
        if variance == "auto":
            variance = "global" if self.config.shadows < GLOBAL_VARIANCE_BELOW else "per-example"
        return variance

    def score(self, target: Target, model: nn.Module, queries: Queries, progress: Progress | None) -> tuple[torch.Tensor, dict[str, Any]]:
        population = self.handed(target, "population")
        logits, ce = self.per_query_loss(model, queries)
        phi = logit_confidence(logits, queries.y)
        refs = self.reference_signals(target, queries, population, progress)
        shadows = refs.queries.shape[0]
        phis = logit_confidence(refs.queries.flatten(0, 1), queries.y.repeat(shadows)).view(shadows, -1)  # (S, N)
        variance = self.variance_rule()
        if self.config.online:
            mu_in, var_in = gaussian(phis, refs.queries_in)
            mu_out, var_out = gaussian(phis, ~refs.queries_in)
            if variance == "global":  # one variance for IN and OUT: the ratio stays monotone in phi for each query
                sigma_in = sigma_out = ((var_in.mean() + var_out.mean()) / 2).sqrt().expand_as(mu_in)
            else:
                sigma_in, sigma_out = var_in.sqrt(), var_out.sqrt()
            sigma_in, sigma_out = sigma_in.clamp_min(1e-6), sigma_out.clamp_min(1e-6)
            score = log_normal(phi, mu_in, sigma_in) - log_normal(phi, mu_out, sigma_out)
            rule = "log N(phi; mu_in, sigma_in) - log N(phi; mu_out, sigma_out), phi = log(p_y / (1 - p_y))"
            extra = {"phi_in_mean": float(mu_in.mean())}
        else:
            mu_out, var_out = gaussian(phis, torch.ones_like(phis, dtype=torch.bool))
            sigma_out = (var_out.mean().sqrt().expand_as(mu_out) if variance == "global" else var_out.sqrt()).clamp_min(1e-6)
            score = (phi - mu_out) / sigma_out
            rule = "(phi_target - mu_out) / sigma_out, phi = log(p_y / (1 - p_y))"
            extra = {}
        return score, {
            **refs.info,
            "target_loss": float(ce.mean()),
            "variance": variance,
            "score": rule,
            "phi_target_mean": float(phi.mean()),
            "phi_shadow_mean": float(mu_out.mean()),
            **extra,
        }


def gaussian(phis: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, the mean and the unbiased variance of ``phis`` (S, N) over the shadows ``chosen`` (S, N) for it.
    A global variance is the mean of these over the queries (Carlini et al. 2022, Sec. VI-A, below 64 shadows)."""
    w = chosen.double()
    count = w.sum(0)
    mu = (phis * w).sum(0) / count.clamp_min(1)
    return mu, (((phis - mu) ** 2) * w).sum(0) / (count - 1).clamp_min(1)


def log_normal(x: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """log N(x; mu, sigma^2), elementwise."""
    return -0.5 * ((x - mu) / sigma) ** 2 - sigma.log() - 0.5 * math.log(2 * math.pi)


# ------------------------------------------------------------------------------------------ registered
_PATH_A = "captured parameters: the sender's module after local training (full parameters, or an update on the previous state)"
_PATH_B = "the client's stored extractor + the head broadcast to it"


@register_attack("mia-loss")
class LossMIA(LossScoring, CapturedModelMembership):
    __doc__ = f"Loss-threshold membership inference on {_PATH_A}."
    needs = Knowledge(previous_state=True, candidates=True)


@register_attack("mia-lira")
class LiRAMIA(LiRAScoring, CapturedModelMembership):
    __doc__ = f"Offline LiRA membership inference on {_PATH_A}."
    needs = Knowledge(previous_state=True, local_hyperparameters=True, candidates=True, population=True)


@register_attack("mia-loss-extractor")
class LossMIAExtractor(LossScoring, ExtractorHeadMembership):
    __doc__ = f"Loss-threshold membership inference on {_PATH_B}."
    needs = Knowledge(extractor=True, candidates=True)


@register_attack("mia-lira-extractor")
class LiRAMIAExtractor(LiRAScoring, ExtractorHeadMembership):
    __doc__ = f"Offline LiRA membership inference on {_PATH_B}."
    needs = Knowledge(extractor=True, local_hyperparameters=True, candidates=True, population=True)


__all__ = [
    "CapturedModelMembership",
    "ExtractorHeadMembership",
    "LiRAConfig",
    "LiRAMIA",
    "LiRAMIAExtractor",
    "LiRAScoring",
    "LossConfig",
    "LossMIA",
    "LossMIAExtractor",
    "LossScoring",
    "MembershipAttack",
    "ShadowTraining",
    "logit_confidence",
]
