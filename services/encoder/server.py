"""gRPC `Encoder` servicer: converts protos, delegates, maps errors onto status codes.

    Encode(room, messages, limits, deadline, client_id)
        job_from_proto ─▶ pipeline.encode (preprocess, in the client's fair share of the
                          worker threads ─▶ sender.announce (what the language side
                          holds) ─▶ cache / ViT ─▶ merge)
                       ─▶ sender.send(room, payload, deadline)   (waits for Attach Init)
                       ─▶ EncodeResponse once Done is on the Attach stream
    Encode with helpers (a split prompt, split.py): the pipeline opens one EncodeRange
                   stream per helper share it plans; the sender hands those ranges' pieces
                   to them (and re-encodes the range of a helper that is lost)
    EncodeRange (this encoder a helper): RangeStart ─▶ pipeline.encode(role=MediaPart) (its
                   media only) ─▶ Ready ─▶ per RangeWrite: sender.write_range ─▶
                   RangeWritten per chunk (AttachWorking meanwhile)
    Attach  ─▶ sender.attach (the transfer layer owns the room protocol)
    GetLoad ─▶ queue, cache and room figures

Traces: an `encoder.encode` span per Encode (a child of the router's `router.encode`, from
the call's traceparent), with the pipeline's stages and the transfer under it;
`encoder.attach` per Attach stream (a child of the language side's `transfer.attach`).

Status codes: INVALID_ARGUMENT for bad input and per-request limits (the message starts
with the offending field, e.g. `messages[0].content[1].image: ...`), UNAVAILABLE while
draining or while the ViT is stalled (`out_of_service`), DEADLINE_EXCEEDED past the
deadline, and the transfer layer's code when the delivery fails. A failure never takes the service down.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from tandem import tracing
from tandem.chat import ChatError
from tandem.errors import abort
from tandem.services.encoder.chat import EncodeJob, inline_fetched, job_from_proto
from tandem.services.encoder.pipeline import EncodeHooks, EncodePipeline, EncodeState
from tandem.services.encoder.split import (
    ALONE,
    FallBack,
    HelperRange,
    HelperStart,
    Lead,
    MediaPart,
    Share,
)
from tandem.serving import deadline_from_proto
from tandem.transfer.buffers import RangeTag
from tandem.transfer.channels import EncoderChannels
from tandem.transfer.errors import TransferError, WriteRefused
from tandem.transfer.sender import RangeListener
from tandem.transfer.sender_room import heartbeat
from tandem.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc

log = logging.getLogger(__name__)


class _LeadStream(RangeListener):
    """A helper's range write told to the lead: each written chunk and heartbeat becomes a
    message on the EncodeRange stream's outbox; the write ends with the stream."""

    def __init__(self, outbox: asyncio.Queue, working: encoder_pb2.EncodeRangeResponse,
                 context) -> None:
        self.outbox, self.heartbeat, self.context = outbox, working, context

    def written(self, end: int, tag: RangeTag | None) -> None:
        self.outbox.put_nowait(encoder_pb2.EncodeRangeResponse(written=encoder_pb2.RangeWritten(
            sent_tokens=end, tag=tag.to_proto() if tag is not None else None)))

    def working(self) -> None:
        self.outbox.put_nowait(self.heartbeat)

    def ended(self) -> bool:
        return self.context.cancelled()


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(
        self,
        pipeline: EncodePipeline,
        sender,
        model_name: str,
        default_timeout_s: float,
        metrics=None,
        channels: EncoderChannels | None = None,
    ) -> None:
        """`channels`: to the helper encoders of split prompts (None: this encoder never
        splits: an Encode naming helpers is refused)."""
        self.pipeline, self.sender, self.metrics = pipeline, sender, metrics
        self.channels = channels
        self.model_name, self.default_timeout_s = model_name, default_timeout_s
        self.draining = False  # set once by the drain: new Encodes get UNAVAILABLE
        self.num_active = 0  # Encodes in progress (the drain waits for 0)
        self.states: dict[int, EncodeState] = {}  # room -> stage, for Encodes in progress
        if metrics:
            metrics.serving(model_name)

    def stall(self) -> str | None:
        """Why the ViT is out of service (a call stalled: scheduler.py), None if it is
        not. The encoder's health follows it (main.py)."""
        if self.pipeline.scheduler.stalled():
            return (f"encoder's ViT stalled (no progress for "
                    f"{self.pipeline.scheduler.stalled_s():.0f}s)")
        return None

    def out_of_service(self) -> str | None:
        """Why this encoder takes no new work now (new Encodes and ranges are refused
        UNAVAILABLE, and the router retries them elsewhere), None when it does."""
        return "encoder is draining" if self.draining else self.stall()

    async def Encode(self, request, context):  # noqa: N802  (gRPC method name)
        if (why := self.out_of_service()) is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, why)
        self.num_active += 1
        self._gauge()
        code = "OK"
        span = tracing.start("encoder.encode", tracing.from_call(context),
                             kind=tracing.SpanKind.SERVER,
                             attributes={tracing.REQUEST_ID: request.request_id,
                                         tracing.ROOM: request.room})
        try:
            return await self._encode(request, span)
        except ChatError as e:
            code = self._end_unsent(request.room, e.code)
            await abort(context, e.grpc_code, e.detail, field=e.field or "")
        except TimeoutError:
            code = self._end_unsent(request.room, "DEADLINE_EXCEEDED")
            stage = self.states.get(request.room, EncodeState.PREPROCESSING).value
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"room {request.room}: deadline passed while {stage}",
            )
        except TransferError as e:
            code = self._end_unsent(request.room, e.code)
            # a split prompt's silent helper is named, so the router's retry avoids it
            await abort(context, _status(e.code), f"transfer: {e.reason}", culprit=e.culprit)
        except asyncio.CancelledError:
            code = self._end_unsent(request.room, "CANCELLED")
            raise
        except Exception as e:  # a bug must not take the server down; it is reported
            log.exception("room %d: encode failed", request.room)
            code = self._end_unsent(request.room, "INTERNAL")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {e!r}")
        finally:
            state = self.states.pop(request.room, None)
            rid = request.request_id or "-"  # NOTE: one line per request, greppable by its id
            if code != "OK":
                log.info("%s room %d: %s while %s", rid, request.room, code,
                         state.value if state else "starting")
            else:
                log.info("%s room %d: delivered", rid, request.room)
            if code != "OK":
                tracing.fail(span, code, f"while {state.value if state else 'starting'}")
            span.set_attribute(tracing.RPC_STATUS, code)
            span.end()
            self.num_active -= 1
            self._gauge()
            if self.metrics:
                self.metrics.requests.labels(code).inc()

    def _end_unsent(self, room: int, code: str) -> str:
        """A failure before the payload was handed to the transfer (bad input, its deadline
        or cancellation, a bug) is the request's: its room ends with it (CANCELLED, reason
        "request"). NOTE: before the caller hears of the failure, which makes the router
        cancel the language side: that side's hang-up must find the room already ended,
        or it is counted a transfer fault. A failure while SENDING is the transfer's,
        counted by it. Returns `code`."""
        if self.states.get(room) is not EncodeState.SENDING:
            self.sender.abandon(room, f"request failed: {code}")
        return code

    async def _encode(self, request, span: tracing.Span) -> encoder_pb2.EncodeResponse:
        now = time.time()
        deadline = deadline_from_proto(request.deadline_unix_ms, self.default_timeout_s, now)
        if deadline <= now:
            raise TimeoutError
        job = job_from_proto(request, deadline)
        helpers: list[HelperRange] = []  # a split prompt's (each closed on every path)

        def open_helper(share: Share, start: HelperStart, fall_back: FallBack) -> HelperRange:
            ask = encoder_pb2.EncodeRequest()
            ask.CopyFrom(request)
            del ask.helpers[:]  # NOTE: a helper never splits its share again
            inline_fetched(ask.messages, start.fetched)  # its URL images: the bytes we fetched
            ask.deadline_unix_ms = int(deadline * 1000)  # both ends bound the range by it
            h = HelperRange(self.channels.get(share.helper), share, encoder_pb2.RangeStart(
                request=ask, payload_start=start.payload_start, first_media=share.first_media,
                media=share.end_media - share.first_media, first_token=share.first_token,
                end_token=share.end_token, image_grids=[
                    encoder_pb2.ImageGrid(temporal=t, height=y, width=x)
                    for t, y, x in start.grids],
                media_keys=start.keys),
                self.sender.config.timeout_s, fall_back,
                metadata=tracing.metadata(span) + ((tracing.REQUEST_ID_HEADER, request.request_id),))
            helpers.append(h)
            return h

        if request.helpers and self.channels is None:
            raise ChatError("this encoder cannot split prompts (no channels to helpers)",
                            "helpers", "FAILED_PRECONDITION")
        role = Lead(list(request.helpers), open_helper) if request.helpers else ALONE
        try:
            return await self._encode_split(job, role, span, helpers)
        finally:
            for h in helpers:
                h.close()

    async def _encode_split(self, job: EncodeJob, role, span: tracing.Span,
                            helpers: list[HelperRange]) -> encoder_pb2.EncodeResponse:
        deadline = job.deadline
        sending: asyncio.Task | None = None  # a streamed payload's delivery, under way

        def mark(state: EncodeState) -> None:
            self.states[job.room] = state

        def stream(payload, remote) -> None:  # the payload, before its rows are all in
            nonlocal sending
            sending = asyncio.ensure_future(self.sender.send(
                job.room, payload, deadline=deadline, trace=span, remote=remote))

        hooks = EncodeHooks(
            on_state=mark,
            announce=lambda info: self.sender.announce(job.room, info, deadline=deadline),
            on_payload=stream if self.sender.config.stream else None,
            trace=span,
        )
        async with asyncio.timeout(deadline - time.time()):
            self.sender.preparing(job.room, True)  # heartbeats on its Attach stream meanwhile
            try:
                res = await self.pipeline.encode(job, hooks, role)
            except BaseException:
                if sending is not None:  # NOTE: fails the room (CANCELLED) on both sides
                    sending.cancel()
                    await asyncio.gather(sending, return_exceptions=True)
                raise
            finally:
                self.sender.preparing(job.room, False)
            mark(EncodeState.SENDING)
            # transfer_ms: the delivery's time after the ViT (streamed: what the ViT did not
            # hide; otherwise the whole delivery)
            t0 = time.perf_counter()
            stats = await (sending if sending is not None else self.sender.send(
                job.room, res.payload, deadline=deadline, trace=span, remote=res.remote))
            transfer_ms = (time.perf_counter() - t0) * 1e3
        if span.is_recording():
            span.set_attributes({
                tracing.INPUT_TOKENS: res.payload.end, "tandem.images": len(res.image_hashes),
                "tandem.videos": len(res.video_keys), "tandem.cached_prefix_tokens":
                res.payload.start, "tandem.cached_image_tokens": res.cached_image_tokens,
                "tandem.skipped_images": res.skipped_images, "tandem.transfer.resumes":
                stats.resumes})
        return encoder_pb2.EncodeResponse(
            room=job.room,
            prompt_tokens=res.payload.end,
            num_images=len(res.image_hashes),
            # the helpers' cache hits too (each writer counts its own units': they add up)
            cached_image_tokens=res.cached_image_tokens + sum(
                h.ready.cached_image_tokens for h in _helped(res, helpers)),
            image_hashes=res.image_hashes,
            resumes=stats.resumes,
            timings=common_pb2.StageTimings(
                preprocess_ms=res.preprocess_ms, vit_ms=res.vit_ms, transfer_ms=transfer_ms,
                skipped_images=res.skipped_images,
            ),
            cached_prompt_tokens=res.payload.start,
            skipped_images=res.skipped_images,
            num_videos=len(res.video_keys),
            video_keys=res.video_keys,
            ranges=_written_ranges(res, helpers),
        )

    async def EncodeRange(self, request_iterator, context):  # noqa: N802
        """This encoder as a helper of another's split prompt (split.py)."""
        it = request_iterator.__aiter__()
        try:
            first = await asyncio.wait_for(it.__anext__(), self.sender.config.timeout_s)
        except (StopAsyncIteration, asyncio.TimeoutError):
            return
        why = self.out_of_service()
        if why is not None or first.WhichOneof("msg") != "start":
            err = ("UNAVAILABLE", why) if why is not None else (
                "INVALID_ARGUMENT", "the first EncodeRange message must be start")
            await context.write(_range_failed(*err))
            return
        start, beat = first.start, self.sender.config.heartbeat_s
        room, rid = start.request.room, start.request.request_id or "-"
        self.num_active += 1
        self._gauge()
        outbox: asyncio.Queue = asyncio.Queue()  # the one writer of the stream: `pump`

        async def pump() -> None:
            while True:
                await context.write(await outbox.get())
                outbox.task_done()

        pumping = asyncio.ensure_future(pump())
        working = encoder_pb2.EncodeRangeResponse(working=encoder_pb2.AttachWorking(room=room))
        code = "OK"
        # a write round under way (rows of ours may be in flight): a failure then says so
        # (AttachFailed.nothing_in_flight false), and the lead fails the room
        in_flight = False
        try:
            now = time.time()
            deadline = deadline_from_proto(start.request.deadline_unix_ms,
                                           self.default_timeout_s, now)
            job = job_from_proto(start.request, deadline)
            # NOTE: no image_grids is a lead from before them (or no image outside the
            # range, the same rendering): the helper reads those images' headers
            part = MediaPart(start.payload_start, start.first_media,
                             start.first_media + start.media, start.first_token, start.end_token,
                             tuple((g.temporal, g.height, g.width) for g in start.image_grids)
                             or None, tuple(start.media_keys))
            beating = heartbeat(beat, lambda: outbox.put(working), self.sender.vouch)
            try:
                async with asyncio.timeout(max(0.0, deadline - now)):
                    res = await self.pipeline.encode(job, EncodeHooks(
                        trace=tracing.start("encoder.range", tracing.from_call(context))),
                        part)
            finally:
                beating.cancel()
            outbox.put_nowait(encoder_pb2.EncodeRangeResponse(ready=encoder_pb2.RangeReady(
                cached_image_tokens=res.cached_image_tokens, vit_ms=res.vit_ms,
                preprocess_ms=res.preprocess_ms)))
            payload = res.payload
            # NOTE: the whole stream ends at the request's deadline: a lead that froze (or
            # never sends a RangeWrite) does not hold this payload and num_active for ever
            async with asyncio.timeout(max(0.0, deadline - time.time())):
                async for req in it:
                    w = req.write if req.WhichOneof("msg") == "write" else None
                    fits = w is not None and w.piece_tokens > 0 and (
                        w.total_tokens, w.mrope_position_delta) == (
                        payload.num_tokens, payload.mrope_delta) and (
                        part.first_token <= w.piece_start
                        and w.piece_start + w.piece_tokens <= part.end_token)
                    if not fits:
                        raise TransferError(f"room {room}: a write outside this range "
                                            f"[{part.first_token}, {part.end_token}) of "
                                            f"{payload.num_tokens} tokens", "INVALID_ARGUMENT")
                    in_flight = True
                    try:
                        await self.sender.write_range(
                            room, w.destination, payload, w.piece_start, w.piece_tokens,
                            deadline, _LeadStream(outbox, working, context))
                    except WriteRefused:
                        in_flight = False  # refused before any row went out
                        raise
                    in_flight = False  # the piece's writes all ended
            await _drained(outbox, pumping)
        except ChatError as e:
            code = e.code
            await _flush_failed(outbox, pumping, code, e.detail, not in_flight)
        except (TimeoutError, asyncio.TimeoutError):
            code = "DEADLINE_EXCEEDED"
            await _flush_failed(outbox, pumping, code, f"room {room}: deadline passed",
                                not in_flight)
        except TransferError as e:
            code = e.code
            await _flush_failed(outbox, pumping, code, e.reason, not in_flight)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception as e:  # a bug must not take the server down; it is reported
            log.exception("room %d: range failed", room)
            code = "INTERNAL"
            await _flush_failed(outbox, pumping, code, f"internal error: {e!r}", not in_flight)
        finally:
            pumping.cancel()
            log.info("%s room %d: range media [%d, %d): %s", rid, room, start.first_media,
                     start.first_media + start.media, code)
            self.num_active -= 1
            self._gauge()

    async def Attach(self, request_iterator, context):  # noqa: N802
        await self.sender.attach(request_iterator, context,
                                 tracing.from_call(context))

    async def GetLoad(self, request, context):  # noqa: N802
        f = self.pipeline.load_figures()
        return encoder_pb2.EncoderGetLoadResponse(
            queued_requests=self.num_active,
            queued_patches=f["queued_patches"],
            vit_patches=f["vit_patches"],
            cache_bytes=f["cache_bytes"],
            cache_capacity_bytes=f["cache_capacity_bytes"],
            open_rooms=len(self.sender.rooms),
            draining=self.draining,
            model=self.model_name,
            vit_stalled=self.pipeline.scheduler.stalled(),
        )

    def _gauge(self) -> None:
        if self.metrics:
            self.metrics.queued_requests.set(self.num_active)
            self.metrics.queue_patches.set(self.pipeline.scheduler.queued_patches)


