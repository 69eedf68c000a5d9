"""Typed run configuration: one dataclass, the same keys on the command line and in config files.

Every field of :class:`TrainConfig` (and of a method's ``Options`` dataclass) becomes a ``--flag`` and
is also accepted as a key in a TOML or YAML file given with ``--config`` (command-line flags win).
Unknown keys are refused with the list of accepted ones; nothing is ever ``eval``'d.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomli_w
import yaml

from privfl.errors import ConfigError, UnknownNameError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (requires-python allows it): the same parser from its backport
    import tomli as tomllib


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with its help text (shown by ``--help``)."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    """Options shared by every method. Defaults are the quick CPU run (minutes on a laptop)."""

    method: str = opt("fedre", "method name, or an import path 'package.module:Class' of your own method")
    dataset: str = opt("fashionmnist", "dataset name")
    data_root: str | None = opt(None, "folder holding the dataset files (default: standard locations)")
    download: bool = opt(False, "download the dataset with torchvision where a network exists")
    subsample: int | None = opt(None, "use a seeded random subset of N samples (quick tests)")
    num_clients: int = opt(10, "number of clients")
    partition: str = opt("dir", "partition scheme")
    alpha: float = opt(0.1, "Dirichlet concentration for dir/exdir/longtail (PRA setting: 0.1)")
    classes_per_client: int = opt(2, "classes per client for pat/exdir (PAT setting: 2/10/20)")
    imbalance_factor: float = opt(100.0, "long-tail imbalance factor (largest/smallest class)")
    balanced: bool = opt(False, "pat: equal shares instead of random-sized ones")
    min_samples: int | None = opt(None, "fail unless every client gets this many samples (default as PFLlib)")
    train_fraction: float = opt(0.75, "per-client train share; the rest is the client's test split (papers: 3:1)")
    model_group: str = opt("cpu5", "heterogeneous model group, assigned round-robin to clients")
    rep_dim: int = opt(512, "unified representation dimension d")
    mapping: str = opt("ap", "representation mapping RM: ap, mp or fc")
    rounds: int = opt(20, "communication rounds")
    join_ratio: float = opt(1.0, "fraction of clients selected per round")
    local_epochs: int = opt(1, "local epochs per round")
    batch_size: int = opt(64, "local batch size")
    lr: float = opt(0.06, "local learning rate (FedRE paper, model-heterogeneous: 0.06)")
    optimizer: str = opt("sgd", "local optimizer: sgd or adam")
    momentum: float = opt(0.0, "SGD momentum")
    weight_decay: float = opt(0.0, "weight decay")
    eval_batch_size: int = opt(512, "batch size for evaluation and representation passes")
    seed: int = opt(0, "one seed fixes partition, initialisation, sampling and every random draw")
    device: str = opt("auto", "auto (GPU when present), cpu, cuda, cuda:N")
    out_dir: str = opt("runs", "where run directories are created")
    run_name: str | None = opt(None, "run directory name (default: METHOD-DATASET-TIMESTAMP)")
    capture: bool = opt(True, "capture every message (index + safetensors) in the run")
    knowledge_every: int = opt(0, "also store client extractors every N rounds (0: final round only)")
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


def field_types(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: _base_type(hints[f.name]) for f in fields(cls)}


def coerce(cls: type, key: str, value: Any) -> Any:
    """Check and convert one config value to its field's type (and its declared choices)."""
    value = _convert(cls, key, value)
    choices = next(f.metadata.get("choices") for f in fields(cls) if f.name == key)
    if choices is not None and value not in choices:
        raise UnknownNameError(f"value for option {key}", str(value), choices)
    return value


def _convert(cls: type, key: str, value: Any) -> Any:
    tp = field_types(cls)[key]
    if value is None:
        return None
    if typing.get_origin(tp) is list:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise ConfigError(f"option {key}: expected a list of strings, got {value!r}")
        return list(items)
    try:
        return parse_scalar(value, tp)
    except (TypeError, ValueError):
        raise ConfigError(f"option {key}: {value!r} is not a valid {tp.__name__}") from None


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
        out = float(value.strip() if isinstance(value, str) else value)
        if not math.isfinite(out):
            raise ValueError(value)
        return out
    if tp is str:
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
        if typing.get_origin(tp) is list:
            parser.add_argument(flag, action="append", default=argparse.SUPPRESS, metavar="SPEC", help=help_text)
        elif tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, type=str, default=argparse.SUPPRESS, metavar=tp.__name__.upper(), help=help_text)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A TOML or YAML file as a dict (keys may use dashes or underscores)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(p.read_text())
        elif p.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(p.read_text()) or {}
        elif p.suffix == ".json":
            data = json.loads(p.read_text())
        else:
            raise ConfigError(f"config file {p}: use .toml, .yaml or .json")
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(f"config file {p} cannot be parsed: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a table of options")
    return _normalise_keys(data)


def _normalise_keys(data: dict[str, Any]) -> dict[str, Any]:
    return {k.replace("-", "_"): (_normalise_keys(v) if isinstance(v, dict) else v) for k, v in data.items()}


def build_config(values: dict[str, Any], options_cls: type | None) -> TrainConfig:
    """A checked :class:`TrainConfig` from flat values; ``options`` is filled from ``options_cls``."""
    values = dict(values)
    method_opts = dict(values.pop("options", {}) or {})
    method = values.get("method", TrainConfig.method)
    # a method's options may also be given as a table named after the method, or at top level
    if isinstance(values.get(method), dict):
        method_opts.update(values.pop(method))
    opt_names = {f.name for f in fields(options_cls)} if options_cls else set()
    for key in list(values):
        if key in opt_names and key not in _ACCEPTED:
            method_opts[key] = values.pop(key)
    unknown = set(values) - _ACCEPTED
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(sorted(unknown))}; accepted: {', '.join(sorted(_ACCEPTED - {'options'}))}")
    cfg = TrainConfig(**{k: coerce(TrainConfig, k, v) for k, v in values.items()})
    cfg.options = resolve_options(options_cls, method_opts) if options_cls else {}
    if method_opts and not options_cls:
        raise ConfigError(f"method {cfg.method} takes no options, got {', '.join(sorted(method_opts))}")
    return cfg


def resolve_options(options_cls: type, given: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(options_cls)}
    unknown = set(given) - names
    if unknown:
        raise ConfigError(f"unknown method option(s) {', '.join(sorted(unknown))}; accepted: {', '.join(sorted(names)) or '(none)'}")
    obj = options_cls(**{k: coerce(options_cls, k, v) for k, v in given.items()})
    return dataclasses.asdict(obj)


def save_config(cfg: TrainConfig, run_dir: Path) -> None:
    """The resolved config as TOML (re-usable with ``--config``) and JSON."""
    from privfl.capture.store import atomic_write_text

    data = dataclasses.asdict(cfg)
    atomic_write_text(run_dir / "config.json", json.dumps(data, indent=2, sort_keys=True) + "\n")
    toml_data = {k: v for k, v in data.items() if v is not None and k != "options"}
    toml_data["options"] = {k: v for k, v in data["options"].items() if v is not None}
    atomic_write_text(run_dir / "config.toml", tomli_w.dumps(toml_data))


def load_saved_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a privfl run (no config.json)")
    return json.loads(path.read_text())
