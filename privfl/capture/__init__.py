"""Messages, the checksummed stores they are captured in, and communication accounting."""

from privfl.capture.message import KINDS, Message
from privfl.capture.store import FORMAT, TensorStore, atomic_write_bytes, atomic_write_text

__all__ = ["FORMAT", "KINDS", "Message", "TensorStore", "atomic_write_bytes", "atomic_write_text"]
