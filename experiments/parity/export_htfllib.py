"""Write a privfl partition in HtFLlib's (PFLlib's) dataset layout, so both libraries train on the same samples.

HtFLlib reads client ``i``'s data from ``../dataset/<NAME>/train/<i>.npz`` and ``test/<i>.npz`` relative to
its working directory (``system/utils/data_utils.py``: ``np.load(f, allow_pickle=True)['data'].tolist()``,
then ``torch.Tensor(data['x'])`` float32 and ``data['y']`` int64). PFLlib's generators (HtFLlib ships
none) write each file with ``np.savez_compressed(f, data={'x': X, 'y': y})`` where ``X`` is the already
normalised float32 image array (N, C, H, W) (``ToTensor()`` + ``Normalize([0.5]*C, [0.5]*C)``, i.e.
``(x/255 - 0.5)/0.5``) and ``y`` the int64 labels, plus a ``config.json``
(``num_clients, num_classes, non_iid, balance, partition, "Size of samples for labels in clients",
alpha, batch_size``). This script writes exactly that, for exactly privfl's partition:

* the samples of client ``k``'s train / test split are the run's ``truth/partition.safetensors``
  (pool indices into the run's seeded subsample), in ascending pool-index order: the order privfl
  iterates them with ``--no-shuffle``, so HtFLlib's ``DataLoader(shuffle=False, drop_last=True)`` sees
  the same batches as ``privfl.train --no-shuffle --drop-last``;
* ``x`` is privfl's own normalised tensor (:class:`privfl.methods.DataView`, the code the trainer
  batches with), so both sides see bit-identical float32 inputs;
* ``config.json`` has the generator's keys plus a ``privfl`` table recording where it came from.

Usage (``--out`` is the dataset folder, i.e. ``<HtFLlib>/dataset/<NAME>`` or any folder that HtFLlib's
working directory reaches as ``../dataset/<NAME>``)::

    python -m experiments.parity.export_htfllib --run runs/fedavg-parity --out /tmp/work/dataset/fmnist_privfl
    python -m experiments.parity.export_htfllib --out /tmp/work/dataset/fmnist_privfl \\
        --dataset fashionmnist --subsample 3000 --num-clients 10 --partition dir --alpha 0.1 --seed 0

The second form takes ``privfl.train``'s options (a METHOD and ``--config`` too) and draws the partition
with privfl's own functions, as ``privfl.train`` would, without training. Bad input (not a run, a
damaged partition, missing data, an impossible partition, an output folder that is not empty) is a
one-line error with exit status 2, found before anything is written; the files are written into a
temporary folder beside ``--out`` and renamed into place, and only what this invocation created is
ever removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from privfl.cli import ArgumentParser, run_cli
from privfl.errors import ConfigError, PrivflError

#: the keys PFLlib's ``save_file`` writes into a dataset's config.json (HtFLlib itself reads none of them)
GENERATOR_KEYS = ("num_clients", "num_classes", "non_iid", "balance", "partition", "Size of samples for labels in clients", "alpha", "batch_size")


@dataclass
class Export:
    """A sample pool (uint8, privfl's normalisation) and one train / test index list per client."""

    images: torch.Tensor  # uint8 (N, C, H, W): the run's (subsampled) pool
    labels: torch.Tensor  # int64 (N,)
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_classes: int
    train: list[np.ndarray]  # pool indices, ascending
    test: list[np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)  # dataset, partition, alpha, batch_size, seed, ...

    @property
    def num_clients(self) -> int:
        return len(self.train)

    def client_arrays(self, k: int, split: str) -> dict[str, np.ndarray]:
        """``{'x': float32 (n, C, H, W), 'y': int64 (n,)}`` of client ``k``'s ``train`` or ``test`` split,
        normalised by privfl's own batching code (bit-identical to what privfl trains on)."""
        from privfl.methods import DataView

        idx = torch.as_tensor((self.train if split == "train" else self.test)[k], dtype=torch.int64)
        view = DataView(self.images, self.labels, self.mean, self.std, torch.device("cpu"))
        x, y = view.batch(idx)
        return {"x": x.numpy().astype(np.float32, copy=False), "y": y.numpy().astype(np.int64, copy=False)}

    def statistic(self) -> list[list[list[int]]]:
        """Per client, ``[label, count]`` over train + test for every label it holds (PFLlib's statistic)."""
        labels = self.labels.numpy()
        out = []
        for tr, te in zip(self.train, self.test):
            counts = np.bincount(labels[np.concatenate([tr, te])], minlength=self.num_classes)
            out.append([[int(c), int(n)] for c, n in enumerate(counts) if n > 0])
        return out

    def config(self) -> dict[str, Any]:
        m = self.meta
        partition = m.get("partition")
        return {
            "num_clients": self.num_clients,
            "num_classes": self.num_classes,
            "non_iid": partition != "iid",
            "balance": bool(m.get("balanced", False)),
            "partition": partition,
            "Size of samples for labels in clients": self.statistic(),
            "alpha": m.get("alpha"),
            "batch_size": m.get("batch_size"),
            "privfl": {
                **m,
                "normalisation": {"mean": list(self.mean), "std": list(self.std), "formula": "(x/255 - mean)/std, float32"},
                "train_sizes": [len(t) for t in self.train],
                "test_sizes": [len(t) for t in self.test],
                "order": "ascending pool index (privfl's --no-shuffle order)",
            },
        }


def _check_split(train: Sequence[np.ndarray], test: Sequence[np.ndarray], n: int, where: str) -> None:
    for k, (tr, te) in enumerate(zip(train, test)):
        both = np.concatenate([tr, te])
        if both.size and (int(both.min()) < 0 or int(both.max()) >= n):
            raise ConfigError(f"{where}: client {k} names samples outside the pool of {n}")
        if len(np.unique(both)) != len(both):
            raise ConfigError(f"{where}: client {k}'s train and test splits overlap or repeat samples")
        if len(tr) == 0 or len(te) == 0:
            raise ConfigError(f"{where}: client {k} has an empty train or test split")


def from_run(run_dir: str | Path, data_root: str | None = None) -> Export:
    """The pool and partition a privfl run trained on (its ``truth/partition.safetensors``)."""
    from privfl.data import ClientSplit
    from privfl.run import Run, load_pool

    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"{path} is not a folder (--run takes a privfl run directory)")
    run = Run(path)  # refuses a folder without config.json
    if not (path / "truth" / "partition.safetensors").is_file():
        raise ConfigError(f"{path} has no truth/partition.safetensors (a privfl run directory holds one)")
    dataset, images, labels, part = load_pool(run, data_root)
    split = ClientSplit.from_tensors(part)
    _check_split(split.train, split.test, len(labels), f"{path}/truth/partition.safetensors")
    cfg = run.config
    meta = {
        "source": f"privfl run {path.resolve()}",
        **{k: cfg.get(k) for k in ("dataset", "subsample", "seed", "partition", "alpha", "classes_per_client", "balanced", "train_fraction")},
        "batch_size": cfg.get("batch_size"),
    }
    return Export(images, labels, tuple(dataset.mean), tuple(dataset.std), dataset.num_classes, list(split.train), list(split.test), meta)


