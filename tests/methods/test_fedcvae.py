"""Fedcvae (DRDFL's decentralised CVAE baseline): the KL and mixing rule on known inputs, the per-message
count against |g_phi|'s formula at the paper's shapes, the negative ELBO falling on a fixed batch, and on
tiny real runs: only g_phi leaves a node, along live graph edges only, the mixed g_phi is exactly the
mean of own and received copies, a down node sends, receives and trains nothing, g_phi is frozen (and
silent) after pretraining, and the same seed gives the same metrics and capture."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from privfl.capture import Message, TensorStore
from privfl.channel import Channel
from privfl.config import build_config
from privfl.methods import ModelRequest
from privfl.methods.fedcvae import (
    PRIOR_PREFIX,
    Fedcvae,
    FedcvaeModel,
    cvae_losses,
    kl_gaussians,
    mix_states,
    pretrain_rounds,
    prior_tensors,
)
from privfl.train import main as train_main
from tests.helpers import needs_fmnist

#: tiny widths; 4 clients on DRDFL's ring
TINY = {
    "method": "fedcvae",
    "subsample": 320,
    "partition": "iid",
    "num_clients": 4,
    "batch_size": 32,
    "prior_width": 4,
    "encoder_width": 4,
    "decoder_width": 4,
    "latent_dim": 8,
    "model_group": "homo-cnn4",
    "progress": False,
    "device": "cpu",
}


def prior_count(c: int, side: int, w: int, d: int) -> int:
    """|g_phi| from the module docstring's formula (DRDFL's Learngene shape)."""
    s = side
    for _ in range(3):
        s = (s - 1) // 2 + 1
    convs = (9 * c * w + w) + (18 * w * w + 2 * w) + (72 * w * w + 4 * w) + (144 * w * w + 4 * w)
    return convs + 22 * w + 4 * w * s * s * 2 * d + 2 * d


def request(c: int, side: int, k: int, **opts) -> ModelRequest:
    cfg = build_config({**TINY, **opts}, Fedcvae.Options)
    return ModelRequest("cnn4", 0, c, k, side, cfg, Fedcvae.Options(**cfg.options))


# ------------------------------------------------------------------------------------------ known inputs
def test_kl_between_diagonal_gaussians_and_the_mixing_rule():
    mu_q, lv_q = torch.tensor([[1.0, -2.0, 0.5]]), torch.tensor([[math.log(2.0), 0.0, -1.0]])
    mu_p, lv_p = torch.tensor([[0.0, 1.0, 0.5]]), torch.tensor([[0.0, math.log(3.0), 0.5]])
    q = torch.distributions.Normal(mu_q, (0.5 * lv_q).exp())
    p = torch.distributions.Normal(mu_p, (0.5 * lv_p).exp())
    assert kl_gaussians(mu_q, lv_q, mu_p, lv_p).item() == pytest.approx(torch.distributions.kl_divergence(q, p).sum().item(), abs=1e-6)
    assert kl_gaussians(mu_q, lv_q, mu_q, lv_q).item() == pytest.approx(0.0, abs=1e-7)
    own = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(7)}
    r1, r2 = {"w": torch.tensor([3.0, 4.0]), "n": torch.tensor(1)}, {"w": torch.tensor([5.0, -6.0]), "n": torch.tensor(2)}
    assert torch.equal(mix_states(own, [r1])["w"], torch.tensor([2.0, 3.0]))  # DRDFL's (phi~ + phi) / 2
    assert torch.equal(mix_states(own, [r1, r2])["w"], torch.tensor([3.0, 0.0])) and mix_states(own, [r1, r2])["n"] == 7
    assert torch.equal(mix_states(own, [])["w"], own["w"])
    assert [pretrain_rounds(r, f) for r, f in ((5, 0.5), (2, 0.5), (300, 0.5), (5, 1.0), (4, 0.01))] == [3, 1, 150, 5, 1]


# ------------------------------------------------------------------------------------------ counts
def test_message_count_is_the_prior_size_at_the_papers_shapes():
    """One message = every tensor of g_phi. Paper scale (CIFAR 3x32x32, w=88, d=128): 3,259,424 per
    message, x20 clients = 65.2M against Table I's 63.44M (within 3%); quick default (FMNIST, 8, 64): 80,976."""
    for (c, side, k, w, d), expected in (((3, 32, 10, 88, 128), 3_259_424), ((1, 28, 10, 8, 64), 80_976), ((3, 32, 100, 32, 64), 503_808)):
        model = Fedcvae.build_client_model(request(c, side, k, prior_width=w, latent_dim=d))
        assert prior_count(c, side, w, d) == expected
        channel = Channel(method="fedcvae", sends=Fedcvae.sends)
        msg = channel.send(Message(0, "client0", "client1", "shared_model", prior_tensors(model), {"num_samples": 5}))
        assert msg.paper_scalars == msg.scalars == expected
        assert set(msg.tensors) == {PRIOR_PREFIX + n for n in model.prior.state_dict()}
    assert abs(20 * 3_259_424 / 63.44e6 - 1) < 0.03


# ------------------------------------------------------------------------------------------ the CVAE bound
def test_negative_elbo_falls_on_a_fixed_batch():
    torch.manual_seed(0)
    req = request(1, 28, 10, prior_width=4, encoder_width=4, decoder_width=4, latent_dim=8)
    model: FedcvaeModel = Fedcvae.build_client_model(req)
    x = (torch.rand(16, 1, 28, 28) * 2 - 1).clamp(-1, 1)
    y = torch.arange(16) % 10
    params = [p for n, p in model.named_parameters() if not n.startswith("classifier.")]
    opt = torch.optim.Adam(params, lr=3e-3)

    def elbo() -> torch.Tensor:
        torch.manual_seed(1)  # the same reparameterisation noise for every evaluation
        return cvae_losses(model, x, y, req.opts)["loss_elbo"]

    start = elbo().item()
    for _ in range(25):
        loss = elbo()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert elbo().item() < 0.8 * start
    # the prior network is trained by the KL term while pretraining, and not at all once frozen
    model.zero_grad()
    cvae_losses(model, x, y, req.opts, train_prior=True)["train_loss"].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.prior.named_parameters() if n.endswith("weight"))
    model.zero_grad()
    cvae_losses(model, x, y, req.opts, train_prior=False)["train_loss"].backward()
    assert all(p.grad is None for p in model.prior.parameters())


