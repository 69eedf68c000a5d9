"""Grad-CAM (captum ``LayerGradCam``) of named modules of several clients' models, laid out as DRDFL's
Figure 7: columns ground truth | module A | module B ..., one row per (client, image).

The score explained is the client's class score for a chosen class (default: each image's true
label), computed by the model's forward or by the method's ``predict`` when that needs only the
client model (:meth:`RunModels.predictor`). Maps are ReLU'd Grad-CAM, upsampled bilinearly to the
input size; the raw maps are kept, the figure normalises each map to its own maximum.
With ``same_images`` every client explains the same images, which makes maps comparable across
clients; the mean pairwise cosine between clients' maps of one image then measures how consistent a
module's attention is across clients (DRDFL's claim: Learngene consistent, PersonaNet client-specific;
DRDFL App. VII-C, Fig. 7).
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F

from privfl.analysis.loading import ClientData, RunModels, sample_ids
from privfl.analysis.modules import resolve_spatial_module, trace_outputs
from privfl.errors import ConfigError
from privfl.seeding import numpy_rng


@dataclass
class ClientMaps:
    """One client's explained images and, per requested module, its maps (n, H, W)."""

    client: int
    arch: str
    data: ClientData
    split: str
    targets: torch.Tensor  # (n,) class explained per image
    predicted: torch.Tensor  # (n,)
    target_prob: torch.Tensor  # (n,) softmax probability of the explained class
    layers: dict[str, str]  # requested module -> resolved module
    coarse: dict[str, tuple[int, int]]  # requested module -> (h, w) of the layer's map
    maps: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class GradCamResult:
    modules: list[str]
    class_index: int | None
    target_note: dict[int, str]
    rows: list[ClientMaps]
    same_images: bool
    skipped: dict[int, str]

    def consistency(self) -> dict[str, float | None]:
        """Per module: mean pairwise cosine similarity between clients' maps of the same image."""
        if not self.same_images or len(self.rows) < 2:
            return dict.fromkeys(self.modules)
        out: dict[str, float | None] = {}
        for m in self.modules:
            sims = [
                F.cosine_similarity(a.maps[m].flatten(1), b.maps[m].flatten(1), dim=1, eps=1e-12) for a, b in itertools.combinations(self.rows, 2)
            ]
            out[m] = float(torch.stack(sims).mean())
        return out


def _spatial_size(shape: tuple[int, ...] | None) -> tuple[int, int]:
    """(h, w) of a traced output that resolve_spatial_module accepted, i.e. shaped (B, C, h, w)."""
    assert shape is not None
    return cast(tuple[int, int], tuple(shape[2:]))


def own_images(rm: RunModels, k: int, class_index: int | None) -> tuple[torch.Tensor, str]:
    """Pool ids of client ``k``'s candidate images and their split: its own test images (of the class,
    when one is given), or its train images of the class if its test split has none."""
    ids = rm.client_ids(k, "test")
    if class_index is None:
        return ids, "test"
    for split in ("test", "train"):
        ids = rm.client_ids(k, split)
        ids = ids[rm.labels_of(ids) == class_index]
        if len(ids):
            break
    return ids, split


