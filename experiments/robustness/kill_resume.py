"""Kill a training run at each point of its life, resume it, and check it ends byte-identical to one never killed.

One reference run is trained to the end. Then, for each chosen kill point, the same run is trained again in a
child process that hard-kills itself there (``SIGKILL`` from inside the engine's ``TrainCallback``: nothing is
flushed, no handler runs), and the dead run is continued with the real CLI, ``python -m privfl.train --resume
RUN --no-progress``. The resumed run is then checked with ``python -m privfl.capture verify`` and compared with
the reference file by file.

Kill points, in the order they happen:

- ``msg S``: right after message ``S`` (capture index record ``seq == S``) was captured and delivered;
- ``ckpt R``: right after round ``R``'s metrics and checkpoint were written (``on_round_end``), i.e. before the
  next round starts (for the last round: before ``summary.json`` is written).

What "identical" means: every file of the run directory (``capture/``, ``truth/``, ``knowledge/``, the
checkpoint, ``config.*``, ``run.json``, ``partition.*``, ...) is compared byte for byte, and the set of files must
be the same (an extra leftover file counts as a difference). Only wall-clock fields are normalised away:

- ``metrics.jsonl``, ``metrics.csv`` and the ``history`` in ``checkpoint/checkpoint.json``: the per-round ``seconds``;
- ``summary.json``: ``train_seconds``, ``run_dir`` and any other time-like key (``*seconds``, ``*time*``);
- ``.lock`` (the run's writer lock, where the engine keeps one): present in both, its content (a pid) not compared.

Every run (reference, killed, resumed, verify) is its own one-thread subprocess (``OMP_NUM_THREADS=1``), run one
at a time on the CPU, so float reductions agree bit for bit across processes. The killed run lives at the same
path as the reference did (``OUT/work/run``), so ``config.json`` is compared without exceptions.

    python -m experiments.robustness.kill_resume                     # fedre, 600 Fashion-MNIST samples, 3 clients, 3 rounds
    python -m experiments.robustness.kill_resume --points 12         # 12 kill points, evenly spaced over the run
    python -m experiments.robustness.kill_resume --method fedavg --rounds 2 --out runs/kr-fedavg --keep
    python -m experiments.robustness.kill_resume --torn index        # also tear the next index line at each kill (simulated)

``--torn`` adds, after the hard kill, what a kill *inside* the next capture write would have left (simulated
from the reference run's bytes): ``index`` a complete blob plus the first half of its index line (no newline),
``blob`` a half-written temporary blob file as ``atomic_write_bytes`` names it. The table shows, per point, what
was on disk at the kill, the exit status of the kill/resume/verify processes and the first file that differed;
the same goes to ``OUT/kill_resume.json``.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RUN_NAME = "run"
#: keys of summary.json that hold wall time or the run's location, not results
TIME_LIKE = re.compile(r"(seconds|time|timestamp|started|finished|date)", re.IGNORECASE)
NORMALISED = {
    "metrics.jsonl": "per-round 'seconds' removed",
    "metrics.csv": "'seconds' column removed",
    "checkpoint/checkpoint.json": "'seconds' removed from each history entry",
    "summary.json": "'run_dir' and time-like keys (train_seconds, ...) removed",
    ".lock": "presence only (it holds the pid of the process that last wrote the run)",
}


def code_snapshot() -> dict[str, str]:
    """sha256 of each Python source file a run executes (privfl, defenses): if one changes while the script
    runs (the tree is being edited), the reference and a resumed run may not run the same code; the table says so."""
    return {
        str(path.relative_to(ROOT)): hashlib.sha256(path.read_bytes()).hexdigest()
        for package in ("privfl", "defenses")
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def code_changes(base: dict[str, str], *now: dict[str, str]) -> list[str]:
    """Source files that differ between ``base`` and any snapshot in ``now``."""
    return sorted({rel for snap in now for rel in base.keys() | snap.keys() if base.get(rel) != snap.get(rel)})


# ---------------------------------------------------------------------- the child: train, and die at a point
def child_main(argv: list[str]) -> int:
    """``python -m experiments.robustness.kill_resume --child CONFIG_JSON [--kill-seq S | --kill-round-end R]``: train; SIGKILL self at the point."""
    import torch

    from privfl.engine import TrainCallback
    from privfl.train import train

    p = argparse.ArgumentParser(prog="python -m experiments.robustness.kill_resume --child")
    p.add_argument("--child", required=True, help="the run's options as JSON (privfl.train keys)")
    p.add_argument("--kill-seq", type=int, default=None)
    p.add_argument("--kill-round-end", type=int, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    class HardKill(TrainCallback):
        """SIGKILL this very process: no exception, no finally, no atexit, no buffered write flushed."""

        def on_message(self, message: Any, record: dict[str, Any]) -> None:
            if args.kill_seq is not None and record["seq"] == args.kill_seq:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_round_end(self, rnd: int, entry: dict[str, Any]) -> None:
            if args.kill_round_end is not None and rnd == args.kill_round_end:
                os.kill(os.getpid(), signal.SIGKILL)

    train(json.loads(args.child), callbacks=[HardKill()])
    return 0


# ---------------------------------------------------------------------- subprocesses
def child_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "torch_threads": "1", "PYTHONPATH": path}


@dataclass
class Proc:
    rc: int
    seconds: float
    tail: str


def run_proc(cmd: list[str], timeout: float) -> Proc:
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return Proc(124, time.perf_counter() - t0, out[-2000:] + "\n[timed out]")
    return Proc(done.returncode, time.perf_counter() - t0, (done.stdout + done.stderr)[-2000:])


def train_child(values: dict[str, Any], timeout: float, *, kill_seq: int | None = None, kill_round_end: int | None = None) -> Proc:
    cmd = [sys.executable, "-m", "experiments.robustness.kill_resume", "--child", json.dumps(values)]
    if kill_seq is not None:
        cmd += ["--kill-seq", str(kill_seq)]
    if kill_round_end is not None:
        cmd += ["--kill-round-end", str(kill_round_end)]
    return run_proc(cmd, timeout)


# ---------------------------------------------------------------------- kill points
@dataclass(frozen=True)
class Point:
    label: str  # "msg 7" or "ckpt 1"
    round: int
    seq: int | None = None  # kill after this message
    ckpt: int | None = None  # kill after this round's checkpoint


def read_index(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """Committed index records (complete lines) and whether a partial last line follows them."""
    lines = path.read_bytes().split(b"\n") if path.exists() else [b""]
    records = []
    for line in lines[:-1]:
        try:
            records.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            records.append({"bad_line": True})
    return records, bool(lines[-1])


def timeline(records: list[dict[str, Any]], rounds: int) -> list[Point]:
    """Every message in capture order, with each round's checkpoint point after its last message."""
    points: list[Point] = []
    done = -1  # rounds whose checkpoint point is placed
    for rec in sorted(records, key=lambda r: r["seq"]):
        while done + 1 < rec["round"]:
            done += 1
            points.append(Point(f"ckpt {done}", done, ckpt=done))
        points.append(Point(f"msg {rec['seq']}", rec["round"], seq=rec["seq"]))
    while done + 1 < rounds:
        done += 1
        points.append(Point(f"ckpt {done}", done, ckpt=done))
    return points


