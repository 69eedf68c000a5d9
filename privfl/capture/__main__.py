# fmt: off
# (the formatter would dedent the examples; this docstring is --help's description, printed as written)
"""``python -m privfl.capture list|show|verify|stats|kinds``: inspect and check a run's capture.

    python -m privfl.capture list                   # messages of the latest run (kind, family, parties, shapes)
    python -m privfl.capture list --kind ent_rep --round 19
    python -m privfl.capture show 42                # one message: index record and tensor stats
    python -m privfl.capture verify --run runs/X    # check files, chain, checksums and meaning (exit 1 on damage)
    python -m privfl.capture kinds                  # the artifact-kind vocabulary: families, tensors, meta
"""
# fmt: on

from __future__ import annotations

import argparse
import json
import sys

from privfl.capture.store import TensorStore
from privfl.channel import summarize_comm
from privfl.cli import PLUGIN_HELP, ArgumentParser, load_plugins, run_cli
from privfl.errors import CaptureError, UnknownNameError
from privfl.kinds import KINDS


def _stores(run_dir):
    out = {}
    for role, folder in (("capture", "capture"), ("knowledge", "knowledge"), ("truth", "truth")):
        if (run_dir / folder / "manifest.json").exists():
            out[role] = TensorStore(run_dir / folder, role)
    if "capture" not in out:
        raise CaptureError(f"{run_dir} has no capture (was it trained with --no-capture?)")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m privfl.capture", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    # --run/--out-dir/--plugin go before or after the subcommand (after: the subparser's value wins)
    parser.add_argument("--run", default=None, help="run directory (default: the latest)")
    parser.add_argument("--out-dir", default="runs", help="where runs live (default: runs)")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE", help=PLUGIN_HELP)
    common = ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument("--run", default=argparse.SUPPRESS, help="run directory (default: the latest)")
    common.add_argument("--out-dir", default=argparse.SUPPRESS, help="where runs live (default: runs)")
    common.add_argument("--plugin", action="append", default=argparse.SUPPRESS, metavar="MODULE", help=PLUGIN_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", parents=[common], help="one line per message", allow_abbrev=False)
    p_list.add_argument("--kind", help="only this kind (python -m privfl.capture kinds lists them)")
    p_list.add_argument("--round", type=int, help="only this round")
    p_list.add_argument("--store", choices=("capture", "knowledge", "truth"), default="capture")
    p_show = sub.add_parser("show", parents=[common], help="one message in full", allow_abbrev=False)
    p_show.add_argument("seq", type=int)
    p_show.add_argument("--store", choices=("capture", "knowledge", "truth"), default="capture")
    sub.add_parser("verify", parents=[common], help="check every checksum, shape and index record", allow_abbrev=False)
    sub.add_parser("stats", parents=[common], help="communication totals per direction and kind", allow_abbrev=False)
    p_kinds = sub.add_parser("kinds", parents=[common], help="the artifact kinds: family, form, tensors, meta", allow_abbrev=False)
    for p in (p_list, p_show, p_kinds):
        p.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def print_kinds(as_json: bool) -> int:
    """The kind vocabulary (privfl.kinds), plug-ins' kinds included."""
    if as_json:
        print(json.dumps([KINDS.get(n).describe() for n in KINDS.names()], indent=1))
        return 0
    for name in KINDS.names():
        k = KINDS.get(name)
        tensors = ", ".join(f"{t.name}{'' if t.required else '?'}" for t in k.tensors)
        form = f" [{k.form}]" if k.form else ""
        print(f"{name:<14} {k.family!s:<26}{form:<14} {tensors:<28} {k.description}")
        for m in k.meta:
            where = "/".join(sorted(m.directions)) if m.directions else "all"
            print(f"{'':<14} meta {m.key}{'' if m.required else '?'}: {m.type} ({where}) {m.doc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from privfl.runs import resolve_run

    argv = list(sys.argv[1:] if argv is None else argv)
    load_plugins(argv)
    args = build_parser().parse_args(argv)
    if args.command == "kinds":
        return print_kinds(args.json)
    run_dir = resolve_run(args.run, args.out_dir)
    if args.command == "verify":  # before opening any store: verify reports a missing one, it does not fail on it
        from privfl.verify import verify_run

        report = verify_run(run_dir)
        for line in report.lines():
            print(line)
        return 0 if report.ok else 1
    stores = _stores(run_dir)
    if args.command == "stats":
        print(json.dumps(summarize_comm(stores["capture"].records()), indent=2))
        return 0
    if args.store not in stores:
        raise CaptureError(f"{run_dir} has no {args.store} store")
    store = stores[args.store]
    records = store.records()
    if args.command == "list":
        if args.kind and args.kind not in KINDS:
            raise UnknownNameError("artifact kind", args.kind, KINDS)
        rows = [r for r in records if (args.kind is None or r.get("kind") == args.kind) and (args.round is None or r.get("round") == args.round)]
        if args.json:
            print(json.dumps(rows, indent=1))
            return 0
        for r in rows:
            shapes = " ".join(f"{k}{tuple(v['shape'])}" for k, v in r["tensors"].items())
            who = f"{r.get('sender', r.get('client', ''))}->{r.get('receiver', '')}" if "sender" in r else r.get("client", "")
            kind = r.get("kind", "")
            family = str(KINDS.get(kind).family) if kind in KINDS else ""
            print(f"{r['seq']:>6} r{r.get('round', ''):<4} {kind:<12} {family:<26} {who:<22} {shapes}  {r.get('scalars', '')}")
        return 0
    matches = [r for r in records if r["seq"] == args.seq]
    if not matches:
        raise CaptureError(f"no record with seq {args.seq} in {store.root} (0..{len(records) - 1})")
    record = matches[0]
    tensors = store.load(record)
    stats = {
        k: {
            "shape": list(v.shape),
            "dtype": str(v.dtype),
            **({"min": float(v.min()), "max": float(v.max()), "mean": float(v.double().mean())} if v.numel() else {}),
        }
        for k, v in tensors.items()
    }
    print(json.dumps({"record": record, "tensors": stats}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("privfl.capture", main))
