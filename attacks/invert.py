"""The representation-inversion attack: DIP generators matched to captured representations.

Threat model (DESIGN.md, FedRE [000] Sec. 3): an honest-but-curious server that sees the captured
message and holds the client's extractor (incl. RM) as it was when it produced the artifact. It does
not see the client's data: this module never opens the ground-truth store.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attacks.base import ATTACKS, require_knowledge
from attacks.dip import DIPConfig, invert
from attacks.targets import Target
from attacks.threat import Knowledge
from attacks.view import AttackerView
from privfl.errors import CaptureError
from privfl.seeding import derive_seed

__all__ = ["ATTACKS", "Reconstruction", "RepresentationInversion"]


@dataclass
class Reconstruction:
    target: Target
    image: torch.Tensor  # (C, H, W) in [0, 1]
    feature_loss: float
    seconds: float  # wall time of its batch divided by the batch size


@ATTACKS.register("invert")
class RepresentationInversion:
    name = "invert"
    consumes = frozenset({"rep", "proto", "global_proto", "ent_rep"})
    needs = Knowledge(extractor=True)
    threat_model = "curious-server-whitebox-extractor"
    paper = "Ulyanov et al., Deep Image Prior, CVPR 2018; used by FedRE [000] Q3 / [001] Q2"

    def __init__(self, cfg: DIPConfig, *, seed: int = 0, device: torch.device | str = "cpu", batch: int = 16):
        self.cfg, self.seed, self.device, self.batch = cfg, seed, torch.device(device), batch

    def check(self, view: AttackerView, targets: list[Target] = ()) -> None:
        """Refuse before optimising anything: missing capability, or no extractor for some target."""
        require_knowledge(self, view)
        for t in targets:
            if t.kind not in self.consumes:
                raise CaptureError(f"attack {self.name} does not take {t.kind}; it takes {', '.join(sorted(self.consumes))}")
        stored = {(r["client"], r["round"]) for r in view.extractor_records()}
        for client, rnd in sorted({(t.client, t.round) for t in targets}):
            if (client, rnd) not in stored:
                view.extractor(client, rnd)  # raises with the list of what is stored

    def reconstruct(
        self, targets: list[Target], view: AttackerView, progress: Callable[[str, int, int, float], None] | None = None
    ) -> list[Reconstruction]:
        """Invert every target through its client's extractor, several targets per optimisation."""
        self.check(view, targets)
        ds = view.dataset
        shape = (ds["channels"], ds["image_size"], ds["image_size"])
        groups: dict[tuple[str, int], list[Target]] = defaultdict(list)
        for t in targets:
            groups[(t.client, t.round)].append(t)
        out: list[Reconstruction] = []
        for (client, rnd), members in groups.items():
            model = view.extractor(client, rnd, self.device)
            for start in range(0, len(members), self.batch):
                chunk = members[start : start + self.batch]
                label = f"{client} r{rnd} targets {start + 1}-{start + len(chunk)}/{len(members)}"
                hook = (lambda step, loss, label=label: progress(label, step, self.cfg.steps, loss)) if progress else None
                result = invert(
                    model.represent,
                    torch.stack([t.vector.float() for t in chunk]),
                    shape, ds["mean"], ds["std"], self.cfg,
                    [derive_seed(self.seed, "dip", t.key) for t in chunk],
                    device=self.device, progress=hook,
                )
                for i, t in enumerate(chunk):
                    out.append(Reconstruction(t, result.images[i], float(result.feature_loss[i]), result.seconds / len(chunk)))
        return out

