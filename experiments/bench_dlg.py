"""DLG wall time per image: privfl's implementation vs a plain reference loop in the original style.

Same victim (DLG's sigmoid LeNet, 100 outputs, U(-0.5, 0.5) weights), same real CIFAR-10 test image,
same 300 L-BFGS steps (lr 1, max_iter 20), same initial dummy data and label. The reference loop is
written here the way the DLG authors' script is structured (model call, autograd.grad with
create_graph, squared distance, LBFGS closure); it is not their code. Prints both times, their ratio
and both PSNRs, plus the full-setting check: PSNR > 30 dB clean and < 15 dB with sigma=0.01 noise.

    python experiments/bench_dlg.py [--steps 300] [--image 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from attacks.gradleak import GradLeakConfig, leak
from attacks.images import packaged_images
from attacks.metrics import psnr
from attacks.victims import SigmoidLeNet

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from experiments.benchlib import record  # noqa: E402


def reference_dlg(model, target_grads, x0, y0, steps):
    dummy_data = x0.clone().requires_grad_(True)
    dummy_label = y0.clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS([dummy_data, dummy_label])
    for _ in range(steps):

        def closure():
            optimizer.zero_grad()
            pred = model(dummy_data)
            onehot = F.softmax(dummy_label, dim=-1)
            loss = torch.mean(torch.sum(-onehot * F.log_softmax(pred, dim=-1), 1))
            dummy_grads = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            diff = 0
            for gx, gy in zip(dummy_grads, target_grads):
                diff += ((gx - gy) ** 2).sum()
            assert isinstance(diff, torch.Tensor)  # 0 + the first term: a tensor
            diff.backward()
            return diff

        optimizer.step(closure)
    return dummy_data.detach()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--image", type=int, default=0)
    args = p.parse_args()
    images, labels = packaged_images("cifar10", args.image + 1)
    img, label = images[args.image : args.image + 1], labels[args.image : args.image + 1]
    model = SigmoidLeNet(3, 100, 32).init_uniform(torch.Generator().manual_seed(0))
    x = (img - 0.5) / 0.5
    params = list(model.named_parameters())
    grads = torch.autograd.grad(F.cross_entropy(model(x), label), [p for _, p in params])
    target = {n: g.detach() for (n, _), g in zip(params, grads)}
    cfg = GradLeakConfig.preset("dlg", steps=args.steps)
    gen = torch.Generator().manual_seed(0)  # the same initial dummies as ours (restart 0)
    x0 = torch.randn((1, 3, 32, 32), generator=gen)
    y0 = torch.randn((1, 100), generator=gen)
    # warm up both (thread pools, allocator) so neither side pays first-call costs in the timing
    leak(model, target, (3, 32, 32), 100, GradLeakConfig.preset("dlg", steps=3), seed=0)
    for prm in model.parameters():
        prm.requires_grad_(True)
    reference_dlg(model, [target[n] for n, _ in params], x0, y0, 3)
    t0 = time.perf_counter()
    ours = leak(model, target, (3, 32, 32), 100, cfg, seed=0)
    t_ours = time.perf_counter() - t0
    for prm in model.parameters():
        prm.requires_grad_(True)
    t0 = time.perf_counter()
    ref = reference_dlg(model, [target[n] for n, _ in params], x0, y0, args.steps)
    t_ref = time.perf_counter() - t0
    p_ours = psnr((ours.images * 0.5 + 0.5).clamp(0, 1), img).item()
    p_ref = psnr((ref * 0.5 + 0.5).clamp(0, 1), img).item()
    noisy = {k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in target.items()}
    p_noisy = psnr((leak(model, noisy, (3, 32, 32), 100, cfg, seed=0).images * 0.5 + 0.5).clamp(0, 1), img).item()
    print(f"DLG, sigmoid LeNet, CIFAR-10 test image {args.image} (label {label.item()}), {args.steps} L-BFGS steps")
    print(f"privfl:    {t_ours:7.1f} s   PSNR {p_ours:6.2f} dB")
    print(f"reference: {t_ref:7.1f} s   PSNR {p_ref:6.2f} dB")
    print(f"time ratio privfl / reference: {t_ours / t_ref:.3f}")
    quality = f"PSNR {p_ref:.2f} vs {p_ours:.2f} dB"
    record("dlg", f"seconds per image, {args.steps} L-BFGS steps", "reference loop", t_ref, "privfl", t_ours, "s", quality)
    print(f"with N(0, 0.01^2) noise on the gradient: PSNR {p_noisy:.2f} dB")
    print(f"checks: clean > 30 dB: {p_ours > 30}; noisy < 15 dB: {p_noisy < 15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