def run_gradcam(
    rm: RunModels,
    modules: Sequence[str],
    *,
    clients: Sequence[int] | None = None,
    class_index: int | None = None,
    per_client: int = 2,
    max_clients: int = 4,
    same_images: bool = False,
    target: str = "auto",
    seed: int = 0,
    progress: Callable[[Any], Any] = lambda it: it,
) -> GradCamResult:
    """Grad-CAM maps of ``modules`` for each chosen client's images (see module docstring).

    Without ``clients``: the first ``max_clients`` clients that have images of the class and in whose
    model every module resolves to a spatial layer (the others are listed as skipped, with why).
    Given ``clients``, any of them that cannot be explained is an error.
    """
    from captum.attr import LayerAttribution, LayerGradCam

    if not modules:
        raise ConfigError("--module needs at least one module name")
    what = f"images of class {rm.class_names[class_index]!r}" if class_index is not None else "test images"
    wanted = list(clients) if clients is not None else list(range(rm.num_clients))
    plans, skipped, notes = {}, {}, {}
    # resolve every module of every client before the slow part, so a bad name fails at once
    for k in wanted:
        ids, split = own_images(rm, k, class_index)
        if len(ids) == 0:
            skipped[k] = f"no {what}"
            continue
        forward, note = rm.predictor(k, target)
        model = rm.model(k)
        traced = trace_outputs(model, forward, rm.probe_input())
        try:
            layers = {m: resolve_spatial_module(model, traced, m, f"client{k} ({rm.info['archs'][k]})") for m in modules}
        except ConfigError as exc:
            if clients is not None:
                raise
            skipped[k] = str(exc)
            continue
        plans[k], notes[k] = (ids, split, forward, layers, traced), note
        if clients is None and len(plans) == max_clients:
            break
    if not plans:
        k, why = next(iter(skipped.items()))
        others = f" (likewise no other client of the {len(skipped)} tried can be explained)" if len(skipped) > 1 else ""
        raise ConfigError(f"client{k}: {why}{others}" if not why.startswith(("unknown", "module")) else f"{why}{others}")
    shared = None
    if same_images:
        pool = torch.unique(torch.cat([plan[0] for plan in plans.values()]))
        shared = sample_ids(pool, per_client, numpy_rng(seed, "gradcam", "shared"))
    rows = []
    for k in progress(list(plans)):
        ids, split, forward, layers, traced = plans[k]
        if shared is not None:
            ids, split = shared, "pooled from the shown clients"
        else:
            ids = sample_ids(ids, per_client, numpy_rng(seed, "gradcam", k))
        data = rm.client_data(ids)
        with torch.no_grad():
            scores = forward(data.x)
        labels = data.labels.to(scores.device)
        targets = labels if class_index is None else torch.full_like(labels, class_index)
        probs = scores.softmax(1).gather(1, targets[:, None])[:, 0]
        row = ClientMaps(
            k,
            rm.info["archs"][k],
            data,
            split,
            targets.cpu(),
            scores.argmax(1).cpu(),
            probs.cpu(),
            {m: name for m, (name, _) in layers.items()},
            {m: _spatial_size(traced[name].shape) for m, (name, _) in layers.items()},
        )
        for m, (_, layer) in layers.items():
            attr = LayerGradCam(forward, layer).attribute(data.x, target=targets.tolist(), relu_attributions=True)
            up = LayerAttribution.interpolate(attr, tuple(data.x.shape[-2:]), "bilinear")  # (n, 1, H, W)
            row.maps[m] = up[:, 0].detach().float().cpu()
        rows.append(row)
    return GradCamResult(list(modules), class_index, notes, rows, same_images, skipped)


