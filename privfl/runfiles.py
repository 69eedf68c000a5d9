"""Reading a run directory: its files (:class:`RunFiles`), its messages and knowledge records
(:class:`MessageView`), its ground truth (:class:`GroundTruth`), checkpoints and partition.

Nothing here rebuilds a method or a model, so this module depends on no method code: :mod:`privfl.run`
builds :class:`privfl.run.Run` on it, adding the method class, the resolved config and the models.
Reading JSON and safetensors only; never unpickling.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from privfl.capture.store import TensorStore, exc_line, read_contained
from privfl.errors import CaptureError, ConfigError, UnknownNameError
from privfl.kinds import KINDS

if TYPE_CHECKING:
    from typing_extensions import Self


_MAX_JSON_FILE = 1 << 28  # 256 MiB: far above any real config, metrics or summary file


def _read_json(path: Path, what: str) -> Any:
    """A JSON file of a run: never through a link or outside the run, one-line errors."""
    if not path.exists() and not path.is_symlink():
        raise CaptureError(f"{path.parent} is not a readable privfl run: {what} is missing")
    data = read_contained(path.parent, path, what, limit=_MAX_JSON_FILE)
    try:
        return json.loads(data)
    # ValueError: a JSON syntax error, bytes that are not UTF-8, or an int of more than 4300 digits
    except (ValueError, RecursionError) as exc:
        raise CaptureError(f"{path} is not valid JSON ({str(exc)[:80]})") from None


def read_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """``checkpoint/checkpoint.json`` checked (None when the run has not finished a round yet): the
    round, the state file's name (a plain ``state-rNNNNN.safetensors`` in ``checkpoint/``, never a
    path elsewhere), the metrics history and the defenses' states."""
    path = run_dir / "checkpoint" / "checkpoint.json"
    if not path.exists() and not path.is_symlink():
        return None
    info = _read_json(path, "checkpoint/checkpoint.json")
    if (
        not isinstance(info, dict)
        or not isinstance(info.get("round"), int)
        or isinstance(info["round"], bool)
        or info["round"] < 0
        or not isinstance(info.get("file"), str)
        or not re.fullmatch(r"state-r\d{5,}\.safetensors", info["file"])
        or not isinstance(info.get("history"), list)
        or not all(isinstance(h, dict) for h in info["history"])
        or not isinstance(info.get("defenses", []), list)
    ):
        raise CaptureError(f"{path} is not a privfl checkpoint pointer (round, file state-rNNNNN.safetensors, history)")
    return info


def load_checkpoint_state(run_dir: Path, info: dict[str, Any], device: str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint ``info`` names (safetensors: never unpickled, never through a link)."""
    path = run_dir / "checkpoint" / str(info["file"])
    data = read_contained(run_dir, path, "checkpoint")
    digest = info.get("sha256")
    if digest is not None and hashlib.sha256(data).hexdigest() != digest:
        raise CaptureError(f"checksum mismatch in checkpoint {path}: the weights were modified or are corrupt")
    try:
        state = st_load(data)
    except (SafetensorError, ValueError, RuntimeError, TypeError, OverflowError, KeyError) as exc:  # KeyError: a dtype torch lacks (F4, ...)
        raise CaptureError(f"checkpoint {path} is not a valid safetensors file ({exc_line(exc)})") from None
    state = {k: v.to(device) for k, v in state.items()}
    for alias, target in checkpoint_aliases(data, path).items():  # a tensor stored once for several keys (shared views)
        if alias in state or target not in state:
            raise CaptureError(f"checkpoint {path}: alias {alias[:60]!r} -> {target[:60]!r} does not name one stored tensor")
        state[alias] = state[target]
    return state


#: safetensors metadata key of a checkpoint's aliases (inside the file, so its sha256 covers them)
ALIASES_KEY = "privfl.aliases"


def checkpoint_aliases(data: bytes, path: Path) -> dict[str, str]:
    """The ``{key: stored key}`` aliases in a checkpoint's safetensors header metadata ({} when none)."""
    try:
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + size])
        text = (header.get("__metadata__") or {}).get(ALIASES_KEY)
        aliases = {} if text is None else json.loads(text)
    except (ValueError, AttributeError, TypeError) as exc:
        raise CaptureError(f"checkpoint {path}: unreadable alias metadata ({exc_line(exc)})") from None
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise CaptureError(f"checkpoint {path}: the alias metadata is not a map of tensor names")
    return aliases


