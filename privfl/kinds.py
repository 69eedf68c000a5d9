"""The artifact-kind vocabulary: every kind of message, declared once.

A kind says what a message carries and what it means, so that the channel can check a message when it
is sent and capture listing, defenses and attacks can act on it without knowing the method that sent
it. Each :class:`ArtifactKind` has

- a **family** (:class:`Family`): what sort of thing it is (per-sample representations, aggregate
  representations, parameters, gradients/updates, logits, statistics, generator). Defenses choose the
  messages they transform by family, attacks choose their targets by family;
- **tensors**: the names (or ``fnmatch`` patterns, e.g. ``*`` for a state dict) a message must or may
  carry, with their dtype class, number of dimensions and role (``payload`` or ``aux``: bookkeeping
  such as labels and class ids that the papers' scalar counts leave out);
- **meta**: the keys a message must or may carry, with their JSON types, optionally only in some
  directions (a client's upload of a model must say how many samples it trained on; the server's
  broadcast need not);
- for parameter-like families, the **form** of the tensors (:class:`ParamForm`): full parameters, a
  gradient of one batch, or an update ``(previous - new) / a``; gradient leakage turns each into the
  gradient it matches, defenses act on full parameters as updates;
- for representation-like kinds, the **aggregation** (:data:`AGGREGATIONS`): how a row was built from
  the per-sample representations (one sample, a class mean, a weighted mixture, a mean over all), so
  that an attack can rebuild the same construction from data of its own (``invert-learned`` trains
  its decoder on it).

A user's method with a new kind registers it with one call (:func:`register_kind`); capture, defenses
of its family and attacks of its family then take it as they take the built-in ones::

    from privfl.kinds import ArtifactKind, Family, MetaSpec, TensorSpec, register_kind

    register_kind(ArtifactKind(
        "sketch", Family.AGGREGATE_REPRESENTATION, "count-sketch of the client's representations",
        tensors=(TensorSpec("vectors", dtype="float", ndim=2), TensorSpec("classes", dtype="int", ndim=1, role="aux")),
    ))

A message that breaks its kind's declaration fails at its first send with one line naming the method,
the kind, what is wrong and how to fix it (:class:`MessageContractError`).
"""

from __future__ import annotations

import enum
import fnmatch
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from privfl.codecs import sparse_decode, svd_decode
from privfl.errors import PrivflError
from privfl.registry import Registry

if TYPE_CHECKING:
    from privfl.capture.message import Message


class Family(str, enum.Enum):
    """What sort of artifact a kind is; defenses and attacks are declared against families."""

    PER_SAMPLE_REPRESENTATION = "per_sample_representation"
    """One feature vector per training sample (row i belongs to sample i of the message's truth)."""
    AGGREGATE_REPRESENTATION = "aggregate_representation"
    """Vectors that summarise several samples: class prototypes, entangled representations."""
    PARAMETERS = "parameters"
    """Parameters of a module (a model, a head, a layer, a shared sub-network)."""
    GRADIENT = "gradient"
    """Gradients or parameter updates."""
    LOGITS = "logits"
    """Class scores, per sample or per class."""
    STATISTICS = "statistics"
    """Summary statistics of representations (class-wise means and variances)."""
    GENERATOR = "generator"
    """Parameters of a generative model."""

    def __str__(self) -> str:
        return self.value


class ParamForm(str, enum.Enum):
    """How the tensors of a parameter-like kind relate to the module's parameters."""

    PARAMETERS = "parameters"
    """theta_new itself; a defense acts on theta_new - theta_prev, an attack needs theta_prev."""
    GRADIENT = "gradient"
    """d loss / d theta of one batch (meta ``batch_size``) at the state the sender last received."""
    UPDATE = "update"
    """(theta_prev - theta_new) / a, with ``a`` in the meta (1 when absent; FedNova's normaliser)."""

    def __str__(self) -> str:
        return self.value


