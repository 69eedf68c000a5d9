"""What a federated method is to the engine: the method contract.

A method says what a client does in a round, what the server (or a neighbour) does, and which
messages they exchange. It is training only:

- every exchange goes through ``env.channel`` (``self.send`` / ``self.channel.broadcast``); a method
  that reads another party's state without a message has a bug. What it sends is declared in
  ``sends`` (kind -> direction) and each message is checked against its kind (:mod:`privfl.kinds`);
- local training goes through the shared :class:`~privfl.fl.trainer.LocalTrainer` (``self.trainer``),
  customised by an objective, parameter groups or a hook, never by copying the seeded loop;
- what an attacker needs to rebuild a parameter-like message's context (which received message was
  the previous state, which part of the client model the tensors belong to, how it maps images to
  class scores) is declared as data, :class:`LeakageContext` in ``leakage``; the attack side reads it
  and replays nothing of the method.

Register built-in methods with ``@METHODS.register("name")``; a user's own method is a subclass of
:class:`FLMethod` given by import path (``package.module:Class``). :func:`check_method_class` is the
load-time check both go through.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from privfl.capture.message import Message
from privfl.errors import ConfigError, PrivflError
from privfl.fl.layout import compute_layout
from privfl.fl.parallel import defer_or_run, ordered_map
from privfl.fl.shared import SharedTensors, bind_shared, own_tensors
from privfl.fl.trainer import LocalStats, LocalTrainer, batches_per_epoch, with_representation_term
from privfl.kinds import KINDS, Family, ParamForm, check_sends
from privfl.registry import Registry
from privfl.seeding import seed_global

METHODS: Registry[type[FLMethod]] = Registry("method", discover=["privfl.methods"])


@dataclass
class NoOptions:
    """This method has no options of its own."""


class DataView:
    """The whole dataset resident on the device as uint8, normalised batch by batch.

    Keeping the data in memory and slicing index tensors is much faster than a DataLoader for
    image sets of this size, and avoids per-round disk traffic.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean, std, device: torch.device):
        self.images = images.to(device)
        self.labels = labels.to(device)
        shape = (1, -1, 1, 1)
        self.mean = torch.tensor(mean, dtype=torch.float32, device=device).view(shape)
        self.std = torch.tensor(std, dtype=torch.float32, device=device).view(shape)
        self.device = device

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[idx].float().div_(255.0).sub_(self.mean).div_(self.std)
        return x, self.labels[idx]

    def batches(
        self, idx: torch.Tensor, batch_size: int, generator: torch.Generator | None = None, *, drop_last: bool = False, min_batch: int = 1
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches over ``idx``; shuffled when a generator is given. The last partial batch is kept
        unless ``drop_last`` (HtFLlib drops it: a client with fewer samples than a batch then trains nothing)
        or it is smaller than ``min_batch`` (see :func:`~privfl.fl.trainer.batches_per_epoch`)."""
        if generator is not None:
            idx = idx[torch.randperm(len(idx), generator=generator).to(idx.device)]
        end = batch_size * batches_per_epoch(len(idx), batch_size, drop_last, min_batch)
        for start in range(0, end, batch_size):
            yield self.batch(idx[start : start + batch_size])


@dataclass
class Client:
    index: int
    arch: str
    model: Any  # privfl.models.SplitModel
    train_idx: torch.Tensor
    test_idx: torch.Tensor

    @property
    def name(self) -> str:
        return f"client{self.index}"


class KnowledgeRecorder:
    """Files what the threat model grants the attacker (here: a client's extractor incl. RM, as it
    was when it produced an artifact), apart from the capture. By default only for the final round;
    ``every`` > 0 adds every N-th round and ``rounds`` names more (mind the size with large models)."""

    def __init__(self, store, final_round: int, every: int = 0, rounds: frozenset[int] = frozenset()):
        self.store, self.final_round, self.every, self.rounds = store, final_round, every, rounds

    def wants(self, rnd: int) -> bool:
        return self.store is not None and (rnd == self.final_round or rnd in self.rounds or (self.every > 0 and (rnd + 1) % self.every == 0))

    def record_extractor(self, rnd: int, client: Client) -> None:
        if self.wants(rnd):  # a client trained in a worker thread files it in client order, from the main thread
            defer_or_run(self._append_extractor, rnd, client)

    def _append_extractor(self, rnd: int, client: Client) -> None:
        self.store.append(
            {"round": rnd, "client": client.name, "kind": "extractor", "arch": client.arch, "spec": client.model.spec},
            client.model.extractor_state(),
        )


@dataclass(frozen=True)
class ModelRequest:
    """What a client's model is built from: the same on the training side (engine) and on the
    attacker's side (:class:`attacks.view.AttackerView`, which knows the architecture, not the weights)."""

    arch: str
    index: int
    in_channels: int
    num_classes: int
    image_size: int
    cfg: Any  # privfl.config.TrainConfig
    opts: Any  # the method's Options instance

    @classmethod
    def from_run(cls, info: dict[str, Any], config: dict[str, Any], index: int) -> ModelRequest:
        """Client ``index``'s request rebuilt from a run's ``run.json`` and ``config.json`` (what the
        attacker and the analysis tools know of a model: its architecture, not its weights)."""
        from privfl.config import build_config, saved_run_values

        options_cls = getattr(resolve_method(info["method"], source="run.json"), "Options", None)
        cfg = build_config(saved_run_values(config), options_cls)
        ds = info["dataset"]
        opts = options_cls(**cfg.options) if options_cls is not None else None
        return cls(info["archs"][index], index, ds["channels"], ds["num_classes"], ds["image_size"], cfg, opts)


#: what a method may let an attacker have beside the messages (``FLMethod.exposes``), with its threat model;
#: the engine stores it in the run's knowledge store and declares it in run.json
EXPOSURES: dict[str, str] = {
    "extractor": "honest-but-curious server with white-box access to each client's extractor incl. RM (FedRE [000] Sec. 3 threat model)",
}

PREVIOUS_RULES = ("last-received", "layer-replay")
READOUTS = ("logits", "probe")


@dataclass(frozen=True)
class LeakageContext:
    """What an attacker needs to turn a parameter-like message of one kind into a differentiable loss.

    Declared per kind in :attr:`FLMethod.leakage`; read by gradient-leakage attacks, which build the
    module from :meth:`FLMethod.build_client_model` (the architecture, which the attacker knows) and
    replay nothing of the method's training.

    - ``previous``: the kind of the message whose last copy delivered to the sender is the state the
      message was computed from (``model`` for a gradient of a FedAvg-style model; the same kind for a
      shared sub-model). ``previous_rule``: ``last-received`` (that message; a message whose meta names
      ``previous_round`` takes the one received in that round) or ``layer-replay`` (FedFree: an
      uploaded layer's start-of-round value rebuilt from the sender's earlier uploads and the
      downloads it applied, see :func:`privfl.kinds.apply_layer_download`).
    - ``module``: dotted path of the client-model submodule the tensors are parameters of ("": the
      whole client model); ``prefix``: what the message puts before that submodule's own parameter
      names; ``output``: when the submodule returns a tuple, the element that goes on.
    - ``readout``: ``logits`` when the submodule's output are class scores, ``probe`` when they are
      features and the attacker appends a classifier of its own (``probe_hidden`` units, random: it
      never sees the client's).
    - ``note``: what the attacker's loss leaves out of the client's true objective (reported).
    """

    previous: str
    previous_rule: str = "last-received"
    module: str = ""
    prefix: str = ""
    output: int | None = None
    readout: str = "logits"
    probe_hidden: int = 128
    note: str = ""

    def __post_init__(self) -> None:
        if self.previous_rule not in PREVIOUS_RULES:
            raise ValueError(f"LeakageContext.previous_rule must be one of {PREVIOUS_RULES}, got {self.previous_rule!r}")
        if self.readout not in READOUTS:
            raise ValueError(f"LeakageContext.readout must be one of {READOUTS}, got {self.readout!r}")


@dataclass
class FLEnv:
    """Everything a method may use: its own clients, data access, the channel and the knowledge log."""

    cfg: Any  # privfl.config.TrainConfig
    opts: Any  # the method's Options instance
    clients: list[Client]
    data: DataView
    num_classes: int
    device: torch.device
    channel: Any  # privfl.channel.Channel
    knowledge: KnowledgeRecorder
    topology: Any = None  # privfl.topology.Star | Ring, from FLMethod.build_topology
    trainer: LocalTrainer | None = None  # the shared seeded local loop (made from cfg and data when absent)
    #: where a server-to-client message goes once sent (:meth:`FLMethod.deliver`): None = this process
    #: holds the client, so the method's :meth:`FLMethod.receive` applies it at once (in-process engine);
    #: the Flower engine's server queues it for the client's node instead
    deliver: Callable[[str, Message], None] | None = None
    #: how the server asks clients for a further exchange within a round (:meth:`FLMethod.request`): None =
    #: this process holds the clients; the Flower engine's server sends a query to their nodes instead
    request: Callable[[int, list[str], str], list[Message]] | None = None
    #: scores a client's model for ``--eval personal`` right after its local training (:meth:`FLMethod.fit`
    #: of a method with :attr:`FLMethod.stateless_clients`), so no copy of it is kept: the in-process
    #: engine's; None (Flower nodes) keeps the copy
    score_personal: Callable[[Client], None] | None = None
    #: how many clients train and are evaluated at once, in threads (``--client-workers``, resolved by the
    #: engine: 1 unless the method declares :attr:`FLMethod.parallel_clients`, and on Flower nodes)
    client_workers: int = 1


@dataclass
class ClientReply:
    """What one client's round produced, in a method written in roles (:meth:`FLMethod.client_round`):
    the messages it sends to the server, each with the ground truth behind it (sample ids, weights;
    filed apart from the capture, never sent), and its metrics (``train_loss``, ...), averaged over clients."""

    uploads: list[tuple[Message, dict[str, torch.Tensor] | None]]
    metrics: dict[str, float]


class FLMethod:
    """Base class of every method (star topology). Its members, by role (docs/writing-a-method.md):

    **Declarations**, read before anything trains (``check_method_class``, ``audit --check``, the attacks):
    :attr:`name`, :attr:`paper`, :attr:`sends`, :attr:`exposes`, :attr:`leakage` / :meth:`leakage_context`,
    :attr:`Options`, :attr:`requires_homogeneous`, :attr:`personal_parts`, :attr:`stateless_clients`,
    :attr:`streams_uploads`, :attr:`parallel_clients`, :meth:`build_client_model`, :meth:`build_topology`,
    :meth:`flower_limits`, :meth:`global_test_size`; derived: :meth:`in_roles`, :meth:`gossips`,
    :meth:`clients_in_parallel`.

    **Server side** (on Flower, the ServerApp): :meth:`setup`, :meth:`server_setup`, :meth:`open_round`,
    :meth:`plan_round`, :meth:`server_round`, :meth:`request`, :meth:`deliver`, :meth:`client_metrics`,
    :meth:`server_state` / :meth:`load_server_state`; a method that does not split its round in roles
    overrides :meth:`run_round` instead and runs in-process only.

    **Client side** (on Flower, each node's ClientApp): :meth:`client_setup`, :meth:`receive`, :meth:`plan`,
    :meth:`client_round`, :meth:`client_step`, :meth:`gossip_send` / :meth:`gossip_round` (peer methods),
    :meth:`note`, :meth:`sent`, :meth:`client_state` / :meth:`load_client_state`, :meth:`predict` /
    :meth:`predict_personal`; the tools a client round uses: :meth:`fit`, :meth:`local_train`,
    :meth:`make_optimizer`, :meth:`representations`.

    **Both sides**: :meth:`send` (through the run's channel, which captures and checks every message),
    :attr:`env` (:class:`FLEnv`: clients, data, options, knowledge recorder).
    """

    name: ClassVar[str] = ""
    #: message kinds this method transmits, with their direction ("up", "down", "peer", "up/down")
    sends: ClassVar[dict[str, str]] = {}
    #: what a run of this method lets an attacker have beside the messages
    exposes: ClassVar[tuple[str, ...]] = ()
    #: per parameter-like kind it sends, what an attacker needs to rebuild its context (see
    #: :class:`LeakageContext`); kinds left out get :meth:`leakage_context`'s default
    leakage: ClassVar[dict[str, LeakageContext]] = {}
    Options: ClassVar[type] = NoOptions
    requires_homogeneous: ClassVar[bool] = False
    paper: ClassVar[str] = ""
    #: submodules of the client model that a received global message overwrites ("" = the whole model).
    #: ``--eval personal`` scores each client with them as they were after its own last local training
    #: (:meth:`fit` keeps that copy); ``--eval global`` with what it holds at the end of the round.
    personal_parts: ClassVar[tuple[str, ...]] = ()
    #: a client keeps nothing between rounds but what the server broadcasts: a :class:`GlobalModelServer`
    #: whose full-model broadcast, at setup and every round, replaces every client's whole model. The
    #: in-process engine then builds client models without initial weights, lets every client alias one
    #: copy of the broadcast until it trains (:mod:`privfl.fl.shared`), scores ``--eval personal``
    #: right after local training instead of keeping a copy, and drops a client's trained weights once it
    #: has sent them: one model in memory instead of one per client. The numbers do not change.
    stateless_clients: ClassVar[bool] = False
    #: :meth:`server_round` reads its uploads once, in order (FedAvg's running weighted sum): the
    #: in-process engine then hands it an iterator that trains each client when its upload is read, so a
    #: round never holds every client's upload at once. The capture and the numbers are the same.
    streams_uploads: ClassVar[bool] = False
    #: a client's :meth:`client_round` (its training, its ``fit``) and :meth:`predict` /
    #: :meth:`predict_personal` touch that client's own state only, write the method's shared attributes
    #: only under the client's own key, and draw randomness only from seeded generators: the in-process
    #: engine may then run ``--client-workers`` clients at once in threads (:mod:`privfl.fl.parallel`),
    #: with the same numbers and capture. Off by default, and not inherited (:meth:`clients_in_parallel`):
    #: each built-in method declares it once ``tests/engine/test_client_workers.py`` shows it gives the same run
    #: with 1 and 2 workers.
    parallel_clients: ClassVar[bool] = False

    def __init__(self, env: FLEnv):
        self.env = env
        #: client name -> {part: its tensors after the client's last local training} (personal evaluation)
        self.personal: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        #: this round's per-client instructions (:meth:`plan_round`), by client name
        self.plans: dict[str, dict[str, Any]] = {}
        #: client-side metrics noted outside client_round (:meth:`note`), until the engine takes them
        self.noted: list[tuple[int, dict[str, float]]] = []
        self.opts = env.opts
        self.cfg = env.cfg
        self.trainer = env.trainer if env.trainer is not None else LocalTrainer(env.cfg, env.data)
        if self.requires_homogeneous and len({c.arch for c in env.clients}) > 1:
            archs = sorted({c.arch for c in env.clients})
            raise ConfigError(f"{self.name} needs identical client models, got {', '.join(archs)}; use --model-group homo-cnn4")

    # -------------------------------------------------------------- models
    @classmethod
    def build_client_model(cls, req: ModelRequest) -> nn.Module:
        """Client ``req.index``'s model, with the global RNG already seeded by the caller.

        The default is a :class:`privfl.models.SplitModel` of the assigned architecture; methods
        with their own model structure (extra modules, private projectors) override this. The
        returned module's ``state_dict`` is what checkpoints save.
        """
        from privfl.models import build_model

        return build_model(
            req.arch,
            in_channels=req.in_channels,
            num_classes=req.num_classes,
            image_size=req.image_size,
            rep_dim=req.cfg.rep_dim,
            mapping=req.cfg.mapping,
        )

    @classmethod
    def build_topology(cls, cfg: Any, opts: Any):
        """Who talks to whom in this method (the engine selects clients from its live nodes).
        Default: a star, every client live; ring methods return a :class:`privfl.topology.Ring`."""
        from privfl.topology import Star

        return Star(cfg.num_clients)

    @classmethod
    def flower_limits(cls, cfg: Any, opts: Any) -> str | None:
        """Why this configuration of the method cannot run on the Flower engine (one line), or None when it can."""
        return None

    @classmethod
    def global_test_size(cls, cfg: Any, opts: Any) -> int:
        """How many samples of the union of the clients' test sets the engine scores every client on each
        round, reporting Local-T/Global-T (0: off). Default: ``--global-test``; DRDFL scores its paper's
        metrics by default."""
        return int(cfg.global_test)

    @classmethod
    def leakage_context(cls, kind: str) -> LeakageContext | None:
        """The declared :class:`LeakageContext` of a parameter-like ``kind``, else the default: the
        whole client model, whose previous state is the last ``model`` the sender received for a
        gradient or update, and the last message of the same kind for full parameters. None for
        kinds the method does not send or that are not parameter-like."""
        if kind in cls.leakage:
            return cls.leakage[kind]
        if kind not in cls.sends:
            return None
        spec = KINDS.get(kind) if kind in KINDS else None
        if spec is None or spec.form is None or spec.family is Family.GENERATOR:
            return None
        legacy = getattr(cls, "parameter_kinds", None)
        if isinstance(legacy, dict) and kind in legacy:  # the pre-0.2 declaration {kind: previous kind}
            return LeakageContext(previous=legacy[kind])
        return LeakageContext(previous="model" if spec.form in (ParamForm.GRADIENT, ParamForm.UPDATE) else kind)

    # -------------------------------------------------------------- protocol
    def setup(self) -> None:
        """Server side, once before round 0: what the server sends first (captured as round 0, meta
        phase=setup). A method whose clients answer at setup adds :meth:`client_setup` and :meth:`server_setup`."""

    def client_setup(self, client: Client) -> list[tuple[Message, dict[str, torch.Tensor] | None]]:
        """Client side, once before round 0, after the client received what :meth:`setup` sent: the messages
        it sends the server at setup (meta phase=setup), each with its ground truth. Default: none."""
        return []

    def server_setup(self, uploads: list[Message]) -> None:
        """Server side, once before round 0: what every client's :meth:`client_setup` sent (their delivered
        copies, in client order) -> the server's state and its last setup messages. Default: nothing."""

    def run_setup(self) -> None:
        """The setup exchange, in one process: :meth:`setup`, each client's :meth:`client_setup` (in client
        order), :meth:`server_setup`. The Flower engine plays the client side on the nodes instead."""
        self.setup()
        uploads = [self.send(msg, truth) for client in self.env.clients for msg, truth in self.client_setup(client)]
        self.server_setup(uploads)

    def run_round(self, rnd: int, selected: list[Client]) -> dict[str, float]:
        """One round, in one process. A method written in roles (:meth:`client_round`, :meth:`server_round`,
        :meth:`receive`) inherits this composition and runs on every engine; a method that overrides
        ``run_round`` itself runs in-process only (``--engine flower`` refuses it, naming these hooks)."""
        cls = type(self)
        if cls.gossips():
            return self._gossip_round(rnd, selected)
        if cls.client_round is FLMethod.client_round or cls.server_round is FLMethod.server_round:  # (a subclass may extend this round)
            raise NotImplementedError(f"{cls.__name__} must implement run_round, client_round + server_round, or gossip_send + gossip_round")
        self.open_round(rnd, selected)
        self.plans = self.plan_round(rnd, selected)
        stream = UploadStream(self, rnd, selected)
        if cls.streams_uploads:
            server = self.server_round(rnd, stream)  # type: ignore[arg-type]  # read once, in order
            stream.finish()
            return {**self.client_metrics(rnd, stream.metrics), **server}
        uploads = list(stream)
        return {**self.client_metrics(rnd, stream.metrics), **self.server_round(rnd, uploads)}

    def sent(self, client: Client) -> None:
        """In-process, after ``client``'s round and its uploads were sent: drop what it need not keep
        (a :attr:`stateless_clients` method: its trained weights). Default: nothing."""

    # -------------------------------------------------------------- protocol, in roles
    # A method written in these three hooks keeps client and server apart: client_round and receive run
    # where the client lives (this process, or its Flower node), server_round where the server lives.
    # Client-side code may use only its own client (env.clients holds just that client on a node);
    # server-side code only what it was sent. State a client keeps between rounds beside its model
    # goes through client_state / load_client_state.

    @classmethod
    def clients_in_parallel(cls) -> bool:
        """Whether this very class declares :attr:`parallel_clients`: a subclass (a user's variant of a built-in
        method) runs one client at a time until it declares it too, as what it adds may share state."""
        return bool(vars(cls).get("parallel_clients", False))

    @classmethod
    def in_roles(cls) -> bool:
        """Whether the method is written in roles (so it runs on the Flower engine as well): it has both
        role hooks of a star round (or both of a gossip round) and keeps the composed :meth:`run_round`
        (a subclass that overrides ``run_round`` of a method in roles is not, since its round is no
        longer the composition)."""
        star = cls.client_round is not FLMethod.client_round and cls.server_round is not FLMethod.server_round
        return (star or cls.gossips()) and cls.run_round is FLMethod.run_round

    @classmethod
    def gossips(cls) -> bool:
        """Whether the method's round is a gossip round on a graph (:meth:`gossip_send` + :meth:`gossip_round`)."""
        return cls.gossip_send is not FLMethod.gossip_send and cls.gossip_round is not FLMethod.gossip_round

    # -------------------------------------------------------------- protocol, in roles, on a graph
    # A decentralised method (ring, neighbour graph) written in two client-side hooks: every live node
    # first sends (gossip_send), then mixes what it received and trains (gossip_round). privfl routes each
    # message from its sender to its receiver, captured as the peer message it is, in the order of the
    # topology's edges: in-process directly, on Flower through the ServerApp (Flower has no peer links).

    def gossip_send(self, rnd: int, client: Client) -> list[tuple[Message, dict[str, torch.Tensor] | None]]:
        """Client side: what this live node sends this round to its out-neighbours of the run's topology
        (receiver ``client{j}``; one or more messages each), each with the ground truth behind it."""
        raise NotImplementedError

    def gossip_round(self, rnd: int, client: Client, received: list[Message]) -> dict[str, float]:
        """Client side: mix what this node received this round (its copies, in edge order), train; its metrics."""
        raise NotImplementedError

    def _gossip_round(self, rnd: int, selected: list[Client]) -> dict[str, float]:
        workers, what = self.env.client_workers, f"{self.name} round {rnd}"
        sent = {c.index: out for c, out in ordered_map(lambda c: self.gossip_send(rnd, c), selected, workers, what=what)}
        inbox: dict[int, list[Message]] = {c.index: [] for c in selected}
        with self.channel.context.simultaneous():
            for receiver, msg, truth in route_gossip(self.env.topology, rnd, sent):
                inbox[receiver].append(self.send(msg, truth))
        rows = [row for _, row in ordered_map(lambda c: self.gossip_round(rnd, c, inbox[c.index]), selected, workers, what=what)]
        return self.client_metrics(rnd, rows)

    def open_round(self, rnd: int, selected: list[Client]) -> None:
        """Server side, before the selected clients train: messages that depend on the round's selection
        (FedGen's generator goes only to the clients that will use it), sent with :meth:`deliver` and
        applied by :meth:`receive` before the client's :meth:`client_round`. Default: none."""

    def plan_round(self, rnd: int, selected: list[Client]) -> dict[str, dict[str, Any]]:
        """Server side, before the clients train: per-client instructions for this round (JSON values, by
        client name), for what only the server can decide because it sees the whole selection (FedProx's
        stragglers). They are settings of the simulation, not transmitted artifacts: never captured.
        A client reads its own with :meth:`plan`. Default: none."""
        return {}

    def client_metrics(self, rnd: int, rows: list[dict[str, float]]) -> dict[str, float]:
        """Server side: the round's metrics from the clients' rows (:class:`ClientReply` metrics, or the live
        nodes' :meth:`gossip_round` rows), in the order of selection. Default: per-key means; override for
        totals or extremes (DFedPGP's live count and smallest push-sum weight)."""
        return mean_metrics(rows)

    def request(self, rnd: int, names: list[str], step: str) -> list[Message]:
        """Server side, inside :meth:`server_round`: a further exchange within the round. Each named client
        runs :meth:`client_step` where it lives, after applying what the server sent it so far (FedFed's
        sharing step: every client encodes its data with the distiller just broadcast); returns their
        uploads (delivered copies, in the order of ``names``), captured in this round."""
        if self.env.request is not None:
            return self.env.request(rnd, names, step)
        by_name = {c.name: c for c in self.env.clients}
        return [self.send(msg, truth) for name in names for msg, truth in self.client_step(rnd, by_name[name], step)]

    def client_step(self, rnd: int, client: Client, step: str) -> list[tuple[Message, dict[str, torch.Tensor] | None]]:
        """Client side: the messages of a further exchange the server asked for (:meth:`request`), each with
        its ground truth."""
        raise NotImplementedError(f"{type(self).__name__} has no client step {step!r}")

    def note(self, client: Client, metrics: dict[str, float]) -> None:
        """Client side: metrics of work a client does outside :meth:`client_round`, such as FedALA's merge of
        a received model in :meth:`receive`. They join the metrics of the round in which the client
        received the message (on Flower, a node reports them with its next reply): per-key means over the
        notes, in client order."""
        self.noted.append((client.index, dict(metrics)))

    def plan(self, client: Client) -> dict[str, Any]:
        """Client side: this round's instructions from :meth:`plan_round` ({} when none)."""
        return self.plans.get(client.name, {})

    def client_round(self, rnd: int, client: Client) -> ClientReply:
        """Client side of a round: local training and the messages the client sends to the server."""
        raise NotImplementedError

    def server_round(self, rnd: int, uploads: list[Message]) -> dict[str, float]:
        """Server side of a round: what the selected clients sent (their delivered copies, in the order
        of selection) -> the server's update, its messages to clients (:meth:`deliver`), its metrics."""
        raise NotImplementedError

    def receive(self, client: Client, msg: Message) -> None:
        """Client side: apply a message the server sent (e.g. load a broadcast model). Runs where the
        client lives, before the client's next training or evaluation."""

    def deliver(self, delivered: dict[str, Message]) -> None:
        """Hand each receiver its copy of a server message (what :meth:`Channel.broadcast` returned):
        applied now by :meth:`receive` in-process, queued for the client's node on Flower."""
        if self.env.deliver is not None:
            for name, msg in delivered.items():
                self.env.deliver(name, msg)
            return
        by_name = {c.name: c for c in self.env.clients}
        for name, msg in delivered.items():
            self.receive(by_name[name], msg)

    def client_state(self, client: Client) -> dict[str, torch.Tensor]:
        """What the client keeps between rounds beside its model's state dict (checkpoints; a Flower node's
        state). Default: its personal parts (:attr:`personal`); extend it with the method's per-client tensors."""
        return {f"personal/{part}/{k}": v for part, tensors in self.personal.get(client.name, {}).items() for k, v in tensors.items()}

    def load_client_state(self, client: Client, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`client_state` returned."""
        kept: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            if key.startswith("personal/"):
                part, name = key.removeprefix("personal/").split("/", 1)
                kept.setdefault(part, {})[name] = value
        if kept:
            self.personal[client.name] = kept

    def predict(self, client: Client, x: torch.Tensor) -> torch.Tensor:
        """Class scores of ``client`` as the method infers at the end of a round (``--eval global``)."""
        return client.model(x)

    def predict_personal(self, client: Client, x: torch.Tensor) -> torch.Tensor:
        """Class scores with the client's own parts (``--eval personal``; :attr:`personal_parts` are
        already swapped back to their state after local training). Default: :meth:`predict`."""
        return self.predict(client, x)

    def server_state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        pass

    # -------------------------------------------------------------- helpers
    @property
    def channel(self):
        return self.env.channel

    def send(self, msg: Message, truth: dict[str, torch.Tensor] | None = None) -> Message:
        return self.env.channel.send(msg, truth=truth)

    def client_names(self) -> list[str]:
        return [c.name for c in self.env.clients]

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        """The run's optimizer over ``params`` (see :meth:`LocalTrainer.make_optimizer`)."""
        return self.trainer.make_optimizer(params)

    def local_train(
        self,
        rnd: int,
        client: Client,
        extra_loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> float:
        """Local CE training (Eq. 1 of FedRE) for ``local_epochs``; returns the mean batch loss.

        ``extra_loss(reps, logits, y)`` adds a method's regulariser (e.g. FedProto's prototype term).
        A shortcut for ``self.trainer.fit(rnd, client, objective).loss``; use the trainer directly for
        other objectives, parameter groups or hooks.
        """
        objective = with_representation_term(extra_loss) if extra_loss is not None else None
        return self.fit(rnd, client, objective).loss

    def fit(self, rnd: int, client: Client, objective=None, **hooks: Any) -> LocalStats:
        """:meth:`LocalTrainer.fit` on one client (objective, parameters, optimizer, before_step, epochs);
        afterwards keeps a copy of the client's :attr:`personal_parts` for personal evaluation (with
        :attr:`stateless_clients`, the engine scores the model at once instead)."""
        stats = self.trainer.fit(rnd, client, objective, **hooks)
        if self.stateless_clients and self.env.score_personal is not None:
            self.personal.pop(client.name, None)  # a copy restored from an older checkpoint is superseded
            self.env.score_personal(client)  # scored now (the whole model is personal): no copy kept
        elif self.personal_parts:
            model = client.model
            self.personal[client.name] = {
                part: {k: v.clone() for k, v in module_tensors(model.get_submodule(part) if part else model).items()} for part in self.personal_parts
            }
        return stats

    @torch.no_grad()
    def representations(self, client: Client, idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample mapped representations (after RM) of the client's train split, eval mode."""
        model = client.model
        model.eval()
        idx = client.train_idx if idx is None else idx
        reps, labels = [], []
        with compute_layout(model, self.cfg.memory_format):
            for x, y in self.env.data.batches(idx, self.cfg.eval_batch_size):
                reps.append(model.represent(x))
                labels.append(y)
        return torch.cat(reps), torch.cat(labels)  # (n, d), (n,)


class UploadStream:
    """The selected clients' rounds, run as their uploads are read (:meth:`FLMethod.run_round`).

    Iterating it runs each client's :meth:`FLMethod.client_round`, sends its uploads through the channel
    and yields their delivered copies; ``metrics`` collects the clients' rows. With ``--client-workers``
    above 1 and a method that declares :attr:`FLMethod.parallel_clients`, up to twice as many clients as
    workers train ahead of the reader in threads; sending stays in this thread, in the order of
    selection. A method with :attr:`FLMethod.streams_uploads` reads it once inside
    :meth:`FLMethod.server_round`; :meth:`finish` then checks that every client ran."""

    def __init__(self, method: FLMethod, rnd: int, selected: list[Client]):
        self.method, self.rnd, self.selected = method, rnd, selected
        self.metrics: list[dict[str, float]] = []
        self._started = False
        self._done = 0

    def __iter__(self) -> Iterator[Message]:
        if self._started:
            raise PrivflError(
                f"{self.method.name} read its uploads twice in server_round; with streams_uploads = True they can be read once "
                "(set streams_uploads = False on the class to get them as a list)"
            )
        self._started = True
        method, rnd = self.method, self.rnd
        for client, reply in ordered_map(
            lambda c: method.client_round(rnd, c), self.selected, method.env.client_workers, what=f"{method.name} round {rnd}"
        ):
            delivered = [self.method.send(msg, truth) for msg, truth in reply.uploads]
            self.metrics.append(reply.metrics)
            self.method.sent(client)
            self._done += 1
            yield from delivered

    def finish(self) -> None:
        if self._done != len(self.selected):
            raise PrivflError(
                f"{self.method.name}.server_round stopped reading its uploads after {self._done} of {len(self.selected)} clients; "
                "with streams_uploads = True it must read them all (or set streams_uploads = False)"
            )


class GlobalModelServer(FLMethod):
    """A server that owns the global model and broadcasts it in full to every client.

    The global model is built from client 0's spec with its own seed (as FedAvg does), so every
    client starts from the same weights once the setup broadcast is loaded. With
    :attr:`~FLMethod.stateless_clients` the broadcast is delivered as one copy that every client model
    aliases until it trains (:mod:`privfl.fl.shared`).
    """

    requires_homogeneous = True
    #: the broadcast overwrites the whole model: ``--eval personal`` scores the locally trained one
    personal_parts: ClassVar[tuple[str, ...]] = ("",)

    def __init__(self, env):
        super().__init__(env)
        from privfl.models import build_model

        seed_global(self.cfg.seed, "init", "server-model")
        self.global_model = build_model(**env.clients[0].model.spec).to(env.device)
        self._shared: SharedTensors | None = None  # the last broadcast copy clients alias (stateless_clients)

    def setup(self) -> None:
        self.broadcast(0, "setup")

    def broadcast(self, rnd: int, phase: str = "train") -> None:
        """Send the full global state dict to every client; each loads its delivered copy (:meth:`receive`)."""
        tensors = module_tensors(self.global_model)
        delivered = self.channel.broadcast(rnd, self.client_names(), "model", tensors, meta={"phase": phase}, shared=self.stateless_clients)
        self.deliver(delivered)

    def receive(self, client: Client, msg: Message) -> None:
        if self.stateless_clients:
            self.share_state(client, msg.tensors)
        else:
            load_module_tensors(client.model, msg.tensors)

    def share_state(self, client: Client, tensors: dict[str, torch.Tensor]) -> None:
        """Bind the client's model to ``tensors`` (copy-on-write); the clients given the same dict share one copy."""
        if self._shared is None or self._shared.tensors is not tensors:
            if self._shared is not None:
                self._shared.check()
            self._shared = SharedTensors(tensors)
        bind_shared(client.model, self._shared)

    def sent(self, client: Client) -> None:
        """A stateless client's trained weights are dead once sent (the round's broadcast replaces them):
        it aliases the last broadcast again, so a round holds one trained model at a time."""
        if self.stateless_clients and self._shared is not None:
            bind_shared(client.model, self._shared)

    def server_state(self) -> dict[str, torch.Tensor]:
        return module_tensors(self.global_model)

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        load_module_tensors(self.global_model, state)


def route_gossip(
    topology: Any, rnd: int, sent: dict[int, list[tuple[Message, dict[str, torch.Tensor] | None]]]
) -> list[tuple[int, Message, dict[str, torch.Tensor] | None]]:
    """The nodes' gossip messages as (receiver, message, truth), in the order of ``topology.edges(rnd)``
    (the capture's order on every engine); a message off the round's edges is an error, in one line."""
    by_edge: dict[tuple[int, int], list[tuple[Message, dict[str, torch.Tensor] | None]]] = {}
    for sender, messages in sent.items():
        for msg, truth in messages:
            receiver = int(msg.receiver.removeprefix("client")) if msg.receiver.startswith("client") else -1
            if msg.sender != f"client{sender}":
                raise PrivflError(f"client{sender}'s gossip holds a message from {msg.sender} to {msg.receiver} (a node sends its own)")
            by_edge.setdefault((sender, receiver), []).append((msg, truth))
    routed = []
    for edge in topology.edges(rnd):  # an edge's messages in the order the sender listed them (DRDFL: Learngene, Gaussians)
        for msg, truth in by_edge.pop(edge, []):
            routed.append((edge[1], msg, truth))
    if by_edge:
        (s, r), _ = next(iter(by_edge.items()))
        raise PrivflError(f"client{s} sent to client{r} in round {rnd}, which is not one of its out-neighbours then")
    return routed


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per-key mean of the clients' round metrics (a key some clients lack is averaged over those that have it)."""
    keys = dict.fromkeys(k for row in rows for k in row)
    return {k: sum(row[k] for row in rows if k in row) / sum(1 for row in rows if k in row) for k in keys}


def class_prototypes(reps: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(classes present, their mean representations (k, d), sample counts) of one client."""
    counts = torch.bincount(labels, minlength=num_classes)
    sums = torch.zeros(num_classes, reps.shape[1], dtype=reps.dtype, device=reps.device)
    sums.index_add_(0, labels, reps)
    present, means = present_class_means(sums, counts)
    return present, means, counts[present]


def present_class_means(sums: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(classes with a non-zero count, their means (k, d)) from per-class sums (C, d) and counts (C,)."""
    present = torch.nonzero(counts, as_tuple=False).flatten()
    return present, sums[present] / counts[present].unsqueeze(1).to(sums.dtype)


def global_test_indices(test_sets: list[torch.Tensor], n: int, seed: int) -> torch.Tensor:
    """DRDFL's Global-T set (its Sec. V-A, "the union of all clients' local test data"): the sorted union of
    the clients' test indices, or a seeded subset of ``n`` of them when ``0 < n`` < the union. One rule
    for the engine's ``--global-test`` and DRDFL's own ``global_test_samples``, so their numbers agree."""
    from privfl.seeding import numpy_rng

    union = torch.cat([t.cpu() for t in test_sets]).sort().values
    if 0 < n < len(union):
        keep = np.sort(numpy_rng(seed, "global-test").permutation(len(union))[:n])
        union = union[torch.from_numpy(keep)]
    return union.to(test_sets[0].device)


def average_states(received: list[Message], reference: dict[str, torch.Tensor], weighting: str = "samples") -> dict[str, torch.Tensor]:
    """FedAvg's aggregate: the mean of the received state dicts, weighted by their ``num_samples``
    (``samples``) or not (``uniform``), accumulated in float64 in the order received (so FedAvg, FedProx,
    FedBN and FedGen's model variant agree bit for bit) and cast to ``reference``'s dtypes and device;
    integer buffers such as BatchNorm's counters are rounded."""
    total = 0.0
    acc: dict[str, torch.Tensor] = {}
    for msg in received:
        w = float(msg.meta["num_samples"]) if weighting == "samples" else 1.0
        total += w
        for k, v in msg.tensors.items():
            # the same two float64 roundings as acc + v * w, in place on a copy (no temporaries: 3 ms less per cnn4 upload)
            v = v.to(reference[k].device, torch.float64, copy=True).mul_(w)
            if k in acc:
                acc[k].add_(v)
            else:
                acc[k] = v
    out = {}
    for k, v in acc.items():
        mean = v / total
        out[k] = mean.to(reference[k].dtype) if reference[k].is_floating_point() else mean.round().to(reference[k].dtype)
    return out


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's parameters and buffers as detached tensors (what goes into a message)."""
    return {k: v.detach() for k, v in module.state_dict().items()}


def load_module_tensors(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    own_tensors(module)  # a model aliasing a shared broadcast takes its own copy before it is written
    module.load_state_dict({k: v.to(next(iter(module.state_dict().values())).device) for k, v in tensors.items()})


def _named_by_user(module: str) -> bool:
    """Already imported, or inside a package the user named with ``--plugin``."""
    from privfl.cli import NAMED_MODULES

    return module in sys.modules or any(module == m or module.startswith(m + ".") for m in NAMED_MODULES)


def resolve_method(name: str, *, source: str | None = None) -> type[FLMethod]:
    """A registered method, or a user's ``package.module:Class`` (imported, never eval'd), checked by
    :func:`check_method_class`.

    ``source`` says the name was read from a file (a run's ``config.json``/``run.json``) rather than
    given by the user: then an import path is resolved only if its module is already imported (the
    user named it: ``--plugin``, the command line, or an ``import``), because opening a run someone
    sent you must never run code it names. A submodule of a package named with ``--plugin`` counts as named."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"method must be a name or an import path pkg.mod:Class, got {str(name)[:60]!r}")
    if ":" not in name:
        return METHODS.get(name)
    module_name, _, attr = name.partition(":")
    if source is not None and not _named_by_user(module_name):
        raise ConfigError(
            f"{source} names the method {name[:80]!r}, which is code; privfl does not import code named in a run's files: "
            f"if you trust it, name it yourself with --plugin {module_name[:60]}"
        )
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot import method {name!r}: {exc}") from None
    if not (isinstance(obj, type) and issubclass(obj, FLMethod)):
        raise ConfigError(f"{name!r} is not a subclass of privfl.methods.FLMethod")
    check_method_class(obj)
    return obj


#: hooks of earlier releases that are no longer called, with what replaces them
_RETIRED_HOOKS = {
    "leakage_module": "declare leakage = {KIND: LeakageContext(previous=..., module='submodule.path', ...)}",
    "attacker_previous_state": "declare leakage = {KIND: LeakageContext(previous=KIND, previous_rule=...)}",
}


def check_method_class(cls: type[FLMethod]) -> None:
    """One-line errors for a method that cannot work, found when it is loaded (before any training):
    unknown kinds or directions in ``sends``, leakage declarations of kinds it does not send, and hooks
    of earlier releases that privfl no longer calls (docs/extending.md, "Migrating")."""
    label = cls.name or cls.__name__
    if not isinstance(cls.sends, dict):
        raise ConfigError(f"{label}.sends must be a dict kind -> direction, e.g. {{'model': 'up/down'}}")
    check_sends(label, cls.sends)
    for hook, instead in _RETIRED_HOOKS.items():
        if any(hook in vars(k) for k in cls.__mro__ if k is not FLMethod):
            raise ConfigError(
                f"{label}.{hook} is no longer called (attacks read declared data, not method code): {instead}; see docs/extending.md#migrating"
            )
    if cls.stateless_clients:
        default_predictions = cls.predict is FLMethod.predict and cls.predict_personal is FLMethod.predict_personal
        if not issubclass(cls, GlobalModelServer) or cls.personal_parts != ("",) or not default_predictions:
            raise ConfigError(
                f"{label}.stateless_clients needs a GlobalModelServer whose broadcast replaces the whole client model "
                "(personal_parts = ('',)) and the default predict/predict_personal"
            )
    unknown = [e for e in cls.exposes if e not in EXPOSURES]
    if unknown:
        raise ConfigError(f"{label}.exposes names {', '.join(map(repr, unknown))}; accepted: {', '.join(EXPOSURES)}")
    for kind, ctx in cls.leakage.items():
        if kind not in cls.sends:
            raise ConfigError(f"{label}.leakage declares {kind!r}, which it does not send (sends: {', '.join(cls.sends) or 'nothing'})")
        if not isinstance(ctx, LeakageContext):
            raise ConfigError(f"{label}.leakage[{kind!r}] must be a privfl.methods.LeakageContext")
