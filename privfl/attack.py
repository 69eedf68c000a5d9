"""``python -m privfl.attack``: attack a run's captured artifacts and score what comes back.

    python -m privfl.attack list                                  # the attacks that apply to a run, and why the others do not
    python -m privfl.attack invert --artifact ent_rep             # latest run, last round, every client
    python -m privfl.attack invert --artifact proto --clients 0,3 --steps 1000
    python -m privfl.attack invert --compare rep,proto,ent_rep    # FedRE Figure 4 on one client
    python -m privfl.attack dlg --artifact grad --clients 0       # gradient leakage (also idlg, ig)
    python -m privfl.attack run NAME --artifact KIND --option k=v --plugin mypkg   # any registered attack, yours included

This module only parses arguments, calls the attack runner (:func:`attacks.run_attack`,
:func:`attacks.compare_artifacts`) and prints. Outputs go to ``RUN/attacks/<name>/``: ``gallery.png``
(ground truth above reconstructions; ``labels.png``, a clients x classes grid, for label inference),
``metrics.json``/``metrics.csv``/``summary.csv``, ``reconstructions.safetensors`` and ``index.html``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from privfl.cli import PLUGIN_HELP, ArgumentParser, run_cli
from privfl.errors import ConfigError

GRADLEAK = {
    "dlg": "Deep Leakage from Gradients (L-BFGS, joint data+label)",
    "idlg": "improved DLG (label from the last layer, then data)",
    "ig": "Inverting Gradients (cosine + TV, signed Adam, boxed, restarts)",
}


def build_parser() -> argparse.ArgumentParser:
    from attacks.dip import PAPER_SETTINGS, DIPConfig
    from attacks.gradleak import GradLeakConfig

    d = DIPConfig()
    parser = ArgumentParser(
        prog="python -m privfl.attack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    # --run/--out-dir/--plugin go before or after the subcommand (after: the subparser's value wins)
    parser.add_argument("--run", default=None, help="run directory (default: the latest)")
    parser.add_argument("--out-dir", default="runs", help="where runs live (default: runs)")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE", help=PLUGIN_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    common = ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument("--run", default=argparse.SUPPRESS, help="run directory (default: the latest)")
    common.add_argument("--out-dir", default=argparse.SUPPRESS, help="where runs live (default: runs)")
    common.add_argument("--plugin", action="append", default=argparse.SUPPRESS, metavar="MODULE", help=PLUGIN_HELP)
    sub.add_parser("list", parents=[common], help="the attacks that apply to a run (and why the others do not)", allow_abbrev=False)
    inv = sub.add_parser(
        "invert",
        parents=[common],
        help="deep-image-prior inversion of representation-like artifacts",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    what = inv.add_mutually_exclusive_group(required=True)
    what.add_argument("--artifact", help="kind to invert: a representation-like kind the run captured (rep, proto, ent_rep, ...)")
    what.add_argument("--compare", help="comma list of rep,proto,ent_rep: Figure-4 comparison on one client")
    _add_selection(inv, max_targets=True)
    inv.add_argument("--samples", type=int, default=4, help="--compare: images of the client to compare on")
    inv.add_argument(
        "--learned",
        action="store_true",
        help="--compare: also invert every target with the learned decoder (invert-learned), its own rows and verdicts",
    )
    inv.add_argument(
        "--settings",
        choices=("privfl", "paper"),
        default="privfl",
        help=f"starting values of --steps/--lr/--upsample: privfl's ({d.steps}, {d.lr:g}, {d.upsample}; measured faster and "
        f"stronger, docs/attacks.md) or the DIP authors' feature inversion ({PAPER_SETTINGS['steps']}, "
        f"{PAPER_SETTINGS['lr']:g}, {PAPER_SETTINGS['upsample']}); an option given explicitly wins",
    )
    inv.add_argument("--steps", type=int, help="DIP optimisation steps (default: from --settings)")
    inv.add_argument("--lr", type=float, help="Adam learning rate (default: from --settings)")
    inv.add_argument("--input-depth", type=int, default=d.input_depth, help="channels of the noise input z")
    inv.add_argument("--tv-weight", type=float, default=d.tv_weight, help="total-variation prior weight")
    inv.add_argument("--reg-noise-std", type=float, default=d.reg_noise_std, help="DIP input noise regularisation")
    inv.add_argument("--downsample", choices=("avg", "stride"), default=d.downsample, help="how each generator level halves")
    inv.add_argument("--upsample", choices=("nearest", "bilinear"), help="how each generator level doubles (default: from --settings)")
    inv.add_argument("--padding", choices=("zeros", "reflect"), default=d.padding, help="padding of the generator's convolutions")
    canvas = "pow2" if d.pad_to_power_of_two else "native"
    inv.add_argument("--canvas", choices=("pow2", "native"), default=canvas, help="generate on a power-of-2 canvas or at the image size")
    inv.add_argument("--double", action="store_true", help="optimise in float64")
    inv.add_argument("--no-cudnn", action="store_true", help="disable cuDNN (determinism on GPU)")
    inv.add_argument("--batch", type=int, default=16, help="targets optimised together (one grouped network)")
    _add_run_options(inv)
    for variant, text in GRADLEAK.items():
        g = sub.add_parser(variant, parents=[common], help=text, formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
        g.add_argument(
            "--artifact",
            required=True,
            help="a parameter-like kind the run's clients send: grad (FedSGD), update (FedNova), model (FedAvg), "
            "small_model (FedMRL), layer (FedFree), learngene (DRDFL), ...",
        )
        _add_selection(g)
        g.add_argument("--steps", type=int, help="optimisation steps (default: DLG/iDLG 300 L-BFGS steps, IG 4800)")
        g.add_argument("--restarts", type=int, default=1)
        g.add_argument("--lr", type=float, help="optimiser learning rate (default: DLG 1.0, IG 0.1)")
        g.add_argument("--tv-weight", type=float, help="total variation weight (default: IG 0.1, DLG 0)")
        g.add_argument("--batch-size", type=int, default=8, help="largest batch reconstructed from one message")
        g.add_argument(
            "--batch",
            type=int,
            default=GradLeakConfig.batch,
            help="targets (messages) optimised together in one vectorised optimisation, each with its own L-BFGS or Adam state; 1 = one at a time",
        )
        g.add_argument(
            "--batch-label-rule",
            choices=["last-layer", "joint"],
            help="idlg/ig with --batch-size > 1: labels read off the last layer first (default) or optimised jointly",
        )
        g.add_argument(
            "--local-steps",
            default="1",
            help="unroll this many local SGD steps (at the message's lr) to match a multi-step update or model "
            "(Inverting Gradients' FedAvg variant); 'auto' = the local steps the message and the run's config imply",
        )
        _add_run_options(g)
    gen = sub.add_parser(
        "run",
        parents=[common],
        help="any registered attack by name (a plug-in's too), options as key=value",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    gen.add_argument("attack", help="registered attack name (python -m privfl.attack list shows them)")
    gen.add_argument("--artifact", help="kind to attack (default: the one kind of the run the attack takes)")
    _add_selection(gen, max_targets=True)
    gen.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="a field of the attack's Config (repeatable)")
    _add_run_options(gen)
    return parser


def _add_selection(p: argparse.ArgumentParser, *, max_targets: bool = False) -> None:
    """Which messages to attack: a round, clients, and (representation kinds) rows per message."""
    p.add_argument("--round", type=int, help="round (default: the last one with the artifact)")
    p.add_argument("--clients", help="comma list of client ids (0,3 or client0,client3); default: every sender of that round")
    if max_targets:
        p.add_argument("--max-targets", type=int, default=4, help="rows attacked per message (representation kinds)")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="fixes every initialisation and noise of the attack")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="bit-reproducible on a GPU: torch's deterministic kernels, no TF32 (docs/scale.md); the CPU repeats without it",
    )
    p.add_argument("--data-root", help="where the run's dataset lives, if not where training found it (scoring only)")
    p.add_argument("--name", help="output folder name under RUN/attacks/ (default from the attack, artifact and round)")
    p.add_argument("--no-progress", action="store_true")


def parse_clients(text: str | None) -> list[str] | None:
    from attacks.runner import client_names

    return client_names(text.split(",")) if text else None


def _positive(name: str, value: float | None, minimum: float = 1, *, strict: bool = False) -> None:
    """A one-line error unless ``value`` (None: not given) is >= ``minimum`` (``strict``: > ``minimum``)."""
    if value is not None and (value <= minimum if strict else value < minimum):
        raise ConfigError(f"{name} must be {'>' if strict else '>='} {minimum}, got {value}")


def invert_options(args: argparse.Namespace) -> dict[str, Any]:
    from attacks.dip import PAPER_SETTINGS, DIPConfig

    start: dict[str, Any] = dict(PAPER_SETTINGS) if args.settings == "paper" else {}
    d = DIPConfig(**start)
    for name in ("steps", "lr", "upsample"):  # an option given explicitly wins over --settings
        if getattr(args, name) is None:
            setattr(args, name, getattr(d, name))
    _positive("--steps", args.steps)
    _positive("--lr", args.lr, 0, strict=True)
    _positive("--batch", args.batch)
    _positive("--input-depth", args.input_depth)
    _positive("--tv-weight", args.tv_weight, 0)
    _positive("--reg-noise-std", args.reg_noise_std, 0)
    return {
        "steps": args.steps,
        "lr": args.lr,
        "tv_weight": args.tv_weight,
        "reg_noise_std": args.reg_noise_std,
        "input_depth": args.input_depth,
        "downsample": args.downsample,
        "upsample": args.upsample,
        "padding": args.padding,
        "pad_to_power_of_two": args.canvas == "pow2",
        "double": args.double,
        "cudnn": not args.no_cudnn,
        "batch": args.batch,
    }


def gradleak_options(args: argparse.Namespace) -> dict[str, Any]:
    _positive("--steps", args.steps)
    _positive("--restarts", args.restarts)
    _positive("--lr", args.lr, 0, strict=True)
    _positive("--tv-weight", args.tv_weight, 0)
    _positive("--batch-size", args.batch_size)
    _positive("--batch", args.batch)
    if args.local_steps == "auto":
        local_steps: int | str = "auto"
    else:
        try:
            local_steps = int(args.local_steps)
        except ValueError:
            local_steps = 0
        if local_steps < 1:
            raise ConfigError(f"--local-steps must be a positive integer or 'auto', got {args.local_steps!r}")
    return {
        "steps": args.steps,
        "lr": args.lr,
        "tv_weight": args.tv_weight,
        "restarts": args.restarts,
        "local_steps": local_steps,
        "batch_label_rule": args.batch_label_rule,
        "max_batch": args.batch_size,
        "batch": args.batch,
    }


def attack_options(name: str, items: list[str]) -> dict[str, Any]:
    """``["steps=3", "tv_weight=0.1"]`` -> options typed by the attack's Config fields (one-line errors)."""
    import dataclasses
    import typing

    from attacks import ATTACKS
    from privfl.config import check_range, parse_scalar

    config_cls = ATTACKS.get(name).Config
    fields = {f.name: f for f in dataclasses.fields(config_cls)} if dataclasses.is_dataclass(config_cls) else {}
    hints = typing.get_type_hints(config_cls) if fields else {}
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in fields:
            raise ConfigError(f"--option {item!r}: expected KEY=VALUE with KEY one of {', '.join(fields) or '(none)'} (attack {name})")
        kinds = [t for t in typing.get_args(hints[key]) or (hints[key],) if t in (bool, int, float, str)]
        for tp in kinds or [str]:
            try:
                out[key] = parse_scalar(value, tp)
                break
            except (TypeError, ValueError):
                continue
        else:
            raise ConfigError(f"--option {item!r}: {value!r} is not a valid {' or '.join(t.__name__ for t in kinds)}")
        check_range(key, out[key], fields[key].metadata)  # a range the attack's Config declares with privfl.config.opt
    return out


