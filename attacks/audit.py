"""The audit: one call that measures what a federated method leaks, beside reference methods.

    from attacks.audit import audit
    result = audit("mypkg.mymethod:MyMethod", profile="quick")     # trains, attacks, compares, reports
    result.report["methods"][0]["kinds"], result.html               # numbers, and the self-contained page

For the audited method (or an existing run of it) and for reference methods trained on the same data,
partition and seed (FedAvg and Local by default; FedProto and FedRE too when the method sends
representations), the audit runs every registered attack that applies, on every kind each method
sends, at a few rounds (first, middle and last), through :func:`attacks.runner.run_attack`, and
keeps per kind the strongest result of each attack family: image reconstruction (PSNR, SSIM, LPIPS
and the gallery of the best one), label inference (recall of the classes behind a message, L1 of
the class shares) and membership inference (AUC, TPR at 1 % FPR, advantage), each with the threat
model it assumes. Defenses given with ``defenses`` add defended runs of the method as extra points.
:mod:`attacks.audit_report` turns that into ``report.json`` (schema ``privfl-audit/1``, documented
in docs/audit.md), a self-contained ``report.html`` and a privacy-utility figure.

Profiles (:data:`PROFILES`) fix the training size and the attack budgets: ``quick`` is minutes on
two CPU cores, ``standard`` the default training run with stronger attacks, ``paper`` the attacks'
own papers' settings on the method's default training.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attacks.audit_plan import PROFILES, AttackOutcome, Profile, Subject, reconstruction_psnr
from attacks.base import ATTACKS, KNOWLEDGE_FIXES, Attack, AttackNotApplicable, Selection
from attacks.runner import AttackReport, run_attack
from privfl.config import parse_scalar
from privfl.errors import ConfigError, PrivflError
from privfl.fl.method import FLMethod
from privfl.kinds import KINDS, Family
from privfl.run import Run

#: which attack family each kind of output belongs to, and the metric that ranks its results
FAMILY_OF_OUTPUT = {"images": "reconstruction", "labels": "labels", "membership": "membership"}
REPRESENTATION_FAMILIES = (Family.PER_SAMPLE_REPRESENTATION, Family.AGGREGATE_REPRESENTATION)
#: run options the references copy from the audited run, so they train on the same data, partition and seed
SHARED_OPTIONS = (
    "dataset", "data_root", "subsample", "num_clients", "partition", "alpha", "classes_per_client", "imbalance_factor", "balanced",
    "min_samples", "train_fraction", "rounds", "local_epochs", "batch_size", "lr", "optimizer", "momentum", "weight_decay", "seed",
    "rep_dim", "mapping", "eval_batch_size", "knowledge_rounds", "device", "deterministic",
)  # fmt: skip


@dataclass
class AuditResult:
    report: dict[str, Any]  # what report.json holds
    folder: Path
    html: Path
    json: Path
    subjects: list[Subject]


def audited_rounds(rounds: int) -> list[int]:
    """First, middle and last round (fewer when the run is shorter)."""
    return sorted({0, (rounds - 1) // 2, rounds - 1})


def references_for(method_cls: type[FLMethod], given: Sequence[str] | None, name: str = "") -> list[str]:
    """``given``, or by default FedAvg and Local, plus FedProto and FedRE when the method sends
    representations; FedAvg audited is compared with FedSGD (its gradient-sharing ancestor, McMahan
    et al. 2017) and Local, so that some reference sends something. The audited method itself is left out."""
    if given is not None:
        return [m for m in given if m and m != name]
    out = ["fedsgd", "local"] if name == "fedavg" else ["fedavg", "local"]
    if any(KINDS.get(k).family in REPRESENTATION_FAMILIES for k in method_cls.sends if k in KINDS):
        out += ["fedproto", "fedre"]
    return [m for m in out if m != name]


def predict(method_cls: type[FLMethod]) -> list[tuple[str, str]]:
    """What the method's declarations already say before training: (attack family or kind, the line to fix).

    Found from ``sends``, ``exposes`` and ``leakage`` alone, so ``--check`` says it before training."""
    notes: list[tuple[str, str]] = []
    families = {k: KINDS.get(k).family for k in method_cls.sends if k in KINDS}
    if not families:
        notes.append(("all", "the method declares nothing in sends: no message to attack (a local baseline?)"))
    reps = [k for k, f in families.items() if f in REPRESENTATION_FAMILIES]
    if reps and "extractor" not in method_cls.exposes:
        notes.append(("invert", f"{', '.join(reps)} cannot be inverted without the client's extractor: {KNOWLEDGE_FIXES['extractor']}"))
    for kind, family in families.items():
        ctx = method_cls.leakage_context(kind)
        if ctx is not None and ctx.readout == "probe":
            notes.append(
                (
                    "membership",
                    f"{kind}: its module ends in the attacker's own probe, so no membership test of the client's "
                    "classifier; declare a LeakageContext whose module maps images to the client's class scores",
                )
            )
        if family in (Family.PARAMETERS, Family.GRADIENT) and ctx is not None and ctx.previous not in method_cls.sends:
            notes.append(
                (
                    "gradient",
                    f"{kind}: its previous state is declared as kind {ctx.previous!r}, which the method does not send: "
                    f"{KNOWLEDGE_FIXES['previous_state']}",
                )
            )
    return notes


def _options_for(attack: type[Attack], wanted: dict[str, Any]) -> dict[str, Any]:
    """The profile's options that the attack's Config has (a plug-in attack may have none of them)."""
    cfg = attack.default_config()
    if not dataclasses.is_dataclass(cfg):
        return {}
    names = {f.name for f in dataclasses.fields(cfg)}
    return {k: v for k, v in wanted.items() if k in names}


@dataclass(frozen=True)
class Workers:
    """How the audit's independent jobs (trainings of the subjects, then every attack on every kind and
    round) run: ``count`` processes, each with ``threads`` torch threads (0: the core budget, from
    ``OMP_NUM_THREADS`` or the machine's cores, split evenly). Two torch processes that each take every
    core slow each other many times over (thread oversubscription), so the threads are always set when
    ``count`` > 1. ``plugins``: modules each worker imports first (``--plugin``), as the parent did.
    Every job is seeded by itself and outcomes keep the sequential order, so the report equals a
    sequential audit's at the same thread count (a different thread count changes CPU reduction order,
    hence the last digits, which training amplifies: docs/audit.md)."""

    count: int = 1
    threads: int = 0
    plugins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.count < 1 or self.threads < 0:
            raise ConfigError(f"--workers must be >= 1 and --threads-per-worker >= 0, got {self.count} and {self.threads}")

    def threads_each(self) -> int:
        budget = int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1
        return self.threads or max(1, budget // self.count)

    def pool(self) -> ProcessPoolExecutor:
        """Worker processes started fresh (spawn: no copied torch state), threads set before any work."""
        import multiprocessing

        return ProcessPoolExecutor(
            self.count, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker, initargs=(self.threads_each(), self.plugins)
        )


def _start_worker(threads: int, plugins: tuple[str, ...]) -> None:
    import importlib

    import torch
    from threadpoolctl import threadpool_limits

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    torch.set_num_threads(threads)
    threadpool_limits(threads)  # numpy's BLAS too (PCA, ridge solves): loaded before the variables were set
    for module in plugins:
        importlib.import_module(module)


@dataclass
class AttackJob:
    """One planned attack: where its outcome goes, and the arguments of :func:`run_attack`."""

    outcome: AttackOutcome
    subject: Subject
    arguments: dict[str, Any]


@dataclass(frozen=True)
class JobSettings:
    """What every attack job of one audit shares (:func:`attacks.run_attack`'s arguments of the same names)."""

    seed: int = 0
    device: str = "auto"
    deterministic: bool = False  # torch's deterministic kernels while each attack runs (--deterministic)
    data_root: str | None = None


def profile_options(profile: Profile, name: str) -> dict[str, Any]:
    """The profile's options for an attack; an ``-extractor`` variant takes its base attack's (the same
    scoring, another way to the model)."""
    return profile.attack_options.get(name, profile.attack_options.get(name.removesuffix("-extractor"), {}))


def attack_jobs(subject: Subject, profile: Profile, settings: JobSettings) -> list[AttackOutcome | AttackJob]:
    """Every registered attack on every kind the subject's run sends, at the audited rounds: an outcome
    already decided (nothing to attack, and why) or a job to run, in the report's order."""
    assert subject.run is not None
    run = subject.run
    view = run.attacker
    rounds = audited_rounds(len(run.metrics) or int(run.config.get("rounds", 1)))
    out: list[AttackOutcome | AttackJob] = []
    for name in ATTACKS.names():
        cls = ATTACKS.get(name)
        family = FAMILY_OF_OUTPUT[sorted(cls.produces)[0]]
        probe = cls(seed=settings.seed)
        for kind in view.kinds():
            if not cls.takes(kind):
                continue
            for rnd in rounds:
                senders = sorted(
                    {m["sender"] if m["sender"] != "server" else m["receiver"] for m in view.messages(kind, rnd)},
                    key=lambda c: int(c.removeprefix("client")) if c.removeprefix("client").isdigit() else 0,
                )
                outcome = AttackOutcome(name, family, kind, rnd, cls.threat_model)
                if not senders:
                    continue
                clients = senders[: profile.attack_clients]
                plan = probe.plan(view, Selection(kind=kind, rounds=[rnd], clients=clients, max_targets=profile.max_targets))
                if not plan:
                    outcome.reason, outcome.fix = plan.reason, plan.fix
                    out.append(outcome)
                    continue
                arguments = {
                    "attack": name,
                    "kind": kind,
                    "round": rnd,
                    "clients": clients,
                    "max_targets": profile.max_targets,
                    "options": _options_for(cls, profile_options(profile, name)),
                    "seed": settings.seed,
                    "device": settings.device,
                    "deterministic": settings.deterministic,
                    "name": f"audit-{name}-{kind}-r{rnd}",
                    "data_root": settings.data_root,
                }
                out.append(AttackJob(outcome, subject, arguments))
    return out


def _attack(run: Run | str, arguments: dict[str, Any], progress: bool) -> tuple[AttackReport | None, str, str, float]:
    """One job: (report, reason, fix, seconds); a job that does not apply or fails gives its reason
    (``failed: ...``), so one missing result does not stop the audit. Runs in a worker, too."""
    start = time.perf_counter()
    report, reason, fix = None, "", ""
    try:
        report = run_attack(run, progress=progress, **arguments)
    except AttackNotApplicable as exc:
        reason, fix = str(exc), exc.fix
    except PrivflError as exc:  # e.g. a message sent without its ground truth: this result is missing, the audit goes on
        reason = f"failed: {exc}"
    return report, reason, fix, time.perf_counter() - start


def _finish(job: AttackJob, result: tuple[AttackReport | None, str, str, float], log: Callable[[str], None]) -> None:
    outcome, (outcome.report, outcome.reason, outcome.fix, outcome.seconds) = job.outcome, result
    job.subject.outcomes.append(outcome)
    a = job.arguments
    if outcome.reason.startswith("failed: "):
        log(f"  {job.subject.label}: {a['attack']} on {a['kind']} r{a['round']} {outcome.reason}")
    if outcome.report is not None:
        log(f"  {job.subject.label}: {a['attack']} on {a['kind']} r{a['round']}: {headline(outcome)}")


def attack_run(subject: Subject, profile: Profile, settings: JobSettings, *, progress: bool, log: Callable[[str], None]) -> None:
    """Every registered attack on every kind the subject's run sends, at the audited rounds (in this process)."""
    assert subject.run is not None
    for job in attack_jobs(subject, profile, settings):
        if isinstance(job, AttackOutcome):
            subject.outcomes.append(job)
        else:
            _finish(job, _attack(subject.run, job.arguments, progress), log)


def headline(outcome: AttackOutcome) -> str:
    """The one number of a result, in words."""
    s = outcome.report.summary if outcome.report else {}
    if outcome.family == "reconstruction":
        psnr = reconstruction_psnr(s)
        return f"PSNR {psnr:.2f} dB" if psnr is not None else "no PSNR"
    if outcome.family == "labels":
        return f"class recall {s.get('recall', float('nan')):.2f}, histogram L1 {s.get('l1', float('nan')):.2f}"
    if "pooled_auc" in s:
        tpr = s.get("pooled_tpr_1pct")
        at1 = f"{tpr:.3f}" if tpr is not None else "unavailable"
        return f"AUC {s['pooled_auc']:.3f} [{s['pooled_auc_low']:.3f}, {s['pooled_auc_high']:.3f}] (pooled), TPR@1%FPR {at1}"
    return f"AUC {s.get('auc', float('nan')):.3f}, TPR@1%FPR {s.get('tpr_at_1pct_fpr', float('nan')):.3f}"


def train_subject(subject: Subject, values: dict[str, Any], out: Path, *, progress: bool, log: Callable[[str], None]) -> None:
    """Train one subject into ``out/runs/<name>``."""
    log(f"training {subject.label} ({subject.role})")
    run_dir, subject.train_seconds = _train(subject.method, subject.defenses, values, out, progress)
    subject.run = Run(run_dir)


def _subject_dir(subject: Subject, out: Path) -> Path:
    name = subject.method.replace(":", ".").replace("/", ".") + ("-" + "-".join(_slug(d) for d in subject.defenses) if subject.defenses else "")
    run_dir = out / "runs" / name
    if (run_dir / "config.json").exists():
        raise ConfigError(f"{run_dir} already exists: give another --out (the audit never overwrites a run)")
    return run_dir


def _train(method: str, defenses: list[str], values: dict[str, Any], out: Path, progress: bool) -> tuple[Path, float]:
    """Train ``method`` into its folder under ``out/runs``; (run folder, seconds). Runs in a worker, too."""
    import privfl.train as train_module

    run_dir = _subject_dir(Subject("", method, list(defenses)), out)
    start = time.perf_counter()
    where = {"out_dir": str(out / "runs"), "run_name": run_dir.name, "progress": progress}
    train_module.train({**values, "method": method, "defense": list(defenses), **where})
    return run_dir, time.perf_counter() - start


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text).strip("_")


