"""``--client-workers``: clients trained and evaluated at once in threads give the run that one client at a
time gives, bit for bit (metrics, capture, ground truth, knowledge log, checkpoint), for every method that
declares ``parallel_clients``; a client that draws from a global random generator stops the run with one
line; the option's bad values are one-line errors."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from privfl.capture import TensorStore
from privfl.config import load_saved_config
from privfl.errors import PrivflError
from privfl.fl import parallel
from privfl.fl.parallel import defer_or_run, ordered_map
from privfl.methods import METHODS, ClientReply
from privfl.methods.simple import Local
from privfl.run import Run, load_checkpoint_state, read_checkpoint
from privfl.seeding import seed_global
from tests.conftest import read_metrics
from tests.test_train import cli_error, needs_fmnist, train

# on the CPU: worker threads are a CPU feature (a GPU trains one client at a time, parallel.resolve_client_workers)
TINY = ["--subsample", "240", "--partition", "iid", "--num-clients", "3", "--batch-size", "32", "--no-progress", "--model-group", "homo-cnn4"]
TINY += ["--device", "cpu"]
#: methods whose declaration these tests hold to (the speed issue's parity methods among them)
PARALLEL = sorted(name for name in METHODS.names() if METHODS.get(name).clients_in_parallel())


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _stores(run: Path) -> dict[str, list[dict]]:
    return {name: list(TensorStore(run / name, name).records()) for name in ("capture", "truth", "knowledge") if (run / name).exists()}


def _state(run: Path) -> dict[str, torch.Tensor]:
    pointer = read_checkpoint(run)
    assert pointer is not None
    return load_checkpoint_state(run, pointer)


def _numbers(run: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "seconds"} for row in read_metrics(run)]


#: the default suite's share, one of each shape of round: every client alone, a stateless streamed FedAvg,
#: a head server with the knowledge log (FedRE), mutual learning, gossip on a graph; the others run as slow
QUICK = ["local", "fedavg", "fedre", "fml", "dfedpgp"]


def test_the_parity_methods_are_declared():
    assert {"local", "fedavg", "fedprox", "fedproto", "fedgh", "fedre"} <= set(PARALLEL)
    assert set(QUICK) <= set(PARALLEL)
    assert not {"fedgen", "fedfed", "drdfl", "fedcvae"} & set(PARALLEL)  # their clients draw from the global generators


def _same_run(tmp_path: Path, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers against one client at a time, both at one torch thread (the numbers of a convolution
    depend on the thread count it is split over, with or without workers): the same run, bit for bit;
    and the two-worker run did hand its clients to worker threads."""
    submitted: list[int] = []

    class Counting(ThreadPoolExecutor):
        def submit(self, *args, **kwargs):
            submitted.append(1)
            return super().submit(*args, **kwargs)

    monkeypatch.setattr(parallel, "ThreadPoolExecutor", Counting)
    args = [*TINY, "--rounds", "2", "--knowledge-every", "1"]
    with torch_threads(1):
        one = train(tmp_path, method, *args, "--client-workers", "1", name="one")
        assert not submitted
        two = train(tmp_path, method, *args, "--client-workers", "2", name="two")
    assert len(submitted) >= 2 * 3  # every round's clients (and their evaluation) went to the workers
    assert _numbers(one) == _numbers(two)
    assert _stores(one) == _stores(two)
    a, b = _state(one), _state(two)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@needs_fmnist
@pytest.mark.parametrize("method", QUICK)
def test_workers_change_no_number(tmp_path, method, monkeypatch):
    _same_run(tmp_path, method, monkeypatch)


@needs_fmnist
@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(set(PARALLEL) - set(QUICK)))
def test_workers_change_no_number_every_declared_method(tmp_path, method, monkeypatch):
    _same_run(tmp_path, method, monkeypatch)


class DrawsInRound(Local):
    """Declares parallel clients but draws from torch's global generator in its round (as dropout does)."""

    parallel_clients = True

    def client_round(self, rnd, client) -> ClientReply:
        reply = super().client_round(rnd, client)
        torch.rand(1)
        return reply


@needs_fmnist
def test_a_draw_from_the_global_generator_is_an_error(tmp_path):
    with torch_threads(2), pytest.raises(PrivflError, match=r"global random generator.*--client-workers 1"):
        train(tmp_path, f"{__name__}:DrawsInRound", *TINY, "--rounds", "1", "--client-workers", "2")
    with torch_threads(2):  # one at a time it runs (seeded, so repeatable)
        train(tmp_path, f"{__name__}:DrawsInRound", *TINY, "--rounds", "1", "--client-workers", "1", name="seq")


def test_ordered_map_keeps_order_effects_and_seeding():
    """Values and deferred effects in item order whatever the finishing order; the global generator left
    as the last item's seeding leaves it; torch's thread count restored."""
    log: list[int] = []

    def work(i: int) -> int:
        seed_global(7, "item", i)
        time.sleep(0.02 * (5 - i))  # later items finish first
        defer_or_run(log.append, i)
        return i * i

    with torch_threads(2):
        out = list(ordered_map(work, range(5), 2, what="test"))
        assert torch.get_num_threads() == 2
    assert out == [(i, i * i) for i in range(5)] and log == list(range(5))
    after = torch.rand(3)
    seed_global(7, "item", 4)
    assert torch.equal(after, torch.rand(3))


def test_ordered_map_raises_a_worker_error_in_order():
    def work(i: int) -> int:
        if i == 1:
            raise ValueError("client 1 failed")
        return i

    seen = []
    results = ordered_map(work, range(4), 2, what="test")
    seen.append(next(results)[0])
    with pytest.raises(ValueError, match="client 1 failed"):
        next(results)
    assert seen == [0]


@needs_fmnist
def test_a_run_saved_before_the_option_resumes_one_client_at_a_time(tmp_path):
    """config.json without client_workers (a run saved before the option, 2026-11-26) is reopened and resumed with one
    client at a time, the thread count its clients computed with."""
    run = train(tmp_path, "local", *TINY, "--rounds", "1", name="old")
    path = run / "config.json"
    config = json.loads(path.read_text())
    assert config["client_workers"] == 0
    del config["client_workers"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    assert Run(run).cfg.client_workers == 1 and load_saved_config(run)["client_workers"] == 1


def test_bad_values_are_one_line_errors(capsys, tmp_path):
    from privfl.train import main

    for bad in ("-1", "two", "1.5"):
        err = cli_error(capsys, main, ["fedavg", "--client-workers", bad, "--out-dir", str(tmp_path)])
        assert "client" in err and "workers" in err, err
    assert not any(tmp_path.iterdir())
