"""The L-BFGS iteration around the closure, per evaluation: privfl's one-problem ``LBFGS`` (``leak()``),
``LockstepLBFGS`` with one problem, and ``torch.optim.LBFGS``, side by side in one process.

DLG spends each evaluation in two places: the closure (a double backward through the victim) and the
L-BFGS iteration around it (direction from up to 100 curvature pairs, step, stopping tests). This
benchmark isolates the second: the closure is an ill-conditioned separable objective (curvatures
from 1e-4 to 1e3 and a small quartic term) whose gradient costs a few microseconds, over the variables
of DLG's LeNet setting (a 3 x 32 x 32 image and 100 label logits: 3,172), so the history fills and
every step runs its 20 iterations. All three start from the same point with DLG's settings (lr 1,
max_iter 20, history 100, no line search); their final iterates differ by rounding grown over the
800 iterations of an ill-conditioned valley (printed; ``tests/attacks/test_lbfgs.py`` checks the iterations
agree in float64).

    python -m experiments.bench.lbfgs [--steps 40] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from attacks.lbfgs import LBFGS, LockstepLBFGS
from experiments.bench.lib import record

CURVATURE = torch.logspace(-4, 3, 3 * 32 * 32)


def solve(kind: str, steps: int) -> tuple[float, int, torch.Tensor]:
    """Seconds per evaluation, evaluations, and the final image, for one implementation."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(1, 1, 3, 32, 32, generator=gen) * 0.5).requires_grad_(True)  # leading 1: one problem
    y = torch.randn(1, 1, 100, generator=gen).requires_grad_(True)

    def loss_and_gradient() -> torch.Tensor:
        flat = x.detach().reshape(-1)
        x.grad = (CURVATURE * flat + 1e-3 * flat**3).reshape_as(x)
        y.grad = 0.01 * y.detach()
        return (0.5 * CURVATURE * flat * flat + 2.5e-4 * flat**4).sum() + 0.005 * (y.detach() ** 2).sum()

    step: Callable[[], object]
    evaluations: Callable[[], int]
    if kind == "LBFGS":
        single = LBFGS([x, y])
        step, evaluations = (lambda: single.step(loss_and_gradient)), (lambda: single.evaluations)
    elif kind == "LockstepLBFGS":
        lockstep = LockstepLBFGS([x, y])
        step, evaluations = (lambda: lockstep.step(lambda needed: loss_and_gradient().reshape(1))), (lambda: lockstep.evaluations)
    else:
        reference = torch.optim.LBFGS([x, y])
        step, evaluations = (lambda: reference.step(loss_and_gradient)), (lambda: reference.state[x]["func_evals"])
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = time.perf_counter() - t0
    count = evaluations()
    return seconds / count, count, x.detach().clone()


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.lbfgs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="L-BFGS steps (up to 20 evaluations each)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each, alternated; the median is reported")
    args = p.parse_args()
    if args.steps < 1 or args.repeats < 1:
        p.error("--steps and --repeats must be at least 1")
    kinds = ["torch.optim.LBFGS", "LockstepLBFGS", "LBFGS"]
    for kind in kinds:  # warm-up: allocator, BLAS threads
        solve(kind, 2)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    finals: dict[str, torch.Tensor] = {}
    evaluations: dict[str, int] = {}
    for _ in range(args.repeats):
        for kind in kinds:
            per_eval, evaluations[kind], finals[kind] = solve(kind, args.steps)
            times[kind].append(per_eval)
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"L-BFGS around a closure that costs ~nothing: 3,172 variables, {args.steps} steps, median of {args.repeats}")
    for kind in kinds:
        gap = (finals[kind] - finals["torch.optim.LBFGS"]).abs().max().item()
        print(f"{kind:18s} {median[kind] * 1e3:6.3f} ms per evaluation, {evaluations[kind]} evaluations, max |x - torch's x| {gap:.2e}")
    ref = median["torch.optim.LBFGS"]
    for kind in kinds[1:]:
        print(f"ratio {kind} / torch.optim.LBFGS: {median[kind] / ref:.3f}")
    measure, ours = "ms per L-BFGS iteration around the closure", median["LBFGS"] * 1e3
    record("lbfgs", measure, "torch.optim.LBFGS", ref * 1e3, "LBFGS (one problem)", ours, "ms")
    record("lbfgs", measure, "LockstepLBFGS, one problem", median["LockstepLBFGS"] * 1e3, "LBFGS (one problem)", ours, "ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
