"""``python -m privfl.analyze``: look inside trained runs' client models.

    python -m privfl.analyze gradcam --module features --class bird --clients 0,1,2,3   # latest run
    python -m privfl.analyze gradcam --run runs/X --module learngene,personanet --same-images
    python -m privfl.analyze tsne --runs runs/A,runs/B,runs/C --space proto             # FedRE Figure 5
    python -m privfl.analyze tsne --runs latest --space rep --max-samples 200
    python -m privfl.analyze tsne --runs runs/X --space module:features.3 --prototypes

gradcam writes ``RUN/analysis/gradcam-<modules>-<class>/``: ``gradcam.png`` (columns ground truth |
module ..., one row per client image), ``maps.safetensors`` (raw maps at input size) and
``gradcam.json``. tsne writes ``RUN/analysis/tsne-<space>/`` for one run, or
``<runs' folder>/analysis/tsne-<space>-<run names>/`` for several: ``tsne.png`` (one panel per run),
``tsne.json``, ``summary.csv`` (silhouette and kNN accuracy per run, computed before t-SNE),
``points.csv`` and ``vectors.safetensors``. Everything is computed from each run's latest checkpoint.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from privfl.cli import PLUGIN_HELP, ArgumentParser, load_plugins, run_cli
from privfl.errors import ConfigError
from privfl.runs import check_output_name, check_replaceable, output_path, write_output_folder

RUN_HELP = "run directory or name (default: the latest); tsne: one run, as --runs"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m privfl.analyze", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    # --run/--out-dir/--plugin go before or after the subcommand (after: the subparser's value wins)
    parser.add_argument("--run", default=None, help=RUN_HELP)
    parser.add_argument("--out-dir", default="runs", help="where run names are looked up (default: runs)")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE", help=PLUGIN_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    common = ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument("--run", default=argparse.SUPPRESS, help=RUN_HELP)
    common.add_argument("--out-dir", default=argparse.SUPPRESS, help="where run names are looked up (default: runs)")
    common.add_argument("--clients", help="comma list of client ids (0,3 or client0,client3)")
    common.add_argument("--seed", type=int, default=0, help="fixes which images/samples are drawn and the t-SNE")
    common.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    common.add_argument("--data-root", help="where the run's dataset lives, if not where training found it")
    common.add_argument("--name", help="output folder name (default from the options)")
    common.add_argument("--no-progress", action="store_true")
    common.add_argument("--plugin", action="append", default=argparse.SUPPRESS, metavar="MODULE", help=PLUGIN_HELP)
    fmt = argparse.ArgumentDefaultsHelpFormatter
    g = sub.add_parser(
        "gradcam",
        parents=[common],
        formatter_class=fmt,
        help="Grad-CAM of named modules of clients' models (DRDFL Figure 7 layout)",
        allow_abbrev=False,
    )
    g.add_argument(
        "--module",
        required=True,
        help="comma list of submodule names as in named_modules() (features, features.3, learngene, ...); "
        "a module without a spatial output stands for the last spatial module inside it",
    )
    g.add_argument("--class", dest="cls", help="class name or index to explain (default: each image's true label)")
    g.add_argument("--images", type=int, default=2, help="images per client (its own test images of the class)")
    g.add_argument("--max-clients", type=int, default=4, help="without --clients: the first N clients that have such images")
    g.add_argument(
        "--same-images",
        action="store_true",
        help="every client explains the same images (pooled from the shown clients); adds a cross-client consistency number per module",
    )
    g.add_argument(
        "--target",
        default="auto",
        choices=("auto", "model", "predict"),
        help="score explained: the model's logits, or the method's predict (auto: predict when it needs only the client model)",
    )
    t = sub.add_parser(
        "tsne",
        parents=[common],
        formatter_class=fmt,
        help="t-SNE of per-client class prototypes or per-sample representations, one panel per run",
        allow_abbrev=False,
    )
    t.add_argument("--runs", help="comma list of run directories or names (default: --run, else the latest)")
    t.add_argument(
        "--space",
        default="proto",
        help="proto (class prototypes of model.represent), rep (per-sample representations) or module:NAME (per-sample output of a submodule)",
    )
    t.add_argument("--prototypes", action="store_true", help="rep / module:NAME: average per (client, class) like proto")
    t.add_argument("--max-samples", type=int, default=100, help="per-sample spaces: seeded subsample per client")
    t.add_argument("--metric", default="euclidean", choices=("euclidean", "cosine"), help="distance for t-SNE, silhouette and kNN")
    t.add_argument("--perplexity", type=float, help="t-SNE perplexity (default: min(30, (n-1)/3))")
    t.add_argument("--output", help="output folder (default: see above)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    load_plugins(argv)
    args = build_parser().parse_args(argv)
    # the numbers first: a bad one fails before any run is opened
    _positive(args.seed, "--seed", 0)
    if args.command == "gradcam":
        _positive(args.images, "--images")
        _positive(args.max_clients, "--max-clients")
    else:
        _positive(args.max_samples, "--max-samples")
        if args.perplexity is not None and not args.perplexity > 0:
            raise ConfigError(f"--perplexity must be > 0, got {args.perplexity}")
    return gradcam_command(args) if args.command == "gradcam" else tsne_command(args)


# ------------------------------------------------------------------------------------------ output
def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("_") or "x"


def _atomic_folder(final: Path, files: dict[str, bytes], by: str) -> Path:
    """``files`` written into ``final`` whole (:func:`privfl.runs.write_output_folder`)."""

    def write(folder: Path) -> None:
        for name, data in files.items():
            (folder / name).write_bytes(data)

    return write_output_folder(final, write, by=by)


def _output_folder(parent: Path, name: str | None, default: str) -> Path:
    """``parent/<--name or default>``, checked before the work (:func:`privfl.runs.output_path`)."""
    return output_path(parent, name if name is not None else default)


def _output_path(text: str) -> Path:
    """``--output DIR``: absolute (``.`` and ``..`` resolved by name, links kept), absent or a privfl output."""
    final = Path(os.path.abspath(text))
    if final == final.parent:  # the file-system root
        raise ConfigError(f"--output {text!r} must name a folder privfl can create or replace")
    check_replaceable(final)
    return final


def _json_bytes(data: Any) -> bytes:
    return (json.dumps(data, indent=2, allow_nan=False, default=str) + "\n").encode()


def _csv_bytes(rows: list[dict[str, Any]]) -> bytes:
    header = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, header)
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue().encode()


def _tensors_bytes(tensors: dict[str, Any]) -> bytes:
    from safetensors.torch import save

    from privfl.capture.store import portable_tensors

    return save(portable_tensors(tensors))


def _progress(args, desc: str):
    from tqdm.auto import tqdm

    return lambda it: tqdm(it, desc=desc, unit="client", disable=args.no_progress, dynamic_ncols=True, leave=False)


def _open(run: str | None, args) -> Any:
    from privfl.runs import resolve_run

    run_dir = resolve_run(run, args.out_dir)  # before the heavy imports: a bad --run fails at once

    from privfl.engine import resolve_device
    from privfl.run import Run

    return Run(run_dir).models(data_root=args.data_root, device=resolve_device(args.device))


def _positive(value: int, flag: str, minimum: int = 1) -> int:
    if value < minimum:
        raise ConfigError(f"{flag} must be at least {minimum}, got {value}")
    return value


# ------------------------------------------------------------------------------------------ gradcam
def gradcam_command(args) -> int:
    if args.name is not None:
        check_output_name(args.name)
    rm = _open(args.run, args)

    from privfl.analysis.gradcam import describe, map_tensors, plot_gradcam, run_gradcam
    from privfl.analysis.loading import parse_client_ids, resolve_class

    modules = [m.strip() for m in args.module.split(",") if m.strip()]
    class_index = resolve_class(args.cls, rm.class_names) if args.cls is not None else None
    what = rm.class_names[class_index] if class_index is not None else "true-label"
    final = _output_folder(rm.run_dir / "analysis", args.name, _slug(f"gradcam-{'+'.join(modules)}-{what}{'-same' if args.same_images else ''}"))
    result = run_gradcam(
        rm,
        modules,
        clients=parse_client_ids(args.clients, rm.num_clients),
        class_index=class_index,
        per_client=_positive(args.images, "--images"),
        max_clients=_positive(args.max_clients, "--max-clients"),
        same_images=args.same_images,
        target=args.target,
        seed=args.seed,
        progress=_progress(args, "grad-cam"),
    )
    info = {**describe(result, rm), "seed": args.seed, "device": str(rm.device)}
    title = f"Grad-CAM: {rm.method}, round {rm.round}, " + (f"class {what!r}" if class_index is not None else "true labels")
    final = _atomic_folder(
        final,
        {
            "gradcam.png": plot_gradcam(result, rm.class_names, title),
            "maps.safetensors": _tensors_bytes(map_tensors(result)),
            "gradcam.json": _json_bytes(info),
        },
        "privfl.analyze gradcam",
    )
    print(f"grad-cam of {', '.join(modules)} on {len(result.rows)} client(s), {info['layout']['rows']} image(s) ({rm.method}, round {rm.round})")
    for row in result.rows:
        layers = ", ".join(f"{m} -> {row.layers[m]} {row.coarse[m][0]}x{row.coarse[m][1]}" for m in modules)
        print(f"  client{row.client} ({row.arch}, {result.target_note[row.client]}): {layers}")
    for k, why in result.skipped.items():
        print(f"  client{k} skipped: {why}")
    for m, v in info["consistency_mean_pairwise_cosine"].items():
        if v is not None:
            print(f"  {m}: mean pairwise cosine across clients {v:.3f}")
    print(f"  results: {final}/gradcam.png")
    return 0


# ------------------------------------------------------------------------------------------ tsne
def tsne_command(args) -> int:
    from privfl.runs import resolve_run

    if args.runs is not None and args.run is not None:
        raise ConfigError("tsne takes --runs (a comma list) or --run (one run), not both")
    runs_text = args.runs if args.runs is not None else (args.run or "latest")
    names = [r.strip() for r in runs_text.split(",") if r.strip()]
    if not names:
        raise ConfigError("--runs needs at least one run")
    for n in names:
        resolve_run(n, args.out_dir)  # before the heavy imports: a bad name fails at once
    if args.name is not None:
        check_output_name(args.name)
    if args.output is not None:
        _output_path(args.output)

    import torch

    from privfl.analysis.loading import parse_client_ids
    from privfl.analysis.tsne import Space, collect, embed, panel_row, plot_panels, point_rows

    space = Space.parse(args.space, args.prototypes)
    runs = [_open(n, args) for n in names]
    classes = {tuple(rm.class_names) for rm in runs}
    if len(classes) > 1:
        raise ConfigError("--runs must share one dataset (their class names differ)")
    max_samples = _positive(args.max_samples, "--max-samples")
    tag = "proto" if args.space == "proto" else _slug(args.space) + ("-prototypes" if args.prototypes else "")
    if args.output:
        final = _output_path(args.output)
    elif len(runs) == 1:
        final = _output_folder(runs[0].run_dir / "analysis", args.name, f"tsne-{tag}")
    else:
        joined = "+".join(rm.name for rm in runs)
        if len(joined) > 80:
            joined = joined[:60] + "-" + hashlib.sha256(joined.encode()).hexdigest()[:10]
        final = _output_folder(runs[0].run_dir.parent / "analysis", args.name, _slug(f"tsne-{tag}-{joined}"))
    panels = []
    for rm in runs:
        clients = parse_client_ids(args.clients, rm.num_clients)
        panel = collect(rm, space, clients, max_samples, args.seed, _progress(args, f"{rm.name} {space.feature}"))
        if not args.no_progress:
            print(f"t-SNE of {len(panel.vectors)} points of {rm.name} ...", file=sys.stderr)
        embed(panel, args.seed, args.metric, args.perplexity)
        panels.append(panel)
    rows = [panel_row(p, space) for p in panels]
    info = {
        "space": space.label,
        "prototypes": space.prototypes,
        "metric": args.metric,
        "seed": args.seed,
        "samples": "each client's train split" + ("" if space.prototypes else f", at most {max_samples} per client (seeded)"),
        "separation": "silhouette (sklearn, by class label; in [-1, 1]) and leave-one-out kNN class accuracy, computed in the "
        "original space before t-SNE; *_2d: the same on the t-SNE coordinates; silhouette_by_client: by client id",
        "tsne": "sklearn TSNE, 2 components, init=pca, random_state=seed",
        "panels": rows,
        "points": point_rows(panels),
    }
    tensors = {}
    for i, p in enumerate(panels):
        tensors.update(
            {
                f"{i}.vectors": torch.from_numpy(p.vectors).float(),
                f"{i}.tsne": torch.from_numpy(p.embedding).float(),
                f"{i}.classes": torch.from_numpy(p.classes).long(),
                f"{i}.clients": torch.from_numpy(p.clients).long(),
                f"{i}.samples": torch.from_numpy(p.counts).long(),
            }
        )
    title = f"t-SNE of {space.label}; colour = class, marker = client"
    final = _atomic_folder(
        final,
        {
            "tsne.png": plot_panels(panels, space, title),
            "tsne.json": _json_bytes(info),
            "summary.csv": _csv_bytes(rows),
            "points.csv": _csv_bytes(info["points"]),
            "vectors.safetensors": _tensors_bytes(tensors),
        },
        "privfl.analyze tsne",
    )
    print(f"t-SNE of {space.label}; separation in the original space ({args.metric}):")
    for r in rows:
        sil = "n/a" if r["silhouette"] is None else f"{r['silhouette']:+.3f}"
        knn = "n/a" if r["knn_accuracy"] is None else f"{r['knn_accuracy']:.3f}"
        byc = "n/a" if r["silhouette_by_client"] is None else f"{r['silhouette_by_client']:+.3f}"
        print(f"  {r['method']:<10} {r['name'][:40]:<40} {r['points']:>5} points  silhouette {sil}  {r['knn_k']}-NN acc {knn}  (by client {byc})")
    print(f"  results: {final}/tsne.png")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("privfl.analyze", main))
