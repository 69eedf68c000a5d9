"""Image-reconstruction metrics: agreement with skimage, the 0-255 convention, matching, LPIPS gating."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from skimage.metrics import mean_squared_error, peak_signal_noise_ratio, structural_similarity

from attacks import metrics as M


def _images(n: int, c: int, h: int = 28, w: int = 28, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, c, h, w, generator=g)


def _noisy(x: torch.Tensor, sigma: float, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (x + sigma * torch.randn(x.shape, generator=g)).clamp(0, 1)


@pytest.mark.parametrize("c", [1, 3])
def test_mse_psnr_match_skimage(c: int) -> None:
    x = _images(4, c)
    y = _noisy(x, 0.1)
    m, p = M.mse(x, y), M.psnr(x, y)
    m255, p255 = M.mse255(x, y), M.psnr255(x, y)
    assert m.shape == p.shape == m255.shape == p255.shape == (4,)
    for i in range(4):
        a, b = x[i].double().numpy(), y[i].double().numpy()
        assert m[i].item() == pytest.approx(mean_squared_error(a, b), rel=1e-12)
        assert p[i].item() == pytest.approx(peak_signal_noise_ratio(a, b, data_range=1.0), rel=1e-12)
        assert m255[i].item() == pytest.approx(mean_squared_error(a * 255, b * 255), rel=1e-12)
        assert p255[i].item() == pytest.approx(peak_signal_noise_ratio(a * 255, b * 255, data_range=255.0), rel=1e-12)
    assert torch.allclose(M.psnr(x * 255, y * 255, data_range=255.0), p)


def test_mse255_is_65025_times_mse() -> None:
    x, y = _images(3, 3), _images(3, 3, seed=5)
    assert torch.allclose(M.mse255(x, y), 65025.0 * M.mse(x, y), rtol=1e-12)


def test_per_image_psnr_mean_at_least_psnr_of_mean_mse() -> None:
    """Jensen: the paper's per-image-averaged PSNR is >= PSNR computed from the averaged MSE."""
    x = _images(8, 3)
    # very different noise levels per image make the gap obvious
    y = torch.stack([_noisy(x[i], s, seed=i) for i, s in enumerate(np.linspace(0.02, 0.6, 8))])
    per_image = M.psnr255(x, y).mean().item()
    of_mean = 10 * math.log10(255.0**2 / M.mse255(x, y).mean().item())
    assert per_image > of_mean + 0.5
    summary = M.summarize(M.score_images(y, x, with_lpips=False))
    assert summary["psnr255"] == pytest.approx(per_image)
    assert summary["mse255"] == pytest.approx(M.mse255(x, y).mean().item())


@pytest.mark.parametrize("c,size", [(1, 28), (3, 32), (3, 5), (1, 4)])
def test_ssim_matches_skimage(c: int, size: int) -> None:
    x = _images(3, c, size, size)
    y = _noisy(x, 0.15)
    s = M.ssim(x, y)
    win = 7 if size >= 7 else (size if size % 2 else size - 1)
    for i in range(3):
        a, b = x[i].double().numpy(), y[i].double().numpy()
        if c == 1:
            ref = structural_similarity(a[0], b[0], data_range=1.0, win_size=win)
        else:
            ref = structural_similarity(a.transpose(1, 2, 0), b.transpose(1, 2, 0), data_range=1.0, win_size=win, channel_axis=-1)
        assert s[i].item() == pytest.approx(ref, rel=1e-10)


def test_identical_images() -> None:
    x = _images(2, 3)
    assert torch.equal(M.mse(x, x), torch.zeros(2, dtype=torch.float64))
    assert torch.equal(M.psnr(x, x), torch.full((2,), M.PSNR_CAP_DB, dtype=torch.float64))
    assert torch.equal(M.psnr255(x, x), torch.full((2,), M.PSNR_CAP_DB, dtype=torch.float64))
    assert torch.allclose(M.ssim(x, x), torch.ones(2, dtype=torch.float64))
    s = M.summarize(M.score_images(x, x, with_lpips=False))
    assert s["psnr"] == M.PSNR_CAP_DB and s["psnr_std"] == 0.0 and s["mse"] == 0.0


def test_score_images_and_summarize_keys() -> None:
    x, y = _images(3, 1), _images(3, 1, seed=2)
    per = M.score_images(y, x, with_lpips=False)
    assert set(per) == {"mse", "psnr", "mse255", "psnr255", "ssim"}
    assert all(len(v) == 3 and all(isinstance(f, float) for f in v) for v in per.values())
    s = M.summarize(per)
    assert s["psnr"] == pytest.approx(float(np.mean(per["psnr"])))
    assert s["psnr_std"] == pytest.approx(float(np.std(per["psnr"])))


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError):
        M.mse(_images(2, 3), _images(3, 3))


