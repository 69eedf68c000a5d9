"""The audit's report: ``report.json`` (schema ``privfl-audit/2``), a self-contained ``report.html`` and
the privacy-utility figure.

``report.json`` is versioned by its ``schema`` field and validated against :data:`SCHEMA` (JSON Schema
2020-12; ``python -m privfl.audit --schema`` prints it, docs/audit.md explains every field). A change
that removes, renames or changes the meaning of a field bumps the version; new optional fields do not.
``privfl-audit/2`` chooses each family's strongest result by its gain over the attacker's prior and gives
every result a verdict; :func:`read_report` still reads ``privfl-audit/1`` reports (their verdicts are
``null``: they were never measured against a prior). ``report.html`` embeds every picture as a data URI,
so it opens offline and can be mailed as one file.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from attacks.audit_plan import reconstruction_psnr
from attacks.threat import THREAT_MODELS, sok_class
from privfl.capture.store import atomic_write_bytes, atomic_write_text
from privfl.kinds import KINDS

if TYPE_CHECKING:
    from attacks.audit_plan import AttackOutcome, Profile, Subject

SCHEMA_VERSION = "privfl-audit/2"
#: versions :func:`read_report` reads
READABLE_VERSIONS = ("privfl-audit/1", SCHEMA_VERSION)
LEAKS = "leaks beyond the prior"
NO_EVIDENCE = "no evidence beyond the prior at this budget"
#: differences below these count as "about as much" in the comparison sentences
MARGINS = {"reconstruction": 0.5, "labels": 0.05, "membership": 0.02}

_NUM = {"type": ["number", "null"]}
_VERDICT = {"enum": [LEAKS, NO_EVIDENCE, None]}
_BEST: dict[str, Any] = {
    "type": ["object", "null"],
    "required": ["attack", "round", "threat_model", "threat_model_text", "sok_threat_model", "verdict"],
    "properties": {"attack": {"type": "string"}, "round": {"type": "integer"}, "threat_model": {"type": "string"},
                   "threat_model_text": {"type": "string"}, "sok_threat_model": {"type": "string"},
                   "sok_threat_model_text": {"type": "string"}, "verdict": _VERDICT, "verdict_detail": {"type": ["string", "null"]},
                   "folder": {"type": ["string", "null"]}, "warnings": {"type": "array", "items": {"type": "string"}}},
}  # fmt: skip
SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://privfl.dev/schemas/privfl-audit-2.json",
    "title": "privfl audit report",
    "type": "object",
    "required": ["schema", "privfl_version", "created", "subject", "profile", "seed", "seconds", "methods", "figure"],
    "properties": {
        "schema": {"const": SCHEMA_VERSION},
        "privfl_version": {"type": "string"},
        "created": {"type": "string"},
        "subject": {"type": "string", "description": "the audited method"},
        "profile": {"type": "object", "required": ["name", "description", "train", "attack_clients", "attack_options"]},
        "seed": {"type": "integer"},
        "seconds": {"type": "number"},
        "figure": {"type": "string"},
        "methods": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["method", "label", "role", "defenses", "run", "accuracy", "communication", "kinds", "privacy"],
                "properties": {
                    "method": {"type": "string"},
                    "label": {"type": "string"},
                    "role": {"enum": ["audited", "defended", "reference"]},
                    "defenses": {"type": "array", "items": {"type": "string"}},
                    "run": {"type": ["string", "null"]},
                    "train_seconds": {"type": "number"},
                    "accuracy": {
                        "type": ["object", "null"],
                        "required": ["final", "final_std", "best", "best_round"],
                        "properties": {"final": _NUM, "final_std": _NUM, "best": _NUM, "best_round": {"type": ["integer", "null"]}},
                    },
                    "communication": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
                    "privacy": {
                        "type": "object",
                        "required": ["best_psnr", "best_gain_psnr", "label_recall", "membership_auc", "leaks"],
                        "properties": {"best_psnr": _NUM, "best_gain_psnr": _NUM, "label_recall": _NUM, "membership_auc": _NUM,
                                       "leaks": {"type": "array", "items": {"type": "string"}}},
                    },
                    "kinds": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["kind", "family", "directions", "verdict", "reconstruction", "labels", "membership", "results",
                                         "not_applicable", "comparison"],
                            "properties": {
                                "kind": {"type": "string"},
                                "family": {"type": "string"},
                                "directions": {"type": "array", "items": {"enum": ["up", "down", "peer"]}},
                                "verdict": _VERDICT,
                                "reconstruction": {**_BEST, "properties": {**_BEST["properties"], "psnr": _NUM, "ssim": _NUM, "lpips": _NUM,
                                                                           "lpips_note": {"type": "string"}, "prior_psnr": _NUM,
                                                                           "strongest_prior": {"type": ["string", "null"]}, "gain_psnr": _NUM,
                                                                           "gain_psnr_low": _NUM, "gain_psnr_high": _NUM, "ident_top1": _NUM,
                                                                           "ident_chance_top1": _NUM, "ident_prior_top1": _NUM}},
                                "labels": {**_BEST, "properties": {**_BEST["properties"], "recall": _NUM, "precision": _NUM, "l1": _NUM,
                                                                   "gain_f1": _NUM, "gain_l1": _NUM}},
                                "membership": {**_BEST, "properties": {**_BEST["properties"], "auc": _NUM, "tpr_at_1pct_fpr": _NUM,
                                                                       "advantage": _NUM, "auc_low": _NUM, "auc_high": _NUM, "tpr_1pct": _NUM,
                                                                       "fpr_reached_1pct": _NUM, "tpr_1pct_note": {"type": ["string", "null"]}}},
                                "results": {"type": "array", "items": {
                                    "type": "object", "required": ["attack", "family", "round", "threat_model", "metrics"],
                                    "properties": {"attack": {"type": "string"}, "family": {"enum": ["reconstruction", "labels", "membership"]},
                                                   "round": {"type": "integer"}, "threat_model": {"type": "string"}, "verdict": _VERDICT,
                                                   "metrics": {"type": "object"}, "folder": {"type": ["string", "null"]},
                                                   "seconds": {"type": "number"}, "warnings": {"type": "array", "items": {"type": "string"}}}}},
                                "not_applicable": {"type": "array", "items": {
                                    "type": "object", "required": ["attack", "reason", "fix"],
                                    "properties": {"attack": {"type": "string"}, "round": {"type": ["integer", "null"]},
                                                   "reason": {"type": "string"}, "fix": {"type": "string"}}}},
                                "comparison": {"type": "array", "items": {"type": "string"}},
                            },
                        },
                    },
                },
            },
        },
    },
}  # fmt: skip


# ------------------------------------------------------------------------------------------ numbers
def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value == value and abs(value) != float("inf") else None


def _result(o: AttackOutcome) -> dict[str, Any]:
    assert o.report is not None and o.round is not None
    s = o.report.summary
    if o.family == "reconstruction":
        metrics: dict[str, Any] = {
            "psnr": reconstruction_psnr(s),
            "ssim": _num(s.get("exact_ssim", s.get("best_ssim", s.get("ssim")))),
            "lpips": _num(s.get("exact_lpips", s.get("best_lpips", s.get("lpips")))),
        }
        keys = ("prior_psnr", "gain_psnr", "gain_psnr_low", "gain_psnr_high", "ident_top1", "ident_chance_top1", "ident_prior_top1")
        metrics.update({k: _num(s.get(k)) for k in keys})
        metrics["strongest_prior"] = s.get("strongest_prior")
    elif o.family == "labels":
        metrics = {k: _num(s.get(k)) for k in ("recall", "precision", "l1", "exact", "gain_f1", "gain_l1")}
    else:  # the pooled AUC (with its interval) where the scorer gives it: per-target means hide low-FPR ties
        metrics = {k: _num(s.get(k)) for k in ("auc", "tpr_at_1pct_fpr", "advantage")}
        if s.get("pooled_auc") is not None:
            metrics["auc"] = _num(s["pooled_auc"])
            metrics.update({k: _num(s.get(f"pooled_{k}")) for k in ("auc_low", "auc_high", "tpr_1pct", "fpr_reached_1pct")})
            metrics["tpr_1pct_note"] = s.get("pooled_tpr_1pct_note")
    calibration: dict[str, Any] = s["calibration"] if isinstance(s.get("calibration"), dict) else {}
    return {
        "attack": o.attack,
        "family": o.family,
        "round": o.round,
        "threat_model": o.threat_model,
        "verdict": s.get("verdict"),
        "verdict_detail": calibration.get("verdict_detail", s.get("verdict_detail")),
        "metrics": metrics,
        "folder": str(o.report.folder) if o.report.folder else None,
        "seconds": round(o.seconds, 2),
        "warnings": list(o.report.protocol.get("warnings", [])),
    }


def _best(results: list[dict[str, Any]], family: str, lpips_note: str) -> dict[str, Any] | None:
    chosen = [r for r in results if r["family"] == family]
    if not chosen:
        return None
    best = max(chosen, key=lambda r: _rank(r["metrics"], family) or (float("-inf"),))
    known = best["threat_model"] in THREAT_MODELS
    letter, letter_text = sok_class(best["threat_model"]) if known else ("?", "not a registered threat model")
    out = {
        "attack": best["attack"],
        "round": best["round"],
        "threat_model": best["threat_model"],
        "threat_model_text": THREAT_MODELS[best["threat_model"]][1] if known else "",
        "sok_threat_model": letter,
        "sok_threat_model_text": letter_text,
        "verdict": best.get("verdict"),
        "verdict_detail": best.get("verdict_detail"),
        "folder": best["folder"],
        "warnings": best["warnings"],
        **best["metrics"],
    }
    if family == "reconstruction":
        out["lpips_note"] = lpips_note
    return out


def method_entry(subject: Subject) -> dict[str, Any]:
    from attacks.runner import lpips_note

    run = subject.run
    summary = run.summary if run is not None else {}
    entry: dict[str, Any] = {
        "method": subject.method, "label": subject.label, "role": subject.role, "defenses": list(subject.defenses),
        "run": str(run.path) if run is not None else None, "train_seconds": round(subject.train_seconds, 2),
        "accuracy": {"final": _num(summary.get("final_acc")), "final_std": _num(summary.get("final_acc_std")),
                     "best": _num(summary.get("best_acc")), "best_round": summary.get("best_round")} if summary else None,
        "communication": {k: float(v) for k, v in summary.get("per_round", {}).items()} if summary else None,
        "kinds": [],
    }  # fmt: skip
    note = lpips_note()
    kinds = sorted({o.kind for o in subject.outcomes} | set(run.attacker.kinds() if run is not None and run.info else []))
    for kind in kinds:
        outcomes = [o for o in subject.outcomes if o.kind == kind]
        results = [_result(o) for o in outcomes if o.report is not None]
        directions = sorted({r["direction"] for r in run.attacker.records() if r["kind"] == kind}) if run is not None else []
        best = {family: _best(results, family, note) for family in ("reconstruction", "labels", "membership")}
        verdicts = [b["verdict"] for b in best.values() if b is not None and b.get("verdict") is not None]
        entry["kinds"].append({
            "kind": kind, "family": str(KINDS.get(kind).family) if kind in KINDS else "", "directions": directions,
            "verdict": (LEAKS if LEAKS in verdicts else NO_EVIDENCE) if verdicts else None,
            **best, "results": results,
            "not_applicable": [{"attack": o.attack, "round": o.round, "reason": o.reason, "fix": o.fix} for o in outcomes if o.report is None],
            "comparison": [],
        })  # fmt: skip
    psnrs = [k["reconstruction"]["psnr"] for k in entry["kinds"] if k["reconstruction"] and k["reconstruction"]["psnr"] is not None]
    recalls = [k["labels"]["recall"] for k in entry["kinds"] if k["labels"] and k["labels"]["recall"] is not None]
    aucs = [k["membership"]["auc"] for k in entry["kinds"] if k["membership"] and k["membership"]["auc"] is not None]
    gains = [k["reconstruction"]["gain_psnr"] for k in entry["kinds"] if k["reconstruction"] and k["reconstruction"].get("gain_psnr") is not None]
    leaking = sorted({f for k in entry["kinds"] for f in ("reconstruction", "labels", "membership") if k[f] and k[f].get("verdict") == LEAKS})
    entry["privacy"] = {
        "best_psnr": max(psnrs) if psnrs else None,
        "best_gain_psnr": max(gains) if gains else None,
        "leaks": leaking,
        "label_recall": max(recalls) if recalls else None,
        "membership_auc": max(aucs) if aucs else None,
    }
    return entry


def _rank(result: dict[str, Any], family: str) -> tuple[float, ...] | None:
    """How much one result leaks, comparable within a family: the PSNR gain over the attacker's prior (the
    raw PSNR for results scored before priors existed); AUC; class recall, then the closeness of the
    class shares (a smaller histogram L1 leaks more)."""
    key = {"reconstruction": "psnr", "labels": "recall", "membership": "auc"}[family]
    if family == "reconstruction" and result.get("gain_psnr") is not None:
        return (float(result["gain_psnr"]), float(result.get("psnr") or 0.0))
    if result.get(key) is None:
        return None
    if family == "labels":
        return (float(result[key]), -float(result["l1"]) if result.get("l1") is not None else -2.0)
    return (float(result[key]),)


def _strongest(entry: dict[str, Any], family: str) -> tuple[tuple[float, ...], str, int, str | None] | None:
    """(rank, kind, round, verdict) of a method's strongest result of one attack family."""
    found = [
        (rank, k["kind"], k[family]["round"], k[family].get("verdict"))
        for k in entry["kinds"]
        if k[family] and (rank := _rank(k[family], family)) is not None
    ]
    return max(found, key=lambda f: f[0]) if found else None