def from_train_args(argv: Sequence[str]) -> Export:
    """The partition ``privfl.train ARGV`` would train on, drawn with privfl's own functions (no training)."""
    from privfl.config import build_config, read_config_file
    from privfl.data import load_dataset
    from privfl.engine import client_split, subsample
    from privfl.methods import resolve_method
    from privfl.train import _method_from_argv, build_parser

    argv = list(argv)
    method_name = _method_from_argv(argv)
    method_cls = resolve_method(method_name) if method_name else None
    args = vars(build_parser(method_cls).parse_args(argv))
    for key in ("resume", "run", "plugin"):
        if args.pop(key, None) is not None and key != "plugin":
            raise ConfigError(f"--{key} is not an export option (give --run RUN_DIR to export a run)")
    config_path = args.pop("config", None)
    values = read_config_file(config_path) if config_path else {}
    values.update(args)
    values.setdefault("method", "fedre")
    method_cls = resolve_method(values["method"])
    if not config_path:
        for key, value in getattr(method_cls.Options, "run_defaults", {}).items():
            values.setdefault(key, value)
    cfg = build_config(values, method_cls.Options)

    # the engine's own steps (tests/experiments/test_parity.py checks the result against a run)
    dataset = load_dataset(cfg.dataset, cfg.data_root, cfg.download)
    images, labels, _ = subsample(dataset, cfg)
    split = client_split(labels, cfg)
    meta = {
        "source": "privfl.train options " + " ".join(argv),
        **{k: getattr(cfg, k) for k in ("dataset", "subsample", "seed", "partition", "alpha", "classes_per_client", "balanced", "train_fraction")},
        "batch_size": cfg.batch_size,
    }
    return Export(images, labels, tuple(dataset.mean), tuple(dataset.std), dataset.num_classes, list(split.train), list(split.test), meta)


