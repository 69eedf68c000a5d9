"""Representation-like artifacts turned into inversion targets, one builder per message kind.

A target is one d-dim vector an attacker tries to turn back into an image, with what the message says
about its label (attacker-visible) and where it came from (kind, client, round, message, row).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attacks.view import client_of
from privfl.registry import Registry


@dataclass
class Target:
    kind: str
    round: int
    client: str  # whose extractor the attacker inverts through
    vector: torch.Tensor  # (d,)
    label: str  # what the message says about the class(es), e.g. "Dress" or "0.41 Coat + 0.33 Dress"
    message_seq: int | None = None
    row: int | None = None
    class_id: int | None = None
    counterfactual: bool = False  # computed from client state, not transmitted by the run's method

    @property
    def key(self) -> str:
        where = f"seq{self.message_seq}" if self.message_seq is not None else "cf"
        return f"{self.kind}/{self.client}/r{self.round}/{where}/{self.row if self.row is not None else 0}"

    def caption(self) -> str:
        cf = " (counterfactual)" if self.counterfactual else ""
        return f"{self.kind}{cf} {self.client} r{self.round}"


Builder = Callable[[dict[str, Any], dict[str, torch.Tensor], list[str], int], list[Target]]
TARGET_BUILDERS: Registry[Builder] = Registry("representation-like artifact kind")


def soft_label_text(label: torch.Tensor, class_names: list[str], top: int = 3) -> str:
    values, idx = label.float().topk(min(top, len(label)))
    return " + ".join(f"{v:.2f} {class_names[i]}" for v, i in zip(values.tolist(), idx.tolist()) if v > 0)


def _rows(kind: str, vectors: torch.Tensor, classes: torch.Tensor, record, names, limit) -> list[Target]:
    out = []
    for row in range(min(limit, len(vectors))):
        c = int(classes[row])
        out.append(Target(kind, record["round"], client_of(record), vectors[row], names[c], record["seq"], row, c))
    return out


@TARGET_BUILDERS.register("rep")
def _rep(record, tensors, names, limit):
    return _rows("rep", tensors["reps"], tensors["labels"], record, names, limit)


@TARGET_BUILDERS.register("proto")
def _proto(record, tensors, names, limit):
    return _rows("proto", tensors["protos"], tensors["classes"], record, names, limit)


@TARGET_BUILDERS.register("global_proto")
def _global_proto(record, tensors, names, limit):
    return _rows("global_proto", tensors["protos"], tensors["classes"], record, names, limit)


@TARGET_BUILDERS.register("ent_rep")
def _ent_rep(record, tensors, names, limit):
    label = tensors["label"]
    return [Target("ent_rep", record["round"], client_of(record), tensors["rep"], soft_label_text(label, names), record["seq"], 0)]
