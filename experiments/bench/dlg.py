"""DLG wall time per image: privfl's implementation vs a plain reference loop in the original style.

Same victim (DLG's sigmoid LeNet, 100 outputs, U(-0.5, 0.5) weights), same real CIFAR-10 test image,
same 300 L-BFGS steps (lr 1, max_iter 20), same initial dummy data and label. The reference loop is
written here the way the DLG authors' script is structured (model call, autograd.grad with
create_graph, squared distance, LBFGS closure); it is not their code. Prints both times, their ratio
and both PSNRs, plus the full-setting check: PSNR > 30 dB clean and < 15 dB with sigma=0.01 noise.

Then the same for ``--images`` CIFAR-10 test images attacked together, the way an audit meets them
(several uploads of one round): the reference loop one image after another, privfl's
:func:`attacks.gradleak.leak_batch` all at once (one vmapped closure, :class:`attacks.lbfgs.LockstepLBFGS`
keeping each image's L-BFGS apart), and privfl's :func:`attacks.gradleak.leak` one image at a time, with the
eager closure and with ``compile=True`` (its compiling timed apart). DLG's L-BFGS is chaotic (a rounding difference in the first step
grows into a different trajectory within a few steps, in float64 too), so batched and one-at-a-time runs
end on different images of the same quality: the comparison is the PSNR of every image, their mean and
how many converge (> 30 dB), against the time per image. ``--cnn4 N`` adds DLG on a 582,026-parameter
``cnn4`` (Fashion-MNIST, batch 1) for N images: one at a time with every gradient materialised (the
attack when the speed issue was filed) against ``--cnn4-batch`` and N at a time with the wide linear
layer factored (:mod:`attacks.gradmatch`), and N at once materialised. ``--filed-code REV`` adds the same
N images one at a time by the code of the day issue 17 was filed (default 645289a: its ``leak()``,
run from ``git archive REV`` in a child process, the same model, images, seeds and steps), the
baseline goal 2's "5x today's speed" is measured against; ``--filed-code ''`` skips it.

    python -m experiments.bench.dlg [--steps 300] [--image 0] [--images 20] [--cnn4 32 --cnn4-steps 30 --cnn4-batch 8] [--skip-single]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from attacks.gradleak import GradLeakConfig, leak, leak_batch
from attacks.images import packaged_images
from attacks.metrics import psnr
from attacks.victims import SigmoidLeNet
from experiments.bench.lib import record
from privfl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]  # the repository

#: CIFAR-10 test images foolbox packages (attacks.images.packaged_images)
PACKAGED = 20


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


#: DLG on cnn4, one image at a time with ``leak()``, written against the APIs the filed code already had
#: (run with that code first on PYTHONPATH); prints seconds per image and each PSNR as JSON
FILED_CHILD = """
import json, sys, time
import torch, torch.nn.functional as F
from attacks.gradleak import GradLeakConfig, leak
from attacks.metrics import psnr
from privfl.data import load_dataset
from privfl.models import build_model
n, steps = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
model = build_model("cnn4", in_channels=1, num_classes=10, image_size=28, rep_dim=512, mapping="ap")
ds = load_dataset("fashionmnist")
images, labels = ds.images[-n:].float().div(255), ds.labels[-n:]
names = [k for k, _ in model.named_parameters()]
targets = []
for i in range(n):
    grads = torch.autograd.grad(F.cross_entropy(model((images[i : i + 1] - 0.5) / 0.5), labels[i : i + 1]), list(model.parameters()))
    targets.append({k: g.detach() for k, g in zip(names, grads)})
