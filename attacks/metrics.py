"""Image-reconstruction metrics shared by representation inversion and gradient leakage.

Every function takes float tensors of images in ``[0, 1]`` with shape ``(N, C, H, W)`` (``C`` = 1 or
3); callers undo the data normalisation (and clamp reconstructions) first, so that numbers from
different datasets and attacks are on one scale. Values are not clipped here: clipping silently would
hide a caller that forgot to denormalise. Results are per image, as CPU ``float64`` tensors, so that
means, spreads and worst cases can all be derived from them.

Two scales are offered because published numbers use both:

* ``mse`` / ``psnr`` on the ``[0, 1]`` scale (the usual convention in gradient-leakage papers);
* ``mse255`` / ``psnr255`` on the ``0-255`` scale, the FedRE paper's convention (MSE in the
  thousands). PSNR does not depend on the scale, so ``psnr255 == psnr``; what matters for comparing
  with that paper is that PSNR is computed *per image and then averaged* (see :func:`summarize`),
  not derived from the averaged MSE: the reported 12.89 dB / 4514.91 pair only fits the former.

LPIPS is computed only with real ImageNet backbone weights found on disk (never downloaded, never a
random backbone); otherwise :func:`lpips` returns ``None`` and :func:`lpips_status` says which file is
missing and where to put it.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import Tensor

from privfl.errors import ConfigError

PSNR_CAP_DB = 100.0
"""PSNR reported for identical images (MSE 0) and upper bound for all PSNR values, so that means
over images stay finite; 100 dB is far above anything a reconstruction attack reaches."""

LPIPS_WEIGHTS_ENV = "PRIVFL_LPIPS_WEIGHTS"

# lpips net name -> (torchvision architecture, file name torchvision's downloader uses, smallest side
# the lpips feature slices accept; smaller images are upsampled to it).
_BACKBONES: dict[str, tuple[str, str, int]] = {
    "alex": ("alexnet", "alexnet-owt-7be5be79.pth", 32),
    "vgg": ("vgg16", "vgg16-397923af.pth", 16),
    "squeeze": ("squeezenet1_1", "squeezenet1_1-b8a52dc0.pth", 17),
}
_NET_ALIASES = {
    "alex": "alex",
    "alexnet": "alex",
    "vgg": "vgg",
    "vgg16": "vgg",
    "squeeze": "squeeze",
    "squeezenet": "squeeze",
    "squeezenet1_1": "squeeze",
}


# ----------------------------------------------------------------------------------------- helpers
def _as_batch(x: Tensor, name: str) -> Tensor:
    """(C,H,W) -> (1,C,H,W); anything but a 3-d/4-d float image tensor is a caller bug."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 3:
        x = x.unsqueeze(0)
    if x.dim() != 4 or x.shape[1] not in (1, 3):
        raise ValueError(f"{name} must have shape (N, C, H, W) with C in (1, 3), got {tuple(x.shape)}")
    return x.detach()


