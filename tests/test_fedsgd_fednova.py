"""FedSGD and FedNova: what they send is exactly what an attacker needs, and the server does the math.

FedSGD: a ``grad`` message is the gradient of one captured batch at the captured global model.
FedNova: an ``update`` message with its meta rebuilds the client's local model, and the server's
normalised averaging with one client is plain local training.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from privfl.capture import TensorStore
from privfl.config import build_config
from privfl.errors import ConfigError
from privfl.methods import METHODS, Client
from privfl.methods.fednova import local_steps, normalizer
from privfl.models import build_model
from tests.test_train import QUICK, needs_fmnist, train

HOMO = ["--model-group", "homo-cnn4"]


def trainer(tmp_path: Path, method: str, **values):
    """An engine Trainer built in-process, so a test can look at client models mid-round."""
    from privfl.engine import Trainer

    base = {
        "method": method,
        "subsample": 300,
        "partition": "iid",
        "rounds": 1,
        "progress": False,
        "batch_size": 32,
        "model_group": "homo-cnn4",
        "out_dir": str(tmp_path),
        "device": "cpu",
    }
    cfg = build_config({**base, **values}, METHODS.get(method).Options)
    return Trainer(cfg, tmp_path / "run")


def model_messages(capture: TensorStore) -> dict[tuple[int, str, str], dict]:
    """(round, phase, receiver) -> the ``model`` broadcast record."""
    return {(r["round"], r["meta"]["phase"], r["receiver"]): r for r in capture.records() if r["kind"] == "model"}


# the run computed its gradients on a GPU where there is one, this test recomputes them on the CPU: other
# kernels, other rounding (seen on an H200: 1e-6 apart on gradients of 5e-4)
GRAD_RTOL, GRAD_ATOL = (1e-3, 1e-5) if torch.cuda.is_available() else (1e-4, 1e-6)


@needs_fmnist
def test_fedsgd_grad_is_one_batch_gradient_and_server_takes_one_step(tmp_path):
    from privfl.data import load_dataset

    run = train(tmp_path, "fedsgd", *QUICK, *HOMO, "--server-lr", "0.5")
    capture, truth = TensorStore(run / "capture", "capture"), TensorStore(run / "truth", "truth")
    truth_by_seq = {r["message_seq"]: r for r in truth.records()}
    models = model_messages(capture)
    ups = [r for r in capture.records() if r["kind"] == "grad"]
    assert len(ups) == 10 and all(r["direction"] == "up" for r in ups)

    info = json.loads((run / "run.json").read_text())
    assert info["knowledge"] == {}  # exposes nothing beyond the capture
    ds = info["dataset"]
    model = build_model("cnn4", in_channels=ds["channels"], num_classes=ds["num_classes"], image_size=ds["image_size"])
    start = capture.load(models[(0, "setup", "client0")])
    model.load_state_dict(start)
    model.train()
    data = load_dataset("fashionmnist")
    split = load_file(str(run / "truth" / "partition.safetensors"))
    subset = split["subset"]

    weighted: dict[str, torch.Tensor] = {}
    total = 0
    for rec in ups:
        t = truth.load(truth_by_seq[rec["seq"]])
        idx = t["indices"]
        client = int(rec["sender"].removeprefix("client"))
        # one batch: batch_size distinct samples of the client's own train split
        assert rec["meta"]["batch_size"] == len(idx) == 32 and len(idx.unique()) == 32
        assert rec["meta"]["num_samples"] == len(split[f"train_{client}"])
        assert set(idx.tolist()) <= set(split[f"train_{client}"].tolist())
        assert torch.equal(t["labels"], data.labels[subset[idx]])
        model.zero_grad()
        F.cross_entropy(model(data.normalize(data.images[subset[idx]])), t["labels"]).backward()
        sent = capture.load(rec)
        assert set(sent) == {k for k, _ in model.named_parameters()}
        for k, p in model.named_parameters():
            assert p.grad is not None and torch.allclose(sent[k], p.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL), k
            weighted[k] = weighted.get(k, 0) + 32 * sent[k].double()
        total += 32
    # the batches differ between clients (seeded per client)
    assert len({tuple(truth.load(truth_by_seq[r["seq"]])["indices"].tolist()) for r in ups}) == 10

    after = capture.load(models[(0, "train", "client3")])
    for k, x in start.items():
        assert torch.allclose(after[k].double(), x.double() - 0.5 * weighted[k] / total, atol=1e-6), k


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
    models = model_messages(capture)
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
