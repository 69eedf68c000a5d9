"""Fuzz every reader of a file privfl or a user wrote: any bytes must give a valid object or a one-line PrivflError.

The rule (privfl.errors): a reader of a run's files (capture/knowledge/truth stores, config.json, run.json,
metrics.jsonl, summary.json, the partition, the checkpoint), of a user's config file (.toml/.yaml/.json) or of
a dataset file (IDX, raw or gzipped) returns a valid object or raises a :class:`~privfl.errors.PrivflError`
with a one-line message, for ANY input bytes: never another exception, never a hang, never unbounded memory.
``verify_run`` is stricter: it returns a report for any damage and raises nothing at all.

Each input takes one file of a valid base (a tiny run built directly with the project's own writers, or a run
you trained, ``--base RUN``), mutates it and runs one reader on it: byte flips, truncation, insertion, deletion,
splicing with another file, purely random bytes, and format-aware mutations (JSON values replaced by another
type, huge ints, deep nesting, huge lists, NaN, negative numbers, very long strings, unicode, keys removed or
added; the safetensors length prefix and header; the IDX magic and dimensions; the gzip stream's contents).

    python -m experiments.robustness.fuzz_readers                        # 100,000 inputs spread over the readers
    python -m experiments.robustness.fuzz_readers --inputs 5000 --seed 3 --reader config.file --reader verify_run
    python -m experiments.robustness.fuzz_readers --base runs/my-run     # mutate a trained run's files instead

Per reader it prints inputs tried, accepted, one-line errors, tracebacks (any other exception, an invalid object
or a multi-line PrivflError; the first 3 distinct ones are shown) and hangs (over ``--timeout`` seconds), then
``fuzz: N inputs, T tracebacks, H hangs``. The same ``--seed`` gives the same inputs. tests/capture/test_fuzz.py drives
the same readers and mutations from hypothesis.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import hashlib
import json
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ------------------------------------------------------------------------------------------- time limit


class Hang(BaseException):
    """Raised by the alarm inside a reader that ran too long (a BaseException: no reader may swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`Hang` in the main thread once ``seconds`` of wall time have passed.

    An alarm armed outside (pytest-timeout's) is put back afterwards with the time it had left."""

    def alarm(signum: int, frame: Any) -> None:
        raise Hang(f"no answer after {seconds:g} s")

    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, alarm)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 1e-3))


# ---------------------------------------------------------------------------------------------- base run

CLIENTS, ROUNDS, REP_DIM, CLASSES, POOL = 3, 2, 8, 10, 60