def reference_values(values: dict[str, Any], method: str) -> dict[str, Any]:
    """The audited run's shared options for a reference method, in a model group it can train (:func:`model_group_for`)."""
    out = {k: v for k, v in values.items() if k in SHARED_OPTIONS}
    out["model_group"] = model_group_for(method, values)
    return out


def model_group_for(method: str, values: dict[str, Any]) -> str:
    """The run's model group, or for a method that needs one architecture (FedAvg) and a mixed group,
    the homogeneous group of the mixed group's first model (``homo-cnn4`` when there is none)."""
    from privfl.methods import resolve_method
    from privfl.models import MODEL_GROUPS, assign_archs

    group = str(values.get("model_group", "cpu5"))
    if resolve_method(method).requires_homogeneous and len(set(assign_archs(group, int(values.get("num_clients", 10))))) > 1:
        first = assign_archs(group, 1)[0]
        return next((g for g in MODEL_GROUPS.names("homo-*") if MODEL_GROUPS.get(g) == (first,)), "homo-cnn4")
    return group


def audit(
    method: str | None = None,
    *,
    run: str | Path | None = None,
    profile: str | Profile = "quick",
    compare: Sequence[str] | None = None,
    defenses: Sequence[str] = (),
    out: str | Path = "runs/audit",
    device: str = "auto",
    seed: int = 0,
    deterministic: bool = False,
    train_options: dict[str, Any] | None = None,
    data_root: str | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    workers: Workers | int = 1,
) -> AuditResult:
    """Audit ``method`` (trained here with ``profile``) or an existing ``run``; see the module docstring.

    ``workers`` (:class:`Workers`, or a count): with more than one, the subjects train in parallel
    processes, then every attack job runs in them, the cores split between them; the report is the same.

    ``train_options`` are run options for the audited training (dataset, model_group, num_clients,
    method options...); the references take the same data, partition and seed. ``out`` must not be an
    existing audit folder with results (nothing is overwritten).

    ``deterministic``: torch's deterministic kernels (``privfl/determinism.py``) in the trainings (the
    references copy it) and in every attack job, so that a GPU repeats the whole audit to the bit. The
    attacks also take it from the audited training's own options: ``train_options={"deterministic": True}``,
    or a ``run=`` trained with ``--deterministic`` (its references are then trained with it too)."""
    from privfl.methods import check_method_class, resolve_method

    pool = workers if isinstance(workers, Workers) else Workers(int(workers))
    if isinstance(profile, Profile):
        prof = profile
    elif profile in PROFILES:
        prof = PROFILES[profile]
    else:
        raise ConfigError(f"unknown profile {profile!r}; accepted: {', '.join(PROFILES)}")
    out = Path(out)
    if (out / "report.json").exists():
        raise ConfigError(f"{out} already holds an audit report: give another --out")
    if run is not None:
        opened = Run.open(run)
        method_name = opened.method
        if method is not None and method != method_name:
            raise ConfigError(f"--run {opened.path} is a run of {method_name}, not {method}")
        values = {**opened.config}
    elif method is not None:
        opened, method_name = None, method
        method_cls = resolve_method(method_name)
        values = {**getattr(method_cls.Options, "run_defaults", {}), **prof.train, **(train_options or {})}
        values["seed"] = seed
        values["device"] = device
        rounds = int(values.get("rounds", 20))
        values.setdefault("knowledge_rounds", ",".join(map(str, audited_rounds(rounds))))
        if "model_group" not in (train_options or {}):
            group = model_group_for(method_name, values)
            if group != values.get("model_group", "cpu5"):
                log(f"note: {method_name} needs one architecture for every client: trained on {group} (set --train model_group=... to choose)")
            values["model_group"] = group
    else:
        raise ConfigError("audit a method (METHOD or pkg.mod:Class) or an existing run (--run DIR)")
    method_cls = resolve_method(method_name, source=None if method is not None else f"{opened.path if opened else ''}/config.json")
    check_method_class(method_cls)
    for note in predict(method_cls):
        log(f"note: {note[1]}")
    for spec in defenses:
        from defenses import parse_defense

        parse_defense(spec)  # one-line error before anything is trained
    if deterministic:
        values["deterministic"] = True  # the trainings here (the references too)
    settings = JobSettings(seed, device, _deterministic(values), data_root)
    refs = references_for(method_cls, compare, method_name)
    for ref in refs:
        resolve_method(ref)
    if method is not None and ":" in method:  # the user named this code: its workers import it as this process did
        pool = dataclasses.replace(pool, plugins=(*pool.plugins, method.partition(":")[0]))
    subjects = [Subject("audited", method_name, run=opened)]
    subjects += [Subject("defended", method_name, [d]) for d in defenses]
    subjects += [Subject("reference", m) for m in refs if m != method_name]
    out.parent.mkdir(parents=True, exist_ok=True)
    try:  # one mkdir decides, atomically, whether this invocation made the folder (and may remove it)
        out.mkdir()
        created = True
    except FileExistsError:
        created = False
    try:
        if pool.count > 1:
            return _audit_in_workers(subjects, values, prof, out, pool, settings, log=log)
        return _audit_subjects(subjects, values, prof, out, settings, progress=progress, log=log)
    except PrivflError:
        if created and not any((out / "runs").glob("*/config.json")):
            shutil.rmtree(out, ignore_errors=True)  # this invocation made it and trained nothing into it: leave no empty folder
        raise


