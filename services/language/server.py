"""The `tandem.v1.Language` servicer: converts protos and delegates.

Generate, per room:

    open the room (EmbeddingReceiver.receive: reserve blocks, Attach to the encoder,
    merge resumed pieces) ─▶ Engine.submit ─▶ stream StreamDeltas as responses

With streamed rows (`--transfer.stream`, the default) the request is submitted at the
room's first verified rows (`receive(on_open=...)`); the engine prefills what has arrived
and waits for the rest (the payload's watermark wakes it); a room that fails after that
ends the request with the transfer's error (`_fail_streamed`), before any token.

or, for a text-only chat in the request (the router's encoder bypass): render and
tokenize it here (`ChatTemplate`, in a worker thread) ─▶ Engine.submit ─▶ stream.

Failures inside a started stream are reported in-stream (finish_reason ERROR or ABORT and
an ErrorInfo with a gRPC code name), as the wire contract says for streams.

Traces: a `language.generate` span per Generate (a child of the router's call, from its
traceparent) with the room's transfer (receiver.py) or `language.tokenize` under it, and,
once the request ended, its stages from the engine's records: `language.grammar` (the
structured-output compile it waited for), `language.queue`, `language.prefill` with one
`language.prefill_chunk` per step that ran a chunk of its prompt (the step's size), a
`first_token` event, `language.decode`; finish reason and usage on the generate span.

NOTE: a client that goes away cancels the handler; the `finally` blocks abort the room in
the receiver (blocks freed) or in the engine (KV pages freed) at once. Deadlines are
enforced by both: the receiver's wait and the engine's per-request deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from tandem import tracing
from tandem.chat import (
    ChatError,
    ChatTemplate,
    messages_from_proto,
    template_options_from_proto,
    tools_from_json,
)
from tandem.errors import abort
from tandem.sampling import SamplingError
from tandem.sampling import from_proto as sampling_from_proto
from tandem.services.language.engine.core import Engine
from tandem.services.language.engine.request import (
    FINISH_REASONS,
    Request,
    RequestSpec,
    StageTrace,
    StreamDelta,
)
from tandem.services.language.engine.scheduler import AdmissionError
from tandem.services.language.metrics import LanguageMetrics
from tandem.serving import deadline_from_proto
from tandem.transfer import BlockAllocator, EmbeddingReceiver, TransferError
from tandem.transfer.payload import PromptPayload
from tandem.v1 import common_pb2, language_pb2, language_pb2_grpc

log = logging.getLogger("tandem.language")


def delta_to_proto(
    d: StreamDelta, transfer_ms: float = 0.0, bypassed: bool = False, token_text=None,
    first_row_ms: float = 0.0,
) -> language_pb2.LanguageGenerateResponse:
    """`token_text(id) -> str` names the top_logprobs alternatives (the tokenizer's);
    `transfer_ms` / `first_row_ms`: Generate to the whole prompt / to its first rows."""
    out = language_pb2.LanguageGenerateResponse(token_ids=d.token_ids, text=d.text)
    if d.logprobs:
        tops = d.top_logprobs or [[] for _ in d.logprobs]
        out.logprobs.extend(
            common_pb2.TokenLogprob(token_id=t, logprob=lp, top=[
                common_pb2.TopLogprob(token_id=a, logprob=b, text=token_text(a))
                for a, b in top])
            for t, lp, top in zip(d.token_ids, d.logprobs, tops, strict=True)
        )
    if d.finish_reason is None and d.prompt_tokens:  # for usage on every streamed chunk
        out.usage.prompt_tokens = d.prompt_tokens
    if d.finish_reason is not None:
        out.finish_reason = FINISH_REASONS[d.finish_reason]
        out.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=d.prompt_tokens, completion_tokens=d.completion_tokens,
            total_tokens=d.prompt_tokens + d.completion_tokens,
            cached_tokens=d.cached_tokens))
        t = d.timings_ms
        out.timings.CopyFrom(common_pb2.StageTimings(
            transfer_ms=0.0 if bypassed else transfer_ms, queue_ms=t.get("queue", 0.0),
            prefill_ms=t.get("prefill", 0.0), decode_ms=t.get("decode", 0.0),
            encoder_bypassed=bypassed, time_to_first_row_ms=0.0 if bypassed else first_row_ms,
            early_prefill_tokens=d.early_prefill_tokens))
        if d.error:
            out.error.CopyFrom(common_pb2.ErrorInfo(code=d.error_code or "INTERNAL",
                                                    message=d.error, field=d.error_field))
    return out


def error_response(code: str, message: str, field: str = "", abort: bool = False):
    reason = common_pb2.FINISH_REASON_ABORT if abort else common_pb2.FINISH_REASON_ERROR
    return language_pb2.LanguageGenerateResponse(
        finish_reason=reason, error=common_pb2.ErrorInfo(code=code, message=message, field=field)
    )


@dataclass
class ServiceLimits:
    request_timeout_s: float
    model: str
    max_prompt_tokens: int = 1 << 20  # text-only chats tokenized here


class LanguageServicer(language_pb2_grpc.LanguageServicer):
    def __init__(
        self,
        engine: Engine,
        receiver: EmbeddingReceiver,
        allocator: BlockAllocator,
        limits: ServiceLimits,
        metrics: LanguageMetrics,
        template: ChatTemplate | None = None,
    ) -> None:
        self.engine, self.receiver, self.allocator = engine, receiver, allocator
        self.template = template  # None: text-only chats are refused
        self.limits, self.metrics = limits, metrics
        metrics.serving(limits.model)
        self.transferring: set[int] = set()
        self.streams: set[int] = set()  # rooms with a Generate call in progress
        self.draining = False
        # streamed rows (`--transfer.stream`): hand a prompt to the engine at its first rows
        self.stream = receiver.config.stream

    @property
    def num_active(self) -> int:
        return len(self.streams)

    async def Generate(self, request, context):  # noqa: N802
        room = request.room
        if self.draining:
            yield error_response("UNAVAILABLE", "language instance is draining")
            return
        try:
            sampling = sampling_from_proto(request.sampling)
        except SamplingError as e:
            yield error_response("INVALID_ARGUMENT", str(e), field=f"sampling.{e.field}")
            return
        if room in self.streams:
            yield error_response("ALREADY_EXISTS", f"room {room} is already in progress")
            return
        now = time.time()
        deadline = deadline_from_proto(request.deadline_unix_ms, self.limits.request_timeout_s, now)
        if deadline <= now:
            yield error_response("DEADLINE_EXCEEDED", "deadline already passed", abort=True)
            return
        self.streams.add(room)
        outcome = "cancelled"  # NOTE: one log line per request (its id greps across tiers)
        span = tracing.start("language.generate", tracing.from_call(context),
                             kind=tracing.SpanKind.SERVER,
                             attributes={tracing.REQUEST_ID: request.request_id,
                                         tracing.ROOM: room})
        t0 = time.monotonic()
        first_row_ms = 0.0  # an encoded prompt's (a text-only one has no rows)
        recv: asyncio.Future | None = None  # the room's transfer (streamed: outlives submit)
        opened: asyncio.Future = asyncio.get_running_loop().create_future()
        # NOTE: the grammar compiles while the prompt is on its way; until the engine has the
        # request, this call owns its interest in the compile (abandoned below if it ends)
        grammar = (self.engine.grammars.compile(sampling.grammar, request.client_id)
                   if sampling.grammar is not None else None)
        submitted = False
        try:
            # -- 1. the prompt: tokenized here (text-only chat) or through the room --
            if request.messages or request.prompt:
                tokenize = tracing.start("language.tokenize", span)
                try:
                    prompt = PromptPayload.of_token_ids(await self._tokenize(request))
                except ChatError as e:
                    outcome = f"{e.code} in the chat: {e.detail}"
                    tracing.fail(span, e.code, e.detail)
                    yield error_response(e.code, e.detail, field=e.field)
                    return
                finally:
                    tokenize.end()
            else:
                self.transferring.add(room)
                self.metrics.transferring.set(len(self.transferring))
                self.engine.expect_prompt(room, request.cache_salt)
                recv = asyncio.ensure_future(self.receiver.receive(
                    room, request.encoder_address, deadline, client=request.client_id,
                    on_open=opened.set_result if self.stream else None, trace=span,
                    request_id=request.request_id, on_rows=self.engine.wake))
                recv.add_done_callback(lambda f: self._received(room, f))
                try:
                    await asyncio.wait({recv, opened}, return_when=asyncio.FIRST_COMPLETED)
                    if not opened.done() or (recv.done() and recv.exception() is not None):
                        prompt = recv.result()  # not streamed, or failed before submit
                    else:
                        prompt = opened.result()
                except TransferError as e:
                    self.engine.unpin(room)
                    if opened.done():  # handed on, never submitted: no step names its rows
                        self.receiver.release(opened.result())
                    abort = e.code in ("CANCELLED", "DEADLINE_EXCEEDED")
                    outcome = f"{e.code} in the transfer"
                    tracing.fail(span, e.code, e.reason)
                    yield error_response(e.code, e.reason, abort=abort)
                    return
                if prompt.arrived is not None:  # streamed: the engine hears of each row
                    self.metrics.streamed_prompts.inc()  # (`on_rows`: its watermark wakes it)
                # its first rows are in place (not streamed: the whole prompt); the metric
                # and the request's time_to_first_row_ms are this one figure
                first_row_ms = (time.monotonic() - t0) * 1e3
                self.metrics.first_row.observe(first_row_ms / 1e3)
            transfer_ms = (time.monotonic() - t0) * 1e3
            # -- 2. the engine generates --
            req = self.engine.request(
                RequestSpec(room, sampling, prompt, request_id=request.request_id,
                            priority=request.priority, cache_salt=request.cache_salt,
                            deadline=time.monotonic() + (deadline - now)),
                grammar_future=grammar,
                trace=StageTrace(tracing.exemplar(span)) if span.is_recording() else None)
            q: asyncio.Queue[StreamDelta] = asyncio.Queue()
            loop = asyncio.get_running_loop()

            def sink(d: StreamDelta) -> None:  # the engine thread
                if d.finished:  # NOTE: no step names its rows any more: the ranks drop them
                    self.receiver.release(prompt)
                loop.call_soon_threadsafe(q.put_nowait, d)

            try:
                self.engine.submit(req, sink)
                submitted = True
                if recv is not None and not recv.done():  # streamed: its transfer goes on
                    recv.add_done_callback(lambda f: self._fail_streamed(room, f))
            except AdmissionError as e:
                self.engine.unpin(room)
                self.receiver.release(prompt)  # never reached a step
                outcome = f"{e.code} at admission: {e.message}"
                tracing.fail(span, e.code, e.message)
                yield error_response(e.code, e.message, field=e.field)
                return
            finished = False
            try:
                while not finished:
                    d = await q.get()
                    # Coalesce what piled up while we were sending (one message, same order).
                    while not d.finished and not q.empty():
                        d = _merge(d, q.get_nowait())
                    finished = d.finished
                    if finished:
                        outcome = (f"{d.finish_reason.label}, {d.prompt_tokens} prompt + "
                                   f"{d.completion_tokens} output tokens")
                        if span.is_recording():  # NOTE: the engine is done with `req`
                            _trace_stages(span, req, d)
                    yield delta_to_proto(d, transfer_ms,
                                         bypassed=bool(request.messages or request.prompt),
                                         token_text=self._token_text, first_row_ms=first_row_ms)
            finally:
                if not finished:  # client gone or handler cancelled: free its pages now
                    self.engine.abort(room, "client cancelled", "CANCELLED")
        finally:
            if recv is not None and not recv.done():  # NOTE: the room ends with the call
                recv.cancel()
            if grammar is not None and not submitted:  # the engine never owned its interest
                self.engine.grammars.abandon(grammar)
            self.engine.unpin(room)  # NOTE: a no-op once submitted (the request took the pin)
            self.streams.discard(room)
            log.info("%s room %d: %s", request.request_id or "-", room, outcome)
            if outcome == "cancelled":
                tracing.fail(span, "CANCELLED")
            span.end()

    def _received(self, room: int, f: asyncio.Future) -> None:
        """The room's transfer ended (success or not; streamed or not)."""
        self.transferring.discard(room)
        self.metrics.transferring.set(len(self.transferring))
        if f.cancelled() or f.exception() is not None:
            return
        prompt = f.result()
        if prompt.arrived is not None:
            self.metrics.streamed_rows.inc(prompt.arrived.rows)

    def _fail_streamed(self, room: int, f: asyncio.Future) -> None:
        """A streamed prompt's transfer failed after its request was submitted: the request
        ends with the transfer's error (the router may retry it: it has no output yet)."""
        e = None if f.cancelled() else f.exception()
        if isinstance(e, TransferError):
            self.engine.abort(room, f"transfer: {e.reason}", e.code,
                              error=e.code not in ("CANCELLED", "DEADLINE_EXCEEDED"))
        elif e is not None:
            self.engine.abort(room, f"transfer: {e!r}", "INTERNAL", error=True)

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    async def _tokenize(self, request) -> list[int]:
        """The prompt ids of a text-only chat or a raw prompt, whichever `request` (a
        Generate or Tokenize request) carries (ChatError names what is wrong)."""
        if self.template is None:
            raise ChatError("this language instance has no chat template", "messages")
        if getattr(request, "encoder_address", "") or (request.messages and request.prompt):
            raise ChatError("set exactly one of messages, prompt and encoder_address",
                            "messages")
        run, limit = asyncio.get_running_loop().run_in_executor, self.limits.max_prompt_tokens
        if request.prompt:
            return await run(None, self.template.raw_ids, request.prompt, limit)
        messages = messages_from_proto(request.messages)
        tools = tools_from_json(getattr(request, "tools_json", ""))
        options = template_options_from_proto(request.template_options)
        return await run(None, self.template.text_only_ids, messages, limit, tools, options)

    async def Tokenize(self, request, context):  # noqa: N802
        try:
            ids = await self._tokenize(request)
        except ChatError as e:  # the input it names travels as FIELD_METADATA (-> `param`)
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, e.detail, field=e.field or "")
        return language_pb2.TokenizeResponse(token_ids=ids,
                                             max_model_len=self.engine.cfg.max_model_len)

    async def Detokenize(self, request, context):  # noqa: N802
        vocab = self.engine.runner.vocab_size
        if any(not 0 <= t < vocab for t in request.token_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token_ids: every id must be in [0, {vocab})")
        text = self.engine.tokenizer.decode(list(request.token_ids))
        return language_pb2.DetokenizeResponse(text=text)

    async def Reattach(self, request, context):  # noqa: N802
        ok = self.receiver.reattach(request.room, request.encoder_address)
        tracing.start("language.reattach", tracing.from_call(context),
                      kind=tracing.SpanKind.SERVER,
                      attributes={tracing.ROOM: request.room, "tandem.reattach.accepted": ok,
                                  "tandem.encoder.address": request.encoder_address}).end()
        return language_pb2.ReattachResponse(accepted=ok)

    async def Abort(self, request, context):  # noqa: N802
        found = self.receiver.abort(request.room) or self.engine.abort(
            request.room, "aborted by request", "CANCELLED"
        )
        return language_pb2.AbortResponse(found=found)

    async def GetLoad(self, request, context):  # noqa: N802
        load = self.engine.load()
        return language_pb2.LanguageGetLoadResponse(
            transferring=len(self.transferring),
            waiting=load["waiting"],
            running=load["running"],
            free_kv_pages=load["free_kv_pages"],
            total_kv_pages=load["total_kv_pages"],
            free_embedding_blocks=self.allocator.num_free,
            total_embedding_blocks=self.allocator.num_total,
            draining=self.draining,
            model=self.limits.model,
        )


def _trace_stages(span: tracing.Span, req: Request, d: StreamDelta) -> None:
    """The engine's stages of a finished request, as spans under its generate `span`
    (from the request's monotonic timestamps), and its outcome on `span`."""
    t, wall = req.times, tracing.wall_ns
    if req.sampling.grammar is not None and t.queued:
        tracing.start("language.grammar", span, start_ns=wall(t.created)).end(wall(t.queued))
    if t.queued and t.first_scheduled:
        tracing.start("language.queue", span, start_ns=wall(t.queued)).end(
            wall(t.first_scheduled))
    if t.first_scheduled:
        prefill = tracing.start("language.prefill", span, start_ns=wall(t.first_scheduled),
                                attributes={"tandem.prefix_cache.hit_tokens": d.cached_tokens,
                                            "tandem.retractions": req.kv.num_retractions})
        for a, b, tokens, seqs, step_tokens in req.trace.chunks:
            tracing.start("language.prefill_chunk", prefill, start_ns=wall(a), attributes={
                "tandem.chunk.tokens": tokens, "tandem.batch.sequences": seqs,
                "tandem.batch.tokens": step_tokens}).end(wall(b))
        prefill.end(wall(t.first_token or time.monotonic()))
    if t.first_token:
        span.add_event("first_token", timestamp=wall(t.first_token))
        tracing.start("language.decode", span, start_ns=wall(t.first_token), attributes={
            tracing.OUTPUT_TOKENS: d.completion_tokens}).end(wall(t.last_token))
    span.set_attributes({
        tracing.INPUT_TOKENS: d.prompt_tokens, tracing.OUTPUT_TOKENS: d.completion_tokens,
        tracing.CACHED_INPUT_TOKENS: d.cached_tokens,
        tracing.FINISH_REASONS: [d.finish_reason.label.removeprefix("finished_")]})
    span.set_attribute(tracing.REQUEST_MAX_TOKENS, req.max_new_tokens)  # (Engine.request's)
    if d.error:
        tracing.fail(span, d.error_code or "INTERNAL", d.error)


def _merge(a: StreamDelta, b: StreamDelta) -> StreamDelta:
    b.token_ids = a.token_ids + b.token_ids
    b.text = a.text + b.text
    b.logprobs = a.logprobs + b.logprobs
    b.top_logprobs = a.top_logprobs + b.top_logprobs
    return b
