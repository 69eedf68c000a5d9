"""``verify_run``: everything that can be checked about a run directory without trusting it.

A run is a measurement; a damaged one must never pass as intact. Three layers, each independent of
the others, so that damage one cannot see another catches:

1. **Files**: no symbolic links or special files anywhere in the run (privfl reads plain files inside
   the run only); ``config.json``, ``run.json``, ``metrics.jsonl``, the checkpoint pointer and the
   partition parse and are of the right shape.
2. **Stores** (:meth:`privfl.capture.store.TensorStore.verify`): every index record well formed, seq
   continuous, the chained hash intact up to the committed head, every blob's checksum, size and
   tensor shapes. A store the run declares (capture on) must exist.
3. **Meaning**: each captured message checked against what the run says happened: its round within
   the run, parties that exist, a direction that matches its parties and the topology (star: client
   to server and back; ring or graph: a node to a live neighbour of that round), a kind the method declares in ``sends``
   for that direction and whose declaration its tensors satisfy, scalar and byte counts that match
   its shapes, an uploader among the round's selected clients, and per round the same message count,
   scalars and bytes as the metrics recorded when the round ran. Every message with ground truth has
   exactly one truth record (same round, client, kind) and no truth record points elsewhere; the
   knowledge store holds only declared kinds of existing clients and rounds; the partition agrees with
   ``partition.json``; the checkpoint's history equals the metrics.

Records written after the last completed round (a killed run) are reported as such: ``--resume``
drops them. Nothing here imports code named in the run: a method given as an import path has its
schedule checked only where its module is already imported (see :func:`privfl.methods.resolve_method`).
"""

from __future__ import annotations

import json
import os
import stat
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from privfl.capture.store import STRAY_TEMP, TensorStore, read_contained
from privfl.channel import summarize_comm
from privfl.errors import PrivflError
from privfl.kinds import KINDS, parse_directions
from privfl.run import client_index

_DTYPES = {str(t).removeprefix("torch."): t for t in (getattr(torch, n) for n in dir(torch)) if isinstance(t, torch.dtype)}


@dataclass
class VerifyReport:
    """Problems found, by area (``files``, ``capture``, ``truth``, ``knowledge``, ``meaning``), plus notes."""

    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    notes: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(self.problems.values())

    def add(self, area: str, problem: str) -> None:
        self.problems[area].append(problem)

    def lines(self) -> list[str]:
        """Human-readable report, one line per store and one per problem."""
        out = []
        for area in ("files", "capture", "truth", "knowledge", "meaning"):
            found = self.problems.get(area, [])
            count = f"{self.counts[area]} records, " if area in self.counts else ""
            out.append(f"{area}: {count}{'OK' if not found else f'{len(found)} problem(s)'}")
            out += [f"  {p}" for p in found[:50]]
            if len(found) > 50:
                out.append(f"  ... and {len(found) - 50} more")
        out += [f"note: {n}" for n in self.notes]
        return out


def _walk_links(run_dir: Path, report: VerifyReport) -> None:
    for dirpath, dirnames, filenames in os.walk(run_dir):  # does not descend into linked folders
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                report.add("files", f"{path} is a symbolic link (a run holds plain files only; privfl does not follow it)")
            elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                report.add("files", f"{path} is not a regular file")
            elif stat.S_ISREG(mode) and STRAY_TEMP.fullmatch(name) and "attacks" not in Path(path).relative_to(run_dir).parts:
                report.add("files", f"{path}: a temporary file a killed write left (--resume removes it)")


def _client_index(name: str, num_clients: int) -> int | None:
    """``client<k>`` of this run (:func:`privfl.run.client_index`, written the one way privfl writes it), else None."""
    if not name.startswith("client") or len(name) > 16:
        return None
    try:
        k = client_index(name)
    except PrivflError:
        return None
    return k if k < num_clients and name == f"client{k}" else None


def _expected_counts(rec: dict[str, Any]) -> tuple[int, int, int] | str:
    """(scalars, paper scalars, bytes) from a record's tensor shapes and dtypes, or why not."""
    scalars = paper = nbytes = 0
    for name, info in rec["tensors"].items():
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            return f"tensor {name!r} has unknown dtype {info['dtype'][:20]!r}"
        n = 1
        for d in info["shape"]:
            n *= d
        scalars += n
        nbytes += n * dtype.itemsize
        if name not in rec["aux"]:
            paper += n
    return scalars, paper, nbytes


