"""The leaderboard's outputs: ``leaderboard.json`` (schema ``privfl-leaderboard/1``), ``leaderboard.md``, ``leaderboard.csv``
(one row per method and defense), ``leaderboard_cells.csv`` (one row per seed), a sortable self-contained
``leaderboard.html`` and the privacy-utility frontier ``frontier.png``.

How a cell of the table is computed from its seeds:

* **Value**: the mean over seeds of each seed's strongest result of the family (the audit's rule: the
  largest gain over the attacker's prior for images, class recall then histogram L1 for labels, the
  pooled AUC for membership).
* **Interval** (95 %): with two or more seeds, Student's t over the seeds' values (seed-to-seed spread of
  partition, initialisation and attack); with one seed, the result's own bootstrap interval where it has
  one (image gain, AUC), else none.
* **Verdict**: how many seeds' strongest result leaks beyond its prior ("leaks in 2 of 3 seeds"). A family
  counts as leaking for a method when any seed shows it: privfl never reports less leakage than a seed
  measured.
* **Rank**: 1 + the number of methods whose interval lies entirely on the leaking (or, for accuracy, the
  better) side of this one's. Methods whose intervals overlap share a rank; no ordering is stated between
  them. For the image gain and the AUC, intervals are read clipped at the prior's line (0 dB, 0.5): below
  it an attack failed, so methods whose attacks failed are never ranked against each other. A cell
  without an interval gets no rank.
"""

from __future__ import annotations

import csv
import datetime
import html
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attacks.audit_report import LEAKS, _bytes, _clean, _data_uri, _rank
from attacks.threat import THREAT_MODELS, sok_class
from privfl.capture.store import atomic_write_bytes, atomic_write_text

if TYPE_CHECKING:
    from attacks.audit import Profile, Workers

SCHEMA_VERSION = "privfl-leaderboard/1"
FAMILIES = ("reconstruction", "labels", "membership")


@dataclass(frozen=True)
class Cell:
    """One method (with its defenses) at one seed: what is trained and attacked, and its key."""

    method: str
    defenses: tuple[str, ...]
    seed: int
    values: dict[str, Any] = field(compare=False, hash=False)  # the run options it trains with
    key: str = ""

    @property
    def label(self) -> str:
        return self.method + (f" + {' + '.join(self.defenses)}" if self.defenses else "")

    @property
    def folder_name(self) -> str:
        slug = "".join(ch if ch.isalnum() else "_" for ch in self.method.replace(":", ".")).strip("_")
        for d in self.defenses:
            slug += "-" + "".join(ch if ch.isalnum() else "_" for ch in d).strip("_")
        return f"{slug}-s{self.seed}-{self.key[:12]}"


@dataclass
class CellResult:
    """What one cell gave: its audit entry and timings, or why it has none."""

    cell: Cell
    entry: dict[str, Any] | None = None
    accuracy_personal: float | None = None
    personal_differs: bool = False
    partition: str = ""  # SHA-256 of the run's partition (the same for every cell of a seed, checked)
    model_group: str = ""
    train_seconds: float = 0.0
    attack_seconds: float = 0.0
    reused: bool = False
    error: str = ""
    folder: str = ""


@dataclass
class LeaderboardResult:
    table: dict[str, Any]  # what leaderboard.json holds
    folder: Path
    html: Path
    json: Path
    csv: Path
    figure: Path
    cells: list[CellResult]


@dataclass(frozen=True)
class Measure:
    """One ranked column: how to read it off a seed's strongest result, and which way is more leakage."""

    key: str
    label: str
    family: str  # utility | reconstruction | labels | membership
    unit: str
    fmt: str
    more_is_more: bool  # a larger value leaks more (or, for utility, is better)
    chance: float | None = None  # the line of "no leakage" drawn in the figure
    bounds: tuple[float, float] | None = None  # the measure's range: an interval is clipped to it (accuracy <= 100 %)


MEASURES = (
    Measure("acc_global", "accuracy, global protocol", "utility", "%", ".2f", True, bounds=(0.0, 100.0)),
    Measure("acc_personal", "accuracy, personal protocol", "utility", "%", ".2f", True, bounds=(0.0, 100.0)),
    Measure("reconstruction", "image reconstruction: PSNR gain over the prior", "reconstruction", "dB", "+.2f", True, 0.0),
    Measure("label_recall", "label inference: class recall", "labels", "", ".2f", True, bounds=(0.0, 1.0)),
    Measure("label_l1", "label inference: histogram L1 (0 = exact shares)", "labels", "", ".2f", False, bounds=(0.0, 2.0)),
    Measure("membership", "membership inference: AUC", "membership", "", ".3f", True, 0.5, bounds=(0.0, 1.0)),
    Measure("membership_tpr", "membership inference: TPR at 1 % FPR", "membership", "", ".3f", True, bounds=(0.0, 1.0)),
)


