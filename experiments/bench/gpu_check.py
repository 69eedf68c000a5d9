"""privfl on a CUDA GPU, measured (issue 17, goal 6): seconds per round and GPU memory of the FedRE paper
configuration, the README's main job on the GPU against the same machine's CPU, and ``--deterministic``.

Three parts, each timed on its own and each allowed to fail without stopping the others (a traceback is
printed and the part's row says ``failed``), and the GPU memory of the first two:

1. ``paper``: the FedRE paper configuration ``experiments/papers/fedre/cifar10_pat_hete.toml`` (ten clients, one
   of each HtM10 model: cnn4, MobileNetV2, GoogLeNet, ResNet-18/34/50/101/152, ViT-B/16, ViT-B/32; CIFAR-10
   PAT, two classes a client, batch 32, lr 0.06, RAP entanglement) for ``--paper-rounds`` rounds on
   ``--device auto``, capture on, then DIP inversion of two clients' entangled representations. CIFAR-10
   is read from ``--cifar-root`` where a user has it; without it (a lent GPU machine reaches no network)
   the script writes CIFAR-10-*shaped* synthetic data in CIFAR's own python-batch format (50,000 + 10,000
   32x32 colour images: a smooth random template per class plus pixel noise, so the models have
   something to learn) and the loader privfl ships reads it. Its seconds and memory are the paper
   configuration's; its accuracies are not CIFAR-10's.
2. ``demo``: the demo's FedRE (``python -m privfl.train fedre``: Fashion-MNIST, the cpu5 models) for
   ``--demo-rounds`` rounds on the GPU, then on this machine's CPU (all its cores), and ``invert --compare
   rep,proto,ent_rep`` on both (fewer targets than the demo: ``--samples``).
3. ``determinism``: the demo's FedRE (``--det-model-group``, default cpu5, whose ResNet has BatchNorm;
   or ``--det-setting paper``, the paper part's configuration and data) for ``--det-rounds`` rounds four
   times on the device: twice as is and twice with ``--deterministic``. It prints whether each pair
   agrees to the bit (every round's metrics but its seconds, and the sha256 of every captured message),
   the seconds per round of both settings and their ratio, and the operations torch warned have no
   deterministic kernel. The process sets ``CUBLAS_WORKSPACE_CONFIG`` before CUDA starts when this part
   is chosen (``--deterministic`` needs it; the plain runs only share the workspace).

Memory is torch's allocator's peak (allocated and reserved) of each part and of each round.

Seconds per round are means over the rounds after the first (the first builds kernels and plans);
``wall`` counts a round from the end of the previous one (evaluation, metrics and checkpoint writes in).

    python -m experiments.bench.gpu_check --out /tmp/gpu                      # on a machine with a CUDA GPU
    python -m experiments.bench.gpu_check --device cpu --subsample 600 --paper-rounds 1 --demo-rounds 2 --steps 20 --targets 1 \\
        --paper-clients 0 --no-cpu-baseline --out /tmp/gpu        # the script itself, quickly, on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import privfl
from attacks import compare_artifacts, run_attack
from attacks.runner import AttackReport
from experiments.bench.lib import RoundClock
from privfl.config import read_config_file
from privfl.determinism import CUBLAS_WORKSPACE
from privfl.run import Run

ROOT = Path(__file__).resolve().parents[2]  # the repository

PAPER_CONFIG = ROOT / "experiments" / "papers" / "fedre" / "cifar10_pat_hete.toml"
CIFAR10_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
PARTS = ("paper", "demo", "determinism")


def write_cifar10_shaped(folder: Path, train: int = 50_000, test: int = 10_000, seed: int = 0) -> Path:
    """CIFAR-10-shaped synthetic data in CIFAR-10's python-batch format (``data_batch_1..5``, ``test_batch``,
    ``batches.meta``) under ``folder/cifar-10-batches-py``; returns that folder. Each class is a smooth random
    8x8 colour template upsampled to 32x32; an image is its class's template plus Gaussian pixel noise,
    clipped to uint8. Labels are balanced and shuffled."""
    rng = np.random.default_rng(seed)
    templates = rng.normal(0.0, 45.0, size=(10, 3, 8, 8)).repeat(4, axis=2).repeat(4, axis=3)
    out = folder / "cifar-10-batches-py"
    out.mkdir(parents=True, exist_ok=True)

    def batch(n: int, name: str) -> dict[bytes, Any]:
        labels = rng.permutation(np.arange(n) % 10)
        pixels = 128.0 + templates[labels] + rng.normal(0.0, 40.0, size=(n, 3, 32, 32))
        data = np.clip(np.rint(pixels), 0, 255).astype(np.uint8).reshape(n, 3 * 32 * 32)
        return {b"batch_label": name.encode(), b"labels": labels.tolist(), b"data": data, b"filenames": [b"synthetic.png"] * n}

    sizes = [train // 5 + (1 if i < train % 5 else 0) for i in range(5)]
    for name, n in [*((f"data_batch_{i + 1}", s) for i, s in enumerate(sizes)), ("test_batch", test)]:
        with open(out / name, "wb") as fh:
            pickle.dump(batch(n, name), fh)
    with open(out / "batches.meta", "wb") as fh:
        pickle.dump({b"label_names": [n.encode() for n in CIFAR10_NAMES], b"num_cases_per_batch": sizes[0], b"num_vis": 3072}, fh)
    return out


class GpuRoundClock(RoundClock):
    """Wall seconds of each round and the peak GPU memory allocated during it (the first round's peak
    includes building the models)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.peak_allocated: list[int] = []
        self.engine_seconds: list[float] = []

    def on_round_end(self, rnd: int, entry: dict[str, Any]) -> None:
        super().on_round_end(rnd, entry)
        self.engine_seconds.append(float(entry["seconds"]))
        if self.device.type == "cuda":
            self.peak_allocated.append(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)


