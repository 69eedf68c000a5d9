"""One table of defenses: what each costs in accuracy and what it buys against gradient leakage.

For every defense setting (``--defenses``, ``;``-separated, each a ``--defense`` spec or ``none``):

1. **utility run**: the default run of a parameter-sending method (``--method``, default FedNova on
   Fashion-MNIST, 10 clients, Dir(0.1), homogeneous ``homo-cnn4``, 20 rounds: the defaults of
   ``privfl.train`` except the model group, since FedNova averages one architecture) trained with the
   defense applied by the channel. Reported: final and best accuracy, and for ``dp`` the largest
   per-client epsilon at the run's delta (opacus RDP accountant, see ``defenses/accounting.py``).
2. **leakage on its captured updates**: ``attacks.run_attack`` (``dlg`` and ``ig``) on the last round's
   uploads of ``--attack-clients`` of that very run, as a curious server would (a one-image
   reconstruction per message, best-matched within the client's data, because an update of many
   local steps over hundreds of images has no single batch to match).
3. **maximal-leakage probe**: the same defense on a FedSGD run whose clients send the gradient of
   ONE image (``--batch-size 1``, one round): DLG's own setting, where an undefended gradient gives
   the image back. This is the column that shows what a defense does against the attack; column 2
   shows what the attack gets in the realistic run.

Every row lands in ``table.csv`` / ``table.json`` under ``--out`` (default runs/defense-table), beside the
run folders (each with its attack galleries). Full setting:

    python -m experiments.privacy.defense_table
    python -m experiments.privacy.defense_table --rounds 5 --subsample 10000 --dlg-steps 100 --ig-steps 300   # minutes
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import attacks
from privfl.config import build_config
from privfl.methods import resolve_method
from privfl.run import Run
from privfl.train import train_config as train

DEFAULT_DEFENSES = ";".join(
    [
        "none",
        "gaussian:sigma=0.001",
        "gaussian:sigma=0.01",
        "clip:max_norm=1.0",
        "dp:max_norm=1.0,noise_multiplier=1.0",
        "topk:keep=0.1",
        "quantize:bits=4",
    ]
)


def run_training(values: dict, name: str, out_dir: Path) -> Run:
    """Train ``values`` as given (no method quick defaults: the table's settings are the run's)."""
    values = {**values, "out_dir": str(out_dir), "run_name": name, "progress": False}
    cfg = build_config(values, getattr(resolve_method(values["method"]), "Options", None))
    return train(cfg)


def run_attack(variant: str, run: Run, artifact: str, clients: str, steps: int, seed: int, device: str) -> dict:
    """``variant`` on ``artifact`` of ``run``, one image per message (``max_batch=1``); its summary.

    Written to ``RUN/attacks/<variant>-<artifact>`` so each run folder keeps its galleries."""
    report = attacks.run_attack(
        run,
        variant,
        kind=artifact,
        clients=clients.split(","),
        options={"steps": steps, "max_batch": 1},
        seed=seed,
        device=device,
        name=f"{variant}-{artifact}",
    )
    return report.summary


def _db(summary: dict) -> float | None:
    value = summary.get("psnr")
    return None if value is None else round(value, 2)


def max_epsilon(summary: dict) -> float | None:
    """The largest per-client epsilon any accounting defense of the run reports (None: no accountant)."""
    eps = [e for report in summary.get("defenses", {}).values() for e in (report.get("epsilon") or {}).values()]
    return max(eps) if eps else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.privacy.defense_table", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--defenses", default=DEFAULT_DEFENSES, help="';'-separated defense specs ('none' = undefended)")
    p.add_argument("--method", default="fednova", help="the parameter-sending method of the utility run")
    p.add_argument("--artifact", default="update", help="its parameter-like upload kind")
    p.add_argument("--model-group", default="homo-cnn4")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--subsample", type=int, help="train on a seeded subset (quicker)")
    p.add_argument("--attack-clients", default="0,1")
    p.add_argument("--dlg-steps", type=int, default=300)
    p.add_argument("--ig-steps", type=int, default=4800)
    p.add_argument("--probe-subsample", type=int, default=2000, help="samples of the probe run's dataset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="for training and attacks: auto (GPU when present), cpu, cuda")
    p.add_argument("--out", default="runs/defense-table")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    rows = []
    for i, spec in enumerate(s.strip() for s in args.defenses.split(";") if s.strip()):
        defense = [] if spec == "none" else [spec]
        slug = f"{i:02d}-" + ("none" if not defense else spec.replace(":", "_").replace(",", "_").replace("=", ""))
        base = {
            "method": args.method,
            "model_group": args.model_group,
            "rounds": args.rounds,
            "seed": args.seed,
            "defense": defense,
            "device": args.device,
        }
        if args.subsample:
            base["subsample"] = args.subsample
        print(f"[{spec}] utility run: {args.method}, {args.rounds} rounds", flush=True)
        run = run_training(base, f"{slug}-{args.method}", out)
        summary = run.summary
        leak = {
            v: run_attack(v, run, args.artifact, args.attack_clients, steps, args.seed, args.device)
            for v, steps in (("dlg", args.dlg_steps), ("ig", args.ig_steps))
        }
        print(f"[{spec}] probe: fedsgd, batch 1, one round", flush=True)
        probe_values = {
            "method": "fedsgd",
            "model_group": args.model_group,
            "rounds": 1,
            "batch_size": 1,
            "seed": args.seed,
            "subsample": args.probe_subsample,
            "defense": defense,
            "device": args.device,
        }
        probe = run_training(probe_values, f"{slug}-probe-fedsgd", out)
        probe_leak = {
            v: run_attack(v, probe, "grad", args.attack_clients, steps, args.seed, args.device)
            for v, steps in (("dlg", args.dlg_steps), ("ig", args.ig_steps))
        }
        row = {
            "defense": spec,
            "method": args.method,
            "final_acc": round(summary["final_acc"], 4),
            "best_acc": round(summary["best_acc"], 4),
            "epsilon": max_epsilon(summary),
            "dlg_psnr_run": _db(leak["dlg"]),
            "ig_psnr_run": _db(leak["ig"]),
            "dlg_psnr_probe": _db(probe_leak["dlg"]),
            "ig_psnr_probe": _db(probe_leak["ig"]),
            "epsilon_probe": max_epsilon(probe.summary),
            "upload_bytes_per_round": round(summary["per_round"]["upload_bytes"]),
            "run": str(run.path),
            "probe_run": str(probe.path),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write(out, rows, vars(args))

    print(f"\n{'defense':<40} {'final acc':>9} {'epsilon':>9} {'DLG run':>8} {'IG run':>7} {'DLG probe':>10} {'IG probe':>9}")
    for r in rows:
        eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.3g}"
        db = {k: "n/a" if r[k] is None else f"{r[k]:.2f}" for k in ("dlg_psnr_run", "ig_psnr_run", "dlg_psnr_probe", "ig_psnr_probe")}
        print(
            f"{r['defense']:<40} {r['final_acc']:9.2%} {eps:>9} {db['dlg_psnr_run']:>8} {db['ig_psnr_run']:>7}"
            f" {db['dlg_psnr_probe']:>10} {db['ig_psnr_probe']:>9}"
        )
    print(f"table: {out}/table.csv (PSNR in dB, per image on [0, 1], averaged)")
    return 0


def _write(out: Path, rows: list[dict], protocol: dict) -> None:
    with (out / "table.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "table.json").write_text(json.dumps({"protocol": protocol, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
