"""A measured and rejected lever: keeping freed memory in the process (glibc ``mallopt``) vs glibc's defaults.

glibc's malloc gives freed memory back to the kernel (trim threshold) and maps blocks above its mmap
threshold afresh on every call, so a process that allocates and frees a step's tensors can touch new
pages, each a page fault, every step. ``retain`` sets ``M_MMAP_THRESHOLD`` to 32 MiB and
``M_TRIM_THRESHOLD`` to 256 MiB through ``mallopt`` at the start of the process; ``system`` leaves glibc's
adaptive defaults. This prints, for each workload, the time and the minor page faults with each setting,
each measurement in a fresh process (glibc adapts its thresholds to what was freed before, so a process
cannot switch back), the two settings interleaved (system, retain, system, ...) ``--repeats`` times, and
the median of each:

- ``step``: one SGD step of ``cnn4`` (batch 10, channels-last, Fashion-MNIST shape), the parity setting's
  step, ms;
- ``round``: the parity setting's FedAvg round (3,000 Fashion-MNIST samples, 10 clients, ``homo-cnn4``,
  batch 10, lr 0.01, ``--eval both``, capture on), wall seconds per round including the checkpoint, mean
  of the rounds after the first;
- ``dip``: steps of a batched DIP inversion (4 targets through a ``cnn4-narrow`` extractor, privfl's
  generator and schedule), ms per step.

Peak RSS of each process is printed as well. Measured 2026-11-27 (docs/scale.md, "Where a one-thread step
goes"): the tight loop gains (4.4 -> 3.1 ms per step), privfl's round and inversion do not (0.95-1.05x:
inside a run glibc's thresholds have already grown by the first round), so privfl leaves the allocator
alone. Linux with glibc only.

    python -m experiments.bench.allocator [--repeats 3] [--threads 1] [--only step,round,dip]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository

WORKLOADS = ("step", "round", "dip")
SETTINGS = ("system", "retain")
UNITS = {"step": "ms/step", "round": "s/round", "dip": "ms/step"}


#: glibc's mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def retain_freed_memory() -> bool:
    """The ``retain`` setting, in this process; True when glibc accepted both values."""
    mallopt = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "mallopt", None)
    if mallopt is None:  # not glibc
        return False
    return mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024) == 1 and mallopt(M_TRIM_THRESHOLD, 256 * 1024 * 1024) == 1


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def child_step(threads: int) -> dict[str, float]:
    import torch

    from experiments.bench.layout import step_seconds
    from privfl.models import MODELS

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    body, dim = MODELS.get("cnn4")(1, 28)
    body, head = body.to(memory_format=torch.channels_last), torch.nn.Linear(dim, 10)
    x = torch.randn(10, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (10,))
    step_seconds(body, head, x, y, 30)  # warm-up: the first steps prepare oneDNN's kernels
    steps, f0 = 300, _faults()
    seconds = step_seconds(body, head, x, y, steps)  # layout.py's step: forward, backward, SGD step
    return {"value": seconds * 1e3, "faults": (_faults() - f0) / steps}


def child_round(threads: int) -> dict[str, float]:
    import torch

    import privfl
    from experiments.bench.lib import RoundClock

    class FaultClock(RoundClock):
        def __init__(self) -> None:
            super().__init__()
            self.faults: list[int] = []

        def on_round_end(self, rnd: int, entry: dict[str, Any]) -> None:
            super().on_round_end(rnd, entry)
            self.faults.append(_faults())

    torch.set_num_threads(threads)
    clock = FaultClock()
    with tempfile.TemporaryDirectory() as tmp:
        privfl.train(
            "fedavg",
            subsample=3000,
            num_clients=10,
            model_group="homo-cnn4",
            batch_size=10,
            lr=0.01,
            rounds=4,
            eval="both",
            client_workers=1,
            out_dir=tmp,
            run_name="r",
            progress=False,
            callbacks=[clock],
        )
    per_round = (clock.faults[-1] - clock.faults[0]) / (len(clock.faults) - 1)  # the rounds after the first
    return {"value": clock.mean_after_first(), "faults": per_round}


def child_dip(threads: int) -> dict[str, float]:
    import torch

    from attacks.dip import DIPConfig, invert
    from privfl.models import MODELS

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    extractor, _ = MODELS.get("cnn4-narrow")(1, 28)
    extractor.eval().requires_grad_(False)
    targets = extractor(torch.rand(4, 1, 28, 28) * 2 - 1)
    steps = 150
    cfg = DIPConfig(steps=steps)
    f0, t0 = _faults(), time.perf_counter()
    invert(extractor, targets, (1, 28, 28), (0.5,), (0.5,), cfg, seeds=[0, 1, 2, 3])
    return {"value": (time.perf_counter() - t0) / steps * 1e3, "faults": (_faults() - f0) / steps}


CHILDREN = {"step": child_step, "round": child_round, "dip": child_dip}


def measure(workload: str, setting: str, threads: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"):
        env.pop(name, None)  # the comparison is privfl's setting against glibc's defaults
    cmd = [sys.executable, "-m", "experiments.bench.allocator", "--child", workload, "--setting", setting, "--threads", str(threads)]
    out = subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.allocator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--child", choices=WORKLOADS, help=argparse.SUPPRESS)
    p.add_argument("--setting", choices=SETTINGS, default="system", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        applied = retain_freed_memory() if args.setting == "retain" else False  # before anything large is allocated
        result: dict[str, Any] = CHILDREN[args.child](args.threads)
        result["applied"] = applied
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or args.repeats < 1:
        why = f"unknown workload {unknown[0]!r}; accepted: {', '.join(WORKLOADS)}" if unknown else "--repeats must be >= 1"
        print(f"experiments.bench.allocator: {why}", file=sys.stderr)
        return 2
    from experiments.bench.lib import record

    print(f"{args.threads} thread(s); median of {args.repeats} fresh processes per setting, interleaved")
    print(f"{'workload':<8}{'unit':>9}{'system':>10}{'retain':>10}{'ratio':>8}{'faults system':>15}{'faults retain':>15}{'peak MB sys/ret':>18}")
    for name in names:
        runs: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
        for _ in range(args.repeats):
            for setting in SETTINGS:
                runs[setting].append(measure(name, setting, args.threads))
        med = {s: {k: statistics.median(r[k] for r in runs[s]) for k in ("value", "faults", "peak_rss_mb")} for s in SETTINGS}
        a, b = med["system"]["value"], med["retain"]["value"]
        peaks = f"{med['system']['peak_rss_mb']:.0f}/{med['retain']['peak_rss_mb']:.0f}"
        print(f"{name:<8}{UNITS[name]:>9}{a:10.3f}{b:10.3f}{b / a:8.3f}{med['system']['faults']:15.1f}{med['retain']['faults']:15.1f}{peaks:>18}")
        if not runs["retain"][0]["applied"]:
            print("  note: glibc refused the retain setting here (not glibc?): both columns are glibc's defaults")
        unit = "s" if name == "round" else "ms"
        faults = f"page faults {med['system']['faults']:.0f} -> {med['retain']['faults']:.0f} per {'round' if name == 'round' else 'step'}"
        record("allocator", f"{name} ({UNITS[name]})", "glibc default", a, "freed memory kept", b, unit, f"rejected lever; {faults}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