def _verb(diff: float, margin: float) -> str:
    return "leaks about as much as" if abs(diff) < margin else ("leaks more than" if diff > 0 else "leaks less than")


def compare(entries: list[dict[str, Any]]) -> None:
    """One plain sentence per attack family and reference, on each kind of the audited (and defended) method."""
    refs = [e for e in entries if e["role"] == "reference"]
    units = {
        "reconstruction": ("dB", ".1f", "PSNR gain over the prior"),
        "labels": ("", ".2f", "class recall"),
        "membership": ("", ".3f", "membership AUC"),
    }
    for entry in entries:
        if entry["role"] == "reference":
            continue
        for k in entry["kinds"]:
            for family, (unit, fmt, what) in units.items():
                if family == "labels" and k["directions"] == ["down"]:  # a broadcast's classes are every client's: no per-client comparison
                    continue
                mine = k[family]
                rank = _rank(mine, family) if mine else None
                if rank is None:
                    continue
                for ref in refs:
                    theirs = _strongest(ref, family)
                    if theirs is None:
                        continue
                    u = f" {unit}" if unit else ""
                    head = f"{entry['label']}'s {k['kind']}"
                    where = f"{ref['label']}'s {theirs[1]}"
                    diff = rank[0] - theirs[0][0]
                    verdicts = (mine.get("verdict"), theirs[3])
                    if None not in verdicts and LEAKS not in verdicts:  # two failures or non-results are no ordering
                        sentence = (
                            f"{family}: neither {head} nor {where} shows leakage beyond the attacker's prior at this budget "
                            f"({what} {rank[0]:{fmt}}{u} against {theirs[0][0]:{fmt}}{u}): this is no ordering of the two"
                        )
                    elif None not in verdicts and verdicts.count(LEAKS) == 1:
                        leaker, other = (head, where) if verdicts[0] == LEAKS else (where, head)
                        sentence = (
                            f"{family}: {leaker} leaks beyond the attacker's prior, {other} shows no evidence beyond it at this budget "
                            f"({what} {rank[0]:{fmt}}{u} (round {mine['round']}) against {theirs[0][0]:{fmt}}{u} (round {theirs[2]}))"
                        )
                    elif family == "labels" and abs(diff) < MARGINS[family]:  # the same classes named: the shares decide
                        sentence = (
                            f"labels: {head} {_verb(rank[1] - theirs[0][1], MARGINS['labels'])} {where}: class recall {rank[0]:.2f} "
                            f"against {theirs[0][0]:.2f}, histogram L1 {-rank[1]:.2f} (round {mine['round']}) against "
                            f"{-theirs[0][1]:.2f} (round {theirs[2]}), 0 = the exact class shares"
                        )
                    else:
                        sentence = (
                            f"{what}: {head} {_verb(diff, MARGINS[family])} {where}: {rank[0]:{fmt}}{u} "
                            f"(round {mine['round']}) against {theirs[0][0]:{fmt}}{u} (round {theirs[2]})"
                        )
                    k["comparison"].append(sentence)
                if not refs or all(_strongest(r, family) is None for r in refs):
                    k["comparison"].append(f"{what}: no reference method gave a {family} result to compare with")
    for ref in refs:
        if not ref["kinds"]:
            for entry in entries:
                if entry["role"] != "reference" and entry["kinds"]:
                    entry["kinds"][0]["comparison"].append(f"{ref['label']} sends nothing: it leaks nothing through messages")


