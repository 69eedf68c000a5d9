"""Train like ``python -m privfl.train ARGS`` and die mid-round, for the kill-and-resume tests.

    python -m tests.killer [--write-early] ROUND MESSAGES ARGS...

The process exits with status 137 (``os._exit``: no cleanup, no flush, as a SIGKILL would) right after
the MESSAGES-th message of round ROUND was delivered and captured. The stores keep a round's records in
memory until the round is committed, so such a kill leaves none of them on disk; ``--write-early`` sets
their ``PENDING_LIMIT`` to 0, so every record is written as it is appended, as in a round whose blobs
outgrow the limit, and the kill leaves uncommitted records for ``--resume`` to drop. The fault comes through the
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
    args = sys.argv[1:]
    if args[:1] == ["--write-early"]:
        import privfl.capture.store

        privfl.capture.store.PENDING_LIMIT = 0
        args = args[1:]
    rnd, count, *argv = args
    sys.exit(main(argv, callbacks=[KillAfter(int(rnd), int(count))]))
