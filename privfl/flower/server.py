"""The Flower engine's server: a ServerApp with a hand-driven round loop, and the run it writes.

:class:`FlowerTrainer` is the in-process :class:`~privfl.engine.Trainer` with the clients moved out: the
run folder, partition, the three stores (capture / knowledge / ground truth), metrics, summary and
checkpoint are written by the same code, and the method's server role (:meth:`FLMethod.server_round`,
:meth:`FLMethod.setup`) runs here, in the ServerApp. Each client is a Flower node running
:mod:`privfl.flower.node`. Per round:

1. ``train`` to each selected client's node, carrying the server messages queued for it (a message the
   server sends is captured when it is sent, as in-process, and handed to the node with its next message);
2. the replies' uploads go through the run's :class:`~privfl.channel.Channel` in the order of selection
   (so the capture, its sequence numbers and the ground-truth store are the in-process engine's), then
   to :meth:`FLMethod.server_round`;
3. ``evaluate`` to every node (each first applies its queued messages), and the accuracy entries are
   assembled from the counts by the in-process engine's own :func:`~privfl.engine.accuracy_metrics`.

Every random draw of a client is seeded from (seed, purpose, round, client), so a run gives the
in-process numbers; see ``docs/scale.md`` for what is and is not bit-identical.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from privfl.capture.message import Message as PrivflMessage
from privfl.engine import Trainer, parse_rounds
from privfl.errors import PrivflError
from privfl.fl.method import FLMethod, route_gossip
from privfl.flower.node import CLIENT_SETUP, GOSSIP, HELLO, SETUP, STEP, build_client_app, indices_record
from privfl.flower.records import get_json, get_messages, get_numbers, get_tensors, put_json, put_messages, tensors_record
from privfl.methods import Client

#: a message from a node's reply: the message, its ground truth, the defenses the node applied to it
_Upload = tuple[PrivflMessage, dict[str, torch.Tensor] | None, list[int]]


class _ServerSide:
    """A defense as a mod of the server's channel: it defends what the server sends (broadcasts, when
    its ``directions`` include them) and lets uploads through, which the client's node defended."""

    def __init__(self, defense: Any):
        self.defense = defense

    def __call__(self, msg: PrivflMessage, ctx: Any) -> PrivflMessage:
        return self.defense(msg, ctx) if msg.sender == "server" else msg


