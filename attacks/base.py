"""What every attack shares: the registry, and the check that a run grants what an attack needs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from privfl.errors import CaptureError
from privfl.registry import Registry

if TYPE_CHECKING:
    from attacks.view import AttackerView

#: attack name -> class with ``consumes``, ``needs``, ``threat_model`` and ``paper``
ATTACKS: Registry[type] = Registry("attack")


def require_knowledge(attack, view: AttackerView) -> None:
    """Refuse, before optimising anything, an attack whose declared ``needs`` the run does not grant."""
    missing = attack.needs.missing(view.available())
    if missing:
        raise CaptureError(
            f"attack {attack.name} needs {', '.join(missing)}, which run {view.run_dir} does not provide "
            "(train with capture on; for extractor knowledge the method must expose client extractors)"
        )
