"""FedALA: the scalar count per message (the full model, as FedRE's Table 11), and the known properties on
tiny real data (homo-cnn4): with W fixed at 1 (eta = 0) it is exactly FedAvg; otherwise the lower layers are
the global model's and the top layers lie between the trained and the global model by the stored W in
[0, 1]; a killed run resumes exactly, ALA epochs included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from privfl.capture import Message, TensorStore
from privfl.channel import Channel, summarize_comm
from privfl.config import build_config
from privfl.fl.method import module_tensors
from privfl.methods import METHODS
from privfl.methods.fedala import FedALA
from privfl.models import build_model
from tests.helpers import cnn4_body_params, engine_trainer, linear_params, metrics_without_time, needs_fmnist, read_metrics
from tests.killer import InterruptAfter as KillAfter
from tests.killer import Interrupted as Killed

NAMES = [f"client{k}" for k in range(10)]


#: the engine settings of this file's in-process runs
ENGINE = {"subsample": 300, "partition": "iid", "rounds": 2, "progress": False, "batch_size": 32, "model_group": "homo-cnn4", "device": "cpu"}


def trainer(tmp_path: Path, method: str, **values: Any):
    """An engine Trainer built in-process on tiny data, so a test can look at client models afterwards."""
    return engine_trainer(tmp_path / method, {**ENGINE, "method": method, "out_dir": str(tmp_path), **values})


# ------------------------------------------------------------------------------------------ counts from layer shapes
@pytest.mark.parametrize("classes, table_11", [(10, 8_785_380), (100, 9_247_080)])
def test_fedala_sends_the_full_model_as_fedre_table_11(classes, table_11):
    """FedRE Table 11, FedALA row (x10^3, 10 clients, CIFAR CNN): 8785.38 / 9247.08 both ways."""
    model = build_model("cnn4", in_channels=3, num_classes=classes, image_size=32)
    full = module_tensors(model)
    assert sum(v.numel() for v in full.values()) == cnn4_body_params(3, 32) + linear_params(512, classes)
    channel = Channel(method="fedala", sends=FedALA.sends)
    for name in NAMES:
        channel.send(Message(0, name, "server", "model", full, {"num_samples": 7}))
    channel.broadcast(0, NAMES, "model", full)
    comm = summarize_comm(channel.end_round())
    assert comm["up"]["paper_scalars"] == comm["down"]["paper_scalars"] == table_11


# ------------------------------------------------------------------------------------------ FedALA, trained
@needs_fmnist
def test_fedala_with_w_fixed_at_one_is_fedavg_exactly(tmp_path):
    """eta = 0 keeps W = 1: every client's model after ALA is the global model, so FedALA trains, sends and
    scores exactly as FedAvg (same messages bit for bit, same accuracies under both protocols)."""
    a = trainer(tmp_path, "fedavg", num_clients=5)
    b = trainer(tmp_path, "fedala", num_clients=5, options={"eta": 0.0})
    a.run()
    b.run()
    ra, rb = a.capture.records(), b.capture.records()
    assert [(r["kind"], r["sender"], r["receiver"], r["sha256"]) for r in ra] == [(r["kind"], r["sender"], r["receiver"], r["sha256"]) for r in rb]
    for ha, hb in zip(a.history, b.history):
        for key in ("acc", "acc_personal", "client_acc", "client_acc_personal", "train_loss", "upload_scalars"):
            assert ha[key] == hb[key], key
        assert hb["upload_scalars"] == hb["broadcast_scalars"] == 5 * 582_026
    assert all(torch.equal(w, torch.ones_like(w)) for ws in b.method.weights.values() for w in ws.values())


@needs_fmnist
def test_fedala_merges_lower_layers_global_and_top_layers_by_w_in_0_1(tmp_path):
    t = trainer(tmp_path, "fedala", num_clients=5)
    t.run()
    names = [n for n, _ in t.clients[0].model.named_parameters()]
    top = names[-2:]
    assert top == ["head.weight", "head.bias"]  # layer_idx = 2: the paper's p = 1 layer, the head
    glob = t.capture.load([r for r in t.capture.records() if r["round"] == 1 and r["direction"] == "down"][0])
    learned = 0
    for client in t.clients:
        params = dict(client.model.named_parameters())
        trained = t.method.personal[client.name][""]  # the client's model after its round-1 training
        weights = t.method.weights[client.name]
        assert sorted(weights) == sorted(top)
        for n in names[:-2]:
            assert torch.equal(params[n], glob[n]), n  # lower layers: the global model's
        for n in top:
            w = weights[n]
            assert w.shape == params[n].shape and bool(((w >= 0) & (w <= 1)).all())
            assert torch.equal(params[n], torch.lerp(trained[n], glob[n], w)), n
            learned += int((w < 1).sum())
    assert learned > 0  # W moved off its initial ones
    first, second = (h["ala_epochs"] for h in t.history)
    assert first > t.method.opts.num_pre_loss and second == 1.0  # converge once, then one epoch per round


@needs_fmnist
def test_killed_run_resumes_exactly(tmp_path):
    """Killed in round 1 after 2 of its 3 uploads and resumed: same metrics, capture and truth as an unbroken
    run. FedALA's state is each client's W, stored after the first, converging ALA at the end of round 0: a
    resume without it would run a converging ALA again in round 1."""
    method = "fedala"
    from privfl.train import resume
    from privfl.train import train_config as train
    from privfl.verify import verify_run

    values = {
        "method": method, "subsample": 200, "num_clients": 3, "partition": "iid", "rounds": 2, "batch_size": 32,
        "model_group": "homo-cnn4", "progress": False, "device": "cpu", "out_dir": str(tmp_path),
    }  # fmt: skip
    options = METHODS.get(method).Options
    full = train(build_config({**values, "run_name": "full"}, options)).path
    cfg = build_config({**values, "run_name": "killed"}, options)
    with pytest.raises(Killed):
        train(cfg, callbacks=[KillAfter(1, 2)])
    killed = tmp_path / "killed"
    assert len(read_metrics(killed)) == 1
    resume(killed, cfg)
    assert verify_run(killed).ok

    assert metrics_without_time(full) == metrics_without_time(killed)
    for store in ("capture", "truth"):
        assert TensorStore(full / store, store).records() == TensorStore(killed / store, store).records(), store
    assert [h["ala_epochs"] for h in read_metrics(killed)][1] == 1.0
