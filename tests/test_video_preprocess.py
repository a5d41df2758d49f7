"""Video preprocessing (services/encoder/media/video.py, video_rules.py) against transformers' own
video processor, and every limit and refusal.

The oracle is transformers itself: tests/oracle/video_oracle.py runs in `.oracle-venv` (made
by `make test`: transformers' video processors need torchvision, which never goes into the
project's venv) and puts each clip through the stock processor of its architecture, built
from the same tiny checkpoint, with the kwargs `Sampling.processor_kwargs()` maps the request
to. The clips are made here with PyAV: several sizes (odd ones too), odd frame counts,
2-10 s, several rates and codecs.

pixel_values are compared bit for bit, no tolerance: both sides decode with the same PyAV
(rgb24), resize uint8 frames with the same torch build's antialiased bicubic kernel (the
oracle venv installs the project's torch) and normalize with the same float32 operations in
the same order. Qwen2.5-VL's second_per_grid_ts comes back from transformers as a float32
tensor, so ours (the same float64 arithmetic) is compared after rounding to float32.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from tandem.services.encoder.media.images import Budget
from tandem.services.encoder.media.video import (
    VideoLimits,
    decode_frames,
    prepare_video,
    probe,
)
from tandem.services.encoder.media.video_rules import (
    Sampling,
    VideoError,
    VideoOptions,
    VideoRefusal,
    VideoSettings,
    plan_video,
)

ROOT = Path(__file__).resolve().parent.parent
ORACLE_PY = ROOT / ".oracle-venv" / "bin" / "python"
ORACLE_SCRIPT = ROOT / "tests" / "oracle" / "video_oracle.py"
ARCHS = ("qwen2_5_vl", "qwen3_vl")


@dataclasses.dataclass(frozen=True)
class Clip:
    width: int
    height: int
    frames: int
    rate: Fraction | int
    codec: str = "libx264"
    container: str = "mp4"
    pix_fmt: str = "yuv420p"

    @property
    def name(self) -> str:
        return f"{self.codec}-{self.width}x{self.height}-{self.frames}f.{self.container}"


def make_clip(c: Clip, path: Path | None = None, movflags: str | None = None) -> bytes:
    """A clip of moving gradients and blocky noise (so resizing has detail to get wrong)."""
    out = str(path) if path else io.BytesIO()
    opts = {"movflags": movflags} if movflags else {}
    with av.open(out, "w", format=c.container, options=opts) as box:
        s = box.add_stream(c.codec, rate=c.rate)
        s.width, s.height, s.pix_fmt = c.width, c.height, c.pix_fmt
        if c.codec == "libx264":
            s.options = {"preset": "ultrafast"}
        rng = np.random.default_rng(c.width * 7919 + c.height * 31 + c.frames)
        yy, xx = np.mgrid[0 : c.height, 0 : c.width]
        for i in range(c.frames):
            base = np.stack([xx * 3 + i * 7, yy * 5 + i * 3, (xx + yy) * 2 + i * 11], -1) % 256
            noise = rng.integers(-40, 40, (c.height // 4 + 1, c.width // 4 + 1, 3))
            noise = noise.repeat(4, 0).repeat(4, 1)[: c.height, : c.width]
            img = np.clip(base + noise, 0, 255).astype(np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                box.mux(p)
        for p in s.encode():
            box.mux(p)
    return path.read_bytes() if path else out.getvalue()


# -- against transformers ------------------------------------------------------------------

CLIPS = {
    "small": Clip(64, 48, 17, 8),  # 2.1 s
    "vga": Clip(640, 480, 90, 30),  # 3 s, shrunk by the pixel budget
    "odd444": Clip(33, 25, 75, Fraction(30000, 1001), pix_fmt="yuv444p"),  # 2.5 s, grown
    "webm": Clip(100, 60, 50, 25, "libvpx-vp9", "webm"),  # no frame count in the header
    "avi": Clip(31, 17, 51, 5, "mpeg4", "avi"),  # 10.2 s, odd sides and count
    "mid": Clip(200, 120, 61, 12),  # 5.1 s
}
# (clip, options, settings changes)
RUNS = {
    "small": ("small", VideoOptions(), {}),
    "vga": ("vga", VideoOptions(), {}),
    "odd444": ("odd444", VideoOptions(), {}),
    "webm": ("webm", VideoOptions(), {}),
    "avi": ("avi", VideoOptions(), {}),
    "fps1.5": ("mid", VideoOptions(fps=1.5), {}),  # 7 frames for qwen3_vl: one repeated
    "fps0.3": ("mid", VideoOptions(fps=0.3), {}),  # under min_frames
    "num7": ("mid", VideoOptions(num_frames=7), {}),
    "max_frames": ("vga", VideoOptions(fps=4.0, max_frames=5), {}),
    "pixels": ("vga", VideoOptions(min_pixels=5000, max_pixels=60000), {}),
    "total_pixels": ("vga", VideoOptions(total_pixels=50000), {}),
    "cap": ("mid", VideoOptions(fps=2.5), {"cap_pixels_per_frame": True, "max_video_tokens": 8}),
    # 61 frames, 14 sampled: Qwen2VLVideoProcessor's float32 arange gives a 15th index, 61,
    # and transformers fails (IndexError); ours keeps the 14 it meant (qwen3_vl: no issue)
    "overshoot": ("mid", VideoOptions(fps=3.0), {}),
    # more frames than the clip has: qwen3_vl samples some twice, qwen2_vl refuses
    "num_over": ("small", VideoOptions(num_frames=21), {}),
}
TRANSFORMERS_FAILS = {"qwen2_5_vl-overshoot": "IndexError", "qwen2_5_vl-num_over": "ValueError"}
CASES = [f"{arch}-{run}" for arch in ARCHS for run in RUNS]


def _case(case_id: str, ckpt) -> tuple[str, str, VideoOptions, VideoSettings]:
    arch, run = case_id.split("-", 1)
    clip, options, changes = RUNS[run]
    settings = dataclasses.replace(VideoSettings.from_checkpoint(ckpt(arch)), **changes)
    return arch, clip, options, settings


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("clips")
    out = {}
    for key, c in CLIPS.items():
        out[key] = d / c.name
        out[key].write_bytes(make_clip(c))
    return out


@pytest.fixture(scope="module")
def oracle(clips, checkpoint, tmp_path_factory) -> tuple[Path, dict]:
    """transformers' results for every case, from one run of the oracle script."""
    if not ORACLE_PY.exists():
        pytest.fail(
            f"{ORACLE_PY.relative_to(ROOT)} is missing: `make test` builds it "
            "(or `make oracle-venv` alone)"
        )
    out = tmp_path_factory.mktemp("oracle")
    jobs = []
    for case_id in CASES:
        arch, clip, options, settings = _case(case_id, checkpoint)
        init, call = Sampling.resolve(settings, options).processor_kwargs()
        jobs.append({"id": case_id, "clip": str(clips[clip]), "arch": arch,
                     "checkpoint": str(checkpoint(arch)), "init": init, "call": call})
    (out / "job.json").write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [str(ORACLE_PY), str(ORACLE_SCRIPT), str(out / "job.json"), str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, f"the oracle failed:\n{r.stderr[-4000:]}"
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("case_id", CASES)
def test_matches_transformers(case_id, clips, oracle, checkpoint):
    arch, clip, options, settings = _case(case_id, checkpoint)
    out, results = oracle
    ref = results[case_id]
    raw = clips[clip].read_bytes()
    if case_id in TRANSFORMERS_FAILS:
        assert ref["error"].startswith(TRANSFORMERS_FAILS[case_id])
        if case_id.endswith("num_over"):
            with pytest.raises(VideoError) as e:
                prepare_video(raw, settings, options)
            assert e.value.reason == VideoRefusal.TOO_SHORT
            return
        got = prepare_video(raw, settings, options)
        n = len(got.plan.indices)
        assert n == 14 and got.plan.indices[-1] < got.header.num_frames and got.grid[0] == 7
        return
    assert "error" not in ref, f"transformers refused the case: {ref['error']}"
    got = prepare_video(raw, settings, options)
    plan = got.plan

    assert list(plan.indices) == ref["frames_indices"]
    assert list(got.grid) == ref["grid"]
    want = np.load(out / f"{case_id}.npy")
    ours = got.pixel_values.numpy()
    assert (ours.dtype, ours.shape) == (want.dtype, want.shape)
    assert np.array_equal(ours, want), f"pixel_values differ: max {np.abs(ours - want).max()}"
    assert (got.header.num_frames, got.header.fps) == (ref["total_num_frames"], ref["fps"])

    pad = "<|video_pad|>"
    if arch == "qwen2_5_vl":
        assert np.float32(plan.second_per_grid_t) == np.float32(ref["second_per_grid_ts"])
        body = pad * plan.num_tokens
    else:
        assert list(plan.timestamps_s) == ref["timestamps"]
        per_group = plan.grid[1] * plan.grid[2] // settings.merge_size**2
        body = "".join(f"{t}<|vision_start|>{pad * per_group}<|vision_end|>"
                       for t in plan.timestamp_text())
    assert ref["text"] == f"<|vision_start|>{body}<|vision_end|>"


# -- settings and options ------------------------------------------------------------------


def test_settings_follow_the_architecture(checkpoint):
    s2 = VideoSettings.from_checkpoint(checkpoint("qwen2_5_vl"))
    s3 = VideoSettings.from_checkpoint(checkpoint("qwen3_vl"))
    assert (s2.rules, s2.patch_size, s2.fps, s2.max_video_tokens) == ("qwen2_vl", 14, None, 128000)
    assert (s3.rules, s3.patch_size, s3.fps, s3.max_video_tokens) == ("qwen3_vl", 16, 2.0, 768)
    # NOTE: the tiny qwen3_vl checkpoint's file names Qwen2VLVideoProcessor; the model's
    # architecture decides the rules, and its size keys are read as Qwen3-VL's.
    assert (s3.min_pixels, s3.max_pixels) == (4096, 262144)


def test_a_request_tightens_never_loosens(checkpoint):
    s = VideoSettings.from_checkpoint(checkpoint("qwen2_5_vl"))
    smp = Sampling.resolve(s, VideoOptions(max_frames=10_000, max_pixels=10**9, min_frames=99))
    assert (smp.max_frames, smp.max_pixels) == (s.max_frames, s.max_pixels)
    assert smp.fps == 2.0 and smp.num_frames is None  # the default rate (none in the file)
    smp = Sampling.resolve(s, VideoOptions(max_frames=6, min_frames=99))
    assert (smp.max_frames, smp.min_frames) == (6, 6)


@pytest.mark.parametrize(
    "options",
    [
        VideoOptions(fps=2.0, num_frames=4),
        VideoOptions(fps=0.0),
        VideoOptions(fps=float("nan")),
        VideoOptions(num_frames=1),
        VideoOptions(num_frames=100_000),
        VideoOptions(max_pixels=0),
        VideoOptions(total_pixels=-5),
        VideoOptions(min_frames=True),
    ],
)
def test_bad_options_are_refused(options, checkpoint):
    s = VideoSettings.from_checkpoint(checkpoint("qwen3_vl"))
    with pytest.raises(VideoError) as e:
        Sampling.resolve(s, options, "messages[0].content[1].video")
    assert e.value.reason == VideoRefusal.OPTIONS
    assert e.value.field == "messages[0].content[1].video"
    assert e.value.code == "INVALID_ARGUMENT"


def test_cache_key_follows_the_sampled_frames(checkpoint):
    s = VideoSettings.from_checkpoint(checkpoint("qwen2_5_vl"))
    raw = make_clip(CLIPS["mid"])
    header = probe(raw, "video", VideoLimits())

    def plan(**kw):
        return plan_video(header, Sampling.resolve(s, VideoOptions(**kw)), "h")

    assert plan(fps=1.0).cache_key == plan(fps=1.0).cache_key
    assert plan(fps=1.0).cache_key != plan(fps=2.0).cache_key
    # fps 1.0 and 1.1 sample the same frames: the same pixels, so the same key
    assert plan(fps=1.0).indices == plan(fps=1.1).indices
    assert plan(fps=1.0).cache_key == plan(fps=1.1).cache_key
    assert plan(fps=1.0).cache_key != plan_video(header, Sampling.resolve(s, VideoOptions(fps=1.0)),
                                                 "other content").cache_key


# -- limits and refusals -------------------------------------------------------------------


@pytest.fixture(scope="module")
def small() -> bytes:
    return make_clip(CLIPS["small"])  # 64x48, 17 frames at 8 per second


@pytest.fixture(scope="module")
def settings(checkpoint) -> VideoSettings:
    return VideoSettings.from_checkpoint(checkpoint("qwen3_vl"))


def _refused(raw: bytes, settings: VideoSettings, **limits) -> VideoError:
    with pytest.raises(VideoError) as e:
        prepare_video(raw, settings, limits=VideoLimits(**limits), field="v")
    too_big = e.value.reason == VideoRefusal.BYTES  # the router's 413
    assert e.value.code == ("RESOURCE_EXHAUSTED" if too_big else "INVALID_ARGUMENT")
    assert e.value.field == "v"
    return e.value


@pytest.mark.parametrize(
    "limits, reason",
    [
        ({"max_video_bytes": 1024}, VideoRefusal.BYTES),
        ({"max_video_duration_s": 2.0}, VideoRefusal.DURATION),
        ({"max_video_frames": 16}, VideoRefusal.FRAMES),
        ({"max_video_decoded_pixels": 64 * 48 * 16}, VideoRefusal.DECODED_PIXELS),
        ({"max_video_decode_s": 1e-9}, VideoRefusal.DECODE_TIME),
        ({"max_video_tokens": 7}, VideoRefusal.TOKENS),
    ],
    ids=lambda v: v.name if isinstance(v, VideoRefusal) else None,
)
def test_each_limit_is_refused_by_name(small, settings, limits, reason):
    assert prepare_video(small, settings, limits=VideoLimits(**{k: 10**12 for k in limits}))
    err = _refused(small, settings, **limits)
    assert err.reason == reason
    assert reason.value == next(iter(limits))  # the reason names the limit's field
    assert reason.value in err.message  # and so does what the client reads


def test_limits_hold_against_a_lying_header(small, settings):
    """The decode loop counts what really decodes: a header claiming 1x1 frames passes the
    up-front pixel check, and the loop still stops at the limit (then at the size)."""
    lim = VideoLimits(max_video_decoded_pixels=1000)
    header = dataclasses.replace(probe(small, "v", lim), width=1, height=1)
    plan = plan_video(header, Sampling.resolve(settings, VideoOptions()), "h")
    with pytest.raises(VideoError) as e:
        decode_frames(small, header, plan, "v", lim)
    assert e.value.reason == VideoRefusal.DECODED_PIXELS
    with pytest.raises(VideoError) as e:
        decode_frames(small, header, plan, "v", VideoLimits())
    assert e.value.reason == VideoRefusal.UNSUPPORTED  # frames are not the header's size


def test_a_request_that_ended_stops_the_decode(small, settings):
    budget = Budget()
    budget.stop.set()
    with pytest.raises(TimeoutError):
        prepare_video(small, settings, budget=budget)


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buf, "PNG")
    return buf.getvalue()


