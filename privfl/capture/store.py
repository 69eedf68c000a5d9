"""Append-only, checksummed tensor stores: the capture, the attacker knowledge and the ground truth.

One format serves all three (kept in three separate folders, docs/usage.md "Three stores, kept apart"):

``manifest.json``
    ``{"format": "privfl-store/2", "role": ...}``: a folder that is not ours is refused.
``index.jsonl``
    one JSON record per entry (seq, round, parties, kind, tensor shapes/dtypes, scalars, bytes, the
    blob's sha256) plus ``chain``: the sha256 of the previous record's ``chain`` and this record's
    canonical JSON. Editing, dropping, reordering or renumbering any record breaks the chain from
    there on, so damage to the index itself is detected, not only damage to the blobs.
``head.json``
    ``{"records": n, "chain": ...}``: the committed length of the index and its last chain value,
    rewritten at the end of every round. Records lost from the end of the index (which no chain can
    show) are caught against it; records after it were written by a round that never completed.
``blobs/<aa>/<sha256>.safetensors``
    the tensors, content-addressed: a head broadcast to ten clients is stored once, and the name is
    the checksum that ``verify`` recomputes. safetensors never unpickles, so a foreign or tampered
    file can at worst fail to parse.

Writes are atomic: a blob is written to a temporary file and ``os.replace``d into place before its
index line is appended, so a killed run leaves at most an unreferenced blob, uncommitted records and
a partial last line. :meth:`TensorStore.truncate` (called on ``--resume``) removes exactly those and
refuses any other damage: a resumed run must never build on an index it cannot vouch for.

When: :meth:`TensorStore.append` serialises and hashes at once (the record it returns is final) but keeps
the blob and the index line in memory; :meth:`TensorStore.flush`, at the end of every round, writes them
(blobs first), fsyncs the index and commits ``head.json``. A round's records are uncommitted until then
in any case, so a kill loses nothing a resume would have kept. The store writes early when it holds at least
``PENDING_LIMIT`` bytes of blobs (a round of full models of many clients) and when the same object
reads (:meth:`TensorStore.records`, :meth:`TensorStore.scan`, :meth:`TensorStore.load`). Why: creating a
small file costs a few hundred microseconds while clients train in other threads on the same cores, and
a FedRE run creates over twenty a round; kept to the round's end (and with no copy of tensors that
need none, :func:`portable_tensors`), the time spent in the capture's writes fell from 4.7 and 4.1 % of
training to 2.9 and 2.1 % in two measurements (FedRE), from 24.5 to 16.5 % for FedAvg's full models
(``python -m experiments.bench.capture``, 2026-11-27).

Every read refuses symbolic links and paths that leave the store's folder, so a run someone sent you
cannot make privfl read (or report as intact) files outside it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from safetensors.torch import save_file

from privfl.errors import CaptureError

FORMAT = "privfl-store/2"
LEGACY_FORMATS = ("privfl-store/1",)  # unchained index, no head: readable, not fully verifiable
ROLES = ("capture", "knowledge", "truth")
_HEX64 = re.compile(r"[0-9a-f]{64}")
#: bytes of blobs a store keeps in memory before writing them out ahead of the round's end
PENDING_LIMIT = 64 * 1024 * 1024
_MAX_JSON_LINE = 1 << 24  # 16 MiB: far above any real record, refuses a file that is one huge line

#: fields every record of a role carries, with their JSON types (checked on read, so that nothing
#: downstream meets a record of the wrong shape)
_INT, _STR, _LIST, _DICT = (int,), (str,), (list,), (dict,)
COMMON_FIELDS: dict[str, tuple[type, ...]] = {"seq": _INT, "sha256": _STR, "tensors": _DICT, "file_bytes": _INT}
ROLE_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "capture": {
        "round": _INT,
        "sender": _STR,
        "receiver": _STR,
        "direction": _STR,
        "kind": _STR,
        "scalars": _INT,
        "paper_scalars": _INT,
        "bytes": _INT,
        "aux": _LIST,
        "meta": _DICT,
    },
    "truth": {"message_seq": _INT, "round": _INT, "client": _STR, "kind": _STR},
    "knowledge": {"round": _INT, "client": _STR, "kind": _STR},
}


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either nothing or the whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write ``tensors`` as a safetensors file at ``path`` atomically (as :func:`atomic_write_bytes`) and
    return its sha256. The file is written by safetensors itself and hashed back in chunks, so a
    checkpoint of many client models never exists as one bytes object in memory (at 1,000 clients of
    cnn4 that object was 4.6 GB, and building it took 3x longer than writing the file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        digest = hashlib.sha256()
        with open(tmp, "rb") as fh:
            while chunk := fh.read(1 << 24):
                digest.update(chunk)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return digest.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def contained(root: Path, path: Path, what: str = "file") -> Path:
    """``path`` if it is a real file or folder inside ``root``; a one-line :class:`CaptureError` if it
    is a symbolic link or resolves outside ``root`` (a run must not make privfl read elsewhere)."""
    if path.is_symlink():
        raise CaptureError(f"{path} is a symbolic link: privfl does not follow links inside a run")
    try:
        real_root = root.resolve()
        if not path.resolve().is_relative_to(real_root):
            raise CaptureError(f"{path} leads outside {root}: privfl does not read outside a run")
    except (OSError, RuntimeError) as exc:  # a symlink loop, a name too long
        raise CaptureError(f"{what} {path} cannot be resolved: {exc}") from None
    return path


def read_contained(root: Path, path: Path, what: str = "file", limit: int | None = None) -> bytes:
    """The bytes of a file inside ``root`` (see :func:`contained`); missing or unreadable -> CaptureError."""
    contained(root, path, what)
    flags = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)  # a FIFO planted in a run must not block us
    try:
        with open(path, "rb", opener=lambda p, f: os.open(p, f | flags)) as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise CaptureError(f"{what} {path} is not a regular file")
            data = fh.read() if limit is None else fh.read(limit + 1)
    except FileNotFoundError:
        raise CaptureError(f"{what} {path} is missing") from None
    except OSError as exc:
        raise CaptureError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    if limit is not None and len(data) > limit:
        raise CaptureError(f"{what} {path} is larger than {limit} bytes: not a privfl file")
    return data


#: a temporary file of :func:`atomic_write_bytes` (or a checkpoint's) that a kill left before its rename
STRAY_TEMP = re.compile(r"\..+\.tmp")


def stray_temps(folder: Path, *, recursive: bool = True) -> list[Path]:
    """Temporary files privfl's atomic writes left in ``folder`` (a kill between write and rename)."""
    if not folder.is_dir() or folder.is_symlink():
        return []
    found = folder.rglob(".*.tmp") if recursive else folder.glob(".*.tmp")
    return sorted(p for p in found if STRAY_TEMP.fullmatch(p.name) and p.is_file() and not p.is_symlink())


