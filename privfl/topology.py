"""Who talks to whom: the star (a server and its clients) and DRDFL's unidirectional ring.

The engine builds one topology per run (``FLMethod.build_topology``) and hands it to the method in
``FLEnv.topology``; the engine's client selection asks it which nodes are live in a round. A ring
node m sends to its successor and receives from its predecessor (DRDFL Fig. 1(a): "client 1 receives
the model from client 4 ... transmits the locally updated model to client 2"). A failed node is
skipped (DRDFL Sec. III: "If a client node ... fails, it will directly skip communication with the
next client node"): its predecessor sends to the next live node instead.

Failures are a pure function of (spec, seed, round), so a resumed run sees the same failures:
``failures`` lists outages as ``NODE@ROUND`` (down from ROUND on) or ``NODE@FIRST-LAST`` (down in
rounds FIRST..LAST inclusive), comma separated; ``failure_rate`` adds seeded transient outages (each
node down in a round with that probability, at least two nodes always kept live).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
            dead = {o.node for o in self.outages if o.covers(rnd)}
            if self.failure_rate > 0:
                draws = numpy_rng(self.seed, "ring-failure", rnd).random(self.num_nodes)
                for node in map(int, (draws < self.failure_rate).nonzero()[0]):
                    if self.num_nodes - len(dead | {node}) >= 2:
                        dead.add(node)
            if self.num_nodes - len(dead) < 1:
                raise ConfigError(f"every ring node is down in round {rnd}: check the listed failures")
            self._cache[rnd] = frozenset(dead)
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

    def edges(self, rnd: int) -> list[tuple[int, int]]:
        """(sender, receiver) of every live link in round ``rnd``, in ring order."""
        out = []
        for m in self.alive(rnd):
            nxt = self.successor(m, rnd)
            if nxt is not None:
                out.append((m, nxt))
        return out


Topology = Star | Ring

__all__ = ["Outage", "Ring", "Star", "Topology", "parse_failures"]
