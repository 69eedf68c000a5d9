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
        #: while a ``shared`` broadcast is sent: its delivered copies by content (see :meth:`broadcast`)
        self._shared_copies: dict[tuple[int, ...], tuple[Message, dict]] | None = None

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
        if self.capture is not None:
            record = self.capture.append(record, msg.tensors)
        else:
            record = {"seq": self._seq, **record}
        self._seq = record["seq"] + 1
        if truth is not None and self.truth is not None:
            self.truth.append(
                {"message_seq": record["seq"], "round": msg.round, "client": msg.sender, "kind": msg.kind},
                truth,
            )
        self._round_records.append(record)
        delivered = self._deliver(msg, self._shared_copies)
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
        copy-on-write (:mod:`privfl.methods.shared`); a mod that changes a receiver's message gives that
        receiver its own copy. Still none of them aliases the sender's tensors."""
        self._shared_copies = {} if shared else None
        try:
            return {r: self.send(Message(round, sender, r, kind, tensors, dict(meta or {}), aux)) for r in receivers}
        finally:
            self._shared_copies = None

    @staticmethod
    def _deliver(msg: Message, copies: dict[tuple[int, ...], tuple[Message, dict]] | None = None) -> Message:
        if copies is None:
            tensors = {k: v.detach().clone() for k, v in msg.tensors.items()}
        else:  # one copy per distinct content after the mods; the mods' message is held so its tensor ids stay unique
            key = tuple(id(v) for v in msg.tensors.values())
            if key not in copies:
                copies[key] = (msg, {k: v.detach().clone() for k, v in msg.tensors.items()})
            tensors = copies[key][1]
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
