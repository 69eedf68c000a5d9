"""FedMRL: the paper's model sizes, the fused Matryoshka forward pass, a server that really averages
what it received, exact capture counts, learning on real data, gradient leakage and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from privfl.capture import Message, TensorStore
from privfl.config import build_config
from privfl.errors import ConfigError
from privfl.methods import METHODS, ModelRequest
from privfl.methods.fedmrl import FedMRL, FedMRLModel, FedMRLOptions, matryoshka_slices, weighted_average
from privfl.models import assign_archs, count_parameters
from privfl.models.fedmrl_zoo import MRLConvNet, small_model
from tests.helpers import FMNIST, ROOT, needs_fmnist, read_metrics, train

CONFIGS = sorted((ROOT / "experiments" / "papers" / "fedmrl").glob("*.toml"))


def request(
    arch: str = "mlp", *, d1: int = 3, rep_dim: int = 8, classes: int = 4, size: int = 16, channels: int = 1, group: str = "cpu5", **options
) -> ModelRequest:
    cfg = build_config({"method": "fedmrl", "rep_dim": rep_dim, "model_group": group, "options": {"d1": d1, **options}}, FedMRLOptions)
    return ModelRequest(arch, 0, channels, classes, size, cfg, FedMRLOptions(**cfg.options))


# ------------------------------------------------------------------------------------------ models
def test_cnn_sizes_match_table_2_and_the_spec():
    # Table 2 sizes with L = 10 on 3x32x32 (CNN-4: 4.045 MiB computed; the table's 3.81 MB is a typo)
    sizes = {1: 2_621_558, 2: 1_815_142, 3: 1_320_558, 4: 1_060_358, 5: 670_058}
    for v, n in sizes.items():
        assert count_parameters(MRLConvNet(v, 3, 32, num_classes=10)) == n
    # small model |theta| (spec Sec. 1.5): CNN-5 (hetero) / CNN-1 (homo) with FC2 = d1
    for (v, d1, classes), n in {
        (5, 100, 10): 465_658,
        (5, 200, 10): 516_758,
        (5, 500, 10): 670_058,
        (5, 100, 100): 474_748,
        (5, 200, 100): 534_848,
        (5, 500, 100): 715_148,
        (1, 100, 10): 1_817_158,
        (1, 500, 10): 2_621_558,
    }.items():
        g = small_model(v, in_channels=3, image_size=32, d1=d1, num_classes=classes)
        assert count_parameters(g) == n
    g = small_model(5, in_channels=3, image_size=32, d1=200, num_classes=10)
    assert [k for k, _ in g.named_parameters()] == [f"{layer}.{p}" for layer in ("conv1", "conv2", "fc1", "fc2", "fc3") for p in ("weight", "bias")]
    assert g.fc1.in_features == 800 and MRLConvNet(2, 3, 32).fc1.in_features == 400
    # client k gets CNN-(k mod 5 + 1); the projector is Linear(d1 + 500 -> 500)
    assert assign_archs("fedmrl-cnn5", 7) == ["mrl-cnn1", "mrl-cnn2", "mrl-cnn3", "mrl-cnn4", "mrl-cnn5", "mrl-cnn1", "mrl-cnn2"]
    model = FedMRL.build_client_model(request("mrl-cnn3", d1=100, rep_dim=500, classes=10, size=32, channels=3, group="fedmrl-cnn5"))
    assert count_parameters(model.projector) == 300_500 and model.small.variant == 5
    homo = FedMRL.build_client_model(request("mrl-cnn1", d1=100, rep_dim=500, classes=10, size=32, channels=3, group="fedmrl-homo-cnn1"))
    assert homo.small.variant == 1 and count_parameters(homo.small) == 1_817_158


def test_fusion_and_matryoshka_heads_are_the_papers_equations():
    torch.manual_seed(0)
    model = FedMRL.build_client_model(request("mlp", d1=3, rep_dim=8))
    x = torch.randn(5, 1, 16, 16)
    r_g, r_f = model.small.represent(x), model.local.represent(x)
    assert r_g.shape == (5, 3) and r_f.shape == (5, 8) and (r_g >= 0).all()  # post-ReLU small representation
    fused = model.fuse(x)
    # Eq. 3-4: the projector sees [R^G, R^F] (small first) and keeps d2
    w, b = model.projector.weight, model.projector.bias
    assert w.shape == (8, 11) and torch.allclose(fused, r_g @ w[:, :3].T + r_f @ w[:, 3:].T + b, atol=1e-6)
    coarse, fine = matryoshka_slices(fused, (3, 8))
    assert torch.equal(coarse, fused[:, :3]) and torch.equal(fine, fused)
    assert coarse.data_ptr() == fine.data_ptr()  # nested: the coarse one is a prefix of the fine one
    y_g, y_f = model.heads(x)
    assert model.small.fc3 is not None
    # Eqs. 6-7: the global header reads the projected prefix, not G^ex's own output
    assert torch.allclose(y_g, model.small.fc3(fused[:, :3])) and not torch.allclose(y_g, model.small(x))
    assert torch.allclose(y_f, model.local.head(fused)) and y_g.shape == y_f.shape == (5, 4)
    assert torch.allclose(model(x), y_f)  # mix-large: no global header
    assert torch.allclose(model.infer(x, "mix-small"), y_g)
    assert torch.allclose(model.infer(x, "single-small"), model.small(x))
    assert torch.allclose(model.infer(x, "single-large"), model.local(x))
    # one summed loss reaches all three parts (Eq. 10)
    (F.cross_entropy(y_g, torch.arange(5) % 4) + F.cross_entropy(y_f, torch.arange(5) % 4)).backward()
    for part in (model.small, model.local, model.projector):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in part.parameters() if p.dim() > 1)
    # every part is in the checkpointed state dict
    assert {k.split(".")[0] for k in model.state_dict()} == {"small", "local", "projector"}
    with pytest.raises(ValueError):
        matryoshka_slices(fused, (8, 3))
    with pytest.raises(ConfigError, match="d1 <= d2"):
        FedMRL.build_client_model(request("mlp", d1=9, rep_dim=8))


def test_leakage_context_is_the_small_model_named_like_its_messages():
    """What the attacker differentiates is declared, not coded: the client model's ``small`` submodule,
    whose parameter names are those of the ``small_model`` messages."""
    from attacks.context import LeakageModule

    ctx = FedMRL.leakage_context("small_model")
    assert ctx is not None
    assert (ctx.previous, ctx.module, ctx.prefix, ctx.readout) == ("small_model", "small", "", "logits") and ctx.note
    req = request("mlp", d1=3, rep_dim=8)
    client = FedMRL.build_client_model(req)
    g = LeakageModule(client.get_submodule(ctx.module), ctx, 4, torch.randn(2, 1, 16, 16))
    assert isinstance(g.body, MRLConvNet) and g(torch.randn(2, 1, 16, 16)).shape == (2, 4)
    sent = {k: v.detach() for k, v in client.small.state_dict().items()}
    assert set(g.to_module_names(sent)) == set(g.state_dict())
    assert FedMRL.leakage_context("model") is None  # FedMRL sends no model; not parameter-like for it either way


def test_weighted_average_averages_every_upload():
    ups = [
        Message(0, f"client{k}", "server", "small_model", {"w": torch.full((2, 2), float(k)), "b": torch.tensor([k * 2.0])}, {"num_samples": n})
        for k, n in ((0, 1), (1, 3), (4, 4))
    ]
    avg = weighted_average(ups)
    assert torch.allclose(avg["w"], torch.full((2, 2), (0 * 1 + 1 * 3 + 4 * 4) / 8))  # 2.375, not the last client's 4
    assert torch.allclose(avg["b"], torch.tensor([2 * 2.375])) and avg["w"].dtype == torch.float32
    with pytest.raises(ValueError):
        weighted_average([ups[0], Message(0, "client9", "server", "small_model", {"w": torch.zeros(2, 2)}, {"num_samples": 1})])


def test_options_are_checked():
    for bad in ({"d1": 0}, {"loss_weight_global": 0.0, "loss_weight_local": 0.0}, {"grad_clip": -1.0}, {"small_lr": 0.0}):
        with pytest.raises(ConfigError):
            FedMRLOptions(**bad)


# ------------------------------------------------------------------------------------------ rounds
def trainer(tmp_path: Path, **values):
    from privfl.engine import Trainer

    base = {
        "method": "fedmrl",
        "subsample": 400,
        "partition": "iid",
        "rounds": 1,
        "progress": False,
        "batch_size": 32,
        "num_clients": 4,
        "model_group": "cpu5",
        "rep_dim": 16,
        "out_dir": str(tmp_path),
        "device": "cpu",
        "options": {"d1": 8},
    }
    cfg = build_config({**base, **values}, FedMRLOptions)
    return Trainer(cfg, tmp_path / "run")


@needs_fmnist
def test_round_downloads_to_selected_and_averages_what_it_received(tmp_path):
    # a noise defense on uploads: the server must average the noisy messages it received, not the clients' models
    t = trainer(tmp_path, join_ratio=0.5, defense=["gaussian:sigma=0.05,kinds=small_model"])
    t.method.setup()
    selected = t.select(0)
    assert len(selected) == 2
    t.method.run_round(0, selected)
    recs = t.capture.records()
    downs = [r for r in recs if r["direction"] == "down"]
    ups = [r for r in recs if r["direction"] == "up"]
    names = sorted(c.name for c in selected)
    assert sorted(r["receiver"] for r in downs) == names and sorted(r["sender"] for r in ups) == names
    assert len(recs) == 4 and all(r["kind"] == "small_model" for r in recs)
    assert all("arch" not in r["meta"] for r in recs)  # the private architecture never leaves the client
    for r in ups:  # what a gradient-leakage attacker needs
        c = t.clients[int(r["sender"].removeprefix("client"))]
        assert r["meta"]["num_samples"] == len(c.train_idx) and r["meta"]["lr"] == 0.06
        assert r["meta"]["local_steps"] == -(-len(c.train_idx) // 32)
    sent = [t.capture.load(r) for r in ups]
    weights = [r["meta"]["num_samples"] for r in ups]
    glob = t.method.global_small.state_dict()
    for k, v in glob.items():
        expected = sum(w * s[k].double() for w, s in zip(weights, sent)) / sum(weights)
        assert torch.allclose(v.double(), expected, atol=1e-6), k
    last = sent[-1]
    assert any(not torch.allclose(glob[k], last[k]) for k in glob)  # not the last client's upload
    own = [c.model.small.state_dict() for c in selected]
    assert not torch.allclose(
        glob["fc2.weight"].double(), sum(w * s["fc2.weight"].double() for w, s in zip(weights, own)) / sum(weights), atol=1e-4
    )  # the clients' own (noise-free) models were not read
    # the download each client trained from is the server's previous global model
    start = t.capture.load(downs[0])
    assert all(torch.equal(start[k], t.capture.load(d)[k]) for d in downs for k in start)


#: the default cpu5 group (five different SplitModels), momentum as the official code
RUN_ARGS = [
    "fedmrl",
    "--subsample",
    "2000",
    "--num-clients",
    "5",
    "--partition",
    "iid",
    "--batch-size",
    "32",
    "--rounds",
    "3",
    "--local-epochs",
    "2",
    "--lr",
    "0.02",
    "--momentum",
    "0.9",
    "--no-progress",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    return train(tmp_path_factory.mktemp("fedmrl"), *RUN_ARGS)


@needs_fmnist
def test_short_run_learns_and_capture_counts_are_exact(run):
    rows = read_metrics(run)
    assert rows[-1]["acc"] > 0.35, [r["acc"] for r in rows]  # chance is 0.10
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    # |theta| of CNN-5 with FC2 = d1 = 200 on 1x28x28 (flatten 32*4*4 = 512), L = 10
    theta = (16 * 25 + 16) + (32 * 16 * 25 + 32) + (512 * 500 + 500) + (500 * 200 + 200) + (200 * 10 + 10)
    assert theta == 371_958 == count_parameters(small_model(5, in_channels=1, image_size=28, d1=200, num_classes=10))
    for r in rows:
        assert r["upload_scalars"] == r["upload_scalars_full"] == r["broadcast_scalars"] == 5 * theta
        assert r["upload_bytes"] == r["broadcast_bytes"] == 4 * 5 * theta
    capture = TensorStore(run / "capture", "capture")
    assert capture.verify() == [] and len(capture.records()) == 3 * 2 * 5
    assert json.loads((run / "run.json").read_text())["sends"] == {"small_model": "up/down"}


@needs_fmnist
def test_dlg_on_a_captured_small_model(run):
    from privfl.attack import main as attack_main

    assert (
        attack_main(["dlg", "--artifact", "small_model", "--run", str(run), "--clients", "0", "--steps", "3", "--batch-size", "1", "--no-progress"])
        == 0
    )
    data = json.loads((run / "attacks" / "dlg-small_model-r2" / "metrics.json").read_text())
    assert len(data["images"]) == 1 and data["images"][0]["client"] == "client0"
    assert data["protocol"]["threat_model"] == "curious-server-previous-state"


def test_killed_run_resumes_exactly(assert_resumes_exactly):
    args = ["fedmrl", "--subsample", "300", "--num-clients", "3", "--partition", "iid", "--rounds", "2", "--rep-dim", "32", "--d1", "16"]
    assert_resumes_exactly(args, kill_round=1, kill_after=4)  # after round 1's 3 downloads and 1 upload


# ------------------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_paper_configs_are_valid(path):
    from privfl.config import read_config_file

    values = read_config_file(path)
    cfg = build_config(values, METHODS.get(values["method"]).Options)
    opts = FedMRLOptions(**cfg.options)
    assert cfg.method == "fedmrl" and cfg.dataset in ("cifar10", "cifar100")
    assert round(cfg.join_ratio * cfg.num_clients) == 10  # K = 10 in every setting of the paper
    assert (cfg.num_clients, cfg.join_ratio) in ((10, 1.0), (50, 0.2), (100, 0.1))
    assert cfg.rep_dim == 500 and cfg.mapping == "ap" and cfg.train_fraction == 0.8 and opts.d1 <= cfg.rep_dim
    archs = assign_archs(cfg.model_group, cfg.num_clients)
    classes = 10 if cfg.dataset == "cifar10" else 100
    req = ModelRequest(archs[3], 3, 3, classes, 32, cfg, opts)
    model = FedMRL.build_client_model(req)
    assert isinstance(model, FedMRLModel) and model.small.variant == (1 if len(set(archs)) == 1 else 5)
    assert model.local.feature_dim == 500 and torch.equal(model.local.mapping(torch.arange(500.0)[None]), torch.arange(500.0)[None])


def test_configs_exist():
    names = {p.stem for p in CONFIGS}
    assert len(names) == 18 and "cifar10_n100_c10_pat_hete" in names and "cifar100_n50_c20_dir0.1_hete" in names