FAMILY_FORMS: dict[Family, ParamForm] = {
    Family.PARAMETERS: ParamForm.PARAMETERS,
    Family.GENERATOR: ParamForm.PARAMETERS,
}
DIRECTIONS = frozenset({"up", "down", "peer"})
_DTYPES = ("float", "int", "bool", "any")
_META_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "number": (int, float),
    "str": (str,),
    "bool": (bool,),
    "list": (list, tuple),
    "dict": (dict,),
    "any": (object,),
}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor a kind's messages carry: its name (or an ``fnmatch`` pattern), dtype class, number of
    dimensions (None: any), role (``payload`` or ``aux``) and whether it must be present."""

    name: str
    dtype: str = "float"
    ndim: int | None = None
    role: str = "payload"
    required: bool = True
    doc: str = ""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"TensorSpec dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.role not in ("payload", "aux"):
            raise ValueError(f"TensorSpec role must be payload or aux, got {self.role!r}")

    @property
    def is_pattern(self) -> bool:
        return any(ch in self.name for ch in "*?[")

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.name) if self.is_pattern else name == self.name

    def dtype_ok(self, tensor: torch.Tensor) -> bool:
        if self.dtype == "float":
            return tensor.is_floating_point()
        if self.dtype == "int":
            return not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool
        if self.dtype == "bool":
            return tensor.dtype == torch.bool
        return True


@dataclass(frozen=True)
class MetaSpec:
    """A meta key: its JSON type (int, float, number, str, bool, list, dict, any), whether it must be
    present, and in which directions (None: all)."""

    key: str
    type: str = "any"
    required: bool = True
    directions: frozenset[str] | None = None
    doc: str = ""

    def __post_init__(self) -> None:
        if self.type not in _META_TYPES:
            raise ValueError(f"MetaSpec type must be one of {sorted(_META_TYPES)}, got {self.type!r}")
        if self.directions is not None:
            object.__setattr__(self, "directions", frozenset(self.directions))
            if not self.directions <= DIRECTIONS:
                raise ValueError(f"MetaSpec directions must be within {sorted(DIRECTIONS)}")

    def applies(self, direction: str) -> bool:
        return self.directions is None or direction in self.directions

    def type_ok(self, value: Any) -> bool:
        if self.type in ("int", "float", "number") and isinstance(value, bool):
            return False
        if self.type in ("float", "number") and isinstance(value, float) and not math.isfinite(value):
            return False
        return isinstance(value, _META_TYPES[self.type])


#: how a representation-like kind's row is built from per-sample representations r_i (``ArtifactKind.aggregation``)
AGGREGATIONS: dict[str, str] = {
    "sample": "one sample's representation per row",
    "class_mean": "a per-class summary of one class's representations per row: their mean (a prototype), or a centre "
    "learned to stand for the class (FedTGP's, FPL's clusters)",
    "weighted_mixture": "one weighted sum of the sender's representations; the kind's soft label carries the same weights "
    "summed per class (FedRE's entangled representation)",
    "mean": "the mean of many representations of no particular class",
}

#: meta keys every kind accepts (set by the engine's protocol, not by a kind)
COMMON_META = (
    MetaSpec("phase", "str", required=False, doc="'setup' for the one-off exchange before round 0"),
    MetaSpec("arch", "str", required=False, doc="the sender's architecture name"),
)


@dataclass(frozen=True)
class ArtifactKind:
    """One kind of message (see the module docstring)."""

    name: str
    family: Family
    description: str
    tensors: tuple[TensorSpec, ...] = ()
    meta: tuple[MetaSpec, ...] = ()
    #: parameter-like kinds: how the tensors relate to the module's parameters (default by family)
    form: ParamForm | None = None
    #: the tensor holding the vectors of a representation-like kind (one per row, or one (d,) vector)
    vectors: str | None = None
    #: the tensor naming each row's class (int ids), or a soft label over classes (float (C,))
    classes: str | None = None
    soft_label: str | None = None
    #: how each row of ``vectors`` was built (a key of :data:`AGGREGATIONS`; None: undeclared)
    aggregation: str | None = None
    #: extra tensors beyond the declared ones are refused (False: a method may add its own)
    closed: bool = True
    #: for a kind that travels compressed: tensors as sent -> the dense tensors the receiver (and an
    #: attacker, through ``AttackerView.load``) works with; the capture keeps what was sent
    decode: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", Family(self.family))
        if self.form is None and self.family in FAMILY_FORMS:
            object.__setattr__(self, "form", FAMILY_FORMS[self.family])
        if self.form is not None:
            object.__setattr__(self, "form", ParamForm(self.form))
        if not self.name or not self.name.replace("_", "").isalnum():
            raise ValueError(f"kind names are identifiers like 'ent_rep', got {self.name!r}")
        if self.aggregation is not None and self.aggregation not in AGGREGATIONS:
            raise ValueError(f"kind {self.name}: aggregation must be one of {', '.join(AGGREGATIONS)} (or None), got {self.aggregation!r}")
        declared = {t.name for t in self.tensors}
        for ref in (self.vectors, self.classes, self.soft_label):
            if ref is not None and ref not in declared:
                raise ValueError(f"kind {self.name}: {ref!r} is not one of its declared tensors {sorted(declared)}")

    @property
    def parameter_like(self) -> bool:
        return self.form is not None

    @property
    def aux_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors if t.role == "aux" and not t.is_pattern)

    def dense(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors a receiver works with: decoded when the kind travels compressed, else as sent."""
        return self.decode(tensors) if self.decode is not None else dict(tensors)

    def meta_specs(self) -> tuple[MetaSpec, ...]:
        return (*COMMON_META, *self.meta)

    def problems(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], direction: str, aux: Iterable[str] = ()) -> list[str]:
        """What is wrong with a message of this kind (empty when it conforms)."""
        out: list[str] = []
        names = list(tensors)
        for spec in self.tensors:
            found = [n for n in names if spec.matches(n)]
            if spec.required and not found:
                shape = f"{spec.ndim}-d " if spec.ndim is not None else ""
                out.append(f"missing tensor {spec.name!r} ({shape}{spec.dtype}{': ' + spec.doc if spec.doc else ''})")
            for n in found:
                t = tensors[n]
                if not spec.dtype_ok(t):
                    out.append(f"tensor {n!r} is {str(t.dtype).removeprefix('torch.')}, expected {spec.dtype}")
                if spec.ndim is not None and t.dim() != spec.ndim:
                    out.append(f"tensor {n!r} has {t.dim()} dimension(s) {tuple(t.shape)}, expected {spec.ndim}")
        if self.closed:
            extra = [n for n in names if not any(s.matches(n) for s in self.tensors)]
            if extra:
                out.append(f"undeclared tensor(s) {', '.join(map(repr, extra))} (declared: {', '.join(s.name for s in self.tensors)})")
        given_aux = set(aux)
        expected_aux = set(self.aux_names) & set(names)
        open_state = any(t.is_pattern for t in self.tensors)  # a state dict: its sender says what is bookkeeping
        if given_aux and given_aux != expected_aux and not open_state:
            out.append(
                f"aux names {sorted(given_aux)} differ from the kind's bookkeeping tensors {sorted(expected_aux)} "
                "(leave aux empty: the channel takes it from the kind)"
            )
        for mspec in self.meta_specs():
            if not mspec.applies(direction):
                continue
            if mspec.key not in meta:
                if mspec.required:
                    out.append(f"missing meta {mspec.key!r} ({mspec.type}{': ' + mspec.doc if mspec.doc else ''})")
            elif not mspec.type_ok(meta[mspec.key]):
                out.append(f"meta {mspec.key!r} is {type(meta[mspec.key]).__name__} {meta[mspec.key]!r}, expected {mspec.type}")
        return out

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary (``privfl.capture kinds``, docs)."""
        return {
            "name": self.name,
            "family": str(self.family),
            "description": self.description,
            "form": str(self.form) if self.form else None,
            "aggregation": self.aggregation,
            "tensors": [{"name": t.name, "dtype": t.dtype, "ndim": t.ndim, "role": t.role, "required": t.required} for t in self.tensors],
            "meta": [
                {"key": m.key, "type": m.type, "required": m.required, "directions": sorted(m.directions) if m.directions else "all"}
                for m in self.meta
            ],
        }


class MessageContractError(PrivflError):
    """A method sent a message that breaks its kind's declaration (or its own ``sends``)."""


