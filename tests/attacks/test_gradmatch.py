"""Gradient matching with linear layers factored (attacks.gradmatch): the same objective as the
materialised one, in value and in gradient, on both of gradient leakage's paths (autograd for one
target, torch.func + vmap for many)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attacks.gradleak import GradLeakConfig, functional_gradient, leak, leak_batch, model_gradient
from attacks.gradmatch import LinearTap, Observed, distance, find_linear_taps, low_rank, observe
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


@pytest.mark.parametrize("rtol", [0.0, 1e-6], ids=["full-G", "low-rank-G"])
@pytest.mark.parametrize("cosine", [False, True], ids=["squared", "cosine"])
def test_factored_objective_equals_the_materialised_one(setting, cosine, rtol):
    model, names, target, taps = setting
    if rtol:  # fc (48 x 64, two rows: rank 2) and mix (two calls: rank 4) have factors; head (5 x 48) is too narrow
        assert sorted(observe(target, names, taps, rtol).low_u) == ["fc.weight", "mix.weight"]
    params = dict(model.named_parameters())
    x = torch.randn(2, 1, 6, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y_logit = torch.randn(2, 5, generator=torch.Generator().manual_seed(2), requires_grad=True)
    out = []
    no_taps: list[LinearTap] = []
    for t in (no_taps, taps):
        loss = distance(model_gradient(model, params, x, F.softmax(y_logit, 1), taps=t), observe(target, names, t, rtol), cosine)
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

    losses = torch.func.vmap(per_problem)(xs, Observed.stack([observe(target, names, taps, rtol), observe(scaled, names, taps, rtol)]))
    (gxs,) = torch.autograd.grad(losses.sum(), [xs])
    assert torch.allclose(losses[0], l0, rtol=1e-5) and torch.allclose(gxs[0], gx0, rtol=1e-4, atol=1e-7)
    plain = distance(model_gradient(model, params, x, y_soft), observe(scaled, names), cosine)
    assert torch.allclose(losses[1], plain, rtol=1e-5)


def test_low_rank_finds_the_rank_of_a_gradient_and_refuses_noise():
    """A float32 sum of r outer products (a victim's gradient on r samples) factors at rank r within the
    tolerance, the same factors every time; noise of a DP defense, a too narrow matrix, a NaN and rtol 0
    give None."""
    gen = torch.Generator().manual_seed(0)
    for r in (1, 3):
        g = (torch.randn(96, r, generator=gen) @ torch.randn(r, 200, generator=gen)).double()
        factors = low_rank(g, 1e-6)
        assert factors is not None
        u, v = factors
        assert u.shape == (96, r) and v.shape == (200, r)
        assert torch.linalg.matrix_norm(g - u @ v.T) <= 1e-6 * torch.linalg.matrix_norm(g)
        again = low_rank(g, 1e-6)
        assert again is not None and torch.equal(again[0], u) and torch.equal(again[1], v)
    noised = g + 1e-4 * g.abs().mean() * torch.randn(96, 200, generator=gen, dtype=torch.float64)
    assert low_rank(noised, 1e-6) is None and low_rank(noised, 1e-2) is not None  # a loose tolerance takes it
    assert low_rank(g, 0.0) is None and low_rank(g[:7], 1e-6) is None and low_rank(g * float("nan"), 1e-6) is None
    wide = (torch.randn(96, 20, generator=gen) @ torch.randn(20, 200, generator=gen)).double()
    assert low_rank(wide, 1e-6) is None  # rank 20 > 96 / 8: the factors would save little


def test_problems_without_factors_make_the_stack_match_every_problem_through_g(setting):
    """Stacking a target that has factors with a noised one that has none: every problem is matched through
    its own G, with the loss each has alone."""
    model, names, target, taps = setting
    gen = torch.Generator().manual_seed(5)
    noised = {n: v + 1e-3 * v.abs().mean() * torch.randn(v.shape, generator=gen) for n, v in target.items()}
    one, other = observe(target, names, taps, 1e-6), observe(noised, names, taps, 1e-6)
    assert one.low_u and not other.low_u
    stacked = Observed.stack([one, other])
    assert not stacked.low_u and sorted(stacked.gram) == sorted(n for n in one.gram_sq)
    both = Observed.stack([one, one])
    assert sorted(both.low_u) == sorted(one.low_u) and "fc.weight" not in both.gram
    params = {n: p.detach() for n, p in model.named_parameters()}
    x = torch.randn(2, 1, 6, 6, generator=gen)
    y_soft = F.softmax(torch.randn(2, 5, generator=gen), 1)

    def per_problem(tp: Observed) -> torch.Tensor:
        return distance(functional_gradient(model, params, names, x, y_soft, 1, 0.1, taps), tp, False)

    losses = torch.func.vmap(per_problem)(stacked)
    live = dict(model.named_parameters())
    alone = [distance(model_gradient(model, live, x, y_soft, taps=taps), o, False).detach() for o in (one, other)]
    assert torch.allclose(losses, torch.stack(alone), rtol=1e-5)
    assert torch.allclose(torch.func.vmap(per_problem)(stacked.rows(torch.tensor([1]))), alone[1].view(1), rtol=1e-5)

    # a one-sample target (rank 1) beside the two-sample one (rank 2): its factors are padded with a zero column
    x1, y1 = torch.randn(1, 1, 6, 6, generator=gen), torch.tensor([4])
    single = observe(
        {n: g.detach() for n, g in zip(live, torch.autograd.grad(F.cross_entropy(model(x1), y1), list(live.values())))}, names, taps, 1e-6
    )
    assert single.low_u["fc.weight"].shape[-1] == 1 and one.low_u["fc.weight"].shape[-1] == 2
    mixed = Observed.stack([single, one])
    assert mixed.low_u["fc.weight"].shape[-1] == 2 and "fc.weight" not in mixed.gram
    alone_mixed = torch.stack([distance(model_gradient(model, live, x, y_soft, taps=taps), o, False).detach() for o in (single, one)])
    assert torch.allclose(torch.func.vmap(per_problem)(mixed), alone_mixed, rtol=1e-5)


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
