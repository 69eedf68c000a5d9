"""Typed run configuration: one dataclass, the same keys on the command line and in config files.

Every field of :class:`TrainConfig` (and of a method's ``Options`` dataclass) becomes a ``--flag`` and
is also accepted as a key in a TOML or YAML file given with ``--config`` (command-line flags win).
Unknown keys are refused with the list of accepted ones; nothing is ever ``eval``'d.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import reprlib
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import tomli_w
import yaml

from privfl.errors import ConfigError, UnknownNameError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (requires-python allows it): the same parser from its backport
    import tomli as tomllib


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with its help text (shown by ``--help``) and optional checks: ``choices``, and a
    numeric range ``min``/``max`` (inclusive) or ``min_exclusive``/``max_exclusive``, enforced by
    :func:`coerce` for CLI flags, config files and Python calls alike (``None`` passes when the field allows it)."""
    unknown = set(kw) - {"choices", *_BOUNDS}
    if unknown:
        raise TypeError(f"opt() got unknown check(s) {', '.join(sorted(unknown))}")
    return field(default=default, metadata={"help": help, **kw})


#: range checks a field may declare: metadata key -> (comparison that must hold, how it reads)
_BOUNDS: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "min": (lambda v, b: v >= b, ">="),
    "min_exclusive": (lambda v, b: v > b, ">"),
    "max": (lambda v, b: v <= b, "<="),
    "max_exclusive": (lambda v, b: v < b, "<"),
}


def range_text(metadata: Mapping[str, Any]) -> str:
    """``{"min": 1}`` -> ``">= 1"``; ``{"min_exclusive": 0, "max_exclusive": 1}`` -> ``"> 0 and < 1"``; ``""`` without a range."""
    return " and ".join(f"{sign} {metadata[key]}" for key, (_, sign) in _BOUNDS.items() if key in metadata)


