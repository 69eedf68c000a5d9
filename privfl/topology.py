"""Who talks to whom: the star (a server and its clients), DRDFL's unidirectional ring, and general
neighbour graphs (bidirectional ring, k-regular, random time-varying, complete) for the decentralised
baselines (DisPFL, DFedPGP, ...).

The engine builds one topology per run (``FLMethod.build_topology``) and hands it to the method in
``FLEnv.topology``; the engine's client selection asks it which nodes are live in a round. Every
decentralised topology answers the same questions: ``alive(rnd)``, ``down(rnd)``,
``in_neighbors(node, rnd)`` (whose messages a node receives), ``out_neighbors(node, rnd)`` and
``edges(rnd)`` (every live directed link), so a method written against them runs on any of them. A ring
node m sends to its successor and receives from its predecessor (DRDFL Fig. 1(a): "client 1 receives
the model from client 4 ... transmits the locally updated model to client 2"). A failed node is
skipped (DRDFL Sec. III: "If a client node ... fails, it will directly skip communication with the
next client node"): its predecessor sends to the next live node instead.

Failures are a pure function of (spec, seed, round), so a resumed run sees the same failures:
``failures`` lists outages as ``NODE@ROUND`` (down from ROUND on) or ``NODE@FIRST-LAST`` (down in
rounds FIRST..LAST inclusive), comma separated; ``failure_rate`` adds seeded transient outages (each
node down in a round with that probability, at least two nodes always kept live). A node that joins
late (DRDFL Fig. 8's new clients) is an outage from round 0: ``NODE@0-199`` joins in round 200.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from privfl.config import opt
from privfl.errors import ConfigError
from privfl.seeding import numpy_rng


@dataclass(frozen=True)
class Outage:
    node: int
    first: int
    last: int | None  # None: the node never comes back

    def covers(self, rnd: int) -> bool:
        return rnd >= self.first and (self.last is None or rnd <= self.last)


def parse_failures(spec: str, num_nodes: int) -> tuple[Outage, ...]:
    """``"2@3,5@4-6"`` -> outages; a one-line ConfigError on anything else."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        node, sep, when = item.partition("@")
        first, dash, last = when.partition("-")
        try:
            if not sep:
                raise ValueError
            outage = Outage(int(node), int(first), int(last) if dash else None)
        except ValueError:
            raise ConfigError(f"ring failure {item!r}: expected NODE@ROUND or NODE@FIRST-LAST, e.g. 2@3,5@4-6") from None
        if not 0 <= outage.node < num_nodes or outage.first < 0 or (outage.last is not None and outage.last < outage.first):
            raise ConfigError(f"ring failure {item!r}: node must be in 0..{num_nodes - 1} and rounds non-negative, FIRST <= LAST")
        out.append(outage)
    return tuple(out)


def down_nodes(num_nodes: int, outages: tuple[Outage, ...], failure_rate: float, seed: int, rnd: int, label: str) -> frozenset[int]:
    """The nodes down in round ``rnd``: the listed outages, plus each node with probability
    ``failure_rate`` (seeded by round; never below two live nodes). The draw's seed purpose is
    ``ring-failure`` for every topology, so a ring's failures are the same under either class."""
    dead = {o.node for o in outages if o.covers(rnd)}
    if failure_rate > 0:
        draws = numpy_rng(seed, "ring-failure", rnd).random(num_nodes)
        for node in map(int, (draws < failure_rate).nonzero()[0]):
            if num_nodes - len(dead | {node}) >= 2:
                dead.add(node)
    if num_nodes - len(dead) < 1:
        raise ConfigError(f"every {label} node is down in round {rnd}: check the listed failures")
    return frozenset(dead)


@dataclass
class Star:
    """Every client talks to the server; every client is live in every round."""

    num_nodes: int
    kind: str = "star"

    def down(self, rnd: int) -> frozenset[int]:
        return frozenset()

    def alive(self, rnd: int) -> list[int]:
        return list(range(self.num_nodes))


