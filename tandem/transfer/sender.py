"""EmbeddingSender: the encoder side of a room — serves `Encoder.Attach` and writes pieces.

Use inside the encoder's grpc.aio server (same event loop; one engine and staging area
registered once at start-up):

    engine = MooncakeEngine(cfg.transfer)
    staging = StagingArea(slots=2, slot_tokens=16384, embed_dim, dtype); staging.register(engine)
    sender = EmbeddingSender(engine, staging, cfg.transfer, chunk_tokens=2048, registry=None)
    # In EncoderServicer (a coroutine handler, not an async generator):
    #     async def Attach(self, request_iterator, context):
    #         await sender.attach(request_iterator, context)
    cached = await sender.announce(room, PromptInfo(ids, images), deadline=None)  # optional
    stats = await sender.send(room, payload, deadline=None)  # SendStats | TransferError
    sender.state(room) -> SenderState | None;  len(sender.rooms) = open rooms
    sender.close()                                           # at shutdown

`send` (or `announce`) and `attach` meet on the room id, in either order. Per room:

    WAITING_FOR_INIT (send/announce first) ─┐
    WAITING_FOR_PAYLOAD (Init first) ───────┴▶ [ANNOUNCING ─▶ WAITING_FOR_PAYLOAD ─▶]
        TRANSFERRING ⇄ WAITING_FOR_RESUME ─▶ FINISHING ─▶ DONE
              ⇅ WAITING_FOR_ROWS (a streamed payload: its next rows are still in the ViT)
    any state ─▶ FAILED (a timeout, a bad message, a broken or closed stream, a failed write)

A streamed payload (`payload.arrived`, docs/architecture.md, "Streamed rows") may be sent before its rows
exist: each staging round covers only rows below its watermark, in whole destination
blocks (the last block of the prompt excepted), and waits (with AttachWorking heartbeats)
while not one block is final. Every round's chunks are reported as usual, so the Progress
messages are the language side's watermark: no message of its own.

`announce` (cache-aware transfer) sends the prompt's token ids and image hashes as soon as
Init is here and returns the language side's answer: how many leading tokens its prefix
cache holds for the room. The encoder then encodes and `send`s only the rest (a payload
whose `start` is that count); every Progress/Done count is of that rest.

The state is the room's whole story: DONE and FAILED are its end (writer threads stop
submitting once it ended), and every wait (for Init, for a Resume, for Done to be written)
re-checks its condition at each transition (`SenderRoom.to`).

Each piece (what the language side reserved) is written in staging rounds of at most
`slot_tokens`, each round in chunks of `chunk_tokens` (a chunk is a few async Mooncake
transfers, one per run of consecutive destination blocks and buffer; the next chunk is
staged while the previous is on the wire); every finished chunk but the
last is reported as Progress(partial=False), a piece that leaves tokens over as
Progress(partial=True), the end as Done. A room whose Init has not come by the request's
`deadline` fails (the language side queues for its first blocks up to then; without a
deadline, `timeout_s` bounds the wait); so does one with no payload (Init waiting) within
`timeout_s`, and one whose Resume does not come within `timeout_s`. A broken Attach stream
fails the room at once, even while a write is in flight (the write is not waited for; its
staging slot is returned when Mooncake gives the thread back). `deadline` is Unix seconds. Failures are sent as AttachFailed and raised as
TransferError(reason, code).

Heartbeats (AttachWorking) say the encoder works on a room that has nothing else to say
(its payload being prepared, its rows in the ViT, a helper's range): they go out only while
`vouch()` is true. The encoder vouches while its ViT makes progress (EncoderScheduler.
stalled); a hung ViT thus shows as silence, and the room fails at the transfer timeout,
not at the request's deadline.

Protection: the Init names it (buffers.py RowProtection); each chunk is one reported range,
sealed in the writer thread under keys of its own (encrypted into the staging slot under
`encrypt`), its tags computed over the private payload and sent with the range's Progress,
partial Progress or Done. An Init asking for less than `config.protect` fails the room
(FAILED_PRECONDITION): this encoder never sends rows less protected than it is set to.

Traces: `send(..., trace=span)` puts an `encoder.transfer` span under `span` (tokens,
bytes, resumes), and under it `transfer.wait_init` (when the Init was not there yet), one
`transfer.write` per staging round (its tokens and bytes) and one `transfer.resume_wait`
per Resume; `attach(..., parent)` an `encoder.attach` span per Attach stream.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from tandem import tracing
from tandem.config import TransferConfig
from tandem.transfer.buffers import RangeTag, RowProtection
from tandem.transfer.errors import TransferError, TransferStuck, WriteRefused, timed_out
from tandem.transfer.metrics import transfer_metrics
from tandem.transfer.payload import PromptInfo, PromptPayload
from tandem.transfer.sender_room import (
    RangeLost,
    RemoteRange,
    SenderRoom,
    SenderState,
    SendStats,
    destinations,
    failed_msg,
    heartbeat,
    working_msg,
)
from tandem.transfer.staging import (
    Destination,
    PieceTarget,
    StagingArea,
    WriteRound,
    write_round,
)
from tandem.v1 import encoder_pb2

log = logging.getLogger(__name__)
_ABANDONED_KEPT = 4096  # rooms remembered as abandoned before their Init came


class RangeListener(Protocol):
    """Who a helper's range write reports to (`EmbeddingSender.write_range`): the lead's
    stream, which services/encoder/server.py relays each call to."""

    def written(self, end: int, tag: RangeTag | None) -> None:
        """A chunk reached every destination: the range is written up to token `end`,
        with the chunk's tags (None without protection)."""

    def working(self) -> None:
        """The range's rows are not final yet (a heartbeat: the write is alive)."""

    def ended(self) -> bool:
        """True once the lead's stream is gone: the write stops."""


