"""Damage a run in every way we can think of and check that ``verify`` (and ``--resume``) notice.

``python -m privfl.capture verify --run DIR`` (:func:`privfl.verify.verify_run`) must never pass a
damaged run as intact. This script trains a few small base runs (or takes ``--run DIR``, repeatable),
then for each damage kind copies a run to a temporary folder (``shutil.copytree(symlinks=True)``; blobs
are hard links, every damage replaces a file instead of writing into it, so the base runs stay intact),
applies the damage and runs ``verify_run`` on the copy in this process under a timeout (``SIGALRM``: a
verify that blocks, e.g. on a FIFO, counts as a hang = missed). A damage is *caught* when the report is
not ok; a hang or a traceback counts as missed.

Damage kinds (groups as in the table; each applied to each store where it makes sense, ``capture``,
``truth``, ``knowledge``, and to the first, middle and last record):

- ``index``: drop / duplicate / swap two lines / renumber a seq / swap the sha256 of two records with
  different blobs / edit a field (round, sender or client, receiver, kind, direction, scalars, bytes,
  meta, tensor shape, aux) / the same position's record of another run / a copy of the last record
  appended / truncated to its first half / emptied / a garbage line in the middle;
- ``killed``: a partial last line (what a kill leaves: verify must flag it, ``--resume`` repairs it);
- ``head``: ``head.json`` deleted, its count up or down, its chain edited;
- ``blob``: a byte flipped, truncated, deleted, replaced by a valid safetensors file of the same tensors
  with other values, replaced by a symlink to an identical copy outside the run, its ``blobs/aa`` folder
  a symlink to an outside copy;
- ``store``: a store folder deleted, its ``manifest.json`` deleted, the folder a symlink to an outside copy;
- ``file``: run files replaced by symlinks to identical outside copies; ``partition.safetensors``
  deleted or two clients' train splits swapped; a round dropped from ``metrics.jsonl`` or its comm counts
  changed; ``config.json`` rounds changed; a kind dropped from ``run.json`` sends; the checkpoint state
  file deleted; a FIFO in place of ``metrics.jsonl``;
- ``truth``: a truth record's ``message_seq`` pointed at another message (a dropped truth record is
  ``index``/drop on the truth store);
- ``extra`` (beyond the brief, counted apart): damage to files verify may not look at (checkpoint
  weights, summary.json, metrics.csv, config.toml, partition.json, the partition's contents);
- ``rechained`` (counted apart): an adversary who edits records and then recomputes seq, chain and
  head, so that only the meaning checks (layer 3) can see the edit.

``--cli`` also runs the real ``python -m privfl.capture verify --run COPY`` for a sample (one case per
kind group, the FIFO, the intact base runs) and checks its exit status (1 on damage, 0 when intact, no
traceback). ``--resume`` kills a copy of each base run's training after round 0 (a child process whose
``TrainCallback.on_round_end`` SIGKILLs itself), applies every index/head damage to copies of it and runs
``python -m privfl.train --resume COPY --no-progress``: damage must be refused (exit 2, one line) and
leave the copy untouched; a partial last line (and uncommitted records of the interrupted round) must be
repaired (exit 0, a ``privfl: resume:`` note) and the resumed run must verify OK. By default the resumes
run in a forked child of this (already imported) process that executes ``privfl.train`` exactly as
``python -m`` does (``runpy``, ``sys.exit(run_cli(...))``); the legitimate repairs and the undamaged
baseline always use a real ``python -m privfl.train`` subprocess, and ``--real-cli`` uses one for every
resume (about 10 s of imports each on a small machine).

    python -m experiments.robustness.damage_verify                                    # train fedre, drdfl, fedavg (homo-cnn4)
    python -m experiments.robustness.damage_verify --run runs/A --run runs/B --cli    # your runs; sample the real CLI
    python -m experiments.robustness.damage_verify --resume --out damage.json         # also the --resume checks
    python -m experiments.robustness.damage_verify --work /tmp/dv --reuse --resume    # keep/reuse base and killed runs

Every process is one-threaded (``OMP_NUM_THREADS=1``). Cases that verify missed are kept under
``WORK/missed/`` for inspection.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import runpy
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository

STORES = ("capture", "truth", "knowledge")
POSITIONS = ("first", "middle", "last")
BRIEF_GROUPS = ("index", "killed", "head", "blob", "store", "file", "truth")
APART_GROUPS = ("extra", "rechained")
TRAIN_FLAGS = ["--subsample", "600", "--num-clients", "3", "--rounds", "2", "--no-progress"]
DEFAULT_BASES = {"fedre": ["fedre"], "drdfl": ["drdfl"], "fedavg": ["fedavg", "--model-group", "homo-cnn4"]}


def code_fingerprint() -> str:
    """A digest of the Python source that runs (privfl, defenses): other people edit the tree; if it changes while
    this script runs, results from before and after are not comparable, and the report says so."""
    digest = hashlib.sha256()
    for package in ("privfl", "defenses"):
        for path in sorted((ROOT / package).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def preimport(methods: list[str]) -> None:
    """Import everything verify and a resume use now, so that forked children run the same code snapshot as
    this process (a module imported later from an edited tree could not match the ones already loaded)."""
    import defenses  # noqa: F401
    import privfl.cli
    import privfl.config
    import privfl.engine
    import privfl.methods
    import privfl.run
    import privfl.runs
    import privfl.verify

    # not privfl.train itself: `python -m privfl.train` finds it unimported (runpy warns otherwise)

    for name in methods:
        privfl.methods.resolve_method(name)


def child_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": path}


# ---------------------------------------------------------------------- small file helpers
def rewrite(path: Path, data: bytes) -> None:
    """Replace ``path`` by a new file holding ``data`` (never writes into the old inode: copies are hard links)."""
    if path.is_symlink() or path.exists():
        path.unlink()
    path.write_bytes(data)


def read_lines(store: Path) -> list[bytes]:
    parts = (store / "index.jsonl").read_bytes().split(b"\n")
    return parts[:-1] if parts and parts[-1] == b"" else parts


def write_lines(store: Path, lines: list[bytes], tail: bytes = b"") -> None:
    rewrite(store / "index.jsonl", b"".join(line + b"\n" for line in lines) + tail)


def dump(rec: dict[str, Any]) -> bytes:
    return json.dumps(rec, sort_keys=True).encode()


def records(store: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in read_lines(store)] if (store / "index.jsonl").is_file() else []


def read_json(path: Path) -> Any:
    return json.loads(path.read_bytes())


def write_json(path: Path, obj: Any, indent: int | None = None) -> None:
    rewrite(path, (json.dumps(obj, indent=indent) + "\n").encode())


def move_outside(run: Path, rel: str, outside: Path) -> None:
    """Replace ``run/rel`` (file or folder) by a symlink to an identical copy under ``outside``."""
    src = run / rel
    dst = outside / rel.replace("/", "__")
    outside.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=True)
        shutil.rmtree(src)
    else:
        shutil.copy2(src, dst)
        src.unlink()
    src.symlink_to(dst.resolve())


def tree_state(run: Path) -> dict[str, tuple[int, int, int]]:
    """(mode, size, mtime) of every entry under ``run``, links not followed, ``.lock`` left out."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(run):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if name == ".lock":
                continue
            st = os.lstat(path)
            out[os.path.relpath(path, run)] = (st.st_mode, st.st_size if not stat.S_ISDIR(st.st_mode) else 0, st.st_mtime_ns)
    return out


def tree_digest(run: Path) -> str:
    """A digest of every file's name and bytes (links: their target), ``.lock`` left out."""
    digest = hashlib.sha256()
    for rel in sorted(tree_state(run)):
        path = run / rel
        digest.update(rel.encode() + b"\0")
        if path.is_symlink():
            digest.update(b"link:" + os.readlink(path).encode())
        elif path.is_file():
            digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


# ---------------------------------------------------------------------- damage kinds
@dataclass
class Ctx:
    """What a damage function may use: the original run (read only), the other base runs, an outside folder."""

    base: Path
    others: list[Path]
    outside: Path
    donor: Path | None = None  # the uninterrupted run of the same config (for a killed run)

    @property
    def num_clients(self) -> int:
        return len(read_json(self.base / "run.json")["archs"])


