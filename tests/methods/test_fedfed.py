"""FedFed: the distiller's scalar count against DRDFL's Table I, the per-round counts of both phases, and
the known properties of the shared dataset (noise of the configured std around the clean x_s, the pool is
the union of the uploads, every client trains on its copy), plus an exact resume after the sharing step."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch

from privfl.capture import Message
from privfl.channel import Channel, summarize_comm
from privfl.config import build_config
from privfl.engine import TrainCallback
from privfl.methods import METHODS
from privfl.methods.drdfl import cifar_resnet18
from privfl.methods.fedfed import SHARED_FEATURES, FeatureDistiller, FedFed, FedFedOptions, Generator, balanced_draw, grouped_noise
from privfl.models import build_model
from privfl.run import Run
from tests.killer import InterruptAfter as StopAfter
from tests.killer import Interrupted as Stop

TINY = {"width": 8, "latent_dim": 16, "distill_rounds": 2}


def config(tmp_path: Path, name: str = "run", **values):
    base = {
        "method": "fedfed",
        "subsample": 160,
        "num_clients": 3,
        "partition": "iid",
        "rounds": 3,
        "batch_size": 32,
        "progress": False,
        "device": "cpu",
        "model_group": "homo-cnn4",
        "out_dir": str(tmp_path),
        "run_name": name,
        "options": dict(TINY),
    }
    return build_config({**base, **values}, FedFedOptions)


def trainer(tmp_path: Path, callbacks=(), **values):
    from privfl.engine import Trainer

    cfg = config(tmp_path, **values)
    return Trainer(cfg, tmp_path / cfg.run_name, callbacks=callbacks)


class Snapshot(TrainCallback):
    """Keeps the client models and the global classifier as they were at the end of round ``rnd``."""

    def __init__(self, rnd: int):
        self.rnd, self.trainer = rnd, None
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    def on_round_end(self, rnd, entry) -> None:
        if rnd == self.rnd and self.trainer is not None:
            t = self.trainer
            self.state = {c.name: copy.deepcopy(c.model.state_dict()) for c in t.clients}
            self.state["global"] = copy.deepcopy(t.method.global_classifier.state_dict())


def state_scalars(module: torch.nn.Module) -> int:
    return sum(v.numel() for v in module.state_dict().values())


def generator_scalars(c: int, size: int, w: int, z: int) -> int:
    """|G| by the module docstring's formula (written out independently of the module)."""
    h, flat = w // 2, w * (size // 4) ** 2
    convs = 32 * c * h + 32 * h * w
    residual = 4 * (10 * w * w + 2 * w)
    norms = 8 * (4 * w + 1) + 2 * (4 * h + 1) + (4 * c + 1)
    return convs + residual + norms + 3 * flat * z + 2 * z + flat


# ------------------------------------------------------------------------------------------ counts
def test_distiller_count_is_drdfl_table_one_454_58m():
    """DRDFL Table I: FedFed 454.58M = 20 clients x the official distiller (VAE + CIFAR ResNet-18) / 2^20;
    the same unit gives FedNova's 213.46M (torchvision ResNet-18) and FedRep's 213.36M (without its head)."""
    g = Generator(3, 32, width=32, latent_dim=2048)
    assert state_scalars(g) == generator_scalars(3, 32, 32, 2048) == 12_649_367  # the official FL_CVAE_cifar minus its classifier
    d = FeatureDistiller(g, cifar_resnet18(3, 10))
    assert set(d.state_dict()) == {f"generator.{k}" for k in g.state_dict()} | {f"classifier.{k}" for k in d.classifier.state_dict()}
    assert state_scalars(d) == 12_649_367 + 11_183_582
    assert round(20 * state_scalars(d) / 2**20, 2) == 454.58
    resnet = build_model("resnet18", in_channels=3, num_classes=10, image_size=32)
    assert round(20 * state_scalars(resnet) / 2**20, 2) == 213.46
    assert round(20 * (state_scalars(resnet) - state_scalars(resnet.head)) / 2**20, 2) == 213.36
    # the quick default's shapes (Fashion-MNIST, w = 32, d_z = 128) by the same formula
    assert state_scalars(Generator(1, 28, 32, 128)) == generator_scalars(1, 28, 32, 128) == 663_215