def main(argv: list[str] | None = None) -> int:
    from privfl.cli import load_plugins
    from privfl.run import Run

    argv = list(sys.argv[1:] if argv is None else argv)
    load_plugins(argv)
    args = build_parser().parse_args(argv)
    if args.command == "list":
        return list_attacks(Run.open(args.run, args.out_dir))
    # every option is checked before the run is opened, and the output folder before the attack runs
    from privfl.runs import check_output_name

    if args.name is not None:
        check_output_name(args.name)
    _positive("--seed", args.seed, 0)
    _positive("--round", args.round, 0)
    _positive("--max-targets", getattr(args, "max_targets", None))
    clients = parse_clients(args.clients)
    if args.command == "run":
        options = attack_options(args.attack, args.option)
    elif args.command == "invert":
        options = invert_options(args)
    else:
        options = gradleak_options(args)
    common = {"seed": args.seed, "device": args.device, "name": args.name, "progress": not args.no_progress, "data_root": args.data_root}
    common["deterministic"] = args.deterministic
    if args.command == "invert" and getattr(args, "learned", False) and not args.compare:
        raise ConfigError("--learned goes with --compare; the learned inversion of one kind is: privfl.attack run invert-learned --artifact KIND")
    if args.command == "invert" and args.compare:
        from attacks import compare_artifacts

        kinds = [k.strip() for k in args.compare.split(",") if k.strip()]
        _positive("--samples", args.samples)
        run = Run.open(args.run, args.out_dir)
        client = clients[0] if clients else None
        report = compare_artifacts(run, kinds, client=client, round=args.round, samples=args.samples, options=options, learned=args.learned, **common)
        print_compare(report)
        return 0
    from attacks import run_attack

    run = Run.open(args.run, args.out_dir)
    selection = {"kind": args.artifact, "round": args.round, "clients": clients}
    if args.command in ("run", "invert"):
        attack = args.attack if args.command == "run" else "invert"
        report = run_attack(run, attack, **selection, max_targets=args.max_targets, options=options, **common)
    else:
        report = run_attack(run, args.command, **selection, options=options, **common)
    print_report(report)
    return 0