def load_partition(run_dir: Path) -> dict[str, torch.Tensor]:
    """``truth/partition.safetensors``: the client splits (and the subsample) as 1-D index tensors.

    Checked here so that a damaged or foreign file is one line, never a crash further on."""
    path = run_dir / "truth" / "partition.safetensors"
    data = read_contained(run_dir, path, "partition")
    try:
        part = st_load(data)
    except (SafetensorError, ValueError, RuntimeError, TypeError, OverflowError, KeyError) as exc:  # KeyError: a dtype torch lacks (F4, ...)
        raise CaptureError(f"{path} is not a valid safetensors file ({exc_line(exc)})") from None
    for key, t in part.items():
        if not re.fullmatch(r"subset|(train|test)_\d{1,7}", key):
            raise CaptureError(f"{path}: unexpected tensor {key[:40]!r} (expected train_K, test_K, subset)")
        if t.dim() != 1 or t.dtype not in (torch.int64, torch.int32):
            raise CaptureError(f"{path}: {key} must be a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}")
        if t.numel() and int(t.min()) < 0:
            raise CaptureError(f"{path}: {key} holds negative sample indices")
    return part


class RunFiles:
    """One run directory's files: what the run is, its metrics and summary, its stores. :class:`privfl.run.Run`
    adds what rebuilds its method and models."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ConfigError(f"{self.path} is not a privfl run directory (no config.json)")
        self.config: dict[str, Any] = _read_json(self.path / "config.json", "config.json")
        self.info: dict[str, Any] = _read_json(self.path / "run.json", "run.json") if (self.path / "run.json").exists() else {}
        if not isinstance(self.config, dict) or not isinstance(self.info, dict):
            raise CaptureError(f"{self.path}: config.json and run.json must hold JSON objects")
        self._truth: dict[str, GroundTruth] = {}  # by data root, opened on first use

    @classmethod
    def open(cls, path: str | Path | None = None, out_dir: str | Path = "runs") -> Self:
        """A run by path, by name under ``out_dir``, or the latest run (``None`` / ``"latest"``)."""
        from privfl.runs import resolve_run

        return cls(resolve_run(None if path is None else str(path), out_dir))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, method={self.method!r})"

    # ------------------------------------------------------------------ what the run is
    @property
    def method(self) -> str:
        return str(self.config.get("method", self.info.get("method", "")))

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def dataset(self) -> dict[str, Any]:
        """Public facts about the data (name, classes, channels, image size, normalisation)."""
        if not isinstance(self.info.get("dataset"), dict):
            raise CaptureError(f"{self.path}/run.json does not describe the dataset (run.json is missing or foreign)")
        return self.info["dataset"]

    @property
    def num_clients(self) -> int:
        archs, count = self.info.get("archs"), self.config.get("num_clients", 0)
        if isinstance(archs, list) and archs:
            return len(archs)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise CaptureError(f"{self.path}: run.json lists no client archs and config.json's num_clients is not a count")
        return count

    @cached_property
    def metrics(self) -> list[dict[str, Any]]:
        """Per-round metrics (``metrics.jsonl``), empty before the first round completes."""
        path = self.path / "metrics.jsonl"
        if not path.exists() and not path.is_symlink():
            return []
        data = read_contained(self.path, path, "metrics", limit=_MAX_JSON_FILE)
        try:
            rows = [json.loads(line) for line in data.splitlines() if line.strip()]
        except (ValueError, RecursionError) as exc:
            raise CaptureError(f"{path} is not valid JSON lines ({str(exc)[:80]})") from None
        if not all(isinstance(r, dict) and isinstance(r.get("round"), int) for r in rows):
            raise CaptureError(f"{path}: every line must be a JSON object with an integer round")
        return rows

    @property
    def summary(self) -> dict[str, Any]:
        """``summary.json`` (final and best accuracy, communication per round, ...); empty if unfinished."""
        path = self.path / "summary.json"
        summary = _read_json(path, "summary.json") if path.exists() or path.is_symlink() else {}
        if not isinstance(summary, dict):
            raise CaptureError(f"{path} must hold a JSON object")
        return summary

    # ------------------------------------------------------------------ stores, each opened once
    @cached_property
    def capture(self) -> TensorStore:
        if not (self.path / "capture" / "manifest.json").exists():
            raise CaptureError(f"{self.path} has no capture (trained with --no-capture?)")
        return TensorStore(self.path / "capture", "capture")

    @cached_property
    def knowledge(self) -> TensorStore | None:
        folder = self.path / "knowledge"
        return TensorStore(folder, "knowledge") if (folder / "manifest.json").exists() else None

    def ground_truth(self, data_root: str | None = None) -> GroundTruth:
        """The samples behind every message (scoring only: the attack runner and the metrics)."""
        key = data_root or ""
        if key not in self._truth:
            self._truth[key] = GroundTruth(self, data_root)
        return self._truth[key]


class MessageView:
    """The messages of a run and the knowledge records it stores, as the attacker reads them (:class:`privfl.run.AttackerView`
    adds what rebuilds models from them).

    It opens ``capture/`` and ``knowledge/``, never ``truth/``: the ground truth reaches only the attack
    runner's scoring, after an attack.
    """

    _CACHE = 4  # recently loaded blobs kept (several targets of one message load it once)

    def __init__(self, run: RunFiles | str | Path):
        self.run = run if isinstance(run, RunFiles) else RunFiles(run)
        self.run_dir = self.run.path
        self.info, self.config = self.run.info, self.run.config
        if not self.info:
            raise CaptureError(f"{self.run_dir} is not a readable privfl run: run.json is missing")
        self.capture = self.run.capture
        self.knowledge_store = self.run.knowledge
        self._records = self.capture.records()
        self._loaded: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()

    # ---------------------------------------------------------------- what the run offers
    @property
    def dataset(self) -> dict[str, Any]:
        return self.run.dataset

    def granted(self) -> set[str]:
        """Knowledge the run declares it stores (``run.json``), present on disk."""
        declared = self.info.get("knowledge", {})
        if not isinstance(declared, dict):
            raise CaptureError(f"{self.run_dir}/run.json: knowledge must be an object (kind -> what it grants), not {type(declared).__name__}")
        return {k for k in declared if self.knowledge_store is not None}

    def records(self) -> list[dict[str, Any]]:
        """Every captured index record (setup broadcasts included)."""
        return list(self._records)

    def kinds(self) -> list[str]:
        return sorted({r["kind"] for r in self._records})

    def rounds(self, kind: str) -> list[int]:
        return sorted({r["round"] for r in self._records if r["kind"] == kind and r.get("meta", {}).get("phase") != "setup"})

    def messages(self, kind: str, round: int | None = None, clients: list[str] | None = None) -> list[dict[str, Any]]:
        """Index records of ``kind`` (in ``round``; involving one of ``clients``), setup broadcasts left out."""
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
        """A message's tensors as its receiver works with them (checksum verified; decoded when its kind
        travels compressed, e.g. ``svd_model``; a few recent ones cached)."""
        key = str(record["sha256"])
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key]
        tensors = self.capture.load(record)
        spec = KINDS.get(record["kind"]) if record["kind"] in KINDS else None
        if spec is not None and spec.decode is not None:
            try:
                tensors = spec.dense(tensors)
            except ValueError as exc:
                raise CaptureError(f"message seq {record.get('seq')} ({record['kind']}) cannot be decoded: {exc}") from None
        self._loaded[key] = tensors
        if len(self._loaded) > self._CACHE:
            self._loaded.popitem(last=False)
        return tensors

    # ---------------------------------------------------------------- knowledge
    def extractor_records(self) -> list[dict[str, Any]]:
        if self.knowledge_store is None:
            return []
        return [r for r in self.knowledge_store.records() if r["kind"] == "extractor"]


class GroundTruth:
    """The run's sample pool, its partition and the samples behind each message. Scoring only."""

    def __init__(self, run: RunFiles | str | Path, data_root: str | None = None):
        self.run = run if isinstance(run, RunFiles) else RunFiles(run)
        self.run_dir = self.run.path
        self.dataset, self.images_u8, self.labels, part = load_pool(self.run, data_root)
        self.train = {k: v for k, v in part.items() if k.startswith("train_")}
        self.test = {k: v for k, v in part.items() if k.startswith("test_")}
        self.store = TensorStore(self.run_dir / "truth", "truth")
        self._by_seq = {r["message_seq"]: r for r in self.store.records()}

    def images(self, idx: torch.Tensor) -> torch.Tensor:
        """Images of pool indices ``idx``, float in [0, 1]."""
        return self.images_u8[idx].float() / 255.0

    def client_train(self, client: str) -> torch.Tensor:
        return self.train[f"train_{client_index(client)}"]

    def client_split(self, client: str, split: str) -> torch.Tensor:
        """Pool indices of a client's ``train`` or ``test`` (held-out) samples."""
        store = self.train if split == "train" else self.test
        key = f"{split}_{client_index(client)}"
        if key not in store:
            raise CaptureError(f"{self.run_dir}/truth/partition.safetensors has no {key}")
        return store[key]

    def clients(self) -> list[str]:
        return [f"client{k.removeprefix('train_')}" for k in sorted(self.train, key=lambda k: int(k.removeprefix("train_")))]

    def has_message(self, seq: int) -> bool:
        return seq in self._by_seq

    def message_truth(self, seq: int) -> dict[str, torch.Tensor]:
        if seq not in self._by_seq:
            raise CaptureError(
                f"the ground-truth store has no record of message {seq} (a run trained with capture keeps one per message that has samples behind it)"
            )
        return self.store.load(self._by_seq[seq])


