"""FedRE Figure 4 / Q3: how much do representations, prototypes and entangled representations leak?

Runs ``python -m privfl.attack invert --compare rep,proto,ent_rep`` on several clients of a FedRE run
and prints, beside the paper's Tiny-ImageNet numbers, the mean PSNR / MSE (0-255 scale, per image
then averaged, as the paper's numbers imply) and SSIM of each artifact, and whether the paper's
ordering rep > proto > ent_rep holds.

    python experiments/fedre_inversion.py                        # the latest run (make demo trains one)
    python experiments/fedre_inversion.py --run runs/X --steps 3100 --clients 0,1,2,3
    python experiments/fedre_inversion.py --train experiments/fedre/tinyimagenet_pra_hete.toml --data-root DATA
        # trains the paper's Tiny-ImageNet/HtM10 setting first (needs the data and a GPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from privfl.attack import main as attack_main
from privfl.runs import resolve_run
from privfl.train import main as train_main

PAPER = {"rep": (12.89, 4514.91), "proto": (10.25, 6992.04), "ent_rep": (9.66, 7781.87)}  # [000]/[001] Q3, Tiny-ImageNet


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", help="a FedRE run (default: the latest)")
    p.add_argument("--train", help="train this config first (e.g. experiments/fedre/tinyimagenet_pra_hete.toml)")
    p.add_argument("--data-root")
    p.add_argument("--clients", default="0,1,2", help="clients to compare on")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--steps", type=int, default=3100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args()
    if args.train:
        extra = ["--data-root", args.data_root] if args.data_root else []
        if train_main(["--config", args.train, *extra]) != 0:
            return 1
    run = resolve_run(args.run)
    rows = {k: [] for k in PAPER}
    for client in args.clients.split(","):
        argv = ["invert", "--compare", "rep,proto,ent_rep", "--run", str(run), "--clients", client, "--samples", str(args.samples),
                "--steps", str(args.steps), "--seed", str(args.seed), "--device", args.device]
        if args.no_progress:
            argv.append("--no-progress")
        if args.data_root:
            argv += ["--data-root", args.data_root]
        if attack_main(argv) != 0:
            return 1
        folder = max((run / "attacks").glob(f"compare-rep-proto-ent_rep-client{client.removeprefix('client')}-r*"), key=lambda f: f.stat().st_mtime)
        data = json.loads((folder / "metrics.json").read_text())
        for image in data["images"]:
            rows[image["kind"]].append(image)
    print(f"\nrun {run}: {len(args.clients.split(','))} client(s) x {args.samples} image(s), {args.steps} DIP steps")
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
