"""The :class:`Defense` base class, the ``DEFENSES`` registry and the ``name:k=v,...`` spec parser.

A defense is a channel mod (``mod(msg, ctx) -> Message``): the channel runs it on every outgoing
message before the capture, so what is captured is what a real eavesdropper would see. The base class
does the bookkeeping every defense shares, so a concrete defense only writes :meth:`Defense.transform`:

* which messages it touches: the kinds of its ``families`` (:class:`privfl.kinds.Family`, declared per
  defense, so a kind a user registers in a family is defended like the built-in ones) or an explicit
  ``kinds=`` list, in its ``directions`` (uploads only by default, since the threat model is an
  honest-but-curious server looking at what clients send);
* which tensors it touches (floating, non-``aux``: labels, class ids, counts and integer buffers such
  as BatchNorm's ``num_batches_tracked`` are bookkeeping and pass unchanged);
* what it acts on: for kinds whose form is full parameters (:class:`privfl.kinds.ParamForm`) it acts on
  the update relative to what the sender last received of that kind (``ctx.reference``), because
  that is where DP-FedAvg clipping,
  DLG-style pruning and quantisation are defined; noising the raw weights would compare sigma with
  the weights' scale rather than with the information a round adds.

This module imports nothing from privfl's training internals (engine, methods), only the message,
channel, registry and error types.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from privfl.capture import KINDS, Message
from privfl.channel import ChannelContext
from privfl.config import parse_scalar
from privfl.errors import ConfigError
from privfl.kinds import Family, ParamForm, kinds_of
from privfl.registry import Registry

#: Families whose tensors are model parameters or differences of them.
PARAMETER_FAMILIES: frozenset[Family] = frozenset({Family.PARAMETERS, Family.GRADIENT, Family.GENERATOR})
#: Families whose tensors are representations or statistics of them.
REPRESENTATION_FAMILIES: frozenset[Family] = frozenset({Family.PER_SAMPLE_REPRESENTATION, Family.AGGREGATE_REPRESENTATION, Family.STATISTICS})
#: Message directions (see :attr:`privfl.capture.Message.direction`).
DIRECTIONS: frozenset[str] = frozenset({"up", "down", "peer"})


def _check_defense(name: str, cls: type[Defense]) -> None:
    """What every registered defense declares (run on every registration, with or without the decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Defense)):
        raise TypeError(f"defense {name}: register a subclass of defenses.Defense")
    if cls.name != name or not dataclasses.is_dataclass(cls.Params):
        raise TypeError(f"{cls.__name__} needs name = {name!r} and a dataclass Params")
    if "default_kinds" in vars(cls):  # the earlier declaration: a set of kind names
        raise TypeError(f"{cls.__name__}.default_kinds is no longer read: declare families = frozenset({{Family...}}) (docs/extending.md#migrating)")
    if not cls.families or not all(isinstance(f, Family) for f in cls.families):
        raise TypeError(f"{cls.__name__}.families must be a non-empty set of privfl.kinds.Family")


#: name -> :class:`Defense` subclass (built-ins found in the ``defenses`` package on first lookup).
DEFENSES: Registry[type[Defense]] = Registry("defense", discover=["defenses"], validate=_check_defense)


def is_full_parameters(kind: str) -> bool:
    """Whether ``kind`` carries full parameters (defended as an update relative to the last received state).

    A kind that travels compressed (``decode``, e.g. ``svd_model``'s factors) is defended as sent, with
    no reference: the factors of two states have different ranks and bases and cannot be subtracted."""
    if kind not in KINDS:
        return False
    spec = KINDS.get(kind)
    return spec.form is ParamForm.PARAMETERS and spec.decode is None


@dataclass
class DefenseParams:
    """Parameters every defense accepts; subclasses add their own (all with defaults).

    ``kinds=None`` means every kind of the defense's ``families``. Both sets may be given as a '+'-separated
    string (as in a spec) or as any iterable of names.
    """

    kinds: frozenset[str] | None = None
    directions: frozenset[str] = frozenset({"up"})

    def __post_init__(self) -> None:
        if self.kinds is not None:
            self.kinds = _name_set("kinds", self.kinds, KINDS)
        self.directions = _name_set("directions", self.directions, DIRECTIONS)


