"""Paper tables from privfl runs: the machinery shared by ``experiments/papers/*/table1.py`` and ``toy2d.py``.

A :class:`Table` is a list of :class:`Row` s (the paper's row label, the privfl method, its options and
the paper's own numbers) and one base configuration. :func:`run_table` trains every row on every seed
of the table, one run after the other in this process (``privfl.train.train_config``), so every row of a
seed sees the same data, partition and client split (they are drawn from the seed). It then reports
per row, as mean ± std over the seeds (population std, ``np.std`` as PFLlib prints it):

- accuracy under both evaluation protocols (``--eval both``; README "Training"), each the sample-weighted
  mean over the clients' test splits: **global** (each client's model with the latest global part it
  received, HtFLlib's protocol and the FedRE tables') and **personal** (with its own parts after its
  last local training), at the final round and at the best round;
- communication per round, paper-style (labels and class ids left out, as the papers count) in units
  of 10³ scalars: the upload total over clients and the broadcast total (per-client payload × clients),
  from the run's ``summary.json`` (``per_round``);
- training seconds per round (the engine's per-round time: local training, server step, evaluation).

Beside each row stand the paper's printed values where there are some (``Row.paper``). The table is
printed, and written under ``--out`` as ``table.json`` (protocol, per-seed values, aggregates),
``table.csv`` and ``table.md``, rewritten after every run so a table cut short shows what is done.

Runs live in ``OUT/runs/<row>-s<seed>`` and the table is resumable: a run folder with ``summary.json``
is read, not trained again (the progress line says so); one that has a ``config.json`` but no summary
(killed mid-run) is continued with ``privfl.train.resume`` from its last complete round. A folder
trained with other settings is refused (one line naming the settings that differ), never mixed in.

A row whose method is not registered (``privfl.methods.METHODS``) stops the table before any training
with one line naming every such row and method (exit status 2); with ``--skip-missing`` those rows are
left out and the line says which. A row that fails while training (bad settings for that method, or a
bug) is reported in one line and marked failed; the other rows go on, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import importlib
import json
import math
import pkgutil
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from privfl.config import TrainConfig, build_config
from privfl.errors import ConfigError, DataMissingError, PartitionError, PrivflError

#: accuracy keys of summary.json: (protocol, when) -> key
ACC_KEYS: dict[tuple[str, str], str] = {
    ("global", "final"): "final_acc",
    ("global", "best"): "best_acc",
    ("personal", "final"): "final_acc_personal",
    ("personal", "best"): "best_acc_personal",
}
#: DRDFL's metrics (``--global-test``; unweighted means over clients): summary keys, and the mean of the
#: last ``LAST_K`` rounds read from metrics.jsonl (DRDFL Fig. 6 reports "the average of the last 10 rounds")
LAST_K = 10
T_KEYS: tuple[str, ...] = tuple(
    f"{when}_{metric}{suffix}" for suffix in ("", "_personal") for metric in ("local_t", "global_t") for when in ("final", f"last{LAST_K}")
)
#: every per-run value a table reports in % (mean ± std over seeds)
PCT_KEYS: tuple[str, ...] = (*ACC_KEYS.values(), *T_KEYS)
#: settings that do not change what a run computes (a finished run is read whatever they were)
NEUTRAL_KEYS = frozenset({"device", "progress", "out_dir", "run_name", "capture", "knowledge_every", "knowledge_rounds", "data_root", "download"})
_TRAIN_KEYS = frozenset(f.name for f in dataclasses.fields(TrainConfig))

Log = Callable[[str], None]


class TableError(ConfigError):
    """A refusal of the table itself (a run folder made with other settings): stops the table, one line, status 2."""


def say(line: str) -> None:
    print(line, flush=True)


@dataclass(frozen=True)
class Row:
    """One row of a paper table.

    ``options``: run settings (TrainConfig keys) and method options, flat (or method options under
    ``"options"``), applied on top of the table's base; a method option the method does not take is
    reported and left out. ``paper``: the paper's values for this row in the table's setting:
    ``acc`` (text as printed, e.g. ``"80.90±0.17"``), ``up`` and ``bc`` (×10³ scalars per round).
    """

    label: str
    method: str
    options: Mapping[str, Any] = field(default_factory=dict)
    paper: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9]+", "-", self.label).strip("-").lower() or self.method


@dataclass
class Table:
    """Rows trained on one base configuration and one seed list; ``paper_acc`` / ``paper_comm`` say
    which of the paper's columns the rows' ``paper`` values come from ("" when the paper has none)."""

    name: str
    title: str
    rows: list[Row]
    base: dict[str, Any]
    seeds: list[int]
    paper_acc: str = ""
    paper_comm: str = ""
    notes: list[str] = field(default_factory=list)
    setting: str = ""  # one line saying what the base configuration is
    #: (header, key) of the accuracy columns; keys from PCT_KEYS (default: both protocols, final and best)
    columns: Sequence[tuple[str, str]] = ()
    #: communication as "up/bc" (×10³ scalars, the FedRE/FedMRL tables) or "total" (upload + broadcast + peer,
    #: M scalars per round, DRDFL's #Comm)
    comm: str = "up/bc"
    #: (header, row.paper key) of paper columns shown after ours (default: the paper's accuracy, ``paper_acc``)
    paper_columns: Sequence[tuple[str, str]] = ()
    #: replaces the accuracy line of the legend (what the columns are)
    accuracy_legend: str = ""
    #: lines computed from the aggregated rows (e.g. the paper's "FedMRL - best baseline" row), shown under the table
    summarize: Callable[[Sequence[Mapping[str, Any]]], list[str]] | None = None

    def footer(self, aggs: Sequence[Mapping[str, Any]]) -> list[str]:
        return [*legend(self), *self.notes, *(self.summarize(aggs) if self.summarize is not None and aggs else [])]


# ------------------------------------------------------------------------------------------ methods


def registered_methods() -> tuple[set[str], dict[str, str]]:
    """Names in ``privfl.methods.METHODS`` and, if a method module fails to import (being edited, say),
    which ones and why: the others are still found."""
    import privfl.methods as package
    from privfl.methods import METHODS

    broken: dict[str, str] = {}
    try:
        return set(METHODS.names()), broken
    except Exception:  # one module's import error stops the registry's discovery: import the rest one by one
        for info in pkgutil.iter_modules(package.__path__):
            if info.name.startswith("_") or f"privfl.methods.{info.name}" in sys.modules:
                continue
            try:
                importlib.import_module(f"privfl.methods.{info.name}")
            except Exception as exc:
                broken[info.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        return set(METHODS.names()), broken


def select_rows(rows: Sequence[Row], selection: str | None) -> list[Row]:
    """``--methods a,b``: the rows named by method or by label (case-insensitive), in table order."""
    if not selection:
        return list(rows)
    wanted = [s.strip().lower() for s in selection.split(",") if s.strip()]
    known = {r.method.lower() for r in rows} | {r.label.lower() for r in rows} | {r.slug for r in rows}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        accepted = ", ".join(f"{r.method} ({r.label})" if r.method.lower() != r.label.lower() else r.method for r in rows)
        raise ConfigError(f"--methods names rows this table does not have: {', '.join(unknown)}; its rows: {accepted}")
    return [r for r in rows if {r.method.lower(), r.label.lower(), r.slug} & set(wanted)]


def check_methods(rows: Sequence[Row], skip_missing: bool, log: Log = say) -> list[Row]:
    """The rows whose methods are registered; a ConfigError (one line, exit 2) naming the others unless
    ``skip_missing``, which leaves them out and says so."""
    names, broken = registered_methods()
    missing = [r for r in rows if r.method not in names and ":" not in r.method]
    if not missing:
        return list(rows)
    listed = ", ".join(f"{r.label} ({r.method})" for r in missing)
    why = "; ".join(f"privfl/methods/{m}.py does not import ({e})" for m, e in broken.items())
    if not skip_missing:
        raise ConfigError(
            f"method(s) not registered for row(s) {listed}{'; ' + why if why else ''}; "
            f"registered: {', '.join(sorted(names))}; --skip-missing leaves such rows out"
        )
    log(f"skipped (method not registered): {listed}{'; ' + why if why else ''}")
    return [r for r in rows if r not in missing]


# ------------------------------------------------------------------------------------------ one run


def run_values(table: Table, row: Row, seed: int, run_dir: Path, log: Log = say) -> dict[str, Any]:
    """The flat config of ``row`` at ``seed``: base, then the row's options; method options the method
    does not take are reported and dropped (a method still being written may not have them yet)."""
    from privfl.methods import resolve_method

    options_cls = getattr(resolve_method(row.method), "Options", None)
    accepted = {f.name for f in dataclasses.fields(options_cls)} if options_cls is not None else set()
    values = {k: v for k, v in table.base.items() if k != "options"}
    method_opts: dict[str, Any] = {}
    for key, value in row.options.items():
        if key == "options":
            method_opts.update(value)
        elif key in _TRAIN_KEYS:
            values[key] = value
        else:
            method_opts[key] = value
    dropped = sorted(set(method_opts) - accepted)
    if dropped:
        log(f"  note: {row.method} takes no option(s) {', '.join(dropped)} (its options: {', '.join(sorted(accepted)) or 'none'}); left out")
    values.update(
        method=row.method,
        seed=seed,
        out_dir=str(run_dir.parent),
        run_name=run_dir.name,
        progress=False,
        options={k: v for k, v in method_opts.items() if k in accepted},
    )
    return values


def _differences(saved: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(saved) | set(wanted)):
        if key in NEUTRAL_KEYS:
            continue
        a, b = saved.get(key), wanted.get(key)
        if key == "options":  # the method options that differ (a method's default may have changed since)
            a = {k: v for k, v in (a or {}).items() if v is not None}
            b = {k: v for k, v in (b or {}).items() if v is not None}
            out += [f"option {k}: {a.get(k)!r} there, {b.get(k)!r} here" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            out.append(f"{key}: {a!r} there, {b!r} here")
    return out


def train_or_read(values: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(summary, status): read a finished run, continue a killed one, or train it; status says which."""
    import privfl.train as training
    from privfl.methods import resolve_method
    from privfl.run import Run

    cfg = build_config(values, getattr(resolve_method(values["method"]), "Options", None))
    run_dir = Path(cfg.out_dir) / str(cfg.run_name)
    if (run_dir / "config.json").is_file():
        saved = Run(run_dir).config
        diff = _differences(saved, dataclasses.asdict(cfg))
        if diff:
            raise TableError(f"{run_dir} was trained with other settings ({'; '.join(diff[:4])}): use another --out, or delete that folder")
        if (run_dir / "summary.json").is_file():
            return Run(run_dir).summary, "read"
        resumed = build_config({**saved, "device": cfg.device, "progress": False}, getattr(resolve_method(saved["method"]), "Options", None))
        return training.resume(run_dir, resumed).summary, "resumed"
    if run_dir.exists():
        raise TableError(f"{run_dir} exists but holds no run (no config.json): delete it to train this row again")
    return training.train_config(cfg).summary, "trained"


