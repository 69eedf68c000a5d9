"""DRDFL's row of the paper's Figure 9: DLG by the ring neighbour on what DRDFL sends (a Learngene).

Paper: Guo, Lv, Geng, "Harmonizing Generalization and Personalization in Ring-topology Decentralized
Federated Learning", App. VII-C, Fig. 9 (DLG on FedNova, FedNova with noise and DRDFL, 200 steps, PSNR).
Two protocols (docs/methods/drdfl.md, "Gradient leakage"):

1. ``attack_learngene(dataset, images, labels, steps, seed)``: the strongest case, on the same images
   as fig9_gradleak.py's FedNova rows. Per image a fresh DRDFL client takes one local SGD
   step (batch 1, lr ``LR``) of its full loss (L_PR + L_GL + L_rec + L_ce), starting from a Learngene
   phi_start the attacker knows; the Learngene message goes through a real Channel to the next node.
   The attacker forms g = (phi_start - phi_end) / lr, the exact phi-gradient of that loss, and runs
   DLG (L-BFGS, joint dummy image + soft label, ``steps`` steps) through the module DRDFL declares for
   a Learngene message (``DRDFL.leakage``, built as :class:`attacks.context.LeakageModule`): the
   Learngene followed by a classifier of its own on mu_l (it never sees PersonaNet, decoder, f_omega
   or the adversary, so it cannot rehearse the loss the client used).
   Yields ``(row, reconstruction)`` pairs in fig9_gradleak.py's row format.
2. ``main()``: a short real DRDFL run on Fashion-MNIST (``privfl.train``), then DLG
   (``attacks.run_attack(run, "dlg", kind="learngene")``) on the last round's captured Learngene
   messages (previous state: the Learngene each sender received in the round it trained; target
   (prev - sent) / (lr * local steps)); prints PSNR. With ``--cifar N`` it also runs protocol 1 on N
   packaged CIFAR-10 test images.

    python -m experiments.papers.drdfl.fig9_learngene                 # ~2 minutes on a CPU
    python -m experiments.papers.drdfl.fig9_learngene --steps 200 --cifar 4
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import attacks
import privfl
from attacks.context import LeakageModule
from attacks.gradleak import GradLeakConfig, leak
from attacks.metrics import psnr, ssim
from privfl.capture.message import Message
from privfl.channel import Channel
from privfl.config import build_config
from privfl.methods import ModelRequest
from privfl.methods.drdfl import DRDFL, batch_losses
from privfl.seeding import derive_seed, seed_global

LR = 0.01  # the victim's SGD step (as fig9_gradleak.py's FedNova client)
MEAN, STD = 0.5, 0.5  # privfl's normalisation of every dataset: inputs in [-1, 1]


def _request(num_classes: int, seed: int, width: int) -> ModelRequest:
    cfg = build_config({"method": "drdfl", "seed": seed, "options": {"width": width, "persona_width": width, "decoder_width": width}}, DRDFL.Options)
    return ModelRequest("cnn4", 0, 3, num_classes, 32, cfg, DRDFL.Options(**cfg.options))


def attacker_probe(req: ModelRequest, example: torch.Tensor, seed: int) -> LeakageModule:
    """The module the ring neighbour differentiates, as DRDFL declares it for ``learngene``: the
    Learngene of a client model it builds itself (architecture known, weights random), followed by a
    random probe classifier of its own; eval mode. Seeded apart from the victim's draws."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        body = DRDFL.build_client_model(req).learngene
        return LeakageModule(body, DRDFL.leakage["learngene"], req.num_classes, example).eval()