def _kind_problems(rec: dict[str, Any]) -> list[str]:
    """The kind declaration's checks on the record's tensor names, shapes, dtypes and meta (no values)."""
    tensors = {}
    for name, info in rec["tensors"].items():
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None or len(info["shape"]) > 8:
            return [f"tensor {name!r} cannot be described"]
        try:
            tensors[name] = torch.empty(info["shape"], dtype=dtype, device="meta")
        except (TypeError, RuntimeError):  # a dimension beyond int64, or a size whose bytes overflow
            return [f"tensor {name!r} has a shape no tensor can have"]
    try:
        return list(KINDS.get(rec["kind"]).problems(tensors, rec["meta"], rec["direction"], tuple(rec["aux"])))
    except (NotImplementedError, RuntimeError):  # a check that reads values: meta tensors have none
        return []


class _RunFacts:
    """What the run's own files say happened, read once (each failure recorded, never raised)."""

    rounds: int
    num_clients: int
    archs: list[Any]
    knowledge_rounds: set[int]
    sends: dict[str, Any]
    metrics: list[dict[str, Any]]

    def __init__(self, run_dir: Path, report: VerifyReport):
        from privfl.run import Run

        self.ok = False
        try:
            self.run = Run(run_dir)
            self.info, self.config = self.run.info, self.run.config
            if not self.info:
                raise PrivflError(f"{run_dir}/run.json is missing")
            self.metrics = self.run.metrics
        except PrivflError as exc:
            report.add("files", str(exc))
            return
        rounds, archs, sends = self.config.get("rounds"), self.info.get("archs"), self.info.get("sends")
        if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
            report.add("files", "config.json: rounds is not a positive integer")
            return
        if not isinstance(archs, list) or not archs or not isinstance(sends, dict):
            report.add("files", "run.json: archs (one per client) and sends (kind -> directions) are missing or malformed")
            return
        self.rounds, self.num_clients, self.sends, self.archs = rounds, len(archs), sends, archs
        self.knowledge_rounds = self._knowledge_rounds()
        self.topology = self._topology(report)
        self.ok = True

    def _knowledge_rounds(self) -> set[int]:
        """The rounds the config stores knowledge at: the final one, every N-th, the listed ones."""
        out = {self.rounds - 1}
        every = self.config.get("knowledge_every")
        if isinstance(every, int) and not isinstance(every, bool) and every > 0:
            out |= {r for r in range(self.rounds) if (r + 1) % every == 0}
        listed = self.config.get("knowledge_rounds")
        if isinstance(listed, str):
            out |= {int(p) for p in listed.split(",") if p.strip().isdigit() and len(p.strip()) < 8}
        return out

    def _topology(self, report: VerifyReport) -> Any:
        from privfl.config import build_config, saved_run_values
        from privfl.methods import resolve_method

        try:
            cls = resolve_method(str(self.config.get("method", "")), source="config.json")
            cfg = build_config(saved_run_values(self.config), getattr(cls, "Options", None))
            if cfg.num_clients != self.num_clients:  # a ring's schedule costs time and memory per node: never for a count that is not the run's
                report.add("files", f"config.json says {str(cfg.num_clients)[:20]} clients, run.json lists {self.num_clients} archs")
                return None
            topology = cls.build_topology(cfg, cls.Options(**cfg.options))
        except PrivflError as exc:
            report.notes.append(f"the schedule (topology, live nodes) was not checked: {exc}")
            return None
        if topology.kind != self.info.get("topology"):
            report.add("files", f"run.json says topology {self.info.get('topology')!r}, the method builds {topology.kind!r}")
        return topology