def check_range(key: str, value: Any, metadata: Mapping[str, Any]) -> None:
    """A one-line :class:`ConfigError` unless ``value`` lies in the range ``metadata`` declares."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if not all(ok(value, metadata[k]) for k, (ok, _) in _BOUNDS.items() if k in metadata):
        raise ConfigError(f"option {key}: must be {range_text(metadata)}, got {value!r}")


#: --memory-format values (privfl.fl.layout says what each does)
MEMORY_FORMATS = ("auto", "channels_last", "contiguous")


@dataclass
class TrainConfig:
    """Options shared by every method. Defaults are the quick CPU run (minutes on a laptop)."""

    method: str = opt("fedre", "method name, or an import path 'package.module:Class' of your own method")
    dataset: str = opt("fashionmnist", "dataset name")
    data_root: str | None = opt(None, "folder holding the dataset files (default: standard locations)")
    download: bool = opt(False, "download the dataset with torchvision where a network exists")
    subsample: int | None = opt(None, "use a seeded random subset of N samples (quick tests)", min=1)
    num_clients: int = opt(10, "number of clients", min=1)
    partition: str = opt("dir", "partition scheme")
    alpha: float = opt(0.1, "Dirichlet concentration for dir/exdir/longtail (PRA setting: 0.1)", min_exclusive=0)
    classes_per_client: int = opt(2, "classes per client for pat/exdir (PAT setting: 2/10/20)", min=1)
    imbalance_factor: float = opt(100.0, "long-tail imbalance factor (largest/smallest class)", min=1)
    balanced: bool = opt(False, "pat: equal shares instead of random-sized ones")
    min_samples: int | None = opt(None, "fail unless every client gets this many samples (default as PFLlib)", min=0)
    train_fraction: float = opt(0.75, "per-client train share; the rest is the client's test split (papers: 3:1)", min_exclusive=0, max_exclusive=1)
    model_group: str = opt("cpu5", "heterogeneous model group, assigned round-robin to clients")
    rep_dim: int = opt(512, "unified representation dimension d", min=1)
    mapping: str = opt("ap", "representation mapping RM: ap, mp or fc")
    rounds: int = opt(20, "communication rounds", min=1)
    join_ratio: float = opt(1.0, "fraction of clients selected per round", min_exclusive=0, max=1)
    local_epochs: int = opt(1, "local epochs per round", min=1)
    batch_size: int = opt(64, "local batch size", min=1)
    lr: float = opt(0.06, "local learning rate (FedRE paper, model-heterogeneous: 0.06)", min_exclusive=0)
    optimizer: str = opt("sgd", "local optimizer: sgd or adam")
    momentum: float = opt(0.0, "SGD momentum", min=0)
    weight_decay: float = opt(0.0, "weight decay", min=0)
    shuffle: bool = opt(True, "reshuffle each client's batches every epoch (--no-shuffle: fixed order, as HtFLlib's loaders)")
    drop_last: bool = opt(False, "drop each epoch's last partial batch (HtFLlib does; a client smaller than a batch then trains nothing)")
    batchnorm_min_batch: int = opt(
        2,
        "smallest last batch of an epoch that a model with BatchNorm trains on (BatchNorm cannot normalise one sample "
        "where its map is 1x1: ResNets on 32x32 crashed); 1 keeps every batch, as runs made before 2026-11-27",
        min=1,
    )
    same_init: bool = opt(False, "clients with the same architecture start from one initialisation (parity runs with HtFLlib/PFLlib)")
    eval: str = opt(
        "both",
        "evaluation protocol: global (each client's model with the latest global part it received, as HtFLlib), "
        "personal (with its own parts after its last local training), or both",
        choices=("global", "personal", "both"),
    )
    global_test: int = opt(
        0,
        "also score every client on a seeded subset of N samples of the union of all clients' test sets and report "
        "Local-T/Global-T, the unweighted client means (DRDFL's metrics); 0: off; N >= the union: all of it",
        min=0,
    )
    eval_batch_size: int = opt(512, "batch size for evaluation and representation passes", min=1)
    memory_format: str = opt(
        "auto",
        "layout of conv weights and activations while a client trains or is evaluated: channels_last (faster on CPU: "
        "0.81x a cnn4 step, 0.47x an evaluation), contiguous (NCHW, as before 2026-11-26; same numbers as runs made then), "
        "or auto (channels_last on CPU for models built only of torch/torchvision/privfl modules)",
        choices=MEMORY_FORMATS,
    )
    client_workers: int = opt(
        0,
        "clients trained and evaluated at once, in threads, each with its share of torch's threads, for methods that "
        "declare parallel_clients (same numbers as one at a time; docs/scale.md): 0 = auto (torch's thread count on CPU, "
        "one client at a time on a GPU), 1 = one at a time",
        min=0,
    )
    seed: int = opt(0, "one seed fixes partition, initialisation, sampling and every random draw", min=0)
    device: str = opt("auto", "auto (GPU when present), cpu, cuda, cuda:N")
    deterministic: bool = opt(
        False,
        "bit-reproducible runs on a GPU: torch's deterministic kernels, no cuDNN autotuning, no TF32, a fixed cuBLAS "
        "workspace (slower; an operation without a deterministic kernel warns); the CPU repeats to the bit without it",
    )
    engine: str = opt(
        "inprocess",
        "inprocess: every client in this process (fast, the default); flower: clients as Flower ClientApps driven by a "
        "ServerApp (pip extra 'flower'), for methods written in roles",
        choices=("inprocess", "flower"),
    )
    flower_mode: str = opt(
        "simulation",
        "with --engine flower: simulation (Flower's Ray-backed Simulation Engine, on this machine) or deployment "
        "(a SuperLink and SuperNodes, see docs/scale.md)",
        choices=("simulation", "deployment"),
    )
    flower_client_cpus: float = opt(1.0, "CPU cores Flower's simulation gives each ClientApp (client resources)", min_exclusive=0)
    flower_client_gpus: float = opt(0.0, "GPUs (fractions allowed) Flower's simulation gives each ClientApp", min=0)
    flower_superlink: str = opt(
        "127.0.0.1:8000",
        "with --flower-mode deployment: the SuperLink's address (host:port of its HTTP API, where the ServerApp is submitted)",
    )
    flower_insecure: bool = opt(False, "with --flower-mode deployment: talk to the SuperLink without TLS (a test federation on localhost)")
    flower_root_certificates: str | None = opt(None, "with --flower-mode deployment: the CA certificate (PEM) of a SuperLink that uses TLS")
    out_dir: str = opt("runs", "where run directories are created")
    run_name: str | None = opt(None, "run directory name (default: METHOD-DATASET-TIMESTAMP)")
    capture: bool = opt(True, "capture every message (index + safetensors) in the run")
    knowledge_every: int = opt(0, "also store client extractors every N rounds (0: final round only)", min=0)
    knowledge_rounds: str = opt("", "also store client extractors at these rounds, a comma list such as 0,9 (the audit's rounds)")
    progress: bool = opt(True, "show a progress bar")
    defense: list[str] = field(
        default_factory=list,
        metadata={
            "help": "defense applied by the channel to outgoing messages, NAME[:k=v,...]; repeatable, applied in order "
            "(gaussian, clip, dp, topk, quantize, repnoise)"
        },
    )
    options: dict[str, Any] = field(default_factory=dict, metadata={"help": "method-specific options"})


_ACCEPTED = {f.name for f in fields(TrainConfig)}


def _base_type(tp: Any) -> type:
    """``int | None`` -> int; ``bool`` -> bool."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


