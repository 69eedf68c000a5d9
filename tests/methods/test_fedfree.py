"""FedFree: exact mechanics on tiny layers, a short real-data run, its capture, and gradient leakage on it."""

from __future__ import annotations

import json
import math
from typing import cast

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from privfl.capture import TensorStore
from privfl.cli import run_cli
from privfl.data.partition import dominant_share_partition
from privfl.methods import METHODS
from privfl.methods.fedfree import (
    FedFree,
    LayerInfo,
    align_layer,
    candidate_layers,
    change_score,
    densify,
    entropy,
    kge,
    match_layer,
    overwrite,
    project_to,
    rank_top_k,
)
from privfl.models import MODEL_GROUPS, assign_archs, build_model, count_parameters
from privfl.train import main as train_main
from tests.helpers import FMNIST, ROOT


# ------------------------------------------------------------------------------------------ mechanics
def test_change_score_is_relative_squared_change_of_weight_and_bias():
    before = [torch.ones(2, 3), torch.ones(2)]  # ||θ||² = 8
    after = [torch.ones(2, 3) * 2, torch.ones(2)]  # ||Δ||² = 6
    assert change_score(before, after) == pytest.approx(6 / 8)
    # a zero-filled layer stays finite (ε in the denominator)
    assert math.isfinite(change_score([torch.zeros(3)], [torch.ones(3)]))


def test_top_k_largest_first_ties_to_the_earlier_layer():
    assert rank_top_k([0.1, 0.5, 0.3, 0.5], 2) == [1, 3]
    assert rank_top_k([0.1, 0.5, 0.3], 1) == [1]
    assert rank_top_k([0.2], 5) == [0]


def test_entropy_and_kge_on_known_weights():
    uniform = torch.linspace(-1, 1, 256)  # one value per bin -> log2(256) = 8 bits
    two = torch.tensor([0.0, 0.0, 1.0, 1.0])  # two equally full bins -> 1 bit
    assert entropy(uniform) == pytest.approx(8.0)
    assert entropy(two) == pytest.approx(1.0)
    assert entropy(torch.full((5, 5), 0.3)) == 0.0
    assert entropy(torch.tensor([0.0, 0.0, 0.0, 1.0])) == pytest.approx(-(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25)))
    assert kge(uniform, two) == pytest.approx(7.0) and kge(two, uniform) == pytest.approx(-7.0)
    # min-max binning: entropy ignores scale and shift
    assert entropy(3 * uniform + 5) == pytest.approx(8.0)


def _name(layer: LayerInfo | None) -> str:
    assert layer is not None
    return layer.name


def test_candidate_layers_and_matching_rules():
    g = candidate_layers(build_model("fedfree-cnn", in_channels=1, num_classes=10, image_size=28, rep_dim=128))
    assert [(x.type, x.depth) for x in g] == [("conv", 0), ("conv", 0.25), ("fc", 0.5), ("fc", 0.75), ("fc", 1.0)]
    name = {x.position: x.name for x in g}
    assert _name(match_layer(0.3, 1.0, 4, "conv", g, "depth")) == name[1]  # nearest overall depth
    assert _name(match_layer(0.9, 0.0, 7, "fc", g, "depth")) == name[4]
    assert _name(match_layer(0.625, 0.0, 7, "fc", g, "depth")) == name[2]  # tie 0.5 / 0.75 -> earlier
    assert _name(match_layer(0.9, 0.0, 7, "fc", g, "type_depth")) == name[2]  # first fc of its model
    assert _name(match_layer(0.25, 1.0, 1, "conv", g, "index")) == name[1]
    assert match_layer(0.25, 1.0, 1, "fc", g, "index") is None  # position 1 is a conv
    assert match_layer(0.0, 0.0, 0, "conv", [x for x in g if x.type == "fc"], "depth") is None
    # resnet-tiny: BatchNorm is not a candidate; its head maps to fc3, its stem to conv1
    c = candidate_layers(build_model("resnet-tiny", in_channels=1, num_classes=10, image_size=28))
    assert all(isinstance(x.module, (nn.Conv2d, nn.Linear)) for x in c) and c[-1].name == "head"
    assert _name(match_layer(c[-1].depth, c[-1].type_depth, c[-1].position, "fc", g, "depth")) == name[4]
    assert _name(match_layer(c[0].depth, c[0].type_depth, 0, "conv", g, "depth")) == name[0]


