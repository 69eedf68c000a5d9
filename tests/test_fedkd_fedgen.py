"""FedKD and FedGen: SVD codec counts and known properties (Eckart-Young), HtFLlib's mutual-distillation
gradient, the energy schedule, exact capture counts and server behaviour on tiny real data, a
class-conditioned generator, and an exact resume of FedGen's server state."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privfl.capture import Message
from privfl.codecs import svd_aux, svd_decode, svd_encode, svd_rank
from privfl.kinds import KINDS
from privfl.methods.fedgen import FedGen, Generator, diversity_loss, ensemble_logits, head_state, teacher_weights, train_generator
from privfl.methods.fedkd import FedKD, FedKDModel, energy_at, load_mentee
from privfl.models import build_model
from privfl.run import Run
from privfl.seeding import torch_generator
from tests.killer import InterruptAfter as StopAfter
from tests.killer import Interrupted as Interrupt
from tests.test_train import FMNIST, metrics, train

TINY = ["--subsample", "600", "--partition", "iid", "--rounds", "2", "--batch-size", "32", "--no-progress"]


def spectrum_matrix(m: int, n: int, decay: float, seed: int) -> torch.Tensor:
    """An m x n matrix with singular values decay**i (known spectrum)."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    k = min(m, n)
    s = decay ** torch.arange(k, dtype=torch.float64)
    return (u[:, :k] * s) @ v[:k, :]


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "conv.weight": torch.randn(8, 3, 5, 5, generator=g),
        "conv.bias": torch.randn(8, generator=g),
        "pointwise.weight": torch.randn(6, 4, 1, 1, generator=g),  # 1x1 conv: HtFLlib keeps 0 values
        "fc.weight": spectrum_matrix(20, 30, 0.8, 2).float(),
        "fc.bias": torch.randn(20, generator=g),
        "row.weight": torch.randn(1, 30, generator=g),  # one row: sent whole (HtFLlib's shape[0] > 1)
        "dead.weight": torch.zeros(4, 4),  # no energy: sent whole (HtFLlib)
    }


def independent_rank(sq: torch.Tensor, energy: float) -> int:
    """Smallest r with sum_{i<r} sq_i > energy * sum sq (sq: pooled squared singular values), else all."""
    total = float(sq.sum())
    for r in range(1, len(sq) + 1):
        if float(sq[:r].sum()) > energy * total:
            return r
    return len(sq)


# ------------------------------------------------------------------------------------------ SVD codec
@pytest.mark.parametrize("conv", ["htfllib", "reshape"])
@pytest.mark.parametrize("energy", [0.0, 0.5, 0.95, 0.98, 1.0])
def test_svd_message_scalars_are_the_sum_of_r_times_m_plus_n_plus_1(conv, energy):
    st = state()
    enc = svd_encode(st, energy, conv=conv)
    expected = 0
    for name, t in st.items():
        if t.dim() < 2 or t.shape[0] == 1 or not t.abs().sum():
            expected += t.numel()
            assert torch.equal(enc[name], t)
            continue
        if t.dim() > 2 and conv == "reshape":
            mat = t.double().reshape(t.shape[0], -1)
            batch, (m, n) = 1, mat.shape
            sq = torch.linalg.svdvals(mat) ** 2
            assert enc[f"{name}@shape"].tolist() == list(t.shape)
        else:  # HtFLlib: a conv weight is out*in kh x kw matrices with one rank on their pooled energy
            batch, (m, n) = t[..., 0, 0].numel(), t.shape[-2:]
            sq = (torch.linalg.svdvals(t.double()) ** 2).reshape(-1, min(m, n)).sum(0)
        r = independent_rank(sq, energy)
        assert enc[f"{name}@s"].shape[-1] == r, name
        expected += batch * r * (m + n + 1)
    if conv == "htfllib":  # a 1x1 kernel has one singular value: HtFLlib's search keeps none (zeros), here it is kept
        assert enc["pointwise.weight@s"].shape == (6, 4, 1)
    msg = Message(0, "client0", "server", "svd_model", enc, {"num_samples": 1, "energy": energy}, svd_aux(enc))
    assert msg.paper_scalars == expected
    assert msg.scalars - msg.paper_scalars == (8 if conv == "reshape" else 0)  # two 4-d shapes, bookkeeping