def test_shared_features_count_level_rows_times_image_size():
    channel = Channel(method="fedfed", sends=FedFed.sends)
    for n, levels in ((7, 2), (5, 1)):
        tensors = {
            "features": torch.rand(levels * n, 3, 32, 32),
            "labels": torch.arange(n).repeat(levels) % 10,
            "level": torch.arange(levels).repeat_interleave(n),
        }
        up = channel.send(Message(0, "client0", "server", SHARED_FEATURES, tensors, {"num_samples": n, "noise_std": [0.2, 0.25][:levels]}))
        assert up.aux == ("labels", "level")
        assert (up.paper_scalars, up.scalars) == (levels * n * 3 * 32 * 32, levels * n * (3 * 32 * 32 + 2))
    down = channel.broadcast(1, ["client0", "client1"], SHARED_FEATURES, tensors, meta={"noise_std": [0.2]})
    assert all(m.paper_scalars == 5 * 3 * 32 * 32 for m in down.values())


def test_balanced_draw_and_grouped_noise():
    rng = np.random.default_rng(0)
    labels = np.array([0] * 50 + [1] * 3 + [2] * 40)  # class 1 short, class 3 absent
    idx = balanced_draw(labels, 43, 4, rng)  # 10 per class, 3 over
    counts = np.bincount(labels[idx], minlength=4)
    assert len(idx) == 43 and counts[3] == 0 and min(counts[:3]) >= 10  # class 3's share and the rest: uniform
    assert len(set(idx[labels[idx] == 1].tolist())) <= 3  # class 1's 10+ rows come from its 3: with replacement
    noise = grouped_noise(130, (1, 2, 2), 0.5, 64, generator=torch.Generator().manual_seed(0))
    assert noise.shape == (130, 1, 2, 2)
    assert torch.equal(noise[0], noise[63]) and not torch.equal(noise[63], noise[64]) and torch.equal(noise[128], noise[129])
    single = grouped_noise(20000, (3,), 0.5, 1, generator=torch.Generator().manual_seed(1))
    assert abs(single.std().item() - 0.5) < 0.01 and len(single.unique(dim=0)) == 20000


# ------------------------------------------------------------------------------------------ a trained run
@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    from tests.helpers import FMNIST

    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    snapshot = Snapshot(1)
    t = trainer(tmp_path_factory.mktemp("fedfed"), callbacks=[snapshot])
    snapshot.trainer = t
    t.run()
    t.after_sharing = snapshot.state
    return t


def test_per_round_counts_follow_the_formula(ran):
    t = ran
    d, f = state_scalars(t.clients[0].model.distiller), state_scalars(t.clients[0].model.classifier)
    assert f == 582_026  # cnn4 on Fashion-MNIST
    n = [len(c.train_idx) for c in t.clients]
    image, levels = 28 * 28, 2
    recs = t.capture.records()
    setup = [r for r in recs if r["meta"].get("phase") == "setup"]
    assert sorted((r["kind"], r["receiver"]) for r in setup) == sorted((k, c.name) for k in ("shared_model", "model") for c in t.clients)
    assert summarize_comm(setup)["down"]["paper_scalars"] == 3 * (d + f)
    h = t.history
    assert [r["round"] for r in h] == [0, 1, 2]
    assert h[0]["upload_scalars"] == h[0]["broadcast_scalars"] == 3 * d  # distillation round
    assert h[1]["upload_scalars"] == 3 * d + levels * sum(n) * image  # ... and the sharing step
    assert h[1]["broadcast_scalars"] == 3 * d + 3 * levels * sum(n) * image
    assert h[1]["upload_scalars_full"] - h[1]["upload_scalars"] == 2 * levels * sum(n)  # labels and levels: aux
    assert h[2]["upload_scalars"] == h[2]["broadcast_scalars"] == 3 * f  # FedAvg round
    kinds = {r["round"]: sorted({x["kind"] for x in recs if x["round"] == r["round"] and x["meta"].get("phase") != "setup"}) for r in h}
    assert kinds == {0: ["shared_model"], 1: [SHARED_FEATURES, "shared_model"], 2: ["model"]}