def test_size_mismatch_overlap_and_flat():
    w = torch.arange(4 * 2 * 5 * 5, dtype=torch.float32).view(4, 2, 5, 5)
    b = torch.tensor([1.0, 2.0, 3.0, 4.0])
    gw, gb = torch.zeros(3, 3, 3, 3), torch.zeros(3)
    pw, pb, wm, bm, om = project_to(w, b, 1, gw, gb, "overlap")
    assert pb is not None and bm is not None
    assert torch.equal(pw[:, :2], w[:3, :, 1:4, 1:4]) and torch.equal(pw[:, 2], torch.zeros(3, 3, 3))  # centre crop
    assert wm[:, :2].all() and not wm[:, 2].any() and torch.equal(pb, b[:3]) and om.all() and bm.all()
    one = torch.ones(2, 1, 1, 1)  # 1x1 kernel lands in the centre of the 3x3
    pw, _, wm, _, om = project_to(one, None, 1, gw, gb, "overlap")
    assert pw[:2, 0, 1, 1].eq(1).all() and pw.sum() == 2 and wm.sum() == 2 and om.tolist() == [True, True, False]
    pw, pb, wm, bm, om = project_to(w, b, 1, gw, gb, "flat")
    assert pb is not None
    assert torch.equal(pw.reshape(-1), w.reshape(-1)[:81]) and torch.equal(pb, b[:3]) and om.all() and wm.all()
    lin = torch.arange(6.0).view(2, 3)
    pw, pb, wm, _, om = project_to(lin, torch.ones(2), 1, torch.zeros(3, 2), torch.zeros(3), "overlap")
    assert pb is not None
    assert pw.tolist() == [[0, 1], [3, 4], [0, 0]] and pb.tolist() == [1, 1, 0] and om.tolist() == [True, True, False]
    # a depthwise conv is a block-diagonal dense kernel
    dw = torch.arange(1.0, 4.0).view(3, 1, 1, 1)
    assert torch.equal(densify(dw, 3)[:, :, 0, 0], torch.diag(torch.arange(1.0, 4.0)))


def test_client_overwrite_keep_and_zero():
    local = torch.arange(6.0).view(2, 3)
    g = torch.tensor([10.0, 11.0, 12.0, 13.0])
    assert overwrite(local, g, "keep").tolist() == [[10, 11, 12], [13, 4, 5]]
    assert overwrite(local, g, "zero").tolist() == [[10, 11, 12], [13, 0, 0]]
    big = torch.arange(100.0)
    assert overwrite(local, big, "keep").reshape(-1).tolist() == list(range(6))  # truncated to d_min


@pytest.mark.parametrize("kind", ["fc", "conv"])
def test_alignment_converges_toward_the_uploaded_layer(kind):
    torch.manual_seed(0)
    layer_module = nn.Linear(6, 4) if kind == "fc" else nn.Conv2d(2, 3, 3, padding=1)
    client = nn.Linear(6, 4) if kind == "fc" else nn.Conv2d(2, 3, 3, padding=1)
    g = candidate_layers(nn.Sequential(layer_module))[0]
    shape = (6,) if kind == "fc" else (2, 8, 8)
    assert client.bias is not None and g.module.bias is not None and layer_module.bias is not None
    w, b, _, _, om = project_to(client.weight.detach(), client.bias.detach(), 1, g.module.weight.detach(), g.module.bias.detach(), "overlap")
    d0 = (g.module.weight - client.weight).norm().item()
    gens = [torch.Generator().manual_seed(s) for s in range(200)]
    losses = align_layer(g, [(w, b, om)], shape, lr=0.01, steps=200, batch=256, generators=gens)
    d1 = (g.module.weight - client.weight).norm().item()
    # E[step] = 2α (g - θ): after 200 steps about 0.98^200 = 1.8% of the distance is left
    assert d1 < 0.05 * d0 and losses[-1] < 0.01 * losses[0]
    assert (g.module.bias - client.bias).norm() < 0.05 * (layer_module.bias.detach() - client.bias).norm() + 0.05


