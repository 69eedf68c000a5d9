"""Channels-last vs contiguous (NCHW): a training step and an evaluation forward of privfl's models, side by side.

Why privfl computes in channels-last on a CPU (``--memory-format auto``, ``privfl/fl/layout.py``):
this prints, per model, the time of one SGD step at two batch sizes and one evaluation forward, each
the fastest of ``--repeats`` interleaved measurements (contiguous, channels-last, contiguous, ...) of
identical copies of one initialisation, and the ratio channels-last / contiguous. It also times max
pooling alone, the operation whose NCHW kernel is the slowest part of a ``cnn4`` step.

    python -m experiments.bench.layout                         # the cpu5 group, 1 thread
    python -m experiments.bench.layout --models cnn4,resnet18 --channels 3 --image-size 32
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from experiments.bench.lib import record
from privfl.models import MODELS

LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def step_seconds(model: nn.Module, head: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    """Mean seconds of one SGD step (forward, backward, step) after two warm-up steps."""
    opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.01)
    model.train()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(head(model(x)), y).backward()
        opt.step()

    for _ in range(2):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


@torch.no_grad()
def forward_seconds(model: nn.Module, x: torch.Tensor, passes: int) -> float:
    model.eval()
    model(x)
    t0 = time.perf_counter()
    for _ in range(passes):
        model(x)
    return (time.perf_counter() - t0) / passes


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.layout", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="cnn4,cnn4-narrow,cnn3x3,resnet-tiny")
    p.add_argument("--channels", type=int, default=1)
    p.add_argument("--image-size", type=int, default=28)
    p.add_argument("--batches", default="10,64", help="training batch sizes (parity setting 10, privfl's default 64)")
    p.add_argument("--eval-batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS.names()]
    if unknown:
        print(f"experiments.bench.layout: unknown model {unknown[0]!r}; accepted: {', '.join(MODELS.names())}", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    shape = (args.channels, args.image_size, args.image_size)
    print(f"{args.threads} thread(s), input {shape}; fastest of {args.repeats} interleaved repeats; ms")
    print(f"{'model':<14}{'measure':<22}{'contiguous':>12}{'channels_last':>15}{'ratio':>8}")
    for name in names:
        torch.manual_seed(args.seed)
        model, dim = MODELS.get(name)(args.channels, args.image_size)
        head = nn.Linear(dim, 10)
        measures: list[tuple[str, dict[str, float]]] = []
        for batch in batches:
            x = torch.randn(batch, *shape, generator=gen)
            y = torch.randint(0, 10, (batch,), generator=gen)
            best = dict.fromkeys(LAYOUTS, float("inf"))
            for _ in range(args.repeats):
                for layout, fmt in LAYOUTS.items():
                    m = copy.deepcopy(model).to(memory_format=fmt)
                    best[layout] = min(best[layout], step_seconds(m, copy.deepcopy(head), x, y, args.steps))
            measures.append((f"train step, batch {batch}", best))
        xe = torch.randn(args.eval_batch, *shape, generator=gen)
        best = dict.fromkeys(LAYOUTS, float("inf"))
        for _ in range(args.repeats):
            for layout, fmt in LAYOUTS.items():
                best[layout] = min(best[layout], forward_seconds(copy.deepcopy(model).to(memory_format=fmt), xe, max(args.steps // 10, 2)))
        measures.append((f"eval forward, {args.eval_batch}", best))
        for measure, best in measures:
            a, b = best["contiguous"] * 1e3, best["channels_last"] * 1e3
            print(f"{name:<14}{measure:<22}{a:12.2f}{b:15.2f}{b / a:8.3f}")
            record("layout", f"{name} {measure}", "contiguous", a, "channels_last", b, "ms")
    pooled = torch.randn(64, 32, 24, 24, generator=gen).relu()
    best = dict.fromkeys(LAYOUTS, float("inf"))
    for _ in range(args.repeats):
        for layout, fmt in LAYOUTS.items():
            z = pooled.contiguous(memory_format=fmt)
            t0 = time.perf_counter()
            for _ in range(20):
                F.max_pool2d(z, 2)
            best[layout] = min(best[layout], (time.perf_counter() - t0) / 20)
    a, b = best["contiguous"] * 1e3, best["channels_last"] * 1e3
    print(f"{'max_pool2d':<14}{'(64, 32, 24, 24)':<22}{a:12.2f}{b:15.2f}{b / a:8.3f}")
    record("layout", "max_pool2d 2x2 on (64, 32, 24, 24)", "contiguous", a, "channels_last", b, "ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