def _range_failed(code: str, message: str,
                  nothing_in_flight: bool = True) -> encoder_pb2.EncodeRangeResponse:
    return encoder_pb2.EncodeRangeResponse(failed=encoder_pb2.AttachFailed(
        error=common_pb2.ErrorInfo(code=code, message=message),
        nothing_in_flight=nothing_in_flight))


async def _drained(outbox: asyncio.Queue, pumping: asyncio.Task) -> None:
    """Until the stream's one writer (`pumping`) has written everything queued, or ended
    (the stream broke: nothing more can be written)."""
    joined = asyncio.ensure_future(outbox.join())
    try:
        await asyncio.wait({joined, pumping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        joined.cancel()


async def _flush_failed(outbox: asyncio.Queue, pumping: asyncio.Task, code: str,
                        message: str, nothing_in_flight: bool) -> None:
    """Everything queued, then AttachFailed, written in order by the stream's one writer."""
    outbox.put_nowait(_range_failed(code, message, nothing_in_flight))
    await _drained(outbox, pumping)


def _helped(res, helpers: list[HelperRange]) -> list[HelperRange]:
    """The helpers whose ranges they wrote themselves (Ready, and not re-encoded by us)."""
    fell = {rr.start for rr in res.remote if rr.fell_back}
    return [h for h in helpers if h.ready is not None and h.share.first_token not in fell]


def _written_ranges(res, helpers: list[HelperRange]) -> list[common_pb2.EncoderRange]:
    """Who wrote which rows (the lead alone without a split), with each writer's ViT and
    preprocessing time and cache hits (the lead's: its own; a helper's: its RangeReady)."""
    if not res.shares:
        return [common_pb2.EncoderRange(first_token=0, tokens=res.payload.num_tokens,
                                         first_media=0, media=len(res.image_hashes) +
                                         len(res.video_keys), vit_ms=res.vit_ms,
                                         cached_image_tokens=res.cached_image_tokens,
                                         preprocess_ms=res.preprocess_ms)]
    fell = {rr.start for rr in res.remote if rr.fell_back}
    ready = {h.share.first_token: h.ready for h in _helped(res, helpers)}
    out = []
    for sh in res.shares:
        r = common_pb2.EncoderRange(
            encoder=sh.helper, first_token=sh.first_token, tokens=sh.end_token - sh.first_token,
            first_media=sh.first_media, media=sh.end_media - sh.first_media,
            fell_back=sh.first_token in fell and bool(sh.helper))
        if not sh.helper:
            r.vit_ms, r.cached_image_tokens = res.vit_ms, res.cached_image_tokens
            r.preprocess_ms = res.preprocess_ms
        elif sh.first_token in ready:
            got = ready[sh.first_token]
            r.vit_ms, r.cached_image_tokens = got.vit_ms, got.cached_image_tokens
            r.preprocess_ms = got.preprocess_ms
        out.append(r)
    return out


def _status(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)
