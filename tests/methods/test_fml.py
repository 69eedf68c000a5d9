"""FML: the shared model's size from its layer formula, the mutual-learning loss, and a tiny real run:
exact capture counts, a server that averages what it received, a private model that never leaves its
client."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from privfl import Run
from privfl.config import build_config
from privfl.errors import PrivflError
from privfl.methods import METHODS, ModelRequest
from privfl.methods.fedapen import FedAPEN, FedAPENOptions
from privfl.methods.fml import FML, FMLModel, FMLOptions, mutual_loss
from privfl.models import build_model, count_parameters
from privfl.models.fedmrl_zoo import MRLConvNet
from privfl.models.split import SplitModel
from tests.helpers import FMNIST, assert_shared_model_counts_and_average, fedmrl_cnn_params, mlp_pair, needs_fmnist, read_metrics, train

TINY = ["--subsample", "600", "--partition", "iid", "--rounds", "2", "--batch-size", "32", "--no-progress"]


CNN5 = {"c2": 32, "fc1": 500}  # Table 2: CNN-5, the shared model with heterogeneous clients
CNN1 = {"c2": 32, "fc1": 2000}  # CNN-1, with identical clients
THETA_FMNIST = fedmrl_cnn_params(1, 28, **CNN5, classes=10)  # what each default shared_model message carries here


def request(method: str, arch: str = "cnn4", *, group: str = "cpu5", channels: int = 3, size: int = 32, classes: int = 10, **options) -> ModelRequest:
    options_cls = METHODS.get(method).Options
    cfg = build_config({"method": method, "model_group": group, "options": options}, options_cls)
    return ModelRequest(arch, 0, channels, classes, size, cfg, options_cls(**cfg.options))


# ------------------------------------------------------------------------------------------ models
def test_shared_model_is_cnn5_or_cnn1_of_the_layer_formula():
    # the formula at CIFAR shapes agrees with Table 2's sizes (CNN-5 2.55 MB, CNN-1 10.00 MB of float32)
    assert fedmrl_cnn_params(3, 32, **CNN5, classes=10) == 670_058 and fedmrl_cnn_params(3, 32, **CNN1, classes=10) == 2_621_558
    assert THETA_FMNIST == 525_258
    for method, part in (("fml", "meme"), ("fedapen", "shared")):
        cls = METHODS.get(method)
        for group, spec, classes in (("cpu5", CNN5, 10), ("cpu5", CNN5, 100), ("homo-cnn4", CNN1, 10)):
            model = cls.build_client_model(request(method, group=group, classes=classes))
            shared = model.get_submodule(part)
            assert isinstance(shared, MRLConvNet) and count_parameters(shared) == fedmrl_cnn_params(3, 32, **spec, classes=classes)
            assert sum(t.numel() for t in shared.state_dict().values()) == count_parameters(shared)  # no buffers: the message is |theta|
            assert isinstance(model.local, SplitModel) and model.local.arch == "cnn4"
        # HtFLlib's choice: client 0's architecture (cpu5 starts with cnn4-narrow)
        model = cls.build_client_model(request(method, "mlp", shared_arch="client0"))
        shared = model.get_submodule(part)
        local = model.get_submodule("local")
        assert isinstance(shared, SplitModel) and shared.arch == "cnn4-narrow" and isinstance(local, SplitModel) and local.arch == "mlp"
        assert count_parameters(shared) == count_parameters(build_model("cnn4-narrow", in_channels=3, num_classes=10, image_size=32))
        model = cls.build_client_model(request(method, shared_arch="cnn3"))
        assert count_parameters(model.get_submodule(part)) == fedmrl_cnn_params(3, 32, c2=32, fc1=1000, classes=10)
    local, meme = mlp_pair()
    assert set(FMLModel(local, meme).state_dict()) == {*(f"local.{k}" for k in local.state_dict()), *(f"meme.{k}" for k in meme.state_dict())}
    apen = FedAPEN.build_client_model(request("fedapen"))
    assert "shared_weight" in apen.state_dict() and float(apen.shared_weight) == 0.5  # lambda is checkpointed
    assert all(p is not apen.shared_weight for p in apen.parameters())  # and never trained by the local optimizer


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


# ------------------------------------------------------------------------------------------ runs
@pytest.fixture(scope="module")
def fml_run(tmp_path_factory):
    """One two-round run on tiny real data."""
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    out = tmp_path_factory.mktemp("fml")
    return Run.open(train(out, "fml", *TINY, name="fml"))


@needs_fmnist
def test_fml_sends_the_meme_model_only_and_averages_what_it_received(fml_run):
    run = fml_run
    recs = assert_shared_model_counts_and_average(run)
    rows = read_metrics(run.path)
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