cfg = GradLeakConfig.preset("dlg", steps=steps)
t0 = time.perf_counter()
results = [leak(model, targets[i], (1, 28, 28), 10, cfg, seed=i) for i in range(n)]
seconds = (time.perf_counter() - t0) / n
print(json.dumps({"seconds": seconds, "psnr": [psnr((r.images * 0.5 + 0.5).clamp(0, 1), images[i : i + 1]).item() for i, r in enumerate(results)]}))
"""


def filed_code(rev: str, n: int, steps: int) -> dict | str:
    """``FILED_CHILD`` run by the tree of commit ``rev`` (``git archive``) in a child process; or why not
    (no such commit in this clone, the child failed)."""
    with tempfile.TemporaryDirectory(prefix="privfl-filed-") as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=False, capture_output=True)
        if archive.returncode != 0:
            return f"git archive {rev}: {archive.stderr.decode(errors='replace').strip()}"
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, *filter(None, [os.environ.get("PYTHONPATH")])])}
        done = subprocess.run([sys.executable, "-c", FILED_CHILD, str(n), str(steps)], cwd=tmp, env=env, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        return f"the filed code's run failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.dlg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--image", type=int, default=0)
    p.add_argument(
        "--images",
        type=int,
        default=20,
        help="images of the second part (0: skip); 8 until 2026-11-27, when one image more or less moved the mean PSNR by 6 dB",
    )
    p.add_argument("--cnn4", type=int, default=32, help="images for the cnn4 part (0: skip); all at once is the attack's --batch default when 32")
    p.add_argument("--cnn4-steps", type=int, default=30)
    p.add_argument("--cnn4-batch", type=int, default=8, help="targets together in smaller groups (--batch's default until 2026-11-27)")
    p.add_argument("--skip-single", action="store_true", help="skip the first part (one image, privfl vs reference)")
    p.add_argument("--filed-code", default="645289a", help="commit whose leak() is the cnn4 part's 'as filed' row ('': skip it)")
    args = p.parse_args()
    if args.images > PACKAGED:
        p.error(f"--images {args.images}: the packaged CIFAR-10 test images are {PACKAGED}")
    model = SigmoidLeNet(3, 100, 32).init_uniform(torch.Generator().manual_seed(0))
    if not args.skip_single:
        single_image(model, args.image, args.steps)
    if args.images > 0:
        many_images(model, args.images, args.steps)
    if args.cnn4 > 0:
        cnn4_images(args.cnn4, args.cnn4_steps, args.cnn4_batch, args.filed_code)
    return 0


def single_image(model, image: int, steps: int) -> None:
    """privfl's leak() vs the reference loop on one image, with the same initial dummies."""
    images, labels = packaged_images("cifar10", image + 1)
    img, label = images[image : image + 1], labels[image : image + 1]
    x = (img - 0.5) / 0.5
    params = list(model.named_parameters())
    grads = torch.autograd.grad(F.cross_entropy(model(x), label), [p for _, p in params])
    target = {n: g.detach() for (n, _), g in zip(params, grads)}
    cfg = GradLeakConfig.preset("dlg", steps=steps)
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
    ref = reference_dlg(model, [target[n] for n, _ in params], x0, y0, steps)
    t_ref = time.perf_counter() - t0
    p_ours = psnr((ours.images * 0.5 + 0.5).clamp(0, 1), img).item()
    p_ref = psnr((ref * 0.5 + 0.5).clamp(0, 1), img).item()
    noisy = {k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in target.items()}
    p_noisy = psnr((leak(model, noisy, (3, 32, 32), 100, cfg, seed=0).images * 0.5 + 0.5).clamp(0, 1), img).item()
    print(f"DLG, sigmoid LeNet, CIFAR-10 test image {image} (label {label.item()}), {steps} L-BFGS steps")
    print(f"privfl:    {t_ours:7.1f} s   PSNR {p_ours:6.2f} dB")
    print(f"reference: {t_ref:7.1f} s   PSNR {p_ref:6.2f} dB")
    print(f"time ratio privfl / reference: {t_ours / t_ref:.3f}")
    quality = f"PSNR {p_ref:.2f} vs {p_ours:.2f} dB"
    record("dlg", f"seconds per image, {steps} L-BFGS steps", "reference loop", t_ref, "privfl", t_ours, "s", quality)
    print(f"with N(0, 0.01^2) noise on the gradient: PSNR {p_noisy:.2f} dB")
    print(f"checks: clean > 30 dB: {p_ours > 30}; noisy < 15 dB: {p_noisy < 15}")


