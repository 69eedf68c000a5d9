"""The attacker's view of a run (:class:`privfl.run.AttackerView`): captured messages and the
knowledge the run stores, never ground truth. Re-exported here for attack code."""

from privfl.run import AttackerView, client_of

__all__ = ["AttackerView", "client_of"]
