"""FedNova: what it sends is exactly what an attacker needs, and the server does the math. An ``update``
message with its meta rebuilds the client's local model; the server's normalised averaging with one client is
plain local training; the momentum normaliser is torch's SGD; Adam is refused."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from privfl.errors import ConfigError
from privfl.methods import Client
from privfl.methods.fednova import local_steps, normalizer
from tests.helpers import engine_trainer, model_broadcasts, needs_fmnist

#: the engine settings of this file's in-process runs
ENGINE = {"subsample": 300, "partition": "iid", "rounds": 1, "progress": False, "batch_size": 32, "model_group": "homo-cnn4", "device": "cpu"}


def trainer(tmp_path: Path, method: str, **values: Any):
    """An engine Trainer built in-process, so a test can look at client models mid-round."""
    return engine_trainer(tmp_path / "run", {**ENGINE, "method": method, "out_dir": str(tmp_path), **values})


@needs_fmnist
def test_fednova_with_one_client_is_local_training(tmp_path):
    t = trainer(tmp_path, "fednova", num_clients=1, local_epochs=2, momentum=0.5)
    t.method.setup()
    client = t.clients[0]
    twin = Client(client.index, client.arch, copy.deepcopy(client.model), client.train_idx, client.test_idx)
    t.method.local_train(0, twin)  # same seeds (round, client) as the method's own local training
    t.method.run_round(0, t.clients)
    glob = t.method.global_model.state_dict()
    for k, v in twin.model.state_dict().items():
        assert torch.allclose(glob[k], v, atol=1e-6), k
        assert torch.equal(client.model.state_dict()[k], glob[k])  # broadcast loaded by the client
    msg = [r for r in t.capture.records() if r["kind"] == "update"][0]
    tau = local_steps(len(client.train_idx), 32, 2)
    assert msg["meta"]["tau"] == tau == 2 * -(-len(client.train_idx) // 32)
    assert msg["meta"]["a"] == pytest.approx(normalizer(tau, 0.5)) and msg["meta"]["a"] > tau  # momentum amplifies


@needs_fmnist
def test_fednova_update_rebuilds_each_client_model_and_server_normalises(tmp_path):
    t = trainer(tmp_path, "fednova", num_clients=3, rounds=2, partition="dir", alpha=0.5, min_samples=5)
    local: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    send = t.channel.send

    def spy(msg, *, truth=None):
        if msg.kind == "update":  # the client's actual model at upload time, before any broadcast
            model = t.clients[int(msg.sender.removeprefix("client"))].model
            local[(msg.round, msg.sender)] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return send(msg, truth=truth)

    t.channel.send = spy
    t.run()
    capture = t.capture
    models = model_broadcasts(capture)
    ups = [r for r in capture.records() if r["kind"] == "update"]
    assert len(ups) == 6 and len(local) == 6
    for rnd in (0, 1):
        round_ups = [r for r in ups if r["round"] == rnd]
        x = capture.load(models[(0, "setup", "client0")] if rnd == 0 else models[(rnd - 1, "train", "client0")])
        ds = [capture.load(r) for r in round_ups]
        for rec, d in zip(round_ups, ds):
            assert rec["meta"]["a"] == rec["meta"]["tau"]  # plain SGD
            assert rec["meta"]["lr"] == t.cfg.lr
            for k, v in local[(rnd, rec["sender"])].items():
                assert torch.allclose(x[k] - rec["meta"]["a"] * d[k], v, atol=1e-6), (rnd, rec["sender"], k)
        n = torch.tensor([r["meta"]["num_samples"] for r in round_ups], dtype=torch.float64)
        p = n / n.sum()
        a = torch.tensor([r["meta"]["a"] for r in round_ups], dtype=torch.float64)
        tau_eff = float((p * a).sum())
        after = capture.load(models[(rnd, "train", "client2")])
        for k in x:
            expected = x[k].double() - tau_eff * sum(pk * d[k].double() for pk, d in zip(p.tolist(), ds))
            assert torch.allclose(after[k].double(), expected, atol=1e-6), k
    assert len({r["meta"]["tau"] for r in ups}) > 1  # unequal local work: the case FedNova is for


def test_momentum_normaliser_matches_torch_sgd():
    """With a constant gradient g, tau momentum-SGD steps move x by exactly lr * a(tau, rho) * g."""
    for rho in (0.0, 0.5, 0.9):
        for tau in (1, 3, 17):
            x = torch.zeros(4, dtype=torch.float64, requires_grad=True)
            g = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
            opt = torch.optim.SGD([x], lr=0.1, momentum=rho)
            for _ in range(tau):
                opt.zero_grad()
                (x * g).sum().backward()
                opt.step()
            assert torch.allclose(x.detach(), -0.1 * normalizer(tau, rho) * g), (rho, tau)
    assert normalizer(5) == 5.0 and local_steps(65, 32, 2) == 6


@needs_fmnist
def test_fednova_refuses_adam(tmp_path):
    with pytest.raises(ConfigError, match="sgd"):
        trainer(tmp_path, "fednova", optimizer="adam")
