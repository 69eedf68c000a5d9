"""Run directories: layout, the ``latest`` pointer, and resolving ``--run`` arguments.

``runs/<name>/``: ``config.toml``/``config.json`` (resolved config), ``run.json`` (what was sent and
what an attacker may know), ``metrics.jsonl``/``metrics.csv`` (per round), ``summary.json``,
``partition.json``/``partition.png``, ``checkpoint/`` (latest round only), ``capture/`` (messages),
``knowledge/`` (attacker knowledge), ``truth/`` (ground truth: partition, samples behind messages).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO

from privfl.errors import ConfigError

LATEST = "latest"
LOCK = ".lock"  # in a run directory: held (flock) by the one process writing the run


def mark_latest(run_dir: Path) -> None:
    """Point ``<out>/latest`` at ``run_dir`` (atomic symlink swap)."""
    link = run_dir.parent / LATEST
    tmp = run_dir.parent / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run_dir.name)
    os.replace(tmp, link)


def latest_target(out_dir: Path) -> str | None:
    """The run name ``<out>/latest`` points at (None when there is no such link)."""
    link = out_dir / LATEST
    return os.readlink(link) if link.is_symlink() else None


def unmark_latest(run_dir: Path, previous: str | None = None) -> None:
    """Undo :func:`mark_latest` for a run this process created and removes: point ``latest`` back at
    ``previous`` (what it pointed at before), or remove it."""
    link = run_dir.parent / LATEST
    if latest_target(run_dir.parent) != run_dir.name:
        return
    if previous is not None and (run_dir.parent / previous).exists():
        tmp = run_dir.parent / f".{LATEST}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(previous)
        os.replace(tmp, link)
    else:
        link.unlink()


def resolve_run(run: str | None, out_dir: str | Path = "runs") -> Path:
    """``None``/``latest`` -> the latest run under ``out_dir``; otherwise a path to a run directory."""
    if run in (None, LATEST):
        link = Path(out_dir) / LATEST
        if not link.exists():
            raise ConfigError(f"no latest run under {out_dir}/ (train one first: python -m privfl.train fedre)")
        path = link.resolve()
    else:
        path = Path(run)
        if not path.exists() and (Path(out_dir) / run).exists():
            path = Path(out_dir) / run
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a privfl run directory (no config.json)")
    return path


def swap_in_folder(folder: Path, final: Path, *, by: str = "privfl") -> Path:
    """Replace ``final`` by the finished ``folder`` (a sibling temp dir) so that a killed attack or
    analysis leaves the previous result, never half a new one.

    ``folder`` gets the :data:`OUTPUT_MARKER` (saying ``by`` wrote it) unless it has one. An existing
    ``final`` is replaced only when it is a privfl output (:func:`check_replaceable`); otherwise this
    is a one-line :class:`ConfigError` and nothing changes. Call :func:`check_replaceable` before the
    work, too, so a refusal comes before minutes of computing and not after."""
    import shutil
    import uuid

    check_replaceable(final)
    if not (folder / OUTPUT_MARKER).exists():
        mark_output(folder, by)
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:12]}")  # a fresh name: never someone's folder
        os.rename(final, old)
        os.replace(folder, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(folder, final)
    return final


#: the file in every output folder privfl writes (attack results, analyses); only such folders are replaced
OUTPUT_MARKER = ".privfl-output.json"


def check_output_name(name: str, what: str = "--name") -> str:
    """An output folder name is one plain path component: no '/' or '\\', not '.', '..' or hidden."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
        raise ConfigError(f"{what} must be a plain folder name (no '/', not '.', '..' or starting with '.'), got {name!r}")
    return name


def output_path(parent: Path, name: str, what: str = "--name") -> Path:
    """``parent/<name>`` for a result privfl is about to write (``RUN/attacks/<name>``, ``RUN/analysis/<name>``):
    ``name`` is one plain component, ``parent`` is not a link (a run someone sent must not redirect our
    writes elsewhere), and an existing folder of that name is a privfl output. One-line ConfigErrors;
    call it before the work."""
    if parent.is_symlink():
        raise ConfigError(f"{parent} is a symbolic link; privfl writes its results into real folders only")
    final = parent / check_output_name(name, what)
    check_replaceable(final)
    return final