# ------------------------------------------------------------------------------------------ pictures
def privacy_utility_figure(path: Path, entries: list[dict[str, Any]]) -> Path:
    """Final accuracy against the best reconstruction's PSNR gain over its prior (0: no better than what the
    attacker had without the message) and against the membership AUC, one point per method."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 3.8), dpi=100)
    FigureCanvasAgg(fig)
    markers = {"audited": ("*", 160), "defended": ("s", 60), "reference": ("o", 60)}
    for i, (key, xlabel) in enumerate(
        (("best_gain_psnr", "best reconstruction PSNR gain over the attacker's prior (dB)"), ("membership_auc", "membership AUC, 0.5 = chance"))
    ):
        ax = fig.add_subplot(1, 2, i + 1)
        shown = 0
        for e in entries:
            x, acc = e["privacy"][key], (e["accuracy"] or {}).get("final")
            if x is None or acc is None:
                continue
            m, size = markers[e["role"]]
            ax.scatter([x], [100 * acc], marker=m, s=size, label=e["label"])
            ax.annotate(e["label"], (x, 100 * acc), textcoords="offset points", xytext=(4, 4), fontsize=7)
            shown += 1
        for e in entries:  # a method that sends nothing has no leakage to plot, but its accuracy is the utility to beat
            acc = (e["accuracy"] or {}).get("final")
            if e["privacy"][key] is None and acc is not None and not e["kinds"]:
                ax.axhline(100 * acc, color="#777777", linestyle=":", linewidth=0.9)
                ax.annotate(f"{e['label']} (sends nothing)", (0.01, 100 * acc), xycoords=("axes fraction", "data"), xytext=(0, 3),
                            textcoords="offset points", fontsize=7, color="#555555")  # fmt: skip
        if key == "membership_auc":
            ax.axvline(0.5, color="#999999", linestyle="--", linewidth=0.8)
        else:  # left of the line an attack did worse than what its attacker had without the message
            ax.axvline(0.0, color="#999999", linestyle="--", linewidth=0.8)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel("final test accuracy (%)", fontsize=8)
        ax.tick_params(labelsize=7)
        if not shown:
            ax.text(0.5, 0.5, "no method gave this result", ha="center", va="center", transform=ax.transAxes, fontsize=8)
        missing = [e["label"] for e in entries if e["privacy"][key] is None and e["kinds"]]
        if missing:  # a method without the result is named, not silently left out
            ax.text(0.0, -0.22, "no result: " + ", ".join(missing), transform=ax.transAxes, fontsize=7, color="#555555")
    fig.suptitle("privacy-utility: each point a method (star: audited, square: defended, circle: reference)", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())
    return path


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _img(path: str | Path | None, alt: str) -> str:
    if path is None or not Path(path).is_file():
        return ""
    return f'<img src="{_data_uri(Path(path))}" alt="{html.escape(alt)}">'


# ------------------------------------------------------------------------------------------ html
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em;color:#222;max-width:1300px}
h1{font-size:1.5em}h2{font-size:1.25em;margin-top:2em;border-bottom:1px solid #ccc}h3{font-size:1.05em;margin-top:1.4em}
table{border-collapse:collapse;margin:.6em 0;font-size:.88em}th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}img{max-width:100%;border:1px solid #ddd;margin:.3em 0}
p.note{color:#555}.warn{color:#a33}li{margin:.15em 0}
"""


