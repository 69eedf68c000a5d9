"""Per-FedAvg: every message is the full model, and the known properties of its local step.

A local step is the hand-computed two-batch MAML step (PFLlib's order); HF differs from FO by exactly
-alpha times the Hessian-vector product on the third batch; the personalised model is the global one after
one seeded gradient step on the client's own train data, and computing it changes nothing else in the run."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from privfl.methods import perfedavg as perfedavg_module
from privfl.methods.perfedavg import meta_objective, split_batch
from privfl.seeding import torch_generator
from tests.helpers import by_round, engine_trainer, needs_fmnist

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
@pytest.mark.parametrize("method", ["perfedavg"])
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


# ------------------------------------------------------------------------------------------ Per-FedAvg
def test_split_batch_gives_b_per_role_and_reuses_a_tiny_batch():
    x, y = torch.arange(20).float().unsqueeze(1), torch.arange(20)
    parts = split_batch(x, y, 2)
    assert [len(p[1]) for p in parts] == [10, 10] and torch.equal(parts[1][1], torch.arange(10, 20))
    assert [len(p[1]) for p in split_batch(x[:7], y[:7], 3)] == [3, 2, 2]
    assert all(torch.equal(p[1], y[:2]) for p in split_batch(x[:2], y[:2], 3))


@needs_fmnist
def test_perfedavg_fo_local_training_is_the_hand_computed_two_batch_step(tmp_path, monkeypatch):
    """Replaying client 1's round-0 training by hand on the batches the shared trainer drew (PFLlib's
    order: a temporary SGD step on the first half, the gradient there on the second half, applied to w)
    gives the same model; the upload says lr = beta and tau = the meta steps."""
    t = trainer(tmp_path, "perfedavg", rounds=1, local_epochs=2, lr=0.05, options={"beta": 0.03})
    t.method.setup()
    client = t.clients[1]
    twin = copy.deepcopy(client.model)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = perfedavg_module.meta_objective

    def recording(*args, **kw):
        objective = real(*args, **kw)

        def wrapped(model, x, y):
            seen.append((x.clone(), y.clone()))
            return objective(model, x, y)

        return wrapped

    monkeypatch.setattr(perfedavg_module, "meta_objective", recording)
    stats = t.method.local_update(0, client)
    b, alpha, beta = 16, 0.05, 0.03
    n = len(client.train_idx)
    assert stats.steps == len(seen) == 2 * -(-n // (2 * b)) and sum(len(y) for _, y in seen) == 2 * n
    assert len(seen[0][1]) == 2 * b
    twin.train()
    params = list(twin.parameters())
    for x, y in seen:
        half = -(-len(y) // 2)
        start = [p.detach().clone() for p in params]
        grads = torch.autograd.grad(F.cross_entropy(twin(x[:half]), y[:half]), params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(alpha * g)
        grads = torch.autograd.grad(F.cross_entropy(twin(x[half:]), y[half:]), params)
        with torch.no_grad():
            for p, s, g in zip(params, start, grads):
                p.copy_(s - beta * g)
    for k, v in twin.state_dict().items():
        assert torch.allclose(v, client.model.state_dict()[k], atol=1e-6), k


def _flat_hessian(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(v: torch.Tensor) -> torch.Tensor:
        parts, start = {}, 0
        for name, shape in zip(names, shapes):
            size = int(torch.Size(shape).numel())
            parts[name] = v[start : start + size].view(shape)
            start += size
        return F.cross_entropy(functional_call(model, parts, (x,)), y)

    return torch.autograd.functional.hessian(loss, flat)


def test_perfedavg_hf_differs_from_fo_by_exactly_the_hessian_vector_term():
    """On a tiny float64 model: the HF objective's gradient minus the FO objective's is
    -alpha H f(w; D'') grad f(w'; D') (the Hessian computed whole by autograd); the central difference
    with a small delta approximates it; both objectives have the value f(w'; D')."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(15, 4, dtype=torch.float64), torch.randint(0, 3, (15,))
    alpha = 0.3
    params = list(model.parameters())

    def grad_of(objective) -> tuple[torch.Tensor, float]:
        loss, _ = objective(model, x, y)
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]), float(loss.detach())

    (x0, y0), (x1, y1), (x2, y2) = split_batch(x, y, 3)
    g_fo, value_fo = grad_of(lambda m, a, b: meta_objective(alpha, "fo")(m, torch.cat([x0, x1]), torch.cat([y0, y1])))
    g_hf, value_hf = grad_of(meta_objective(alpha, "hf", hf_delta=0.0))
    g_fd, _ = grad_of(meta_objective(alpha, "hf", hf_delta=1e-4))
    # the FO gradient is grad f(w'; D') with w' = w - alpha grad f(w; D), written out here
    probe = copy.deepcopy(model)
    g0 = torch.autograd.grad(F.cross_entropy(probe(x0), y0), list(probe.parameters()))
    with torch.no_grad():
        for p, g in zip(probe.parameters(), g0):
            p.sub_(alpha * g)
    v = torch.cat([g.reshape(-1) for g in torch.autograd.grad(F.cross_entropy(probe(x1), y1), list(probe.parameters()))])
    assert torch.allclose(g_fo, v, atol=1e-12)
    hv = _flat_hessian(model, x2, y2) @ v
    assert hv.abs().max() > 1e-3  # the term is not negligible here
    assert torch.allclose(g_hf - g_fo, -alpha * hv, atol=1e-10)
    assert torch.allclose(g_fd - g_fo, -alpha * hv, atol=1e-6)
    assert value_hf == pytest.approx(value_fo, abs=1e-12)


@needs_fmnist
def test_perfedavg_personal_model_is_one_step_on_own_train_data_and_leaks_nothing(tmp_path):
    """After each round every client holds the global model; its personal part is that model after one
    alpha-step on a seeded batch of its train split. Computing it changes no message and no global score
    (a run with adapt_steps = 0 captures the same tensors), only the personal scores."""
    t = trainer(tmp_path, "perfedavg", name="one")
    t.run()
    recs = t.capture.records()
    glob = t.capture.load(by_round(recs, 1, "down")[0])
    for client in t.clients:
        assert all(torch.equal(v, glob[k]) for k, v in client.model.state_dict().items())
        model = copy.deepcopy(client.model)
        model.train()
        gen = torch_generator(t.cfg.seed, "perfedavg-adapt", 1, client.index, 0)
        x, y = next(iter(t.data.batches(client.train_idx, 16, gen)))
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
        expected = {n: p.detach() - t.cfg.lr * g for (n, p), g in zip(model.named_parameters(), grads)}
        personal = t.method.personal[client.name][""]
        assert all(torch.allclose(personal[k], v, atol=1e-6) for k, v in expected.items())
        assert not torch.equal(personal["head.bias"], glob["head.bias"])
    u = trainer(tmp_path, "perfedavg", name="zero", options={"adapt_steps": 0})
    u.run()
    assert [r["sha256"] for r in recs] == [r["sha256"] for r in u.capture.records()]
    assert [h["acc"] for h in t.history] == [h["acc"] for h in u.history]
    assert [h["acc_personal"] for h in u.history] == [h["acc"] for h in u.history]  # 0 steps: the global model
    assert [h["acc_personal"] for h in t.history] != [h["acc"] for h in t.history]
    meta = by_round(recs, 0, "up")[0]["meta"]
    assert (meta["lr"], meta["inner_lr"], meta["variant"]) == (0.01, t.cfg.lr, "fo")
