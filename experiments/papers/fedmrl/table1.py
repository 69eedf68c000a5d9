"""FedMRL Table 1 (model-heterogeneous) and, with ``--homo``, Table 3 (model-homogeneous).

Paper: Yi, Yu, Ren, Wang, Liu, Li, "Federated Model Heterogeneous Matryoshka Representation Learning",
NeurIPS 2024 (arXiv 2406.00488).

Rows, as the paper's Tables 1 and 3, with the privfl method each runs: Standalone
(``local``), LG-FedAvg (``lgfedavg``), FD (``fd``), FedProto (``fedproto``), FML (``fml``), FedKD
(``fedkd``), FedAPEN (``fedapen``) and FedMRL (``fedmrl``). The paper reports "-" (did not converge)
for FD and FedAPEN in most cells. Every row trains on the same partition and seeds
(``experiments/papers/tables.py`` says what is reported and how a cut table resumes); a row whose method is
not registered stops the script before training, naming it (exit 2), unless ``--skip-missing``.
Under the table: FedMRL minus the best other row, the paper's "FedMRL - Best B." line.

Quick default (no flags): Fashion-MNIST (1x28x28; the CNNs' flatten size follows the input), FedMRL's
CNN-1..5 group ``fedmrl-cnn5`` (client k gets CNN-(k mod 5 + 1); ``--homo``: every client CNN-1),
10 clients, all taking part, pathological non-IID with 2 classes per client, each client's data split
8:2, a 3,000-sample subset, 5 rounds of two local epochs, batch 32, SGD lr 0.01 with momentum 0.9 and
weight decay 1e-3 (the official code's), d2 = 500 (``--rep-dim 500``, so the AP mapping is the identity
and the head is FC3), FedMRL's d1 = 200; seeds 0, 1, 2. The paper's (N=10, C=100%) CIFAR-10 column
stands beside it for reference. One seed took 225 s of CPU time (6 minutes wall on this shared
2-core machine), so the three take about 11 minutes on an idle one. ``--paper``: the paper's configuration
``experiments/papers/fedmrl/{dataset}_n{N}_c{C}_pat_{hete|homo}.toml`` (500 rounds, 10 local epochs, batch
512; ``make_configs.py`` says where each value is from) for ``--clients 10 | 50 | 100`` (participation
100 / 20 / 10 %) on ``--dataset cifar10 | cifar100`` (``--data-root``), with that paper column beside.

    python -m experiments.papers.fedmrl.table1                      # quick
    python -m experiments.papers.fedmrl.table1 --homo               # quick Table 3
    python -m experiments.papers.fedmrl.table1 --paper --dataset cifar100 --clients 50 --data-root DATA
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.papers.tables import Row, Table, add_arguments, apply_common, main_for, margin_over_best, parse_seeds
from privfl.cli import ArgumentParser
from privfl.config import read_config_file

HERE = Path(__file__).resolve().parent

METHOD_OF = {
    "Standalone": "local",
    "LG-FedAvg": "lgfedavg",
    "FD": "fd",
    "FedProto": "fedproto",
    "FML": "fml",
    "FedKD": "fedkd",
    "FedAPEN": "fedapen",
    "FedMRL": "fedmrl",
}
#: columns of both tables: (N clients, participation %, dataset)
COLUMNS = ((10, 100, "cifar10"), (10, 100, "cifar100"), (50, 20, "cifar10"), (50, 20, "cifar100"), (100, 10, "cifar10"), (100, 10, "cifar100"))
#: Table 1, model-heterogeneous, average test accuracy (%); "-" = did not converge
TABLE1 = {
    "Standalone": "96.53 72.53 95.14 62.71 91.97 53.04",
    "LG-FedAvg": "96.30 72.20 94.83 60.95 91.27 45.83",
    "FD": "96.21 - - - - -",
    "FedProto": "96.51 72.59 95.48 62.69 92.49 53.67",
    "FML": "30.48 16.84 - 21.96 - 15.21",
    "FedKD": "80.20 53.23 77.37 44.27 73.21 37.21",
    "FedAPEN": "- - - - - -",
    "FedMRL": "96.63 74.37 95.70 66.04 95.85 62.15",
}
#: Table 3, model-homogeneous (every client CNN-1)
TABLE3 = {
    "Standalone": "96.35 74.32 95.25 62.38 92.58 54.93",
    "LG-FedAvg": "96.47 73.43 94.20 61.77 90.25 46.64",
    "FD": "96.30 - - - - -",
    "FedProto": "95.83 72.79 95.10 62.55 91.19 54.01",
    "FML": "94.83 70.02 93.18 57.56 87.93 46.20",
    "FedKD": "94.77 70.04 92.93 57.56 90.23 50.99",
    "FedAPEN": "95.38 71.48 93.31 57.62 87.97 46.85",
    "FedMRL": "96.71 74.52 95.76 66.46 95.52 60.64",
}
#: the paper's "FedMRL - Best B." row, per column
BEST_B = {"hete": "0.10 1.78 0.22 3.33 3.36 8.48", "homo": "0.24 0.20 0.51 3.91 2.94 5.71"}
PARTICIPATION = {10: 100, 50: 20, 100: 10}
DATASET_NAMES = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100"}

QUICK = {
    "dataset": "fashionmnist",
    "model_group": "fedmrl-cnn5",
    "num_clients": 10,
    "join_ratio": 1.0,
    "partition": "pat",
    "classes_per_client": 2,
    "balanced": False,
    "train_fraction": 0.8,
    "subsample": 3000,
    "rounds": 5,
    "local_epochs": 2,
    "batch_size": 32,
    "optimizer": "sgd",
    "lr": 0.01,
    "momentum": 0.9,
    "weight_decay": 1e-3,
    "rep_dim": 500,
    "mapping": "ap",
}
#: FedMRL's own options in the quick setting (the paper's CIFAR-10 values, make_configs.py)
QUICK_FEDMRL = {"d1": 200, "grad_clip": 50.0, "projector_bias": True, "inference": "mix-large"}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m experiments.papers.fedmrl.table1", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paper", action="store_true", help="the paper's configuration (TOMLs in experiments/papers/fedmrl/) on real data")
    p.add_argument("--dataset", default="cifar10", choices=("cifar10", "cifar100"), help="with --paper")
    p.add_argument("--clients", type=int, default=10, choices=(10, 50, 100), help="with --paper: N (participation 100 / 20 / 10 %%)")
    p.add_argument("--homo", action="store_true", help="Table 3: every client CNN-1 (model-homogeneous)")
    add_arguments(p, out="runs/fedmrl-table1")
    return p


def build_table(args: argparse.Namespace) -> Table:
    models = "homo" if args.homo else "hete"
    if args.paper:
        values = read_config_file(HERE / f"{args.dataset}_n{args.clients}_c{PARTICIPATION[args.clients]}_pat_{models}.toml")
        fedmrl_options = dict(values.pop("options", {}))
        values.pop("method", None)
        base = values
        column = (args.clients, PARTICIPATION[args.clients], args.dataset)
        where = f"{DATASET_NAMES[args.dataset]}, N={args.clients}, C={PARTICIPATION[args.clients]}%"
        paper_label = f"N={args.clients} {DATASET_NAMES[args.dataset]}"
    else:
        base = dict(QUICK)
        if args.homo:
            base["model_group"] = "fedmrl-homo-cnn1"
        fedmrl_options = dict(QUICK_FEDMRL)
        column = COLUMNS[0]
        where = "Fashion-MNIST (quick; the paper has no such column)"
        paper_label = "(N=10 C10, ref.)"
    base = apply_common(base, args)
    index = COLUMNS.index(column)
    values_of = TABLE3 if args.homo else TABLE1
    rows = [
        Row(label, METHOD_OF[label], options=fedmrl_options if label == "FedMRL" else {}, paper={"acc": values_of[label].split()[index]})
        for label in values_of
    ]
    paper_best = BEST_B[models].split()[index]

    def summarize(aggs: Sequence[Mapping[str, Any]]) -> list[str]:
        line = margin_over_best(aggs, "FedMRL")
        return [f"{line} Paper (FedMRL - Best B.): +{paper_best} points."] if line else []

    setting = (
        f"Setting: {base['dataset']}, model group {base['model_group']}, {base.get('num_clients', 10)} clients "
        f"(join ratio {base.get('join_ratio', 1.0)}), pat {base.get('classes_per_client')} classes per client, "
        f"{base.get('subsample') or 'all'} samples, {base['rounds']} rounds x {base.get('local_epochs')} local epochs, "
        f"lr {base.get('lr')} (momentum {base.get('momentum')}), batch {base.get('batch_size')}, d1 = {fedmrl_options.get('d1')}."
    )
    return Table(
        name=f"fedmrl-table{'3' if args.homo else '1'}",
        title=f"FedMRL Table {'3 (model-homogeneous)' if args.homo else '1 (model-heterogeneous)'}: {where}",
        rows=rows,
        base=base,
        seeds=parse_seeds(args.seeds),
        paper_acc=paper_label,
        notes=[f"Paper values: Table {'3' if args.homo else '1'}, column {where if args.paper else 'N=10, C=100%, CIFAR-10'}; - = did not converge."],
        setting=setting,
        summarize=summarize,
    )


def main(argv: list[str] | None = None) -> int:
    return main_for("experiments.papers.fedmrl.table1", build_parser(), build_table, argv)


if __name__ == "__main__":
    sys.exit(main())