def _deterministic(values: dict[str, Any]) -> bool:
    """Whether the audited training's options ask for deterministic kernels (a run's config, or ``--train``'s text)."""
    try:
        return bool(parse_scalar(values.get("deterministic", False), bool))
    except ValueError:
        raise ConfigError(f"deterministic={values['deterministic']!r}: expected true or false") from None


def _subject_values(subject: Subject, values: dict[str, Any]) -> dict[str, Any]:
    """The run options a subject trains with: the audited ones, or a reference's share of them."""
    base = {k: v for k, v in values.items() if k not in ("method", "defense", "run_name", "out_dir", "options", "progress")}
    if subject.role in ("audited", "defended"):
        return {**base, **({"options": dict(values["options"])} if values.get("options") else {})}
    return reference_values(base, subject.method)


def _audit_in_workers(
    subjects: list[Subject],
    values: dict[str, Any],
    prof: Profile,
    out: Path,
    workers: Workers,
    settings: JobSettings,
    *,
    log: Callable[[str], None],
) -> AuditResult:
    """:func:`_audit_subjects` with the trainings, then the attack jobs, spread over ``workers`` processes
    (no progress bars: several would share one terminal). Outcomes are kept in the sequential order."""
    from attacks.audit_report import write_audit

    start = time.perf_counter()
    log(f"{workers.count} workers, {workers.threads_each()} torch thread(s) each")
    with workers.pool() as pool:
        pending = [s for s in subjects if s.run is None]
        for subject in pending:
            _subject_dir(subject, out)  # refuse an existing run before anything trains
        futures = {id(s): pool.submit(_train, s.method, s.defenses, _subject_values(s, values), out, False) for s in pending}
        for i, subject in enumerate(subjects, 1):
            if subject.run is not None:
                continue
            try:
                run_dir, subject.train_seconds = futures[id(subject)].result()
            except PrivflError as exc:
                if subject.role == "audited":
                    raise
                log(f"  {subject.label}: not trained: {exc}")
                continue
            subject.run = Run(run_dir)
            log(f"[{i}/{len(subjects)}] trained {subject.label} ({subject.role}) in {subject.train_seconds:.1f} s")
        planned = [(s, s.run.path, attack_jobs(s, prof, settings)) for s in subjects if s.run is not None]
        results = {id(j): pool.submit(_attack, str(path), j.arguments, False) for _, path, jobs in planned for j in jobs if isinstance(j, AttackJob)}
        for subject, _, jobs in planned:
            for job in jobs:
                if isinstance(job, AttackOutcome):
                    subject.outcomes.append(job)
                else:
                    _finish(job, results[id(job)].result(), log)
    report, html, json_path = write_audit(out, subjects, prof, seconds=time.perf_counter() - start, seed=settings.seed)
    return AuditResult(report, out, html, json_path, subjects)