Apply = Callable[[Path, str, Ctx], "str | None"]


@dataclass
class Damage:
    group: str
    kind: str
    scope: str  # "index" (store@position), "store" (a store), "run" (the named targets)
    apply: Apply
    targets: tuple[str, ...] = ()
    stores: tuple[str, ...] = STORES
    positions: tuple[str, ...] = POSITIONS
    resume: bool = False  # apply to the killed run for the --resume checks


def pos_index(recs: list[dict[str, Any]], pos: str) -> int | None:
    n = len(recs)
    if not n:
        return None
    if pos == "first":
        return 0
    if pos == "middle":
        return n // 2
    if pos == "last":
        return n - 1
    if pos == "truth-msg":
        return next((i for i, r in enumerate(recs) if r.get("truth")), None)
    raise ValueError(pos)


def split_target(target: str) -> tuple[str, str]:
    store, _, pos = target.partition("@")
    return store, pos


# -- index: whole lines
def _line_op(op: Callable[[list[bytes], int], list[bytes] | None]) -> Apply:
    def apply(run: Path, target: str, ctx: Ctx) -> str | None:
        store, pos = split_target(target)
        lines = read_lines(run / store)
        i = pos_index([{}] * len(lines), pos)
        if i is None:
            return None
        new = op(list(lines), i)
        if new is None:
            return None
        write_lines(run / store, new)
        return f"record {i} of {len(lines)}"

    return apply


def _drop(lines: list[bytes], i: int) -> list[bytes]:
    return lines[:i] + lines[i + 1 :]


def _duplicate(lines: list[bytes], i: int) -> list[bytes]:
    return [*lines[: i + 1], lines[i], *lines[i + 1 :]]


def _swap_lines(lines: list[bytes], i: int) -> list[bytes] | None:
    if len(lines) < 2:
        return None
    j = i + 1 if i + 1 < len(lines) else i - 1
    lines[i], lines[j] = lines[j], lines[i]
    return lines


# -- index: one record's fields
Editor = Callable[[dict[str, Any], Ctx, str], bool]


def _rec_op(edit: Editor) -> Apply:
    def apply(run: Path, target: str, ctx: Ctx) -> str | None:
        store, pos = split_target(target)
        lines = read_lines(run / store)
        recs = [json.loads(line) for line in lines]
        i = pos_index(recs, pos)
        if i is None:
            return None
        before = dict(recs[i])
        if not edit(recs[i], ctx, store):
            return None
        lines[i] = dump(recs[i])
        write_lines(run / store, lines)
        changed = {k: (before.get(k), recs[i].get(k)) for k in set(before) | set(recs[i]) if before.get(k) != recs[i].get(k)}
        return f"record {i}: " + "; ".join(f"{k} {str(a)[:40]} -> {str(b)[:40]}" for k, (a, b) in sorted(changed.items()))

    return apply


def _parties(ctx: Ctx) -> list[str]:
    return ["server", *(f"client{k}" for k in range(ctx.num_clients))]


def edit_round(rec: dict[str, Any], ctx: Ctx, store: str) -> bool:
    rec["round"] = rec["round"] + 1 if rec["round"] == 0 else rec["round"] - 1
    return True


def edit_sender(rec: dict[str, Any], ctx: Ctx, store: str) -> bool:
    key = "sender" if store == "capture" else "client"
    taken = {rec.get("sender"), rec.get("receiver"), rec.get("client")}
    choices = [p for p in _parties(ctx) if p not in taken and (store == "capture" or p != "server")]
    if not choices:
        return False
    rec[key] = choices[0]
    return True


def edit_receiver(rec: dict[str, Any], ctx: Ctx, store: str) -> bool:
    if store != "capture":
        return False
    choices = [p for p in _parties(ctx) if p not in (rec["sender"], rec["receiver"])]
    rec["receiver"] = choices[0]
    return True


def edit_kind(rec: dict[str, Any], ctx: Ctx, store: str) -> bool:
    from privfl.kinds import KINDS

    sends = list(read_json(ctx.base / "run.json").get("sends", {}))
    choices = [k for k in [*sends, *KINDS.names()] if k != rec["kind"]]
    rec["kind"] = choices[0]
    return True


def edit_direction(rec: dict[str, Any], ctx: Ctx, store: str) -> bool:
    if store != "capture":
        return False
    rec["direction"] = {"up": "down", "down": "up", "peer": "up"}.get(rec["direction"], "up")
    return True


def edit_scalars(rec: dict[str, Any], ctx: Ctx, store: str) -> bool:
    if store != "capture":
        return False
    rec["scalars"] += 1
    return True


def edit_bytes(rec: dict[str, Any], ctx: Ctx, store: str) -> bool:
    if store != "capture":
        return False
    rec["bytes"] += 4
    return True


def edit_meta(rec: dict[str, Any], ctx: Ctx, store: str) -> bool:
    if store == "capture":
        meta = rec["meta"]
        if "num_samples" in meta:
            meta["num_samples"] += 1
        elif meta.get("phase") in ("setup", "train"):
            meta["phase"] = "train" if meta["phase"] == "setup" else "setup"
        else:
            meta["note"] = "tampered"
        return True
    if store == "knowledge" and isinstance(rec.get("spec"), dict):
        rec["spec"]["rep_dim"] = int(rec["spec"].get("rep_dim", 0)) + 1
        return True
    return False


def edit_shape(rec: dict[str, Any], ctx: Ctx, store: str) -> bool:
    if not rec["tensors"]:
        return False
    info = rec["tensors"][sorted(rec["tensors"])[0]]
    info["shape"] = [*info["shape"][:-1], info["shape"][-1] + 1] if info["shape"] else [1]
    return True


def edit_aux(rec: dict[str, Any], ctx: Ctx, store: str) -> bool:
    if store != "capture" or not rec["tensors"]:
        return False
    rec["aux"] = [] if rec["aux"] else [sorted(rec["tensors"])[0]]
    return True


def edit_renumber(rec: dict[str, Any], ctx: Ctx, store: str) -> bool:
    rec["seq"] += 100
    return True


def edit_message_seq(rec: dict[str, Any], ctx: Ctx, store: str) -> bool:
    if store != "truth":
        return False
    rec["message_seq"] = 0 if rec["message_seq"] != 0 else 1
    return True


def swap_sha256(run: Path, target: str, ctx: Ctx) -> str | None:
    store, pos = split_target(target)
    lines = read_lines(run / store)
    recs = [json.loads(line) for line in lines]
    i = pos_index(recs, pos)
    if i is None:
        return None
    order = [*range(i + 1, len(recs)), *range(i - 1, -1, -1)]
    j = next((j for j in order if recs[j]["sha256"] != recs[i]["sha256"]), None)
    if j is None:
        return None
    recs[i]["sha256"], recs[j]["sha256"] = recs[j]["sha256"], recs[i]["sha256"]
    lines[i], lines[j] = dump(recs[i]), dump(recs[j])
    write_lines(run / store, lines)
    same = recs[i]["tensors"] == recs[j]["tensors"]
    return f"records {i} and {j} ({'same' if same else 'different'} tensor shapes)"


def foreign_record(run: Path, target: str, ctx: Ctx) -> str | None:
    store, pos = split_target(target)
    lines = read_lines(run / store)
    i = pos_index([{}] * len(lines), pos)
    if i is None:
        return None
    for other in ctx.others:
        theirs = read_lines(other / store) if (other / store / "index.jsonl").is_file() else []
        if i < len(theirs) and theirs[i] != lines[i]:
            lines[i] = theirs[i]
            write_lines(run / store, lines)
            return f"record {i} from {other.name}"
    return None


# -- index: position-less
def append_last(run: Path, target: str, ctx: Ctx) -> str | None:
    lines = read_lines(run / target)
    if not lines:
        return None
    write_lines(run / target, [*lines, lines[-1]])
    return f"{len(lines)} -> {len(lines) + 1} lines"


