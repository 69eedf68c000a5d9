"""The attacker's view of a run: its captured messages and the knowledge the run stores, nothing else.

``AttackerView`` opens ``capture/`` and ``knowledge/`` of a run directory, never ``truth/``: the
ground truth reaches only :mod:`attacks.groundtruth`, which the scoring code uses after an attack.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from attacks.threat import Knowledge
from privfl.capture import KINDS, TensorStore
from privfl.errors import CaptureError, UnknownNameError


class AttackerView:
    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        try:
            self.info = json.loads((self.run_dir / "run.json").read_text())
            self.config = json.loads((self.run_dir / "config.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError) as exc:
            raise CaptureError(f"{self.run_dir} is not a readable privfl run: {exc}") from None
        if not (self.run_dir / "capture" / "manifest.json").exists():
            raise CaptureError(f"{self.run_dir} has no capture (trained with --no-capture?)")
        self.capture = TensorStore(self.run_dir / "capture", "capture")
        know = self.run_dir / "knowledge"
        self.knowledge_store = TensorStore(know, "knowledge") if (know / "manifest.json").exists() else None
        self._records = self.capture.records()

    # ---------------------------------------------------------------- what the run offers
    @property
    def dataset(self) -> dict[str, Any]:
        return self.info["dataset"]

    def available(self) -> Knowledge:
        """What this run lets an attacker have. The previous state a server broadcast is in the
        capture itself; the local hyperparameters are the run's config, which a server sets."""
        granted = set(self.info.get("knowledge", {}))
        previous_kinds = set(self.parameter_kinds().values())
        return Knowledge(
            extractor="extractor" in granted and self.knowledge_store is not None,
            previous_state=any(r["receiver"] != "server" and r["kind"] in previous_kinds for r in self._records),
            local_hyperparameters=True,
        )

    def kinds(self) -> list[str]:
        return sorted({r["kind"] for r in self._records})

    def rounds(self, kind: str) -> list[int]:
        return sorted({r["round"] for r in self._records if r["kind"] == kind})

    def messages(self, kind: str, round: int | None = None, clients: list[str] | None = None) -> list[dict[str, Any]]:
        """Index records of ``kind`` (in ``round``; involving one of ``clients``)."""
        if kind not in KINDS:
            raise UnknownNameError("artifact kind", kind, KINDS)
        out = []
        for r in self._records:
            if r["kind"] != kind or (round is not None and r["round"] != round) or r.get("meta", {}).get("phase") == "setup":
                continue
            if clients is not None and client_of(r) not in clients:
                continue
            out.append(r)
        return out

    def load(self, record: dict[str, Any]) -> dict[str, torch.Tensor]:
        return self.capture.load(record)

    @cached_property
    def method_cls(self):
        """The trained method's class: it says which kinds carry parameters and how its models are built."""
        from privfl.methods import resolve_method

        return resolve_method(self.info["method"])

    def parameter_kinds(self) -> dict[str, str]:
        """Parameter-like kinds this run's method sends, each with the kind that holds its previous state."""
        return dict(self.method_cls.parameter_kinds)

    def previous_state(self, record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The last message of the previous-state kind (``model`` for a star method's update; a
        Learngene for a ring neighbour's Learngene...) that the sender of ``record`` received before
        sending it. A message whose meta names ``previous_round`` (a ring, where a node may already
        hold the next round's Learngene when it sends) takes the one received in that round."""
        custom = self.method_cls.attacker_previous_state(self, record)
        if custom is not None:
            return custom
        client = record["sender"]
        prev_kind = self.parameter_kinds().get(record["kind"], "model")
        want = record.get("meta", {}).get("previous_round")
        earlier = [r for r in self._records if r["kind"] == prev_kind and r["receiver"] == client and r["seq"] < record["seq"]
                   and (want is None or r["round"] == want)]
        if not earlier:
            raise CaptureError(f"no {prev_kind} was sent to {client} before message {record['seq']}: no previous state to attack from")
        return earlier[-1], self.load(earlier[-1])

    def model_request(self, client: str):
        """What the attacker knows of a client's model: architecture, dataset shape, run options."""
        from privfl.methods import ModelRequest

        return ModelRequest.from_run(self.info, self.config, int(client.removeprefix("client")))

    def model_for(self, client: str, kind: str = "model"):
        """A fresh module of what a ``kind`` message of the client carries, eval mode, random weights."""
        return self.method_cls.leakage_module(kind, self.model_request(client)).eval()

    # ---------------------------------------------------------------- knowledge
    def extractor_records(self) -> list[dict[str, Any]]:
        if self.knowledge_store is None:
            return []
        return [r for r in self.knowledge_store.records() if r["kind"] == "extractor"]

    def extractor(self, client: str, round: int, device: torch.device | str = "cpu"):
        """The client's extractor (a SplitModel with its features and mapping loaded), frozen, eval mode."""
        from privfl.models import build_model

        recs = self.extractor_records()
        match = [r for r in recs if r["client"] == client and r["round"] == round]
        if not match:
            have = sorted({(r["client"], r["round"]) for r in recs})
            where = ", ".join(f"{c}@r{n}" for c, n in have[:12]) or "none"
            raise CaptureError(
                f"the run stores no extractor of {client} at round {round} (it has: {where}); "
                "retrain with --knowledge-every N to keep more rounds"
            )
        rec = match[0]
        model = build_model(**rec["spec"])
        model.load_extractor_state(self.knowledge_store.load(rec))
        model.eval().to(device)
        for p in model.parameters():
            p.requires_grad_(False)
        return model


def client_of(record: dict[str, Any]) -> str:
    """The client an artifact belongs to (its sender, or the receiver of a server broadcast)."""
    return record["receiver"] if record["sender"] == "server" else record["sender"]