def _audit_subjects(
    subjects: list[Subject],
    values: dict[str, Any],
    prof: Profile,
    out: Path,
    settings: JobSettings,
    *,
    progress: bool,
    log: Callable[[str], None],
) -> AuditResult:
    """Train what is not trained yet, attack every subject, write the report."""
    from attacks.audit_report import write_audit

    start = time.perf_counter()
    for i, subject in enumerate(subjects, 1):
        log(f"[{i}/{len(subjects)}] {subject.label} ({subject.role})")
        if subject.run is None:
            try:
                train_subject(subject, _subject_values(subject, values), out, progress=progress, log=log)
            except PrivflError as exc:
                if subject.role == "audited":
                    raise
                log(f"  {subject.label}: not trained: {exc}")
                continue
        attack_run(subject, prof, settings, progress=progress, log=log)
    report, html, json_path = write_audit(out, subjects, prof, seconds=time.perf_counter() - start, seed=settings.seed)
    return AuditResult(report, out, html, json_path, subjects)


__all__ = [
    "PROFILES",
    "AttackOutcome",
    "AuditResult",
    "JobSettings",
    "Profile",
    "Subject",
    "Workers",
    "audit",
    "audited_rounds",
    "predict",
    "reconstruction_psnr",
    "references_for",
]