def choose(points: list[Point], n: int | None) -> list[Point]:
    """``n`` evenly spaced points; by default all when there are at most 60, else 40 evenly spaced plus the
    first and last message of each round and every checkpoint point."""

    def spaced(k: int) -> set[int]:
        if k >= len(points):
            return set(range(len(points)))
        if k <= 1:
            return {len(points) - 1} if k == 1 else set()
        return {round(i * (len(points) - 1) / (k - 1)) for i in range(k)}

    if n is not None:
        keep = spaced(n)
    elif len(points) <= 60:
        keep = set(range(len(points)))
    else:
        keep = spaced(40)
        for rnd in sorted({p.round for p in points}):
            msgs = [i for i, p in enumerate(points) if p.round == rnd and p.seq is not None]
            keep.update(msgs[:1] + msgs[-1:])
        keep.update(i for i, p in enumerate(points) if p.ckpt is not None)
    return [points[i] for i in sorted(keep)]


# ---------------------------------------------------------------------- what a kill left, and a simulated torn write
def disk_state(run: Path) -> dict[str, Any]:
    records, partial = read_index(run / "capture" / "index.jsonl")
    pointer = run / "checkpoint" / "checkpoint.json"
    ckpt = json.loads(pointer.read_text())["round"] if pointer.is_file() else None
    metrics = run / "metrics.jsonl"
    rows = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    tmp = sorted(str(f.relative_to(run)) for f in run.rglob("*.tmp"))
    return {"index_records": len(records), "partial_tail": partial, "checkpoint_round": ckpt, "metrics_rows": rows, "tmp_files": tmp}


