"""Backbones ("extractors" up to the penultimate vector) and model groups.

Every factory in :data:`MODELS` has the signature ``factory(in_channels, image_size)`` and returns
``(features, feature_dim)``: ``features`` maps ``(B, C, H, W)`` to a flat ``(B, feature_dim)`` vector
(after the backbone's own global pooling / flatten), i.e. the network with its classifier removed.
The classifier itself is *not* built here: :func:`privfl.models.split.build_model` appends a
representation mapping and one homogeneous ``nn.Linear(rep_dim, num_classes)`` head for every arch,
as FedRE / HtFLlib do.

All torchvision networks are built with ``weights=None`` (no network access; everything is trained
from scratch) and keep torchvision's own initialisation. When ``in_channels != 3`` the stem conv is
replaced by one with ``in_channels`` inputs (same out channels / kernel / stride / padding / bias) and
re-initialised the way that torchvision initialises the original stem, so grey and colour inputs work
with every model.

Feature dims of torchvision nets are known constants (checked by the tests with a real forward pass)
rather than measured by a dry forward, because a forward in train mode would update BatchNorm
running statistics and one in eval mode would still cost time for the big nets.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from privfl.errors import ConfigError
from privfl.registry import Registry

FeatureFactory = Callable[[int, int], tuple[nn.Module, int]]

MODELS: Registry[FeatureFactory] = Registry("model architecture", discover=["privfl.models"])
MODEL_GROUPS: Registry[tuple[str, ...]] = Registry("model group", discover=["privfl.models"])


def count_parameters(module: nn.Module) -> int:
    """Number of parameters (trainable or not) — the usual "model size" reported in papers."""
    return sum(p.numel() for p in module.parameters())


def _check_input(arch: str, in_channels: int, image_size: int) -> None:
    if not isinstance(in_channels, int) or in_channels < 1:
        raise ConfigError(f"{arch}: in_channels must be a positive integer, got {in_channels!r}")
    if not isinstance(image_size, int) or image_size < 1:
        raise ConfigError(f"{arch}: image_size must be a positive integer, got {image_size!r}")


def _replace_conv(conv: nn.Conv2d, in_channels: int) -> nn.Conv2d:
    """A copy of ``conv``'s geometry with ``in_channels`` inputs (freshly initialised by PyTorch)."""
    return nn.Conv2d(
        in_channels,
        conv.out_channels,
        kernel_size=conv.kernel_size,  # type: ignore[arg-type]
        stride=conv.stride,  # type: ignore[arg-type]
        padding=conv.padding,  # type: ignore[arg-type]
        dilation=conv.dilation,  # type: ignore[arg-type]
        groups=1,
        bias=conv.bias is not None,
        padding_mode=conv.padding_mode,
    )


# --------------------------------------------------------------------------------------------------
# Small CNNs / MLP (HtFLlib FedAvgCNN and CPU-friendly variants)
# --------------------------------------------------------------------------------------------------


def _cnn_flat_dim(arch: str, image_size: int, out_channels: int, kernel: int, padding: int) -> int:
    """Flattened size after two (conv kernel, pad) + MaxPool2d(2) stages; fails fast if too small."""
    s = image_size
    for _ in range(2):
        s = s + 2 * padding - kernel + 1
        if s < 2:
            raise ConfigError(f"{arch}: image_size {image_size} is too small for this architecture")
        s //= 2
    return out_channels * s * s


def _two_conv_cnn(arch: str, in_channels: int, image_size: int, channels: tuple[int, int], kernel: int, padding: int) -> tuple[nn.Module, int]:
    """The FedAvgCNN layout: 2x (conv + ReLU + maxpool), flatten, Linear(flat, 512) + ReLU."""
    c1, c2 = channels
    flat = _cnn_flat_dim(arch, image_size, c2, kernel, padding)
    features = nn.Sequential(
        nn.Conv2d(in_channels, c1, kernel_size=kernel, padding=padding, stride=1, bias=True),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=2),
        nn.Conv2d(c1, c2, kernel_size=kernel, padding=padding, stride=1, bias=True),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=2),
        nn.Flatten(),
        nn.Linear(flat, 512),
        nn.ReLU(inplace=True),
    )
    return features, 512


