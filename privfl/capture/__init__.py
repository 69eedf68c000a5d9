"""Messages, the checksummed stores they are captured in, and communication accounting."""

from privfl.capture.message import Message
from privfl.capture.store import FORMAT, TensorStore, atomic_write_bytes, atomic_write_text
from privfl.kinds import KINDS  # re-exported: the vocabulary lives in privfl.kinds

__all__ = ["FORMAT", "KINDS", "Message", "TensorStore", "atomic_write_bytes", "atomic_write_text"]
