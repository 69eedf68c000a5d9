"""The client side of a privfl run on Flower: one ClientApp, the same for every method written in roles.

A node learns which client it is from its ``partition-id`` (``--node-config`` in deployment; Flower's
simulation numbers its virtual nodes 0..N-1), receives the run's config and its own train/test indices
once (``query.privfl_setup``), answers ``query.privfl_client_setup`` (the method's
:meth:`~privfl.methods.FLMethod.client_setup`), ``query.privfl_step`` (:meth:`~privfl.methods.FLMethod.client_step`)
and ``query.privfl_gossip`` (the first half of a gossip round) when the method has them, and otherwise two message types:

- ``train``: apply the server's pending messages (:meth:`FLMethod.receive`, in the order sent), run the
  method's :meth:`~privfl.methods.FLMethod.client_round`, reply with its uploads (records of
  :mod:`privfl.flower.records`), the ground truth behind them and any knowledge records;
- ``evaluate``: apply pending messages, score the client (:func:`privfl.engine.client_hits`) under the
  asked protocols, reply with the counts and the node's state (model and client_state), which the
  server's checkpoint keeps so that a killed run resumes.

Everything the client keeps between messages (its model's state dict, :meth:`FLMethod.client_state`, the
config and indices) lives in the node's ``context.state``, which Flower keeps per node, so any worker
may serve any node. The method object is rebuilt for each message (cheap next to a round of training);
the dataset is loaded once per worker process. A node never writes the run's files: the server does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from privfl.errors import PrivflError
from privfl.flower.records import get_json, get_messages, get_tensors, put_json, put_messages, put_numbers, tensors_record

SETUP = "query.privfl_setup"
HELLO = "query.privfl_hello"
GOSSIP = "query.privfl_gossip"
CLIENT_SETUP = "query.privfl_client_setup"
STEP = "query.privfl_step"


class NodeChannel:
    """The channel a method sees on a node: client-side code hands its messages back in a
    :class:`~privfl.methods.ClientReply`; sending from a node would bypass the server's capture."""

    def send(self, *args: Any, **kwargs: Any) -> Any:
        raise PrivflError("a method written in roles sends from client_round by returning ClientReply(uploads=...), not through the channel")

    broadcast = send


