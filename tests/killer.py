"""Train like ``python -m privfl.train ARGS`` and die mid-round, for the kill-and-resume tests.

    python -m tests.killer ROUND MESSAGES ARGS...

The process exits with status 137 (``os._exit``: no cleanup, no flush, as a SIGKILL would) right after
the MESSAGES-th message of round ROUND was delivered and captured. The fault comes through the
engine's explicit callback hook (:class:`privfl.engine.TrainCallback`), not through the environment.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from privfl.engine import TrainCallback
from privfl.train import main


class KillAfter(TrainCallback):
    """Exit at once after ``count`` messages of round ``rnd``."""

    def __init__(self, rnd: int, count: int):
        self.rnd, self.count, self.seen = rnd, count, 0

    def on_message(self, message: Any, record: dict[str, Any]) -> None:
        if message.round == self.rnd:
            self.seen += 1
            if self.seen == self.count:
                self.die()

    def die(self) -> None:
        os._exit(137)


class Interrupted(Exception):
    """Raised by :class:`InterruptAfter`."""


class InterruptAfter(KillAfter):
    """The in-process twin of :class:`KillAfter`: raise :class:`Interrupted` at the same point. The engine
    keeps the folder (the rounds before are complete and checkpointed), and no subprocess pays for
    importing torch again."""

    def die(self) -> None:
        raise Interrupted


if __name__ == "__main__":
    rnd, count, *argv = sys.argv[1:]
    sys.exit(main(argv, callbacks=[KillAfter(int(rnd), int(count))]))
