"""E/P/D: a request's prompt on a prefill instance, its decoding on a decode instance
(docs/architecture.md, "Prefill and decode apart"). Both sides of the `Prefill` stream,
which the decode instance opens when its Generate names `prefill_address`:

    decode (D)                                     prefill (P)
    PrefillOpen(request, KV layout)  ───────────▶  the prompt: tokenized, or Attach to the
                                                   encoder (as a `both` instance's Generate)
                                     ◀───────────  PrefillPrompt(length, token ids)
    reserve its pages and inbox slots (waits here
    while too few are free: the pre-allocation
    queue; P holds only its embedding blocks)
    PrefillRoom(session, slots, secret) ────────▶  prefill (chunked, prefix cache), sample;
                                                   each chunk's tag taken as the prefill
                                                   completes its pages (`KVTagger`)
                                     ◀───────────  first: the first token (relayed at once)
                                                   or finished: the request ended there
                                                   (EOS, stop, max_tokens, an error)
                                     ◀───────────  chunk: pages written (tag), per chunk
    land each chunk in its reserved pages and
    check its tag there (DATA_LOSS: pages freed
    unread, the request fails before any more
    output: the router retries it elsewhere)
                                     ◀───────────  done: MRoPE delta, generator state,
                                                   cached tokens, P's stage timings (then
                                                   P wipes its outbox slots)
    the request joins its running batch
    (`Engine.submit(handoff=...)`; its inbox
    slots wiped meanwhile); its send
    side closes  ────────────────────────────────▶  the held pages are freed

Invariants: P computes nothing before D has reserved the pages it will fill (so no KV is
computed that has nowhere to go); P holds the prompt's pages (`PrefixCache.hold`) until
D closes its side (or the stream breaks), so a retry elsewhere could take them again;
D reads no landed page before its tag passed (`KVKeys.open_pages`); every path frees the
reservation (D: `Engine.unpin`, `KVStaging.drop` / `sweep`) and the hold (P:
`Engine.unpin`).

Limits (refused at start-up, by name): tensor parallel 1, the CPU (the pages are packed
and checked in host memory).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from tandem import tracing
from tandem.config import TransferConfig
from tandem.services.language.engine.request import Request
from tandem.services.language.engine.sampler import generator_state
from tandem.services.language.engine.types import HandOff
from tandem.services.language.metrics import LanguageMetrics
from tandem.transfer.buffers import RowProtection
from tandem.transfer.errors import TransferError
from tandem.transfer.kv import (
    KVChunk,
    KVDestination,
    KVKeys,
    KVPageLayout,
    KVSent,
    KVStaging,
    KVTagger,
    send_pages,
)
from tandem.transfer.payload import PromptInfo, PromptPayload
from tandem.units import ceil_div
from tandem.v1 import common_pb2, language_pb2

log = logging.getLogger("tandem.language.handoff")

# How often a decode instance looks again for free pages and inbox slots (its
# pre-allocation queue is this wait; a request gives up at its deadline)
RESERVE_POLL_S = 0.02


class HandOffError(Exception):
    """A hand-off that failed, with the gRPC code name the request ends with; `culprit`:
    the address of the other end when the failure is its doing ("" when it is this
    instance's own). The decode side names the prefill instance (CULPRIT_METADATA, to the
    router, whose retry then avoids it and may keep this instance)."""

    def __init__(self, message: str, code: str, culprit: str = "") -> None:
        super().__init__(message)
        self.message, self.code, self.culprit = message, code, culprit


def layout_to_proto(layout: KVPageLayout) -> language_pb2.KVLayout:
    return language_pb2.KVLayout(layers=layout.layers, page_size=layout.page_size,
                                 kv_heads=layout.kv_heads, head_dim=layout.head_dim,
                                 dtype=str(layout.dtype).removeprefix("torch."))


def layout_from_proto(m: language_pb2.KVLayout) -> KVPageLayout:
    dtype = getattr(torch, m.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise HandOffError(f"KV layout names no torch dtype: {m.dtype!r}", "INVALID_ARGUMENT")
    return KVPageLayout(m.layers, m.page_size, m.kv_heads, m.head_dim, dtype)


@dataclass
class KVPort:
    """One instance's side of KV transfers: its Mooncake engine, its registered staging
    area (a prefill instance's outbox, a decode instance's inbox), its KV cache and the
    transfer settings (protection, timeout)."""

    role: str
    engine: object  # tandem.transfer.engine.MooncakeEngine
    staging: KVStaging
    cache: object  # runner/kv_cache.KVCache
    transfer: TransferConfig
    # a prefill instance's tagger thread (`KVTagger`: the tags of handed-off prompts'
    # pages, taken as the prefill completes them, beside the engine thread); made at first use
    _tag_pool: ThreadPoolExecutor | None = field(default=None, repr=False)

    @property
    def layout(self) -> KVPageLayout:
        return self.staging.layout

    @property
    def tag_pool(self) -> ThreadPoolExecutor:
        if self._tag_pool is None:
            self._tag_pool = ThreadPoolExecutor(1, thread_name_prefix="kv-tag")
        return self._tag_pool


def refuse_role(role: str, tp: int, device: torch.device) -> str:
    """Why this instance cannot take `role` ("" when it can)."""
    if role == "both":
        return ""
    if tp != 1:
        return f"--role {role} needs --tp 1 (a rank's share of the KV heads is not built)"
    if device.type != "cpu":
        return (f"--role {role} runs on the CPU only (KV pages are packed and checked in host "
                f"memory; landing on {device.type} is not built)")
    return ""


# ---- the prefill side ----------------------------------------------------------------


class PrefillLink:
    """A prefill instance's end of one Prefill stream: the decode side's messages
    (`incoming`, after its PrefillOpen) and the stream's writer (`write`). With `engine`
    (the language engine), the tags of the prompt's pages are taken as the prefill
    completes them (`Engine.watch_prefill` -> `KVTagger`, on the port's tagger thread),
    not in the transfer; without it, in the transfer."""

    def __init__(self, port: KVPort, incoming: AsyncIterator, write, room: int,
                 deadline: float, metrics: LanguageMetrics, engine=None) -> None:
        self.port, self._incoming, self._write = port, incoming, write
        self.room, self.deadline = room, deadline  # (time.time() seconds)
        self.metrics = metrics
        self.engine = engine
        self.dest: KVDestination | None = None
        self.tagger: KVTagger | None = None
        self.chunks = 0

    async def _next(self, what: str):
        left = self.deadline - time.time()
        try:
            return await asyncio.wait_for(self._incoming.__anext__(), max(left, 0.001))
        except StopAsyncIteration:
            raise HandOffError(f"the decode instance closed the stream {what}",
                               "UNAVAILABLE") from None
        except asyncio.TimeoutError:
            raise HandOffError(f"deadline passed {what}", "DEADLINE_EXCEEDED") from None

    async def reserve(self, prompt: PromptPayload) -> None:
        """Say the prompt's length and ids; return once the decode instance reserved its
        pages (its PrefillRoom): nothing is computed here before that."""
        if prompt.info is None and prompt.arrived is not None:  # its ids fill in as it comes
            await prompt.arrived.reach(prompt.arrived.total)
        ids = (prompt.info.token_ids if prompt.info is not None
               else prompt.fill_ids.tolist())
        await self._write(language_pb2.PrefillResponse(prompt=language_pb2.PrefillPrompt(
            prompt_tokens=prompt.end, token_ids=ids)))
        msg = await self._next("before reserving the prompt's pages")
        if msg.WhichOneof("msg") != "room":
            raise HandOffError(f"expected PrefillRoom, got {msg.WhichOneof('msg')}",
                               "INVALID_ARGUMENT")
        r = msg.room
        pages = ceil_div(prompt.end, self.port.layout.page_size)
        if len(r.slots) != pages:
            raise HandOffError(f"PrefillRoom names {len(r.slots)} slots for {pages} pages",
                               "INVALID_ARGUMENT")
        protection = RowProtection(r.protect, bytes(r.protection_key))
        if not protection.at_least(self.port.transfer.protect):
            raise HandOffError(f"the decode side protects with {r.protect!r}, below this "
                               f"instance's --transfer.protect {self.port.transfer.protect!r}",
                               "FAILED_PRECONDITION")
        self.dest = KVDestination(r.session, r.base, list(r.slots), self.room, r.generation,
                                  protection)
        if self.engine is not None and protection.on:  # keys known: tag pages as computed
            self.tagger = KVTagger(self.port.cache, protection, self.room, r.generation,
                                   prompt.end, self.port.layout.page_size, self.port.tag_pool)
            self.engine.watch_prefill(self.room, self.tagger.progress)
        # NOTE: open the decode instance's segment now, while it is alive (it just named
        # it): a first write's handshake with a peer frozen meanwhile would hold every
        # write of this instance's engine for ~60 s (MooncakeEngine.open)
        self.port.engine.open_soon(r.session)

    async def send(self, req: Request, pages: list[int], trace: tracing.Span) -> None:
        """Write the handed-off request's prompt `pages` (held by its room), report each
        chunk, then Done; return once the decode side closed its side (it holds the
        pages: ours may go). Counted (`kv_transfer*{direction="sent"}`) and traced
        (`language.kv_send` under `trace`)."""
        m = self.metrics
        span = tracing.start("language.kv_send", trace, attributes={
            "tandem.kv.peer": self.dest.peer, "tandem.kv.pages": len(pages)})
        try:
            await self._send(req, pages, span)
        except HandOffError as e:
            m.kv_transfers.labels("sent", e.code).inc()
            tracing.fail(span, e.code, e.message)
            raise
        finally:
            span.end()
            if self.tagger is not None:  # tags not started are not taken
                self.tagger.close()
        m.kv_transfers.labels("sent", "ok").inc()

    async def _send(self, req: Request, pages: list[int], span: tracing.Span) -> None:
        loop = asyncio.get_running_loop()

        def on_chunk(c: KVChunk) -> None:  # the sender's thread: the report, in order
            try:
                asyncio.run_coroutine_threadsafe(self._write(language_pb2.PrefillResponse(
                    chunk=language_pb2.PrefillChunk(first=c.first, pages=c.pages,
                                                    chunk_tag=c.tag))), loop).result()
            except Exception as e:  # the stream is gone: a TransferError, so that
                # send_pages waits out its writes in flight before its slots are reused
                raise TransferError(f"the decode side's stream ended: {e!r}",
                                    "CANCELLED") from None

        port, m, t0 = self.port, self.metrics, time.monotonic()
        took = [0.0]

        def on_written(sent: KVSent) -> None:  # the sender's thread: every write ended
            took[0] = time.monotonic() - t0
            t = req.times.ms()
            done = language_pb2.PrefillResponse(done=language_pb2.PrefillDone(
                mrope_position_delta=req.prompt.mrope_delta,
                generator_state=generator_state(req), cached_tokens=req.kv.cached_tokens or 0,
                timings=common_pb2.StageTimings(queue_ms=t["queue"], prefill_ms=t["prefill"]),
                early_prefill_tokens=req.early_prefill_tokens))
            # NOTE: Done before the outbox is wiped (send_pages wipes once this returns): the
            # decode side takes the pages into use while this side wipes
            try:
                asyncio.run_coroutine_threadsafe(self._write(done), loop).result()
            except Exception as e:
                raise TransferError(f"the decode side's stream ended: {e!r}",
                                    "CANCELLED") from None

        try:
            sent = await loop.run_in_executor(None, lambda: send_pages(
                port.engine, port.cache, pages, port.staging, self.dest, on_chunk,
                tags=self.tagger, on_written=on_written))
        except TransferError as e:
            raise HandOffError(f"KV pages to {self.dest.peer}: {e.reason}", e.code) from None
        self.chunks = len(sent.chunks)
        m.kv_transfer_time.labels("sent").observe(took[0])
        m.kv_transfer_bytes.labels("sent").inc(sent.bytes)
        m.kv_transfer_descriptors.observe(sent.descriptors)
        span.set_attributes({"tandem.kv.bytes": sent.bytes, "tandem.kv.chunks": self.chunks,
                             "tandem.kv.descriptors": sent.descriptors})
        try:
            await self._next("after Done")  # its close (a message here is a mistake)
            raise HandOffError("the decode side sent a message after Done", "INVALID_ARGUMENT")
        except HandOffError as e:
            if e.code != "UNAVAILABLE":  # UNAVAILABLE: it closed its side, as it should
                raise


# ---- the decode side -----------------------------------------------------------------


@dataclass
class Landed:
    """What a decode instance has of a hand-off once the prefill side's Done came."""

    prompt: PromptPayload  # no rows: tokens [0, start) are its reserved pages
    handoff: HandOff
    prefill_timings: common_pb2.StageTimings
    early_prefill_tokens: int

    def timings(self, decode_ms: float) -> common_pb2.StageTimings:
        """The request's stage timings: its prompt's (queue, prefill) ran on the prefill
        instance, its decoding (`decode_ms`) here."""
        p = self.prefill_timings
        return common_pb2.StageTimings(queue_ms=p.queue_ms, prefill_ms=p.prefill_ms,
                                       decode_ms=decode_ms,
                                       early_prefill_tokens=self.early_prefill_tokens)


class DecodeLink:
    """A decode instance's end of one Prefill stream, for `request` (a Generate naming its
    prefill instance, `peer`): reserve, land and check, and what the request continues
    from. `outgoing` feeds the call's request iterator, its PrefillOpen already in it.

    Blame: a failure that is the prefill instance's doing (a message out of protocol, a
    chunk that fails its check or never comes: DATA_LOSS, its stream ending before Done)
    names it (`HandOffError.culprit`); one of this instance's own (too few pages for the
    prompt, its deadline passed waiting for them) names no one."""

    def __init__(self, port: KVPort, engine, request: language_pb2.LanguageGenerateRequest,
                 deadline: float, metrics: LanguageMetrics, trace: tracing.Span) -> None:
        self.port, self.engine, self.room = port, engine, request.room
        self.peer = request.prefill_address
        self.deadline = deadline  # time.time() seconds
        self.metrics, self.trace = metrics, trace
        self.named_at = 0.0  # time.monotonic() of the PrefillRoom (0: not yet)
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.protection = RowProtection.new(port.transfer.protect)
        self.generation = 1
        self.pages: list[int] = []
        self.prompt_tokens = 0
        self.token_ids: list[int] = []
        self.pages_landed = 0  # landed and checked
        self.first: tuple[int, float | None] | None = None
        self.landed: Landed | None = None  # once the prefill side's Done came (`relay`)
        self._open(request)

    async def requests(self):
        while True:
            msg = await self.outgoing.get()
            if msg is None:
                return
            yield msg

    async def relay(self, call, max_model_len: int
                    ) -> AsyncIterator[language_pb2.LanguageGenerateResponse]:
        """Drive the Prefill `call` (opened on `requests()`) up to the prefill side's Done:
        reserve when it says the prompt, land and check each chunk. Yields what goes to the
        client meanwhile: the first token, as soon as the prefill side has it, or the
        request's end when it ended there (EOS, a stop, max_tokens, an error: then nothing
        lands and `landed` stays None). Once it returns without that end, `landed` is what
        the request continues from. A failed hand-off raises HandOffError (counted:
        `kv_transfers{direction="received"}`); a broken stream the call's AioRpcError."""
        try:
            async for msg in call:
                kind = msg.WhichOneof("msg")
                if kind == "prompt":
                    await self.reserve(msg.prompt, max_model_len)
                elif kind == "first":
                    f = msg.first
                    if len(f.token_ids) != 1 or self.first is not None:
                        raise HandOffError(f"first message with {len(f.token_ids)} tokens",
                                           "INVALID_ARGUMENT", self.peer)
                    self.first = (f.token_ids[0], f.logprobs[0].logprob if f.logprobs else None)
                    yield f
                elif kind == "finished":
                    yield msg.finished
                    return
                elif kind == "chunk":
                    await self.land(msg.chunk)
                elif kind == "done":
                    self.landed = self.done(msg.done)
                    # NOTE: the inbox slots are wiped (then freed) once the pages they fed
                    # may be used: beside the request's first steps, not before them
                    asyncio.get_running_loop().run_in_executor(
                        None, self.port.staging.sweep, self.room)
                    return
            raise HandOffError("the prefill instance's stream ended before Done",
                               "UNAVAILABLE", self.peer)
        except HandOffError as e:
            self.metrics.kv_transfers.labels("received", e.code).inc()
            raise

    def close(self) -> None:
        """Our side of the stream closes (the request took the landed pages): the prefill
        side frees its hold."""
        self.outgoing.put_nowait(None)

    def _open(self, request: language_pb2.LanguageGenerateRequest) -> None:
        inner = language_pb2.LanguageGenerateRequest()
        inner.CopyFrom(request)
        inner.prefill_address = ""
        self.outgoing.put_nowait(language_pb2.PrefillRequest(open=language_pb2.PrefillOpen(
            request=inner, layout=layout_to_proto(self.port.layout))))

    async def reserve(self, prompt: language_pb2.PrefillPrompt, max_model_len: int) -> None:
        """Pages for the prompt (and inbox slots, one per page), waiting while too few are
        free; then the PrefillRoom naming them."""
        n, ps = prompt.prompt_tokens, self.port.layout.page_size
        if not 0 < n < max_model_len or len(prompt.token_ids) != n:
            raise HandOffError(f"prefill side announced a {n}-token prompt with "
                               f"{len(prompt.token_ids)} ids (max_model_len {max_model_len})",
                               "INVALID_ARGUMENT", self.peer)
        pages = ceil_div(n, ps)
        inbox = self.port.staging
        if pages + 1 > self.engine.pool.num_total or pages > inbox.num_slots:
            raise HandOffError(f"a {n}-token prompt needs {pages} KV pages and inbox slots; "
                               f"this decode instance has {self.engine.pool.num_total} pages "
                               f"and {inbox.num_slots} inbox slots (--kv-staging-pages)",
                               "RESOURCE_EXHAUSTED")
        self.prompt_tokens, self.token_ids = n, list(prompt.token_ids)
        span = tracing.start("language.kv_reserve", self.trace, attributes={
            "tandem.kv.pages": pages, "tandem.prompt_tokens": n})
        t0 = time.monotonic()
        try:
            slots = await self._reserve(n, pages)
        except HandOffError as e:
            tracing.fail(span, e.code, e.message)
            raise
        finally:
            span.end()
        self.metrics.kv_reserve_wait.observe(time.monotonic() - t0)
        self.named_at = time.monotonic()
        self.outgoing.put_nowait(language_pb2.PrefillRequest(room=language_pb2.PrefillRoom(
            session=self.port.engine.session_id, base=inbox.base, slots=slots,
            protect=self.protection.mode, protection_key=self.protection.key,
            generation=self.generation)))

    async def _reserve(self, n: int, pages: int) -> list[int]:
        inbox, slots = self.port.staging, None
        while True:
            if not self.pages:
                self.pages = self.engine.reserve_pages(self.room, n) or []
            if self.pages and slots is None:
                slots = inbox.reserve(pages, self.room)
            if slots is not None:
                break
            if time.time() >= self.deadline:
                raise HandOffError("deadline passed waiting for free KV pages",
                                   "DEADLINE_EXCEEDED")
            await asyncio.sleep(RESERVE_POLL_S)
        return slots

    async def land(self, c: language_pb2.PrefillChunk) -> None:
        """Land one reported chunk in its reserved pages and check its tag there (no step
        reads them before); DATA_LOSS when the check fails."""
        if c.first != self.pages_landed or c.pages < 1 or c.first + c.pages > len(self.pages):
            raise HandOffError(f"chunk of pages [{c.first}, {c.first + c.pages}) after "
                               f"{self.pages_landed} of {len(self.pages)}", "INVALID_ARGUMENT",
                               self.peer)
        part = self.pages[c.first : c.first + c.pages]
        keys = KVKeys.derive(self.protection, self.room, self.generation, c.first, c.pages)
        port = self.port

        def land() -> None:  # the slots wiped once every page landed and passed (`relay`)
            port.staging.land(self.room, port.cache, part, first=c.first, wipe=False)
            if keys is not None:
                keys.open_pages(port.cache, part, bytes(c.chunk_tag))

        try:
            await asyncio.get_running_loop().run_in_executor(None, land)
        except TransferError as e:  # the check failed (DATA_LOSS): the bytes that came are
            # not the prefill instance's (its writes, or either staging area on the way)
            raise HandOffError(e.reason, e.code, self.peer) from None
        self.pages_landed += c.pages

    def done(self, d: language_pb2.PrefillDone) -> Landed:
        if self.pages_landed != len(self.pages) or self.first is None:
            raise HandOffError(f"Done after {self.pages_landed} of {len(self.pages)} pages"
                               f"{'' if self.first else ' and no first token'}",
                               "DATA_LOSS", self.peer)
        empty = torch.empty(0, dtype=torch.int32)
        prompt = PromptPayload(None, empty, torch.empty((3, 0), dtype=torch.int32),
                               int(d.mrope_position_delta), start=self.prompt_tokens,
                               info=PromptInfo(self.token_ids))
        first, logprob = self.first
        m, nbytes = self.metrics, self.pages_landed * self.port.layout.page_bytes
        m.kv_transfer_time.labels("received").observe(time.monotonic() - self.named_at)
        m.kv_transfer_bytes.labels("received").inc(nbytes)
        m.kv_transfers.labels("received", "ok").inc()
        tracing.start("language.kv_receive", self.trace, start_ns=tracing.wall_ns(
            self.named_at), attributes={"tandem.kv.pages": self.pages_landed,
                                         "tandem.kv.bytes": nbytes}).end()
        return Landed(prompt, HandOff(first, logprob, d.cached_tokens,
                                      bytes(d.generator_state)),
                      d.timings, d.early_prefill_tokens)

    def release(self) -> None:
        """Every path: the inbox slots still held are wiped and freed (retired for the
        transfer timeout first when the room was named and not every page landed: the
        prefill side's writes may still be on the way; landed ones not swept yet: wiped
        and freed on an executor thread), and the pages go back unless a submitted request
        took them."""
        inbox = self.port.staging
        if inbox.held(self.room):
            if self.named_at:  # (its landed slots wiped there: off the event loop)
                asyncio.get_running_loop().run_in_executor(
                    None, inbox.retire, self.room, self.port.transfer.timeout_s)
            else:
                inbox.drop(self.room)
        elif inbox.holds(self.room):  # landed, or landing: `sweep` (idempotent) frees them
            asyncio.get_running_loop().run_in_executor(None, inbox.sweep, self.room)
        self.engine.unpin(self.room)
        self.outgoing.put_nowait(None)
