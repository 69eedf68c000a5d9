# fmt: off
# (the formatter would dedent the examples; this docstring is --help's description, printed as written)
"""``python -m privfl.audit``: audit what a federated method leaks, in one command and one report.

    python -m privfl.audit fedre                                  # quick profile: minutes on 2 CPU cores
    python -m privfl.audit mypkg.mymethod:MyMethod --plugin mypkg --profile standard
    python -m privfl.audit --run runs/X                           # audit an existing run (references trained alike)
    python -m privfl.audit fedavg --defense dp:max_norm=1,noise_multiplier=1 --compare local
    python -m privfl.audit mypkg.mymethod:MyMethod --check        # one tiny round: which attacks apply, what to declare
    python -m privfl.audit --schema                               # the JSON schema of report.json
    python -m privfl.audit --all --seeds 0,1,2 --workers 2        # the leaderboard: every method, one partition
    python -m privfl.audit --methods fedavg,fedre,fedproto --out runs/lb   # run again with the same --out to resume

The method is trained with the profile's settings (``--train KEY=VALUE`` sets any run option, e.g.
``--train model_group=homo-cnn4``), attacked by every registered attack that applies on every kind
it sends at its first, middle and last round, beside reference methods trained on the same data,
partition and seed. The report folder (``--out``, default ``runs/audit-METHOD-TIME``) holds
``report.html`` (self-contained), ``report.json`` (schema privfl-audit/1, docs/audit.md),
``privacy_utility.png`` and the runs with every attack's own results.

With ``--all`` or ``--methods`` it builds the leaderboard instead: every named method trained on one
partition per seed and audited alike, written to ``leaderboard.html`` / ``.json`` / ``.csv`` and
``frontier.png`` (docs/leaderboard.md); ``--out`` (default ``runs/leaderboard-PROFILE``) run again
continues a killed leaderboard, reusing every finished method whose settings, data and code match.
"""
# fmt: on

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from privfl.cli import PLUGIN_HELP, ArgumentParser, load_plugins, run_cli
from privfl.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    from attacks.audit import PROFILES

    p = ArgumentParser(prog="python -m privfl.audit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)  # fmt: skip
    p.add_argument("method", nargs="?", help="registered method name or pkg.mod:Class (not with --run)")
    p.add_argument("--run", help="audit this existing run instead of training the method")
    p.add_argument("--all", action="store_true", help="leaderboard of every registered method (docs/leaderboard.md)")
    p.add_argument("--methods", metavar="A,B,C", help="leaderboard of these methods (registered names or pkg.mod:Class)")
    p.add_argument("--seeds", metavar="0,1,2", help="leaderboard seeds: mean and 95 %% interval per cell (default: --seed)")
    p.add_argument("--profile", default="quick", choices=list(PROFILES), help="training size and attack budgets (default: quick)")
    p.add_argument("--compare", help="comma list of reference methods (default: fedavg,local; +fedproto,fedre for representation methods)")
    p.add_argument("--defense", action="append", default=[], metavar="SPEC", help="also audit the method with this defense (repeatable)")
    p.add_argument("--train", action="append", default=[], metavar="KEY=VALUE", help="a run option of the audited training (repeatable)")
    p.add_argument("--out", help="report folder (default: runs/audit-METHOD-TIME); must not hold a report")
    p.add_argument("--device", default="auto", help="auto (GPU when present), cpu, cuda, cuda:N")
    p.add_argument("--seed", type=int, default=0, help="fixes partitions, initialisations and every attack")
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels in all trainings and attacks: a GPU repeats the audit")
    p.add_argument("--data-root", help="where the dataset lives, if not its standard place")
    p.add_argument("--check", action="store_true", help="train one tiny round and say which attacks apply and what to declare")
    p.add_argument("--schema", action="store_true", help="print the JSON schema of report.json and exit")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE", help=PLUGIN_HELP)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--workers", type=int, default=1, help="processes running the trainings, then the attack jobs, in parallel (default: 1)")
    p.add_argument("--threads-per-worker", type=int, default=0, help="torch threads per worker (default: OMP_NUM_THREADS or the cores, split evenly)")
    return p


