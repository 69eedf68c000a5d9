"""Messages, the checksummed stores and the channel."""

import json

import pytest
import torch

from privfl.capture import Message, TensorStore
from privfl.channel import Channel, summarize_comm
from privfl.errors import CaptureError


def msg(kind="ent_rep", rnd=0, sender="client0", receiver="server", **tensors):
    tensors = tensors or {"rep": torch.arange(4.0), "label": torch.tensor([0.25, 0.75])}
    aux = ("label",) if "label" in tensors else ()
    return Message(rnd, sender, receiver, kind, tensors, {"re": "rap"}, aux)


def cap(rnd=0, sender="client0", receiver="server", kind="model", **extra):
    """A well-formed capture record (what the channel writes), for storing tensors directly."""
    direction = "up" if receiver == "server" else "down" if sender == "server" else "peer"
    return {"round": rnd, "sender": sender, "receiver": receiver, "direction": direction, "kind": kind,
            "scalars": 0, "paper_scalars": 0, "bytes": 0, "aux": [], "meta": {}, **extra}  # fmt: skip


def test_message_checks_on_write():
    with pytest.raises(TypeError, match="kind name"):
        msg(kind="")
    with pytest.raises(ValueError, match="requires grad"):
        msg(rep=torch.zeros(3, requires_grad=True))
    with pytest.raises(TypeError, match="JSON"):
        Message(0, "a", "server", "rep", {"x": torch.zeros(1)}, {"bad": object()})
    m = msg()
    assert m.direction == "up" and m.scalars == 6 and m.paper_scalars == 4 and m.nbytes == 24


def test_store_roundtrip_dedupe_and_flipped_byte(tmp_path):
    store = TensorStore(tmp_path / "cap", "capture", create=True)
    t = {"w": torch.randn(3, 4)}
    a = store.append(cap(), t)
    b = store.append(cap(), t)
    assert a["sha256"] == b["sha256"] and (a["seq"], b["seq"]) == (0, 1)
    assert len(list((tmp_path / "cap" / "blobs").rglob("*.safetensors"))) == 1  # content-addressed
    assert torch.equal(store.load(a)["w"], t["w"])
    assert any("uncommitted: 2 record(s)" in p for p in store.verify())  # written, round not completed
    store.flush()
    assert store.verify() == []
    blob = store.blob_path(a["sha256"])
    data = bytearray(blob.read_bytes())
    data[-3] ^= 0x01
    blob.write_bytes(bytes(data))
    problems = store.verify()
    assert len(problems) == 2 and all("checksum mismatch" in p for p in problems)
    with pytest.raises(CaptureError, match="checksum"):
        store.load(a)


def test_store_refuses_foreign_folders_and_bad_index(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(CaptureError, match="not a privfl"):
        TensorStore(tmp_path / "x", "capture")
    (tmp_path / "x" / "manifest.json").write_text(json.dumps({"format": "other/9"}))
    with pytest.raises(CaptureError, match="unknown store format"):
        TensorStore(tmp_path / "x", "capture")
    store = TensorStore(tmp_path / "k", "knowledge", create=True)
    with pytest.raises(CaptureError, match="holds 'knowledge'"):
        TensorStore(tmp_path / "k", "capture")
    store.append({"round": 0, "client": "client0", "kind": "extractor"}, {"a": torch.ones(1)})
    store.flush()
    with open(store.index_path, "a") as fh:
        fh.write('{"seq": 1, "round": 1')  # a run killed mid-append
    assert len(store.records()) == 1 and any("partial" in p for p in store.verify())
    assert store.truncate(lambda r: True)[0] == 1
    assert store.verify() == [] and store.append({"round": 1, "client": "client0", "kind": "extractor"}, {"a": torch.zeros(1)})["seq"] == 1
    with open(store.index_path, "a") as fh:
        fh.write("garbage\n")
    with pytest.raises(CaptureError, match="not a valid"):
        store.records()


def test_channel_captures_what_left_after_mods_and_delivers_copies(tmp_path):
    cap = TensorStore(tmp_path / "capture", "capture", create=True)
    truth = TensorStore(tmp_path / "truth", "truth", create=True)

    def add_one(m: Message, ctx) -> Message:  # a stand-in defense
        return Message(m.round, m.sender, m.receiver, m.kind, {k: v + 1 for k, v in m.tensors.items()}, m.meta, m.aux)

    ch = Channel(cap, truth, mods=[add_one])
    original = msg()
    delivered = ch.send(original, truth={"indices": torch.arange(5)})
    rec = cap.records()[0]
    assert torch.equal(cap.load(rec)["rep"], torch.arange(4.0) + 1)  # defended message is captured
    assert torch.equal(delivered.tensors["rep"], torch.arange(4.0) + 1)
    delivered.tensors["rep"].zero_()
    assert torch.equal(cap.load(rec)["rep"], torch.arange(4.0) + 1)  # receiver cannot alias
    assert truth.records()[0]["message_seq"] == rec["seq"]
    assert ch.context.reference(Message(1, "server", "client0", "ent_rep", {"x": torch.zeros(1)})) is not None
    assert "indices" not in rec["tensors"]  # ground truth never enters the capture
    out = ch.broadcast(0, ["client0", "client1"], "head", {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)})
    assert set(out) == {"client0", "client1"}
    records = ch.end_round()
    comm = summarize_comm(records)
    assert comm["up"]["paper_scalars"] == 4 and comm["up"]["scalars"] == 6
    assert comm["down"]["scalars"] == 2 * (2 * 3 + 2) and comm["down"]["messages"] == 2