def test_one_step_is_about_two_alpha_toward_the_mean_of_uploads():
    torch.manual_seed(1)
    g = candidate_layers(nn.Sequential(nn.Linear(8, 5)))[0]
    start = g.module.weight.detach().clone()
    uploads = [torch.randn(5, 8) for _ in range(3)]
    targets = [(u, torch.zeros(5), torch.ones(5, dtype=torch.bool)) for u in uploads]
    align_layer(g, targets, (8,), lr=0.01, steps=1, batch=20000, generators=[torch.Generator().manual_seed(0)])
    expected = 0.98 * start + 0.02 * torch.stack(uploads).mean(0)
    assert torch.allclose(g.module.weight, expected, atol=2e-3)


def test_dominant_partition_is_8_1_1():
    labels = np.repeat(np.arange(10), 100)
    parts = dominant_share_partition(labels, 10, np.random.default_rng(0))
    for i, p in enumerate(parts):
        counts = np.bincount(labels[p], minlength=10)
        assert counts[i] == 80 and counts[(i + 1) % 10] == 10 and counts[(i + 2) % 10] == 10 and counts.sum() == 100
    assert len(np.unique(np.concatenate(parts))) == 1000


def test_model_group_and_paper_parameter_counts():
    assert set(MODEL_GROUPS.get("fedfree8")) == set(MODEL_GROUPS.get("fedfree8-random"))
    assert len(set(assign_archs("fedfree8", 10))) == 8
    assert assign_archs("fedfree8-random", 20) == list(MODEL_GROUPS.get("fedfree8-random")[:20])
    assert count_parameters(build_model("fedfree-cnn", in_channels=3, num_classes=10, image_size=32, rep_dim=128)) == 3_265_610


@pytest.mark.parametrize("path", sorted((ROOT / "experiments" / "papers" / "fedfree").glob("*.toml")), ids=lambda p: p.stem)
def test_paper_configs_are_valid(path):
    from privfl.config import build_config, read_config_file

    values = read_config_file(path)
    cfg = build_config(values, METHODS.get(values["method"]).Options)
    assert cfg.method == "fedfree" and cfg.rounds == 200 and cfg.lr == 0.01 and cfg.batch_size == 10
    assert cfg.options["k"] == 2 and cfg.options["server_lr"] == 0.01 and cfg.options["kge_bins"] == 256
    assert cfg.num_clients in (10, 20, 100)
    assert set(assign_archs(cfg.model_group, cfg.num_clients)) <= set(MODEL_GROUPS.get("fedfree8"))


# ------------------------------------------------------------------------------------------ real run
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    out = tmp_path_factory.mktemp("fedfree")
    assert (
        train_main(
            [
                "fedfree",
                "--subsample",
                "2000",
                "--rounds",
                "3",
                "--batch-size",
                "32",  # Dir(0.1), cpu5
                "--no-progress",
                "--out-dir",
                str(out),
                "--run-name",
                "r",
            ]
        )
        == 0
    )
    return out / "r"


def test_short_run_learns(run):
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    counts = np.array(json.loads((run / "partition.json").read_text())["counts"])
    majority = counts.max(1).sum() / counts.sum()  # every client predicting its most frequent class
    assert metrics[-1]["acc"] > max(0.5, majority + 0.05) and metrics[-1]["acc"] > metrics[0]["acc"]
    assert all(m["downloads"] <= 10 for m in metrics)


