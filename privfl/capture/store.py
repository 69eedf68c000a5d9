"""Append-only, checksummed tensor stores: the capture, the attacker knowledge and the ground truth.

One format serves all three (kept in three separate folders, DESIGN.md "three-way split"):

``manifest.json``
    ``{"format": "privfl-store/1", "role": ...}``: a folder that is not ours is refused.
``index.jsonl``
    one JSON record per entry (round, parties, kind, tensor shapes/dtypes, scalars, bytes, sha256).
``blobs/<aa>/<sha256>.safetensors``
    the tensors, content-addressed: a head broadcast to ten clients is stored once, and the name is
    the checksum that ``verify`` recomputes. safetensors never unpickles, so a foreign or tampered
    file can at worst fail to parse.

Writes are atomic: a blob is written to a temporary file and ``os.replace``d into place before its
index line is appended, so a killed run leaves at most an unreferenced blob or a partial last line,
both of which :meth:`TensorStore.truncate` (called on ``--resume``) removes.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from privfl.errors import CaptureError

FORMAT = "privfl-store/1"
ROLES = ("capture", "knowledge", "truth")


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


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def tensor_summary(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    return {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in tensors.items()}


def _portable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors needs contiguous CPU tensors that share no storage
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in sorted(tensors.items())}


class TensorStore:
    """One folder of checksummed safetensors blobs plus a JSON-lines index."""

    def __init__(self, root: str | Path, role: str, *, create: bool = False):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        self.root = Path(root)
        self.role = role
        self.index_path = self.root / "index.jsonl"
        manifest = self.root / "manifest.json"
        if create and not manifest.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            atomic_write_text(manifest, json.dumps({"format": FORMAT, "role": role}) + "\n")
            self.index_path.touch()
        self._check_manifest(manifest)
        self._next_seq: int | None = None
        self.partial_tail = False

    def _check_manifest(self, manifest: Path) -> None:
        if not manifest.is_file():
            raise CaptureError(f"{self.root} is not a privfl {self.role} store (no manifest.json)")
        try:
            info = json.loads(manifest.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CaptureError(f"{manifest} is not valid JSON: not a privfl store") from None
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            raise CaptureError(f"{manifest}: unknown store format {info!r}; expected {FORMAT}")
        if info.get("role") != self.role:
            raise CaptureError(f"{self.root} holds {info.get('role')!r}, not {self.role!r}")

    # ------------------------------------------------------------------ writing
    def blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / digest[:2] / f"{digest}.safetensors"

    def append(self, record: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Store ``tensors`` and append ``record`` (plus seq, shapes and checksum) to the index."""
        data = st_save(_portable(tensors))
        digest = hashlib.sha256(data).hexdigest()
        path = self.blob_path(digest)
        if not path.exists():
            atomic_write_bytes(path, data)
        if self._next_seq is None:
            self._next_seq = len(self.records())
        full = {
            "seq": self._next_seq,
            **record,
            "tensors": tensor_summary(tensors),
            "sha256": digest,
            "file_bytes": len(data),
        }
        with open(self.index_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(full, sort_keys=True) + "\n")
        self._next_seq += 1
        return full

    def flush(self) -> None:
        """fsync the index (called once per round, not per message)."""
        with open(self.index_path, "rb") as fh:
            os.fsync(fh.fileno())

    def truncate(self, keep: Callable[[dict[str, Any]], bool]) -> int:
        """Keep the records for which ``keep`` is true (and drop a partial last line); returns how many."""
        kept = [r for r in self.records(strict=False) if keep(r)]
        atomic_write_text(self.index_path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        self._next_seq = len(kept)
        return len(kept)

    # ------------------------------------------------------------------ reading
    def records(self, *, strict: bool = True) -> list[dict[str, Any]]:
        """All committed index records.

        A partial last line (a run killed while appending) was never committed and is skipped; it is
        reported by :meth:`verify` and removed by :meth:`truncate`. Any other bad line is an error
        when ``strict``.
        """
        if not self.index_path.exists():
            raise CaptureError(f"{self.index_path} is missing")
        lines = self.index_path.read_bytes().split(b"\n")
        self.partial_tail = bool(lines[-1])
        out = []
        for n, line in enumerate(lines[:-1], 1):
            try:
                rec = json.loads(line)
                ok = isinstance(rec, dict) and "sha256" in rec and "seq" in rec
            except (json.JSONDecodeError, UnicodeDecodeError):
                ok = False
            if not ok:
                if strict:
                    raise CaptureError(f"{self.index_path}:{n} is not a valid privfl index record")
                continue
            out.append(rec)
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records())

    def load(self, record: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors of ``record``, after checking their checksum (never unpickles)."""
        path = self.blob_path(str(record["sha256"]))
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CaptureError(f"{self.role} file {path} is missing") from None
        if hashlib.sha256(data).hexdigest() != record["sha256"]:
            raise CaptureError(f"checksum mismatch in {path}: the file is corrupt or was modified")
        try:
            return st_load(data)
        except (SafetensorError, ValueError) as exc:
            raise CaptureError(f"{path} is not a valid safetensors file: {exc}") from None

    def verify(self) -> list[str]:
        """Every problem found (empty when the store is intact): checksums, shapes, index syntax."""
        problems: list[str] = []
        try:
            records = self.records()
        except CaptureError as exc:
            return [str(exc)]
        if self.partial_tail:
            problems.append(f"{self.index_path}: partial last record (run killed mid-write; --resume drops it)")
        for rec in records:
            try:
                tensors = self.load(rec)
            except CaptureError as exc:
                problems.append(f"seq {rec['seq']}: {exc}")
                continue
            if tensor_summary(tensors) != rec.get("tensors"):
                problems.append(f"seq {rec['seq']}: tensor names/shapes differ from the index")
        return problems
