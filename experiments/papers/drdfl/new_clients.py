"""DRDFL's Figure 8: newly joined clients, DRDFL (initialised from the trained Learngene and class
Gaussians) against DisPFL, the paper's comparison.

Paper: Guo, Lv, Geng, "Harmonizing Generalization and Personalization in Ring-topology Decentralized
Federated Learning", Fig. 8 (CIFAR-10: 15 clients for 200 rounds, then five new clients with unseen
data distributions).

Stage 1 trains ``--old`` clients on the ring for ``--stage1`` rounds; the ``--new`` clients exist in the
partition but are down (not yet joined: ring outages ``m@0-(stage1-1)``), so nobody trains on or sees
their data. Stage 2 brings them up for ``--stage2`` further rounds. Each row is one method run through
both stages in one run (the outages make the join), so a row's stage 2 continues its own stage 1:

- ``DRDFL (Learngene init)`` (the paper): a node that never trained adopts the Learngene and Gaussians
  its ring predecessor sends (``join_adopt=true``); its PersonaNet, decoder, classifier and adversary
  start fresh (the paper initialises new clients from the Learngene and the Gaussians only);
- ``DRDFL (fresh init)``: the ablation, the plain mixing rule from the node's own random initialisation
  (``join_adopt=false``);
- ``DisPFL``: a new node starts from its own initialisation and sparse mask and aggregates what its ring
  neighbours send, DisPFL's own joining (privfl's ``dispfl`` on ``topology=ring``).

Printed, and written under ``--out``: each row's new clients' mean accuracy on their own local test sets
per stage-2 round (``new_clients.json``), and the curves (``new_clients.png``). Accuracy is each client's
personalised model (privfl's personal protocol where the method has one). ``--out`` must be a new or
empty folder: the script creates its runs there and never deletes anything.

    python -m experiments.papers.drdfl.new_clients                    # quick: Fashion-MNIST, 6 + 2 clients
    python -m experiments.papers.drdfl.new_clients --paper --data-root DATA   # CIFAR-10, shards s=4, 15 + 5, 200 + 100 rounds
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from privfl.cli import ArgumentParser, run_cli
from privfl.config import build_config, read_config_file
from privfl.errors import ConfigError
from privfl.methods import METHODS
from privfl.train import train_config as train

PAPER_CONFIG = Path(__file__).with_name("cifar10_shard4.toml")
#: row label -> (method, its options for this experiment)
ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "DRDFL (Learngene init)": ("drdfl", {"join_adopt": True}),
    "DRDFL (fresh init)": ("drdfl", {"join_adopt": False}),
    "DisPFL": ("dispfl", {"topology": "ring"}),
}


def new_client_curve(metrics: list[dict[str, Any]], old: int, stage1: int) -> list[float]:
    """Mean accuracy of clients ``old..`` per stage-2 round, personal protocol when recorded."""
    key = "client_acc_personal" if "client_acc_personal" in metrics[0] else "client_acc"
    return [sum(h[key][old:]) / len(h[key][old:]) for h in metrics[stage1:]]


def plot(curves: dict[str, list[float]], stage1: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for label, curve in curves.items():
        ax.plot(range(stage1 + 1, stage1 + len(curve) + 1), [100 * a for a in curve], marker="o" if len(curve) < 30 else None, label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(f"round, counted from 1 (new clients joined after round {stage1})")
    ax.set_ylabel("new clients' mean Local-T accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(
        prog="python -m experiments.papers.drdfl.new_clients", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--paper", action="store_true", help="the paper's Fig. 8 setting (CIFAR-10, s=4, 15+5, 200+100 rounds)")
    p.add_argument("--old", type=int, default=6)
    p.add_argument("--new", type=int, default=2)
    p.add_argument("--stage1", type=int, default=3)
    p.add_argument("--stage2", type=int, default=3)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of rows (default all: {', '.join(ROWS)})")
    p.add_argument("--subsample", type=int, default=None, help="quick setting's seeded subset (default 4000)")
    p.add_argument("--data-root", default=None)
    p.add_argument("--out", default="runs/drdfl-new-clients")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ConfigError(f"--rows: unknown {', '.join(unknown)}; rows: {', '.join(ROWS)}")
    if args.paper:
        values = read_config_file(PAPER_CONFIG)
        args.old, args.new, args.stage1, args.stage2 = 15, 5, 200, 100
    else:
        values = {
            "dataset": "fashionmnist",
            "subsample": args.subsample or 4000,
            "partition": "pat",
            "classes_per_client": 4,
            "balanced": True,
            "model_group": "homo-cnn4",
            "lr": 0.05,
        }
    if min(args.old, args.new, args.stage1, args.stage2) < 1:
        raise ConfigError("--old, --new, --stage1 and --stage2 must be at least 1")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty folder: give a new one (this script never deletes runs)")
    if args.data_root:
        values["data_root"] = args.data_root
    total = args.old + args.new
    drdfl_options = dict(values.pop("options", {}))
    values.pop("method", None)
    joins = ",".join(f"{m}@0-{args.stage1 - 1}" for m in range(args.old, total))
    configs = {}
    for label in rows:  # every config is checked before anything is created
        method, options = ROWS[label]
        method_options = {**(drdfl_options if method == "drdfl" else {}), **options, "failures": joins}
        if method == "drdfl" and "global_test_samples" not in method_options:
            method_options["global_test_samples"] = 400
        run_values = {
            **values,
            "method": method,
            "num_clients": total,
            "rounds": args.stage1 + args.stage2,
            "seed": args.seed,
            "out_dir": str(out),
            "run_name": label.lower().replace(" ", "-").replace("(", "").replace(")", ""),
            "progress": False,
            "options": method_options,
        }
        if method != "drdfl" and args.paper:  # the paper's DisPFL: SGD on the classifier's ResNet-18, not DRDFL's Adam modules
            run_values.update(optimizer="sgd", lr=0.01)
        configs[label] = build_config(run_values, METHODS.get(method).Options)
    curves = {}
    for label, cfg in configs.items():
        run = train(cfg)
        curves[label] = new_client_curve(run.metrics, args.old, args.stage1)
        print(f"{label:<24} new clients' mean accuracy per stage-2 round: {' '.join(f'{100 * a:.2f}' for a in curves[label])}", flush=True)
    result = {"old": args.old, "new": args.new, "stage1": args.stage1, "stage2": args.stage2, "seed": args.seed, "curves": curves}
    (out / "new_clients.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(curves, args.stage1, out / "new_clients.png")
    print(f"written: {out / 'new_clients.json'}, {out / 'new_clients.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("experiments.papers.drdfl.new_clients", main))