def _no_frames(tmp: Path) -> bytes:
    """A Matroska file with a video track that holds no frame (and some audio)."""
    path = tmp / "empty.mkv"
    with av.open(str(path), "w", format="matroska") as box:
        v = box.add_stream("libx264", rate=8)
        v.width, v.height, v.pix_fmt = 64, 48, "yuv420p"
        a = box.add_stream("aac", rate=8000)
        for i in range(4):
            f = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), "fltp", "mono")
            f.sample_rate, f.pts = 8000, i * 1024
            for p in a.encode(f):
                box.mux(p)
        for p in a.encode():
            box.mux(p)
    return path.read_bytes()


def _audio_only(tmp: Path) -> bytes:
    path = tmp / "audio.mp4"
    with av.open(str(path), "w", format="mp4") as box:
        a = box.add_stream("aac", rate=8000)
        for i in range(4):
            f = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), "fltp", "mono")
            f.sample_rate, f.pts = 8000, i * 1024
            for p in a.encode(f):
                box.mux(p)
        for p in a.encode():
            box.mux(p)
    return path.read_bytes()


def test_empty_undecodable_and_corrupt_files(small, settings, tmp_path):
    assert _refused(b"", settings).reason == VideoRefusal.EMPTY
    rng = np.random.default_rng(0)
    for junk in (
        rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        _png(),  # an image is not a video (its demuxer is not on the list)
        b"ffconcat version 1.0\nfile /etc/hostname\n",  # a playlist naming another file
        small[: len(small) // 2],  # an mp4 cut before its index (moov at the end)
        _audio_only(tmp_path),
    ):
        assert _refused(junk, settings).reason == VideoRefusal.UNDECODABLE
    assert _refused(_no_frames(tmp_path), settings).reason == VideoRefusal.ZERO_DURATION
    one = make_clip(dataclasses.replace(CLIPS["small"], frames=1))
    assert _refused(one, settings).reason == VideoRefusal.TOO_SHORT
    # the index up front (faststart), the frames cut off: it opens, then ends early
    whole = make_clip(CLIPS["mid"], tmp_path / "fs.mp4", movflags="faststart")
    cut = _refused(whole[: len(whole) * 6 // 10], settings)
    assert cut.reason == VideoRefusal.CORRUPT


def test_timing_and_costs_are_reported(small, settings):
    got = prepare_video(small, settings)
    assert got.frames_decoded == got.plan.indices[-1] + 1 == 17
    assert got.decode_s > 0 and got.process_s > 0
    assert got.num_tokens == got.grid[0] * got.grid[1] * got.grid[2] // 4
    assert len(got.plan.timestamps_s) == got.grid[0]