@pytest.mark.parametrize("energy", [0.5, 0.8, 0.95, 0.98])
def test_kept_energy_and_eckart_young_error(energy):
    st = {"a": spectrum_matrix(40, 25, 0.9, 3), "b": torch.randn(16, 16, dtype=torch.float64), "c": torch.randn(4, 3, 5, 5, dtype=torch.float64)}
    for conv in ("htfllib", "reshape"):
        enc = svd_encode(st, energy, conv=conv)
        dec = svd_decode(enc)
        for name, t in st.items():
            full = t.reshape(t.shape[0], -1) if (conv == "reshape" and t.dim() > 2) else t
            s_all = torch.linalg.svdvals(full)
            kept = enc[f"{name}@s"]
            assert float(kept.pow(2).sum()) >= energy * float(s_all.pow(2).sum())  # pooled over a conv's matrices
            rel = float((dec[name] - t).pow(2).sum() / t.pow(2).sum())
            assert rel <= 1 - energy + 1e-9, (name, conv, rel)
            assert dec[name].shape == t.shape


def test_energy_one_round_trips_and_decode_checks():
    st = state()
    for conv in ("htfllib", "reshape"):
        dec = svd_decode(svd_encode(st, 1.0, conv=conv))
        assert set(dec) == set(st)
        for k, v in st.items():
            assert dec[k].shape == v.shape and torch.allclose(dec[k], v, atol=1e-5), k
    assert svd_rank(torch.tensor([3.0, 2.0, 1.0]), 1.0) == 3  # HtFLlib keeps 0 here
    assert svd_rank(torch.tensor([3.0, 2.0, 1.0]), 0.0) == 1
    enc = svd_encode({"w": torch.randn(6, 2, 3, 3)}, 0.9, conv="reshape")
    with pytest.raises(ValueError, match="does not fit"):
        svd_decode({**enc, "w@shape": torch.tensor([5, 2, 3, 3])})
    with pytest.raises(ValueError, match="lack"):
        svd_decode({k: v for k, v in enc.items() if not k.endswith("@v")})
    with pytest.raises(ValueError, match="energy"):
        svd_encode({"w": torch.randn(3, 3)}, 1.5)
    assert KINDS.get("svd_model").dense(enc)["w"].shape == (6, 2, 3, 3)  # the kind's decoder is svd_decode


def test_energy_schedule_is_htfllibs():
    # HtFLlib: round 0 at T_start, round i at T_start + i/R (T_end - T_start) (set at the end of round i-1)
    assert energy_at(0, 10, 0.95, 0.98) == 0.95
    assert energy_at(1, 10, 0.95, 0.98) == pytest.approx(0.953)
    assert energy_at(9, 10, 0.95, 0.98) == pytest.approx(0.977)  # privfl's last round; HtFLlib's extra round R reaches T_end


