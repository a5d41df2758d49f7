"""Video bytes -> `PreparedVideo`: decoded with PyAV under limits, then sampled, resized and
patchified by transformers' rules for the checkpoint's architecture
(services/encoder/media/video_rules.py), bit for bit what its video processor makes
(tests/test_video_preprocess.py).

Two steps, both in the encoder's preprocessing pool, so that a video whose features the
encoder's cache (or the language side's prefix cache) already holds is never decoded:

    plan_source: bytes --probe: open (PyAV, allow-listed demuxers)--> VideoHeader: N frames,
                 rate r, W x H --limits on the header: bytes, frame count, duration N / r--
                 --plan_video: indices, target size, grid, timing, cache key (nothing
                 decoded yet); the token limit; the decode work (DecodeWork: pixels
                 decoded and sampled) against what the file's bytes buy--> PlannedVideo
    decode:      PlannedVideo --decode_frames: frames 0..last index, the sampled ones resized
                 as they come (uint8 bicubic, antialiased); limits on what really decodes:
                 frames, pixels, time (what the bytes buy, at most max_video_decode_s);
                 the request's budget between frames--
                 --normalize_and_patchify--> PreparedVideo: pixel_values [t * h * w,
                 3 * 2 * P * P], grid

`prepare_video` runs both. Frame count and rate are what transformers' PyAV loader reads
(`read_video_pyav`): the stream's frame count and average rate; where the header has no
count (WebM, Matroska) the packets are counted (one per frame). Rotation metadata is not
applied (transformers does not either).
"""

from __future__ import annotations

import hashlib
import io
import math
import time
from dataclasses import dataclass

import torch

from tandem.chat import VideoOptions
from tandem.services.encoder.media.images import Budget
from tandem.services.encoder.media.video_rules import (
    Sampling,
    VideoError,
    VideoHeader,
    VideoPlan,
    VideoRefusal,
    VideoSettings,
    normalize_and_patchify,
    plan_video,
    resize_frame,
)

# Demuxers FFmpeg may pick for an upload (matched against its names, e.g. "mov,mp4,..."):
# none that reads a playlist or another file (hls, concat, ...).
FORMATS = ("mov", "mp4", "matroska", "webm", "avi")


@dataclass(frozen=True)
class VideoLimits:
    """What one video may cost; each field is the encoder config field of the same name.
    Every bound holds against a lying header: the header is checked first (refusing
    early), then what actually decodes."""

    max_video_bytes: int = 64 * 1024 * 1024
    max_video_duration_s: float = 600.0  # N / r, transformers' VideoMetadata.duration
    max_video_frames: int = 18_000  # frames in the file (ten minutes at 30 per second)
    max_video_decoded_pixels: int = 4_000_000_000  # sum of W * H over every frame decoded
    max_video_decode_s: float = 60.0  # wall time of the decode loop, whatever its bytes
    max_video_tokens: int = 32_768  # vision tokens of the clip (t * h * w / merge**2)
    # what a file's bytes buy (services/encoder/config.py says how the defaults were chosen)
    video_decode_pixels_per_byte: int = 60_000  # DecodeWork.units per byte, before decoding
    video_decode_s_per_mib: float = 90.0  # decode CPU time per MiB (the decoding thread's)
    video_decode_min_bytes: int = 32 * 1024  # a smaller file is budgeted as this size

    def _paid_bytes(self, nbytes: int) -> int:
        return max(nbytes, self.video_decode_min_bytes)

    def work_allowed(self, nbytes: int) -> int:
        """The most `DecodeWork.units` a file of `nbytes` may cost."""
        return self._paid_bytes(nbytes) * self.video_decode_pixels_per_byte

    def cpu_allowed(self, nbytes: int) -> float:
        """The CPU seconds a file of `nbytes` may spend decoding (its bytes' budget; the
        wall clock's max_video_decode_s applies beside it)."""
        return self._paid_bytes(nbytes) / 2**20 * self.video_decode_s_per_mib


