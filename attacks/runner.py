"""The one attack runner: plan, run, score against ground truth, write. Every entry point calls it.

    from privfl import Run
    from attacks import run_attack

    report = run_attack(Run.open("runs/latest"), "invert", kind="ent_rep", options={"steps": 1000})
    report.summary["best_psnr255"], report.folder        # numbers, and RUN/attacks/invert-ent_rep-r19/

:func:`run_attack` asks the attack for its plan on the attacker's view of the run (messages and the
knowledge the run grants, no ground truth), runs it with a progress bar, and only then opens the
ground truth to score the reconstructions (the rule depends on the artifact's family, see
:mod:`attacks.scoring`). Results are written into a temporary folder beside ``RUN/attacks/<name>``
and swapped in whole, so a killed attack leaves the previous result, never half of a new one:
``gallery.png`` (``labels.png`` for an attack that produces labels), ``metrics.json`` (protocol,
summary, one row per image, or per message for labels), ``metrics.csv``, ``summary.csv``,
``reconstructions.safetensors`` and ``index.html``.

The CLI (``python -m privfl.attack``), the experiments and the audit all go through here; the
rep/proto/ent_rep comparison (:mod:`attacks.compare`) uses :func:`execute` and :func:`write_report`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import torch
from safetensors.torch import save_file

from attacks.base import Attack, AttackNotApplicable, Queries, Reconstruction, Selection, Target, create_attack
from attacks.scoring import Scored, scorer_for
from privfl.capture.store import portable_tensors
from privfl.errors import ConfigError
from privfl.kinds import KINDS
from privfl.run import GroundTruth, Run
from privfl.runs import output_path, write_output_folder


@dataclass
class AttackReport:
    """What one attack run produced: its protocol, summary numbers, per-image rows, the
    reconstructions, and the folder it was written to (None with ``write=False``)."""

    attack: str
    kind: str
    round: int
    protocol: dict[str, Any]
    summary: dict[str, Any]
    rows: list[dict[str, Any]]
    reconstructions: list[Reconstruction] = field(repr=False)
    folder: Path | None = None


def resolve_attack_device(name: str | torch.device, deterministic: bool = False) -> torch.device:
    """``auto`` (the GPU when there is one), ``cpu``, ``cuda``, ``cuda:N`` or a device; one-line errors.
    ``deterministic``: cuBLAS is given its reproducible workspace before CUDA starts (or refused, one line)."""
    from privfl.determinism import prepare_cublas
    from privfl.engine import resolve_device

    device = name if isinstance(name, torch.device) else resolve_device(name)
    if deterministic:
        prepare_cublas(device)
    return device


def execute(
    attack: Attack, targets: Sequence[Target], *, progress: bool = False, desc: str = "", deterministic: bool = False
) -> tuple[list[Reconstruction], float]:
    """Run ``attack`` on ``targets`` with a progress bar (steps and the current loss); (results, seconds).
    ``deterministic``: with torch's deterministic kernels (``--deterministic``, :mod:`privfl.determinism`)."""
    from tqdm.auto import tqdm

    from privfl.determinism import deterministic_kernels

    with deterministic_kernels(deterministic):  # prepare too: a plug-in attack may compute there
        attack.prepare(targets)  # loads its inputs: a damaged capture fails in one line, before any progress bar
        bar = tqdm(
            total=attack.steps_for(targets),
            desc=desc or f"{attack.name} on {len(targets)} target(s)",
            unit="step",
            disable=not progress,
            dynamic_ncols=True,
        )

        def hook(label: str, step: int, steps: int, loss: float) -> None:
            bar.update(1)
            if step % 25 == 0 or step == steps - 1:
                bar.set_postfix_str(f"{label} loss {loss:.3g}")

        start = time.perf_counter()
        try:
            recons = attack.run_batch(targets, hook)
        finally:
            bar.close()
        return recons, time.perf_counter() - start


def lpips_note() -> str:
    from attacks.metrics import lpips_status

    ok, why = lpips_status()
    return "computed" if ok else f"unavailable: {why}"


def base_protocol(attack: Attack, run: Run, deterministic: bool = False) -> dict[str, Any]:
    """What every result records: the attack, its paper, threat model and knowledge, the run, seed, device
    (and whether its kernels were the deterministic ones)."""
    return {
        "attack": attack.name,
        "paper": attack.paper,
        "run": str(run.path),
        "method": run.method,
        "threat_model": attack.threat_model,
        "threat_model_text": attack.threat_text(),
        "knowledge_used": attack.needs.granted(),
        "seed": attack.seed,
        "device": str(attack.device),
        "deterministic": deterministic,
        "psnr_convention": "per image, then averaged",
        "lpips": lpips_note(),
    }


