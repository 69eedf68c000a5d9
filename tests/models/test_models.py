"""Tests for privfl.models: backbones, representation mappings, the extractor/RM/head split."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from privfl.errors import ConfigError, UnknownNameError
from privfl.models import (
    MAPPINGS,
    MODEL_GROUPS,
    MODELS,
    SplitModel,
    assign_archs,
    build_model,
    count_parameters,
)

torch.set_num_threads(min(2, torch.get_num_threads()))

ALL_ARCHS = MODELS.names()
# Too slow to build and run at 64x64 in the default suite (still covered at 28/32 px).
HEAVY_AT_64 = {"resnet101", "resnet152", "vit_b_16", "vit_b_32"}
CPU5 = MODEL_GROUPS.get("cpu5")
EXPECTED_DIMS = {
    "cnn4": 512,
    "cnn4-narrow": 512,
    "cnn3x3": 512,
    "mlp": 512,
    "resnet-tiny": 64,
    "resnet18": 512,
    "resnet34": 512,
    "resnet50": 2048,
    "resnet101": 2048,
    "resnet152": 2048,
    "googlenet": 1024,
    "mobilenet_v2": 1280,
    "vit_b_16": 768,
    "vit_b_32": 768,
    "squeezenet1_1": 512,
    "shufflenet_v2_x0_5": 1024,
    **{f"mrl-cnn{v}": 500 for v in range(1, 6)},  # FedMRL's CNN-1..5 (Table 2), up to ReLU(FC2)
    # FedFree's CIFAR-style ResNets (3x3 stem, no max-pool) and its 5-layer CNN
    "cifar-resnet18": 512,
    "cifar-resnet34": 512,
    "cifar-resnet50": 2048,
    "cifar-resnet101": 2048,
    "cifar-resnet152": 2048,
    "fedfree-cnn": 128,
}


def _build(arch: str, **kw) -> SplitModel:
    torch.manual_seed(0)
    return build_model(arch, **kw)


def test_every_arch_has_expected_dim():
    assert set(ALL_ARCHS) == set(EXPECTED_DIMS)


@pytest.mark.parametrize("in_channels,size", [(1, 28), (3, 32)], ids=["grey28", "rgb32"])
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_forward_shapes_all_mappings(arch: str, in_channels: int, size: int):
    rep_dim, num_classes, batch = 512, 7, 2
    model = _build(arch, in_channels=in_channels, num_classes=num_classes, image_size=size)
    assert model.feature_dim == EXPECTED_DIMS[arch]
    if arch != "mlp":  # the stem conv takes the data's channels (grey or colour)
        stem = next(m for m in model.features.modules() if isinstance(m, nn.Conv2d))
        assert stem.in_channels == in_channels
    model.eval()
    x = torch.randn(batch, in_channels, size, size)
    with torch.no_grad():
        feats = model.features(x)
        assert feats.shape == (batch, EXPECTED_DIMS[arch])
        assert model(x).shape == (batch, num_classes)
        assert model.represent(x).shape == (batch, rep_dim)
        # Every mapping on the same features (building each big net once per mapping is too slow).
        for name in MAPPINGS.names():
            rm = MAPPINGS.get(name)(model.feature_dim, rep_dim)
            rep = rm(feats)
            assert rep.shape == (batch, rep_dim)
            assert model.head(rep).shape == (batch, num_classes)


@pytest.mark.parametrize("arch", [a for a in ALL_ARCHS if a not in HEAVY_AT_64])
def test_forward_64px(arch: str):
    model = _build(arch, in_channels=3, num_classes=200, image_size=64).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 64, 64)).shape == (2, 200)


@pytest.mark.parametrize("mapping", ["ap", "mp", "fc"])
@pytest.mark.parametrize("arch", CPU5)
def test_cpu5_build_each_mapping_and_train_step(arch: str, mapping: str):
    model = _build(arch, in_channels=1, num_classes=10, image_size=28, rep_dim=256, mapping=mapping)
    model.train()
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    assert model.represent(x).shape == (4, 256)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    assert model.head.weight.grad is not None
    if mapping == "fc":
        assert model.mapping.weight.grad is not None


def test_head_is_linear_for_every_arch():
    for arch in ["cnn4", "mlp", "resnet-tiny", "squeezenet1_1"]:
        model = _build(arch, in_channels=3, num_classes=5, image_size=32, rep_dim=128)
        assert isinstance(model.head, nn.Linear)
        assert (model.head.in_features, model.head.out_features) == (128, 5)


def test_cnn4_parameter_counts():
    m10 = _build("cnn4", in_channels=3, num_classes=10, image_size=32)
    assert count_parameters(m10) == 878_538
    assert count_parameters(m10.mapping) == 0  # AP identity at 512 -> 512
    m100 = _build("cnn4", in_channels=3, num_classes=100, image_size=32)
    assert count_parameters(m100) == 924_708


@pytest.mark.parametrize("size,flat", [(28, 1024), (32, 1600), (64, 10816)])
def test_cnn4_flat_dim(size: int, flat: int):
    model = _build("cnn4", in_channels=1, num_classes=10, image_size=size)
    linears = [m for m in model.features.modules() if isinstance(m, nn.Linear)]
    assert linears[0].in_features == flat


def test_too_small_image_fails_fast():
    with pytest.raises(ConfigError):
        build_model("cnn4", in_channels=1, num_classes=10, image_size=8)


def test_ap_mp_mapping_semantics():
    x = torch.randn(3, 2048)
    ap = MAPPINGS.get("ap")(2048, 512)
    mp = MAPPINGS.get("mp")(2048, 512)
    torch.testing.assert_close(ap(x), x.view(3, 512, 4).mean(-1))
    torch.testing.assert_close(mp(x), x.view(3, 512, 4).amax(-1))
    same = torch.randn(3, 512)
    assert torch.equal(MAPPINGS.get("ap")(512, 512)(same), same)
    assert torch.equal(MAPPINGS.get("mp")(512, 512)(same), same)
    # Smaller input than rep_dim: values are repeated (64 -> 512: each value 8 times).
    small = torch.randn(2, 64)
    torch.testing.assert_close(MAPPINGS.get("ap")(64, 512)(small), small.repeat_interleave(8, dim=1))
    assert count_parameters(ap) == 0 and count_parameters(mp) == 0
    fc = MAPPINGS.get("fc")(2048, 512)
    assert isinstance(fc, nn.Linear) and fc(x).shape == (3, 512)


@pytest.mark.parametrize("arch,mapping", [("cnn4", "fc"), ("resnet-tiny", "ap"), ("vit_b_16", "mp")])
def test_extractor_state_round_trip(arch: str, mapping: str):
    size = 28
    torch.manual_seed(1)
    src = build_model(arch, in_channels=1, num_classes=10, image_size=size, mapping=mapping)
    # Make BN buffers non-default so that buffers are proven to travel too.
    src.train()
    with torch.no_grad():
        src(torch.randn(4, 1, size, size))
    state = src.extractor_state()
    assert state and all(k.startswith(("features.", "mapping.")) for k in state)
    assert not any(k.startswith("head.") for k in state)
    json.dumps(src.spec)  # JSON-able
    torch.manual_seed(2)
    dst = build_model(**src.spec)
    dst.load_extractor_state(state)
    src.eval(), dst.eval()
    x = torch.randn(3, 1, size, size)
    with torch.no_grad():
        assert torch.equal(src.represent(x), dst.represent(x))
    # The snapshot is a copy: later changes to the model do not alter it.
    with torch.no_grad():
        next(src.features.parameters()).add_(1.0)
    assert not torch.equal(next(src.features.parameters()), state[next(iter(state))])


def test_load_extractor_state_rejects_foreign_state():
    a = _build("cnn4", in_channels=1, num_classes=10, image_size=28)
    b = _build("cnn4", in_channels=3, num_classes=10, image_size=32)
    with pytest.raises(ConfigError):
        a.load_extractor_state(b.extractor_state())  # same keys, other shapes
    c = _build("mlp", in_channels=1, num_classes=10, image_size=28)
    with pytest.raises(ConfigError):
        a.load_extractor_state(c.extractor_state())  # other keys
    with pytest.raises(ConfigError):
        a.load_extractor_state({**a.extractor_state(), **{f"head.{k}": v for k, v in a.head.state_dict().items()}})


def test_build_is_deterministic_given_seed():
    for arch in ["cnn4", "resnet-tiny", "googlenet"]:
        s1 = _build(arch, in_channels=1, num_classes=10, image_size=28, mapping="fc").state_dict()
        s2 = _build(arch, in_channels=1, num_classes=10, image_size=28, mapping="fc").state_dict()
        assert s1.keys() == s2.keys()
        assert all(torch.equal(s1[k], s2[k]) for k in s1)


def test_vit_pads_non_multiple_sizes():
    model = _build("vit_b_32", in_channels=1, num_classes=10, image_size=28)
    vit = model.features.get_submodule("1")
    assert vit.image_size == 32
    model32 = _build("vit_b_16", in_channels=3, num_classes=10, image_size=32)
    assert model32.features.image_size == 32  # no padding wrapper when already a multiple


def test_groups_and_assign_archs():
    assert MODEL_GROUPS.get("htm10") == (
        "cnn4", "mobilenet_v2", "googlenet", "resnet18", "resnet34",
        "resnet50", "resnet101", "resnet152", "vit_b_16", "vit_b_32",
    )  # fmt: skip
    assert len(MODEL_GROUPS.get("htfe8")) == 8
    assert MODEL_GROUPS.get("homo-cnn4") == ("cnn4",)
    assert MODEL_GROUPS.get("homo-resnet18") == ("resnet18",)
    cpu5 = MODEL_GROUPS.get("cpu5")
    archs = assign_archs("cpu5", 12)
    assert archs == [cpu5[i % 5] for i in range(12)]
    assert archs[:5] == list(cpu5) and archs[5] == cpu5[0]
    assert assign_archs("homo-cnn4", 3) == ["cnn4"] * 3
    with pytest.raises(ConfigError):
        assign_archs("cpu5", 0)


def test_unknown_names_list_accepted():
    with pytest.raises(UnknownNameError) as e:
        build_model("resnet9000", in_channels=3, num_classes=10, image_size=32)
    assert "resnet18" in str(e.value) and "cnn4" in str(e.value)
    with pytest.raises(UnknownNameError) as e:
        assign_archs("htm99", 4)
    assert "htm10" in str(e.value) and "cpu5" in str(e.value)
    with pytest.raises(UnknownNameError) as e:
        build_model("cnn4", in_channels=3, num_classes=10, image_size=32, mapping="pca")
    assert "ap" in str(e.value) and "fc" in str(e.value)


def test_bad_numeric_args():
    with pytest.raises(ConfigError):
        build_model("cnn4", in_channels=0, num_classes=10, image_size=32)
    with pytest.raises(ConfigError):
        build_model("cnn4", in_channels=3, num_classes=10, image_size=32, rep_dim=-1)


def test_torchvision_is_imported_only_by_models_that_use_it() -> None:
    """Importing torchvision costs about 2 s a process (every CLI call, Ray worker and Flower ClientApp): the
    engine, the methods and the model registry load it only when a torchvision-based model is built."""
    import subprocess
    import sys

    code = (
        "import sys, privfl.engine, privfl.methods, privfl.models\n"
        "from privfl.models import build_model\n"
        "build_model('cnn4', in_channels=1, num_classes=10, image_size=28, rep_dim=64, mapping='ap')\n"
        "assert 'torchvision' not in sys.modules, 'torchvision imported'\n"
        "build_model('resnet-tiny', in_channels=1, num_classes=10, image_size=28, rep_dim=64, mapping='ap')\n"
        "assert 'torchvision' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
