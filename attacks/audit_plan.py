"""What an audit is made of, apart from running it: its profiles (training size and attack budgets), the
subjects it trains and attacks, and the outcome of each attack. :mod:`attacks.audit` runs them and
:mod:`attacks.audit_report` writes them up; both read this module, neither reads the other's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attacks.dip import PAPER_SETTINGS
from attacks.runner import AttackReport
from privfl.run import Run


@dataclass(frozen=True)
class Profile:
    """How big the trained runs are and how hard each attack tries."""

    name: str
    description: str
    train: dict[str, Any]  # run options of every trained run (over the methods' own quick defaults)
    attack_clients: int  # clients attacked per kind and round
    attack_options: dict[str, dict[str, Any]]  # per attack name: Config fields (unknown ones are skipped)
    max_targets: int = 1  # rows per representation message


PROFILES: dict[str, Profile] = {
    "quick": Profile(
        "quick",
        "minutes on 2 CPU cores: 6000 samples, 5 rounds, 2 clients attacked, short optimisations",
        {"subsample": 6000, "rounds": 5},
        2,
        {
            "invert": {"steps": 300, "batch": 16},
            "invert-learned": {"steps": 400, "shifts": 3},
            "invert-substitute": {"steps": 400, "shifts": 3, "substitute_steps": 300},
            "invert-head": {"steps": 400, "shifts": 3},
            "dlg": {"steps": 20, "max_batch": 1, "lbfgs_max_iter": 10},
            "idlg": {"steps": 20, "max_batch": 1, "lbfgs_max_iter": 10},
            "ig": {"steps": 300, "max_batch": 1},
            "mia-loss": {"queries": 200},
            "mia-lira": {"queries": 200, "population": 600, "shadows": 2, "shadow_epochs": 2},
            "mia-rmia": {"queries": 200, "population": 600, "shadows": 2, "shadow_epochs": 2},
            "mia-logits": {"queries": 200, "population": 600, "matching_rounds": 4},
        },
    ),
    "standard": Profile(
        "standard",
        "the default training run (the method's quick CPU default) with stronger attacks on 3 clients",
        {},
        3,
        {
            "invert": {"steps": 1000},
            "dlg": {"steps": 100, "max_batch": 4},
            "idlg": {"steps": 100, "max_batch": 4},
            "ig": {"steps": 1000, "max_batch": 4},
            "mia-loss": {"queries": 500},
            "mia-lira": {"queries": 500, "population": 2000, "shadows": 8, "shadow_epochs": 5},
            "mia-rmia": {"queries": 500, "population": 2000, "shadows": 8, "shadow_epochs": 5},
            "mia-logits": {"queries": 500, "population": 2000},
        },
        max_targets=2,
    ),
    "paper": Profile(
        "paper",
        "each attack's own paper settings (DIP 3100 steps, DLG 300, IG 4800, LiRA 64 shadows) on the default training run",
        {},
        4,
        {
            "invert": dict(PAPER_SETTINGS),  # the DIP authors' 3100 steps, lr 1e-3, nearest upsampling
            "dlg": {},
            "idlg": {},
            "ig": {},
            "mia-loss": {"queries": 1000},
            "mia-lira": {"queries": 1000, "shadows": 64},
            "mia-rmia": {"queries": 1000, "shadows": 64},
            "mia-logits": {"queries": 1000, "matching_rounds": 10},
        },
        max_targets=4,
    ),
}


@dataclass
class AttackOutcome:
    """One attack on one kind at one round of one run: its report, or why it did not apply."""

    attack: str
    family: str  # reconstruction | labels | membership
    kind: str
    round: int | None
    threat_model: str
    report: AttackReport | None = None
    reason: str = ""
    fix: str = ""
    seconds: float = 0.0


@dataclass
class Subject:
    """A method the audit trains (or opens) and attacks: the audited one, a defended variant, a reference."""

    role: str  # audited | defended | reference
    method: str
    defenses: list[str] = field(default_factory=list)
    run: Run | None = None
    outcomes: list[AttackOutcome] = field(default_factory=list)
    train_seconds: float = 0.0

    @property
    def label(self) -> str:
        return self.method + (f" + {' + '.join(self.defenses)}" if self.defenses else "")


def reconstruction_psnr(summary: dict[str, Any]) -> float | None:
    """PSNR (dB, per image then averaged) of a reconstruction result: against the exact image when there
    is one, else the best match (gradient leakage scores 'psnr' per matched image)."""
    for key in ("exact_psnr255", "best_psnr255", "psnr"):
        value = summary.get(key)
        if isinstance(value, (int, float)) and value == value:
            return float(value)
    return None


__all__ = ["PROFILES", "AttackOutcome", "Profile", "Subject", "reconstruction_psnr"]
