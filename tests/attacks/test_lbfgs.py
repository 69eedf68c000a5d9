"""LockstepLBFGS runs torch.optim.LBFGS's iteration on every problem of a batch, LBFGS on one problem."""

from __future__ import annotations

import pytest
import torch

from attacks.lbfgs import LBFGS, LockstepLBFGS


def rosenbrock(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One Rosenbrock valley per row of ``x`` (P, n), each with its own (a, b): losses (P,)."""
    return ((a.unsqueeze(1) - x[:, :-1]) ** 2 + b.unsqueeze(1) * (x[:, 1:] - x[:, :-1] ** 2) ** 2).sum(1)


def torch_lbfgs(x0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, steps: int, **kw) -> tuple[torch.Tensor, list[float], int]:
    """One problem solved alone by torch.optim.LBFGS (the reference): iterate, losses, evaluations."""
    x = x0.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([x], **kw)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = rosenbrock(x.unsqueeze(0), a.view(1), b.view(1)).sum()
        loss.backward()
        return loss

    losses = [float(opt.step(closure).detach()) for _ in range(steps)]
    return x.detach(), losses, opt.state[x]["func_evals"]


SETTINGS = [
    {"lr": 1.0, "max_iter": 20},
    {"lr": 0.5, "max_iter": 7, "history_size": 5},
    {"lr": 1.0, "max_iter": 20, "tolerance_change": 1e-4, "history_size": 5},
    {"lr": 1.0, "max_iter": 3, "history_size": 4},  # torch.optim.LBFGS's max_eval (3 * 5 // 4) stops it first
]


@pytest.mark.parametrize("kw", SETTINGS)
def test_each_problem_follows_torch_lbfgs_as_if_solved_alone(kw: dict) -> None:
    gen = torch.Generator().manual_seed(0)
    problems, n = 4, 6
    x0 = torch.randn(problems, n, generator=gen, dtype=torch.float64) * 0.5
    a = torch.tensor([1.0, 0.5, -0.3, 2.0], dtype=torch.float64)
    b = torch.tensor([5.0, 1.0, 10.0, 0.5], dtype=torch.float64)
    x = x0.clone().requires_grad_(True)
    opt = LockstepLBFGS([x], **kw)

    def closure(needed: torch.Tensor) -> torch.Tensor:
        losses = rosenbrock(x, a, b)
        losses.sum().backward()
        return losses

    steps = 4
    batched = [opt.step(closure) for _ in range(steps)]
    for p in range(problems):
        alone, alone_losses, _ = torch_lbfgs(x0[p], a[p], b[p], steps, **kw)
        # the compact form and torch's two-loop recursion round differently: 1e-16 apart after one step,
        # up to ~5e-7 after 80 iterations of a Rosenbrock valley (float64)
        torch.testing.assert_close(x.detach()[p], alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.stack(batched)[:, p], torch.tensor(alone_losses, dtype=torch.float64), rtol=1e-5, atol=1e-8)


def test_a_converged_problem_waits_while_the_others_go_on_and_frozen_ones_never_move() -> None:
    a = torch.tensor([1.0, 1.0, 1.0])
    b = torch.tensor([1.0, 1.0, 1.0])
    x = torch.stack([torch.ones(3), torch.full((3,), -1.0), torch.zeros(3)]).requires_grad_(True)  # row 0 sits at the minimum
    opt = LockstepLBFGS([x])
    opt.freeze(torch.tensor([False, False, True]))

    def closure(needed: torch.Tensor) -> torch.Tensor:
        losses = rosenbrock(x, a, b)
        losses.sum().backward()
        return losses

    opt.step(closure)
    assert torch.equal(x.detach()[0], torch.ones(3))  # gradient zero: it never moved
    assert torch.equal(x.detach()[2], torch.zeros(3))  # frozen
    assert not torch.equal(x.detach()[1], torch.full((3,), -1.0))


@pytest.mark.parametrize("kw", SETTINGS)
@pytest.mark.parametrize("a, b, seed", [(1.0, 5.0, 1), (-0.3, 10.0, 2), (2.0, 0.5, 3)])
def test_one_problem_follows_torch_lbfgs(kw: dict, a: float, b: float, seed: int) -> None:
    """LBFGS (one problem, leak()'s one target at a time) against torch.optim.LBFGS, over two variables."""
    x0 = torch.randn(7, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.5
    head, tail = x0[:3].clone().requires_grad_(True), x0[3:].clone().requires_grad_(True)
    opt = LBFGS([head, tail], **kw)
    at, bt = torch.tensor([a], dtype=torch.float64), torch.tensor([b], dtype=torch.float64)

    def closure() -> torch.Tensor:
        loss = rosenbrock(torch.cat([head, tail]).unsqueeze(0), at, bt).sum()
        loss.backward()
        return loss

    steps = 6
    losses = [opt.step(closure) for _ in range(steps)]
    alone, alone_losses, evaluations = torch_lbfgs(x0, at[0], bt[0], steps, **kw)
    torch.testing.assert_close(torch.cat([head, tail]).detach(), alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(alone_losses, dtype=torch.float64), rtol=1e-5, atol=1e-8)
    assert opt.evaluations == evaluations


def test_one_problem_stops_at_a_zero_gradient_without_moving() -> None:
    """A step that starts at a zero gradient returns at once, as torch.optim.LBFGS's does, and leaves the
    iteration unstarted: the next step's first move is still the scaled one (min(1, 1/|g|_1) * lr)."""
    x = torch.ones(4, dtype=torch.float64, requires_grad=True)  # the minimum of rosenbrock with a = 1
    ref = x.detach().clone().requires_grad_(True)
    opt, torch_opt = LBFGS([x]), torch.optim.LBFGS([ref])
    a, b = torch.ones(1, dtype=torch.float64), torch.full((1,), 5.0, dtype=torch.float64)

    def closure() -> torch.Tensor:
        loss = rosenbrock(x.unsqueeze(0), a, b).sum()
        loss.backward()
        return loss

    def torch_closure() -> torch.Tensor:
        torch_opt.zero_grad()
        loss = rosenbrock(ref.unsqueeze(0), a, b).sum()
        loss.backward()
        return loss

    assert opt.step(closure) == 0.0
    torch_opt.step(torch_closure)
    assert opt.evaluations == 1
    assert torch.equal(x.detach(), torch.ones(4, dtype=torch.float64))
    with torch.no_grad():  # away from the minimum, on both sides
        x.add_(torch.tensor([0.3, -0.2, 0.1, 0.4], dtype=torch.float64))
        ref.copy_(x)
    for _ in range(3):
        torch.testing.assert_close(
            torch.tensor(opt.step(closure), dtype=torch.float64), torch_opt.step(torch_closure).detach(), rtol=1e-10, atol=1e-12
        )
    torch.testing.assert_close(x.detach(), ref.detach(), rtol=1e-8, atol=1e-10)
