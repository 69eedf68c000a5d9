"""One row per measured ratio, for ``experiments/bench/run_all.py`` (``make bench``) to gather into one table.

Each benchmark prints its own report as before and, when ``PRIVFL_BENCH_JSON`` names a file, also
appends its headline comparisons there: the two configurations measured side by side in the same
run, their values, and the ratio ``b / a``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import privfl

#: privfl.train's options for the parity setting (experiments/parity: HtFLlib's FedAvgCNN, batch, learning
#: rate, data order and initialisation), for the benchmarks that time a round of it
PARITY_TRAIN: dict[str, Any] = {
    "dataset": "fashionmnist",
    "model_group": "homo-cnn4",
    "subsample": 3000,
    "num_clients": 10,
    "batch_size": 10,
    "lr": 0.01,
    "local_epochs": 1,
    "optimizer": "sgd",
    "same_init": True,
    "shuffle": False,
    "drop_last": True,
    "eval": "both",
    "device": "cpu",
    "progress": False,
    "seed": 0,
}


class RoundClock(privfl.TrainCallback):
    """The wall seconds of each round, from one round's end to the next (checkpoint and metrics writes included)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.walls: list[float] = []

    def on_round_end(self, rnd: int, entry: dict[str, Any]) -> None:
        now = time.perf_counter()
        self.walls.append(now - self.t)
        self.t = now

    def mean_after_first(self) -> float:
        """Mean wall per round without the first (kernels are prepared then)."""
        return sum(self.walls[1:]) / max(len(self.walls) - 1, 1)


def record(bench: str, measure: str, a_label: str, a: float, b_label: str, b: float, unit: str, note: str = "") -> None:
    """Append ``measure`` of configuration ``a`` vs ``b`` (same run, same inputs) to the bench file, if any."""
    path = os.environ.get("PRIVFL_BENCH_JSON")
    if not path:
        return
    row = {"bench": bench, "measure": measure, "a_label": a_label, "a": a, "b_label": b_label, "b": b, "unit": unit, "note": note}
    row["ratio"] = b / a if a else None
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")


def record_value(bench: str, measure: str, value: float, unit: str, note: str = "") -> None:
    """A measured value with nothing beside it (e.g. peak memory at 1,000 clients)."""
    path = os.environ.get("PRIVFL_BENCH_JSON")
    if not path:
        return
    row = {"bench": bench, "measure": measure, "a_label": "", "a": None, "b_label": "", "b": value, "unit": unit, "note": note, "ratio": None}
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")


@dataclass
class InversionTargets:
    """A client's own images and their representations through its stored extractor: what the DIP
    experiments invert. They pick their targets by reading the ground truth, as no attack may."""

    run_path: str
    client: str
    round: int
    represent: Callable[[torch.Tensor], torch.Tensor]
    images: torch.Tensor  # (K, C, H, W) in [0, 1]
    targets: torch.Tensor  # (K, d) on the device
    shape: tuple[int, int, int]
    mean: list[float]
    std: list[float]


def inversion_targets(run_path: str | None, client: str, k: int, device: str | torch.device = "cpu") -> InversionTargets:
    """The first ``k`` training images of ``client`` and their representations at the last round whose
    extractor the run stores."""
    from privfl.run import Run

    run = Run.open(run_path)
    view, truth = run.attacker, run.ground_truth()
    rnd = max(r["round"] for r in view.extractor_records() if r["client"] == client)
    model = view.extractor(client, rnd, device)
    images = truth.images(truth.client_train(client)[:k])
    ds = view.dataset
    mean, std = torch.tensor(ds["mean"]).view(1, -1, 1, 1), torch.tensor(ds["std"]).view(1, -1, 1, 1)
    with torch.no_grad():
        targets = model.represent(((images - mean) / std).to(device))
    shape = (ds["channels"], ds["image_size"], ds["image_size"])
    return InversionTargets(str(run.path), client, rnd, model.represent, images, targets, shape, list(ds["mean"]), list(ds["std"]))


def add_target_options(parser: argparse.ArgumentParser, k: int) -> None:
    """``--run``, ``--client``, ``--k`` and ``--device``: which targets :func:`inversion_targets` picks, and where."""
    parser.add_argument("--run", help="a FedRE run with stored client extractors (default: the latest)")
    parser.add_argument("--client", default="client0")
    parser.add_argument("--k", type=int, default=k, help="targets: the client's first K training images")
    parser.add_argument("--device", default="auto")
