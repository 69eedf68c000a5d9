"""FML and FedAPEN: the shared model's size from its layer formula, the mutual-learning losses, FedAPEN's
adaptive ensemble weight on a constructed case, and tiny real runs: exact capture counts, a server that
averages what it received, a private model that never leaves its client, lambda in the checkpoint."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from privfl import Run
from privfl.config import build_config
from privfl.errors import PrivflError
from privfl.methods import METHODS, Client, ModelRequest
from privfl.methods.fedapen import FedAPEN, FedAPENModel, FedAPENOptions, ensemble, fit_shared_weight
from privfl.methods.fml import FML, FMLModel, FMLOptions, mutual_loss
from privfl.models import build_model, count_parameters
from privfl.models.fedmrl_zoo import MRLConvNet
from privfl.models.split import SplitModel
from tests.test_train import FMNIST, metrics, needs_fmnist, train

TINY = ["--subsample", "600", "--partition", "iid", "--rounds", "2", "--batch-size", "32", "--no-progress"]


def cnn_params(c_in: int, size: int, c2: int, fc1: int, classes: int, fc2: int = 500) -> int:
    """FedMRL's CNN-j (Table 2) from its layer sizes: conv 5x5 (c_in -> 16), pool 2, conv 5x5 (16 -> c2), pool 2,
    FC (c2 s^2 -> fc1), FC (fc1 -> fc2 = 500), FC (fc2 -> classes); weights plus biases."""
    s = ((size - 4) // 2 - 4) // 2  # spatial side after two valid 5x5 convs, each followed by 2x2 pooling
    return (c_in * 25 * 16 + 16) + (16 * 25 * c2 + c2) + (c2 * s * s * fc1 + fc1) + (fc1 * fc2 + fc2) + (fc2 * classes + classes)


CNN5 = {"c2": 32, "fc1": 500}  # Table 2: CNN-5, the shared model with heterogeneous clients
CNN1 = {"c2": 32, "fc1": 2000}  # CNN-1, with identical clients
THETA_FMNIST = cnn_params(1, 28, **CNN5, classes=10)  # what each default shared_model message carries here


def request(method: str, arch: str = "cnn4", *, group: str = "cpu5", channels: int = 3, size: int = 32, classes: int = 10, **options) -> ModelRequest:
    options_cls = METHODS.get(method).Options
    cfg = build_config({"method": method, "model_group": group, "options": options}, options_cls)
    return ModelRequest(arch, 0, channels, classes, size, cfg, options_cls(**cfg.options))


# ------------------------------------------------------------------------------------------ models
def test_shared_model_is_cnn5_or_cnn1_of_the_layer_formula():
    # the formula at CIFAR shapes agrees with Table 2's sizes (CNN-5 2.55 MB, CNN-1 10.00 MB of float32)
    assert cnn_params(3, 32, **CNN5, classes=10) == 670_058 and cnn_params(3, 32, **CNN1, classes=10) == 2_621_558
    assert THETA_FMNIST == 525_258
    for method, part in (("fml", "meme"), ("fedapen", "shared")):
        cls = METHODS.get(method)
        for group, spec, classes in (("cpu5", CNN5, 10), ("cpu5", CNN5, 100), ("homo-cnn4", CNN1, 10)):
            model = cls.build_client_model(request(method, group=group, classes=classes))
            shared = model.get_submodule(part)
            assert isinstance(shared, MRLConvNet) and count_parameters(shared) == cnn_params(3, 32, **spec, classes=classes)
            assert sum(t.numel() for t in shared.state_dict().values()) == count_parameters(shared)  # no buffers: the message is |theta|
            assert isinstance(model.local, SplitModel) and model.local.arch == "cnn4"
        # HtFLlib's choice: client 0's architecture (cpu5 starts with cnn4-narrow)
        model = cls.build_client_model(request(method, "mlp", shared_arch="client0"))
        shared = model.get_submodule(part)
        local = model.get_submodule("local")
        assert isinstance(shared, SplitModel) and shared.arch == "cnn4-narrow" and isinstance(local, SplitModel) and local.arch == "mlp"
        assert count_parameters(shared) == count_parameters(build_model("cnn4-narrow", in_channels=3, num_classes=10, image_size=32))
        model = cls.build_client_model(request(method, shared_arch="cnn3"))
        assert count_parameters(model.get_submodule(part)) == cnn_params(3, 32, c2=32, fc1=1000, classes=10)
    local, meme = _pair()
    assert set(FMLModel(local, meme).state_dict()) == {*(f"local.{k}" for k in local.state_dict()), *(f"meme.{k}" for k in meme.state_dict())}
    apen = FedAPEN.build_client_model(request("fedapen"))
    assert "shared_weight" in apen.state_dict() and float(apen.shared_weight) == 0.5  # lambda is checkpointed
    assert all(p is not apen.shared_weight for p in apen.parameters())  # and never trained by the local optimizer


def _pair(seed: int = 0) -> tuple[SplitModel, SplitModel]:
    torch.manual_seed(seed)
    return (
        build_model("mlp", in_channels=1, num_classes=3, image_size=4, rep_dim=8),
        build_model("mlp", in_channels=1, num_classes=3, image_size=4, rep_dim=8),
    )


def test_mutual_loss_is_ce_plus_kl_to_a_fixed_target():
    torch.manual_seed(0)
    own, other = torch.randn(6, 4, requires_grad=True), torch.randn(6, 4, requires_grad=True)
    y = torch.arange(6) % 4
    loss, ce, kl = mutual_loss(own, other, y, 0.3)
    p_other, p_own = F.softmax(other, 1), F.softmax(own, 1)
    manual_kl = (p_other * (p_other.log() - p_own.log())).sum(1).mean()  # KL(p_other || p_own) per sample
    assert torch.allclose(kl, manual_kl, atol=1e-6) and torch.allclose(ce, F.cross_entropy(own, y))
    assert torch.allclose(loss, 0.3 * ce + 0.7 * kl, atol=1e-6)
    loss.backward()
    assert own.grad is not None and other.grad is None  # the other model's output is a target, never trained through
    assert torch.equal(mutual_loss(own, other, y, 1.0)[0], F.cross_entropy(own, y))  # alpha = 1: plain CE (HtFLlib's default)
    for bad in ({"local_alpha": 1.5}, {"meme_beta": -0.1}, {"grad_clip": -1.0}, {"shared_arch": "cnn9"}):
        with pytest.raises(PrivflError, match=next(iter(bad))):
            build_config({"method": "fml", "options": bad}, FMLOptions)
    for bad in ({"holdout_fraction": 1.0}, {"lambda_init": 2.0}, {"lambda_lr": 0.0}, {"mix": "votes"}):
        with pytest.raises(PrivflError, match=next(iter(bad))):
            build_config({"method": "fedapen", "options": bad}, FedAPENOptions)


def test_lambda_moves_toward_the_better_model_and_stays_in_0_1():
    """A shared model trained on the task against a private model frozen at its random init: lambda (the
    shared model's weight) goes up; with the roles swapped it goes down; a huge step stops at the bound."""
    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(3, 1, 4, 4, generator=gen)
    y = torch.arange(240) % 3
    x = centres[y] + 0.5 * torch.randn(240, 1, 4, 4, generator=gen)
    private, shared = _pair(1)
    sgd = torch.optim.SGD(shared.parameters(), lr=0.2)
    for _ in range(150):
        sgd.zero_grad()
        F.cross_entropy(shared(x[:200]), y[:200]).backward()
        sgd.step()
    held_x, held_y = x[200:], y[200:]  # held out: neither model saw them
    with torch.no_grad():
        s, p = shared(held_x), private(held_x)
    assert (s.argmax(1) == held_y).float().mean() > 0.9 > 0.6 > (p.argmax(1) == held_y).float().mean()
    fit: dict[str, Any] = {"lr": 0.05, "epochs": 10, "batch_size": 16}
    for mix in ("probs", "logits"):
        up = fit_shared_weight(0.5, s, p, held_y, mix=mix, **fit)
        down = fit_shared_weight(0.5, p, s, held_y, mix=mix, **fit)  # the trained model is now the private one
        assert 0.5 < up <= 1.0 and 0.0 <= down < 0.5, (mix, up, down)
        assert fit_shared_weight(0.5, s, p, held_y, mix=mix, lr=1e3, epochs=1, batch_size=16) == 1.0
        assert fit_shared_weight(0.5, p, s, held_y, mix=mix, lr=1e3, epochs=1, batch_size=16) == 0.0
        assert fit_shared_weight(0.3, s, p, held_y, mix=mix, lr=0.05, epochs=0, batch_size=16) == pytest.approx(0.3)
    # seeded shuffling: the same generator gives the same lambda
    g = lambda epoch: torch.Generator().manual_seed(epoch)  # noqa: E731
    assert fit_shared_weight(0.5, s, p, held_y, generator=g, **fit) == fit_shared_weight(0.5, s, p, held_y, generator=g, **fit)

    # the prediction is the lambda-weighted mix of the two models' distributions (or logits)
    model = FedAPENModel(private, shared, 0.5)
    model.shared_weight.fill_(up)
    method = object.__new__(FedAPEN)  # predict needs only the client's model
    client = Client(0, "mlp", model, torch.arange(4), torch.arange(4))
    with torch.no_grad():
        scores = method.predict(client, held_x)
        mixed = up * F.softmax(s, 1) + (1 - up) * F.softmax(p, 1)
        assert torch.allclose(F.softmax(scores, 1), mixed, atol=1e-6) and torch.allclose(scores.exp(), mixed, atol=1e-6)
        model.mix = "logits"
        assert torch.allclose(method.predict(client, held_x), up * s + (1 - up) * p, atol=1e-6)
        assert torch.allclose(ensemble(s, p, 1.0, "probs").exp(), F.softmax(s, 1), atol=1e-6)  # lambda = 1: the shared model alone
        assert torch.allclose(ensemble(s, p, 0.0, "probs").exp(), F.softmax(p, 1), atol=1e-6)


# ------------------------------------------------------------------------------------------ runs
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    out = tmp_path_factory.mktemp("fml_fedapen")
    return {method: Run.open(train(out, method, *TINY, name=method)) for method in ("fml", "fedapen")}


def _check_counts_and_average(run: Run) -> list[dict]:
    """Every round: K uploads and N broadcasts of exactly |theta| scalars each; each broadcast is the
    sample-weighted mean of that round's uploads (as received); the messages carry the shared model only."""
    names = MRLConvNet(5, 1, 28, num_classes=10).state_dict()
    rows = metrics(run.path)
    for r in rows:
        assert r["upload_scalars"] == r["upload_scalars_full"] == r["broadcast_scalars"] == 10 * THETA_FMNIST
        assert r["upload_bytes"] == r["broadcast_bytes"] == 4 * 10 * THETA_FMNIST
    recs = run.capture.records()
    assert {r["kind"] for r in recs} == {"shared_model"} and len(recs) == 10 + 2 * 20  # setup broadcast + 2 rounds
    for rec in recs:  # the shared model's tensors, nothing else: no private tensor, no architecture
        assert {k: v["shape"] for k, v in rec["tensors"].items()} == {k: list(v.shape) for k, v in names.items()}
        assert "arch" not in rec["meta"]
    for rnd in range(2):
        ups = [r for r in recs if r["round"] == rnd and r["direction"] == "up"]
        downs = [r for r in recs if r["round"] == rnd and r["direction"] == "down" and r["meta"]["phase"] == "train"]
        assert len(ups) == len(downs) == 10 and all(u["meta"]["lr"] == 0.06 for u in ups)
        weights = [u["meta"]["num_samples"] for u in ups]
        sent = [run.capture.load(u) for u in ups]
        broadcast = [run.capture.load(d) for d in downs]
        for k in names:
            expected = sum(w * s[k].double() for w, s in zip(weights, sent)) / sum(weights)
            assert all(torch.allclose(b[k].double(), expected, atol=1e-6) for b in broadcast), (rnd, k)
        assert any(not torch.equal(sent[0][k], sent[1][k]) for k in names)  # clients really trained differently
    return recs


@needs_fmnist
def test_fml_sends_the_meme_model_only_and_averages_what_it_received(runs):
    run = runs["fml"]
    recs = _check_counts_and_average(run)
    rows = metrics(run.path)
    assert all(0.0 <= r["acc"] <= 1.0 for r in rows) and {"loss_local", "loss_meme"} <= set(rows[0])
    assert rows[-1]["acc"] == rows[-1]["acc_personal"]  # inference is the private model, which the broadcast never touches
    # the private model never leaves the client: its final weights appear in no message it sent
    models = run.models()
    truth = run.ground_truth()
    for k in (0, 3):
        model = models.model(k)
        assert isinstance(model, FMLModel)
        private = [t for t in model.local.state_dict().values() if t.is_floating_point()]
        ups = [r for r in recs if r["sender"] == f"client{k}"]
        for rec in ups:
            for t in run.capture.load(rec).values():
                assert not any(t.shape == q.shape and torch.equal(t, q) for q in private)
            assert torch.equal(truth.message_truth(rec["seq"])["indices"].sort().values, truth.client_train(f"client{k}").long().sort().values)
    # gradient leakage targets the meme submodule, whose parameter names are the message's
    from attacks import ATTACKS, Selection
    from attacks.context import leakage_module

    ctx = FML.leakage_context("shared_model")
    assert ctx is not None and (ctx.previous, ctx.module) == ("shared_model", "meme") and "KL" in ctx.note
    view = run.attacker
    up = [r for r in recs if r["direction"] == "up"][-1]
    module = leakage_module(view, up)
    assert isinstance(module.body, MRLConvNet) and set(module.to_module_names(view.load(up))) == set(module.state_dict())
    assert ATTACKS.get("dlg")().plan(view, Selection(kind="shared_model", max_targets=1))


@needs_fmnist
def test_fedapen_holds_out_samples_fits_lambda_and_checkpoints_it(runs):
    run = runs["fedapen"]
    recs = _check_counts_and_average(run)
    rows = metrics(run.path)
    assert all(0.0 <= r["shared_weight"] <= 1.0 for r in rows) and "acc_personal" in rows[-1]
    truth = run.ground_truth()
    for rec in [r for r in recs if r["direction"] == "up"]:
        train_split = truth.client_train(rec["sender"]).long()
        n = len(train_split)
        assert rec["meta"]["num_samples"] == n - min(n - 1, max(1, round(0.05 * n)))  # 5% held out for lambda
        trained = truth.message_truth(rec["seq"])["indices"].long()
        assert len(trained) == rec["meta"]["num_samples"] and set(trained.tolist()) < set(train_split.tolist())
    models = run.models()
    for k in range(10):
        model = models.model(k)
        assert isinstance(model, FedAPENModel)
        lam = float(model.shared_weight)
        assert 0.0 <= lam <= 1.0 and lam != 0.5  # fitted, and restored from the checkpoint
    assert sum(float(models.model(k).shared_weight) for k in range(10)) / 10 == pytest.approx(rows[-1]["shared_weight"], abs=1e-6)
    ctx = FedAPEN.leakage_context("shared_model")
    assert ctx is not None and ctx.module == "shared"
