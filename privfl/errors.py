"""User-facing errors.

Every CLI catches :class:`PrivflError`, prints its message on one line and exits with status 2, so
bad input (unknown names, missing data, corrupt captures) never produces a traceback or half-written
output. Internal bugs are *not* PrivflErrors and keep their tracebacks.
"""

from __future__ import annotations

from collections.abc import Iterable


class PrivflError(Exception):
    """An error caused by the user's input; shown as one line, exit status 2."""

    exit_code = 2


class UnknownNameError(PrivflError, KeyError):
    """A name that is not in a registry; the message lists the accepted names."""

    def __init__(self, what: str, name: str, accepted: Iterable[str]):
        self.what, self.name, self.accepted = what, name, sorted(accepted)
        super().__init__(f"unknown {what} {name!r}; accepted: {', '.join(self.accepted) or '(none)'}")

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return self.args[0]


class DataMissingError(PrivflError):
    """A dataset is not on disk; the message says how to obtain it."""


class ConfigError(PrivflError):
    """An invalid option value or an inconsistent combination of options."""


class PartitionError(PrivflError):
    """A partition cannot give every client enough samples (fail fast, never loop)."""


class CaptureError(PrivflError):
    """A capture (or knowledge / ground-truth store) is missing, foreign or corrupt."""