def attack_learngene(
    dataset: str, images: torch.Tensor, labels: torch.Tensor, steps: int = 200, seed: int = 0, width: int = 8
) -> Iterator[tuple[dict, torch.Tensor]]:
    """DLG on one-step Learngene messages of ``images`` ((N, 3, 32, 32) in [0, 1]); see the module docstring."""
    num_classes = 100 if dataset == "cifar100" else 10
    cfg = GradLeakConfig.preset("dlg", steps=steps, snapshots=max(1, steps // 10))
    for i in range(len(images)):
        req = _request(num_classes, derive_seed(seed, "drdfl-victim", dataset), width)
        seed_global(seed, "drdfl-victim", dataset, i)
        model = DRDFL.build_client_model(req).train()
        x, y = (images[i : i + 1] - MEAN) / STD, labels[i : i + 1]
        start = {k: v.clone() for k, v in DRDFL.learngene_tensors(model).items()}
        main = [p for n, p in model.named_parameters() if not n.startswith("adversary.")]
        opt = torch.optim.SGD(main, lr=LR)
        losses = batch_losses(model, x, y, req.opts, torch.optim.SGD(model.adversary.parameters(), lr=LR))
        opt.zero_grad()
        losses["train_loss"].backward()
        opt.step()
        sent = Channel(None, None).send(
            Message(
                0,
                f"client{i}",
                f"client{i + 1}",
                "learngene",
                DRDFL.learngene_tensors(model),
                {"lr": LR, "num_samples": 1, "local_epochs": 1, "batch_size": 1},
            )
        )
        probe = attacker_probe(req, torch.zeros_like(x).expand(2, -1, -1, -1), derive_seed(seed, "drdfl-probe", dataset, i))
        probe.load_state_dict(probe.to_module_names(start), strict=False)  # the attacker knows phi_start (strongest case)
        names = {n for n, _ in probe.named_parameters()}
        gradient = {k: (start[k] - v) / LR for k, v in sent.tensors.items()}
        target = {k: v for k, v in probe.to_module_names(gradient).items() if k in names}
        t0 = time.perf_counter()
        res = leak(probe, target, (3, 32, 32), num_classes, cfg, seed=derive_seed(seed, "dlg-drdfl", dataset, i))
        rec = (res.images * STD + MEAN).clamp(0, 1)
        row = {
            "dataset": dataset,
            "system": "DRDFL Learngene",
            "victim": f"drdfl-w{width}",
            "image": i,
            "label": int(y),
            "label_recovered": int(res.labels[0]),
            "psnr": float(psnr(rec, images[i : i + 1])[0]),
            "ssim": float(ssim(rec, images[i : i + 1])[0]),
            "seconds": round(time.perf_counter() - t0, 2),
        }
        yield row, rec[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.papers.drdfl.fig9_learngene", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=20, help="DLG steps (the paper: 200)")
    p.add_argument("--rounds", type=int, default=2, help="ring rounds (at least 2: round 0's senders had received nothing)")
    p.add_argument("--cifar", type=int, default=0, help="also run the one-step protocol on N packaged CIFAR-10 images")
    p.add_argument("--out", default=None, help="run folder (default: a temporary one)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.rounds < 2:  # a round-0 Learngene has no previous state to difference against
        p.error("--rounds must be at least 2: the attack needs a Learngene its sender received in an earlier round")
    out = Path(args.out or tempfile.mkdtemp(prefix="drdfl-fig9-"))
    run = privfl.train(
        "drdfl",
        subsample=2000,
        partition="iid",
        num_clients=4,
        rounds=args.rounds,
        model_group="homo-cnn4",
        global_test_samples=200,
        progress=False,
        seed=args.seed,
        out_dir=str(out),
        run_name="train",
    )
    report = attacks.run_attack(run, "dlg", kind="learngene", options={"steps": args.steps, "max_batch": 1}, seed=args.seed)
    summary = report.summary
    print(f"DRDFL Learngene, captured messages of round {report.round}: PSNR {summary['psnr']:.2f} dB, SSIM {summary['ssim']:.3f}")
    if args.cifar:
        from attacks.images import packaged_images

        images, labels = packaged_images("cifar10", args.cifar)
        for row, _ in attack_learngene("cifar10", images, labels, steps=args.steps, seed=args.seed):
            print(f"one-step protocol, cifar10 image {row['image']}: PSNR {row['psnr']:.2f} dB  SSIM {row['ssim']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
