"""TransferError: the one exception the transfer layer raises, a `ServiceError`.

`code` is a gRPC status code name ("DEADLINE_EXCEEDED", "UNAVAILABLE", "INVALID_ARGUMENT",
...) so servicers can map it straight onto a status or an `ErrorInfo`; `reason` is one
human-readable line saying what happened; `room` is the room it ended, or None for a
failure of the engine itself (a write to a peer, the port range) that a caller attributes
to its room; `culprit` is the address of another instance whose silence ended the room (a
split prompt's helper encoder), "" when none: the lead's Encode names it to the router
(trailing metadata CULPRIT_METADATA), whose retry then avoids it.
"""

from __future__ import annotations

import time

from tandem.errors import ServiceError


class TransferError(ServiceError):
    """A room (or the engine) failed; `reason` says why, `code` is a gRPC code name."""

    def __init__(self, reason: str, code: str = "INTERNAL", room: int | None = None,
                 culprit: str = "") -> None:
        super().__init__(reason, code)
        self.room = room
        self.culprit = culprit
        # Engine-level failures: the (batch, count) transfers already started, which the
        # caller must drain before it reuses their source memory.
        self.pending: list[tuple[int, int]] = []

    @property
    def reason(self) -> str:
        return self.message

    def for_room(self, room: int) -> TransferError:
        """This error as the failure of `room` (itself when it already names a room)."""
        if self.room is not None:
            return self
        return type(self)(f"room {room}: {self.reason}", self.code, room, self.culprit)


class WriteRefused(TransferError):
    """A write refused before any of its rows went out (the destination's protection,
    layout or size): nothing of it is in flight."""


class TransferStuck(TransferError):
    """Writes that never ended (not even failed): their source memory is still in use and
    must never be reused."""


def timed_out(what: str, timeout: float, deadline: float | None, room: int | None,
              culprit: str = "") -> TransferError:
    """A wait that ran out. DEADLINE_EXCEEDED only when the request's own `deadline` (Unix
    seconds) has passed; otherwise the transfer's timeout fired first: the peer is stuck,
    not the request late, so UNAVAILABLE (another encoder may serve it: the router retries),
    naming `culprit`, the stuck peer, when it is not the caller's own counterpart.
    """
    if deadline is not None and time.time() >= deadline - 0.05:
        return TransferError(f"{what}: the request deadline passed", "DEADLINE_EXCEEDED", room)
    return TransferError(f"{what} within the transfer timeout ({timeout:.1f}s)", "UNAVAILABLE",
                         room, culprit)
