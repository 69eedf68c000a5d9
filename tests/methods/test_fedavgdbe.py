"""FedAvg + DBE: FedAvg's per-message counts at the paper's CNN shape plus one d-vector each way at
setup; PRBM never crosses the wire and differs per client; the global mean is the sample-weighted mean
of the uploaded running means; a replay of the setup pass and of a round with an objective written
here gives the same mean, model and PRBM; kappa = 0 with a frozen PRBM is FedAvg; a killed run resumes
exactly."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from privfl.capture import Message
from privfl.channel import Channel, summarize_comm
from privfl.config import build_config
from privfl.methods import METHODS, Client, ModelRequest
from privfl.methods.fedavgdbe import PRIVATE, SETUP_ROUND, DBEModel, FedAvgDBE, FedAvgDBEOptions, shared_state
from tests.helpers import metrics_without_time, needs_fmnist, read_metrics
from tests.killer import InterruptAfter as KillAfter
from tests.killer import Interrupted as Killed

NAMES = [f"client{k}" for k in range(10)]


def trainer(tmp_path: Path, method: str = "fedavgdbe", **values):
    """An engine Trainer built in-process (identical cnn4 clients), so a test can look inside."""
    from privfl.engine import Trainer

    base = {
        "method": method,
        "subsample": 600,
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


# ------------------------------------------------------------------------------------------ counts
@pytest.mark.parametrize("classes, per_model, table_11", [(10, 878_538, 8_785_380), (100, 924_708, 9_247_080)])
def test_sends_fedavgs_count_per_round_and_one_d_vector_each_way_at_setup(classes, per_model, table_11):
    """FedRE Table 11 (x10^3, 10 clients): FedAvgDBE 8785.38 / 9247.08 both ways on CIFAR-10/100 with
    HtFLlib's 4-layer CNN (privfl's cnn4 at 3x32x32); the running means are d = 512 scalars each."""
    cfg = build_config({"method": "fedavgdbe", "model_group": "homo-cnn4"}, FedAvgDBEOptions)
    req = ModelRequest("cnn4", 0, 3, classes, 32, cfg, FedAvgDBEOptions())
    model = FedAvgDBE.build_client_model(req)
    assert isinstance(model, DBEModel) and model.prbm.shape == model.global_mean.shape == (512,)
    state = shared_state(model)
    assert not set(state) & set(PRIVATE) and set(state) | set(PRIVATE) == set(model.state_dict())
    channel = Channel(method="fedavgdbe", sends=FedAvgDBE.sends)
    for name in NAMES:
        up = channel.send(Message(1, name, "server", "model", state, {"num_samples": 7, "arch": "cnn4"}))
        assert up.paper_scalars == up.scalars == per_model
    down = channel.broadcast(1, NAMES, "model", state)
    assert all(m.paper_scalars == per_model for m in down.values())
    comm = summarize_comm(channel.end_round())
    assert comm["up"]["paper_scalars"] == comm["down"]["paper_scalars"] == 10 * per_model == table_11
    mean = channel.send(Message(0, "client0", "server", "mean_rep", {"rep": torch.zeros(512)}, {"num_samples": 3, "phase": "setup"}))
    assert mean.paper_scalars == 512
    assert channel.broadcast(0, NAMES, "mean_rep", {"rep": torch.zeros(512)}, meta={"phase": "setup"})["client3"].paper_scalars == 512


# ------------------------------------------------------------------------------------------ trained
@needs_fmnist
def test_prbm_stays_private_and_the_global_mean_is_the_sample_weighted_mean_of_the_uploads(tmp_path):
    k = 5
    t = trainer(tmp_path, num_clients=k, subsample=400, partition="dir", alpha=0.5, min_samples=10)
    t.run()
    recs = t.capture.records()
    setup = [r for r in recs if r["meta"].get("phase") == "setup"]
    assert [(r["kind"], r["direction"]) for r in setup] == [("model", "down")] * k + [("mean_rep", "up")] * k + [("mean_rep", "down")] * k
    assert not [r for r in recs if r["kind"] == "mean_rep" and r["meta"].get("phase") != "setup"]  # G is computed once
    # G = sum_i n_i m_i / sum_i n_i over what the clients uploaded
    ups = [r for r in setup if r["kind"] == "mean_rep" and r["direction"] == "up"]
    n = torch.tensor([r["meta"]["num_samples"] for r in ups], dtype=torch.float64)
    assert n.tolist() == [len(c.train_idx) for c in t.clients] and len(set(n.tolist())) > 1  # unequal: the weighting matters
    means = torch.stack([t.capture.load(r)["rep"].double() for r in ups])
    assert all(r["paper_scalars"] == 512 for r in ups) and means.abs().sum(1).min() > 0
    expected = (n[:, None] * means).sum(0) / n.sum()
    for r in (r for r in setup if r["kind"] == "mean_rep" and r["direction"] == "down"):
        assert torch.allclose(t.capture.load(r)["rep"].double(), expected, atol=1e-6)
    assert not torch.allclose(expected, means.mean(0), atol=1e-6)  # not the unweighted mean
    for c in t.clients:
        assert torch.allclose(c.model.global_mean.double(), expected, atol=1e-6)
    # PRBM: trained, different on every client, in no message
    prbms = torch.stack([c.model.prbm.detach() for c in t.clients])
    assert prbms.abs().sum(1).min() > 0 and torch.cdist(prbms, prbms).fill_diagonal_(1.0).min() > 0
    for r in recs:
        assert not set(r["tensors"]) & set(PRIVATE), r["seq"]
        for tensor in t.capture.load(r).values():
            if tensor.shape == (512,):
                assert not any(torch.equal(tensor, p) for p in prbms), r["seq"]
    # rounds: FedAvg's model messages only, counted without the setup exchange
    for rnd in (0, 1):
        train = [r for r in recs if r["round"] == rnd and r["meta"].get("phase") != "setup"]
        assert {(r["kind"], r["direction"]) for r in train} == {("model", "up"), ("model", "down")} and len(train) == 2 * k
    p = sum(v.numel() for v in shared_state(t.clients[0].model).values())
    assert all(h["upload_scalars"] == h["broadcast_scalars"] == k * p for h in t.history)
    # after the last round each client holds the broadcast under its own PRBM; its trained parts are what it uploaded
    last_down = t.capture.load(next(r for r in reversed(recs) if r["kind"] == "model" and r["direction"] == "down"))
    last_up = {r["sender"]: t.capture.load(r) for r in recs if r["round"] == 1 and r["direction"] == "up"}
    for c in t.clients:
        state = shared_state(c.model)
        assert all(torch.equal(state[k], v) for k, v in last_down.items())
        own = t.method.personal[c.name]
        assert all(torch.equal(own[k.split(".", 1)[0]][k.split(".", 1)[1]], v) for k, v in last_up[c.name].items())
    assert "acc_personal" in t.history[-1]


@needs_fmnist
def test_setup_pass_and_a_round_replayed_with_dbes_objective_written_here(tmp_path):
    """Setup: the uploaded mean is the EMA (mu = 0.3, from 0) of the batch means of g(x) over the pass,
    and the run keeps the extractor of the pass's last batch as round-0 knowledge. Round 1: client 3's
    model and PRBM after the round equal a replay from the same start with CE(h(g(x) + p), y) +
    kappa mean((m - G)^2) / 2, m the same EMA with the earlier batches detached."""
    kappa, mu = 5.0, 0.3
    t = trainer(tmp_path, num_clients=4, knowledge_rounds="0", options={"kappa": kappa, "mean_momentum": mu})
    client = t.clients[3]
    start = copy.deepcopy(client.model)  # before the setup broadcast; the replay loads what it received
    uploads: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    send = t.channel.send

    def spy(msg, *, truth=None):
        got = send(msg, truth=truth)
        if msg.direction == "up":
            uploads[(msg.round, msg.kind, msg.sender)] = {k: v.clone() for k, v in got.tensors.items()}
        if msg.direction == "down" and msg.kind == "model" and msg.receiver == client.name and msg.meta.get("phase") == "setup":
            start.load_state_dict({**start.state_dict(), **got.tensors})
        return got

    t.channel.send = spy
    t.method.run_setup()
    # --- the setup pass, replayed
    twin = Client(client.index, client.arch, copy.deepcopy(start), client.train_idx, client.test_idx)
    seen: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []

    def plain(model, x, y):
        rep = model.represent(x)
        seen.append((rep.detach().mean(0), model.extractor_state()))
        return F.cross_entropy(model.head(rep), y)

    t.method.trainer.fit(SETUP_ROUND, twin, plain, parameters=[p for n, p in twin.model.named_parameters() if n != "prbm"])
    ema = torch.zeros(512)
    for batch_mean, _ in seen:
        ema = (1 - mu) * ema + mu * batch_mean
    assert len(seen) > 2 and torch.allclose(uploads[(0, "mean_rep", client.name)]["rep"], ema, atol=1e-6)
    stored = t.method.env.knowledge.store  # round-0 knowledge: the extractor of the last batch
    rec = next(r for r in stored.records() if r["client"] == client.name)
    assert rec["round"] == 0 and all(torch.equal(stored.load(rec)[k], v) for k, v in seen[-1][1].items())
    assert all(torch.equal(v, start.state_dict()[k]) for k, v in shared_state(client.model).items())  # the pass was dropped
    # --- round 0 as the method runs it, then round 1 replayed
    t.method.run_round(0, t.clients)
    twin = Client(client.index, client.arch, copy.deepcopy(client.model), client.train_idx, client.test_idx)
    glob = client.model.global_mean.clone()
    assert torch.equal(glob, t.method.global_mean) and glob.abs().sum() > 0

    running = [torch.zeros(512)]

    def dbe(model, x, y):
        rep = model.represent(x)
        m = (1 - mu) * running[-1] + mu * rep.mean(0)
        running.append(m.detach())
        return F.cross_entropy(model.head(rep + model.prbm), y) + kappa * ((m - glob) ** 2).mean() / 2

    prbm_before = client.model.prbm.detach().clone()
    t.method.run_round(1, t.clients)
    t.method.trainer.fit(1, twin, dbe, parameters=[p for n, p in twin.model.named_parameters()])
    sent = uploads[(1, "model", client.name)]
    for k, v in twin.model.state_dict().items():
        if k in PRIVATE:
            continue
        assert torch.allclose(sent[k], v, atol=1e-5), k
    assert torch.allclose(client.model.prbm, twin.model.prbm, atol=1e-6)
    assert not torch.allclose(client.model.prbm, prbm_before, atol=1e-6)  # PRBM moved in the round
    assert torch.equal(client.model.global_mean, glob)  # G stays fixed


@needs_fmnist
def test_kappa_0_with_a_frozen_prbm_is_fedavg(tmp_path):
    """Same seed: same accuracies, losses and uploads as privfl's FedAvg, round by round."""
    a = trainer(tmp_path / "a", "fedavg", num_clients=5, subsample=400, partition="dir", alpha=0.5, min_samples=10)
    a.run()
    b = trainer(tmp_path / "b", num_clients=5, subsample=400, partition="dir", alpha=0.5, min_samples=10, options={"kappa": 0.0, "train_prbm": False})
    b.run()
    for x, y in zip(a.history, b.history, strict=True):
        assert (x["acc"], x["client_acc"], x["upload_scalars"]) == (y["acc"], y["client_acc"], y["upload_scalars"])
        assert x["train_loss"] == y["train_loss"] and y["mr"] > 0  # MR computed, weighted by 0
    ups_a = [r for r in a.capture.records() if r["direction"] == "up"]
    ups_b = [r for r in b.capture.records() if r["direction"] == "up" and r["kind"] == "model"]
    assert len(ups_a) == len(ups_b) == 10
    for ra, rb in zip(ups_a, ups_b):
        ta, tb = a.capture.load(ra), b.capture.load(rb)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert all(torch.count_nonzero(c.model.prbm) == 0 for c in b.clients)