def build_base_run(run_dir: Path) -> Path:
    """A small, complete and intact fedre run written by the project's own writers (no training, no dataset):
    config.json/.toml, run.json, the capture/truth/knowledge stores (through the real Channel), metrics.jsonl,
    summary.json, partition.json + truth/partition.safetensors and the checkpoint. ``verify_run`` passes it."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from privfl.capture.message import Message
    from privfl.capture.store import TensorStore, atomic_write_text
    from privfl.channel import Channel, summarize_comm
    from privfl.config import build_config, save_config
    from privfl.data.datasets import FASHION_MNIST_CLASSES
    from privfl.data.partition import split_train_test
    from privfl.engine import knowledge_rounds_text, metrics_csv_text, summary_accuracies
    from privfl.fl.method import EXPOSURES
    from privfl.methods import resolve_method

    run_dir.mkdir(parents=True)
    cls = resolve_method("fedre")
    values = {"method": "fedre", "num_clients": CLIENTS, "rounds": ROUNDS, "subsample": POOL, "rep_dim": REP_DIM}
    cfg = build_config({**values, "progress": False, "out_dir": str(run_dir.parent), "run_name": run_dir.name}, cls.Options)
    save_config(cfg, run_dir)
    archs = ["mlp"] * CLIENTS
    info = {
        "method": "fedre",
        "paper": cls.paper,
        "sends": cls.sends,
        "topology": "star",
        "knowledge": {k: {"rounds": knowledge_rounds_text(cfg), "threat_model": EXPOSURES[k]} for k in cls.exposes},
        "archs": archs,
        "dataset": {
            "name": "fashionmnist",
            "num_classes": CLASSES,
            "channels": 1,
            "image_size": 28,
            "mean": [0.5],
            "std": [0.5],
            "class_names": list(FASHION_MNIST_CLASSES),
        },
        "stores": {"capture": "capture/", "knowledge": "knowledge/", "ground_truth": "truth/"},
    }
    atomic_write_text(run_dir / "run.json", json.dumps(info, indent=2) + "\n")

    gen = torch.Generator().manual_seed(0)
    split = split_train_test([np.arange(k, POOL, CLIENTS) for k in range(CLIENTS)], cfg.train_fraction, seed=0)
    part = split.to_tensors()
    part["subset"] = torch.arange(0, 3 * POOL, 3, dtype=torch.int64)
    (run_dir / "truth").mkdir()
    capture = TensorStore(run_dir / "capture", "capture", create=True)
    truth = TensorStore(run_dir / "truth", "truth", create=True)
    knowledge = TensorStore(run_dir / "knowledge", "knowledge", create=True)
    save_file(part, str(run_dir / "truth" / "partition.safetensors"))
    sizes = {"train_sizes": [len(t) for t in split.train], "test_sizes": [len(t) for t in split.test]}
    atomic_write_text(run_dir / "partition.json", json.dumps({"scheme": "iid", "class_names": list(FASHION_MNIST_CLASSES), **sizes}) + "\n")

    channel = Channel(capture, truth, method="fedre", sends=cls.sends)
    clients = [f"client{k}" for k in range(CLIENTS)]
    head = {"weight": torch.randn(CLASSES, REP_DIM, generator=gen), "bias": torch.zeros(CLASSES)}
    channel.broadcast(0, clients, "head", head, meta={"phase": "setup"})
    channel.end_round()
    history: list[dict[str, Any]] = []
    for rnd in range(ROUNDS):
        for k, name in enumerate(clients):
            ids = torch.as_tensor(split.train[k][:4])
            msg = Message(rnd, name, "server", "ent_rep", {"rep": torch.randn(REP_DIM, generator=gen), "label": torch.full((CLASSES,), 0.1)})
            channel.send(msg, truth={"indices": ids, "weights": torch.full((len(ids),), 0.25, dtype=torch.float64)})
        head = {k: v + 0.01 for k, v in head.items()}
        channel.broadcast(rnd, clients, "head", head)
        records = channel.end_round()
        history.append({"round": rnd, "acc": 0.5, "acc_std": 0.0, "selected": list(range(CLIENTS)), "comm": summarize_comm(records)})
    for k, name in enumerate(clients):
        spec = {"arch": archs[k], "image_size": 28, "in_channels": 1, "mapping": cfg.mapping, "num_classes": CLASSES, "rep_dim": REP_DIM}
        knowledge.append({"round": ROUNDS - 1, "client": name, "kind": "extractor", "arch": archs[k], "spec": spec}, {"w": torch.ones(2, 3) * k})
    knowledge.flush()
    atomic_write_text(run_dir / "metrics.jsonl", "".join(json.dumps(h, sort_keys=True) + "\n" for h in history))
    atomic_write_text(run_dir / "metrics.csv", metrics_csv_text(history))
    summary = {"method": "fedre", "dataset": "fashionmnist", "clients": CLIENTS, "rounds": ROUNDS, **summary_accuracies(history)}
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    state = {f"client{k}.head.{p}": v.clone() for k in range(CLIENTS) for p, v in head.items()}
    state.update({f"method.head.{p}": v.clone() for p, v in head.items()})
    (run_dir / "checkpoint").mkdir()
    save_file(state, str(run_dir / "checkpoint" / f"state-r{ROUNDS - 1:05d}.safetensors"))
    pointer = {"round": ROUNDS - 1, "file": f"state-r{ROUNDS - 1:05d}.safetensors", "history": history, "defenses": []}
    atomic_write_text(run_dir / "checkpoint" / "checkpoint.json", json.dumps(pointer) + "\n")
    # the same config as a user would write it: the inputs of read_config_file
    data = {k: v for k, v in dataclasses.asdict(cfg).items() if v is not None}
    folder = run_dir.parent / f"{run_dir.name}-configs"
    folder.mkdir()
    import tomli_w
    import yaml

    (folder / "config.toml").write_text(tomli_w.dumps(data))
    (folder / "config.yaml").write_text(yaml.safe_dump({k.replace("_", "-"): v for k, v in data.items()}))
    (folder / "config.json").write_text(json.dumps(data, indent=1))
    write_idx_folders(run_dir.parent / f"{run_dir.name}-idx")
    return run_dir


def idx_bytes(array: Any) -> bytes:
    """``array`` (uint8) in the IDX format: 0, 0, dtype 0x08, ndim, big-endian dims, data."""
    return bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write_idx_folders(folder: Path) -> None:
    """``folder/raw`` and ``folder/gz``: the four Fashion-MNIST IDX files of a 6-image (4 train + 2 test) pool."""
    import numpy as np

    rng = np.random.default_rng(0)
    files = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (4, 5, 5), dtype=np.uint8),
        "train-labels-idx1-ubyte": np.array([0, 3, 9, 1], dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (2, 5, 5), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": np.array([2, 2], dtype=np.uint8),
    }
    for sub in ("raw", "gz"):
        (folder / sub).mkdir(parents=True)
    for name, array in files.items():
        (folder / "raw" / name).write_bytes(idx_bytes(array))
        (folder / "gz" / f"{name}.gz").write_bytes(gzip.compress(idx_bytes(array), mtime=0))


# ---------------------------------------------------------------------------------------------- mutation

#: JSON text spliced in for a value: what json.dumps cannot write (deep nesting, huge numbers, odd tokens)
RAW_TOKENS = (
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1e999",
    "-0",
    "1" * 5000,  # beyond Python's int/str digit limit: json.loads raises ValueError (not JSONDecodeError)
    "-" + "9" * 400,
    "[" * 60000 + "]" * 60000,  # beyond the recursion limit
    '{"a":' * 60000 + "1" + "}" * 60000,
    "[" + "0," * 200000 + "0]",  # a huge list
    '"' + "a" * 300000 + '"',  # a very long string
    '"\\ud800"',  # a lone surrogate: a str that cannot be encoded
    '"\\u0000"',
    '"\\u202e\\ufeff\\u0301"',
)

#: plain values that replace a JSON node (of every type; the fuzzer also uses other nodes of the same file)
VALUES: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    1,
    7,
    2**31,
    2**63,
    2**64 + 1,
    -(2**63) - 1,
    10**30,
    0.5,
    -2.5,
    1e308,
    -1e-310,
    float("nan"),
    float("inf"),
    "",
    "x",
    "server",
    "client0",
    "client99999999",
    "fedre",
    "fedre:Foo",
    "os:system",
    "float16",
    "F8_E5M2",  # safetensors dtypes, some of which torch lacks
    "F4",
    "F6_E2M3",
    "F8_E8M0",
    "U64",
    "C64",
    "BOOL",
    "up",
    "ent_rep",
    "state-r00001.safetensors",
    "../../../etc/passwd",
    "/dev/zero",
    "ü/ℕ/😀 ﷽",
    "0" * 64,
    "a" * 70000,
    [],
    {},
    [1, 2, 3],
    [[1]],
    ["a", 1, None],
    {"a": 1},
    {"": None},
    list(range(1000)),
)


def _alias_bomb(open_: str, close: str, levels: int = 9, width: int = 9) -> bytes:
    """YAML whose last anchor expands to width**levels nodes through aliases ("billion laughs")."""
    lines = [f"l0: &l0 {open_}x{close}" if open_ == "[" else "l0: &l0 {x: 1}"]
    for i in range(1, levels + 1):
        refs = ", ".join(f"*l{i - 1}" if open_ == "[" else f"k{j}: *l{i - 1}" for j in range(width))
        lines.append(f"l{i}: &l{i} {open_}{refs}{close}")
    return ("\n" + "\n".join(lines) + "\n").encode()


#: text fragments spliced into TOML/YAML files (syntax corners of each)
TEXT_SNIPPETS = (
    _alias_bomb("[", "]"),
    _alias_bomb("{", "}"),
    _alias_bomb("[", "]") + b"defense: *l9\ndataset: *l9\n",
    _alias_bomb("{", "}") + b"options: *l9\nfedre: *l8\n",
    b"\n[options]\n",
    b"\n[[defense]]\nx = 1\n",
    b"\nrounds = 1979-05-27T07:32:00Z\n",
    b"\nx = inf\ny = nan\n",
    b"\n1: 2\n",
    b"\n? [a, b]\n: c\n",
    b"\n&a x: *a\n",
    b"\nrecursive: &r {self: *r}\n",
    b"\nloop: &l [*l]\n",
    b"\n!!python/object/apply:os.system ['true']\n",
    b"\nnull: 1\n",
    b"\ntrue: 1\n",
    b"\n- a\n- b\n",
    b"\n---\n---\n",
    b"\n%YAML 1.1\n",
    b"\nmethod: [fedre]\n",
    b"\nmethod: 5\n",
    b"\nmethod = 5\n",
    b"\nmethod = [1]\n",
    b"\noptions = 'ab'\n",
    b"\noptions = [1, 2]\n",
    b"\nfedre = 1\n",
    b"\n\xff\xfe\x00bad utf-8\n",
    b"\n" + b"[" * 5000 + b"]" * 5000 + b"\n",
    b"\nx = " + b"[" * 5000 + b"]" * 5000 + b"\n",
    b"\nx: " + b"[" * 5000 + b"]" * 5000 + b"\n",
    b'\n"\\ud800" = 1\n',
    b"\nx = 99999999999999999999999999\n",
)

BYTE_OPS = ("flip", "set", "truncate", "insert", "delete", "duplicate", "splice", "random", "interesting")
FORMAT_OPS: dict[str, tuple[str, ...]] = {
    "json": ("json",),
    "jsonl": ("json", "lines"),
    "toml": ("json", "snippet"),
    "yaml": ("json", "snippet"),
    "safetensors": ("st_length", "st_header", "st_header_raw", "st_region"),
    "idx": ("idx_field",),
    "gz": ("gz_inner",),
    "bytes": (),
}
INTERESTING_BYTES = (b"\x00", b"\xff", b"\x7f", b"\x80", b"\n", b'"', b"{", b"[", b"\\", b"\r\n", b"\x00" * 8, b"\xff" * 8)
INTERESTING_U32 = (0, 1, 2, 3, 8, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32 - 1)
INTERESTING_U64 = (0, 1, 7, 8, 100, 2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1)


@dataclass(frozen=True)
class Mutation:
    """One edit: an operation, two numbers that say where and how much, some bytes and a JSON value."""

    op: str
    a: int = 0
    b: int = 0
    blob: bytes = b""
    value: Any = None


def ops_for(fmt: str) -> tuple[str, ...]:
    return BYTE_OPS + FORMAT_OPS[fmt]


def apply_mutations(data: bytes, mutations: list[Mutation], fmt: str, pool: list[bytes]) -> bytes:
    """``data`` after each mutation in turn (deterministic: the same list gives the same bytes)."""
    for m in mutations:
        try:
            data = _apply(data, m, fmt, pool)
        except (ValueError, RecursionError, OverflowError, UnicodeError, TypeError):  # an earlier edit left something this one cannot parse
            data = _apply(data, Mutation("insert", m.a, m.b, m.blob), "bytes", [])
    return data


def _apply(data: bytes, m: Mutation, fmt: str, pool: list[bytes]) -> bytes:
    n = len(data)
    pos = m.a % (n + 1)
    if m.op == "flip":
        if not n:
            return data
        out = bytearray(data)
        out[m.a % n] ^= 1 << (m.b % 8)
        return bytes(out)
    if m.op == "set":
        return data[:pos] + (m.blob or b"\x00") + data[pos + len(m.blob or b"\x00") :]
    if m.op == "truncate":
        return data[:pos]
    if m.op == "insert":
        return data[:pos] + m.blob + data[pos:]
    if m.op == "interesting":
        return data[:pos] + INTERESTING_BYTES[m.b % len(INTERESTING_BYTES)] + data[pos:]
    if m.op == "delete":
        return data[:pos] + data[pos + 1 + m.b % 64 :]
    if m.op == "duplicate":
        chunk = data[pos : pos + 1 + m.b % 256]
        return data[:pos] + chunk * (2 + m.b % 3) + data[pos:]
    if m.op == "splice":
        other = pool[m.b % len(pool)] if pool else m.blob
        return data[:pos] + other[m.b % (len(other) + 1) :]
    if m.op == "random":
        return m.blob
    if m.op in ("json", "lines"):
        return _mutate_structured(data, m, fmt)
    if m.op == "snippet":
        return data[:pos] + TEXT_SNIPPETS[m.b % len(TEXT_SNIPPETS)] + data[pos:]
    if m.op.startswith("st_"):
        return _mutate_safetensors(data, m)
    if m.op == "idx_field":
        return _mutate_idx(data, m)
    if m.op == "gz_inner":
        try:
            inner = gzip.decompress(data)
        except Exception:  # already damaged (zlib.error, EOFError, ...): leave it
            return data
        return gzip.compress(_mutate_idx(inner, m), mtime=0)
    raise ValueError(f"unknown mutation {m.op!r}")


# ----------------------------------------------------------------------------------------- structured


def _nodes(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:50]):
            yield from _nodes(v, (*path, i))


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return obj


_RAW = "\x00RAW\x00"  # marks where a raw token goes in the dumped text


def _mutate_value(doc: Any, m: Mutation) -> tuple[Any, str | None]:
    """``doc`` with one node edited, and a raw JSON token to splice in place of the marker (or None)."""
    nodes = list(_nodes(doc))
    path, node = nodes[m.a % len(nodes)]
    how = m.b % 8
    raw = None
    if how == 0 and path:  # remove the node
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        del parent[path[-1]]
        return doc, None
    if how == 1 and isinstance(node, dict):  # an extra key
        node[str(m.value)[:40] if m.value is not None else "extra"] = m.value
        return doc, None
    if how == 2:  # a raw token (deep nesting, huge numbers, NaN, ...)
        raw = RAW_TOKENS[m.a % len(RAW_TOKENS)]
        return _set(doc, path, _RAW), raw
    if how == 3:  # another node of the same document (a type confusion that looks plausible)
        other = nodes[(m.a * 7 + m.b) % len(nodes)][1]
        return _set(doc, path, json.loads(json.dumps(other))), None
    if how == 4 and isinstance(node, (int, float)) and not isinstance(node, bool):  # negative, off by one, huge
        return _set(doc, path, (-node - 1, node + 1, node * 2**40, -(2**70))[m.a % 4]), None
    if how == 5 and isinstance(node, list):  # a longer or shorter list
        return _set(doc, path, node[: m.a % (len(node) + 1)] if m.a % 2 else node * (2 + m.a % 50)), None
    return _set(doc, path, m.value), None


def _dump(fmt: str, doc: Any, raw: str | None) -> bytes:
    if fmt == "toml":
        import tomli_w

        text = tomli_w.dumps(doc)
        return text.replace(json.dumps(_RAW), raw or "0").encode("utf-8", "surrogatepass")
    if fmt == "yaml":
        import yaml

        text = yaml.safe_dump(doc, allow_unicode=True)
        return text.replace("\x00RAW\x00", raw or "0").replace('"\\0RAW\\0"', raw or "0").encode("utf-8", "surrogatepass")
    text = json.dumps(doc, sort_keys=False)
    return text.replace(json.dumps(_RAW), raw or "0").encode("utf-8", "surrogatepass")


def _load(fmt: str, data: bytes) -> Any:
    if fmt == "toml":
        from privfl.config import tomllib

        return tomllib.loads(data.decode())
    if fmt == "yaml":
        import yaml

        return yaml.safe_load(data.decode())
    return json.loads(data)


def _mutate_structured(data: bytes, m: Mutation, fmt: str) -> bytes:
    """A JSON/TOML/YAML-aware edit; for JSON lines either one line is edited or lines are dropped/duplicated/swapped."""
    if fmt == "jsonl":
        lines = data.split(b"\n")
        body, tail = lines[:-1], lines[-1]
        if not body:
            return data
        i = m.a % len(body)
        if m.op == "lines":
            j = (m.a // 7 + m.b) % len(body)
            how = m.b % 4
            if how == 0:
                del body[i]
            elif how == 1:
                body.insert(j, body[i])
            elif how == 2:
                body[i], body[j] = body[j], body[i]
            else:
                body = body[: i + 1]
            return b"\n".join([*body, tail])
        body[i] = _mutate_structured(body[i], Mutation("json", m.a // 3, m.b, m.blob, m.value), "json")
        return b"\n".join([*body, tail])
    try:
        doc = _load(fmt, data)
    except Exception:  # the file is damaged already: a byte mutation then
        return _apply(data, Mutation("insert", m.a, m.b, m.blob), "bytes", [])
    if sum(1 for _ in zip(range(5001), _nodes(doc))) > 5000:  # e.g. a YAML alias bomb: walking or dumping it would explode
        return _apply(data, Mutation("insert", m.a, m.b, m.blob), "bytes", [])
    try:
        doc, raw = _mutate_value(doc, m)
        return _dump(fmt, doc, raw)
    except Exception:  # tomli_w cannot write None, a mixed array, ...: fall back to a raw token in the text
        token = RAW_TOKENS[m.a % len(RAW_TOKENS)].encode()
        pos = m.a % (len(data) + 1)
        return data[:pos] + token + data[pos:]


def _mutate_safetensors(data: bytes, m: Mutation) -> bytes:
    """Edits of a safetensors file: its 8-byte little-endian header length, its JSON header (re-encoded with
    a matching or a wrong length) or bytes inside the header region."""
    if len(data) < 8:
        return data
    (hlen,) = struct.unpack("<Q", data[:8])
    header, body = data[8 : 8 + hlen], data[8 + hlen :]
    if m.op == "st_length":
        choices = (*INTERESTING_U64, hlen - 1, hlen + 1, len(data), len(data) - 8, m.b)
        return struct.pack("<Q", choices[m.a % len(choices)] % 2**64) + data[8:]
    if m.op == "st_region":  # a byte edit inside the length + header (where the parsing is)
        region = max(1, min(len(data), 8 + hlen))
        kinds = ("flip", "set", "insert", "delete", "interesting")
        inner = Mutation(kinds[m.b % len(kinds)], m.a % region, m.b // 5, m.blob[:4], m.value)
        return _apply(data, inner, "bytes", [])
    try:
        doc = json.loads(header)
    except ValueError:
        return data
    # point at the interesting parts first: a tensor's dtype, shape and data_offsets, and __metadata__
    doc, raw = _mutate_value(doc, m)
    text = _dump("json", doc, raw) if m.op == "st_header" else json.dumps(doc).encode()
    if m.op == "st_header_raw":  # the same header, a wrong length
        return struct.pack("<Q", (len(text) + (m.b % 17) - 8) % 2**64) + text + body
    return struct.pack("<Q", len(text)) + text + body


def _mutate_idx(data: bytes, m: Mutation) -> bytes:
    """Set one header field of an IDX file: a magic byte, the dtype code, ndim, or a 4-byte dimension."""
    if len(data) < 4:
        return data
    ndim = data[3]
    fields = 4 + max(ndim, 1)
    which = m.a % fields
    out = bytearray(data)
    if which < 4:
        out[which] = (0, 1, 8, 9, 0x0B, 0x0C, 0x0D, 0x0E, 0x0F, 3, 255, m.b % 256)[m.b % 12]
        return bytes(out)
    value = (*INTERESTING_U32, m.b % 2**32)[m.b % (len(INTERESTING_U32) + 1)]
    at = 4 + 4 * (which - 4)
    return bytes(out[:at]) + struct.pack(">I", value) + bytes(out[at + 4 :])


def random_mutations(rng: random.Random, fmt: str) -> list[Mutation]:
    """1-3 mutations for ``fmt`` drawn from ``rng`` (format-aware ones half of the time)."""
    out = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        special = FORMAT_OPS[fmt]
        op = rng.choice(special) if special and rng.random() < 0.5 else rng.choice(BYTE_OPS)
        blob_len = rng.choice((0, 1, 2, 4, 8, 16, 64, 512, 4096))
        if op == "random" and rng.random() < 0.3:
            blob = bytes(rng.choice((0x20, 0x30, 0x41, 0x5B, 0x7B, 0x22, 0x0A)) for _ in range(blob_len))
        else:
            blob = rng.randbytes(blob_len)
        value = rng.choice(VALUES)
        out.append(Mutation(op, rng.getrandbits(rng.choice((4, 8, 16, 32))), rng.getrandbits(rng.choice((4, 8, 16, 32))), blob, value))
    return out


# ----------------------------------------------------------------------------------------------- targets


@dataclass
class Outcome:
    kind: str  # "ok", "error", "traceback", "hang"
    detail: str = ""


@dataclass
class Target:
    """A reader and the files (relative to the workspace, with their format) it is fuzzed through."""

    name: str
    files: list[tuple[str, str]]
    call: Callable[[Workspace, str], Any]
    strict: bool = False  # verify_run: must not raise at all, not even a PrivflError


class Workspace:
    """A writable copy of the base; ``put`` replaces one file's bytes until ``restore``."""

    def __init__(self, base: Path, root: Path):
        self.root = root
        self.run = root / "run"
        shutil.copytree(base, self.run, symlinks=True)
        for extra in ("configs", "idx"):
            src = base.parent / f"{base.name}-{extra}"
            if src.exists():
                shutil.copytree(src, root / extra)
            elif extra == "configs":
                _configs_from_run(self.run, root / extra)
            else:
                write_idx_folders(root / extra)
        self.original: dict[Path, bytes] = {}
        self.created: list[Path] = []
        self.pool = [p.read_bytes()[:20000] for p in sorted(root.rglob("*")) if p.is_file()][:64]

    def path(self, rel: str) -> Path:
        return self.root / rel

    def read(self, rel: str) -> bytes:
        return self.path(rel).read_bytes()

    def put(self, rel: str, data: bytes) -> None:
        path = self.path(rel)
        if path not in self.original:
            self.original[path] = path.read_bytes()
        path.write_bytes(data)

    def create(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self.created.append(path)

    def restore(self) -> None:
        for path, data in self.original.items():
            path.write_bytes(data)
        for path in self.created:
            path.unlink(missing_ok=True)
        self.original.clear()
        self.created.clear()


def _configs_from_run(run: Path, folder: Path) -> None:
    import tomli_w
    import yaml

    data = {k: v for k, v in json.loads((run / "config.json").read_text()).items() if v is not None}
    folder.mkdir()
    (folder / "config.toml").write_text(tomli_w.dumps(data))
    (folder / "config.yaml").write_text(yaml.safe_dump(data))
    (folder / "config.json").write_text(json.dumps(data, indent=1))


def run_files(ws: Workspace) -> list[tuple[str, str]]:
    """Every file of the workspace's run with its format (blobs: the checksum-named safetensors)."""
    out = []
    for path in sorted(ws.run.rglob("*")):
        if not path.is_file() or path.name == ".lock" or path.suffix == ".png":
            continue
        rel = str(path.relative_to(ws.root))
        fmt = {".json": "json", ".jsonl": "jsonl", ".safetensors": "safetensors", ".toml": "toml"}.get(path.suffix, "bytes")
        out.append((rel, fmt))
    return out


def _store(ws: Workspace, rel: str) -> tuple[Any, str]:
    from privfl.capture.store import TensorStore

    role = rel.split("/")[1]
    return TensorStore(ws.run / role, role), role


def _check_records(records: Any) -> None:
    assert isinstance(records, list) and all(isinstance(r, dict) for r in records), "records() must give a list of dicts"


def _check_tensors(tensors: Any) -> None:
    import torch

    assert isinstance(tensors, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()), "not str -> Tensor"


def call_store_open(ws: Workspace, rel: str) -> Any:
    store, _ = _store(ws, rel)
    _check_records(store.records())
    return store


def call_store_index(ws: Workspace, rel: str) -> Any:
    from privfl.capture.store import IndexScan

    store, _ = _store(ws, rel)
    scan = store.scan()
    assert isinstance(scan, IndexScan)
    problems = store.verify()
    assert isinstance(problems, list) and all(isinstance(p, str) for p in problems)
    _check_records(store.records(strict=False))
    records = store.records()
    _check_records(records)
    if records:
        _check_tensors(store.load(records[-1]))
    return records


def call_store_blob(ws: Workspace, rel: str) -> Any:
    """The fuzzed blob is stored under its own checksum, so ``load`` gets past the checksum to the parser."""
    store, _ = _store(ws, rel)
    data = ws.read(rel)
    ws.restore()  # the blob keeps its original name and bytes; the fuzzed bytes go to their own name
    digest = hashlib.sha256(data).hexdigest()
    path = store.blob_path(digest)
    if not path.exists():
        ws.create(path, data)
    tensors = store.load({"seq": 0, "sha256": digest})
    _check_tensors(tensors)
    return tensors


def call_run(ws: Workspace, rel: str) -> Any:
    from privfl.run import Run

    run = Run(ws.run)
    assert isinstance(run.config, dict) and isinstance(run.info, dict)
    assert isinstance(run.method, str) and isinstance(run.name, str)
    return run


def call_run_describe(ws: Workspace, rel: str) -> Any:
    """What the attack and analysis commands ask of an opened run: method, clients, options, a client's model request."""
    from privfl.config import TrainConfig
    from privfl.run import Run

    run = Run(ws.run)
    assert isinstance(run.num_clients, int)
    assert isinstance(run.cfg, TrainConfig) and isinstance(run.method_cls, type)
    request = run.model_request(0)
    assert isinstance(request.arch, str) and isinstance(request.num_classes, int), "a model request of the wrong types"
    return request


def call_run_metrics(ws: Workspace, rel: str) -> Any:
    from privfl.run import Run

    rows = Run(ws.run).metrics
    assert isinstance(rows, list) and all(isinstance(r, dict) and isinstance(r["round"], int) for r in rows)
    return rows


def call_run_summary(ws: Workspace, rel: str) -> Any:
    from privfl.run import Run

    summary = Run(ws.run).summary
    assert isinstance(summary, dict)
    return summary


def call_partition(ws: Workspace, rel: str) -> Any:
    from privfl.data.partition import ClientSplit
    from privfl.run import load_partition

    part = load_partition(ws.run)
    _check_tensors(part)
    part.pop("subset", None)
    split = ClientSplit.from_tensors(part)
    assert split.num_clients >= 1
    return split


def call_checkpoint(ws: Workspace, rel: str) -> Any:
    from privfl.run import load_checkpoint_state, read_checkpoint

    info = read_checkpoint(ws.run)
    if info is None:
        return None
    assert isinstance(info, dict)
    state = load_checkpoint_state(ws.run, info)
    _check_tensors(state)
    return state


def call_config(ws: Workspace, rel: str) -> Any:
    from privfl.config import TrainConfig, build_config, read_config_file
    from privfl.methods import resolve_method

    values = read_config_file(ws.path(rel))
    assert isinstance(values, dict)
    # source=: the fuzzer must not import modules its random method names name (a user's own file may)
    cls = resolve_method(values.get("method", "fedre"), source=rel)
    cfg = build_config(values, getattr(cls, "Options", None))
    assert isinstance(cfg, TrainConfig)
    return cfg


def call_verify(ws: Workspace, rel: str) -> Any:
    from privfl.verify import VerifyReport, verify_run

    report = verify_run(ws.run)
    assert isinstance(report, VerifyReport), "verify_run must return a VerifyReport"
    lines = report.lines()
    assert all(isinstance(line, str) for line in lines)
    return report


def call_attacker_view(ws: Workspace, rel: str) -> Any:
    from privfl.kinds import KINDS
    from privfl.run import AttackerView, Run

    view = AttackerView(Run(ws.run))
    _check_records(view.records())
    for kind in view.kinds():
        assert isinstance(view.rounds(kind), list)
    assert isinstance(view.granted(), set)
    _check_records(view.extractor_records())
    for kind in ("ent_rep", "head"):
        assert kind in KINDS
        _check_records(view.messages(kind))
    return view


def call_run_models(ws: Workspace, rel: str) -> Any:
    from privfl.run import Run

    models = Run(ws.run).models()
    assert isinstance(models.round, int) and isinstance(models.config, dict) and isinstance(models.info, dict)
    assert isinstance(models.method, str) and isinstance(models.num_clients, int)  # what the analyze commands ask first
    assert isinstance(models.class_names, list)
    return models


def call_idx(ws: Workspace, rel: str) -> Any:
    import numpy as np

    from privfl.data.datasets import ImageDataset, load_dataset, read_idx

    array = read_idx(ws.path(rel))
    assert isinstance(array, np.ndarray)
    dataset = load_dataset("fashionmnist", ws.path(rel).parent)
    assert isinstance(dataset, ImageDataset)
    return dataset


def build_targets(ws: Workspace) -> list[Target]:
    files = run_files(ws)
    stores = [(rel, fmt) for rel, fmt in files if rel.split("/")[1] in ("capture", "truth", "knowledge")]
    blobs = [(rel, fmt) for rel, fmt in stores if "/blobs/" in rel][:3]
    by_name = {rel.split("/", 1)[1]: (rel, fmt) for rel, fmt in files}
    run_meta = [by_name["config.json"], by_name["run.json"]]
    idx = [(str(p.relative_to(ws.root)), "gz" if p.suffix == ".gz" else "idx") for p in sorted((ws.root / "idx").rglob("*")) if p.is_file()]
    configs = [(f"configs/config.{ext}", ext) for ext in ("toml", "yaml", "json")]
    return [
        Target("store.open", [(rel, fmt) for rel, fmt in stores if rel.endswith("manifest.json")], call_store_open),
        Target("store.index", [(rel, fmt) for rel, fmt in stores if rel.endswith(("index.jsonl", "head.json"))], call_store_index),
        Target("store.load", blobs, call_store_blob),
        Target("run.open", run_meta, call_run),
        Target("run.describe", run_meta, call_run_describe),
        Target("run.metrics", [by_name["metrics.jsonl"]], call_run_metrics),
        Target("run.summary", [by_name["summary.json"]], call_run_summary),
        Target("run.partition", [by_name["truth/partition.safetensors"]], call_partition),
        Target("run.checkpoint", [(rel, fmt) for rel, fmt in files if "/checkpoint/" in rel], call_checkpoint),
        Target("config.file", configs, call_config),
        Target("verify_run", files, call_verify, strict=True),
        Target(
            "attacker_view",
            [*run_meta, *[(rel, fmt) for rel, fmt in stores if rel.split("/")[1] in ("capture", "knowledge") and "/blobs/" not in rel]],
            call_attacker_view,
        ),
        Target("run_models", [*run_meta, by_name["checkpoint/checkpoint.json"]], call_run_models),
        Target("idx", idx, call_idx),
    ]


def run_one(target: Target, ws: Workspace, rel: str, data: bytes, timeout: float) -> Outcome:
    """Write ``data`` as ``rel``, call the reader, classify what happened, put the file back."""
    from privfl.errors import PrivflError

    try:
        ws.put(rel, data)
        with time_limit(timeout):
            result = target.call(ws, rel)
        if target.strict and not result.ok:  # verify_run found (and reported) damage: the expected answer
            return Outcome("error", next(p for found in result.problems.values() for p in found))
        return Outcome("ok")
    except Hang as exc:
        return Outcome("hang", f"{target.name} on {rel}: {exc}")
    except PrivflError as exc:
        text = str(exc)
        if target.strict:
            return Outcome("traceback", f"verify_run raised {type(exc).__name__}: {text[:200]}")
        if not text or "\n" in text:
            return Outcome("traceback", f"multi-line or empty {type(exc).__name__}: {text[:200]!r}")
        return Outcome("error", text)
    except Exception as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        where = next((f for f in reversed(frames) if "/privfl/" in f.filename), frames[-1] if frames else None)
        at = f" at {Path(where.filename).name}:{where.lineno} ({where.name})" if where else ""
        return Outcome("traceback", f"{type(exc).__name__}{at}: {str(exc)[:160]!r}")
    finally:
        ws.restore()


# -------------------------------------------------------------------------------------------------- main


@dataclass
class Tally:
    inputs: int = 0
    ok: int = 0
    errors: int = 0
    tracebacks: int = 0
    hangs: int = 0
    memory: int = 0
    seconds: float = 0.0
    examples: dict[str, str] = field(default_factory=dict)  # distinct failure -> first input that showed it


def _signature(detail: str) -> str:
    """A failure's identity: exception type and place, without the varying message."""
    return detail.split(": ")[0] if detail else detail


def fuzz(base: Path, inputs: int, seed: int, timeout: float, readers: list[str] | None, keep: Path | None) -> dict[str, Tally]:
    root = Path(tempfile.mkdtemp(prefix="privfl-fuzz-"))
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    trace = open(keep / "trace.txt", "w") if keep is not None else None  # noqa: SIM115 - kept open for the whole run
    try:
        ws = Workspace(base, root / "ws")
        targets = [t for t in build_targets(ws) if readers is None or t.name in readers]
        if readers and len(targets) != len(readers):
            raise SystemExit(f"unknown reader(s) {set(readers) - {t.name for t in targets}}; known: {[t.name for t in build_targets(ws)]}")
        # warm imports (privfl.methods imports every method, torchvision included) before any input is timed
        for t in targets:
            run_one(t, ws, t.files[0][0], ws.read(t.files[0][0]), 600)
        rng = random.Random(seed)
        tallies = {t.name: Tally() for t in targets}
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for i in range(inputs):
            target = targets[i % len(targets)]
            rel, fmt = rng.choice(target.files)
            original = ws.read(rel)
            if rng.random() < 0.03:
                data = rng.randbytes(rng.choice((0, 1, 8, 100, 5000)))
            else:
                data = apply_mutations(original, random_mutations(rng, fmt), fmt, ws.pool)
            tally = tallies[target.name]
            if trace is not None:  # where the process was if it dies (killed for memory, a crash in native code)
                trace.seek(0)
                trace.write(f"{i} {target.name} {rel}\n".ljust(200))
                trace.flush()
                if keep is not None:
                    (keep / "last-input").write_bytes(data)
            t0 = time.perf_counter()
            out = run_one(target, ws, rel, data, timeout)
            tally.seconds += time.perf_counter() - t0
            tally.inputs += 1
            now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            if now - peak > 512 * 1024:  # kB: one input made the process grow by half a GiB
                tally.memory += 1
                tally.examples.setdefault(f"memory {target.name}", f"peak RSS +{(now - peak) // 1024} MiB on {rel}")
                if keep is not None:
                    (keep / f"{target.name}-memory-{tally.memory}-{Path(rel).name}").write_bytes(data)
            peak = max(peak, now)
            if out.kind == "ok":
                tally.ok += 1
            elif out.kind == "error":
                tally.errors += 1
            else:
                if out.kind == "hang":
                    tally.hangs += 1
                else:
                    tally.tracebacks += 1
                sig = _signature(out.detail)
                if sig not in tally.examples:
                    tally.examples[sig] = out.detail
                    if keep is not None:
                        keep.mkdir(parents=True, exist_ok=True)
                        (keep / f"{target.name}-{len(tally.examples)}-{Path(rel).name}").write_bytes(data)
                        with open(keep / "failures.txt", "a") as fh:
                            fh.write(f"{target.name}-{len(tally.examples)} {rel}: {out.detail}\n")
        return tallies
    finally:
        if trace is not None:
            trace.close()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.robustness.fuzz_readers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--inputs", type=int, default=100_000, help="inputs in all, spread evenly over the readers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds one input may take before it counts as a hang")
    parser.add_argument("--base", type=Path, help="a run directory to mutate (default: a tiny run built in a temp folder)")
    parser.add_argument("--reader", action="append", help="fuzz only these readers (repeatable)")
    parser.add_argument("--keep", type=Path, help="write the first input of each distinct failure here (and trace.txt, last-input)")
    parser.add_argument("--max-memory", type=float, default=8.0, help="address-space limit in GiB (0: none); beyond it a reader fails")
    args = parser.parse_args(argv)
    if args.max_memory:  # an input that makes a reader allocate without bound fails (MemoryError) instead of the machine
        limit = int(args.max_memory * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="privfl-fuzz-base-") as tmp:
        base = args.base.resolve() if args.base else build_base_run(Path(tmp) / "run")
        tallies = fuzz(base, args.inputs, args.seed, args.timeout, args.reader, args.keep)
    total = sum(t.inputs for t in tallies.values())
    tracebacks = sum(t.tracebacks for t in tallies.values())
    hangs = sum(t.hangs for t in tallies.values())
    memory = sum(t.memory for t in tallies.values())
    print(f"{'reader':<16}{'inputs':>8}{'accepted':>10}{'errors':>9}{'tracebacks':>12}{'hangs':>7}{'ms/input':>10}")
    for name, t in tallies.items():
        ms = 1000 * t.seconds / max(t.inputs, 1)
        print(f"{name:<16}{t.inputs:>8}{t.ok:>10}{t.errors:>9}{t.tracebacks:>12}{t.hangs:>7}{ms:>10.2f}")
        for detail in list(t.examples.values())[:3]:
            print(f"    {detail}")
        if len(t.examples) > 3:
            print(f"    ... and {len(t.examples) - 3} more distinct failure(s)")
    elapsed = time.perf_counter() - started
    print(f"{total} inputs in {elapsed:.0f} s ({total / max(elapsed, 1e-9):.0f} inputs/s); inputs that grew memory by > 512 MiB: {memory}")
    print(f"fuzz: {total} inputs, {tracebacks} tracebacks, {hangs} hangs")
    return 1 if tracebacks or hangs or memory else 0


if __name__ == "__main__":
    sys.exit(main())
