"""The leakage leaderboard: every method trained on one partition, attacked alike, in one table and figure.

    from attacks.leaderboard import leaderboard
    result = leaderboard(["fedavg", "fedre"], seeds=[0, 1, 2], out="runs/leaderboard-quick")
    result.html, result.table["rows"]                  # the sortable page, and the numbers behind it

Each (method, defense, seed) is one *cell*: the method trained with the audit profile's settings on the
same data, subsample, partition and client count as every other cell of that seed (heterogeneous methods
on the model group, methods that need one architecture on its homogeneous counterpart, the audit's rule
:func:`attacks.audit.model_group_for`), then attacked by every registered attack that applies, at the
audit's rounds. A cell writes its own audit report (``cells/<cell>/report.html``) and, last,
``cell.json``, which names the cell's *key*: a SHA-256 over the method (and the source of its class),
its defenses, every run option, the profile's attack budgets, the dataset's contents, the seed, the
device type and the source of privfl itself. A killed leaderboard run again with the same ``out``
reuses every cell whose key matches and continues the others (a half-trained run resumes from its
last round); a cell whose key does not match is never read, so a changed setting or changed code
cannot leave a stale number in the table.

:mod:`attacks.leaderboard_report` aggregates the cells over seeds (mean and a 95 % interval per cell),
ranks methods only where intervals separate, and writes ``leaderboard.json`` / ``.csv`` / ``.html``
and the privacy-utility frontier.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any

from attacks.audit import (
    PROFILES,
    SHARED_OPTIONS,
    JobSettings,
    Profile,
    Subject,
    Workers,
    attack_run,
    audited_rounds,
    model_group_for,
)
from attacks.leaderboard_report import Cell, CellResult, LeaderboardResult, write_leaderboard
from privfl.capture.store import atomic_write_text
from privfl.errors import ConfigError, PrivflError

CELL_FORMAT = "privfl-leaderboard-cell/1"
#: the folder's marker: a leaderboard continues only in a folder it made
MARKER = "leaderboard-folder.json"
#: packages whose source is part of every cell's key (a change to any of them recomputes the cells)
CODE_PACKAGES = ("privfl", "attacks", "defenses")
#: files left out of that: they orchestrate and render the leaderboard, and what they hand a cell (its
#: run options, the profile) is in the key itself; a fix to the table's page keeps the trained cells
KEY_EXEMPT = frozenset({"attacks/leaderboard.py", "attacks/leaderboard_report.py", "privfl/audit.py"})


# ------------------------------------------------------------------------------------------ keys
def _sha256_files(paths: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.name).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def code_fingerprint() -> str:
    """SHA-256 of privfl's own source (the packages in :data:`CODE_PACKAGES`): a code change is a new key."""
    import importlib

    h = hashlib.sha256()
    for name in CODE_PACKAGES:
        root = Path(importlib.import_module(name).__file__ or "").parent
        for p in sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts):
            name = p.relative_to(root.parent).as_posix()  # relative: a moved checkout keeps its keys
            if name not in KEY_EXEMPT:
                h.update(name.encode())
                h.update(p.read_bytes())
    return h.hexdigest()


def method_fingerprint(method: str) -> str:
    """SHA-256 of the file that defines the method's class (a plug-in method's edits are a new key too)."""
    import inspect

    from privfl.methods import resolve_method

    source = inspect.getsourcefile(resolve_method(method))
    return _sha256_files([Path(source)]) if source else ""


def data_fingerprint(dataset: str, data_root: str | None) -> str:
    """SHA-256 of the dataset's images and labels as privfl loads them (not of file names or dates)."""
    from privfl.data import load_dataset

    ds = load_dataset(dataset, data_root)
    h = hashlib.sha256()
    h.update(ds.images.numpy().tobytes())
    h.update(ds.labels.numpy().tobytes())
    return h.hexdigest()


def cell_key(cell: Cell, profile: Profile, *, data: str, code: str, device_type: str) -> str:
    """The content hash a finished cell is stored under (see the module docstring)."""
    values = {k: v for k, v in cell.values.items() if k not in ("device", "progress", "out_dir", "run_name")}
    content = {
        "format": CELL_FORMAT,
        "method": cell.method,
        "method_source": method_fingerprint(cell.method),
        "defenses": list(cell.defenses),
        "seed": cell.seed,
        "values": values,
        "profile": {"train": profile.train, "attack_clients": profile.attack_clients, "attack_options": profile.attack_options,
                    "max_targets": profile.max_targets},
        "data": data,
        "code": code,
        "device": device_type,
    }  # fmt: skip
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()


