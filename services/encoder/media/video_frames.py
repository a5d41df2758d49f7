"""A video given as its frames (qwen-vl-utils' list-of-images `video`, the wire's
`VideoFrames`) -> `PlannedVideo` -> `PreparedVideo`: bit for bit what transformers' video
processor makes of the same frames, `processor(videos=[[frame, ...]], video_metadata=[{
"total_num_frames": n, "fps": fps, "frames_indices": range(n)}], do_sample_frames=False)`
(tests/test_video_preprocess.py). Both steps run in the encoder's preprocessing pool, as a
file's do (services/encoder/media/video.py), so a video a cache holds is never decoded:

    plan_frames_source: the controls (fps required, nothing sampled: video_rules.
                 Sampling.resolve_frames) --limits on the count: max_video_frames,
                 max_video_duration_s (n / fps)-- each frame read as an image part is (bytes,
                 data URL or allow-listed URL; max_image_bytes, formats, max_source_pixels)
                 and its header opened, not decoded --the frames' bytes summed
                 (max_video_bytes), all one size, n * W * H (max_video_decoded_pixels)--
                 --video_rules.plan_frames: every frame, target size, grid, timing, cache
                 key; max_video_tokens--> PlannedVideo (with `frames`)
    decode_frames: each frame decoded to RGB as an image part is, resized as a file's
                 frames are (uint8 bicubic, antialiased), the decode-time limit and the
                 request's budget between frames --normalize_and_patchify--> PreparedVideo

The frames' bytes together buy their decode work and time as a file's bytes do
(`VideoLimits.work_allowed`, `DecodeClock`).

A frame is converted to RGB as an image part is (`images.to_rgb`): for RGB frames
(JPEG, RGB PNG) that is the array transformers takes from the same PIL image.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import torch

from tandem.chat import ImageInput, VideoOptions
from tandem.services.encoder.media.images import (
    Budget,
    ImageLimits,
    decode_image,
    image_bytes,
    open_image,
)
from tandem.services.encoder.media.video import (
    DecodeClock,
    DecodeWork,
    PlannedVideo,
    PreparedVideo,
    VideoLimits,
    check_work,
    over,
)
from tandem.services.encoder.media.video_rules import (
    Sampling,
    VideoError,
    VideoHeader,
    VideoRefusal,
    VideoSettings,
    normalize_and_patchify,
    plan_frames,
    resize_frame,
)

FORMAT = "frames"  # VideoHeader.format of a video given as frames


def plan_frames_source(
    frames: tuple[ImageInput, ...],
    settings: VideoSettings,
    options: VideoOptions | None,
    limits: VideoLimits,
    image: ImageLimits,
    field: str = "video.frames",
    budget: Budget | None = None,
) -> PlannedVideo:
    """The frames -> `PlannedVideo`: read, headers checked, planned; nothing decoded.
    Refusals name `field` (the whole video) or `field[k]` (frame k)."""
    budget = budget or Budget()
    t0 = time.perf_counter()
    smp = Sampling.resolve_frames(settings, options or VideoOptions(), field)
    n = len(frames)
    if n == 0:
        raise VideoError(field, VideoRefusal.EMPTY, "a video given as frames has no frame")
    if n > limits.max_video_frames:
        raise over(field, VideoRefusal.FRAMES, f"video has {n} frames", limits.max_video_frames)
    if n / smp.fps > limits.max_video_duration_s:
        raise over(field, VideoRefusal.DURATION,
                   f"video is {n / smp.fps:.1f} s long ({n} frames at fps {smp.fps:g})",
                   limits.max_video_duration_s)
    raws: list[bytes] = []
    total, size, formats = 0, None, set()
    for k, frame in enumerate(frames):
        budget.check()
        where = f"{field}[{k}]"
        raw = image_bytes(frame, where, image, budget)
        total += len(raw)
        if total > limits.max_video_bytes:
            raise over(field, VideoRefusal.BYTES, f"the frames are {total} bytes or more",
                       limits.max_video_bytes)
        img = open_image(raw, where, image)
        size = size or img.size
        if img.size != size:
            raise VideoError(where, VideoRefusal.UNSUPPORTED,
                             f"frame {k} is {img.size[0]}x{img.size[1]}, frame 0 "
                             f"{size[0]}x{size[1]}: a video's frames are one size")
        formats.add(img.format)
        raws.append(raw)
    w, h = size
    if n * w * h > limits.max_video_decoded_pixels:
        raise over(field, VideoRefusal.DECODED_PIXELS, f"{n} frames of {w}x{h} pixels",
                   limits.max_video_decoded_pixels)
    header = VideoHeader(n, smp.fps, w, h, FORMAT, "/".join(sorted(formats)))
    plan = plan_frames(header, smp, content_hash(raws), field)
    if plan.num_tokens > limits.max_video_tokens:
        raise over(field, VideoRefusal.TOKENS, f"video is {plan.num_tokens} tokens",
                   limits.max_video_tokens)
    check_work(DecodeWork.of(header, plan.indices), total, field, limits)
    return PlannedVideo(b"", header, plan, settings, field, time.perf_counter() - t0,
                        tuple(raws))


def decode_frames(
    video: PlannedVideo, limits: VideoLimits, image: ImageLimits, budget: Budget | None = None
) -> PreparedVideo:
    """A planned video given as frames -> `PreparedVideo`: every frame decoded (RGB), resized
    to the plan's size, then normalized and patchified as a file's frames are."""
    budget = budget or Budget()
    header, plan = video.header, video.plan
    t0 = time.perf_counter()
    out = torch.empty((len(video.frames), 3, *plan.size), dtype=torch.uint8)
    clock = DecodeClock(video.field, sum(len(raw) for raw in video.frames), limits)
    for k, raw in enumerate(video.frames):
        budget.check()
        rgb = decode_image(raw, f"{video.field}[{k}]", image)
        # NOTE: the plan checked every header's size; a decoded frame has its header's size
        assert rgb.size == (header.width, header.height), (rgb.size, header)
        out[k] = resize_frame(np.array(rgb), plan.size)  # np.array: what transformers takes
        clock.check()
    t1 = time.perf_counter()
    pixel_values = normalize_and_patchify(out, video.settings)
    return PreparedVideo(content_hash(video.frames), header, plan, pixel_values, video.field,
                         len(video.frames), video.plan_s + t1 - t0,
                         time.perf_counter() - t1)


def content_hash(frames) -> str:
    """sha256 over each frame's sha256, in order: the frames' identity."""
    h = hashlib.sha256(FORMAT.encode())
    for raw in frames:
        h.update(hashlib.sha256(raw).digest())
    return h.hexdigest()
