"""A split prompt's faults (services/encoder/split.py's rules), over real services: the
lead encoder, the language instance and a helper encoder of tests/test_split.py's Trio.

- Of two helpers, the second is lost (its address answers nothing) while the first
  works: the lead re-encodes the second's range and answers exactly (its own payload
  waits for its own units only, so the first helper's rows are never waited for).
- While the lead re-encodes a lost helper's range (held in its ViT past the transfer
  timeout), its Attach stream carries heartbeats: the room survives.
- A helper that refuses its range before Ready (a limit only it has) is lost, not the
  request's failure: the lead falls back and answers exactly.
- A helper that fails after its RangeWrite went out fails the room UNAVAILABLE, naming
  it as the culprit (the router retries elsewhere; the new generation fences late
  writes), and nothing leaks.
- A range written whole ends its stream cleanly (the lead half-closes it), not cancelled.
- The helper bounds an EncodeRange stream by the request's deadline: a lead that never
  sends a RangeWrite does not hold the helper's payload and load for ever.
- A RangeWrite of no tokens and a RangeStart whose payload_start lies outside the prompt
  are refused INVALID_ARGUMENT.
- The lead's rule on one helper's failure at its next piece, over a scripted stream: lost
  when nothing of it can be in flight (its stream ended since its last piece; it refused
  the RangeWrite before any row), else the room's failure naming it, but DATA_LOSS and
  the request's deadline keep their codes and blame no one.

No test here bounds a duration: every wait is a hang guard (tests/waiting.py).
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
from pathlib import Path

import grpc
import pytest
from waiting import wait_until

sys.path.insert(0, str(Path(__file__).parent))
from test_split import (  # noqa: E402
    Trio,
    _grid,
    assert_idle,
    chat_proto,
    four_image_chat,
    metric,
)
from test_stream import HANG_GUARD_S, Gate, expected  # noqa: E402

from tandem.errors import CULPRIT_METADATA  # noqa: E402
from tandem.launch.procs import free_port  # noqa: E402
from tandem.v1 import encoder_pb2, encoder_pb2_grpc  # noqa: E402

pytestmark = pytest.mark.timeout(420)


@pytest.fixture
def gate():
    from tandem.services.encoder.vit.runner import VisionRunner

    g = Gate()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VisionRunner, "run", g.wrap(VisionRunner.run))
        yield g


def nobody() -> str:
    """An address where no encoder listens: a helper whose channel breaks at once."""
    return f"127.0.0.1:{free_port()}"


def test_second_of_two_helpers_lost_while_the_first_works(checkpoint):
    ckpt = checkpoint("qwen2_5_vl")
    chat = four_image_chat(21)
    trio = Trio(ckpt).start()
    try:
        lost = nobody()
        tokens, res = trio.call(trio.generate(chat, helpers=[trio.helper, lost]))
        assert isinstance(res, encoder_pb2.EncodeResponse), (res, trio.language_error)
        assert tokens == expected(ckpt, chat)
        assert [r.encoder for r in res.ranges] == ["", trio.helper, lost]
        assert [r.fell_back for r in res.ranges] == [False, False, True]
        assert_idle(trio)
    finally:
        trio.stop()


def test_the_room_lives_while_the_lead_re_encodes_a_lost_range(checkpoint, gate):
    ckpt = checkpoint("qwen2_5_vl")
    chat = four_image_chat(22)
    timeout_s = 3
    trio = Trio(ckpt, timeout_s=timeout_s).start()
    try:
        # the last image is the helper's: only the lead's fall back runs it here
        gate.hold(_grid(ckpt, chat, 3))
        lost = nobody()
        fut = asyncio.run_coroutine_threadsafe(trio.generate(chat, helpers=[lost]), trio.loop)
        wait_until(lambda: gate.entered.is_set(), timeout_s=HANG_GUARD_S,
                   what="the fall back's ViT of image 3")
        # NOTE: nothing to wait for: the room must merely outlive several transfer
        # timeouts of a re-encode that says nothing else on the stream
        time.sleep(3 * timeout_s)
        assert not fut.done(), fut.result()
        gate.opened.set()
        tokens, res = fut.result(HANG_GUARD_S)
        assert isinstance(res, encoder_pb2.EncodeResponse), (res, trio.language_error)
        assert tokens == expected(ckpt, chat)
        assert [r.encoder for r in res.ranges] == ["", lost] and res.ranges[1].fell_back
        assert_idle(trio)
    finally:
        gate.opened.set()
        trio.stop()


def test_a_helper_refusing_before_ready_is_fallen_back_on(checkpoint):
    ckpt = checkpoint("qwen2_5_vl")
    chat = four_image_chat(23)
    trio = Trio(ckpt)
    # a limit only the helper has (config skew): it refuses INVALID_ARGUMENT before Ready
    trio.helper_cfg = trio.helper_cfg.model_copy(update={"max_images_per_request": 1})
    trio.start()
    try:
        tokens, res = trio.call(trio.generate(chat))
        assert isinstance(res, encoder_pb2.EncodeResponse), (res, trio.language_error)
        assert tokens == expected(ckpt, chat)
        assert [r.encoder for r in res.ranges] == ["", trio.helper]
        assert res.ranges[1].fell_back
        assert metric(trio.lead_cfg.metrics_port, "tandem_transfer_range_fallbacks_total") >= 1
        assert_idle(trio)
    finally:
        trio.stop()


@pytest.mark.parametrize("how", ["fails", "goes_silent"])
def test_a_helper_failing_after_its_range_write_fails_the_room_naming_it(checkpoint, how):
    """Its write round fails, or it goes silent mid-write (past the transfer timeout: a
    helper frozen while writing, whose writes may still land)."""
    from tandem.transfer.errors import TransferError
    from tandem.transfer.sender import EmbeddingSender

    ckpt = checkpoint("qwen2_5_vl")
    chat = four_image_chat(24)
    trio = Trio(ckpt, timeout_s=3).start()
    got = []

    async def failing(self, room, init, payload, start, piece, *args, **kwargs):
        # (only a helper writes a range: the lead's own pieces never come here)
        got.append((start, piece))
        if how == "goes_silent":
            await asyncio.Event().wait()  # until the lead hangs up (cancelled)
        raise TransferError(f"room {room}: a write round failed (injected)", "INTERNAL")

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(EmbeddingSender, "write_range", failing)
            tokens, res = trio.call(trio.generate(chat))
        assert got, "the helper was sent its RangeWrite"
        assert isinstance(res, grpc.aio.AioRpcError), res
        assert res.code() == grpc.StatusCode.UNAVAILABLE, res  # the router retries it
        assert dict(res.trailing_metadata()).get(CULPRIT_METADATA) == trio.helper
        assert not tokens
        assert_idle(trio)
    finally:
        trio.stop()


def test_a_range_written_whole_ends_cleanly_not_cancelled(checkpoint):
    from tandem.services.encoder.server import EncoderServicer

    ckpt = checkpoint("qwen2_5_vl")
    chat = four_image_chat(26)
    ends = []
    real = EncoderServicer.EncodeRange

    async def watched(self, request_iterator, context):
        try:
            await real(self, request_iterator, context)
        except asyncio.CancelledError:
            ends.append("cancelled")
            raise
        ends.append("returned")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EncoderServicer, "EncodeRange", watched)  # before the servers bind it
        trio = Trio(ckpt).start()
    try:
        tokens, res = trio.call(trio.generate(chat))
        assert isinstance(res, encoder_pb2.EncodeResponse), res
        assert tokens == expected(ckpt, chat) and not res.ranges[1].fell_back
        wait_until(lambda: ends, timeout_s=HANG_GUARD_S, what="the helper's range ended")
        assert ends == ["returned"]
    finally:
        trio.stop()


@pytest.fixture(scope="module")
def helper_range(checkpoint):
    """A Trio, one split done, and what a lead sends its helper for it: the range, the
    helper's first RangeWrite (destination, total tokens, MRoPE delta, as the helper's
    write saw them) and `start(payload_start, deadline_unix_ms)`: its RangeStart (tokens
    shifted with a payload_start other than the real one, so they still lie where the
    helper's units start)."""
    from tandem.transfer.sender import EmbeddingSender

    ckpt = checkpoint("qwen2_5_vl")
    chat = four_image_chat(25)
    trio = Trio(ckpt).start()
    seen = []
    real = EmbeddingSender.write_range

    async def spy(self, room, init, payload, *args, **kwargs):
        seen.append(encoder_pb2.RangeWrite(destination=init, total_tokens=payload.num_tokens,
                                           mrope_position_delta=payload.mrope_delta))
        return await real(self, room, init, payload, *args, **kwargs)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(EmbeddingSender, "write_range", spy)
            tokens, res = trio.call(trio.generate(chat))
        assert isinstance(res, encoder_pb2.EncodeResponse), res
        assert seen
        rng = res.ranges[1]

        def start(payload_start: int = res.cached_prompt_tokens,
                  deadline_unix_ms: int = 0) -> encoder_pb2.RangeStart:
            shift = res.cached_prompt_tokens - payload_start
            return encoder_pb2.RangeStart(
                request=encoder_pb2.EncodeRequest(room=secrets.randbits(62),
                                                  messages=chat_proto(chat),
                                                  deadline_unix_ms=deadline_unix_ms),
                payload_start=payload_start, first_media=rng.first_media, media=rng.media,
                first_token=rng.first_token + shift,
                end_token=rng.first_token + rng.tokens + shift)

        yield trio, rng, seen[0], start
    finally:
        trio.stop()


class RawRange:
    """The lead's side of an EncodeRange stream, by hand."""

    def __init__(self, address: str, start: encoder_pb2.RangeStart) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.requests: asyncio.Queue = asyncio.Queue()
        self.requests.put_nowait(encoder_pb2.EncodeRangeRequest(start=start))

        async def stream():
            while (msg := await self.requests.get()) is not None:
                yield msg

        self.call = encoder_pb2_grpc.EncoderStub(self.channel).EncodeRange(stream())

    async def until(self, kind: str) -> encoder_pb2.EncodeRangeResponse:
        """Messages up to the first of `kind` or `failed` (which it returns)."""
        while True:
            msg = await asyncio.wait_for(self.call.read(), HANG_GUARD_S)
            assert msg is not grpc.aio.EOF, f"the stream ended before {kind}"
            if msg.WhichOneof("msg") in (kind, "failed"):
                return msg

    async def __aenter__(self) -> RawRange:
        return self

    async def __aexit__(self, *exc) -> None:
        self.requests.put_nowait(None)
        self.call.cancel()
        await self.channel.close()


def test_the_helper_ends_a_range_at_the_request_deadline(helper_range):
    trio, _, _, start = helper_range

    async def never_write():
        deadline_ms = int((time.time() + 8) * 1000)
        async with RawRange(trio.helper, start(deadline_unix_ms=deadline_ms)) as raw:
            ready = await raw.until("ready")
            assert ready.WhichOneof("msg") == "ready", ready  # the deadline is after Ready
            # no RangeWrite, ever: the helper gives up at the deadline
            return await raw.until("failed")

    msg = trio.call(never_write())
    assert msg.failed.error.code == "DEADLINE_EXCEEDED", msg
    wait_until(trio.helper_load, until=lambda r: r.queued_requests == 0,
               timeout_s=HANG_GUARD_S, what="the helper's load back to 0")


def test_a_write_of_no_tokens_is_refused_invalid_argument(helper_range):
    trio, rng, write, start = helper_range

    async def empty_write():
        async with RawRange(trio.helper, start()) as raw:
            ready = await raw.until("ready")
            assert ready.WhichOneof("msg") == "ready", ready
            empty = encoder_pb2.RangeWrite()
            empty.CopyFrom(write)  # the real destination, total and delta: all in order
            empty.piece_start, empty.piece_tokens = rng.first_token, 0
            raw.requests.put_nowait(encoder_pb2.EncodeRangeRequest(write=empty))
            return await raw.until("failed")

    msg = trio.call(empty_write())
    assert msg.failed.error.code == "INVALID_ARGUMENT", msg


@pytest.mark.parametrize("where", ["before the prompt", "past the prompt"])
def test_a_payload_start_outside_the_prompt_is_refused_invalid_argument(helper_range, where):
    trio, rng, write, start = helper_range

    async def refused():
        bad = -1 if where == "before the prompt" else 10 * (write.total_tokens + rng.tokens)
        async with RawRange(trio.helper, start(payload_start=bad)) as raw:
            return await raw.until("failed")

    msg = trio.call(refused())
    assert msg.failed.error.code == "INVALID_ARGUMENT", msg
    wait_until(trio.helper_load, until=lambda r: r.queued_requests == 0,
               timeout_s=HANG_GUARD_S, what="the helper's load back to 0")


# ---- the lead's rule on one helper's messages (HelperRange over a scripted stream) --------

class _Call:
    """A scripted EncodeRange call: `read` returns the messages, then raises `end`."""

    def __init__(self, messages=(), end: Exception | None = None, done: bool = False) -> None:
        self.messages, self.end, self._done = list(messages), end, done

    async def read(self):
        if self.messages:
            return self.messages.pop(0)
        if self.end is not None:
            raise self.end
        return grpc.aio.EOF

    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        pass


def _helper(call: _Call, step: str):
    from tandem.services.encoder.split import HelperRange, HelperStep, Share

    class Channel:  # every method of the stub gives the scripted call
        def __getattr__(self, kind):
            return lambda *args, **kwargs: lambda *a, **k: call

    async def no_fall_back() -> None:  # never lost here: these write, they do not fall back
        raise AssertionError("fell back")

    h = HelperRange(Channel(), Share("h:1", 1, 2, 10, 40), encoder_pb2.RangeStart(), 5.0,
                    no_fall_back)
    h.ready, h.step = encoder_pb2.RangeReady(), HelperStep(step)
    return h


def _outcome(call: _Call, step: str, settled: bool = False) -> tuple[str, str, str]:
    """(exception type, code, culprit) of writing tokens [20, 40) of the range of a helper
    at `step`; `settled`: the lead reads the stream's end before the write (the helper
    failed while the lead was busy), else only once its RangeWrite is out."""
    from tandem.transfer.sender_room import RangeLost

    async def write():
        h = _helper(call, step)  # NOTE: in the loop: it reads its stream from the start
        while settled and h.ended is None:
            await asyncio.sleep(0)
        return await h.write(encoder_pb2.AttachInit(), 20, 20, 100, 0, lambda *a: None,
                             lambda: None)

    try:
        asyncio.run(write())
    except RangeLost:
        return ("RangeLost", "", "")
    except Exception as e:
        return (type(e).__name__, getattr(e, "code", ""), getattr(e, "culprit", ""))
    raise AssertionError("the write did not fail")


def _failed(code: str, nothing_in_flight: bool) -> encoder_pb2.EncodeRangeResponse:
    from tandem.v1 import common_pb2

    return encoder_pb2.EncodeRangeResponse(failed=encoder_pb2.AttachFailed(
        error=common_pb2.ErrorInfo(code=code, message="x"), nothing_in_flight=nothing_in_flight))


@pytest.mark.parametrize(("call", "want"), [
    # its stream ended since its last piece: nothing of it in flight
    (_Call(done=True), ("RangeLost", "", "")),
    # it refused the RangeWrite before any row went out (e.g. its protection minimum)
    (_Call([_failed("FAILED_PRECONDITION", True)]), ("RangeLost", "", "")),
    # it failed mid-write: the room's failure, naming it
    (_Call([_failed("INTERNAL", False)]), ("TransferError", "UNAVAILABLE", "h:1")),
    # the room's own integrity check: its code, no one blamed
    (_Call([_failed("DATA_LOSS", False)]), ("TransferError", "DATA_LOSS", "")),
    # the request's deadline, reported by the helper or by the call's own timeout: no blame
    (_Call([_failed("DEADLINE_EXCEEDED", False)]), ("TransferError", "DEADLINE_EXCEEDED", "")),
    (_Call(end=grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                    grpc.aio.Metadata(), "deadline")),
     ("TransferError", "DEADLINE_EXCEEDED", "")),
    # its stream broke mid-write: writes may be in flight
    (_Call(end=grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                    grpc.aio.Metadata(), "gone")),
     ("TransferError", "UNAVAILABLE", "h:1")),
], ids=["ended_between_pieces", "refused_before_any_row", "failed_mid_write", "data_loss",
        "deadline_reported", "deadline_of_the_call", "broken_mid_write"])
def test_the_leads_rule_for_a_helper_failing_at_its_next_piece(call, want):
    assert _outcome(call, "ready") == want


def test_a_helper_that_died_after_its_ready_is_lost_not_the_rooms_failure():
    """Its stream broke while the lead was busy with its own range (after the helper's
    Ready, before any RangeWrite): the lead has read that end by its piece, so nothing of
    the helper can be in flight and it re-encodes the range (before, it read the end only
    once its RangeWrite was out, and failed the room: tests/test_split.py's killed helper,
    now and then)."""
    broke = _Call(end=grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), "connection reset"))
    assert _outcome(broke, "ready", settled=True) == ("RangeLost", "", "")