def _check_capture(facts: _RunFacts, records: list[dict[str, Any]], committed: int | None, report: VerifyReport) -> None:
    last_round = -1
    selected = {m["round"]: m.get("selected") for m in facts.metrics}
    for rec in records:
        seq, rnd = rec["seq"], rec["round"]
        where = f"seq {seq}"
        if rnd >= facts.rounds:
            report.add("meaning", f"{where}: round {rnd}, but the run has rounds 0..{facts.rounds - 1}")
        if rnd < last_round:
            report.add("meaning", f"{where}: round {rnd} after round {last_round} (records reordered)")
        last_round = max(last_round, rnd)
        sender, receiver = rec["sender"], rec["receiver"]
        parties_ok = True
        for party in (sender, receiver):
            if party != "server" and _client_index(party, facts.num_clients) is None:
                report.add("meaning", f"{where}: party {party[:40]!r} is neither the server nor one of client0..client{facts.num_clients - 1}")
                parties_ok = False
        direction = "up" if receiver == "server" else "down" if sender == "server" else "peer"
        if sender == receiver:
            report.add("meaning", f"{where}: {sender} sends to itself")
        if rec["direction"] != direction:
            report.add("meaning", f"{where}: direction {rec['direction'][:10]!r}, but {sender} -> {receiver} is {direction}")
        kind = rec["kind"]
        if kind not in KINDS:
            report.add("meaning", f"{where}: unknown kind {kind[:40]!r}")
            continue
        try:
            allowed = parse_directions(str(facts.sends.get(kind, "")))
        except ValueError:
            allowed = frozenset()
        if direction not in allowed:
            report.add("meaning", f"{where}: {kind} sent {direction}, which the method does not declare (sends: {facts.sends.get(kind, 'nothing')})")
        counts = _expected_counts(rec)
        if isinstance(counts, str):
            report.add("meaning", f"{where}: {counts}")
        elif counts != (rec["scalars"], rec["paper_scalars"], rec["bytes"]):
            stated = f"{rec['scalars']}/{rec['paper_scalars']}/{rec['bytes']}"
            report.add("meaning", f"{where}: scalars/paper scalars/bytes {stated} do not match its tensors {counts}")
        for problem in _kind_problems(rec)[:1]:
            report.add("meaning", f"{where}: {kind} {problem}")
        if not parties_ok or rec["meta"].get("phase") == "setup":
            continue
        topo = facts.topology
        if topo is not None and rnd < facts.rounds:
            if (topo.kind != "star") != (direction == "peer"):
                report.add("meaning", f"{where}: a {direction} message on a {topo.kind} topology")
            elif direction == "peer" and hasattr(topo, "edges"):
                edge = (_client_index(sender, facts.num_clients), _client_index(receiver, facts.num_clients))
                if edge not in topo.edges(rnd):
                    report.add("meaning", f"{where}: {sender} -> {receiver} is not a live {topo.kind} link in round {rnd}")
        chosen = selected.get(rnd)
        if direction == "up" and isinstance(chosen, list) and _client_index(sender, facts.num_clients) not in chosen:
            report.add("meaning", f"{where}: {sender} uploads in round {rnd} but was not selected (selected: {chosen[:10]})")
    # per round: the capture says what the metrics recorded when the round ran
    done = records if committed is None else records[:committed]
    by_round: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for rec in done:
        if rec["meta"].get("phase") != "setup":
            by_round[rec["round"]].append(rec)
    metric_rounds = {m["round"] for m in facts.metrics}
    for m in facts.metrics:
        if "comm" in m and summarize_comm(by_round.get(m["round"], [])) != m["comm"]:
            report.add("meaning", f"round {m['round']}: the captured messages differ from what metrics.jsonl recorded (count, scalars or bytes)")
    for rnd in sorted(set(by_round) - metric_rounds):
        if committed is None or any(r["seq"] < committed for r in by_round[rnd]):
            report.add("meaning", f"round {rnd}: captured messages, but metrics.jsonl has no such round")


def _check_truth(records: list[dict[str, Any]], truth: list[dict[str, Any]], report: VerifyReport) -> None:
    by_seq = {r["seq"]: r for r in records}
    seen: set[int] = set()
    for t in truth:
        msg = by_seq.get(t["message_seq"])
        if msg is None:
            report.add("truth", f"truth seq {t['seq']} refers to message {t['message_seq']}, which the capture does not hold")
            continue
        if t["message_seq"] in seen:
            report.add("truth", f"message {t['message_seq']} has more than one ground-truth record")
        seen.add(t["message_seq"])
        flagged = msg.get("truth") is True or "chain" not in msg  # captures before the flag: not checkable
        if (t["round"], t["client"], t["kind"]) != (msg["round"], msg["sender"], msg["kind"]) or not flagged:
            report.add("truth", f"truth seq {t['seq']} does not match message {t['message_seq']} (round, sender, kind)")
    missing = [r["seq"] for r in records if r.get("truth") and r["seq"] not in seen]
    if missing:
        report.add("truth", f"{len(missing)} message(s) with samples behind them have no ground-truth record (first: seq {missing[0]})")