#: kind name -> declaration
KINDS: Registry[ArtifactKind] = Registry("artifact kind")


def register_kind(kind: ArtifactKind) -> ArtifactKind:
    """Add a kind to the vocabulary (a name can be registered once)."""
    if not isinstance(kind, ArtifactKind):
        raise TypeError("register_kind takes an ArtifactKind")
    KINDS.register(kind.name, kind)
    return kind


def get_kind(name: str) -> ArtifactKind:
    return KINDS.get(name)


def kinds_of(families: Iterable[Family | str]) -> frozenset[str]:
    """Names of the registered kinds in any of ``families``."""
    wanted = {Family(f) for f in families}
    return frozenset(n for n in KINDS.names() if KINDS.get(n).family in wanted)


def check_message(msg: Message, method: str = "the method", sends: Mapping[str, str] | None = None) -> None:
    """Raise :class:`MessageContractError` (one line) unless ``msg`` satisfies its kind and ``sends``."""
    if msg.kind not in KINDS:
        raise MessageContractError(
            f"{method} sends unknown kind {msg.kind!r}: register it with privfl.kinds.register_kind(ArtifactKind({msg.kind!r}, ...)) "
            f"or use one of {', '.join(KINDS.names())}"
        )
    if sends is not None:
        allowed = parse_directions(sends.get(msg.kind, ""))
        if msg.direction not in allowed:
            declared = f"declares {msg.kind}: {sends[msg.kind]!r}" if msg.kind in sends else f"does not declare {msg.kind!r} in sends"
            raise MessageContractError(
                f"{method} sends {msg.kind} {msg.direction} ({msg.sender} -> {msg.receiver}) but {declared}; "
                f"add sends = {{..., {msg.kind!r}: {'/'.join(sorted(allowed | {msg.direction}))!r}}}"
            )
    problems = KINDS.get(msg.kind).problems(msg.tensors, msg.meta, msg.direction, msg.aux)
    if problems:
        raise MessageContractError(
            f"{method} sent a malformed {msg.kind!r} message ({msg.sender} -> {msg.receiver}, round {msg.round}): "
            f"{'; '.join(problems)}; see privfl.kinds.KINDS.get({msg.kind!r}).describe() or docs/extending.md"
        )


