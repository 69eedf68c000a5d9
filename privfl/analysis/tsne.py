"""t-SNE of what clients learned, with numbers that say how well classes separate.

FedRE [000] Figure 5 shows per-client class prototypes of FedAvg, FedProto, FedGH and FedRE, colour =
class, and claims FedRE's prototypes of one class cluster across clients. Here each panel is one run:
every client's checkpointed model is applied to the client's own train split, giving

* ``proto``: per-client class prototypes (mean ``model.represent(x)`` per class present), one point
  per (client, class), as the methods themselves compute them;
* ``rep``: per-sample representations (a seeded subsample per client);
* ``module:NAME``: per-sample outputs of any named submodule (forward hook, flattened), e.g. a
  method's latents; with ``prototypes=True`` averaged per (client, class) like ``proto``.

t-SNE is for the eye only: distances in it are not meaningful, so the separation numbers are computed
in the original space (before t-SNE): the silhouette score by class label (sklearn; in [-1, 1],
higher = tighter, better separated classes), a leave-one-out kNN class accuracy, and the silhouette
by client (high = points group by client rather than class). The 2-D silhouette is given as well.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from privfl.analysis.loading import RunModels, sample_ids
from privfl.errors import ConfigError
from privfl.seeding import numpy_rng

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p", "8", "d", "H", "1", "2", "3", "4", "+")


@dataclass(frozen=True)
class Space:
    """What each point is: the vector (``rep`` or ``module:NAME``) and whether points are prototypes."""

    feature: str
    prototypes: bool

    @classmethod
    def parse(cls, text: str, prototypes: bool = False) -> Space:
        if text == "proto":
            return cls("rep", True)
        if text == "rep":
            return cls("rep", prototypes)
        if text.startswith("module:") and len(text) > len("module:"):
            return cls(text, prototypes)
        raise ConfigError(f"unknown --space {text!r}; accepted: proto, rep, module:NAME (a dotted submodule name)")

    @property
    def label(self) -> str:
        what = "model.represent(x)" if self.feature == "rep" else f"output of module {self.feature[7:]!r} (flattened)"
        return f"{'per-client class prototypes (class means) of ' if self.prototypes else 'per-sample '}{what}"


@dataclass
class Panel:
    """One run's points: vectors in the original space, their t-SNE coordinates and the numbers."""

    run: RunModels
    vectors: np.ndarray  # (n, d)
    classes: np.ndarray  # (n,)
    clients: np.ndarray  # (n,)
    counts: np.ndarray  # (n,) samples behind each point (1 for per-sample points)
    embedding: np.ndarray | None = None  # (n, 2)
    metrics: dict[str, Any] | None = None


def client_vectors(rm: RunModels, k: int, space: Space, ids: torch.Tensor, batch_size: int) -> torch.Tensor:
    """(n, d) vectors of client ``k``'s samples ``ids`` in ``space``, eval mode, no gradients."""
    model = rm.model(k)
    if space.feature == "rep":
        if not callable(getattr(model, "represent", None)):
            raise ConfigError(f"client{k}'s model ({type(model).__name__}) has no represent(x); use --space module:NAME")
        compute = cast(Callable[[torch.Tensor], torch.Tensor], model.represent)  # checked callable above
    else:
        name = space.feature[len("module:") :]
        modules = dict(model.named_modules())
        if name not in modules or not name:
            shown = ", ".join(n for n in list(modules)[1:41])
            raise ConfigError(
                f"unknown module {name!r} in client{k}'s model ({rm.info['archs'][k]}); modules: {shown}" + (" ..." if len(modules) > 41 else "")
            )
        forward, _ = rm.predictor(k, "auto")
        compute = _hooked(modules[name], forward, name, k)
    out = []
    with torch.no_grad():
        for start in range(0, len(ids), batch_size):
            out.append(compute(rm.client_data(ids[start : start + batch_size]).x).flatten(1).float().cpu())
    return torch.cat(out) if out else torch.empty(0, 0)


