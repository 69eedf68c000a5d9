"""The classic gradient-leakage victim: DLG's LeNet with sigmoid activations (Zhu et al., NeurIPS 2019).

Conv(C->12, k5, s2) -> Sigmoid -> Conv(12->12, k5, s2) -> Sigmoid -> Conv(12->12, k5, s1) -> Sigmoid ->
Linear(12*(H/4)*(W/4) -> classes), padding k//2, no pooling and no BatchNorm, every weight and bias
drawn from U(-0.5, 0.5) as in DLG's ``weights_init``. Smooth activations make the gradient map
nearly invertible, which is why it is the maximal-leakage reference.
"""

from __future__ import annotations

import torch
from torch import nn


class SigmoidLeNet(nn.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 32):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 12, 5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, 5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, 5, padding=2, stride=1),
            nn.Sigmoid(),
        )
        side = -(-image_size // 4)
        self.fc = nn.Linear(12 * side * side, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x).flatten(1))

    @torch.no_grad()
    def init_uniform(self, generator: torch.Generator, bound: float = 0.5) -> SigmoidLeNet:
        for p in self.parameters():
            p.copy_(torch.rand(p.shape, generator=generator) * 2 * bound - bound)
        return self
