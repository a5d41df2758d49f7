"""EmbeddingReceiver: the language side of a room — reserves blocks, attaches, merges pieces.

Use inside the language service's event loop (one per process, one engine, buffers and
allocator registered once at start-up):

    engine = MooncakeEngine(cfg.transfer)
    buffers = EmbeddingBuffers(num_blocks, block_size, embed_dim, dtype); buffers.register(engine)
    receiver = EmbeddingReceiver(engine, buffers, cfg.transfer, ReceiverLimits(
                                     reserve_tokens=8192, reattach_grace_s=1.0,
                                     max_prompt_tokens=1 << 20, resume_tokens=None),
                                 registry=None, on_prompt=None)
    receiver.allocator  # BlockAllocator of the buffers' blocks: the receiver owns it
    payload = await receiver.receive(room, encoder_address, deadline=None)  # PromptPayload
    receiver.reattach(room, other_encoder_address) -> bool   # router retry before Done
    receiver.abort(room) -> bool                             # any stage; frees everything
    receiver.state(room) -> ReceiverState | None;  await receiver.close()  # at shutdown

Per room: BOOTSTRAPPING (reserving `reserve_tokens`, waiting for free blocks up to the
request's deadline: that wait is queueing) -> WAITING_FOR_INPUT (Init sent) ->
TRANSFERRING (data arrived) -> SUCCESS | FAILED. An AttachPrompt before any data (the
prompt's ids and images) is answered with AttachCached: `on_prompt(room, PromptInfo)`
says how many leading tokens the language side holds (its prefix cache pins them; the
caller releases the pin if the room then fails), and the payload returned starts there
(`payload.start`, `payload.info`). Without `on_prompt` the answer is 0. A non-partial Progress names a finished
chunk, which is copied out while the encoder writes the next. On a partial Progress the
piece is copied out, blocks for the rest (or `resume_tokens` of it) are reserved, waiting
for free blocks up to `timeout_s` (ahead of every first reservation), and a Resume names them. No message within `timeout_s`
(an encoder still preparing the payload sends AttachWorking every third of it)
fails the room. When the Attach stream breaks before Done the room keeps its reservation
for `reattach_grace_s` waiting for `reattach()`, then fails (0 fails at once). Every block
is freed on every path: after the payload is gathered out, on failure, on abort and when
the awaiting task is cancelled. `deadline` is Unix seconds. Failures raise
TransferError(reason, code) with a gRPC code name.

With `ranks` (a tensor-parallel instance's other ranks, services/language/tp/buffers.py)
every Init names each rank's buffers too (the encoder writes all of them); each copy-out,
wipe and drop is done by every rank, and the payload's `ranks_key` names the rows they hold
(`release(payload)` once its request ended).

NOTE: blocks are reused as soon as a room ends. An encoder frozen mid-write (SIGSTOP) whose
room timed out can, if it ever resumes, land a stale write in reused blocks; every block
carries an aux row (room, piece, index) checked before it is copied out, so such a write is
reported as DATA_LOSS instead of reaching the model when it hits the aux rows.

Protection (`config.protect`, buffers.py RowProtection): every Init carries a fresh secret;
each Progress/Done carries the encoder's tags over the range it reports. A copy-out gathers
the rows into the private `out` and opens them there (decrypts under `encrypt`, verifies
the tags), so what reaches a prefill is exactly what the encoder wrote: any other process's
write into the registered blocks fails the room with DATA_LOSS, before or after the check.

Traces: `receive(..., trace=span)` puts a `language.transfer` span under `span` (tokens,
bytes, resumes, attempts, the cached prefix), and under it `language.room_wait` (the first
reservation's wait), one `transfer.attach` per Attach attempt (its call carries that span
as traceparent, and the request id) with a `transfer.resume` per Resume (its wait for
blocks), and on a tensor-parallel instance each other rank's `tp.gather` of a range.

One class, one module, on purpose: the answers to the encoder's messages (`_on_prompt`,
`_on_progress`, `_on_partial`, `_on_done` and their `_announce` / `_copy_out`) are the
receiver's side of the Attach protocol, not a second role. They read and advance the same
room record, write on the same stream, wait for blocks with the same interrupt rules and
name the ranks' rows as `receive` does; cut out, they only ever reached back for a dozen
undeclared attributes of the receiver (a mixin), so they live here, next to the `_attempt`
loop that dispatches to them.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from tandem import tracing
from tandem.config import TransferConfig
from tandem.transfer.allocator import BlockAllocator
from tandem.transfer.buffers import (
    AUX_MROPE_DELTA,
    EmbeddingBuffers,
    PieceCheck,
    RangeSeal,
    RangeTag,
    RowProtection,
    open_range,
)
from tandem.transfer.channels import EncoderChannels
from tandem.transfer.errors import TransferError, timed_out
from tandem.transfer.metrics import transfer_metrics
from tandem.transfer.payload import ImageSpan, PromptInfo, PromptPayload, RowWatermark
from tandem.transfer.room import (
    AbortRoom,
    AttachBroken,
    BlockReservations,
    ReattachTo,
    ReceiverRoom,
    ReceiverState,
    RoomEvent,
    StreamBroken,
    StreamMessage,
)
from tandem.units import ceil_div
from tandem.v1 import encoder_pb2, encoder_pb2_grpc


@dataclass(frozen=True)
class ReceiverLimits:
    """How much a room may reserve, hold and wait for (the language tier's config maps
    its flags onto these: services/language/main.py)."""

    # tokens a room reserves at Attach, before the prompt's size is known
    reserve_tokens: int = 8192
    # the share of the pool one client's rooms may hold while others wait (BlockReservations)
    client_share: float = 1.0
    # how long a room whose Attach stream broke before Done waits for `reattach()`
    reattach_grace_s: float = 1.0
    # the longest prompt a room accepts (AttachPrompt / Progress totals past it: refused)
    max_prompt_tokens: int = 1 << 20
    # tokens reserved per Resume: None reserves the whole rest (fewest round trips), capped
    # by the pool; a number bounds how much one room holds at a time
    resume_tokens: int | None = None


class EmbeddingReceiver:
    def __init__(
        self,
        engine,
        buffers: EmbeddingBuffers,
        config: TransferConfig,
        limits: ReceiverLimits = ReceiverLimits(),
        registry=None,
        on_prompt: Callable[[int, PromptInfo], int] | None = None,
        ranks=None,
        tls=None,
    ) -> None:
        # NOTE: the receiver owns the allocator of its buffers' blocks (one id per buffer
        # block, so the two cannot disagree); others read it as `receiver.allocator`
        allocator = BlockAllocator(buffers.num_blocks, buffers.block_size)
        self.engine, self.buffers, self.allocator, self.config = engine, buffers, allocator, config
        self.limits = limits
        self.on_prompt = on_prompt
        self.metrics = transfer_metrics(registry)
        self.rooms: dict[int, ReceiverRoom] = {}
        self.metrics.watch_rooms(self)  # tandem_transfer_room_stall_seconds
        self._layout = buffers.layout().to_proto()
        # bounded, one per address; mTLS with `tls` (tandem/internal_tls.py: its role is
        # "language", the one role an encoder's Attach admits)
        self.channels = EncoderChannels(grace_s=config.timeout_s, tls=tls)
        # The instance's other tensor-parallel ranks (services/language/tp/buffers.py
        # RankBuffers): named in every Init, told to copy, clear and drop with rank 0.
        self.ranks = ranks
        self._rank_dests = list(ranks.destinations) if ranks is not None else []
        self._keys = itertools.count(1)  # the ranks' name for a payload's rows
        self.blocks = BlockReservations(allocator, self.metrics, clear=self._clear,
                                        client_share=limits.client_share)

    # ---- public control ---------------------------------------------------------------
    def state(self, room: int) -> ReceiverState | None:
        r = self.rooms.get(room)
        return r.state if r else None

    def progress_times(self) -> list[float]:
        """The last progress (`time.monotonic()`) of each open room past its queueing
        (metrics.py RoomStall; called on the metrics thread: the tuple is one atomic copy)."""
        return [t for r in tuple(self.rooms.values()) if (t := r.progressed) is not None]

    def reattach(self, room: int, encoder_address: str) -> bool:
        """Point a room whose encoder failed before Done at another encoder."""
        r = self.rooms.get(room)
        if r is None or r.state in (ReceiverState.SUCCESS, ReceiverState.FAILED):
            return False
        if r.payload is not None:  # streamed rows handed on: see `receive`
            return False
        r.post(ReattachTo(encoder_address))
        return True

    def abort(self, room: int) -> bool:
        r = self.rooms.get(room)
        if r is None:
            return False
        r.post(AbortRoom())
        return True

    async def close(self) -> None:
        await self.channels.close()

    def release(self, payload: PromptPayload) -> None:
        """The request of a payload `receive` returned ended: the other ranks may forget
        its rows. NOTE: only once no model step can name them any more."""
        if self.ranks is not None and payload.ranks_key is not None:
            self.ranks.drop(payload.ranks_key)

    def _clear(self, ids: list[int]) -> None:
        """Blocks a room lets go: wiped on every rank before anyone can have them again."""
        self.buffers.clear(ids)
        if self.ranks is not None:
            self.ranks.clear(ids)

    def _drop_rows(self, r: ReceiverRoom) -> None:
        if self.ranks is not None and r.ranks_key is not None:
            self.ranks.drop(r.ranks_key)
        r.ranks_key = None

    def _interrupt(self, r: ReceiverRoom, ev: RoomEvent) -> None:
        """Handle an event that arrives while no message is expected."""
        match ev:
            case StreamMessage(attempt=a) | StreamBroken(attempt=a) if a != r.attempt:
                return  # left over from an earlier Attach
            case AbortRoom():
                raise TransferError(f"room {r.room}: aborted", "CANCELLED", r.room)
            case StreamMessage(msg=msg) if msg.WhichOneof("msg") == "working":
                return  # a heartbeat: the encoder lives
            case StreamBroken(reason=reason):
                raise AttachBroken(reason)
            case ReattachTo(address=address):
                if r.call is None:  # still reserving: nothing to hang up, just aim elsewhere
                    r.address = address
                    return
                raise AttachBroken("reattach requested", new_address=address)
            case StreamMessage(msg=msg) if msg.WhichOneof("msg") == "failed":
                e = msg.failed.error
                raise TransferError(f"room {r.room}: encoder failed: {e.message}",
                                    e.code or "UNKNOWN", r.room)
            case StreamMessage(msg=msg):
                raise TransferError(f"room {r.room}: unexpected {msg.WhichOneof('msg')} from "
                                    f"the encoder ({r.state.value})", "INTERNAL", r.room)

    def _timeout(self, deadline: float | None) -> float:
        t = self.config.timeout_s
        return t if deadline is None else max(0.0, min(t, deadline - time.time()))

    def _queue_timeout(self, deadline: float | None) -> float:
        t = self.config.timeout_s
        return t if deadline is None else max(0.0, deadline - time.time())

    # ---- the room ---------------------------------------------------------------------
    async def receive(self, room: int, encoder_address: str, deadline: float | None = None,
                      client: str = "", trace: tracing.Span = tracing.OFF,
                      request_id: str = "",
                      on_open: Callable[[PromptPayload], None] | None = None,
                      on_rows: Callable[[], None] | None = None) -> PromptPayload:
        """Reserve, attach to `encoder_address`, and return the room's prompt payload.
        `client` (the router's client key) bounds its rooms' share of the blocks; `trace`:
        the span the room's span goes under; `request_id` names it on the Attach calls.

        `on_open(payload)` (streamed rows): called once, on this loop, as soon as the first
        rows are copied out and verified, with the payload that `receive` will return: its
        tensors have every row's place, its `arrived` watermark counts the rows in (raised
        after each copy-out; `on_rows()` runs after each raise, on this loop), its
        `mrope_delta` is set just before the last rows are counted. From then on the room
        is not reattached: its first rows may be in a prefill already, and a failure ends
        it (the caller ends the request; the router retries it whole)."""
        if room in self.rooms:
            raise TransferError(f"room {room} is already receiving", "ALREADY_EXISTS")
        r = self.rooms[room] = ReceiverRoom(room, encoder_address, client=client,
                                            request_id=request_id, on_open=on_open,
                                            on_rows=on_rows)
        r.trace = tracing.start("language.transfer", trace, attributes={tracing.ROOM: room})
        t0 = time.monotonic()
        payload: PromptPayload | None = None
        try:
            # NOTE: waiting for a first reservation is queueing behind rooms under way (each
            # bounded by the transfer timeout), not a stalled transfer: it may last until the
            # request's own deadline.
            wait = tracing.start("language.room_wait", r.trace,
                                 attributes={"tandem.transfer.reserve_tokens": self.limits.reserve_tokens})
            r.key, r.ids = await self.blocks.alloc(
                r, self.limits.reserve_tokens, self._queue_timeout(deadline),
                lambda ev: self._interrupt(r, ev),
                timeout_code="UNAVAILABLE" if deadline is None else "DEADLINE_EXCEEDED")
            wait.end()
            r.allocated = len(r.ids) * self.buffers.block_size
            while True:
                try:
                    payload = await self._attempt(r, deadline)
                    break
                except AttachBroken as b:
                    tracing.fail(r.attach_trace, "UNAVAILABLE", b.reason)
                    r.attach_trace.end()
                    self._hang_up(r)
                    if r.payload is not None:  # NOTE: its rows may be in a prefill already
                        raise TransferError(f"room {room}: {b.reason} after its first rows "
                                            f"were handed on (not reattached)", "UNAVAILABLE",
                                            room) from None
                    r.address = b.new_address or await self._await_reattach(r, b.reason, deadline)
                    r.attempt += 1
                    r.sent = r.copied = r.cached = r.reported = 0
                    r.ranges = []
                    r.info = None
                    r.total, r.out, r.state = None, None, ReceiverState.BOOTSTRAPPING
        except TransferError as e:
            r.state = ReceiverState.FAILED
            self.metrics.failures.labels("language", e.code).inc()
            for span in (r.attach_trace, r.trace):
                tracing.fail(span, e.code, e.reason)
            raise
        except asyncio.CancelledError:
            r.state = ReceiverState.FAILED
            self.metrics.failures.labels("language", "CANCELLED").inc()
            for span in (r.attach_trace, r.trace):
                tracing.fail(span, "CANCELLED")
            raise
        finally:
            self._hang_up(r, graceful=r.state == ReceiverState.TRANSFERRING and r.sent == r.total)
            self.blocks.free_all(r)  # NOTE: every path ends here; no block outlives the room
            self.rooms.pop(room, None)
            if payload is None and r.payload is None:  # failed: the ranks' rows go too
                self._drop_rows(r)  # NOTE: an opened payload's go with its request (release)
            r.attach_trace.end()
            if r.trace.is_recording():
                r.trace.set_attributes({"tandem.transfer.attempts": r.attempt + 1,
                                        "tandem.transfer.resumes": r.resumes,
                                        "tandem.cached_prefix_tokens": r.cached})
            r.trace.end()
        r.state = ReceiverState.SUCCESS
        payload.ranks_key = r.ranks_key
        m = self.metrics
        m.tokens.labels("language").inc(payload.num_tokens)
        m.bytes.labels("language").inc(sum(t.numel() * t.element_size() for t in r.out))
        m.resumes.labels("language").inc(r.resumes)
        m.seconds.labels("language").observe(time.monotonic() - t0, tracing.exemplar(r.trace))
        return payload

    def _hang_up(self, r: ReceiverRoom, graceful: bool = False) -> None:
        if graceful and r.call is not None:
            # NOTE: after Done, let the encoder finish its side of the stream. Cancelling the
            # call (or the task blocked in call.read(), which grpc.aio turns into an RPC
            # cancel) can land before the encoder sees Done written, failing it there.
            self.channels.track(asyncio.create_task(self._close_call(r.call, r.reader)))
        else:
            if r.reader is not None:
                r.reader.cancel()
            if r.call is not None:
                r.call.cancel()
        r.call = r.reader = None

    async def _close_call(self, call, reader) -> None:
        try:
            await call.done_writing()
            await asyncio.wait_for(asyncio.shield(reader), self.config.timeout_s)
        except Exception:
            pass
        finally:
            reader.cancel()
            call.cancel()

    async def _await_reattach(self, r: ReceiverRoom, reason: str, deadline: float | None) -> str:
        grace = self.limits.reattach_grace_s
        if deadline is not None:
            grace = min(grace, deadline - time.time())
        end = time.monotonic() + grace
        while (left := end - time.monotonic()) > 0:
            try:
                ev = await asyncio.wait_for(r.events.get(), left)
            except asyncio.TimeoutError:
                break
            if isinstance(ev, AbortRoom):
                raise TransferError(f"room {r.room}: aborted", "CANCELLED", r.room)
            if isinstance(ev, ReattachTo):
                return ev.address
        raise TransferError(f"room {r.room}: {reason}", "UNAVAILABLE")

    async def _attempt(self, r: ReceiverRoom, deadline: float | None) -> PromptPayload:
        stub = encoder_pb2_grpc.EncoderStub(self.channels.get(r.address))
        r.attach_trace = tracing.start(
            "transfer.attach", r.trace, kind=tracing.SpanKind.CLIENT,
            attributes={tracing.SERVER_ADDRESS: r.address, "tandem.transfer.attempt": r.attempt + 1})
        md = ((tracing.REQUEST_ID_HEADER, r.request_id),) if r.request_id else ()
        r.call = call = stub.Attach(metadata=md + tracing.metadata(r.attach_trace))
        r.reader = asyncio.create_task(self._read(r, call, r.attempt))
        # NOTE: a fresh secret per attempt: the tags of an earlier attempt's encoder (one
        # frozen mid-write that wakes) can never verify this attempt's rows
        r.protection = RowProtection.new(self.config.protect)
        init = encoder_pb2.AttachInit(
            room=r.room, session_id=self.engine.session_id, layout=self._layout,
            block_ids=r.ids, allocated_tokens=r.allocated, generation=r.attempt + 1,
            ranks=self._rank_dests, **r.protection.init_fields())
        early = await self._write_init(r, encoder_pb2.AttachRequest(init=init), deadline)
        r.state = ReceiverState.WAITING_FOR_INPUT
        r.progressed = time.monotonic()
        while True:
            timeout = self._timeout(deadline)
            try:
                ev = early.pop(0) if early else await asyncio.wait_for(r.events.get(), timeout)
            except asyncio.TimeoutError:
                raise timed_out(
                    f"room {r.room}: no data from encoder {r.address} ({r.state.value}, "
                    f"{r.copied} tokens received)", timeout, deadline, r.room) from None
            if not isinstance(ev, StreamMessage) or ev.attempt != r.attempt:
                self._interrupt(r, ev)
                continue
            msg = ev.msg
            which = msg.WhichOneof("msg")
            if which != "working":  # a heartbeat says the encoder lives, not that the room moved
                r.progressed = time.monotonic()
            if which == "prompt":
                await self._on_prompt(r, msg.prompt)
            elif which == "progress" and msg.progress.partial:
                await self._on_partial(r, msg.progress, deadline)
            elif which == "progress":
                await self._on_progress(r, msg.progress)
            elif which == "done":
                return await self._on_done(r, msg.done)
            elif which == "working":  # the encoder still prepares it: silence starts anew
                continue
            else:
                self._interrupt(r, ev)

    # ---- the answers to the encoder's messages ------------------------------------------
    # Every check here raises TransferError: INVALID_ARGUMENT for a message that does not
    # fit the room, DATA_LOSS for blocks that do not hold this attempt's data.
    async def _on_prompt(self, r: ReceiverRoom, p: encoder_pb2.AttachPrompt) -> None:
        """The prompt's content, before any data: answer how much of it we hold."""
        info = PromptInfo(list(p.token_ids),
                          [ImageSpan(im.start, im.length, im.hash) for im in p.images])
        n = len(info.token_ids)
        why = ("sent twice" if r.info is not None else "after data" if r.out is not None
               else f"{n} tokens (limit {self.limits.max_prompt_tokens})"
               if not 0 < n <= self.limits.max_prompt_tokens else info.check())
        if why:
            raise TransferError(f"room {r.room}: bad AttachPrompt: {why}", "INVALID_ARGUMENT")
        r.info = info
        r.cached = self.on_prompt(r.room, info) if self.on_prompt else 0
        await self._write(r, encoder_pb2.AttachRequest(cached=encoder_pb2.AttachCached(
            room=r.room, cached_tokens=r.cached)))

    def _announce(self, r: ReceiverRoom, sent: int, total: int, final: bool) -> None:
        """Validate a Progress/Done against the room; allocate the output on first sight.
        `r.sent` is where the current piece starts; it holds `r.allocated` tokens."""
        expect = r.total or (len(r.info.token_ids) - r.cached if r.info is not None else None)
        if not 0 < total <= self.limits.max_prompt_tokens or (expect is not None and total != expect):
            raise TransferError(f"room {r.room}: bad total_tokens {total} (expected "
                                f"{expect or f'<= {self.limits.max_prompt_tokens}'})", "INVALID_ARGUMENT")
        if not r.copied < sent <= min(total, r.sent + r.allocated) or (final and sent != total):
            raise TransferError(f"room {r.room}: encoder reports {sent}/{total} tokens; piece "
                                f"at {r.sent} holds {r.allocated}, {r.copied} copied out",
                                "INVALID_ARGUMENT")
        if r.out is None:
            r.total = total
            b, dev = self.buffers, self.buffers.embeddings.device
            r.out = (b.private_embeds(total),  # (page-locked for a CUDA model)
                     torch.empty(total, dtype=torch.int32, device=dev),
                     torch.empty((3, total), dtype=torch.int32, device=dev))
            if self.ranks is not None:  # a new attempt's rows: under a new name
                self._drop_rows(r)
                r.ranks_key = next(self._keys)
        r.state = ReceiverState.TRANSFERRING

    def _take_tags(self, r: ReceiverRoom, sent: int, tag: encoder_pb2.RangeTag) -> None:
        """Keep the encoder's tags of the range it reports: tokens [r.reported, sent)."""
        if not r.protection.on:
            return
        got = RangeTag.from_proto(tag)
        if got is None or sent <= r.reported:
            raise TransferError(f"room {r.room}: tokens [{r.reported}, {sent}) reported without "
                                f"valid tags (the Init asked for {r.protection.mode!r})",
                                "INVALID_ARGUMENT")
        r.ranges.append((r.protection.seal(r.room, r.attempt + 1, r.reported, sent), got))
        r.reported = sent

    def _seals(self, r: ReceiverRoom, start: int, upto: int) -> list[tuple[RangeSeal, RangeTag]]:
        """The reported ranges that tokens [r.copied, upto) of the piece at `start` consist
        of, each starting a block (none when unprotected)."""
        if not r.protection.on:
            return []
        take = []
        while r.ranges and r.ranges[0][0].end <= upto:
            take.append(r.ranges.pop(0))
        bs = self.buffers.block_size
        if (not take or take[0][0].start != r.copied or take[-1][0].end != upto
                or any((s.start - start) % bs for s, _ in take)):
            raise TransferError(f"room {r.room}: the encoder's reports do not cover tokens "
                                f"[{r.copied}, {upto}) in whole blocks", "INVALID_ARGUMENT")
        return take

    async def _copy_out(self, r: ReceiverRoom, ids: list[int], start: int, upto: int) -> None:
        """Gather tokens [r.copied, upto) of the piece at `start` in `ids` into the private
        `r.out` and prove them there: the aux fence, then (protected) decryption and the
        encoder's tags. Every tensor-parallel rank does the same with its own copy."""
        a, bs = r.copied, self.buffers.block_size
        i0 = (a - start) // bs
        piece_tokens = min(r.total - start, len(ids) * bs)
        check = PieceCheck(ids[i0:], r.room, r.attempt + 1, r.total, start, piece_tokens,
                           upto - a, i0)
        seals = self._seals(r, start, upto)
        self.buffers.check_piece(check)  # early: a stale write is named as such
        copy = functools.partial(self._gather, check, r.out, a, seals, f"room {r.room}: ")
        if self.ranks is not None:  # every rank copies and proves its own blocks
            copy = functools.partial(
                self.ranks.gather, r.ranks_key, check, a, local=copy,
                seals=[seal.for_rank(tag) for seal, tag in seals],
                trace=_rank_trace(r))
        await asyncio.get_running_loop().run_in_executor(None, copy)
        # NOTE: range by range, not at Done: streamed rows are prefilled (and their pages
        # keyed by the announced ids) before Done
        announced = r.info.token_ids[r.cached + a : r.cached + upto] if r.info else None
        if announced is not None and r.out[1][a:upto].tolist() != announced:
            raise TransferError(f"room {r.room}: the token ids written in [{a}, {upto}) "
                                f"differ from the announced prompt's", "DATA_LOSS")
        r.copied = upto
        self._publish(r)

    def _publish(self, r: ReceiverRoom) -> None:
        """Streamed rows: hand the payload on at its first rows (`on_open`), then raise its
        watermark to what is copied out and verified (`receive`)."""
        if r.on_open is None:
            return
        if r.payload is None:
            e, f, m = r.out
            r.payload = PromptPayload(e, f, m, r.mrope_delta or 0, start=r.cached, info=r.info,
                                      arrived=RowWatermark(r.total, on_advance=r.on_rows))
            r.payload.ranks_key = r.ranks_key
            r.on_open(r.payload)
        elif r.mrope_delta is not None:
            r.payload.mrope_delta = r.mrope_delta  # NOTE: before the last rows count
        r.payload.arrived.advance(r.copied)

    def _gather(self, check: PieceCheck, out: tuple, at: int, seals: list, where: str) -> None:
        """Executor side of `_copy_out` (rank 0's copy). NOTE: everything checked is the
        private copy, taken after the rows were copied: a write into the registered blocks
        after this point cannot reach a prefill, one during it is seen."""
        b = self.buffers
        ids, n = check.block_ids, check.n_tokens
        b.gather_into(ids, n, *out, at)
        aux = b.aux_rows(ids, n)
        b.check_piece(check, rows=aux)
        for seal, tag in seals:
            k = (seal.start - at) // b.block_size
            open_range(seal, tag, *out, aux[k : k + ceil_div(seal.end - seal.start, b.block_size)],
                       where=where)

    async def _on_progress(self, r: ReceiverRoom, p: encoder_pb2.AttachProgress) -> None:
        """A chunk of the current piece is written: copy it out while the rest flies."""
        self._announce(r, p.sent_tokens, p.total_tokens, final=False)
        self._take_tags(r, p.sent_tokens, p.tag)
        if (p.sent_tokens - r.sent) % self.buffers.block_size == 0:
            await self._copy_out(r, r.ids, r.sent, p.sent_tokens)

    async def _on_partial(self, r: ReceiverRoom, p: encoder_pb2.AttachProgress, deadline) -> None:
        self._announce(r, p.sent_tokens, p.total_tokens, final=False)
        self._take_tags(r, p.sent_tokens, p.tag)
        old_key, old_ids, start, sent = r.key, r.ids, r.sent, p.sent_tokens
        cap = self.allocator.num_total * self.allocator.block_size
        if self.limits.resume_tokens:
            cap = min(cap, self.limits.resume_tokens)
        want = min(p.total_tokens - sent, cap)
        span = tracing.start("transfer.resume", r.attach_trace, attributes={
            "tandem.transfer.sent_tokens": sent, "tandem.transfer.reserve_tokens": want})
        got = self.blocks.try_alloc(r, want)
        span.set_attribute("tandem.transfer.waited_for_blocks", got is None)
        if got is None:  # pool busy: free this piece first, then wait for blocks
            await self._copy_out(r, old_ids, start, sent)
            self.blocks.free(r, old_key)
            bounded_by_deadline = (deadline is not None
                                   and deadline - time.time() <= self.config.timeout_s)
            got = await self.blocks.alloc(
                r, want, self._timeout(deadline), lambda ev: self._interrupt(r, ev),
                resume=True,
                timeout_code="DEADLINE_EXCEEDED" if bounded_by_deadline else "UNAVAILABLE")
        r.key, r.ids = got
        r.allocated = len(r.ids) * self.buffers.block_size
        r.resumes += 1
        await self._write(r, encoder_pb2.AttachRequest(resume=encoder_pb2.AttachResume(
            room=r.room, block_ids=r.ids, sent_tokens=sent, allocated_tokens=r.allocated)))
        span.end()
        if old_key in r.keys:  # NOTE: Resume first, so this copy overlaps the next write
            await self._copy_out(r, old_ids, start, sent)
            self.blocks.free(r, old_key)
        r.sent = sent

    async def _on_done(self, r: ReceiverRoom, d: encoder_pb2.AttachDone) -> PromptPayload:
        self._announce(r, d.total_tokens, d.total_tokens, final=True)
        self._take_tags(r, d.total_tokens, d.tag)
        delta = int(self.buffers.aux[r.ids[0], AUX_MROPE_DELTA])
        if delta != d.mrope_position_delta:
            raise TransferError(f"room {r.room}: Done says mrope delta {d.mrope_position_delta}, "
                                f"blocks say {delta}", "DATA_LOSS")
        r.mrope_delta = d.mrope_position_delta
        await self._copy_out(r, r.ids, r.sent, d.total_tokens)
        self.blocks.free(r, r.key)
        r.sent = d.total_tokens
        if r.trace.is_recording():
            r.trace.set_attributes({"tandem.transfer.tokens": d.total_tokens,
                                    "tandem.transfer.bytes": sum(t.numel() * t.element_size()
                                                                 for t in r.out)})
        if r.payload is not None:  # streamed: the payload handed on, now complete
            return r.payload
        e, f, m = r.out
        return PromptPayload(input_embeds=e, fill_ids=f, mrope_positions=m,
                             mrope_delta=d.mrope_position_delta, start=r.cached, info=r.info)

    # ---- the stream -----------------------------------------------------------------------
    async def _write_init(self, r: ReceiverRoom, req: encoder_pb2.AttachRequest,
                          deadline: float | None) -> list[StreamMessage]:
        """Write the Init while still answering the room's events; return the encoder's
        messages of this attempt read meanwhile, in order, for the caller to handle first.
        NOTE: the encoder may answer the Init (its Prompt) before this write's completion
        is seen here (a loaded host): that answer is the protocol's next step, not an
        interruption; once it is in, the write has landed, so later events stay queued for
        the caller (an encoder's end of stream after its Done is no break). A first Attach to an encoder that froze before answering (no
        connection yet: the kernel accepts it, nothing reads it) never completes the write;
        a Reattach or an Abort must still end the attempt at once, and silence fails it at
        the transfer timeout, as anywhere."""
        write = asyncio.ensure_future(self._write(r, req))
        early: list[StreamMessage] = []
        try:
            timeout = self._timeout(deadline)
            end = time.monotonic() + timeout
            while not write.done() and not early:
                ev = asyncio.ensure_future(r.events.get())
                done, _ = await asyncio.wait({write, ev}, timeout=max(0.0, end - time.monotonic()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if ev in done:
                    got = ev.result()
                    if isinstance(got, StreamMessage) and got.attempt == r.attempt:
                        early.append(got)
                    else:
                        self._interrupt(r, got)  # raises for an Abort, a Reattach, a break
                    continue
                ev.cancel()
                if not done:
                    raise timed_out(f"room {r.room}: encoder {r.address} does not take the "
                                    f"Attach stream's Init", timeout, deadline, r.room)
            await write
        finally:
            if not write.done():
                write.cancel()
        return early

    async def _write(self, r: ReceiverRoom, req: encoder_pb2.AttachRequest) -> None:
        try:
            await r.call.write(req)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            raise AttachBroken(f"Attach stream to {r.address} broken while writing: {e}") from None

    async def _read(self, r: ReceiverRoom, call, attempt: int) -> None:
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    r.post(StreamBroken(
                        attempt, f"encoder {r.address} ended the Attach stream before Done"))
                    return
                r.post(StreamMessage(attempt, msg))
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            r.post(StreamBroken(attempt, f"Attach stream to encoder {r.address} broken: "
                                         f"{e.code().name}: {e.details()}"))


def _rank_trace(r: ReceiverRoom) -> dict[str, str]:
    """What the other tensor-parallel ranks need to put their copy's span in the room's
    trace (empty while off): the attempt's traceparent and the request id."""
    out = tracing.carrier(r.attach_trace)
    if out and r.request_id:
        out[tracing.REQUEST_ID_HEADER] = r.request_id
    return out