def parse_directions(text: str) -> frozenset[str]:
    """``"up/down"`` -> {"up", "down"}; unknown words are refused."""
    parts = frozenset(p.strip() for p in text.split("/") if p.strip())
    if not parts <= DIRECTIONS:
        raise ValueError(f"directions are up, down, peer (joined with '/'), got {text!r}")
    return parts


def check_sends(method: str, sends: Mapping[str, str]) -> None:
    """A method's ``sends`` declaration: registered kinds, known directions (checked when it is loaded)."""
    for kind, directions in sends.items():
        if kind not in KINDS:
            raise MessageContractError(
                f"{method} declares unknown kind {kind!r} in sends: register it first with privfl.kinds.register_kind "
                f"(docs/extending.md), or use one of {', '.join(KINDS.names())}"
            )
        try:
            parse_directions(directions)
        except ValueError:
            raise MessageContractError(f"{method}: sends[{kind!r}] = {directions!r}; use 'up', 'down', 'peer' or 'up/down'") from None


def example_message(kind: str, direction: str = "up", *, rows: int = 3, dim: int = 4, num_classes: int = 5) -> Message:
    """A small message that satisfies ``kind``'s declaration (for tests of defenses and plug-ins)."""
    from privfl.capture.message import Message

    spec = KINDS.get(kind)
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for t in spec.tensors:
        if t.is_pattern:  # a state dict: a linear layer whose names the pattern matches
            parts: tuple[tuple[str, tuple[int, ...]], ...] = (("layer.weight", (num_classes, dim)), ("layer.bias", (num_classes,)))
            for part, part_shape in parts:
                name = t.name.replace("*", part, 1).replace("?", "x").replace("[", "").replace("]", "")
                if not t.matches(name):
                    raise ValueError(f"kind {kind}: cannot name an example tensor for pattern {t.name!r}")
                tensors[name] = torch.randn(part_shape, generator=gen)
            continue
        ndim = 1 if t.ndim is None else t.ndim
        shape = {0: (), 1: (rows,), 2: (rows, dim)}.get(ndim, (rows,) * ndim)
        if t.name == spec.soft_label:
            shape = (num_classes,)
        if t.dtype == "int":
            tensors[t.name] = torch.arange(math.prod(shape)).reshape(shape) % num_classes
        elif t.dtype == "bool":
            tensors[t.name] = torch.ones(shape, dtype=torch.bool)
        else:
            tensors[t.name] = torch.rand(shape, generator=gen)
    samples = {"int": 1, "float": 0.1, "number": 0.1, "str": "x", "bool": False, "list": [], "dict": {}, "any": 0}
    meta = {m.key: samples[m.type] for m in spec.meta if m.required and m.applies(direction)}
    sender, receiver = {"up": ("client0", "server"), "down": ("server", "client0"), "peer": ("client0", "client1")}[direction]
    return Message(0, sender, receiver, kind, tensors, meta, tuple(n for n in spec.aux_names if n in tensors))


