"""Scores of one reconstruction against the images behind its artifact (metrics side only).

``exact``: against the one image a per-sample target is about. ``best``: against the best-matching
image of the aggregate (highest PSNR; the worst case for privacy). ``mean``: weighted mean over the
images that make up the aggregate (RE weights for entangled representations, equal for prototypes);
SSIM there uses the (at most) 512 highest-weight images to stay fast on large clients.
"""

from __future__ import annotations

import torch

from attacks.groundtruth import Candidates
from attacks.metrics import best_match, mse, score_images, ssim

MEAN_SSIM_LIMIT = 512


def _single(recon: torch.Tensor, truth: torch.Tensor) -> dict[str, float]:
    return {k: v[0] for k, v in score_images(recon.unsqueeze(0), truth.unsqueeze(0)).items()}


def score(recon: torch.Tensor, cand: Candidates) -> dict[str, float | int]:
    """Flat dict: exact_* (if any), best_*, mean_* metrics and best_index."""
    out: dict[str, float | int] = {}
    if cand.exact is not None:
        out.update({f"exact_{k}": v for k, v in _single(recon, cand.images[cand.exact]).items()})
    idx, _ = best_match(recon.unsqueeze(0), cand.images)
    out["best_index"] = int(idx)
    out.update({f"best_{k}": v for k, v in _single(recon, cand.images[idx]).items()})
    w = cand.weights.double()
    m = mse(recon.unsqueeze(0).expand_as(cand.images), cand.images)  # (M,) on [0, 1]
    capped_psnr = torch.clamp(10 * torch.log10(1.0 / m.clamp_min(1e-10)), max=100.0)
    out["mean_mse"] = float((w * m).sum())
    out["mean_mse255"] = float((w * m * 255.0**2).sum())
    out["mean_psnr"] = float((w * capped_psnr).sum())
    out["mean_psnr255"] = out["mean_psnr"]  # PSNR does not depend on the scale; kept for the paper's naming
    top = torch.argsort(w, descending=True)[:MEAN_SSIM_LIMIT]
    s = ssim(recon.unsqueeze(0).expand(len(top), *recon.shape), cand.images[top])
    out["mean_ssim"] = float((w[top] * s).sum() / w[top].sum())
    return out


def headline(scores: dict[str, float | int]) -> str:
    """The prefix that best describes a target: its own image when it has one, else the best match."""
    return "exact" if "exact_psnr" in scores else "best"
