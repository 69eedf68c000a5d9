"""privfl messages as Flower records, and back, exactly.

A privfl :class:`~privfl.capture.message.Message` travels as two records of one Flower ``RecordDict``:
``{name}.tensors`` (an ``ArrayRecord``: every tensor, in order, serialised by numpy without pickle) and
``{name}.head`` (a ``ConfigRecord``: round, sender, receiver, kind, aux names and the meta as JSON). The
decoded message has the same tensor names, order, dtypes, shapes and values, so the capture written from
it on the server is byte for byte the one the in-process engine writes.

Ground truth (sample ids behind an upload) and knowledge records (what the threat model grants the
attacker, e.g. a client's extractor) are engine bookkeeping, not method messages: they ride in records
of their own (``truth.*``, ``knowledge.*``) that the server files in its stores and never hands to the
method, and they are never captured or counted (docs/scale.md).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, TypeVar

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from privfl.capture.message import Message
from privfl.errors import PrivflError

R = TypeVar("R", ArrayRecord, ConfigRecord, MetricRecord)


def tensors_record(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    """An ``ArrayRecord`` of ``tensors`` (moved to the CPU; numpy serialisation, never pickle)."""
    return ArrayRecord(OrderedDict((k, v.detach().contiguous().cpu()) for k, v in tensors.items()))


def get_tensors(content: RecordDict, name: str, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of the ``ArrayRecord`` ``name``, in their order, on ``device`` (writable copies)."""
    record = _record(content, name, ArrayRecord)
    return {k: torch.from_numpy(record[k].numpy().copy()).to(device) for k in record}


def put_json(content: RecordDict, name: str, value: Any) -> None:
    """A JSON-able value as a one-entry ``ConfigRecord`` (configs, message heads, counts)."""
    content[name] = ConfigRecord({"json": json.dumps(value, sort_keys=True)})


def get_json(content: RecordDict, name: str) -> Any:
    return json.loads(str(_record(content, name, ConfigRecord)["json"]))


def put_numbers(content: RecordDict, name: str, values: dict[str, float]) -> None:
    content[name] = MetricRecord({k: float(v) for k, v in values.items()})


def get_numbers(content: RecordDict, name: str) -> dict[str, float]:
    return {k: float(v) for k, v in _record(content, name, MetricRecord).items() if isinstance(v, (int, float))}


def _record(content: RecordDict, name: str, kind: type[R]) -> R:
    record = content.get(name)
    if not isinstance(record, kind):
        raise PrivflError(f"Flower message lacks the privfl {kind.__name__} {name!r}")
    return record


def put_message(content: RecordDict, name: str, msg: Message) -> None:
    """Store ``msg`` in ``content`` as the records ``{name}.tensors`` and ``{name}.head``."""
    content[f"{name}.tensors"] = tensors_record(msg.tensors)
    head = {"round": msg.round, "sender": msg.sender, "receiver": msg.receiver, "kind": msg.kind, "aux": list(msg.aux), "meta": msg.meta}
    put_json(content, f"{name}.head", head)


def get_message(content: RecordDict, name: str, device: torch.device | str = "cpu") -> Message:
    """The message stored under ``name`` by :func:`put_message`."""
    head = get_json(content, f"{name}.head")
    tensors = get_tensors(content, f"{name}.tensors", device)
    return Message(int(head["round"]), str(head["sender"]), str(head["receiver"]), str(head["kind"]), tensors, head["meta"], tuple(head["aux"]))


def put_messages(content: RecordDict, prefix: str, messages: list[Message]) -> None:
    put_json(content, f"{prefix}.count", len(messages))
    for i, msg in enumerate(messages):
        put_message(content, f"{prefix}.{i}", msg)


def get_messages(content: RecordDict, prefix: str, device: torch.device | str = "cpu") -> list[Message]:
    if f"{prefix}.count" not in content:
        return []
    return [get_message(content, f"{prefix}.{i}", device) for i in range(int(get_json(content, f"{prefix}.count")))]


__all__ = [
    "get_json",
    "get_message",
    "get_messages",
    "get_numbers",
    "get_tensors",
    "put_json",
    "put_message",
    "put_messages",
    "put_numbers",
    "tensors_record",
]