@functools.cache
def field_types(cls: type) -> Mapping[str, type]:
    """Each field's base type, read once per class: ``typing.get_type_hints`` evaluates every annotation
    string and took 2 of the 3.7 s an attack needed to plan on a run (once per option of every config built)."""
    hints = typing.get_type_hints(cls)
    return MappingProxyType({f.name: _base_type(hints[f.name]) for f in fields(cls)})


def coerce(cls: type, key: str, value: Any) -> Any:
    """Check and convert one config value to its field's type (and its declared choices)."""
    value = _convert(cls, key, value)
    metadata = next(f.metadata for f in fields(cls) if f.name == key)
    choices = metadata.get("choices")
    if choices is not None and value not in choices:
        raise UnknownNameError(f"value for option {key}", str(value), choices)
    check_range(key, value, metadata)
    return value


def _convert(cls: type, key: str, value: Any) -> Any:
    tp = field_types(cls)[key]
    if value is None:
        return None
    if typing.get_origin(tp) is list:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise ConfigError(f"option {key}: expected a list of strings, got {_short(value)}")
        return list(items)
    try:
        return parse_scalar(value, tp)
    except (TypeError, ValueError):
        raise ConfigError(f"option {key}: {_short(value)} is not a valid {tp.__name__}") from None


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 4, 4, 60, 60


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut short, for one-line errors about values read from a file (a YAML file can make a
    small list whose full repr is exponentially long, through aliases)."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int too long to print
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _keys(names: Collection[Any]) -> str:
    """Option names for a one-line error: plain ones as they are, odd ones (a newline, very long) as a short repr."""
    return ", ".join(k if isinstance(k, str) and k.isprintable() and len(k) <= 60 else _short(k, 60) for k in sorted(names, key=str))


def parse_scalar(value: Any, tp: Any) -> Any:
    """``value`` (a flag, a spec string, or a TOML/YAML value) as bool, int, float or str.

    The one set of parsing rules for run options and defense parameters: ints accept whole floats
    (TOML/YAML may write ``8.0``) but not bools, floats must be finite. Raises ValueError/TypeError;
    callers word the error. Other types pass through unchanged.
    """
    if tp is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no"):
            return False
        raise ValueError(value)
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(value)
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            return int(value.strip())
        raise ValueError(value)
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(value)
        try:
            out = float(value.strip() if isinstance(value, str) else value)
        except OverflowError:  # an int too large for a float
            raise ValueError(value) from None
        if not math.isfinite(out):
            raise ValueError(value)
        return out
    if tp is str:
        if isinstance(value, (list, dict)):  # not a str written another way (and a YAML alias can make its text huge)
            raise ValueError(value)
        return str(value)
    return value


def add_dataclass_arguments(parser: argparse.ArgumentParser | Any, cls: type, skip: Collection[str] = frozenset()) -> None:
    """One ``--flag`` per field; defaults are SUPPRESSed so config files can fill the gaps."""
    for f in fields(cls):
        if f.name in skip or f.name == "options":
            continue
        tp = field_types(cls)[f.name]
        flag = "--" + f.name.replace("_", "-")
        default = (
            f.default if f.default is not dataclasses.MISSING else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        )
        help_text = f"{f.metadata.get('help', '')} (default: {default})"
        if "choices" in f.metadata:
            help_text += f"; one of: {', '.join(f.metadata['choices'])}"
        if range_text(f.metadata):
            help_text += f"; {range_text(f.metadata)}"
        if typing.get_origin(tp) is list:
            parser.add_argument(flag, action="append", default=argparse.SUPPRESS, metavar="SPEC", help=help_text)
        elif tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, type=str, default=argparse.SUPPRESS, metavar=tp.__name__.upper(), help=help_text)


#: 64 KiB: far above any real config file (a few hundred bytes); bounds the time a parser may spend on one
#: (PyYAML's pure-Python loader needs seconds for a few hundred KiB; libyaml's is faster but crashes on deep nesting)
_MAX_CONFIG_BYTES = 1 << 16


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A TOML or YAML file as a dict (keys may use dashes or underscores)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        if p.stat().st_size > _MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {p} is larger than {_MAX_CONFIG_BYTES >> 10} KiB: not a config file")
        if p.suffix == ".toml":
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        elif p.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        elif p.suffix == ".json":
            data = json.loads(p.read_text(encoding="utf-8"))
        else:
            raise ConfigError(f"config file {p}: use .toml, .yaml or .json")
    # ValueError: also not UTF-8 text, a number too long to convert; RecursionError: nested too deeply
    except (tomllib.TOMLDecodeError, yaml.YAMLError, ValueError, RecursionError) as exc:
        raise ConfigError(f"config file {p} cannot be parsed: {(str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]}") from None
    except OSError as exc:
        raise ConfigError(f"config file {p} cannot be read: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a table of options")
    return _normalise_keys(data, str(p), {}, set())