def _fmt(v: Any, spec: str = ".3g", unit: str = "") -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:{spec}}{unit}"
    return html.escape(str(v)) + unit


def _headline_table(entries: list[dict[str, Any]]) -> str:
    head = ("<tr><th>method</th><th>role</th><th>final accuracy</th><th>upload / round</th><th>broadcast / round</th>"
            "<th>peer / round</th><th>best PSNR (dB)</th><th>its gain over the prior (dB)</th><th>class recall</th>"
            "<th>membership AUC</th><th>leaks beyond the prior</th></tr>")  # fmt: skip
    rows = []
    for e in entries:
        acc, comm, p = e["accuracy"] or {}, e["communication"] or {}, e["privacy"]
        final = f"{100 * acc['final']:.2f} ± {100 * (acc.get('final_std') or 0):.2f} %" if acc.get("final") is not None else "–"
        rows.append(
            f"<tr><td>{html.escape(e['label'])}</td><td>{e['role']}</td><td class=n>{final}</td>"
            f"<td class=n>{_bytes(comm.get('upload_bytes'))}</td><td class=n>{_bytes(comm.get('broadcast_bytes'))}</td>"
            f"<td class=n>{_bytes(comm.get('peer_bytes'))}</td><td class=n>{_fmt(p['best_psnr'], '.2f')}</td>"
            f"<td class=n>{_fmt(p.get('best_gain_psnr'), '+.2f')}</td>"
            f"<td class=n>{_fmt(p['label_recall'], '.2f')}</td><td class=n>{_fmt(p['membership_auc'], '.3f')}</td>"
            f"<td>{html.escape(', '.join(p.get('leaks', [])) or ('none found' if e['kinds'] else 'sends nothing'))}</td></tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"


def _lpips_note(entries: list[dict[str, Any]]) -> str:
    """Why LPIPS is missing, said once for the page (it is the same reason for every result)."""
    for e in entries:
        for k in e["kinds"]:
            r = k["reconstruction"]
            if r and r.get("lpips") is None and r.get("lpips_note", "").startswith("unavailable"):
                return str(r["lpips_note"]).removeprefix("unavailable: ")
    return ""


def _bytes(n: float | None) -> str:
    if not n:
        return "0"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _verdict_cell(best: dict[str, Any]) -> str:
    detail = best.get("verdict_detail") or best.get("verdict") or "not measured against a prior"
    return f"<td>{html.escape(str(detail))}</td>"


def _threat_cell(best: dict[str, Any]) -> str:
    sok = best.get("sok_threat_model")
    letter = f" <i>SoK class {html.escape(str(sok))}: {html.escape(str(best.get('sok_threat_model_text', '')))}</i>" if sok else ""
    return f"<td>{html.escape(best['threat_model_text'])}{letter}</td>"


def _kind_section(k: dict[str, Any]) -> str:
    verdict = f" <small>verdict: {html.escape(k['verdict'])}</small>" if k.get("verdict") else ""
    parts = [f"<h3>{html.escape(k['kind'])} <small>({html.escape(k['family'])}, sent {', '.join(k['directions']) or '–'})</small>{verdict}</h3>"]
    r, lab, mem = k["reconstruction"], k["labels"], k["membership"]
    rows = []
    if r:
        lp = _fmt(r.get("lpips"), ".3f") if r.get("lpips") is not None else "unavailable (why: at the top)"
        prior = ""
        if r.get("gain_psnr") is not None:
            prior = (
                f"<br>prior ({html.escape(str(r.get('strongest_prior', '')).replace('_', ' '))}) {_fmt(r.get('prior_psnr'), '.2f', ' dB')}; "
                f"gain {_fmt(r['gain_psnr'], '+.2f', ' dB')} [{_fmt(r.get('gain_psnr_low'), '+.2f')}, {_fmt(r.get('gain_psnr_high'), '+.2f')}]"
            )
            if r.get("ident_top1") is not None:
                prior += (
                    f"<br>identified top-1 {_fmt(r['ident_top1'], '.2f')} (chance {_fmt(r.get('ident_chance_top1'), '.3f')}, "
                    f"prior {_fmt(r.get('ident_prior_top1'), '.2f')})"
                )
        rows.append(f"<tr><td>reconstruction</td><td>{r['attack']}, round {r['round']}</td><td>PSNR {_fmt(r.get('psnr'), '.2f', ' dB')}, "
                    f"SSIM {_fmt(r.get('ssim'), '.3f')}, LPIPS {lp}{prior}</td>{_verdict_cell(r)}{_threat_cell(r)}</tr>")  # fmt: skip
    if lab:
        gains = ""
        if lab.get("gain_f1") is not None:
            gains = f"<br>over naming every class: F1 {_fmt(lab['gain_f1'], '+.2f')}, L1 {_fmt(lab.get('gain_l1'), '+.2f')}"
        rows.append(f"<tr><td>labels</td><td>{lab['attack']}, round {lab['round']}</td><td>class recall {_fmt(lab.get('recall'), '.2f')}, "
                    f"precision {_fmt(lab.get('precision'), '.2f')}, histogram L1 {_fmt(lab.get('l1'), '.2f')}{gains}</td>"
                    f"{_verdict_cell(lab)}{_threat_cell(lab)}</tr>")  # fmt: skip
    if mem:
        interval = f" [{_fmt(mem.get('auc_low'), '.3f')}, {_fmt(mem.get('auc_high'), '.3f')}]" if mem.get("auc_low") is not None else ""
        tpr = _fmt(mem.get("tpr_1pct"), ".3f") if mem.get("tpr_1pct") is not None else html.escape(str(mem.get("tpr_1pct_note") or "–"))
        if "tpr_1pct" not in mem:  # a report of scores without pooled low-FPR fields
            tpr = _fmt(mem.get("tpr_at_1pct_fpr"), ".3f")
        rows.append(f"<tr><td>membership</td><td>{mem['attack']}, round {mem['round']}</td><td>AUC {_fmt(mem.get('auc'), '.3f')}{interval}, "
                    f"TPR at 1 % FPR {tpr}, advantage {_fmt(mem.get('advantage'), '.3f')}</td>"
                    f"{_verdict_cell(mem)}{_threat_cell(mem)}</tr>")  # fmt: skip
    if rows:
        parts.append("<table><tr><th>attack family</th><th>strongest attack</th><th>result</th><th>verdict</th><th>threat model it assumes</th></tr>"
                     + "".join(rows) + "</table>")  # fmt: skip
    else:
        parts.append("<p class=note>No attack gave a result on this kind (reasons below).</p>")
    for best in (r, lab, mem):
        for w in (best or {}).get("warnings", []):
            parts.append(f"<p class=warn>Warning: {html.escape(w)}</p>")
    if k["comparison"]:
        parts.append("<ul>" + "".join(f"<li>{html.escape(c)}</li>" for c in k["comparison"]) + "</ul>")
    if r and r.get("folder"):
        parts.append(_img(Path(r["folder"]) / "gallery.png", "best reconstruction: ground truth above reconstructions"))
    if lab and lab.get("folder"):
        parts.append(_img(Path(lab["folder"]) / "labels.png", "label inference per client"))
    if mem and mem.get("folder"):
        parts.append(_img(Path(mem["folder"]) / "roc.png", "membership inference ROC"))
    if k["results"]:
        parts.append("<details><summary>every result</summary><table><tr><th>attack</th><th>round</th><th>metrics</th><th>seconds</th></tr>"
                     + "".join(f"<tr><td>{x['attack']}</td><td class=n>{x['round']}</td><td>"
                               + ", ".join(f"{m} {_fmt(v, '.3f')}" for m, v in x["metrics"].items()) + f"</td><td class=n>{x['seconds']}</td></tr>"
                               for x in k["results"]) + "</table></details>")  # fmt: skip
    if k["not_applicable"]:
        seen: dict[tuple[str, str], list[Any]] = {}
        for na in k["not_applicable"]:
            seen.setdefault((na["attack"], na["reason"]), []).append(na)
        items = []
        for (attack, reason), group in seen.items():
            fix = group[0]["fix"]
            items.append(f"<li><b>{html.escape(attack)}</b> does not apply: {html.escape(reason)}"
                         + (f" <i>To enable it: {html.escape(fix)}</i>" if fix else "") + "</li>")  # fmt: skip
        parts.append("<details><summary>attacks that do not apply, and why</summary><ul>" + "".join(items) + "</ul></details>")
    return "\n".join(parts)


def render_html(report: dict[str, Any], figure: Path) -> str:
    entries = report["methods"]
    prof = report["profile"]
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>privfl audit: {html.escape(report['subject'])}</title><style>{_CSS}</style></head><body>",
             f"<h1>Leakage audit of {html.escape(report['subject'])}</h1>",
             f"<p class=note>privfl {html.escape(report['privfl_version'])}, profile <b>{html.escape(prof['name'])}</b> "
             f"({html.escape(prof['description'])}), seed {report['seed']}, {report['seconds']:.0f} s, {html.escape(report['created'])}. "
             "Reconstruction PSNR is per image on [0, 1], then averaged; membership AUC 0.5 is chance; class recall is the share "
             "of a client's classes an attacker names. Every number below assumes the threat model printed beside it (with its class "
             "in Carletti et al.'s SoK, USENIX Security 2025, A-H). Every result is read against what the attacker has without the "
             "message (its prior: a blank image, the population mean, the class mean of what the message reveals; naming every "
             "class; AUC 0.5): an attack that scores below its prior failed, which is not evidence of protection.</p>",
             *([f"<p class=note>{html.escape(lpips)}</p>"] if (lpips := _lpips_note(entries)) else []),
             "<h2>Summary</h2>", _headline_table(entries), _img(figure, "privacy-utility figure")]  # fmt: skip
    for e in entries:
        parts.append(f"<h2>{html.escape(e['label'])} <small>({e['role']})</small></h2>")
        if e["run"]:
            parts.append(f"<p class=note>run: {html.escape(e['run'])}</p>")
        if not e["kinds"]:
            parts.append("<p>This method sends nothing: no attack on messages applies.</p>")
        for k in e["kinds"]:
            parts.append(_kind_section(k))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_audit(out: Path, subjects: list[Subject], profile: Profile, *, seconds: float, seed: int) -> tuple[dict[str, Any], Path, Path]:
    """report.json, privacy_utility.png and report.html in ``out``; returns (report, html path, json path)."""
    import privfl

    entries = [method_entry(s) for s in subjects]
    compare(entries)
    figure = privacy_utility_figure(out / "privacy_utility.png", entries)
    report = {
        "schema": SCHEMA_VERSION, "privfl_version": privfl.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "subject": subjects[0].method,
        "profile": {"name": profile.name, "description": profile.description, "train": profile.train,
                    "attack_clients": profile.attack_clients, "attack_options": profile.attack_options},
        "seed": seed, "seconds": round(seconds, 1), "figure": figure.name, "methods": entries,
    }  # fmt: skip
    json_path = out / "report.json"
    atomic_write_text(json_path, json.dumps(_clean(report), indent=2, allow_nan=False) + "\n")
    html_path = out / "report.html"
    atomic_write_text(html_path, render_html(report, figure))
    return report, html_path, json_path


