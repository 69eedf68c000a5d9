"""LG-FedAvg: the paper's scalar counts per message (d x C + C each way, FedRE's Table 11), and on tiny real
data with the heterogeneous cpu5 group: heads averaged by sample count and loaded by every client, each
keeping its own body."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from privfl.channel import Channel, summarize_comm
from privfl.methods.lgfedavg import LGFedAvg, average_heads, head_message, head_state
from privfl.models import assign_archs
from tests.helpers import engine_trainer, needs_fmnist

NAMES = [f"client{k}" for k in range(10)]


#: the engine settings of this file's in-process runs
ENGINE = {"subsample": 600, "partition": "iid", "rounds": 2, "progress": False, "batch_size": 32, "device": "cpu"}


def trainer(tmp_path: Path, method: str, **values: Any):
    """An engine Trainer built in-process (default model group cpu5: heterogeneous bodies)."""
    return engine_trainer(tmp_path / "run", {**ENGINE, "method": method, "out_dir": str(tmp_path), **values})


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