def truncate_half(run: Path, target: str, ctx: Ctx) -> str | None:
    lines = read_lines(run / target)
    if len(lines) < 2:
        return None
    write_lines(run / target, lines[: len(lines) // 2])
    return f"{len(lines)} -> {len(lines) // 2} lines"


def empty_index(run: Path, target: str, ctx: Ctx) -> str | None:
    lines = read_lines(run / target)
    if not lines:
        return None
    write_lines(run / target, [])
    return f"{len(lines)} -> 0 lines"


def garbage_middle(run: Path, target: str, ctx: Ctx) -> str | None:
    lines = read_lines(run / target)
    i = len(lines) // 2
    write_lines(run / target, [*lines[:i], b"this is not a record {", *lines[i:]])
    return f"garbage before line {i + 1}"


def partial_tail(run: Path, target: str, ctx: Ctx) -> str | None:
    """The first half of the record that would have come next (from the uninterrupted run when there is one)."""
    lines = read_lines(run / target)
    donors = [ctx.donor] if ctx.donor else []
    line = None
    for donor in [*donors, ctx.base, *ctx.others]:
        theirs = read_lines(donor / target) if (donor / target / "index.jsonl").is_file() else []
        if len(theirs) > len(lines):
            line = theirs[len(lines)]
            break
    if line is None:
        line = lines[-1] if lines else b'{"client": "client0", "kind": "extractor", "round": 0, "seq": 0}'
    write_lines(run / target, lines, tail=line[: len(line) // 2])
    return f"half a line ({len(line) // 2} bytes) after {len(lines)} records"


def stray_temp(run: Path, target: str, ctx: Ctx) -> str | None:
    """What a kill between an atomic write and its rename leaves: ``.NAME.XXXXXXXX.tmp`` holding part of the file."""
    if target == "checkpoint":
        info = read_json(run / "checkpoint" / "checkpoint.json") if (run / "checkpoint" / "checkpoint.json").is_file() else {"round": -1}
        name = f"state-r{info['round'] + 1:05d}.safetensors"
        path = run / "checkpoint" / f".{name}.tmp"  # the engine's own temporary name for a checkpoint
        src = next((run / "checkpoint").glob("state-r*.safetensors"), None)
        data = src.read_bytes()[:4096] if src else b"\0" * 4096
    else:
        donor = ctx.donor or ctx.base
        ours = {r["sha256"] for r in records(run / target)}
        theirs = [r["sha256"] for r in records(donor / target) if r["sha256"] not in ours]
        sha = theirs[0] if theirs else hashlib.sha256(b"privfl damage_verify").hexdigest()
        src = donor / target / "blobs" / sha[:2] / f"{sha}.safetensors"
        data = src.read_bytes()[: max(1, src.stat().st_size // 2)] if src.is_file() else b"\0" * 4096
        path = run / target / "blobs" / sha[:2] / f".{sha}.safetensors.k3x9q_2a.tmp"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return f"{path.relative_to(run)} ({len(data)} bytes)"


# -- head
def _head_op(op: Callable[[dict[str, Any]], bool]) -> Apply:
    def apply(run: Path, target: str, ctx: Ctx) -> str | None:
        path = run / target / "head.json"
        head = read_json(path)
        before = dict(head)
        if not op(head):
            return None
        write_json(path, head)
        return f"{before} -> {head}"

    return apply


def head_delete(run: Path, target: str, ctx: Ctx) -> str | None:
    (run / target / "head.json").unlink()
    return "deleted"


def _count_up(head: dict[str, Any]) -> bool:
    head["records"] += 1
    return True


def _count_down(head: dict[str, Any]) -> bool:
    if head["records"] < 1:
        return False
    head["records"] -= 1
    return True


def _chain_edit(head: dict[str, Any]) -> bool:
    head["chain"] = head["chain"][:-1] + ("0" if head["chain"][-1] != "0" else "1")
    return True


# -- blobs
def _blob_op(op: Callable[[Path, Ctx], str]) -> Apply:
    def apply(run: Path, target: str, ctx: Ctx) -> str | None:
        store, pos = split_target(target)
        recs = records(run / store)
        i = pos_index(recs, pos)
        if i is None:
            return None
        sha = recs[i]["sha256"]
        return f"blob of record {i} ({sha[:8]}): " + op(run / store / "blobs" / sha[:2] / f"{sha}.safetensors", ctx)

    return apply


def blob_flip(path: Path, ctx: Ctx) -> str:
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    at = header + (len(data) - header) // 2
    data[at] ^= 0xFF
    rewrite(path, bytes(data))
    return f"byte {at} of {len(data)} flipped"


def blob_truncate(path: Path, ctx: Ctx) -> str:
    data = path.read_bytes()
    rewrite(path, data[: len(data) // 2])
    return f"{len(data)} -> {len(data) // 2} bytes"


def blob_delete(path: Path, ctx: Ctx) -> str:
    path.unlink()
    return "deleted"


def blob_other_values(path: Path, ctx: Ctx) -> str:
    import torch
    from safetensors.torch import load, save

    tensors = load(path.read_bytes())
    changed = {k: (v + 1 if v.dtype != torch.bool else ~v) for k, v in sorted(tensors.items())}
    data = save(changed)
    rewrite(path, data)
    return f"same tensors, values + 1 ({len(data)} bytes)"


def blob_symlink(path: Path, ctx: Ctx) -> str:
    run_rel = path.relative_to(path.parents[3])
    move_outside(path.parents[3], str(run_rel), ctx.outside)
    return "symlink to an identical copy outside"


def blob_dir_symlink(path: Path, ctx: Ctx) -> str:
    run = path.parents[3]
    move_outside(run, str(path.parent.relative_to(run)), ctx.outside)
    return f"folder {path.parent.name} is a symlink to an identical copy outside"


# -- stores
def store_delete(run: Path, target: str, ctx: Ctx) -> str | None:
    shutil.rmtree(run / target)
    return "deleted"


def manifest_delete(run: Path, target: str, ctx: Ctx) -> str | None:
    (run / target / "manifest.json").unlink()
    return "deleted"


def store_symlink(run: Path, target: str, ctx: Ctx) -> str | None:
    move_outside(run, target, ctx.outside)
    return "symlink to an identical copy outside"


# -- run files
def run_file(run: Path, target: str) -> str | None:
    """``target`` inside ``run`` (``checkpoint/STATE``: the state file the pointer names), None if absent."""
    if target == "checkpoint/STATE":
        target = f"checkpoint/{read_json(run / 'checkpoint' / 'checkpoint.json')['file']}"
    return target if (run / target).is_file() else None


def file_symlink(run: Path, target: str, ctx: Ctx) -> str | None:
    found = run_file(run, target)
    if found is None:
        return None
    move_outside(run, found, ctx.outside)
    return "symlink to an identical copy outside"


def file_delete(run: Path, target: str, ctx: Ctx) -> str | None:
    found = run_file(run, target)
    if found is None:
        return None
    (run / found).unlink()
    return f"{found} deleted"


def _partition_op(op: Callable[[dict[str, Any]], str | None]) -> Apply:
    def apply(run: Path, target: str, ctx: Ctx) -> str | None:
        from safetensors.torch import load, save

        path = run / "truth" / "partition.safetensors"
        part = dict(load(path.read_bytes()))
        what = op(part)
        if what is None:
            return None
        rewrite(path, save({k: v.contiguous() for k, v in part.items()}))
        return what

    return apply


def part_swap_train(part: dict[str, Any]) -> str | None:
    part["train_0"], part["train_1"] = part["train_1"], part["train_0"]
    return f"train_0 ({part['train_1'].numel()} samples) <-> train_1 ({part['train_0'].numel()} samples)"


def part_exchange_one(part: dict[str, Any]) -> str | None:
    a, b = part["train_0"].clone(), part["train_1"].clone()
    a[0], b[0] = part["train_1"][0], part["train_0"][0]
    part["train_0"], part["train_1"] = a, b
    return "train_0[0] <-> train_1[0] (sizes kept)"


def part_duplicate_sample(part: dict[str, Any]) -> str | None:
    b = part["train_1"].clone()
    b[0] = part["train_0"][0]
    part["train_1"] = b
    return "train_1[0] = train_0[0] (one sample in two clients' splits, sizes kept)"


def part_subset(part: dict[str, Any]) -> str | None:
    if "subset" not in part:
        return None
    s = part["subset"].clone()
    s[-1] += 1
    part["subset"] = s
    return "the last index of the subsample + 1"


def metrics_op(op: Callable[[list[dict[str, Any]]], str | None]) -> Apply:
    def apply(run: Path, target: str, ctx: Ctx) -> str | None:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_bytes().splitlines() if line.strip()]
        what = op(rows)
        if what is None:
            return None
        rewrite(run / "metrics.jsonl", b"".join(json.dumps(r, sort_keys=True).encode() + b"\n" for r in rows))
        return what

    return apply


def metrics_drop_round(run: Path, target: str, ctx: Ctx) -> str | None:
    which = 0 if target.endswith("first") else -1
    return metrics_op(lambda rows: f"round {rows.pop(which)['round']} dropped" if rows else None)(run, target, ctx)


def _comm_edit(rows: list[dict[str, Any]]) -> str | None:
    comm = rows[0].get("comm")
    if not comm:
        return None
    key = sorted(comm)[0]
    comm[key]["messages"] += 1
    return f"round 0 comm[{key!r}].messages + 1"


def metrics_fifo(run: Path, target: str, ctx: Ctx) -> str | None:
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    return "metrics.jsonl is a FIFO"


def config_rounds(run: Path, target: str, ctx: Ctx) -> str | None:
    cfg = read_json(run / "config.json")
    new = cfg["rounds"] + (1 if target.endswith("up") else -1)
    if new < 1:
        return None
    detail = f"rounds {cfg['rounds']} -> {new}"
    cfg["rounds"] = new
    write_json(run / "config.json", cfg, indent=2)
    return detail


def config_lr(run: Path, target: str, ctx: Ctx) -> str | None:
    cfg = read_json(run / "config.json")
    cfg["lr"] = cfg["lr"] * 2
    write_json(run / "config.json", cfg, indent=2)
    return f"lr doubled to {cfg['lr']}"


def runjson_drop_kind(run: Path, target: str, ctx: Ctx) -> str | None:
    info = read_json(run / "run.json")
    sent = [r["kind"] for r in records(run / "capture")]
    if not sent:
        return None
    del info["sends"][sent[-1]]
    write_json(run / "run.json", info, indent=2)
    return f"sends without {sent[-1]!r}"


def checkpoint_flip(run: Path, target: str, ctx: Ctx) -> str | None:
    info = read_json(run / "checkpoint" / "checkpoint.json")
    path = run / "checkpoint" / info["file"]
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    at = header + (len(data) - header) // 2
    data[at] ^= 0x40
    rewrite(path, bytes(data))
    return f"{info['file']}: byte {at} (tensor data) changed; still valid safetensors"


def summary_edit(run: Path, target: str, ctx: Ctx) -> str | None:
    if not (run / "summary.json").is_file():
        return None
    s = read_json(run / "summary.json")
    s["final_acc"] = 0.99
    write_json(run / "summary.json", s, indent=2)
    return "final_acc -> 0.99"


def text_edit(rel: str, old: bytes, new: bytes) -> Apply:
    def apply(run: Path, target: str, ctx: Ctx) -> str | None:
        path = run / rel
        if not path.is_file():
            return None
        data = path.read_bytes()
        if old not in data:
            return None
        rewrite(path, data.replace(old, new, 1))
        return f"{rel}: first {old.decode()!r} -> {new.decode()!r}"

    return apply


def metrics_csv_edit(run: Path, target: str, ctx: Ctx) -> str | None:
    path = run / "metrics.csv"
    if not path.is_file():
        return None
    lines = path.read_bytes().splitlines(keepends=True)
    if len(lines) < 2:
        return None
    lines[1] = lines[1].replace(b"0.", b"0.9", 1)
    rewrite(path, b"".join(lines))
    return "metrics.csv row 1: first '0.' -> '0.9'"


def partition_json_counts(run: Path, target: str, ctx: Ctx) -> str | None:
    info = read_json(run / "partition.json")
    counts = info["counts"]
    row = counts[0]
    j = max(range(len(row)), key=lambda c: row[c])
    k = (j + 1) % len(row)
    row[j], row[k] = row[j] - 1, row[k] + 1
    write_json(run / "partition.json", info)
    return f"client 0: one sample moved from class {j} to class {k} (sizes kept)"


def history_and_metrics_acc(run: Path, target: str, ctx: Ctx) -> str | None:
    metrics_op(lambda rows: rows[0].update(acc=0.99) or "")(run, target, ctx)
    info = read_json(run / "checkpoint" / "checkpoint.json")
    info["history"][0]["acc"] = 0.99
    write_json(run / "checkpoint" / "checkpoint.json", info)
    return "round 0 acc -> 0.99 in metrics.jsonl and in the checkpoint history alike"


# -- rechained (an adversary who fixes seq, chain and head)
def rechain(store: Path, recs: list[dict[str, Any]], renumber: bool = True, commit: bool = True) -> None:
    from privfl.capture.store import chain_next, genesis

    role = read_json(store / "manifest.json")["role"]
    chain = genesis(role)
    for i, rec in enumerate(recs):
        if renumber:
            rec["seq"] = i
        rec.pop("chain", None)
        chain = chain_next(chain, rec)
        rec["chain"] = chain
    write_lines(store, [dump(r) for r in recs])
    if commit:
        write_json(store / "head.json", {"records": len(recs), "chain": chain})


def _rechained(op: Callable[[list[dict[str, Any]], int, Ctx, str], str | None], commit: bool = True) -> Apply:
    def apply(run: Path, target: str, ctx: Ctx) -> str | None:
        store, pos = split_target(target)
        recs = records(run / store)
        i = pos_index(recs, pos)
        if i is None:
            return None
        what = op(recs, i, ctx, store)
        if what is None:
            return None
        rechain(run / store, recs, commit=commit)
        return what + " (seq, chain" + (" and head" if commit else "") + " recomputed)"

    return apply


def _rc_edit(edit: Editor) -> Callable[[list[dict[str, Any]], int, Ctx, str], str | None]:
    def op(recs: list[dict[str, Any]], i: int, ctx: Ctx, store: str) -> str | None:
        before = json.dumps(recs[i], sort_keys=True)
        if not edit(recs[i], ctx, store):
            return None
        after = recs[i]
        old = json.loads(before)
        changed = [f"{k} {str(old.get(k))[:30]} -> {str(after.get(k))[:30]}" for k in sorted(set(old) | set(after)) if old.get(k) != after.get(k)]
        return f"record {i}: " + "; ".join(changed)

    return op


def _rc_drop(recs: list[dict[str, Any]], i: int, ctx: Ctx, store: str) -> str | None:
    recs.pop(i)
    return f"record {i} dropped"


def _rc_duplicate(recs: list[dict[str, Any]], i: int, ctx: Ctx, store: str) -> str | None:
    recs.insert(i + 1, dict(recs[i]))
    return f"record {i} duplicated"


def _rc_swap(recs: list[dict[str, Any]], i: int, ctx: Ctx, store: str) -> str | None:
    if len(recs) < 2:
        return None
    j = i + 1 if i + 1 < len(recs) else i - 1
    recs[i], recs[j] = recs[j], recs[i]
    return f"records {i} and {j} swapped"


def _rc_swap_blob(recs: list[dict[str, Any]], i: int, ctx: Ctx, store: str) -> str | None:
    """Swap the blobs of two records whose tensors have the same names and shapes (the blobs stay valid)."""
    j = next((j for j in range(len(recs)) if j != i and recs[j]["tensors"] == recs[i]["tensors"] and recs[j]["sha256"] != recs[i]["sha256"]), None)
    if j is None:
        return None
    for key in ("sha256", "file_bytes"):
        recs[i][key], recs[j][key] = recs[j][key], recs[i][key]
    return f"blobs of records {i} and {j} swapped (same shapes)"


def _rc_append_copy(recs: list[dict[str, Any]], i: int, ctx: Ctx, store: str) -> str | None:
    recs.append(dict(recs[-1]))
    return "a copy of the last record appended"


# ---------------------------------------------------------------------- the catalogue
def catalogue() -> list[Damage]:
    d: list[Damage] = []

    def idx(kind: str, apply: Apply, stores: tuple[str, ...] = STORES) -> None:
        d.append(Damage("index", kind, "index", apply, stores=stores, resume=True))

    idx("drop a record", _line_op(_drop))
    idx("duplicate a record", _line_op(_duplicate))
    idx("swap two lines", _line_op(_swap_lines))
    idx("renumber a seq", _rec_op(edit_renumber))
    idx("swap sha256 of two records", swap_sha256)
    idx("edit round", _rec_op(edit_round))
    idx("edit sender/client", _rec_op(edit_sender))
    idx("edit receiver", _rec_op(edit_receiver), ("capture",))
    idx("edit kind", _rec_op(edit_kind))
    idx("edit direction", _rec_op(edit_direction), ("capture",))
    idx("edit scalars", _rec_op(edit_scalars), ("capture",))
    idx("edit bytes", _rec_op(edit_bytes), ("capture",))
    idx("edit meta (knowledge: spec)", _rec_op(edit_meta), ("capture", "knowledge"))
    idx("edit tensor shape", _rec_op(edit_shape))
    idx("edit aux", _rec_op(edit_aux), ("capture",))
    idx("record from another run", foreign_record)
    for kind, fn in (
        ("append a copy of the last record", append_last),
        ("truncate to the first half", truncate_half),
        ("empty the index", empty_index),
        ("garbage line in the middle", garbage_middle),
    ):
        d.append(Damage("index", kind, "store", fn, resume=True))
    d.append(Damage("killed", "partial last line", "store", partial_tail))
    d.append(Damage("killed", "stray temporary file of a cut-short write", "run", stray_temp, targets=(*STORES, "checkpoint")))
    d.append(Damage("head", "delete head.json", "store", head_delete, resume=True))
    d.append(Damage("head", "head count + 1", "store", _head_op(_count_up), resume=True))
    d.append(Damage("head", "head count - 1", "store", _head_op(_count_down), resume=True))
    d.append(Damage("head", "head chain edited", "store", _head_op(_chain_edit), resume=True))
    for kind, op in (
        ("flip a byte", blob_flip),
        ("truncate", blob_truncate),
        ("delete", blob_delete),
        ("same tensors, other values", blob_other_values),
        ("symlink to an outside copy", blob_symlink),
        ("blobs/aa folder a symlink", blob_dir_symlink),
    ):
        d.append(Damage("blob", kind, "index", _blob_op(op)))
    d.append(Damage("store", "delete the store folder", "store", store_delete))
    d.append(Damage("store", "delete manifest.json", "store", manifest_delete))
    d.append(Damage("store", "store folder a symlink to an outside copy", "store", store_symlink))
    files = ("config.json", "run.json", "metrics.jsonl", "checkpoint/checkpoint.json", "truth/partition.safetensors")
    d.append(Damage("file", "symlink to an identical outside copy", "run", file_symlink, targets=files))
    d.append(Damage("file", "delete partition.safetensors", "run", file_delete, targets=("truth/partition.safetensors",)))
    d.append(Damage("file", "swap two clients' train splits", "run", _partition_op(part_swap_train), targets=("truth/partition.safetensors",)))
    d.append(Damage("file", "drop a round from metrics.jsonl", "run", metrics_drop_round, targets=("metrics.jsonl@first", "metrics.jsonl@last")))
    d.append(Damage("file", "change a round's comm counts", "run", metrics_op(_comm_edit), targets=("metrics.jsonl",)))
    d.append(Damage("file", "edit config.json rounds", "run", config_rounds, targets=("config.json@up", "config.json@down")))
    d.append(Damage("file", "drop a kind from run.json sends", "run", runjson_drop_kind, targets=("run.json",)))
    d.append(Damage("file", "delete the checkpoint state file", "run", file_delete, targets=("checkpoint/STATE",)))
    d.append(Damage("file", "FIFO in place of metrics.jsonl", "run", metrics_fifo, targets=("metrics.jsonl",)))
    d.append(Damage("truth", "message_seq -> another message", "index", _rec_op(edit_message_seq), stores=("truth",), resume=True))
    # beyond the brief
    more = ("summary.json", "partition.json", "checkpoint/STATE", "config.toml", "metrics.csv")
    d.append(Damage("extra", "symlink to an identical outside copy (more files)", "run", file_symlink, targets=more))
    d.append(
        Damage(
            "extra",
            "delete a run file",
            "run",
            file_delete,
            targets=("config.json", "run.json", "metrics.jsonl", "checkpoint/checkpoint.json", *more),
        )
    )
    d.append(Damage("extra", "checkpoint weights changed (valid file)", "run", checkpoint_flip, targets=("checkpoint/STATE",)))
    d.append(Damage("extra", "summary.json final_acc edited", "run", summary_edit, targets=("summary.json",)))
    d.append(Damage("extra", "metrics.csv value edited", "run", metrics_csv_edit, targets=("metrics.csv",)))
    d.append(Damage("extra", "config.toml lr edited", "run", text_edit("config.toml", b"lr = ", b"lr = 9"), targets=("config.toml",)))
    d.append(Damage("extra", "config.json lr doubled", "run", config_lr, targets=("config.json",)))
    d.append(Damage("extra", "partition.json class counts edited", "run", partition_json_counts, targets=("partition.json",)))
    d.append(
        Damage("extra", "exchange one sample between train splits", "run", _partition_op(part_exchange_one), targets=("truth/partition.safetensors",))
    )
    d.append(
        Damage("extra", "one sample in two clients' splits", "run", _partition_op(part_duplicate_sample), targets=("truth/partition.safetensors",))
    )
    d.append(Damage("extra", "partition subsample changed", "run", _partition_op(part_subset), targets=("truth/partition.safetensors",)))
    d.append(Damage("extra", "acc edited in metrics and checkpoint alike", "run", history_and_metrics_acc, targets=("metrics.jsonl",)))
    # an adversary who recomputes the chain: only the meaning checks can see these
    rc_pos = ("first", "middle", "last", "truth-msg")

    def rc(
        kind: str,
        op: Callable[[list[dict[str, Any]], int, Ctx, str], str | None],
        stores: tuple[str, ...] = STORES,
        commit: bool = True,
        positions: tuple[str, ...] = rc_pos,
    ) -> None:
        d.append(Damage("rechained", kind, "index", _rechained(op, commit), stores=stores, positions=positions))

    rc("edit round", _rc_edit(edit_round))
    rc("edit sender/client", _rc_edit(edit_sender))
    rc("edit receiver", _rc_edit(edit_receiver), ("capture",))
    rc("edit kind", _rc_edit(edit_kind))
    rc("edit direction", _rc_edit(edit_direction), ("capture",))
    rc("edit scalars", _rc_edit(edit_scalars), ("capture",))
    rc("edit bytes", _rc_edit(edit_bytes), ("capture",))
    rc("edit meta (knowledge: spec)", _rc_edit(edit_meta), ("capture", "knowledge"))
    rc("edit aux", _rc_edit(edit_aux), ("capture",))
    rc("drop a record", _rc_drop)
    rc("duplicate a record", _rc_duplicate)
    rc("swap two records", _rc_swap)
    rc("swap the blobs of two same-shape records", _rc_swap_blob)
    rc("message_seq -> another message", _rc_edit(edit_message_seq), ("truth",))
    rc("append a copy of the last record, committed", _rc_append_copy, positions=("last",))
    rc("append a copy of the last record, uncommitted", _rc_append_copy, commit=False, positions=("last",))
    return d


def targets_for(dmg: Damage, base: Path) -> list[str]:
    if dmg.scope == "run":
        return list(dmg.targets)
    stores = [s for s in dmg.stores if (base / s / "index.jsonl").is_file()]
    if dmg.scope == "store":
        return stores
    out = []
    for store in stores:
        recs = records(base / store)
        seen: set[Any] = set()
        for pos in dmg.positions:
            i = pos_index(recs, pos)
            if i is None:
                continue
            key = recs[i]["sha256"] if dmg.group == "blob" else i
            if key in seen:
                continue
            seen.add(key)
            out.append(f"{store}@{pos}")
    return out


# ---------------------------------------------------------------------- running verify
class _Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Hang()


def verify_inprocess(run: Path, timeout: float) -> tuple[str, str, list[str]]:
    """(status, first problem line, report lines): status caught / missed / hang / crash."""
    from privfl.verify import verify_run

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        report = verify_run(run)
    except _Hang:
        return "hang", f"verify did not return within {timeout:g} s", []
    except Exception as exc:
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
        return "crash", f"{type(exc).__name__}: {str(exc)[:200]} (at {tb[-2].strip().splitlines()[0][:120]})", tb
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    first = next((p for area in ("files", "capture", "truth", "knowledge", "meaning") for p in report.problems.get(area, [])), "")
    return ("caught" if not report.ok else "missed"), first, report.lines()


@dataclass
class Proc:
    rc: int | None  # None: timed out
    seconds: float
    stdout: str
    stderr: str


def run_proc(cmd: list[str], timeout: float, cwd: Path = ROOT) -> Proc:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=cwd, check=False)
        return Proc(p.returncode, time.perf_counter() - t0, p.stdout, p.stderr)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return Proc(None, time.perf_counter() - t0, out, err)


def run_module_forked(module: str, argv: list[str], timeout: float) -> Proc:
    """Run ``python -m module argv`` in a forked child of this (already imported) process: the module is
    executed as ``__main__`` by runpy exactly as ``-m`` does; an exception that escapes prints its
    traceback and exits 1, as the interpreter would."""
    t0 = time.perf_counter()
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = Path(tmp) / "out", Path(tmp) / "err"
        pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT)
                err_fd = os.open(err_path, os.O_WRONLY | os.O_CREAT)
                os.dup2(out_fd, 1)
                os.dup2(err_fd, 2)
                sys.argv = [module, *argv]
                try:
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                    code = 0
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                    if not isinstance(exc.code, int | None):
                        print(exc.code, file=sys.stderr)
                except BaseException:
                    traceback.print_exc()
                    code = 1
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + timeout
        status: int | None = None
        while True:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(st)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.05)
        return Proc(status, time.perf_counter() - t0, out_path.read_text(errors="replace"), err_path.read_text(errors="replace"))


def cli_verify(run: Path, timeout: float) -> dict[str, Any]:
    p = run_proc([sys.executable, "-m", "privfl.capture", "verify", "--run", str(run)], timeout)
    return {
        "rc": p.rc,
        "seconds": round(p.seconds, 1),
        "traceback": "Traceback" in p.stderr,
        "first": next(
            (ln.strip() for ln in p.stdout.splitlines() if ln.startswith("  ")), p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
        ),
    }


# ---------------------------------------------------------------------- cases
@dataclass
class Case:
    group: str
    kind: str
    run: str
    target: str
    detail: str = ""
    status: str = ""  # caught / missed / hang / crash
    first: str = ""
    seconds: float = 0.0
    verify_wrote: bool = False
    cli: dict[str, Any] | None = None
    kept: str = ""


def claim_work_folder(folder: Path, by: str) -> bool:
    """This script deletes and replaces what is inside its work folder, so the folder must be new, empty,
    or one an earlier run of it made (it carries privfl's output marker): never a user's folder."""
    from privfl.runs import is_privfl_output, mark_output

    if folder.exists() and any(folder.iterdir()) and not is_privfl_output(folder):
        print(f"{folder} exists and was not made by {by}: give a new --work folder", file=sys.stderr)
        return False
    folder.mkdir(parents=True, exist_ok=True)
    mark_output(folder, by)
    return True


@contextlib.contextmanager
def case_dir(work: Path) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="case-", dir=work))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def copy_run(src: Path, dst: Path, hardlink: bool) -> None:
    shutil.copytree(src, dst, symlinks=True, copy_function=os.link if hardlink else shutil.copy2)


def short(text: str, run: Path, width: int = 110) -> str:
    text = text.replace(str(run.resolve()), "RUN").replace(str(run), "RUN")
    return text if len(text) <= width else text[: width - 3] + "..."


def run_case(dmg: Damage, base: Path, target: str, ctx: Ctx, args: argparse.Namespace, cli: bool) -> Case | None:
    case = Case(dmg.group, dmg.kind, base.name, target)
    with case_dir(args.work_dir) as tmp:
        run = tmp / base.name
        copy_run(base, run, hardlink=True)
        ctx.outside = tmp / "outside"
        detail = dmg.apply(run, target, ctx)
        if detail is None:
            return None
        case.detail = detail
        before = tree_state(run)
        t0 = time.perf_counter()
        case.status, first, _lines = verify_inprocess(run, args.timeout)
        case.seconds = round(time.perf_counter() - t0, 2)
        case.first = short(first, run)
        case.verify_wrote = tree_state(run) != before
        if cli:
            case.cli = cli_verify(run, args.timeout + 60)
            case.cli["first"] = short(case.cli["first"], run)
        if case.status != "caught":
            missed = args.work_dir / "missed"
            missed.mkdir(exist_ok=True)
            keep = missed / f"{len(list(missed.iterdir())):03d}-{base.name}-{dmg.group}"
            if (run / "metrics.jsonl").is_fifo():  # copying a FIFO would block
                (run / "metrics.jsonl").unlink()
                (run / "metrics.jsonl.WAS-A-FIFO").touch()
            shutil.copytree(tmp, keep, symlinks=True)
            (keep / "CASE.json").write_text(json.dumps(asdict(case), indent=1) + "\n")
            case.kept = str(keep)
    return case


# ---------------------------------------------------------------------- base and killed runs
def train_base(name: str, argv: list[str], out_dir: Path, reuse: bool) -> Path:
    run = out_dir / name
    if reuse and (run / "summary.json").is_file():
        print(f"reusing base run {run}", flush=True)
        return run
    if run.exists():
        shutil.rmtree(run)
    cmd = [sys.executable, "-m", "privfl.train", *argv, *TRAIN_FLAGS, "--out-dir", str(out_dir), "--run-name", name]
    print(f"training {name}: {' '.join(cmd[1:])}", flush=True)
    p = run_proc(cmd, 900)
    if p.rc != 0:
        raise SystemExit(f"training {name} failed (rc {p.rc}):\n{p.stderr[-3000:]}")
    print(f"  {p.seconds:.0f} s", flush=True)
    return run


def child_kill_main(config_path: str) -> int:
    """``--child-kill CONFIG.json``: train that config and SIGKILL this process at the end of round 0."""
    import torch

    from privfl.config import build_config
    from privfl.engine import TrainCallback
    from privfl.methods import resolve_method
    from privfl.train import train_config as train

    torch.set_num_threads(1)
    values = json.loads(Path(config_path).read_text())

    class KillAfterRound0(TrainCallback):
        def on_round_end(self, rnd: int, entry: dict[str, Any]) -> None:
            if rnd == 0:
                os.kill(os.getpid(), signal.SIGKILL)

    cfg = build_config(values, resolve_method(values["method"]).Options)
    train(cfg, callbacks=[KillAfterRound0()])
    return 0


def train_killed(base: Path, out_dir: Path, reuse: bool) -> Path:
    name = f"killed-{base.name}"
    run = out_dir / name
    if reuse and (run / "checkpoint" / "checkpoint.json").is_file() and not (run / "summary.json").exists():
        print(f"reusing killed run {run}", flush=True)
        return run
    if run.exists():
        shutil.rmtree(run)
    out_dir.mkdir(parents=True, exist_ok=True)
    values = read_json(base / "config.json")
    values.update(out_dir=str(out_dir), run_name=name, progress=False)
    if values.get("rounds", 0) < 2:
        raise SystemExit(f"{base}: --resume needs a base run of at least 2 rounds")
    cfg_path = out_dir / f"{name}.config.json"
    cfg_path.write_text(json.dumps(values))
    print(f"training {name} (SIGKILL at the end of round 0)", flush=True)
    p = run_proc([sys.executable, "-m", "experiments.robustness.damage_verify", "--child-kill", str(cfg_path)], 900)
    if p.rc != -signal.SIGKILL:
        raise SystemExit(f"the killed run {name} ended with rc {p.rc}, not SIGKILL:\n{p.stderr[-3000:]}")
    metrics = [line for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    print(f"  killed after {p.seconds:.0f} s: {len(metrics)} round(s) in metrics.jsonl, summary: {(run / 'summary.json').exists()}", flush=True)
    return run


# ---------------------------------------------------------------------- resume checks
@dataclass
class ResumeCase:
    run: str
    kind: str
    target: str
    expect: str  # refuse / repair
    detail: str = ""
    how: str = ""  # fork / subprocess
    rc: int | None = None
    stderr: str = ""
    outcome: str = ""  # refused / refused (not one line) / resumed / crash / hang
    untouched: bool | None = None  # a refused resume left the copy as it was
    verify_after: str = ""  # resumed: the verify status of the resumed run
    verify_first: str = ""
    same_as_uninterrupted: bool | None = None
    ok: bool = False
    seconds: float = 0.0


def resume_once(run: Path, real: bool, timeout: float) -> tuple[Proc, str]:
    argv = ["--resume", str(run), "--no-progress"]
    if real:
        return run_proc([sys.executable, "-m", "privfl.train", *argv], timeout), "subprocess"
    return run_module_forked("privfl.train", argv, timeout), "fork"


def resume_case(
    killed: Path, donor: Path, kind: str, target: str, apply: Apply | None, ctx: Ctx, expect: str, args: argparse.Namespace
) -> ResumeCase | None:
    rc_case = ResumeCase(killed.name, kind, target, expect)
    with case_dir(args.work_dir) as tmp:
        run = tmp / killed.name
        copy_run(killed, run, hardlink=False)
        ctx.outside = tmp / "outside"
        if apply is not None:
            detail = apply(run, target, ctx)
            if detail is None:
                return None
            rc_case.detail = detail
        digest = tree_digest(run)
        real = args.real_cli or expect == "repair"
        proc, rc_case.how = resume_once(run, real, args.resume_timeout)
        rc_case.rc, rc_case.seconds = proc.rc, round(proc.seconds, 1)
        err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        notes = [ln for ln in err if ln.startswith("privfl")]
        rc_case.stderr = short(" | ".join(notes or err[-3:]), run, 400)
        if proc.rc is None:
            rc_case.outcome = "hang"
        elif "Traceback" in proc.stderr:
            rc_case.outcome = "crash"
        elif proc.rc == 2:
            one_line = len(err) == 1 and err[0].startswith("privfl.train: error:")
            rc_case.outcome = "refused" if one_line else "refused (not one line)"
            rc_case.untouched = tree_digest(run) == digest
        elif proc.rc == 0:
            rc_case.outcome = "resumed"
            status, first, _ = verify_inprocess(run, args.timeout)
            rc_case.verify_after, rc_case.verify_first = ("OK" if status == "missed" else status), short(first, run)
            rc_case.same_as_uninterrupted = all(
                (run / s / "index.jsonl").read_bytes() == (donor / s / "index.jsonl").read_bytes()
                for s in STORES
                if (donor / s / "index.jsonl").is_file()
            )
        else:
            rc_case.outcome = f"rc {proc.rc}"
        if expect == "refuse":
            rc_case.ok = rc_case.outcome == "refused" and bool(rc_case.untouched)
        else:
            rc_case.ok = rc_case.outcome == "resumed" and "privfl: resume:" in proc.stderr and rc_case.verify_after == "OK"
            if apply is None:  # the undamaged baseline: nothing to repair, so no note is expected
                rc_case.ok = rc_case.outcome == "resumed" and rc_case.verify_after == "OK"
    return rc_case


def uncommitted_round(run: Path, target: str, ctx: Ctx, torn: bool = True) -> str | None:
    """What a kill inside round 1 leaves: that round's first records (from the uninterrupted run, with
    their blobs), not committed in head.json, and (``torn``) half of the next line."""
    assert ctx.donor is not None
    lines = read_lines(run / target)
    theirs = read_lines(ctx.donor / target)
    extra = theirs[len(lines) : len(lines) + 2]
    if not extra:
        return None
    for line in extra:
        sha = json.loads(line)["sha256"]
        src = ctx.donor / target / "blobs" / sha[:2] / f"{sha}.safetensors"
        dst = run / target / "blobs" / sha[:2] / f"{sha}.safetensors"
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    nxt = theirs[len(lines) + len(extra)] if len(theirs) > len(lines) + len(extra) else extra[-1]
    write_lines(run / target, [*lines, *extra], tail=nxt[: len(nxt) // 2] if torn else b"")
    return f"{len(extra)} uncommitted record(s) of round 1" + (" and half a line" if torn else "")


def uncommitted_whole(run: Path, target: str, ctx: Ctx) -> str | None:
    return uncommitted_round(run, target, ctx, torn=False)


def resume_checks(bases: list[Path], damages: list[Damage], args: argparse.Namespace) -> list[ResumeCase]:
    out: list[ResumeCase] = []
    killed_dir = args.work_dir / "killed"
    for base in bases:
        killed = train_killed(base, killed_dir, args.reuse)
        others = [b for b in bases if b != base]
        ctx = Ctx(killed, others, Path("/nonexistent"), donor=base)
        status, first, _ = verify_inprocess(killed, args.timeout)
        print(f"verify on the undamaged killed run {killed.name}: {'OK' if status == 'missed' else status + ': ' + first}", flush=True)
        plan: list[tuple[str, str, Apply | None, str]] = [("(none: undamaged killed run)", "-", None, "repair")]
        for store in STORES:
            if (killed / store / "index.jsonl").is_file():
                plan.append(("partial last line", store, partial_tail, "repair"))
        for where in ("capture", "checkpoint"):
            plan.append(("stray temporary file of a cut-short write", where, stray_temp, "repair"))
        for store in ("capture", "truth"):
            plan.append(("killed inside round 1 (uncommitted records + partial line)", store, uncommitted_round, "repair"))
            plan.append(("killed inside round 1 (uncommitted records, whole lines)", store, uncommitted_whole, "repair"))
        for dmg in damages:
            if not dmg.resume:
                continue
            for target in targets_for(dmg, killed):
                store, pos = split_target(target)
                if pos and pos != "middle":
                    continue
                plan.append((f"{dmg.group}: {dmg.kind}", target, dmg.apply, "refuse"))
        for store in ("capture", "truth"):  # beyond the brief: a re-chained record where a kill cannot leave one
            plan.append(
                ("rechained: an uncommitted copy of a completed round's record", f"{store}@last", _rechained(_rc_append_copy, False), "refuse")
            )
        for kind, target, apply, expect in plan:
            case = resume_case(killed, base, kind, target, apply, ctx, expect, args)
            if case is None:
                continue
            out.append(case)
            mark = "ok " if case.ok else "BAD"
            print(f"  [{mark}] {killed.name:<14} {kind[:58]:<58} {target:<16} {case.outcome:<10} {case.how:<10} {case.verify_after}", flush=True)
    return out


# ---------------------------------------------------------------------- report
def print_table(cases: list[Case]) -> None:
    rows: dict[tuple[str, str, str], list[Case]] = defaultdict(list)
    for c in cases:
        rows[(c.group, c.kind, split_target(c.target)[0])].append(c)
    header = f"{'group':<9} {'damage kind':<48} {'target':<28} {'caught':<10} first problem line (or what was missed)"
    print(header)
    print("-" * len(header))
    for (group, kind, target), cs in rows.items():
        caught = [c for c in cs if c.status == "caught"]
        bad = [c for c in cs if c.status != "caught"]
        verdict = f"yes {len(caught)}/{len(cs)}" if not bad else f"NO {len(caught)}/{len(cs)}"
        if bad:
            b = bad[0]
            text = f"{b.status.upper()}: {b.run}:{b.target} ({b.detail[:60]})" + (f" {b.first}" if b.status in ("crash", "hang") else "")
        else:
            text = caught[0].first
        print(f"{group:<9} {kind[:48]:<48} {target[:28]:<28} {verdict:<10} {text[:150]}")


def kind_totals(cases: list[Case], groups: tuple[str, ...]) -> tuple[int, int, int, int]:
    by_kind: dict[tuple[str, str], list[Case]] = defaultdict(list)
    for c in cases:
        if c.group in groups:
            by_kind[(c.group, c.kind)].append(c)
    kinds_caught = sum(all(c.status == "caught" for c in cs) for cs in by_kind.values())
    n_cases = sum(len(cs) for cs in by_kind.values())
    cases_caught = sum(c.status == "caught" for cs in by_kind.values() for c in cs)
    return kinds_caught, len(by_kind), cases_caught, n_cases


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child-kill"]:
        return child_kill_main(argv[1])
    p = argparse.ArgumentParser(
        prog="python -m experiments.robustness.damage_verify", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--run", action="append", default=[], help="a finished run to damage copies of (repeatable; default: train fedre, drdfl, fedavg)")
    p.add_argument("--work", default=None, help="working folder (base and killed runs, case copies, kept misses; default: a new temp folder)")
    p.add_argument("--reuse", action="store_true", help="reuse base/killed runs already in --work")
    p.add_argument("--out", default=None, help="write every case as JSON here")
    p.add_argument("--cli", action="store_true", help="also run the real verify CLI on a sample of cases and on the intact runs")
    p.add_argument("--resume", action="store_true", help="also check --resume on damaged copies of a run killed after round 0")
    p.add_argument("--resume-runs", default=None, help="comma list of base run names to kill for --resume (default: all)")
    p.add_argument("--real-cli", action="store_true", help="--resume: run every resume as a real python -m privfl.train subprocess")
    p.add_argument("--groups", default=None, help=f"comma list of damage groups (default: all of {', '.join(BRIEF_GROUPS + APART_GROUPS)})")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a verify may take before it counts as a hang")
    p.add_argument("--resume-timeout", type=float, default=300.0)
    p.add_argument("--verbose", action="store_true", help="print every case")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    args.work_dir = Path(args.work or tempfile.mkdtemp(prefix="damage-verify-")).resolve()
    if not claim_work_folder(args.work_dir, "python -m experiments.robustness.damage_verify"):
        return 2
    shutil.rmtree(args.work_dir / "missed", ignore_errors=True)  # inside a folder this script made and marked
    print(f"work folder: {args.work_dir}", flush=True)

    if args.run:
        bases = [Path(r).resolve() for r in args.run]
    else:
        bases = [train_base(name, flags, args.work_dir / "base", args.reuse) for name, flags in DEFAULT_BASES.items()]
    preimport(sorted({str(read_json(b / "config.json").get("method")) for b in bases}))
    fingerprint = code_fingerprint()
    print(f"code fingerprint (privfl, defenses): {fingerprint}", flush=True)
    digests = {b: tree_digest(b) for b in bases}
    for b in bases:
        kinds = {(r["direction"], r["kind"]) for r in records(b / "capture")}
        counts = {s: len(records(b / s)) for s in STORES}
        print(f"base {b.name}: {counts}, messages {sorted(kinds)}", flush=True)
        status, first, lines = verify_inprocess(b, args.timeout)
        if status != "missed":
            raise SystemExit(f"the intact base run {b} does not verify ({status}: {first}); nothing can be measured on it\n" + "\n".join(lines))
    if not any(r["direction"] == "peer" for b in bases for r in records(b / "capture")):
        print("note: no base run has peer (ring) messages", flush=True)

    damages = catalogue()
    groups = set(args.groups.split(",")) if args.groups else set(BRIEF_GROUPS + APART_GROUPS)
    cases: list[Case] = []
    cli_groups_done: set[str] = set()
    cli_intact = {}
    if args.cli:
        for b in bases:
            cli_intact[b.name] = cli_verify(b, args.timeout + 60)
            print(f"CLI verify on intact {b.name}: rc {cli_intact[b.name]['rc']}", flush=True)
    for dmg in damages:
        if dmg.group not in groups:
            continue
        for base in bases:
            ctx = Ctx(base, [b for b in bases if b != base], Path("/nonexistent"))
            for target in targets_for(dmg, base):
                cli = args.cli and (dmg.group not in cli_groups_done or "FIFO" in dmg.kind) and dmg.group in BRIEF_GROUPS
                case = run_case(dmg, base, target, ctx, args, cli)
                if case is None:
                    continue
                if cli:
                    cli_groups_done.add(dmg.group)
                cases.append(case)
                if args.verbose or case.status != "caught":
                    print(f"  [{case.status:<6}] {dmg.group}/{dmg.kind} {base.name}:{target}: {case.detail[:80]} | {case.first[:100]}", flush=True)
    t_verify = time.perf_counter() - t_start

    resume_cases: list[ResumeCase] = []
    if args.resume:
        chosen = [b for b in bases if args.resume_runs is None or b.name in args.resume_runs.split(",")]
        resume_cases = resume_checks(chosen, damages, args)

    untouched = all(tree_digest(b) == digests[b] for b in bases)
    print()
    print_table(cases)
    print()
    misses = [c for c in cases if c.status != "caught"]
    if misses:
        print("missed / hung / crashed cases:")
        for c in misses:
            print(f"  {c.status:<6} {c.group}/{c.kind} {c.run}:{c.target}: {c.detail[:120]}" + (f" [{c.first[:120]}]" if c.first else ""))
            if c.kept:
                print(f"         kept at {c.kept}")
        print()
    wrote = [c for c in cases if c.verify_wrote]
    if wrote:
        print(f"verify changed the run directory in {len(wrote)} case(s): " + ", ".join(f"{c.kind} {c.run}:{c.target}" for c in wrote[:5]))
    if args.cli:
        sampled = [c for c in cases if c.cli]
        good = [c for c in sampled if c.cli and c.cli["rc"] == 1 and not c.cli["traceback"]]
        print(f"real CLI on {len(sampled)} sampled damaged copies: exit 1 without traceback in {len(good)}/{len(sampled)}")
        for c in sampled:
            assert c.cli is not None
            print(
                f"  rc {c.cli['rc']} {'TRACEBACK ' if c.cli['traceback'] else ''}{c.group}/{c.kind} {c.run}:{c.target} "
                f"({c.cli['seconds']} s): {c.cli['first'][:100]}"
            )
        print("real CLI on the intact runs: " + ", ".join(f"{k} rc {v['rc']}" for k, v in cli_intact.items()))
    if resume_cases:
        print()
        print(f"{'resume: damage':<66} {'run:target':<28} {'outcome':<22} {'ok':<4} detail")
        for r in resume_cases:
            after = (
                f"; resumed run verify: {r.verify_after}" + (f" ({r.verify_first[:80]})" if r.verify_first else "") if r.outcome == "resumed" else ""
            )
            after += "" if r.untouched is None else ("; copy untouched" if r.untouched else "; COPY CHANGED by the refused resume")
            same = (
                ""
                if r.same_as_uninterrupted is None
                else f"; indexes identical to the uninterrupted run: {'yes' if r.same_as_uninterrupted else 'no'}"
            )
            print(
                f"{r.kind[:66]:<66} {r.run + ':' + r.target:<28} {r.outcome + ' (' + r.how + ')':<22} {'yes' if r.ok else 'NO':<4} "
                f"{r.stderr[:110]}{after}{same}"
            )
    print()
    print(f"base runs unchanged by the whole experiment: {'yes' if untouched else 'NO'}")
    end_fingerprint = code_fingerprint()
    if end_fingerprint != fingerprint:
        print(f"WARNING: the privfl/defenses source changed during the experiment ({fingerprint} -> {end_fingerprint}): results mix code versions")
    else:
        print(f"code unchanged during the experiment ({fingerprint})")
    for label, grp in (("beyond the brief (extra)", ("extra",)), ("re-chained adversary (rechained)", ("rechained",))):
        k, n, kc, nc = kind_totals(cases, grp)
        if n:
            print(f"{label}: caught {k}/{n} damage kinds ({kc}/{nc} cases)")
    print(f"run time: {time.perf_counter() - t_start:.0f} s (verify cases {t_verify:.0f} s)")
    if resume_cases:
        damaged = [r for r in resume_cases if r.expect == "refuse" and not r.kind.startswith("rechained")]
        refused = [r for r in damaged if r.ok]
        tails = [r for r in resume_cases if r.kind == "partial last line"]
        repaired = bool(tails) and all(r.ok for r in tails)
        print(f"resume refused {len(refused)}/{len(damaged)} damaged indexes; repaired partial tail: {'yes' if repaired else 'no'}")
    k, n, kc, nc = kind_totals(cases, BRIEF_GROUPS)
    if args.out:
        out = {
            "bases": [str(b) for b in bases],
            "work": str(args.work_dir),
            "cases": [asdict(c) for c in cases],
            "resume": [asdict(r) for r in resume_cases],
            "cli_intact": cli_intact,
            "totals": {"kinds_caught": k, "kinds": n, "cases_caught": kc, "cases": nc, "bases_unchanged": untouched},
            "seconds": round(time.perf_counter() - t_start, 1),
            "code": {"start": fingerprint, "end": end_fingerprint},
        }
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"verify caught {k}/{n} damage kinds ({kc}/{nc} cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