@MODELS.register("cnn4")
def cnn4(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """HtFLlib's FedAvgCNN without its final Linear(512, C), which is our head."""
    _check_input("cnn4", in_channels, image_size)
    return _two_conv_cnn("cnn4", in_channels, image_size, (32, 64), kernel=5, padding=0)


@MODELS.register("cnn4-narrow")
def cnn4_narrow(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """FedAvgCNN with 16/32 conv channels: same shape of network, cheaper on CPU."""
    _check_input("cnn4-narrow", in_channels, image_size)
    return _two_conv_cnn("cnn4-narrow", in_channels, image_size, (16, 32), kernel=5, padding=0)


@MODELS.register("cnn3x3")
def cnn3x3(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """A 3x3-conv CNN (padding 1): a different receptive-field shape from cnn4 for heterogeneity."""
    _check_input("cnn3x3", in_channels, image_size)
    return _two_conv_cnn("cnn3x3", in_channels, image_size, (16, 32), kernel=3, padding=1)


@MODELS.register("mlp")
def mlp(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """A two-hidden-layer MLP: the non-convolutional member of the CPU group."""
    _check_input("mlp", in_channels, image_size)
    features = nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_channels * image_size * image_size, 512),
        nn.ReLU(inplace=True),
        nn.Linear(512, 512),
        nn.ReLU(inplace=True),
    )
    return features, 512


def _init_resnet_like(module: nn.Module) -> None:
    """torchvision ResNet's initialisation (kaiming fan_out for convs, BN weight 1 / bias 0)."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)


@MODELS.register("resnet-tiny")
def resnet_tiny(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """A 2-block ResNet from torchvision's BasicBlock: residual + BatchNorm, yet fast on CPU."""
    from torchvision.models.resnet import BasicBlock  # torchvision imported when used (about 2 s a process)

    _check_input("resnet-tiny", in_channels, image_size)

    def down(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 1, stride=2, bias=False), nn.BatchNorm2d(cout))

    features = nn.Sequential(
        nn.Conv2d(in_channels, 16, kernel_size=3, stride=1, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        BasicBlock(16, 32, stride=2, downsample=down(16, 32)),
        BasicBlock(32, 64, stride=2, downsample=down(32, 64)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )
    _init_resnet_like(features)
    return features, 64


# --------------------------------------------------------------------------------------------------
# torchvision backbones
# --------------------------------------------------------------------------------------------------


def _resnet(name: str, dim: int) -> FeatureFactory:
    def factory(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
        _check_input(name, in_channels, image_size)
        import torchvision.models as tvm  # imported when used (about 2 s a process)

        net = getattr(tvm, name)(weights=None)
        if in_channels != 3:
            net.conv1 = _replace_conv(net.conv1, in_channels)
            nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
        net.fc = nn.Identity()
        return net, dim

    factory.__doc__ = f"torchvision {name} (weights=None) with fc removed -> {dim}."
    return factory


for _name, _dim in [
    ("resnet18", 512),
    ("resnet34", 512),
    ("resnet50", 2048),
    ("resnet101", 2048),
    ("resnet152", 2048),
]:
    MODELS.register(_name, _resnet(_name, _dim))


@MODELS.register("mobilenet_v2")
def mobilenet_v2(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """torchvision MobileNetV2 with its classifier (dropout + linear) removed -> 1280."""
    _check_input("mobilenet_v2", in_channels, image_size)
    import torchvision.models as tvm

    net = tvm.mobilenet_v2(weights=None)
    if in_channels != 3:
        stem = _replace_conv(net.features[0][0], in_channels)
        nn.init.kaiming_normal_(stem.weight, mode="fan_out")
        net.features[0][0] = stem
    net.classifier = nn.Identity()
    return net, 1280


@MODELS.register("googlenet")
def googlenet(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """torchvision GoogLeNet (no aux heads, no input transform) with dropout + fc removed -> 1024.

    The pre-fc dropout goes with the classifier (as MobileNetV2's does) so the representation that
    methods upload is the pooled vector itself.
    """
    _check_input("googlenet", in_channels, image_size)
    import torchvision.models as tvm

    net = tvm.googlenet(weights=None, aux_logits=False, init_weights=True, transform_input=False)
    if in_channels != 3:
        stem = _replace_conv(net.conv1.conv, in_channels)
        nn.init.trunc_normal_(stem.weight, mean=0.0, std=0.01, a=-2, b=2)
        net.conv1.conv = stem
    net.dropout = nn.Identity()
    net.fc = nn.Identity()
    return net, 1024


class _SqueezeFeatures(nn.Module):
    """SqueezeNet's conv trunk + global average pool (its classifier is a conv, so it is dropped)."""

    def __init__(self, trunk: nn.Module):
        super().__init__()
        self.features = trunk
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()

    def forward(self, x: Tensor) -> Tensor:
        return self.flatten(self.pool(self.features(x)))


@MODELS.register("squeezenet1_1")
def squeezenet1_1(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """torchvision SqueezeNet 1.1 trunk + global pool -> 512; very cheap on CPU."""
    _check_input("squeezenet1_1", in_channels, image_size)
    import torchvision.models as tvm

    net = tvm.squeezenet1_1(weights=None)
    if in_channels != 3:
        stem = _replace_conv(net.features[0], in_channels)
        assert stem.bias is not None  # _replace_conv keeps the original conv's bias
        nn.init.kaiming_uniform_(stem.weight)
        nn.init.constant_(stem.bias, 0)
        net.features[0] = stem
    return _SqueezeFeatures(net.features), 512


@MODELS.register("shufflenet_v2_x0_5")
def shufflenet_v2_x0_5(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """torchvision ShuffleNetV2 x0.5 up to its global mean -> 1024."""
    _check_input("shufflenet_v2_x0_5", in_channels, image_size)
    import torchvision.models as tvm

    net = tvm.shufflenet_v2_x0_5(weights=None)
    if in_channels != 3:
        # torchvision leaves ShuffleNetV2 at PyTorch's default init, which the fresh conv already has.
        net.conv1[0] = _replace_conv(net.conv1[0], in_channels)
    net.fc = nn.Identity()
    return net, 1024


class _PadToSize(nn.Module):
    """Zero-pads (B, C, s, s) symmetrically to (B, C, target, target); extra pixel goes right/bottom."""

    def __init__(self, image_size: int, target: int):
        super().__init__()
        total = target - image_size
        self.pad = (total // 2, total - total // 2, total // 2, total - total // 2)

    def forward(self, x: Tensor) -> Tensor:
        return F.pad(x, self.pad)

    def extra_repr(self) -> str:
        return f"pad={self.pad}"


def _vit(name: str, patch: int) -> FeatureFactory:
    def factory(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
        """torchvision ViT at the data resolution (FedRE spec), heads removed -> 768.

        A ViT needs ``image_size % patch == 0``. For sizes that are not (28x28 Fashion-MNIST with
        patch 16 or 32) the input is zero-padded symmetrically to the next multiple *inside*
        ``features`` and the ViT is built for the padded size, so callers always feed native-size
        images and the padding is part of the architecture (it is in ``spec`` via image_size).
        """
        _check_input(name, in_channels, image_size)
        padded = math.ceil(image_size / patch) * patch
        import torchvision.models as tvm  # imported when used (about 2 s a process)

        net = getattr(tvm, name)(weights=None, image_size=padded)
        if in_channels != 3:
            stem = _replace_conv(net.conv_proj, in_channels)
            fan_in = stem.in_channels * stem.kernel_size[0] * stem.kernel_size[1]
            assert stem.bias is not None  # _replace_conv keeps the original conv's bias
            nn.init.trunc_normal_(stem.weight, std=math.sqrt(1 / fan_in))
            nn.init.zeros_(stem.bias)
            net.conv_proj = stem
        net.heads = nn.Identity()
        if padded != image_size:
            return nn.Sequential(_PadToSize(image_size, padded), net), 768
        return net, 768

    return factory


MODELS.register("vit_b_16", _vit("vit_b_16", 16))
MODELS.register("vit_b_32", _vit("vit_b_32", 32))


# --------------------------------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------------------------------

MODEL_GROUPS.register(
    "htm10",
    (
        "cnn4",
        "mobilenet_v2",
        "googlenet",
        "resnet18",
        "resnet34",
        "resnet50",
        "resnet101",
        "resnet152",
        "vit_b_16",
        "vit_b_32",
    ),
)
MODEL_GROUPS.register(
    "htfe8",
    ("cnn4", "googlenet", "mobilenet_v2", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152"),
)
# The quick CPU default: five different architectures (two conv nets, an MLP, a BatchNorm ResNet built
# from torchvision blocks, and HtFLlib's exact 4-layer CNN), about 4 minutes per 20 rounds of the full
# Fashion-MNIST on 2 cores. squeezenet1_1 was tried and dropped: at the papers' lr 0.06 it collapsed
# to one class on some Dir(0.1) clients even in Local training.
MODEL_GROUPS.register("cpu5", ("cnn4-narrow", "mlp", "cnn3x3", "resnet-tiny", "cnn4"))
MODEL_GROUPS.register("homo-cnn4", ("cnn4",))
MODEL_GROUPS.register("homo-resnet18", ("resnet18",))
# the quick homogeneous group with BatchNorm (FedBN keeps BN layers local; FedRep/DFedPGP split body and head)
MODEL_GROUPS.register("homo-resnet-tiny", ("resnet-tiny",))


def assign_archs(group: str, num_clients: int) -> list[str]:
    """Round-robin over the group (client i gets ``group[i % len]``), as HtFLlib assigns models."""
    archs = MODEL_GROUPS.get(group)
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ConfigError(f"num_clients must be a positive integer, got {num_clients!r}")
    return [archs[i % len(archs)] for i in range(num_clients)]


def _check_groups() -> None:
    """Every group member must be a registered arch (caught at import, not mid-experiment)."""
    for g in MODEL_GROUPS:
        for a in MODEL_GROUPS.get(g):
            MODELS.get(a)


_check_groups()

__all__ = ["MODELS", "MODEL_GROUPS", "assign_archs", "count_parameters"]