class DecodeClock:
    """The two clocks of one decode, checked after each frame:

    - the bytes' budget (`cpu_allowed`) in the decoding thread's CPU time: the decode runs
      on this thread alone (FFmpeg's thread_count is 1, frames given as images decode
      here), so other requests' load on the cores cannot push a client's file over what
      its bytes bought, while a file slower per pixel than its work says still stops;
    - max_video_decode_s in wall time: no decode holds a preprocessing worker longer,
      whatever its bytes and however loaded the machine."""

    def __init__(self, field: str, nbytes: int, lim: VideoLimits) -> None:
        self.field, self.nbytes, self.lim = field, nbytes, lim
        self.cpu_s = lim.cpu_allowed(nbytes)
        self.cpu0, self.wall0 = time.thread_time(), time.monotonic()

    def check(self) -> None:
        if time.thread_time() - self.cpu0 > self.cpu_s:
            raise over(self.field, VideoRefusal.DECODE_BUDGET,
                       f"decoding took more than the {self.cpu_s:.2f} s of CPU that "
                       f"{self.nbytes} bytes buy", self.lim.video_decode_s_per_mib)
        if time.monotonic() - self.wall0 > self.lim.max_video_decode_s:
            raise over(self.field, VideoRefusal.DECODE_TIME, "decoding took longer",
                       self.lim.max_video_decode_s)


# The cost of a sampled frame's pixel (RGB conversion, then the antialiased bicubic resize
# of the whole frame) relative to a decoded one's (the codec's work alone), measured on
# this project's CPUs: 4096x4096 15x (0.75 ns decode; 2.5 + 8.9 ns), 1920x1080 8x (0.6 ns;
# 1.0 + 3.9 ns). What a sampled frame weighs in `DecodeWork.units`.
SAMPLED_PIXEL_WEIGHT = 12


@dataclass(frozen=True)
class DecodeWork:
    """What decoding a planned video costs, known from its header and plan before any frame
    is decoded: every frame up to the last sampled one is decoded, each sampled frame is
    converted and resized at full size."""

    decoded_pixels: int  # (last sampled index + 1) * W * H
    sampled_pixels: int  # distinct sampled frames * W * H

    @classmethod
    def of(cls, header: VideoHeader, indices: tuple[int, ...] | list[int]) -> DecodeWork:
        frame = header.width * header.height
        return cls((max(indices) + 1) * frame, len(set(indices)) * frame)

    @property
    def units(self) -> int:
        """Pixel-equivalents of decode work (a decoded pixel = 1)."""
        return self.decoded_pixels + SAMPLED_PIXEL_WEIGHT * self.sampled_pixels


def check_work(work: DecodeWork, nbytes: int, field: str, lim: VideoLimits) -> None:
    """Refuse, before decoding, a video whose decode work is more than its bytes buy (a
    tiny file declaring huge frames: a decompression bomb)."""
    allowed = lim.work_allowed(nbytes)
    if work.units > allowed:
        raise over(field, VideoRefusal.DECODE_WORK,
                   f"decoding this video is {work.units} pixel-equivalents of work for "
                   f"{nbytes} bytes (at most {allowed})",
                   lim.video_decode_pixels_per_byte)


class _FromPlan:
    """What a video is to the ViT and the caches, read from its plan: the embedding cache
    key (`VideoPlan.cache_key`), the grid and the token count; the same before and after
    decoding."""

    plan: VideoPlan

    @property
    def key(self) -> str:
        return self.plan.cache_key

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.plan.grid

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens


@dataclass
class PlannedVideo(_FromPlan):
    """One probed video, not decoded: its file, what it will be, and under which rules.
    `key` is its embedding cache identity (equal keys: bit-identical pixel_values).
    A video given as frames (services/encoder/media/video_frames.py) has `frames`, each frame's
    image file in order, and an empty `raw`."""

    raw: bytes
    header: VideoHeader
    plan: VideoPlan
    settings: VideoSettings
    field: str
    plan_s: float = 0.0  # probe + plan
    frames: tuple[bytes, ...] = ()


@dataclass
class PreparedVideo(_FromPlan):
    """One video ready for the ViT: its plan, the patches, and what it cost."""

    hash: str  # sha256 hex of the file's bytes
    header: VideoHeader
    plan: VideoPlan
    pixel_values: torch.Tensor  # [t * h * w, C * temporal_patch_size * P * P] float32
    field: str
    frames_decoded: int = 0
    decode_s: float = 0.0  # open + decode + resize
    process_s: float = 0.0  # normalize + patchify

    @property
    def num_patches(self) -> int:
        t, h, w = self.plan.grid
        return t * h * w


