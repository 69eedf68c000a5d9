"""Client scaling of the in-process engine: setup time, time per round and peak memory at 10 / 100 /
1,000 / 10,000 clients, each configuration in a fresh process so its peak RSS is its own.

The setting is the one the speed issue measured: FedAvg, ``homo-cnn4``, 6,000 Fashion-MNIST samples
in total (IID, so every client holds some), batch 64, one local epoch, capture off (``--capture`` to
include it). A row with more clients than ``--samples`` / 6 takes 7 samples per client instead (10,000
clients: 70,000, all of Fashion-MNIST; a client needs 4 to train on 3 and test on 1), so the
``samples`` column says what each row trained on. Per configuration it prints:

- ``build s``: constructing the trainer (data, partition, one model per client): what a user waits
  for before the first round; ``build cpu s`` is the same in CPU time, which other jobs on the
  machine do not inflate;
- ``round s``: the engine's per-round ``seconds`` (training, aggregation, evaluation), mean over the
  rounds after round 0 (whose first optimiser step also pays one-off imports);
- ``wall/round s``: the same rounds' wall time, i.e. plus the checkpoint written after every round
  (what the user waits); ``round 0 wall s`` is printed apart;
- ``ms/client``: the slope of ``round s`` from the previous row, i.e. the engine's cost per extra client
  (left blank where the previous row trained on fewer samples);
- ``peak GB``: the process's peak resident memory (``ru_maxrss``).

    python -m experiments.bench.clients                       # 10, 100, 1,000, 10,000 clients, 3 rounds
    python -m experiments.bench.clients --clients 10000 --rounds 2

Run it alone: another torch process on the same cores slows both (thread oversubscription). Each
worker uses ``--threads`` torch threads (default 1).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.bench.lib import record_value

ROOT = Path(__file__).resolve().parents[2]  # the repository


def worker(args: argparse.Namespace) -> dict:
    """One configuration, in this process: returns its timings and peak RSS."""
    import torch

    torch.set_num_threads(args.threads)
    from privfl.config import build_config
    from privfl.engine import TrainCallback, Trainer
    from privfl.methods import METHODS

    ends: list[float] = []

    class RoundEnds(TrainCallback):
        def on_round_end(self, rnd: int, entry: dict) -> None:
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        values = {
            "method": args.method,
            "model_group": args.model_group,
            "subsample": samples_for(args.worker, args.samples),
            "num_clients": args.worker,
            "partition": "iid",
            "rounds": args.rounds,
            "capture": args.capture,
            "progress": False,
            "out_dir": tmp,
            "device": "cpu",
            "seed": 0,
        }
        cfg = build_config(values, METHODS.get(args.method).Options)
        t0, c0 = time.perf_counter(), time.process_time()
        trainer = Trainer(cfg, Path(tmp) / "run", callbacks=[RoundEnds()])
        t1, c1 = time.perf_counter(), time.process_time()
        trainer.run()
        rows = trainer.history
    walls = [b - a for a, b in zip([t1, *ends[:-1]], ends)]
    later = walls[1:] or walls  # round 0's wall also holds the setup exchange
    return {
        "clients": args.worker,
        "samples": samples_for(args.worker, args.samples),
        "build_s": round(t1 - t0, 2),
        "build_cpu_s": round(c1 - c0, 2),
        "first_round_wall_s": round(walls[0], 2),
        "round_s": round(sum(r["seconds"] for r in rows[1:] or rows) / len(rows[1:] or rows), 3),
        "wall_per_round_s": round(sum(later) / len(later), 3),
        "acc": round(rows[-1]["acc"], 4),
        "peak_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),  # Linux: kB
    }


def samples_for(clients: int, samples: int) -> int:
    """The row's training set: ``samples``, or 7 per client where that leaves a client fewer than 6."""
    return samples if samples >= 6 * clients else min(7 * clients, 70_000)


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.clients", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="10,100,1000,10000", help="comma list of client counts")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--samples", type=int, default=6000)
    p.add_argument("--method", default="fedavg")
    p.add_argument("--model-group", default="homo-cnn4")
    p.add_argument("--capture", action="store_true", help="record the capture as well (off in the issue's measurement)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    capture = "on" if args.capture else "off"
    print(f"{args.method}, {args.model_group}, IID, {args.rounds} rounds, capture {capture}, {args.threads} thread(s)")
    print(
        f"{'clients':>8} {'samples':>8} {'build s':>8} {'build cpu s':>12} {'round 0 wall s':>15} {'round s':>8} {'wall/round s':>13} "
        f"{'ms/client':>10} {'peak GB':>8} {'acc':>7}"
    )
    previous: dict | None = None
    for n in [int(v) for v in args.clients.split(",")]:
        cmd = [sys.executable, "-m", "experiments.bench.clients", "--worker", str(n), "--rounds", str(args.rounds), "--samples", str(args.samples)]
        cmd += ["--method", args.method, "--model-group", args.model_group, "--threads", str(args.threads)]
        cmd += ["--capture"] if args.capture else []
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"{n:>8} failed (exit {done.returncode}): {tail}")
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        comparable = previous is not None and previous["samples"] == row["samples"]  # else more data, not only more clients
        slope = f"{1e3 * (row['round_s'] - previous['round_s']) / (n - previous['clients']):.2f}" if comparable and previous else ""
        print(
            f"{n:>8} {row['samples']:>8} {row['build_s']:>8.2f} {row['build_cpu_s']:>12.2f} {row['first_round_wall_s']:>15.2f} "
            f"{row['round_s']:>8.3f} {row['wall_per_round_s']:>13.3f} {slope:>10} {row['peak_gb']:>8.2f} {row['acc']:>7.4f}",
            flush=True,
        )
        without = f"round {row['round_s']:.2f} s without it"
        record_value("clients", f"{n} clients: wall per round (with checkpoint)", row["wall_per_round_s"], "s", without)
        record_value("clients", f"{n} clients: build (data, partition, models)", row["build_s"], "s", f"{row['build_cpu_s']:.2f} s CPU")
        record_value("clients", f"{n} clients: peak RSS", row["peak_gb"], "GB")
        previous = row
    return 0


if __name__ == "__main__":
    sys.exit(main())
