"""``make bench``: every speed benchmark, then one table of what each measured side by side.

Each benchmark runs as its own process, alone (two torch processes on the same cores slow each other),
prints its own report, and appends its headline comparisons (configuration a vs b in the same run,
the ratio b / a) through :mod:`benchlib`; the table at the end gathers them. The inversion benchmarks
need a FedRE run with client extractors: a small one is trained first (Fashion-MNIST 2,000 samples,
3 rounds), unless ``--run`` gives one.

    python experiments/bench.py                    # all of them (27 minutes on 2 CPU cores, 2026-11-27)
    python experiments/bench.py --only clients,dlg
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent

#: name -> arguments of its script (the inversion benchmarks get --run added)
BENCHES: dict[str, list[str]] = {
    "capture": ["bench_capture.py"],
    "inversion": ["bench_inversion_batching.py"],
    "dip-settings": ["bench_dip_settings.py"],
    "dlg": ["bench_dlg.py"],
    "lbfgs": ["bench_lbfgs.py"],
    "clients": ["bench_clients.py"],
    "round-profile": ["profile_round.py"],
    "layout": ["bench_layout.py"],
    "client-workers": ["bench_client_workers.py"],
    "flower": ["bench_flower.py"],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help=f"comma list of {', '.join(BENCHES)}")
    p.add_argument("--run", help="the FedRE run the inversion benchmark attacks (default: train a small one)")
    args = p.parse_args()
    names = [n.strip() for n in args.only.split(",")] if args.only else list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"bench: unknown benchmark {unknown[0]!r}; accepted: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        env["PRIVFL_BENCH_JSON"] = rows_path = str(Path(tmp) / "rows.jsonl")
        Path(rows_path).touch()
        for name in names:
            cmd = [sys.executable, str(HERE / BENCHES[name][0]), *BENCHES[name][1:]]
            if name in ("inversion", "dip-settings"):
                run = args.run or str(Path(tmp) / "fedre-bench")
                if not args.run and not Path(run).exists():
                    train = [sys.executable, "-m", "privfl.train", "fedre", "--subsample", "2000", "--rounds", "3", "--no-progress"]
                    train += ["--out-dir", tmp, "--run-name", "fedre-bench"]
                    subprocess.run(train, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
                cmd += ["--run", run]
            print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
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
