"""Language-side room bookkeeping: the state enum, a room's record, and its blocks.

`BlockReservations` wraps the shared BlockAllocator for the receiver: each room holds one
or more owners `(room, n)` (the current piece's blocks, plus the previous piece's until it
is copied out), waits for frees when the pool is busy, and keeps the block gauges current.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.tracing import OFF, Span
from tandem.transfer.allocator import BlockAllocator
from tandem.transfer.buffers import RangeSeal, RangeTag, RowProtection
from tandem.transfer.errors import TransferError
from tandem.transfer.payload import PromptInfo, PromptPayload
from tandem.units import ceil_div
from tandem.v1 import encoder_pb2


class ReceiverState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


class AttachBroken(Exception):
    """The Attach stream ended before Done (or reattach() asked to switch encoders)."""

    def __init__(self, reason: str, new_address: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.new_address = reason, new_address


# -- what reaches a room's event queue (dispatched by type) ---------------------------------
# `attempt` numbers the Attach stream an event came from: events of an earlier attempt
# (after a reattach) are stale and ignored.


@dataclass(frozen=True)
class StreamMessage:
    """A message the encoder sent on the Attach stream."""

    attempt: int
    msg: encoder_pb2.AttachResponse


@dataclass(frozen=True)
class StreamBroken:
    """The Attach stream ended or failed before Done."""

    attempt: int
    reason: str


@dataclass(frozen=True)
class ReattachTo:
    """The router points the room at another encoder (its encoder failed before Done)."""

    address: str


@dataclass(frozen=True)
class AbortRoom:
    """The request was aborted: end the room."""


RoomEvent = StreamMessage | StreamBroken | ReattachTo | AbortRoom


@dataclass
class ReceiverRoom:
    room: int
    address: str
    client: str = ""  # the router's client key ("" = a client of its own: no share limit)
    state: ReceiverState = ReceiverState.BOOTSTRAPPING
    events: asyncio.Queue[RoomEvent] = field(default_factory=asyncio.Queue)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    keys: set = field(default_factory=set)  # allocator owners held by this room
    key: tuple | None = None  # owner of the current destination blocks
    ids: list[int] = field(default_factory=list)
    allocated: int = 0
    n_keys: int = 0
    attempt: int = 0
    sent: int = 0  # first token of the current piece (all before it are copied out)
    copied: int = 0  # tokens gathered into `out` so far
    total: int | None = None
    info: PromptInfo | None = None  # the prompt's content, when the encoder announced it
    cached: int = 0  # leading tokens we hold: the payload starts there
    out: tuple | None = None  # (embeds, fill_ids, mrope) of the whole prompt
    ranks_key: int | None = None  # the other tensor-parallel ranks' name for `out`'s rows
    protection: RowProtection = RowProtection()  # this attempt's (new at every Init)
    reported: int = 0  # end of the last range the encoder reported (with its tags)
    # reported ranges not yet copied out and verified: (its keys, the encoder's tags)
    ranges: list[tuple[RangeSeal, RangeTag]] = field(default_factory=list)
    resumes: int = 0
    # time.monotonic() of its last progress (an Init, or a message from its encoder other
    # than a heartbeat); None while queued for its first blocks (metrics.py RoomStall)
    progressed: float | None = None
    call: object | None = None
    reader: asyncio.Task | None = None
    request_id: str = ""  # its request's (x-request-id on the Attach calls)
    trace: Span = OFF  # the room's span (receive), parent of each attempt's
    attach_trace: Span = OFF  # the current attempt's span (its Attach call's traceparent)
    # streamed rows (receiver.receive's `on_open`): the payload handed on at the first rows
    # (then the room is never reattached), and the delta Done names (set before its rows)
    on_open: Callable[[PromptPayload], None] | None = None
    on_rows: Callable[[], None] | None = None  # its watermark's on_advance (receive)
    payload: PromptPayload | None = None
    mrope_delta: int | None = None

    def post(self, event: RoomEvent) -> None:
        self.events.put_nowait(event)
        self.wake.set()


class BlockReservations:
    def __init__(self, allocator: BlockAllocator, metrics, clear=None,
                 client_share: float = 1.0) -> None:
        """`clear(block_ids)` wipes blocks as they are freed (`EmbeddingBuffers.clear`).
        `client_share`: the most of the blocks one client's rooms may hold at once (first
        reservations beyond it wait; a client holding none may always take what it needs,
        so every client progresses; resumes are not limited: their rooms are under way)."""
        self.allocator, self.metrics, self.clear = allocator, metrics, clear
        self._changed = asyncio.Event()  # replaced (and set) on every free
        self.resumes_waiting = 0  # rooms mid-transfer waiting for blocks (they go first)
        self.client_quota = max(1, int(client_share * allocator.num_total))
        self.held_by: dict[str, int] = {}  # client -> blocks its rooms hold (named only)
        self._client_of: dict = {}  # owner key -> client, for the keys of named clients
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.blocks(self.allocator.num_free, self.allocator.num_total)

    def free(self, r: ReceiverRoom, key) -> None:
        held = self.allocator.held(key)
        if self.clear is not None:
            self.clear(held)
        self.allocator.free(key)
        r.keys.discard(key)
        client = self._client_of.pop(key, None)
        if client is not None:
            left = self.held_by[client] - len(held)
            if left:
                self.held_by[client] = left
            else:
                del self.held_by[client]
        self._gauges()
        self._notify()

    def _notify(self) -> None:
        """Wake every waiter to try again (blocks were freed, or the resume rule lifted)."""
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    def free_all(self, r: ReceiverRoom) -> None:
        for key in list(r.keys):
            self.free(r, key)

    def try_alloc(self, r: ReceiverRoom, tokens: int) -> tuple | None:
        """(owner key, block ids) for `tokens`, or None when the pool is short now."""
        key = (r.room, r.n_keys)
        ids = self.allocator.alloc(tokens, key)
        if ids is None:
            return None
        r.n_keys += 1
        r.keys.add(key)
        if r.client:
            self._client_of[key] = r.client
            self.held_by[r.client] = self.held_by.get(r.client, 0) + len(ids)
        self._gauges()
        return key, ids

    def over_share(self, r: ReceiverRoom, tokens: int) -> bool:
        """Would `tokens` more put the room's client past its share (while it holds some)?"""
        held = self.held_by.get(r.client, 0) if r.client else 0
        need = ceil_div(tokens, self.allocator.block_size)
        return held > 0 and held + need > self.client_quota

    async def alloc(self, r: ReceiverRoom, tokens: int, timeout: float, on_event,
                    resume: bool = False, timeout_code: str = "UNAVAILABLE") -> tuple:
        """Blocks for `tokens`, waiting for frees up to `timeout`; each room event that
        arrives meanwhile (abort, a broken stream, an encoder failure) goes to `on_event`,
        which raises to end the wait. A `resume` (a room mid-transfer, whose encoder holds
        a staging slot for it) goes before every first reservation: new rooms take no
        block while one waits, so rooms already under way finish first. A wait that runs
        out fails with `timeout_code`: the pool is busy, not the request too large
        (DEADLINE_EXCEEDED where the request's own deadline bounded the wait, else
        UNAVAILABLE, which the router retries elsewhere)."""
        end = time.monotonic() + timeout
        self.resumes_waiting += resume
        try:
            while True:
                got = self._try(r, tokens, resume)
                if got is not None:
                    return got
                if not r.events.empty():
                    on_event(r.events.get_nowait())
                    continue
                left = end - time.monotonic()
                if left <= 0:
                    raise TransferError(
                        f"room {r.room}: no free embedding blocks for {tokens} tokens within "
                        f"{timeout:.1f}s ({self.allocator.num_free}/{self.allocator.num_total} "
                        f"free)", timeout_code)
                r.wake.clear()
                waits = [asyncio.ensure_future(self._changed.wait()),
                         asyncio.ensure_future(r.wake.wait())]
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
        finally:
            self.resumes_waiting -= resume
            if resume and not self.resumes_waiting:
                self._notify()

    def _try(self, r: ReceiverRoom, tokens: int, resume: bool) -> tuple | None:
        if not resume and (self.resumes_waiting or self.over_share(r, tokens)):
            return None
        return self.try_alloc(r, tokens)
