"""In-process engine vs Flower simulation: the same runs side by side, and Flower at 100 clients (IID).

For each method the same config and seed is trained twice, in-process and with ``--engine flower``
(Flower's Ray-backed Simulation Engine, one ClientApp per client), and the script prints accuracy,
messages and scalars from each capture, whether the two captures are byte-identical, the training
seconds per round (``seconds`` in metrics: local training, server, evaluation) and the wall time of the
whole invocation (Flower's includes starting Ray and its workers). Then a 100-client FedAvg run on
Flower gives its time per round. Run it alone: two torch processes on two cores slow each other.

    python -m experiments.bench.flower                          # FedAvg and FedRE quick, then 100 clients
    python -m experiments.bench.flower --methods fedre --rounds 5 --clients-scaling 0
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.bench.lib import record
from privfl.config import build_config
from privfl.methods import resolve_method
from privfl.train import train_config as train

MODEL_GROUP = {"fedavg": "homo-cnn4"}


def one_run(out: Path, method: str, engine: str, args: argparse.Namespace, clients: int, subsample: int, partition: str) -> dict[str, Any]:
    values: dict[str, Any] = {
        "method": method,
        "engine": engine,
        "num_clients": clients,
        "subsample": subsample,
        "rounds": args.rounds,
        "partition": partition,
        "alpha": 0.1,
        "seed": args.seed,
        "device": "cpu",
        "progress": False,
        "out_dir": str(out),
        "run_name": f"{method}-{engine}-{clients}",
        "flower_client_cpus": args.client_cpus,
    }
    if method in MODEL_GROUP:
        values["model_group"] = MODEL_GROUP[method]
    cfg = build_config(values, resolve_method(method).Options)
    t0 = time.perf_counter()
    run = train(cfg)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in (run.path / "capture" / "index.jsonl").read_text().splitlines()]
    return {
        "path": run.path,
        "acc": rows[-1]["acc"],
        "messages": len(records),
        "scalars": sum(r["scalars"] for r in records),
        "s_per_round": sum(r["seconds"] for r in rows) / len(rows),
        "wall": wall,
    }


def same_tree(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    if files != sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()):
        return False
    return all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.flower", description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="fedavg,fedre", help="comma list of methods written in roles")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--subsample", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-cpus", type=float, default=1.0, help="--flower-client-cpus")
    p.add_argument("--clients-scaling", type=int, default=100, help="also FedAvg with this many clients on both engines (0: skip)")
    p.add_argument("--scaling-subsample", type=int, default=6000)
    args = p.parse_args()
    import torch

    torch.set_num_threads(max(1, int(args.client_cpus)))  # the nodes' thread count, so both sides compute alike
    header = "| method | clients | engine | final acc | messages | scalars | s/round (training) | wall s (invocation) | capture identical |"
    lines = [header, "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    plan = [(m, args.clients, args.subsample, "dir") for m in args.methods.split(",") if m]
    if args.clients_scaling:
        plan.append(("fedavg", args.clients_scaling, args.scaling_subsample, "iid"))  # Dir(0.1) leaves some of 100 clients nearly empty
    with tempfile.TemporaryDirectory() as tmp:
        for method, clients, subsample, partition in plan:
            a = one_run(Path(tmp), method, "inprocess", args, clients, subsample, partition)
            b = one_run(Path(tmp), method, "flower", args, clients, subsample, partition)
            same = all(same_tree(a["path"] / s, b["path"] / s) for s in ("capture", "truth", "knowledge"))
            for engine, r in (("inprocess", a), ("flower", b)):
                cells = [method, clients, engine, f"{100 * r['acc']:.2f}", r["messages"], r["scalars"], f"{r['s_per_round']:.2f}", f"{r['wall']:.1f}"]
                lines.append("| " + " | ".join(map(str, cells)) + f" | {'yes' if same else 'NO'} |")
            ratio = f"{b['s_per_round'] / a['s_per_round']:.2f}x | {b['wall'] / a['wall']:.2f}x"
            note = f"capture identical: {'yes' if same else 'NO'}"
            record("flower", f"{method}, {clients} clients, s/round", "in-process", a["s_per_round"], "Flower", b["s_per_round"], "s", note)
            lines.append(f"| {method} | {clients} | flower / inprocess | | | | {ratio} | |")
            print("\n".join(lines[-3:]), flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