def exc_line(exc: BaseException, limit: int = 100) -> str:
    """The first line of an exception's text (or its type), cut to ``limit``: for one-line errors."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


def tensor_summary(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    return {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in tensors.items()}


def portable_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors that share no storage, in key order: what safetensors writes. Rows of one
    batch moved off a GPU are views of one CPU tensor, which safetensors refuses ("Some tensors share memory").
    A tensor is copied only when it needs to be: on another device or not contiguous (``to`` and
    ``contiguous`` copy), a part of a larger storage, or the same storage as one before it (a copy of
    every tensor cost a tenth of a millisecond per message). :meth:`TensorStore.append` serialises at
    once, so what it stores is the tensors' values at the call either way."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for k, v in sorted(tensors.items()):
        t = v.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if t.numel() and (storage.nbytes() != t.numel() * t.element_size() or storage.data_ptr() in seen):
            t = t.clone()
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        out[k] = t
    return out


def genesis(role: str) -> str:
    """The chain value before the first record of a ``role`` store."""
    return hashlib.sha256(f"{FORMAT}:{role}".encode()).hexdigest()


def chain_next(previous: str, record: dict[str, Any]) -> str:
    """The chain value of ``record`` (without its ``chain`` field) following ``previous``."""
    body = json.dumps({k: v for k, v in record.items() if k != "chain"}, sort_keys=True)
    return hashlib.sha256(f"{previous}\n{body}".encode()).hexdigest()


def _record_problem(rec: Any, role: str, chained: bool) -> str | None:
    """Why ``rec`` is not a well-formed record of ``role`` (None when it is)."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    wanted = {**COMMON_FIELDS, **ROLE_FIELDS[role], **({"chain": _STR} if chained else {})}
    for key, types in wanted.items():
        value = rec.get(key)
        if not isinstance(value, types) or isinstance(value, bool):
            return f"field {key!r} is missing or not a {types[0].__name__}"
    for key in ("seq", "file_bytes", "round", "message_seq", "scalars", "paper_scalars", "bytes"):
        if key in wanted and rec[key] < 0:
            return f"field {key!r} is negative"
    if not _HEX64.fullmatch(rec["sha256"]) or (chained and not _HEX64.fullmatch(rec["chain"])):
        return "sha256/chain is not a 64-digit hex digest"
    for name, info in rec["tensors"].items():
        if not (
            isinstance(info, dict)
            and isinstance(info.get("dtype"), str)
            and isinstance(info.get("shape"), list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in info["shape"])
        ):
            return f"tensor {name!r} has no valid shape/dtype"
    if role == "capture" and not all(isinstance(a, str) for a in rec["aux"]):
        return "field 'aux' must list tensor names"
    return None


