"""What people look at after an attack: an image gallery, metric files and one self-contained page.

* :func:`save_gallery` -- a PNG grid: ground truth on top, one row per reconstruction set, a caption
  under every image (e.g. its PSNR). Drawn with matplotlib's object API on an Agg canvas (no pyplot
  global state, so it is safe in threads and never opens a window).
* :func:`write_metrics` -- ``metrics.json`` (protocol + summary + per-image rows), ``metrics.csv``
  (per-image rows) and ``summary.csv``, each written atomically.
* :func:`write_html` -- ``index.html`` with protocol, galleries and summary tables per section;
  inline CSS, no JavaScript, no external URLs, every string escaped.
"""

from __future__ import annotations

import contextlib
import csv
import html
import io
import json
import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
from torch import Tensor

from privfl.capture import atomic_write_bytes, atomic_write_text

TRUTH_LABEL = "ground truth"


# ------------------------------------------------------------------------------------------ gallery
def _to_numpy_images(t: Tensor, name: str) -> np.ndarray:
    """(N,C,H,W) or (C,H,W) tensor in [0,1] -> (N,H,W) grey or (N,H,W,3) colour, clipped for display."""
    if t.dim() == 3:
        t = t.unsqueeze(0)
    if t.dim() != 4 or t.shape[1] not in (1, 3):
        raise ValueError(f"{name}: expected shape (N, C, H, W) with C in (1, 3), got {tuple(t.shape)}")
    a = t.detach().float().cpu().clamp(0, 1).numpy()
    return a[:, 0] if a.shape[1] == 1 else a.transpose(0, 2, 3, 1)


def save_gallery(
    path: str | os.PathLike,
    truth: Tensor | None,
    rows: Sequence[tuple[str, Tensor]],
    captions: Sequence[str] | None = None,
    title: str = "",
    per_image_labels: Mapping[str, Sequence[str]] | None = None,
    cell_inches: float = 1.1,
    dpi: int = 100,
) -> Path:
    """Save a PNG grid: ground truth row (if given), then one row per ``(label, images)`` set.

    ``captions`` label the columns at the top; ``per_image_labels[row label]`` (``"ground truth"``
    for the truth row) gives one small caption under each image of that row. Rows may hold
    different numbers of images (missing cells stay blank). Layout is computed explicitly, so the
    image grows with the number of rows and columns and never clips labels.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    all_rows: list[tuple[str, np.ndarray]] = []
    if truth is not None:
        all_rows.append((TRUTH_LABEL, _to_numpy_images(truth, TRUTH_LABEL)))
    all_rows += [(label, _to_numpy_images(imgs, label)) for label, imgs in rows]
    if not all_rows:
        raise ValueError("save_gallery needs ground truth or at least one row of reconstructions")
    labels = dict(per_image_labels or {})
    ncols = max(*(a.shape[0] for _, a in all_rows), len(captions or ()), 1)
    h, w = all_rows[0][1].shape[1:3]
    aspect = h / w

    # geometry in inches: left label column, image cells each with a caption strip below
    has_img_captions = any(labels.get(lbl) for lbl, _ in all_rows)
    left, right, pad = 1.5, 0.1, 0.08
    top = (0.45 if title else 0.1) + (0.25 if captions else 0.0)
    cap_h = 0.22 if has_img_captions else 0.0
    cell_w = cell_inches
    cell_h = cell_inches * aspect
    row_h = cell_h + cap_h + pad
    fig_w = left + ncols * (cell_w + pad) + right
    fig_h = top + len(all_rows) * row_h + 0.1

    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
    FigureCanvasAgg(fig)
    fs = 7.5
    if title:
        fig.text(0.5, 1 - 0.2 / fig_h, title, ha="center", va="center", fontsize=10, weight="bold")
    for r, (row_label, imgs) in enumerate(all_rows):
        y0 = fig_h - top - r * row_h - cell_h  # bottom of the image cells of this row (inches)
        fig.text((left - 0.1) / fig_w, (y0 + cell_h / 2) / fig_h, textwrap.fill(row_label, 20), ha="right", va="center", fontsize=fs)
        row_caps = list(labels.get(row_label) or [])
        for c in range(imgs.shape[0]):
            x0 = left + c * (cell_w + pad)
            ax = fig.add_axes((x0 / fig_w, y0 / fig_h, cell_w / fig_w, cell_h / fig_h))
            ax.set_axis_off()
            if imgs.ndim == 3:  # grey
                ax.imshow(imgs[c], cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
            else:
                ax.imshow(imgs[c], interpolation="nearest")
            if c < len(row_caps) and row_caps[c]:
                fig.text((x0 + cell_w / 2) / fig_w, (y0 - 0.03) / fig_h, str(row_caps[c]), ha="center", va="top", fontsize=fs - 1)
    for c, cap in enumerate(captions or ()):
        x0 = left + c * (cell_w + pad)
        fig.text((x0 + cell_w / 2) / fig_w, (fig_h - top + 0.05) / fig_h, str(cap), ha="center", va="bottom", fontsize=fs)

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor="white")
    out = Path(path)
    atomic_write_bytes(out, buf.getvalue())
    return out


def save_label_grid(
    path: str | os.PathLike,
    grid: Sequence[tuple[str, Sequence[int], Sequence[int]]],
    class_names: Sequence[str],
    title: str = "",
    dpi: int = 100,
) -> Path:
    """A clients x classes picture of label inference: each cell says whether the client's message had
    the class behind it and whether the attack named it (hit, missed, false alarm, neither)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    colours = ["#ffffff", "#b0b0b0", "#d62728", "#2ca02c"]  # neither, missed, false alarm, hit
    codes = np.zeros((len(grid), len(class_names)), dtype=int)
    for i, (_, true, found) in enumerate(grid):
        t, f = set(true), set(found)
        for c in range(len(class_names)):
            codes[i, c] = (c in t) * 1 + (c in f) * 2  # 0 neither, 1 missed, 2 false alarm, 3 hit
    fig = Figure(figsize=(max(4.0, 0.45 * len(class_names) + 2.5), max(2.5, 0.35 * len(grid) + 1.8)), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.imshow(codes, cmap=ListedColormap(colours), vmin=0, vmax=3, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(class_names)), [str(c)[:10] for c in class_names], rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(grid)), [row[0] for row in grid], fontsize=7)
    ax.set_xticks(np.arange(-0.5, len(class_names)), minor=True)
    ax.set_yticks(np.arange(-0.5, len(grid)), minor=True)
    ax.grid(which="minor", color="#dddddd", linewidth=0.5)
    ax.tick_params(which="minor", length=0)
    ax.legend(
        handles=[
            Patch(color=colours[3], label="named, present"),
            Patch(color=colours[1], label="present, missed"),
            Patch(color=colours[2], label="named, absent"),
        ],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
    )
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())
    return path