def over(field: str, reason: VideoRefusal, what: str, limit) -> VideoError:
    """The refusal of a video over limit `reason`, naming the limit and its value."""
    return VideoError(field, reason, f"{what}, over the encoder's {reason.value} = {limit}")


# --- decoding -------------------------------------------------------------------------------


def _open(raw: bytes, field: str):
    import av

    try:
        container = av.open(io.BytesIO(raw), options={"format_whitelist": ",".join(FORMATS)})
    except Exception:  # av.error.*: not a container FFmpeg opens, or a refused demuxer
        raise VideoError(field, VideoRefusal.UNDECODABLE, _not_decodable()) from None
    if not container.streams.video:
        container.close()
        raise VideoError(field, VideoRefusal.UNDECODABLE, "file has no video stream")
    stream = container.streams.video[0]
    # NOTE: one decoding thread: a decode holds one worker of the preprocessing pool, never
    # more than that share of the CPU.
    stream.codec_context.thread_count = 1
    return container, stream


def probe(raw: bytes, field: str, lim: VideoLimits) -> VideoHeader:
    """The header of `raw`, refused when empty, undecodable or over a header-visible limit."""
    if not raw:
        raise VideoError(field, VideoRefusal.EMPTY, "video is empty (0 bytes)")
    if len(raw) > lim.max_video_bytes:
        raise over(field, VideoRefusal.BYTES, f"video is {len(raw)} bytes", lim.max_video_bytes)
    container, stream = _open(raw, field)
    try:
        rate = float(stream.average_rate or 0)
        n = stream.frames
        if n <= 0:  # no count in the header (WebM, Matroska): one packet per frame
            n = 0
            for packet in container.demux(stream):
                if packet.size:  # the demuxer ends with an empty flush packet
                    n += 1
                if n > lim.max_video_frames:
                    break
        header = VideoHeader(
            n, rate, stream.width, stream.height, container.format.name, stream.codec_context.name
        )
    except VideoError:
        raise
    except Exception:
        raise VideoError(field, VideoRefusal.CORRUPT, "video data is corrupt") from None
    finally:
        container.close()
    if header.num_frames == 0:
        raise VideoError(field, VideoRefusal.ZERO_DURATION, "video has no frames")
    if header.fps <= 0 or not math.isfinite(header.fps):
        raise VideoError(field, VideoRefusal.ZERO_DURATION, "video has no frame rate")
    if header.num_frames > lim.max_video_frames:
        raise over(
            field,
            VideoRefusal.FRAMES,
            f"video has {header.num_frames} frames",
            lim.max_video_frames,
        )
    if header.duration_s > lim.max_video_duration_s:
        raise over(
            field,
            VideoRefusal.DURATION,
            f"video is {header.duration_s:.1f} s long",
            lim.max_video_duration_s,
        )
    if header.width < 1 or header.height < 1:
        raise VideoError(field, VideoRefusal.UNDECODABLE, "video has no frame size")
    return header


