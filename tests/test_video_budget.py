"""A video's decode is bounded by what its bytes buy (issue 41, point 4).

Both videos are made here with PyAV (libx264 mp4s), and read under the encoder's default
limits (EncoderConfig's fields of VideoLimits' names):

- the bomb: 58 KB declaring 4096x4096 x 230 black frames. Its header passes the pixel
  cap (3.86e9 < 4e9) and it decoded for max_video_decode_s before; now its decode work
  (125,000 pixel-equivalents per byte) is refused from the header and plan, before a frame
  is decoded, naming the limit.
- slide decks as a talk records them: 1080p at 2 fps, a new slide every 15 s, and one slide
  shown throughout (x264's default preset, the most compressible case measured), sampled
  at 0.5 fps. Served: their work per byte is far below the bomb's, and their decode ends
  inside the time their bytes buy. One and two minutes stand for ten: the work grows with
  the frames, the bytes with the slides and key frames, so the ratios do not depend on the
  length (the measurements in services/encoder/config.py).
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest

from tandem.chat import VideoOptions
from tandem.services.encoder.config import EncoderConfig
from tandem.services.encoder.media.video import (
    DecodeWork,
    VideoLimits,
    decode,
    plan_source,
    prepare_video,
)
from tandem.services.encoder.media.video_rules import VideoError, VideoRefusal, VideoSettings

SETTINGS = dataclasses.replace(VideoSettings.defaults("qwen2_vl"), fps=2.0)
# the sampling a ten-minute deck needs to fit max_video_tokens
SLIDES_SAMPLING = VideoOptions(fps=0.5, max_pixels=128 * 28 * 28)


def default_limits(**changes) -> VideoLimits:
    """VideoLimits as the encoder builds them from its config's defaults."""
    fields = {f.name: EncoderConfig.model_fields[f.name].default
              for f in dataclasses.fields(VideoLimits)}
    return VideoLimits(**{**fields, **changes})


