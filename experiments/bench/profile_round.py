"""Where one training round's time goes, and how much of it is the model's own arithmetic.

The speed issue asks for privfl's time per round at <= 0.5x HtFLlib's on the parity setting. Both libraries
run the same local SGD (same model, batch, samples, epochs), so the part of a round that is forward,
backward and optimizer step is a floor neither can go under by engineering around it. This script trains
one run (default: the parity setting, FedAvg, ``homo-cnn4``, 3,000 Fashion-MNIST samples, 10 clients,
batch 10, lr 0.01, HtFLlib's data order, ``--eval both``, one thread) with timers wrapped around the
engine's parts, and measures that floor in the same process: one epoch of SGD of every client's model
(a copy, its own architecture) over its own batches built beforehand, and its evaluation forwards, in a
tight loop. Methods whose local training bypasses ``LocalTrainer.fit`` are refused (exit 2).

Printed per round (mean over the rounds after the first): wall (incl. checkpoint and metrics writes);
local training, split into batch building (index slicing and normalisation) and the rest of the loop;
evaluation; checkpoint; everything else (server step, capture, selection); then the compute floor and
what fraction of the round it is. Given ``--reference-seconds S`` (a reference library's time per round
on the same setting, e.g. from ``experiments/parity/run_parity.py``), it prints the ratio privfl / S and
the lowest ratio any implementation of the same computation could reach, floor / S.

Each ``--memory-formats`` value (default: ``contiguous``, then ``channels_last``) is profiled in turn in
this process, and the ratio of their walls per round is printed last (``privfl/fl/layout.py``
says why channels-last is faster on a CPU).

    python -m experiments.bench.profile_round                                   # FedAvg, parity setting
    python -m experiments.bench.profile_round --method fedproto --rounds 4 --reference-seconds 3.5
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

import privfl
from experiments.bench.lib import PARITY_TRAIN, RoundClock, record
from privfl.engine import Trainer
from privfl.fl.layout import MEMORY_FORMATS, wants_channels_last
from privfl.fl.method import DataView
from privfl.fl.trainer import LocalTrainer

SECONDS: dict[str, float] = defaultdict(float)
STEPS: dict[str, int] = defaultdict(int)
INSIDE: dict[str, int] = defaultdict(int)  # how deep each timed part is on the stack right now


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its wall time added to ``SECONDS[name]``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        INSIDE[name] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            INSIDE[name] -= 1
            SECONDS[name] += time.perf_counter() - t0

    return wrapper


def timed_batches(fn: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """``DataView.batches`` with the time spent producing each batch (not consuming it) counted, as
    ``batches`` within local training and ``eval_batches`` elsewhere (evaluation uses it too)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Iterator[Any]:
        key = "batches" if INSIDE["local"] else "eval_batches"
        it = fn(*args, **kwargs)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                SECONDS[key] += time.perf_counter() - t0
                return
            SECONDS[key] += time.perf_counter() - t0
            STEPS[key] += 1
            yield item

    return wrapper


TRAINERS: list[Trainer] = []