def record_of(summary: Mapping[str, Any]) -> dict[str, Any]:
    """What a table keeps of one run's summary (accuracies as fractions, communication in scalars)."""
    rounds = max(int(summary.get("rounds", 0)), 1)
    per_round = summary.get("per_round", {})
    rec: dict[str, Any] = {key: summary.get(key) for key in ACC_KEYS.values()}
    rec.update(_t_metrics(summary))
    rec.update(
        {
            "final_acc_std_clients": summary.get("final_acc_std"),
            "rounds": summary.get("rounds"),
            "upload_scalars": per_round.get("upload_scalars"),
            "broadcast_scalars": per_round.get("broadcast_scalars"),
            "upload_scalars_full": per_round.get("upload_scalars_full"),
            "broadcast_scalars_full": per_round.get("broadcast_scalars_full"),
            "upload_bytes": per_round.get("upload_bytes"),
            "broadcast_bytes": per_round.get("broadcast_bytes"),
            "peer_scalars": per_round.get("peer_scalars"),
            "seconds_per_round": summary.get("train_seconds", 0.0) / rounds,
            "run_dir": summary.get("run_dir"),
        }
    )
    return rec


def _t_metrics(summary: Mapping[str, Any]) -> dict[str, Any]:
    """Local-T/Global-T of a ``--global-test`` run: the final round's (summary.json) and the mean of the
    last ``LAST_K`` rounds (metrics.jsonl); empty for a run without them."""
    out: dict[str, Any] = {k: summary[k] for k in T_KEYS if k in summary}
    if not out or not summary.get("run_dir"):
        return out
    path = Path(str(summary["run_dir"])) / "metrics.jsonl"
    if not path.is_file():
        return out
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][-LAST_K:]
    for key in {k.split("_", 1)[1] for k in T_KEYS}:
        vals = [r[key] for r in rows if key in r]
        if vals:
            out[f"last{LAST_K}_{key}"] = sum(vals) / len(vals)
    return out


