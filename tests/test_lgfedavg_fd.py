"""LG-FedAvg and FD: the paper's scalar counts per message, and the known properties of what each
sends (heads averaged by sample count and loaded by every client; per-class mean logits up, their
per-class means over the holders down), on tiny real data with the heterogeneous cpu5 group."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privfl.capture import Message
from privfl.channel import Channel, summarize_comm
from privfl.config import build_config
from privfl.methods import METHODS, Client
from privfl.methods.fd import FD, LogitAccumulator, class_mean_logits, logits_message
from privfl.methods.lgfedavg import LGFedAvg, average_heads, head_message, head_state
from privfl.models import assign_archs
from tests.test_train import needs_fmnist

NAMES = [f"client{k}" for k in range(10)]


def trainer(tmp_path: Path, method: str, **values):
    """An engine Trainer built in-process (default model group cpu5: heterogeneous bodies)."""
    from privfl.engine import Trainer

    base = {"method": method, "subsample": 600, "partition": "iid", "rounds": 2, "progress": False, "batch_size": 32, "device": "cpu"}
    cfg = build_config({**base, **values}, METHODS.get(method).Options)
    return Trainer(cfg, tmp_path / "run")


# ------------------------------------------------------------------------------------------ counts
@pytest.mark.parametrize("d, c, table_11", [(512, 10, 51_300), (512, 100, 513_000), (2048, 200, 4_098_000)])
def test_lgfedavg_sends_d_c_plus_c_each_way_as_fedre_table_11(d, c, table_11):
    """FedRE Table 11 (x10^3, 10 clients): 51.30 / 513.00 / 4098.00 both ways, homo = hete."""
    channel = Channel(method="lgfedavg", sends=LGFedAvg.sends)
    head = nn.Linear(d, c)
    for name in NAMES:
        up = channel.send(head_message(0, name, "server", head, {"num_samples": 7, "arch": "cnn4"}))
        assert up.paper_scalars == up.scalars == d * c + c
    down = channel.broadcast(0, NAMES, "head", head_state(head))
    assert all(m.paper_scalars == d * c + c for m in down.values())
    comm = summarize_comm(channel.end_round())
    assert comm["up"]["paper_scalars"] == comm["down"]["paper_scalars"] == 10 * (d * c + c) == table_11
    assert comm["up"]["messages"] == comm["down"]["messages"] == 10


def test_fd_sends_k_times_c_up_and_m_times_c_down():
    channel = Channel(method="fd", sends=FD.sends)
    c = 100
    for k in (1, 7, 100):
        up = channel.send(logits_message(0, "client0", "server", torch.arange(k), torch.randn(k, c), {"arch": "mlp"}))
        assert (up.paper_scalars, up.scalars, up.aux) == (k * c, k * c + k, ("classes",))  # class ids are not counted
    channel.end_round()
    m = 42
    down = channel.broadcast(1, NAMES, "logits", {"logits": torch.randn(m, c), "classes": torch.arange(m)})
    assert all(msg.paper_scalars == m * c for msg in down.values())
    assert summarize_comm(channel.end_round())["down"]["paper_scalars"] == 10 * m * c


# ------------------------------------------------------------------------------------------ helpers, exactly
def test_average_heads_weights_by_num_samples_or_uniformly():
    heads = [nn.Linear(4, 3) for _ in range(3)]
    msgs = [head_message(0, f"client{i}", "server", h, {"num_samples": n}) for i, (h, n) in enumerate(zip(heads, (1, 2, 7)))]
    for weighting, w in (("samples", torch.tensor([1.0, 2.0, 7.0]) / 10), ("uniform", torch.full((3,), 1 / 3))):
        avg = average_heads(msgs, weighting)
        assert set(avg) == {"head.weight", "head.bias"}
        for k in avg:
            expected = sum(wi * m.tensors[k].double() for wi, m in zip(w.double(), msgs))
            assert torch.allclose(avg[k].double(), expected, atol=1e-6) and avg[k].dtype == torch.float32


def test_logit_accumulator_and_class_mean_logits_are_per_class_means():
    from privfl.fl.method import DataView

    torch.manual_seed(0)
    images = torch.randint(0, 256, (50, 1, 4, 4), dtype=torch.uint8)
    labels = torch.randint(0, 5, (50,))
    labels[labels == 3] = 2  # class 3 absent
    data = DataView(images, labels, (0.5,), (0.25,), torch.device("cpu"))
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 5))
    idx = torch.arange(3, 47)
    x, y = data.batch(idx)
    with torch.no_grad():
        z = model(x)
    expected_classes = torch.tensor([c for c in range(5) if (y == c).any()])
    expected = torch.stack([z[y == c].mean(0) for c in expected_classes.tolist()])
    classes, means = class_mean_logits(model, data, idx, 5, batch_size=8)  # batch by batch
    assert torch.equal(classes, expected_classes) and torch.allclose(means, expected, atol=1e-6)
    acc = LogitAccumulator(5, torch.device("cpu"))
    for start in range(0, len(y), 8):
        acc.add(z[start : start + 8], y[start : start + 8])
    classes, means = acc.means()
    assert torch.equal(classes, expected_classes) and torch.allclose(means, expected, atol=1e-6)


# ------------------------------------------------------------------------------------------ LG-FedAvg, trained
@needs_fmnist
def test_lgfedavg_every_client_loads_the_sample_weighted_mean_head_and_keeps_its_body(tmp_path):
    t = trainer(tmp_path, "lgfedavg", partition="dir", alpha=0.5, min_samples=10)
    t.run()
    recs = t.capture.records()
    setup = [r for r in recs if r["meta"].get("phase") == "setup"]
    assert len(setup) == 10 and all(r["kind"] == "head" and r["direction"] == "down" for r in setup)
    for rnd in (0, 1):
        ups = [r for r in recs if r["round"] == rnd and r["direction"] == "up"]
        downs = [r for r in recs if r["round"] == rnd and r["meta"].get("phase") == "train"]
        assert len(ups) == len(downs) == 10 and {r["kind"] for r in ups + downs} == {"head"}
        assert all(r["paper_scalars"] == 512 * 10 + 10 for r in ups + downs)
        n = torch.tensor([r["meta"]["num_samples"] for r in ups], dtype=torch.float64)
        assert n.tolist() == [len(c.train_idx) for c in t.clients] and len(set(n.tolist())) > 1  # unequal: weighting matters
        sent = [t.capture.load(r) for r in ups]
        glob = [t.capture.load(r) for r in downs]
        for k in ("head.weight", "head.bias"):
            expected = sum(w * s[k].double() for w, s in zip((n / n.sum()).tolist(), sent))
            assert torch.allclose(glob[0][k].double(), expected, atol=1e-6), k
            assert all(torch.equal(g[k], glob[0][k]) for g in glob)  # one head for everyone
    # after the last round: every client holds that head; its own trained head is what it uploaded
    last_up = {r["sender"]: t.capture.load(r) for r in recs if r["round"] == 1 and r["direction"] == "up"}
    for client in t.clients:
        assert all(torch.equal(v, glob[0][k]) for k, v in head_state(client.model.head).items())
        own = t.method.personal[client.name]["head"]
        assert all(torch.equal(own[k.removeprefix("head.")], v) for k, v in last_up[client.name].items())
    # bodies stay private and differ, also between two clients of the same architecture
    archs = assign_archs("cpu5", 10)
    assert archs[0] == archs[5] and len(set(archs)) == 5
    a, b = t.clients[0].model.features.state_dict(), t.clients[5].model.features.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a if a[k].is_floating_point())
    m = t.history[-1]
    assert m["upload_scalars"] == m["broadcast_scalars"] == 51_300 and "acc_personal" in m


# ------------------------------------------------------------------------------------------ FD, trained
@needs_fmnist
def test_fd_after_uploads_class_means_of_the_trained_model_and_server_averages_over_holders(tmp_path):
    t = trainer(tmp_path, "fd", partition="pat", classes_per_client=3, options={"collect": "after"})
    t.run()
    recs = t.capture.records()
    assert not [r for r in recs if r["meta"].get("phase") == "setup"]  # nothing before round 0
    ups = [r for r in recs if r["round"] == 1 and r["direction"] == "up"]
    downs = [r for r in recs if r["round"] == 1 and r["direction"] == "down"]
    assert len(ups) == len(downs) == 10
    sums, holders = torch.zeros(10, 10, dtype=torch.float64), torch.zeros(10)
    for rec in ups:
        client = t.clients[int(rec["sender"].removeprefix("client"))]
        sent = t.capture.load(rec)
        x, y = t.data.batch(client.train_idx)  # the client's train split; its model is as it uploaded (FD loads nothing)
        client.model.eval()
        with torch.no_grad():
            z = client.model(x)
        present = y.unique()
        assert torch.equal(sent["classes"], present) and len(present) <= 3
        assert rec["paper_scalars"] == len(present) * 10
        for row, c in enumerate(present.tolist()):
            assert torch.allclose(sent["logits"][row], z[y == c].mean(0), atol=1e-5), (rec["sender"], c)
        sums[sent["classes"]] += sent["logits"].double()
        holders[sent["classes"]] += 1
    held = torch.nonzero(holders).flatten()
    glob = t.capture.load(downs[0])
    assert torch.equal(glob["classes"], held) and downs[0]["paper_scalars"] == len(held) * 10
    assert torch.allclose(glob["logits"].double(), sums[held] / holders[held].unsqueeze(1), atol=1e-6)
    assert all(torch.equal(t.capture.load(r)["logits"], glob["logits"]) for r in downs)
    target, known = t.method.received["client4"]
    assert torch.equal(known.nonzero().flatten(), held) and torch.equal(target[held], glob["logits"])
    assert t.history[0]["distill_loss"] == 0 < t.history[1]["distill_loss"]  # no teacher in round 0


@needs_fmnist
def test_fd_during_uploads_the_training_steps_logits_and_distils_with_soft_ce(tmp_path):
    """Replaying client 3's round-1 training with an objective written here (CE + soft-target CE to the
    global logit of each sample's class) gives the same model and the uploaded per-class means."""
    t = trainer(tmp_path, "fd", local_epochs=2)
    t.method.setup()
    t.method.run_round(0, t.clients)
    client = t.clients[3]
    twin = Client(client.index, client.arch, copy.deepcopy(client.model), client.train_idx, client.test_idx)
    target, known = (v.clone() for v in t.method.received[client.name])
    assert bool(known.any())
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def objective(model, x, y):
        z = model(x)
        seen.append((z.detach(), y))
        mask = known[y]
        soft = -(target[y[mask]].softmax(1) * z[mask].log_softmax(1)).sum(1).sum() / len(y)
        return F.cross_entropy(z, y) + 1.0 * soft

    sent: dict[str, Message] = {}
    send = t.channel.send

    def spy(msg, *, truth=None):
        if msg.direction == "up":
            sent[msg.sender] = msg
        return send(msg, truth=truth)

    t.channel.send = spy
    t.method.run_round(1, t.clients)
    t.method.trainer.fit(1, twin, objective)  # the same seeded loop: same batches, same order
    for k, v in client.model.state_dict().items():
        assert torch.allclose(twin.model.state_dict()[k].double(), v.double(), atol=1e-5), k
    z = torch.cat([s[0] for s in seen])
    y = torch.cat([s[1] for s in seen])
    assert len(y) == 2 * len(client.train_idx)  # every sample, once per local epoch
    msg = sent[client.name]
    for row, c in enumerate(msg.tensors["classes"].tolist()):
        assert torch.allclose(msg.tensors["logits"][row], z[y == c].mean(0), atol=1e-5), c


@needs_fmnist
def test_fd_others_leaves_each_clients_own_upload_out(tmp_path):
    t = trainer(tmp_path, "fd", num_clients=3, rounds=1, options={"global_logits": "others"})
    t.run()
    recs = t.capture.records()
    ups = {r["sender"]: t.capture.load(r) for r in recs if r["direction"] == "up"}
    downs = {r["receiver"]: t.capture.load(r) for r in recs if r["direction"] == "down"}
    assert set(downs) == {"client0", "client1", "client2"}
    for name, got in downs.items():
        others = [u for n, u in ups.items() if n != name]
        for row, c in enumerate(got["classes"].tolist()):
            rows = [u["logits"][u["classes"] == c] for u in others if (u["classes"] == c).any()]
            assert torch.allclose(got["logits"][row], torch.cat(rows).mean(0), atol=1e-6)