# ------------------------------------------------------------------------------------------ FedKD objective
def test_fedkd_gradient_is_htfllibs_two_backward_passes():
    """One objective L_t + L_s gives the gradients HtFLlib accumulates with loss.backward(); loss_g.backward()."""
    from types import SimpleNamespace

    from privfl.methods.fedkd import FedKDOptions

    torch.manual_seed(0)
    model = FedKDModel(
        build_model("mlp", in_channels=1, num_classes=4, image_size=16, rep_dim=8),
        build_model("cnn4-narrow", in_channels=1, num_classes=4, image_size=16, rep_dim=8),
    )
    x, y = torch.randn(6, 1, 16, 16), torch.arange(6) % 4
    method = SimpleNamespace(opts=FedKDOptions())

    captured = {}

    def fake_fit(rnd, client, objective, optimizer, before_step):
        loss, parts = objective(client.model, x, y)
        loss.backward()
        captured.update({n: p.grad.clone() for n, p in client.model.named_parameters()})
        return SimpleNamespace(as_dict=lambda key: {key: loss.item(), **{k: v.item() for k, v in parts.items()}}, steps=1)

    method.fit = fake_fit
    FedKD.train_client(method, 0, SimpleNamespace(model=model))  # type: ignore[arg-type]
    model.zero_grad()
    # HtFLlib clientKD.train, verbatim in structure
    kl, mse = nn.KLDivLoss(), nn.MSELoss()
    rep, rep_g = model.local.represent(x), model.mentee.represent(x)
    output, output_g = model.local.head(rep), model.mentee.head(rep_g)
    ce, ce_g = F.cross_entropy(output, y), F.cross_entropy(output_g, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # KLDivLoss's 'mean' reduction warning
        l_d = kl(F.log_softmax(output, dim=1), F.softmax(output_g, dim=1)) / (ce + ce_g)
        l_d_g = kl(F.log_softmax(output_g, dim=1), F.softmax(output, dim=1)) / (ce + ce_g)
    l_h = mse(rep, model.w_h(rep_g)) / (ce + ce_g)
    (ce + l_d + l_h).backward(retain_graph=True)
    (ce_g + l_d_g + l_h).backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.allclose(captured[n], p.grad, atol=1e-6, rtol=1e-4), n


# ------------------------------------------------------------------------------------------ FedKD, real data
@pytest.fixture(scope="module")
def kd_run(tmp_path_factory):
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    return train(tmp_path_factory.mktemp("fedkd"), "fedkd", *TINY)


def factor_count(tensors: dict[str, torch.Tensor]) -> int:
    """sum of B*r*(m+n+1) over factored tensors (from the factor shapes) plus whole tensors' numel."""
    total = 0
    for k, t in tensors.items():
        base, _, part = k.rpartition("@")
        if part == "s":
            u, v = tensors[f"{base}@u"], tensors[f"{base}@v"]
            r, m, n = t.shape[-1], u.shape[-2], v.shape[-1]
            total += t[..., 0].numel() * r * (m + n + 1)
        elif not base:
            total += t.numel()
    return total


def test_fedkd_counts_schedule_and_server_average(kd_run):
    run = Run.open(kd_run)
    cap = run.capture
    records = cap.records()
    rows = metrics(kd_run)
    assert len(rows) == 2 and all(0 <= r["acc"] <= 1 for r in rows)
    assert {r["kind"] for r in records} == {"svd_model"}
    setup = [r for r in records if r["meta"].get("phase") == "setup"]
    assert len(setup) == 10 and all(r["meta"]["energy"] == 1.0 for r in setup)
    for rnd, row in enumerate(rows):
        energy = energy_at(rnd, 2, 0.95, 0.98)
        ups = [r for r in records if r["round"] == rnd and r["direction"] == "up"]
        downs = [r for r in records if r["round"] == rnd and r["direction"] == "down" and r["meta"].get("phase") != "setup"]
        assert len(ups) == len(downs) == 10
        for r in ups + downs:
            assert r["meta"]["energy"] == pytest.approx(energy)
            assert r["paper_scalars"] == factor_count(cap.load(r))  # what crossed the wire: the factors
        assert row["upload_scalars"] == sum(r["paper_scalars"] for r in ups)
        assert row["broadcast_scalars"] == sum(r["paper_scalars"] for r in downs)
        assert row["energy"] == pytest.approx(energy)
        # the server: uniform mean of the decoded uploads, re-compressed at the same threshold
        dense = [run.attacker.load(r) for r in ups]
        mean = {k: torch.stack([d[k].double() for d in dense]).mean(0) for k in dense[0]}
        expected = svd_decode(svd_encode({k: v.float() for k, v in mean.items()}, energy))
        got = run.attacker.load(downs[0])
        for k in expected:
            assert torch.allclose(got[k], expected[k], atol=1e-5), k
    # each client holds the last decoded download as its mentee (checkpoint); its mentor and W_h never left it
    from privfl.run import load_checkpoint_state, read_checkpoint

    info = read_checkpoint(kd_run)
    assert info is not None
    ckpt = load_checkpoint_state(kd_run, info)
    for client in ("client0", "client7"):
        last = next(r for r in reversed(records) if r["receiver"] == client)
        for k, v in run.attacker.load(last).items():  # decoded here on the CPU; on a GPU the client decoded it there
            if torch.cuda.is_available():
                torch.testing.assert_close(ckpt[f"{client}.mentee.{k}"], v, rtol=1e-5, atol=1e-6, msg=k)
            else:
                assert torch.equal(ckpt[f"{client}.mentee.{k}"], v), k
        assert any(k.startswith(f"{client}.w_h.") for k in ckpt) and any(k.startswith(f"{client}.local.") for k in ckpt)


def test_fedkd_leakage_is_the_decoded_mentee(kd_run):
    from attacks.context import leakage_module, previous_state

    run = Run.open(kd_run)
    view = run.attacker
    up = next(r for r in view.records() if r["kind"] == "svd_model" and r["direction"] == "up" and r["round"] == 1)
    _, prev = previous_state(view, up)
    module = leakage_module(view, up)
    names = set(module.message_names(list(module.state_dict())))
    assert set(prev) == set(view.load(up)) == names  # decoded names are the mentee's parameters
    assert module(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    target = FedKDModel(
        build_model("mlp", in_channels=1, num_classes=10, image_size=28, rep_dim=512),
        build_model("cnn4-narrow", in_channels=1, num_classes=10, image_size=28, rep_dim=512),
    )
    load_mentee(target, prev)
    assert all(torch.equal(p, prev[k]) for k, p in target.mentee.named_parameters())


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
    rows = metrics(gen_run)
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
    rows = metrics(gen_homo_run)
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
    for rec in records:  # the kinds' contracts, as tests/test_contracts.py checks the heterogeneous variant's
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
    assert len(metrics(stopped)) == 1
    resume(stopped, cfg)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert strip(metrics(full)) == strip(metrics(stopped))
    a, b = Run.open(full).capture.records(), Run.open(stopped).capture.records()
    assert [r["sha256"] for r in a] == [r["sha256"] for r in b] and len(a) == 3 + 3 + 3 + 2 * (3 + 3) + 3
