"""Seconds per inverted target: K targets in one grouped DIP optimisation vs one at a time.

Same extractor (a client of a real run), same K targets (that client's per-sample representations of
K training images), same steps and seeds; prints the ratio and both sides' PSNR so speed is not
bought with quality.

    python -m experiments.bench.inversion_batching                 # latest run, client0, K=8, 200 steps
    python -m experiments.bench.inversion_batching --k 16 --steps 500 --device cuda
"""

from __future__ import annotations

import argparse
import sys

import torch

from attacks.dip import DIPConfig, invert
from attacks.metrics import psnr
from experiments.bench.lib import add_target_options, inversion_targets, record
from privfl.engine import resolve_device
from privfl.seeding import derive_seed


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.inversion_batching", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_target_options(p, k=8)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    device = resolve_device(args.device)
    t = inversion_targets(args.run, args.client, args.k, device)
    targets, images = t.targets.cpu(), t.images
    cfg = DIPConfig(steps=args.steps)
    seeds = [derive_seed(0, "bench", i) for i in range(args.k)]
    batched = invert(t.represent, targets, t.shape, t.mean, t.std, cfg, seeds, device=device)
    singles = [invert(t.represent, targets[i : i + 1], t.shape, t.mean, t.std, cfg, [seeds[i]], device=device) for i in range(args.k)]
    t_batched = batched.seconds / args.k
    t_single = sum(s.seconds for s in singles) / args.k
    psnr_b = psnr(batched.images, images).mean().item()
    psnr_s = psnr(torch.cat([s.images for s in singles]), images).mean().item()
    print(f"run {t.run_path}, {args.client} r{t.round}, K={args.k}, {args.steps} DIP steps, device {device}")
    print(f"one at a time: {t_single:.3f} s per target   (mean PSNR {psnr_s:.2f} dB)")
    print(f"batched (K={args.k}): {t_batched:.3f} s per target   (mean PSNR {psnr_b:.2f} dB)")
    print(f"speed-up batched vs one at a time: {t_single / t_batched:.2f}x")
    note = f"{args.steps} steps; PSNR {psnr_s:.2f} vs {psnr_b:.2f} dB"
    record("inversion", "DIP seconds per target", "one at a time", t_single, f"batched K={args.k}", t_batched, "s", note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