@dataclass
class Ring:
    """Unidirectional ring 0 -> 1 -> ... -> M-1 -> 0 with seeded node failures."""

    num_nodes: int
    outages: tuple[Outage, ...] = ()
    failure_rate: float = 0.0
    seed: int = 0
    kind: str = "ring"
    _cache: dict[int, frozenset[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.num_nodes < 2:
            raise ConfigError(f"a ring needs at least 2 clients, got {self.num_nodes}")
        if not 0.0 <= self.failure_rate < 1.0:
            raise ConfigError(f"ring failure rate must be in [0, 1), got {self.failure_rate}")

    def down(self, rnd: int) -> frozenset[int]:
        """Nodes that are down in round ``rnd`` (listed outages plus seeded random ones)."""
        if rnd not in self._cache:
            self._cache[rnd] = down_nodes(self.num_nodes, self.outages, self.failure_rate, self.seed, rnd, "ring")
        return self._cache[rnd]

    def alive(self, rnd: int) -> list[int]:
        dead = self.down(rnd)
        return [m for m in range(self.num_nodes) if m not in dead]

    def successor(self, node: int, rnd: int) -> int | None:
        """The next live node after ``node`` in ring order (dead ones skipped); None if it is alone."""
        dead = self.down(rnd)
        for step in range(1, self.num_nodes):
            nxt = (node + step) % self.num_nodes
            if nxt not in dead:
                return nxt if nxt != node else None
        return None

    def predecessor(self, node: int, rnd: int) -> int | None:
        dead = self.down(rnd)
        for step in range(1, self.num_nodes):
            prv = (node - step) % self.num_nodes
            if prv not in dead:
                return prv if prv != node else None
        return None

    def out_neighbors(self, node: int, rnd: int) -> list[int]:
        nxt = self.successor(node, rnd)
        return [] if nxt is None or node in self.down(rnd) else [nxt]

    def in_neighbors(self, node: int, rnd: int) -> list[int]:
        prv = self.predecessor(node, rnd)
        return [] if prv is None or node in self.down(rnd) else [prv]

    def edges(self, rnd: int) -> list[tuple[int, int]]:
        """(sender, receiver) of every live link in round ``rnd``, in ring order."""
        out = []
        for m in self.alive(rnd):
            nxt = self.successor(m, rnd)
            if nxt is not None:
                out.append((m, nxt))
        return out


GRAPH_SHAPES = ("ring", "ring2", "kregular", "random", "full")


@dataclass
class Graph:
    """A directed neighbour graph over ``num_nodes`` nodes with the ring's seeded failures.

    Shapes (``shape``):

    - ``ring``: unidirectional ring, node m receives from its live predecessor (DRDFL's topology, the
      one DRDFL Sec. VII-B3 runs DisPFL, DFedPGP and Fedcvae on); dead nodes are skipped as in :class:`Ring`.
    - ``ring2``: bidirectional ring, the live predecessor and the live successor.
    - ``kregular``: a static undirected ``degree``-regular graph: the nodes in a seeded random order on a
      circle, each linked to the ``degree // 2`` next on either side (``degree`` even; a seeded circulant
      graph, so every node has exactly ``degree`` neighbours). Dead neighbours are missing, not rewired.
    - ``random``: time-varying: in each round every live node receives from ``degree`` distinct other
      live nodes drawn uniformly, seeded by (seed, round) (DisPFL's "each client randomly selects its
      neighbours in each round"; directed, so in- and out-degree may differ).
    - ``full``: every live node receives from every other live node.

    The graph of a round is a pure function of (shape, degree, seed, round, failures), so a resumed run
    and ``privfl verify`` see the same links.
    """

    num_nodes: int
    shape: str = "ring"
    degree: int = 2
    outages: tuple[Outage, ...] = ()
    failure_rate: float = 0.0
    seed: int = 0
    kind: str = "graph"
    _down: dict[int, frozenset[int]] = field(default_factory=dict, repr=False)
    _in: dict[int, dict[int, list[int]]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.shape not in GRAPH_SHAPES:
            raise ConfigError(f"graph shape must be one of {', '.join(GRAPH_SHAPES)}, got {self.shape!r}")
        if self.num_nodes < 2:
            raise ConfigError(f"a {self.shape} graph needs at least 2 clients, got {self.num_nodes}")
        if not 0.0 <= self.failure_rate < 1.0:
            raise ConfigError(f"node failure rate must be in [0, 1), got {self.failure_rate}")
        if self.shape in ("kregular", "random") and not 1 <= self.degree <= self.num_nodes - 1:
            raise ConfigError(f"--degree must be in 1..{self.num_nodes - 1} for {self.num_nodes} clients, got {self.degree}")
        if self.shape == "kregular" and self.degree % 2:
            raise ConfigError(f"a k-regular graph here takes an even --degree (degree//2 neighbours on either side), got {self.degree}")
        self._order = [int(i) for i in numpy_rng(self.seed, "graph-order").permutation(self.num_nodes)]

    def down(self, rnd: int) -> frozenset[int]:
        if rnd not in self._down:
            self._down[rnd] = down_nodes(self.num_nodes, self.outages, self.failure_rate, self.seed, rnd, self.shape)
        return self._down[rnd]

    def alive(self, rnd: int) -> list[int]:
        dead = self.down(rnd)
        return [m for m in range(self.num_nodes) if m not in dead]

    def _live_step(self, node: int, rnd: int, direction: int) -> int | None:
        dead = self.down(rnd)
        for step in range(1, self.num_nodes):
            other = (node + direction * step) % self.num_nodes
            if other not in dead:
                return other if other != node else None
        return None

    def _receives_from(self, rnd: int) -> dict[int, list[int]]:
        if rnd in self._in:
            return self._in[rnd]
        dead, live = self.down(rnd), self.alive(rnd)
        out: dict[int, list[int]] = {}
        for m in live:
            if self.shape == "ring":
                senders = [self._live_step(m, rnd, -1)]
            elif self.shape == "ring2":
                senders = [self._live_step(m, rnd, -1), self._live_step(m, rnd, +1)]
            elif self.shape == "kregular":
                pos = self._order.index(m)
                half = self.degree // 2
                senders = [self._order[(pos + d) % self.num_nodes] for d in range(-half, half + 1) if d != 0]
            elif self.shape == "random":
                others = [n for n in live if n != m]
                k = min(self.degree, len(others))
                pick = numpy_rng(self.seed, "graph-random", rnd, m).choice(len(others), k, replace=False) if k else np.zeros(0, dtype=int)
                senders = [others[int(i)] for i in sorted(pick)]
            else:  # full
                senders = [n for n in live if n != m]
            out[m] = sorted({s for s in senders if s is not None and s != m and s not in dead})
        self._in[rnd] = out
        return out

    def in_neighbors(self, node: int, rnd: int) -> list[int]:
        """The live nodes whose messages ``node`` receives in round ``rnd`` (none when it is down)."""
        return list(self._receives_from(rnd).get(node, []))

    def out_neighbors(self, node: int, rnd: int) -> list[int]:
        """The live nodes ``node`` sends to in round ``rnd``."""
        return [m for m, senders in self._receives_from(rnd).items() if node in senders]

    def edges(self, rnd: int) -> list[tuple[int, int]]:
        """(sender, receiver) of every live link in round ``rnd``, sorted."""
        return sorted((s, m) for m, senders in self._receives_from(rnd).items() for s in senders)


@dataclass
class GraphOptions:
    """The neighbour-graph options every decentralised method shares (inherit them in its Options)."""

    topology: str = opt("ring", "neighbour graph: ring (DRDFL's), ring2, kregular, random (time-varying) or full", choices=GRAPH_SHAPES)
    degree: int = opt(2, "neighbours per node for kregular (even) and random", min=1)
    failures: str = opt("", "node outages NODE@ROUND (down from then on) or NODE@FIRST-LAST, comma separated (NODE@0-K: joins in round K+1)")
    failure_rate: float = opt(0.0, "seeded per-round probability that a node is down (transient)", min=0, max_exclusive=1)

    #: a method's own default graph differs from DRDFL's ring where its paper says so (override in the subclass)
    paper_topology: ClassVar[str] = ""


def build_graph(cfg: Any, opts: Any) -> Graph:
    """The run's :class:`Graph` from a method's :class:`GraphOptions` (one-line errors on bad values)."""
    return Graph(cfg.num_clients, opts.topology, opts.degree, parse_failures(opts.failures, cfg.num_clients), opts.failure_rate, cfg.seed)


Topology = Star | Ring | Graph

__all__ = ["GRAPH_SHAPES", "Graph", "GraphOptions", "Outage", "Ring", "Star", "Topology", "build_graph", "down_nodes", "parse_failures"]