# ------------------------------------------------------------------------------------------ metrics
def save_roc(path: str | os.PathLike, curves: Sequence[tuple[str, Sequence[float], Sequence[float]]], title: str = "", dpi: int = 100) -> Path:
    """ROC curves of membership inference on log-log axes (the low-FPR region is what matters), chance dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.8, 4.2), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    floor = 1e-3
    for label, fpr, tpr in curves:
        ax.plot(np.clip(fpr, floor, 1), np.clip(tpr, floor, 1), linewidth=1.2, label=label)
    ax.plot([floor, 1], [floor, 1], "k--", linewidth=0.8, label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(floor, 1)
    ax.set_ylim(floor, 1)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.legend(fontsize=6, loc="lower right")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(Path(path), buf.getvalue())
    return Path(path)


def _jsonable(v: Any) -> Any:
    """Plain JSON values: numpy/torch scalars -> numbers, paths -> str, non-finite floats -> None
    (strict JSON has no NaN/Infinity)."""
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, Tensor):
        return _jsonable(v.tolist())
    if isinstance(v, np.ndarray):
        return _jsonable(v.tolist())
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, (str, int, bool)) or v is None:
        return v
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    return str(v)


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> dotted keys, for one-value-per-cell CSV."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _csv_cell(v: Any) -> Any:
    v = _jsonable(v)
    if v is None:
        return ""
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return v


def _csv_text(header: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(header), lineterminator="\n", restval="")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _csv_cell(v) for k, v in row.items()})
    return buf.getvalue()


def write_metrics(
    folder: str | os.PathLike, per_image_rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any], protocol: Mapping[str, Any]
) -> tuple[Path, Path, Path]:
    """Write ``metrics.json``, ``metrics.csv`` (one row per image) and ``summary.csv`` into ``folder``.

    CSV columns are the union of the rows' keys in order of first appearance; missing values are
    empty cells. ``summary.csv`` has ``key,value`` rows (nested keys dotted). Non-finite numbers are
    written as JSON ``null`` / empty CSV cells. Returns the three paths (json, csv, summary csv).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [dict(r) for r in per_image_rows]
    doc = {"protocol": _jsonable(protocol), "summary": _jsonable(summary), "images": _jsonable(rows)}
    json_path, csv_path, summary_path = folder / "metrics.json", folder / "metrics.csv", folder / "summary.csv"
    atomic_write_text(json_path, json.dumps(doc, indent=2, allow_nan=False) + "\n")

    columns: dict[str, None] = {}
    for r in rows:
        columns.update(dict.fromkeys(r))
    atomic_write_text(csv_path, _csv_text(list(columns), rows))
    flat = _flatten(summary)
    atomic_write_text(summary_path, _csv_text(["key", "value"], [{"key": k, "value": v} for k, v in flat.items()]))
    return json_path, csv_path, summary_path


