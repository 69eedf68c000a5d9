"""FedGen: the generator's pieces, a class-conditioned generator after server training, exact capture
counts on tiny real data (the head both ways, the generator apart; the whole model with identical client
models, as FedAvg), its leakage declarations, and an exact resume of its server state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from privfl.capture import Message
from privfl.kinds import KINDS
from privfl.methods.fedgen import FedGen, Generator, diversity_loss, ensemble_logits, head_state, teacher_weights, train_generator
from privfl.methods.fedkd import FedKD
from privfl.models import build_model
from privfl.run import Run
from privfl.seeding import torch_generator
from tests.helpers import FMNIST, metrics_without_time, read_metrics, train
from tests.killer import InterruptAfter as StopAfter
from tests.killer import Interrupted as Interrupt

TINY = ["--subsample", "600", "--partition", "iid", "--rounds", "2", "--batch-size", "32", "--no-progress"]


# ------------------------------------------------------------------------------------------ FedGen
def test_generator_pieces():
    torch.manual_seed(0)
    noise, out = torch.rand(5, 7), torch.randn(5, 3)
    manual = torch.exp(
        -torch.stack([((noise[i] - noise[j]).pow(2).mean() * (out[i] - out[j]).abs().mean()) for i in range(5) for j in range(5)]).mean()
    )
    assert torch.allclose(diversity_loss(noise, out), manual)
    counts = torch.tensor([[3, 0, 1], [1, 0, 1]])
    w = teacher_weights(counts, torch.tensor([4.0, 2.0]), "label")
    assert torch.allclose(w, torch.tensor([[0.75, 0.5, 0.5], [0.25, 0.5, 0.5]], dtype=torch.float64))  # nobody holds label 1: 1/K
    assert torch.allclose(teacher_weights(counts, torch.tensor([4.0, 2.0]), "samples")[:, 1], torch.tensor([2 / 3, 1 / 3], dtype=torch.float64))
    heads, biases, z = torch.randn(2, 3, 4), torch.randn(2, 3), torch.randn(5, 4)
    labels = torch.tensor([0, 1, 2, 0, 2])
    got = ensemble_logits(z, labels, w.float(), heads, biases)
    for i in range(5):
        want = torch.stack([w[k, labels[i]].float() * (heads[k] @ z[i] + biases[k]) for k in range(2)]).sum(0)
        assert torch.allclose(got[i], want, atol=1e-6)


def test_trained_generator_is_class_conditioned_synthetic():
    """Against fixed heads, the generator learns G(., c) that the average head classifies as c."""
    torch.manual_seed(0)
    k, c, d = 3, 6, 16
    heads, biases = torch.randn(k, c, d), torch.zeros(k, c)
    g = Generator(8, c, 32, d)
    counts = torch.ones(k, c, dtype=torch.int64)
    probs = counts.sum(0).double()
    w = teacher_weights(counts, torch.ones(k), "label")
    train_generator(g, heads, biases, w, probs, steps=150, batch=32, lr=0.01, diversity_weight=1.0, gen=torch_generator(0, "t"))
    labels = torch.arange(c).repeat(20)
    with torch.no_grad():
        z = g(labels, torch.rand(len(labels), 8))
        pred = (z @ heads.mean(0).T + biases.mean(0)).argmax(1)
    assert (pred == labels).float().mean() > 0.9


@pytest.fixture(scope="module")
def gen_run(tmp_path_factory):
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    return train(tmp_path_factory.mktemp("fedgen"), "fedgen", *TINY)


def test_fedgen_counts_head_both_ways_generator_apart(gen_run):
    run = Run.open(gen_run)
    rows = read_metrics(gen_run)
    d, c, k = 512, 10, 10
    gen_numel = sum(t.numel() for t in Generator(512, c, 512, d).state_dict().values())
    assert gen_numel == (512 + c + 1) * 512 + 4 * 512 + 1 + (512 + 1) * d == 532_481
    for rnd, row in enumerate(rows):
        comm = row["comm"]
        assert comm["up:head"]["paper_scalars"] == comm["down:head"]["paper_scalars"] == k * (d * c + c) == 51_300  # Table 11 hete, C10
        assert row["upload_scalars"] == 51_300
        assert comm.get("down:generator", {}).get("paper_scalars", 0) == (0 if rnd == 0 else k * gen_numel)  # not counted by the paper
        assert row["broadcast_scalars"] == 51_300 + (0 if rnd == 0 else k * gen_numel)
    # C = 100 (CIFAR-100): the head message the method sends carries d*C + C scalars
    assert Message(0, "client0", "server", "head", head_state(nn.Linear(d, 100)), {"num_samples": 1}).paper_scalars == 51_300
    records = run.capture.records()
    setup = [r for r in records if r["meta"].get("phase") == "setup"]
    assert sorted({(r["kind"], r["direction"]) for r in setup}) == [("head", "down"), ("label_counts", "down"), ("label_counts", "up")]
    counts_up = [run.capture.load(r)["counts"] for r in setup if r["kind"] == "label_counts" and r["direction"] == "up"]
    counts_down = [run.capture.load(r)["counts"] for r in setup if r["kind"] == "label_counts" and r["direction"] == "down"]
    total = torch.stack(counts_up).sum(0)
    assert len(counts_up) == 10 and all(torch.equal(cd, total) for cd in counts_down)
    assert int(total.sum()) == sum(json_train_sizes(gen_run))
    assert not [r for r in records if r["kind"] == "label_counts" and r["meta"].get("phase") != "setup"]  # counts go once


def json_train_sizes(run_dir: Path) -> list[int]:
    import json

    return json.loads((run_dir / "partition.json").read_text())["train_sizes"]


def test_fedgen_generator_after_server_training_is_class_conditioned(gen_run):
    """The generator sent in round 1 (trained on the round-0 heads) against the global head of round 0."""
    cap = Run.open(gen_run).capture
    records = cap.records()
    gen_msg = next(r for r in records if r["kind"] == "generator" and r["round"] == 1)
    head_msg = next(r for r in records if r["kind"] == "head" and r["direction"] == "down" and r["round"] == 0 and r["meta"].get("phase") != "setup")
    g = Generator(512, 10, 512, 512)
    g.load_state_dict(cap.load(gen_msg))
    head = cap.load(head_msg)
    labels = torch.arange(10).repeat(20)
    with torch.no_grad():
        z = g.train()(labels, torch.rand(len(labels), 512, generator=torch.Generator().manual_seed(0)))  # batch statistics, as used
        pred = (z @ head["head.weight"].T + head["head.bias"]).argmax(1)
    per_class = torch.stack([(pred[labels == y] == y).float().mean() for y in range(10)])
    assert (per_class > 0.5).sum() >= 8, per_class  # chance is 0.1


@pytest.fixture(scope="module")
def gen_homo_run(tmp_path_factory):
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    return train(tmp_path_factory.mktemp("fedgen-homo"), "fedgen", *TINY, "--model-group", "homo-cnn4", "--num-clients", "4")


def test_fedgen_with_identical_models_sends_the_whole_model_as_fedavg(gen_homo_run):
    """FedRE Table 11 counts FedGen as FedAvg when the models are identical (8785.38e3 both ways for
    HtFLlib's CIFAR-10 CNN and 10 clients): ``share=auto`` sends the whole model up and down, and the
    global model is the sample-weighted mean of the uploads; the generator still goes apart."""
    cnn = build_model("cnn4", in_channels=3, num_classes=10, image_size=32)
    per_model = sum(t.numel() for t in cnn.state_dict().values())
    assert per_model == 878_538 and 10 * per_model == 8_785_380
    fmnist_model = sum(t.numel() for t in build_model("cnn4", in_channels=1, num_classes=10, image_size=28).state_dict().values())
    gen_numel = 532_481
    rows = read_metrics(gen_homo_run)
    for rnd, row in enumerate(rows):
        comm = row["comm"]
        assert comm["up:model"]["paper_scalars"] == comm["down:model"]["paper_scalars"] == 4 * fmnist_model
        assert "up:head" not in comm and "down:head" not in comm
        assert comm.get("down:generator", {}).get("paper_scalars", 0) == (0 if rnd == 0 else 4 * gen_numel)
    cap = Run.open(gen_homo_run).capture
    records = cap.records()
    setup = sorted({(r["kind"], r["direction"]) for r in records if r["meta"].get("phase") == "setup"})
    assert setup == [("label_counts", "down"), ("label_counts", "up"), ("model", "down")]
    assert {r["kind"] for r in records} == {"model", "label_counts", "generator"}
    for rec in records:  # the kinds' contracts, as tests/methods/test_contracts.py checks the heterogeneous variant's
        assert KINDS.get(rec["kind"]).problems(cap.load(rec), rec["meta"], rec["direction"], rec["aux"]) == [], rec["seq"]
    for rnd in range(len(rows)):
        ups = [r for r in records if r["round"] == rnd and r["kind"] == "model" and r["direction"] == "up"]
        down = next(
            r for r in records if r["round"] == rnd and r["kind"] == "model" and r["direction"] == "down" and r["meta"].get("phase") != "setup"
        )
        weights = torch.tensor([float(r["meta"]["num_samples"]) for r in ups], dtype=torch.float64)
        states = [cap.load(r) for r in ups]
        got = cap.load(down)
        for key, value in got.items():
            mean = sum(w * st[key].double() for w, st in zip(weights.tolist(), states)) / weights.sum()
            torch.testing.assert_close(value.double(), mean, rtol=0, atol=1e-6)


@pytest.mark.skipif(not FMNIST.exists(), reason="apt-get install dataset-fashion-mnist")
def test_fedgen_share_model_refuses_a_heterogeneous_group(tmp_path):
    """The option alone is valid; the group is checked when the method meets its clients, and the refusal leaves nothing."""
    from privfl.config import build_config
    from privfl.errors import ConfigError
    from privfl.methods.fedgen import FedGenOptions
    from privfl.train import train_config as train_cfg

    cfg = build_config(
        {"method": "fedgen", "subsample": 200, "model_group": "cpu5", "out_dir": str(tmp_path / "runs"), "options": {"share": "model"}}, FedGenOptions
    )
    with pytest.raises(ConfigError, match="share=model needs identical client models"):
        train_cfg(cfg)
    assert list(tmp_path.iterdir()) == []


def test_fedgen_leakage_and_declarations():
    ctx = FedGen.leakage_context("head")
    assert ctx is not None and ctx.previous == "head" and ctx.module == ""
    assert FedGen.leakage_context("generator") is None and FedGen.leakage_context("label_counts") is None
    model_ctx = FedGen.leakage_context("model")
    assert model_ctx is not None and model_ctx.previous == "model" and model_ctx.module == ""
    assert FedKD.leakage_context("svd_model").module == "mentee"  # type: ignore[union-attr]


@pytest.mark.parametrize("group", ["cpu5", "homo-cnn4"])  # share=head, share=model (the global model is server state too)
def test_fedgen_interrupted_run_resumes_exactly(tmp_path, fmnist, group):
    """The generator, the global head and the label counts (received once, at setup) are server state: a run
    stopped inside round 1 (after the generator downloads and one head upload) and resumed from its round-0
    checkpoint sends and scores exactly what an uninterrupted run does. (tests/conftest.py's subprocess
    kill-and-resume check is the same with a hard kill; it costs a minute of CPU here.)"""
    from privfl.config import build_config
    from privfl.methods.fedgen import FedGenOptions
    from privfl.train import resume
    from privfl.train import train_config as train_cfg

    values = {
        "method": "fedgen",
        "model_group": group,
        "subsample": 300,
        "num_clients": 3,
        "partition": "iid",
        "rounds": 2,
        "rep_dim": 32,
        "batch_size": 32,
        "progress": False,
        "device": "cpu",
        "out_dir": str(tmp_path),
        "options": {"noise_dim": 16, "hidden_dim": 16, "server_epochs": 5},
    }
    full = train_cfg(build_config({**values, "run_name": "full"}, FedGenOptions)).path
    cfg = build_config({**values, "run_name": "stopped"}, FedGenOptions)
    with pytest.raises(Interrupt):
        train_cfg(cfg, callbacks=[StopAfter(1, 4)])
    stopped = tmp_path / "stopped"
    assert len(read_metrics(stopped)) == 1
    resume(stopped, cfg)
    assert metrics_without_time(full) == metrics_without_time(stopped)
    a, b = Run.open(full).capture.records(), Run.open(stopped).capture.records()
    assert [r["sha256"] for r in a] == [r["sha256"] for r in b] and len(a) == 3 + 3 + 3 + 2 * (3 + 3) + 3
