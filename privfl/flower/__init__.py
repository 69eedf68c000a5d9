"""privfl on Flower (``--engine flower``): the same methods, capture and run layout, with clients as
Flower ClientApps driven by a ServerApp (:mod:`privfl.flower.server`, :mod:`privfl.flower.node`).

Flower is an optional extra; nothing here is imported unless a run asks for it."""

from __future__ import annotations

from privfl.errors import ConfigError

INSTALL = "uv sync --extra flower (or: pip install 'privfl[flower]')"


def require_flower() -> None:
    """A one-line error saying how to install Flower when it is missing."""
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise ConfigError(f"--engine flower needs Flower, which is not installed: {INSTALL}") from None


__all__ = ["INSTALL", "require_flower"]