def _name_set(field: str, value: Any, accepted: typing.Iterable[str]) -> frozenset[str]:
    """Normalise a '+'-separated string or an iterable of names, checked against ``accepted``."""
    names = value.split("+") if isinstance(value, str) else list(value)
    names = [n.strip() if isinstance(n, str) else n for n in names]
    ok = sorted(accepted)
    if not names or any(not isinstance(n, str) or not n for n in names):
        raise ConfigError(f"{field} must be a non-empty '+'-separated list of: {', '.join(ok)}")
    unknown = sorted(set(names) - set(ok))
    if unknown:
        raise ConfigError(f"unknown {field} {', '.join(unknown)}; accepted: {', '.join(ok)}")
    return frozenset(names)


def check_range(
    field: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise a one-line :class:`ConfigError` unless ``value`` lies in the stated interval."""
    bad = (
        (low is not None and (value <= low if low_open else value < low))
        or (high is not None and (value >= high if high_open else value > high))
        or (isinstance(value, float) and not math.isfinite(value))
    )
    if bad:
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        interval = f"{'(' if low_open or low is None else '['}{lo}, {hi}{')' if high_open or high is None else ']'}"
        raise ConfigError(f"{field} must be in {interval}, got {value!r}")


def _coerce(field: str, value: Any, hint: Any) -> Any:
    """Convert ``value`` (a spec string or a Python value) to the type of a Params field."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            return None
        (hint,) = [a for a in args if a is not type(None)]
        origin = typing.get_origin(hint)
    wording = {bool: "true or false", int: "an integer", float: "a number"}
    if hint in wording:
        try:
            return parse_scalar(value, hint)
        except (TypeError, ValueError):
            raise ConfigError(f"{field} must be {wording[hint]}, got {value!r}") from None
    if origin is frozenset:
        return value  # validated against its vocabulary by DefenseParams.__post_init__
    return value


def _format(value: Any) -> str:
    if isinstance(value, frozenset):
        return "+".join(sorted(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


class Defense:
    """A channel mod that transforms the float, non-aux tensors of selected outgoing messages.

    Subclasses set ``name``, ``paper``, ``families`` and ``Params`` and implement
    :meth:`transform`; they register with :func:`register_defense`.
    """

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    families: ClassVar[frozenset[Family]] = PARAMETER_FAMILIES
    Params: ClassVar[type] = DefenseParams

    def __init__(self, **params: Any):
        fields = {f.name: f for f in dataclasses.fields(self.Params)}
        unknown = sorted(set(params) - set(fields))
        if unknown:
            raise ConfigError(f"unknown parameter(s) {', '.join(unknown)} for defense {self.name!r}; accepted: {', '.join(fields)}")
        hints = typing.get_type_hints(self.Params)
        try:
            values = {k: _coerce(k, v, hints[k]) for k, v in params.items()}
            self.params = self.Params(**values)
        except ConfigError as exc:
            raise ConfigError(f"defense {self.name!r}: {exc}") from None
        self.directions: frozenset[str] = self.params.directions
        self.defended_messages = 0

    @classmethod
    def default_kinds(cls) -> frozenset[str]:
        """Every registered kind of the defense's families (kinds registered later included)."""
        return kinds_of(cls.families)

    @property
    def kinds(self) -> frozenset[str]:
        """The kinds this defense touches: the explicit ``kinds=`` or :meth:`default_kinds`."""
        return self.params.kinds if self.params.kinds is not None else self.default_kinds()

    # -- what the channel calls -------------------------------------------------------------------

    def applies_to(self, msg: Message) -> bool:
        if msg.direction not in self.directions:
            return False
        if self.params.kinds is not None:
            return msg.kind in self.params.kinds
        return msg.kind in KINDS and KINDS.get(msg.kind).family in self.families

    def __call__(self, msg: Message, ctx: ChannelContext) -> Message:
        """Return a new message with the defended tensors (or ``msg`` itself when not selected)."""
        if not self.applies_to(msg):
            return msg
        names = [k for k, t in msg.tensors.items() if k not in msg.aux and t.is_floating_point()]
        if not names:
            return msg
        reference = ctx.reference(msg) if is_full_parameters(msg.kind) else None
        bases: dict[str, torch.Tensor] = {}
        updates: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for k in names:
                t = msg.tensors[k]
                # half precision is widened so that differences and noise are not rounded away
                work = torch.float64 if t.dtype == torch.float64 else torch.float32
                ref = reference.get(k) if reference is not None else None
                if ref is not None and ref.shape == t.shape and ref.is_floating_point():
                    bases[k] = ref.to(device=t.device, dtype=work)
                    updates[k] = t.to(work) - bases[k]
                else:
                    updates[k] = t.to(work)
            defended = self.transform(updates, msg)
            out = dict(msg.tensors)
            for k in names:
                value = defended[k] + bases[k] if k in bases else defended[k]
                out[k] = value.to(msg.tensors[k].dtype).contiguous()
        defended_msg = Message(msg.round, msg.sender, msg.receiver, msg.kind, out, dict(msg.meta), msg.aux)
        self.account(defended_msg)
        return defended_msg

    def account(self, msg: Message) -> None:
        """Count ``msg`` as defended (and run :meth:`after_defended`). On Flower a client's node defends
        its uploads and the server's copy of the defense accounts for them, so a defense's report and
        checkpointed state live on the server; :meth:`transform` must depend only on the message, its
        reference and the defense's parameters."""
        self.defended_messages += 1
        self.after_defended(msg)

    # -- what subclasses implement ----------------------------------------------------------------

    def transform(self, updates: dict[str, torch.Tensor], msg: Message) -> dict[str, torch.Tensor]:
        """Defend ``updates`` (float tensors, never aux); return new tensors of the same shapes."""
        raise NotImplementedError

    def after_defended(self, msg: Message) -> None:
        """Hook run once per defended message (e.g. privacy accounting)."""

    def report(self) -> dict[str, Any]:
        """What to put in a run's report; at least how many messages were defended."""
        return {"defended_messages": self.defended_messages}

    def state(self) -> dict[str, Any]:
        """JSON state a checkpoint keeps so ``--resume`` continues exactly (e.g. privacy accounting)."""
        return {"defended_messages": self.defended_messages}

    def load_state(self, state: dict[str, Any]) -> None:
        self.defended_messages = int(state.get("defended_messages", 0))

    # -- helpers ----------------------------------------------------------------------------------

    def noise(self, msg: Message, tensor_name: str, like: torch.Tensor, std: float, seed: int) -> torch.Tensor:
        """N(0, std^2) shaped like ``like``, reproducible per (seed, round, sender, kind, tensor name).

        The stream is derived with sha256 rather than Python's ``hash`` (salted per process), and
        drawn on the CPU so that it does not depend on the device; the kind is part of the key so
        that two messages a client sends in one round never share noise.
        """
        key = f"{self.name}|{seed}|{msg.round}|{msg.sender}|{msg.kind}|{tensor_name}".encode()
        gen = torch.Generator(device="cpu")
        gen.manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & (2**63 - 1))
        sample = torch.randn(like.shape, generator=gen, dtype=torch.float64 if like.dtype == torch.float64 else torch.float32)
        return sample.to(device=like.device, dtype=like.dtype) * std

    @property
    def spec(self) -> str:
        """The ``name:k=v,...`` string that :func:`parse_defense` turns back into this defense."""
        items = [
            f"{f.name}={_format(getattr(self.params, f.name))}" for f in dataclasses.fields(self.params) if getattr(self.params, f.name) is not None
        ]
        return f"{self.name}:{','.join(items)}" if items else self.name

    def __repr__(self) -> str:
        return f"<defense {self.spec}>"


D = typing.TypeVar("D", bound=type[Defense])


def register_defense(cls: D) -> D:
    """Class decorator: add ``cls`` to :data:`DEFENSES` under ``cls.name`` (checked by the registry)."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a name")
    DEFENSES.register(cls.name, cls)
    return cls


def parse_defense(spec: str) -> Defense:
    """Build a defense from ``"name"`` or ``"name:key=value,key=value"``.

    Values are converted to the Params field types; ``kinds``/``directions`` are '+'-separated.
    Errors are one line: :class:`~privfl.errors.UnknownNameError` for an unknown defense,
    :class:`~privfl.errors.ConfigError` for a malformed spec, unknown parameter or bad value.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("empty defense spec; expected name or name:key=value,...")
    name, _, rest = spec.strip().partition(":")
    cls = DEFENSES.get(name.strip())
    params: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ConfigError(f"bad defense parameter {item!r} in {spec!r}; expected key=value")
        if key in params:
            raise ConfigError(f"defense parameter {key!r} given twice in {spec!r}")
        params[key] = value
    return cls(**params)


def build_defenses(specs: typing.Iterable[str]) -> list[Defense]:
    """Parse every spec (in order: the channel applies the mods in this order)."""
    return [parse_defense(s) for s in specs]
