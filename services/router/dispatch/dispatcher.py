"""The request life cycle: pick E and L, open the room, relay tokens, retry, clean up.

    pick L (conversation affinity), E (image affinity), both bounded by load;
    room = random 63-bit id
    L.Generate(room, E.address, sampling, deadline) ──▶ token stream ──▶ Output, Output, ...
    E.Encode(room, messages, deadline)  (concurrently; returns once the prompt is delivered)
       └─ a prompt with >= 2 images/videos and `split_encoders` > 1 names helpers: the
          least loaded other encoders of its model (selection.pick_helpers); E decides
          which of its media each one encodes (EncodeRange), the router only offers them
       └─ E failed (UNAVAILABLE, broken) before delivery: E2 = another encoder,
          L.Reattach(room, E2.address), E2.Encode(room, ...)   (up to `encoder_retries`;
          its helpers picked afresh, never an encoder that failed the request, nor a
          helper E names as the culprit of a stalled room: CULPRIT_METADATA)
       └─ E ejected by the registry while Encode is in flight (a frozen E only ever answers
          with silence): the call is cancelled at once and moves to E2 the same way, so
          the room's language blocks serve the request instead of waiting out a timeout

A chat without an image (and `encoder_bypass` on) skips E: L.Generate(room, messages)
and L tokenizes it itself.

E/P/D (`prefills` configured): L is a decode instance D, and a prefill instance P is
picked too (conversation affinity: its prefix cache holds the earlier turns);
D.Generate(room, ..., prefill_address=P) has P run the prompt (services/language/
handoff.py) and the encoder deliver into P, so a Reattach goes to P. A retry avoids whom
the failure blames (`Avoid.record`, on typed fields only): D's failure names P when it is
P's doing (CULPRIT_METADATA, read from the Generate call's trailing metadata after an
in-stream error as from a failed call's status), and the retry avoids P and may come back
to D; a failure of D's own (or D dead or silent: no answer at all) avoids D and keeps P,
whose prefix cache holds the conversation, while P is healthy.

Traces (tandem/tracing.py; every span a no-op while tracing is off): under the request's
root span (`req.trace`, the front end's) one `router.attempt` per whole-request attempt,
and under it a `router.pick` per instance choice (with the reason), `router.language` (the
Generate stream) and one `router.encode` per Encode call, `router.reattach` between them;
each call carries its span to the next tier as W3C traceparent metadata.

NOTE (leak hazard): every exit path — normal end, error, deadline, caller gone (the
generator is closed or its task cancelled) — runs the `finally` below, which cancels
whatever is still in flight and sends L.Abort(room) unless the stream ended normally, so
the language instance frees its blocks and KV pages at once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from tandem import tracing
from tandem.services.router.config import RouterConfig
from tandem.services.router.dispatch.registry import Instance, Registry
from tandem.services.router.dispatch.selection import (
    NoInstanceError,
    Selector,
    pick_helpers,
    splittable,
)
from tandem.services.router.errors import (
    RETRYABLE_ENCODER,
    RETRYABLE_REQUEST,
    RouterError,
    Tier,
    culprit_of,
    from_error_info,
    from_rpc,
    internal_call_error,
)
from tandem.services.router.metrics import RouterMetrics
from tandem.services.router.request import (
    ChatRequest,
    Output,
    Route,
    Usage,
    conversation_key,
    image_hashes,
    merge_timings,
    prompt_key,
)
from tandem.v1 import common_pb2, encoder_pb2, language_pb2

log = logging.getLogger("tandem.router")

REATTACH_TIMEOUT_S = 5.0  # a Reattach is bookkeeping: an instance silent this long is stuck

@dataclass
class Avoid:
    """The instances a request's later attempts stay off: one per request, shared by its
    attempts (`_generate` makes it), written as attempts fail."""

    encoders: set[str] = field(default_factory=set)  # failed an attempt, or blamed
    languages: set[str] = field(default_factory=set)  # failed an attempt (or DATA_LOSS)
    prefills: set[str] = field(default_factory=set)  # E/P/D: the same, of prefill instances
    # encoders a lead named as the culprit of a stalled room (`_encode`): taken again only
    # when nothing else is left
    blamed: set[str] = field(default_factory=set)

    def record(self, route: Route, err: RouterError) -> list[str]:
        """Stay off what the failure `err` of the attempt `route` blames, read from its
        typed fields (tier, code, culprit; never its text); the addresses added.

        - the attempt's encoder, always;
        - E/P/D, its prefill instance P: when `err` names it (the decode instance does,
          for P's failures: its stream broke, its pages failed their check or never came,
          its own error; the router does when P went silent or refused a Reattach), or
          when the encoder failed (P held the room the encoder delivered into: P's death
          shows first as the encoder's closed Attach, and an encoder names no culprit for
          its own counterpart);
        - its language instance (E/P/D: the decode instance D): when the language tier
          failed blaming no prefill instance (D's own failure, or D dead or silent, which
          names no one), or on DATA_LOSS whoever reports it: the rows or pages failed
          their check where they landed, and that staging area may be written by another
          process.
        A culprit that is not the attempt's prefill instance blames no one here (the
        encoder's helpers are `_encode`'s)."""
        added = [route.encoder]
        prefill_failed = bool(route.prefill) and (
            err.culprit == route.prefill or err.tier is Tier.ENCODER)
        if prefill_failed:
            added.append(route.prefill)
            self.prefills.add(route.prefill)
        if (err.tier is Tier.LANGUAGE and not prefill_failed) or err.code == "DATA_LOSS":
            added.append(route.language)
            self.languages.add(route.language)
        self.encoders.add(route.encoder)
        return [a for a in added if a]


class _Ejected(Exception):
    """The instance a call waited on was ejected while the call was in flight."""


async def _unless_ejected(inst: Instance, call):
    """The call's answer, or `_Ejected` (the call cancelled) as soon as the router ejects
    `inst`: a frozen instance never answers, and the room it holds on the language side
    keeps embedding blocks other requests are waiting for."""
    answer = asyncio.ensure_future(call)
    ejected = asyncio.ensure_future(inst.ejected.wait())
    try:
        await asyncio.wait({answer, ejected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ejected.cancel()
        if not answer.done():  # ejected, or our own task cancelled: hang up
            call.cancel()
            answer.cancel()
            answer.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved
            pending = True
        else:
            pending = False
    if pending:
        raise _Ejected(inst.address)
    return answer.result()


class Dispatcher:
    """Runs chat requests across the tiers."""

    def __init__(self, registry: Registry, selectors: dict[str, Selector], cfg: RouterConfig,
                 metrics: RouterMetrics) -> None:
        self.registry = registry
        self.selectors = selectors
        self.cfg = cfg
        self.metrics = metrics
        self._background: set[asyncio.Task] = set()

    def _pick(self, kind: str, hashes=(), exclude=frozenset(),
              trace: tracing.Span = tracing.OFF) -> Instance:
        pool = self.registry.pool(kind)
        candidates = pool.candidates()
        try:
            choice = self.selectors[kind].choose(candidates, hashes, exclude)
        except NoInstanceError:
            raise RouterError("UNAVAILABLE", f"no healthy {kind} instance") from None
        if trace.is_recording():
            tracing.start("router.pick", trace, attributes={
                "tandem.tier": kind, tracing.SERVER_ADDRESS: choice.address,
                "tandem.pick.reason": choice.reason.value,
                "tandem.pick.candidates": len(candidates), "tandem.pick.excluded": len(exclude),
            }).end()
        return pool.instances[choice.address]

    def pick_language(self) -> Instance:
        """A language instance for a call outside any request (least load)."""
        return self._pick("language")

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, lang: Instance, room: int, trace: tracing.Span) -> None:
        try:
            await lang.stub.Abort(language_pb2.AbortRequest(room=room), timeout=2.0,
                                  metadata=tracing.metadata(trace))
        except grpc.RpcError:
            pass

    def _helpers(self, lead: Instance, media: int, exclude: frozenset[str] | set[str],
                 videos: int = 0) -> list[Instance]:
        """The helper encoders the Encode on `lead` names (selection.pick_helpers' rule,
        `split_encoders`), counted in the metrics."""
        pool = self.registry.encoders
        helpers = [pool.instances[a] for a in pick_helpers(
            pool.states(), lead.address, media, self.cfg.split_encoders, exclude, videos,
            self.cfg.split_max_helper_load)]
        if splittable(media, self.cfg.split_encoders, videos):
            self.metrics.encode_helpers.observe(len(helpers))
            if helpers:
                self.metrics.split_prompts.inc()
        return helpers

    async def _encode(
        self, req: ChatRequest, room: int, enc: Instance, lang: Instance, deadline: float,
        route: Route, trace: tracing.Span, avoid: Avoid,
    ) -> encoder_pb2.EncodeResponse | None:
        """Deliver the prompt, retrying on other encoders. None: the language side
        declined a Reattach (it already holds the prompt, or the room is gone) and its
        stream tells which. `trace`: the attempt's span; `avoid.encoders`: the request's
        encoders to stay off (those that failed an earlier attempt: never named as
        helpers); a helper an encoder blames for a stalled room (`RouterError.culprit`) is
        added to it and to `avoid.blamed`, so no later attempt of the request leads with it
        or names it either (`_pick_avoiding`: not even when nothing else is left, unless it
        is the last)."""
        hashes = image_hashes(req.messages)
        videos = sum(p.WhichOneof("part") == "video" for m in req.messages for p in m.content)
        tried: set[str] = set()
        for attempt in range(self.cfg.encoder_retries + 1):
            tried.add(enc.address)
            route.encoder = enc.address
            route.encoder_attempts = attempt + 1
            # NOTE: recomputed on every attempt: a failover's lead is another encoder, and
            # those that failed this request are no helpers.
            helpers = self._helpers(enc, len(hashes), avoid.encoders | tried, videos)
            # A helper's range is this router's work on it too (counted at once, so a
            # burst before the next load report spreads over the encoders).
            for inst in (enc, *helpers):
                inst.outstanding += 1
            span = tracing.start("router.encode", trace, kind=tracing.SpanKind.CLIENT,
                                 attributes={tracing.SERVER_ADDRESS: enc.address,
                                             "tandem.encoder.attempt": attempt + 1,
                                             "tandem.encoder.helpers": len(helpers)})
            try:
                resp = await _unless_ejected(enc, enc.stub.Encode(
                    encoder_pb2.EncodeRequest(
                        room=room,
                        request_id=req.request_id,
                        messages=req.messages,
                        deadline_unix_ms=int(deadline * 1000),
                        tools_json=req.tools.tools_json,
                        client_id=req.client_id,
                        template_options=req.template_options,
                        cache_salt=req.cache_salt,
                        helpers=[h.address for h in helpers],
                    ),
                    timeout=max(0.001, deadline - time.time()),
                    metadata=_id_metadata(req, span),
                ))
                self.registry.encoders.record_success(enc.address)
                route.resumes = resp.resumes
                span.set_attribute("tandem.transfer.resumes", resp.resumes)
                return resp
            except (grpc.RpcError, _Ejected) as e:
                err = (RouterError("UNAVAILABLE", f"encoder {enc.address} ejected",
                                   tier=Tier.ENCODER)
                       if isinstance(e, _Ejected) else from_rpc(e, Tier.ENCODER))
                tracing.fail(span, err.code, err.message)
                # a helper of this attempt that stalled the room (any other address a lead
                # names is not its to blame): neither lead nor helper again
                if err.culprit in {h.address for h in helpers}:
                    tried.add(err.culprit)  # again for this request, and health-checked
                    avoid.encoders.add(err.culprit)
                    avoid.blamed.add(err.culprit)
                    self._spawn(self.registry.encoders.verify(err.culprit))
                if err.code not in RETRYABLE_ENCODER or attempt == self.cfg.encoder_retries:
                    raise err from None
                if not isinstance(e, _Ejected):
                    self._spawn(self.registry.encoders.verify(enc.address))
                span.set_attribute("tandem.retried", True)
                log.warning("%s: encoder %s failed (%s); retrying", req.request_id, enc.address, err)
            finally:
                for inst in (enc, *helpers):
                    inst.outstanding -= 1
                span.end()
            try:
                enc = self._pick("encoder", hashes, frozenset(tried), trace)
            except RouterError:
                raise err from None
            self.metrics.encoder_retries.inc()
            span = tracing.start("router.reattach", trace, kind=tracing.SpanKind.CLIENT,
                                 attributes={tracing.SERVER_ADDRESS: lang.address,
                                             "tandem.encoder.address": enc.address})
            try:
                r = await lang.stub.Reattach(
                    language_pb2.ReattachRequest(room=room, encoder_address=enc.address),
                    timeout=max(0.001, min(REATTACH_TIMEOUT_S, deadline - time.time())),
                    metadata=_id_metadata(req, span),
                )
                span.set_attribute("tandem.reattach.accepted", r.accepted)
            except grpc.RpcError as e2:
                err = internal_call_error(e2, Tier.LANGUAGE, lang.address, deadline)
                # the instance that holds the room failed (E/P/D: the prefill instance P,
                # not the decode instance whose stream the request reads)
                err.culprit = lang.address
                tracing.fail(span, err.code, err.message)
                raise err from None
            finally:
                span.end()
            if not r.accepted:
                return None
        raise AssertionError("unreachable")

    async def generate(self, req: ChatRequest) -> AsyncIterator[Output]:
        """Yield Outputs; raise `RouterError` (before or between them) on failure.

        A failure of the instances (not of the input) before any output is retried once
        more as a whole (new room, other instances where there are any): the caller has
        seen nothing yet, so it still gets exactly one answer."""
        start = time.time()
        outcome, inner, detail = "CANCELLED (client gone)", self._generate(req, start), ""
        try:
            async for output in inner:
                if output.finished:
                    reason = common_pb2.FinishReason.Name(output.finish_reason)
                    outcome = f"OK ({reason.removeprefix('FINISH_REASON_').lower()})"
                    detail = output.summary()
                    _trace_finished(req.trace, output)
                yield output
        except RouterError as err:
            outcome = f"{err.code}: {err.message}"
            raise
        finally:
            await inner.aclose()  # NOTE: now, not at garbage collection (cancels its calls)
            # one log line per finished request (status, tokens, stage times); its id
            # greps across the three tiers
            log.info("%s: %s in %.0f ms%s", req.request_id, outcome,
                     (time.time() - start) * 1e3, detail)

    async def _generate(self, req: ChatRequest, start: float) -> AsyncIterator[Output]:
        deadline = start + req.timeout_s
        avoid = Avoid()
        for attempt in range(self.cfg.request_retries + 1):
            route = Route(attempts=attempt + 1)
            span = tracing.start("router.attempt", req.trace,
                                 attributes={"tandem.attempt": attempt + 1})
            attempt_gen = self._attempt(req, start, deadline, avoid, route, span)
            yielded = False
            try:
                async for output in attempt_gen:
                    yielded = True
                    yield output
                return
            except RouterError as err:
                tracing.fail(span, err.code, err.message)
                if (
                    yielded
                    or err.code not in RETRYABLE_REQUEST
                    or attempt == self.cfg.request_retries
                    or time.time() >= deadline
                ):
                    raise
                avoided = avoid.record(route, err)
                log.warning("%s: attempt %d failed (%s); retrying the request, avoiding %s",
                            req.request_id, attempt + 1, err, ", ".join(avoided) or "none")
                span.set_attributes({"tandem.retried": True, "tandem.retry.avoid": avoided})
                self.metrics.request_retries.inc()
            finally:
                # NOTE: close the attempt now (cancels its calls, aborts its room) rather
                # than at garbage collection; it has no awaits in its own finally.
                await attempt_gen.aclose()
                span.end()

    def _pick_avoiding(self, kind: str, hashes, avoid: set[str], trace: tracing.Span,
                       blamed: set[str] = frozenset()) -> Instance:
        """An instance outside `avoid`; when none is healthy, the same again, but one that
        was `blamed` for a stalled room (a helper named as the culprit: it may still answer
        its health checks, with its ViT hung) only when nothing else is left."""
        for exclude in (avoid | blamed, blamed):
            try:
                return self._pick(kind, hashes, frozenset(exclude), trace)
            except RouterError:
                pass
        return self._pick(kind, hashes, trace=trace)

    async def _attempt(
        self, req: ChatRequest, start: float, deadline: float, avoid: Avoid, route: Route,
        trace: tracing.Span,
    ) -> AsyncIterator[Output]:
        hashes = image_hashes(req.messages)
        # NOTE: a raw prompt always goes straight to a language instance (no chat to encode)
        bypass = bool(req.prompt) or (self.cfg.encoder_bypass and not hashes)
        key = prompt_key(req.prompt) if req.prompt else conversation_key(req.messages)
        lang = self._pick_avoiding("language", [key], avoid.languages, trace)
        # E/P/D: the prompt's instance, which holds the room the encoder delivers into
        pre = (self._pick_avoiding("prefill", [key], avoid.prefills, trace)
               if self.registry.disaggregated else None)
        enc = None if bypass else self._pick_avoiding("encoder", hashes, avoid.encoders, trace,
                                                      avoid.blamed)
        room = secrets.randbits(63)
        trace.set_attribute(tracing.ROOM, room)
        span = tracing.start("router.language", trace, kind=tracing.SpanKind.CLIENT,
                             attributes={tracing.SERVER_ADDRESS: lang.address})
        lang.outstanding += 1
        gen_call = lang.stub.Generate(
            language_pb2.LanguageGenerateRequest(
                room=room,
                request_id=req.request_id,
                encoder_address=enc.address if enc else "",
                messages=req.messages if bypass else (),
                prompt=req.prompt,
                tools_json=req.tools.tools_json if bypass else "",
                template_options=req.template_options if bypass else None,
                sampling=req.sampling,
                deadline_unix_ms=int(deadline * 1000),
                priority=req.priority,
                client_id=req.client_id,
                cache_salt=req.cache_salt,
                prefill_address=pre.address if pre is not None else "",
            ),
            timeout=max(0.001, deadline - time.time()),
            metadata=_id_metadata(req, span),
        )
        route.language = lang.address
        route.prefill = pre.address if pre is not None else ""
        if pre is not None:
            pre.outstanding += 1
        if enc is not None:
            route.encoder, route.encoder_attempts = enc.address, 1
            encode_task = asyncio.ensure_future(
                self._encode(req, room, enc, pre or lang, deadline, route, trace, avoid))
        else:  # nothing to deliver: an Encode that is already done, with no answer
            self.metrics.encoder_bypassed.inc()
            encode_task = asyncio.get_running_loop().create_future()
            encode_task.set_result(None)
        stream = gen_call.__aiter__()
        finished = False
        first = True
        # NOTE: a frozen language instance answers with silence; once the router ejects it
        # (its load polls go unanswered), a request that has no output yet moves to another
        # instance (RouterError UNAVAILABLE: `_generate` retries it). One with output keeps
        # waiting: its caller has seen tokens, and the instance may wake.
        ejected = asyncio.ensure_future(lang.ejected.wait())
        # E/P/D: a frozen prefill instance is as silent (D waits on it): its ejection moves a
        # request with no output yet elsewhere too
        pre_ejected = asyncio.ensure_future(pre.ejected.wait()) if pre is not None else None
        try:
            while True:
                next_msg = asyncio.ensure_future(stream.__anext__())
                try:
                    while not next_msg.done():
                        waits = {next_msg} if encode_task.done() else {next_msg, encode_task}
                        if first:
                            waits.add(ejected)
                            if pre_ejected is not None:
                                waits.add(pre_ejected)
                        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                        if encode_task.done() and encode_task.exception() is not None:
                            raise encode_task.exception()
                        if first and ejected.done() and not next_msg.done():
                            raise RouterError(
                                "UNAVAILABLE", f"language {lang.address} stopped answering "
                                "before any output", tier=Tier.LANGUAGE)
                        if (first and pre_ejected is not None and pre_ejected.done()
                                and not next_msg.done()):
                            raise RouterError(
                                "UNAVAILABLE", f"prefill {pre.address} stopped answering "
                                "before any output", tier=Tier.LANGUAGE, culprit=pre.address)
                finally:
                    if not next_msg.done():
                        next_msg.cancel()
                try:
                    msg = next_msg.result()
                except StopAsyncIteration:
                    raise RouterError(
                        "UNAVAILABLE", "language: stream ended early", tier=Tier.LANGUAGE
                    ) from None
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED or time.time() >= deadline:
                        raise RouterError("DEADLINE_EXCEEDED", "request deadline passed") from None
                    await self._raise_encoder_error(encode_task, deadline)
                    err = from_rpc(e, Tier.LANGUAGE)
                    # D blames P: P is health-checked (below), not D
                    if not (pre is not None and err.culprit == pre.address):
                        self._spawn(self.registry.languages.verify(lang.address))
                    raise err from None
                if msg.finish_reason == common_pb2.FINISH_REASON_ERROR and first:
                    await self._raise_encoder_error(encode_task, deadline)
                output = await self._convert(msg, encode_task, deadline, route.encoder,
                                             gen_call)
                if output.finished:
                    output.route = route
                if first and (output.token_ids or output.text or output.finished):
                    first = False
                    ttft = time.time() - start
                    self.metrics.ttft.observe(ttft, tracing.exemplar(trace))
                    span.add_event("first_token")
                    req.trace.set_attribute(tracing.TIME_TO_FIRST_CHUNK, ttft)
                if output.finished:
                    finished = True
                    self.registry.languages.record_success(lang.address)
                    e2e = time.time() - start
                    self.metrics.latency.observe(e2e, tracing.exemplar(trace))
                    if output.usage:
                        self.metrics.cached_image_tokens.inc(output.usage.cached_image_tokens)
                        self.metrics.cached_prompt_tokens.inc(output.usage.cached_tokens)
                        self.metrics.vllm.finished(
                            self.registry.model_name() or "tandem", ttft, e2e,
                            output.usage.prompt_tokens, output.usage.completion_tokens)
                    yield output
                    return
                if output.token_ids or output.text:
                    yield output
        except RouterError as err:
            tracing.fail(span, err.code, err.message)
            if pre is not None and err.culprit == pre.address:  # D (or the router) blames P:
                self._spawn(self.registry.prefills.verify(pre.address))  # health-checked
            raise
        finally:
            span.end()
            lang.outstanding -= 1
            if pre is not None:
                pre.outstanding -= 1
            ejected.cancel()
            if pre_ejected is not None:
                pre_ejected.cancel()
            if not encode_task.done():
                encode_task.cancel()
            elif not encode_task.cancelled():
                encode_task.exception()  # retrieved: no "never retrieved" warning
            if not finished:
                gen_call.cancel()
                self._spawn(self._abort(lang, room, trace))

    async def _raise_encoder_error(self, encode_task: asyncio.Future, deadline: float) -> None:
        """When the language side fails before any token, the encoder's own error (bad
        image, too large) is the one the caller needs: wait briefly for it and raise it."""
        if not encode_task.done():
            await asyncio.wait({encode_task}, timeout=max(0.0, min(1.0, deadline - time.time())))
        if encode_task.done() and not encode_task.cancelled() and encode_task.exception():
            raise encode_task.exception()

    async def _convert(
        self, msg: language_pb2.LanguageGenerateResponse, encode_task: asyncio.Future,
        deadline: float, lead: str, call,
    ) -> Output:
        """The language tier's message as an Output (the last one: with the encoder's
        figures merged; `lead`: the address of the encoder whose answer `encode_task`
        gives), or the RouterError its ERROR / ABORT stands for, with the instance `call`
        (its Generate) blames in its trailing metadata."""
        output = Output(msg)
        reason = msg.finish_reason
        if reason == common_pb2.FINISH_REASON_UNSPECIFIED:
            return output
        if reason == common_pb2.FINISH_REASON_ERROR:
            raise from_error_info(msg.error, Tier.LANGUAGE, await _blamed(call, deadline))
        if reason == common_pb2.FINISH_REASON_ABORT:
            # NOTE: the language tier names why it aborted; its clock may pass the deadline
            # a moment before ours, so its DEADLINE_EXCEEDED is believed as is.
            if msg.error.code == "DEADLINE_EXCEEDED" or time.time() >= deadline:
                raise RouterError("DEADLINE_EXCEEDED", "request deadline passed")
            culprit = await _blamed(call, deadline)
            if msg.error.code and msg.error.code != "CANCELLED":
                raise from_error_info(msg.error, Tier.LANGUAGE, culprit)
            raise RouterError("ABORTED", "language: request aborted", tier=Tier.LANGUAGE,
                              culprit=culprit)
        # The Encode answer normally precedes the first token (delivery precedes prefill);
        # wait a little for it to merge encoder timings and cache figures.
        enc_resp = None
        if not encode_task.done():
            await asyncio.wait({encode_task}, timeout=max(0.0, min(2.0, deadline - time.time())))
        if encode_task.done() and not encode_task.cancelled() and not encode_task.exception():
            enc_resp = encode_task.result()
        output.usage = Usage(
            prompt_tokens=msg.usage.prompt_tokens or (enc_resp.prompt_tokens if enc_resp else 0),
            completion_tokens=msg.usage.completion_tokens,
            cached_image_tokens=(
                enc_resp.cached_image_tokens if enc_resp else msg.usage.cached_image_tokens
            ),
            cached_tokens=msg.usage.cached_tokens,
        )
        output.timings = merge_timings(msg.timings, enc_resp, lead)
        return output


async def _blamed(call, deadline: float) -> str:
    """The instance a language instance blames for the failure it has just reported
    in-stream (CULPRIT_METADATA in the call's trailing metadata, which follows that last
    message at once: `tandem.errors.blame`); "" when it names none, or when the call has
    not ended within a second."""
    try:
        trailing = await asyncio.wait_for(call.trailing_metadata(),
                                          max(0.001, min(1.0, deadline - time.time())))
    except (asyncio.TimeoutError, grpc.RpcError):
        return ""
    return culprit_of(trailing)


def _id_metadata(req: ChatRequest, span: tracing.Span) -> tuple[tuple[str, str], ...]:
    """The request id as gRPC metadata too (x-request-id), beside the message's field, for
    proxies and tracing that read only headers; and `span` as the call's W3C traceparent
    (none while tracing is off)."""
    return (("x-request-id", req.request_id), *tracing.metadata(span))


def _trace_finished(root: tracing.Span, output: Output) -> None:
    """A choice finished: its finish reason, usage and route on the request's root span
    (several choices: reasons listed, output tokens summed)."""
    if not root.is_recording():
        return
    reason = common_pb2.FinishReason.Name(output.finish_reason)
    tracing.append(root, tracing.FINISH_REASONS, reason.removeprefix("FINISH_REASON_").lower())
    if output.usage is not None:
        root.set_attribute(tracing.INPUT_TOKENS, output.usage.prompt_tokens)
        root.set_attribute(tracing.CACHED_INPUT_TOKENS, output.usage.cached_tokens)
        root.set_attribute("tandem.cached_image_tokens", output.usage.cached_image_tokens)
        tracing.add(root, tracing.OUTPUT_TOKENS, output.usage.completion_tokens)

