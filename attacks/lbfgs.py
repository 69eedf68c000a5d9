"""L-BFGS for many independent problems advanced together, so one batched closure serves them all.

Gradient leakage solves one small optimisation per target (and per restart). Each closure call is a
double backward through a small network, dominated by per-operator overhead on a CPU, so evaluating P
problems in one vectorised call costs far less than P calls. ``torch.optim.LBFGS`` cannot use that:
its state (direction, step, curvature history) is one flat vector for everything it optimises, so P
problems handed to it together would share one line of search and one history, which is a different
algorithm. :class:`LockstepLBFGS` keeps every piece of state per problem and runs
``torch.optim.LBFGS``'s iteration (``line_search_fn=None``, the setting DLG uses) on each one:

- the first iteration of a problem steps ``min(1, 1/|g|_1) * lr`` along ``-g``, later ones ``lr``
  along the two-loop direction with ``H_diag = y.s / y.y`` from the newest accepted pair;
- a curvature pair ``(s, y)`` is accepted when ``y.s > 1e-10``;
- within one :meth:`step`, a problem stops iterating on the same tests as ``torch.optim.LBFGS``
  (gradient below ``tolerance_grad``, ``g.d > -tolerance_change``, a step or a loss change below
  ``tolerance_change``, ``max_iter`` iterations) and waits, unchanged, until the next :meth:`step`.

One difference, by design: the histories of all problems live in one ring of ``history_size`` slots,
and a slot is used whenever at least one problem accepts a pair; a problem that did not (it waited, or
its pair failed the curvature test) holds a zero pair there, which the two-loop recursion skips
exactly (it contributes nothing), but which still counts towards the ``history_size`` newest slots.
So a problem may remember fewer than ``history_size`` pairs where ``torch.optim.LBFGS`` would keep
them all. With one problem, or while no problem waits or rejects, the iterates are
``torch.optim.LBFGS``'s up to floating-point rounding (``tests/test_lbfgs.py`` compares them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class LockstepLBFGS:
    """L-BFGS on ``P`` independent problems; every variable has the problems along dimension 0.

    The closure zeroes nothing itself: :meth:`step` clears the variables' gradients before each call.
    It must return the per-problem losses, shape ``(P,)``, after back-propagating their sum (the
    problems being independent, the sum's gradient is each problem's own gradient).
    """

    def __init__(
        self,
        variables: Sequence[torch.Tensor],
        lr: float = 1.0,
        max_iter: int = 20,
        tolerance_grad: float = 1e-7,
        tolerance_change: float = 1e-9,
        history_size: int = 100,
    ):
        if not variables:
            raise ValueError("LockstepLBFGS needs at least one variable")
        self.variables = list(variables)
        self.problems = self.variables[0].shape[0]
        if any(v.shape[0] != self.problems for v in self.variables):
            raise ValueError("every variable must have the same number of problems along dimension 0")
        self.lr, self.max_iter, self.history_size = lr, max_iter, history_size
        self.tolerance_grad, self.tolerance_change = tolerance_grad, tolerance_change
        ref = self.variables[0]
        size = sum(v[0].numel() for v in self.variables)
        p, dtype, device = self.problems, ref.dtype, ref.device
        self.s_hist = torch.zeros(p, history_size, size, dtype=dtype, device=device)
        self.y_hist = torch.zeros(p, history_size, size, dtype=dtype, device=device)
        self.ro = torch.zeros(p, history_size, dtype=dtype, device=device)
        self.slots: list[int] = []  # ring slots in use, oldest first
        self.h_diag = torch.ones(p, dtype=dtype, device=device)
        self.d = torch.zeros(p, size, dtype=dtype, device=device)
        self.t = torch.zeros(p, dtype=dtype, device=device)
        self.prev_grad = torch.zeros(p, size, dtype=dtype, device=device)
        self.prev_loss = torch.zeros(p, dtype=torch.float64, device=device)  # torch.optim.LBFGS keeps Python floats
        self.started = torch.zeros(p, dtype=torch.bool, device=device)
        #: problems taken out for good (:meth:`freeze`): they never move again
        self.frozen = torch.zeros(p, dtype=torch.bool, device=device)
        self.evaluations = 0

    # ------------------------------------------------------------------ flat views
    def _flat_grad(self) -> torch.Tensor:
        parts = []
        for v in self.variables:
            g = v.grad if v.grad is not None else torch.zeros_like(v)
            parts.append(g.reshape(self.problems, -1))
        return torch.cat(parts, dim=1)

    def _move(self, step: torch.Tensor) -> None:
        """Add the rows of ``step`` (P, size) to the variables."""
        offset = 0
        with torch.no_grad():
            for v in self.variables:
                n = v[0].numel()
                v.add_(step[:, offset : offset + n].view_as(v))
                offset += n

    def _evaluate(self, closure: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        for v in self.variables:
            v.grad = None
        with torch.enable_grad():
            losses = closure()
        self.evaluations += 1
        return losses.detach().to(torch.float64), self._flat_grad()

    def freeze(self, mask: torch.Tensor) -> None:
        """Stop the problems in ``mask`` for good (e.g. diverged ones whose last finite iterate was restored)."""
        self.frozen |= mask

    # ------------------------------------------------------------------ the iteration
    def _direction(self, g: torch.Tensor) -> torch.Tensor:
        """The two-loop recursion for every problem at once, newest slot first."""
        q = -g
        alphas = []
        for slot in reversed(self.slots):
            a = self.ro[:, slot] * (self.s_hist[:, slot] * q).sum(1)
            q = q - a.unsqueeze(1) * self.y_hist[:, slot]
            alphas.append(a)
        r = q * self.h_diag.unsqueeze(1)
        for slot, a in zip(self.slots, reversed(alphas)):
            b = self.ro[:, slot] * (self.y_hist[:, slot] * r).sum(1)
            r = r + self.s_hist[:, slot] * (a - b).unsqueeze(1)
        return r

    def _remember(self, g: torch.Tensor, active: torch.Tensor) -> None:
        """The curvature pair of every active, started problem from its last move (torch.optim.LBFGS
        forms it at the start of the next iteration, as here)."""
        y = g - self.prev_grad
        s = self.d * self.t.unsqueeze(1)
        ys = (y * s).sum(1)
        accept = active & self.started & (ys > 1e-10)
        if not bool(accept.any()):
            return
        if len(self.slots) == self.history_size:
            slot = self.slots.pop(0)
        else:
            slot = len(self.slots)
        keep = accept.unsqueeze(1).to(s.dtype)
        self.s_hist[:, slot] = s * keep
        self.y_hist[:, slot] = y * keep
        self.ro[:, slot] = torch.where(accept, 1.0 / torch.where(accept, ys, torch.ones_like(ys)), torch.zeros_like(ys))
        self.slots.append(slot)
        self.h_diag = torch.where(accept, ys / torch.where(accept, (y * y).sum(1), torch.ones_like(ys)), self.h_diag)

    def step(self, closure: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One ``torch.optim.LBFGS.step`` for every problem (up to ``max_iter`` iterations each); returns
        the losses at the start of the step, as ``torch.optim.LBFGS`` does."""
        losses, g = self._evaluate(closure)
        start_losses = losses.clone()
        active = ~self.frozen & ~(g.abs().amax(1) <= self.tolerance_grad)
        n_iter = 0
        while bool(active.any()):
            n_iter += 1
            self._remember(g, active)
            first = active & ~self.started
            d = torch.where(first.unsqueeze(1), -g, self._direction(g)) if self.slots else -g
            mask = active.unsqueeze(1)
            self.d = torch.where(mask, d, self.d)
            self.prev_grad = torch.where(mask, g, self.prev_grad)
            self.prev_loss = torch.where(active, losses, self.prev_loss)
            first_t = torch.clamp(1.0 / g.abs().sum(1), max=1.0) * self.lr
            self.t = torch.where(first, first_t, torch.where(active, torch.full_like(self.t, self.lr), self.t))
            self.started |= active
            gtd = (g * self.d).sum(1)
            active = active & ~(gtd > -self.tolerance_change)
            if not bool(active.any()):
                break
            step = torch.where(active.unsqueeze(1), self.d * self.t.unsqueeze(1), torch.zeros_like(self.d))  # 0 * a NaN direction is NaN
            self._move(step)
            if n_iter == self.max_iter:
                break
            losses, g = self._evaluate(closure)
            small_grad = g.abs().amax(1) <= self.tolerance_grad
            small_step = (self.d * self.t.unsqueeze(1)).abs().amax(1) <= self.tolerance_change
            small_change = (losses - self.prev_loss).abs() < self.tolerance_change
            active = active & ~small_grad & ~small_step & ~small_change
        return start_losses


__all__ = ["LockstepLBFGS"]