class CollectingStore:
    """Stands in for the knowledge store on a node: keeps what the method records, for the reply."""

    def __init__(self) -> None:
        self.items: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = []

    def append(self, record: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self.items.append((dict(record), {k: v.detach().cpu().clone() for k, v in tensors.items()}))


@lru_cache(maxsize=2)
def _data(dataset: str, data_root: str | None, download: bool, subsample: int | None, seed: int, device: str) -> tuple[Any, Any]:
    """(DataView, dataset) of a run's config, loaded once per worker process."""
    from privfl.data import load_dataset
    from privfl.engine import subsample_of
    from privfl.methods import DataView

    ds = load_dataset(dataset, data_root, download)
    images, labels, _ = subsample_of(ds, subsample, seed)
    return DataView(images, labels, ds.mean, ds.std, torch.device(device)), ds


class ClientNode:
    """One client of a run, rebuilt on its node from ``context.state``."""

    def __init__(self, context: Context):
        from privfl.config import build_config
        from privfl.determinism import prepare_cublas, set_deterministic_kernels
        from privfl.engine import resolve_device
        from privfl.fl.trainer import LocalTrainer
        from privfl.methods import Client, FLEnv, KnowledgeRecorder, ModelRequest, resolve_method
        from privfl.models import assign_archs
        from privfl.seeding import seed_global

        state = context.state
        if "privfl.setup" not in state:
            raise PrivflError("this Flower node has not been set up by a privfl ServerApp (no query.privfl_setup received)")
        setup = get_json(state, "privfl.setup")
        self.method_cls = resolve_method(setup["config"]["method"])
        cfg = build_config(setup["config"], self.method_cls.Options)
        torch.set_num_threads(max(1, int(setup["threads"])))
        self.cfg, self.index = cfg, int(setup["index"])
        self.device = resolve_device(cfg.device)
        if cfg.deterministic:  # this node's process belongs to the run: set for good, not restored
            prepare_cublas(self.device)
            set_deterministic_kernels()
        self.data, ds = _data(cfg.dataset, cfg.data_root, cfg.download, cfg.subsample, cfg.seed, str(self.device))
        idx = get_tensors(state, "privfl.indices", self.device)
        arch = assign_archs(cfg.model_group, cfg.num_clients)[self.index]
        opts = self.method_cls.Options(**cfg.options)
        seed_global(cfg.seed, "init", f"arch:{arch}" if cfg.same_init else self.index)
        request = ModelRequest(arch, self.index, ds.channels, ds.num_classes, ds.image_size, cfg, opts)
        model = self.method_cls.build_client_model(request).to(self.device)
        self.client = Client(self.index, arch, model, idx["train"], idx["test"])
        self.union = idx.get("global_test")
        self.knowledge = CollectingStore()
        recorder = KnowledgeRecorder(self.knowledge, cfg.rounds - 1, cfg.knowledge_every, frozenset(setup["knowledge_rounds"]))
        topology = self.method_cls.build_topology(cfg, opts)
        env = FLEnv(cfg, opts, [self.client], self.data, ds.num_classes, self.device, NodeChannel(), recorder, topology, LocalTrainer(cfg, self.data))
        self.method = self.method_cls(env)
        if "privfl.model" in state:
            model.load_state_dict(get_tensors(state, "privfl.model", self.device))
            self.method.load_client_state(self.client, get_tensors(state, "privfl.client", self.device))

    def apply_inbox(self, content: RecordDict) -> None:
        for msg in get_messages(content, "in", self.device):
            if msg.receiver != self.client.name:
                raise PrivflError(f"{self.client.name} was handed a message for {msg.receiver}")
            self.method.receive(self.client, msg)

    def save(self, context: Context) -> None:
        context.state["privfl.model"] = tensors_record(self.client.model.state_dict())
        context.state["privfl.client"] = tensors_record(self.method.client_state(self.client))

    def reply(self, msg: Message, context: Context, content: RecordDict) -> Message:
        """The reply to ``msg``, with the metrics the method noted (:meth:`FLMethod.note`); the node's state saved."""
        if self.method.noted:
            put_json(content, "privfl.notes", [[index, metrics] for index, metrics in self.method.noted])
        self.save(context)
        return Message(content, reply_to=msg)


def _hello(msg: Message, context: Context) -> Message:
    pid = context.node_config.get("partition-id")
    if pid is None:
        raise PrivflError("this Flower node has no partition-id in its node config (start it with --node-config 'partition-id=K')")
    content = RecordDict()
    put_json(content, "privfl.hello", int(pid))
    return Message(content, reply_to=msg)


def _setup(msg: Message, context: Context) -> Message:
    for key in ("privfl.setup", "privfl.indices"):
        context.state[key] = msg.content[key]
    for key in list(context.state):  # a node reused for a new run starts clean
        if key in ("privfl.model", "privfl.client") or key.startswith("privfl.reference."):
            del context.state[key]
    for key in ("privfl.model", "privfl.client"):  # a resumed run: the state its checkpoint kept for this client
        if key in msg.content:
            context.state[key] = msg.content[key]
    return Message(RecordDict(), reply_to=msg)


def _put_uploads(content: RecordDict, uploads: list[tuple[Any, dict[str, torch.Tensor] | None]]) -> None:
    put_messages(content, "up", [m for m, _ in uploads])
    for i, (_, truth) in enumerate(uploads):
        if truth is not None:
            content[f"truth.{i}"] = tensors_record(truth)


def _gossip(msg: Message, context: Context) -> Message:
    """First half of a gossip round: this node's messages to its out-neighbours (the server routes them)."""
    node = ClientNode(context)
    node.apply_inbox(msg.content)
    content = RecordDict()
    _put_uploads(content, node.method.gossip_send(int(get_json(msg.content, "privfl.round")), node.client))
    return node.reply(msg, context, content)


def _put_knowledge(content: RecordDict, node: ClientNode) -> None:
    for i, (record, tensors) in enumerate(node.knowledge.items):
        put_json(content, f"knowledge.{i}.head", record)
        content[f"knowledge.{i}.tensors"] = tensors_record(tensors)
    put_json(content, "privfl.knowledge", len(node.knowledge.items))


def _client_setup(msg: Message, context: Context) -> Message:
    """The client's part of the setup exchange: apply what the server sent at setup, then reply with the
    messages :meth:`FLMethod.client_setup` sends (and any knowledge it recorded)."""
    node = ClientNode(context)
    node.apply_inbox(msg.content)
    content = RecordDict()
    _put_uploads(content, node.method.client_setup(node.client))
    put_numbers(content, "privfl.metrics", {})
    _put_knowledge(content, node)
    return node.reply(msg, context, content)


def _step(msg: Message, context: Context) -> Message:
    """A further exchange within a round (:meth:`FLMethod.request`): apply what the server sent so far,
    reply with the messages of :meth:`FLMethod.client_step`."""
    node = ClientNode(context)
    node.apply_inbox(msg.content)
    content = RecordDict()
    rnd, step = int(get_json(msg.content, "privfl.round")), str(get_json(msg.content, "privfl.step"))
    _put_uploads(content, node.method.client_step(rnd, node.client, step))
    put_numbers(content, "privfl.metrics", {})
    _put_knowledge(content, node)
    return node.reply(msg, context, content)


def _train(msg: Message, context: Context) -> Message:
    node = ClientNode(context)
    node.apply_inbox(msg.content)
    rnd = int(get_json(msg.content, "privfl.round"))
    content = RecordDict()
    if node.method.gossips():  # second half of a gossip round: mix what the neighbours sent, train
        metrics = node.method.gossip_round(rnd, node.client, get_messages(msg.content, "peer", node.device))
    else:
        node.method.plans = {node.client.name: get_json(msg.content, "privfl.plan")}
        reply = node.method.client_round(rnd, node.client)
        _put_uploads(content, reply.uploads)
        metrics = reply.metrics
    put_numbers(content, "privfl.metrics", metrics)
    _put_knowledge(content, node)
    return node.reply(msg, context, content)


def _evaluate(msg: Message, context: Context) -> Message:
    from privfl.engine import client_hits

    node = ClientNode(context)
    node.apply_inbox(msg.content)
    out = RecordDict()
    for flag in get_json(msg.content, "privfl.eval"):
        correct, total, global_hits = client_hits(
            node.method, node.client, node.data, node.cfg.eval_batch_size, personal=bool(flag), union=node.union
        )
        put_json(out, f"hits.{int(bool(flag))}", [correct, total, global_hits])
    # the node's state once the round is over, for the server's checkpoint (a resumed run hands it back)
    out["privfl.state.model"] = tensors_record(node.client.model.state_dict())
    out["privfl.state.client"] = tensors_record(node.method.client_state(node.client))
    return node.reply(msg, context, out)


def defense_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """The run's ``--defense`` specs, applied on the client's node to what it uploads, before it leaves.

    As the in-process channel does: each upload is checked and prepared (:func:`privfl.channel.prepared`),
    then each defense transforms it in order, relative to what this client last received of the same
    kind (kept in the node's state, per kind, only while a defense is set). The reply says which
    defenses touched which upload, so the server's copies account for them (epsilon, counts) in the
    run's report; downlink defenses run on the server, which sends those messages."""
    if "privfl.setup" not in context.state or not get_json(context.state, "privfl.setup")["config"].get("defense"):
        return call_next(msg, context)
    from defenses import build_defenses
    from privfl.capture.message import Message as PrivflMessage
    from privfl.channel import ChannelContext, prepared

    setup = get_json(context.state, "privfl.setup")
    name = f"client{int(setup['index'])}"
    for got in [*get_messages(msg.content, "in"), *get_messages(msg.content, "peer")]:
        context.state[f"privfl.reference.{got.kind}"] = tensors_record(got.tensors)
    reply = call_next(msg, context)
    if msg.metadata.message_type not in ("train", GOSSIP, CLIENT_SETUP, STEP) or reply.has_error():
        return reply
    config = setup["config"]
    defenses = build_defenses(config["defense"])
    channel_context = ChannelContext()
    prefix = "privfl.reference."
    for key in [k for k in context.state if k.startswith(prefix)]:
        channel_context.delivered(PrivflMessage(0, "server", name, key.removeprefix(prefix), get_tensors(context.state, key)))
    from privfl.methods import resolve_method

    method_cls = resolve_method(config["method"])
    uploads = []
    for i, upload in enumerate(get_messages(reply.content, "up")):
        upload = prepared(upload, config["method"], method_cls.sends)
        touched = []
        for j, defense in enumerate(defenses):
            before = defense.defended_messages
            upload = defense(upload, channel_context)
            if defense.defended_messages > before:
                touched.append(j)
        put_json(reply.content, f"defended.{i}", touched)
        uploads.append(upload)
    put_messages(reply.content, "up", uploads)
    return reply


def build_client_app() -> ClientApp:
    """The privfl ClientApp (the same object for every method and run)."""
    app = ClientApp(mods=[defense_mod])
    app.query("privfl_hello")(_hello)
    app.query("privfl_setup")(_setup)
    app.query("privfl_gossip")(_gossip)
    app.query("privfl_client_setup")(_client_setup)
    app.query("privfl_step")(_step)
    app.train()(_train)
    app.evaluate()(_evaluate)
    return app


#: what ``flwr run`` / a SuperNode loads (``privfl.flower.node:app``)
app = build_client_app()


def indices_record(train: torch.Tensor, test: torch.Tensor, global_test: torch.Tensor | None) -> Any:
    tensors = OrderedDict([("train", train), ("test", test)])
    if global_test is not None:
        tensors["global_test"] = global_test
    return tensors_record(tensors)


__all__ = ["ClientNode", "app", "build_client_app", "indices_record"]
