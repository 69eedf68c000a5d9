"""``python -m privfl.attack``: attack a run's captured artifacts and score what comes back.

    python -m privfl.attack invert --artifact ent_rep             # latest run, last round, every client
    python -m privfl.attack invert --artifact proto --clients 0,3 --steps 1000
    python -m privfl.attack invert --compare rep,proto,ent_rep    # FedRE Figure 4 on one client
    python -m privfl.attack list                                  # what a run offers to attack

Outputs go to ``RUN/attacks/<name>/``: ``gallery.png`` (ground truth above reconstructions),
``metrics.json``/``metrics.csv``/``summary.csv``, ``reconstructions.safetensors`` and ``index.html``.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from privfl.cli import run_cli
from privfl.errors import CaptureError, ConfigError, UnknownNameError
from privfl.runs import swap_in_folder


def _dip_config(args):
    from attacks.dip import DIPConfig

    cfg = DIPConfig(steps=args.steps, lr=args.lr, tv_weight=args.tv_weight, reg_noise_std=args.reg_noise_std,
                    input_depth=args.input_depth, double=args.double, cudnn=not args.no_cudnn)
    if cfg.steps < 0:
        raise ConfigError("--steps must be >= 0")
    return cfg


def build_parser() -> argparse.ArgumentParser:
    from attacks.dip import DIPConfig

    d = DIPConfig()
    parser = argparse.ArgumentParser(prog="python -m privfl.attack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--run", help="run directory (default: the latest)")
    common.add_argument("--out-dir", default="runs", help="where runs live (default: runs)")
    sub.add_parser("list", parents=[common], help="captured kinds, rounds and the attacks that apply")
    inv = sub.add_parser("invert", parents=[common], help="deep-image-prior inversion of representation-like artifacts",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    what = inv.add_mutually_exclusive_group(required=True)
    what.add_argument("--artifact", help="kind to invert: rep, proto, ent_rep, global_proto (what the run captured)")
    what.add_argument("--compare", help="comma list of rep,proto,ent_rep: Figure-4 comparison on one client")
    inv.add_argument("--round", type=int, help="round (default: the last one with the artifact / extractor)")
    inv.add_argument("--clients", help="comma list of client ids (0,3 or client0,client3); default: all")
    inv.add_argument("--max-targets", type=int, default=4, help="rows inverted per message (rep/proto)")
    inv.add_argument("--samples", type=int, default=4, help="--compare: images of the client to compare on")
    inv.add_argument("--steps", type=int, default=d.steps, help="DIP optimisation steps (DIP feature inversion: 3100)")
    inv.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate")
    inv.add_argument("--input-depth", type=int, default=d.input_depth, help="channels of the noise input z")
    inv.add_argument("--tv-weight", type=float, default=d.tv_weight, help="total-variation prior weight")
    inv.add_argument("--reg-noise-std", type=float, default=d.reg_noise_std, help="DIP input noise regularisation")
    inv.add_argument("--double", action="store_true", help="optimise in float64")
    inv.add_argument("--no-cudnn", action="store_true", help="disable cuDNN (determinism on GPU)")
    inv.add_argument("--batch", type=int, default=16, help="targets optimised together (one grouped network)")
    inv.add_argument("--seed", type=int, default=0, help="fixes every generator's initialisation and noise")
    inv.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    inv.add_argument("--data-root", help="where the run's dataset lives, if not where training found it (scoring only)")
    inv.add_argument("--name", help="output folder name under RUN/attacks/ (default from the artifact and round)")
    inv.add_argument("--no-progress", action="store_true")
    for variant, text in (("dlg", "Deep Leakage from Gradients (L-BFGS, joint data+label)"),
                          ("idlg", "improved DLG (label from the last layer, then data)"),
                          ("ig", "Inverting Gradients (cosine + TV, signed Adam, boxed, restarts)")):
        g = sub.add_parser(variant, parents=[common], help=text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        g.add_argument("--artifact", required=True,
                       help="a parameter-like kind the run's method sends: grad (FedSGD), update (FedNova), model (FedAvg), "
                            "small_model (FedMRL), layer (FedFree), learngene (DRDFL)")
        g.add_argument("--round", type=int, help="round (default: the last one with the artifact)")
        g.add_argument("--clients", help="comma list of client ids; default: every sender of that round")
        g.add_argument("--steps", type=int, help="optimisation steps (default: DLG/iDLG 300 L-BFGS steps, IG 4800)")
        g.add_argument("--restarts", type=int, default=1)
        g.add_argument("--lr", type=float, help="optimiser learning rate (default: DLG 1.0, IG 0.1)")
        g.add_argument("--tv-weight", type=float, help="total variation weight (default: IG 0.1, DLG 0)")
        g.add_argument("--batch-size", type=int, default=8, help="largest batch reconstructed from one message")
        g.add_argument("--batch-label-rule", choices=["last-layer", "joint"],
                       help="idlg/ig with --batch-size > 1: labels read off the last layer first (default) or optimised jointly")
        g.add_argument("--local-steps", default="1",
                       help="unroll this many local SGD steps (at the run's lr) to match a multi-step update or model "
                            "(Inverting Gradients' FedAvg variant); 'auto' = the local steps the run's config implies")
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--device", default="auto")
        g.add_argument("--data-root", help="where the run's dataset lives (scoring only)")
        g.add_argument("--name", help="output folder name under RUN/attacks/")
        g.add_argument("--no-progress", action="store_true")
    return parser


def parse_clients(text: str | None) -> list[str] | None:
    if not text:
        return None
    out = []
    for part in text.split(","):
        part = part.strip()
        name = part if part.startswith("client") else f"client{part}"
        if not name.removeprefix("client").isdigit():
            raise ConfigError(f"--clients takes ids like 0,3 or client0,client3; got {part!r}")
        out.append(name)
    return out


def representation_kinds(view) -> list[str]:
    from attacks.invert import RepresentationInversion

    return [k for k in view.kinds() if k in RepresentationInversion.consumes]


def main(argv: list[str] | None = None) -> int:
    from attacks.view import AttackerView
    from privfl.runs import resolve_run

    args = build_parser().parse_args(argv)
    run_dir = resolve_run(args.run, args.out_dir)
    view = AttackerView(run_dir)
    if args.command == "list":
        from attacks import ATTACKS

        print(f"run {run_dir}: method {view.info['method']}, knowledge: {', '.join(view.available().granted()) or 'none'}")
        for kind in view.kinds():
            attacks = [n for n in ATTACKS.names() if kind in ATTACKS.get(n).consumes]
            rounds = view.rounds(kind)
            print(f"  {kind:<12} rounds {rounds[0]}..{rounds[-1]}  attacks: {', '.join(attacks) or '-'}")
        ext = view.extractor_records()
        print(f"  extractors stored for rounds: {sorted({r['round'] for r in ext}) or 'none'}")
        return 0
    if args.command in ("dlg", "idlg", "ig"):
        return run_gradleak(args, view)
    if args.compare:
        return run_compare(args, view)
    return run_invert(args, view)


def _progress_bar(args, total: int, desc: str):
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit="step", disable=args.no_progress, dynamic_ncols=True)

    def hook(label: str, step: int, steps: int, loss: float) -> None:
        bar.update(1)
        if step % 25 == 0 or step == steps - 1:
            bar.set_postfix_str(f"{label} feature-mse {loss:.3g}")

    return bar, hook


def _attack(args, view, targets):
    from attacks.invert import RepresentationInversion
    from privfl.engine import resolve_device

    attack = RepresentationInversion(_dip_config(args), seed=args.seed, device=resolve_device(args.device), batch=args.batch)
    attack.check(view, targets)
    groups: dict[tuple, int] = {}
    for t in targets:
        groups[(t.client, t.round)] = groups.get((t.client, t.round), 0) + 1
    batches = sum(-(-n // args.batch) for n in groups.values())
    bar, hook = _progress_bar(args, batches * args.steps, f"invert {len(targets)} target(s)")
    t0 = time.perf_counter()
    recons = attack.reconstruct(targets, view, hook)
    bar.close()
    return attack, recons, time.perf_counter() - t0


def _protocol(args, view, attack, extra: dict) -> dict:
    """What an inversion result records: the shared protocol plus the DIP settings actually used."""
    return {
        **_protocol_base(args, view, attack), "dip": attack.cfg.as_dict(),
        "dip_levels_used": attack.cfg.depth_for(2 ** math.ceil(math.log2(view.dataset["image_size"]))),
        "batch": args.batch, **extra,
        "psnr_convention": "per image, then averaged; MSE on [0,1] and on 0-255 (FedRE papers' scale) averaged separately",
    }


def _lpips_note() -> str:
    from attacks.metrics import lpips_status

    ok, why = lpips_status()
    return "computed" if ok else f"unavailable: {why}"


def run_invert(args, view) -> int:
    from attacks.groundtruth import GroundTruth
    from attacks.metrics import summarize
    from attacks.report import save_gallery, write_html, write_metrics
    from attacks.scoring import headline, score
    from attacks.targets import TARGET_BUILDERS

    kind = args.artifact
    valid = representation_kinds(view)
    if kind not in valid:
        raise UnknownNameError("artifact kind for inversion in this run", kind, valid)
    rounds = view.rounds(kind)
    rnd = rounds[-1] if args.round is None else args.round
    if rnd not in rounds:
        raise ConfigError(f"round {rnd} has no {kind} messages; rounds with them: {rounds[0]}..{rounds[-1]}")
    clients = parse_clients(args.clients)
    records = view.messages(kind, rnd, clients)
    if not records:
        raise ConfigError(f"no {kind} messages of clients {', '.join(clients or [])} in round {rnd}")
    names = view.dataset["class_names"]
    targets = [t for rec in records for t in TARGET_BUILDERS.get(kind)(rec, view.load(rec), names, args.max_targets)]
    attack, recons, seconds = _attack(args, view, targets)

    truth = GroundTruth(view.run_dir, args.data_root)  # opened only now, for scoring
    rows, truth_images, captions = [], [], []
    for r in recons:
        cand = truth.candidates(r.target)
        s = score(r.image, cand)
        h = headline(s)
        truth_images.append(cand.images[cand.exact if h == "exact" else s["best_index"]])
        captions.append(f"{r.target.client} {r.target.label[:18]}")
        rows.append({"target": r.target.key, "kind": r.target.kind, "client": r.target.client, "round": r.target.round,
                     "label": r.target.label, "counterfactual": r.target.counterfactual, "ground_truth": cand.description,
                     "feature_mse": r.feature_loss, "seconds": r.seconds, **s, "headline": h})
    summary = {"targets": len(rows), "seconds_total": round(seconds, 2), "seconds_per_target": round(seconds / len(rows), 3)}
    for prefix in ("exact", "best", "mean"):
        per = {m: [row[f"{prefix}_{m}"] for row in rows if f"{prefix}_{m}" in row] for m in ("psnr255", "mse255", "psnr", "mse", "ssim", "lpips")}
        summary.update({f"{prefix}_{k}": v for k, v in summarize({m: v for m, v in per.items() if v}).items()})
    name = args.name or f"invert-{kind}-r{rnd}"
    final = view.run_dir / "attacks" / name
    final.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{name}."))
    label = f"{kind} r{rnd}"
    psnr_labels = [f"PSNR {row[row['headline'] + '_psnr255']:.2f} dB" for row in rows]
    save_gallery(folder / "gallery.png", torch.stack(truth_images), [(label, torch.stack([r.image for r in recons]))],
                 captions=captions, title=f"DIP inversion of {kind} ({view.info['method']}, round {rnd})",
                 per_image_labels={label: psnr_labels})
    save_file({r.target.key.replace("/", "."): r.image.contiguous() for r in recons}, str(folder / "reconstructions.safetensors"))
    protocol = _protocol(args, view, attack, {"artifact": kind, "round": rnd, "clients": sorted({t.client for t in targets}),
                                              "ground_truth_rule": "rep: own image; proto/ent_rep/global_proto: best match and (weighted) mean over the aggregate's images"})
    write_metrics(folder, rows, summary, protocol)
    write_html(folder, f"Inversion of {kind}: {view.info['method']} round {rnd}",
               [{"heading": label, "protocol": protocol, "images": "gallery.png", "summary": summary}])
    final = swap_in_folder(folder, final)
    _print_summary(f"{kind} r{rnd}", summary, final)
    return 0


def _print_summary(title: str, summary: dict, folder: Path) -> None:
    keys = [k for k in ("exact_psnr255", "exact_mse255", "best_psnr255", "best_mse255", "best_ssim", "mean_psnr255", "mean_mse255") if k in summary]
    print(f"{title}: {summary['targets']} target(s), {summary['seconds_per_target']:.2f} s per target")
    for k in keys:
        print(f"  {k:<16} {summary[k]:10.3f}")
    print(f"  results: {folder}/index.html")


def run_compare(args, view) -> int:
    from attacks import compare
    from attacks.groundtruth import GroundTruth
    from attacks.metrics import score_images, summarize
    from attacks.report import save_gallery, write_html, write_metrics
    from attacks.scoring import score

    kinds = [k.strip() for k in args.compare.split(",") if k.strip()]
    ext = view.extractor_records()
    if not ext:
        raise CaptureError(f"run {view.run_dir} stores no client extractors: the comparison needs them")
    clients = parse_clients(args.clients)
    client = clients[0] if clients else sorted({r["client"] for r in ext}, key=lambda c: int(c[6:]))[0]
    rounds = sorted({r["round"] for r in ext if r["client"] == client})
    if not rounds:
        raise CaptureError(f"the run stores no extractor of {client}")
    rnd = rounds[-1] if args.round is None else args.round
    truth = GroundTruth(view.run_dir, args.data_root)
    p = compare.plan(view, truth, kinds, client, rnd, args.samples, args.seed)
    unique = list({t.key: t for ts in p.targets.values() for t in ts}.values())
    attack, recons, seconds = _attack(args, view, unique)
    by_key = {r.target.key: r for r in recons}
    sample_images = truth.images(p.samples)
    rows, gallery_rows, labels, summary = [], [], {}, {"targets": len(unique), "seconds_total": round(seconds, 2),
                                                        "seconds_per_target": round(seconds / len(unique), 3)}
    for kind in kinds:
        images = torch.stack([by_key[t.key].image for t in p.targets[kind]])
        per = score_images(images, sample_images)  # rule (a): against the same sample
        cf = p.targets[kind][0].counterfactual
        row_label = f"{kind}{' (counterfactual)' if cf else ''}"
        gallery_rows.append((row_label, images))
        labels[row_label] = [f"PSNR {v:.2f} dB" for v in per["psnr255"]]
        best = {}
        for t in {t.key: t for t in p.targets[kind]}.values():
            best[t.key] = score(by_key[t.key].image, p.candidates[t.key])
        for i, t in enumerate(p.targets[kind]):
            rows.append({"kind": kind, "counterfactual": cf, "client": client, "round": rnd, "sample": int(p.samples[i]),
                         "class": truth.dataset.class_names[p.classes[i]], "target": t.key,
                         **{f"sample_{m}": v[i] for m, v in per.items()},
                         **{k: v for k, v in best[t.key].items() if k.startswith("best_")}})
        s = summarize(per)
        summary.update({f"{kind}_sample_{k}": v for k, v in s.items()})
        summary[f"{kind}_counterfactual"] = cf
    order = [summary[f"{k}_sample_psnr255"] for k in kinds]
    summary["ordering"] = " > ".join(f"{k} ({v:.2f} dB)" for k, v in sorted(zip(kinds, order), key=lambda kv: -kv[1]))
    if kinds == ["rep", "proto", "ent_rep"]:
        summary["paper_ordering_holds"] = bool(order[0] > order[1] > order[2])
    name = args.name or f"compare-{'-'.join(kinds)}-{client}-r{rnd}"
    final = view.run_dir / "attacks" / name
    final.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{name}."))
    save_gallery(folder / "gallery.png", sample_images, gallery_rows,
                 captions=[truth.dataset.class_names[c] for c in p.classes],
                 title=f"{view.info['method']}: {client}, round {rnd}: what each artifact reveals",
                 per_image_labels=labels)
    save_file({f"{k}.{i}": by_key[t.key].image.contiguous() for k in kinds for i, t in enumerate(p.targets[k])},
              str(folder / "reconstructions.safetensors"))
    protocol = _protocol(args, view, attack, {"compare": kinds, "client": client, "round": rnd, "samples": p.samples.tolist(),
                                              "counterfactual": {k: p.targets[k][0].counterfactual for k in kinds},
                                              "ground_truth_rule": "(a) each reconstruction against the same sample image; (b) best match in the artifact's aggregate"})
    write_metrics(folder, rows, summary, protocol)
    write_html(folder, f"Representation vs prototype vs entangled representation ({view.info['method']})",
               [{"heading": f"{client}, round {rnd}", "protocol": protocol, "images": "gallery.png", "summary": summary,
                 "text": "Rows marked counterfactual were not transmitted by this method; they were computed from the client's stored extractor and data."}])
    final = swap_in_folder(folder, final)
    print(f"compare {', '.join(kinds)} on {client} r{rnd}: {summary['seconds_per_target']:.2f} s per target")
    for k in kinds:
        print(f"  {k:<8}{' (counterfactual)' if summary[k + '_counterfactual'] else '':<17} PSNR {summary[k + '_sample_psnr255']:6.2f} dB"
              f"  MSE(0-255) {summary[k + '_sample_mse255']:9.2f}  SSIM {summary[k + '_sample_ssim']:.3f}")
    print(f"  ordering: {summary['ordering']}")
    print(f"  results: {final}/index.html")
    return 0


def run_gradleak(args, view) -> int:
    from attacks.gradleak import GradientLeakage, GradLeakConfig
    from attacks.groundtruth import GroundTruth
    from attacks.metrics import best_match, hungarian_match, score_images, summarize
    from attacks.report import save_gallery, write_html, write_metrics
    from privfl.engine import resolve_device

    kind = args.artifact
    sent_by_clients = ("up", "peer")
    param_kinds = view.parameter_kinds()
    valid = sorted({r for r in view.kinds() if r in param_kinds and any(m["direction"] in sent_by_clients for m in view.messages(r))})
    if kind not in valid:
        raise UnknownNameError(f"parameter-like artifact kind for {args.command} in this run", kind, valid)
    ups = [r for r in view.messages(kind, None, parse_clients(args.clients)) if r["direction"] in sent_by_clients]
    rounds = sorted({r["round"] for r in ups})
    if not rounds:
        raise ConfigError(f"no {kind} uploads from clients {args.clients}")
    rnd = rounds[-1] if args.round is None else args.round
    records = [r for r in ups if r["round"] == rnd]
    if not records:
        raise ConfigError(f"round {rnd} has no {kind} uploads; rounds with them: {rounds[0]}..{rounds[-1]}")
    local_steps = _local_steps(args.local_steps, view, records)
    overrides = {k: v for k, v in {"steps": args.steps, "lr": args.lr, "tv_weight": args.tv_weight, "restarts": args.restarts,
                                   "local_steps": local_steps, "local_lr": float(view.config["lr"]),
                                   "batch_label_rule": args.batch_label_rule}.items() if v is not None}
    cfg = GradLeakConfig.preset(args.command, **overrides)
    attack = GradientLeakage(args.command, cfg, seed=args.seed, device=resolve_device(args.device), max_batch=args.batch_size)
    attack.check(view)
    for rec in records:
        view.previous_state(rec)  # fail before optimising if a round has no previous state
    bar, hook = _progress_bar(args, len(records) * cfg.steps, f"{args.command} on {len(records)} message(s)")
    leaks = []
    for rec in records:
        leaks.append(attack.run(view, rec, progress=lambda step, loss, rec=rec: hook(rec["sender"], step, cfg.steps, loss)))
    bar.close()
    truth = GroundTruth(view.run_dir, args.data_root)  # opened only now, for scoring
    rows, truth_row, final_row, snap_rows, labels = [], [], [], {}, []
    for lk in leaks:
        t = truth.message_truth(lk.record["seq"])
        cand = truth.images(t["indices"])
        exact = len(t["indices"]) == lk.batch_size
        pairs = hungarian_match(lk.images, cand) if exact else [(i, best_match(lk.images[i], cand)[0]) for i in range(len(lk.images))]
        for i, j in pairs:
            s = {k: v[0] for k, v in score_images(lk.images[i : i + 1], cand[j : j + 1]).items()}
            rows.append({"client": lk.record["sender"], "round": rnd, "message_seq": lk.record["seq"], "image": i, "matched_truth": int(t["indices"][j]),
                         "matching": "hungarian over the exact batch" if exact else "best match in the client's data",
                         "label_recovered": int(lk.labels[i]), "label_source": lk.label_source, "seconds": lk.seconds / len(pairs), **s})
            truth_row.append(cand[j])
            final_row.append(lk.images[i])
            labels.append(f"PSNR {s['psnr']:.1f} dB")
            for step, x in lk.snapshots[:-1]:
                snap_rows.setdefault(step, []).append(x[i])
    summary = {"images": len(rows), "messages": len(leaks), "seconds_per_message": round(sum(lk.seconds for lk in leaks) / len(leaks), 2),
               **summarize({m: [r[m] for r in rows] for m in ("psnr", "mse", "psnr255", "mse255", "ssim") })}
    name = args.name or f"{args.command}-{kind}-r{rnd}"
    final = view.run_dir / "attacks" / name
    final.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{name}."))
    steps = sorted(snap_rows)
    shown = [steps[i] for i in sorted({0, len(steps) // 2, len(steps) - 1})] if steps else []
    gallery_rows = [(f"step {st}", torch.stack(snap_rows[st])) for st in shown] + [(f"{args.command} final", torch.stack(final_row))]
    save_gallery(folder / "gallery.png", torch.stack(truth_row), gallery_rows,
                 captions=[f"{r['client']}" for r in rows], title=f"{args.command} on {kind} ({view.info['method']}, round {rnd})",
                 per_image_labels={f"{args.command} final": labels})
    protocol = {**_protocol_base(args, view, attack), "artifact": kind, "round": rnd, "config": cfg.as_dict(),
                "target": leaks[0].target_note, "batch_size": leaks[0].batch_size}
    write_metrics(folder, rows, summary, protocol)
    write_html(folder, f"{args.command} on {kind}: {view.info['method']} round {rnd}",
               [{"heading": f"{kind} r{rnd}", "protocol": protocol, "images": "gallery.png", "summary": summary}])
    final = swap_in_folder(folder, final)
    print(f"{args.command} on {kind} r{rnd}: {len(rows)} image(s) from {len(leaks)} message(s), {summary['seconds_per_message']:.1f} s per message")
    print(f"  PSNR {summary['psnr']:.2f} dB (0-255 MSE {summary['mse255']:.1f}), SSIM {summary['ssim']:.3f}")
    print(f"  results: {final}/index.html")
    return 0


def _local_steps(text: str, view, records: list[dict]) -> int:
    """``--local-steps``: an integer >= 1, or ``auto`` for local_epochs * ceil(samples / batch) of the
    first attacked message (what the server that set the hyperparameters would assume)."""
    if text == "auto":
        cfg, meta = view.config, records[0].get("meta", {})
        n = int(meta.get("num_samples", cfg["batch_size"]))
        return max(1, cfg["local_epochs"] * -(-n // cfg["batch_size"]))
    try:
        steps = int(text)
    except ValueError:
        steps = 0
    if steps < 1:
        raise ConfigError(f"--local-steps must be a positive integer or 'auto', got {text!r}")
    return steps


def _protocol_base(args, view, attack) -> dict:
    from attacks.threat import THREAT_MODELS

    return {"attack": attack.name, "paper": attack.paper, "run": str(view.run_dir), "method": view.info["method"],
            "threat_model": attack.threat_model, "threat_model_text": THREAT_MODELS[attack.threat_model][1],
            "knowledge_used": attack.needs.granted(), "seed": args.seed, "device": str(attack.device),
            "psnr_convention": "per image, then averaged", "lpips": _lpips_note()}


if __name__ == "__main__":
    sys.exit(run_cli("privfl.attack", main))