# ------------------------------------------------------------------------------------------ built-in kinds
_UPLOAD = frozenset({"up", "peer"})


def _samples(doc: str = "training samples behind the message; attacks scale an update by it, servers weight by it") -> MetaSpec:
    return MetaSpec("num_samples", "int", required=True, directions=_UPLOAD, doc=doc)


def _lr() -> MetaSpec:
    return MetaSpec("lr", "number", required=False, doc="the local learning rate (default: the run's --lr)")


_STATE = (TensorSpec("*", dtype="any", doc="a state dict: parameter and buffer names of the module"),)

for _kind in (
    ArtifactKind(
        "rep",
        Family.PER_SAMPLE_REPRESENTATION,
        "per-sample representations (+ their labels)",
        (
            TensorSpec("reps", ndim=2, doc="(n, d), one row per training sample"),
            TensorSpec("labels", dtype="int", ndim=1, role="aux", required=False, doc="(n,) class of each row"),
        ),
        vectors="reps",
        classes="labels",
        aggregation="sample",
    ),
    ArtifactKind(
        "proto",
        Family.AGGREGATE_REPRESENTATION,
        "per-class local prototypes (+ class ids and counts)",
        (
            TensorSpec("protos", ndim=2, doc="(k, d), the mean representation of each present class"),
            TensorSpec("classes", dtype="int", ndim=1, role="aux", doc="(k,) class id of each row"),
            TensorSpec("counts", dtype="int", ndim=1, role="aux", required=False, doc="(k,) samples per class"),
        ),
        vectors="protos",
        classes="classes",
        aggregation="class_mean",
    ),
    ArtifactKind(
        "global_proto",
        Family.AGGREGATE_REPRESENTATION,
        "per-class global prototypes broadcast by a server",
        (TensorSpec("protos", ndim=2, doc="(m, d)"), TensorSpec("classes", dtype="int", ndim=1, role="aux", doc="(m,) class ids")),
        (MetaSpec("role", "str", required=False, doc="which global prototypes when a method sends several sets (FPL: cluster, unbiased)"),),
        vectors="protos",
        classes="classes",
        aggregation="class_mean",
    ),
    ArtifactKind(
        "ent_rep",
        Family.AGGREGATE_REPRESENTATION,
        "entangled representation (+ its dense entangled label)",
        (
            TensorSpec("rep", ndim=1, doc="(d,) weighted sum of the client's representations"),
            TensorSpec("label", ndim=1, role="aux", required=False, doc="(C,) the same weights over one-hot labels"),
        ),
        vectors="rep",
        soft_label="label",
        aggregation="weighted_mixture",
    ),
    ArtifactKind("head", Family.PARAMETERS, "classifier head parameters", _STATE, (_samples(), _lr()), closed=False),
    ArtifactKind(
        "model",
        Family.PARAMETERS,
        "model parameters (a state dict, full or partial: FedBN leaves its BatchNorm layers out, FedRep sends its body)",
        _STATE,
        (_samples(), _lr()),
        closed=False,
    ),
    ArtifactKind(
        "update",
        Family.GRADIENT,
        "parameter update (previous - new) / a, a in meta (default 1)",
        _STATE,
        (
            _samples(),
            _lr(),
            MetaSpec("a", "number", required=False, doc="the update's normaliser (FedNova's a_k)"),
            MetaSpec("tau", "int", required=False, doc="local steps behind the update"),
        ),
        form=ParamForm.UPDATE,
        closed=False,
    ),
    ArtifactKind(
        "grad",
        Family.GRADIENT,
        "gradients of one batch at the state the sender last received",
        _STATE,
        (MetaSpec("batch_size", "int", directions=_UPLOAD, doc="samples in the batch the gradient is of"),),
        form=ParamForm.GRADIENT,
        closed=False,
    ),
    ArtifactKind(
        "logits",
        Family.LOGITS,
        "per-sample or per-class logits",
        (
            TensorSpec("logits", ndim=2, doc="(n, C) class scores"),
            TensorSpec("classes", dtype="int", ndim=1, role="aux", required=False, doc="(n,) the class each row is about"),
            TensorSpec("labels", dtype="int", ndim=1, role="aux", required=False, doc="(n,) labels of per-sample rows"),
        ),
        vectors="logits",
        classes="classes",
    ),
    ArtifactKind("small_model", Family.PARAMETERS, "shared small model parameters (FedMRL)", _STATE, (_samples(), _lr()), closed=False),
    ArtifactKind(
        "layer",
        Family.PARAMETERS,
        "parameters of single layers (FedFree): uploads name the layers, downloads overwrite a target layer's first entries (apply_layer_download)",
        _STATE,
        (
            _samples(),
            MetaSpec("layers", "list", directions=frozenset({"up"}), doc="per uploaded layer: name, type, shape, bias, position"),
            MetaSpec("target", "str", directions=frozenset({"down"}), doc="the receiver's layer to overwrite"),
            MetaSpec("global_layer", "str", directions=frozenset({"down"}), doc="the tensor-name prefix of the sent layer"),
            MetaSpec("fill", "str", directions=frozenset({"down"}), doc="keep or zero: entries beyond the copied ones"),
            MetaSpec("target_shape", "list", directions=frozenset({"down"}), doc="weight shape of the target layer"),
            MetaSpec("target_bias", "bool", directions=frozenset({"down"}), doc="whether the target layer has a bias"),
        ),
        closed=False,
    ),
    ArtifactKind(
        "shared_model",
        Family.PARAMETERS,
        "a homogeneous model shared next to each client's private model (FML's meme model, FedAPEN's shared model)",
        _STATE,
        (_samples(), _lr()),
        closed=False,
    ),
    ArtifactKind(
        "svd_model",
        Family.PARAMETERS,
        "model parameters sent as truncated SVD factors NAME@u, NAME@s, NAME@v (+ NAME@shape when reshaped; FedKD's mentee; privfl.codecs)",
        _STATE,
        (
            _samples(),
            _lr(),
            MetaSpec("energy", "number", required=True, doc="the energy threshold the factors keep (FedKD's T)"),
        ),
        closed=False,
        decode=svd_decode,
    ),
    ArtifactKind(
        "sparse_model",
        Family.PARAMETERS,
        "a sparse model (DisPFL): per parameter NAME its values at the sender's mask (NAME@values), the mask as packed "
        "bits (NAME@mask, aux) and its shape (NAME@shape, aux); decoded to dense, zero-filled tensors (privfl.codecs)",
        (TensorSpec("*", dtype="any", doc="NAME@values (float, 1-d), NAME@mask (uint8 packed bits), NAME@shape (int64); or a dense NAME"),),
        (
            MetaSpec("num_samples", "int", directions=frozenset({"up", "peer"}), doc="training samples behind the model"),
            MetaSpec("lr", "number", required=False, doc="the local learning rate (default: the run's --lr)"),
        ),
        closed=False,
        decode=sparse_decode,
    ),
    ArtifactKind(
        "mean_rep",
        Family.AGGREGATE_REPRESENTATION,
        "one mean representation over many samples of no particular class: a client's running mean "
        "(DBE's r_i^g mean, up) or the server's sample-weighted mean of them (DBE's global mean, down)",
        (TensorSpec("rep", ndim=1, doc="(d,) the mean representation"),),
        (
            MetaSpec("num_samples", "int", directions=frozenset({"up", "peer"}), doc="training samples of the sender; the server weights by it"),
            MetaSpec("momentum", "number", required=False, doc="the running mean's momentum (1: the mean of the last batch)"),
        ),
        vectors="rep",
        aggregation="mean",
    ),
    ArtifactKind(
        "shared_features",
        Family.PER_SAMPLE_REPRESENTATION,
        "input-space features shared as training data, one image-shaped row per sample and noise draw (FedFed's x_s + n), with labels",
        (
            TensorSpec("features", ndim=4, doc="(m, C, H, W) on the [0, 1] pixel scale; row i belongs to sample i of the message's truth"),
            TensorSpec("labels", dtype="int", ndim=1, role="aux", doc="(m,) class of each row"),
            TensorSpec("level", dtype="int", ndim=1, role="aux", required=False, doc="(m,) the noise level of each row (index into meta noise_std)"),
        ),
        (
            MetaSpec("num_samples", "int", directions=frozenset({"up", "peer"}), doc="distinct training samples behind an upload"),
            MetaSpec("noise_std", "list", doc="std of the Gaussian noise of each level, in [0, 1] pixel units"),
        ),
        vectors="features",
        classes="labels",
        aggregation="sample",
    ),
    ArtifactKind(
        "label_counts",
        Family.STATISTICS,
        "how many training samples of each class the sender holds (FedGen's label distribution)",
        (TensorSpec("counts", dtype="int", ndim=1, doc="(C,) samples per class"),),
    ),
    ArtifactKind("generator", Family.GENERATOR, "generator parameters", _STATE, closed=False),
    ArtifactKind(
        "learngene",
        Family.PARAMETERS,
        "Learngene parameters (DRDFL)",
        _STATE,
        (_samples(), _lr(), MetaSpec("previous_round", "int", required=False, doc="round whose received state this one was trained from (-1: none)")),
        closed=False,
    ),
    ArtifactKind(
        "gaussians",
        Family.STATISTICS,
        "class-wise Gaussian parameters (DRDFL)",
        (TensorSpec("mu", ndim=2, doc="(K, d) class means"), TensorSpec("var", ndim=2, doc="(K, d) diagonal variances")),
    ),
):
    register_kind(_kind)


def apply_layer_download(local: torch.Tensor, incoming: torch.Tensor, fill: str) -> torch.Tensor:
    """What a ``layer`` download does to the receiver's target tensor (FedFree Eq. 7): its first d_min
    flattened entries come from ``incoming``; the rest are kept (``fill="keep"``) or zeroed."""
    out = local.detach().clone().reshape(-1)
    if fill == "zero":
        out.zero_()
    d = min(out.numel(), incoming.numel())
    out[:d] = incoming.reshape(-1)[:d].to(out.dtype)
    return out.view_as(local)


__all__ = [
    "AGGREGATIONS",
    "DIRECTIONS",
    "KINDS",
    "ArtifactKind",
    "Family",
    "MessageContractError",
    "MetaSpec",
    "ParamForm",
    "TensorSpec",
    "apply_layer_download",
    "check_message",
    "check_sends",
    "example_message",
    "get_kind",
    "kinds_of",
    "parse_directions",
    "register_kind",
]