def test_capture_is_exact(run):
    capture = TensorStore(run / "capture", "capture")
    assert capture.verify() == []
    records = capture.records()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    archs = json.loads((run / "run.json").read_text())["archs"]
    g = candidate_layers(build_model("fedfree-cnn", in_channels=1, num_classes=10, image_size=28, rep_dim=128))
    g_numel = {x.name: x.module.weight.numel() + cast(torch.Tensor, x.module.bias).numel() for x in g}  # all have biases
    for rnd, m in enumerate(metrics):
        ups = [r for r in records if r["round"] == rnd and r["direction"] == "up"]
        downs = [r for r in records if r["round"] == rnd and r["direction"] == "down"]
        assert len(ups) == 10 and len(downs) == m["downloads"] and all(r["kind"] == "layer" for r in ups + downs)
        for r in ups:
            layers = r["meta"]["layers"]
            assert len(layers) == 2 and r["meta"]["arch"] == archs[int(r["sender"].removeprefix("client"))]
            numel = sum(math.prod(lm["shape"]) + (lm["shape"][0] if lm["bias"] else 0) for lm in layers)
            assert r["scalars"] == r["paper_scalars"] == numel and r["bytes"] == 4 * numel
            assert layers[0]["score"] >= layers[1]["score"]
        for r in downs:
            assert r["scalars"] == g_numel[r["meta"]["global_layer"]] and r["meta"]["kge"] > 0
        assert m["upload_scalars"] == sum(r["scalars"] for r in ups) and m["upload_bytes"] == sum(r["bytes"] for r in ups)
        assert m["broadcast_scalars"] == sum(r["scalars"] for r in downs)
    # the last round's uploads are the clients' post-training layers; the download then overwrote one (Eq. 7, keep)
    last = len(metrics) - 1
    state = load_file(str(run / "checkpoint" / f"state-r{last:05d}.safetensors"))
    for up in [r for r in records if r["round"] == last and r["direction"] == "up"]:
        down = next((r for r in records if r["round"] == last and r["receiver"] == up["sender"]), None)
        sent = capture.load(up)
        for name, t in sent.items():
            have = state[f"{up['sender']}.{name}"]
            if down is not None and name.rsplit(".", 1)[0] == down["meta"]["target"]:
                incoming = capture.load(down)[f"{down['meta']['global_layer']}.{name.rsplit('.', 1)[1]}"]
                assert torch.equal(have, overwrite(t, incoming, "keep"))
            else:
                assert torch.equal(have, t)


def test_dlg_on_uploaded_layers_and_the_clear_error(run, capsys):
    from privfl.attack import main as attack_main

    code = run_cli(
        "privfl.attack",
        lambda: attack_main(["dlg", "--artifact", "layer", "--run", str(run), "--round", "0", "--clients", "0", "--steps", "3", "--no-progress"]),
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "start-of-round state" in err, err
    assert attack_main(["dlg", "--artifact", "layer", "--run", str(run), "--clients", "0", "--steps", "3", "--batch-size", "2", "--no-progress"]) == 0
    data = json.loads((run / "attacks" / "dlg-layer-r2" / "metrics.json").read_text())
    assert len(data["images"]) == 2 and data["protocol"]["method"] == "fedfree"


def test_bad_options_are_one_line_errors(tmp_path, capsys):
    if not FMNIST.exists():
        pytest.skip("apt-get install dataset-fashion-mnist")
    code = run_cli("privfl.train", lambda: train_main(["fedfree", "--k", "0", "--subsample", "600", "--no-progress", "--out-dir", str(tmp_path)]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "option k: must be >= 1, got 0" in err and len(err.splitlines()) == 1
    assert not any(tmp_path.iterdir())
    ctx = FedFree.leakage_context("layer")
    assert ctx is not None and ctx.previous_rule == "layer-replay"
