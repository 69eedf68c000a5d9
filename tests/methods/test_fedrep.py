"""FedRep: the scalar count per message at the paper's shapes, and the known properties on tiny real data
(homo-cnn4): only the body crosses the wire; the head phase leaves the body alone (with no body epochs an
upload is the broadcast it started from); the server's body is the sample-weighted mean of the uploads; a
killed run resumes exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from privfl.capture import Message, TensorStore
from privfl.channel import Channel, summarize_comm
from privfl.config import build_config
from privfl.methods import METHODS
from privfl.methods.fedrep import FedRep, body_state, head_parameters
from privfl.models import build_model
from tests.helpers import cnn4_body_params, engine_trainer, metrics_without_time, needs_fmnist, read_metrics, resnet18_body_params
from tests.killer import InterruptAfter as KillAfter
from tests.killer import Interrupted as Killed

NAMES = [f"client{k}" for k in range(10)]


#: the engine settings of this file's in-process runs
ENGINE = {"subsample": 300, "partition": "iid", "rounds": 2, "progress": False, "batch_size": 32, "model_group": "homo-cnn4", "device": "cpu"}


def trainer(tmp_path: Path, method: str, **values: Any):
    """An engine Trainer built in-process on tiny data, so a test can look at client models afterwards."""
    return engine_trainer(tmp_path / method, {**ENGINE, "method": method, "out_dir": str(tmp_path), **values})


# ------------------------------------------------------------------------------------------ counts from layer shapes
@pytest.mark.parametrize(
    "arch, channels, side, expected",
    [("cnn4", 1, 28, 576_896), ("cnn4", 3, 32, 873_408), ("resnet18", 3, 32, 11_176_512)],
)
def test_fedrep_sends_the_body_parameter_count_each_way(arch, channels, side, expected):
    """|phi| = parameters of features + mapping, no head: homo-cnn4 on Fashion-MNIST, the CNN on CIFAR, and
    DRDFL's ResNet-18 minus its fc (11,689,512 - 513,000 for torchvision's 1000-class model)."""
    formula = cnn4_body_params(channels, side) if arch == "cnn4" else resnet18_body_params(channels)
    assert formula == expected
    model = build_model(arch, in_channels=channels, num_classes=10, image_size=side)
    body = body_state(model)
    assert all(k.startswith(("features.", "mapping.")) for k in body) and not any(k.startswith("head.") for k in body)
    assert sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.head.parameters()) == expected
    channel = Channel(method="fedrep", sends=FedRep.sends)
    for name in NAMES:
        up = channel.send(Message(0, name, "server", "model", body, {"num_samples": 7}))
        assert up.paper_scalars == up.scalars == expected
    down = channel.broadcast(0, NAMES, "model", body)
    assert all(m.paper_scalars == expected for m in down.values())
    comm = summarize_comm(channel.end_round())
    assert comm["up"]["paper_scalars"] == comm["down"]["paper_scalars"] == 10 * expected


# ------------------------------------------------------------------------------------------ FedRep, trained
def records_by_round(t) -> dict[tuple[int, str], list[dict]]:
    out: dict[tuple[int, str], list[dict]] = {}
    for r in t.capture.records():
        out.setdefault((r["round"], r["meta"].get("phase", "train") if r["direction"] == "down" else "up"), []).append(r)
    return out


@needs_fmnist
def test_fedrep_sends_bodies_only_and_the_server_averages_them_by_samples(tmp_path):
    t = trainer(tmp_path, "fedrep", partition="dir", alpha=0.5, min_samples=10)
    heads_before = [{k: v.detach().clone() for k, v in head_parameters(c.model).items()} for c in t.clients]
    t.run()
    recs = t.capture.records()
    body_names = set(body_state(t.clients[0].model))
    assert {r["kind"] for r in recs} == {"model"}
    assert all(set(r["tensors"]) == body_names for r in recs)  # the head is in no message, either way
    by = records_by_round(t)
    assert len(by[(0, "setup")]) == 10
    for rnd in (0, 1):
        ups, downs = by[(rnd, "up")], by[(rnd, "train")]
        assert len(ups) == len(downs) == 10 and all(r["paper_scalars"] == 576_896 for r in ups + downs)
        n = torch.tensor([r["meta"]["num_samples"] for r in ups], dtype=torch.float64)
        assert len(set(n.tolist())) > 1  # unequal sizes: the weighting matters
        sent = [t.capture.load(r) for r in ups]
        glob = t.capture.load(downs[0])
        for k in body_names:
            expected = sum(w * s[k].double() for w, s in zip((n / n.sum()).tolist(), sent))
            assert torch.allclose(glob[k].double(), expected, atol=1e-6), k
        assert all(torch.equal(t.capture.load(r)[k], glob[k]) for r in downs for k in body_names)
    assert t.history[-1]["upload_scalars"] == t.history[-1]["broadcast_scalars"] == 10 * 576_896
    last_up = {r["sender"]: t.capture.load(r) for r in by[(1, "up")]}
    for client, before in zip(t.clients, heads_before):
        assert all(torch.equal(v, glob[k]) for k, v in body_state(client.model).items())  # it holds the global body
        own = t.method.personal[client.name]  # --eval personal: its own body after local training, as uploaded
        assert all(torch.equal(own[k.split(".", 1)[0]][k.split(".", 1)[1]], v) for k, v in last_up[client.name].items())
        assert all(not torch.equal(v, before[k]) for k, v in head_parameters(client.model).items())  # the head trained
    heads = [torch.cat([p.detach().flatten() for p in head_parameters(c.model).values()]) for c in t.clients]
    assert all(not torch.equal(heads[i], heads[j]) for i in range(10) for j in range(i + 1, 10))  # personal heads
    assert "head_loss" in t.history[-1] and "acc_personal" in t.history[-1]


@needs_fmnist
def test_fedrep_head_epochs_leave_the_body_untouched(tmp_path):
    """With no body epochs, each client uploads exactly the body it received; its head still trains."""
    t = trainer(tmp_path, "fedrep", num_clients=5, options={"body_epochs": 0, "head_epochs": 2})
    heads_before = [{k: v.detach().clone() for k, v in head_parameters(c.model).items()} for c in t.clients]
    t.run()
    by = records_by_round(t)
    for rnd, received in ((0, by[(0, "setup")]), (1, by[(0, "train")])):
        got = {r["receiver"]: t.capture.load(r) for r in received}
        for up in by[(rnd, "up")]:
            sent = t.capture.load(up)
            assert sent.keys() == got[up["sender"]].keys()
            assert all(torch.equal(v, got[up["sender"]][k]) for k, v in sent.items()), (rnd, up["sender"])
    for client, before in zip(t.clients, heads_before):
        assert all(not torch.equal(v, before[k]) for k, v in head_parameters(client.model).items())


@needs_fmnist
def test_killed_run_resumes_exactly(tmp_path):
    """Killed in round 1 after 2 of its 3 uploads and resumed: same metrics, capture and truth as an unbroken
    run. FedRep's state is the server's body."""
    method = "fedrep"
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