def lenet_gradients(model, images: torch.Tensor, labels: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """One gradient per image (DLG's setting: batch 1), as name -> tensor."""
    out = []
    for i in range(len(images)):
        x = (images[i : i + 1] - 0.5) / 0.5
        params = list(model.named_parameters())
        grads = torch.autograd.grad(F.cross_entropy(model(x), labels[i : i + 1]), [p for _, p in params])
        out.append({n: g.detach() for (n, _), g in zip(params, grads)})
    return out


def summary(psnrs: list[float]) -> str:
    good = sum(v > 30 for v in psnrs)
    return f"mean {sum(psnrs) / len(psnrs):6.2f} dB, {good}/{len(psnrs)} above 30 dB"


def many_images(model, n: int, steps: int) -> None:
    """Reference loop one image at a time vs privfl on the same n images and initial dummies: batched
    (:func:`leak_batch`), one at a time (:func:`leak`) and one at a time with the closure compiled (its
    compiling timed apart, on two warm-up images, as an audit of many targets pays it once; skipped, and
    said so, where ``compile=True`` cannot run: a CPU without a C++ compiler)."""
    images, labels = packaged_images("cifar10", n)
    targets = lenet_gradients(model, images, labels)
    names = [name for name, _ in model.named_parameters()]
    cfg = GradLeakConfig.preset("dlg", steps=steps)
    compiled = GradLeakConfig.preset("dlg", steps=steps, compile=True)
    leak_batch(model, targets[:2], (3, 32, 32), 100, GradLeakConfig.preset("dlg", steps=2), seeds=[0, 1])  # warm-up
    unavailable = ""  # why compile=True cannot run here (leak()'s own refusal), if it cannot
    t0 = time.perf_counter()
    try:
        for i in range(2):  # the compiling (both label forms are the same graph here: DLG's joint label)
            leak(model, targets[i], (3, 32, 32), 100, GradLeakConfig.preset("dlg", steps=2, compile=True), seed=i)
    except ConfigError as exc:
        unavailable = str(exc)
    can_compile = not unavailable
    t_compile = time.perf_counter() - t0

    def timed(run) -> tuple[list, float, float]:
        out, wall, cpu = [], 0.0, 0.0
        for i in range(n):
            t0, c0 = time.perf_counter(), time.process_time()
            out.append(run(i))
            wall, cpu = wall + time.perf_counter() - t0, cpu + time.process_time() - c0
        return out, wall, cpu

    t0, c0 = time.perf_counter(), time.process_time()
    batched = [r.images for r in leak_batch(model, targets, (3, 32, 32), 100, cfg, seeds=list(range(n)))]
    t_batch, c_batch = time.perf_counter() - t0, time.process_time() - c0
    one, t_one, c_one = timed(lambda i: leak(model, targets[i], (3, 32, 32), 100, cfg, seed=i).images)
    if can_compile:
        comp, t_comp, c_comp = timed(lambda i: leak(model, targets[i], (3, 32, 32), 100, compiled, seed=i).images)
    for prm in model.parameters():
        prm.requires_grad_(True)

    def reference(i: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(i * 1000)  # leak()'s draws for seed i, restart 0
        x0, y0 = torch.randn((1, 3, 32, 32), generator=gen), torch.randn((1, 100), generator=gen)
        return reference_dlg(model, [targets[i][k] for k in names], x0, y0, steps)

    refs, t_ref, c_ref = timed(reference)

    def scores(rebuilt: list[torch.Tensor]) -> list[float]:
        return [psnr((r * 0.5 + 0.5).clamp(0, 1), images[i : i + 1]).item() for i, r in enumerate(rebuilt)]

    p_ref, p_batch, p_one = scores(refs), scores(batched), scores(one)
    p_comp = scores(comp) if can_compile else [float("nan")] * n
    print(f"\nDLG on {n} CIFAR-10 test images, sigmoid LeNet, {steps} L-BFGS steps each")
    print("image  reference dB  privfl batched dB  privfl one at a time dB  compiled dB")
    for i in range(n):
        print(f"{i:5d}  {p_ref[i]:12.2f}  {p_batch[i]:17.2f}  {p_one[i]:23.2f}  {p_comp[i]:11.2f}")
    print(f"reference, one at a time:  {t_ref / n:7.2f} s per image ({c_ref / n:.2f} s CPU), {summary(p_ref)}")
    print(f"privfl, {n} together:       {t_batch / n:7.2f} s per image ({c_batch / n:.2f} s CPU), {summary(p_batch)}")
    print(f"privfl, one at a time:     {t_one / n:7.2f} s per image ({c_one / n:.2f} s CPU), {summary(p_one)}")
    measured = [("batched", t_batch, c_batch), ("one at a time", t_one, c_one)]
    head = f"seconds per image, {n} images, {steps} L-BFGS steps"
    rows = [("dlg-batch", f"privfl, {n} batched", t_batch, p_batch, ""), ("dlg-one", "privfl, one at a time", t_one, p_one, "")]
    if can_compile:
        print(
            f"privfl, compiled closure:  {t_comp / n:7.2f} s per image ({c_comp / n:.2f} s CPU), {summary(p_comp)}; compiling {t_compile:.1f} s once"
        )
        measured.append(("compiled", t_comp, c_comp))
        rows.append(
            ("dlg-compiled", "privfl, one at a time, compiled", t_comp, p_comp, f"; compiling {t_compile:.1f} s once per process, not included")
        )
    else:
        print(f"privfl, compiled closure:  unavailable ({unavailable})")
    for label, t, c in measured:
        print(f"time per image ratio privfl {label} / reference: {t / t_ref:.3f} wall, {c / c_ref:.3f} CPU (read CPU on a shared machine)")
    for bench, label, t, scored, more in rows:
        quality = f"reference {summary(p_ref)}; privfl {summary(scored)}{more}"
        record(bench, head, "reference loop, one at a time", t_ref / n, label, t / n, "s", quality)


def cnn4_images(n: int, steps: int, batch: int, filed: str = "") -> None:
    """DLG on the 582,026-parameter cnn4 (Fashion-MNIST, batch 1), four ways on the same n images and
    initial dummies: one at a time with every gradient materialised (the attack as it was when the speed
    issue was filed), ``batch`` at a time and all n at once with the wide linear layer factored
    (:mod:`attacks.gradmatch`), and all n at once materialised (what factoring alone buys)."""
    from privfl.data import load_dataset
    from privfl.models import build_model

    torch.manual_seed(0)
    model = build_model("cnn4", in_channels=1, num_classes=10, image_size=28, rep_dim=512, mapping="ap")
    ds = load_dataset("fashionmnist")
    images, labels = ds.images[-n:].float().div(255), ds.labels[-n:]  # the last images: Fashion-MNIST's test split
    targets = []
    for i in range(n):
        x = (images[i : i + 1] - 0.5) / 0.5
        params = list(model.named_parameters())
        grads = torch.autograd.grad(F.cross_entropy(model(x), labels[i : i + 1]), [p for _, p in params])
        targets.append({k: g.detach() for (k, _), g in zip(params, grads)})
    count = sum(p.numel() for p in model.parameters())
    dense = GradLeakConfig.preset("dlg", steps=steps, factor_linear=False)
    factored = GradLeakConfig.preset("dlg", steps=steps)
    seeds = list(range(n))

    def together(cfg: GradLeakConfig, size: int) -> list:
        return [r for k in range(0, n, size) for r in leak_batch(model, targets[k : k + size], (1, 28, 28), 10, cfg, seeds=seeds[k : k + size])]

    runs = {
        "one at a time, materialised": lambda: [leak(model, targets[i], (1, 28, 28), 10, dense, seed=i) for i in range(n)],
        f"{batch} at a time, factored": lambda: together(factored, batch),
        f"{n} at once, factored": lambda: together(factored, n),
        f"{n} at once, materialised": lambda: together(dense, n),
    }
    leak_batch(model, targets[:2], (1, 28, 28), 10, GradLeakConfig.preset("dlg", steps=1), seeds=[0, 1])  # warm-up
    seconds, psnrs = {}, {}
    print(f"\nDLG on cnn4 ({count:,} parameters), {n} Fashion-MNIST test images, {steps} L-BFGS steps each")
    print(f"{'configuration':32s} {'s/image':>8s} {'CPU s':>7s}  quality")
    for label, fn in runs.items():
        t0, c0 = time.perf_counter(), time.process_time()
        results = fn()
        seconds[label] = (time.perf_counter() - t0) / n
        cpu = (time.process_time() - c0) / n
        psnrs[label] = [psnr((r.images * 0.5 + 0.5).clamp(0, 1), images[i : i + 1]).item() for i, r in enumerate(results)]
        print(f"{label:32s} {seconds[label]:8.2f} {cpu:7.2f}  {summary(psnrs[label])}", flush=True)
    base, grouped, best, plain = runs
    print("image  " + "  ".join(f"{label[:18]:>18s}" for label in runs))
    for i in range(n):
        print(f"{i:5d}  " + "  ".join(f"{psnrs[label][i]:18.2f}" for label in runs))
    for label in (grouped, best):
        print(f"time per image ratio {label} / {base}: {seconds[label] / seconds[base]:.3f}")
    print(f"time per image ratio {best} / {plain}: {seconds[best] / seconds[plain]:.3f} (factoring alone)")
    for label in (grouped, best):
        record(
            "dlg-cnn4",
            f"seconds per image, cnn4 {count} params, {steps} L-BFGS steps",
            base,
            seconds[base],
            label,
            seconds[label],
            "s",
            f"{base} {summary(psnrs[base])}; {label} {summary(psnrs[label])}",
        )
    record(
        "dlg-cnn4-factor",
        f"seconds per image, cnn4, {n} at once",
        plain,
        seconds[plain],
        best,
        seconds[best],
        "s",
        f"materialised {summary(psnrs[plain])}; factored {summary(psnrs[best])}",
    )
    if filed:
        as_filed = f"filed code {filed}, 1 at a time"
        child = filed_code(filed, n, steps)
        if isinstance(child, str):
            print(f"{as_filed}: unavailable ({child})")
            return
        seconds[as_filed], psnrs[as_filed] = child["seconds"], child["psnr"]
        print(f"{as_filed:32s} {seconds[as_filed]:8.2f} {'-':>7s}  {summary(psnrs[as_filed])}")
        print(f"time per image ratio {best} / {as_filed}: {seconds[best] / seconds[as_filed]:.3f} ({seconds[as_filed] / seconds[best]:.1f}x faster)")
        record(
            "dlg-cnn4-filed",
            f"seconds per image, cnn4, {steps} L-BFGS steps",
            as_filed,
            seconds[as_filed],
            best,
            seconds[best],
            "s",
            f"as filed {summary(psnrs[as_filed])}; {best} {summary(psnrs[best])}",
        )


if __name__ == "__main__":
    sys.exit(main())