def _clean(v: Any) -> Any:
    """JSON-safe: non-finite numbers become null, numpy scalars plain numbers."""
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, (np.floating, float)):
        return float(v) if np.isfinite(v) else None
    if isinstance(v, np.integer):
        return int(v)
    return v


def read_report(path: str | Path) -> dict[str, Any]:
    """A ``report.json`` of any readable version, as the current schema: a ``privfl-audit/1`` report gets
    ``verdict: null`` everywhere (its results were never set against a prior), the SoK letter of each
    threat model, and ``best_gain_psnr: null`` / ``leaks: []``. Validated against :data:`SCHEMA`; an
    unknown version or a report that does not validate is a one-line ConfigError."""
    from privfl.errors import ConfigError

    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the audit report {path}: {exc}") from None
    version = report.get("schema") if isinstance(report, dict) else None
    if version not in READABLE_VERSIONS:
        raise ConfigError(f"{path}: schema {version!r} is not one privfl reads ({', '.join(READABLE_VERSIONS)})")
    if version == "privfl-audit/1":
        report["schema"] = SCHEMA_VERSION
        for entry in report.get("methods", []):
            entry.setdefault("privacy", {}).setdefault("best_gain_psnr", None)
            entry["privacy"].setdefault("leaks", [])
            for k in entry.get("kinds", []):
                k.setdefault("verdict", None)
                for family in ("reconstruction", "labels", "membership"):
                    best = k.get(family)
                    if best:
                        best.setdefault("verdict", None)
                        known = best.get("threat_model") in THREAT_MODELS
                        best.setdefault("sok_threat_model", sok_class(best["threat_model"])[0] if known else "?")
    try:
        import jsonschema
    except ImportError:  # an install without the test extra: the version check above is what can be done
        return report
    try:
        jsonschema.validate(report, SCHEMA)
    except jsonschema.ValidationError as exc:
        raise ConfigError(f"{path}: not a valid privfl audit report: {exc.message}") from None
    return report


__all__ = ["SCHEMA", "SCHEMA_VERSION", "method_entry", "privacy_utility_figure", "read_report", "render_html", "write_audit"]
