"""Time to a given PSNR: privfl's DIP defaults vs the DIP authors' feature-inversion settings.

Same extractor (a client of a real run), same K targets (that client's per-sample representations of
its first K training images), same seeds, both batched the same way. The DIP authors' settings
(:data:`attacks.dip.PAPER_SETTINGS`: nearest upsampling, Adam lr 1e-3, 3100 steps) run to the end; the
PSNR they finish at is the bar. privfl's defaults (:class:`attacks.dip.DIPConfig`) run to their own
end, with the PSNR read every ``--every`` steps from the same run; the time privfl needs to reach the
bar is its time per step times the first snapshot step at or above the bar. Snapshot forwards are
counted in both sides' time (a fraction of a percent).

    python -m experiments.bench.dip_settings --run runs/X             # client0, K=4
    python -m experiments.bench.dip_settings --run runs/X --client client4 --k 8
"""

from __future__ import annotations

import argparse
import sys

from attacks.dip import PAPER_SETTINGS, DIPConfig, invert
from attacks.metrics import psnr
from experiments.bench.lib import add_target_options, inversion_targets, record
from privfl.engine import resolve_device
from privfl.seeding import derive_seed


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.dip_settings", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_target_options(p, k=4)
    p.add_argument("--every", type=int, default=25, help="read privfl's PSNR every this many steps")
    args = p.parse_args()
    device = resolve_device(args.device)
    t = inversion_targets(args.run, args.client, args.k, device)
    images, targets = t.images, t.targets
    seeds = [derive_seed(0, "bench-dip", i) for i in range(args.k)]

    def attack(cfg: DIPConfig, every: int) -> tuple[float, dict[int, float]]:
        marks = list(range(every, cfg.steps + 1, every))
        result = invert(t.represent, targets, t.shape, t.mean, t.std, cfg, seeds, device=device, snapshot_steps=marks)
        return result.seconds, {s: psnr(result.snapshots[s], images).mean().item() for s in marks}

    paper, ours = DIPConfig(**PAPER_SETTINGS), DIPConfig()  # type: ignore[arg-type]
    t_paper, curve_paper = attack(paper, 100)
    t_ours, curve_ours = attack(ours, args.every)
    bar = curve_paper[max(curve_paper)]
    reached = next((s for s in sorted(curve_ours) if curve_ours[s] >= bar), None)
    print(f"run {t.run_path}, {args.client} r{t.round}, K={args.k} targets batched, device {device}")
    print(f"DIP authors' settings ({paper.steps} steps, lr {paper.lr:g}, {paper.upsample}): {t_paper / args.k:.2f} s per target, PSNR {bar:.2f} dB")
    final = curve_ours[ours.steps]
    print(f"privfl defaults ({ours.steps} steps, lr {ours.lr:g}, {ours.upsample}): {t_ours / args.k:.2f} s per target, PSNR {final:.2f} dB")
    print("privfl PSNR by step: " + ", ".join(f"{s}: {v:.2f}" for s, v in curve_ours.items() if s % (4 * args.every) == 0))
    full = f"{ours.steps} vs {paper.steps} steps; PSNR {final:.2f} vs {bar:.2f} dB"
    record("dip settings", "DIP seconds per target, each to its end", "DIP authors'", t_paper / args.k, "privfl defaults", t_ours / args.k, "s", full)
    if reached is None:
        print(f"privfl's defaults never reached {bar:.2f} dB in {ours.steps} steps")
        return 0
    t_reach = t_ours / ours.steps * reached
    print(f"privfl reaches {bar:.2f} dB at step {reached}: {t_reach / args.k:.2f} s per target, {t_reach / t_paper:.3f}x the authors' time")
    note = f"to {bar:.2f} dB (the authors' final): step {reached} vs {paper.steps}"
    record("dip settings", "DIP seconds per target to a given PSNR", "DIP authors'", t_paper / args.k, "privfl defaults", t_reach / args.k, "s", note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