def _overlay(ax, image: np.ndarray, cam: np.ndarray | None) -> None:
    ax.set_axis_off()
    if image.ndim == 2:
        ax.imshow(image, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
    else:
        ax.imshow(image, interpolation="nearest")
    if cam is not None:
        peak = float(cam.max())
        ax.imshow(cam / peak if peak > 0 else cam, cmap="jet", vmin=0.0, vmax=1.0, alpha=0.5, interpolation="bilinear")


def plot_gradcam(result: GradCamResult, class_names: Sequence[str], title: str, dpi: int = 100) -> bytes:
    """PNG bytes of the Figure-7 grid: rows (client, image), columns ground truth | each module."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    entries = [(row, i) for row in result.rows for i in range(len(row.data.ids))]
    ncols = 1 + len(result.modules)
    cell, cap, left, top, pad = 1.35, 0.3, 1.55, 0.75, 0.06
    fig_w = left + ncols * (cell + pad) + 0.1
    fig_h = top + len(entries) * (cell + cap + pad) + 0.1
    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
    FigureCanvasAgg(fig)
    fig.text(0.5, 1 - 0.22 / fig_h, title, ha="center", va="center", fontsize=10, weight="bold")
    headers = ["ground truth", *result.modules]
    for c, text in enumerate(headers):
        x = left + c * (cell + pad) + cell / 2
        fig.text(x / fig_w, 1 - (top - 0.12) / fig_h, text, ha="center", va="bottom", fontsize=8.5, weight="bold")
    for r, (row, i) in enumerate(entries):
        y0 = fig_h - top - r * (cell + cap + pad) - cell
        img = row.data.images[i]
        img_np = img[0].numpy() if img.shape[0] == 1 else img.permute(1, 2, 0).numpy()
        label = class_names[int(row.data.labels[i])]
        fig.text((left - 0.08) / fig_w, (y0 + cell / 2) / fig_h, f"client{row.client}\n{row.arch}\n{label}", ha="right", va="center", fontsize=7.5)
        for c in range(ncols):
            x0 = left + c * (cell + pad)
            ax = fig.add_axes((x0 / fig_w, y0 / fig_h, cell / fig_w, cell / fig_h))
            if c == 0:
                _overlay(ax, img_np, None)
                caption = f"pred {class_names[int(row.predicted[i])][:12]}"
            else:
                m = result.modules[c - 1]
                _overlay(ax, img_np, row.maps[m][i].numpy())
                h, w = row.coarse[m]
                layer = row.layers[m]
                caption = (layer if len(layer) <= 24 else "…" + layer[-23:]) + f" {h}x{w}"
            fig.text((x0 + cell / 2) / fig_w, (y0 - 0.03) / fig_h, caption, ha="center", va="top", fontsize=6.5)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor="white")
    return buf.getvalue()


def describe(result: GradCamResult, rm: RunModels) -> dict[str, Any]:
    """The JSON beside the figure: what was explained, how, and per image the numbers."""
    names = rm.class_names
    images = []
    for row in result.rows:
        for i in range(len(row.data.ids)):
            images.append(
                {
                    "client": row.client,
                    "arch": row.arch,
                    "split": row.split,
                    "pool_index": int(row.data.ids[i]),
                    "label": int(row.data.labels[i]),
                    "label_name": names[int(row.data.labels[i])],
                    "target": int(row.targets[i]),
                    "target_name": names[int(row.targets[i])],
                    "predicted": int(row.predicted[i]),
                    "target_prob": round(float(row.target_prob[i]), 6),
                    "map_max": {m: float(row.maps[m][i].max()) for m in result.modules},
                }
            )
    return {
        "run": str(rm.run_dir),
        "method": rm.method,
        "round": rm.round,
        "dataset": rm.config["dataset"],
        "modules": result.modules,
        "class": None if result.class_index is None else {"index": result.class_index, "name": names[result.class_index]},
        "target_rule": "each image's true label" if result.class_index is None else "the given class",
        "score": {f"client{k}": v for k, v in result.target_note.items()},
        "layers": {f"client{row.client}": row.layers for row in result.rows},
        "layer_map_size": {f"client{row.client}": {m: list(s) for m, s in row.coarse.items()} for row in result.rows},
        "map": "captum LayerGradCam, ReLU'd, bilinear upsampling to the input size; figure normalises each map to its max",
        "image_size": list(result.rows[0].data.x.shape[-2:]),
        "same_images": result.same_images,
        "layout": {
            "columns": ["ground truth", *result.modules],
            "rows": len(images),
            "row_order": "client, then image",
            "clients": [row.client for row in result.rows],
        },
        "consistency_mean_pairwise_cosine": result.consistency(),
        "skipped_clients": {f"client{k}": why for k, why in result.skipped.items()},
        "images": images,
        "maps_file": "maps.safetensors: client<K>.<module> (n, H, W) float32, client<K>.pool_index (n,), client<K>.images (n, C, H, W) in [0,1]",
    }


def map_tensors(result: GradCamResult) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for row in result.rows:
        for m, t in row.maps.items():
            out[f"client{row.client}.{m}"] = t.contiguous()
        out[f"client{row.client}.pool_index"] = row.data.ids.contiguous()
        out[f"client{row.client}.images"] = row.data.images.contiguous()
    return out


__all__ = ["ClientMaps", "GradCamResult", "describe", "map_tensors", "own_images", "plot_gradcam", "run_gradcam"]