# ------------------------------------------------------------------------------------------ the plan
def all_methods() -> list[str]:
    """Every registered method, in the registry's order."""
    from privfl.methods import METHODS

    return list(METHODS.names())


def _config_default(name: str) -> Any:
    from privfl.config import TrainConfig

    for f in dataclasses.fields(TrainConfig):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    raise KeyError(name)


def cell_values(method: str, seed: int, profile: Profile, train_options: dict[str, Any], device: str, data_root: str | None) -> dict[str, Any]:
    """The run options of one cell. The data, partition and training size are the same for every method:
    a method's own quick defaults (``Options.run_defaults``) keep only its method options, and the shared
    options it overrides go back to the run's defaults (FedFed's 3,000-sample default would otherwise be
    another partition). The model group follows the audit's rule."""
    from privfl.methods import resolve_method

    own = dict(getattr(resolve_method(method).Options, "run_defaults", {}))
    values: dict[str, Any] = {k: v for k, v in own.items() if k not in SHARED_OPTIONS and k != "model_group"}
    for k in own:
        if k in SHARED_OPTIONS or k == "model_group":
            values[k] = _config_default(k)
    values.update(profile.train)
    values.update(train_options)
    values["seed"] = seed
    values["device"] = device
    if data_root is not None:
        values["data_root"] = data_root
    values.setdefault("knowledge_rounds", ",".join(map(str, audited_rounds(int(values.get("rounds", _config_default("rounds")))))))
    values["model_group"] = model_group_for(method, values)
    return values


def plan(
    methods: Sequence[str],
    seeds: Sequence[int],
    defenses: Sequence[str],
    profile: Profile,
    *,
    train_options: dict[str, Any],
    device: str,
    data_root: str | None,
) -> tuple[list[Cell], list[str]]:
    """Every cell, keyed, and notes on the defended variants left out (a defense that touches none of a
    method's messages would only repeat the undefended row); every name and option is checked before
    anything is created (one-line errors)."""
    from privfl.config import build_config
    from privfl.engine import resolve_device
    from privfl.methods import check_method_class, resolve_method

    if not methods:
        raise ConfigError("no method to put on the leaderboard: give --all or --methods a,b,c")
    if len(set(methods)) != len(methods):
        raise ConfigError(f"--methods names a method twice: {', '.join(m for m in dict.fromkeys(methods) if list(methods).count(m) > 1)}")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError("--seeds needs distinct integers, e.g. --seeds 0,1,2")
    from defenses import parse_defense

    parsed = {spec: parse_defense(spec) for spec in defenses}
    cells: list[Cell] = []
    notes: list[str] = []
    for method in methods:
        cls = resolve_method(method)
        check_method_class(cls)
        variants: list[tuple[str, ...]] = [()]
        for spec, defense in parsed.items():
            touched = [k for k, where in cls.sends.items() if k in defense.kinds and set(str(where).split("/")) & set(defense.directions)]
            if touched:
                variants.append((spec,))
            else:
                notes.append(f"{method} + {spec}: left out, the defense touches none of what {method} sends ({', '.join(cls.sends) or 'nothing'})")
        for seed in seeds:
            values = cell_values(method, seed, profile, train_options, device, data_root)
            build_config({**values, "method": method, "defense": []}, cls.Options)  # a bad option is one line, now
            for variant in variants:
                cells.append(Cell(method, variant, seed, values))

    def data_of(c: Cell) -> tuple[str, str | None]:
        return str(c.values.get("dataset", _config_default("dataset"))), c.values.get("data_root")

    prints = {d: data_fingerprint(*d) for d in {data_of(c) for c in cells}}
    code = code_fingerprint()
    device_type = resolve_device(device).type
    keyed = [dataclasses.replace(c, key=cell_key(c, profile, data=prints[data_of(c)], code=code, device_type=device_type)) for c in cells]
    return keyed, notes


