"""FedRE Figure 4: how much do representations, prototypes and entangled representations leak?

Paper: Yao et al., "FedRE: A Representation Entanglement Framework for Model-Heterogeneous Federated
Learning", CVPR 2026 (arXiv 2511.22265), Q2 of Sec. 4 and Fig. 4 (Q3 in the NeurIPS 2025 submission).

Runs :func:`attacks.compare_artifacts` (what ``python -m privfl.attack invert --compare rep,proto,ent_rep``
does) on several clients of a FedRE run and prints, beside the paper's Tiny-ImageNet numbers, the mean PSNR / MSE (0-255 scale, per image
then averaged, as the paper's numbers imply) and SSIM of each artifact, and whether the paper's
ordering rep > proto > ent_rep holds.

    python -m experiments.papers.fedre.inversion                        # the latest run (make demo trains one)
    python -m experiments.papers.fedre.inversion --run runs/X --settings paper --clients 0,1,2,3   # the DIP authors' 3100 steps
    python -m experiments.papers.fedre.inversion --train experiments/papers/fedre/tinyimagenet_pra_hete.toml --data-root DATA
        # trains the paper's Tiny-ImageNet/HtM10 setting first (needs the data and a GPU)
"""

from __future__ import annotations

import argparse
import statistics
import sys

import privfl
from attacks import compare_artifacts
from attacks.dip import PAPER_SETTINGS, DIPConfig
from privfl.config import build_config, read_config_file
from privfl.methods import resolve_method
from privfl.run import Run

KINDS = ("rep", "proto", "ent_rep")

PAPER = {"rep": (12.89, 4514.91), "proto": (10.25, 6992.04), "ent_rep": (9.66, 7781.87)}  # PSNR, MSE: the paper's Q2 (Fig. 4), Tiny-ImageNet


def train_config(path: str, data_root: str | None, progress: bool) -> Run:
    """Train a config file as ``python -m privfl.train --config`` does: the file's settings only,
    no method quick defaults."""
    values = {"method": "fedre", **read_config_file(path), "progress": progress}
    if data_root:
        values["data_root"] = data_root
    return privfl.train(build_config(values, resolve_method(values["method"]).Options))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.papers.fedre.inversion", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--run", help="a FedRE run (default: the latest)")
    p.add_argument("--train", help="train this config first (e.g. experiments/papers/fedre/tinyimagenet_pra_hete.toml)")
    p.add_argument("--data-root")
    p.add_argument("--clients", default="0,1,2", help="clients to compare on")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--settings", choices=("privfl", "paper"), default="privfl", help="DIP steps/lr/upsampling: privfl's or the DIP authors'")
    p.add_argument("--steps", type=int, help="DIP steps (default: from --settings)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    dip: dict = dict(PAPER_SETTINGS) if args.settings == "paper" else {}
    if args.steps is not None:
        dip["steps"] = args.steps
    args.steps = DIPConfig(**dip).steps
    trained = train_config(args.train, args.data_root, not args.no_progress) if args.train else None
    run = trained if trained is not None and args.run is None else Run.open(args.run)
    rows: dict[str, list[dict]] = {k: [] for k in KINDS}
    for client in args.clients.split(","):
        report = compare_artifacts(
            run,
            KINDS,
            client=client,
            samples=args.samples,
            options=dip,
            seed=args.seed,
            device=args.device,
            progress=not args.no_progress,
            data_root=args.data_root,
        )
        for image in report.rows:
            rows[image["kind"]].append(image)
    print(f"\nrun {run.path}: {len(args.clients.split(','))} client(s) x {args.samples} image(s), {args.steps} DIP steps")
    print(f"{'artifact':<10}{'PSNR dB':>9}{'MSE 0-255':>11}{'SSIM':>7}{'best PSNR':>11}   paper PSNR / MSE (Tiny-ImageNet)")
    means = {}
    for kind, images in rows.items():
        psnr = statistics.mean(r["sample_psnr255"] for r in images)
        mse = statistics.mean(r["sample_mse255"] for r in images)
        ssim = statistics.mean(r["sample_ssim"] for r in images)
        best = statistics.mean(r["best_psnr255"] for r in images)
        cf = " (counterfactual)" if images[0]["counterfactual"] else ""
        means[kind] = psnr
        print(f"{kind:<10}{psnr:9.2f}{mse:11.2f}{ssim:7.3f}{best:11.2f}   {PAPER[kind][0]:.2f} / {PAPER[kind][1]:.2f}{cf}")
    holds = means["rep"] > means["proto"] > means["ent_rep"]
    print(f"paper ordering rep > proto > ent_rep holds: {holds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