# ------------------------------------------------------------------------------------------ the table


def run_table(table: Table, out: Path, *, skip_missing: bool = False, log: Log = say) -> dict[str, Any]:
    """Train (or read) every row at every seed, then aggregate; writes and returns the result.

    ``result["failed"]`` counts the runs that failed (each reported in one line as it happened)."""
    rows = check_methods(table.rows, skip_missing, log)
    skipped = [r for r in table.rows if r not in rows]
    if not rows:
        raise ConfigError("no row of the table is left to train")
    out.mkdir(parents=True, exist_ok=True)
    runs_dir = out / "runs"
    per_seed: dict[str, dict[int, dict[str, Any]]] = {r.label: {} for r in rows}
    total, done, failed = len(rows) * len(table.seeds), 0, 0
    started, cpu_started = time.perf_counter(), time.process_time()
    log(f"{table.title}: {len(rows)} rows x {len(table.seeds)} seeds ({', '.join(map(str, table.seeds))}) -> {out}")
    for seed in table.seeds:  # seed-major: a table cut short has every row at the first seeds
        for row in rows:
            done += 1
            head = f"[{done}/{total}] {row.label} ({row.method}) seed {seed}"
            run_dir = runs_dir / f"{row.slug}-s{seed}"
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                summary, status = train_or_read(run_values(table, row, seed, run_dir, log))
            except (TableError, DataMissingError, PartitionError):
                raise  # the same for every row (data, partition) or a folder we refuse to mix in: stop with one line
            except Exception as exc:  # this row's method refused the settings, or has a bug: the other rows go on
                failed += 1
                text = str(exc) if isinstance(exc, PrivflError) else f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                per_seed[row.label][seed] = {"status": f"failed: {text}"}
                log(f"{head}: FAILED: {text}")
                continue
            finally:
                gc.collect()
            rec = record_of(summary)
            rec["status"] = status
            rec["wall_seconds"] = round(time.perf_counter() - t0, 2)
            rec["cpu_seconds"] = round(time.process_time() - c0, 2)  # this process's CPU time: the wall time on an idle machine
            per_seed[row.label][seed] = rec
            what = {
                "trained": f"trained in {rec['wall_seconds']:.1f} s",
                "resumed": f"continued a killed run, {rec['wall_seconds']:.1f} s",
                "read": f"read {run_dir}/summary.json (already trained, not retrained)",
            }[status]
            log(
                f"{head}: {what}; final acc {_pct(rec['final_acc'])} global / {_pct(rec['final_acc_personal'])} personal, "
                f"up {_e3(rec['upload_scalars'])} bc {_e3(rec['broadcast_scalars'])} (x10^3 scalars/round), {rec['seconds_per_round']:.2f} s/round"
            )
            write_outputs(table, rows, skipped, per_seed, out, time.perf_counter() - started, time.process_time() - cpu_started)
    result = write_outputs(table, rows, skipped, per_seed, out, time.perf_counter() - started, time.process_time() - cpu_started)
    result["failed"] = failed
    return result