# ------------------------------------------------------------------------------------------ reading cells
def strongest(entry: dict[str, Any], family: str) -> tuple[str, dict[str, Any]] | None:
    """(kind, best result) of one audit entry's strongest result of ``family`` over all its kinds."""
    found = [(rank, k["kind"], k[family]) for k in entry["kinds"] if k[family] and (rank := _rank(k[family], family)) is not None]
    if not found:
        return None
    rank, kind, best = max(found, key=lambda f: f[0])
    return kind, best


def seed_values(r: CellResult) -> dict[str, Any]:
    """Every measure of one finished cell: ``{measure: (value, low, high)}`` plus each family's details."""
    e = r.entry or {}
    acc = e.get("accuracy") or {}
    out: dict[str, Any] = {}
    g = acc.get("final")
    out["acc_global"] = (100 * g if g is not None else None, None, None)
    p = r.accuracy_personal if r.personal_differs else g
    out["acc_personal"] = (100 * p if p is not None else None, None, None)
    details: dict[str, Any] = {}
    for family in FAMILIES:
        found = strongest(e, family) if e else None
        if found is None:
            continue
        kind, best = found
        letter = best.get("sok_threat_model") or (sok_class(best["threat_model"])[0] if best.get("threat_model") in THREAT_MODELS else "?")
        details[family] = {"attack": best.get("attack"), "kind": kind, "round": best.get("round"), "threat_model": best.get("threat_model"),
                           "sok": letter, "verdict": best.get("verdict"), "folder": best.get("folder")}  # fmt: skip
        if family == "reconstruction":
            out["reconstruction"] = (best.get("gain_psnr"), best.get("gain_psnr_low"), best.get("gain_psnr_high"))
            details[family].update(psnr=best.get("psnr"), prior=best.get("strongest_prior"), prior_psnr=best.get("prior_psnr"))
        elif family == "labels":
            out["label_recall"] = (best.get("recall"), None, None)
            out["label_l1"] = (best.get("l1"), None, None)
        else:
            out["membership"] = (best.get("auc"), best.get("auc_low"), best.get("auc_high"))
            tpr = best.get("tpr_1pct", best.get("tpr_at_1pct_fpr"))
            out["membership_tpr"] = (tpr, None, None)
            details[family].update(fpr_reached=best.get("fpr_reached_1pct"), tpr_note=best.get("tpr_1pct_note"))
    out["details"] = details
    return out


def combine(values: Sequence[tuple[float | None, float | None, float | None]]) -> dict[str, Any] | None:
    """Mean and 95 % interval of one measure over seeds (the module docstring's rule); None without values."""
    from scipy import stats

    got = [v for v in values if v[0] is not None]
    if not got:
        return None
    xs = [float(v[0]) for v in got]  # type: ignore[arg-type]
    n = len(xs)
    mean = sum(xs) / n
    if n == 1:
        low, high = got[0][1], got[0][2]
        return {"mean": mean, "low": low, "high": high, "n": 1, "values": xs, "interval": "bootstrap within the run" if low is not None else None}
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n, "values": xs, "interval": f"Student's t over {n} seeds"}


def ranks(rows: list[dict[str, Any]], measure: Measure) -> None:
    """Set ``row["cells"][key]["rank"]``: 1 + how many rows' intervals lie entirely beyond this one's."""
    stats = [(row, row["cells"].get(measure.key)) for row in rows]
    with_interval = [(row, s) for row, s in stats if s and s.get("low") is not None and s.get("high") is not None]
    for _, s in with_interval:
        s["rank"] = 1 + sum(1 for _, o in with_interval if beyond(o, s, measure.more_is_more, measure.chance))


def beyond(a: dict[str, Any], b: dict[str, Any], more_is_more: bool, floor: float | None = None) -> bool:
    """Whether ``a``'s interval lies entirely on the leaking (or better) side of ``b``'s. With ``floor`` (the
    prior's line: gain 0, AUC 0.5), both intervals are read clipped at it: below it an attack failed, which
    is no evidence of less leakage, so two methods whose attacks failed are never ordered."""

    def clip(x: float) -> float:
        return x if floor is None else max(x, floor)

    return bool(clip(a["low"]) > clip(b["high"])) if more_is_more else bool(a["high"] < b["low"])


def _verdict(details: list[dict[str, Any]], n_seeds: int) -> dict[str, Any]:
    leaks = sum(1 for d in details if d.get("verdict") == LEAKS)
    measured = sum(1 for d in details if d.get("verdict") is not None)
    if not details:
        text = None
    elif leaks:
        text = f"leaks beyond the prior in {leaks} of {n_seeds} seed{'s' if n_seeds > 1 else ''}"
    else:
        text = f"no evidence beyond the prior in {measured} of {n_seeds} seed{'s' if n_seeds > 1 else ''}"
    return {"leaks_seeds": leaks, "measured_seeds": measured, "text": text}


