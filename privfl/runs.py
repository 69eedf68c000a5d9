"""Run directories: layout, the ``latest`` pointer, and resolving ``--run`` arguments.

``runs/<name>/``: ``config.toml``/``config.json`` (resolved config), ``run.json`` (what was sent and
what an attacker may know), ``metrics.jsonl``/``metrics.csv`` (per round), ``summary.json``,
``partition.json``/``partition.png``, ``checkpoint/`` (latest round only), ``capture/`` (messages),
``knowledge/`` (attacker knowledge), ``truth/`` (ground truth: partition, samples behind messages).
"""

from __future__ import annotations

import os
from pathlib import Path

from privfl.errors import ConfigError

LATEST = "latest"


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


def swap_in_folder(folder: Path, final: Path) -> Path:
    """Replace ``final`` by the finished ``folder`` (a sibling temp dir) so that a killed attack or
    analysis leaves the previous result, never half a new one."""
    import shutil

    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(folder, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(folder, final)
    return final
