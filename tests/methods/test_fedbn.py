"""FedBN: the scalar count per message at the paper's shapes (the model without its BatchNorm layers),
and the known properties on tiny real data: on a model without BatchNorm it is FedAvg; its BN layers never
leave a client and differ between clients while everything else is one sample-weighted average; every
attack plans on it or says why; a killed run resumes exactly with each client's BatchNorm."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from privfl.capture import Message
from privfl.channel import Channel
from privfl.methods.fedbn import FedBN, bn_tensor_names, shared_state
from privfl.models import build_model
from tests.helpers import assert_same_run, engine_trainer, needs_fmnist, train

#: the engine settings of this file's in-process runs
ENGINE = {
    "subsample": 600,
    "num_clients": 3,
    "rounds": 1,
    "progress": False,
    "batch_size": 32,
    "device": "cpu",
    "partition": "dir",
    "alpha": 1.0,
    "min_samples": 10,
    "model_group": "homo-cnn4",
}


def trainer(tmp_path: Path, method: str, **values: Any):
    """An engine Trainer built in-process, so a test can look at client models between rounds."""
    return engine_trainer(tmp_path / "run", {**ENGINE, "method": method, "out_dir": str(tmp_path), **values})


def _bn_scalars(channels: list[int]) -> int:
    """A BatchNorm over c channels keeps weight, bias, running mean and variance (c each) and one counter."""
    return sum(4 * c + 1 for c in channels)


@pytest.mark.parametrize(
    "arch, in_channels, size, bn_channels",
    [
        # resnet-tiny: stem BN 16; two BasicBlocks with bn1, bn2 and the shortcut's BN (32 and 64 channels)
        ("resnet-tiny", 1, 28, [16, 32, 32, 32, 64, 64, 64]),
        # torchvision ResNet-18: bn1 64; layer1 2x2x64; layer2-4: 2 blocks x 2 BN + the downsample BN
        ("resnet18", 3, 32, [64] + [64] * 4 + [128] * 5 + [256] * 5 + [512] * 5),
    ],
)
def test_fedbn_sends_the_model_without_its_batchnorm_layers(arch, in_channels, size, bn_channels):
    torch.manual_seed(0)
    model = build_model(arch, in_channels=in_channels, num_classes=10, image_size=size)
    full = sum(v.numel() for v in model.state_dict().values())
    local = bn_tensor_names(model)
    assert len(local) == 5 * len(bn_channels)  # weight, bias, running_mean, running_var, num_batches_tracked
    # found by module type: the BN layers named by position, which a "bn" name pattern misses, are local too
    assert {k for k in local if "bn" not in k} and all(not k.startswith("head.") for k in local)
    channel = Channel(method="fedbn", sends=FedBN.sends)
    up = channel.send(Message(0, "client0", "server", "model", shared_state(model, local), {"num_samples": 7}))
    assert up.paper_scalars == full - _bn_scalars(bn_channels)
    if arch == "resnet18":
        assert sum(bn_channels) == 4_800 and _bn_scalars(bn_channels) == 19_220
        params = sum(p.numel() for p in model.parameters())
        assert params == 11_181_642 and full == params + 2 * 4_800 + 20  # + running statistics and counters
        assert up.paper_scalars == 11_172_042 == params - 2 * 4_800  # the parameters without BN's affine ones
    else:
        assert _bn_scalars(bn_channels) == 1_223 and up.paper_scalars == full - 1_223


# ------------------------------------------------------------------------------------------ FedBN, trained
@needs_fmnist
def test_fedbn_on_a_model_without_batchnorm_is_fedavg(tmp_path, unequal_fedavg):
    args, fedavg = unequal_fedavg
    assert_same_run(fedavg, train(tmp_path, "fedbn", *args, name="bn"), messages=3 + 2 * 2 * 3)  # setup + 2 rounds x (3 up + 3 down)


@pytest.fixture(scope="module")
def fedbn_run(tmp_path_factory):
    """One FedBN run on the BatchNorm ResNet (4 clients of unequal size, 2 rounds), with its Trainer."""
    from tests.helpers import FMNIST

    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    from privfl.config import save_config
    from privfl.engine import write_run_info

    t = trainer(tmp_path_factory.mktemp("fedbn"), "fedbn", num_clients=4, rounds=2, model_group="homo-resnet-tiny")
    save_config(t.cfg, t.run_dir)  # what privfl.engine.train writes first, so that Run.open reads the run
    write_run_info(t)
    t.run()
    return t


def test_fedbn_keeps_batchnorm_local_and_averages_everything_else(fedbn_run):
    t = fedbn_run
    local = bn_tensor_names(t.clients[0].model)
    full = t.clients[0].model.state_dict()
    shared = set(full) - local
    assert len(local) == 35 and "features.1.running_mean" in local and "features.3.downsample.1.weight" in local
    recs = t.capture.records()
    assert {r["kind"] for r in recs} == {"model"} and len(recs) == 4 + 2 * 2 * 4
    for rec in recs:  # no BN tensor crosses the wire, either way
        assert set(rec["tensors"]) == shared, rec["seq"]
        assert rec["paper_scalars"] == sum(v.numel() for v in full.values()) - 1_223
    for rnd in (0, 1):
        ups = [r for r in recs if r["round"] == rnd and r["direction"] == "up"]
        downs = [r for r in recs if r["round"] == rnd and r["meta"].get("phase") == "train"]
        assert len(ups) == len(downs) == 4
        n = torch.tensor([r["meta"]["num_samples"] for r in ups], dtype=torch.float64)
        assert len(set(n.tolist())) > 1  # unequal sizes: the sample weighting shows
        sent = [t.capture.load(r) for r in ups]
        glob = t.capture.load(downs[0])
        for k in shared:
            expected = sum(w * s[k].double() for w, s in zip((n / n.sum()).tolist(), sent))
            assert torch.allclose(glob[k].double(), expected, atol=1e-6), k
            assert all(torch.equal(t.capture.load(d)[k], glob[k]) for d in downs)
    # after the last round: one set of shared tensors for everyone, the last broadcast
    for client in t.clients:
        state = client.model.state_dict()
        assert all(torch.equal(state[k], glob[k]) for k in shared)
        # ... and each client's own BN layers, exactly as its local training left them (never overwritten)
        own = t.method.personal[client.name][""]
        assert all(torch.equal(state[k], own[k]) for k in local)
    # BN layers moved with each client's own data: every BN tensor differs between every two clients
    floats = [k for k in local if full[k].is_floating_point()]
    for a, b in itertools.combinations(t.clients, 2):
        sa, sb = a.model.state_dict(), b.model.state_dict()
        assert all(not torch.equal(sa[k], sb[k]) for k in floats), (a.name, b.name)


def test_every_attack_on_fedbn_plans_or_says_why_and_warns_that_bn_is_unknown(fedbn_run):
    from attacks import ATTACKS, Selection, run_attack
    from privfl.run import Run

    run = Run.open(fedbn_run.run_dir)
    view = run.attacker
    ctx = view.leakage_context("model")
    assert ctx is not None and "BatchNorm" in ctx.note
    for name in ATTACKS.names():
        plan = ATTACKS.get(name)().plan(view, Selection(kind="model", max_targets=1))
        if not plan:
            assert plan.reason and "\n" not in plan.reason, name
        elif name in ("dlg", "idlg", "ig"):  # the BN tensors stay at the attacker's initialisation: said so
            assert all("never transmitted" in t.payload["warning"] for t in plan.targets), name
    report = run_attack(run, "mia-loss", clients=[0], max_targets=1, device="cpu")
    (row,) = report.rows
    assert row["coverage"] < 1 and "never transmitted" in row["warning"] and "BatchNorm" in row["approximation"]
    report = run_attack(run, "dlg", clients=[0], max_targets=1, options={"steps": 1, "max_batch": 1}, device="cpu")
    assert len(report.rows) == 1


def test_fedbn_resumes_exactly_with_each_clients_batchnorm(assert_resumes_exactly):
    args = ["fedbn", "--subsample", "300", "--num-clients", "3", "--partition", "iid", "--rounds", "2"]
    records = assert_resumes_exactly([*args, "--model-group", "homo-resnet-tiny", "--batch-size", "32"], kill_round=1, kill_after=2)
    assert len(records) == 3 + 2 * 2 * 3
