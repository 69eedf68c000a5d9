# fmt: off
# (the formatter would dedent the examples; this docstring is --help's description, printed as written)
"""``python -m privfl.capture list|show|verify``: inspect and check a run's capture.

    python -m privfl.capture list                   # messages of the latest run
    python -m privfl.capture list --kind ent_rep --round 19
    python -m privfl.capture show 42                # one message: index record and tensor stats
    python -m privfl.capture verify --run runs/X    # recompute every checksum (exit 1 on problems)
"""
# fmt: on

from __future__ import annotations

import argparse
import json
import sys

from privfl.capture.message import KINDS
from privfl.capture.store import TensorStore
from privfl.channel import summarize_comm
from privfl.cli import run_cli
from privfl.errors import CaptureError, UnknownNameError


def _stores(run_dir):
    out = {}
    for role, folder in (("capture", "capture"), ("knowledge", "knowledge"), ("truth", "truth")):
        if (run_dir / folder / "manifest.json").exists():
            out[role] = TensorStore(run_dir / folder, role)
    if "capture" not in out:
        raise CaptureError(f"{run_dir} has no capture (was it trained with --no-capture?)")
    return out


def main(argv: list[str] | None = None) -> int:
    from privfl.runs import resolve_run

    parser = argparse.ArgumentParser(prog="python -m privfl.capture", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default=None, help="run directory (default: the latest)")
    parser.add_argument("--out-dir", default="runs", help="where runs live (default: runs)")
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="one line per message")
    p_list.add_argument("--kind", help=f"only this kind ({', '.join(KINDS)})")
    p_list.add_argument("--round", type=int, help="only this round")
    p_list.add_argument("--store", choices=("capture", "knowledge", "truth"), default="capture")
    p_show = sub.add_parser("show", help="one message in full")
    p_show.add_argument("seq", type=int)
    p_show.add_argument("--store", choices=("capture", "knowledge", "truth"), default="capture")
    sub.add_parser("verify", help="check every checksum, shape and index record")
    sub.add_parser("stats", help="communication totals per direction and kind")
    for p in (p_list, p_show):
        p.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)

    run_dir = resolve_run(args.run, args.out_dir)
    stores = _stores(run_dir)
    if args.command == "verify":
        failed = False
        for role, store in stores.items():
            problems = store.verify()
            n = len(store.records(strict=False))
            print(f"{role}: {n} records, {'OK' if not problems else f'{len(problems)} problem(s)'}")
            for p in problems:
                print(f"  {p}")
            failed |= bool(problems)
        return 1 if failed else 0
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
            print(f"{r['seq']:>6} r{r.get('round', ''):<4} {r.get('kind', ''):<12} {who:<22} {shapes}  {r.get('scalars', '')}")
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
