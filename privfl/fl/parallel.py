"""Clients trained and evaluated at once, in threads (``--client-workers``), with the numbers unchanged.

Why threads help: a client's local round is small arithmetic (a ``cnn4`` step at batch 10 is ~8 ms), so
torch's own intra-op threads speed it up little, while clients are independent. On this project's
2-core machine a round of the parity setting (``python -m experiments.bench.client_workers``, 2026-11-26) takes
0.70x the time of one thread with torch splitting each operation over two, 0.54x with two clients at
once, one thread each (torch releases the GIL inside its kernels; the Python between them is a small
share of a step).

A run's numbers depend on the thread count each client computes with (torch splits a convolution's sums
by it), not on how many clients compute at once: with ``W`` workers on ``T`` threads each client computes
on ``T // W`` threads and the server on ``T``, and the run is bit for bit the one with those thread counts
one client at a time (``tests/engine/test_client_workers.py`` compares 2 workers with 1 at one thread), since:

- everything that leaves a client (sends, the capture, ground truth) happens in the main thread, in
  the order of selection, after that client's work: the capture files are the same;
- a client's work that writes a run's files (the knowledge log) is deferred with :func:`defer_or_run`
  and replayed in the main thread, in client order, before that client's messages are sent;
- the global random generators (torch, numpy, ``random``) are one per process, so a worker only records
  the seeds a client would set (:func:`privfl.seeding.recorded_seeding`); after the clients, the states
  are checked to be untouched (nothing drew from them) and the last client's last seeding is replayed,
  which leaves the state a sequential run leaves. A client that draws from them (dropout, a method's
  own noise) makes the run stop with one line naming the way out (``--client-workers 1``);
- each worker computes with ``threads // workers`` torch threads (at least one), restored afterwards.

Only methods that declare :attr:`FLMethod.parallel_clients <privfl.fl.method.FLMethod.parallel_clients>`
run so: their ``client_round`` (on a graph ``gossip_send`` and ``gossip_round``), ``fit`` and ``predict``
touch their own client only (the contract of a method written in roles, which the Flower engine relies on
too). A user's method runs one client at a time until it declares it. On a GPU clients run one at a time
(one device).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from privfl.errors import PrivflError
from privfl.seeding import global_rng_states, recorded_seeding, same_rng_states, seed_global

T = TypeVar("T")
R = TypeVar("R")

#: per thread: the deferred effects of the client task it runs (None outside a task)
_TASK = threading.local()


def defer_or_run(fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` now, or, inside a client task in a worker thread, later in the main thread, in client
    order (before that client's messages are sent): for work whose order shows in a run's files."""
    effects = getattr(_TASK, "effects", None)
    if effects is None:
        fn(*args)
    else:
        effects.append((fn, args))


@dataclass
class _Done:
    """One task's value, the effects it deferred and the seedings it recorded."""

    value: Any
    effects: list[tuple[Callable[..., Any], tuple[Any, ...]]] = field(default_factory=list)
    seeds: list[tuple[int | str, ...]] = field(default_factory=list)


def _task(fn: Callable[[T], R], item: T) -> _Done:
    effects: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
    _TASK.effects = effects
    try:
        with recorded_seeding() as seeds:
            value = fn(item)
        return _Done(value, effects, seeds)
    finally:
        _TASK.effects = None


def resolve_client_workers(setting: int, device: torch.device) -> int:
    """``--client-workers``: 0 (auto) is torch's thread count on CPU; a GPU runs one client at a time."""
    if device.type != "cpu":
        return 1
    return max(1, torch.get_num_threads() if setting == 0 else setting)


def ordered_map(fn: Callable[[T], R], items: Iterable[T], workers: int, *, what: str, ahead: int | None = None) -> Iterator[tuple[T, R]]:
    """``(item, fn(item))`` in the order of ``items``, computed by ``workers`` threads at most ``ahead`` items
    (default ``2 * workers``) before the consumer, with the guarantees in the module docstring; ``what``
    names the work in the error a draw from the global generators gives. With one worker, or one item,
    it is a plain loop in this thread."""
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        for item in items:
            yield item, fn(item)
        return
    workers = min(workers, len(items))  # 10 clients on 16 threads: 10 workers, the threads split among them
    ahead = max(1, ahead or 2 * workers)
    saved_threads = torch.get_num_threads()
    per_worker = max(1, saved_threads // workers)
    before = global_rng_states()
    last_seed: tuple[int | str, ...] | None = None
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="privfl-client", initializer=torch.set_num_threads, initargs=(per_worker,))
    pending: deque[tuple[T, Future[_Done]]] = deque()
    todo = iter(items)

    def submit_ahead() -> None:  # keep up to `ahead` items submitted beyond what the consumer took
        pending.extend((item, pool.submit(_task, fn, item)) for item in itertools.islice(todo, ahead - len(pending)))

    torch.set_num_threads(per_worker)  # the main thread's own work meanwhile (sends, capture) shares the cores too
    try:
        submit_ahead()
        while pending:
            item, future = pending.popleft()
            done = future.result()
            submit_ahead()  # the workers go on while this item is consumed
            for effect, args in done.effects:
                effect(*args)
            if done.seeds:
                last_seed = done.seeds[-1]
            if not pending:  # every task has finished: the global generators must be as they were
                if not same_rng_states(before, global_rng_states()):
                    raise PrivflError(
                        f"{what} drew from torch's, numpy's or Python's global random generator while clients ran in parallel "
                        "threads (dropout, or noise drawn without a generator), which would make the numbers depend on thread "
                        "timing: run it with --client-workers 1"
                    )
                if last_seed is not None:
                    seed_global(*last_seed)  # type: ignore[arg-type]  # (seed, *keys): the state the last client's seeding leaves in a sequential run
            yield item, done.value
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(saved_threads)


__all__ = ["defer_or_run", "ordered_map", "resolve_client_workers"]