def _hooked(module: torch.nn.Module, forward: Callable, name: str, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> the output of ``module`` during ``forward(x)`` (its last call). A module that returns a
    tuple or list (a Gaussian encoder's (mean, log-variance)) gives its first tensor: the mean, the
    point estimate of the latent."""

    def run(x: torch.Tensor) -> torch.Tensor:
        got: list[Any] = []
        handle = module.register_forward_hook(lambda _m, _i, out: got.append(out))
        try:
            forward(x)
        finally:
            handle.remove()
        if not got:
            raise ConfigError(f"module {name!r} of client{k} does not run in the model's forward")
        out = got[-1]
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise ConfigError(f"module {name!r} of client{k} outputs {type(out).__name__}, not a tensor; name one of its submodules")
        return out

    return run


def collect(
    rm: RunModels, space: Space, clients: Sequence[int] | None, max_samples: int | None, seed: int, progress: Callable[[Any], Any] = lambda it: it
) -> Panel:
    """One run's points: prototypes over each client's whole train split, or a seeded per-client
    subsample of per-sample vectors (the same draw for every run of the same partition and seed)."""
    from privfl.fl.method import class_prototypes

    vecs, classes, owners, counts = [], [], [], []
    num_classes = len(rm.class_names)
    for k in progress(list(clients) if clients is not None else list(range(rm.num_clients))):
        ids = rm.client_ids(k, "train")
        if not space.prototypes:
            ids = sample_ids(ids, max_samples, numpy_rng(seed, "tsne", k))
        if len(ids) == 0:
            continue
        v = client_vectors(rm, k, space, ids, int(rm.config.get("eval_batch_size", 512)))
        y = rm.labels_of(ids)
        if space.prototypes:
            present, protos, n = class_prototypes(v.double(), y, num_classes)
            v, y, c = protos.float(), present, n
        else:
            c = torch.ones(len(y), dtype=torch.long)
        vecs.append(v)
        classes.append(y)
        owners.append(torch.full((len(y),), k))
        counts.append(c)
    dims = sorted({v.shape[1] for v in vecs})
    if len(dims) > 1:
        raise ConfigError(
            f"{space.feature} has different sizes across clients of {rm.name} ({', '.join(map(str, dims))}); "
            "pick clients with the same architecture (--clients) or a module with a common size"
        )
    if not vecs:
        raise ConfigError(f"run {rm.name}: the chosen clients have no training samples")
    return Panel(rm, torch.cat(vecs).double().numpy(), torch.cat(classes).numpy(), torch.cat(owners).numpy(), torch.cat(counts).numpy())


def separation(x: np.ndarray, classes: np.ndarray, clients: np.ndarray, metric: str, knn_k: int = 5) -> dict[str, Any]:
    """Silhouette by class and by client, and leave-one-out kNN class accuracy, in the space of ``x``.

    A silhouette needs 2..n-1 distinct labels; otherwise it is None with the reason alongside.
    """
    from sklearn.metrics import silhouette_score
    from sklearn.neighbors import NearestNeighbors

    n = len(x)

    def silhouette(labels: np.ndarray, what: str) -> tuple[float | None, str | None]:
        m = len(np.unique(labels))
        if not 2 <= m <= n - 1:
            return None, f"{m} distinct {what} among {n} points (needs 2..n-1)"
        return float(silhouette_score(x, labels, metric=metric)), None

    out: dict[str, Any] = {"points": n, "dim": int(x.shape[1]), "metric": metric}
    out["silhouette"], why = silhouette(classes, "classes")
    if why:
        out["silhouette_note"] = why
    out["silhouette_by_client"], why = silhouette(clients, "clients")
    if why:
        out["silhouette_by_client_note"] = why
    k = min(knn_k, n - 1)
    if k >= 1:
        nn = NearestNeighbors(n_neighbors=k + 1, metric=metric).fit(x)
        _, idx = nn.kneighbors(x)
        correct = 0
        for i in range(n):
            neigh = [j for j in idx[i] if j != i][:k]  # leave the point itself out
            votes = np.bincount(classes[neigh], minlength=int(classes.max()) + 1)
            best = np.flatnonzero(votes == votes.max())
            # ties go to the class of the nearest neighbour among the tied classes
            pred = next(classes[j] for j in neigh if classes[j] in best)
            correct += int(pred == classes[i])
        out["knn_accuracy"], out["knn_k"] = correct / n, k
    else:
        out["knn_accuracy"], out["knn_k"] = None, 0
    return out


def embed(panel: Panel, seed: int, metric: str, perplexity: float | None) -> None:
    """t-SNE to 2-D (PCA init, fixed seed: deterministic on CPU) and the numbers, stored on the panel."""
    from sklearn.manifold import TSNE

    n = len(panel.vectors)
    if n < 4:
        raise ConfigError(f"run {panel.run.name}: only {n} point(s); t-SNE needs at least 4 (more clients or samples)")
    p = perplexity if perplexity is not None else float(min(30.0, max(2.0, (n - 1) / 3)))
    if not 0 < p < n:
        raise ConfigError(f"--perplexity must be in (0, {n}) for run {panel.run.name} ({n} points), got {p}")
    tsne = TSNE(n_components=2, perplexity=p, init="pca", random_state=seed, metric=metric)
    panel.embedding = tsne.fit_transform(panel.vectors)
    metrics = separation(panel.vectors, panel.classes, panel.clients, metric)
    flat = separation(panel.embedding, panel.classes, panel.clients, "euclidean")
    metrics.update(
        {"silhouette_2d": flat["silhouette"], "knn_accuracy_2d": flat["knn_accuracy"], "perplexity": p, "kl_divergence": float(tsne.kl_divergence_)}
    )
    panel.metrics = metrics


def plot_panels(panels: Sequence[Panel], space: Space, title: str, dpi: int = 100) -> bytes:
    """PNG bytes: one t-SNE panel per run (colour = class, marker = client), separation under each."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    names = panels[0].run.class_names
    cmap_name = "tab10" if len(names) <= 10 else "tab20"
    ncols = min(len(panels), 4)
    nrows = -(-len(panels) // ncols)
    fig = Figure(figsize=(3.6 * ncols + 1.9, 3.9 * nrows + 0.6), dpi=dpi)
    FigureCanvasAgg(fig)
    cmap = matplotlib.colormaps[cmap_name]
    colour = {c: cmap(c % cmap.N) for c in range(len(names))}
    right = 1 - 1.9 / (3.6 * ncols + 1.9)
    fig.subplots_adjust(left=0.04, right=right, top=1 - 0.75 / (3.9 * nrows + 0.6), bottom=0.1 / nrows, wspace=0.12, hspace=0.45)
    fig.suptitle(title, fontsize=10, weight="bold")
    clients_seen: set[int] = set()
    classes_seen: set[int] = set()
    for i, p in enumerate(panels):
        assert p.embedding is not None  # embedded before plotting
        ax = fig.add_subplot(nrows, ncols, i + 1)
        ax.set_xticks([])
        ax.set_yticks([])
        size = 36 if space.prototypes else 10
        for k in np.unique(p.clients):
            sel = p.clients == k
            ax.scatter(
                p.embedding[sel, 0],
                p.embedding[sel, 1],
                c=[colour[int(c)] for c in p.classes[sel]],
                marker=MARKERS[int(k) % len(MARKERS)],
                s=size,
                linewidths=0.3,
                edgecolors="black",
                alpha=0.9,
            )
            clients_seen.add(int(k))
        classes_seen.update(int(c) for c in np.unique(p.classes))
        m = p.metrics or {}
        sil = "n/a" if m.get("silhouette") is None else f"{m['silhouette']:.3f}"
        knn = "n/a" if m.get("knn_accuracy") is None else f"{m['knn_accuracy']:.2f}"
        ax.set_title(f"{p.run.method} ({p.run.name[:28]})", fontsize=8.5)
        ax.set_xlabel(f"silhouette {sil}  ·  {m.get('knn_k', 0)}-NN acc {knn}\n(original {m.get('dim')}-d space, {m.get('metric')})", fontsize=7.5)
    class_handles = [Line2D([], [], marker="o", ls="", color=colour[c], label=names[c][:16]) for c in sorted(classes_seen)]
    client_handles = [
        Line2D([], [], marker=MARKERS[k % len(MARKERS)], ls="", color="grey", markeredgecolor="black", label=f"client{k}")
        for k in sorted(clients_seen)
    ]
    leg = fig.legend(
        handles=class_handles,
        title="class (colour)",
        loc="upper left",
        bbox_to_anchor=(right + 0.01, 0.95),
        fontsize=7,
        title_fontsize=7.5,
        frameon=False,
    )
    fig.add_artist(leg)
    fig.legend(
        handles=client_handles[:20],
        title="client (marker)",
        loc="lower left",
        bbox_to_anchor=(right + 0.01, 0.02),
        fontsize=7,
        title_fontsize=7.5,
        frameon=False,
        ncols=1 if len(client_handles) <= 10 else 2,
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor="white")
    return buf.getvalue()


def panel_row(p: Panel, space: Space) -> dict[str, Any]:
    """The per-run summary row (also a CSV line)."""
    m = p.metrics or {}
    return {
        "run": str(p.run.run_dir),
        "name": p.run.name,
        "method": p.run.method,
        "round": p.run.round,
        "space": space.feature,
        "prototypes": space.prototypes,
        "clients": int(len(np.unique(p.clients))),
        "classes": int(len(np.unique(p.classes))),
        **{
            k: m.get(k)
            for k in (
                "points",
                "dim",
                "metric",
                "silhouette",
                "knn_accuracy",
                "knn_k",
                "silhouette_by_client",
                "silhouette_2d",
                "knn_accuracy_2d",
                "perplexity",
                "kl_divergence",
            )
        },
        **{k: v for k, v in m.items() if k.endswith("_note")},
    }


def point_rows(panels: Sequence[Panel]) -> list[dict[str, Any]]:
    rows = []
    for i, p in enumerate(panels):
        assert p.embedding is not None  # embedded before its rows are written
        names = p.run.class_names
        for j in range(len(p.vectors)):
            rows.append(
                {
                    "panel": i,
                    "run": p.run.name,
                    "client": int(p.clients[j]),
                    "class": int(p.classes[j]),
                    "class_name": names[int(p.classes[j])],
                    "samples": int(p.counts[j]),
                    "x": round(float(p.embedding[j, 0]), 5),
                    "y": round(float(p.embedding[j, 1]), 5),
                }
            )
    return rows


__all__ = ["Panel", "Space", "collect", "embed", "panel_row", "plot_panels", "point_rows", "separation"]
