"""FedRep and FedALA: the paper's scalar counts per message at the papers' shapes, and the known
properties of each on tiny real data (homo-cnn4).

FedRep: only the body crosses the wire; the head phase leaves the body alone (with no body epochs an
upload is the broadcast it started from); the server's body is the sample-weighted mean of the uploads.
FedALA: with W fixed at 1 (eta = 0) it is exactly FedAvg; otherwise the lower layers are the global
model's and the top layers lie between the trained and the global model by the stored W in [0, 1].
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from privfl.capture import Message, TensorStore
from privfl.channel import Channel, summarize_comm
from privfl.config import build_config
from privfl.fl.method import module_tensors
from privfl.methods import METHODS
from privfl.methods.fedala import FedALA
from privfl.methods.fedrep import FedRep, body_state, head_parameters
from privfl.models import build_model
from tests.conftest import read_metrics
from tests.killer import InterruptAfter as KillAfter
from tests.killer import Interrupted as Killed
from tests.test_train import needs_fmnist

NAMES = [f"client{k}" for k in range(10)]


def trainer(tmp_path: Path, method: str, **values):
    """An engine Trainer built in-process on tiny data, so a test can look at client models afterwards."""
    from privfl.engine import Trainer

    base = {
        "method": method,
        "subsample": 300,
        "partition": "iid",
        "rounds": 2,
        "progress": False,
        "batch_size": 32,
        "model_group": "homo-cnn4",
        "out_dir": str(tmp_path),
        "device": "cpu",
    }
    cfg = build_config({**base, **values}, METHODS.get(method).Options)
    return Trainer(cfg, tmp_path / method)


# ------------------------------------------------------------------------------------------ counts from layer shapes
def conv(cin: int, cout: int, k: int, bias: bool = True) -> int:
    return cin * cout * k * k + (cout if bias else 0)


def linear(din: int, dout: int) -> int:
    return din * dout + dout


def bn(c: int) -> int:
    return 2 * c  # weight and bias (running statistics are buffers, not parameters)


def cnn4_body(channels: int, side: int) -> int:
    """HtFLlib's FedAvgCNN without its last Linear: two 5x5 convs (valid) + 2x2 pools, then Linear(flat, 512)."""
    s = ((side - 4) // 2 - 4) // 2
    return conv(channels, 32, 5) + conv(32, 64, 5) + linear(64 * s * s, 512)


def resnet18_body(channels: int) -> int:
    """torchvision ResNet-18 without fc: 7x7 stem + BN, four stages of two BasicBlocks (3x3 convs, BN, 1x1 downsample)."""

    def block(cin: int, cout: int) -> int:
        down = conv(cin, cout, 1, bias=False) + bn(cout) if cin != cout else 0
        return conv(cin, cout, 3, bias=False) + bn(cout) + conv(cout, cout, 3, bias=False) + bn(cout) + down

    stages = sum(block(cin, cout) + block(cout, cout) for cin, cout in ((64, 64), (64, 128), (128, 256), (256, 512)))
    return conv(channels, 64, 7, bias=False) + bn(64) + stages


@pytest.mark.parametrize(
    "arch, channels, side, expected",
    [("cnn4", 1, 28, 576_896), ("cnn4", 3, 32, 873_408), ("resnet18", 3, 32, 11_176_512)],
)
def test_fedrep_sends_the_body_parameter_count_each_way(arch, channels, side, expected):
    """|phi| = parameters of features + mapping, no head: homo-cnn4 on Fashion-MNIST, the CNN on CIFAR, and
    DRDFL's ResNet-18 minus its fc (11,689,512 - 513,000 for torchvision's 1000-class model)."""
    formula = cnn4_body(channels, side) if arch == "cnn4" else resnet18_body(channels)
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


@pytest.mark.parametrize("classes, table_11", [(10, 8_785_380), (100, 9_247_080)])
def test_fedala_sends_the_full_model_as_fedre_table_11(classes, table_11):
    """FedRE Table 11, FedALA row (x10^3, 10 clients, CIFAR CNN): 8785.38 / 9247.08 both ways."""
    model = build_model("cnn4", in_channels=3, num_classes=classes, image_size=32)
    full = module_tensors(model)
    assert sum(v.numel() for v in full.values()) == cnn4_body(3, 32) + linear(512, classes)
    channel = Channel(method="fedala", sends=FedALA.sends)
    for name in NAMES:
        channel.send(Message(0, name, "server", "model", full, {"num_samples": 7}))
    channel.broadcast(0, NAMES, "model", full)
    comm = summarize_comm(channel.end_round())
    assert comm["up"]["paper_scalars"] == comm["down"]["paper_scalars"] == table_11


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
@pytest.mark.parametrize("method", ["fedrep", "fedala"])
def test_killed_run_resumes_exactly(tmp_path, method):
    """Killed in round 1 after 2 of its 3 uploads and resumed: same metrics, capture and truth as an unbroken
    run. FedRep's state is the server's body; FedALA's is each client's W, stored after the first, converging
    ALA at the end of round 0: a resume without it would run a converging ALA again in round 1."""
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

    def strip(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]

    assert strip(read_metrics(full)) == strip(read_metrics(killed))
    for store in ("capture", "truth"):
        assert TensorStore(full / store, store).records() == TensorStore(killed / store, store).records(), store
    if method == "fedala":
        assert [h["ala_epochs"] for h in read_metrics(killed)][1] == 1.0