def test_best_match_finds_planted_copy() -> None:
    cands = _images(10, 3, 16, 16)
    target = _noisy(cands[6], 0.05)
    idx, p = M.best_match(target, cands)
    assert idx == 6 and p.shape == (10,)
    assert p[6] == p.max() and p[6] > p[torch.arange(10) != 6].max() + 5
    idx1, p1 = M.best_match(target.unsqueeze(0), cands)
    assert idx1 == 6 and torch.equal(p, p1)


@pytest.mark.parametrize("by", ["psnr", "mse"])
def test_hungarian_match_recovers_permutation(by: str) -> None:
    truth = _images(7, 1)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(3))
    recon = _noisy(truth[perm], 0.08)  # recon i is a noisy copy of truth perm[i]
    pairs = M.hungarian_match(recon, truth, by=by)
    assert pairs == [(i, int(perm[i])) for i in range(7)]
    # fewer reconstructions than truths: one pair per reconstruction
    assert M.hungarian_match(recon[:3], truth, by=by) == [(i, int(perm[i])) for i in range(3)]


def _isolate_lpips(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """No weights anywhere: empty TORCH_HOME, no env override, no cached models."""
    home = tmp_path / "torch_home"
    home.mkdir()
    monkeypatch.setenv("TORCH_HOME", str(home))
    monkeypatch.delenv(M.LPIPS_WEIGHTS_ENV, raising=False)
    monkeypatch.setattr(M, "_LPIPS_CACHE", {})


def test_lpips_unavailable_without_weights(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    _isolate_lpips(monkeypatch, tmp_path)
    empty = tmp_path / "weights"
    empty.mkdir()
    ok, reason = M.lpips_status(str(empty))
    assert not ok
    assert "alexnet-owt-7be5be79.pth" in reason and str(empty) in reason
    assert str(tmp_path / "torch_home" / "hub" / "checkpoints") in reason
    assert M.LPIPS_WEIGHTS_ENV in reason
    x = _images(2, 3, 32, 32)
    assert M.lpips(x, x, weights_dir=str(empty)) is None
    assert "lpips" not in M.score_images(x, x, weights_dir=str(empty))
    ok, reason = M.lpips_status(str(empty), net="vgg")
    assert not ok and "vgg16-397923af.pth" in reason


def test_lpips_loading_path_with_random_backbone_file(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Checks only the loading path (file lookup, key mapping, grey/small-image handling) with a
    randomly initialised torchvision alexnet saved under the real file name; real LPIPS values need
    the real ImageNet weights, which tests never download."""
    from torchvision.models import alexnet

    _isolate_lpips(monkeypatch, tmp_path)
    wdir = tmp_path / "weights"
    wdir.mkdir()
    torch.manual_seed(0)
    net = alexnet(weights=None)
    torch.save(net.state_dict(), wdir / "alexnet-owt-7be5be79.pth")
    ok, where = M.lpips_status(str(wdir))
    assert ok and where.endswith("alexnet-owt-7be5be79.pth")

    x = _images(3, 3, 32, 32)
    y = _noisy(x, 0.2)
    d = M.lpips(x, y, weights_dir=str(wdir))
    assert d is not None and d.shape == (3,) and torch.isfinite(d).all()
    same = M.lpips(x, x, weights_dir=str(wdir))
    assert same is not None and torch.allclose(same, torch.zeros(3, dtype=torch.float64), atol=1e-6)
    # the backbone holds the file's weights, not lpips' own random init
    metric = next(iter(M._LPIPS_CACHE.values()))
    assert torch.equal(metric.model.net.slice1[0].weight, net.features[0].weight)
    assert torch.equal(getattr(metric.model.net.slice5, "10").bias, net.features[10].bias)
    # grey 28x28 (below alexnet's minimum) is repeated to 3 channels and upsampled
    g = _images(2, 1, 28, 28)
    dg = M.lpips(g, _noisy(g, 0.2), weights_dir=str(wdir))
    assert dg is not None and dg.shape == (2,) and torch.isfinite(dg).all()
    # env var is honoured too
    monkeypatch.setenv(M.LPIPS_WEIGHTS_ENV, str(wdir))
    assert M.lpips_status()[0]
    assert "lpips" in M.score_images(y, x)


def test_lpips_rejects_wrong_file(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A file under the right name that is not alexnet's state dict is an error, never random LPIPS."""
    from privfl.errors import ConfigError

    _isolate_lpips(monkeypatch, tmp_path)
    wdir = tmp_path / "weights"
    wdir.mkdir()
    torch.save({"features.0.weight": torch.zeros(3)}, wdir / "alexnet-owt-7be5be79.pth")
    with pytest.raises(ConfigError, match="does not match"):
        M.lpips(_images(1, 3, 32, 32), _images(1, 3, 32, 32), weights_dir=str(wdir))
