"""FedProx: the scalar count per message at the paper's shape (the full model each way), and the known
properties on tiny real data: with mu = 0 it is FedAvg, its upload is perturbed gradient descent towards the
received model, a large mu keeps it closer, and stragglers run fewer epochs and are still averaged
deterministically."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from privfl.capture import Message
from privfl.channel import Channel, summarize_comm
from privfl.fl.method import module_tensors
from privfl.methods.fedprox import FedProx
from privfl.models import build_model
from privfl.seeding import torch_generator
from tests.helpers import assert_same_run, engine_trainer, needs_fmnist, train

NAMES = [f"client{k}" for k in range(10)]


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


def spy_uploads(t) -> dict[tuple[int, str], Message]:
    """(round, sender) -> the upload as sent, recorded while the run goes on (cloned: a message's tensors
    may share storage with the client model, which the next broadcast overwrites)."""
    sent: dict[tuple[int, str], Message] = {}
    send = t.channel.send

    def spy(msg, *, truth=None):
        if msg.direction == "up":
            tensors = {k: v.clone() for k, v in msg.tensors.items()}
            sent[(msg.round, msg.sender)] = Message(msg.round, msg.sender, msg.receiver, msg.kind, tensors, dict(msg.meta))
        return send(msg, truth=truth)

    t.channel.send = spy
    return sent


def param_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: list[str]) -> float:
    return float(sum((a[k].double() - b[k].double()).pow(2).sum() for k in names) ** 0.5)


# ------------------------------------------------------------------------------------------ counts
def test_fedprox_sends_the_full_model_each_way_878538_for_htfllib_cnn_as_fedre_table_11():
    """HtFLlib's FedAvgCNN on CIFAR-10: conv(3->32, 5x5), conv(32->64, 5x5), Linear(1600, 512), Linear(512, 10)."""
    expected = (3 * 32 * 25 + 32) + (32 * 64 * 25 + 64) + (64 * 5 * 5 * 512 + 512) + (512 * 10 + 10)
    assert expected == 878_538
    torch.manual_seed(0)
    model = build_model("cnn4", in_channels=3, num_classes=10, image_size=32)
    channel = Channel(method="fedprox", sends=FedProx.sends)
    for name in NAMES:
        up = channel.send(Message(0, name, "server", "model", module_tensors(model), {"num_samples": 7, "arch": "cnn4"}))
        assert up.paper_scalars == up.scalars == expected
    down = channel.broadcast(0, NAMES, "model", module_tensors(model))
    assert all(m.paper_scalars == expected for m in down.values())
    comm = summarize_comm(channel.end_round())
    assert comm["up"]["paper_scalars"] == comm["down"]["paper_scalars"] == 8_785_380  # Table 11: 8785.38e3, 10 clients


# ------------------------------------------------------------------------------------------ FedProx, trained
@needs_fmnist
def test_fedprox_with_mu_zero_is_fedavg(tmp_path, unequal_fedavg):
    args, fedavg = unequal_fedavg
    assert_same_run(fedavg, train(tmp_path, "fedprox", *args, "--mu", "0", name="prox"), messages=3 + 2 * 2 * 3)  # setup + 2 rounds x (3 up + 3 down)


@needs_fmnist
def test_fedprox_upload_is_perturbed_gradient_descent_towards_the_received_model(tmp_path):
    """Client 1's upload equals PFLlib's/the authors' PerturbedGradientDescent replayed here on the same
    seeded batches: p <- p - lr (grad CE + mu (p - p_received)); plain SGD from there is far off."""
    mu, lr = 0.5, 0.05
    t = trainer(tmp_path, "fedprox", lr=lr, local_epochs=2, capture=False, options={"mu": mu})
    sent = spy_uploads(t)
    t.method.setup()
    client = t.clients[1]
    received = copy.deepcopy(client.model)
    t.method.run_round(0, t.clients)
    upload = sent[(0, client.name)]
    assert upload.meta["mu"] == mu and upload.meta["tau"] == 2 * -(-len(client.train_idx) // 32)

    def replay(mu_: float) -> dict[str, torch.Tensor]:
        model = copy.deepcopy(received).train()
        anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
        for epoch in range(2):
            gen = torch_generator(t.cfg.seed, "shuffle", 0, client.index, epoch)
            for x, y in t.data.batches(client.train_idx, 32, gen):
                model.zero_grad()
                F.cross_entropy(model(x), y).backward()
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p -= lr * (p.grad + mu_ * (p - anchor[n]))
        return module_tensors(model)

    prox, plain = replay(mu), replay(0.0)
    names = [n for n, _ in received.named_parameters()]
    for k in names:
        assert torch.allclose(upload.tensors[k], prox[k], atol=1e-6), k
    assert param_distance(upload.tensors, plain, names) > 100 * param_distance(upload.tensors, prox, names)


@needs_fmnist
def test_fedprox_large_mu_keeps_each_upload_closer_to_the_received_model(tmp_path):
    distances = {}
    for mu in (0.0, 5.0):
        t = trainer(tmp_path / str(mu), "fedprox", local_epochs=3, capture=False, options={"mu": mu})
        sent = spy_uploads(t)
        t.method.setup()
        start = {c.name: {k: v.clone() for k, v in module_tensors(c.model).items()} for c in t.clients}  # what each received
        t.method.run_round(0, t.clients)
        names = [n for n, _ in t.clients[0].model.named_parameters()]
        distances[mu] = [param_distance(sent[(0, c.name)].tensors, start[c.name], names) for c in t.clients]
    assert all(0 < near < 0.5 * far for near, far in zip(distances[5.0], distances[0.0])), distances


@needs_fmnist
def test_fedprox_stragglers_run_fewer_epochs_and_are_still_averaged_deterministically(tmp_path):
    def run(name: str) -> tuple[list[dict], dict[tuple[int, str], Message]]:
        t = trainer(tmp_path / name, "fedprox", num_clients=4, rounds=2, local_epochs=3, subsample=300, capture=False, options={"stragglers": 0.5})
        sent = spy_uploads(t)
        t.run()
        per_epoch = {c.name: -(-len(c.train_idx) // 32) for c in t.clients}
        for rnd in (0, 1):
            short = [n for n, steps in per_epoch.items() if sent[(rnd, n)].meta["tau"] < 3 * steps]
            assert len(short) == 2  # round(4 * (1 - 0.5)) = 2 clients run all 3 epochs, the 2 others fewer
            assert all(sent[(rnd, n)].meta["tau"] in (per_epoch[n], 2 * per_epoch[n]) for n in short)  # epochs in [1, E)
        # every upload of the last round, stragglers' included, enters the sample-weighted mean
        ups = [sent[(1, n)] for n in per_epoch]
        w = torch.tensor([float(m.meta["num_samples"]) for m in ups], dtype=torch.float64)
        glob = t.method.global_model.state_dict()
        for k in ("head.weight", "features.0.weight"):
            mean = sum(wi * m.tensors[k].double() for wi, m in zip((w / w.sum()).tolist(), ups))
            assert torch.allclose(glob[k].double(), mean, atol=1e-6), k
        return t.history, sent

    first, sent_a = run("a")
    second, sent_b = run("b")
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert strip(first) == strip(second)
    assert all(torch.equal(sent_a[key].tensors[k], sent_b[key].tensors[k]) for key in sent_a for k in sent_a[key].tensors)