def build_rows(results: list[CellResult], seeds: Sequence[int]) -> list[dict[str, Any]]:
    """One row per (method, defenses): every measure over its seeds, with the attacks behind them."""
    groups: dict[tuple[str, tuple[str, ...]], list[CellResult]] = {}
    for r in results:
        groups.setdefault((r.cell.method, r.cell.defenses), []).append(r)
    rows = []
    for (method, defenses), cells in groups.items():
        done = [c for c in cells if c.entry is not None]
        per_seed = [seed_values(c) for c in done]
        row: dict[str, Any] = {
            "method": method,
            "defenses": list(defenses),
            "label": cells[0].cell.label,
            "model_group": sorted({c.model_group for c in done if c.model_group}),
            "seeds": [c.cell.seed for c in done],
            "missing": [{"seed": c.cell.seed, "why": c.error} for c in cells if c.entry is None],
            "sends": sorted({k["kind"] for c in done for k in (c.entry or {}).get("kinds", [])}),
            "reports": [str(Path(c.folder) / "report.html") for c in done],
            "cells": {},
            "families": {},
        }
        for m in MEASURES:
            stat = combine([s.get(m.key, (None, None, None)) for s in per_seed])
            if stat is not None:
                if m.bounds is not None and stat["low"] is not None:  # a t-interval over few seeds can leave the measure's range
                    stat["low"], stat["high"] = max(stat["low"], m.bounds[0]), min(stat["high"], m.bounds[1])
                row["cells"][m.key] = stat
        for key in ("upload_bytes", "broadcast_bytes", "peer_bytes"):
            vals = [float(((c.entry or {}).get("communication") or {}).get(key) or 0.0) for c in done]
            row[key] = sum(vals) / len(vals) if vals else None
        for family in FAMILIES:
            details = [s["details"][family] for s in per_seed if family in s["details"]]
            if not details:
                continue
            attacks = sorted({f"{d['attack']} on {d['kind']}" for d in details})
            letters = sorted({str(d["sok"]) for d in details})
            row["families"][family] = {
                "attacks": attacks,
                "sok": letters,
                "threat_models": sorted({str(d["threat_model"]) for d in details}),
                "verdict": _verdict(details, len(done)),
                "per_seed": details,
            }
        row["leaks"] = [f for f in FAMILIES if row["families"].get(f, {}).get("verdict", {}).get("leaks_seeds")]
        rows.append(row)
    for m in MEASURES:
        ranks(rows, m)
    return rows


def ordering(rows: list[dict[str, Any]]) -> list[str]:
    """Plain sentences stating only orderings whose intervals separate."""
    out = []
    by_label = {r["label"]: r for r in rows}
    for m in MEASURES:
        ranked = [r for r in rows if r["cells"].get(m.key, {}).get("rank") is not None]
        if len(ranked) < 2:
            continue
        top = [r["label"] for r in ranked if r["cells"][m.key]["rank"] == 1]
        below = [r["label"] for r in ranked if r["cells"][m.key]["rank"] > 1]
        word = "highest" if m.family == "utility" else "most leakage"
        if not below:
            out.append(f"{m.label}: every interval overlaps another: no ordering of the {len(ranked)} methods is supported")
            continue
        out.append(f"{m.label}, {word}: {', '.join(top)} (their intervals overlap: no order among them); "
                   f"each of the other {len(below)} lies entirely below at least one of them")  # fmt: skip
        ref = by_label.get("fedavg")
        if ref is not None and ref["cells"].get(m.key, {}).get("low") is not None:
            s = ref["cells"][m.key]
            above = [r["label"] for r in ranked if r is not ref and beyond(r["cells"][m.key], s, m.more_is_more, m.chance)]
            under = [r["label"] for r in ranked if r is not ref and beyond(s, r["cells"][m.key], m.more_is_more, m.chance)]
            verb = ("score above", "score below") if m.family == "utility" else ("leak more than", "leak less than")
            if above:
                out.append(f"{m.label}: {', '.join(above)} {verb[0]} FedAvg (intervals separate)")
            if under:
                out.append(f"{m.label}: {', '.join(under)} {verb[1]} FedAvg (intervals separate)")
    return out


# ------------------------------------------------------------------------------------------ the figure
def _pareto(points: list[tuple[float, float, str]], more_is_more: bool) -> list[tuple[float, float, str]]:
    """The points no other point beats on both leakage (less) and accuracy (more), sorted by leakage."""

    def leak(p: tuple[float, float, str]) -> float:
        return p[0] if more_is_more else -p[0]

    front = [p for p in points if not any(leak(q) <= leak(p) and q[1] >= p[1] and (leak(q) < leak(p) or q[1] > p[1]) for q in points)]
    return sorted(front, key=leak)


