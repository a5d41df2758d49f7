"""TransferError: the one exception the transfer layer raises, with a gRPC status name.

`code` is a gRPC status code name ("DEADLINE_EXCEEDED", "UNAVAILABLE", "INVALID_ARGUMENT",
...) so servicers can map it straight onto a status or an `ErrorInfo`; `reason` is one
human-readable line naming the room and what happened.
"""

from __future__ import annotations


class TransferError(Exception):
    """A room (or the engine) failed; `reason` says why, `code` is a gRPC code name."""

    def __init__(self, reason: str, code: str = "INTERNAL") -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.reason}"


class TransferStuck(TransferError):
    """Writes that never ended (not even failed): their source memory is still in use and
    must never be reused."""
