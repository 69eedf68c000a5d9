"""``python -m privfl.train METHOD [options]``: train a method, capture everything it sends.

Examples::

    python -m privfl.train fedre                      # quick default: Fashion-MNIST, 10 clients, Dir(0.1)
    python -m privfl.train fedre --re vap --mapping mp
    python -m privfl.train --config experiments/papers/fedre/cifar10_pra_hete.toml
    python -m privfl.train --resume                   # continue the latest (killed) run
    python -m privfl.train mypkg.mymethod:MyMethod    # your own FLMethod subclass

From Python the module itself is the training function, returning a :class:`privfl.Run`::

    import privfl
    run = privfl.train("fedre", rounds=2, subsample=600)       # the same keys as the flags / config files
    run = privfl.train(cfg)                                     # or a privfl.config.TrainConfig
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from privfl.cli import PLUGIN_HELP, ArgumentParser, add_hint, disk_error, load_plugins, run_cli
from privfl.config import TrainConfig, add_dataclass_arguments, build_config, load_saved_config, read_config_file
from privfl.errors import ConfigError
from privfl.runs import latest_target

if TYPE_CHECKING:
    from privfl.engine import TrainCallback, Trainer
    from privfl.fl.method import FLMethod
    from privfl.run import Run


def train(cfg: TrainConfig | Mapping[str, Any] | str | None = None, /, *, callbacks: Sequence[TrainCallback] = (), **options: Any) -> Run:
    """Train a method and return its :class:`~privfl.run.Run`.

    ``cfg`` is a :class:`TrainConfig`, a mapping of options (the keys of the CLI flags and config files,
    method options under ``options`` or at top level) or a method name; keyword ``options`` override it.
    Without a TrainConfig, a method's quick CPU defaults (``Options.run_defaults``) fill what is not
    given, as on the command line. ``callbacks`` are :class:`privfl.engine.TrainCallback` hooks.
    """
    from privfl.methods import resolve_method

    if isinstance(cfg, TrainConfig):
        if options:
            raise ConfigError("give either a TrainConfig or options, not both")
        # the checks the CLI and config files get (types, ranges, choices, method options), on a copy
        build_config(dataclasses.asdict(cfg), resolve_method(cfg.method).Options)
        return train_config(cfg, callbacks=callbacks)
    values: dict[str, Any] = {"method": cfg} if isinstance(cfg, str) else dict(cfg or {})
    values.update(options)
    values.setdefault("method", "fedre")
    method_cls = resolve_method(values["method"])
    for key, value in getattr(method_cls.Options, "run_defaults", {}).items():
        values.setdefault(key, value)
    return train_config(build_config(values, method_cls.Options), callbacks=callbacks)


def train_config(cfg: TrainConfig, *, callbacks: Sequence[TrainCallback] = ()) -> Run:
    """Train a built :class:`TrainConfig` on the engine it names: the in-process trainer, Flower's
    simulation, or a Flower deployment (submitted to the SuperLink, whose ServerApp trains it). The
    choice lives here, above :mod:`privfl.engine` and :mod:`privfl.flower`, which builds on the engine."""
    from privfl import engine

    trainer_cls = engine_class(cfg)
    run_dir = engine.new_run_dir(cfg)
    if cfg.engine == "flower" and cfg.flower_mode == "deployment":
        return _submit(cfg, run_dir)
    return engine.train_with(trainer_cls, cfg, run_dir, callbacks=callbacks)


def resume(run_dir: Path, cfg: TrainConfig, *, callbacks: Sequence[TrainCallback] = ()) -> Run:
    """Continue a killed run from its last complete round; returns the finished :class:`~privfl.run.Run`.

    What the kill left half-done is repaired and reported on stderr; any other damage to the run's
    stores refuses the resume with a one-line error (run ``python -m privfl.capture verify``)."""
    from privfl import engine

    trainer_cls = engine_class(cfg)
    if cfg.engine == "flower" and (cfg.flower_mode == "deployment" or cfg.defense):
        why = (
            "a deployment's SuperNodes are started anew" if cfg.flower_mode == "deployment" else "its nodes' defense references are not checkpointed"
        )
        raise ConfigError(f"{run_dir} ran on Flower ({why}): only simulation runs without --defense resume on Flower yet (train it again)")
    return engine.resume_with(trainer_cls, run_dir, cfg, callbacks=callbacks)


def engine_class(cfg: TrainConfig) -> type[Trainer]:
    """The trainer of ``cfg.engine``; a one-line error (before anything is created) when it cannot run
    the method: Flower not installed, a method not written in roles, an option it does not support yet."""
    from privfl.engine import Trainer
    from privfl.methods import resolve_method

    if cfg.engine == "inprocess":
        return Trainer
    from privfl.flower import require_flower

    require_flower()
    method_cls = resolve_method(cfg.method)
    if not method_cls.in_roles():
        raise ConfigError(
            f"{cfg.method} runs in-process only: --engine flower needs a method written in roles "
            "(client_round + server_round + receive, docs/extending.md), and this one overrides run_round"
        )
    limit = method_cls.flower_limits(cfg, method_cls.Options(**cfg.options))
    if limit is not None:
        raise ConfigError(f"{cfg.method} with these options runs in-process only: {limit}")
    if cfg.flower_mode == "deployment":
        from privfl.flower.deploy import check_deployment

        check_deployment(cfg)
    return _flower_trainer()


def _flower_trainer() -> type[Trainer]:
    from privfl.flower.server import FlowerTrainer

    return FlowerTrainer


def _submit(cfg: TrainConfig, run_dir: Path) -> Run:
    """Hand the run to the SuperLink and wait for it; the run folder is written by its ServerApp."""
    from privfl.errors import PrivflError
    from privfl.flower.deploy import submit
    from privfl.run import Run

    status = submit(cfg, run_dir)
    if not (run_dir / "summary.json").is_file():
        where = "see Flower's log above" if status else f"no finished run at {run_dir.resolve()} on this machine: the SuperLink's machine writes it"
        raise PrivflError(f"the Flower deployment run did not finish here ({where})")
    return Run(run_dir)


def _catalogue() -> str:
    from privfl.data import DATASETS, PARTITIONS
    from privfl.methods import METHODS
    from privfl.models import MAPPINGS, MODEL_GROUPS

    lines = ["methods:"]
    for name in METHODS.names():
        cls = METHODS.get(name)
        sends = ", ".join(f"{k} ({v})" for k, v in cls.sends.items()) or "nothing"
        lines.append(f"  {name:<10} sends {sends}; {cls.paper}")
    lines.append("  pkg.mod:Cls  your own privfl.methods.FLMethod subclass")
    lines.append(f"datasets: {', '.join(DATASETS.names())}")
    lines.append("model groups (round-robin over clients):")
    for name in MODEL_GROUPS.names():
        lines.append(f"  {name:<14} {', '.join(MODEL_GROUPS.get(name))}")
    lines.append(f"partitions: {', '.join(PARTITIONS.names())}")
    lines.append(f"representation mappings: {', '.join(MAPPINGS.names())}")
    lines.append("every option is also a key of a TOML/YAML file given with --config (method options in an [options] table)")
    return "\n".join(lines)


def build_parser(method_cls: type[FLMethod] | None = None) -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m privfl.train",
        description="Train a federated method and capture every message it sends.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_catalogue(),
        allow_abbrev=False,  # --run is not --run-name
    )
    parser.add_argument("method", nargs="?", default=argparse.SUPPRESS, help="method name (default: fedre)")
    parser.add_argument("--config", help="TOML or YAML file of options (command-line flags win)")
    parser.add_argument("--resume", nargs="?", const="latest", metavar="RUN", help="resume a run (default: the latest)")
    parser.add_argument("--run", metavar="RUN", help="with --resume: the run to resume (--resume --run RUN is --resume RUN)")
    parser.add_argument("--plugin", action="append", metavar="MODULE", default=argparse.SUPPRESS, help=PLUGIN_HELP)
    add_dataclass_arguments(parser.add_argument_group("run options"), TrainConfig, skip={"method"})
    if method_cls is not None and fields(method_cls.Options):
        group = parser.add_argument_group(f"{method_cls.name or method_cls.__name__} options")
        add_dataclass_arguments(group, method_cls.Options)
    return parser


def _method_from_argv(argv: list[str]) -> str | None:
    """The positional METHOD, found before full parsing (its options decide the parser).

    A ``--flag`` without ``=`` consumes the next token unless it is a known on/off switch.
    """
    for i, arg in enumerate(argv):
        if arg.startswith("-"):
            continue
        prev = argv[i - 1] if i else ""
        if prev.startswith("--") and "=" not in prev and prev not in _SWITCHES:
            continue
        return arg
    return None


_SWITCHES = {"-h", "--help"} | {
    prefix + f.name.replace("_", "-") for f in fields(TrainConfig) if f.type in ("bool", bool) for prefix in ("--", "--no-")
}


def main(argv: list[str] | None = None, *, callbacks: Sequence[TrainCallback] = ()) -> int:
    """The CLI; ``callbacks`` (:class:`privfl.engine.TrainCallback`) hook into the run it trains or resumes."""
    from privfl.methods import resolve_method
    from privfl.runs import resolve_run

    argv = list(sys.argv[1:] if argv is None else argv)
    load_plugins(argv)
    method_name = _method_from_argv(argv)
    method_cls = resolve_method(method_name) if method_name else None
    args = vars(build_parser(method_cls).parse_args(argv))
    config_path = args.pop("config", None)
    resume_run = resume_target(args.pop("resume", None), args.pop("run", None))
    args.pop("plugin", None)

    if resume_run is not None:
        run_dir = resolve_run(resume_run, args.get("out_dir", "runs"))
        saved = load_saved_config(run_dir)
        allowed = {"device", "progress"}
        ignored = set(args) - allowed
        if ignored:
            raise ConfigError(
                f"--resume continues a run with its saved config; only --device/--progress may change, got {', '.join(sorted(ignored))}"
            )
        saved.update(args)
        cfg = build_config(saved, resolve_method(saved.get("method", ""), source=f"{run_dir}/config.json").Options)
        with _hint_on_disk_error(lambda: run_dir):
            run = resume(run_dir, cfg, callbacks=callbacks)
    else:
        values = read_config_file(config_path) if config_path else {}
        values.update(args)
        values.setdefault("method", "fedre")
        method_cls = resolve_method(values["method"])
        if not config_path:  # a method's quick CPU defaults (Options.run_defaults) fill what the flags leave out
            for key, value in getattr(method_cls.Options, "run_defaults", {}).items():
                values.setdefault(key, value)
        cfg = build_config(values, method_cls.Options)
        before = latest_target(Path(cfg.out_dir))
        with _hint_on_disk_error(lambda: _run_created(cfg, before)):
            run = train_config(cfg, callbacks=callbacks)
    print_summary(run.summary)
    return 0


@contextmanager
def _hint_on_disk_error(find_run: Callable[[], Path | None]) -> Iterator[None]:
    """A full disk (or quota, read-only file system, permission) while training: the one-line error says
    how to continue the run, which keeps its last complete round (checkpoints are written atomically)."""
    try:
        yield
    except Exception as exc:
        if disk_error(exc) is not None:
            run = find_run()
            if run is not None:
                hint = f"the run keeps its last complete round: python -m privfl.train --resume --run {run} continues it"
            else:
                hint = "no round was saved, so there is nothing to resume: train again once that is fixed"
            with suppress(AttributeError, TypeError):  # an exception type that takes no attributes: the line goes without the hint
                add_hint(exc, hint)
        raise


def _run_created(cfg: TrainConfig, latest_before: str | None) -> Path | None:
    """The run folder ``train_config`` created for ``cfg``, if it got as far as saving its config."""
    out = Path(cfg.out_dir)
    if cfg.run_name:
        run: Path | None = out / cfg.run_name
    else:  # a timestamped name: the run train() marked as latest, if it is not the one marked before
        target = latest_target(out)
        run = out / target if target is not None and target != latest_before else None
    return run if run is not None and (run / "config.json").is_file() else None


def resume_target(resume: str | None, run: str | None) -> str | None:
    """The run ``--resume [RUN]`` / ``--resume --run RUN`` names (``latest`` by default); None without --resume."""
    if run is None:
        return resume
    if resume is None:
        raise ConfigError(f"--run names the run to resume: add --resume (python -m privfl.train --resume --run {run})")
    if resume not in ("latest", run):
        raise ConfigError(f"--resume {resume} and --run {run} name two runs; give one")
    return run


def _fmt_count(n: float) -> str:
    return f"{n / 1e3:,.2f}e3"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def print_summary(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{s['method']} on {s['dataset']}: {s['clients']} clients, {s['rounds']} rounds, {s['train_seconds']:.1f} s")
    table.add_column("metric")
    table.add_column("value", justify="right")
    protocol = "personal" if s.get("eval") == "personal" else "global"
    table.add_row(
        f"final mean test accuracy, {protocol} evaluation (sample-weighted ± std over clients)",
        f"{100 * s['final_acc']:.2f} ± {100 * s['final_acc_std']:.2f} %",
    )
    table.add_row(f"best mean test accuracy (round {s['best_round']})", f"{100 * s['best_acc']:.2f} ± {100 * s['best_acc_std']:.2f} %")
    if "final_acc_personal" in s:
        table.add_row(
            "final accuracy, personal evaluation (own parts after local training)",
            f"{100 * s['final_acc_personal']:.2f} ± {100 * s['final_acc_personal_std']:.2f} %",
        )
        table.add_row(
            f"best accuracy, personal evaluation (round {s['best_round_personal']})",
            f"{100 * s['best_acc_personal']:.2f} ± {100 * s['best_acc_personal_std']:.2f} %",
        )
    p = s["per_round"]
    table.add_row(
        "upload per round: scalars (paper-style / incl. labels)", f"{_fmt_count(p['upload_scalars'])} / {_fmt_count(p['upload_scalars_full'])}"
    )
    table.add_row("upload per round: bytes", _fmt_bytes(p["upload_bytes"]))
    table.add_row(
        "broadcast per round: scalars (paper-style / incl. labels)",
        f"{_fmt_count(p['broadcast_scalars'])} / {_fmt_count(p['broadcast_scalars_full'])}",
    )
    table.add_row("broadcast per round: bytes", _fmt_bytes(p["broadcast_bytes"]))
    if p.get("peer_scalars"):
        table.add_row("client-to-client per round: scalars / bytes", f"{_fmt_count(p['peer_scalars'])} / {_fmt_bytes(p['peer_bytes'])}")
    for spec, rep in s.get("defenses", {}).items():
        eps = rep.get("epsilon")
        text = f"{rep.get('defended_messages', 0)} messages defended"
        if eps:
            text += f"; epsilon max {max(eps.values()):.3g} (delta {rep['delta']:g}, {rep['accountant']})"
        table.add_row(f"defense {spec}", text)
    if s.get("nonfinite"):
        first = ", ".join(f"{k} from round {r}" for k, r in s["nonfinite"].items())
        table.add_row("[bold red]non-finite (training diverged)[/]", first)
    table.add_row("capture on disk", _fmt_bytes(s["capture_bytes"]))
    table.add_row("run directory (also runs/latest)", s["run_dir"])
    Console().print(table)


class _TrainModule(types.ModuleType):
    """``privfl.train`` is both this CLI module and, called, :func:`train`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Run:
        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _TrainModule

if __name__ == "__main__":
    sys.exit(run_cli("privfl.train", main))
