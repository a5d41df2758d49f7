"""Encoder-side room bookkeeping: the sender's state enum, a room's record (its one
wake-up), the stats of a delivery, and the AttachFailed message (see sender.py)."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.transfer.errors import TransferError
from tandem.v1 import common_pb2, encoder_pb2


class SenderState(enum.Enum):
    WAITING_FOR_INIT = "waiting_for_init"  # send() called; the language side's Init not yet
    WAITING_FOR_PAYLOAD = "waiting_for_payload"  # Init here; send() not called yet
    ANNOUNCING = "announcing"  # AttachPrompt sent; waiting for the language's AttachCached
    TRANSFERRING = "transferring"
    WAITING_FOR_RESUME = "waiting_for_resume"
    FINISHING = "finishing"  # Done queued: a half-close from now on is normal
    DONE = "done"  # Done written on the stream
    FAILED = "failed"


@dataclass
class SendStats:
    tokens: int
    bytes: int
    resumes: int
    seconds: float


@dataclass
class SenderRoom:
    room: int
    state: SenderState
    born: float = field(default_factory=time.monotonic)
    init: encoder_pb2.AttachInit | None = None  # set once, when the Attach stream opens
    cached: int = 0  # leading tokens the language holds (its AttachCached answer)
    error: TransferError | None = None
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # AttachResume
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # AttachResponse | None
    # NOTE: the one wake-up: set (then replaced) at every transition, so a waiter re-checks
    # its condition on the new state; nothing else signals. Writer threads read `terminal`
    # (a plain attribute read) to stop submitting.
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def terminal(self) -> bool:
        """The room ended: DONE, or FAILED (which every broken or closed stream becomes)."""
        return self.state in (SenderState.DONE, SenderState.FAILED)

    def to(self, state: SenderState) -> None:
        """The one place the state changes."""
        self.state = state
        self.notify()

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def until(self, done: Callable[[], bool]) -> None:
        """Return once `done()` holds (checked now and after every transition)."""
        while not done():
            await self._changed.wait()


def failed_msg(err: TransferError) -> encoder_pb2.AttachResponse:
    info = common_pb2.ErrorInfo(code=err.code, message=err.reason)
    return encoder_pb2.AttachResponse(failed=encoder_pb2.AttachFailed(error=info))
