"""The Attack API: what every attack declares, plans and returns, and the registry that dispatches.

An attack is a class registered in :data:`ATTACKS` that declares, as data,

- ``consumes``: the artifact families (:class:`privfl.kinds.Family`) or kind names it takes; a kind a
  user registers in a consumed family is taken without a change to the attack;
- ``needs``: the attacker knowledge it requires (:class:`attacks.threat.Knowledge`, no default);
- ``threat_model``: its name in :data:`attacks.threat.THREAT_MODELS`, and ``paper``;
- ``Config``: a dataclass of its options (every field has a default; the CLI and the audit fill it).

and implements two steps:

- ``plan(view, selection) -> Plan``: the targets it would attack in a run (an
  :class:`~privfl.run.AttackerView`, which holds no ground truth), or the reason none applies.
  Planning reads the capture index, and only the tensors a check cannot do without (a parameter
  message's previous state), so listing what applies stays cheap;
- ``run(target) -> Reconstruction``: one target; ``run_batch`` attacks several (the default loops,
  attacks that batch override it).

The runner (:func:`attacks.runner.run_attack`) selects, runs, scores against ground truth and writes;
an attack never reads ground truth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from attacks.threat import THREAT_MODELS, Knowledge, available
from privfl.errors import ConfigError, PrivflError
from privfl.kinds import KINDS, Family
from privfl.registry import Registry
from privfl.run import AttackerView


def _check_attack(name: str, cls: type[Attack]) -> None:
    """What every registered attack declares (LeakPro's lesson: no silent defaults)."""
    if not (isinstance(cls, type) and issubclass(cls, Attack)):
        raise TypeError(f"attack {name}: register a subclass of attacks.Attack (docs/extending.md#migrating)")
    if not isinstance(getattr(cls, "needs", None), Knowledge):  # Attack itself declares no default
        raise TypeError(f"attack {name}: declare needs = Knowledge(...) on the class (no default)")
    if not cls.consumes or cls.threat_model not in THREAT_MODELS:
        raise TypeError(f"attack {name}: declare consumes and a threat_model from attacks.threat.THREAT_MODELS")
    if not cls.produces or not cls.produces <= OUTPUTS:
        raise TypeError(f"attack {name}: produces must be a non-empty subset of {sorted(OUTPUTS)}")
    if cls.name and cls.name != name:
        raise TypeError(f"attack class {cls.__name__} is named {cls.name!r}, registered as {name!r}")
    cls.name = name


#: attack name -> :class:`Attack` subclass (built-ins found in the ``attacks`` package on first lookup)
ATTACKS: Registry[type[Attack]] = Registry("attack", discover=["attacks"], validate=_check_attack)
#: what an attack's reconstructions hold: images (scored by the family's image rule), labels (label
#: inference) or membership scores
OUTPUTS = frozenset({"images", "labels", "membership"})

#: ``progress(label, step, steps, loss)``, called once per optimisation step
Progress = Callable[[str, int, int, float], None]


class AttackNotApplicable(PrivflError):
    """An attack has nothing to attack in the selected part of a run; the message says why, and ``fix``
    (when there is one) the one declaration of the method, or the run option, that would enable it."""

    def __init__(self, reason: str, fix: str = ""):
        super().__init__(reason)
        self.fix = fix


#: the declaration that grants each kind of knowledge (what `privfl.audit --check` suggests)
KNOWLEDGE_FIXES = {
    "extractor": "declare exposes = ('extractor',) and call self.env.knowledge.record_extractor(rnd, client) when a client uploads",
    "previous_state": "send clients the state they train from as a message (e.g. kind 'model' down) and name its kind in "
    "leakage = {KIND: LeakageContext(previous=...)}",
    "local_hyperparameters": "(always granted: the server sets them)",
    "candidates": "(always granted by the runner, the membership game's challenger)",
    "population": "(always granted by the runner, the membership game's challenger)",
}


@dataclass
class Selection:
    """What part of a run to attack: a kind (None: every kind the attack consumes), rounds (None: the
    last round that has the kind), clients (None: all), and at most ``max_targets`` rows per message."""

    kind: str | None = None
    rounds: Sequence[int] | None = None
    clients: Sequence[str] | None = None
    max_targets: int = 4


@dataclass
class Target:
    """One thing an attack reconstructs from: a message (or a row of it) of one client and round.

    ``payload`` holds what the attack needs beyond the index record (e.g. a counterfactual vector);
    ``view`` is the attacker's view it came from (capture and knowledge only).
    """

    kind: str
    round: int
    client: str  # whose model / extractor the attacker goes through
    record: dict[str, Any] | None  # the capture index record (None: a counterfactual target)
    view: AttackerView = field(repr=False, compare=False)
    row: int | None = None
    label: str = ""  # what the message says about the class(es), e.g. "Dress" or "0.41 Coat + 0.33 Dress"
    class_id: int | None = None
    counterfactual: bool = False  # computed from client state, not transmitted by the run's method
    payload: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def message_seq(self) -> int | None:
        return None if self.record is None else int(self.record["seq"])

    @property
    def family(self) -> Family:
        return KINDS.get(self.kind).family

    @property
    def key(self) -> str:
        where = f"seq{self.message_seq}" if self.message_seq is not None else "cf"
        return f"{self.kind}/{self.client}/r{self.round}/{where}/{self.row if self.row is not None else 0}"

    def caption(self) -> str:
        cf = " (counterfactual)" if self.counterfactual else ""
        return f"{self.kind}{cf} {self.client} r{self.round}"


@dataclass
class Reconstruction:
    """What an attack got out of one target: images in [0, 1] (B, C, H, W) (None for an attack that
    produces labels only), recovered labels, the final loss of its objective, wall time, snapshots
    along the optimisation and free-form notes."""

    target: Target
    images: torch.Tensor | None
    loss: float
    seconds: float
    labels: torch.Tensor | None = None
    snapshots: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    #: label inference: the estimated share of each class behind the message, (C,) summing to 1 (None:
    #: only the set ``labels`` is claimed, scored as uniform over it)
    label_distribution: torch.Tensor | None = None
    #: membership inference: one score per query of ``target.payload["queries"]`` (higher: more likely a member)
    scores: torch.Tensor | None = None

    @property
    def image(self) -> torch.Tensor:
        """The first (for one-image targets, the only) reconstruction, (C, H, W)."""
        if self.images is None:
            raise ValueError(f"{self.target.key}: this attack produced labels, not images")
        return self.images[0]


@dataclass
class Queries:
    """Records handed to a membership attack: normalised model inputs and their labels, membership hidden."""

    x: torch.Tensor  # (N, C, H, W) normalised as the client's model sees its data
    y: torch.Tensor  # (N,) labels


@dataclass
class Plan:
    """Targets an attack would attack, and why the rest of the selection does not apply."""

    attack: str
    targets: list[Target] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # kind (or kind@round) -> reason
    reason: str = ""  # why nothing applies (set when targets is empty)
    fix: str = ""  # the one declaration (or run option) that would make it apply, when there is one

    def __bool__(self) -> bool:
        return bool(self.targets)

    @property
    def kinds(self) -> list[str]:
        return sorted({t.kind for t in self.targets})

    @property
    def rounds(self) -> list[int]:
        return sorted({t.round for t in self.targets})


@dataclass
class NoOptions:
    """The options of an attack that has none."""


class Attack:
    """Base class of every attack (see the module docstring)."""

    name: ClassVar[str] = ""
    consumes: ClassVar[frozenset[str]] = frozenset()
    needs: ClassVar[Knowledge]
    #: what reconstructions hold: {"images"} (the default), {"labels"} (label inference) or {"membership"}
    produces: ClassVar[frozenset[str]] = frozenset({"images"})
    threat_model: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    Config: ClassVar[type] = NoOptions

    def __init__(self, config: Any = None, *, seed: int = 0, device: torch.device | str = "cpu", **options: Any):
        if config is None:
            config = self.default_config()
        if options:
            config = configure(config, options, self.name)
        self.config = config
        self.seed = int(seed)
        self.device = torch.device(device)

    # ------------------------------------------------------------------ declarations
    @classmethod
    def default_config(cls) -> Any:
        """The attack's options when none are given (its paper's settings)."""
        return cls.Config()

    @classmethod
    def takes(cls, kind: str) -> bool:
        """Whether this attack consumes ``kind`` (by name or by the kind's family)."""
        if kind not in KINDS:
            return False
        return kind in cls.consumes or str(KINDS.get(kind).family) in cls.consumes

    @classmethod
    def threat_text(cls) -> str:
        return THREAT_MODELS[cls.threat_model][1]

    def missing_knowledge(self, view: AttackerView) -> str:
        """'' when the run grants what ``needs`` asks, else the reason."""
        missing = self.needs.missing(available(view))
        if not missing:
            return ""
        return (
            f"attack {self.name} needs {', '.join(missing)}, which run {view.run_dir} does not provide "
            "(train with capture on; for extractor knowledge the method must expose client extractors)"
        )

    # ------------------------------------------------------------------ planning helpers
    def candidate_kinds(self, view: AttackerView) -> list[str]:
        """Kinds of the run this attack consumes and that have at least one message to attack."""
        return [k for k in view.kinds() if self.takes(k) and self.messages_of(view, k)]

    def messages_of(self, view: AttackerView, kind: str, rnd: int | None = None, clients: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The messages of ``kind`` this attack would read (default: every non-setup message)."""
        return view.messages(kind, rnd, list(clients) if clients is not None else None)

    def plan(self, view: AttackerView, selection: Selection | None = None) -> Plan:
        """Targets in ``view`` for ``selection`` (default: every consumed kind at its last round)."""
        selection = selection or Selection()
        plan = Plan(self.name)
        reason = self.missing_knowledge(view)
        if reason:
            plan.reason = reason
            plan.fix = "; ".join(KNOWLEDGE_FIXES[k] for k in self.needs.missing(available(view)))
            return plan
        kinds = self.candidate_kinds(view)
        if selection.kind is not None:
            if selection.kind not in kinds:
                accepted = f"accepted: {', '.join(kinds) or '(none)'}"
                if selection.kind not in view.kinds():
                    plan.reason = f"unknown artifact kind for {self.name} in this run {selection.kind!r}; {accepted}"
                elif not self.takes(selection.kind):
                    family = KINDS.get(selection.kind).family
                    plan.reason = (
                        f"{self.name} does not take {selection.kind!r} (family {family}; it takes {', '.join(sorted(self.consumes))}); {accepted}"
                    )
                else:
                    plan.reason = f"{self.name} reads no {selection.kind} message of this run (it reads what clients send); {accepted}"
                return plan
            kinds = [selection.kind]
        if not kinds:
            consumed = ", ".join(sorted(self.consumes))
            plan.reason = f"run {view.run_dir.name} sends nothing {self.name} takes ({consumed}); it sends {', '.join(view.kinds()) or 'nothing'}"
            return plan
        for kind in kinds:
            all_rounds = sorted({r["round"] for r in self.messages_of(view, kind)})
            rounds = list(selection.rounds) if selection.rounds is not None else all_rounds[-1:]
            for rnd in rounds:
                if rnd not in all_rounds:
                    plan.skipped[f"{kind}@{rnd}"] = f"round {rnd} has no {kind} messages; rounds with them: {all_rounds[0]}..{all_rounds[-1]}"
                    continue
                records = self.messages_of(view, kind, rnd, selection.clients)
                if not records:
                    who = ", ".join(selection.clients or [])
                    plan.skipped[f"{kind}@{rnd}"] = f"no {kind} messages of clients {who} in round {rnd}"
                    continue
                try:
                    plan.targets.extend(self.plan_messages(view, kind, rnd, records, selection))
                except AttackNotApplicable as exc:
                    plan.skipped[f"{kind}@{rnd}"] = str(exc)
                    plan.fix = plan.fix or exc.fix
        if not plan.targets:
            plan.reason = "; ".join(dict.fromkeys(plan.skipped.values())) or f"nothing for {self.name} in {view.run_dir}"
        return plan

    def plan_messages(self, view: AttackerView, kind: str, rnd: int, records: list[dict[str, Any]], selection: Selection) -> list[Target]:
        """Targets from the selected messages of one kind and round; raise :class:`AttackNotApplicable`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ attacking
    def prepare(self, targets: Sequence[Target]) -> None:
        """Load and check what the targets need (message tensors, previous states) before any
        optimisation, so a damaged capture fails in one line before progress is shown."""

    def run(self, target: Target, progress: Progress | None = None) -> Reconstruction:
        raise NotImplementedError

    def run_batch(self, targets: Sequence[Target], progress: Progress | None = None) -> list[Reconstruction]:
        """Attack every target (attacks that optimise several targets together override this)."""
        return [self.run(t, progress) for t in targets]

    def steps_for(self, targets: Sequence[Target]) -> int:
        """Progress-bar length for ``targets`` (optimisation steps in all)."""
        return len(targets)

    def protocol(self) -> dict[str, Any]:
        """What this attack records with every result: its options."""
        cfg = self.config
        # a config is an instance (never a dataclass type): the isinstance test only narrows the type for asdict
        return {"config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type) else {}}


def configure(config: Any, options: dict[str, Any], name: str) -> Any:
    """``config`` with ``options`` replaced; an unknown option is a one-line error naming the accepted ones."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise ConfigError(f"attack {name} takes no options, got {', '.join(options)}")
    accepted = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(unknown)} for attack {name}; accepted: {', '.join(sorted(accepted))}")
    return dataclasses.replace(config, **{k: v for k, v in options.items() if v is not None})


def create_attack(name: str, config: Any = None, *, seed: int = 0, device: torch.device | str = "cpu", **options: Any) -> Attack:
    """An attack by registry name, with its config (or options that override the defaults)."""
    cls = ATTACKS.get(name)
    return cls(config, seed=seed, device=device, **options)


def register_attack(name: str) -> Callable[[type[Attack]], type[Attack]]:
    """Class decorator: set the attack's name, check its declarations, register it under ``name``."""

    def add(cls: type[Attack]) -> type[Attack]:
        cls.name = name
        ATTACKS.register(name, cls)
        return cls

    return add


__all__ = [
    "ATTACKS",
    "Attack",
    "AttackNotApplicable",
    "Plan",
    "Progress",
    "Queries",
    "Reconstruction",
    "Selection",
    "Target",
    "configure",
    "create_attack",
    "register_attack",
]