def test_server_averages_distillers_and_classifiers_by_sample_count(ran):
    t = ran
    recs = t.capture.records()
    for rnd, kind in ((0, "shared_model"), (1, "shared_model"), (2, "model")):
        ups = [r for r in recs if r["round"] == rnd and r["kind"] == kind and r["direction"] == "up"]
        down = next(r for r in recs if r["round"] == rnd and r["kind"] == kind and r["meta"].get("phase") == "train")
        w = torch.tensor([r["meta"]["num_samples"] for r in ups], dtype=torch.float64)
        assert w.tolist() == [len(c.train_idx) for c in t.clients]
        sent, glob = [t.capture.load(r) for r in ups], t.capture.load(down)
        for k, v in glob.items():
            mean = sum(wi * s[k].double() for wi, s in zip((w / w.sum()).tolist(), sent))
            assert torch.allclose(v.double(), mean if v.is_floating_point() else mean.round(), atol=1e-6), (rnd, k)


def test_shared_dataset_is_the_union_of_the_uploads_with_their_truth(ran):
    t = ran
    truth = {r["message_seq"]: t.truth.load(r) for r in t.truth.records()}
    recs = [r for r in t.capture.records() if r["kind"] == SHARED_FEATURES]
    ups = [r for r in recs if r["direction"] == "up"]
    downs = [r for r in recs if r["direction"] == "down"]
    assert [r["sender"] for r in ups] == [c.name for c in t.clients] and len(downs) == 3
    assert len({r["sha256"] for r in downs}) == 1  # one dataset for everyone
    sent = [t.capture.load(r) for r in ups]
    pool = t.capture.load(downs[0])
    for k in ("features", "labels", "level"):
        assert torch.equal(pool[k], torch.cat([s[k] for s in sent])), k
    rows = [len(s["labels"]) for s in sent]
    assert rows == [2 * len(c.train_idx) for c in t.clients] and len(pool["labels"]) == sum(rows)  # counts add up
    ids = []
    for rec, s, client in zip(ups, sent, t.clients):
        idx = truth[rec["seq"]]["indices"]
        assert torch.equal(idx, client.train_idx.cpu().repeat(2))  # row i is sample idx[i]
        assert torch.equal(s["labels"], t.data.labels[idx]) and torch.equal(s["level"], torch.arange(2).repeat_interleave(len(client.train_idx)))
        assert rec["meta"] == {"num_samples": len(client.train_idx), "noise_std": [0.2, 0.25]}
        ids.append(idx)
    assert torch.equal(truth[downs[0]["seq"]]["indices"], torch.cat(ids))
    for client in t.clients:  # each client kept the copy it received (identical here: kept once)
        assert t.method.client_pools[client.name] is t.method.pool


def test_shared_rows_are_clean_x_s_plus_noise_of_the_configured_std(ran):
    """Rebuild client 1's clean x_s with the distiller the capture says it held (the round-1 broadcast):
    what it uploaded minus x_s is zero-mean noise with std sigma_l per level, independent across levels."""
    t = ran
    recs = t.capture.records()
    state = t.capture.load(next(r for r in recs if r["kind"] == "shared_model" and r["round"] == 1 and r["receiver"] == "client1"))
    up = t.capture.load(next(r for r in recs if r["kind"] == SHARED_FEATURES and r["sender"] == "client1"))
    client = t.clients[1]
    known = copy.deepcopy(client.model.distiller)
    known.load_state_dict(state)
    known.eval()
    with torch.no_grad():
        x_s = known.split(t.data.batch(client.train_idx)[0])[0]
    n = len(client.train_idx)
    noise = [up["features"][lv * n : (lv + 1) * n] - x_s for lv in range(2)]
    for sigma, e in zip((0.2, 0.25), noise):
        assert abs(e.std().item() - sigma) < 0.02 * sigma and abs(e.mean().item()) < 0.005, sigma
    corr = torch.corrcoef(torch.stack([noise[0].flatten(), noise[1].flatten()]))[0, 1]
    assert abs(corr.item()) < 0.02  # fresh draws per level
    # a per-batch draw (the official code: noise_group = 64): the rows of a group carry the same noise
    t.method.opts.noise_group = 16
    try:
        grouped = t.method.noisy_features(1, client)["features"][:n] - x_s
    finally:
        t.method.opts.noise_group = 1
    assert torch.allclose(grouped[0], grouped[15], atol=1e-5) and not torch.allclose(grouped[15], grouped[16], atol=1e-3)