@needs_fmnist
def test_killed_run_resumes_exactly(tmp_path):
    """G lives in each client's model buffer (checkpointed with it), so a run killed in round 1 and
    resumed, without a second setup, ends with the same metrics, capture and knowledge as an unbroken one.
    In-process: ``tests.killer`` and subprocesses (conftest's ``assert_resumes_exactly``) cost a minute here."""
    from privfl.capture import TensorStore
    from privfl.train import resume
    from privfl.train import train_config as train
    from privfl.verify import verify_run

    values = {
        "method": "fedavgdbe", "subsample": 300, "num_clients": 3, "partition": "iid", "rounds": 2, "batch_size": 32,
        "model_group": "homo-cnn4", "knowledge_rounds": "0", "progress": False, "device": "cpu", "out_dir": str(tmp_path),
        "options": {"kappa": 5.0, "mean_momentum": 0.5},
    }  # fmt: skip
    full = train(build_config({**values, "run_name": "full"}, FedAvgDBEOptions)).path
    cfg = build_config({**values, "run_name": "killed"}, FedAvgDBEOptions)
    with pytest.raises(Killed):
        train(cfg, callbacks=[KillAfter(1, 2)])  # after 2 of round 1's 3 uploads
    killed = tmp_path / "killed"
    assert len(read_metrics(killed)) == 1
    resume(killed, cfg)
    assert verify_run(killed).ok

    assert metrics_without_time(full) == metrics_without_time(killed)
    for store in ("capture", "knowledge", "truth"):
        assert TensorStore(full / store, store).records() == TensorStore(killed / store, store).records(), store
    recs = TensorStore(full / "capture", "capture").records()
    assert sum(r["kind"] == "mean_rep" for r in recs) == 6 and len(TensorStore(full / "knowledge", "knowledge").records()) == 3
