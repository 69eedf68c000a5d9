"""Deep-image-prior representation inversion (Ulyanov, Vedaldi, Lempitsky, CVPR 2018).

An untrained encoder-decoder ``G`` with skip connections is optimised, from a fixed noise input ``z``,
so that the attacked extractor maps ``G(z)`` onto the target representation: the network's structure
is the only image prior. The generator is the DIP authors' feature-inversion skip net (input depth 32,
channels 16-32-64-128-128-128, skip 4, filters 7-7-5-5-3-3, average-pool downsampling, LeakyReLU, zero
padding, sigmoid output, z ~ U(0,1)*0.1 fixed, MSE in feature space). The FedRE papers give none of
these (FedRE, CVPR 2026, Sec. 4.2 Q2; docs/decisions.md). Three defaults differ from the DIP authors' setting
(:data:`PAPER_SETTINGS`: nearest upsampling, Adam lr 1e-3, 3100 steps) because privfl's ablation
(``python -m experiments.papers.fedre.dip_ablation``, docs/attacks.md) measured a much faster route to a higher PSNR on
FedRE's representations: bilinear upsampling with Adam lr 3e-2 passes the paper setting's 3100-step
PSNR within 100-250 steps, and 1000 steps (the default, where the measured PSNR-vs-steps curves
flatten) end 2-6 dB above it at a third of the time.

Several targets are inverted together by running B independent generators as ONE network whose
convolutions have ``groups=B`` (BatchNorm is per channel, so per generator): each generator sees only
its own target, starts from its own seed's initialisation and noise exactly as it would alone, and the
loss is a sum over targets, so no generator's gradient depends on another target. Batched and
one-at-a-time runs are therefore the same attack; their trajectories still drift apart after a few
steps because Adam's normalised update turns float rounding on near-zero gradients into full steps.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from privfl.errors import ConfigError


@dataclass
class DIPConfig:
    """Generator and optimisation settings; recorded with every result."""

    steps: int = 1000  # the DIP authors' 3100 in PAPER_SETTINGS
    lr: float = 3e-2  # the DIP authors' 1e-3 in PAPER_SETTINGS
    optimizer: str = "adam"
    input_depth: int = 32
    channels_down: tuple[int, ...] = (16, 32, 64, 128, 128, 128)
    channels_up: tuple[int, ...] = (16, 32, 64, 128, 128, 128)
    channels_skip: tuple[int, ...] = (4, 4, 4, 4, 4, 4)
    filters_down: tuple[int, ...] = (7, 7, 5, 5, 3, 3)
    filters_up: tuple[int, ...] = (7, 7, 5, 5, 3, 3)
    input_noise: float = 0.1  # z ~ U(0, 1) * input_noise (DIP's get_noise(..., var=1/10))
    reg_noise_std: float = 0.0  # fresh N(0, std) added to z every step (DIP's noise regularisation)
    tv_weight: float = 0.0  # optional total-variation prior on G(z)
    leaky_slope: float = 0.2
    #: how a level halves the resolution: ``avg`` (2x2 average pool after the first conv, as the DIP
    #: feature-inversion setting) or ``stride`` (the first conv has stride 2: DIP's ``skip()`` default)
    downsample: str = "avg"
    #: ``bilinear`` (DIP's inpainting and super-resolution settings) or ``nearest`` (its feature inversion)
    upsample: str = "bilinear"
    padding: str = "zeros"  # zeros or reflect (DIP's ``pad='reflection'``) for every k>1 convolution
    #: True: pad the image to the next power of two and crop the output (28 -> 32 px); False: generate at
    #: the native size (28 -> 14 -> 7 ...; each upsampling returns to the size of its skip input)
    pad_to_power_of_two: bool = True
    double: bool = False  # float64 (DIP README: optimisation may not converge on some GPUs)
    cudnn: bool = True  # turn off to avoid non-deterministic cuDNN kernels
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, accepted in (("downsample", ("avg", "stride")), ("upsample", ("nearest", "bilinear")), ("padding", ("zeros", "reflect"))):
            if getattr(self, key) not in accepted:
                raise ConfigError(f"DIP {key} must be one of {', '.join(accepted)}, got {getattr(self, key)!r}")

    def canvas(self, height: int, width: int) -> int:
        """The square size the generator works at: the image's, or the next power of two."""
        side = max(height, width)
        return 2 ** math.ceil(math.log2(side)) if self.pad_to_power_of_two else side

    def depth_for(self, size: int) -> int:
        """Levels used for a ``size`` input. Each level halves the resolution; like DIP's 6 levels on a
        256 input we stop at about 4x4, so small images get fewer levels (32 px: 3, 64 px: 4; a native
        28 px canvas: 3, down to 4x4 with strided convolutions, 3x3 with average pooling)."""
        return max(1, min(len(self.channels_down), math.ceil(math.log2(size / 4))))

    def as_dict(self) -> dict:
        return asdict(self)