# ------------------------------------------------------------------------------------------ runs
def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@needs_fmnist
@pytest.mark.parametrize("topology", ["ring", "full"])
def test_only_the_prior_travels_along_live_edges_and_is_mixed_exactly(tmp_path: Path, topology: str):
    """Rounds 0-1 pretraining (client1 down in round 1), round 2 frozen: run round by round in-process."""
    from privfl.engine import Trainer

    cfg = build_config({**TINY, "rounds": 3, "pretrain_fraction": 0.6, "failures": "1@1-1", "topology": topology}, Fedcvae.Options)
    tr = Trainer(cfg, tmp_path / "run")
    method: Fedcvae = tr.method  # type: ignore[assignment]
    assert method.pretrain_rounds == 2
    sent: list[Message] = []
    send = method.send

    def recording_send(msg: Message, truth: dict[str, torch.Tensor] | None = None) -> Message:
        sent.append(send(msg, truth))  # the receiver's copy, as the method uses it
        return sent[-1]

    method.send = recording_send  # type: ignore[method-assign]
    names = {PRIOR_PREFIX + n for n in tr.clients[0].model.prior.state_dict()}
    size = sum(v.numel() for v in tr.clients[0].model.prior.state_dict().values())
    for rnd in range(3):
        before = {c.index: state(c.model) for c in tr.clients}
        del sent[:]
        selected = tr.select(rnd)
        out = method.run_round(rnd, selected)
        records = tr.channel.end_round()
        edges = method.topology.edges(rnd)
        if rnd == 1:
            assert [c.index for c in selected] == [0, 2, 3] and all(1 not in e for e in edges)
            assert all(torch.equal(v, before[1][k]) for k, v in tr.clients[1].model.state_dict().items())  # untouched
        if rnd == 2:  # frozen: silent, g_phi unchanged, the rest trains on
            assert sent == [] and records == [] and out["pretraining"] == 0.0 and out["prior_scalars"] == 0.0
            for c in tr.clients:
                assert all(torch.equal(v, before[c.index][f"prior.{k}"]) for k, v in c.model.prior.state_dict().items())
                assert not torch.equal(c.model.encoder.fc.weight, before[c.index]["encoder.fc.weight"])
            continue
        # only g_phi, whole, one message per live edge, exactly the round's edges
        assert sorted((int(m.sender[6:]), int(m.receiver[6:])) for m in sent) == sorted(edges) and len(sent) == len(edges)
        assert all(m.kind == "shared_model" and m.direction == "peer" and set(m.tensors) == names for m in sent)
        assert [r["paper_scalars"] for r in records] == [size] * len(edges) and out["prior_scalars"] == size
        # mixed = (own trained copy + received copies in sender order) / (1 + n), bit for bit
        for c in selected:
            own = [m for m in sent if m.sender == c.name]
            got = [m for m in sent if m.receiver == c.name]
            assert own, c.name
            assert len(got) == len(method.topology.in_neighbors(c.index, rnd)) == (1 if topology == "ring" else len(selected) - 1)
            for k, v in c.model.prior.state_dict().items():
                total = own[0].tensors[PRIOR_PREFIX + k].clone()
                for m in got:
                    total = total + m.tensors[PRIOR_PREFIX + k]
                assert torch.equal(v, total / (1 + len(got))), (rnd, c.name, k)
            assert own[0].meta["previous_round"] == rnd - 1  # -1 in round 0; every node live in round 1 mixed in round 0


@needs_fmnist
def test_run_verifies_with_exact_counts_and_is_deterministic(tmp_path: Path):
    args = [
        "fedcvae",
        *[f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k not in ("method", "progress", "device")],
        "--rounds=3",
        "--pretrain-fraction=0.6",
        "--failures=2@1-1",
        "--no-progress",
        "--out-dir",
        str(tmp_path),
    ]
    assert train_main([*args, "--run-name", "a"]) == 0
    assert train_main([*args, "--run-name", "b"]) == 0
    from privfl.run import Run
    from privfl.verify import verify_run

    report = verify_run(tmp_path / "a")
    assert report.ok, report.lines()  # every peer message on a live link of its round, counts match
    ma, mb = ([json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in "ab")
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert strip(ma) == strip(mb)
    ra, rb = (TensorStore(tmp_path / n / "capture", "capture").records() for n in "ab")
    assert ra == rb
    view = Run.open(tmp_path / "a").attacker
    model = view.method_cls.build_client_model(view.model_request("client0"))
    assert isinstance(model, FedcvaeModel)
    size = sum(v.numel() for v in model.prior.state_dict().values())
    assert size == prior_count(1, 28, 4, 8)
    assert [m["peer_scalars"] for m in ma] == [4 * size, 3 * size, 0]  # ring of 4, then 3 (node 2 down), then frozen
    assert {r["kind"] for r in ra} == {"shared_model"} and all(r["sender"] != "client2" and r["receiver"] != "client2" for r in ra if r["round"] == 1)
    assert all(0 <= m["acc"] <= 1 for m in ma) and ma[0]["loss_elbo"] > ma[-1]["loss_elbo"]