def run_attack(
    run: Run | str | Path,
    attack: str | Attack,
    *,
    kind: str | None = None,
    round: int | None = None,
    clients: Sequence[str | int] | None = None,
    max_targets: int = 4,
    options: dict[str, Any] | None = None,
    seed: int = 0,
    device: str | torch.device = "auto",
    name: str | None = None,
    write: bool = True,
    progress: bool = False,
    data_root: str | None = None,
    deterministic: bool = False,
) -> AttackReport:
    """Plan ``attack`` on ``run`` (one kind, one round: the last with it unless ``round``), run it, score
    it against ground truth and (with ``write``) save the results under ``RUN/attacks/<name>``.

    ``attack`` is a registered name (``invert``, ``dlg``, ``idlg``, ``ig``, ...) built with ``options``,
    or an :class:`~attacks.base.Attack` instance. Raises :class:`~attacks.base.AttackNotApplicable`
    (one line, exit status 2 in the CLIs) when nothing in the selection can be attacked. ``deterministic``:
    torch's deterministic kernels while it runs, so that a GPU repeats it to the bit (``--deterministic``).
    """
    run = run if isinstance(run, Run) else Run.open(run)
    if write and name is not None:
        output_folder(run, name)  # a bad or foreign output folder is refused before the attack runs
    if isinstance(attack, str):
        attack = create_attack(attack, seed=seed, device=resolve_attack_device(device, deterministic), **(options or {}))
    elif options:
        raise ConfigError("pass options with an attack name, or configure the Attack instance yourself")
    elif deterministic:
        resolve_attack_device(attack.device, deterministic)  # an Attack the caller built: cuBLAS for its device
    selection = Selection(kind, None if round is None else [round], client_names(clients), max_targets)
    view = run.attacker
    plan = attack.plan(view, selection)
    if not plan:
        raise AttackNotApplicable(plan.reason)
    if len(plan.kinds) > 1:
        raise ConfigError(f"run {run.name} sends several kinds {attack.name} takes ({', '.join(plan.kinds)}): choose one (kind=..., --artifact)")
    kind, rnd = plan.kinds[0], plan.rounds[-1]
    targets = plan.targets
    name = name or f"{attack.name}-{kind}-r{rnd}"
    if write:
        output_folder(run, name)
    membership: dict[str, torch.Tensor] = {}
    if attack.needs.candidates or attack.needs.population:  # the membership game: the challenger hands over records
        membership = hand_over(run.ground_truth(data_root), run.dataset, targets, attack)
    desc = f"{attack.name} {kind} r{rnd}: {len(targets)} target(s)"
    recons, seconds = execute(attack, targets, progress=progress, desc=desc, deterministic=deterministic)

    if "images" in attack.produces:
        empty = next((r for r in recons if r.images is None or len(r.images) == 0), None)
        if empty is not None:
            raise ConfigError(
                f"attack {attack.name} returned no images for {empty.target.key}; an attack that infers labels "
                "declares produces = frozenset({'labels'})"
            )
    truth = run.ground_truth(data_root)  # opened only now, for scoring
    family = KINDS.get(kind).family
    scorer = scorer_for(family, attack.produces, membership, seed=attack.seed)
    title = f"{kind} r{rnd}" if family.value.endswith("representation") else f"{attack.name} final"
    scored = scorer.score(recons, truth, title, seconds)
    protocol = {
        **base_protocol(attack, run, deterministic),
        **attack.protocol(),
        "artifact": kind,
        "family": str(family),
        "round": rnd,
        "clients": sorted({t.client for t in targets}, key=_client_order),
        "ground_truth_rule": scored.rule,
    }
    if hasattr(attack, "levels_used"):
        protocol["dip_levels_used"] = attack.levels_used(run.dataset["image_size"])
        protocol["psnr_convention"] = "per image, then averaged; MSE on [0,1] and on 0-255 (FedRE papers' scale) averaged separately"
    notes = {k: v for r in recons for k, v in r.notes.items() if k in ("target_note", "approximation")}
    if notes.get("target_note"):
        protocol["target"] = notes["target_note"]
        protocol["batch_size"] = recons[0].notes.get("batch_size")
    if notes.get("approximation"):
        protocol["approximation"] = notes["approximation"]
    together = [int(r.notes["optimised_with"]) for r in recons if "optimised_with" in r.notes]
    if together:  # targets that shared one vectorised optimisation (gradient leakage's --batch)
        protocol["optimised_together"] = max(together)
    warnings = list(dict.fromkeys(str(r.notes["warning"]) for r in recons if r.notes.get("warning")))
    if warnings:  # a result that rests on a guess says so with the numbers
        protocol["warnings"] = warnings
    report = AttackReport(attack.name, kind, rnd, protocol, scored.summary, scored.rows, recons)
    if write:
        heading = f"{kind} r{rnd}"
        report.folder = write_report(
            run,
            name,
            scored,
            protocol,
            title=f"{attack.name} on {kind}: {run.method} round {rnd}",
            heading=heading,
            gallery_title=f"{attack.name} on {kind} ({run.method}, round {rnd})",
            reconstructions={r.target.key.replace("/", "."): r.images for r in recons if r.images is not None},
        )
    return report