# ------------------------------------------------------------------------------------------ one cell
def _partition_hash(run_dir: Path) -> str:
    """The clients' class counts and split sizes (what makes the partition), hashed."""
    try:
        p = json.loads((run_dir / "partition.json").read_text())
    except (OSError, ValueError):
        return ""
    keep = {k: p.get(k) for k in ("scheme", "counts", "train_sizes", "test_sizes")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()


def _trained(run_dir: Path, values: dict[str, Any], method: str, defenses: Sequence[str], progress: bool) -> float:
    """Train the cell's run into ``run_dir``, or continue it: a run killed after its first round resumes
    where it stopped; one killed before any round was saved is moved aside (``run.incomplete-N``, kept)
    and trained anew. Returns the seconds spent here."""
    import privfl.train as train_module
    from privfl.config import build_config
    from privfl.methods import resolve_method

    start = time.perf_counter()
    if (run_dir / "summary.json").is_file():
        return 0.0
    if (run_dir / "config.json").is_file():
        saved = json.loads((run_dir / "config.json").read_text())
        saved["progress"] = progress
        cfg = build_config(saved, resolve_method(method).Options)
        try:
            train_module.resume(run_dir, cfg)
            return time.perf_counter() - start
        except PrivflError:
            pass  # nothing to resume from: train it again beside the remains
    if run_dir.exists():
        n = 1
        while (aside := run_dir.with_name(f"{run_dir.name}.incomplete-{n}")).exists():
            n += 1
        run_dir.rename(aside)
    train_module.train({**values, "method": method, "defense": list(defenses), "out_dir": str(run_dir.parent),
                        "run_name": run_dir.name, "progress": progress})  # fmt: skip
    return time.perf_counter() - start


def run_cell(
    cell: Cell,
    folder: str | Path,
    profile: Profile,
    settings: JobSettings,
    *,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
) -> CellResult:
    """Train (or continue) and attack one cell in ``folder``, write its audit report and, last, ``cell.json``.
    Runs in a worker process, too; a finished cell with the same key is read, not recomputed."""
    from attacks.audit_report import write_audit
    from privfl.run import Run

    folder = Path(folder)
    result = CellResult(cell, folder=str(folder))
    done = folder / "cell.json"
    if done.is_file():
        return read_cell(cell, folder)
    folder.mkdir(parents=True, exist_ok=True)
    run_dir = folder / "run"
    try:
        result.train_seconds = _trained(run_dir, cell.values, cell.method, cell.defenses, progress)
        subject = Subject("defended" if cell.defenses else "audited", cell.method, list(cell.defenses), run=Run(run_dir),
                          train_seconds=result.train_seconds)  # fmt: skip
        start = time.perf_counter()
        attack_run(subject, profile, dataclasses.replace(settings, seed=cell.seed), progress=progress, log=log or (lambda _: None))
        result.attack_seconds = time.perf_counter() - start
        write_audit(folder, [subject], profile, seconds=result.train_seconds + result.attack_seconds, seed=cell.seed)
    except PrivflError as exc:
        result.error = str(exc)
        return result
    summary = json.loads((run_dir / "summary.json").read_text())
    record = {
        "format": CELL_FORMAT,
        "key": cell.key,
        "method": cell.method,
        "defenses": list(cell.defenses),
        "seed": cell.seed,
        "values": {k: v for k, v in cell.values.items() if k != "progress"},
        "model_group": str(json.loads((run_dir / "config.json").read_text()).get("model_group", "")),
        "partition": _partition_hash(run_dir),
        "accuracy_personal": summary.get("final_acc_personal"),
        "personal_differs": "final_acc_personal" in summary,
        "train_seconds": round(result.train_seconds, 2),
        "attack_seconds": round(result.attack_seconds, 2),
        "report": "report.json",
    }
    atomic_write_text(done, json.dumps(record, indent=2, default=str) + "\n")
    out = read_cell(cell, folder)  # reads the report back through read_report, which validates it
    out.reused = False
    return out


def read_cell(cell: Cell, folder: Path) -> CellResult:
    """A finished cell from its ``cell.json`` and ``report.json``; a key that does not match is refused
    (the folder name carries the key, so this means the files were changed or moved)."""
    from attacks.audit_report import read_report

    try:
        record = json.loads((folder / "cell.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {folder / 'cell.json'}: {exc}") from None
    if record.get("format") != CELL_FORMAT or record.get("key") != cell.key:
        raise ConfigError(f"{folder / 'cell.json'} is not the cell {cell.label} seed {cell.seed} (its key differs): move the folder away")
    report = read_report(folder / str(record.get("report", "report.json")))
    return CellResult(
        cell,
        entry=report["methods"][0],
        accuracy_personal=record.get("accuracy_personal"),
        personal_differs=bool(record.get("personal_differs")),
        partition=str(record.get("partition", "")),
        model_group=str(record.get("model_group", "")),
        train_seconds=float(record.get("train_seconds", 0.0)),
        attack_seconds=float(record.get("attack_seconds", 0.0)),
        reused=True,
        folder=str(folder),
    )


def _cell_in_worker(cell: Cell, folder: str, profile: Profile, settings: JobSettings) -> CellResult:
    try:
        return run_cell(cell, folder, profile, settings)
    except Exception as exc:  # a method's own bug: that cell is missing and says why, the others go on
        if isinstance(exc, ConfigError) and "key differs" in str(exc):
            raise
        return CellResult(cell, error=f"failed: {type(exc).__name__}: {exc}", folder=folder)


# ------------------------------------------------------------------------------------------ the whole
INVOCATIONS = "invocations.jsonl"


def _log_event(out: Path, event: dict[str, Any]) -> None:
    """One line of ``invocations.jsonl``: when each invocation started, finished a cell, ended. A killed
    invocation has no end; its wall time counts until its last finished cell."""
    with open(out / INVOCATIONS, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(event) + "\n")


def invocation_times(out: Path) -> list[dict[str, Any]]:
    """Per invocation of the leaderboard in ``out``: its start, its wall seconds, the cells it finished, whether it ended."""
    found: dict[str, dict[str, Any]] = {}
    try:
        lines = (out / INVOCATIONS).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if not isinstance(e, dict) or "id" not in e or "t" not in e:
            continue
        inv = found.setdefault(str(e["id"]), {"started": e["t"], "last": e["t"], "cells": 0, "ended": False})
        inv["last"] = max(inv["last"], e["t"])
        inv["cells"] += e.get("event") == "cell"
        inv["ended"] |= e.get("event") == "end"
    return [{"started": v["started"], "seconds": round(v["last"] - v["started"], 1), "cells": v["cells"], "ended": v["ended"]}
            for v in found.values()]  # fmt: skip


def _claim(out: Path) -> tuple[Any, bool]:
    """Take the leaderboard folder: made here, or one a leaderboard made before (its marker), never
    another folder. An flock keeps a second leaderboard out of it while this one runs."""
    from privfl.runs import RunClaim

    marker = out / MARKER
    if out.exists():
        if not out.is_dir():
            raise ConfigError(f"--out {out} is a file, not a leaderboard folder")
        if any(out.iterdir()) and not marker.is_file():
            raise ConfigError(f"--out {out} is not empty and is not a leaderboard folder: give a new folder, or the one a leaderboard wrote")
    claim = RunClaim(out)
    claim.acquire(create=not out.exists())
    if not marker.is_file():
        atomic_write_text(marker, json.dumps({"format": "privfl-leaderboard-folder/1"}) + "\n")
    return claim, claim.created


def leaderboard(
    methods: Sequence[str] | None = None,
    *,
    seeds: Sequence[int] = (0,),
    defenses: Sequence[str] = (),
    profile: str | Profile = "quick",
    out: str | Path = "runs/leaderboard-quick",
    device: str = "auto",
    train_options: dict[str, Any] | None = None,
    data_root: str | None = None,
    workers: Workers | int = 1,
    deterministic: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> LeaderboardResult:
    """Train and attack every cell (``methods`` x defended variants x ``seeds``) not already done in
    ``out``, then write the leaderboard. ``methods=None`` is every registered method."""
    prof = profile if isinstance(profile, Profile) else PROFILES.get(profile)
    if prof is None:
        raise ConfigError(f"unknown profile {profile!r}; accepted: {', '.join(PROFILES)}")
    pool = workers if isinstance(workers, Workers) else Workers(int(workers))
    options = dict(train_options or {})
    if deterministic:
        options["deterministic"] = True
    names = list(methods) if methods is not None else all_methods()
    start = time.perf_counter()
    cells, notes = plan(names, list(seeds), list(defenses), prof, train_options=options, device=device, data_root=data_root)
    out = Path(out)
    claim, created = _claim(out)
    invocation = f"{os.getpid()}-{time.time():.0f}"
    _log_event(out, {"id": invocation, "t": time.time(), "event": "start", "cells": len(cells)})
    try:
        settings = JobSettings(0, device, deterministic or bool(options.get("deterministic")), data_root)
        results = _run_cells(cells, out, prof, settings, pool, progress=progress, log=log,
                             on_cell=lambda c: _log_event(out, {"id": invocation, "t": time.time(), "event": "cell", "key": c.key}))  # fmt: skip
        _log_event(out, {"id": invocation, "t": time.time(), "event": "end"})
        seconds = time.perf_counter() - start
        first = cells[0].values if cells else {}
        setting = {k: first.get(k, _config_default(k)) for k in ("dataset", "subsample", "num_clients", "partition", "alpha", "rounds")}
        if setting["partition"] != "dir":
            setting["alpha"] = None
        table, paths = write_leaderboard(out, results, prof, seeds=list(seeds), defenses=list(defenses), wall_seconds=seconds,
                                         workers=pool, device=device, train_options=options, notes=notes, setting=setting,
                                         invocations=invocation_times(out))  # fmt: skip
        return LeaderboardResult(table, out, *paths, results)
    except BaseException:
        if created and not any((out / "cells").glob("*/cell.json")) and not any((out / "cells").glob("*/run")):
            shutil.rmtree(out, ignore_errors=True)  # made here, nothing trained into it: no empty folder left behind
        raise
    finally:
        claim.release()


def _run_cells(
    cells: list[Cell],
    out: Path,
    prof: Profile,
    settings: JobSettings,
    pool: Workers,
    *,
    progress: bool,
    log: Callable[[str], None],
    on_cell: Callable[[Cell], None] = lambda _: None,
) -> list[CellResult]:
    """Every cell, reusing the finished ones, in the plan's order whatever order they finish in."""
    from tqdm import tqdm

    folders = {c: out / "cells" / c.folder_name for c in cells}
    results: dict[Cell, CellResult] = {}
    for c in cells:
        if (folders[c] / "cell.json").is_file():
            results[c] = read_cell(c, folders[c])
    todo = [c for c in cells if c not in results]
    log(f"leaderboard: {len(cells)} cells ({len(results)} already done in {out}, {len(todo)} to train and attack)"
        + (f"; {pool.count} workers, {pool.threads_each()} torch thread(s) each" if pool.count > 1 and todo else ""))  # fmt: skip
    bar = tqdm(total=len(todo), desc="cells", unit="cell", disable=not progress or not todo, dynamic_ncols=True)

    def finished(r: CellResult) -> None:
        results[r.cell] = r
        bar.update(1)
        if not r.error:
            on_cell(r.cell)
        if r.error:
            log(f"  {r.cell.label} seed {r.cell.seed}: {r.error}")
        else:
            acc = ((r.entry or {}).get("accuracy") or {}).get("final")
            leaks = ", ".join((r.entry or {}).get("privacy", {}).get("leaks", [])) or "nothing beyond the prior"
            accuracy = f"accuracy {100 * acc:.2f} %" if acc is not None else "no accuracy"
            took = f"{r.train_seconds:.0f} s training, {r.attack_seconds:.0f} s attacks"
            log(f"  {r.cell.label} seed {r.cell.seed}: {accuracy}, leaks {leaks} ({took})")

    try:
        if pool.count > 1 and len(todo) > 1:
            with pool.pool() as executor:
                futures: dict[Future[CellResult], Cell] = {executor.submit(_cell_in_worker, c, str(folders[c]), prof, settings): c for c in todo}
                pending = set(futures)
                while pending:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for f in done:
                        finished(f.result())
        else:
            threads = pool.threads if pool.threads else 0
            if threads:
                import torch

                torch.set_num_threads(threads)
            for c in todo:
                bar.set_postfix_str(f"{c.label} seed {c.seed}")
                try:
                    finished(run_cell(c, folders[c], prof, settings, progress=False))
                except (ConfigError, KeyboardInterrupt):
                    raise
                except Exception as exc:
                    finished(CellResult(c, error=f"failed: {type(exc).__name__}: {exc}", folder=str(folders[c])))
    finally:
        bar.close()
    return [results[c] for c in cells]


__all__ = ["Cell", "CellResult", "LeaderboardResult", "all_methods", "cell_key", "leaderboard", "plan", "run_cell"]
