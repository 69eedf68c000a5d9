"""Neighbour graphs (ring, ring2, k-regular, random time-varying, full) with failures and joins, and the
engine's Local-T / Global-T metrics (``--global-test``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from privfl.cli import run_cli
from privfl.errors import ConfigError
from privfl.topology import Graph, Ring, parse_failures
from privfl.train import main as train_main


def test_graph_ring_is_drdfls_ring_with_the_same_failures():
    outages = parse_failures("2@1,4@2-3", 6)
    ring, graph = Ring(6, outages, 0.3, seed=5), Graph(6, "ring", outages=outages, failure_rate=0.3, seed=5)
    for rnd in range(8):
        assert graph.down(rnd) == ring.down(rnd)
        assert graph.edges(rnd) == ring.edges(rnd)
        for node in range(6):
            assert graph.in_neighbors(node, rnd) == ring.in_neighbors(node, rnd)
            assert graph.out_neighbors(node, rnd) == ring.out_neighbors(node, rnd)


@pytest.mark.parametrize("degree", [2, 4, 6])
def test_kregular_is_regular_symmetric_static_and_seeded(degree):
    g = Graph(10, "kregular", degree, seed=3)
    for node in range(10):
        assert len(g.in_neighbors(node, 0)) == degree
        assert g.in_neighbors(node, 0) == g.out_neighbors(node, 0)  # undirected
    assert g.edges(0) == g.edges(7)  # static
    assert Graph(10, "kregular", degree, seed=3).edges(0) == g.edges(0)
    assert any(Graph(10, "kregular", degree, seed=s).edges(0) != g.edges(0) for s in range(4, 8))


def test_random_graph_varies_by_round_and_is_reproducible():
    g = Graph(12, "random", 3, seed=1)
    assert all(len(g.in_neighbors(n, r)) == 3 for n in range(12) for r in range(5))
    assert len({tuple(g.edges(r)) for r in range(5)}) == 5  # time-varying
    assert [Graph(12, "random", 3, seed=1).edges(r) for r in range(5)] == [g.edges(r) for r in range(5)]
    degrees = np.bincount([s for r in range(200) for s, _ in g.edges(r)], minlength=12)
    assert degrees.min() > 0.8 * degrees.mean()  # senders drawn uniformly


@pytest.mark.parametrize("shape", ["ring", "ring2", "kregular", "random", "full"])
def test_down_nodes_have_no_links_and_late_joiners_join(shape):
    g = Graph(8, shape, 2, outages=parse_failures("3@0-2,5@4", 8), seed=0)
    for rnd in range(7):
        dead = g.down(rnd)
        assert (3 in dead) == (rnd <= 2) and (5 in dead) == (rnd >= 4)
        assert all(s not in dead and m not in dead for s, m in g.edges(rnd))
        assert set(g.alive(rnd)) == set(range(8)) - dead
    assert g.in_neighbors(3, 3) and g.out_neighbors(3, 3)  # joined in round 3
    if shape == "full":
        assert len(g.edges(0)) == 7 * 6


def test_graph_refuses_impossible_shapes():
    with pytest.raises(ConfigError, match="even"):
        Graph(8, "kregular", 3)
    with pytest.raises(ConfigError, match=r"1\.\.7"):
        Graph(8, "random", 8)
    with pytest.raises(ConfigError, match="shape"):
        Graph(8, "torus")
    with pytest.raises(ConfigError, match="down"):
        Graph(3, "ring", outages=parse_failures("0@0,1@0,2@0", 3)).down(0)


def test_global_t_scores_every_client_on_the_union_of_test_sets(tmp_path: Path, fmnist):
    """FedAvg's clients hold one model under the global protocol, so each scores the same on the
    shared Global-T set; with N at least the union, Local-T is the unweighted mean of the clients'
    accuracies; under the personal protocol (each its own locally trained model) they differ."""
    argv = ["fedavg", "--model-group", "homo-cnn4", "--subsample", "600", "--rounds", "1", "--no-progress"]
    assert train_main([*argv, "--global-test", "100000", "--out-dir", str(tmp_path), "--run-name", "g"]) == 0
    (last,) = [json.loads(line) for line in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    assert len(set(last["client_global_t"])) == 1 and last["global_t"] == pytest.approx(last["acc"])
    assert last["local_t"] == pytest.approx(np.mean(last["client_acc"]))
    assert last["local_t_personal"] == pytest.approx(np.mean(last["client_acc_personal"]))
    assert len(set(last["client_global_t_personal"])) > 1
    summary = json.loads((tmp_path / "g" / "summary.json").read_text())
    assert summary["final_global_t"] == last["global_t"] and summary["final_local_t_personal"] == last["local_t_personal"]
    assert train_main([*argv, "--out-dir", str(tmp_path), "--run-name", "off"]) == 0
    (plain,) = [json.loads(line) for line in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines()]
    assert "global_t" not in plain and plain["acc"] == last["acc"]  # the metric changes nothing else


def test_drdfl_runs_on_a_kregular_graph_and_mixes_the_mean_of_its_neighbours(tmp_path: Path, fmnist):
    """Every node receives from its two k-regular neighbours (peer messages only along the round's
    edges, as verify checks); with one received state absorb_all is the paper's absorb."""
    from privfl.run import Run
    from privfl.verify import verify_run

    argv = ["drdfl", "--subsample", "400", "--num-clients", "4", "--rounds", "1", "--no-progress", "--partition", "iid"]
    assert train_main([*argv, "--topology", "kregular", "--degree", "2", "--out-dir", str(tmp_path), "--run-name", "k"]) == 0
    run = Run.open(tmp_path / "k")
    assert run.info["topology"] == "graph"
    learngene = [r for r in run.capture.records() if r["kind"] == "learngene"]
    assert len(learngene) == 4 * 2 and {(r["sender"], r["receiver"]) for r in learngene} == {
        (f"client{s}", f"client{m}") for s, m in Graph(4, "kregular", 2, seed=0).edges(0)
    }
    assert verify_run(tmp_path / "k").ok
    bad = [*argv, "--topology", "random", "--schedule", "token", "--out-dir", str(tmp_path), "--run-name", "bad"]
    assert run_cli("privfl.train", lambda: train_main(bad)) == 2
    assert not (tmp_path / "bad").exists()

    # mixing: two received states act as their mean; the Gaussians' EMA moves towards the mean too
    import torch

    from privfl.capture import Message
    from privfl.config import build_config
    from privfl.engine import Trainer
    from privfl.methods import METHODS

    cfg = build_config({"method": "drdfl", "subsample": 400, "num_clients": 4, "partition": "iid", "progress": False}, METHODS.get("drdfl").Options)
    from privfl.methods.drdfl import DRDFL

    method = Trainer(cfg, tmp_path / "mix").method
    assert isinstance(method, DRDFL)
    a, b, c = method.env.clients[:3]
    with torch.no_grad():
        for p in b.model.learngene.parameters():
            p.add_(1.0)
    msgs = [
        (
            Message(0, x.name, a.name, "learngene", method.learngene_tensors(x.model), {"trained": True}),
            Message(0, x.name, a.name, "gaussians", method.gaussian_tensors(x.model), {"trained": True}),
        )
        for x in (b, c)
    ]
    own = {k: v.clone() for k, v in a.model.learngene.state_dict().items()}
    method.last_trained[a.index] = 0  # a trained node mixes (a new one would adopt)
    method.absorb_all(a, msgs)
    for k, v in a.model.learngene.state_dict().items():
        if v.is_floating_point():
            expected = (own[k] + (msgs[0][0].tensors[f"learngene.{k}"] + msgs[1][0].tensors[f"learngene.{k}"]) / 2) / 2
            assert torch.allclose(v, expected), k