def list_attacks(run: Any) -> int:
    """What the run captured, and per registered attack: what it would attack, or why it cannot."""
    from attacks import ATTACKS, Selection

    view = run.attacker
    print(f"run {run.path}: method {run.method}, knowledge: {', '.join(sorted(view.granted())) or 'none'}")
    for kind in view.kinds():
        rounds = view.rounds(kind) or sorted({r["round"] for r in view.records() if r["kind"] == kind})
        print(f"  {kind:<12} rounds {rounds[0]}..{rounds[-1]}")
    ext = view.extractor_records()
    print(f"  extractors stored for rounds: {sorted({r['round'] for r in ext}) or 'none'}")
    print("attacks:")
    for name in ATTACKS.names():
        attack = ATTACKS.get(name)()
        plan = attack.plan(view, Selection(max_targets=1))
        if plan:
            where = ", ".join(f"{k} (last round {max(t.round for t in plan.targets if t.kind == k)})" for k in plan.kinds)
            print(f"  {name:<18} applies to {where}: {len(plan.targets)} target(s)")
        else:
            print(f"  {name:<18} does not apply: {plan.reason}")
    return 0


def print_report(report: Any) -> None:
    from attacks.calibration import describe

    s = report.summary
    if "f1" in s:  # label inference
        print(f"{report.attack} on {report.kind} r{report.round}: {s['messages']} message(s)")
        print(f"  precision {s['precision']:.3f}  recall {s['recall']:.3f}  F1 {s['f1']:.3f}  exact sets {s['exact']:.3f}")
    elif "targets" in s:  # representation inversion
        print(f"{report.kind} r{report.round}: {s['targets']} target(s), {s['seconds_per_target']:.2f} s per target")
        for k in ("exact_psnr255", "exact_mse255", "best_psnr255", "best_mse255", "best_ssim", "mean_psnr255", "mean_mse255"):
            if k in s:
                print(f"  {k:<16} {s[k]:10.3f}")
    else:
        print(
            f"{report.attack} on {report.kind} r{report.round}: {s['images']} image(s) from {s['messages']} message(s), "
            f"{s['seconds_per_message']:.1f} s per message"
        )
        print(f"  PSNR {s['psnr']:.2f} dB (0-255 MSE {s['mse255']:.1f}), SSIM {s['ssim']:.3f}")
    for line in describe(s.get("calibration", {})):
        print(line)
    if report.folder is not None:
        print(f"  results: {report.folder}/index.html")


