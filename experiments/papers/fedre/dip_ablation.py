"""DIP generator ablation and PSNR-vs-steps curve on one client's representations.

The same targets (client ``--client``'s per-sample representations of its first ``--targets`` training
images, through its extractor at the run's last stored round), the same seeds, and one batched
optimisation per generator variant; PSNR is read at several step counts of the same run
(``snapshot_steps``), so the curve costs one run per variant. The variants change one design choice
at a time from privfl's earlier defaults (average-pool downsampling, nearest upsampling, zero padding,
a power-of-2 canvas) towards a plain DIP (strided convolutions, bilinear upsampling, reflection padding,
the native size), then all four together.

    python -m experiments.papers.fedre.dip_ablation --run runs/fedre-... --steps 250,500,1000,2000,3100
"""

from __future__ import annotations

import argparse
import sys
import time

from attacks.dip import DIPConfig, invert
from attacks.metrics import psnr
from experiments.bench.lib import inversion_targets
from privfl.seeding import derive_seed

OLD = {"downsample": "avg", "upsample": "nearest", "padding": "zeros", "pad_to_power_of_two": True}
VARIANTS: dict[str, dict] = {
    "earlier default (avg, nearest, zeros, 32 px)": OLD,
    "stride": {**OLD, "downsample": "stride"},
    "bilinear": {**OLD, "upsample": "bilinear"},
    "reflect": {**OLD, "padding": "reflect"},
    "native size": {**OLD, "pad_to_power_of_two": False},
    "all four (stride, bilinear, reflect, native)": {
        "downsample": "stride",
        "upsample": "bilinear",
        "padding": "reflect",
        "pad_to_power_of_two": False,
    },
}


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.papers.fedre.dip_ablation", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--run", required=True)
    p.add_argument("--client", default="client0")
    p.add_argument("--targets", type=int, default=4)
    p.add_argument("--steps", default="250,500,1000,2000,3100", help="comma list: PSNR read after these many steps")
    p.add_argument("--variants", help="comma list of variant numbers (0-based) to run (default: all)")
    p.add_argument("--lr", default="0.001", help="comma list of Adam learning rates; every variant runs with each")
    args = p.parse_args()
    steps = sorted(int(s) for s in args.steps.split(","))
    t = inversion_targets(args.run, args.client, args.targets)
    images, targets = t.images, t.targets
    seeds = [derive_seed(0, "dip-ablation", i) for i in range(args.targets)]
    names = list(VARIANTS)
    chosen = [names[int(i)] for i in args.variants.split(",")] if args.variants else names
    print(f"run {t.run_path}, {args.client} r{t.round}, {args.targets} targets, batched")
    print("| variant | " + " | ".join(f"PSNR @{s}" for s in steps) + " | s/step (batch) | final feature MSE |")
    print("|---|" + "---:|" * (len(steps) + 2))
    for name, lr in [(n, float(lr)) for n in chosen for lr in args.lr.split(",")]:
        cfg = DIPConfig(steps=steps[-1], lr=lr, **VARIANTS[name])
        t0 = time.perf_counter()
        result = invert(t.represent, targets, t.shape, t.mean, t.std, cfg, seeds, snapshot_steps=steps)
        seconds = time.perf_counter() - t0
        cells = [f"{psnr(result.snapshots[s], images).mean().item():.2f}" for s in steps]
        print(f"| {name}, lr {lr:g} | " + " | ".join(cells) + f" | {seconds / steps[-1]:.4f} | {result.feature_loss.mean().item():.4g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
