"""DRDFL: loss mechanics on known inputs, the ring with failures, exact message counts, a short real
run that learns, resume after a kill on the token schedule, and DLG on a captured Learngene."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from privfl.capture import TensorStore
from privfl.errors import ConfigError
from privfl.methods import METHODS, ModelRequest
from privfl.methods.drdfl import (
    DRDFL,
    DRDFLModel,
    ema_mix,
    gaussian_log_density,
    gm_logits,
    grad_reverse,
    kl_standard_normal,
    persona_loss,
    uniform_confusion,
)
from privfl.topology import Ring, parse_failures
from privfl.train import main as train_main
from tests.helpers import ROOT, needs_fmnist

TINY = [
    "--subsample",
    "480",
    "--partition",
    "iid",
    "--num-clients",
    "4",
    "--no-progress",
    "--batch-size",
    "32",
    "--width",
    "4",
    "--persona-width",
    "4",
    "--decoder-width",
    "4",
    "--latent-dim",
    "8",
    "--persona-dim",
    "6",
    "--model-group",
    "homo-cnn4",
    "--global-test-samples",
    "64",
]


def train(tmp_path: Path, *args: str, name: str = "run") -> Path:
    assert train_main(["drdfl", *args, "--out-dir", str(tmp_path), "--run-name", name]) == 0
    return tmp_path / name


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------ losses
def test_gaussian_mixture_loss_on_known_inputs():
    z = torch.zeros(1, 2)
    mu = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    log_var = torch.zeros(2, 2)
    log_prior = torch.full((2,), math.log(0.5))
    dens = gaussian_log_density(z, mu, log_var)
    assert torch.allclose(dens, torch.tensor([[-math.log(2 * math.pi), -0.5 - math.log(2 * math.pi)]]))
    l_cls, l_log = persona_loss(z, torch.tensor([0]), mu, log_var, log_prior)
    assert l_cls.item() == pytest.approx(math.log(1 + math.exp(-0.5)), abs=1e-6)  # Eq. 6
    assert l_log.item() == pytest.approx(math.log(2 * math.pi), abs=1e-6)  # Eq. 7
    # a variance enters both the Mahalanobis term and the normaliser
    lv = torch.tensor([[math.log(4.0), 0.0], [0.0, 0.0]])
    z2 = torch.tensor([[2.0, 0.0]])
    expected0 = -0.5 * (4.0 / 4.0 + math.log(4.0) + 2 * math.log(2 * math.pi))
    assert gaussian_log_density(z2, mu, lv)[0, 0].item() == pytest.approx(expected0, abs=1e-6)
    # logits equal the densities plus the log prior; the L-GM margin only scales the true class's distance
    assert torch.allclose(gm_logits(z2, mu, lv, log_prior), gaussian_log_density(z2, mu, lv) + log_prior)
    with_margin = gm_logits(z2, mu, log_var, log_prior, torch.tensor([1]), margin=1.0)
    plain = gm_logits(z2, mu, log_var, log_prior)
    assert with_margin[0, 0] == plain[0, 0] and with_margin[0, 1].item() == pytest.approx(plain[0, 1].item() - 0.5)


def test_kl_confusion_ema_and_reversal():
    assert kl_standard_normal(torch.zeros(3, 4), torch.zeros(3, 4)).item() == 0.0
    mu, lv = torch.tensor([[1.0, -2.0]]), torch.tensor([[math.log(2.0), 0.0]])
    expected = torch.distributions.kl_divergence(torch.distributions.Normal(mu, (0.5 * lv).exp()), torch.distributions.Normal(0.0, 1.0)).sum()
    assert kl_standard_normal(mu, lv).item() == pytest.approx(expected.item(), abs=1e-6)
    assert uniform_confusion(torch.zeros(5, 10)).item() == pytest.approx(math.log(10), abs=1e-6)
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    assert uniform_confusion(logits).item() == pytest.approx(-F.log_softmax(logits, 1).mean().item(), abs=1e-6)
    assert torch.allclose(ema_mix(torch.tensor([1.0]), torch.tensor([3.0]), 0.99), torch.tensor([1.02]))
    x = torch.ones(3, requires_grad=True)
    grad_reverse(x, 0.5).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full((3,), -0.5))


# ------------------------------------------------------------------------------------------ ring
def test_ring_skips_failed_nodes():
    ring = Ring(5, parse_failures("2@1, 3@2-3", 5))
    assert ring.edges(0) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 0)]
    assert ring.alive(1) == [0, 1, 3, 4] and ring.successor(1, 1) == 3 and ring.predecessor(3, 1) == 1
    assert ring.alive(2) == [0, 1, 4] and ring.successor(1, 2) == 4 and ring.edges(2) == [(0, 1), (1, 4), (4, 0)]
    assert ring.alive(4) == [0, 1, 3, 4]  # 3 came back, 2 did not
    random = Ring(6, failure_rate=0.5, seed=3)
    downs = [random.down(r) for r in range(30)]
    assert downs == [Ring(6, failure_rate=0.5, seed=3).down(r) for r in range(30)]  # seeded
    assert any(downs) and all(len(d) <= 4 for d in downs)
    for bad in ("2", "x@1", "9@1", "1@3-2"):
        with pytest.raises(ConfigError):
            parse_failures(bad, 5)
    with pytest.raises(ConfigError):
        Ring(2, parse_failures("0@0,1@0", 2)).alive(0)


# ------------------------------------------------------------------------------------------ runs
@needs_fmnist
def test_ring_reroutes_around_failures_with_exact_counts(tmp_path):
    run = train(tmp_path, *TINY, "--rounds", "3", "--failures", "1@1")
    info = json.loads((run / "run.json").read_text())
    assert info["topology"] == "ring" and info["sends"] == {"learngene": "peer", "gaussians": "peer"}
    recs = TensorStore(run / "capture", "capture").records()
    assert {r["kind"] for r in recs} == {"learngene", "gaussians"} and {r["direction"] for r in recs} == {"peer"}
    edges = {rnd: sorted({(r["sender"], r["receiver"]) for r in recs if r["round"] == rnd}) for rnd in range(3)}
    assert edges[0] == [("client0", "client1"), ("client1", "client2"), ("client2", "client3"), ("client3", "client0")]
    assert edges[1] == edges[2] == [("client0", "client2"), ("client2", "client3"), ("client3", "client0")]
    m = metrics(run)
    assert [h["selected"] for h in m] == [[0, 1, 2, 3], [0, 2, 3], [0, 2, 3]] and m[-1]["live_nodes"] == 3
    # exact counts: every tensor of the Learngene, and 2 * K * d_p Gaussian scalars
    from attacks.context import previous_state
    from privfl.run import Run

    view = Run.open(run).attacker
    model = view.method_cls.build_client_model(view.model_request("client0"))
    assert isinstance(model, DRDFLModel)
    n_learngene = sum(v.numel() for v in model.learngene.state_dict().values())
    for r in recs:
        assert r["paper_scalars"] == (n_learngene if r["kind"] == "learngene" else 2 * 10 * 6)
    assert m[-1]["comm"]["peer:learngene"]["paper_scalars"] == 3 * n_learngene == 3 * m[-1]["learngene_scalars"]
    assert m[-1]["comm"]["peer:gaussians"]["scalars"] == 3 * 120
    assert m[-1]["peer_scalars"] == 3 * (n_learngene + 120) and m[-1]["upload_scalars"] == m[-1]["broadcast_scalars"] == 0
    assert all(0 <= h["local_t"] <= 1 and 0 <= h["global_t"] <= 1 for h in m)
    # the attacker's previous state is what the sender received in the round its state was trained
    last = [r for r in recs if r["round"] == 2 and r["kind"] == "learngene" and r["sender"] == "client2"][0]
    prev, _ = previous_state(view, last)
    assert (prev["sender"], prev["round"]) == ("client0", 1) and last["meta"]["previous_round"] == 1
    # gradient leakage by the ring neighbour on a captured Learngene (tiny: 3 steps)
    from privfl.attack import main as attack

    assert attack(["dlg", "--run", str(run), "--artifact", "learngene", "--steps", "3", "--clients", "2", "--no-progress"]) == 0
    out = json.loads(next((run / "attacks").glob("dlg-learngene-r2/metrics.json")).read_text())
    assert out["summary"]["images"] >= 1 and math.isfinite(out["summary"]["psnr"])


@needs_fmnist
def test_short_run_learns(tmp_path):
    run = train(
        tmp_path,
        "--subsample",
        "3000",
        "--partition",
        "iid",
        "--num-clients",
        "3",
        "--rounds",
        "2",
        "--no-progress",
        "--model-group",
        "homo-cnn4",
        "--global-test-samples",
        "300",
    )
    m = metrics(run)
    assert m[-1]["local_t"] > 0.3 and m[-1]["global_t"] > 0.3 and m[-1]["acc"] > 0.3  # chance: 0.1 (3 x chance or more)
    assert m[-1]["loss_rec"] < m[0]["loss_rec"] * 1.5


def test_token_schedule_resumes_exactly_after_a_kill(assert_resumes_exactly):
    args = ["drdfl", *TINY, "--num-clients", "3", "--schedule", "token", "--rounds", "3"]
    a = assert_resumes_exactly(args, kill_round=1, kill_after=3)  # dies inside round 1
    # token passing: within a round node m receives from m-1 before it sends; node 0 from round r-1
    r1 = [(r["sender"], r["meta"]["previous_round"]) for r in a if r["round"] == 1 and r["kind"] == "learngene"]
    assert r1 == [("client0", 0), ("client1", 1), ("client2", 1)]


def test_ring_refuses_partial_participation(tmp_path, capsys):
    from privfl.cli import run_cli

    code = run_cli("privfl.train", lambda: train_main(["drdfl", *TINY, "--join-ratio", "0.5", "--out-dir", str(tmp_path)]))
    assert code == 2 and "join-ratio" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("path", sorted((ROOT / "experiments" / "papers" / "drdfl").glob("*.toml")), ids=lambda p: p.stem)
def test_paper_configs_are_valid(path):
    from privfl.config import build_config, read_config_file
    from privfl.models import assign_archs

    values = read_config_file(path)
    cfg = build_config(values, METHODS.get(values["method"]).Options)
    o = DRDFL.Options(**cfg.options)
    assert (cfg.method, cfg.num_clients, cfg.rounds, cfg.local_epochs, cfg.batch_size) == ("drdfl", 20, 300, 5, 64)
    assert o.local_optimizer == "adam" and o.adam_lr == 0.001 and o.ema == 0.99 and cfg.subsample is None
    assert (cfg.partition, cfg.alpha) in {("dir", 0.1), ("dir", 0.4)} or (cfg.partition == "pat" and cfg.balanced)
    assert o.classifier == "resnet18-cifar" and o.width == 32
    assert len(assign_archs(cfg.model_group, cfg.num_clients)) == 20
    req = ModelRequest("resnet18", 0, 3, 100 if "cifar100" in path.stem else 10, 32, cfg, o)
    model = DRDFL.build_client_model(req)
    shared = sum(p.numel() for p in model.learngene.parameters()) + 2 * req.num_classes * o.persona_dim
    assert shared <= 0.58e6  # the paper's 0.58M per exchange