def print_compare(report: Any) -> None:
    from attacks.calibration import describe

    s, p = report.summary, report.protocol
    kinds = p["compare"]
    print(f"compare {', '.join(kinds)} on {p['client']} r{p['round']}: {s['seconds_per_target']:.2f} s per target")
    for k in kinds:
        print(
            f"  {k:<8}{' (counterfactual)' if s[k + '_counterfactual'] else '':<17} PSNR {s[k + '_sample_psnr255']:6.2f} dB"
            f"  MSE(0-255) {s[k + '_sample_mse255']:9.2f}  SSIM {s[k + '_sample_ssim']:.3f}"
        )
        for line in describe(s.get(f"{k}_calibration", {}), indent="      "):
            print(line)
        if f"{k}_learned_sample_psnr255" in s:
            print(f"  {k:<8}{' (learned)':<17} PSNR {s[k + '_learned_sample_psnr255']:6.2f} dB  SSIM {s[k + '_learned_sample_ssim']:.3f}")
            for line in describe(s.get(f"{k}_learned_calibration", {}), indent="      "):
                print(line)
    print(f"  ordering: {s['ordering']}")
    if s.get("ordering_note"):
        print(f"  {s['ordering_note']}")
    if report.folder is not None:
        print(f"  results: {report.folder}/index.html")


if __name__ == "__main__":
    sys.exit(run_cli("privfl.attack", main))