def _check_partition(run_dir: Path, facts: _RunFacts, report: VerifyReport) -> None:
    from privfl.run import load_partition

    try:
        part = load_partition(run_dir)
    except PrivflError as exc:
        report.add("truth", str(exc))
        return
    path = run_dir / "partition.json"
    try:
        sizes = json.loads(path.read_bytes()) if path.is_file() and not path.is_symlink() else None
    except (ValueError, RecursionError):
        report.add("files", f"{path} is not valid JSON")
        return
    if sizes is None:
        report.add("files", f"{path} is missing (the run writes it with its partition)")
    for split in ("train", "test"):
        have = [int(part[f"{split}_{k}"].numel()) if f"{split}_{k}" in part else None for k in range(facts.num_clients)]
        if None in have:
            report.add("truth", f"partition.safetensors lacks the {split} split of some of the {facts.num_clients} clients")
        elif isinstance(sizes, dict) and sizes.get(f"{split}_sizes") != have:
            report.add("truth", f"partition.safetensors {split} sizes differ from partition.json")
    splits = [t for k, t in part.items() if k != "subset"]
    if splits:  # every sample belongs to at most one client's train or test split
        every = torch.cat([t.to(torch.int64) for t in splits])
        if every.numel() != every.unique().numel():
            report.add("truth", "partition.safetensors names a sample in more than one client split")


def _check_copies(run_dir: Path, facts: _RunFacts, report: VerifyReport) -> None:
    """The files privfl writes twice agree: ``config.toml`` with ``config.json`` (as parsed), ``metrics.csv``
    with ``metrics.jsonl`` (rewritten from it, byte for byte)."""
    from privfl.config import config_toml_data, tomllib
    from privfl.engine import metrics_csv_text

    try:
        toml = read_contained(run_dir, run_dir / "config.toml", "config.toml", limit=1 << 20)
        if tomllib.loads(toml.decode()) != config_toml_data(facts.config):
            report.add("files", "config.toml differs from config.json")
    except PrivflError as exc:
        report.add("files", str(exc))
    except (ValueError, TypeError):  # not UTF-8 or not TOML
        report.add("files", f"{run_dir / 'config.toml'} is not the TOML privfl writes")
    path = run_dir / "metrics.csv"
    if not facts.metrics and not path.exists():
        return  # no round completed yet
    try:
        if read_contained(run_dir, path, "metrics.csv", limit=1 << 28) != metrics_csv_text(facts.metrics).encode():
            report.add("files", "metrics.csv differs from metrics.jsonl")
    except PrivflError as exc:
        report.add("files", str(exc))


def _check_summary(run_dir: Path, facts: _RunFacts, report: VerifyReport) -> None:
    """``summary.json`` (written when the run finished) says what the metrics say."""
    from privfl.runfiles import _read_json

    path = run_dir / "summary.json"
    if not path.exists() and not path.is_symlink():
        if len(facts.metrics) == facts.rounds:
            report.add("files", "summary.json is missing though every round completed (a kill before it was written: --resume writes it)")
        return
    try:
        summary = _read_json(path, "summary.json")
    except PrivflError as exc:
        report.add("files", str(exc))
        return
    rows = facts.metrics
    if not isinstance(summary, dict) or not rows or not all(isinstance(r.get("acc"), (int, float)) for r in rows):
        report.add("files", f"{path} or metrics.jsonl does not hold the run's accuracies")
        return
    from privfl.engine import summary_accuracies

    try:
        expected = {"rounds": len(rows), **summary_accuracies(rows)}
    except (KeyError, TypeError, ValueError):
        report.add("files", "metrics.jsonl's accuracy columns are incomplete")
        return
    if any(summary.get(k) != v for k, v in expected.items()):
        report.add("files", "summary.json's rounds, final or best accuracy differ from metrics.jsonl")


