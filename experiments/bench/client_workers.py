"""Clients trained at once in threads (``--client-workers``) against one at a time, on the parity setting.

Why privfl trains several clients at once on a CPU (``privfl/fl/parallel.py``): one client's step is
too small for torch's intra-op threads to split well, while clients are independent. This trains each
method of ``--methods`` on the parity setting (Fashion-MNIST 3,000 samples, 10 clients, Dir(0.1),
``homo-cnn4``, batch 10, lr 0.01, HtFLlib's data order, ``--eval both``), in this process, one
configuration after the other:

- ``--threads`` torch threads, one client at a time (``--client-workers 1``): torch splits each operation;
- ``--threads`` torch threads, ``--threads`` clients at once, one thread each (``--client-workers auto``);
- one thread, one client at a time (the parity table's setting), for the numbers: every client computed
  with one thread, as with the workers, so the two runs must agree bit for bit (printed).

Printed per method: the wall time per round (rounds after the first, checkpoint included) of each and the
ratios.

    python -m experiments.bench.client_workers                           # local and fedavg, 2 threads
    python -m experiments.bench.client_workers --methods fedproto,fedgh --rounds 4 --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import Any

import torch

import privfl
from experiments.bench.lib import PARITY_TRAIN, RoundClock, record
from privfl.methods import METHODS


def run(method: str, rounds: int, threads: int, workers: int) -> tuple[float, list[dict[str, Any]]]:
    """(mean wall seconds per round after the first, the metrics rows without their seconds)."""
    clock = RoundClock()
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="privfl-workers-") as tmp:
        options = {**PARITY_TRAIN, "rounds": rounds, "client_workers": workers, "out_dir": tmp}
        trained = privfl.train(method, callbacks=[clock], **options)
        rows = [json.loads(line) for line in (trained.path / "metrics.jsonl").read_text().splitlines()]
    return clock.mean_after_first(), [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.client_workers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--methods", default="local,fedavg")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="torch threads (the workers' count under auto)")
    args = p.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS.names()]
    if unknown or args.rounds < 2 or args.threads < 2:
        why = f"unknown method {unknown[0]!r}" if unknown else "--rounds must be >= 2 and --threads >= 2"
        print(f"experiments.bench.client_workers: {why}", file=sys.stderr)
        return 2
    t = args.threads
    print(f"parity setting, {args.rounds} rounds, wall seconds per round (rounds 2..{args.rounds}, checkpoint included)")
    print(f"{'method':<10}{f'{t} thr, 1 at once':>18}{f'{t} thr, {t} at once':>20}{'1 thr, 1 at once':>18}{'ratio':>8}  same numbers")
    for method in methods:
        split, _ = run(method, args.rounds, t, 1)
        workers, worker_rows = run(method, args.rounds, t, 0)
        single, single_rows = run(method, args.rounds, 1, 1)
        same = worker_rows == single_rows
        print(f"{method:<10}{split:18.3f}{workers:20.3f}{single:18.3f}{workers / split:8.3f}  {same}")
        note = f"{t} threads; one thread, one client at a time: {single:.3f} s ({workers / single:.3f}); same numbers as it: {same}"
        measure = f"{method}, parity setting, s/round"
        record("client-workers", measure, f"{t} threads, 1 client at a time", split, f"{t} clients at once", workers, "s", note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
