"""Attacks that read captured artifacts, the runner that scores them, and the metrics.

Public API (stable): :class:`Attack`, :data:`ATTACKS`, :func:`create_attack`, :func:`register_attack`,
:class:`Selection`, :class:`Target`, :class:`Plan`, :class:`Reconstruction`,
:class:`AttackNotApplicable`, :func:`run_attack` and :class:`AttackReport`, :func:`compare_artifacts`,
:class:`Knowledge` and :data:`THREAT_MODELS`. Built-in attacks register themselves when the registry
is first used: image reconstruction (``invert``, ``dlg``, ``idlg``, ``ig``), label inference
(``labels``, ``labels-delta``) and membership inference (``mia-loss``, ``mia-lira``, their
``-extractor`` variants, ``mia-logits``). :mod:`attacks.audit` runs them all on a method.
"""

from attacks.base import ATTACKS, Attack, AttackNotApplicable, Plan, Reconstruction, Selection, Target, create_attack, register_attack
from attacks.compare import compare_artifacts
from attacks.runner import AttackReport, run_attack
from attacks.threat import THREAT_MODELS, Knowledge

__all__ = [
    "ATTACKS",
    "THREAT_MODELS",
    "Attack",
    "AttackNotApplicable",
    "AttackReport",
    "Knowledge",
    "Plan",
    "Reconstruction",
    "Selection",
    "Target",
    "compare_artifacts",
    "create_attack",
    "register_attack",
    "run_attack",
]
