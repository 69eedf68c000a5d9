"""Attacks that read captured artifacts (representation inversion, gradient leakage) and their metrics."""

from attacks import gradleak, invert  # noqa: E402,F401  (registration in ATTACKS)
from attacks.base import ATTACKS  # noqa: E402

__all__ = ["ATTACKS"]
