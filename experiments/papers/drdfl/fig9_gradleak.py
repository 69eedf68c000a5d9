"""DRDFL Figure 9 setting: DLG on what FedNova sends, with and without Gaussian noise (and DRDFL's Learngene).

The DRDFL paper (Guo, Lv, Geng, "Harmonizing Generalization and Personalization in Ring-topology
Decentralized Federated Learning", App. VII-C, Fig. 9) attacks FedNova, FedNova with added Gaussian
noise and DRDFL with DLG for 200 optimisation steps on CIFAR-10 and CIFAR-100 and reports PSNR, without
numbers in the text. It leaves the victim, the noise level, the batch and the optimiser open; this
script decides them as follows:

- victim: DLG's sigmoid LeNet (U(-0.5, 0.5) weights, 100 outputs on both datasets as in DLG's own
  script), the model with which DLG's "recognizable" reconstructions are reproduced. ``--victims lenet,resnet18``
  adds the paper's ResNet-18 (BatchNorm in eval mode, since a one-image batch has no batch statistics
  at the last stage); that costs minutes per image on a CPU.
- FedNova client: one local SGD step (tau = 1, batch 1, lr ``--lr``) from the broadcast model, then
  the normalised update d = (x - x_1) / a with a = ``privfl.methods.fednova.normalizer(1)``, sent as an
  ``update`` message through a real :class:`privfl.channel.Channel` whose mods are the ``--defense``
  transforms, exactly as in ``privfl.train fednova --defense gaussian:sigma=...``.
- noise: N(0, s^2) on every gradient entry, s^2 in {1e-4, 1e-3, 1e-2} (DLG's range; headline 1e-3).
  The defense acts on the transmitted update d = lr * g, so it is configured with sigma = lr * s; the
  attacker's gradient estimate d / lr then carries exactly N(0, s^2).
- attack: :func:`attacks.gradleak.leak` with DLG's settings (joint dummy image + soft label, L-BFGS lr 1,
  squared gradient distance), 200 ``step`` calls, a snapshot every 10; the attacker knows the model it
  broadcast and the lr, so its target is d / lr (``GradientLeakage.observation`` for ``update``).
- DRDFL row: when ``experiments/papers/drdfl/fig9_learngene.py`` exists (issue 6), its ``attack_learngene``
  is run on the same images and added to the table.

Outputs (``--out``, default runs/fig9): ``table.csv`` / ``table.json`` (PSNR, SSIM, label accuracy per
system and dataset: mean and std over images), ``per_image.csv``, and one ``gallery-<dataset>.png`` per
dataset with ground truth, the FedNova reconstruction along the optimisation, and every system's final
reconstruction.

    python -m experiments.papers.drdfl.fig9_gradleak                      # 8 images per dataset, 200 steps
    python -m experiments.papers.drdfl.fig9_gradleak --images 2 --steps 20  # a quick look
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from attacks.gradleak import GradLeakConfig, leak
from attacks.images import packaged_images
from attacks.metrics import psnr, ssim
from attacks.report import save_gallery
from attacks.victims import SigmoidLeNet
from defenses import build_defenses
from privfl.capture.message import Message
from privfl.channel import Channel
from privfl.fl.method import module_tensors
from privfl.methods.fednova import normalizer
from privfl.seeding import derive_seed

NUM_CLASSES = {"cifar10": 10, "cifar100": 100}
MEAN, STD = 0.5, 0.5  # DLG's normalisation of the victim's input
RECOGNISABLE_DB = 20.0  # a reconstruction above this PSNR is visibly the same image (gallery check)


def build_victim(name: str, num_classes: int, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    if name == "lenet":
        return SigmoidLeNet(3, num_classes, 32).init_uniform(gen)
    if name == "resnet18":
        from torchvision.models import resnet18

        torch.manual_seed(seed)
        return resnet18(num_classes=num_classes).eval()
    raise SystemExit(f"unknown victim {name!r}; accepted: lenet, resnet18")


def fednova_update(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float, channel: Channel, sender: str) -> Message:
    """One FedNova client round (tau = 1) on one image; returns the message as delivered (defended)."""
    start = {k: v.clone() for k, v in module_tensors(model).items()}
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    a = normalizer(1)
    d = {k: (start[k] - v) / a for k, v in module_tensors(model).items() if v.is_floating_point()}
    model.load_state_dict(start)  # the attacker attacks from the model it broadcast
    msg = Message(0, sender, "server", "update", d, {"tau": 1, "a": a, "lr": lr, "num_samples": 1})
    return channel.send(msg)


def attack_update(model: nn.Module, delivered: Message, lr: float, num_classes: int, cfg: GradLeakConfig, seed: int):
    names = {n for n, _ in model.named_parameters()}
    target = {k: v / lr for k, v in delivered.tensors.items() if k in names}
    return leak(model, target, (3, 32, 32), num_classes, cfg, seed=seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.papers.drdfl.fig9_gradleak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--datasets", default="cifar10,cifar100")
    p.add_argument("--images", type=int, default=8, help="victim images per dataset (8 or more for a mean and spread)")
    p.add_argument("--steps", type=int, default=200, help="DLG optimisation steps (the paper: 200)")
    p.add_argument("--variances", default="1e-4,1e-3,1e-2", help="noise variances s^2 on the gradient")
    p.add_argument("--victims", default="lenet", help="lenet and/or resnet18")
    p.add_argument("--lr", type=float, default=0.01, help="the FedNova client's local learning rate")
    p.add_argument(
        "--restarts", type=int, default=1, help="DLG restarts from fresh dummies, the lowest final loss wins (DLG itself: 1; some inits diverge)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-drdfl", action="store_true", help="skip the DRDFL row even if its script exists")
    p.add_argument("--only-drdfl", action="store_true", help="only the DRDFL row (e.g. to add it to an earlier table)")
    p.add_argument(
        "--drdfl-width", type=int, default=32, help="DRDFL Learngene width (32: the paper configs' ~0.50M-parameter Learngene; 8: the quick default)"
    )
    p.add_argument("--out", default="runs/fig9")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variances = [float(v) for v in args.variances.split(",") if v]
    cfg = GradLeakConfig.preset("dlg", steps=args.steps, snapshots=max(1, args.steps // 10), restarts=args.restarts)
    drdfl = None if args.no_drdfl else _drdfl_row()
    if args.only_drdfl and drdfl is None:
        raise SystemExit("--only-drdfl: experiments/papers/drdfl/fig9_learngene.py is missing")

    per_image: list[dict] = []
    for dataset in args.datasets.split(","):
        images, labels = packaged_images(dataset, args.images)
        finals: dict[str, list[torch.Tensor]] = {}
        snaps: dict[int, list[torch.Tensor]] = {}
        for victim in [] if args.only_drdfl else args.victims.split(","):
            systems: list[tuple[str, list[str]]] = [("FedNova", [])] + [
                (f"FedNova+noise s2={v:g}", [f"gaussian:sigma={args.lr * v**0.5:.6g},seed={args.seed}"]) for v in variances
            ]
            for system, defense in systems:
                label = f"{system} ({victim})"
                k = 100 if victim == "lenet" else NUM_CLASSES[dataset]
                for i in range(len(images)):
                    model = build_victim(victim, k, derive_seed(args.seed, "victim", dataset, victim))
                    x = (images[i : i + 1] - MEAN) / STD
                    y = labels[i : i + 1]
                    channel = Channel(None, None, mods=build_defenses(defense))
                    delivered = fednova_update(model, x, y, args.lr, channel, sender=f"client{i}")
                    t0 = time.perf_counter()
                    res = attack_update(model, delivered, args.lr, k, cfg, derive_seed(args.seed, "dlg", dataset, i))
                    secs = time.perf_counter() - t0
                    rec = (res.images * STD + MEAN).clamp(0, 1)
                    row = {
                        "dataset": dataset,
                        "system": system,
                        "victim": victim,
                        "image": i,
                        "label": int(y),
                        "label_recovered": int(res.labels[0]),
                        "psnr": float(psnr(rec, images[i : i + 1])[0]),
                        "ssim": float(ssim(rec, images[i : i + 1])[0]),
                        "seconds": round(secs, 2),
                    }
                    per_image.append(row)
                    finals.setdefault(label, []).append(rec[0])
                    if system == "FedNova" and victim == args.victims.split(",")[0]:
                        for step, xs in res.snapshots:
                            snaps.setdefault(step, []).append((xs[0] * STD + MEAN).clamp(0, 1))
                    print(
                        f"{dataset} {label:<32} image {i}: PSNR {row['psnr']:6.2f} dB  SSIM {row['ssim']:.3f}  "
                        f"label {'ok' if row['label'] == row['label_recovered'] else 'wrong'}  {secs:5.1f} s",
                        flush=True,
                    )
        if drdfl is not None:
            for row, rec in drdfl(dataset, images, labels, steps=args.steps, seed=args.seed, width=args.drdfl_width):
                per_image.append(row)
                finals.setdefault(f"{row['system']} ({row['victim']})", []).append(rec)
        steps = sorted(snaps)
        shown = [steps[j] for j in sorted({0, len(steps) // 4, len(steps) // 2, 3 * len(steps) // 4})] if steps else []
        rows = [(f"FedNova step {s}", torch.stack(snaps[s])) for s in shown]
        rows += [(name, torch.stack(recs)) for name, recs in finals.items()]
        per_label = {
            name: [f"{r['psnr']:.1f} dB" for r in per_image if r["dataset"] == dataset and f"{r['system']} ({r['victim']})" == name]
            for name in finals
        }
        save_gallery(
            out / f"gallery-{dataset}.png",
            images,
            rows,
            captions=[f"#{i}" for i in range(len(images))],
            title=f"DLG, {args.steps} steps, {dataset}: FedNova vs defended / DRDFL",
            per_image_labels=per_label,
        )

    table = _table(per_image)
    _write_csv(out / "per_image.csv", per_image)
    _write_csv(out / "table.csv", table)
    (out / "table.json").write_text(json.dumps({"protocol": dict(vars(args)), "dlg": cfg.as_dict(), "table": table}, indent=2) + "\n")
    print(f"\n{'dataset':<9} {'system':<28} {'victim':<9} {'PSNR dB':>14} {'SSIM':>12} {'labels':>7} {'>20 dB':>7}")
    for r in table:
        print(
            f"{r['dataset']:<9} {r['system']:<28} {r['victim']:<9} {r['psnr_mean']:7.2f} ± {r['psnr_std']:<5.2f}"
            f" {r['ssim_mean']:.3f} ± {r['ssim_std']:.3f} {r['label_acc']:6.0%} {r['recognisable']:6.0%}"
        )
    print(f"results: {out}/table.csv, {out}/gallery-*.png")
    return 0


def _table(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["system"], r["victim"]), []).append(r)
    out = []
    for (dataset, system, victim), rs in groups.items():
        ps, ss = [r["psnr"] for r in rs], [r["ssim"] for r in rs]
        out.append(
            {
                "dataset": dataset,
                "system": system,
                "victim": victim,
                "images": len(rs),
                "psnr_mean": round(statistics.fmean(ps), 3),
                "psnr_std": round(statistics.pstdev(ps), 3),
                "ssim_mean": round(statistics.fmean(ss), 4),
                "ssim_std": round(statistics.pstdev(ss), 4),
                "label_acc": sum(r["label"] == r["label_recovered"] for r in rs) / len(rs),
                "recognisable": sum(r["psnr"] > RECOGNISABLE_DB for r in rs) / len(rs),
                "seconds_per_image": round(statistics.fmean(r["seconds"] for r in rs), 2),
            }
        )
    return out


def _write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _drdfl_row():
    """``attack_learngene(dataset, images, labels, steps, seed)`` from ``fig9_learngene.py`` beside this script, if present."""
    path = Path(__file__).with_name("fig9_learngene.py")
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("fig9_learngene", path)
    assert spec is not None and spec.loader is not None  # a .py file that exists
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, "attack_learngene", None)


if __name__ == "__main__":
    sys.exit(main())