def _mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return None, None
    mean = sum(vals) / len(vals)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))


def aggregate(row: Row, runs: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """Mean ± std over the seeds that finished (accuracies in %, communication in 10³ scalars)."""
    ok = [r for r in runs.values() if not str(r.get("status", "")).startswith("failed")]
    agg: dict[str, Any] = {"label": row.label, "method": row.method, "seeds_done": len(ok), "seeds_failed": len(runs) - len(ok)}
    for key in PCT_KEYS:
        mean, std = _mean_std([r.get(key) for r in ok])
        agg[key] = None if mean is None else round(100 * mean, 2)
        agg[f"{key}_std"] = None if std is None else round(100 * std, 2)
    for key in ("upload_scalars", "broadcast_scalars", "upload_scalars_full", "broadcast_scalars_full", "peer_scalars"):
        mean, _ = _mean_std([r.get(key) for r in ok])
        agg[key.replace("_scalars", "_e3")] = None if mean is None else round(mean / 1e3, 2)
    totals = [sum(float(r.get(k) or 0.0) for k in ("upload_scalars", "broadcast_scalars", "peer_scalars")) for r in ok]
    agg["comm_m"] = round(sum(totals) / len(totals) / 1e6, 4) if totals else None
    mean, _ = _mean_std([r.get("seconds_per_round") for r in ok])
    agg["seconds_per_round"] = None if mean is None else round(mean, 3)
    agg["paper_acc"] = row.paper.get("acc")
    agg["paper_up_e3"] = row.paper.get("up")
    agg["paper_bc_e3"] = row.paper.get("bc")
    agg.update({f"paper_{k}": v for k, v in row.paper.items() if k not in ("acc", "up", "bc")})
    agg["note"] = row.note
    failures = sorted({str(r["status"]) for r in runs.values() if str(r.get("status", "")).startswith("failed")})
    if failures:
        agg["failures"] = failures
    return agg


def margin_over_best(aggs: Sequence[Mapping[str, Any]], label: str, key: str = "final_acc", *, exclude: Sequence[str] = ()) -> str:
    """One line: row ``label``'s ``key`` minus the best other row's (percentage points and relative %),
    as the papers' "X - Best B." rows; "" when either is missing."""
    ours = next((a for a in aggs if a["label"] == label and a.get(key) is not None), None)
    others = [a for a in aggs if a["label"] != label and a["label"] not in exclude and a.get(key) is not None]
    if ours is None or not others:
        return ""
    best = max(others, key=lambda a: a[key])
    diff = ours[key] - best[key]
    rel = 100 * diff / best[key] if best[key] else float("nan")
    name = dict(ACC_NAMES).get(key, key)
    return f"Ours, {name}: {label} - best other row ({best['label']}, {best[key]:.2f}) = {diff:+.2f} points ({rel:+.2f} % relative)."


ACC_NAMES = (
    ("final_acc", "global final"),
    ("best_acc", "global best"),
    ("final_acc_personal", "personal final"),
    ("best_acc_personal", "personal best"),
)


# ------------------------------------------------------------------------------------------ output

COLUMNS = (
    ("Method", "label"),
    ("global final", "final_acc"),
    ("global best", "best_acc"),
    ("personal final", "final_acc_personal"),
    ("personal best", "best_acc_personal"),
)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def _e3(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e3:.2f}"


def _cell(agg: Mapping[str, Any], key: str) -> str:
    if key == "label":
        return str(agg["label"])
    mean, std = agg.get(key), agg.get(f"{key}_std")
    if mean is None:
        return "failed" if agg.get("seeds_failed") else "-"
    return f"{mean:.2f}±{std:.2f}" if agg["seeds_done"] > 1 else f"{mean:.2f}"


def table_lines(table: Table, aggs: Sequence[Mapping[str, Any]], *, markdown: bool) -> list[str]:
    """The table in the paper's layout (one row per method), ours beside the paper's values."""
    columns = [("Method", "label"), *table.columns] if table.columns else list(COLUMNS)
    header = [name for name, _ in columns]
    keys = [key for _, key in columns]
    if table.paper_columns:
        header += [name for name, _ in table.paper_columns]
        keys += [f"paper_{key}" for _, key in table.paper_columns]
    elif table.paper_acc:
        header.append(f"paper {table.paper_acc}")
        keys.append("paper_acc")
    if table.comm == "total":
        header.append("#Comm M/round")
        keys.append("comm_m")
        if table.paper_comm:
            header.append(f"paper #Comm ({table.paper_comm})")
            keys.append("paper_comm")
    else:
        header += ["Up ×10³", "Bc ×10³"]
        keys += ["upload_e3", "broadcast_e3"]
        if table.paper_comm:
            header += [f"paper Up ({table.paper_comm})", "paper Bc"]
            keys += ["paper_up_e3", "paper_bc_e3"]
    header.append("s/round")
    keys.append("seconds_per_round")
    body = []
    for agg in aggs:
        cells = []
        for key in keys:
            if key in ("label", *PCT_KEYS):
                cells.append(_cell(agg, key))
            else:
                v = agg.get(key)
                digits = 4 if key == "comm_m" else 2
                cells.append("-" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) and key != "seconds_per_round" else str(v)))
        body.append(cells)
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
        return lines + ["| " + " | ".join(c) + " |" for c in body]
    widths = [max([len(h), *(len(c[i]) for c in body)]) for i, h in enumerate(header)]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [fmt(header), "  ".join("-" * w for w in widths), *(fmt(c) for c in body)]