def _check_knowledge(facts: _RunFacts, records: list[dict[str, Any]], report: VerifyReport) -> None:
    declared = facts.info.get("knowledge") or {}
    if not isinstance(declared, dict):
        report.add("files", "run.json: knowledge (kind -> what it grants an attacker) is not an object")
        declared = {}
    for rec in records:
        if rec["kind"] not in declared:
            report.add("knowledge", f"knowledge seq {rec['seq']}: kind {rec['kind'][:40]!r} is not declared in run.json")
        k = _client_index(rec["client"], facts.num_clients)
        if k is None or rec["round"] >= facts.rounds:
            who = f"{rec['client'][:40]!r} at round {rec['round']}"
            report.add("knowledge", f"knowledge seq {rec['seq']}: {who} is not a client and round of this run")
        elif "arch" in rec and rec["arch"] != facts.archs[k]:
            report.add(
                "knowledge", f"knowledge seq {rec['seq']}: {rec['client']}'s model is {facts.archs[k]!r} (run.json), not {str(rec['arch'])[:40]!r}"
            )
        elif rec["round"] not in facts.knowledge_rounds:
            report.add("knowledge", f"knowledge seq {rec['seq']}: round {rec['round']} is not one the run stores knowledge at")
    seen = [(r["kind"], r["client"], r["round"]) for r in records]
    if len(seen) != len(set(seen)):
        report.add("knowledge", "the same client's knowledge is stored twice for one round")


def _check_checkpoint(run_dir: Path, facts: _RunFacts, report: VerifyReport) -> None:
    from privfl.run import load_checkpoint_state, read_checkpoint

    try:
        info = read_checkpoint(run_dir)
        if info is None:
            if facts.metrics:
                report.add("files", "checkpoint/checkpoint.json is missing, though rounds completed")
            return
        load_checkpoint_state(run_dir, info)
    except PrivflError as exc:
        report.add("files", str(exc))
        return
    if info["history"] != facts.metrics:
        report.add("files", "the checkpoint's history differs from metrics.jsonl")
    if facts.metrics and info["round"] != facts.metrics[-1]["round"]:
        report.add("files", f"the checkpoint is of round {info['round']}, metrics.jsonl ends at round {facts.metrics[-1]['round']}")


def verify_run(run_dir: str | Path) -> VerifyReport:
    """Every problem of a run directory (see the module docstring); ``report.ok`` when there is none."""
    run_dir = Path(run_dir)
    report = VerifyReport()
    if run_dir.is_symlink():
        run_dir = run_dir.resolve()  # the user named a link (runs/latest): check what it points at
    _walk_links(run_dir, report)
    facts = _RunFacts(run_dir, report)
    if not facts.ok:
        return report
    rounds = [m["round"] for m in facts.metrics]
    if rounds != list(range(len(rounds))):
        report.add("files", f"metrics.jsonl rounds are not 0..{len(rounds) - 1} in order")
    if (run_dir / "summary.json").exists() and len(rounds) != facts.rounds:
        report.add("files", f"summary.json says the run finished, but metrics.jsonl has {len(rounds)} of {facts.rounds} rounds")
    _check_checkpoint(run_dir, facts, report)
    _check_summary(run_dir, facts, report)
    _check_copies(run_dir, facts, report)
    if not facts.config.get("capture", True):
        report.notes.append("trained with --no-capture: nothing was captured")
        return report
    stores: dict[str, TensorStore] = {}
    for role in ("capture", "truth", "knowledge"):
        try:
            stores[role] = TensorStore(run_dir / role, role)
        except PrivflError as exc:
            report.add(role, f"{exc} (the run was trained with capture, so it must have one)")
    scans = {}
    for role, store in stores.items():
        try:
            scans[role] = store.scan()  # read and chained once, then checked blob by blob
        except PrivflError as exc:
            report.add(role, str(exc))
            continue
        report.problems[role] += store.verify(scans[role])
        report.counts[role] = len(scans[role].records)
    if "capture" in scans:
        cap = scans["capture"]
        _check_capture(facts, cap.records, cap.committed, report)
        if "truth" in scans:
            _check_truth(cap.records, scans["truth"].records, report)
    _check_partition(run_dir, facts, report)
    if "knowledge" in scans:
        _check_knowledge(facts, scans["knowledge"].records, report)
    return report


__all__ = ["VerifyReport", "verify_run"]
