"""FedFree's model set (Du et al., NeurIPS 2025, Table A1): its 5-layer CNN and CIFAR-style ResNets.

The paper names the architectures but not the CNN's widths; privfl's
choice (conv 3x3 32 -> 64, each + ReLU + MaxPool2, fc 768 -> 128 -> C) gives 3.27M
parameters on CIFAR-10, the paper's "≈3.2M". The paper's ResNet counts (11.2M/21.3M/23.5M/42.5M/58.2M)
are those of CIFAR ResNets (3x3 stride-1 stem, no max-pool), built here from torchvision's own blocks
(weights=None, torchvision initialisation). GoogLeNet and MobileNetV2 are the zoo's torchvision models
(MobileNetV2 is 3.5M as in the paper; GoogLeNet 6.6M vs the paper's 6.8M).

Groups:
- ``fedfree8``: the paper's eight architectures round-robin (all eight appear at N >= 8);
- ``fedfree8-random``: a seeded uniform draw (numpy seed 0) of 100 architectures from the same eight,
  the paper's "randomly assigning one architecture to each client" (client i gets draw i);
- ``fedfree-homo``: the CNN only (HmFL; the global model has the same architecture).
"""

from __future__ import annotations

import numpy as np
from torch import nn

from privfl.models.zoo import MODEL_GROUPS, MODELS, _check_input, _cnn_flat_dim


@MODELS.register("fedfree-cnn")
def fedfree_cnn(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """FedFree's Model_1 / global model up to fc2 (-> 128); the head Linear(128, C) is its fc3."""
    _check_input("fedfree-cnn", in_channels, image_size)
    flat = _cnn_flat_dim("fedfree-cnn", image_size, 64, kernel=3, padding=1)
    features = nn.Sequential(
        nn.Conv2d(in_channels, 32, kernel_size=3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(flat, 768),
        nn.ReLU(inplace=True),
        nn.Linear(768, 128),
        nn.ReLU(inplace=True),
    )
    return features, 128


def _cifar_resnet(name: str, dim: int):
    def factory(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
        _check_input(f"cifar-{name}", in_channels, image_size)
        import torchvision.models as tvm  # imported when used (about 2 s a process)

        net = getattr(tvm, name)(weights=None)
        # CIFAR stem (kuangliu/pytorch-cifar): 3x3 stride 1, no max-pool; torchvision's stem init
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
        net.maxpool = nn.Identity()
        net.fc = nn.Identity()
        return net, dim

    factory.__doc__ = f"CIFAR-style {name} (3x3 stride-1 stem, no max-pool), fc removed -> {dim}."
    return factory


for _name, _dim in [("resnet18", 512), ("resnet34", 512), ("resnet50", 2048), ("resnet101", 2048), ("resnet152", 2048)]:
    MODELS.register(f"cifar-{_name}", _cifar_resnet(_name, _dim))

FEDFREE8 = ("fedfree-cnn", "cifar-resnet18", "cifar-resnet34", "cifar-resnet50", "cifar-resnet101", "cifar-resnet152", "googlenet", "mobilenet_v2")

MODEL_GROUPS.register("fedfree8", FEDFREE8)
MODEL_GROUPS.register("fedfree8-random", tuple(FEDFREE8[i] for i in np.random.default_rng(0).integers(0, len(FEDFREE8), 100)))
MODEL_GROUPS.register("fedfree-homo", ("fedfree-cnn",))

__all__ = ["FEDFREE8"]