@dataclass
class IndexScan:
    """What reading an index found: the well-formed records and every problem, by line."""

    records: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    partial_tail: bool = False
    committed: int | None = None  # head.json's record count (None: no usable head)


class TensorStore:
    """One folder of checksummed safetensors blobs plus a chained JSON-lines index."""

    def __init__(self, root: str | Path, role: str, *, create: bool = False):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        self.root = Path(root)
        self.role = role
        self.index_path = self.root / "index.jsonl"
        self.head_path = self.root / "head.json"
        manifest = self.root / "manifest.json"
        if self.root.is_symlink():
            raise CaptureError(f"{self.root} is a symbolic link: privfl does not follow links inside a run")
        if create and not manifest.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            atomic_write_text(manifest, json.dumps({"format": FORMAT, "role": role}) + "\n")
            self.index_path.touch()
            self._write_head(0, genesis(role))
        self.chained = self._check_manifest(manifest) == FORMAT
        self._next_seq: int | None = None
        self._chain: str | None = None
        self.partial_tail = False
        #: what :meth:`append` has not written yet (blobs by sha256, index lines), written by
        #: :meth:`write_pending` at the latest when the round is committed (:meth:`flush`)
        self._pending_blobs: dict[str, bytes] = {}
        self._pending_bytes = 0
        self._pending_lines: list[str] = []

    def _check_manifest(self, manifest: Path) -> str:
        if not manifest.is_file() and not manifest.is_symlink():
            raise CaptureError(f"{self.root} is not a privfl {self.role} store (no manifest.json)")
        try:
            info = json.loads(read_contained(self.root, manifest, "manifest", limit=4096))
        except (ValueError, RecursionError):
            raise CaptureError(f"{manifest} is not valid JSON: not a privfl store") from None
        if not isinstance(info, dict) or info.get("format") not in (FORMAT, *LEGACY_FORMATS):
            raise CaptureError(f"{manifest}: unknown store format {str(info)[:80]!r}; expected {FORMAT}")
        if info.get("role") != self.role:
            raise CaptureError(f"{self.root} holds {str(info.get('role'))[:40]!r}, not {self.role!r}")
        return str(info["format"])

    # ------------------------------------------------------------------ writing
    def blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / digest[:2] / f"{digest}.safetensors"

    def _write_head(self, records: int, chain: str) -> None:
        atomic_write_text(self.head_path, json.dumps({"records": records, "chain": chain}) + "\n")

    def _tail_state(self) -> tuple[int, str]:
        records = self.records()
        chain = records[-1]["chain"] if records and self.chained else genesis(self.role)
        return len(records), chain

    def append(self, record: dict[str, Any], tensors: dict[str, torch.Tensor], *, stored: tuple[str, int] | None = None) -> dict[str, Any]:
        """Store ``tensors`` and append ``record`` (plus seq, shapes, checksum and chain) to the index.

        ``stored``: ``(sha256, file bytes)`` of these very tensors, unchanged, as an earlier ``append`` of
        this store returned them (a broadcast's next receiver, :meth:`privfl.channel.Channel.broadcast`):
        the record names that blob without serialising and hashing the tensors again."""
        if self._next_seq is None or self._chain is None:
            self._next_seq, self._chain = self._tail_state()
        if stored is None:
            data = st_save(portable_tensors(tensors))
            digest, size = hashlib.sha256(data).hexdigest(), len(data)
            if digest not in self._pending_blobs:  # whether it is on disk already: write_pending, at the round end
                self._pending_blobs[digest] = data
                self._pending_bytes += size
        else:
            digest, size = stored
            if digest not in self._pending_blobs and not self.blob_path(digest).is_file():
                raise ValueError(f"{self.role} record {record!r}: blob {digest} was not stored by this store")
        full = {
            "seq": self._next_seq,
            **record,
            "tensors": tensor_summary(tensors),
            "sha256": digest,
            "file_bytes": size,
        }
        if self.chained:
            full["chain"] = chain_next(self._chain, full)
        problem = _record_problem(full, self.role, self.chained)
        if problem:
            raise ValueError(f"{self.role} record {record!r}: {problem}")
        self._pending_lines.append(json.dumps(full, sort_keys=True) + "\n")
        self._next_seq += 1
        self._chain = full.get("chain", self._chain)
        if self._pending_bytes >= PENDING_LIMIT:  # at 0 (tests.killer --write-early): every record at once
            self.write_pending()
        return full

    def write_pending(self) -> None:
        """Write the blobs and index lines :meth:`append` has kept, blobs first (each atomically), then
        the lines in one append; a blob already on disk (content-addressed: the same bytes) is not written
        again. Nothing is committed here (:meth:`flush` does that)."""
        for digest, data in self._pending_blobs.items():
            path = self.blob_path(digest)
            if not path.exists():  # here, at the round's end, not per message while clients train
                atomic_write_bytes(path, data)
        self._pending_blobs.clear()
        self._pending_bytes = 0
        if self._pending_lines:
            with open(self.index_path, "a", encoding="utf-8") as fh:
                fh.write("".join(self._pending_lines))
            self._pending_lines.clear()

    def flush(self) -> None:
        """Write what is pending, fsync the index and commit it in ``head.json`` (once per round, not per message)."""
        self.write_pending()
        with open(self.index_path, "rb") as fh:
            os.fsync(fh.fileno())
        if self.chained:
            if self._next_seq is None or self._chain is None:
                self._next_seq, self._chain = self._tail_state()
            self._write_head(self._next_seq, self._chain)

    def truncate(self, keep: Callable[[dict[str, Any]], bool]) -> tuple[int, list[str]]:
        """Keep the leading records for which ``keep`` is true; returns (how many, repairs made).

        Repairs are the damage a kill leaves (a partial last line, records written after the last
        committed round); any other damage raises :class:`CaptureError`, so ``--resume`` never
        continues from an index it cannot vouch for.
        """
        scan = self.scan()
        repairs = []
        if scan.partial_tail:
            repairs.append(f"{self.index_path}: dropped a partial last line (the run was killed while writing it)")
        damage = [p for p in scan.problems if not p.startswith(("partial last", "uncommitted"))]
        if damage:
            raise CaptureError(
                f"{self.index_path} is damaged ({damage[0]}{f'; and {len(damage) - 1} more' if len(damage) > 1 else ''}): "
                "--resume refuses to continue it (python -m privfl.capture verify lists the damage)"
            )
        n = 0
        while n < len(scan.records) and keep(scan.records[n]):
            n += 1
        if any(keep(r) for r in scan.records[n:]):
            raise CaptureError(f"{self.index_path}: records to keep follow records to drop; --resume cannot cut it at one place")
        if scan.committed is not None and n > scan.committed:  # a kill leaves only the interrupted round uncommitted
            raise CaptureError(
                f"{self.index_path}: {n - scan.committed} record(s) of completed rounds follow the committed head; "
                "--resume refuses to continue it (python -m privfl.capture verify lists the damage)"
            )
        kept = scan.records[:n]
        if len(scan.records) > n:
            repairs.append(f"{self.index_path}: dropped {len(scan.records) - n} record(s) of the round that was interrupted")
        atomic_write_text(self.index_path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        self._next_seq = n
        self._chain = kept[-1]["chain"] if kept and self.chained else genesis(self.role)
        if self.chained:
            self._write_head(n, self._chain)
        return n, repairs

    # ------------------------------------------------------------------ reading
    def _read_head(self) -> tuple[int, str] | str:
        """(records, chain) from ``head.json``, or why it cannot be used."""
        if not self.head_path.exists() and not self.head_path.is_symlink():
            return f"{self.head_path} is missing: the committed length of the index is unknown"
        try:
            head = json.loads(read_contained(self.root, self.head_path, "head", limit=4096))
        except CaptureError as exc:
            return str(exc)
        except (ValueError, RecursionError):
            return f"{self.head_path} is not valid JSON"
        if (
            not isinstance(head, dict)
            or not isinstance(head.get("records"), int)
            or isinstance(head.get("records"), bool)
            or head["records"] < 0
            or not isinstance(head.get("chain"), str)
        ):
            return f"{self.head_path} does not hold a record count and a chain value"
        return head["records"], head["chain"]

    def _parse(self, line: bytes) -> dict[str, Any] | str:
        """One index line as a well-formed record of this store, or what is wrong with it."""
        try:
            rec = json.loads(line) if len(line) <= _MAX_JSON_LINE else None
        except (ValueError, RecursionError):
            rec = None
        if rec is None:
            return "not JSON"
        problem = _record_problem(rec, self.role, self.chained)
        return problem if problem is not None else rec

    def scan(self) -> IndexScan:
        """Read the whole index and check its structure: record syntax, seq continuity, the chain and
        the committed head. Never raises on damage; blobs are not read (see :meth:`verify`)."""
        out = IndexScan()
        self.write_pending()  # this object's own appends read back
        data = read_contained(self.root, self.index_path, "index")
        lines = data.split(b"\n")
        out.partial_tail = self.partial_tail = bool(lines[-1])
        if out.partial_tail:
            out.problems.append(f"partial last record in {self.index_path} (run killed mid-write; --resume drops it)")
        chain = genesis(self.role)
        chain_ok = self.chained
        due = 0  # the seq the next record must carry
        for n, line in enumerate(lines[:-1], 1):
            rec = self._parse(line)
            if isinstance(rec, str):
                out.problems.append(f"{self.index_path}:{n}: {rec}")
                due += 1
                continue
            if rec["seq"] != due:
                out.problems.append(f"{self.index_path}:{n}: seq {rec['seq']} where {due} was due (records dropped, duplicated or renumbered)")
            due = rec["seq"] + 1
            if chain_ok:
                chain = chain_next(chain, rec)
                if rec["chain"] != chain:
                    out.problems.append(
                        f"{self.index_path}:{n}: chain mismatch (this record, or one before it, was edited, dropped, duplicated or reordered)"
                    )
                    chain_ok = False  # one break is enough: later records cannot be checked against it
            out.records.append(rec)
        if not self.chained:
            out.problems.append(f"{self.root} is a legacy store (unchained index): records cannot be checked against edits")
            return out
        head = self._read_head()
        if isinstance(head, str):
            out.problems.append(head)
            return out
        out.committed, head_chain = head
        n_ok = len(out.records)
        if out.committed > n_ok:
            out.problems.append(f"{self.index_path}: {out.committed} records were committed, {n_ok} are left (records were lost)")
        elif (out.committed == 0 and head_chain != genesis(self.role)) or (out.committed and out.records[out.committed - 1]["chain"] != head_chain):
            out.problems.append(f"{self.head_path}: the index does not end in the committed chain value (records were replaced)")
        if n_ok > out.committed and not out.problems:
            out.problems.append(
                f"uncommitted: {n_ok - out.committed} record(s) of {self.index_path} follow the last completed round "
                "(a killed run; --resume drops them)"
            )
        return out

    def records(self, *, strict: bool = True) -> list[dict[str, Any]]:
        """All well-formed index records.

        A partial last line (a run killed while appending) was never committed and is skipped. Any
        other bad line is an error when ``strict`` (the first one, as one line); otherwise skipped.
        Chain and head are checked by :meth:`scan` / :meth:`verify`, not here.
        """
        self.write_pending()  # this object's own appends read back
        data = read_contained(self.root, self.index_path, "index")
        lines = data.split(b"\n")
        self.partial_tail = bool(lines[-1])
        out: list[dict[str, Any]] = []
        for n, line in enumerate(lines[:-1], 1):
            rec = self._parse(line)
            if not isinstance(rec, str) and strict and rec["seq"] != len(out):
                rec = f"seq {rec['seq']} where {len(out)} was due"
            if isinstance(rec, str):
                if strict:
                    raise CaptureError(f"{self.index_path}:{n} is not a valid privfl index record ({rec})")
                continue
            out.append(rec)
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records())

    def load(self, record: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors of ``record``, after checking their checksum (never unpickles, never follows links)."""
        digest = str(record["sha256"])
        if not _HEX64.fullmatch(digest):
            raise CaptureError(f"{self.role} record {record.get('seq')!r} has no valid sha256")
        if digest in self._pending_blobs:
            self.write_pending()
        path = self.blob_path(digest)
        data = read_contained(self.root, path, f"{self.role} file")
        if hashlib.sha256(data).hexdigest() != digest:
            raise CaptureError(f"checksum mismatch in {path}: the file is corrupt or was modified")
        try:
            return st_load(data)
        except (SafetensorError, ValueError, RuntimeError, TypeError, OverflowError, KeyError) as exc:  # KeyError: a dtype torch lacks (F4, ...)
            raise CaptureError(f"{path} is not a valid safetensors file: {exc_line(exc)}") from None

    def verify(self, scan: IndexScan | None = None) -> list[str]:
        """Every problem found (empty when the store is intact): index structure (:meth:`scan`, or the
        ``scan`` already made), each blob's checksum, size and tensor shapes, and links anywhere in the store."""
        if scan is None:
            try:
                scan = self.scan()
            except CaptureError as exc:
                return [str(exc)]
        problems = list(scan.problems)
        for rec in scan.records:
            path = self.blob_path(rec["sha256"])
            try:
                tensors = self.load(rec)
            except CaptureError as exc:
                problems.append(f"seq {rec['seq']}: {exc}")
                continue
            if tensor_summary(tensors) != rec["tensors"]:
                problems.append(f"seq {rec['seq']}: tensor names/shapes differ from the index")
            if path.stat().st_size != rec["file_bytes"]:
                problems.append(f"seq {rec['seq']}: file size differs from the index")
        for dirpath, dirnames, filenames in os.walk(self.root):  # os.walk does not descend into links
            for name in dirnames + filenames:
                if os.path.islink(os.path.join(dirpath, name)):
                    problems.append(f"{os.path.join(dirpath, name)} is a symbolic link (a store holds plain files only)")
        return problems