def write_output_folder(final: Path, write: Callable[[Path], object], *, by: str) -> Path:
    """Run ``write(folder)`` on a fresh temporary folder beside ``final`` and swap it in whole
    (:func:`swap_in_folder`): a killed attack or analysis leaves the previous result, never half a new
    one. The temporary folder is this call's own, and is all it removes on failure."""
    import shutil
    import tempfile

    check_replaceable(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    try:
        write(folder)
        return swap_in_folder(folder, final, by=by)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # absent after the swap; what a failed write left otherwise


def is_privfl_output(path: Path) -> bool:
    """``path`` is a real folder (not a link) holding the :data:`OUTPUT_MARKER` as a regular file."""
    marker = path / OUTPUT_MARKER
    return path.is_dir() and not path.is_symlink() and marker.is_file() and not marker.is_symlink()


def check_replaceable(final: Path) -> None:
    """A one-line :class:`ConfigError` unless ``final`` is absent or a privfl output that may be replaced."""
    if final.is_symlink():
        raise ConfigError(f"{final} is a symbolic link; privfl replaces only output folders it wrote: remove it or choose another name")
    if final.exists() and not is_privfl_output(final):
        raise ConfigError(
            f"{final} already exists and is not a privfl output (no {OUTPUT_MARKER}); privfl replaces only folders it wrote: "
            "remove it or choose another name"
        )


def mark_output(folder: Path, by: str) -> None:
    """Write the :data:`OUTPUT_MARKER` into ``folder``: what wrote it, and when."""
    import json
    from datetime import datetime, timezone

    info = {"format": "privfl-output/1", "written_by": by, "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    (folder / OUTPUT_MARKER).write_text(json.dumps(info) + "\n")


def _make_folders(folder: Path) -> list[Path]:
    """Create ``folder`` and the missing folders above it; return the ones this call made, deepest first.

    The path is walked top down as given, ``..`` included, and a folder is listed only when its own
    ``mkdir`` succeeded: asking "did it exist?" before creating anything would list ``new/../old``
    while ``new`` is missing, and removing it later would remove ``old``, which was there before."""
    made: list[Path] = []
    for path in reversed([folder, *folder.parents]):
        if path.exists():
            continue
        try:
            os.mkdir(path)
        except FileExistsError:  # another process made it meanwhile: not ours to remove
            continue
        made.append(path)
    return made[::-1]


class RunClaim:
    """Exclusive ownership of a run directory by the one process that writes it.

    A new run's folder is created with one ``mkdir`` (atomic: of two trainings given the same
    ``--run-name`` exactly one gets it); the writer then holds an ``flock`` on ``RUN/.lock`` until it
    ends, so a second ``--resume`` of the same run (or a resume while the training still runs) is a
    one-line error instead of two processes interleaving one capture. The kernel drops the lock when
    the process dies, so a killed run can be resumed at once. ``created`` tells the caller whether
    this invocation created the folder: only then may it remove it on failure.
    """

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.created = False
        #: folders above the run that did not exist and this invocation made (``--out-dir``), deepest first
        self.created_parents: list[Path] = []
        self._fh: IO[str] | None = None

    def acquire(self, *, create: bool) -> None:
        if create:
            self.created_parents = _make_folders(self.run_dir.parent)
            try:
                os.mkdir(self.run_dir)
            except FileExistsError:
                raise ConfigError(
                    f"{self.run_dir} appeared while this run was setting up (another run with the same --run-name?); nothing was written"
                ) from None
            self.created = True
        elif not self.run_dir.is_dir() or self.run_dir.is_symlink():
            raise ConfigError(f"{self.run_dir} is not a run directory")
        import fcntl

        try:
            fd = os.open(self.run_dir / LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as exc:
            raise ConfigError(f"cannot lock {self.run_dir / LOCK}: {exc.strerror}") from None
        fh = os.fdopen(fd, "r+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = fh.read(32).strip() or "?"
            fh.close()
            raise ConfigError(
                f"{self.run_dir} is being written by another privfl process (pid {holder}); wait for it, or stop it and --resume"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        self._fh = fh

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()  # closing drops the flock
            self._fh = None

    def discard(self) -> None:
        """Release, then remove what this claim created: the run folder, and the ``--out-dir`` folders
        above it that did not exist before, each only while it is empty (another process may have put
        a run there meanwhile)."""
        self.release()
        if not self.created:
            return
        shutil.rmtree(self.run_dir, ignore_errors=True)
        for folder in self.created_parents:
            try:
                folder.rmdir()
            except OSError:
                break
