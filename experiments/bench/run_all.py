"""``make bench``: every speed benchmark, then one table of what each measured side by side.

Each benchmark runs as its own process, alone (two torch processes on the same cores slow each other),
prints its own report, and appends its headline comparisons (configuration a vs b in the same run,
the ratio b / a) through :mod:`experiments.bench.lib`; the table at the end gathers them. The inversion benchmarks
need a FedRE run with client extractors: a small one is trained first (Fashion-MNIST 2,000 samples,
3 rounds), unless ``--run`` gives one.

    python -m experiments.bench.run_all                    # all of them (27 minutes on 2 CPU cores, 2026-11-27)
    python -m experiments.bench.run_all --only clients,dlg
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: the benchmarks run from there

#: name -> the module and its arguments, run as ``python -m`` (the inversion benchmarks get --run added)
BENCHES: dict[str, list[str]] = {
    "capture": ["experiments.bench.capture"],
    "inversion": ["experiments.bench.inversion_batching"],
    "dip-settings": ["experiments.bench.dip_settings"],
    "dlg": ["experiments.bench.dlg"],
    "lbfgs": ["experiments.bench.lbfgs"],
    "clients": ["experiments.bench.clients"],
    "round-profile": ["experiments.bench.profile_round"],
    "layout": ["experiments.bench.layout"],
    "client-workers": ["experiments.bench.client_workers"],
    "flower": ["experiments.bench.flower"],
}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.run_all", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help=f"comma list of {', '.join(BENCHES)}")
    p.add_argument("--run", help="the FedRE run the inversion benchmark attacks (default: train a small one)")
    args = p.parse_args()
    names = [n.strip() for n in args.only.split(",")] if args.only else list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"experiments.bench.run_all: unknown benchmark {unknown[0]!r}; accepted: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        env["PRIVFL_BENCH_JSON"] = rows_path = str(Path(tmp) / "rows.jsonl")
        Path(rows_path).touch()
        for name in names:
            cmd = [sys.executable, "-m", *BENCHES[name]]
            if name in ("inversion", "dip-settings"):
                run = args.run or str(Path(tmp) / "fedre-bench")
                if not args.run and not Path(run).exists():
                    train = [sys.executable, "-m", "privfl.train", "fedre", "--subsample", "2000", "--rounds", "3", "--no-progress"]
                    train += ["--out-dir", tmp, "--run-name", "fedre-bench"]
                    subprocess.run(train, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
                cmd += ["--run", run]
            print(f"\n=== {name}: python {' '.join(cmd[1:])}", flush=True)
            if subprocess.run(cmd, check=False, env=env, cwd=ROOT).returncode != 0:
                failed.append(name)
        rows = [json.loads(line) for line in Path(rows_path).read_text().splitlines() if line.strip()]
    print("\n| benchmark | measure | a | value a | b | value b | b / a | note |")
    print("|---|---|---|---:|---|---:|---:|---|")
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        a = "" if r["a"] is None else f"{r['a']:.4g} {r['unit']}"
        print(f"| {r['bench']} | {r['measure']} | {r['a_label']} | {a} | {r['b_label']} | {r['b']:.4g} {r['unit']} | {ratio} | {r['note']} |")
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
