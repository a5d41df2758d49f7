"""Encoder-side room bookkeeping: the sender's state enum, a room's record (its one
wake-up), the stats of a delivery, a room's destinations (one per tensor-parallel rank),
and the AttachFailed message (see sender.py)."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from tandem import tracing
from tandem.transfer.buffers import BufferLayout, RangeTag, RowProtection
from tandem.transfer.errors import TransferError
from tandem.transfer.payload import PromptPayload
from tandem.transfer.staging import Destination, StagingArea
from tandem.v1 import common_pb2, encoder_pb2


class SenderState(enum.Enum):
    WAITING_FOR_INIT = "waiting_for_init"  # send() called; the language side's Init not yet
    WAITING_FOR_PAYLOAD = "waiting_for_payload"  # Init here; send() not called yet
    ANNOUNCING = "announcing"  # AttachPrompt sent; waiting for the language's AttachCached
    TRANSFERRING = "transferring"
    WAITING_FOR_ROWS = "waiting_for_rows"  # a streamed payload's next rows are not final yet
    WAITING_FOR_RESUME = "waiting_for_resume"
    HELPER_WRITING = "helper_writing"  # another encoder writes this piece (RemoteRange)
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
    protection: RowProtection = RowProtection()  # what the Init asked for (of_init)
    # the tags of the current piece's last chunk, reported by its partial Progress or Done
    piece_tag: tuple[int, RangeTag | None] | None = None  # (end token, tags)
    error: TransferError | None = None
    trace: tracing.Span = tracing.OFF  # the delivery's span (send), parent of its rounds'
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


class RangeLost(Exception):
    """A helper encoder is gone (it failed, or its EncodeRange stream broke or ended) while
    none of its writes could be in flight (no RangeWrite outstanding: split.py's rule):
    the lead re-encodes the range itself."""


class RangeWriter(Protocol):
    """Who writes a RemoteRange: another encoder, through the lead's stream to it
    (services/encoder/split.py HelperRange)."""

    async def write(self, init: encoder_pb2.AttachInit, start: int, piece: int, total: int,
                    delta: int, on_chunk: Callable[[int, RangeTag | None], None],
                    on_working: Callable[[], None]) -> int:
        """Write payload tokens [start, start + piece) into the blocks `init` names; return
        the bytes this process wrote (0 for a helper's: the helper counts them).
        `on_chunk(end, tags)` as each chunk reached every destination (in order; the last
        ends at start + piece), `on_working()` at each heartbeat of the helper's. Raises
        RangeLost (the helper is gone, nothing of it in flight), or TransferError (the
        room's failure: a helper that failed with a write outstanding, or stalled, cut at
        the transfer timeout)."""
        ...

    async def fall_back(self) -> None:
        """After RangeLost: put the range's rows into the lead's own payload."""
        ...


@dataclass
class RemoteRange:
    """Payload tokens [start, end) of a room that another encoder writes (docs/architecture.md, "Streamed
    rows", split across encoders). The lead's sender cuts its pieces at `start` and `end`
    and hands every piece inside to `writer.write`; when that raises RangeLost it awaits
    `writer.fall_back()` once (`fell_back` then holds) and writes the rest itself."""

    start: int
    end: int
    address: str
    writer: RangeWriter
    fell_back: bool = False


MAX_RANKS = 64  # destinations one Init may name (tensor-parallel ranks of one instance)


def destinations(room: int, init: encoder_pb2.AttachInit, staging: StagingArea,
                 payload: PromptPayload) -> list[Destination]:
    """Rank 0's buffers, then each other tensor-parallel rank's (docs/architecture.md's "N destinations":
    required_dst_info_num destinations); every one must take this payload, and mirror rank
    0's pool (one list of block ids serves them all). Raises INVALID_ARGUMENT."""
    dests = [Destination(init.session_id, BufferLayout.from_proto(init.layout))]
    dests += [Destination(d.session_id, BufferLayout.from_proto(d.layout)) for d in init.ranks]
    if len(dests) > MAX_RANKS:
        raise TransferError(f"room {room}: {len(dests)} destinations (at most {MAX_RANKS})",
                            "INVALID_ARGUMENT")
    first = dests[0].layout
    for k, d in enumerate(dests):
        why = staging.check_layout(d.layout, payload)
        if not why and (d.layout.block_size, d.layout.num_blocks) != (first.block_size,
                                                                         first.num_blocks):
            why = (f"rank {k}'s pool ({d.layout.num_blocks} blocks of {d.layout.block_size}) "
                   f"does not mirror rank 0's ({first.num_blocks} of {first.block_size})")
        if why:
            raise TransferError(f"room {room}: layout mismatch: {why}", "INVALID_ARGUMENT")
    return dests


def working_msg(room: int) -> encoder_pb2.AttachResponse:
    """A heartbeat: the encoder works on `room`, which has nothing else to say."""
    return encoder_pb2.AttachResponse(working=encoder_pb2.AttachWorking(room=room))


def failed_msg(err: TransferError) -> encoder_pb2.AttachResponse:
    info = common_pb2.ErrorInfo(code=err.code, message=err.reason)
    return encoder_pb2.AttachResponse(failed=encoder_pb2.AttachFailed(error=info))


def heartbeat(period: float, send: Callable[[], Awaitable[None]],
              vouch: Callable[[], bool]) -> asyncio.Task:
    """A task that awaits `send()` every `period` seconds until cancelled, each time
    `vouch()` holds: a heartbeat says the work progresses, not only that the process is
    alive (EmbeddingSender.vouch)."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(period)
            if vouch():
                await send()

    return asyncio.ensure_future(beat())
