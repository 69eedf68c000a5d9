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
    blobs = tmp_path / "cap" / "blobs"
    # kept in memory until the round is committed (or read back, or PENDING_LIMIT bytes are held)
    assert not list(blobs.rglob("*.safetensors")) and (tmp_path / "cap" / "index.jsonl").read_bytes() == b""
    assert torch.equal(store.load(a)["w"], t["w"])  # this object reads its own appends
    assert len(list(blobs.rglob("*.safetensors"))) == 1  # content-addressed
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


def test_store_writes_at_the_round_commit_or_past_its_memory_limit(tmp_path, monkeypatch):
    """Appends are written when the round is committed (flush): another reader sees nothing of the
    round before, everything after; past PENDING_LIMIT bytes the blobs and lines go out early."""
    import privfl.capture.store as store_module

    store = TensorStore(tmp_path / "cap", "capture", create=True)
    reader = TensorStore(tmp_path / "cap", "capture")
    store.append(cap(), {"w": torch.randn(8)})
    assert reader.records() == [] and not list((tmp_path / "cap" / "blobs").rglob("*.safetensors"))
    store.flush()
    assert [r["seq"] for r in reader.records()] == [0] and reader.verify() == []
    monkeypatch.setattr(store_module, "PENDING_LIMIT", 10)
    rec = store.append(cap(), {"w": torch.randn(8)})  # over the limit: written at once, not committed
    assert store.blob_path(rec["sha256"]).is_file() and [r["seq"] for r in reader.records()] == [0, 1]
    assert any("uncommitted: 1 record(s)" in p for p in reader.verify())
    store.flush()
    assert reader.verify() == []


def test_a_blob_already_on_disk_is_not_written_again(tmp_path):
    """The same bytes sent in a later round name the blob the earlier round wrote: the file is left as it is
    (same inode: not replaced), the round's record points at it."""
    store = TensorStore(tmp_path / "cap", "capture", create=True)
    t = {"w": torch.arange(5.0)}
    first = store.append(cap(), t)
    store.flush()
    path = store.blob_path(first["sha256"])
    inode = path.stat().st_ino
    second = store.append(cap(), t)
    store.flush()
    assert second["sha256"] == first["sha256"] and path.stat().st_ino == inode
    assert len(list((tmp_path / "cap" / "blobs").rglob("*.safetensors"))) == 1 and store.verify() == []


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


def test_broadcast_serialises_each_content_once_and_captures_exactly_what_left(tmp_path, monkeypatch):
    """A broadcast's receivers whose message leaves the mods as the same unchanged tensors share one
    serialisation and hash; a receiver whose message a mod replaced, or changed in place, gets its own."""
    import privfl.capture.store as store_mod

    saves: list[int] = []
    real_save = store_mod.st_save

    def counting_save(tensors):
        saves.append(1)
        return real_save(tensors)

    monkeypatch.setattr(store_mod, "st_save", counting_save)
    cap = TensorStore(tmp_path / "capture", "capture", create=True)

    def mod(m: Message, ctx) -> Message:
        if m.receiver == "client1":  # a new tensor for this receiver
            return Message(m.round, m.sender, m.receiver, m.kind, {**m.tensors, "bias": m.tensors["bias"] + 1}, m.meta, m.aux)
        if m.receiver == "client3":  # a mod that (wrongly) edits the message in place: caught by the version counter
            m.tensors["weight"].add_(5)
        return m

    tensors = {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}
    ch = Channel(cap, mods=[mod])
    out = ch.broadcast(0, [f"client{i}" for i in range(6)], "head", tensors, shared=True)
    ch.end_round()
    records = cap.records()
    assert len(saves) == 3  # client0 (and 2), client1, client3 (and 4, 5)
    digests = [r["sha256"] for r in records]
    assert digests[0] == digests[2] and digests[3] == digests[4] == digests[5] and len(set(digests)) == 3
    assert all(r["file_bytes"] == records[0]["file_bytes"] for r in records)
    for rec, name in zip(records, out):  # each record holds what that receiver got
        assert rec["receiver"] == name
        for key, value in cap.load(rec).items():
            assert torch.equal(value, out[name].tensors[key]), (name, key)
    assert torch.equal(cap.load(records[3])["weight"], torch.full((2, 3), 5.0))
    assert torch.equal(cap.load(records[1])["bias"], torch.ones(2)) and torch.equal(cap.load(records[0])["weight"], torch.zeros(2, 3))
    assert cap.verify() == []
    # the same tensors sent again, outside a broadcast, are serialised again (no cache across sends)
    ch.send(Message(1, "server", "client0", "head", tensors))
    assert len(saves) == 4
    # tensors made in inference mode keep no version counter: each receiver's message is serialised
    with torch.inference_mode():
        frozen = {"weight": torch.ones(2, 3), "bias": torch.ones(2)}
    out = Channel(cap).broadcast(1, ["client0", "client2"], "head", frozen, shared=True)
    assert len(saves) == 6 and all(torch.equal(m.tensors["weight"], frozen["weight"]) for m in out.values())
    with pytest.raises(ValueError, match="not stored by this store"):
        cap.append({"round": 1, "sender": "server", "receiver": "client0", "kind": "head"}, tensors, stored=("0" * 64, 10))


def test_portable_tensors_are_unshared_cpu_copies_that_safetensors_writes():
    """Overlapping views of one tensor (as an attack's reconstructions came off a GPU: one image under two
    targets' names) make safetensors refuse the file; ``portable_tensors`` gives each its own contiguous
    CPU copy, in key order."""
    from safetensors.torch import load, save

    from privfl.capture.store import portable_tensors

    batch = torch.arange(24.0).view(3, 2, 4)
    rows = {"r2": batch[2], "r0": batch[0], "r1": batch[1], "r1_again": batch[1:2].squeeze(0)}
    with pytest.raises(RuntimeError, match="share memory"):
        save(rows)
    portable = portable_tensors(rows)
    assert list(portable) == ["r0", "r1", "r1_again", "r2"]
    assert len({t.untyped_storage().data_ptr() for t in portable.values()}) == 4
    assert all(torch.equal(v, batch[int(k[1])]) for k, v in load(save(portable)).items())
    # a tensor that owns its whole storage is written as it is; the same tensor under a second name is copied
    whole = torch.arange(6.0)
    kept = portable_tensors({"a": whole, "b": whole, "empty": torch.empty(0), "empty2": torch.empty(0)})
    assert kept["a"].untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    assert kept["b"].untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
    assert torch.equal(load(save(kept))["b"], whole)