def check_out(out: Path) -> None:
    """``--out`` must be a folder that does not exist yet, or an empty one (nothing is ever overwritten)."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConfigError(f"--out {out} exists and is not a folder; give a new folder")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty; give a new or empty folder (nothing is overwritten)")
    parent = out.parent
    while not parent.exists():  # the first existing ancestor must be a writable folder
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"cannot create --out {out}: {parent} is not a writable folder")


def write(export: Export, out: Path) -> Path:
    """Write ``train/<k>.npz``, ``test/<k>.npz`` and ``config.json`` into ``out`` (new or empty), atomically."""
    check_out(out)
    arrays = {(split, k): export.client_arrays(k, split) for split in ("train", "test") for k in range(export.num_clients)}
    config = export.config()
    created = []  # folders this call made, deepest last
    parent = out.parent
    missing = []
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for folder in reversed(missing):
        folder.mkdir()
        created.append(folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the dataset folder gets the usual permissions
        for split in ("train", "test"):
            (tmp / split).mkdir()
        for (split, k), data in arrays.items():
            with open(tmp / split / f"{k}.npz", "wb") as f:
                np.savez_compressed(f, data=data)  # type: ignore[arg-type]  # a dict becomes a 0-d object array, as PFLlib writes it
        (tmp / "config.json").write_text(json.dumps(config) + "\n")
        if out.exists():  # an empty folder the user made: move our files into it
            for child in tmp.iterdir():
                child.rename(out / child.name)
            tmp.rmdir()
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in reversed(created):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise
    return out


def read_htfllib_client(folder: str | Path, k: int, split: str) -> dict[str, np.ndarray]:
    """Client ``k``'s ``split`` as HtFLlib reads it (``np.load(...)['data'].tolist()``)."""
    with open(Path(folder) / split / f"{k}.npz", "rb") as f:
        return dict(np.load(f, allow_pickle=True)["data"].tolist())


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(
        prog="python -m experiments.parity.export_htfllib",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--out", required=True, help="the dataset folder to write (new or empty): HtFLlib reads it as ../dataset/<NAME>")
    p.add_argument("--run", help="a privfl run directory whose partition to export")
    p.add_argument("--data-root", help="where the dataset files are (default: the run's, or the standard places)")
    args, rest = p.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(args.out)
    check_out(out)  # before any data is read: a bad --out costs nothing
    if args.run is not None:
        if rest:
            raise ConfigError(f"--run exports a run's own partition and takes no privfl.train options, got {' '.join(rest)}")
        export = from_run(args.run, args.data_root)
    else:
        if args.data_root is not None:
            rest += ["--data-root", args.data_root]
        export = from_train_args(rest)
    write(export, out)
    sizes = [len(t) for t in export.train]
    print(f"wrote {export.num_clients} clients ({sum(sizes)} train / {sum(len(t) for t in export.test)} test samples) to {out}")
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """:func:`main` with privfl's error handling: bad input is one line on stderr and exit status 2."""
    return run_cli("experiments.parity.export_htfllib", lambda: main(argv))


__all__ = ["Export", "PrivflError", "check_out", "cli", "from_run", "from_train_args", "main", "read_htfllib_client", "write"]

if __name__ == "__main__":
    sys.exit(cli())
