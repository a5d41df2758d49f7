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

or, on a decode instance (E/P/D: the request names `prefill_address`): open the Prefill
stream there, relay its first token, land its KV pages (`DecodeLink.relay`) ─▶
Engine.submit(handoff=...) ─▶ stream. On a prefill instance the same body serves the
Prefill stream: it ends at the first token, its pages written to the decode instance.
Every way shares one `_generate` and its one loop over the engine's deltas.

Failures inside a started stream are reported in-stream (finish_reason ERROR or ABORT and
an ErrorInfo with a gRPC code name), as the wire contract says for streams. A decode
instance's failure that is its prefill instance's doing (its stream broke, its chunks
failed their check or never came, its own error relayed) also names that instance in the
call's trailing metadata (CULPRIT_METADATA, `blame`): the router's retry avoids it, and
may come back here.

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
from contextlib import aclosing
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
from tandem.errors import abort, blame
from tandem.internal_tls import InternalTLS, aio_channel
from tandem.sampling import SamplingError, SamplingParams
from tandem.sampling import from_proto as sampling_from_proto
from tandem.services.language.engine.core import Engine
from tandem.services.language.engine.request import (
    FINISH_REASONS,
    Request,
    RequestSpec,
    RequestStatus,
    StageTrace,
    StreamDelta,
)
from tandem.services.language.engine.scheduler import AdmissionError
from tandem.services.language.handoff import (
    DecodeLink,
    HandOffError,
    KVPort,
    PrefillLink,
    layout_from_proto,
)
from tandem.services.language.metrics import LanguageMetrics
from tandem.serving import deadline_from_proto
from tandem.transfer import BlockAllocator, EmbeddingReceiver, TransferError
from tandem.transfer.payload import PromptPayload
from tandem.v1 import common_pb2, language_pb2, language_pb2_grpc

log = logging.getLogger("tandem.language")

# A decode instance's channels to its prefill instances reconnect within 2 s of a lost
# connection, as the router's own do (registry.CHANNEL_OPTIONS). gRPC's default backoff
# grows to 120 s, and a call on a channel backing off fails at once ("failed to connect"):
# a prefill instance restarted on its address, which the router picks again as soon as it
# answers, stayed unreachable from here, and every request sent to it failed blaming it.
PEER_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200),
                        ("grpc.max_reconnect_backoff_ms", 2000))


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


@dataclass(frozen=True)
class Admitted:
    """A Generate past its checks: its sampling, its deadline and when it came (Unix s)."""

    sampling: SamplingParams
    deadline: float
    now: float


