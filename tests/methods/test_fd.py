"""FD: the paper's scalar counts per message (K x C up, M x C down), and the known properties of what it
sends on tiny real data with the heterogeneous cpu5 group: per-class mean logits up (of the trained model,
or of the training steps), their per-class means over the holders down, each client's own upload left out
on request."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from privfl.capture import Message
from privfl.channel import Channel, summarize_comm
from privfl.methods import Client
from privfl.methods.fd import FD, LogitAccumulator, class_mean_logits, logits_message
from tests.helpers import engine_trainer, needs_fmnist

NAMES = [f"client{k}" for k in range(10)]


#: the engine settings of this file's in-process runs
ENGINE = {"subsample": 600, "partition": "iid", "rounds": 2, "progress": False, "batch_size": 32, "device": "cpu"}


def trainer(tmp_path: Path, method: str, **values: Any):
    """An engine Trainer built in-process (default model group cpu5: heterogeneous bodies)."""
    return engine_trainer(tmp_path / "run", {**ENGINE, "method": method, "out_dir": str(tmp_path), **values})


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
