"""FedProx and FedBN: the scalar counts per message at the papers' shapes, and the known properties of
each (FedProx with mu = 0 is FedAvg, its upload is perturbed gradient descent towards the received
model, a large mu keeps it closer; FedBN on a model without BatchNorm is FedAvg, its BN layers never
leave a client and differ between clients while everything else is one average), on tiny real data."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from privfl.capture import Message, TensorStore
from privfl.channel import Channel, summarize_comm
from privfl.config import build_config
from privfl.fl.method import module_tensors
from privfl.methods import METHODS
from privfl.methods.fedbn import FedBN, bn_tensor_names, shared_state
from privfl.methods.fedprox import FedProx
from privfl.models import build_model
from privfl.seeding import torch_generator
from tests.test_train import needs_fmnist, train

NAMES = [f"client{k}" for k in range(10)]
TINY = ["--subsample", "300", "--no-progress", "--batch-size", "32", "--num-clients", "3", "--rounds", "2"]
UNEQUAL = ["--partition", "dir", "--alpha", "1.0", "--min-samples", "10"]  # unequal client sizes: weighting matters


def trainer(tmp_path: Path, method: str, **values):
    """An engine Trainer built in-process, so a test can look at client models between rounds."""
    from privfl.engine import Trainer

    base = {"method": method, "subsample": 600, "num_clients": 3, "rounds": 1, "progress": False, "batch_size": 32, "device": "cpu"}
    base.update(partition="dir", alpha=1.0, min_samples=10, model_group="homo-cnn4")
    cfg = build_config({**base, **values}, METHODS.get(method).Options)
    return Trainer(cfg, tmp_path / "run")


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


def messages(run: Path) -> list[tuple[tuple, dict[str, torch.Tensor]]]:
    """Every captured message as ((round, sender, receiver, kind, phase), tensors), in capture order."""
    capture = TensorStore(run / "capture", "capture")
    return [((r["round"], r["sender"], r["receiver"], r["kind"], r["meta"].get("phase")), capture.load(r)) for r in capture.records()]


def assert_same_run(a: Path, b: Path) -> None:
    """Same metrics (accuracies, losses, counts) and bit-identical tensors in every captured message."""
    from tests.conftest import read_metrics

    keys = ("acc", "acc_personal", "client_acc", "client_acc_personal", "train_loss", "upload_scalars", "broadcast_scalars")
    assert [{k: m[k] for k in keys} for m in read_metrics(a)] == [{k: m[k] for k in keys} for m in read_metrics(b)]
    ma, mb = messages(a), messages(b)
    assert [h for h, _ in ma] == [h for h, _ in mb] and len(ma) == 3 + 2 * 2 * 3  # setup + 2 rounds x (3 up + 3 down)
    for (head, ta), (_, tb) in zip(ma, mb):
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), head


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


# ------------------------------------------------------------------------------------------ FedProx, trained
@needs_fmnist
def test_fedprox_with_mu_zero_is_fedavg(tmp_path):
    args = [*TINY, *UNEQUAL, "--model-group", "homo-cnn4"]
    assert_same_run(train(tmp_path, "fedavg", *args, name="avg"), train(tmp_path, "fedprox", *args, "--mu", "0", name="prox"))


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


# ------------------------------------------------------------------------------------------ FedBN, trained
@needs_fmnist
def test_fedbn_on_a_model_without_batchnorm_is_fedavg(tmp_path):
    args = [*TINY, *UNEQUAL, "--model-group", "homo-cnn4"]
    assert_same_run(train(tmp_path, "fedavg", *args, name="avg"), train(tmp_path, "fedbn", *args, name="bn"))


@pytest.fixture(scope="module")
def fedbn_run(tmp_path_factory):
    """One FedBN run on the BatchNorm ResNet (4 clients of unequal size, 2 rounds), with its Trainer."""
    from tests.conftest import FMNIST

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
