"""L-BFGS for many independent problems advanced together, so one batched closure serves them all.

Gradient leakage solves one small optimisation per target (and per restart). Each closure call is a
double backward through a small network, dominated by per-operator overhead on a CPU, so evaluating P
problems in one vectorised call costs far less than P calls. ``torch.optim.LBFGS`` cannot use that:
its state (direction, step, curvature history) is one flat vector for everything it optimises, so P
problems handed to it together would share one line of search and one history, which is a different
algorithm. :class:`LockstepLBFGS` keeps every piece of state per problem and runs
``torch.optim.LBFGS``'s iteration (``line_search_fn=None``, the setting DLG uses) on each one:

- the first iteration of a problem steps ``min(1, 1/|g|_1) * lr`` along ``-g``, later ones ``lr``
  along ``-H g`` with ``H`` the L-BFGS inverse-Hessian estimate from the problem's last
  ``history_size`` accepted pairs and ``H_0 = (y.s / y.y) I`` from the newest;
- a curvature pair ``(s, y)`` is accepted when ``y.s > 1e-10``;
- within one :meth:`step`, a problem stops iterating on the same tests as ``torch.optim.LBFGS``
  (gradient below ``tolerance_grad``, ``g.d > -tolerance_change``, a step or a loss change below
  ``tolerance_change``, ``max_iter`` iterations, ``max_iter * 5 // 4`` evaluations) and waits,
  unchanged, until the next :meth:`step`.

``H g`` is computed in the compact form of Byrd, Nocedal and Schnabel (Math. Programming 63, 1994,
Theorem 2.2) rather than by the two-loop recursion ``torch.optim.LBFGS`` uses: the two are the same
matrix, but the compact form is a handful of batched matrix products and two triangular solves per
iteration whatever the history length, where the recursion is 2 x ``history_size`` sequential
vector operations. Each problem has its own ring of ``history_size`` slots; a slot not yet filled
holds a zero pair, which contributes nothing. The iterates are ``torch.optim.LBFGS``'s up to
floating-point rounding (``tests/attacks/test_lbfgs.py`` compares them in float64, history truncation and
early stops included). :class:`LBFGS` is the same iteration for one problem (``leak()``, one target at
a time), with its bookkeeping in Python numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class _Iteration:
    """``torch.optim.LBFGS``'s settings (``line_search_fn=None``, the setting DLG uses), with its defaults;
    a subclass allocates its state in :meth:`_allocate`."""

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
            raise ValueError(f"{type(self).__name__} needs at least one variable")
        self.variables = list(variables)
        self.lr, self.max_iter, self.history_size = lr, max_iter, history_size
        self.max_eval = max_iter * 5 // 4  # torch.optim.LBFGS's default; it binds for max_iter < 4
        self.tolerance_grad, self.tolerance_change = tolerance_grad, tolerance_change
        self._allocate()

    def _allocate(self) -> None:
        raise NotImplementedError


class LockstepLBFGS(_Iteration):
    """L-BFGS on ``P`` independent problems; every variable has the problems along dimension 0.

    The closure is called with a boolean mask ``(P,)`` of the problems whose loss and gradient are
    needed (those still iterating in this step; the others' values are not read, so a closure may skip
    them). It zeroes nothing itself (:meth:`step` clears the variables' gradients before each call) and
    must return the per-problem losses, shape ``(P,)``, after back-propagating their sum (the problems
    being independent, the sum's gradient is each problem's own gradient).
    """

    def _allocate(self) -> None:
        self.problems = self.variables[0].shape[0]
        if any(v.shape[0] != self.problems for v in self.variables):
            raise ValueError("every variable must have the same number of problems along dimension 0")
        ref = self.variables[0]
        size = sum(v[0].numel() for v in self.variables)
        p, dtype, device = self.problems, ref.dtype, ref.device
        m = self.history_size
        #: the rings, slot layout: rows [0, m) hold each problem's s vectors, rows [m, 2m) its y vectors
        self.hist = torch.zeros(p, 2 * m, size, dtype=dtype, device=device)
        self.sy = torch.zeros(p, m, m, dtype=dtype, device=device)  # s_a . y_b for every pair of slots
        self.yy = torch.zeros(p, m, m, dtype=dtype, device=device)  # y_a . y_b
        # [S Y]^T g at each problem's last iteration, and Y^T d of its last direction: with them a new pair's
        # products with the ring are differences and small-matrix products, not another pass over the rings
        self.hist_g = torch.zeros(p, 2 * m, dtype=dtype, device=device)
        self.y_d = torch.zeros(p, m, dtype=dtype, device=device)
        self.count = torch.zeros(p, dtype=torch.long, device=device)  # accepted pairs held (<= m)
        self.head = torch.zeros(p, dtype=torch.long, device=device)  # the slot the next pair goes to
        self.h_diag = torch.ones(p, dtype=dtype, device=device)
        self.d = torch.zeros(p, size, dtype=dtype, device=device)
        self.t = torch.zeros(p, dtype=dtype, device=device)
        self.s = torch.zeros(p, size, dtype=dtype, device=device)  # d * t: each problem's last move
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

    def _evaluate(self, closure: Callable[[torch.Tensor], torch.Tensor], needed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for v in self.variables:
            v.grad = None
        with torch.enable_grad():
            losses = closure(needed)
        self.evaluations += 1
        return losses.detach().to(torch.float64), self._flat_grad()

    def freeze(self, mask: torch.Tensor) -> None:
        """Stop the problems in ``mask`` for good (e.g. diverged ones whose last finite iterate was restored)."""
        self.frozen |= mask

    # ------------------------------------------------------------------ the iteration
    def _direction(self, g: torch.Tensor, hist_g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``-H g`` for every problem (compact form; slots ordered oldest to newest per problem, the
        unfilled ones first, as zero pairs with a unit diagonal so that they decouple), and ``Y^T`` of it."""
        m = self.history_size
        order = (self.head.unsqueeze(1) + torch.arange(m, device=g.device)) % m  # (P, m): chronological slots
        used = torch.arange(m, device=g.device).unsqueeze(0) >= (m - self.count).unsqueeze(1)
        gamma = self.h_diag.unsqueeze(1)
        u = hist_g[:, :m].gather(1, order)  # S^T g
        v = hist_g[:, m:].gather(1, order) * gamma  # gamma Y^T g
        rows_at, cols_at = order.unsqueeze(2).expand(-1, m, m), order.unsqueeze(1).expand(-1, m, m)
        sy = self.sy.gather(1, rows_at).gather(2, cols_at)
        yy = self.yy.gather(1, rows_at).gather(2, cols_at)
        diag = torch.diagonal(sy, dim1=1, dim2=2)
        r = torch.triu(sy, diagonal=1) + torch.diag_embed(torch.where(used, diag, torch.ones_like(diag)))
        w = torch.linalg.solve_triangular(r, u.unsqueeze(2), upper=True)  # R^-1 S^T g
        rhs = (diag * used).unsqueeze(2) * w + gamma.unsqueeze(2) * _matvec(yy, w.squeeze(2)).unsqueeze(2) - v.unsqueeze(2)
        z = torch.linalg.solve_triangular(r.transpose(1, 2), rhs, upper=False)
        z_slots = torch.zeros_like(u).scatter(1, order, z.squeeze(2))
        w_slots = torch.zeros_like(u).scatter(1, order, w.squeeze(2))
        coef = torch.cat([z_slots, -gamma * w_slots], dim=1).unsqueeze(1)  # H g = gamma g + S z - gamma Y w
        h_g = g * gamma + torch.bmm(coef, self.hist).squeeze(1)
        # Y^T H g = gamma Y^T g + (S^T Y)^T z - gamma (Y^T Y) w, all in slot layout
        y_hg = gamma * hist_g[:, m:] + _matvec(self.sy.transpose(1, 2), z_slots) - gamma * _matvec(self.yy, w_slots)
        return -h_g, -y_hg

    def _remember(self, g: torch.Tensor, hist_g: torch.Tensor, active: torch.Tensor) -> None:
        """The curvature pair of every active, started problem from its last move (torch.optim.LBFGS
        forms it at the start of the next iteration, as here), into that problem's ring; ``hist_g``
        (``[S Y]^T g`` before the pair) gets the new slot's entries."""
        m = self.history_size
        y = g - self.prev_grad
        s = self.s
        ys = (y * s).sum(1)
        accept = active & self.started & (ys > 1e-10)
        if not bool(accept.any()):
            return
        idx = torch.nonzero(accept).flatten()
        slot = self.head[idx]
        # the new pair against the ring (slot `slot` is overwritten below, its entries set last)
        s_y = hist_g[idx, :m] - self.hist_g[idx, :m]  # s_a . y = s_a . g - s_a . g_prev
        y_y = hist_g[idx, m:] - self.hist_g[idx, m:]  # y_b . y
        y_s = self.t[idx].unsqueeze(1) * self.y_d[idx]  # y_b . s = t (Y^T d)_b
        self.hist[idx, slot] = s[idx]
        self.hist[idx, m + slot] = y[idx]
        self.sy[idx, :, slot] = s_y
        self.sy[idx, slot, :] = y_s
        self.sy[idx, slot, slot] = ys[idx]
        self.yy[idx, :, slot] = y_y
        self.yy[idx, slot, :] = y_y
        self.yy[idx, slot, slot] = (y[idx] * y[idx]).sum(1)
        hist_g[idx, slot] = (s[idx] * g[idx]).sum(1)
        hist_g[idx, m + slot] = (y[idx] * g[idx]).sum(1)
        self.head[idx] = (slot + 1) % m
        self.count[idx] = torch.clamp(self.count[idx] + 1, max=m)
        self.h_diag = torch.where(accept, ys / torch.where(accept, (y * y).sum(1), torch.ones_like(ys)), self.h_diag)

    def step(self, closure: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One ``torch.optim.LBFGS.step`` for every problem (up to ``max_iter`` iterations each); returns
        the losses at the start of the step, as ``torch.optim.LBFGS`` does (frozen problems' included)."""
        if bool(self.frozen.all()):
            return torch.zeros(self.problems, dtype=torch.float64, device=self.frozen.device)
        losses, g = self._evaluate(closure, ~self.frozen)
        start_losses = losses.clone()
        active = ~self.frozen & ~(g.abs().amax(1) <= self.tolerance_grad)
        n_iter = 0
        while bool(active.any()):
            n_iter += 1
            hist_g = _matvec(self.hist, g)  # [S Y]^T g: one pass over the rings
            self._remember(g, hist_g, active)
            first = active & ~self.started
            if bool(self.count.any()):
                d, y_d = self._direction(g, hist_g)
                d = torch.where(first.unsqueeze(1), -g, d)
            else:
                d, y_d = -g, torch.zeros_like(self.y_d)  # no pairs yet: Y is empty
            mask = active.unsqueeze(1)
            self.d = torch.where(mask, d, self.d)
            self.y_d = torch.where(mask, y_d, self.y_d)
            self.hist_g = torch.where(mask, hist_g, self.hist_g)
            self.prev_grad = torch.where(mask, g, self.prev_grad)
            self.prev_loss = torch.where(active, losses, self.prev_loss)
            first_t = torch.clamp(1.0 / g.abs().sum(1), max=1.0) * self.lr
            self.t = torch.where(first, first_t, torch.where(active, torch.full_like(self.t, self.lr), self.t))
            self.s = self.d * self.t.unsqueeze(1)  # the move of this iteration: the next pair's s
            self.started |= active
            gtd = (g * self.d).sum(1)
            active = active & ~(gtd > -self.tolerance_change)
            if not bool(active.any()):
                break
            step = torch.where(active.unsqueeze(1), self.s, torch.zeros_like(self.s))  # 0 * a NaN direction is NaN
            self._move(step)
            if n_iter == self.max_iter:
                break
            losses, g = self._evaluate(closure, active)
            if 1 + n_iter >= self.max_eval:  # evaluations in this step
                break
            small_grad = g.abs().amax(1) <= self.tolerance_grad
            small_step = self.s.abs().amax(1) <= self.tolerance_change
            small_change = (losses - self.prev_loss).abs() < self.tolerance_change
            active = active & ~small_grad & ~small_step & ~small_change
        return start_losses


class LBFGS(_Iteration):
    """``torch.optim.LBFGS``'s iteration (``line_search_fn=None``) on one problem, in the compact form.

    The same iteration as :class:`LockstepLBFGS` with one problem, for ``leak()``'s one target at a time,
    where the L-BFGS bookkeeping around a LeNet closure costs about a third of each evaluation: here the
    ring's slot and count, the step length and the stopping tests are Python numbers (each test reads one
    number off a tensor, as ``torch.optim.LBFGS`` does), and the compact form is solved on the filled slots
    only, gathered in chronological order: 0.24-0.27 ms per iteration against 0.52-0.60 ms for
    :class:`LockstepLBFGS` with one problem (``python -m experiments.bench.lbfgs``). ``tests/attacks/test_lbfgs.py``
    checks both classes against ``torch.optim.LBFGS``.

    The closure takes no argument, leaves each variable's gradient in ``.grad`` (``None`` reads as zero;
    :meth:`step` clears them before each call) and returns the loss (one element).
    """

    def _allocate(self) -> None:
        ref = self.variables[0]
        size = sum(v.numel() for v in self.variables)
        m, dtype, device = self.history_size, ref.dtype, ref.device
        self.hist = torch.zeros(2 * m, size, dtype=dtype, device=device)  # rows [0, m): s, [m, 2m): y, ring slots
        self.sy = torch.zeros(m, m, dtype=dtype, device=device)  # s_a . y_b
        self.yy = torch.zeros(m, m, dtype=dtype, device=device)  # y_a . y_b
        self.hist_g = torch.zeros(2 * m, dtype=dtype, device=device)  # [S Y]^T g at the last iteration
        self.y_d = torch.zeros(m, dtype=dtype, device=device)  # Y^T d of the last direction
        self.count, self.head = 0, 0  # pairs held, the slot the next one goes to
        self.h_diag = torch.ones((), dtype=dtype, device=device)
        self.d = torch.zeros(size, dtype=dtype, device=device)
        self.t = 0.0
        self.s = torch.zeros(size, dtype=dtype, device=device)  # d * t: the last move
        self.prev_grad = torch.zeros(size, dtype=dtype, device=device)
        self.prev_loss = 0.0
        self.started = False
        self.evaluations = 0

    def _evaluate(self, closure: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
        for v in self.variables:
            v.grad = None
        with torch.enable_grad():
            loss = closure()
        self.evaluations += 1
        grads = [(v.grad if v.grad is not None else torch.zeros_like(v)).reshape(-1) for v in self.variables]
        return float(loss.detach()), grads[0] if len(grads) == 1 else torch.cat(grads)

    def _remember(self, g: torch.Tensor, hist_g: torch.Tensor) -> None:
        """The pair from the last move, when its curvature ``y.s`` exceeds 1e-10 (torch.optim.LBFGS's test)."""
        y = g - self.prev_grad
        s = self.s
        ys = torch.dot(y, s)
        if not float(ys) > 1e-10:
            return
        m, slot = self.history_size, self.head
        s_y = hist_g[:m] - self.hist_g[:m]  # s_a . y for every slot a
        y_y = hist_g[m:] - self.hist_g[m:]  # y_b . y
        self.hist[slot] = s
        self.hist[m + slot] = y
        self.sy[:, slot] = s_y
        self.sy[slot] = self.y_d * self.t  # s . y_b = t (Y^T d)_b
        self.sy[slot, slot] = ys
        yy = torch.dot(y, y)
        self.yy[:, slot] = y_y
        self.yy[slot] = y_y
        self.yy[slot, slot] = yy
        hist_g[slot] = torch.dot(s, g)
        hist_g[m + slot] = torch.dot(y, g)
        self.head = (slot + 1) % m
        self.count = min(self.count + 1, m)
        self.h_diag = ys / yy

    def _direction(self, g: torch.Tensor, hist_g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``-H g`` and ``Y^T`` of it (slot layout), from the filled slots in chronological order."""
        m, k = self.history_size, self.count
        order = torch.arange(self.head - k, self.head, device=g.device) % m  # chronological slots
        gamma = self.h_diag
        sy = self.sy.index_select(0, order).index_select(1, order)
        yy = self.yy.index_select(0, order).index_select(1, order)
        u = hist_g.index_select(0, order).unsqueeze(1)  # S^T g
        v = hist_g.index_select(0, order + m) * gamma  # gamma Y^T g
        r = torch.triu(sy)
        w = torch.linalg.solve_triangular(r, u, upper=True)  # R^-1 S^T g
        rhs = torch.diagonal(sy).unsqueeze(1) * w + gamma * (yy @ w) - v.unsqueeze(1)
        z = torch.linalg.solve_triangular(r.T, rhs, upper=False)
        coef = torch.zeros(2 * m, dtype=g.dtype, device=g.device)
        coef[order] = z.squeeze(1)
        coef[order + m] = -gamma * w.squeeze(1)
        h_g = torch.addmv(g * gamma, self.hist.T, coef)  # H g = gamma g + S z - gamma Y w
        # Y^T H g = gamma Y^T g + (S^T Y)^T z - gamma (Y^T Y) w, in slot layout
        y_hg = gamma * hist_g[m:] + self.sy.T @ coef[:m] + self.yy @ coef[m:]
        return -h_g, -y_hg

    def _move(self, step: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for v in self.variables:
                n = v.numel()
                v.add_(step[offset : offset + n].view_as(v))
                offset += n

    def step(self, closure: Callable[[], torch.Tensor]) -> float:
        """One ``torch.optim.LBFGS.step`` (up to ``max_iter`` iterations); returns the loss at its start."""
        loss, g = self._evaluate(closure)
        start_loss = loss
        if float(g.abs().max()) <= self.tolerance_grad:
            return start_loss
        for n_iter in range(1, self.max_iter + 1):
            hist_g = self.hist @ g  # [S Y]^T g: one pass over the ring
            if self.started:
                self._remember(g, hist_g)
            if not self.started or self.count == 0:
                # the first iteration steps along -g; later ones with no pair yet, -H_0 g with H_0 = I
                self.d, self.y_d = -g, torch.zeros_like(self.y_d)
            else:
                self.d, self.y_d = self._direction(g, hist_g)
            self.hist_g, self.prev_grad, self.prev_loss = hist_g, g, loss
            self.t = min(1.0, 1.0 / float(g.abs().sum())) * self.lr if not self.started else self.lr
            self.started = True
            self.s = self.d * self.t  # the move of this iteration: the next pair's s
            if float(torch.dot(g, self.d)) > -self.tolerance_change:
                break
            self._move(self.s)
            if n_iter == self.max_iter:
                break
            loss, g = self._evaluate(closure)
            if 1 + n_iter >= self.max_eval:
                break
            if float(g.abs().max()) <= self.tolerance_grad:
                break
            if float(self.s.abs().max()) <= self.tolerance_change:
                break
            if abs(loss - self.prev_loss) < self.tolerance_change:
                break
        return start_loss


def _matvec(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``a @ x`` per problem, (P, m, n) x (P, n) -> (P, m), as a row vector times ``a``'s transpose:
    a batched matrix-vector ``bmm`` takes a slow path on CPU (about 9x slower, measured here)."""
    return torch.bmm(x.unsqueeze(1), a.transpose(1, 2)).squeeze(1)


__all__ = ["LBFGS", "LockstepLBFGS"]