def legend(table: Table) -> list[str]:
    n = len(table.seeds)
    seeds = f"mean ± std over {n} seed(s) ({', '.join(map(str, table.seeds))})"
    accuracy = (
        f"Accuracy (%): {seeds} of the sample-weighted mean test accuracy over "
        "clients; global = each client's model with the latest global part it received (HtFLlib, the papers' tables), personal = "
        "with its own parts after its last local training; final = last round, best = best round."
    )
    comm = (
        "#Comm: scalars per round in millions, paper-style (labels and class ids not counted): everything sent in a round, "
        "uploads + broadcasts (per-client payload × receivers) + peer messages."
        if table.comm == "total"
        else "Up / Bc: scalars per round ×10³, paper-style (labels and class ids not counted): upload summed over clients, "
        "broadcast = per-client payload × receivers."
    )
    return [
        f"{table.accuracy_legend} ({seeds})" if table.accuracy_legend else accuracy,
        f"{comm} s/round: training seconds per round (local training, server, evaluation).",
    ]


def write_outputs(
    table: Table,
    rows: Sequence[Row],
    skipped: Sequence[Row],
    per_seed: Mapping[str, Mapping[int, Mapping[str, Any]]],
    out: Path,
    wall: float,
    cpu: float = 0.0,
) -> dict[str, Any]:
    aggs = [aggregate(r, per_seed[r.label]) for r in rows if per_seed[r.label]]
    result = {
        "table": table.name,
        "title": table.title,
        "setting": table.setting,
        "protocol": {
            "base": table.base,
            "seeds": table.seeds,
            "rows": [{"label": r.label, "method": r.method, "options": dict(r.options)} for r in rows],
            "std": "population std over seeds (numpy std, ddof=0)",
            "paper_acc": table.paper_acc,
            "paper_comm": table.paper_comm,
        },
        "skipped": [{"label": r.label, "method": r.method, "why": "method not registered"} for r in skipped],
        "rows": aggs,
        "runs": {label: {str(s): rec for s, rec in runs.items()} for label, runs in per_seed.items()},
        "wall_seconds": round(wall, 1),
        "cpu_seconds": round(cpu, 1),
        "notes": table.footer(aggs),
    }
    (out / "table.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    if aggs:
        with (out / "table.csv").open("w", newline="") as fh:
            cols = [k for k in aggs[0] if k != "failures"]
            writer = csv.DictWriter(fh, cols, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(aggs)
    md = [f"# {table.title}", ""]
    if table.setting:
        md += [table.setting, ""]
    md += [*table_lines(table, aggs, markdown=True), ""]
    md += [f"- {line}" for line in table.footer(aggs)]
    if skipped:
        md.append(f"- Not run (method not registered): {', '.join(f'{r.label} ({r.method})' for r in skipped)}.")
    for agg in aggs:
        for failure in agg.get("failures", []):
            md.append(f"- {agg['label']}: {failure}")
    md.append(f"- Wall time of this invocation: {wall:.0f} s (CPU time of its process: {cpu:.0f} s); runs under `{out / 'runs'}`.")
    (out / "table.md").write_text("\n".join(md) + "\n")
    return result


def print_table(table: Table, result: Mapping[str, Any], log: Log = say) -> None:
    log("")
    log(table.title)
    if table.setting:
        log(table.setting)
    for line in table_lines(table, result["rows"], markdown=False):
        log(line)
    for line in table.footer(result["rows"]):
        log(f"  {line}")
    if result["skipped"]:
        log("  not run (method not registered): " + ", ".join(f"{s['label']} ({s['method']})" for s in result["skipped"]))
    log(f"wall time {result['wall_seconds']:.0f} s (CPU time of this process {result['cpu_seconds']:.0f} s)")


# ------------------------------------------------------------------------------------------ command line


def add_arguments(parser: argparse.ArgumentParser, *, out: str, seeds: str = "0,1,2") -> None:
    """The options every table script takes."""
    parser.add_argument("--seeds", default=seeds, help=f"comma list of seeds; every row runs on each (default {seeds})")
    parser.add_argument("--rounds", type=int, help="communication rounds (default: the script's quick or paper setting)")
    parser.add_argument("--subsample", type=int, help="train on a seeded subset of N samples")
    parser.add_argument("--num-clients", type=int, help="number of clients")
    parser.add_argument("--methods", help="comma list of rows to run, by method name or row label (default: all)")
    parser.add_argument("--skip-missing", action="store_true", help="leave out rows whose method is not registered (default: exit 2 naming them)")
    parser.add_argument("--data-root", help="folder holding the dataset (CIFAR python batches, tiny-imagenet-200/, ...)")
    parser.add_argument("--device", default="auto", help="auto (GPU when present), cpu, cuda, cuda:N")
    parser.add_argument("--capture", action="store_true", help="keep every run's capture (off by default: the counts need no capture)")
    parser.add_argument("--out", default=out, help=f"where runs and the table go (default {out})")


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds takes a comma list of non-negative integers, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds takes a comma list of distinct non-negative integers, got {text!r}")
    return seeds


def apply_common(base: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The base configuration with the common flags applied."""
    out = dict(base)
    for key in ("rounds", "subsample", "num_clients", "data_root"):
        value = getattr(args, key, None)
        if value is not None:
            out[key] = value
    out["device"] = args.device
    out["capture"] = bool(args.capture)
    out["eval"] = "both"
    return out


def main_for(prog: str, parser: argparse.ArgumentParser, build: Callable[[argparse.Namespace], Table], argv: Sequence[str] | None = None) -> int:
    """Parse, build the table, run it, print it; a user error is one line and status 2 (privfl.cli.run_cli)."""
    from privfl.cli import run_cli

    def main() -> int:
        args = parser.parse_args(None if argv is None else list(argv))
        table = build(args)
        table.rows = select_rows(table.rows, args.methods)
        out = Path(args.out)
        try:
            result = run_table(table, out, skip_missing=args.skip_missing)
        except KeyboardInterrupt:
            print(f"{prog}: interrupted; the same command continues the table (finished runs are read, the cut one resumes)", file=sys.stderr)
            return 130
        print_table(table, result)
        say(f"written: {out / 'table.md'}, {out / 'table.csv'}, {out / 'table.json'}")
        return 1 if result["failed"] else 0

    return run_cli(prog, main)


__all__ = [
    "ACC_KEYS",
    "Row",
    "Table",
    "add_arguments",
    "aggregate",
    "apply_common",
    "check_methods",
    "main_for",
    "margin_over_best",
    "parse_seeds",
    "print_table",
    "record_of",
    "registered_methods",
    "run_table",
    "select_rows",
    "table_lines",
    "train_or_read",
]
