"""Client-level privacy accounting for the ``dp`` defense, with opacus' RDP accountant.

DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR 2018)
protects a client's whole contribution per round: its clipped update plus Gaussian noise of std
``noise_multiplier * max_norm`` is one application of the sampled Gaussian mechanism, with sampling
rate the fraction of clients selected per round. We therefore keep one opacus ``RDPAccountant`` per
client and step it once per round in which that client's contribution was defended, however many
messages it sent that round (they are parts of one round's contribution).

We rely on opacus rather than our own RDP arithmetic so that the numbers match a widely reviewed
implementation; it is imported lazily because importing opacus costs seconds.
"""

from __future__ import annotations

from typing import Any


class ClientAccountant:
    """One RDP accountant per client; at most one step per client per round."""

    name = "opacus RDP"

    def __init__(self, noise_multiplier: float, sample_rate: float, delta: float):
        self.noise_multiplier = noise_multiplier
        self.sample_rate = sample_rate
        self.delta = delta
        self._accountants: dict[str, Any] = {}
        self._rounds: dict[str, set[int]] = {}

    def record(self, client: str, round: int) -> bool:
        """Count ``client``'s participation in ``round``; returns whether a new step was taken."""
        seen = self._rounds.setdefault(client, set())
        if round in seen:
            return False
        seen.add(round)
        if client not in self._accountants:
            from opacus.accountants import RDPAccountant

            self._accountants[client] = RDPAccountant()
        self._accountants[client].step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        return True

    def steps(self, client: str) -> int:
        return len(self._rounds.get(client, ()))

    def epsilon(self, client: str) -> float:
        """(epsilon, delta)-DP epsilon spent so far by ``client`` (0.0 before its first step)."""
        acc = self._accountants.get(client)
        return 0.0 if acc is None else float(acc.get_epsilon(delta=self.delta))

    def epsilons(self) -> dict[str, float]:
        return {c: self.epsilon(c) for c in sorted(self._accountants)}