def hand_over(truth: GroundTruth, dataset: dict[str, Any], targets: Sequence[Target], attack: Attack) -> dict[str, torch.Tensor]:
    """The challenger's side of the membership game, per target client: ``queries`` (up to ``queries``
    of its training samples and as many of its held-out samples, shuffled, membership hidden) and
    ``population`` (up to ``population`` held-out samples of the other clients, never trained on by
    anyone), as normalised inputs with labels in ``target.payload``. Returns the hidden membership bits
    by target key, for scoring. Seeded by (attack seed, client)."""
    from privfl.seeding import torch_generator

    cfg = attack.config
    n_queries, n_population = int(getattr(cfg, "queries", 200)), int(getattr(cfg, "population", 1000))
    mean = torch.tensor(dataset["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(dataset["std"]).view(1, -1, 1, 1)

    def records(idx: torch.Tensor) -> Queries:
        return Queries((truth.images(idx) - mean) / std, truth.labels[idx].long())

    bits: dict[str, torch.Tensor] = {}
    handed: dict[str, tuple[torch.Tensor, dict[str, Queries]]] = {}  # per client: every draw is seeded by (seed, client) alone
    for t in targets:
        if t.client not in handed:
            gen = torch_generator(attack.seed, "membership-game", t.client)
            train, test = truth.client_train(t.client), truth.client_split(t.client, "test")
            n = min(len(train), len(test), n_queries)
            members = train[torch.randperm(len(train), generator=gen)[:n]]
            others = test[torch.randperm(len(test), generator=gen)[:n]]
            order = torch.randperm(2 * n, generator=gen)
            idx = torch.cat([members, others])[order]
            payload: dict[str, Queries] = {}
            if attack.needs.candidates:
                payload["queries"] = records(idx)
            if attack.needs.population:
                pool = torch.cat([truth.client_split(c, "test") for c in truth.clients() if c != t.client])
                payload["population"] = records(pool[torch.randperm(len(pool), generator=gen)[:n_population]])
            handed[t.client] = (torch.cat([torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)])[order], payload)
        bits[t.key], payload = handed[t.client]
        t.payload.update(payload)
    return bits


def write_report(
    run: Run,
    name: str,
    scored: Scored,
    protocol: dict[str, Any],
    *,
    title: str,
    heading: str,
    gallery_title: str,
    reconstructions: dict[str, torch.Tensor],
    text: str = "",
) -> Path:
    """Gallery, metrics and HTML of one result, written in a temporary folder and swapped into
    ``RUN/attacks/<name>`` whole (a privfl output: it carries the marker file)."""
    final = output_folder(run, name)
    return write_output_folder(
        final,
        lambda folder: _write_result(
            folder, run, scored, protocol, title=title, heading=heading, gallery_title=gallery_title, reconstructions=reconstructions, text=text
        ),
        by=f"privfl.attack {protocol.get('attack', '')}".strip(),
    )


def _write_result(
    folder: Path,
    run: Run,
    scored: Scored,
    protocol: dict[str, Any],
    *,
    title: str,
    heading: str,
    gallery_title: str,
    reconstructions: dict[str, torch.Tensor],
    text: str,
) -> None:
    from attacks.report import save_gallery, save_label_grid, save_roc, write_html, write_metrics

    if scored.label_grid is not None:
        picture = "labels.png"
        save_label_grid(folder / picture, scored.label_grid, run.dataset["class_names"], title=gallery_title)
    elif scored.roc_curves is not None:
        picture = "roc.png"
        save_roc(folder / picture, scored.roc_curves, title=gallery_title)
    else:
        picture = "gallery.png"
        save_gallery(
            folder / picture,
            scored.truth_images,
            scored.gallery_rows,
            captions=scored.captions,
            title=gallery_title,
            per_image_labels=scored.labels,
        )
    if reconstructions:
        save_file(portable_tensors(reconstructions), str(folder / "reconstructions.safetensors"))
    write_metrics(folder, scored.rows, scored.summary, protocol)
    section = {"heading": heading, "protocol": protocol, "images": picture, "summary": scored.summary}
    if text:
        section["text"] = text
    write_html(folder, title, [section])


def output_folder(run: Run, name: str) -> Path:
    """``RUN/attacks/<name>``, checked: ``name`` is one plain path component, and an existing folder of
    that name is a privfl output (only those are replaced). One-line ConfigErrors; call it before the work."""
    return output_path(run.path / "attacks", name)


@overload
def client_names(clients: Sequence[str | int]) -> list[str]: ...
@overload
def client_names(clients: None) -> None: ...
def client_names(clients: Sequence[str | int] | None) -> list[str] | None:
    """``[0, "3", "client5"]`` -> ``["client0", "client3", "client5"]``."""
    if clients is None:
        return None
    out = []
    for c in clients:
        text = str(c).strip()
        name = text if text.startswith("client") else f"client{text}"
        if not name.removeprefix("client").isdigit():
            raise ConfigError(f"clients are given as ids like 0,3 or client0,client3; got {text!r}")
        out.append(name)
    return out


def _client_order(name: str) -> int:
    return int(name.removeprefix("client")) if name.removeprefix("client").isdigit() else -1


__all__ = ["AttackReport", "base_protocol", "client_names", "execute", "run_attack", "write_report"]
