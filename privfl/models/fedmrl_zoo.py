"""FedMRL's CNN-1 .. CNN-5 (Yi et al., NeurIPS 2024, arXiv 2406.00488, Appendix C.1 Table 2).

Every CNN is Conv1 (5x5, 16) -> MaxPool 2x2 -> Conv2 (5x5, 16 or 32) -> MaxPool 2x2 -> FC1 -> FC2
(500) -> FC3 (classes); convs have no padding and stride 1, every conv and FC is followed by ReLU,
no BatchNorm, no dropout (as the official code). The feature extractor ends at ReLU(FC2), so the
representation is 500-dimensional (d2 = 500 in the paper); FC3 is the header.

Two uses:
- ``mrl-cnn1`` .. ``mrl-cnn5`` in :data:`~privfl.models.MODELS` are the heterogeneous client
  extractors (conv1 .. ReLU(FC2), 500-d), so the standard split (features -> RM -> head) holds; with
  ``--rep-dim 500 --mapping ap`` the RM is the identity and the head is the paper's FC3.
  Groups: ``fedmrl-cnn5`` (client k gets CNN-(k mod 5 + 1), as the official code assigns them) and
  ``fedmrl-homo-cnn1`` (every client CNN-1, the model-homogeneous setting of Table 3).
- :func:`small_model` builds FedMRL's shared homogeneous small model: one of the CNNs with FC2 = d1 and
  its own FC3 (the global header), with the parameter names ``conv1.weight`` ... ``fc3.bias`` that its
  ``small_model`` messages carry.

The names are registered when ``privfl.models`` is imported (it imports this module).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from privfl.errors import ConfigError
from privfl.models.zoo import MODEL_GROUPS, MODELS, _check_input, _cnn_flat_dim

#: Table 2: CNN-j -> (Conv2 output channels, FC1 width); Conv1 is 16 channels and FC2 500 for all.
CNN_TABLE: dict[int, tuple[int, int]] = {1: (32, 2000), 2: (16, 2000), 3: (32, 1000), 4: (32, 800), 5: (32, 500)}
#: FC2 width of every CNN, i.e. the heterogeneous representation dimension d2 of the paper
FC2_DIM = 500


class MRLConvNet(nn.Module):
    """CNN-j of Table 2 with a configurable FC2 width and an optional FC3 header.

    ``represent(x)`` is ReLU(FC2(...)) (the extractor's output, post-ReLU as in the official code);
    ``forward(x)`` applies FC3 when the net has one. Layers are named as in the paper's code so the
    small model's message tensors read ``conv1.weight`` ... ``fc3.bias``.
    """

    def __init__(self, variant: int, in_channels: int, image_size: int, rep_dim: int = FC2_DIM, num_classes: int | None = None):
        super().__init__()
        if variant not in CNN_TABLE:
            raise ConfigError(f"unknown FedMRL CNN variant {variant!r}; accepted: {', '.join(map(str, CNN_TABLE))}")
        name = f"mrl-cnn{variant}"
        _check_input(name, in_channels, image_size)
        if isinstance(rep_dim, bool) or not isinstance(rep_dim, int) or rep_dim < 1:
            raise ConfigError(f"{name}: FC2 width must be a positive integer, got {rep_dim!r}")
        c2, hidden = CNN_TABLE[variant]
        self.variant, self.rep_dim = variant, rep_dim
        #: the constructor arguments: a fresh copy of this architecture is ``MRLConvNet(**config)``
        self.config = {"variant": variant, "in_channels": in_channels, "image_size": image_size, "rep_dim": rep_dim, "num_classes": num_classes}
        self.conv1 = nn.Conv2d(in_channels, 16, kernel_size=5)
        self.conv2 = nn.Conv2d(16, c2, kernel_size=5)
        self.fc1 = nn.Linear(_cnn_flat_dim(name, image_size, c2, kernel=5, padding=0), hidden)  # 800 on 32x32 (400 for CNN-2)
        self.fc2 = nn.Linear(hidden, rep_dim)
        self.fc3 = nn.Linear(rep_dim, num_classes) if num_classes is not None else None

    def represent(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, rep_dim): the extractor output after ReLU."""
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return F.relu(self.fc2(x))

    def forward(self, x: Tensor) -> Tensor:
        rep = self.represent(x)
        return self.fc3(rep) if self.fc3 is not None else rep


def _extractor_factory(variant: int):
    def factory(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
        return MRLConvNet(variant, in_channels, image_size), FC2_DIM

    factory.__doc__ = f"FedMRL CNN-{variant} (Table 2) up to ReLU(FC2) -> {FC2_DIM}; FC3 is the split model's head."
    return factory


for _v in CNN_TABLE:
    MODELS.register(f"mrl-cnn{_v}", _extractor_factory(_v))
MODEL_GROUPS.register("fedmrl-cnn5", tuple(f"mrl-cnn{v}" for v in CNN_TABLE))
MODEL_GROUPS.register("fedmrl-homo-cnn1", ("mrl-cnn1",))


def small_model(variant: int, *, in_channels: int, image_size: int, d1: int, num_classes: int) -> MRLConvNet:
    """FedMRL's homogeneous small model G: CNN-``variant`` with FC2 = d1 and FC3 (the global header,
    R^{d1} -> R^L). The paper uses CNN-5 in the model-heterogeneous and CNN-1 in the
    model-homogeneous setting (Sec. 5.1 / App. C.1)."""
    return MRLConvNet(variant, in_channels, image_size, rep_dim=d1, num_classes=num_classes)


__all__ = ["CNN_TABLE", "FC2_DIM", "MRLConvNet", "small_model"]