#: the DIP authors' feature-inversion optimisation (Ulyanov et al. 2018): what ``--settings paper`` and
#: the audit's ``paper`` profile use instead of privfl's defaults
PAPER_SETTINGS: dict[str, object] = {"steps": 3100, "lr": 1e-3, "upsample": "nearest"}


class _GroupConcat(nn.Module):
    """Concatenate two grouped feature maps generator by generator (not block by block)."""

    def __init__(self, groups: int):
        super().__init__()
        self.groups = groups

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        n, _, h, w = a.shape
        g = self.groups
        return torch.cat([a.view(n, g, -1, h, w), b.view(n, g, -1, h, w)], dim=2).view(n, -1, h, w)


class _Level(nn.Module):
    """One scale of the skip net: skip branch beside (down, deeper, up), concat, then up-convs."""

    def __init__(self, cfg: DIPConfig, i: int, depth: int, in_ch: int, groups: int):
        super().__init__()
        g = groups
        act = lambda: nn.LeakyReLU(cfg.leaky_slope, inplace=True)  # noqa: E731
        down, up, skip = cfg.channels_down[i], cfg.channels_up[i], cfg.channels_skip[i]
        kd, ku = cfg.filters_down[i], cfg.filters_up[i]
        pad: Literal["zeros", "reflect"] = "reflect" if cfg.padding == "reflect" else "zeros"
        self.upsample = cfg.upsample
        self.skip = nn.Sequential(nn.Conv2d(g * in_ch, g * skip, 1, groups=g), nn.BatchNorm2d(g * skip), act()) if skip else None
        if cfg.downsample == "stride":
            halve: list[nn.Module] = [nn.Conv2d(g * in_ch, g * down, kd, stride=2, padding=kd // 2, padding_mode=pad, groups=g)]
        else:
            halve = [nn.Conv2d(g * in_ch, g * down, kd, padding=kd // 2, padding_mode=pad, groups=g), nn.AvgPool2d(2)]
        self.down = nn.Sequential(
            *halve,
            nn.BatchNorm2d(g * down),
            act(),
            nn.Conv2d(g * down, g * down, kd, padding=kd // 2, padding_mode=pad, groups=g),
            nn.BatchNorm2d(g * down),
            act(),
        )
        self.deeper = _Level(cfg, i + 1, depth, down, groups) if i + 1 < depth else None
        deeper_out = cfg.channels_up[i + 1] if i + 1 < depth else down
        self.concat = _GroupConcat(groups)
        self.up = nn.Sequential(
            nn.BatchNorm2d(g * (skip + deeper_out)),
            nn.Conv2d(g * (skip + deeper_out), g * up, ku, padding=ku // 2, padding_mode=pad, groups=g),
            nn.BatchNorm2d(g * up),
            act(),
            nn.Conv2d(g * up, g * up, 1, groups=g),
            nn.BatchNorm2d(g * up),
            act(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(x)
        if self.deeper is not None:
            y = self.deeper(y)
        if self.upsample == "bilinear":
            y = F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)
        else:
            y = F.interpolate(y, size=x.shape[-2:], mode="nearest")
        if self.skip is not None:
            y = self.concat(self.skip(x), y)
        return self.up(y)


class SkipGenerator(nn.Module):
    """``groups`` independent DIP skip generators in one module; output (groups, out_ch, H, W) in [0,1]."""

    def __init__(self, cfg: DIPConfig, out_channels: int, size: int, groups: int = 1):
        super().__init__()
        self.groups, self.out_channels = groups, out_channels
        depth = cfg.depth_for(size)
        for name in ("channels_up", "channels_skip", "filters_down", "filters_up"):
            if len(getattr(cfg, name)) < depth:
                raise ConfigError(f"DIP {name} needs at least {depth} entries")
        self.body = _Level(cfg, 0, depth, cfg.input_depth, groups)
        self.out = nn.Conv2d(groups * cfg.channels_up[0], groups * out_channels, 1, groups=groups)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(self.out(self.body(z)))  # (1, G*C, H, W)
        return y.view(self.groups, self.out_channels, *y.shape[-2:])

    @torch.no_grad()
    def load_member(self, index: int, single: SkipGenerator) -> None:
        """Copy a one-generator network's parameters into slot ``index`` (same layout, per-channel slices)."""
        for mine, theirs in zip(self.modules(), single.modules(), strict=True):
            if isinstance(mine, (nn.Conv2d, nn.BatchNorm2d)):
                for name, tensor in list(theirs.named_parameters(recurse=False)) + list(theirs.named_buffers(recurse=False)):
                    target = getattr(mine, name)
                    if tensor.dim() == 0:  # BatchNorm's step counter
                        target.copy_(tensor)
                        continue
                    n = tensor.shape[0]
                    target[index * n : (index + 1) * n].copy_(tensor)


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Anisotropic TV per image, (B,)."""
    return (x[..., 1:, :] - x[..., :-1, :]).abs().flatten(1).mean(1) + (x[..., :, 1:] - x[..., :, :-1]).abs().flatten(1).mean(1)


@dataclass
class InversionResult:
    images: torch.Tensor  # (B, C, H, W) in [0, 1]
    feature_loss: torch.Tensor  # (B,) final MSE between extractor(G(z)) and the target
    seconds: float
    steps: int
    #: images after the steps asked for with ``snapshot_steps`` (a PSNR-vs-steps curve from one run)
    snapshots: dict[int, torch.Tensor] = field(default_factory=dict)


def invert(
    represent: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    image_shape: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    cfg: DIPConfig,
    seeds: Sequence[int],
    *,
    device: torch.device | str = "cpu",
    progress: Callable[[int, float], None] | None = None,
    snapshot_steps: Sequence[int] = (),
) -> InversionResult:
    """Invert ``targets`` (B, d) through the frozen ``represent`` (normalised images -> (B, d)).

    ``seeds[b]`` fixes generator b's initialisation and noise input, whatever the batch it is in.
    ``snapshot_steps``: also keep G(z) after each of these many steps (they do not change the run).
    """
    import time

    channels, height, width = image_shape
    size = cfg.canvas(height, width)  # the net halves `depth` times: by default on a power-of-2 canvas
    dtype = torch.float64 if cfg.double else torch.float32
    b = len(targets)
    if len(seeds) != b:
        raise ValueError("one seed per target")
    net = SkipGenerator(cfg, channels, size, groups=b)
    zs = []
    for i, seed in enumerate(seeds):
        gen = torch.Generator().manual_seed(int(seed))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            net.load_member(i, SkipGenerator(cfg, channels, size, groups=1))
        zs.append(torch.rand(cfg.input_depth, size, size, generator=gen) * cfg.input_noise)
    net = net.to(device=device, dtype=dtype)
    z = torch.cat(zs).unsqueeze(0).to(device=device, dtype=dtype)  # (1, B*input_depth, size, size)
    target = targets.to(device=device, dtype=dtype)
    mean_t = torch.tensor(mean, device=device, dtype=dtype).view(1, -1, 1, 1)
    std_t = torch.tensor(std, device=device, dtype=dtype).view(1, -1, 1, 1)
    top, left = (size - height) // 2, (size - width) // 2
    if cfg.optimizer == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    else:
        raise ConfigError(f"unknown DIP optimizer {cfg.optimizer!r}; accepted: adam")
    # one noise stream per target, from its own seed: a target's reconstruction does not depend on the batch it is in
    noise_gens = [torch.Generator(device=device).manual_seed(int(seed) ^ 0x5EED) for seed in seeds]
    member_shape = (cfg.input_depth, size, size)
    cudnn = torch.backends.cudnn.flags(enabled=False) if not cfg.cudnn else contextlib.nullcontext()
    snapshots: dict[int, torch.Tensor] = {}
    start = time.perf_counter()
    with cudnn:
        for step in range(cfg.steps):
            net_in = z
            if cfg.reg_noise_std > 0:
                noise = torch.cat([torch.randn(member_shape, generator=g, device=device, dtype=dtype) for g in noise_gens]).unsqueeze(0)
                net_in = z + noise * cfg.reg_noise_std
            images = net(net_in)[:, :, top : top + height, left : left + width]  # (B, C, H, W) in [0,1]
            reps = represent((images - mean_t) / std_t)  # (B, d)
            per_target = ((reps - target) ** 2).mean(dim=1)
            loss = per_target.sum()  # a sum keeps every generator's gradient its own
            if cfg.tv_weight > 0:
                loss = loss + cfg.tv_weight * total_variation(images).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if progress is not None:
                progress(step, float(per_target.detach().mean()))
            if step + 1 in snapshot_steps:
                with torch.no_grad():
                    snapshots[step + 1] = net(z)[:, :, top : top + height, left : left + width].detach().float().cpu()
        with torch.no_grad():
            images = net(z)[:, :, top : top + height, left : left + width]
            per_target = ((represent((images - mean_t) / std_t) - target) ** 2).mean(dim=1)
    seconds = time.perf_counter() - start
    return InversionResult(images.detach().float().cpu(), per_target.detach().float().cpu(), seconds, cfg.steps, snapshots)
