"""How much does capture slow training? Same run, same seed, capture on vs off, side by side.

Runs are interleaved (on, off, off, on, ...) so drift in machine load hits both sides; the ratio of
the medians is printed, with the capture's size. Because run-to-run noise on a shared CPU is a few
percent, the time spent inside the capture's own writes is also measured directly in the same runs. Also checks that both sides reach identical
accuracies (capture must not change training).

    python -m experiments.bench.capture                       # FedRE, 10k Fashion-MNIST samples, 5 rounds
    python -m experiments.bench.capture --method fedallrep    # the heaviest capture (every representation)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from experiments.bench.lib import record
from privfl.capture import TensorStore
from privfl.config import build_config
from privfl.engine import Trainer, dir_size
from privfl.methods import resolve_method


class StoreTimer:
    """Wall time spent inside the stores' writes (append + flush): the capture's direct cost."""

    def __init__(self):
        self.seconds = 0.0
        self._orig = {}

    def __enter__(self):
        for name in ("append", "flush"):
            orig = self._orig[name] = getattr(TensorStore, name)

            def timed(store, *a, _orig=orig, **kw):
                t0 = time.perf_counter()
                try:
                    return _orig(store, *a, **kw)
                finally:
                    self.seconds += time.perf_counter() - t0

            setattr(TensorStore, name, timed)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(TensorStore, name, orig)


def one_run(out: Path, name: str, capture: bool, args) -> tuple[float, list[float], int, float]:
    values = {
        "method": args.method,
        "subsample": args.subsample,
        "rounds": args.rounds,
        "capture": capture,
        "progress": False,
        "out_dir": str(out),
        "run_name": name,
        "seed": args.seed,
        "device": args.device,
    }
    if resolve_method(args.method).requires_homogeneous:
        values["model_group"] = "homo-cnn4"
    cfg = build_config(values, resolve_method(args.method).Options)
    trainer = Trainer(cfg, out / name)
    with StoreTimer() as timer:
        t0 = time.perf_counter()
        trainer.run()
        seconds = time.perf_counter() - t0
    return seconds, [h["acc"] for h in trainer.history], dir_size(out / name / "capture"), timer.seconds


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.capture", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="fedre")
    p.add_argument("--subsample", type=int, default=10000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="pairs of (on, off) runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    times: dict[bool, list[float]] = {True: [], False: []}
    accs, size, inside = {}, 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for capture in (True, False) if rep % 2 == 0 else (False, True):
                seconds, acc, nbytes, store_seconds = one_run(Path(tmp), f"r{rep}-{capture}", capture, args)
                times[capture].append(seconds)
                if capture:
                    inside.append(store_seconds / seconds)
                accs[capture] = acc
                size = max(size, nbytes)
                print(f"  repeat {rep} capture={'on ' if capture else 'off'} {seconds:7.2f} s", flush=True)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"{args.method}: {args.subsample} samples, {args.rounds} rounds, {args.repeats} pairs")
    print(f"training time, capture on  (median): {on:.2f} s")
    print(f"training time, capture off (median): {off:.2f} s")
    print(f"slowdown ratio on/off: {on / off:.4f}  ({100 * (on / off - 1):+.2f} %)")
    print(f"time inside capture writes, measured in the capture-on runs: {100 * statistics.median(inside):.2f} % of training")
    print(f"capture size: {size / 1024:.1f} KiB ({size / args.rounds / 1024:.1f} KiB per round)")
    same = accs[True] == accs[False]
    print(f"identical accuracies with and without capture: {same}")
    record("capture", f"{args.method} training time (median)", "capture off", off, "capture on", on, "s", f"identical accuracies: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