def _normalise_keys(data: dict[str, Any], source: str, done: dict[int, Any], active: set[int]) -> dict[str, Any]:
    """Dashes in keys become underscores, in nested tables too. Keys must be strings; a table shared through
    YAML aliases is converted once (``done``) and one that contains itself is refused (``active``)."""
    if id(data) in done:
        return done[id(data)]
    if id(data) in active:
        raise ConfigError(f"{source}: a table contains itself (a YAML alias to its own anchor)")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{source}: option names must be strings, got {_short(bad[0])}")
    active.add(id(data))
    out = {k.replace("-", "_"): (_normalise_keys(v, source, done, active) if isinstance(v, dict) else v) for k, v in data.items()}
    active.discard(id(data))
    done[id(data)] = out
    return out


def build_config(values: dict[str, Any], options_cls: type | None) -> TrainConfig:
    """A checked :class:`TrainConfig` from flat values; ``options`` is filled from ``options_cls``."""
    values = dict(values)
    given_opts = values.pop("options", {}) or {}
    if not isinstance(given_opts, Mapping):
        raise ConfigError(f"option options: expected a table of method options, got {_short(given_opts)}")
    method_opts = dict(given_opts)
    method = values.get("method", TrainConfig.method)
    # a method's options may also be given as a table named after the method, or at top level
    if isinstance(method, str) and isinstance(values.get(method), dict):
        method_opts.update(values.pop(method))
    opt_names = {f.name for f in fields(options_cls)} if options_cls else set()
    for key in list(values):
        if key in opt_names and key not in _ACCEPTED:
            method_opts[key] = values.pop(key)
    unknown = set(values) - _ACCEPTED
    if unknown:
        raise ConfigError(f"unknown option(s) {_keys(unknown)}; accepted: {', '.join(sorted(_ACCEPTED - {'options'}))}")
    cfg = TrainConfig(**{k: coerce(TrainConfig, k, v) for k, v in values.items()})
    cfg.options = resolve_options(options_cls, method_opts) if options_cls else {}
    if method_opts and not options_cls:
        raise ConfigError(f"method {cfg.method} takes no options, got {_keys(method_opts)}")
    return cfg


def resolve_options(options_cls: type, given: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(options_cls)}
    unknown = set(given) - names
    if unknown:
        raise ConfigError(f"unknown method option(s) {_keys(unknown)}; accepted: {', '.join(sorted(names)) or '(none)'}")
    obj = options_cls(**{k: coerce(options_cls, k, v) for k, v in given.items()})
    return dataclasses.asdict(obj)


def save_config(cfg: TrainConfig, run_dir: Path) -> None:
    """The resolved config as TOML (re-usable with ``--config``) and JSON."""
    from privfl.capture.store import atomic_write_text

    data = dataclasses.asdict(cfg)
    atomic_write_text(run_dir / "config.json", json.dumps(data, indent=2, sort_keys=True) + "\n")
    atomic_write_text(run_dir / "config.toml", config_toml_text(data))


def config_toml_text(data: dict[str, Any]) -> str:
    return tomli_w.dumps(config_toml_data(data))


def config_toml_data(data: dict[str, Any]) -> dict[str, Any]:
    """What ``config.toml`` holds of a resolved config (as saved in ``config.json``; TOML has no null):
    verify compares it with the parsed ``config.toml``."""
    toml_data = {k: v for k, v in data.items() if v is not None and k != "options"}
    toml_data["options"] = {k: v for k, v in (data.get("options") or {}).items() if v is not None}
    return toml_data


#: options added after runs were saved, with the value a run saved before then used: a resumed or
#: reopened old run keeps computing as it did (``memory_format``: NCHW until 2026-11-26; ``client_workers``: one
#: client at a time before 2026-11-26, the thread count its clients computed with; ``batchnorm_min_batch``: every
#: last batch trained on before 2026-11-27)
SAVED_RUN_DEFAULTS: dict[str, Any] = {"memory_format": "contiguous", "client_workers": 1, "batchnorm_min_batch": 1}


def saved_run_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """A saved run's ``config.json`` values, with :data:`SAVED_RUN_DEFAULTS` for options it predates."""
    return {**SAVED_RUN_DEFAULTS, **config}


def load_saved_config(run_dir: Path) -> dict[str, Any]:
    """A run's saved ``config.json`` (checked to be a JSON object, read without following links), with
    :data:`SAVED_RUN_DEFAULTS` for options it predates."""
    from privfl.runfiles import RunFiles

    return saved_run_values(RunFiles(run_dir).config)
