"""One row per measured ratio, for ``experiments/bench.py`` (``make bench``) to gather into one table.

Each benchmark prints its own report as before and, when ``PRIVFL_BENCH_JSON`` names a file, also
appends its headline comparisons there: the two configurations measured side by side in the same
run, their values, and the ratio ``b / a``.
"""

from __future__ import annotations

import json
import os


def record(bench: str, measure: str, a_label: str, a: float, b_label: str, b: float, unit: str, note: str = "") -> None:
    """Append ``measure`` of configuration ``a`` vs ``b`` (same run, same inputs) to the bench file, if any."""
    path = os.environ.get("PRIVFL_BENCH_JSON")
    if not path:
        return
    row = {"bench": bench, "measure": measure, "a_label": a_label, "a": a, "b_label": b_label, "b": b, "unit": unit, "note": note}
    row["ratio"] = b / a if a else None
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")


def record_value(bench: str, measure: str, value: float, unit: str, note: str = "") -> None:
    """A measured value with nothing beside it (e.g. peak memory at 1,000 clients)."""
    path = os.environ.get("PRIVFL_BENCH_JSON")
    if not path:
        return
    row = {"bench": bench, "measure": measure, "a_label": "", "a": None, "b_label": "", "b": value, "unit": unit, "note": note, "ratio": None}
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")
