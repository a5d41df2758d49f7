"""One prompt's media split across encoders (docs/architecture.md, "Streamed rows"; issue 27 step 3).

The encoder the router sent `Encode` to is the room's *lead*: it owns the Attach stream
(Init, Prompt/Cached, Progress, Resume, Done), renders and preprocesses the chat, and
decides the split. The router names candidate *helpers* (EncodeRequest.helpers, by
load); the lead gives each a contiguous run of the prompt's units (images, and temporal
groups of videos: units.py) and the payload rows from the first pad of that run up to the
next run's (`plan_split`): the token range alone says which units are whose. A helper renders the
same chat itself (the same token ids, grids and positions: they come from the chat
alone), runs the ViT for its media only and writes its rows straight into the language
instance's blocks; the lead's sender makes each range a piece of its own (services the
language side cannot tell from a Resume: Progress, partial Progress, Resume), forwards the
helper's chunk reports as its own Progress, and the helper's heartbeats as AttachWorking.

    lead                                   helper (EncodeRange stream, HelperRange)
    preprocess, announce, cache lookups
    plan_split ─── RangeStart(chat, media [a, b), tokens [t0, t1)) ──▶ preprocess, ViT of
    ViT of its own media                                               [a, b)  (Working…)
    write its range, partial Progress                   ◀── Ready
    Resume(blocks) ─▶ RangeWrite(blocks, piece) ───────────────────▶ write rows
    Progress(chunk) ◀─ forwarded ◀──────────────── RangeWritten(end, tags) per chunk
    Done (or the next range)

Rules (all here):
- A split happens only with at least 2 units the ViT must run (embedding-cache misses of
  the lead, past the language side's cached prefix: two images, or one video of two
  temporal groups) and a helper; at most one range per encoder; the lead keeps the first
  range (its rows reach the language side first), ranges are balanced by the lead's
  uncached patches (cache hits weigh nothing) and cut only where a unit the ViT must run
  starts (weight > 0), so every share has ViT work: a helper is never sent units the lead
  holds cached and nothing else (weightless units join the share before them).
- Rows of a range depend only on its units and the chat (text embeddings, ids,
  positions): no writer needs another's.
- Every range is its own piece (its own blocks, aux rows and tags), so no block is
  written by two writers.
- A helper's RangeWrite goes out only after its Ready (`HelperRange` reads the helper's
  stream as it comes, so a failure is judged at the step the lead was at when it came,
  however busy the lead was then), so whether it may have written is known: a helper
  failure of any kind (a failed message of any code, its stream broken or ended) before
  the lead sent it a RangeWrite, or after it reported a piece's last chunk and before
  the next RangeWrite, leaves nothing of it in flight: the helper is lost (RangeLost) and
  the lead re-encodes its range, from the helper's last reported chunk (the rows before
  it stay). A failure while a RangeWrite is outstanding (sent, its end not reported:
  the helper's Mooncake writes may still be in flight) fails the room: UNAVAILABLE
  naming the helper as the culprit (the router retries the request elsewhere, and the
  new attempt's generation fences any late write), unless the helper says nothing of it
  is in flight (AttachFailed.nothing_in_flight: it refused the RangeWrite before any row
  went out, e.g. the room is protected less than its own minimum, or the destination
  does not fit it: lost, as above); a DATA_LOSS it reports (the room's own integrity)
  and the request's deadline keep their codes and blame no one.
  A helper that stalls (no message within the transfer timeout; it heartbeats while in
  the ViT) is one more failure under the same rule: lost while it holds no destination
  (the lead re-encodes; a frozen helper that wakes has nothing to write into), else the
  room fails (UNAVAILABLE, culprit): a helper frozen mid-write may wake and write, and
  only a new attempt's generation fences its stale rows.
- Both ends bound the range by the request's deadline: the lead's EncodeRange call
  carries it as its timeout, the helper ends the stream at it (DEADLINE_EXCEEDED).
- While the lead re-encodes a lost helper's range its Attach stream carries heartbeats
  (AttachWorking), as while rows are in its own ViT.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from tandem.chat import ChatError
from tandem.services.encoder.preprocess import PreparedImage
from tandem.services.encoder.units import Unit
from tandem.transfer.buffers import RangeTag
from tandem.transfer.errors import TransferError
from tandem.transfer.sender_room import RangeLost, RemoteRange
from tandem.v1 import encoder_pb2, encoder_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Share:
    """One writer's part of a split prompt: payload tokens [first_token, end_token) and the
    units whose first pad lies there, units [first_unit, end_unit) of the plan's list, of
    media [first_media, end_media) (a video may be in two shares); `helper` "" for the
    lead."""

    helper: str
    first_unit: int
    end_unit: int
    first_token: int
    end_token: int
    first_media: int = 0
    end_media: int = 0


def plan_split(starts: list[int], weights: list[int], payload_start: int, total: int,
               helpers: list[str]) -> list[Share]:
    """The writers of a prompt, in prompt order (empty: no split).

    `starts[u]`: unit u's first pad token (prompt index; units in prompt order);
    `weights[u]`: its patches the lead would run through the ViT (0: cached);
    `payload_start`: the language side's cached prefix (the payload's token 0); `total`:
    payload tokens. Units that start inside the cached prefix stay with the lead. A cut
    falls only before a unit of weight > 0: weightless units stay in the share before
    them, so every share holds ViT work. The caller fills each share's media
    (`with_media`).
    """
    movable = [i for i, s in enumerate(starts) if s > payload_start]
    work = sum(weights)
    if not helpers or work == 0 or sum(1 for w in weights if w) < 2 or not movable:
        return []
    n = min(len(helpers) + 1, sum(1 for w in weights if w))
    # cut before the medium where the running work first passes k/n of the whole
    cuts, run, k = [], 0, 1
    for i in range(len(starts)):
        if k < n and weights[i] > 0 and i in movable and run >= work * k / n:
            cuts.append(i)
            k += 1
        run += weights[i]
    if not cuts or not any(weights[j] for j in range(cuts[0])):
        return []  # the lead's range would hold no ViT work: the split buys nothing
    bounds = [0, *cuts, len(starts)]
    owners = ["", *helpers[: len(cuts)]]
    out = []
    for j, owner in enumerate(owners):
        a, b = bounds[j], bounds[j + 1]
        t0 = 0 if j == 0 else starts[a] - payload_start
        t1 = total if j == len(owners) - 1 else starts[b] - payload_start
        out.append(Share(owner, a, b, t0, t1))
    return out


def with_media(shares: list[Share], units: list) -> list[Share]:
    """Each share with the media its units are of (units.Unit, the plan's list)."""
    return [dataclasses.replace(s, first_media=units[s.first_unit].medium,
                                end_media=units[s.end_unit - 1].medium + 1) for s in shares]


def units_in(units: list, payload_start: int, first_token: int, end_token: int) -> list:
    """The units whose first pad lies in payload tokens [first_token, end_token)."""
    return [u for u in units if first_token <= u.first_pad - payload_start < end_token]


@dataclass(frozen=True)
class HelperStart:
    """What a helper of one share is sent beside the chat (RangeStart): the payload's
    first prompt token (the language side's cached prefix), the grids of the images
    outside the share, prompt order (so it need not fetch them), the share's media's cache
    keys (which it checks its own against) and the bytes of the share's images that came
    from http(s) URLs, by media index (so it takes them instead of fetching again)."""

    payload_start: int
    grids: list[tuple[int, int, int]]
    keys: list[str]
    fetched: dict[int, bytes]


# the lead's re-encoding of a lost helper's range into its own payload (the pipeline's)
FallBack = Callable[[], Awaitable[None]]


class HelperOpener(Protocol):
    """Opens one helper's range (the servicer's: it starts the helper's work at once);
    `fall_back` puts the range's rows into the lead's payload if the helper is lost."""

    def __call__(self, share: Share, start: HelperStart, fall_back: FallBack) -> HelperRange: ...


class SplitRole(Protocol):
    """What one Encode is in a split prompt, and what that changes in the pipeline: a
    prompt encoded alone (`Alone`), the lead that may split it (`Lead`), or a helper's
    share of another encoder's prompt (`MediaPart`). The pipeline asks its role at each
    step where they differ; the role holds no per-request state of the pipeline. Its
    methods' bodies here are a prompt encoded alone (the roles subclass it)."""

    def pixels_for(self) -> range | None:
        """The media whose pixels this encoder prepares (None: all)."""
        return None

    def other_grids(self) -> tuple[tuple[int, int, int], ...] | None:
        """The grids of the images it does not prepare, from the lead (None: read them)."""
        return None

    def keeps_fetched(self) -> bool:
        """Whether preprocessing keeps the bytes URLs answered (for helpers)."""
        return False

    def payload_start(self) -> int | None:
        """The payload's first prompt token when fixed by the lead (None: the prompt is
        announced and the language side answers)."""
        return None

    def own_units(self, every: list[Unit], prompt_tokens: int,
                  media: list) -> set[tuple[int, int]] | None:
        """The (medium, group) units this encoder writes, checked against its rendering
        (None: every unit)."""
        return None

    def plan(self, every: list[Unit], weights: list[int], cached: int,
             prompt_tokens: int) -> list[Share]:
        """The writers of the prompt, prompt order (empty: no split)."""
        return []

    def open(self, share: Share, start: HelperStart, fall_back: FallBack) -> HelperRange:
        raise TypeError(f"{type(self).__name__} opens no helper")


class Alone(SplitRole):
    """A prompt this encoder encodes whole, no helper."""


ALONE = Alone()


class Lead(SplitRole):
    """The lead of a prompt it may split across `helpers` (names, by load), each share
    opened with `opener`."""

    def __init__(self, helpers: list[str], opener: HelperOpener) -> None:
        if not helpers:
            raise ValueError("a lead needs helpers (no helper: Alone)")
        self.helpers, self._opener = list(helpers), opener

    def keeps_fetched(self) -> bool:
        return True

    def plan(self, every: list[Unit], weights: list[int], cached: int,
             prompt_tokens: int) -> list[Share]:
        return with_media(plan_split([u.first_pad for u in every], weights, cached,
                                     prompt_tokens - cached, self.helpers), every)

    def open(self, share: Share, start: HelperStart, fall_back: FallBack) -> HelperRange:
        return self._opener(share, start, fall_back)


@dataclass(frozen=True)
class MediaPart(SplitRole):
    """A helper's share of another encoder's prompt (EncodeRange): media [first_media,
    end_media) into payload tokens [first_token, end_token), the payload starting at
    prompt token `payload_start` (the language side's cached prefix); `other_grids`: the
    lead's grids of the chat's images outside the share, prompt order (RangeStart's
    image_grids: those images are not fetched; None: a lead that sent none, their headers
    are read). No announce, only these media's images prepared and run, the other images
    grid-only, the payload's other rows left zero, no PromptInfo."""

    start: int
    first_media: int
    end_media: int
    first_token: int
    end_token: int
    grids: tuple[tuple[int, int, int], ...] | None = None
    # the lead's cache keys of media [first_media, end_media) (RangeStart.media_keys; ():
    # a lead from before them, not checked)
    keys: tuple[str, ...] = ()

    def pixels_for(self) -> range:
        return range(self.first_media, self.end_media)

    def other_grids(self) -> tuple[tuple[int, int, int], ...] | None:
        return self.grids

    def payload_start(self) -> int:
        return self.start

    def own_units(self, every: list[Unit], prompt_tokens: int,
                  media: list) -> set[tuple[int, int]]:
        self._check_range(every, prompt_tokens)
        self._check_keys(media)
        return {(u.medium, u.g0)
                for u in units_in(every, self.start, self.first_token, self.end_token)}

    def _check_range(self, every: list[Unit], prompt_tokens: int) -> None:
        """A helper's own rendering of the chat must put the lead's share where the lead
        said (the same chat, template and processor): its edges where units start, at
        least one unit in it, its units of media [first_media, end_media) from the first
        to the last (the media it prepared). A mismatch is a misconfigured tier."""
        if not 0 <= self.start < prompt_tokens:
            raise ChatError(f"range: payload_start {self.start} is outside the prompt's "
                            f"{prompt_tokens} tokens", "range")
        total = prompt_tokens - self.start
        starts = {u.first_pad - self.start for u in every}
        ok = (0 < self.first_token < self.end_token <= total and self.first_token in starts
              and (self.end_token == total or self.end_token in starts))
        if not ok:
            raise ChatError(f"range: tokens [{self.first_token}, {self.end_token}) of {total} "
                            f"do not start and end where this encoder's units (images, video "
                            f"groups) start", "range")
        media = [u.medium for u in units_in(every, self.start, self.first_token,
                                            self.end_token)]
        if (media[0], media[-1] + 1) != (self.first_media, self.end_media):
            raise ChatError(f"range: tokens [{self.first_token}, {self.end_token}) hold media "
                            f"[{media[0]}, {media[-1] + 1}) here, not [{self.first_media}, "
                            f"{self.end_media})", "range")

    def _check_keys(self, media: list) -> None:
        """A helper's media of its share must be the lead's (the same cache keys): a URL is
        fetched again here and may answer differently (a signed URL expired, a random-image
        endpoint); their rows would then go out under the key the lead announced, and the
        language side's prefix cache would serve them to another chat. ABORTED: this range
        only (the lead encodes it itself)."""
        if not self.keys:
            return
        mine = [m.key for m in media[self.first_media:self.end_media]]
        if len(self.keys) != len(mine):
            raise ChatError(f"media_keys: {len(self.keys)} keys for the range's {len(mine)} "
                            "media", "media_keys")
        for i, (theirs, ours) in enumerate(zip(self.keys, mine, strict=True)):
            if theirs != ours:
                raise ChatError(f"medium {self.first_media + i}: its content here differs "
                                "from the lead's (a URL that answered differently)",
                                "media_keys", "ABORTED")


def grids_outside(media: list, first_media: int, end_media: int) -> list[tuple[int, int, int]]:
    """The grids of the images outside media [first_media, end_media), prompt order: what a
    helper of that share is sent (RangeStart.image_grids; Preprocessor's `other_grids`)."""
    return [m.grid for k, m in enumerate(media)
            if isinstance(m, PreparedImage) and not first_media <= k < end_media]


def helper_start(media: list, share: Share, payload_start: int) -> HelperStart:
    """What the helper of `share` is sent, from the lead's prepared media."""
    mine = media[share.first_media:share.end_media]
    return HelperStart(payload_start, grids_outside(media, share.first_media, share.end_media),
                       [m.key for m in mine],
                       {k: m.fetched for k, m in enumerate(mine, share.first_media)
                        if isinstance(m, PreparedImage) and m.fetched})


class HelperStep(enum.Enum):
    """Where one helper's range is, as the lead sees it: whether the helper may be writing
    into the room's blocks now (the module docstring's rule for fall back or fail)."""

    PREPARING = "preparing"  # RangeStart sent; its Ready not read yet: nothing written
    READY = "ready"  # its rows are final; no RangeWrite outstanding: nothing in flight
    WRITING = "writing"  # a RangeWrite sent and its end not reported: writes may be in flight
    FINISHED = "finished"  # the range's last piece written: the stream ends cleanly


class HelperRange:
    """The lead's side of one helper's EncodeRange stream: started at once (the helper
    preprocesses and runs its ViT while the lead runs its own), then one RangeWrite per
    piece (`write`: it is the sender's RangeWriter), each only after the helper's Ready.
    `fall_back` (the pipeline's, given at opening) puts the range's rows into the lead's
    payload when the helper is lost. The call is bounded by the request's deadline (`start.request`'s,
    which the lead sets)."""

    def __init__(self, channel: grpc.aio.Channel, share: Share, start: encoder_pb2.RangeStart,
                 timeout_s: float, fall_back: FallBack, metadata: tuple = ()) -> None:
        self.share, self.timeout_s, self._fall_back_to = share, timeout_s, fall_back
        self.step = HelperStep.PREPARING
        stub = encoder_pb2_grpc.EncoderStub(channel)
        self._requests: asyncio.Queue = asyncio.Queue()
        self._requests.put_nowait(encoder_pb2.EncodeRangeRequest(start=start))
        ms = start.request.deadline_unix_ms
        self._call = stub.EncodeRange(self._stream(), metadata=metadata, timeout=max(
            0.0, ms / 1000 - time.time()) if ms else None)
        self.ready: encoder_pb2.RangeReady | None = None
        # The helper's messages as they come, its end (a failure, judged at the step the
        # lead was at when it came) last: `ended` is known before the next RangeWrite goes
        # out, however long the lead was busy since (read at its piece, a helper that died
        # after its Ready looked alive until the RangeWrite was out, and failed the room)
        self._inbox: asyncio.Queue = asyncio.Queue()
        self.ended: Exception | None = None
        self._reader = asyncio.ensure_future(self._read_all())

    async def _stream(self):
        while True:
            msg = await self._requests.get()
            if msg is None:
                return
            yield msg

    def remote(self) -> RemoteRange:
        s = self.share
        return RemoteRange(s.first_token, s.end_token, s.helper, self)

    async def fall_back(self) -> None:
        self.close()
        await self._fall_back_to()

    def close(self) -> None:
        """End the stream: cleanly (done writing) once the whole range is written, else
        cancelled (the helper stops)."""
        self._requests.put_nowait(None)
        if self.step is not HelperStep.FINISHED:
            self._call.cancel()
            self._reader.cancel()

    def _failed(self, why: str, code: str = "", nothing_in_flight: bool = False) -> Exception:
        """The helper's failure (`code`: the one it reported, "" for a broken or ended
        stream; `nothing_in_flight`: it says none of its writes can still land), as the
        module docstring's rule has it: RangeLost while nothing of it can be in flight,
        else the room's failure."""
        if self.step is not HelperStep.WRITING or nothing_in_flight:
            return RangeLost(f"{code or 'stream'}: {why}")
        # the room's own integrity check, the request's deadline: their codes, no one blamed
        if code in ("DATA_LOSS", "DEADLINE_EXCEEDED"):
            return TransferError(f"helper {self.share.helper}: {why}", code)
        return TransferError(f"helper {self.share.helper} failed while writing its range "
                             f"({code or 'stream'}: {why})", "UNAVAILABLE",
                             culprit=self.share.helper)

    async def _read_all(self) -> None:
        """Every message into the inbox until the stream's end, which becomes `ended`
        (`_failed` says what a failure is) and the inbox's last item."""
        try:
            while True:
                msg = await self._call.read()
                if msg is grpc.aio.EOF:
                    end = self._failed("the stream ended")
                elif msg.WhichOneof("msg") == "failed":
                    f = msg.failed
                    end = self._failed(f.error.message, f.error.code, f.nothing_in_flight)
                else:
                    self._inbox.put_nowait(msg)
                    continue
                break
        except grpc.aio.AioRpcError as e:
            deadline = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # the call's timeout
            end = self._failed(f"{e.code().name}: {e.details()}",
                               "DEADLINE_EXCEEDED" if deadline else "")
        except Exception as e:  # noqa: BLE001  (the stream is unreadable: its end all the same)
            end = self._failed(f"reading its stream: {e!r}")
        self.ended = end
        self._inbox.put_nowait(end)

    async def _next(self, what: str) -> encoder_pb2.EncodeRangeResponse:
        """The helper's next message that is not a failure (its end is raised). Silent
        for the transfer timeout (frozen: it heartbeats while in its ViT) is a failure too:
        RangeLost while it has no RangeWrite outstanding (it holds no destination, so
        nothing of it can land: the lead re-encodes, the request goes on), else
        TransferError UNAVAILABLE naming it (the room fails; the router's retry fences its
        late writes)."""
        try:
            item = await asyncio.wait_for(self._inbox.get(), self.timeout_s)
        except asyncio.TimeoutError:
            raise self._failed(f"silent for {self.timeout_s:.1f}s while {what}") from None
        if isinstance(item, Exception):
            raise item
        return item

    async def write(self, init: encoder_pb2.AttachInit, start: int, piece: int, total: int,
                    delta: int, on_chunk: Callable[[int, RangeTag | None], None],
                    on_working: Callable[[], None]) -> int:
        end = start + piece
        while self.ready is None:  # NOTE: no RangeWrite before Ready (the docstring's rule)
            msg = await self._next("preparing its range")
            kind = msg.WhichOneof("msg")
            if kind == "working":
                on_working()
            elif kind == "ready":
                self.ready = msg.ready
                self.step = HelperStep.READY
            else:
                raise self._failed(f"sent {kind} before Ready", "INTERNAL")
        # it ended since its last piece (or its Ready): nothing of it in flight (`ended`
        # comes from the reader task, which may not have seen the call's end yet)
        if self.ended is not None or self._call.done():
            raise RangeLost(f"its stream ended before this piece ({self.ended or 'done'})")
        self.step = HelperStep.WRITING
        self._requests.put_nowait(encoder_pb2.EncodeRangeRequest(write=encoder_pb2.RangeWrite(
            destination=init, piece_start=start, piece_tokens=piece, total_tokens=total,
            mrope_position_delta=delta)))
        while True:
            msg = await self._next(f"writing tokens {start}..{end}")
            kind = msg.WhichOneof("msg")
            if kind == "working":
                on_working()
            elif kind == "written":
                w = msg.written
                on_chunk(w.sent_tokens, RangeTag.from_proto(w.tag) if w.HasField("tag")
                         else None)
                if w.sent_tokens == end:  # its writes all ended before it said so
                    self.step = (HelperStep.FINISHED if end == self.share.end_token
                                 else HelperStep.READY)
                    return 0  # NOTE: the helper's bytes, counted in its own metrics
            else:
                raise self._failed(f"sent {kind} while writing", "INTERNAL")


