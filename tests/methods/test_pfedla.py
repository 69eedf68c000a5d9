"""pFedLA (and HeurpFedLA): every message is the full model, and the known properties on tiny real data.

The weights per layer sum to 1 and differ per client; frozen to uniform they make every download the plain
average of the uploads; the hypernetwork step is the chain rule through the aggregation and (as descent)
brings the aggregate closer to the upload; HeurpFedLA keeps the client's own layers; an interrupted run
resumes exactly."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privfl.config import build_config
from privfl.fl.method import module_tensors
from privfl.methods import METHODS
from privfl.methods.pfedla import layer_weights
from privfl.run import Run
from tests.helpers import by_round, engine_trainer, metrics_without_time, needs_fmnist, read_metrics
from tests.killer import InterruptAfter as StopAfter
from tests.killer import Interrupted as Interrupt

#: homo-cnn4 on Fashion-MNIST from its layer shapes: conv 5x5 1->32, conv 5x5 32->64, Linear(1024, 512), head Linear(512, 10)
CNN4_FMNIST = (32 * 1 * 5 * 5 + 32) + (64 * 32 * 5 * 5 + 64) + (1024 * 512 + 512) + (512 * 10 + 10)


#: the engine settings of this file's in-process runs
ENGINE = {
    "subsample": 300,
    "num_clients": 3,
    "partition": "dir",
    "alpha": 0.5,
    "min_samples": 10,
    "rounds": 2,
    "progress": False,
    "batch_size": 16,
    "model_group": "homo-cnn4",
    "device": "cpu",
}


def trainer(tmp_path: Path, method: str, name: str = "run", **values: Any):
    """An engine Trainer built in-process (homo-cnn4), so a test can look at models mid-run."""
    return engine_trainer(tmp_path / name, {**ENGINE, "method": method, "out_dir": str(tmp_path), **values})


# ------------------------------------------------------------------------------------------ counts
@needs_fmnist
@pytest.mark.parametrize("method", ["pfedla"])
def test_every_message_is_the_full_model_and_every_client_gets_one(tmp_path, method):
    assert CNN4_FMNIST == 582_026
    t = trainer(tmp_path, method, num_clients=10, partition="iid", min_samples=None, rounds=1)
    t.run()
    recs = t.capture.records()
    setup = [r for r in recs if r["meta"].get("phase") == "setup"]
    ups, downs = by_round(recs, 0, "up"), by_round(recs, 0, "down")
    assert len(setup) == len(ups) == len(downs) == 10
    assert {r["receiver"] for r in downs} == {f"client{i}" for i in range(10)}
    assert all(r["kind"] == "model" and r["paper_scalars"] == r["scalars"] == CNN4_FMNIST for r in setup + ups + downs)
    m = t.history[-1]
    assert m["upload_scalars"] == m["broadcast_scalars"] == 10 * CNN4_FMNIST == 5_820_260


# ------------------------------------------------------------------------------------------ pFedLA
def test_layer_weights_normalise_and_fall_back_to_own():
    scores = torch.tensor([[1.0, 3.0, 0.0], [0.0, 0.0, 0.0], [2.0, 2.0, 4.0]])
    w = layer_weights(scores, own=1)
    assert torch.allclose(w.sum(1), torch.ones(3))
    assert torch.allclose(w[0], torch.tensor([0.25, 0.75, 0.0])) and torch.equal(w[1], torch.tensor([0.0, 1.0, 0.0]))
    w = layer_weights(scores, own=2, retain=1)  # HeurpFedLA: the row of largest own score (row 2) is its own
    assert torch.equal(w[2], torch.tensor([0.0, 0.0, 1.0])) and torch.allclose(w[0], torch.tensor([0.25, 0.75, 0.0]))


@needs_fmnist
def test_pfedla_weights_sum_to_one_per_layer_differ_per_client_and_learn_only_from_uploads(tmp_path):
    t = trainer(tmp_path, "pfedla", rounds=3, join_ratio=0.67, options={"hn_lr": 0.5})
    m = t.method
    assert list(m.layers) == ["features.0", "features.3", "features.7", "head"]
    before = [m.weights(i).detach().clone() for i in range(3)]
    t.run()
    after = [m.weights(i).detach() for i in range(3)]
    for w in after:
        assert w.shape == (4, 3) and torch.allclose(w.sum(1), torch.ones(4, dtype=w.dtype)) and bool((w >= 0).all())
    assert not torch.allclose(after[0], after[1]) and not torch.allclose(after[1], after[2])
    # round 0 starts from one model everywhere: no gradient; after it, a hypernetwork moves only when its client uploads
    chosen = [set(h["selected"]) for h in t.history]
    assert all(len(s) == 2 for s in chosen)
    trained = set().union(*chosen[1:])
    for i in range(3):
        moved = not torch.equal(before[i], after[i])
        assert moved == (i in trained), (i, chosen)
    recs = t.capture.records()
    downs = [t.capture.load(r) for r in by_round(recs, 2, "down")]
    assert not torch.equal(downs[0]["head.weight"], downs[1]["head.weight"])  # one personalised model per client


@needs_fmnist
def test_pfedla_frozen_uniform_weights_download_the_plain_average_of_uploads(tmp_path):
    t = trainer(tmp_path, "pfedla", options={"hn_lr": 0.0})
    for hypernet in t.method.hypernets:
        for head in hypernet.heads:
            nn.init.zeros_(head.weight)
            nn.init.ones_(head.bias)
    t.run()
    recs = t.capture.records()
    for rnd in (0, 1):
        ups = [t.capture.load(r) for r in by_round(recs, rnd, "up")]
        downs = [t.capture.load(r) for r in by_round(recs, rnd, "down")]
        assert len(ups) == len(downs) == 3
        for k in ups[0]:
            mean = torch.stack([u[k].double() for u in ups]).mean(0)
            for d in downs:
                assert torch.allclose(d[k].double(), mean, atol=1e-6), (rnd, k)


@needs_fmnist
def test_pfedla_hypernet_step_is_the_chain_rule_and_descends(tmp_path):
    """The step on HN_i equals autograd's gradient of 1/2 ||theta_bar_i(psi) - upload||^2 through the whole
    aggregation; it brings theta_bar_i closer to the upload, and hn_sign=fl-bench moves it away."""
    t = trainer(tmp_path, "pfedla", options={"hn_lr": 0.05})
    t.method.setup()
    t.method.run_round(0, t.clients)  # the stored models now differ
    m = t.method
    client = t.clients[2]
    m.fit(1, client)
    upload = module_tensors(client.model)

    def distance() -> float:
        with torch.no_grad():
            sent = m.aggregate(2, m.weights(2))
        return sum(float((sent[k].double() - upload[k].double()).pow(2).sum()) for k in m.layer_of)

    hypernet = m.hypernets[2]
    start = copy.deepcopy(hypernet.state_dict())
    aggregate = m.aggregate(2, m.weights(2))
    loss = 0.5 * sum((aggregate[k] - upload[k]).pow(2).sum() for k in m.layer_of)
    expected = torch.autograd.grad(loss, list(hypernet.parameters()))
    got = m.hypernet_grads(2, upload)
    for (name, _), g, e in zip(hypernet.named_parameters(), got, expected):
        assert g is not None and e.abs().max() > 0 and torch.allclose(g, e, rtol=1e-4, atol=1e-9), name
    d0 = distance()
    m.update_hypernet(2, upload)
    d1 = distance()
    assert d1 < d0
    hypernet.load_state_dict(start)
    m.opts.hn_sign = "fl-bench"
    m.update_hypernet(2, upload)
    assert distance() > d0


@needs_fmnist
def test_heurpfedla_keeps_the_clients_own_layers(tmp_path):
    t = trainer(tmp_path, "pfedla", rounds=1, options={"k": 2})
    t.run()
    m = t.method
    downs = {r["receiver"]: t.capture.load(r) for r in by_round(t.capture.records(), 0, "down")}
    for i in range(3):
        w = m.weights(i).detach()
        own = [layer for layer in range(4) if torch.equal(w[layer], F.one_hot(torch.tensor(i), 3).to(w))]
        assert len(own) == 2
        for layer in own:
            for name in list(m.layers.values())[layer]:
                assert torch.equal(downs[f"client{i}"][name], m.stacked[name][i])  # its own last upload


# ------------------------------------------------------------------------------------------ resume


@needs_fmnist
def test_pfedla_interrupted_run_resumes_exactly(tmp_path):
    """Stopped inside round 1 and resumed from the round-0 checkpoint, a run sends and scores exactly what
    an uninterrupted one does: hypernetworks and stored models are in the checkpoint. (Per-FedAvg keeps
    only the global model and the personal parts, which the engine checkpoints for every method; its
    determinism is checked above, two runs capturing the same tensors.)"""
    method, options = "pfedla", {"hn_lr": 0.5}
    from privfl.train import resume
    from privfl.train import train_config as train_cfg

    values = {
        "method": method,
        "subsample": 300,
        "num_clients": 3,
        "partition": "dir",
        "alpha": 0.5,
        "min_samples": 10,
        "rounds": 2,
        "batch_size": 16,
        "model_group": "homo-cnn4",
        "progress": False,
        "device": "cpu",
        "out_dir": str(tmp_path),
        "options": options,
    }
    opts = METHODS.get(method).Options
    full = train_cfg(build_config({**values, "run_name": "full"}, opts)).path
    cfg = build_config({**values, "run_name": "stopped"}, opts)
    with pytest.raises(Interrupt):
        train_cfg(cfg, callbacks=[StopAfter(1, 2)])
    stopped = tmp_path / "stopped"
    assert len(read_metrics(stopped)) == 1
    resume(stopped, cfg)
    assert metrics_without_time(full) == metrics_without_time(stopped)
    a, b = Run.open(full).capture.records(), Run.open(stopped).capture.records()
    assert [r["sha256"] for r in a] == [r["sha256"] for r in b] and len(a) == 3 + 2 * (3 + 3)
    assert read_metrics(full)[-1]["acc_personal"] != read_metrics(full)[-1]["acc"]
