"""FedKD: the SVD codec's counts and known properties (Eckart-Young), the energy schedule, HtFLlib's
mutual-distillation gradient, and on tiny real data exact capture counts, the server average and the
leakage view (the decoded mentee)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privfl.capture import Message
from privfl.codecs import svd_aux, svd_decode, svd_encode, svd_rank
from privfl.kinds import KINDS
from privfl.methods.fedkd import FedKD, FedKDModel, energy_at, load_mentee
from privfl.models import build_model
from privfl.run import Run
from tests.helpers import FMNIST, read_metrics, train

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
    rows = read_metrics(kd_run)
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