def instrument() -> None:
    init = Trainer.__init__

    def keep(self: Trainer, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        TRAINERS.append(self)

    Trainer.__init__ = keep  # type: ignore[method-assign]
    LocalTrainer.fit = timed("local", LocalTrainer.fit)  # type: ignore[method-assign]
    DataView.batches = timed_batches(DataView.batches)  # type: ignore[method-assign]
    Trainer.evaluate = timed("evaluate", Trainer.evaluate)  # type: ignore[method-assign]
    # stateless clients (FedAvg) are scored for --eval personal right after local training, not in evaluate
    Trainer.score_personal = timed("evaluate", Trainer.score_personal)  # type: ignore[method-assign]
    Trainer.save_checkpoint = timed("checkpoint", Trainer.save_checkpoint)  # type: ignore[method-assign]
    Trainer.write_metrics = timed("metrics", Trainer.write_metrics)  # type: ignore[method-assign]


def compute_floor(trainer: Trainer, eval_passes: int) -> tuple[float, float, int]:
    """Seconds for one epoch of SGD of every client's model (a copy) over its own training batches,
    built beforehand, and for ``eval_passes`` forwards of each over its test split: the arithmetic of
    a round with nothing else in the loop; and the number of steps taken. (Repeating one batch instead
    measured 20 % slower than the engine's own loop, likely as its loss and gradients shrink towards
    denormal floats.)"""
    cfg = trainer.cfg
    bs = cfg.batch_size
    train_s = eval_s = 0.0
    steps = 0
    for client in trainer.clients:
        model = copy.deepcopy(client.model)
        if wants_channels_last(model, cfg.memory_format):  # the run's layout (--memory-format)
            model.to(memory_format=torch.channels_last)
        idx = client.train_idx
        batches = [trainer.data.batch(idx[i : i + bs]) for i in range(0, len(idx) - bs + 1, bs)]  # drop_last, as the run
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        model.train()
        t0 = time.perf_counter()
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            loss.item()
        train_s += time.perf_counter() - t0
        steps += len(batches)
        model.eval()
        xe, _ = trainer.data.batch(client.test_idx)
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(eval_passes):
                model(xe)
        eval_s += time.perf_counter() - t0
    return train_s, eval_s, steps


def profile(args: argparse.Namespace, memory_format: str) -> dict[str, float]:
    """One instrumented run in ``memory_format``: per-round means of its parts and its compute floor."""
    SECONDS.clear()
    STEPS.clear()
    TRAINERS.clear()
    per_round: list[dict[str, float]] = []

    class Snapshots(RoundClock):
        """Also snapshots the counters at each round's end (after checkpoint and metrics writes)."""

        def on_round_end(self, rnd: int, entry: dict[str, Any]) -> None:
            super().on_round_end(rnd, entry)
            per_round.append({**SECONDS, "batches_n": STEPS["batches"]})

    clock = Snapshots()
    with tempfile.TemporaryDirectory(prefix="privfl-profile-") as tmp:
        options = {**PARITY_TRAIN, "model_group": args.model_group, "subsample": args.subsample, "num_clients": args.num_clients}
        options |= {"rounds": args.rounds, "eval": args.eval, "memory_format": memory_format, "out_dir": tmp}
        privfl.train(args.method, callbacks=[clock], **options)
        deltas = [{k: b[k] - a.get(k, 0.0) for k in b} for a, b in itertools.pairwise(per_round)]
        n = len(deltas)
        out = {k: sum(d.get(k, 0.0) for d in deltas) / n for k in ("local", "batches", "evaluate", "checkpoint", "metrics", "batches_n")}
        out["wall"] = clock.mean_after_first()
        out["passes"] = 2 if args.eval == "both" and TRAINERS[0].personal_differs else 1
        if out["batches_n"]:
            out["floor_train"], out["floor_eval"], out["floor_steps"] = compute_floor(TRAINERS[-1], int(out["passes"]))
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.profile_round", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--method", default="fedavg")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--subsample", type=int, default=3000)
    p.add_argument("--num-clients", type=int, default=10)
    p.add_argument("--model-group", default="homo-cnn4")
    p.add_argument("--eval", default="both", choices=["global", "personal", "both"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--memory-formats",
        default="contiguous,channels_last",
        help="comma list of --memory-format values, each profiled in turn in this process (the ratio compares the first two)",
    )
    p.add_argument("--reference-seconds", type=float, help="a reference library's seconds per round on this setting")
    args = p.parse_args()
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (the first round is left out of the means)")
    formats = [f.strip() for f in args.memory_formats.split(",") if f.strip()]
    if not formats or any(f not in MEMORY_FORMATS for f in formats):
        p.error(f"--memory-formats takes a comma list of {', '.join(MEMORY_FORMATS)}")
    torch.set_num_threads(args.threads)
    instrument()
    setting = f"{args.method}, {args.model_group}, {args.subsample} samples, {args.num_clients} clients, batch 10"
    results: dict[str, dict[str, float]] = {}
    for memory_format in formats:
        r = results[memory_format] = profile(args, memory_format)
        steps = int(round(r["batches_n"]))
        if steps == 0:
            print(f"{args.method} trains outside LocalTrainer.fit: its local training is in 'other' and no floor is measured", file=sys.stderr)
            return 2
        wall = r["wall"]
        other = wall - r["local"] - r["evaluate"] - r["checkpoint"] - r["metrics"]
        floor = r["floor_train"] + r["floor_eval"]
        print(f"\n{setting}, --memory-format {memory_format}, {args.threads} thread(s), means over rounds 2..{args.rounds}")
        print(f"wall per round (incl. checkpoint):          {wall:7.3f} s")
        print(f"  local training:                           {r['local']:7.3f} s  ({steps} batches)")
        print(f"    of which building batches:              {r['batches']:7.3f} s")
        print(f"  evaluation ({int(r['passes'])} protocol pass(es)):          {r['evaluate']:7.3f} s")
        print(f"  checkpoint:                               {r['checkpoint']:7.3f} s")
        print(f"  metrics file:                             {r['metrics']:7.3f} s")
        print(f"  other (server, capture, selection):       {other:7.3f} s")
        print(f"compute floor: {int(r['floor_steps'])} SGD steps {r['floor_train']:.3f} s + evaluation forwards {r['floor_eval']:.3f} s")
        print(f"             = {floor:.3f} s, {floor / wall:.0%} of the round")
        record(
            "round-profile",
            f"seconds per round, {args.method} parity setting, {memory_format}",
            "compute floor",
            floor,
            "privfl round",
            wall,
            "s",
            f"{steps} steps",
        )
        if args.reference_seconds:
            ref = args.reference_seconds
            print(f"privfl / reference: {wall / ref:.3f}; the lowest ratio the same computation allows: {floor / ref:.3f}")
    if len(formats) >= 2:
        a, b = formats[:2]
        ratio = results[b]["wall"] / results[a]["wall"]
        print(f"\nwall per round, {b} / {a}: {ratio:.3f}")
        record("round-profile", f"wall per round, {args.method} parity setting", a, results[a]["wall"], b, results[b]["wall"], "s", "memory format")
    return 0


if __name__ == "__main__":
    sys.exit(main())
