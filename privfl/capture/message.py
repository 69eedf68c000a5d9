"""The one thing that crosses the wire: a typed, checked :class:`Message`.

After Flower's ``Message`` (content + metadata, typed records that check on write): keys are strings,
tensors are detached, ``kind`` comes from a closed vocabulary and ``meta`` is JSON only, so a mistake
fails at the sender instead of deep inside an attack. What a kind must carry is checked by the
channel when the message is sent (:func:`privfl.kinds.check_message`), where the sending method is known.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch


def _check_meta(meta: dict[str, Any]) -> None:
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"Message.meta must be JSON-serialisable: {exc}") from None


__all__ = ["Message"]


@dataclass(frozen=True)
class Message:
    """One transmission from ``sender`` to ``receiver`` in ``round``.

    ``aux`` names tensors that are bookkeeping rather than knowledge (labels, class ids, counts).
    They are sent and captured like any tensor, but the papers' "# scalars" leave them out, so the
    capture reports both a paper-style count (without ``aux``) and the full count.
    """

    round: int
    sender: str
    receiver: str
    kind: str
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)
    aux: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise TypeError(f"Message.kind must be a kind name (privfl.kinds.KINDS), got {self.kind!r}")
        if not self.tensors:
            raise ValueError("a message must carry at least one tensor")
        for key, value in self.tensors.items():
            if not isinstance(key, str) or not key:
                raise TypeError(f"tensor names must be non-empty strings, got {key!r}")
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"tensor {key!r} is a {type(value).__name__}, not a torch.Tensor")
            if value.requires_grad:
                raise ValueError(f"tensor {key!r} requires grad: detach it before sending")
        unknown_aux = set(self.aux) - set(self.tensors)
        if unknown_aux:
            raise ValueError(f"aux names {sorted(unknown_aux)} are not tensors of this message")
        _check_meta(self.meta)

    @property
    def direction(self) -> str:
        """``up`` (client to server), ``down`` (server to client) or ``peer`` (client to client)."""
        if self.receiver == "server":
            return "up"
        if self.sender == "server":
            return "down"
        return "peer"

    @property
    def scalars(self) -> int:
        return sum(t.numel() for t in self.tensors.values())

    @property
    def paper_scalars(self) -> int:
        return sum(t.numel() for k, t in self.tensors.items() if k not in self.aux)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
