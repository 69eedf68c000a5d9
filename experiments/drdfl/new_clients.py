"""DRDFL's Figure 8: newly joined clients initialised from the trained Learngene and class Gaussians.

Stage 1 trains ``--old`` clients on the ring for ``--stage1`` rounds; the ``--new`` clients exist in the
partition but are down (not yet joined: ring outages ``m@0-(stage1-1)``), so nobody trains on or sees
their data. Stage 2 brings them up for ``--stage2`` rounds and compares two ways of joining, from the
same stage-1 checkpoint:

- ``learngene-init`` (the paper): a node that never trained adopts the Learngene and Gaussians its ring
  predecessor sends (``join_adopt=true``); its PersonaNet, decoder, classifier and adversary start fresh
  (spec 4.5);
- ``fresh-init``: the plain mixing rule from the node's own random initialisation (``join_adopt=false``).

The paper's comparison is against DisPFL, which privfl does not implement; the second row is the
ablation of the initialisation instead. Printed and written (``RUN/new_clients.json``): the new
clients' mean accuracy on their local test sets (Local-T over the new clients) per stage-2 round.

    python experiments/drdfl/new_clients.py                    # quick: Fashion-MNIST, 6 + 2 clients
    python experiments/drdfl/new_clients.py --paper --data-root DATA   # CIFAR-10, shards s=4, 15 + 5, 200 + 100 rounds
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from privfl.config import build_config, read_config_file, save_config
from privfl.engine import resume, train
from privfl.methods.drdfl import DRDFL

PAPER_CONFIG = Path(__file__).with_name("cifar10_shard4.toml")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paper", action="store_true", help="the paper's Fig. 8 setting (CIFAR-10, s=4, 15+5, 200+100 rounds)")
    p.add_argument("--old", type=int, default=6)
    p.add_argument("--new", type=int, default=2)
    p.add_argument("--stage1", type=int, default=3)
    p.add_argument("--stage2", type=int, default=2)
    p.add_argument("--data-root", default=None)
    p.add_argument("--out", default="runs/drdfl-new-clients")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.paper:
        values = read_config_file(PAPER_CONFIG)
        args.old, args.new, args.stage1, args.stage2 = 15, 5, 200, 100
    else:
        values = {
            "method": "drdfl",
            "dataset": "fashionmnist",
            "subsample": 4000,
            "partition": "pat",
            "classes_per_client": 4,
            "balanced": True,
            "model_group": "homo-cnn4",
            "options": {"global_test_samples": 400},
        }
    if args.data_root:
        values["data_root"] = args.data_root
    total = args.old + args.new
    options = dict(values.pop("options", {}))
    options["failures"] = ",".join(f"{m}@0-{args.stage1 - 1}" for m in range(args.old, total))
    values.update(num_clients=total, rounds=args.stage1, seed=args.seed, out_dir=args.out, run_name="stage1", progress=False, options=options)
    out = Path(args.out)
    if (out / "stage1").exists():
        shutil.rmtree(out / "stage1")
    train(build_config(values, DRDFL.Options))

    results = {}
    for variant, adopt in (("learngene-init", True), ("fresh-init", False)):
        run = out / variant
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(out / "stage1", run)
        cfg = build_config(
            {**values, "rounds": args.stage1 + args.stage2, "run_name": variant, "options": {**options, "join_adopt": adopt}}, DRDFL.Options
        )
        save_config(cfg, run)  # the copy continues under stage 2's config (more rounds, the join rule)
        finished = resume(run, cfg)
        curve = [sum(h["client_acc"][args.old :]) / args.new for h in finished.metrics[args.stage1 :]]
        results[variant] = curve
        print(f"{variant:<15} new clients' mean accuracy per stage-2 round: {' '.join(f'{a:.3f}' for a in curve)}")
    (out / "new_clients.json").write_text(
        json.dumps({"old": args.old, "new": args.new, "stage1": args.stage1, "stage2": args.stage2, "curves": results}, indent=2) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