def train_options(items: list[str]) -> dict[str, Any]:
    """``["model_group=homo-cnn4", "rounds=5"]`` -> options (typed later by the run config; one-line errors there)."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--train {item!r}: expected KEY=VALUE, e.g. --train model_group=homo-cnn4")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def check(method: str, options: dict[str, Any], *, seed: int, device: str) -> int:
    """One tiny round of ``method``; print what it sends, which attacks apply, and the fix for each that does not."""
    import privfl.train as train_module
    from attacks import ATTACKS, Selection
    from attacks.audit import predict
    from privfl.kinds import KINDS
    from privfl.methods import check_method_class, resolve_method

    cls = resolve_method(method)
    check_method_class(cls)  # raises one line before anything is trained
    print(f"{method}: declarations load; it sends {', '.join(f'{k} ({v})' for k, v in cls.sends.items()) or 'nothing'}")
    for _, note in predict(cls):
        print(f"  before training: {note}")
    with tempfile.TemporaryDirectory(prefix="privfl-check-") as tmp:
        values = {"subsample": 600, "partition": "iid", "rounds": 1, "batch_size": 32, **options, "method": method, "seed": seed,
                  "device": device, "out_dir": tmp, "run_name": "check", "progress": False}  # fmt: skip
        run = train_module.train(values)
        view = run.attacker
        print(f"one round trained ({run.summary['final_acc']:.1%} accuracy); captured kinds:")
        for kind in view.kinds():
            n = len([r for r in view.records() if r["kind"] == kind])
            print(f"  {kind:<14} {KINDS.get(kind).family!s:<26} {n} message(s)")
        print("attacks:")
        for name in ATTACKS.names():
            plan = ATTACKS.get(name)(seed=seed).plan(view, Selection(max_targets=1))
            if plan:
                print(f"  {name:<18} applies to {', '.join(plan.kinds)}")
            else:
                reason = plan.reason.replace(f"run {run.path}", "this run").replace(f"run {run.path.name}", "this run")  # a temporary folder
                print(f"  {name:<18} does not apply: {reason}")
                if plan.fix:
                    print(f"  {'':<18} to enable it: {plan.fix}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from attacks.audit import Workers, audit
    from attacks.audit_report import SCHEMA

    argv = list(sys.argv[1:] if argv is None else argv)
    load_plugins(argv)
    args = build_parser().parse_args(argv)
    if args.schema:
        print(json.dumps(SCHEMA, indent=2))
        return 0
    options = train_options(args.train)
    workers = Workers(args.workers, args.threads_per_worker, tuple(args.plugin))
    if args.all or args.methods is not None:
        return board(args, options, workers)
    if args.seeds is not None:
        raise ConfigError("--seeds is for the leaderboard (--all or --methods); a single audit takes --seed")
    if args.check:
        if not args.method:
            raise ConfigError("--check needs a METHOD (a registered name or pkg.mod:Class)")
        return check(args.method, options, seed=args.seed, device=args.device)
    if not args.method and not args.run:
        raise ConfigError("give a METHOD (registered name or pkg.mod:Class) or --run DIR")
    name = (args.method or Path(args.run).name).replace(":", ".")
    out = Path(args.out) if args.out else Path("runs") / f"audit-{name}-{datetime.now():%Y%m%d-%H%M%S}"
    compare = [m.strip() for m in args.compare.split(",")] if args.compare is not None else None
    result = audit(args.method, run=args.run, profile=args.profile, compare=compare, defenses=args.defense, out=out, device=args.device,
                   seed=args.seed, deterministic=args.deterministic, train_options=options, data_root=args.data_root,
                   progress=not args.no_progress, workers=workers)  # fmt: skip
    print_summary(result.report)
    print(f"report: {result.html}")
    return 0


def board(args: argparse.Namespace, options: dict[str, Any], workers: Any) -> int:
    """``--all`` / ``--methods``: the leaderboard; 1 when a method has no result (the table says why)."""
    from attacks.leaderboard import all_methods, leaderboard

    if args.method or args.run or args.check or args.compare is not None:
        raise ConfigError("--all/--methods build the leaderboard: give no METHOD, --run, --check or --compare with them")
    if args.all and args.methods is not None:
        raise ConfigError("give --all or --methods, not both")
    methods = all_methods() if args.all else [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds is not None else [args.seed]
    except ValueError:
        raise ConfigError(f"--seeds {args.seeds!r}: expected integers separated by commas, e.g. 0,1,2") from None
    plugins = tuple(m.partition(":")[0] for m in methods if ":" in m)
    if plugins:
        import dataclasses

        workers = dataclasses.replace(workers, plugins=(*workers.plugins, *plugins))
    out = Path(args.out) if args.out else Path("runs") / f"leaderboard-{args.profile}"
    result = leaderboard(methods, seeds=seeds, defenses=args.defense, profile=args.profile, out=out, device=args.device,
                         train_options=options, data_root=args.data_root, workers=workers, deterministic=args.deterministic,
                         progress=not args.no_progress)  # fmt: skip
    print_board(result.table)
    print(f"leaderboard: {result.html}")
    return 1 if any(r.entry is None for r in result.cells) else 0


def print_board(table: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def cell(s: dict[str, Any] | None, fmt: str) -> str:
        if s is None:
            return "-"
        text = f"{s['mean']:{fmt}}" + (f" [{s['low']:{fmt}}, {s['high']:{fmt}}]" if s.get("low") is not None else "")
        return text + (f" #{s['rank']}" if s.get("rank") is not None else "")

    wall = f"{table['wall_seconds']:.0f} s wall; {table['total_wall_seconds']:.0f} s over {len(table['invocations'])} invocation(s)"
    t = Table(title=f"leakage leaderboard ({table['profile']['name']} profile, seeds {','.join(map(str, table['seeds']))}, {wall})")
    for col in ("method", "acc global %", "acc personal %", "upload/round", "image gain dB", "labels recall / L1", "membership AUC", "leaks"):
        t.add_column(col, justify="left" if col in ("method", "leaks") else "right")
    for r in table["rows"]:
        c = r["cells"]
        up = r.get("upload_bytes")
        leaks = ", ".join(r["leaks"]) or ("sends nothing" if not r["sends"] else "none beyond the prior")
        t.add_row(r["label"], cell(c.get("acc_global"), ".2f"), cell(c.get("acc_personal"), ".2f"), f"{(up or 0) / 1024:,.1f} KiB",
                  cell(c.get("reconstruction"), "+.2f"), f"{cell(c.get('label_recall'), '.2f')} / {cell(c.get('label_l1'), '.2f')}",
                  cell(c.get("membership"), ".3f"), leaks)  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 200).print(t)
    for w in table["warnings"]:
        print(f"warning: {w}")
    for note in table.get("notes", []):
        print(f"note: {note}")
    for sentence in table["ordering"]:
        print(f"  {sentence}")


def print_summary(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"audit of {report['subject']} ({report['profile']['name']} profile, {report['seconds']:.0f} s)")
    for col in ("method", "role", "final acc", "upload/round", "best PSNR (dB)", "gain over prior (dB)", "class recall", "membership AUC", "leaks"):
        table.add_column(col, justify="left" if col in ("method", "role", "leaks") else "right")
    for e in report["methods"]:
        acc, p = e["accuracy"] or {}, e["privacy"]
        up = (e["communication"] or {}).get("upload_bytes") or 0
        table.add_row(e["label"], e["role"], f"{100 * acc['final']:.2f} %" if acc.get("final") is not None else "-", f"{up / 1024:,.1f} KiB",
                      f"{p['best_psnr']:.2f}" if p["best_psnr"] is not None else "-",
                      f"{p['best_gain_psnr']:+.2f}" if p.get("best_gain_psnr") is not None else "-",
                      f"{p['label_recall']:.2f}" if p["label_recall"] is not None else "-",
                      f"{p['membership_auc']:.3f}" if p["membership_auc"] is not None else "-",
                      ", ".join(p.get("leaks", [])) or ("none beyond the prior" if e["kinds"] else "sends nothing"))  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 150).print(table)  # a log file gets the whole table, not 80 columns
    for e in report["methods"]:
        for k in e["kinds"]:
            for family in ("reconstruction", "labels", "membership"):
                best = k[family]
                if best and best.get("verdict_detail") and e["role"] != "reference":
                    where = f"{best['attack']}, SoK class {best.get('sok_threat_model', '?')}"
                    print(f"  {e['label']}'s {k['kind']}, {family} ({where}): {best['verdict_detail']}")
            for sentence in k["comparison"]:
                print(f"  {sentence}")


if __name__ == "__main__":
    sys.exit(run_cli("privfl.audit", main))