# --------------------------------------------------------------------------------------------- HTML
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em;color:#222;max-width:1400px}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ccc;padding-bottom:.2em}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
img{max-width:100%;image-rendering:pixelated;border:1px solid #ddd;margin:.4em 0}
p.note{color:#555}ul.links{padding-left:1.2em}
"""

_METRIC_FILES = ("metrics.json", "metrics.csv", "summary.csv")


def _fmt(v: Any) -> str:
    """Numbers with 6 significant digits (12.89 dB and 4514.91 both stay exact); others via str."""
    v = _jsonable(v)
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return str(v)


def _esc(v: Any) -> str:
    return html.escape(_fmt(v), quote=True)


def _href(folder: Path, p: str | os.PathLike) -> str:
    """Link target relative to the page's folder, percent-encoded and HTML-escaped."""
    path = Path(p)
    if path.is_absolute():
        with contextlib.suppress(ValueError):  # outside the folder: keep absolute (still works locally)
            path = path.resolve().relative_to(folder.resolve())
    return html.escape(quote(path.as_posix(), safe="/"), quote=True)


def _kv_table(d: Mapping[str, Any]) -> str:
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{_esc(v)}</td></tr>" for k, v in _flatten(d).items())
    return f"<table>{rows}</table>"


def _summary_table(summary: Mapping[str, Any]) -> str:
    """Metric | mean | std, pairing ``m`` with ``m_std``; other keys get their own row."""
    flat = _flatten(summary)
    bases = [k for k in flat if not k.endswith("_std")]
    orphan_std = [k for k in flat if k.endswith("_std") and k[:-4] not in flat]
    has_std = any(f"{k}_std" in flat for k in bases)
    head = "<tr><th>metric</th><th>mean</th>" + ("<th>std</th>" if has_std else "") + "</tr>"
    body = ""
    for k in bases + orphan_std:
        std = f"<td class=num>{_esc(flat[k + '_std'])}</td>" if k + "_std" in flat else "<td></td>"
        body += f"<tr><th>{html.escape(k)}</th><td class=num>{_esc(flat[k])}</td>" + (std if has_std else "") + "</tr>"
    return f"<table>{head}{body}</table>"


def write_html(folder: str | os.PathLike, title: str, sections: Sequence[Mapping[str, Any]]) -> Path:
    """Write ``folder/index.html``: per section a heading, protocol table, galleries, summary table.

    Section keys (all optional): ``heading`` (str), ``text`` (a paragraph), ``protocol`` (mapping),
    ``images`` (path or list of paths, relative to ``folder`` or absolute inside it), ``summary``
    (mapping, e.g. from :func:`attacks.metrics.summarize`), ``links`` (mapping label -> path).
    The page links ``metrics.json`` / ``metrics.csv`` / ``summary.csv`` when they exist in
    ``folder`` (call :func:`write_metrics` first).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    present = [n for n in _METRIC_FILES if (folder / n).is_file()]
    if present:
        parts.append('<ul class="links">' + "".join(f'<li><a href="{_href(folder, n)}">{html.escape(n)}</a></li>' for n in present) + "</ul>")
    for i, sec in enumerate(sections):
        parts.append("<section>")
        parts.append(f"<h2>{html.escape(str(sec.get('heading', f'Section {i + 1}')))}</h2>")
        if sec.get("text"):
            parts.append(f'<p class="note">{html.escape(str(sec["text"]))}</p>')
        if sec.get("protocol"):
            parts.append("<h3>Protocol</h3>" + _kv_table(sec["protocol"]))
        images = sec.get("images") or []
        if isinstance(images, (str, os.PathLike)):
            images = [images]
        for img in images:
            src = _href(folder, img)
            parts.append(f'<div><a href="{src}"><img src="{src}" alt="{html.escape(Path(img).name)}"></a></div>')
        if sec.get("summary"):
            parts.append("<h3>Summary</h3>" + _summary_table(sec["summary"]))
        links = sec.get("links") or {}
        if links:
            parts.append(
                '<ul class="links">'
                + "".join(f'<li><a href="{_href(folder, p)}">{html.escape(str(label))}</a></li>' for label, p in links.items())
                + "</ul>"
            )
        parts.append("</section>")
    parts.append("</body></html>\n")
    out = folder / "index.html"
    atomic_write_text(out, "\n".join(parts))
    return out