def _pair(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    x, y = _as_batch(x, "x"), _as_batch(y, "y")
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs {tuple(y.shape)}")
    return x, y


def _psnr_from_mse(m: Tensor, data_range: float) -> Tensor:
    """10 log10(range^2 / mse), capped at :data:`PSNR_CAP_DB` (which also covers mse == 0)."""
    p = 10.0 * torch.log10(torch.as_tensor(float(data_range) ** 2, dtype=torch.float64) / m)
    return p.clamp(max=PSNR_CAP_DB)


# ------------------------------------------------------------------------------------- MSE / PSNR
def mse(x: Tensor, y: Tensor) -> Tensor:
    """Per-image mean squared error on the [0, 1] scale, shape (N,)."""
    x, y = _pair(x, y)
    return (x.double() - y.double()).pow(2).flatten(1).mean(1).cpu()


def psnr(x: Tensor, y: Tensor, data_range: float = 1.0) -> Tensor:
    """Per-image PSNR in dB, shape (N,); capped at 100 dB (so identical images give 100, not inf).

    ``data_range`` is the range of the values passed in (1 for [0, 1] images).
    """
    return _psnr_from_mse(mse(x, y), data_range)


def mse255(x: Tensor, y: Tensor) -> Tensor:
    """Per-image MSE on the 0-255 scale (inputs in [0, 1] are multiplied by 255), shape (N,).

    The FedRE paper's convention: values in the thousands (``65025 * mse(x, y)``). Average these
    separately from :func:`psnr255` -- the paper's PSNR is the mean of per-image PSNRs, not the PSNR
    of the mean MSE (by Jensen's inequality the former is larger).
    """
    return mse(x, y) * 255.0**2


def psnr255(x: Tensor, y: Tensor) -> Tensor:
    """Per-image PSNR on the 0-255 scale (range 255 on x*255), shape (N,), capped at 100 dB.

    Numerically equal to :func:`psnr` (PSNR is scale free); kept as its own name to pair with
    :func:`mse255` and the FedRE paper's convention of averaging PSNR *per image* (12.89 dB there
    goes with a mean MSE of 4514.91, which alone would give 11.58 dB).
    """
    return _psnr_from_mse(mse255(x, y), 255.0)


# ------------------------------------------------------------------------------------------ SSIM
def _ssim_win_size(h: int, w: int) -> int:
    """7 (skimage's default) when it fits, else the largest odd size <= the shorter side."""
    side = min(h, w)
    if side < 3:
        raise ValueError(f"SSIM needs images of at least 3x3 pixels, got {h}x{w}")
    return 7 if side >= 7 else (side if side % 2 else side - 1)


def ssim(x: Tensor, y: Tensor) -> Tensor:
    """Per-image SSIM (skimage, data_range 1, uniform 7x7 window or smaller for tiny images), (N,)."""
    from skimage.metrics import structural_similarity

    x, y = _pair(x, y)
    win = _ssim_win_size(x.shape[2], x.shape[3])
    a = x.double().cpu().numpy()
    b = y.double().cpu().numpy()
    out = []
    for i in range(a.shape[0]):
        if a.shape[1] == 1:
            out.append(structural_similarity(a[i, 0], b[i, 0], data_range=1.0, win_size=win))
        else:
            out.append(structural_similarity(a[i].transpose(1, 2, 0), b[i].transpose(1, 2, 0), data_range=1.0, win_size=win, channel_axis=-1))
    return torch.tensor(out, dtype=torch.float64)


# ----------------------------------------------------------------------------------------- LPIPS
def _canonical_net(net: str) -> str:
    try:
        return _NET_ALIASES[net]
    except KeyError:
        raise ConfigError(f"unknown LPIPS network {net!r}; accepted: alex, vgg, squeeze") from None


def _hub_checkpoints() -> Path:
    """Where torchvision stores downloaded weights ($TORCH_HOME/hub/checkpoints), read at call time."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def _search_dirs(weights_dir: str | os.PathLike | None) -> list[Path]:
    dirs = []
    if weights_dir is not None:
        dirs.append(Path(weights_dir).expanduser())
    env = os.environ.get(LPIPS_WEIGHTS_ENV)
    if env:
        dirs.append(Path(env).expanduser())
    dirs.append(_hub_checkpoints())
    return dirs


def _linear_weights(net: str) -> Path:
    """The calibrated linear layers shipped inside the ``lpips`` package (found without importing it:
    importing lpips pulls in torchvision, too slow for a status check)."""
    import importlib.util

    spec = importlib.util.find_spec("lpips")
    if spec is None or spec.origin is None:
        raise ImportError("lpips")
    return Path(spec.origin).parent / "weights" / "v0.1" / f"{net}.pth"


def _locate(net: str, weights_dir: str | os.PathLike | None) -> tuple[Path | None, str]:
    """(backbone file, '') when everything is on disk, else (None, why not and how to fix it)."""
    net = _canonical_net(net)
    arch, fname, _ = _BACKBONES[net]
    try:
        lin = _linear_weights(net)
    except ImportError:
        return None, "LPIPS unavailable: the 'lpips' package is not installed (pip install lpips)"
    if not lin.is_file():
        return None, f"LPIPS unavailable: the lpips package's linear weights {lin} are missing (reinstall lpips)"
    dirs = _search_dirs(weights_dir)
    for d in dirs:
        if (d / fname).is_file():
            return d / fname, ""
    looked = ", ".join(str(d) for d in dirs)
    return None, (
        f"LPIPS unavailable: ImageNet {arch} backbone weights {fname} not found in {looked}. "
        f"Copy {fname} (torchvision's {arch} ImageNet weights, e.g. from a machine with network where "
        f"torchvision.models.{arch}(weights='DEFAULT') downloaded it to ~/.cache/torch/hub/checkpoints) "
        f"into one of these folders, or set ${LPIPS_WEIGHTS_ENV} (or pass weights_dir) to the folder holding it."
    )


def lpips_status(weights_dir: str | None = None, net: str = "alex") -> tuple[bool, str]:
    """(True, path of the backbone file) if real LPIPS can be computed, else (False, reason).

    Looks in ``weights_dir``, then ``$PRIVFL_LPIPS_WEIGHTS``, then ``$TORCH_HOME/hub/checkpoints``
    (default ``~/.cache/torch/hub/checkpoints``). Only checks that the files exist; a file that is
    present but not the expected state dict raises :class:`~privfl.errors.ConfigError` on use.
    """
    path, why = _locate(net, weights_dir)
    return (True, str(path)) if path is not None else (False, why)


def _load_backbone(model: torch.nn.Module, path: Path, arch: str) -> None:
    """Load torchvision ``features.<i>.*`` weights into lpips' ``net.slice<k>.<i>.*`` modules.

    lpips splits torchvision's ``features`` Sequential into ``slice1..sliceK`` keeping the original
    child indices as module names, so the slice holding index ``i`` is found from the module tree.
    Loading is strict over the backbone: a missing or mis-shaped tensor is an error, never a
    silently random layer.
    """
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # corrupt, truncated, or not a tensor file
        raise ConfigError(f"cannot read LPIPS backbone weights {path}: {e}") from None
    if not isinstance(state, dict):
        raise ConfigError(f"{path} is not a state dict of torchvision {arch}")
    net = cast(torch.nn.Module, model.net)  # lpips.LPIPS.net, the backbone
    slice_of = {idx: sname for sname, sl in net.named_children() for idx, _ in sl.named_children()}
    mapped = {}
    for key, value in state.items():
        parts = key.split(".", 2)
        if len(parts) == 3 and parts[0] == "features" and parts[1] in slice_of:
            mapped[f"{slice_of[parts[1]]}.{parts[1]}.{parts[2]}"] = value
    try:
        net.load_state_dict(mapped, strict=True)
    except RuntimeError as e:
        raise ConfigError(f"{path} does not match torchvision {arch}: {str(e).splitlines()[0]}") from None


class LPIPSMetric:
    """LPIPS (v0.1 linear weights) on a real ImageNet backbone loaded from a local file.

    Built with ``pnet_rand=True`` so that neither lpips nor torchvision touches the network; the
    backbone weights are then loaded from ``backbone_path``. Grey images are repeated to 3 channels,
    [0, 1] inputs are mapped to [-1, 1], and images whose shorter side is below what the backbone's
    feature slices accept (alex 32, vgg 16, squeeze 17 px; e.g. 28x28 MNIST for alex) are upsampled
    bilinearly to that side first -- values for such images are not comparable to LPIPS at native
    size in other papers.
    """

    def __init__(self, net: str = "alex", weights_dir: str | None = None, backbone_path: str | None = None):
        import lpips as lpips_pkg

        self.net = _canonical_net(net)
        arch, _, self.min_side = _BACKBONES[self.net]
        if backbone_path is None:
            found, why = _locate(self.net, weights_dir)
            if found is None:
                raise ConfigError(why)
            backbone_path = str(found)
        self.backbone_path = Path(backbone_path)
        with warnings.catch_warnings():  # torchvision's 'pretrained' deprecation warnings
            warnings.simplefilter("ignore")
            model = lpips_pkg.LPIPS(net=self.net, pretrained=True, pnet_rand=True, verbose=False)
        _load_backbone(model, self.backbone_path, arch)
        self.model = model.eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, x: Tensor, y: Tensor, batch_size: int = 64) -> Tensor:
        """Per-image LPIPS distance, shape (N,), CPU float64 (lower = more similar)."""
        x, y = _pair(x, y)
        device = x.device
        self.model.to(device)
        out = []
        for i in range(0, x.shape[0], batch_size):
            a, b = (self._prepare(t[i : i + batch_size].to(device)) for t in (x, y))
            out.append(self.model(a, b).flatten().double().cpu())
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)

    def _prepare(self, t: Tensor) -> Tensor:
        t = t.float()
        if t.shape[1] == 1:
            t = t.repeat(1, 3, 1, 1)
        h, w = t.shape[2:]
        if min(h, w) < self.min_side:
            scale = self.min_side / min(h, w)
            size = (max(self.min_side, math.ceil(h * scale)), max(self.min_side, math.ceil(w * scale)))
            t = torch.nn.functional.interpolate(t, size=size, mode="bilinear", align_corners=False)
        return t * 2.0 - 1.0


_LPIPS_CACHE: dict[tuple[str, str], LPIPSMetric] = {}


def lpips(x: Tensor, y: Tensor, net: str = "alex", weights_dir: str | None = None) -> Tensor | None:
    """Per-image LPIPS, shape (N,), or ``None`` when the real backbone weights are not on disk.

    The reason for ``None`` is available from :func:`lpips_status`. Loaded models are cached per
    (net, backbone file).
    """
    path, _ = _locate(net, weights_dir)
    if path is None:
        return None
    key = (_canonical_net(net), str(path.resolve()))
    metric = _LPIPS_CACHE.get(key)
    if metric is None:
        metric = _LPIPS_CACHE[key] = LPIPSMetric(net, backbone_path=str(path))
    return metric(x, y)


# ------------------------------------------------------------------------------------ aggregates
def score_images(
    recon: Tensor, truth: Tensor, lpips_net: str = "alex", weights_dir: str | None = None, with_lpips: bool = True
) -> dict[str, list[float]]:
    """Per-image mse, psnr, mse255, psnr255, ssim and (when the weights exist) lpips, as lists."""
    recon, truth = _pair(recon, truth)
    m = mse(recon, truth)
    out = {
        "mse": m.tolist(),
        "psnr": _psnr_from_mse(m, 1.0).tolist(),
        "mse255": (m * 255.0**2).tolist(),
        "psnr255": _psnr_from_mse(m * 255.0**2, 255.0).tolist(),
        "ssim": ssim(recon, truth).tolist(),
    }
    if with_lpips:
        lp = lpips(recon, truth, net=lpips_net, weights_dir=weights_dir)
        if lp is not None:
            out["lpips"] = lp.tolist()
    return out


def summarize(per_image: dict[str, list[float]]) -> dict[str, float]:
    """Mean and population std (ddof 0) per metric over images: ``{m: mean, m + "_std": std}``.

    Each metric is averaged on its own (PSNR per image, then mean), matching the FedRE convention.
    """
    out: dict[str, float] = {}
    for name, values in per_image.items():
        v = np.asarray(values, dtype=np.float64)
        if v.size == 0:
            out[name], out[f"{name}_std"] = float("nan"), float("nan")
            continue
        out[name] = float(v.mean())
        out[f"{name}_std"] = float(v.std())
    return out


# ----------------------------------------------------------------------------------------- matching
def _pairwise_mse(a: Tensor, b: Tensor) -> Tensor:
    """(N, M) MSE between every image of ``a`` and every image of ``b`` (float64, CPU)."""
    a, b = _as_batch(a, "recon"), _as_batch(b, "candidates")
    if a.shape[1:] != b.shape[1:]:
        raise ValueError(f"image shape mismatch: {tuple(a.shape[1:])} vs {tuple(b.shape[1:])}")
    fa, fb = a.double().flatten(1).cpu(), b.double().flatten(1).cpu()
    d = torch.cdist(fa, fb, compute_mode="donot_use_mm_for_euclid_dist")
    return d.pow(2) / fa.shape[1]


def best_match(recon: Tensor, candidates: Tensor) -> tuple[int, Tensor]:
    """(index of the candidate with the highest PSNR to ``recon``, per-candidate PSNR (M,)).

    Takes the closest candidate -- the worst case for privacy. Ties go to the lowest index.
    """
    recon = _as_batch(recon, "recon")
    if recon.shape[0] != 1:
        raise ValueError(f"best_match takes one reconstruction, got {recon.shape[0]}")
    p = _psnr_from_mse(_pairwise_mse(recon, candidates)[0], 1.0)
    return int(torch.argmax(p)), p


def hungarian_match(recon: Tensor, truth: Tensor, by: str = "psnr") -> list[tuple[int, int]]:
    """Pairs (recon index, truth index) maximising total PSNR (``by="psnr"``) or minimising total MSE.

    For batch reconstructions whose order is unknown. The two objectives usually pick the same
    assignment but not always (log is concave: PSNR rewards a few near-perfect matches more); PSNR is
    the default because it is the headline metric. With N != M, min(N, M) pairs are returned.
    Sorted by recon index.
    """
    from scipy.optimize import linear_sum_assignment

    cost = _pairwise_mse(recon, truth)
    if by == "psnr":
        cost = -_psnr_from_mse(cost, 1.0)
    elif by != "mse":
        raise ValueError(f"by must be 'psnr' or 'mse', got {by!r}")
    rows, cols = linear_sum_assignment(cost.numpy())
    return sorted((int(r), int(c)) for r, c in zip(rows, cols))