class FlowerTrainer(Trainer):
    """A run whose clients are Flower nodes (``--engine flower``)."""

    builds_clients_from_broadcast = False  # the nodes hold the clients; the server's copies take the nodes' states

    def __init__(self, cfg: Any, run_dir: Path, *, grid: Grid | None = None, **kwargs: Any):
        super().__init__(cfg, run_dir, **kwargs)
        # a client's node defends its uploads (privfl.flower.node.defense_mod); the server's channel runs the
        # defenses only on what the server sends, and accounts for the uploads its nodes defended
        self.channel.mods = [_ServerSide(d) for d in self.defenses]
        self.outbox: dict[str, list[PrivflMessage]] = {c.name: [] for c in self.clients}
        self.method.env.deliver = self._queue
        self.method.env.request = self._request
        self.grid = grid  # given in deployment (the SuperLink's ServerApp); simulation makes its own
        self.node_of: dict[int, int] = {}
        #: metrics the nodes noted (FLMethod.note), with their client's index, until take_notes
        self.notes: list[tuple[int, dict[str, float]]] = []
        #: each node's state as it reported it with its last evaluation: (model state dict, client_state)
        self.node_states: dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}

    def _queue(self, name: str, msg: PrivflMessage) -> None:
        self.outbox[name].append(msg)

    # ------------------------------------------------------------------ Flower plumbing
    def run(self) -> dict[str, Any]:
        if self.grid is not None:  # deployment: this is the ServerApp the SuperLink started
            self._connect()
            return Trainer.run(self)
        from flwr.simulation import run_simulation

        result: dict[str, Any] = {}
        server = ServerApp()

        @server.main()
        def main(grid: Grid, context: Context) -> None:
            self.grid = grid
            self._connect()
            result["summary"] = Trainer.run(self)

        cfg = self.cfg
        backend = {
            "client_resources": {"num_cpus": cfg.flower_client_cpus, "num_gpus": cfg.flower_client_gpus},
            "init_args": {"num_cpus": os.cpu_count() or 1, "logging_level": logging.ERROR, "log_to_driver": False},
        }
        run_simulation(server, build_client_app(), num_supernodes=cfg.num_clients, backend_config=backend)  # type: ignore[arg-type]
        if "summary" not in result:
            raise PrivflError("the Flower simulation ended before the run finished (see Flower's log above)")
        return result["summary"]

    def _exchange(self, messages: list[Message]) -> dict[int, RecordDict]:
        """Send, wait for every reply; node id -> reply content. A node's failure is one line."""
        assert self.grid is not None
        replies = list(self.grid.send_and_receive(messages))
        by_node: dict[int, RecordDict] = {}
        client_of = {node: k for k, node in self.node_of.items()}
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                reason = [line.strip() for line in str(reply.error.reason).splitlines() if line.strip()]
                who = f"client{client_of[node]}" if node in client_of else f"node {node}"
                raise PrivflError(f"Flower {who} failed: {(reason[-1] if reason else 'no reason given')[:300]}")
            by_node[node] = reply.content
            if "privfl.notes" in reply.content:
                self.notes += [(int(index), metrics) for index, metrics in get_json(reply.content, "privfl.notes")]
        missing = {m.metadata.dst_node_id for m in messages} - set(by_node)
        if missing:
            raise PrivflError(f"{len(missing)} Flower node(s) did not reply")
        return by_node

    def _connect(self) -> None:
        """Map each node to its client (``partition-id``), then give each its config and data indices."""
        assert self.grid is not None
        nodes = self._wait_for_nodes()
        hello = self._exchange([Message(RecordDict(), dst_node_id=n, message_type=HELLO) for n in nodes])
        self.node_of = {int(get_json(hello[n], "privfl.hello")): n for n in nodes}
        wanted = set(range(self.cfg.num_clients))
        if set(self.node_of) != wanted:
            raise PrivflError(f"the Flower nodes' partition-ids are {sorted(self.node_of)}, expected 0..{self.cfg.num_clients - 1}")
        config = dataclasses.asdict(self.cfg)
        knowledge_rounds = sorted(parse_rounds(self.cfg.knowledge_rounds, self.cfg.rounds))
        threads = max(1, int(self.cfg.flower_client_cpus))
        union = self.global_test_idx
        setup = []
        for c in self.clients:
            content = RecordDict()
            put_json(content, "privfl.setup", {"config": config, "index": c.index, "threads": threads, "knowledge_rounds": knowledge_rounds})
            content["privfl.indices"] = indices_record(c.train_idx, c.test_idx, union)
            if self.start_round > 0:  # resumed: the node starts from its state in the checkpoint
                content["privfl.model"] = tensors_record(c.model.state_dict())
                content["privfl.client"] = tensors_record(self.method.client_state(c))
            setup.append(Message(content, dst_node_id=self.node_of[c.index], message_type=SETUP))
        self._exchange(setup)

    def _wait_for_nodes(self, timeout: float = 300.0) -> list[int]:
        """The node ids, once every client's node has connected (nodes register with the SuperLink a
        little after the ServerApp starts)."""
        assert self.grid is not None
        deadline = time.monotonic() + timeout
        while True:
            nodes = sorted(self.grid.get_node_ids())
            if len(nodes) >= self.cfg.num_clients:
                return nodes
            if time.monotonic() > deadline:
                raise PrivflError(f"only {len(nodes)} of {self.cfg.num_clients} Flower nodes connected within {timeout:.0f} s")
            time.sleep(0.2)

    def _with_inbox(self, client: Client, content: RecordDict) -> RecordDict:
        """``content`` plus the server messages queued for ``client`` (the queue is emptied)."""
        put_messages(content, "in", self.outbox[client.name])
        self.outbox[client.name] = []
        return content

    # ------------------------------------------------------------------ the round, server side
    def _messages(self, selected: list[Client], message_type: str, fill: Any) -> dict[int, RecordDict]:
        """One ``message_type`` message to each selected client's node (``fill(client, content)`` adds the
        round's records, then its queued server messages); its replies by client index."""
        messages = []
        for c in selected:
            content = RecordDict()
            fill(c, content)
            self._with_inbox(c, content)
            messages.append(Message(content, dst_node_id=self.node_of[c.index], message_type=message_type))
        replies = self._exchange(messages)
        return {c.index: replies[self.node_of[c.index]] for c in selected}

    def _uploads(
        self, client: Client, content: RecordDict, peer: bool = False
    ) -> list[tuple[PrivflMessage, dict[str, torch.Tensor] | None, list[int]]]:
        """A reply's messages, each with its ground truth and the defenses its node applied to it."""
        out = []
        for i, msg in enumerate(get_messages(content, "up", self.device)):
            if msg.sender != client.name or (msg.receiver == "server") == peer:
                raise PrivflError(f"{client.name}'s node replied with a message from {msg.sender} to {msg.receiver}")
            truth = get_tensors(content, f"truth.{i}") if f"truth.{i}" in content else None
            out.append((msg, truth, [int(j) for j in get_json(content, f"defended.{i}")] if f"defended.{i}" in content else []))
        return out

    def _send(self, msg: PrivflMessage, truth: dict[str, torch.Tensor] | None, defended: list[int]) -> PrivflMessage:
        """Through the run's channel (capture, truth, kind checks), accounting for the node's defenses."""
        copy = self.channel.send(msg, truth=truth)
        for j in defended:
            self.defenses[j].account(msg)
        return copy

    def _finish(self, client: Client, content: RecordDict) -> dict[str, float]:
        """File the knowledge a node recorded; its metrics."""
        for i in range(int(get_json(content, "privfl.knowledge"))):
            if self.knowledge_store is not None:
                self.knowledge_store.append(get_json(content, f"knowledge.{i}.head"), get_tensors(content, f"knowledge.{i}.tensors"))
        return get_numbers(content, "privfl.metrics")

    def _request(self, rnd: int, names: list[str], step: str) -> list[PrivflMessage]:
        """:meth:`FLMethod.request` on Flower: a ``query.privfl_step`` to each named client's node (with the
        server messages queued for it), the uploads through the channel in the order of ``names``."""
        by_name = {c.name: c for c in self.clients}
        chosen = [by_name[name] for name in names]

        def fill(c: Client, content: RecordDict) -> None:
            put_json(content, "privfl.round", rnd)
            put_json(content, "privfl.step", step)

        replies = self._messages(chosen, STEP, fill)
        uploads: list[PrivflMessage] = []
        for c in chosen:
            uploads += [self._send(*upload) for upload in self._uploads(c, replies[c.index])]
            self._finish(c, replies[c.index])
        return uploads

    def take_notes(self) -> list[dict[str, float]]:
        """What the nodes noted since the last call, in client order (as the in-process engine has them)."""
        notes, self.notes = self.notes, []
        return [metrics for _, metrics in sorted(notes, key=lambda note: note[0])]

    def play_setup(self) -> None:
        """The setup exchange: the server's :meth:`FLMethod.setup` here, each node's ``client_setup`` (only
        when the method has one; its uploads through the channel in client order), ``server_setup`` here."""
        method = self.method
        method.setup()
        uploads: list[PrivflMessage] = []
        if type(method).client_setup is not FLMethod.client_setup:
            replies = self._messages(self.clients, CLIENT_SETUP, lambda c, content: None)
            for c in self.clients:
                uploads += [self._send(*upload) for upload in self._uploads(c, replies[c.index])]
                self._finish(c, replies[c.index])
        method.server_setup(uploads)

    def play_round(self, rnd: int, selected: list[Client]) -> dict[str, float]:
        if self.method.gossips():
            return self._gossip_round(rnd, selected)
        self.method.open_round(rnd, selected)
        plans = self.method.plan_round(rnd, selected)

        def fill(c: Client, content: RecordDict) -> None:
            put_json(content, "privfl.round", rnd)
            put_json(content, "privfl.plan", plans.get(c.name, {}))

        replies = self._messages(selected, "train", fill)
        uploads: list[PrivflMessage] = []
        metrics = []
        for c in selected:  # in the order of selection, as the in-process engine sends them
            uploads += [self._send(*upload) for upload in self._uploads(c, replies[c.index])]
            metrics.append(self._finish(c, replies[c.index]))
        return {**self.method.client_metrics(rnd, metrics), **self.method.server_round(rnd, uploads)}

    def _gossip_round(self, rnd: int, selected: list[Client]) -> dict[str, float]:
        """A round on a graph: each live node sends (GOSSIP); the ServerApp, as the router Flower lacks,
        passes each message through the channel (captured as the peer message it is) in the order of the
        topology's edges, then hands each node what it received with its ``train`` message."""
        replies = self._messages(selected, GOSSIP, lambda c, content: put_json(content, "privfl.round", rnd))
        sent, notes = {}, {}
        for c in selected:
            uploads = self._uploads(c, replies[c.index], peer=True)
            sent[c.index] = [(msg, truth) for msg, truth, _ in uploads]
            notes.update({id(msg): defended for msg, _, defended in uploads})
        inbox: dict[int, list[PrivflMessage]] = {c.index: [] for c in selected}
        with self.channel.context.simultaneous():
            for receiver, msg, truth in route_gossip(self.topology, rnd, sent):
                inbox[receiver].append(self._send(msg, truth, notes[id(msg)]))

        def fill(c: Client, content: RecordDict) -> None:
            put_json(content, "privfl.round", rnd)
            put_messages(content, "peer", inbox[c.index])

        replies = self._messages(selected, "train", fill)
        return self.method.client_metrics(rnd, [self._finish(c, replies[c.index]) for c in selected])

    def collect_hits(self, flags: tuple[bool, ...]) -> dict[bool, list[tuple[int, int, int | None]]]:
        messages = []
        for c in self.clients:
            content = RecordDict()
            put_json(content, "privfl.eval", [int(f) for f in flags])
            self._with_inbox(c, content)
            messages.append(Message(content, dst_node_id=self.node_of[c.index], message_type="evaluate"))
        replies = self._exchange(messages)
        for c in self.clients:  # for the round's checkpoint: what each node holds once the round is over
            reply = replies[self.node_of[c.index]]
            self.node_states[c.name] = (get_tensors(reply, "privfl.state.model"), get_tensors(reply, "privfl.state.client"))
        out: dict[bool, list[tuple[int, int, int | None]]] = {}
        for flag in flags:
            rows = []
            for c in self.clients:
                correct, total, global_hits = get_json(replies[self.node_of[c.index]], f"hits.{int(flag)}")
                rows.append((int(correct), int(total), None if global_hits is None else int(global_hits)))
            out[flag] = rows
        return out

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The in-process layout: each client's model and client_state as its node reported them with the
        round's evaluation (so ``--resume`` hands each node its state back), and the server's state."""
        state = {f"method.{k}": v for k, v in self.method.server_state().items()}
        for c in self.clients:
            model, own = self.node_states[c.name]
            state.update({f"{c.name}.{k}": v for k, v in model.items()})
            state.update({f"clientstate.{c.name}/{k}": v for k, v in own.items()})
        return state


#: the ServerApp a SuperLink starts for ``privfl.train --flower-mode deployment`` (privfl.flower.deploy)
app = ServerApp()


@app.main()
def _deployed(grid: Grid, context: Context) -> None:
    from privfl.config import build_config
    from privfl.engine import new_run_dir, train_with
    from privfl.flower.deploy import JOB_KEY
    from privfl.methods import resolve_method

    job = json.loads(str(context.run_config[JOB_KEY]))
    cfg = build_config(job, resolve_method(job["method"]).Options)
    train_with(FlowerTrainer, cfg, new_run_dir(cfg), grid=grid)


__all__ = ["FlowerTrainer", "app"]
