"""The single channel every exchange of every method goes through.

Order on ``send``: mods (defenses) transform the outgoing message, then the capture records exactly
what left, then the receiver gets its own copy. Capture therefore sits outermost, as Flower's
``message_size_mod`` does, and a receiver can never alias the sender's tensors.

Before anything else the channel checks the message against its kind's declaration and the sending
method's ``sends`` (:func:`privfl.kinds.check_message`): a malformed message fails at its first send,
in one line that names the method, the kind and what to fix, before it is captured. ``aux`` (the
bookkeeping tensors the papers' counts leave out) comes from the kind.

The channel is also the only place that sees both a message and the samples behind it: the sender
passes ``truth=`` (sample ids, weights) and the channel files it in the ground-truth store under the
message's sequence number, apart from the capture.

Observers (``Channel.observers``, e.g. :class:`privfl.engine.TrainCallback`) are called after every
send with the receiver's copy and the capture record; tests inject faults through them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from privfl.capture.message import Message
from privfl.capture.store import TensorStore
from privfl.kinds import KINDS, check_message


class ChannelContext:
    """What a mod may know about the system beside the message: what each party last received.

    A defense on a parameter message (a client's model or head) acts on the *update*, i.e. the
    difference to the state of the same kind that the sender last received; ``reference`` gives it.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        self._held: list[Message] | None = None

    def reference(self, msg: Message) -> dict[str, torch.Tensor] | None:
        return self._last.get((msg.sender, msg.kind))

    def delivered(self, msg: Message) -> None:
        if self._held is not None:
            self._held.append(msg)
        else:
            self._last[(msg.receiver, msg.kind)] = msg.tensors

    @contextmanager
    def simultaneous(self) -> Iterator[None]:
        """Messages sent inside count as received only at its end: in a gossip round every node sends at
        once, so what a node sends is defended against what it received in earlier rounds, not against
        a message that a sequential simulation happened to deliver to it a moment before."""
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            for msg in held:
                self.delivered(msg)


Mod = Callable[[Message, ChannelContext], Message]


def prepared(msg: Message, method: str, sends: Mapping[str, str] | None) -> Message:
    """``msg`` checked against its kind and the method's ``sends``, with the kind's ``aux`` names set:
    what the mods see (on Flower a client's node runs the defenses, so it prepares its uploads the same way)."""
    check_message(msg, method, sends)
    aux = tuple(n for n in KINDS.get(msg.kind).aux_names if n in msg.tensors) or msg.aux
    if aux != msg.aux:
        msg = Message(msg.round, msg.sender, msg.receiver, msg.kind, msg.tensors, msg.meta, aux)
    return msg


Observer = Callable[[Message, dict[str, Any]], None]


@dataclass
class _Broadcast:
    """What one :meth:`Channel.broadcast` has already done for one content (its tensor objects after the
    mods): the stored blob's ``(sha256, file bytes)`` and, for a ``shared`` broadcast, the receivers'
    common copy. ``msg`` is held so that the tensor ids in the key stay unique while the broadcast runs."""

    msg: Message
    blob: tuple[str, int] | None = None
    copy: dict[str, torch.Tensor] | None = None


def _content_key(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[str, int, int], ...] | None:
    """The same tensor objects, none changed in place since (an in-place op bumps ``_version``); None
    for tensors made under ``torch.inference_mode``, which keep no version counter (never reused)."""
    if any(t.is_inference() for t in tensors.values()):
        return None
    return tuple((name, id(t), t._version) for name, t in tensors.items())


class Channel:
    def __init__(
        self,
        capture: TensorStore | None = None,
        truth: TensorStore | None = None,
        mods: Sequence[Mod] = (),
        *,
        method: str = "the method",
        sends: Mapping[str, str] | None = None,
        observers: Sequence[Observer] = (),
    ):
        self.capture = capture
        self.truth = truth
        self.mods = list(mods)
        self.method, self.sends = method, sends
        self.observers = list(observers)
        self._seq = len(capture.records(strict=False)) if capture is not None else 0
        self._round_records: list[dict[str, Any]] = []
        self.context = ChannelContext()
        #: while a broadcast is sent: what was done per content (see :meth:`broadcast`), and whether its
        #: receivers share one copy
        self._broadcast: dict[tuple[tuple[str, int, int], ...], _Broadcast] | None = None
        self._broadcast_shared = False

    def send(self, msg: Message, *, truth: dict[str, torch.Tensor] | None = None) -> Message:
        """Transmit ``msg``; returns the receiver's copy (after mods). Every message goes through here,
        a broadcast's too (tests and tools that wrap ``send`` see them all)."""
        msg = prepared(msg, self.method, self.sends)
        for mod in self.mods:
            msg = mod(msg, self.context)
        record: dict[str, Any] = {
            "round": msg.round,
            "sender": msg.sender,
            "receiver": msg.receiver,
            "direction": msg.direction,
            "kind": msg.kind,
            "scalars": msg.scalars,
            "paper_scalars": msg.paper_scalars,
            "bytes": msg.nbytes,
            "aux": list(msg.aux),
            "meta": msg.meta,
        }
        if truth is not None and self.truth is not None:
            record["truth"] = True  # verify checks that the ground-truth store holds it
        done = None
        if self._broadcast is not None and (key := _content_key(msg.tensors)) is not None:
            done = self._broadcast.setdefault(key, _Broadcast(msg))
        if self.capture is not None:
            record = self.capture.append(record, msg.tensors, stored=done.blob if done is not None else None)
            if done is not None:
                done.blob = (record["sha256"], record["file_bytes"])
        else:
            record = {"seq": self._seq, **record}
        self._seq = record["seq"] + 1
        if truth is not None and self.truth is not None:
            self.truth.append(
                {"message_seq": record["seq"], "round": msg.round, "client": msg.sender, "kind": msg.kind},
                truth,
            )
        self._round_records.append(record)
        delivered = self._deliver(msg, done if self._broadcast_shared else None)
        self.context.delivered(delivered)
        for observer in self.observers:
            observer(delivered, record)
        return delivered

    def broadcast(
        self,
        round: int,
        receivers: Iterable[str],
        kind: str,
        tensors: dict[str, torch.Tensor],
        *,
        sender: str = "server",
        meta: dict[str, Any] | None = None,
        aux: tuple[str, ...] = (),
        shared: bool = False,
    ) -> dict[str, Message]:
        """One message per receiver (each counted and captured, as the papers count broadcast per client).

        ``shared``: receivers whose message left the mods unchanged get one common copy (the same
        ``tensors`` dict) instead of a copy each, for receivers that only read it or alias it
        copy-on-write (:mod:`privfl.fl.shared`); a mod that changes a receiver's message gives that
        receiver its own copy. Still none of them aliases the sender's tensors.

        The capture serialises and hashes each distinct content once: the receivers whose message left the
        mods as the same, unchanged tensors get records that name the blob the first one stored (a model
        broadcast to ten clients cost ten serialisations and sha256s of the whole model before). A mod
        must return new tensors for what it changes, not change the message's in place (the channel also
        checks each tensor's in-place version counter)."""
        self._broadcast, self._broadcast_shared = {}, shared
        try:
            return {r: self.send(Message(round, sender, r, kind, tensors, dict(meta or {}), aux)) for r in receivers}
        finally:
            self._broadcast, self._broadcast_shared = None, False

    @staticmethod
    def _deliver(msg: Message, shared: _Broadcast | None = None) -> Message:
        if shared is None:
            tensors = {k: v.detach().clone() for k, v in msg.tensors.items()}
        else:  # one copy per distinct content after the mods
            if shared.copy is None:
                shared.copy = {k: v.detach().clone() for k, v in msg.tensors.items()}
            tensors = shared.copy
        return Message(msg.round, msg.sender, msg.receiver, msg.kind, tensors, dict(msg.meta), msg.aux)

    def end_round(self) -> list[dict[str, Any]]:
        """Records of this round's messages; makes the capture durable."""
        for store in (self.capture, self.truth):
            if store is not None:
                store.flush()
        records, self._round_records = self._round_records, []
        return records


def summarize_comm(records: Iterable[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Totals per direction (``up``/``down``/``peer``) and per ``direction:kind``.

    ``paper_scalars`` leaves out labels/class ids (``aux`` tensors), as the papers count; ``scalars``
    and ``bytes`` are everything that was sent.
    """
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"messages": 0, "scalars": 0, "paper_scalars": 0, "bytes": 0})
    for rec in records:
        for key in (rec["direction"], f"{rec['direction']}:{rec['kind']}"):
            slot = out[key]
            slot["messages"] += 1
            slot["scalars"] += rec["scalars"]
            slot["paper_scalars"] += rec["paper_scalars"]
            slot["bytes"] += rec["bytes"]
    return {k: dict(v) for k, v in sorted(out.items())}
