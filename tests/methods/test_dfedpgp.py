"""DFedPGP on the neighbour graph: the per-message count at the paper's ResNet-18 (and how it explains
DRDFL's "#Comm" column), and the known properties on tiny real data (homo-cnn4): only the body crosses the
wire (never the head); a node's body before training is exactly the mean of its own and the received bodies
on a ring; push-sum keeps the total weight on a directed random graph; a down node sends, receives and
trains nothing; a killed run resumes to the same metrics and capture."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from privfl.capture import Message, TensorStore
from privfl.channel import Channel
from privfl.methods.dfedpgp import DFedPGP, body_state, mix_states
from privfl.topology import Graph, parse_failures
from privfl.train import main as train_main
from privfl.verify import verify_run
from tests.helpers import FMNIST, ClientSpy, client_index, edges_of, metrics_without_time, read_metrics, seeded_resnet18
from tests.killer import InterruptAfter as KillAt
from tests.killer import Interrupted as Kill

TINY = ["--subsample", "300", "--partition", "iid", "--batch-size", "32", "--no-progress", "--model-group", "homo-cnn4"]
RANDOM = ["--num-clients", "5", "--rounds", "2", "--topology", "random", "--degree", "3", "--failures", "1@1"]
MI = 2**20  # DRDFL's "#Comm" column counts in units of 2^20 (see the counts tests)


def pgp_snapshot(method: DFedPGP, client: Any) -> dict[str, Any]:
    return {"body": body_state(client.model), "head": {k: v.detach().clone() for k, v in client.model.head.state_dict().items()}}


def run_spied(out: Path, name: str, argv: list[str]) -> tuple[Path, ClientSpy]:
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    spy = ClientSpy()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DFedPGP, "train_client", spy.wrap(DFedPGP.train_client, pgp_snapshot))
        assert train_main(["dfedpgp", *TINY, *argv, "--out-dir", str(out), "--run-name", name]) == 0
    return out / name, spy


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Callable[[str], tuple[Path, ClientSpy]]:
    """Each tiny run trained once for the module: (run folder, what each client held around its training)."""
    out = tmp_path_factory.mktemp("graph-runs")
    plans = {
        "pgp-ring": ["--num-clients", "3", "--rounds", "2"],
        "pgp-random": RANDOM,
    }
    cache: dict[str, tuple[Path, ClientSpy]] = {}

    def get(name: str) -> tuple[Path, ClientSpy]:
        if name not in cache:
            cache[name] = run_spied(out, name, plans[name])
        return cache[name]

    return get


# ------------------------------------------------------------------------------------------ counts at ResNet-18


def test_dfedpgp_sends_the_body_state_and_explains_drdfls_213_36m():
    """A message is the body's state dict (features + mapping, BatchNorm buffers included, no head):
    torchvision ResNet-18 at 3x32x32 has 11,176,512 body parameters + 9,620 buffer entries. DRDFL's 20-node
    ring carries 20 of them per round: 223.72e6 scalars, printed as 213.36 "M" (units of 2^20)."""
    model = seeded_resnet18()
    body = body_state(model)
    assert not any(k.startswith("head.") for k in body)
    params = sum(p.numel() for k, p in model.named_parameters() if not k.startswith("head."))
    assert (params, sum(v.numel() for v in body.values())) == (11_176_512, 11_186_132)
    channel = Channel(method="dfedpgp", sends=DFedPGP.sends)
    meta = {"num_samples": 7, "push_weight": 1.0, "out_degree": 1}
    msg = channel.send(Message(0, "client0", "client1", "model", body, meta))
    assert msg.direction == "peer" and msg.paper_scalars == msg.scalars == 11_186_132
    assert round(20 * msg.paper_scalars / MI, 2) == 213.36  # DRDFL Tables I/II, DFedPGP "#Comm"
    assert round(20 * sum(v.numel() for v in model.state_dict().values()) / MI, 2) == 213.46  # its FedNova row: the whole state


def test_mix_states_is_the_weighted_mean_and_rounds_integer_buffers():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(4)}
    out = mix_states([a, b], [1.0, 3.0])
    assert torch.equal(out["w"], torch.tensor([2.5, 5.0])) and out["n"].item() == 4 and out["n"].dtype == torch.int64


# ------------------------------------------------------------------------------------------ DFedPGP, trained
def test_dfedpgp_ring_sends_bodies_only_and_mixes_to_the_exact_mean(runs):
    run, spy = runs("pgp-ring")
    assert verify_run(run).ok, verify_run(run).lines()
    recs = TensorStore(run / "capture", "capture").records()
    ring = Graph(3, "ring")
    body_keys = set(body_state(spy.method.env.clients[0].model))
    for rnd in (0, 1):
        assert edges_of(recs, rnd) == ring.edges(rnd) == [(0, 1), (1, 2), (2, 0)]
    for rec in recs:
        assert (rec["kind"], rec["direction"], rec["paper_scalars"]) == ("model", "peer", 576_896)
        assert set(rec["tensors"]) == body_keys and not any(k.startswith("head.") for k in rec["tensors"])
    capture = TensorStore(run / "capture", "capture")
    for (rnd, i), held in spy.before.items():
        own = capture.load(next(r for r in recs if r["round"] == rnd and client_index(r["sender"]) == i))
        got = capture.load(next(r for r in recs if r["round"] == rnd and client_index(r["receiver"]) == i))
        for k, v in held["body"].items():  # the body after mixing, before the head phase
            assert torch.equal(v, ((own[k].double() + got[k].double()) / 2).to(v.dtype)), (rnd, i, k)
        if rnd:  # the head is the node's own, as it left its last training: never mixed
            assert all(torch.equal(v, spy.after[(rnd - 1, i)]["head"][k]) for k, v in held["head"].items())
    # what a node sends is its body as it left its last training
    for rec in (r for r in recs if r["round"] == 1):
        sent = capture.load(rec)
        assert all(torch.equal(v, spy.after[(0, client_index(rec["sender"]))]["body"][k]) for k, v in sent.items())
        assert rec["meta"]["previous_round"] == 0 and rec["meta"]["num_samples"] > 0
    assert all(r["meta"]["previous_round"] == -1 for r in recs if r["round"] == 0)  # the untrained start: nothing to attack


def test_dfedpgp_random_graph_with_a_down_node_and_push_sum(runs):
    run, spy = runs("pgp-random")
    assert verify_run(run).ok, verify_run(run).lines()
    recs = TensorStore(run / "capture", "capture").records()
    graph = Graph(5, "random", 3, parse_failures("1@1", 5))
    for rnd in (0, 1):
        assert edges_of(recs, rnd) == graph.edges(rnd)
    assert not [r for r in recs if r["round"] == 1 and "client1" in (r["sender"], r["receiver"])]  # down: no message
    assert (1, 1) not in spy.before and (1, 0) in spy.before  # and no training
    assert [m["selected"] for m in read_metrics(run)] == [[0, 1, 2, 3, 4], [0, 2, 3, 4]]
    mu = spy.method.push_weight
    assert mu.sum().item() == pytest.approx(5.0, abs=1e-9) and (mu - 1).abs().max() > 1e-3  # mass kept, de-biasing at work


# ------------------------------------------------------------------------------------------ resume


@pytest.mark.parametrize(
    "name, method, argv, kill_after",
    [("pgp-random", "dfedpgp", RANDOM, 3)],
)
def test_killed_run_resumes_to_the_same_metrics_and_capture(runs, tmp_path, name, method, argv, kill_after):
    """DisPFL's two masks per node and DFedPGP's push-sum weights live in the checkpoint: a run killed inside
    round 1 and resumed ends as the uninterrupted one."""
    full, _ = runs(name)
    with pytest.raises(Kill):
        train_main([method, *TINY, *argv, "--out-dir", str(tmp_path), "--run-name", "killed"], callbacks=[KillAt(1, kill_after)])
    killed = tmp_path / "killed"
    assert len(read_metrics(killed)) == 1
    assert train_main(["--resume", str(killed), "--no-progress"]) == 0
    assert verify_run(killed).ok

    assert metrics_without_time(full) == metrics_without_time(killed)
    for store in ("capture", "truth"):
        assert TensorStore(full / store, store).records() == TensorStore(killed / store, store).records(), store
