"""Ground truth for scoring: which images are behind an artifact. Only the metrics read this.

Matching rules (the FedRE papers leave them open, shared/specs/fedre.md §2.4):
- per-sample representation (``rep`` row i): its own image (``exact``);
- prototype of class c: the client's training images of class c, equal weights;
- entangled representation: the client's training images with their RE weights w_i;
- global prototype of class c: every client's training images of class c.
For aggregates the score is reported twice: against the best-matching image (the worst case for
privacy) and as the weighted mean over the images that make up the aggregate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from attacks.targets import Target
from privfl.capture import TensorStore


@dataclass
class Candidates:
    images: torch.Tensor  # (M, C, H, W) in [0, 1]
    weights: torch.Tensor  # (M,) summing to 1
    exact: int | None = None  # index of the image this target is exactly about, if any
    description: str = ""


class GroundTruth:
    def __init__(self, run_dir: str | Path, data_root: str | None = None):
        from privfl.data import load_dataset

        self.run_dir = Path(run_dir)
        cfg = json.loads((self.run_dir / "config.json").read_text())
        self.dataset = load_dataset(cfg["dataset"], data_root or cfg.get("data_root"), False)
        part = load_file(str(self.run_dir / "truth" / "partition.safetensors"))
        subset = part.pop("subset", None)
        self.images_u8 = self.dataset.images if subset is None else self.dataset.images[subset]
        self.labels = self.dataset.labels if subset is None else self.dataset.labels[subset]
        self.train = {k: v for k, v in part.items() if k.startswith("train_")}
        self.store = TensorStore(self.run_dir / "truth", "truth")
        self._by_seq = {r["message_seq"]: r for r in self.store.records()}

    def images(self, idx: torch.Tensor) -> torch.Tensor:
        return self.images_u8[idx].float() / 255.0

    def client_train(self, client: str) -> torch.Tensor:
        return self.train[f"train_{int(client.removeprefix('client'))}"]

    def message_truth(self, seq: int) -> dict[str, torch.Tensor]:
        return self.store.load(self._by_seq[seq])

    def candidates(self, target: Target) -> Candidates:
        if target.kind == "rep":
            idx = self.message_truth(target.message_seq)["indices"][target.row : target.row + 1]
            return Candidates(self.images(idx), torch.ones(1), 0, "its own image")
        if target.kind in ("proto", "global_proto"):
            pool = self.client_train(target.client) if target.kind == "proto" else torch.cat(list(self.train.values()))
            idx = pool[self.labels[pool] == target.class_id]
            where = "the client's" if target.kind == "proto" else "all clients'"
            return Candidates(self.images(idx), torch.full((len(idx),), 1.0 / len(idx)), None, f"{where} {len(idx)} training images of its class")
        if target.kind == "ent_rep":
            t = self.message_truth(target.message_seq)
            keep = t["weights"] > 0
            w = t["weights"][keep].float()
            return Candidates(self.images(t["indices"][keep]), w / w.sum(), None, f"the client's {int(keep.sum())} training images, RE-weighted")
        raise ValueError(f"no ground-truth rule for kind {target.kind}")