class Refused(Exception):
    """A Generate refused before it holds anything: `response` is its one answer."""

    def __init__(self, response: language_pb2.LanguageGenerateResponse) -> None:
        super().__init__(response.error.message)
        self.response = response


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
        port: KVPort | None = None,
        tls: InternalTLS | None = None,
    ) -> None:
        self.engine, self.receiver, self.allocator = engine, receiver, allocator
        self.template = template  # None: text-only chats are refused
        self.limits, self.metrics = limits, metrics
        # E/P/D: this instance's KV port (None: `both`, which takes no Prefill and names none)
        self.port = port
        self.role = port.role if port is not None else "both"
        self.tls = tls  # a decode instance's client credentials for its prefill instances
        self._peers: dict[str, grpc.aio.Channel] = {}  # prefill instances' channels
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
        why = self._off_role(request)
        if why:
            yield error_response("FAILED_PRECONDITION",
                                 f"this language instance has --role {self.role}: {why}")
            return
        gen = self._generate(request, context)
        try:
            async for out in gen:
                yield out
        finally:  # NOTE: now, on every way out (a cancelled call too): its finally frees
            await gen.aclose()  # the room's blocks and pages, not at garbage collection

    def _off_role(self, request) -> str:
        """Why this instance's role refuses the Generate `request` ("" when it takes it): a
        decode instance takes exactly the requests that name a prefill instance, a `both`
        instance the others, a prefill instance none (it serves Prefill)."""
        if request.prefill_address:
            return ("" if self.role == "decode" else
                    "a request naming a prefill instance needs a decode instance")
        if self.role == "decode":
            return "it takes requests that name a prefill instance (prefill_address)"
        if self.role == "prefill":
            return "it serves only decode instances (Prefill)"
        return ""

    def _admit(self, request) -> Admitted:
        """What every Generate checks before it holds anything; Refused (its one answer)
        when it fails."""
        if self.draining:
            raise Refused(error_response("UNAVAILABLE", "language instance is draining"))
        try:
            sampling = sampling_from_proto(request.sampling)
        except SamplingError as e:
            raise Refused(error_response("INVALID_ARGUMENT", str(e),
                                         field=f"sampling.{e.field}")) from None
        if request.room in self.streams:
            raise Refused(error_response("ALREADY_EXISTS",
                                         f"room {request.room} is already in progress"))
        now = time.time()
        deadline = deadline_from_proto(request.deadline_unix_ms, self.limits.request_timeout_s,
                                       now)
        if deadline <= now:
            raise Refused(error_response("DEADLINE_EXCEEDED", "deadline already passed",
                                         abort=True))
        return Admitted(sampling, deadline, now)

    async def _generate(self, request, context, link: PrefillLink | None = None):
        """Generate's body, every role's: (1) the prompt, (2) the engine's deltas streamed
        by one loop. The prompt is tokenized here (a text-only chat, a raw prompt), or
        comes through the room (the encoder's rows), or, on a decode instance (the request
        names `prefill_address`), runs on the prefill instance, whose KV pages land here
        (`DecodeLink.relay`; its first token is relayed at once) and the request goes on
        from its first token. With `link` (a prefill instance, its Prefill stream) the
        pages are reserved on the decode instance before any compute, and the request ends
        after its first token, its pages written there (`PrefillLink.send`)."""
        room = request.room
        try:
            admitted = self._admit(request)
        except Refused as r:
            yield r.response
            return
        sampling, deadline, now = admitted.sampling, admitted.deadline, admitted.now
        self.streams.add(room)
        outcome = "cancelled"  # NOTE: one log line per request (its id greps across tiers)
        prefill = request.prefill_address  # a decode instance: where the prompt runs
        attributes = {tracing.REQUEST_ID: request.request_id, tracing.ROOM: room}
        if prefill:
            attributes["tandem.prefill.address"] = prefill
        span = tracing.start("language.generate", tracing.from_call(context),
                             kind=tracing.SpanKind.SERVER, attributes=attributes)
        t0 = time.monotonic()
        first_row_ms = 0.0  # an encoded prompt's (a text-only one has no rows)
        recv: asyncio.Future | None = None  # the room's transfer (streamed: outlives submit)
        opened: asyncio.Future = asyncio.get_running_loop().create_future()
        # NOTE: the grammar compiles while the prompt is on its way; until the engine has the
        # request, this call owns its interest in the compile (abandoned below if it ends)
        grammar = (self.engine.grammars.compile(sampling.grammar, request.client_id)
                   if sampling.grammar is not None else None)
        decode: DecodeLink | None = None  # a decode instance's end of the Prefill stream
        call = None  # ... and the call it feeds
        submitted = False
        ended = False  # this call's clean-up has run (read by the engine thread: `sink`)
        try:
            # -- 1. the prompt: from the prefill instance, tokenized here, or the room's --
            if prefill:
                decode = DecodeLink(self.port, self.engine, request, deadline, self.metrics,
                                    span)
                call = language_pb2_grpc.LanguageStub(self._peer(prefill)).Prefill(
                    decode.requests(), timeout=max(0.001, deadline - now),
                    metadata=tracing.metadata(span))
                try:
                    async with aclosing(decode.relay(call, self.engine.cfg.max_model_len)) as it:
                        async for out in it:
                            if out.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                                name = common_pb2.FinishReason.Name(out.finish_reason)
                                outcome = f"ended on the prefill instance: {name}"
                                if out.error.code:  # an error that arose there
                                    blame(context, prefill)
                            yield out  # the first token, as soon as the prefill side has it
                except HandOffError as e:
                    outcome = f"{e.code} in the hand-off: {e.message}"
                    tracing.fail(span, e.code, e.message)
                    blame(context, e.culprit)
                    yield error_response(e.code, e.message)
                    return
                except grpc.aio.AioRpcError as e:
                    code = ("DEADLINE_EXCEEDED" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                            else "UNAVAILABLE")
                    outcome = f"{code} from the prefill instance: {e.details()}"
                    tracing.fail(span, code, outcome)
                    if code == "UNAVAILABLE":  # its stream broke (it died, or refused the call)
                        blame(context, prefill)
                    yield error_response(code, f"prefill instance {prefill}: "
                                         f"{e.code().name}: {e.details()}")
                    return
                if decode.landed is None:  # the request ended there
                    return
                prompt = decode.landed.prompt
            elif request.messages or request.prompt:
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
            if link is not None:  # -- E/P/D: the decode instance reserves first --
                try:
                    await link.reserve(prompt)
                except HandOffError as e:
                    self.engine.unpin(room)
                    self.receiver.release(prompt)  # never reached a step
                    outcome = f"{e.code} reserving on the decode instance: {e.message}"
                    tracing.fail(span, e.code, e.message)
                    yield error_response(e.code, e.message)
                    return
            transfer_ms = (time.monotonic() - t0) * 1e3
            # -- 2. the engine generates --
            # (a decode instance's request has no stages of its prompt here: they ran on
            # the prefill instance, whose spans carry them)
            traced = span.is_recording() and decode is None
            req = self.engine.request(
                RequestSpec(room, sampling, prompt, request_id=request.request_id,
                            priority=request.priority, cache_salt=request.cache_salt,
                            deadline=time.monotonic() + (deadline - time.time()),
                            hand_off=link is not None),
                grammar_future=grammar,
                trace=StageTrace(tracing.exemplar(span)) if traced else None)
            q: asyncio.Queue[StreamDelta] = asyncio.Queue()
            loop = asyncio.get_running_loop()

            def sink(d: StreamDelta) -> None:  # the engine thread
                if d.finished:  # NOTE: no step names its rows any more: the ranks drop them
                    self.receiver.release(prompt)
                # NOTE (leak hazard, a prefill instance): the engine moves a handed-off
                # request's prompt pages to the room's hold as it finishes it, then calls
                # this. A call that ended meanwhile (its decode side gone while the step
                # sampled the first token) unpinned before the hold existed, and its abort
                # came too late to stop the finish: release the hold here. (Either order
                # frees it: `ended` is set before the call's own unpin.)
                if d.finish_reason is RequestStatus.FINISHED_HANDED_OFF and ended:
                    self.engine.unpin(room)
                loop.call_soon_threadsafe(q.put_nowait, d)

            try:
                self.engine.submit(req, sink,
                                   handoff=decode.landed.handoff if decode is not None else None)
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
            if decode is not None:  # the request holds the landed pages now
                decode.close()
            finished = False
            try:
                while not finished:
                    d = await q.get()
                    # Coalesce what piled up while we were sending (one message, same order).
                    while not d.finished and not q.empty():
                        d = _merge(d, q.get_nowait())
                    finished = d.finished
                    if d.finish_reason is RequestStatus.FINISHED_HANDED_OFF:
                        # its first token, then its pages to the decode instance, which
                        # goes on with the request (no final message from here)
                        if traced:  # its stages here: queue, prefill
                            _trace_stages(span, req, d)
                        d.finish_reason = None
                        yield delta_to_proto(d, transfer_ms, token_text=self._token_text)
                        try:
                            await link.send(req, self.engine.reserved_pages(room), span)
                        except HandOffError as e:
                            outcome = f"{e.code} handing off: {e.message}"
                            tracing.fail(span, e.code, e.message)
                            yield error_response(e.code, e.message)
                            return
                        outcome = (f"handed off, {d.prompt_tokens} prompt tokens' KV in "
                                   f"{link.chunks} chunk(s)")
                        return
                    out = delta_to_proto(d, transfer_ms,
                                         bypassed=bool(request.messages or request.prompt),
                                         token_text=self._token_text, first_row_ms=first_row_ms)
                    if finished:
                        outcome = (f"{d.finish_reason.label}, {d.prompt_tokens} prompt + "
                                   f"{d.completion_tokens} output tokens")
                        if decode is not None:
                            outcome += f" (prefilled on {prefill})"
                            out.timings.CopyFrom(decode.landed.timings(out.timings.decode_ms))
                        if traced:  # NOTE: the engine is done with `req`
                            _trace_stages(span, req, d)
                    yield out
            finally:
                if not finished:  # client gone or handler cancelled: free its pages now
                    self.engine.abort(room, "client cancelled", "CANCELLED")
        finally:
            if recv is not None and not recv.done():  # NOTE: the room ends with the call
                recv.cancel()
            if call is not None and not call.done():
                call.cancel()
            if decode is not None:  # its inbox slots, and its pages unless submitted
                decode.release()
            if grammar is not None and not submitted:  # the engine never owned its interest
                self.engine.grammars.abandon(grammar)
            ended = True  # NOTE: before the unpin (see `sink`)
            # the room's pin: a no-op once submitted (the request took it), but for a
            # handed-off request's hold (a prefill instance: the decode side has its pages)
            self.engine.unpin(room)
            self.streams.discard(room)
            log.info("%s room %d: %s", request.request_id or "-", room, outcome)
            if outcome == "cancelled":
                tracing.fail(span, "CANCELLED")
            span.end()

    async def Prefill(self, request_iterator, context):  # noqa: N802
        """E/P/D, a prefill instance: run a decode instance's request up to its first
        token and write its KV pages there (services/language/handoff.py)."""
        async def write(msg) -> None:
            await context.write(msg)

        async def refuse(code: str, message: str) -> None:
            await write(language_pb2.PrefillResponse(finished=error_response(code, message)))

        if self.role != "prefill":
            await refuse("FAILED_PRECONDITION", f"this language instance has --role "
                         f"{self.role}: only a prefill instance serves Prefill")
            return
        incoming = request_iterator.__aiter__()
        try:
            first = await incoming.__anext__()
        except StopAsyncIteration:
            return
        if first.WhichOneof("msg") != "open":
            await refuse("INVALID_ARGUMENT", "a Prefill stream starts with PrefillOpen")
            return
        request = first.open.request
        try:
            self.port.layout.check(layout_from_proto(first.open.layout))
        except HandOffError as e:
            await refuse(e.code, e.message)
            return
        except TransferError as e:
            await refuse(e.code, e.reason)
            return
        deadline = deadline_from_proto(request.deadline_unix_ms, self.limits.request_timeout_s,
                                       time.time())
        link = PrefillLink(self.port, incoming, write, request.room, deadline, self.metrics,
                           engine=self.engine)  # its pages tagged as the prefill computes them
        gen = self._generate(request, context, link)
        try:
            async for out in gen:
                ended = out.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                await write(language_pb2.PrefillResponse(
                    **{"finished" if ended else "first": out}))
        finally:  # NOTE: a call cancelled while we write (its decode side gone) must free
            await gen.aclose()  # the held pages now: the generator's finally does

    def _peer(self, address: str) -> grpc.aio.Channel:
        """The channel to the prefill instance at `address` (kept: one per instance)."""
        channel = self._peers.get(address)
        if channel is None:
            channel = self._peers[address] = aio_channel(address, self.tls,
                                                         PEER_CHANNEL_OPTIONS)
        return channel

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
            role=self.role,
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