def load_pool(run: RunFiles, data_root: str | None = None) -> tuple[Any, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(dataset, images uint8, labels, partition tensors) of the run's sample pool: its dataset, reduced
    to the seeded subset the run trained on when it was subsampled."""
    from privfl.data import load_dataset

    cfg = run.config
    dataset = load_dataset(str(cfg.get("dataset")), data_root or cfg.get("data_root"), False)
    part = load_partition(run.path)
    subset = part.pop("subset", None)
    if subset is not None and subset.numel() and int(subset.max()) >= len(dataset.labels):
        raise CaptureError(f"{run.path}/truth/partition.safetensors: the subset names samples beyond {cfg.get('dataset')}'s {len(dataset.labels)}")
    images = dataset.images if subset is None else dataset.images[subset]
    labels = dataset.labels if subset is None else dataset.labels[subset]
    too_far = [k for k, v in part.items() if v.numel() and int(v.max()) >= len(labels)]
    if too_far:
        raise CaptureError(f"{run.path}/truth/partition.safetensors: {too_far[0]} names samples beyond the run's {len(labels)}")
    return dataset, images, labels, part


def client_of(record: dict[str, Any]) -> str:
    """The client an artifact belongs to (its sender, or the receiver of a server broadcast)."""
    return record["receiver"] if record["sender"] == "server" else record["sender"]


def client_index(client: str) -> int:
    text = client.removeprefix("client")
    if not text.isdigit():
        raise ConfigError(f"not a client name: {client!r} (expected client0, client1, ...)")
    return int(text)


__all__ = [
    "ALIASES_KEY",
    "GroundTruth",
    "MessageView",
    "RunFiles",
    "checkpoint_aliases",
    "client_index",
    "client_of",
    "load_checkpoint_state",
    "load_partition",
    "load_pool",
    "read_checkpoint",
]