def mean_after_first(values: list[float]) -> float | None:
    rest = values[1:] if len(values) > 1 else values
    return statistics.fmean(rest) if rest else None


def memory_of(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device), "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}


def train(values: dict[str, Any], device: torch.device) -> tuple[Run, dict[str, Any]]:
    """``privfl.train(values)`` in this process; the run, and its per-round seconds, memory and accuracies."""
    clock = GpuRoundClock(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    run = privfl.train({**values, "device": str(device)}, callbacks=[clock])
    rows, summary = run.metrics, run.summary
    return run, {
        "run": str(run.path),
        "total_seconds": round(time.perf_counter() - t0, 2),
        "rounds": len(rows),
        "engine_s_per_round": mean_after_first(clock.engine_seconds),
        "wall_s_per_round": mean_after_first(clock.walls),
        "engine_seconds": clock.engine_seconds,
        "wall_seconds": [round(w, 3) for w in clock.walls],
        "round_peak_allocated_bytes": clock.peak_allocated,
        "acc": [r["acc"] for r in rows],
        "acc_personal": [r.get("acc_personal") for r in rows],
        "upload_bytes": rows[-1]["upload_bytes"],
        "capture_bytes": summary["capture_bytes"],
        "knowledge_bytes": summary["knowledge_bytes"],
        "nonfinite": summary.get("nonfinite", {}),  # a loss that went NaN/inf, and from which round
        **memory_of(device),
    }


def inversion(report: AttackReport, device: torch.device) -> dict[str, Any]:
    """An inversion's seconds per target, PSNR per kind and GPU memory."""
    summary = report.summary
    # compare_artifacts: "<kind>_sample_psnr" per kind; run_attack on an aggregate: "best_psnr"/"mean_psnr"
    psnr = {k[: -len("_sample_psnr")]: v for k, v in summary.items() if k.endswith("_sample_psnr")}
    psnr.update({k[: -len("_psnr")]: v for k, v in summary.items() if k in ("sample_psnr", "best_psnr", "mean_psnr")})
    psnr = {k: None if v is None else round(v, 2) for k, v in psnr.items()}
    return {"targets": summary["targets"], "seconds_per_target": summary["seconds_per_target"], "psnr": psnr, **memory_of(device)}


def attack_settings(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """What run_attack and compare_artifacts take here: privfl's DIP settings, ``--steps`` if given."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    options = {"steps": args.steps} if args.steps else {}
    return {"options": options, "seed": args.seed, "device": device, "name": f"gpu-check-{device.type}", "progress": args.progress}


def run_values(args: argparse.Namespace, run_name: str) -> dict[str, Any]:
    """The options every training of the check shares."""
    values: dict[str, Any] = {"seed": args.seed, "out_dir": str(args.work / "runs"), "run_name": run_name, "progress": args.progress}
    return {**values, "subsample": args.subsample} if args.subsample else values


def paper_data(args: argparse.Namespace) -> tuple[Path, bool]:
    """CIFAR-10's folder: ``--cifar-root``, or CIFAR-10-shaped synthetic data written once under ``--work``."""
    if args.cifar_root is not None:
        return args.cifar_root, False
    root = args.work / "cifar10-shaped"
    if not root.exists():
        t0 = time.perf_counter()
        write_cifar10_shaped(root, seed=args.seed)
        print(f"wrote CIFAR-10-shaped synthetic data under {root} in {time.perf_counter() - t0:.1f} s", flush=True)
    return root, True


def part_paper(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    root, synthetic = paper_data(args)
    values = {**read_config_file(PAPER_CONFIG), **run_values(args, f"paper-{device.type}"), "data_root": str(root), "rounds": args.paper_rounds}
    run, trained = train(values, device)
    shutil.copy(run.path / "metrics.jsonl", args.out / "paper_metrics.jsonl")  # per client, per round
    clients = [c.strip() for c in args.paper_clients.split(",") if c.strip()]
    report = run_attack(run, "invert", kind="ent_rep", clients=clients, max_targets=args.targets, **attack_settings(args, device))
    data = "CIFAR-10-shaped synthetic" if synthetic else f"CIFAR-10 from {root}"
    return {"data": data, "train": trained, "invert": inversion(report, device)}


def part_demo(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    sides: dict[str, Any] = {}
    devices = [device] if device.type == "cpu" or args.no_cpu_baseline else [device, torch.device("cpu")]
    for dev in devices:
        run, trained = train({"method": "fedre", **run_values(args, f"demo-{dev.type}"), "rounds": args.demo_rounds}, dev)
        report = compare_artifacts(run, ["rep", "proto", "ent_rep"], samples=args.targets, **attack_settings(args, dev))
        sides[dev.type] = {"train": trained, "invert": inversion(report, dev)}
    return {"sides": sides}


def bitwise_record(run: Run) -> tuple[list[dict[str, Any]], list[str]]:
    """What two bit-identical runs share: every round's metrics but its seconds, and the sha256 of every
    captured message."""
    rows = [{k: v for k, v in row.items() if k != "seconds"} for row in run.metrics]
    return rows, [rec["sha256"] for rec in run.capture.records()]


def part_determinism(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The demo's FedRE (or, ``--det-setting paper``, the paper configuration) twice as is and twice with
    ``--deterministic``, on ``device``."""
    if args.det_setting == "paper":
        root, synthetic = paper_data(args)
        base = {**read_config_file(PAPER_CONFIG), "data_root": str(root)}
        setting = "paper HtM10, " + ("CIFAR-10-shaped synthetic" if synthetic else "CIFAR-10")
    else:
        base = {"method": "fedre", "model_group": args.det_model_group}
        setting = f"demo, {args.det_model_group}"
    sides: dict[str, Any] = {}
    for deterministic in (False, True):
        label = "deterministic" if deterministic else "plain"
        records, trained = [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for repeat in (1, 2):
                values = {**base, **run_values(args, f"det-{label}-{repeat}"), "rounds": args.det_rounds, "deterministic": deterministic}
                run, result = train(values, device)
                records.append(bitwise_record(run))
                trained.append(result)
        # torch's wording: "<op> does not have a deterministic implementation, ..." or "<kernel> defaults to a non-deterministic algorithm. ..."
        texts = [str(w.message) for w in caught if "deterministic" in str(w.message)]
        warned = sorted({text.split(" does not have a deterministic")[0].split(". ")[0] for text in texts})
        first_differing = next((r["round"] for r, q in zip(records[0][0], records[1][0], strict=True) if r != q), None)
        sides[label] = {
            "metrics_equal": records[0][0] == records[1][0],
            "capture_equal": records[0][1] == records[1][1],
            "first_differing_round": first_differing,
            "messages": len(records[0][1]),
            "s_per_round": [t["wall_s_per_round"] for t in trained],
            "acc": [t["acc"][-1] for t in trained],
            "nondeterministic_ops": warned,
        }
    sides["slowdown"] = statistics.fmean(sides["deterministic"]["s_per_round"]) / statistics.fmean(sides["plain"]["s_per_round"])
    return {"setting": setting, "rounds": args.det_rounds, **sides}


def guarded(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        out = fn()
        out["part_seconds"] = round(time.perf_counter() - t0, 1)
        return out
    except Exception:  # a part's failure is reported and the next part still runs
        traceback.print_exc()
        print(f"gpu_check: part {name} failed (above); going on", flush=True)
        return {"failed": traceback.format_exc(limit=-8), "part_seconds": round(time.perf_counter() - t0, 1)}


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def report(results: dict[str, Any]) -> str:
    lines = [f"# gpu_check: {results['device_name']} (torch {results['torch']}, {results['threads']} CPU threads)", ""]
    if "paper" in results or "demo" in results:
        lines.append(
            "| job | device | rounds | s/round engine | s/round wall | peak alloc GiB | peak reserved GiB | final acc | invert s/target | PSNR dB |"
        )
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    diverged: list[str] = []

    def row(job: str, dev: str, side: dict[str, Any]) -> None:
        if "failed" in side:
            lines.append(f"| {job} | {dev} | failed: {side['failed'].strip().splitlines()[-1]} |")
            return
        t, inv = side["train"], side.get("invert", {})
        peak = max(t.get("peak_allocated_bytes", 0), inv.get("peak_allocated_bytes", 0)) or None
        reserved = max(t.get("peak_reserved_bytes", 0), inv.get("peak_reserved_bytes", 0)) or None
        psnr = ", ".join(f"{k} {v}" for k, v in inv.get("psnr", {}).items())
        lines.append(
            f"| {job} | {dev} | {t['rounds']} | {t['engine_s_per_round']:.2f} | {t['wall_s_per_round']:.2f} | {gib(peak)} | {gib(reserved)} "
            f"| {t['acc'][-1]:.4f} | {inv.get('seconds_per_target', float('nan')):.2f} | {psnr} |"
        )
        if t.get("nonfinite"):
            diverged.append(f"{job} on {dev}: " + ", ".join(f"{k} non-finite from round {r}" for k, r in t["nonfinite"].items()))

    if "paper" in results:
        row(f"FedRE paper HtM10 ({results['paper'].get('data', '?')})", results["device"], results["paper"])
    if "demo" in results:
        demo = results["demo"]
        if "failed" in demo:
            row("FedRE demo (Fashion-MNIST, cpu5)", results["device"], demo)
        else:
            for dev, side in demo["sides"].items():
                row("FedRE demo (Fashion-MNIST, cpu5)", dev, side)
            if len(demo["sides"]) == 2:
                gpu, cpu = demo["sides"][results["device_type"]], demo["sides"]["cpu"]
                lines.append("")
                train_ratio = gpu["train"]["wall_s_per_round"] / cpu["train"]["wall_s_per_round"]
                invert_ratio = gpu["invert"]["seconds_per_target"] / cpu["invert"]["seconds_per_target"]
                lines.append(f"GPU / CPU here: training {train_ratio:.2f}x the CPU's wall per round, inversion {invert_ratio:.2f}x its s/target")
    if diverged:
        lines += ["", *diverged]
    if "determinism" in results:
        det = results["determinism"]
        head = f"| FedRE {det.get('setting', '')} twice on {results['device']} | metrics equal | capture equal "
        head += "| first differing round | s/round (two runs) | final acc |"
        lines += ["", head]
        lines.append("|---|---|---|---:|---|---|")
        if "failed" in det:
            lines.append(f"| determinism | failed: {det['failed'].strip().splitlines()[-1]} |")
        else:
            for label in ("plain", "deterministic"):
                side = det[label]
                seconds = " / ".join(f"{v:.2f}" for v in side["s_per_round"])
                acc = " / ".join(f"{v:.4f}" for v in side["acc"])
                first = "-" if side["first_differing_round"] is None else str(side["first_differing_round"])
                lines.append(f"| {label} | {side['metrics_equal']} | {side['capture_equal']} | {first} | {seconds} | {acc} |")
            lines.append(f"\n--deterministic / plain seconds per round: {det['slowdown']:.2f}x")
            ops = det["deterministic"]["nondeterministic_ops"]
            lines.append("operations without a deterministic kernel (torch warned): " + (", ".join(ops) if ops else "none"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.gpu_check", description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and gpu_check.md (and the runs, unless --work)")
    p.add_argument("--work", type=Path, default=None, help="where the runs and the synthetic data go (default: OUT/work)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    p.add_argument("--cifar-root", type=Path, default=None, help="real CIFAR-10 (cifar-10-batches-py) for the paper part")
    p.add_argument("--paper-rounds", type=int, default=3)
    p.add_argument("--paper-clients", default="0,3", help="clients whose entangled representations are inverted (0 cnn4, 3 resnet18)")
    p.add_argument("--demo-rounds", type=int, default=3)
    p.add_argument("--no-cpu-baseline", action="store_true", help="demo on the GPU only")
    p.add_argument("--targets", type=int, default=4, help="inversion targets per client (demo: images compared)")
    p.add_argument("--steps", type=int, default=None, help="DIP steps (default: privfl's)")
    p.add_argument("--det-rounds", type=int, default=3, help="rounds of each of the determinism part's four runs")
    p.add_argument("--det-setting", choices=("demo", "paper"), default="demo", help="the determinism part's runs: demo FedRE or the paper's")
    p.add_argument("--det-model-group", default="cpu5", help="model group of the determinism part's demo setting (Fashion-MNIST)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--subsample", type=int, default=None, help="train on N samples of each dataset (a quick check of the script itself)")
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    from privfl.engine import resolve_device
    from privfl.errors import ConfigError

    try:
        device = resolve_device(args.device)
    except ConfigError as exc:
        p.error(str(exc))
    paper_scale = "paper" in parts or ("determinism" in parts and args.det_setting == "paper")
    if device.type == "cpu" and paper_scale and not args.subsample:
        p.error("the paper part (HtM10 on 60,000 images) takes hours on a CPU: run it where a GPU is, or pass --subsample")
    args.work = args.work or args.out / "work"
    if args.work.exists() and any(args.work.iterdir()):
        p.error(f"{args.work} holds an earlier check's runs: give another --out or --work")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "device": str(device),
        "device_type": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if "determinism" in parts:  # cuBLAS reads its workspace setting once, when CUDA first uses it
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if "paper" in parts:
        results["paper"] = guarded("paper", lambda: part_paper(args, device))
    if "demo" in parts:
        results["demo"] = guarded("demo", lambda: part_demo(args, device))
    if "determinism" in parts:
        results["determinism"] = guarded("determinism", lambda: part_determinism(args, device))
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1) + "\n")
    text = report(results)
    (args.out / "gpu_check.md").write_text(text + "\n")
    print(text)
    failed = [k for k in PARTS if isinstance(results.get(k), dict) and "failed" in results[k]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