def tear(run: Path, ref: Path, mode: str) -> str:
    """Leave what a kill inside the *next* capture append would have left (taken from the reference's bytes)."""
    index = run / "capture" / "index.jsonl"
    have, _ = read_index(index)
    ref_lines = (ref / "capture" / "index.jsonl").read_bytes().split(b"\n")[:-1]
    if len(have) >= len(ref_lines):
        return "nothing left to tear"
    line = ref_lines[len(have)]
    digest = json.loads(line)["sha256"]
    rel = Path("capture") / "blobs" / digest[:2] / f"{digest}.safetensors"
    blob = (ref / rel).read_bytes()
    if mode == "index":
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(blob)
        with open(index, "ab") as fh:
            fh.write(line[: len(line) // 2])
        return f"blob {digest[:8]} + half of index line {len(have)}"
    if (run / rel).exists():  # the store writes a blob only when it is new: this append would write no blob
        return f"next message's blob {digest[:8]} already stored: no blob write to tear"
    tmp = (run / rel).parent / f".{rel.name}.kr0000.tmp"  # the name tempfile.mkstemp gives in atomic_write_bytes
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(blob[: len(blob) // 2])
    return f"half-written {tmp.relative_to(run)}"


# ---------------------------------------------------------------------- comparing two runs
def _normalise(rel: str, data: bytes) -> bytes:
    if rel == ".lock":
        return b""
    if rel == "metrics.jsonl":
        rows = [json.loads(line) for line in data.decode().splitlines()]
        return "".join(json.dumps({k: v for k, v in r.items() if k != "seconds"}, sort_keys=True) + "\n" for r in rows).encode()
    if rel == "metrics.csv":
        table = list(csv.reader(io.StringIO(data.decode())))
        drop = table[0].index("seconds") if table and "seconds" in table[0] else None
        return "\n".join(",".join(c for i, c in enumerate(row) if i != drop) for row in table).encode()
    if rel == "checkpoint/checkpoint.json":
        info = json.loads(data)
        info["history"] = [{k: v for k, v in h.items() if k != "seconds"} for h in info.get("history", [])]
        return json.dumps(info, sort_keys=True).encode()
    if rel == "summary.json":
        info = json.loads(data)
        return json.dumps({k: v for k, v in info.items() if k != "run_dir" and not TIME_LIKE.search(k)}, sort_keys=True).encode()
    return data


def files(run: Path) -> dict[str, Path]:
    return {str(f.relative_to(run)): f for f in sorted(run.rglob("*")) if f.is_file() and not f.is_symlink()}


def compare(ref: Path, got: Path) -> list[str]:
    """Every difference between two run folders, after removing wall time (see NORMALISED); empty: identical."""
    a, b = files(ref), files(got)
    diffs = [f"missing {rel}" for rel in sorted(a.keys() - b.keys())]
    diffs += [f"extra {rel}" for rel in sorted(b.keys() - a.keys())]
    for rel in sorted(a.keys() & b.keys()):
        x, y = a[rel].read_bytes(), b[rel].read_bytes()
        if x == y:
            continue
        try:
            same = _normalise(rel, x) == _normalise(rel, y)
        except (ValueError, KeyError, UnicodeDecodeError):  # unparsable: a difference in itself
            same = False
        if not same:
            diffs.append(f"differs {rel}")
    return diffs


# ---------------------------------------------------------------------- one kill point
@dataclass
class Result:
    point: str
    at_kill: dict[str, Any] = field(default_factory=dict)
    torn: str = ""
    kill_rc: int | None = None
    resume_rc: int | None = None
    verify_rc: int | None = None
    identical: bool = False
    diffs: list[str] = field(default_factory=list)
    seconds: float = 0.0
    code_changed: list[str] = field(default_factory=list)  # source files changed since the reference began
    note: str = ""


def one_point(point: Point, values: dict[str, Any], work: Path, ref: Path, args: argparse.Namespace, base: dict[str, str]) -> Result:
    t0 = time.perf_counter()
    res = Result(point.label)
    before = code_snapshot()
    run = work / RUN_NAME
    shutil.rmtree(work, ignore_errors=True)
    killed = train_child(values, args.timeout, kill_seq=point.seq, kill_round_end=point.ckpt)
    res.kill_rc = killed.rc
    if killed.rc != -signal.SIGKILL:
        res.note = f"the child did not die at the point (exit {killed.rc}): {killed.tail.strip().splitlines()[-1:] or ''}"
        res.seconds = time.perf_counter() - t0
        return res
    if args.torn != "none":
        res.torn = tear(run, ref, args.torn)
    res.at_kill = disk_state(run)  # what --resume finds (torn write included)
    resumed = run_proc([sys.executable, "-m", "privfl.train", "--resume", str(run), "--no-progress"], args.timeout)
    res.resume_rc = resumed.rc
    if resumed.rc != 0:
        res.note = "resume failed: " + " | ".join(resumed.tail.strip().splitlines()[-3:])
    verified = run_proc([sys.executable, "-m", "privfl.capture", "verify", "--run", str(run)], args.timeout)
    res.verify_rc = verified.rc
    if verified.rc != 0:
        res.note = (res.note + "; " if res.note else "") + "verify: " + " | ".join(verified.tail.strip().splitlines()[-3:])
    res.diffs = compare(ref, run)
    res.identical = resumed.rc == 0 and not res.diffs
    res.code_changed = code_changes(base, before, code_snapshot())
    res.seconds = time.perf_counter() - t0
    return res


# ---------------------------------------------------------------------- report
def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def table(results: list[Result]) -> str:
    head = ("kill point", "index recs", "partial", "tmp files", "ckpt", "kill rc", "resume rc", "verify rc", "identical", "first difference", "s")
    rows = []
    for r in results:
        at = r.at_kill
        first = r.diffs[0] + (f" (+{len(r.diffs) - 1} more)" if len(r.diffs) > 1 else "") if r.diffs else r.note
        if r.code_changed:
            first = f"[{len(r.code_changed)} source file(s) changed since the reference] {first}"
        rows.append(
            (
                r.point,
                str(at.get("index_records", "-")),
                yes(at["partial_tail"]) if at else "-",
                str(len(at["tmp_files"])) if at else "-",
                "-" if at.get("checkpoint_round") is None else f"r{at['checkpoint_round']}",
                str(r.kill_rc),
                "-" if r.resume_rc is None else str(r.resume_rc),
                "-" if r.verify_rc is None else str(r.verify_rc),
                yes(r.identical),
                first,
                f"{r.seconds:.1f}",
            )
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--child" or a.startswith("--child=") for a in argv):
        return child_main(argv)
    p = argparse.ArgumentParser(
        prog="python -m experiments.robustness.kill_resume", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--method", default="fedre")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--subsample", type=int, default=600)
    p.add_argument("--num-clients", type=int, default=3)
    p.add_argument("--model-group", default="homo-cnn4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--defense", action="append", default=[], help="a privfl --defense spec for the run (repeatable)")
    p.add_argument("--points", type=int, default=None, help="N evenly spaced kill points (default: all if <= 60, else 40 + round edges)")
    p.add_argument("--torn", choices=("none", "index", "blob"), default="none", help="also simulate a kill inside the next capture write")
    p.add_argument("--out", default="runs/kill_resume", help="folder for the runs and kill_resume.json (default: runs/kill_resume)")
    p.add_argument("--keep", action="store_true", help="keep every resumed run (default: only those that differ)")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per subprocess")
    args = p.parse_args(argv)

    t_start = time.perf_counter()
    base = code_snapshot()
    from privfl.runs import is_privfl_output, mark_output

    out = Path(args.out).resolve()
    work = out / "work"
    if out.exists() and any(out.iterdir()) and not is_privfl_output(out):  # what follows deletes inside it
        print(f"{out} exists and was not made by this script: give a new --out folder", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    mark_output(out, "python -m experiments.robustness.kill_resume")
    for old in ("work", "ref", "points"):
        shutil.rmtree(out / old, ignore_errors=True)
    values: dict[str, Any] = {
        "method": args.method,
        "rounds": args.rounds,
        "subsample": args.subsample,
        "num_clients": args.num_clients,
        "model_group": args.model_group,
        "seed": args.seed,
        "device": "cpu",
        "progress": False,
        "out_dir": str(work),
        "run_name": RUN_NAME,
    }
    if args.defense:
        values["defense"] = args.defense

    # the reference: trained to the end at the very path every killed run will use, then moved aside
    reference = train_child(values, args.timeout)
    if reference.rc != 0:
        print(f"reference run failed (exit {reference.rc}):\n{reference.tail}", file=sys.stderr)
        return 2
    ref = out / "ref" / RUN_NAME
    ref.parent.mkdir(parents=True)
    (work / RUN_NAME).rename(ref)
    shutil.rmtree(work)
    ref_verify = run_proc([sys.executable, "-m", "privfl.capture", "verify", "--run", str(ref)], args.timeout)
    ref_changed = code_changes(base, code_snapshot())
    records, _ = read_index(ref / "capture" / "index.jsonl")
    every = timeline(records, args.rounds)
    chosen = choose(every, args.points)
    print(
        f"{args.method}: {args.subsample} samples, {args.num_clients} clients, {args.rounds} rounds, seed {args.seed}"
        f"{', defense ' + ' '.join(args.defense) if args.defense else ''}; reference {reference.seconds:.1f} s, "
        f"{len(records)} messages, {len(every)} kill points, testing {len(chosen)}"
        f"{'' if args.torn == 'none' else f' (torn next write: {args.torn}, simulated)'}",
        flush=True,
    )
    print(f"verify of the reference (never killed): exit {ref_verify.rc}", flush=True)
    if ref_changed:
        print(f"  WARNING: source changed while the reference ran: {', '.join(ref_changed)}", flush=True)
    if ref_verify.rc != 0:
        print("  " + "\n  ".join(ref_verify.tail.strip().splitlines()[-6:]), flush=True)

    results: list[Result] = []
    for n, point in enumerate(chosen, 1):
        res = one_point(point, values, work, ref, args, base)
        results.append(res)
        print(f"  [{n}/{len(chosen)}] {point.label:<8} identical={yes(res.identical):<3} {res.seconds:5.1f} s {res.note}", flush=True)
        if (args.keep or not res.identical) and (work / RUN_NAME).exists():
            dest = out / "points" / point.label.replace(" ", "-")
            dest.parent.mkdir(parents=True, exist_ok=True)
            (work / RUN_NAME).rename(dest)
        shutil.rmtree(work, ignore_errors=True)

    same = sum(r.identical for r in results)
    total = time.perf_counter() - t_start
    print()
    print(table(results))
    print("normalised before comparing: " + "; ".join(f"{k}: {v}" for k, v in NORMALISED.items()) + "; every other file byte for byte")
    print(f"total {total:.1f} s")
    changed = code_changes(base, code_snapshot())
    if changed or ref_changed:
        print(f"WARNING: source changed during the measurement ({', '.join(sorted(set(changed) | set(ref_changed)))}): re-run for a clean result")
    print(f"kill-and-resume: {same}/{len(results)} points byte-identical")
    report = {
        "config": values | {"out_dir": "OUT/work"},
        "torn": args.torn,
        "reference": {
            "messages": len(records),
            "seconds": round(reference.seconds, 2),
            "path": str(ref),
            "verify_rc": ref_verify.rc,
            "verify_output": ref_verify.tail,
            "code_changed": ref_changed,
        },
        "kill_points_total": len(every),
        "normalised": NORMALISED,
        "points": [asdict(r) for r in results],
        "code_changed_during_run": code_changes(base, code_snapshot()),
        "identical": same,
        "tested": len(results),
        "seconds": round(total, 1),
    }
    (out / "kill_resume.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"written {out / 'kill_resume.json'}")
    return 0 if same == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
