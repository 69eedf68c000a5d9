"""Gradient matching with linear layers factored (attacks.gradmatch): the same objective as the
materialised one, in value and in gradient, on both of gradient leakage's paths (autograd for one
target, torch.func + vmap for many)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attacks.gradleak import GradLeakConfig, functional_gradient, leak, leak_batch, model_gradient
from attacks.gradmatch import LinearTap, Observed, distance, find_linear_taps, observe
from attacks.metrics import psnr


class Net(nn.Module):
    """A convolution, a linear layer followed by an in-place ReLU, one linear layer called twice and
    a pair of linear layers sharing one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(64, 48)
        self.mix = nn.Linear(48, 48)
        self.head = nn.Linear(48, 5)
        self.tied = nn.Linear(5, 5)
        self.tied_again = nn.Linear(5, 5)
        self.tied_again.weight = self.tied.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc(self.conv(x).flatten(1)), inplace=True)
        h = self.mix(torch.tanh(self.mix(h)))
        return self.tied_again(torch.tanh(self.tied(self.head(h))))


@pytest.fixture(scope="module")
def setting():
    torch.manual_seed(0)
    model = Net().eval()
    names = [n for n, _ in model.named_parameters()]
    x_true, y_true = torch.randn(2, 1, 6, 6), torch.tensor([1, 3])
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(F.cross_entropy(model(x_true), y_true), list(params.values()))
    target = {n: g.detach() for n, g in zip(params, grads)}
    taps = find_linear_taps(model, names, torch.zeros(2, 1, 6, 6))
    return model, names, target, taps


def test_taps_are_the_layers_whose_gradient_is_one_product(setting):
    model, names, _, taps = setting
    assert [(t.path, t.out_shapes) for t in taps] == [("fc", ((2, 48),)), ("mix", ((2, 48), (2, 48))), ("head", ((2, 5),))]
    assert find_linear_taps(model, names, torch.zeros(2, 1, 6, 6), local_steps=2) == []  # an unrolled update is not A^T X
    assert [t.path for t in find_linear_taps(model, names, torch.zeros(2, 1, 6, 6), min_weights=64 * 48)] == ["fc"]
    assert [t.path for t in find_linear_taps(model, names, torch.zeros(8, 1, 6, 6))] == ["fc", "mix"]  # head: 8 rows >= 5 outputs
    assert [t.path for t in find_linear_taps(model, ["fc.bias", "head.weight"], torch.zeros(2, 1, 6, 6))] == ["head"]

    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    assert find_linear_taps(nn.Sequential(Scaled(16, 16)), ["0.weight"], torch.zeros(1, 16)) == []  # its own forward


@pytest.mark.parametrize("cosine", [False, True], ids=["squared", "cosine"])
def test_factored_objective_equals_the_materialised_one(setting, cosine):
    model, names, target, taps = setting
    params = dict(model.named_parameters())
    x = torch.randn(2, 1, 6, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y_logit = torch.randn(2, 5, generator=torch.Generator().manual_seed(2), requires_grad=True)
    out = []
    no_taps: list[LinearTap] = []
    for t in (no_taps, taps):
        loss = distance(model_gradient(model, params, x, F.softmax(y_logit, 1), taps=t), observe(target, names, t), cosine)
        out.append((loss.detach(), *torch.autograd.grad(loss, [x, y_logit])))
    (l0, gx0, gy0), (l1, gx1, gy1) = out
    assert l1.dtype == l0.dtype == torch.float32
    assert torch.allclose(l1, l0, rtol=1e-5) and torch.allclose(gx1, gx0, rtol=1e-4, atol=1e-7) and torch.allclose(gy1, gy0, rtol=1e-4, atol=1e-7)

    # the torch.func path, vmapped over two problems (the second target scaled), agrees with it
    state = {n: p.detach() for n, p in params.items()}
    xs = torch.stack([x.detach(), x.detach()]).requires_grad_(True)
    scaled = {n: 2 * v for n, v in target.items()}
    y_soft = F.softmax(y_logit.detach(), 1)

    def per_problem(xp: torch.Tensor, tp: Observed) -> torch.Tensor:
        return distance(functional_gradient(model, state, names, xp, y_soft, 1, 0.1, taps), tp, cosine)

    losses = torch.func.vmap(per_problem)(xs, Observed.stack([observe(target, names, taps), observe(scaled, names, taps)]))
    (gxs,) = torch.autograd.grad(losses.sum(), [xs])
    assert torch.allclose(losses[0], l0, rtol=1e-5) and torch.allclose(gxs[0], gx0, rtol=1e-4, atol=1e-7)
    plain = distance(model_gradient(model, params, x, y_soft), observe(scaled, names), cosine)
    assert torch.allclose(losses[1], plain, rtol=1e-5)


def test_without_taps_the_objective_is_the_materialised_sum(setting):
    """No factored layer: the same operations as before factoring existed (sum in name order)."""
    model, names, target, _ = setting
    params = dict(model.named_parameters())
    x = torch.randn(2, 1, 6, 6, generator=torch.Generator().manual_seed(3))
    dummy = model_gradient(model, params, x, F.one_hot(torch.tensor([0, 2]), 5).float())
    expected = sum((dummy[n] - target[n]).pow(2).sum() for n in names)
    assert torch.equal(distance(dummy, observe(target, names), cosine=False), expected)


def test_dlg_with_a_factored_layer_rebuilds_the_input():
    """DLG through a sigmoid MLP whose first layer is factored: one image (leak) and two together
    (leak_batch) come back to > 30 dB, as they do materialised."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 96), nn.Sigmoid(), nn.Linear(96, 4))
    images = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(4))
    labels = torch.tensor([1, 2])
    params = dict(model.named_parameters())
    targets = []
    for i in range(2):
        g = torch.autograd.grad(F.cross_entropy(model((images[i : i + 1] - 0.5) / 0.5), labels[i : i + 1]), list(params.values()))
        targets.append({n: v.detach() for n, v in zip(params, g)})
    cfg = GradLeakConfig.preset("dlg", steps=12, factor_min_weights=0)
    assert [t.path for t in find_linear_taps(model, list(params), torch.zeros(1, 1, 8, 8))] == ["1", "3"]
    one = leak(model, targets[0], (1, 8, 8), 4, cfg, seed=0)
    both = leak_batch(model, targets, (1, 8, 8), 4, cfg, seeds=[0, 1])
    for r, i in [(one, 0), (both[0], 0), (both[1], 1)]:
        assert psnr((r.images * 0.5 + 0.5).clamp(0, 1), images[i : i + 1]).item() > 30
        assert r.labels.tolist() == [labels[i].item()]


def test_a_layer_called_more_often_than_counted_is_a_clear_error():
    class Repeats(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.times = 1

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(self.times):
                x = self.fc(x)
            return x

    model = Repeats()
    taps = find_linear_taps(model, ["fc.weight", "fc.bias"], torch.zeros(1, 16))
    model.times = 2
    with pytest.raises(RuntimeError, match=r"ran more often.*factor_linear=False"):
        model_gradient(model, dict(model.named_parameters()), torch.randn(1, 16), torch.full((1, 16), 1 / 16), taps=taps)
