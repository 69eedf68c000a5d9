"""The in-process engine: star, ring or neighbour-graph topology, rounds, partial participation, evaluation, checkpoints.

One process, models kept in memory on the chosen device, data resident as uint8. Every random draw
is derived from (seed, purpose, round, client) (see :mod:`privfl.seeding`), so ``--resume`` after a
kill repeats the remaining rounds exactly: same metrics, same capture. The method's topology
(:mod:`privfl.topology`) decides who is live in a round: every client of a star (then ``--join-ratio``
samples from them), the live nodes of a ring or graph (failed nodes are skipped; they take no join ratio).
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from privfl.capture.store import TensorStore, atomic_write_safetensors, atomic_write_text, stray_temps
from privfl.channel import Channel, summarize_comm
from privfl.config import TrainConfig, save_config
from privfl.determinism import deterministic_kernels, prepare_cublas
from privfl.errors import ConfigError, PrivflError
from privfl.fl.layout import compute_layout
from privfl.fl.method import EXPOSURES, global_test_indices, mean_metrics
from privfl.fl.parallel import ordered_map, resolve_client_workers
from privfl.fl.shared import check_bound, own_tensors
from privfl.fl.trainer import LocalTrainer
from privfl.methods import Client, DataView, FLEnv, FLMethod, KnowledgeRecorder, ModelRequest, check_method_class, resolve_method
from privfl.run import ALIASES_KEY, Run, load_checkpoint_state, load_partition, read_checkpoint
from privfl.runs import RunClaim, latest_target, mark_latest, unmark_latest
from privfl.seeding import numpy_rng, seed_global

#: per-round communication columns of metrics.csv, averaged per round in summary.json
COMM_COLUMNS = (
    "upload_scalars",
    "upload_scalars_full",
    "upload_bytes",
    "broadcast_scalars",
    "broadcast_scalars_full",
    "broadcast_bytes",
    "peer_scalars",
    "peer_bytes",
)

#: the threat model each kind of exposed knowledge stands for (declared with the method contract)
THREAT_MODELS = EXPOSURES


def resolve_device(name: str) -> torch.device:
    """``auto`` (the GPU when present), ``cpu``, ``cuda`` or ``cuda:N``; anything else (``meta``, ``mps``,
    a GPU that is not there) is a one-line :class:`ConfigError`."""
    text = str(name).strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    head, colon, index = text.partition(":")
    if head not in ("cpu", "cuda") or (colon and (head == "cpu" or not index.isdigit())):
        raise ConfigError(f"unknown device {name!r}; accepted: auto, cpu, cuda, cuda:N")
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name} requested but no CUDA GPU is available (use --device auto or cpu)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"device {name} requested but only {count} CUDA GPU(s) exist (cuda:0..cuda:{count - 1})")
    return device


class TrainCallback:
    """Hooks into a training run, given explicitly to :func:`train` / :func:`resume` (never through the
    environment). Subclass and override what you need; every method is a no-op by default.

    ``on_message(message, record)``: after each message the channel delivered (the receiver's copy and
    its capture record); ``on_round_end(round, entry)``: after a round's metrics and checkpoint are
    written. Tests use ``on_message`` to kill a run mid-round and check that ``--resume`` is exact.
    """

    def on_message(self, message: Any, record: dict[str, Any]) -> None:
        pass

    def on_round_end(self, rnd: int, entry: dict[str, Any]) -> None:
        pass


class Trainer:
    #: a method with stateless clients gets meta-device client models that the setup broadcast binds
    #: (the Flower engine's server keeps ordinary ones: it loads the nodes' states into them)
    builds_clients_from_broadcast: bool = True

    def __init__(
        self, cfg: TrainConfig, run_dir: Path, *, resume: bool = False, callbacks: Sequence[TrainCallback] = (), claim: RunClaim | None = None
    ):
        from privfl.data import load_dataset, plot_partition
        from privfl.data.partition import PARTITIONS, ClientSplit
        from privfl.models import assign_archs

        self.cfg, self.run_dir = cfg, run_dir
        self.callbacks = list(callbacks)
        self.method_cls = resolve_method(cfg.method)
        check_method_class(self.method_cls)
        self.device = resolve_device(cfg.device)
        if cfg.deterministic:
            prepare_cublas(self.device)  # before this run's first CUDA call
        if not 0 < cfg.join_ratio <= 1:
            raise ConfigError(f"--join-ratio must be in (0, 1], got {cfg.join_ratio}")
        if cfg.rounds < 1 or cfg.num_clients < 1:
            raise ConfigError("--rounds and --num-clients must be at least 1")
        archs = assign_archs(cfg.model_group, cfg.num_clients)  # checks the group name early
        PARTITIONS.get(cfg.partition)  # and the partition scheme, before the run folder exists
        knowledge_rounds = parse_rounds(cfg.knowledge_rounds, cfg.rounds)
        opts = self.method_cls.Options(**cfg.options)
        self.topology = self.method_cls.build_topology(cfg, opts)
        if self.topology.kind != "star" and cfg.join_ratio != 1.0:
            raise ConfigError(f"{cfg.method} runs on a {self.topology.kind}: every live node takes part, so --join-ratio must be 1")
        for rnd in range(cfg.rounds):  # e.g. listed failures that take every ring node down in some round
            self.topology.alive(rnd)

        dataset = load_dataset(cfg.dataset, cfg.data_root, cfg.download)
        self.dataset = dataset
        images, labels, subset = subsample(dataset, cfg)
        self.labels = labels

        truth_dir = run_dir / "truth"
        if resume:  # nothing is read before the run is ours: another process may be writing it
            self.claim = self._claim(run_dir, claim, resume)
            saved = load_partition(run_dir)
            saved.pop("subset", None)
            split = ClientSplit.from_tensors(saved)
        else:
            split = client_split(labels, cfg)
        self.split = split
        if not resume:  # everything checkable is checked: create the folder, exclusively
            self.claim = self._claim(run_dir, claim, resume)

        # the three stores, kept apart (docs/usage.md): messages / attacker knowledge / ground truth
        # (a resumed run must find them: recreating a deleted store would hide the loss)
        self.capture = TensorStore(run_dir / "capture", "capture", create=not resume) if cfg.capture else None
        self.knowledge_store = TensorStore(run_dir / "knowledge", "knowledge", create=not resume) if cfg.capture else None
        self.truth = TensorStore(truth_dir, "truth", create=not resume) if cfg.capture else None
        truth_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            tensors = split.to_tensors()
            if subset is not None:
                tensors["subset"] = torch.from_numpy(subset)
            save_file(tensors, str(truth_dir / "partition.safetensors"))
            counts = split.counts(labels.numpy(), dataset.num_classes)
            atomic_write_text(
                run_dir / "partition.json",
                json.dumps(
                    {
                        "scheme": cfg.partition,
                        "counts": counts.tolist(),
                        "class_names": list(dataset.class_names),
                        "train_sizes": [len(t) for t in split.train],
                        "test_sizes": [len(t) for t in split.test],
                    }
                )
                + "\n",
            )
            plot_partition(
                counts,
                run_dir / "partition.png",
                class_names=list(dataset.class_names),
                title=f"{cfg.dataset}: {cfg.partition} partition, {cfg.num_clients} clients",
            )

        self.data = DataView(images, labels, dataset.mean, dataset.std, self.device)
        clients = []
        # stateless clients get every weight from the setup broadcast: their models are built without
        # storage or initial draws (meta tensors) and alias the broadcast once it arrives
        for k, arch in enumerate(archs):
            request = ModelRequest(arch, k, dataset.channels, dataset.num_classes, dataset.image_size, cfg, opts)
            if self.clients_from_broadcast:
                with torch.device("meta"):
                    model = self.method_cls.build_client_model(request)
            else:
                seed_global(cfg.seed, "init", f"arch:{arch}" if cfg.same_init else k)  # --same-init: one draw per architecture
                model = self.method_cls.build_client_model(request).to(self.device)
            clients.append(
                Client(k, arch, model, torch.as_tensor(split.train[k], device=self.device), torch.as_tensor(split.test[k], device=self.device))
            )
        self.clients = clients
        from defenses import build_defenses

        self.defenses = build_defenses(cfg.defense)
        self.channel = Channel(
            self.capture,
            self.truth,
            mods=self.defenses,
            method=cfg.method,
            sends=self.method_cls.sends,
            observers=[cb.on_message for cb in self.callbacks],
        )
        self.knowledge = KnowledgeRecorder(self.knowledge_store, cfg.rounds - 1, cfg.knowledge_every, knowledge_rounds)
        env = FLEnv(
            cfg, opts, clients, self.data, dataset.num_classes, self.device, self.channel, self.knowledge, self.topology, LocalTrainer(cfg, self.data)
        )
        env.score_personal = self.score_personal
        #: clients trained and evaluated at once (--client-workers): 1 unless the method declares parallel_clients
        self.client_workers = resolve_client_workers(cfg.client_workers, self.device) if self.method_cls.clients_in_parallel() else 1
        env.client_workers = self.client_workers
        #: client name -> its --eval personal hits, scored right after its last local training (stateless clients)
        self.personal_hits: dict[str, tuple[int, int, int | None]] = {}
        self.method: FLMethod = self.method_cls(env)
        self.history: list[dict[str, Any]] = []
        self.start_round = 0

    @property
    def clients_from_broadcast(self) -> bool:
        """Client models are meta-device shells that alias the method's broadcast (stateless clients, in-process)."""
        return self.method_cls.stateless_clients and self.builds_clients_from_broadcast

    @staticmethod
    def _claim(run_dir: Path, claim: RunClaim | None, resume: bool) -> RunClaim:
        if claim is None:  # a Trainer built directly (tests, benchmarks) claims its folder itself
            claim = RunClaim(run_dir)
            claim.acquire(create=not resume and not run_dir.exists())
        else:
            claim.acquire(create=not resume)
        return claim

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, rnd: int) -> None:
        """Client models + method state as safetensors, then a JSON pointer; only the latest kept."""
        ckpt = self.run_dir / "checkpoint"
        ckpt.mkdir(exist_ok=True)
        state, aliases = dedupe_views(self.checkpoint_tensors())
        name = f"state-r{rnd:05d}.safetensors"
        metadata = {ALIASES_KEY: json.dumps(aliases)} if aliases else None  # inside the file: the sha256 covers them
        sha256 = atomic_write_safetensors(ckpt / name, {k: v.detach().contiguous().cpu() for k, v in state.items()}, metadata)
        atomic_write_text(
            ckpt / "checkpoint.json",
            json.dumps(
                {
                    "round": rnd,
                    "file": name,
                    "sha256": sha256,  # verify and --resume check the weights against it
                    "history": self.history,
                    "defenses": [d.state() for d in self.defenses],
                }
            )
            + "\n",
        )
        for old in ckpt.glob("state-r*.safetensors"):
            if old.name != name:
                old.unlink()

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds: every client's model, the method's server state, and what each client
        keeps beside its model (:meth:`FLMethod.client_state`: the personal parts ``--eval personal`` swaps
        in, the method's per-client tensors), so a resumed run continues as if never stopped."""
        state = {}
        for c in self.clients:
            state.update({f"{c.name}.{k}": v.detach() for k, v in c.model.state_dict().items()})
        state.update({f"method.{k}": v for k, v in self.method.server_state().items()})
        taken = {v.untyped_storage().data_ptr() for v in state.values()}
        for c in self.clients:
            for k, v in self.method.client_state(c).items():
                # a method may keep a client's tensor in its server state as well (one process holds both):
                # safetensors stores each storage once, so such a tensor is copied
                shared = v.untyped_storage().data_ptr() in taken
                state[f"clientstate.{c.name}/{k}"] = v.detach().clone() if shared else v.detach()
                taken.add(state[f"clientstate.{c.name}/{k}"].untyped_storage().data_ptr())
        if self.personal_hits:  # (client, correct, total, Global-T correct or -1) for --eval personal
            rows = []
            for c in self.clients:
                if c.name in self.personal_hits:
                    correct, total, global_t = self.personal_hits[c.name]
                    rows.append([c.index, correct, total, -1 if global_t is None else global_t])
            state["engine.personal_hits"] = torch.tensor(rows, dtype=torch.int64)
        return state

    def load_checkpoint(self) -> None:
        info = read_checkpoint(self.run_dir)
        if info is None:
            self.start_round = 0  # killed before the first round completed: start over
            self._truncate_stores(-1)
            return
        state = load_checkpoint_state(self.run_dir, info, str(self.device))
        groups: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
        for c in self.clients:
            prefix = f"{c.name}."
            tensors = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            if self.clients_from_broadcast:  # clients stored once (checkpoint aliases) alias one copy again, as before the kill
                self.method.share_state(c, groups.setdefault(tuple(id(v) for v in tensors.values()), tensors))  # type: ignore[attr-defined]
            else:
                c.model.load_state_dict(tensors)
        self.method.load_server_state({k[7:]: v for k, v in state.items() if k.startswith("method.")})
        hits = state.get("engine.personal_hits")
        self.personal_hits = {}
        for index, correct, total, global_t in [] if hits is None else hits.tolist():
            self.personal_hits[f"client{index}"] = (correct, total, None if global_t < 0 else global_t)
        self.method.personal = {}
        kept: dict[str, dict[str, torch.Tensor]] = {c.name: {} for c in self.clients}
        for key, value in state.items():
            if key.startswith("clientstate."):
                client, name = key.removeprefix("clientstate.").split("/", 1)
                kept[client][name] = value
            elif key.startswith("personal."):  # checkpoints written before client_state was saved
                client, name = key.removeprefix("personal.").split("/", 1)
                kept[client][f"personal/{name}"] = value
        for c in self.clients:
            if kept[c.name]:
                self.method.load_client_state(c, kept[c.name])
        self.history = info["history"]
        for defense, state in zip(self.defenses, info.get("defenses", [])):
            defense.load_state(state)
        self.start_round = info["round"] + 1
        self._truncate_stores(info["round"])

    def _truncate_stores(self, last_round: int) -> None:
        """Drop what a killed round wrote, so the resumed round writes it again, identically.

        Only what a kill leaves is repaired (a partial last line, the interrupted round's records);
        the repairs are listed in ``self.repairs``. Any other damage refuses the resume (CaptureError)."""
        self.repairs: list[str] = []
        capture_kept: set[int] = set()
        if self.capture is not None:
            n, repairs = self.capture.truncate(lambda r: r["round"] <= last_round)
            self.repairs += repairs
            capture_kept = set(range(n))
            self.channel._seq = n
        if self.truth is not None:
            self.repairs += self.truth.truncate(lambda r: r["message_seq"] in capture_kept)[1]
        if self.knowledge_store is not None:
            self.repairs += self.knowledge_store.truncate(lambda r: r["round"] <= last_round)[1]
        stray = stray_temps(self.run_dir, recursive=False) + [
            p for sub in ("checkpoint", "capture", "truth", "knowledge") for p in stray_temps(self.run_dir / sub)
        ]
        for path in stray:  # privfl's own temporary files (`.NAME.XXXX.tmp`): a kill came between write and rename
            path.unlink()
            self.repairs.append(f"removed {path.relative_to(self.run_dir)} (a write the kill cut short)")

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Test accuracy under the run's protocol(s) (``--eval``): ``acc``/``acc_std``/``client_acc`` for
        the main one (global, or personal when only that is asked), plus ``acc_personal*`` with ``both``.
        A method that has no personal parts and no personal predictor scores the same under both, so
        it is evaluated once."""
        protocol = self.cfg.eval
        flags = (protocol == "personal",) if protocol != "both" else ((False, True) if self.personal_differs else (False,))
        hits = self.collect_hits(flags)
        union = self.global_test_idx
        size = len(union) if union is not None else None
        main = accuracy_metrics(hits[protocol == "personal"], size)
        if protocol != "both":
            return main
        personal = accuracy_metrics(hits[True], size) if self.personal_differs else main
        return {**main, **{_personal_key(k): v for k, v in personal.items()}}

    def collect_hits(self, flags: tuple[bool, ...]) -> dict[bool, list[tuple[int, int, int | None]]]:
        """Every client's :func:`client_hits` under each protocol in ``flags`` (True: personal), in client order;
        personal hits scored right after local training (:meth:`score_personal`) are taken as they are."""
        union = self.global_test_idx
        bs = self.cfg.eval_batch_size
        out = {}
        for flag in flags:
            cached = self.personal_hits if flag else {}
            todo = [c for c in self.clients if c.name not in cached]
            scored = {
                c.name: hits
                for c, hits in ordered_map(
                    lambda c: client_hits(self.method, c, self.data, bs, personal=flag, union=union),  # noqa: B023 (consumed in this iteration)
                    todo,
                    self.client_workers,
                    what=f"{self.cfg.method}'s evaluation",
                    ahead=len(todo),
                )
            }
            out[flag] = [cached.get(c.name) or scored[c.name] for c in self.clients]
        return out

    def score_personal(self, client: Client) -> None:
        """``--eval personal`` of a stateless client's model as local training left it (what the copy the
        method no longer keeps would give at the end of the round), in eval mode, then back to its mode."""
        if self.cfg.eval == "global":
            return
        training = client.model.training
        union = self.global_test_idx
        self.personal_hits[client.name] = client_hits(self.method, client, self.data, self.cfg.eval_batch_size, personal=True, union=union)
        client.model.train(training)

    @property
    def global_test_idx(self) -> torch.Tensor | None:
        """``--global-test N`` (or the method's :meth:`FLMethod.global_test_size`): a fixed seeded subset of the
        union of the clients' test sets (DRDFL's Global-T set, its Sec. V-A: "the union of all clients' local
        test data"), the same every round."""
        size = type(self.method).global_test_size(self.cfg, self.method.opts)
        if size <= 0:
            return None
        if not hasattr(self, "_global_test_idx"):
            self._global_test_idx = global_test_indices([c.test_idx for c in self.clients], size, self.cfg.seed)
        return self._global_test_idx

    @property
    def personal_differs(self) -> bool:
        m = type(self.method)
        return bool(m.personal_parts) or m.predict_personal is not FLMethod.predict_personal

    def select(self, rnd: int) -> list[Client]:
        if self.topology.kind != "star":  # ring or graph: every live node
            return [self.clients[i] for i in self.topology.alive(rnd)]
        k = max(1, int(round(self.cfg.join_ratio * len(self.clients))))
        if k == len(self.clients):
            return list(self.clients)
        chosen = np.sort(numpy_rng(self.cfg.seed, "select", rnd).choice(len(self.clients), k, replace=False))
        return [self.clients[i] for i in chosen]

    # ------------------------------------------------------------------ the loop
    def play_round(self, rnd: int, selected: list[Client]) -> dict[str, float]:
        """One round of the method; returns its metrics (``train_loss``, ...). The Flower engine plays the
        client side on the nodes instead (:class:`privfl.flower.server.FlowerTrainer`)."""
        return self.method.run_round(rnd, selected)

    def play_setup(self) -> None:
        """The method's setup exchange before round 0 (captured as round 0, meta phase=setup). The Flower
        engine plays its client side on the nodes instead."""
        self.method.run_setup()

    def take_notes(self) -> list[dict[str, float]]:
        """The metrics clients noted since the last call (:meth:`FLMethod.note`), in client order."""
        notes, self.method.noted = self.method.noted, []
        return [metrics for _, metrics in sorted(notes, key=lambda note: note[0])]  # stable: a client's notes in order

    def run(self) -> dict[str, Any]:
        with deterministic_kernels(self.cfg.deterministic):
            return self._run_rounds()

    def _run_rounds(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        cfg = self.cfg
        if self.start_round == 0:
            self.play_setup()
            setup_records = self.channel.end_round()
        else:
            setup_records = []
        bar = tqdm(
            range(self.start_round, cfg.rounds),
            desc=cfg.method,
            unit="round",
            initial=self.start_round,
            total=cfg.rounds,
            disable=not cfg.progress,
            dynamic_ncols=True,
        )
        diverged = nonfinite_metrics(self.history)  # a resumed run does not announce its earlier rounds again
        for rnd in bar:
            t0 = time.perf_counter()
            selected = self.select(rnd)
            extra = self.play_round(rnd, selected)
            records = setup_records + self.channel.end_round()
            setup_records = []
            if self.knowledge_store is not None:
                self.knowledge_store.flush()
            ev = self.evaluate()
            check_bound(c.model for c in self.clients)  # no write went around a shared broadcast's copy-on-write
            notes = self.take_notes()
            if notes:  # client-side metrics of this round noted outside client_round (e.g. FedALA's merge)
                extra = {**extra, **mean_metrics(notes)}
            comm = summarize_comm(r for r in records if r.get("meta", {}).get("phase") != "setup")
            entry: dict[str, Any] = {
                "round": rnd,
                "acc": ev["acc"],
                "acc_std": ev["acc_std"],
                **{k: ev[k] for k in ("acc_personal", "acc_personal_std", *GLOBAL_T_KEYS) if k in ev},
                **{k: float(v) for k, v in extra.items()},
                "selected": [c.index for c in selected],
                "upload_scalars": comm.get("up", {}).get("paper_scalars", 0),
                "upload_scalars_full": comm.get("up", {}).get("scalars", 0),
                "upload_bytes": comm.get("up", {}).get("bytes", 0),
                "broadcast_scalars": comm.get("down", {}).get("paper_scalars", 0),
                "broadcast_scalars_full": comm.get("down", {}).get("scalars", 0),
                "broadcast_bytes": comm.get("down", {}).get("bytes", 0),
                "peer_scalars": comm.get("peer", {}).get("paper_scalars", 0),  # client to client (ring, graph)
                "peer_bytes": comm.get("peer", {}).get("bytes", 0),
                "comm": comm,
                "client_acc": ev["client_acc"],
                **{k: ev[k] for k in ("client_acc_personal", "client_global_t", "client_global_t_personal") if k in ev},
                **({"defenses": {d.spec: d.report() for d in self.defenses}} if self.defenses else {}),
                "seconds": round(time.perf_counter() - t0, 3),
            }
            self.history.append(entry)
            for key in nonfinite_metrics([entry]).keys() - diverged.keys():
                diverged[key] = rnd
                bar.write(f"privfl: round {rnd}: {key} is {entry[key]} (training diverged; summary.json 'nonfinite')", file=sys.stderr)
            self.write_metrics()
            self.save_checkpoint(rnd)
            for cb in self.callbacks:
                cb.on_round_end(rnd, entry)
            bar.set_postfix(acc=f"{ev['acc']:.4f}", loss=f"{extra.get('train_loss', float('nan')):.3f}")
        bar.close()
        return self.write_summary()

    def write_metrics(self) -> None:
        lines = "".join(json.dumps(h, sort_keys=True) + "\n" for h in self.history)
        atomic_write_text(self.run_dir / "metrics.jsonl", lines)
        atomic_write_text(self.run_dir / "metrics.csv", metrics_csv_text(self.history))

    def write_summary(self) -> dict[str, Any]:
        final = self.history[-1]
        rounds = len(self.history)
        summary = {
            "method": self.cfg.method,
            "dataset": self.cfg.dataset,
            "clients": self.cfg.num_clients,
            "rounds": rounds,
            "eval": self.cfg.eval,
            **summary_accuracies(self.history),
            "nonfinite": nonfinite_metrics(self.history),
            "per_round": {k: sum(h.get(k, 0) for h in self.history) / rounds for k in COMM_COLUMNS},
            "last_round_comm": final["comm"],
            "train_seconds": round(sum(h["seconds"] for h in self.history), 2),
            "defenses": final.get("defenses", {}),
            "capture_bytes": dir_size(self.run_dir / "capture"),
            "knowledge_bytes": dir_size(self.run_dir / "knowledge"),
            "run_dir": str(self.run_dir),
        }
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary


def dedupe_views(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the tensors to store, {key: key it is stored under}): a tensor that is the very same view as an
    earlier one (client models aliasing one broadcast) is stored once and named as an alias in the
    checkpoint file's metadata (:func:`privfl.run.load_checkpoint_state` restores it)."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple[Any, ...], str] = {}
    for key, value in state.items():
        view = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride(), value.dtype)
        if value.numel() and view in first:
            aliases[key] = first[view]
        else:
            first.setdefault(view, key)
            kept[key] = value
    return kept, aliases


def _part(client: Client, part: str) -> torch.nn.Module:
    return client.model.get_submodule(part) if part else client.model


@torch.no_grad()
def client_hits(
    method: FLMethod, client: Client, data: DataView, batch_size: int, *, personal: bool, union: torch.Tensor | None
) -> tuple[int, int, int | None]:
    """(correct, test samples, correct on the Global-T set or None) of one client under one protocol.

    ``personal``: the client's personal parts as they were after its last local training are swapped in
    for the evaluation (then swapped back). Runs where the client lives (this process, or its Flower node)."""
    with compute_layout(client.model, method.cfg.memory_format):
        client.model.eval()
        kept = method.personal.get(client.name, {}) if personal else {}
        if kept:  # swapping the personal parts in writes into the model: one aliasing a broadcast takes its own copy
            own_tensors(client.model)  # (a Flower node's stateless client keeps its personal copy: no engine scores it)
        current = {part: {k: v.clone() for k, v in _part(client, part).state_dict().items()} for part in kept}
        for part, tensors in kept.items():
            _part(client, part).load_state_dict(tensors)
        predict = method.predict_personal if personal else method.predict

        def hits(idx: torch.Tensor) -> int:
            return sum(int((predict(client, x).argmax(1) == y).sum()) for x, y in data.batches(idx, batch_size))

        out = (hits(client.test_idx), len(client.test_idx), hits(union) if union is not None else None)
        for part, tensors in current.items():
            _part(client, part).load_state_dict(tensors)
        return out


def accuracy_metrics(hits: Sequence[tuple[int, int, int | None]], union_size: int | None = None) -> dict[str, Any]:
    """The round's accuracy entries from every client's :func:`client_hits`, in client order: the mean is
    sample-weighted (sum correct / sum test samples), the std across clients (HtFLlib's convention);
    with a Global-T set, Local-T and Global-T are unweighted means over clients (DRDFL)."""
    correct = np.array([h[0] for h in hits])
    totals = np.array([h[1] for h in hits])
    accs = correct / np.maximum(totals, 1)
    out: dict[str, Any] = {"acc": float(correct.sum() / max(totals.sum(), 1)), "acc_std": float(accs.std()), "client_acc": accs.round(6).tolist()}
    if hits and hits[0][2] is not None:
        size = union_size if union_size is not None else 0
        global_accs = np.array([h[2] for h in hits]) / max(size, 1)
        out |= {"local_t": float(accs.mean()), "global_t": float(global_accs.mean()), "client_global_t": global_accs.round(6).tolist()}
    return out


def subsample(dataset: Any, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor, np.ndarray | None]:
    """(images, labels, the kept indices or None): the run's seeded ``--subsample`` of the dataset."""
    return subsample_of(dataset, cfg.subsample, cfg.seed)


def subsample_of(dataset: Any, size: int | None, seed: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray | None]:
    """:func:`subsample` from its two settings (a Flower node caches the data by them)."""
    images, labels = dataset.images, dataset.labels
    if size is None or size >= len(labels):
        return images, labels, None
    subset = np.sort(numpy_rng(seed, "subsample").permutation(len(labels))[:size])
    return images[subset], labels[subset], subset


def client_split(labels: torch.Tensor, cfg: TrainConfig) -> Any:
    """The run's partition of ``labels`` over clients, each split into train and test (a ClientSplit)."""
    from privfl.data.partition import partition_indices, split_train_test

    parts = partition_indices(
        labels.numpy(),
        cfg.num_clients,
        cfg.partition,
        cfg.seed,
        alpha=cfg.alpha,
        classes_per_client=cfg.classes_per_client,
        imbalance_factor=cfg.imbalance_factor,
        min_samples=cfg.min_samples,
        balanced=cfg.balanced,
    )
    return split_train_test(parts, cfg.train_fraction, cfg.seed)


#: the Local-T/Global-T columns of ``--global-test`` (unweighted means over clients), per protocol
GLOBAL_T_KEYS = ("local_t", "global_t", "local_t_personal", "global_t_personal")


def _personal_key(key: str) -> str:
    """The personal protocol's name for a metric: acc -> acc_personal, global_t -> global_t_personal."""
    if key.startswith(("acc", "client_acc")):
        return key.replace("acc", "acc_personal", 1)
    return key + "_personal"


def summary_accuracies(history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Final and best accuracy (± std across clients) of each protocol in the metrics: ``final_acc``,
    ``best_acc``, ``best_round``, and ``*_personal`` when the run evaluated both (verify compares them)."""
    out: dict[str, Any] = {}
    for suffix in ("", "_personal"):
        key = "acc" + suffix
        rows = [h for h in history if key in h]
        if not rows:
            continue
        best = max(rows, key=lambda h: h[key])
        out.update(
            {
                f"final_acc{suffix}": rows[-1][key],
                f"final_acc{suffix}_std": rows[-1][f"{key}_std"],
                f"best_acc{suffix}": best[key],
                f"best_acc{suffix}_std": best[f"{key}_std"],
                f"best_round{suffix}": best["round"],
            }
        )
    for key in GLOBAL_T_KEYS:  # --global-test: the last round's Local-T / Global-T
        if history and key in history[-1]:
            out[f"final_{key}"] = history[-1][key]
    return out


def nonfinite_metrics(history: Sequence[dict[str, Any]]) -> dict[str, int]:
    """{metric: first round it was NaN or infinite} over the rounds' scalar metrics (a loss that diverged).
    Why: a run whose training diverged still ends and scores its models; this says where it went wrong."""
    first: dict[str, int] = {}
    for h in history:
        for key, value in h.items():
            if isinstance(value, float) and not math.isfinite(value) and key not in first:
                first[key] = h["round"]
    return first


def metrics_csv_text(history: Sequence[dict[str, Any]]) -> str:
    """``metrics.csv``: the main per-round columns of ``metrics.jsonl`` (verify compares the two)."""
    cols = ["round", "acc", "acc_std", "acc_personal", "acc_personal_std", *GLOBAL_T_KEYS, "train_loss", "server_loss", *COMM_COLUMNS, "seconds"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, cols, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(history)
    return buf.getvalue()


def parse_rounds(text: str, rounds: int) -> frozenset[int]:
    """``"0,9"`` -> {0, 9}; each within 0..rounds-1, else a one-line error."""
    out = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit() or int(part) >= rounds:
            raise ConfigError(f"--knowledge-rounds takes rounds 0..{rounds - 1} as a comma list, got {part!r}")
        out.add(int(part))
    return frozenset(out)


def knowledge_rounds_text(cfg: TrainConfig) -> str:
    """Which rounds' knowledge a run stores, in words (run.json)."""
    parts = ["final"]
    if cfg.knowledge_every:
        parts.append(f"every {cfg.knowledge_every}")
    extra = sorted(parse_rounds(cfg.knowledge_rounds, cfg.rounds))
    if extra:
        parts.append("rounds " + ",".join(map(str, extra)))
    return " and ".join(parts)


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def new_run_dir(cfg: TrainConfig) -> Path:
    """The folder a new run will be created in: one plain name inside ``--out-dir`` that does not
    exist yet. A run that fails while setting up is removed with ``rmtree``, so it must be a folder
    this invocation creates: never ``..``, a nested path, or a folder that is already there."""
    name = cfg.run_name or f"{cfg.method.replace(':', '.').replace('/', '.')}-{cfg.dataset}-{datetime.now():%Y%m%d-%H%M%S}"
    if name in ("", ".", "..") or "/" in name or "\\" in name or name.startswith("."):
        raise ConfigError(f"--run-name must be a plain folder name (no '/', not starting with '.'), got {name!r}")
    path = Path(cfg.out_dir) / name
    if (path / "config.json").exists():
        raise ConfigError(f"run directory {path} already exists (choose another --run-name, or --resume it)")
    if path.exists() or path.is_symlink():
        raise ConfigError(f"{path} already exists and is not a run: choose another --run-name (privfl never writes into it)")
    return path


def write_run_info(trainer: Trainer) -> None:
    """What crossed the wire and what an attacker may know, declared for attacks to check."""
    m = trainer.method_cls
    info = {
        "method": trainer.cfg.method,
        "paper": m.paper,
        "sends": m.sends,
        "topology": trainer.topology.kind,
        "engine": trainer.cfg.engine,
        "knowledge": {
            kind: {
                "rounds": knowledge_rounds_text(trainer.cfg),
                "threat_model": THREAT_MODELS[kind],
            }
            for kind in m.exposes
        }
        if trainer.cfg.capture
        else {},
        "archs": [c.arch for c in trainer.clients],
        "dataset": {
            "name": trainer.cfg.dataset,
            "num_classes": trainer.dataset.num_classes,
            "channels": trainer.dataset.channels,
            "image_size": trainer.dataset.image_size,
            "mean": list(trainer.dataset.mean),
            "std": list(trainer.dataset.std),
            "class_names": list(trainer.dataset.class_names),
        },
        "stores": {"capture": "capture/", "knowledge": "knowledge/", "ground_truth": "truth/"},
    }
    atomic_write_text(trainer.run_dir / "run.json", json.dumps(info, indent=2) + "\n")


def train_with(trainer_cls: type[Trainer], cfg: TrainConfig, run_dir: Path, *, callbacks: Sequence[TrainCallback] = (), grid: Any = None) -> Run:
    """Train ``cfg`` with ``trainer_cls`` into the new folder ``run_dir``; returns the finished :class:`~privfl.run.Run`.
    Which trainer runs a config (in-process or Flower) is chosen above this module, in :func:`privfl.train.train`,
    so the engine never imports the Flower trainer built on it.

    The folder is created by this call, exclusively (:class:`~privfl.runs.RunClaim`), after every
    check that needs no folder; only a folder this call created is ever removed."""
    claim = RunClaim(run_dir)
    try:
        trainer = trainer_cls(cfg, run_dir, callbacks=callbacks, claim=claim, **({"grid": grid} if grid is not None else {}))
        save_config(cfg, run_dir)
        write_run_info(trainer)
    except BaseException:
        # bad input found while setting up (impossible partition, ...), or a full disk before the run
        # could be resumed (no config.json yet): leave nothing behind, so the name is free again
        claim.discard()
        raise
    try:
        previous_latest = latest_target(run_dir.parent)
        mark_latest(run_dir)
        try:
            trainer.run()
        except PrivflError:
            # a method that breaks its contract (a malformed message) fails in its first round: nothing
            # worth resuming exists yet, so the run this call created goes, and so does `latest` pointing at it
            if not (run_dir / "checkpoint" / "checkpoint.json").exists():
                unmark_latest(run_dir, previous_latest)
                claim.discard()
            raise
    finally:
        claim.release()
    return Run(run_dir)


def resume_with(trainer_cls: type[Trainer], run_dir: Path, cfg: TrainConfig, *, callbacks: Sequence[TrainCallback] = ()) -> Run:
    """Continue a killed run from its last complete round with ``trainer_cls`` (chosen by :func:`privfl.train.resume`).

    What the kill left half-done is repaired and reported on stderr; any other damage to the run's
    stores refuses the resume with a one-line error (run ``python -m privfl.capture verify``)."""
    claim = RunClaim(run_dir)
    try:
        trainer = trainer_cls(cfg, run_dir, resume=True, callbacks=callbacks, claim=claim)
        trainer.load_checkpoint()
        for repair in trainer.repairs:
            print(f"privfl: resume: {repair}", file=sys.stderr)
        mark_latest(run_dir)
        if trainer.start_round >= cfg.rounds:
            trainer.write_summary()
        else:
            trainer.run()
    finally:
        claim.release()
    return Run(run_dir)


__all__ = ["TrainCallback", "Trainer", "dir_size", "new_run_dir", "resolve_device", "resume_with", "train_with"]