def decode_frames(
    raw: bytes,
    header: VideoHeader,
    plan: VideoPlan,
    field: str,
    lim: VideoLimits,
    budget: Budget | None = None,
) -> tuple[torch.Tensor, int]:
    """Decode frames 0..plan.indices[-1]; return the sampled ones resized, [T, 3, h, w]
    uint8, and how many frames were decoded. Every frame decoded counts toward the limits;
    the request's budget is checked between frames (TimeoutError once it has ended)."""
    from av.video.reformatter import VideoReformatter

    budget = budget or Budget()
    last = plan.indices[-1]
    if header.width * header.height * (last + 1) > lim.max_video_decoded_pixels:
        raise over(
            field,
            VideoRefusal.DECODED_PIXELS,
            f"decoding {last + 1} frames of {header.width}x{header.height} pixels",
            lim.max_video_decoded_pixels,
        )
    slots: dict[int, list[int]] = {}
    for slot, i in enumerate(plan.indices):
        slots.setdefault(i, []).append(slot)
    out = torch.empty((len(plan.indices), 3, *plan.size), dtype=torch.uint8)
    # NOTE: the loop stops after the last sampled index (< N <= max_frames) and refuses a
    # frame whose size is not the header's, so what it decodes is what was checked above;
    # the running pixel sum bounds it without relying on that reasoning.
    clock = DecodeClock(field, len(raw), lim)
    container, stream = _open(raw, field)
    pixels, decoded = 0, 0
    # NOTE: one reformatter for the clip: frame.to_ndarray(format=...) makes one per frame,
    # and with it a swscale context (about a third of a 30 s clip's decode time here);
    # the same conversion, so the same bytes (tests/test_video_preprocess.py).
    rgb24 = VideoReformatter()
    try:
        for frame in container.decode(stream):
            budget.check()
            pixels += frame.width * frame.height
            if pixels > lim.max_video_decoded_pixels:
                raise over(
                    field,
                    VideoRefusal.DECODED_PIXELS,
                    f"video decodes to {pixels} pixels or more",
                    lim.max_video_decoded_pixels,
                )
            if (frame.height, frame.width) != (header.height, header.width):
                raise VideoError(
                    field,
                    VideoRefusal.UNSUPPORTED,
                    f"frame {decoded} is {frame.width}x{frame.height}, the stream "
                    f"{header.width}x{header.height}",
                )
            if decoded in slots:
                # the same conversion as transformers' read_video_pyav (to_ndarray(format=
                # "rgb24"): its frame's reformatter, with these defaults)
                rgb = rgb24.reformat(frame, format="rgb24").to_ndarray()
                resized = resize_frame(rgb, plan.size)
                for slot in slots[decoded]:
                    out[slot] = resized
            decoded += 1
            clock.check()
            if decoded > last:
                break
    except (VideoError, TimeoutError):
        raise
    except Exception as e:  # av.error.*: broken packets
        raise VideoError(field, VideoRefusal.CORRUPT, f"video data is corrupt ({e})") from None
    finally:
        container.close()
    if decoded <= last:
        raise VideoError(
            field, VideoRefusal.CORRUPT, f"video ends after {decoded} of {header.num_frames} frames"
        )
    return out, decoded


def plan_source(
    raw: bytes,
    settings: VideoSettings,
    options: VideoOptions | None = None,
    limits: VideoLimits | None = None,
    field: str = "video",
) -> PlannedVideo:
    """Bytes -> `PlannedVideo`: probe, plan, the token limit; nothing decoded."""
    lim = limits or VideoLimits()
    smp = Sampling.resolve(settings, options or VideoOptions(), field)
    t0 = time.perf_counter()
    header = probe(raw, field, lim)
    plan = plan_video(header, smp, hashlib.sha256(raw).hexdigest(), field)
    if plan.num_tokens > lim.max_video_tokens:
        raise over(
            field, VideoRefusal.TOKENS, f"video is {plan.num_tokens} tokens", lim.max_video_tokens
        )
    check_work(DecodeWork.of(header, plan.indices), len(raw), field, lim)
    return PlannedVideo(raw, header, plan, settings, field, time.perf_counter() - t0)


def decode(
    video: PlannedVideo, limits: VideoLimits | None = None, budget: Budget | None = None
) -> PreparedVideo:
    """`PlannedVideo` -> `PreparedVideo`: decode the sampled frames, normalize, patchify."""
    lim = limits or VideoLimits()
    t0 = time.perf_counter()
    frames, decoded = decode_frames(video.raw, video.header, video.plan, video.field, lim, budget)
    t1 = time.perf_counter()
    pixel_values = normalize_and_patchify(frames, video.settings)
    return PreparedVideo(hashlib.sha256(video.raw).hexdigest(), video.header, video.plan,
                         pixel_values, video.field, decoded, video.plan_s + t1 - t0,
                         time.perf_counter() - t1)


def prepare_video(
    raw: bytes,
    settings: VideoSettings,
    options: VideoOptions | None = None,
    limits: VideoLimits | None = None,
    field: str = "video",
    budget: Budget | None = None,
) -> PreparedVideo:
    """Bytes -> `PreparedVideo`: probe, plan, decode, normalize, patchify (see the module)."""
    return decode(plan_source(raw, settings, options, limits, field), limits, budget)


def _not_decodable() -> str:
    return f"not a decodable video ({', '.join(FORMATS)})"