class EmbeddingSender:
    def __init__(self, engine, staging: StagingArea, config: TransferConfig,
                 chunk_tokens: int = 2048, registry=None,
                 vouch: Callable[[], bool] | None = None):
        """`vouch()`: whether this process's work progresses, so its heartbeats may go
        out (see the module's docstring); None: always."""
        self.engine, self.staging, self.config = engine, staging, config
        self.vouch: Callable[[], bool] = vouch or (lambda: True)
        self.chunk_tokens = chunk_tokens  # tokens per submitted chunk (pipelining unit)
        self.metrics = transfer_metrics(registry)
        self.rooms: dict[int, SenderRoom] = {}
        # Rooms whose request failed before their Attach stream came (`abandon`): an Init
        # that arrives later is answered Failed at once. Bounded: the oldest are forgotten
        # (such an Init then waits out the payload timeout, as before).
        self._abandoned: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._preparing: set[int] = set()  # rooms whose payload the pipeline works on
        # NOTE: writes busy-poll inside Mooncake; a private pool keeps a frozen peer's
        # spinning thread from starving the loop's default executor.
        self._pool = ThreadPoolExecutor(staging.slots + 2, thread_name_prefix="tandem-send")

    def close(self) -> None:
        """At shutdown: stop the write threads once their writes end."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def state(self, room: int) -> SenderState | None:
        r = self.rooms.get(room)
        return r.state if r else None

    def preparing(self, room: int, busy: bool) -> None:
        """The pipeline is (busy) or is no longer preparing `room`'s payload. While it is,
        the room's Attach stream carries a heartbeat (AttachWorking) every third of the
        transfer timeout instead of timing out for want of a payload: a long preprocess or
        ViT queue is work, not a stall. The caller clears it on every path."""
        if busy:
            self._preparing.add(room)
        else:
            self._preparing.discard(room)

    def abandon(self, room: int, reason: str) -> None:
        """The request ended before its payload was sent (its Encode failed: a client's bad
        input, its deadline, its cancellation): end the room now, as the request's failure
        (CANCELLED, counted under reason "request"), so the language side's hang-up that
        follows is not taken for a transfer fault. A room whose Attach stream has not come
        yet is remembered, and its Init answered Failed at once."""
        r = self.rooms.get(room)
        if r is not None:
            self._fail(r, TransferError(f"room {room}: {reason}", "CANCELLED"))
            return
        self._abandoned[room] = reason  # NOTE: its Init may still be on its way
        while len(self._abandoned) > _ABANDONED_KEPT:
            self._abandoned.popitem(last=False)

    # ---- room bookkeeping -------------------------------------------------------------
    def _room(self, room: int, state: SenderState) -> SenderRoom:
        r = self.rooms.get(room)
        if r is None:
            r = self.rooms[room] = SenderRoom(room, state)
        return r

    def _fail(self, r: SenderRoom, err: TransferError) -> None:
        if r.terminal:  # Done delivered, or failed already: nothing left to fail
            return
        r.error = err
        r.to(SenderState.FAILED)
        self.metrics.failures.labels("encoder", err.code).inc()
        log.info("room %d failed: %s", r.room, err)
        r.outbox.put_nowait(failed_msg(err))
        self.rooms.pop(r.room, None)

    async def _race(self, r: SenderRoom, aw, deadline: float | None, what: str,
                    stall: bool = True):
        """Await `aw`, unless the room ends or the transfer timeout (bounded by the request's
        `deadline`; without `stall`, the deadline alone) passes first (TransferError:
        `timed_out`). NOTE: `aw` is cancelled on every other exit, including our own
        cancellation."""
        timeout = self._timeout(deadline) if stall else (
            None if deadline is None else max(0.0, deadline - time.time()))
        task = asyncio.ensure_future(aw)
        ended = asyncio.ensure_future(r.until(lambda: r.terminal))
        try:
            done, _ = await asyncio.wait({task, ended}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            ended.cancel()
        if task in done:
            return task.result()
        task.cancel()
        if r.error is not None:
            raise r.error
        if r.terminal:
            raise TransferError(f"room {r.room}: Attach stream closed while {what}", "UNAVAILABLE")
        raise timed_out(f"room {r.room}: no progress while {what}", timeout, deadline, r.room)

    async def _acquire_slot(self, r: SenderRoom, deadline: float | None) -> int:
        """A staging slot for the room's next round. NOTE: waiting for one is queueing
        behind this encoder's other rounds, not a stall: the room heartbeats meanwhile (or
        the language side would fail it at its transfer timeout) and waits up to the
        request's deadline (without one, the transfer timeout). A round's slot comes back
        only when Mooncake is done with its writes, which to a frozen peer is its own
        timeout (MC_TRANSFER_TIMEOUT): before, two rounds stuck so starved every other
        room of the encoder, whose language sides then failed them one by one."""
        task = asyncio.ensure_future(self.staging.acquire())
        try:
            with self._heartbeat(r):
                return await self._race(r, task, deadline, "waiting for a staging slot",
                                        stall=deadline is None)
        except BaseException:
            # NOTE: the acquire may have won the race at the last moment: give it back.
            if task.done() and not task.cancelled() and task.exception() is None:
                self.staging.release(task.result())
            raise

    def _timeout(self, deadline: float | None) -> float:
        t = self.config.timeout_s
        return t if deadline is None else max(0.0, min(t, deadline - time.time()))

    # ---- the Attach stream ------------------------------------------------------------
    async def attach(self, request_iterator, context, parent=None) -> None:
        """Body of `Encoder.Attach` (grpc.aio): first message Init, then Resumes. `parent`:
        the caller's trace context (tracing.from_call), for the stream's span."""
        it = request_iterator.__aiter__()
        try:
            first = await asyncio.wait_for(it.__anext__(), self.config.timeout_s)
        except (StopAsyncIteration, asyncio.TimeoutError):
            return
        if first.WhichOneof("msg") != "init":
            await context.write(failed_msg(TransferError(
                "the first Attach message must be init", "INVALID_ARGUMENT")))
            return
        room = first.init.room
        if room in self._abandoned:  # its request failed before this stream came
            err = TransferError(f"room {room}: {self._abandoned.pop(room)}", "CANCELLED")
            self.metrics.failures.labels("encoder", err.code).inc()
            await context.write(failed_msg(err))
            return
        r = self.rooms.get(room)
        if r is not None and r.init is not None:
            await context.write(failed_msg(TransferError(
                f"room {room} already has an Attach stream", "ALREADY_EXISTS")))
            return
        r = self._room(room, SenderState.WAITING_FOR_PAYLOAD)
        r.init, r.born = first.init, time.monotonic()
        self._open_peers(first.init)
        beat = self.config.heartbeat_s
        r.notify()  # a send() waiting for Init goes on
        reader = asyncio.create_task(self._read(r, it))
        span = tracing.start("encoder.attach", parent, kind=tracing.SpanKind.SERVER,
                             attributes={tracing.ROOM: room,
                                         "tandem.transfer.generation": first.init.generation})
        try:
            while True:
                # Init is here; without send() the payload has timeout_s to come (from Init,
                # or from the announce's answer). While announcing, re-check every second.
                wait = 1.0 if r.state is SenderState.ANNOUNCING else None
                preparing = room in self._preparing
                if r.state is SenderState.WAITING_FOR_PAYLOAD:
                    left = max(0.0, r.born + self.config.timeout_s - time.monotonic())
                    # being prepared: wake every beat, to vouch for it again
                    wait = min(beat, left) if preparing else left
                try:
                    msg = await asyncio.wait_for(r.outbox.get(), wait)
                except asyncio.TimeoutError:
                    # NOTE: unvouched (a hung ViT), a room being prepared beats no more and
                    # times out like one nobody prepares, unless the ViT moves again first
                    if (r.state is SenderState.WAITING_FOR_PAYLOAD and preparing
                            and self.vouch()):
                        # the pipeline works on it: say so, and count silence from now
                        r.born = time.monotonic()
                        await context.write(working_msg(room))
                        continue
                    late = time.monotonic() >= r.born + self.config.timeout_s
                    if r.state is SenderState.WAITING_FOR_PAYLOAD and late:
                        why = " (this encoder's ViT stalled)" if preparing else ""
                        self._fail(r, timed_out(f"room {room}: no payload after Init{why}",
                                                self.config.timeout_s, None, room))
                    continue
                await context.write(msg)
                kind = msg.WhichOneof("msg")
                if kind == "done":
                    r.to(SenderState.DONE)
                if kind in ("done", "failed"):
                    return
        finally:
            reader.cancel()
            self._fail(r, TransferError(f"room {room}: language closed the Attach stream",
                                        "UNAVAILABLE"))
            if r.error is not None:
                tracing.fail(span, r.error.code, r.error.reason)
            span.end()

    def _open_peers(self, init: encoder_pb2.AttachInit) -> None:
        """Open the segments of the peers `init` names now, while they are alive (they have
        just sent it), in the background: a first write's handshake with a peer frozen
        meanwhile would hold every write of this encoder, to every peer, for ~60 s
        (MooncakeEngine.open)."""
        for peer in {init.session_id, *(d.session_id for d in init.ranks)}:
            self.engine.open_soon(peer)

    async def _read(self, r: SenderRoom, it) -> None:
        try:
            async for req in it:
                kind = req.WhichOneof("msg")
                body = getattr(req, kind) if kind in ("resume", "cached") else None
                if body is None or body.room != r.room:
                    self._fail(r, TransferError(
                        f"room {r.room}: unexpected Attach message after Init", "INVALID_ARGUMENT"))
                    return
                r.inbox.put_nowait(body)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the stream broke under us
            self._fail(r, TransferError(f"room {r.room}: Attach stream broken: {e}", "UNAVAILABLE"))
            return
        if r.state not in (SenderState.FINISHING, SenderState.DONE):
            self._fail(r, TransferError(f"room {r.room}: language closed the Attach stream "
                                        f"before Done", "UNAVAILABLE"))

    # ---- sending ----------------------------------------------------------------------
    async def _await_init(self, r: SenderRoom, deadline: float | None) -> None:
        if r.init is None:
            # NOTE: the language side sends Init once it holds the room's first blocks, and
            # waits for them up to the request's deadline (receiver.py: queueing behind the
            # rooms under way, not a stall); this wait is the same queueing and lasts as
            # long. A dead or frozen language instance is the router's to see (its Generate
            # fails, its load polls go unanswered): the router then ends this Encode, and
            # with it the room. Without a deadline nothing else would: the transfer timeout.
            await self._race(r, r.until(lambda: r.init is not None), deadline,
                             "waiting for the language side's Init", stall=deadline is None)
        r.protection = RowProtection.of_init(r.init)
        if not r.protection.at_least(self.config.protect):
            # NOTE: never send rows less protected than this encoder is configured for
            raise TransferError(
                f"room {r.room}: the language side asks for transfer protection "
                f"{r.protection.mode!r}, this encoder requires at least "
                f"{self.config.protect!r} (--transfer.protect)", "FAILED_PRECONDITION")

    async def _next(self, r: SenderRoom, kind: type, deadline: float | None, what: str):
        """The language side's next message on the room, which must be a `kind`."""
        msg = await self._race(r, r.inbox.get(), deadline, what)
        if not isinstance(msg, kind):
            raise TransferError(f"room {r.room}: got {type(msg).__name__} while {what}",
                                "INVALID_ARGUMENT")
        return msg

    async def announce(self, room: int, info: PromptInfo, deadline: float | None = None) -> int:
        """Tell the language side the prompt's content; return the leading tokens its
        prefix cache holds for the room (what `send` must then leave out)."""
        r = self.rooms.get(room)
        if r is None:
            r = self._room(room, SenderState.WAITING_FOR_INIT)
        elif r.state is not SenderState.WAITING_FOR_PAYLOAD:
            raise TransferError(f"room {room} is already being sent", "ALREADY_EXISTS")
        with self._failing(r, "announce"):
            await self._await_init(r, deadline)
            r.to(SenderState.ANNOUNCING)
            r.outbox.put_nowait(encoder_pb2.AttachResponse(prompt=encoder_pb2.AttachPrompt(
                token_ids=info.token_ids, images=[encoder_pb2.ImageSpan(
                    start=im.start, length=im.length, hash=im.hash) for im in info.images])))
            ans = await self._next(r, encoder_pb2.AttachCached, deadline,
                                   "waiting for the language side's Cached")
            if not 0 <= ans.cached_tokens < len(info.token_ids):
                raise TransferError(f"room {room}: language holds {ans.cached_tokens} of "
                                    f"{len(info.token_ids)} tokens", "INVALID_ARGUMENT")
            r.cached = ans.cached_tokens
            r.born = time.monotonic()  # the payload's wait starts now
            r.to(SenderState.WAITING_FOR_PAYLOAD)
            return r.cached

    async def send(self, room: int, payload: PromptPayload, deadline: float | None = None,
                   trace: tracing.Span = tracing.OFF,
                   remote: list[RemoteRange] | None = None) -> SendStats:
        """Deliver `payload` into the room's blocks; returns once Done is on the stream.
        `trace`: the span the delivery's span goes under; `remote`: payload ranges other
        encoders write (in order, disjoint; `payload` need not hold their rows)."""
        r = self.rooms.get(room)
        if r is None:
            r = self._room(room, SenderState.WAITING_FOR_INIT)
        elif r.state is SenderState.WAITING_FOR_PAYLOAD:
            r.to(SenderState.TRANSFERRING)  # Init is here: sending starts now
        else:
            raise TransferError(f"room {room} is already being sent", "ALREADY_EXISTS")
        r.trace = span = tracing.start("encoder.transfer", trace, attributes={
            tracing.ROOM: room, "tandem.transfer.tokens": payload.num_tokens})
        try:
            with self._failing(r, "send"):
                stats = await self._deliver(r, payload, deadline, remote or [])
            span.set_attributes({"tandem.transfer.bytes": stats.bytes,
                                 "tandem.transfer.resumes": stats.resumes})
        except TransferError as e:
            tracing.fail(span, e.code, e.reason)
            raise
        finally:
            span.end()
            if self.rooms.get(room) is r:  # NOTE: send is the room's last user on every path
                del self.rooms[room]
        m = self.metrics
        m.bytes.labels("encoder").inc(stats.bytes)
        m.tokens.labels("encoder").inc(stats.tokens)
        m.resumes.labels("encoder").inc(stats.resumes)
        m.seconds.labels("encoder").observe(stats.seconds, tracing.exemplar(span))
        return stats

    @contextlib.contextmanager
    def _failing(self, r: SenderRoom, what: str):
        """Every failure inside fails the room (AttachFailed to the language side) and
        propagates as a TransferError (a bug: INTERNAL)."""
        try:
            yield
        except TransferError as e:
            self._fail(r, e)
            raise
        except asyncio.CancelledError:
            self._fail(r, TransferError(f"room {r.room}: {what} cancelled", "CANCELLED"))
            raise
        except Exception as e:
            err = TransferError(f"room {r.room}: internal error: {e!r}", "INTERNAL")
            self._fail(r, err)
            raise err from e

    async def _deliver(self, r: SenderRoom, payload: PromptPayload, deadline,
                       remote: list[RemoteRange]) -> SendStats:
        """The rounds of `send`: wait for Init, write each piece, Resume, Done. A piece
        never crosses a remote range's edge: each range is a piece of its own (or several,
        when the reservation is short), written by its encoder."""
        room = r.room
        if r.init is None:
            span = tracing.start("transfer.wait_init", r.trace)
            await self._await_init(r, deadline)
            span.end()
        else:
            await self._await_init(r, deadline)
        init = r.init
        if payload.start != r.cached:
            raise TransferError(f"room {room}: payload starts at token {payload.start}, the "
                                f"language side holds {r.cached}", "INTERNAL")
        dests = destinations(room, init, self.staging, payload)
        layout = dests[0].layout
        r.to(SenderState.TRANSFERRING)
        t0 = time.monotonic()
        total, sent, resumes, nbytes = payload.num_tokens, 0, 0, 0
        ids, allocated = list(init.block_ids), init.allocated_tokens
        edges = sorted({e for rr in remote for e in (rr.start, rr.end) if 0 < e < total})
        while True:
            layout.check_destination(room, ids, allocated)
            piece = min(total - sent, allocated,
                        next((e for e in edges if e > sent), total) - sent)
            owner = next((rr for rr in remote if rr.start <= sent < rr.end), None)
            if owner is None:
                nbytes += await self._write_piece(r, payload, dests, ids, sent, piece, deadline)
            else:
                nbytes += await self._remote_piece(r, owner, payload, dests, ids, sent, piece,
                                                   deadline)
            sent += piece
            if sent >= total:
                break
            r.to(SenderState.WAITING_FOR_RESUME)
            r.outbox.put_nowait(encoder_pb2.AttachResponse(progress=encoder_pb2.AttachProgress(
                sent_tokens=sent, total_tokens=total, partial=True, tag=self._piece_tag(r, sent))))
            span = tracing.start("transfer.resume_wait", r.trace,
                                 attributes={"tandem.transfer.sent_tokens": sent})
            res = await self._next(r, encoder_pb2.AttachResume, deadline,
                                   f"waiting for Resume at token {sent}/{total}")
            span.set_attribute("tandem.transfer.allocated_tokens", res.allocated_tokens)
            span.end()
            if res.sent_tokens != sent:
                raise TransferError(f"room {room}: Resume at token {res.sent_tokens}, "
                                    f"expected {sent}", "INVALID_ARGUMENT")
            ids, allocated = list(res.block_ids), res.allocated_tokens
            resumes += 1
            r.to(SenderState.TRANSFERRING)
        r.to(SenderState.FINISHING)
        r.outbox.put_nowait(encoder_pb2.AttachResponse(done=encoder_pb2.AttachDone(
            total_tokens=total, mrope_position_delta=payload.mrope_delta,
            tag=self._piece_tag(r, total))))
        await self._race(r, r.until(lambda: r.state is SenderState.DONE), deadline,
                         "sending Done")
        return SendStats(tokens=total, bytes=nbytes, resumes=resumes,
                         seconds=time.monotonic() - t0)

    @staticmethod
    def _piece_tag(r: SenderRoom, end: int) -> encoder_pb2.RangeTag | None:
        """The tags of the piece's last chunk (which ends at `end`), for its report."""
        got, r.piece_tag = r.piece_tag, None
        if got is None or got[0] != end:
            raise TransferError(f"room {r.room}: no tags for the chunk ending at {end}",
                                "INTERNAL")
        return got[1].to_proto() if got[1] is not None else None

    async def _remote_piece(self, r: SenderRoom, owner: RemoteRange, payload: PromptPayload,
                            dests: list[Destination], ids: list[int], start: int, piece: int,
                            deadline) -> int:
        """Piece [start, start+piece) by the encoder that owns it: its chunks are reported
        as ours (the language side sees one writer's stream); a helper that is gone
        (RangeLost) leaves the rest of the piece, from its last reported chunk, to us."""
        end, done = start + piece, start
        r.to(SenderState.HELPER_WRITING)

        def chunk(sent: int, tag: RangeTag | None) -> None:
            nonlocal done
            if not done < sent <= end:
                raise TransferError(f"room {r.room}: helper {owner.address} reported token "
                                    f"{sent} in piece [{start}, {end})", "INTERNAL")
            done = sent
            _chunk_written(r, sent, end, payload.num_tokens, tag)

        def working() -> None:  # the helper is in the ViT: so say we, the room is alive
            r.outbox.put_nowait(working_msg(r.room))

        dest = encoder_pb2.AttachInit()
        dest.CopyFrom(r.init)
        del dest.block_ids[:]
        dest.block_ids.extend(ids)
        dest.allocated_tokens = len(ids) * dests[0].layout.block_size
        span = tracing.start("transfer.helper_write", r.trace, attributes={
            "tandem.transfer.helper": owner.address, "tandem.transfer.first_token": start,
            "tandem.transfer.tokens": piece})
        try:
            if not owner.fell_back:
                self.metrics.ranges.labels("lead").inc()
                try:
                    # NOTE: no transfer timeout around it: the helper's silence is judged
                    # by `owner.write` (its stall timeout: lost, or the room fails), the
                    # deadline bounds it all; we, alive and waiting on it, heartbeat
                    # meanwhile, so the language side's own stall timeout never races
                    # that judgement (a silent helper would fail the room there first)
                    with self._heartbeat(r):
                        wrote = await self._race(
                            r, owner.writer.write(dest, start, piece, payload.num_tokens,
                                           payload.mrope_delta, chunk, working),
                            deadline, f"helper {owner.address} writing tokens {start}..{end}",
                            stall=False)
                    if done != end:
                        raise TransferError(f"room {r.room}: helper {owner.address} wrote "
                                            f"to token {done} of {end}", "INTERNAL")
                    return wrote
                except RangeLost as e:
                    log.warning("room %d: helper %s lost (%s): re-encoding tokens %d..%d here",
                                r.room, owner.address, e, done, end)
                    span.set_attribute("tandem.transfer.fell_back", True)
                    owner.fell_back = True
                    self.metrics.range_fallbacks.inc()
                    # NOTE: the re-encode is ViT work, not a stall: heartbeats meanwhile
                    # (the language side fails a silent room at its transfer timeout)
                    with self._heartbeat(r):
                        await self._race(r, owner.writer.fall_back(), deadline,
                                         f"re-encoding tokens {owner.start}..{owner.end}",
                                         stall=False)
            r.to(SenderState.TRANSFERRING)
            return await self._write_piece(r, payload, dests, ids, start, piece, deadline,
                                           first=done)
        finally:
            span.end()

    @contextlib.contextmanager
    def _heartbeat(self, r: SenderRoom):
        """An AttachWorking on the room's stream every `heartbeat_s` while inside (work
        that says nothing else on the stream)."""

        async def beat() -> None:
            r.outbox.put_nowait(working_msg(r.room))

        task = heartbeat(self.config.heartbeat_s, beat, self.vouch)
        try:
            yield
        finally:
            task.cancel()

    async def write_range(self, room: int, init: encoder_pb2.AttachInit,
                          payload: PromptPayload, start: int, piece: int,
                          deadline: float | None, lead: RangeListener) -> int:
        """A helper's side of RangeWriter.write: tokens [start, start+piece) of `payload`
        (its rows there final, or becoming so: its watermark) into the blocks `init` names,
        for the lead's room, told to `lead` as it goes (the last chunk written ends at
        start+piece). Returns bytes written; raises TransferError. The room is not one of
        ours (no Attach stream here): a record of its own, never in `rooms`."""
        r = SenderRoom(room, SenderState.TRANSFERRING, init=init)
        r.protection = RowProtection.of_init(init)
        self._open_peers(init)
        # NOTE: refusals before any row goes out are WriteRefused (nothing in flight: the
        # lead may re-encode the range instead of failing the room)
        if not r.protection.at_least(self.config.protect):
            raise WriteRefused(
                f"room {room}: the lead asks for transfer protection {r.protection.mode!r}, "
                f"this encoder requires at least {self.config.protect!r}",
                "FAILED_PRECONDITION")
        try:
            dests = destinations(room, init, self.staging, payload)
            dests[0].layout.check_destination(room, list(init.block_ids),
                                              init.allocated_tokens)
        except TransferError as e:
            raise WriteRefused(e.reason, e.code, e.room) from None
        if piece > init.allocated_tokens:
            raise WriteRefused(f"room {room}: piece of {piece} tokens into "
                               f"{init.allocated_tokens} reserved", "INVALID_ARGUMENT")

        def handle(msg: encoder_pb2.AttachResponse) -> None:  # the write's own messages
            kind = msg.WhichOneof("msg")
            if kind == "progress":
                lead.written(msg.progress.sent_tokens, RangeTag.from_proto(msg.progress.tag)
                             if msg.progress.HasField("tag") else None)
            elif kind == "working":
                lead.working()

        async def relay() -> None:  # chunks and heartbeats, as they come
            while True:
                handle(await r.outbox.get())

        async def watch() -> None:
            while not lead.ended():
                await asyncio.sleep(0.2)
            self._fail(r, TransferError(f"room {room}: the lead's stream ended",
                                        "CANCELLED"))

        self.metrics.ranges.labels("helper").inc()
        relaying = asyncio.ensure_future(relay())
        watching = asyncio.ensure_future(watch())
        try:
            with self._failing(r, "write_range"):
                wrote = await self._write_piece(r, payload, dests, list(init.block_ids),
                                                start, piece, deadline)
            relaying.cancel()
            while not r.outbox.empty():  # NOTE: the chunks queued before the round's result
                handle(r.outbox.get_nowait())
            last = r.piece_tag
            if last is None or last[0] != start + piece:
                raise TransferError(f"room {room}: no tags for the piece's end", "INTERNAL")
            lead.written(last[0], last[1])
            self.metrics.bytes.labels("encoder").inc(wrote)  # the lead counts the tokens
            return wrote
        finally:
            relaying.cancel()
            watching.cancel()
            if r.error is None:  # NOTE: ends the write threads' room_ended() on every path
                r.to(SenderState.DONE)

    def _slot_done(self, slot: int, f) -> None:
        if isinstance(f.exception(), TransferStuck):
            log.error("staging slot %d retired: its writes never finished", slot)
            self.staging.retire(slot)
        else:
            self.staging.release(slot)

    async def _write_piece(self, r: SenderRoom, payload: PromptPayload, dests: list[Destination],
                           ids: list[int], start: int, piece: int, deadline,
                           first: int | None = None) -> int:
        """Write tokens [first, start+piece) (`first`: `start` unless another writer wrote
        the piece's head) into `ids` of every destination: per staging round, chunks of
        `chunk_tokens` are staged and submitted, two deep (chunk k+1 is copied while chunk
        k is on the wire); each finished chunk but the piece's last is announced with a
        non-partial Progress, so the language side copies it out early."""
        loop = asyncio.get_running_loop()
        bs = dests[0].layout.block_size
        step = self.staging.round_tokens(bs)
        chunk = max(bs, min(step, self.chunk_tokens // bs * bs))
        end, nbytes = start + piece, 0
        # NOTE: the aux rows name the piece as the language side knows it: the tokens its
        # blocks hold, or the rest of the prompt (a piece cut short at a remote range's edge
        # is still that piece: the partial Progress at its end says where it stopped)
        reserved = min(payload.num_tokens - start, len(ids) * bs)

        def reported(sent: int, tag: RangeTag | None) -> None:
            _chunk_written(r, sent, end, payload.num_tokens, tag)

        t0 = start if first is None else first
        while t0 < end:
            t1 = await self._rows_for_round(r, payload, t0, min(t0 + step, end), bs, deadline)
            span = tracing.start("transfer.write", r.trace, attributes={
                "tandem.transfer.first_token": t0, "tandem.transfer.tokens": t1 - t0})
            slot = await self._acquire_slot(r, deadline)
            job = WriteRound(
                self.engine, self.staging, dests, slot, payload,
                PieceTarget(r.room, r.init.generation, ids, start, reserved),
                t0, t1, chunk, lambda: r.terminal,
                # NOTE: queued on the loop before the round's result: the piece's last tags
                # are in `r.piece_tag` by the time this round's await returns
                on_chunk=lambda c_end, tag: loop.call_soon_threadsafe(reported, c_end, tag),
                on_fail=lambda err: loop.call_soon_threadsafe(self._fail, r, err),
                protection=r.protection,
            )
            cf = self._pool.submit(write_round, job)
            # NOTE: the slot goes back only when the thread is done with it, even if the
            # room failed long before (a frozen peer keeps Mooncake busy up to its timeout).
            cf.add_done_callback(lambda f, s=slot: loop.call_soon_threadsafe(
                self._slot_done, s, f))
            inner = asyncio.wrap_future(cf)
            inner.add_done_callback(lambda f: f.cancelled() or f.exception())
            wrote = await self._race(r, asyncio.shield(inner), deadline,
                                     f"writing tokens {t0}..{t1}")
            span.set_attribute("tandem.transfer.bytes", wrote)
            span.end()
            nbytes += wrote
            t0 = t1
        return nbytes

    async def _rows_for_round(self, r: SenderRoom, payload: PromptPayload, t0: int, cap: int,
                              bs: int, deadline) -> int:
        """End of the next staging round from token `t0` (at most `cap`): `cap` when its
        rows are final, else as many whole blocks as are (a streamed payload: the range's
        tags and the receiver's copy-outs are per whole block; the last block of the
        prompt may be short). Waits while not one block is final, with a heartbeat
        (AttachWorking) every third of the transfer timeout: the rows are in the ViT, which
        is work, not a stall; the request's deadline bounds the wait."""
        arrived = payload.arrived
        if arrived is None or arrived.rows >= cap:
            return cap
        if arrived.rows - t0 >= bs:
            return t0 + (arrived.rows - t0) // bs * bs
        want = min(t0 + bs, cap)  # NOTE: never past the piece (a remote range may follow)
        r.to(SenderState.WAITING_FOR_ROWS)
        beat = self.config.heartbeat_s
        while arrived.rows < want:
            left = None if deadline is None else deadline - time.time()
            if left is not None and left <= 0:
                raise timed_out(f"room {r.room}: rows {t0}.. not ready by the deadline",
                                0.0, deadline, r.room)
            reach = asyncio.ensure_future(arrived.reach(want))
            ended = asyncio.ensure_future(r.until(lambda: r.terminal))
            try:
                await asyncio.wait({reach, ended}, timeout=beat if left is None else min(beat, left),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                reach.cancel()
                ended.cancel()
            if r.terminal:
                raise r.error or TransferError(f"room {r.room}: Attach stream closed while "
                                               "waiting for rows", "UNAVAILABLE")
            if arrived.rows < want and self.vouch():  # still in the ViT: say so
                r.outbox.put_nowait(working_msg(r.room))
        r.to(SenderState.TRANSFERRING)
        return cap if arrived.rows >= cap else t0 + (arrived.rows - t0) // bs * bs


def _chunk_written(r: SenderRoom, sent: int, end: int, total: int, tag: RangeTag | None) -> None:
    """A chunk of the piece ending at `end` reached every destination (ours, or a
    helper's): a Progress of its own, or (the piece's last) the partial Progress or Done
    that `_deliver` sends, with its tags."""
    if sent == end:
        r.piece_tag = (sent, tag)
        return
    r.outbox.put_nowait(encoder_pb2.AttachResponse(progress=encoder_pb2.AttachProgress(
        sent_tokens=sent, total_tokens=total, partial=False,
        tag=tag.to_proto() if tag is not None else None)))
