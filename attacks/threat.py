"""What an attacker knows beyond the captured messages, declared per attack and recorded per run.

After LeakPro's documented capability flags: every field says what it grants, an attack declares
the fields it ``needs`` (no default), and the runner refuses to start when the run does not provide
them, naming what is missing. Ground truth is never a capability.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from privfl.run import AttackerView


@dataclass(frozen=True)
class Knowledge:
    extractor: bool = False
    """White-box access to the attacked client's extractor incl. its representation mapping, as it was
    when it produced the artifact (FedRE [000] Sec. 3: the server "can illegally access the
    representation extractors of clients")."""

    previous_state: bool = False
    """The parameters the attacker itself last sent or received, so a parameter message becomes an update."""

    local_hyperparameters: bool = False
    """The clients' local steps, learning rate and batch size (known to a server that set them)."""

    candidates: bool = False
    """Candidate records to test, handed over by the challenger of the membership game: some of the
    client's training samples and as many of its held-out samples, with their labels, membership hidden
    (Shokri et al., S&P 2017; Carlini et al., S&P 2022). The runner builds them from ground truth."""

    population: bool = False
    """Samples of the data distribution that the attacked client never trained on (other clients'
    held-out samples), for shadow models. The runner provides them, as the challenger would."""

    def missing(self, available: Knowledge) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) and not getattr(available, f.name)]

    def granted(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name)]


#: threat models of the literature, by name
THREAT_MODELS: dict[str, tuple[Knowledge, str]] = {
    "curious-server-whitebox-extractor": (
        Knowledge(extractor=True),
        "honest-but-curious server that also holds each client's extractor (FedRE [000] Sec. 3)",
    ),
    "curious-server-whitebox-extractor-population": (
        Knowledge(extractor=True, population=True),
        "honest-but-curious server that holds each client's extractor (FedRE [000] Sec. 3) and samples of the data distribution "
        "the client never trained on (other clients' held-out samples), to train an inverse network through the extractor "
        "(He, Zhang, Lee, ACSAC 2019)",
    ),
    "eavesdropper-population": (
        Knowledge(population=True),
        "anyone who sees the messages (the server, a neighbour, an eavesdropper on the link) and holds samples of the data "
        "distribution, no model of the client: it trains a substitute extractor to reproduce what the messages carry",
    ),
    "curious-server-previous-state": (
        Knowledge(previous_state=True, local_hyperparameters=True),
        "honest-but-curious server that knows the architecture, the state it last broadcast and the local hyperparameters",
    ),
    "curious-server-previous-state-population": (
        Knowledge(previous_state=True, local_hyperparameters=True, population=True),
        "honest-but-curious server that knows the architecture, the state it last broadcast and the local hyperparameters, and "
        "holds samples of the data distribution the client never trained on, to train an inverse network through that state's features",
    ),
    "eavesdropper": (
        Knowledge(),
        "anyone who sees the messages (the server, a neighbour, an eavesdropper on the link) and nothing else",
    ),
    "curious-server-membership": (
        Knowledge(previous_state=True, candidates=True, population=True),
        "honest-but-curious server that rebuilds a client's model from what it captured and is handed candidate records "
        "(membership hidden) plus population data for shadow models: the membership-inference game",
    ),
    "curious-server-extractor-membership": (
        Knowledge(extractor=True, candidates=True, population=True),
        "honest-but-curious server that holds each client's extractor, completes it with the head it broadcast, and is handed "
        "candidate records (membership hidden) plus population data for shadow models: the membership-inference game",
    ),
    "eavesdropper-membership": (
        Knowledge(candidates=True, population=True),
        "anyone who sees the messages, no model of the client, handed candidate records (membership hidden) and "
        "population data for reference models: the membership-inference game on what was transmitted",
    ),
}


def available(view: AttackerView) -> Knowledge:
    """What a run lets an attacker have. Extractors only when the run declares and stores them; the
    previous state when some message an attack could take as one (a kind named ``previous`` by a
    leakage declaration of a kind the run sends) was delivered to a client; the local
    hyperparameters always, since the server set them (they are the run's config)."""
    method = view.method_cls
    previous_kinds = {ctx.previous for k in view.kinds() if (ctx := method.leakage_context(k)) is not None}
    return Knowledge(
        extractor="extractor" in view.granted(),
        previous_state=any(r["receiver"] != "server" and r["kind"] in previous_kinds for r in view.records()),
        local_hyperparameters=True,
        candidates=True,  # the membership game's challenger (the runner) always hands these over
        population=True,
    )


#: the threat-model classes of Carletti et al., "SoK: Gradient Inversion Attacks in Federated Learning"
#: (USENIX Security 2025, its threat-model table): what a passive attacker holds beyond the messages (A-E), and whether it
#: manipulates the model or the clients (F-H). privfl's attacks are passive, so they fall in A-E.
SOK_CLASSES = {
    "A": "eavesdropper: the model updates only",
    "B": "informed eavesdropper: updates and the model's architecture",
    "C": "parameter-aware eavesdropper: updates, architecture and training details (hyperparameters)",
    "D": "data-enhanced eavesdropper: as C, plus surrogate data from the same distribution",
    "E": "statistical-informed eavesdropper: as D, plus the client's data distribution (e.g. batch statistics)",
    "F": "active manipulator: modifies the model sent to clients",
    "G": "data-enhanced manipulator: as F, with surrogate data",
    "H": "active client manipulator: as G, and chooses which clients train",
}


def sok_class(threat_model: str) -> tuple[str, str]:
    """(letter, text) of a privfl threat model in the SoK's classes, from the knowledge it grants: population
    data is the SoK's surrogate data (D); a previous state or local hyperparameters are training details (C);
    a client's extractor is white-box knowledge of a private model, which the SoK's classes do not cover, so
    such models are marked ``B+`` (more than the architecture, no training details); otherwise A."""
    knowledge = THREAT_MODELS[threat_model][0]
    extra = " (+ the client's private extractor, beyond the SoK's classes)" if knowledge.extractor else ""
    if knowledge.population:
        return "D", SOK_CLASSES["D"] + extra
    if knowledge.previous_state or knowledge.local_hyperparameters:
        return "C", SOK_CLASSES["C"] + extra
    if knowledge.extractor:
        return "B+", SOK_CLASSES["B"] + extra
    return "A", SOK_CLASSES["A"]