def _mp4(width: int, height: int, frames, fps: int, preset: str) -> bytes:
    """An H.264 mp4 of `frames` (yuv420p VideoFrames, one per frame; the same object may
    repeat)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": preset, "crf": "23"}
        for i, frame in enumerate(frames):
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def _black(size: int):
    import av

    frame = av.VideoFrame(size, size, "yuv420p")
    for plane, value in zip(frame.planes, (16, 128, 128), strict=True):
        plane.update(np.full(plane.buffer_size, value, np.uint8).tobytes())
    return frame


def _slide(seed: int, width: int = 1920, height: int = 1080):
    """A slide: a coloured title bar over rows of dark word-like blocks on white."""
    import av

    rng = np.random.default_rng(seed)
    img = np.full((height, width, 3), 250, np.uint8)
    img[:120] = rng.integers(0, 255, 3)
    for y in range(200, height - 80, 48):
        x = 120
        while x < width - 200:
            w = int(rng.integers(8, 60))
            img[y:y + 22, x:x + w] = 30
            x += w + int(rng.integers(6, 14))
    return av.VideoFrame.from_ndarray(img, format="rgb24").reformat(format="yuv420p")


@pytest.fixture(scope="module")
def bomb() -> bytes:
    black = _black(4096)
    raw = _mp4(4096, 4096, [black] * 230, 25, "ultrafast")
    assert 50_000 < len(raw) < 70_000, len(raw)  # the probe's 58 KB
    return raw


def _deck(seconds: int, every: int, preset: str) -> bytes:
    fps = 2
    slides = [_slide(k) for k in range(-(-seconds // every))]
    return _mp4(1920, 1080, [slides[i // (fps * every)] for i in range(seconds * fps)], fps,
                preset)


DECKS = {  # name: (seconds, a new slide every, x264 preset)
    "a new slide every 15 s": (60, 15, "ultrafast"),
    "one slide throughout": (120, 10**6, "medium"),
}


@pytest.fixture(scope="module", params=DECKS)
def deck(request) -> tuple[str, bytes]:
    return request.param, _deck(*DECKS[request.param])


def test_the_bomb_is_refused_from_its_header_before_a_frame_is_decoded(bomb, monkeypatch):
    import tandem.services.encoder.media.video as video

    def no_decode(*a, **k):
        raise AssertionError("the bomb reached the decoder")

    monkeypatch.setattr(video, "decode", no_decode)  # the refusal comes from header + plan
    lim = default_limits()
    with pytest.raises(VideoError) as e:
        prepare_video(bomb, SETTINGS, None, lim, "messages[0].content[1].video_url")
    err = e.value
    assert (err.reason, err.field) == (VideoRefusal.DECODE_WORK,
                                       "messages[0].content[1].video_url")
    assert err.code == "INVALID_ARGUMENT" and "video_decode_pixels_per_byte" in err.message
    # what let it through before: its header is inside the pixel cap
    assert 4096 * 4096 * 230 < lim.max_video_decoded_pixels


def test_the_bomb_gets_seconds_of_cpu_not_a_minute_when_its_work_is_allowed(bomb):
    """With the work check out of the way, the bytes' CPU budget stops it: 58 KB buy
    seconds, not max_video_decode_s (shown on a budget its decode cannot fit, so the test
    does not depend on this core's speed)."""
    lim = default_limits(video_decode_pixels_per_byte=10**9)
    assert lim.cpu_allowed(len(bomb)) < 6 < lim.max_video_decode_s
    tight = default_limits(video_decode_pixels_per_byte=10**9, video_decode_s_per_mib=1e-6)
    with pytest.raises(VideoError) as e:
        prepare_video(bomb, SETTINGS, None, tight, "v")
    assert e.value.reason is VideoRefusal.DECODE_BUDGET


def test_the_budget_counts_this_threads_cpu_not_the_wall(monkeypatch):
    """Time the decoding thread spends off the CPU (other requests on the cores) is not
    charged to the file: a small clip whose decode waits 0.1 s per sampled frame (0.8 s in
    all) passes a CPU budget of 0.3 s that a wall clock would have refused."""
    import threading

    import tandem.services.encoder.media.video as video

    raw = _mp4(64, 64, [_black(64)] * 16, 8, "ultrafast")
    real = video.resize_frame

    def waits(*a, **k):  # off the CPU, as when the cores serve someone else
        threading.Event().wait(0.1)
        return real(*a, **k)

    monkeypatch.setattr(video, "resize_frame", waits)
    lim = default_limits(video_decode_min_bytes=1 << 20, video_decode_s_per_mib=0.3)
    assert lim.cpu_allowed(len(raw)) == pytest.approx(0.3)
    planned = plan_source(raw, SETTINGS, VideoOptions(num_frames=8), lim)
    assert len(planned.plan.indices) == 8
    out = decode(planned, lim)
    assert out.frames_decoded == planned.plan.indices[-1] + 1


def test_a_slide_deck_is_served(deck, one_torch_thread):
    name, raw = deck
    lim = default_limits()
    planned = plan_source(raw, SETTINGS, SLIDES_SAMPLING, lim)
    work = DecodeWork.of(planned.header, planned.plan.indices)
    assert work.units <= lim.work_allowed(len(raw)) / 1.5, (name, work.units / len(raw))
    video = decode(planned, lim)
    assert video.frames_decoded == planned.plan.indices[-1] + 1  # served whole, in budget


def test_a_decode_past_its_bytes_time_names_that_limit(deck):
    _, raw = deck
    lim = default_limits(video_decode_s_per_mib=1e-9)
    with pytest.raises(VideoError) as e:
        prepare_video(raw, SETTINGS, SLIDES_SAMPLING, lim, "v")
    assert e.value.reason is VideoRefusal.DECODE_BUDGET and e.value.field == "v"
    assert "video_decode_s_per_mib" in e.value.message


def test_the_budget_is_proportional_to_the_bytes_above_a_floor():
    lim = default_limits()
    floor = lim.video_decode_min_bytes
    assert lim.work_allowed(1) == lim.work_allowed(floor) == floor * lim.video_decode_pixels_per_byte
    assert lim.work_allowed(4 * floor) == 4 * lim.work_allowed(floor)
    assert lim.cpu_allowed(1) == lim.cpu_allowed(floor)
    assert lim.cpu_allowed(4 * floor) == pytest.approx(4 * lim.cpu_allowed(floor))