def frontier_figure(path: Path, rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Accuracy (personal protocol, the model a client keeps) against each leakage measure, one point per
    method with its intervals, the Pareto front drawn; Local (sends nothing) is a line, FedAvg a diamond,
    defended variants squares. A point left of the prior's line (gain 0, AUC 0.5) is drawn where it was
    measured, but the front places it on the line: a failed attack does not make a method more private.
    Returns the front's members per panel."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [m for m in MEASURES if m.key in ("reconstruction", "label_l1", "membership")]
    fig = Figure(figsize=(16.5, 5.6), dpi=100)
    FigureCanvasAgg(fig)
    fronts: dict[str, list[str]] = {}
    for i, m in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        points = []
        for r in rows:
            x, y = r["cells"].get(m.key), r["cells"].get("acc_personal")
            if x is None or y is None:
                continue
            xerr = [[x["mean"] - x["low"]], [x["high"] - x["mean"]]] if x.get("low") is not None else None
            yerr = [[y["mean"] - y["low"]], [y["high"] - y["mean"]]] if y.get("low") is not None else None
            marker, color, size = ("s", "#7a4", 36) if r["defenses"] else ("o", "#36c", 30)
            if r["method"] == "fedavg" and not r["defenses"]:
                marker, color, size = ("D", "#c33", 60)
            ax.errorbar([x["mean"]], [y["mean"]], xerr=xerr, yerr=yerr, fmt="none", ecolor="#bbbbbb", elinewidth=0.8, zorder=1)
            ax.scatter([x["mean"]], [y["mean"]], marker=marker, s=size, color=color, zorder=3)
            ax.annotate(r["label"], (x["mean"], y["mean"]), textcoords="offset points", xytext=(3, 3), fontsize=6.5,
                        weight="bold" if r["method"] in ("fedavg", "local") else "normal")  # fmt: skip
            points.append((x["mean"], y["mean"], r["label"]))
        if m.chance is not None:  # below the prior an attack failed: that is no evidence of less leakage, so the front
            # compares such methods at the prior's line, by accuracy alone
            floor = m.chance
            front = _pareto([(max(p[0], floor), p[1], p[2]) for p in points], m.more_is_more)
            lo, hi = ax.get_xlim() if points else (floor - 1.0, floor + 1.0)
            ax.axvspan(min(lo, floor), floor, color="#eeeeee", zorder=0)
            ax.set_xlim(min(lo, floor), max(hi, floor))
            ax.text(0.01, 0.01, "left of the line: the attack scored below its prior (failed), not less leakage", transform=ax.transAxes,
                    fontsize=6.5, color="#666666")  # fmt: skip
        else:
            front = _pareto(points, m.more_is_more)
        fronts[m.key] = [p[2] for p in front]
        if len(front) > 1:
            ax.step([p[0] for p in front], [p[1] for p in front], where="post" if m.more_is_more else "pre", color="#e90", linewidth=1.2,
                    zorder=2, label="Pareto front")  # fmt: skip
        elif front:
            ax.scatter([front[0][0]], [front[0][1]], s=140, facecolors="none", edgecolors="#e90", zorder=2, label="Pareto front")
        for r in rows:  # Local and every method that sends nothing: no leakage through messages, its accuracy is the bar
            y = r["cells"].get("acc_personal")
            if not r["sends"] and y is not None:
                ax.axhline(y["mean"], color="#555555", linestyle=":", linewidth=1.0)
                ax.annotate(f"{r['label']} (sends nothing)", (0.01, y["mean"]), xycoords=("axes fraction", "data"), xytext=(0, 3),
                            textcoords="offset points", fontsize=7, color="#333333", weight="bold")  # fmt: skip
        if m.chance is not None:
            ax.axvline(m.chance, color="#999999", linestyle="--", linewidth=0.8)
        if not m.more_is_more:
            ax.invert_xaxis()  # right is always more leakage
        ax.set_xlabel(m.label + (f" ({m.unit})" if m.unit else "") + ("  [axis reversed]" if not m.more_is_more else ""), fontsize=8)
        ax.set_ylabel("final accuracy, personal protocol (%)", fontsize=8)
        ax.tick_params(labelsize=7)
        missing = [r["label"] for r in rows if r["sends"] and r["cells"].get(m.key) is None]
        if missing:
            ax.text(0.0, -0.16, "no result: " + ", ".join(missing), transform=ax.transAxes, fontsize=6.5, color="#555555", wrap=True)
        if points:
            ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("privacy-utility frontier: one point per method (bars: 95 % intervals); right = more leakage; diamond: FedAvg; "
                 "square: defended; dotted line: a method that sends nothing", fontsize=9)  # fmt: skip
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())
    return fronts


