"""Which true images a reconstruction is compared with, and its score against them (metrics side only).

The rule depends on the artifact's family (the FedRE papers leave it open; privfl's decision):

- per-sample representation (row i of a ``rep``-like message): its own image (``exact``);
- aggregate representation: the images behind it, weighted as the message weighted them when the
  ground truth says so (an entangled representation's RE weights), else the client's training images
  of the row's class (prototypes; every client's for a server's global prototype), else the samples
  behind the message with equal weights. Reported twice: against the best-matching image (``best``,
  the worst case for privacy) and as the weighted mean over them (``mean``);
- gradient or parameters: the samples behind the message (:class:`attacks.scoring.BatchScorer` matches
  an exact batch with the Hungarian algorithm, a reconstruction of a larger set to its best match).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from attacks.base import Target
from attacks.metrics import best_match, mse, score_images, ssim
from privfl.errors import CaptureError
from privfl.kinds import Family
from privfl.run import GroundTruth

MEAN_SSIM_LIMIT = 512


@dataclass
class Candidates:
    images: torch.Tensor  # (M, C, H, W) in [0, 1]
    weights: torch.Tensor  # (M,) summing to 1
    exact: int | None = None  # index of the image this target is exactly about, if any
    description: str = ""
    #: pool indices of ``images`` (identification finds them among the client's training images)
    indices: torch.Tensor | None = None


def sample_ids(t: dict[str, torch.Tensor], seq: int) -> torch.Tensor:
    """The ids of the samples behind message ``seq``, or a one-line error naming the fix (the sender
    passed no ``truth={"indices": ...}``), instead of a KeyError deep in scoring."""
    if "indices" not in t:
        raise CaptureError(
            f"message {seq} was sent without the ids of the samples behind it, so its reconstruction cannot be scored: "
            "send it with truth={'indices': sample ids} (self.send(Message(...), truth))"
        )
    return t["indices"]


def candidates(truth: GroundTruth, target: Target) -> Candidates:
    """The images behind ``target`` (see the module docstring)."""
    family = target.family
    seq = target.message_seq
    t = truth.message_truth(seq) if seq is not None and truth.has_message(seq) else {}
    if family is Family.PER_SAMPLE_REPRESENTATION:
        assert target.row is not None  # a per-sample target is one row of its message
        idx = sample_ids(t, cast(int, seq))[target.row : target.row + 1]
        return Candidates(truth.images(idx), torch.ones(1), 0, "its own image", idx)
    if "weights" in t:
        keep = t["weights"] > 0
        w = t["weights"][keep].float()
        idx = sample_ids(t, cast(int, seq))[keep]
        return Candidates(truth.images(idx), w / w.sum(), None, f"the client's {int(keep.sum())} training images, RE-weighted", idx)
    if target.class_id is not None:
        everyone = target.record is not None and target.record["sender"] == "server"
        pool = torch.cat(list(truth.train.values())) if everyone else truth.client_train(target.client)
        idx = pool[truth.labels[pool] == target.class_id]
        where = "all clients'" if everyone else "the client's"
        return Candidates(truth.images(idx), torch.full((len(idx),), 1.0 / len(idx)), None, f"{where} {len(idx)} training images of its class", idx)
    idx = t["indices"] if "indices" in t else truth.client_train(target.client)
    return Candidates(truth.images(idx), torch.full((len(idx),), 1.0 / len(idx)), None, f"the {len(idx)} samples behind the message", idx)


def _single(recon: torch.Tensor, truth: torch.Tensor) -> dict[str, float]:
    return {k: v[0] for k, v in score_images(recon.unsqueeze(0), truth.unsqueeze(0)).items()}


def score(recon: torch.Tensor, cand: Candidates) -> dict[str, float | int]:
    """Flat dict: exact_* (if any), best_*, mean_* metrics and best_index, for one image (C, H, W)."""
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


__all__ = ["MEAN_SSIM_LIMIT", "Candidates", "candidates", "headline", "sample_ids", "score"]