def test_run_stopped_after_sharing_resumes_exactly(ran, tmp_path):
    """The shared dataset lives in the server state: a run stopped inside its first federated round resumes
    from the checkpoint after the sharing step and sends and scores what the uninterrupted run (the fixture,
    same seed) did."""
    from privfl.train import resume
    from privfl.train import train_config as train_cfg

    cfg = config(tmp_path, "stopped")
    with pytest.raises(Stop):
        train_cfg(cfg, callbacks=[StopAfter(2, 2)])
    stopped = tmp_path / "stopped"
    assert len(Run.open(stopped).metrics) == 2
    resumed = resume(stopped, cfg)

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in json.loads(json.dumps(rows))]

    assert strip(ran.history) == strip(resumed.metrics)
    assert [r["sha256"] for r in ran.capture.records()] == [r["sha256"] for r in resumed.capture.records()]


def test_checkpoint_keeps_each_clients_own_copy_only_where_it_differs(ran, tmp_path):
    """A defense on the way down would give each client its own copy of the shared dataset: the server
    state holds the pool once, that client's state holds its copy (and no other client's does), and
    loading both restores every client's copy."""
    from privfl.engine import Trainer

    pool = ran.method.pool
    assert pool is not None
    ran.method.client_pools["client2"] = {**pool, "features": pool["features"] + 1}
    try:
        state = ran.method.server_state()
        own = {c.name: ran.method.client_state(c) for c in ran.clients}
    finally:
        ran.method.client_pools["client2"] = pool
    assert {k for k in state if k.startswith("pool")} == {"pool.features", "pool.labels", "pool.level"}
    assert {name for name, st in own.items() if any(k.startswith("fedfed.pool.") for k in st)} == {"client2"}
    fresh = cast(FedFed, Trainer(config(tmp_path, "fresh"), tmp_path / "fresh").method)
    assert fresh.pool is None
    fresh.load_server_state(state)
    for c in fresh.env.clients:
        fresh.load_client_state(c, own[c.name])
    assert fresh.pool is not None and torch.equal(fresh.pool["features"], pool["features"])
    assert fresh.client_pools["client0"] is fresh.pool and torch.equal(fresh.client_pools["client2"]["features"], pool["features"] + 1)
    assert fresh.federated == {c.name for c in ran.clients}  # the phase comes back with each client's state


def test_every_client_trains_on_its_copy_of_the_shared_dataset(ran):
    """Federated round 2 again from the state after the sharing step, with client 1's copy of the shared
    dataset zeroed: client 1's upload changes and nobody else's. Each client trained on 2 n_k shared rows
    besides its n_k own."""
    t = ran
    assert t.history[2]["shared_rows_trained"] == sum(2 * len(c.train_idx) for c in t.clients)
    before = {r["sender"]: t.capture.load(r) for r in t.capture.records() if r["kind"] == "model" and r["direction"] == "up"}
    for c in t.clients:
        c.model.load_state_dict(t.after_sharing[c.name])
    t.method.global_classifier.load_state_dict(t.after_sharing["global"])
    pool = t.method.client_pools["client1"]
    t.method.client_pools["client1"] = {**pool, "features": torch.zeros_like(pool["features"])}
    stores = t.channel.capture, t.channel.truth
    t.channel.capture = t.channel.truth = None  # the fixture's capture stays as the run wrote it
    send, uploads = t.method.send, {}

    def spy(msg, truth=None):
        if msg.direction == "up":
            uploads[msg.sender] = {k: v.clone() for k, v in msg.tensors.items()}
        return send(msg, truth)

    t.method.send = spy
    try:
        t.method.run_round(2, t.clients)
    finally:
        t.method.send = send
        t.channel.capture, t.channel.truth = stores
        t.method.client_pools["client1"] = pool
    for c in t.clients:
        same = all(torch.equal(before[c.name][k], uploads[c.name][k]) for k in before[c.name])
        assert same == (c.name != "client1"), c.name


def test_fedfed_is_registered_with_its_kinds():
    cls = METHODS.get("fedfed")
    assert cls is FedFed and cls.requires_homogeneous
    assert cls.leakage_context(SHARED_FEATURES) is None  # data, not parameters
    contexts = {kind: cls.leakage_context(kind) for kind in ("shared_model", "model")}
    assert {kind: ctx.module if ctx else None for kind, ctx in contexts.items()} == {"shared_model": "distiller", "model": "classifier"}