# ------------------------------------------------------------------------------------------ html and csv
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;font-size:.82em}th,td{border:1px solid #ccc;padding:.2em .45em;vertical-align:top}
th{background:#f3f3f3;cursor:pointer;position:sticky;top:0}td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.leak{background:#fde2e2}td.fail{color:#a33}img{max-width:100%;border:1px solid #ddd}p.note{color:#555;max-width:1200px}
small{color:#666}
"""
_SORT_JS = """
document.querySelectorAll('table.sortable th').forEach(function(th, col){th.addEventListener('click', function(){
 var t=th.closest('table'), body=t.tBodies[0], rows=Array.from(body.rows), asc=th.dataset.asc!=='1'; th.dataset.asc=asc?'1':'0';
 rows.sort(function(a,b){var x=a.cells[col].dataset.sort, y=b.cells[col].dataset.sort;
  var nx=parseFloat(x), ny=parseFloat(y); if(x===undefined||x===''){return 1} if(y===undefined||y===''){return -1}
  if(!isNaN(nx)&&!isNaN(ny)){return asc?nx-ny:ny-nx} return asc?x.localeCompare(y):y.localeCompare(x)});
 rows.forEach(function(r){body.appendChild(r)});});});
"""


def _stat_text(s: dict[str, Any] | None, fmt: str) -> str:
    if s is None:
        return "–"
    text = f"{s['mean']:{fmt}}"
    if s.get("low") is not None:
        text += f" [{s['low']:{fmt}}, {s['high']:{fmt}}]"
    return text


def _td(s: dict[str, Any] | None, fmt: str, extra: str = "", cls: str = "n") -> str:
    sort = "" if s is None else f"{s['mean']:.6g}"
    rank = f" <small>#{s['rank']}</small>" if s and s.get("rank") is not None else ""
    return f'<td class="{cls}" data-sort="{sort}">{html.escape(_stat_text(s, fmt))}{rank}{extra}</td>'


def _family_extra(row: dict[str, Any], family: str) -> tuple[str, str]:
    f = row["families"].get(family)
    if not f:
        return "", "n"
    v = f["verdict"]
    text = f"<br><small>{html.escape(v['text'] or '')}; {html.escape(', '.join(f['attacks']))}; SoK {', '.join(f['sok'])}</small>"
    return text, "n leak" if v["leaks_seeds"] else "n"


COLUMNS_HTML = (
    ("method", "the method (and defense)"),
    ("model group", "the architectures its clients train (homogeneous methods: the mixed group's homogeneous counterpart)"),
    ("accuracy, global (%)", "each client's model with the latest global part it received, on its own test split; mean over clients"),
    ("accuracy, personal (%)", "each client's model with its own parts after its last local training (= global for methods without personal parts)"),
    ("upload / round", "bytes all clients send the server per round (mean over rounds)"),
    ("broadcast / round", "bytes the server sends all clients per round"),
    ("peer / round", "bytes clients send each other per round (decentralised methods)"),
    (
        "images: PSNR gain over the prior (dB)",
        "the strongest reconstruction attack's PSNR minus the strongest prior's (blank, population mean, class mean of what the "
        "message reveals); threat model and SoK class below each value",
    ),
    ("labels: class recall", "share of each client's classes the strongest label attack names"),
    ("labels: histogram L1", "distance of the inferred class shares from the true ones, 0 = exact, 2 = disjoint"),
    ("membership: AUC", "pooled AUC of the strongest membership attack, 0.5 = chance"),
    ("membership: TPR at 1 % FPR", "at the FPR the scores reach (unavailable with fewer than 10 false positives)"),
    ("seeds", "seeds with a result, and each seed's audit report"),
)


def render_html(table: dict[str, Any], figure: Path) -> str:
    rows = table["rows"]
    s = table["setting"]
    head = "".join(f'<th title="{html.escape(t)}">{html.escape(c)}</th>' for c, t in COLUMNS_HTML)
    body = []
    for r in rows:
        c = r["cells"]
        rec_extra, rec_cls = _family_extra(r, "reconstruction")
        lab_extra, lab_cls = _family_extra(r, "labels")
        mem_extra, mem_cls = _family_extra(r, "membership")
        tprs = [d.get("tpr_note") for d in r["families"].get("membership", {}).get("per_seed", []) if d.get("tpr_note")]
        fprs = [d.get("fpr_reached") for d in r["families"].get("membership", {}).get("per_seed", []) if d.get("fpr_reached") is not None]
        tpr_extra = f"<br><small>FPR reached {', '.join(f'{f:.4f}' for f in fprs)}</small>" if fprs else ""
        if tprs and c.get("membership_tpr") is None:
            tpr_extra = f"<br><small>{html.escape(tprs[0])}</small>"
        sends = "" if r["sends"] else "<br><small>sends nothing</small>"
        missing = "".join(f"<br><small class=fail>seed {m['seed']}: {html.escape(m['why'])}</small>" for m in r["missing"])
        links = " ".join(f'<a href="{html.escape(_relative(p, table))}">s{seed}</a>' for seed, p in zip(r["seeds"], r["reports"], strict=True))
        body.append(
            f'<tr><td data-sort="{html.escape(r["label"])}"><b>{html.escape(r["label"])}</b>{sends}{missing}</td>'
            f"<td>{html.escape(', '.join(r['model_group']))}</td>"
            + _td(c.get("acc_global"), ".2f") + _td(c.get("acc_personal"), ".2f")
            + "".join(f'<td class=n data-sort="{r[k] or 0}">{_bytes(r[k])}</td>' for k in ("upload_bytes", "broadcast_bytes", "peer_bytes"))
            + _td(c.get("reconstruction"), "+.2f", rec_extra, rec_cls)
            + _td(c.get("label_recall"), ".2f", lab_extra, lab_cls) + _td(c.get("label_l1"), ".2f")
            + _td(c.get("membership"), ".3f", mem_extra, mem_cls) + _td(c.get("membership_tpr"), ".3f", tpr_extra)
            + f"<td>{links}</td></tr>"
        )  # fmt: skip
    letters = sorted({x for r in rows for f in r["families"].values() for x in f["sok"]})
    legend = "".join(f"<li><b>{html.escape(x)}</b>: {html.escape(_sok_text(x))}</li>" for x in letters)
    threats = sorted({t for r in rows for f in r["families"].values() for t in f["threat_models"]})
    threat_items = "".join(f"<li><code>{html.escape(t)}</code>: {html.escape(_threat_text(t))}</li>" for t in threats)
    warn = "".join(f"<p class=fail><b>Warning:</b> {html.escape(w)}</p>" for w in table["warnings"])
    warn += "".join(f"<p class=note>Note: {html.escape(n)}</p>" for n in table.get("notes", []))
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>privfl leakage leaderboard ({html.escape(table['profile']['name'])})</title><style>{_CSS}</style></head><body>",
        f"<h1>Leakage leaderboard: {len(rows)} methods, {html.escape(table['profile']['name'])} profile, "
        f"seeds {', '.join(map(str, table['seeds']))}</h1>",
        f"<p class=note>privfl {html.escape(table['privfl_version'])}, {html.escape(table['created'])}. Every method trained on the same data "
        f"({html.escape(str(s['dataset']))}, {s['subsample']} samples, {s['num_clients']} clients, partition {html.escape(str(s['partition']))}"
        f"{', alpha ' + str(s['alpha']) if s.get('alpha') is not None else ''}, {s['rounds']} rounds) and seed; heterogeneous methods on "
        f"<code>{html.escape(', '.join(s['model_groups']['heterogeneous']))}</code>, methods that need one architecture on "
        f"<code>{html.escape(', '.join(s['model_groups']['homogeneous']))}</code>. Wall time of this invocation "
        f"{table['wall_seconds']:.0f} s ({table['cells_computed']} cells computed, {table['cells_reused']} reused; "
        f"{len(table['invocations'])} invocation(s) in this folder, {table['total_wall_seconds']:.0f} s of wall time in all, a killed one "
        "counted to its last finished cell; "
        f"{table['cell_seconds']:.0f} s of cell work in all) with {table['workers']['count']} worker(s) on {html.escape(table['device'])}.</p>",
        "<p class=note>Each value is the mean over seeds with a 95 % interval (Student's t over seeds; with one seed, the result's own "
        "bootstrap interval). <small>#k</small> is the rank: 1 + the number of methods whose interval lies entirely beyond this one's, so "
        "methods whose intervals overlap share a rank. A red cell leaks beyond the attacker's prior in at least one seed. An attack that "
        "scores below its prior failed: that is not evidence that a method protects anything. Click a header to sort; hover it for its "
        "meaning. Compare leakage only between cells of the same threat model (SoK class under each value).</p>",
        warn,
        f'<table class="sortable"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>',
        "<h2>Privacy-utility frontier</h2>", f'<img src="{_data_uri(figure)}" alt="privacy-utility frontier">',
        "<h2>Orderings the intervals support</h2><ul>" + "".join(f"<li>{html.escape(o)}</li>" for o in table["ordering"]) + "</ul>",
        "<h2>Threat models</h2><p class=note>Classes of Carletti et al., SoK, USENIX Security 2025 (A-H):</p><ul>" + legend + "</ul><ul>"
        + threat_items + "</ul>",
        f"<script>{_SORT_JS}</script></body></html>\n",
    ]  # fmt: skip
    return "\n".join(parts)


def _threat_text(name: str) -> str:
    return THREAT_MODELS[name][1] if name in THREAT_MODELS else ""


def _sok_text(letter: str) -> str:
    for name in THREAT_MODELS:
        got = sok_class(name)
        if got[0] == letter:
            return got[1]
    return ""


def _relative(path: str, table: dict[str, Any]) -> str:
    try:
        return str(Path(path).relative_to(Path(table["folder"])))
    except ValueError:
        return path


CSV_FIELDS = ["method", "defenses", "model_group", "seeds", "upload_bytes", "broadcast_bytes", "peer_bytes"]


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    fields = list(CSV_FIELDS)
    for m in MEASURES:
        fields += [f"{m.key}", f"{m.key}_low", f"{m.key}_high", f"{m.key}_rank"]
    for f in FAMILIES:
        fields += [f"{f}_verdict", f"{f}_attacks", f"{f}_sok"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fields, lineterminator="\n")
    w.writeheader()
    for r in rows:
        line: dict[str, Any] = {"method": r["method"], "defenses": "+".join(r["defenses"]), "model_group": " ".join(r["model_group"]),
                                "seeds": " ".join(map(str, r["seeds"]))}  # fmt: skip
        line.update({k: r[k] for k in ("upload_bytes", "broadcast_bytes", "peer_bytes")})
        for m in MEASURES:
            s = r["cells"].get(m.key) or {}
            line.update({m.key: s.get("mean"), f"{m.key}_low": s.get("low"), f"{m.key}_high": s.get("high"), f"{m.key}_rank": s.get("rank")})
        for f in FAMILIES:
            fam = r["families"].get(f) or {}
            line.update({f"{f}_verdict": (fam.get("verdict") or {}).get("text"), f"{f}_attacks": "; ".join(fam.get("attacks", [])),
                         f"{f}_sok": " ".join(fam.get("sok", []))})  # fmt: skip
        w.writerow(line)
    atomic_write_text(path, buf.getvalue())


def write_cells_csv(path: Path, results: list[CellResult]) -> None:
    measured = ("acc_global", "acc_personal", "reconstruction", "label_recall", "label_l1", "membership")
    fields = ["method", "defenses", "seed", "key", "status", "model_group", "train_seconds", "attack_seconds", *measured,
              "reconstruction_verdict", "labels_verdict", "membership_verdict", "report"]  # fmt: skip
    buf = io.StringIO()
    w = csv.DictWriter(buf, fields, lineterminator="\n")
    w.writeheader()
    for r in results:
        v = seed_values(r) if r.entry is not None else {"details": {}}
        d = v["details"]
        w.writerow({"method": r.cell.method, "defenses": "+".join(r.cell.defenses), "seed": r.cell.seed, "key": r.cell.key,
                    "status": r.error or ("reused" if r.reused else "computed"), "model_group": r.model_group,
                    "train_seconds": round(r.train_seconds, 2), "attack_seconds": round(r.attack_seconds, 2),
                    **{k: (v.get(k) or (None,))[0] for k in measured},
                    "reconstruction_verdict": d.get("reconstruction", {}).get("verdict"), "labels_verdict": d.get("labels", {}).get("verdict"),
                    "membership_verdict": d.get("membership", {}).get("verdict"),
                    "report": str(Path(r.folder) / "report.html") if r.entry is not None else ""})  # fmt: skip
    atomic_write_text(path, buf.getvalue())


def render_markdown(table: dict[str, Any]) -> str:
    """The table as Markdown (for a README, a paper's appendix or docs/leaderboard.md): one row per method,
    each leakage cell with its interval, rank, verdict count, strongest attack and SoK class."""

    def stat(s: dict[str, Any] | None, fmt: str) -> str:
        if s is None:
            return "–"
        text = f"{s['mean']:{fmt}}" + (f" [{s['low']:{fmt}}, {s['high']:{fmt}}]" if s.get("low") is not None else "")
        return text + (f" #{s['rank']}" if s.get("rank") is not None else "")

    def family(r: dict[str, Any], name: str) -> str:
        f = r["families"].get(name)
        if not f:
            return ""
        v = f["verdict"]
        word = "**leaks**" if v["leaks_seeds"] else "no evidence"
        return f"; {word} {v['leaks_seeds']}/{len(r['seeds'])}, {', '.join(f['attacks'])}, SoK {', '.join(f['sok'])}"

    def tpr(r: dict[str, Any]) -> str:
        if r["cells"].get("membership_tpr") is not None:
            return stat(r["cells"]["membership_tpr"], ".3f")
        notes = [d.get("tpr_note") for d in r["families"].get("membership", {}).get("per_seed", []) if d.get("tpr_note")]
        return "unavailable: fewer than 10 false positives" if notes else "–"

    lines = [
        "| method | model group | acc. global (%) | acc. personal (%) | up / down / peer per round | images: PSNR gain over the prior (dB) "
        "| labels: recall / L1 | membership: AUC | TPR at 1 % FPR |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table["rows"]:
        c = r["cells"]
        sends = "" if r["sends"] else " (sends nothing)"
        lines.append(
            f"| {r['label']}{sends} | {', '.join(r['model_group'])} | {stat(c.get('acc_global'), '.2f')} | {stat(c.get('acc_personal'), '.2f')} "
            f"| {' / '.join(_bytes(r.get(k)) for k in ('upload_bytes', 'broadcast_bytes', 'peer_bytes'))} "
            f"| {stat(c.get('reconstruction'), '+.2f')}{family(r, 'reconstruction')} "
            f"| {stat(c.get('label_recall'), '.2f')} / {stat(c.get('label_l1'), '.2f')}{family(r, 'labels')} "
            f"| {stat(c.get('membership'), '.3f')}{family(r, 'membership')} | {tpr(r)} |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ the whole
def write_leaderboard(
    out: Path,
    results: list[CellResult],
    profile: Profile,
    *,
    seeds: list[int],
    defenses: list[str],
    wall_seconds: float,
    workers: Workers,
    device: str,
    train_options: dict[str, Any],
    notes: Sequence[str] = (),
    setting: dict[str, Any],
    invocations: Sequence[dict[str, Any]] = (),
) -> tuple[dict[str, Any], tuple[Path, Path, Path, Path]]:
    """leaderboard.json / .csv / _cells.csv / .html and frontier.png in ``out``: (the table, (html, json, csv, figure)).
    ``setting``: the shared data options every cell trained with (dataset, subsample, clients, partition, alpha, rounds)."""
    import privfl
    from privfl.engine import resolve_device

    rows = build_rows(results, seeds)
    warnings = []
    for seed in seeds:
        parts = {r.partition for r in results if r.cell.seed == seed and r.entry is not None and r.partition}
        if len(parts) > 1:
            warnings.append(f"seed {seed}: the cells were trained on {len(parts)} different partitions; their numbers are not comparable")
    failed = [r for r in results if r.entry is None]
    if failed:
        warnings.append(f"{len(failed)} cell(s) have no result: " + "; ".join(f"{r.cell.label} seed {r.cell.seed}: {r.error}" for r in failed))
    groups = {"heterogeneous": sorted({r.model_group for r in results if r.entry and not _homogeneous(r.cell.method)}),
              "homogeneous": sorted({r.model_group for r in results if r.entry and _homogeneous(r.cell.method)})}  # fmt: skip
    figure = out / "frontier.png"
    fronts = frontier_figure(figure, rows)
    table: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "privfl_version": privfl.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "folder": str(out),
        "profile": {"name": profile.name, "description": profile.description, "train": profile.train,
                    "attack_clients": profile.attack_clients, "attack_options": profile.attack_options},
        "seeds": seeds,
        "defenses": defenses,
        "train_options": train_options,
        "setting": {**setting, "model_groups": groups},
        "device": str(resolve_device(device)),
        "workers": {"count": workers.count, "threads_each": workers.threads_each()},
        "wall_seconds": round(wall_seconds, 1),
        "invocations": list(invocations),
        "total_wall_seconds": round(sum(float(i["seconds"]) for i in invocations), 1) if invocations else round(wall_seconds, 1),
        "cell_seconds": round(sum(r.train_seconds + r.attack_seconds for r in results), 1),
        "cells_computed": sum(1 for r in results if not r.reused and r.entry is not None),
        "cells_reused": sum(1 for r in results if r.reused),
        "warnings": warnings,
        "notes": list(notes),
        "figure": figure.name,
        "pareto_front": fronts,
        "ordering": ordering(rows),
        "measures": [{"key": m.key, "label": m.label, "family": m.family, "unit": m.unit, "more_is_more": m.more_is_more} for m in MEASURES],
        "rows": rows,
        "cells": [{"method": r.cell.method, "defenses": list(r.cell.defenses), "seed": r.cell.seed, "key": r.cell.key, "folder": r.folder,
                   "error": r.error or None, "reused": r.reused, "partition": r.partition, "train_seconds": round(r.train_seconds, 2),
                   "attack_seconds": round(r.attack_seconds, 2)} for r in results],
    }  # fmt: skip
    json_path = out / "leaderboard.json"
    atomic_write_text(json_path, json.dumps(_clean(table), indent=2, allow_nan=False) + "\n")
    csv_path = out / "leaderboard.csv"
    write_csv(csv_path, rows)
    write_cells_csv(out / "leaderboard_cells.csv", results)
    atomic_write_text(out / "leaderboard.md", render_markdown(table))
    html_path = out / "leaderboard.html"
    atomic_write_text(html_path, render_html(table, figure))
    return table, (html_path, json_path, csv_path, figure)


def _homogeneous(method: str) -> bool:
    from privfl.methods import resolve_method

    return bool(resolve_method(method).requires_homogeneous)


__all__ = ["MEASURES", "SCHEMA_VERSION", "build_rows", "combine", "frontier_figure", "ordering", "ranks", "write_leaderboard"]
