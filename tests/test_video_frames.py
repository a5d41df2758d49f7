"""A video given as frames (services/encoder/media/video_frames.py) against transformers' own video
processor fed the same frames, and its limits and refusals.

The oracle (tests/oracle/video_oracle.py in `.oracle-venv`, as tests/test_video_preprocess.py
runs it) opens each frame file with PIL and calls the stock processor of the architecture
with `videos=[[frame, ...]]`, `video_metadata` {"total_num_frames": n, "fps": fps,
"frames_indices": range(n)} and `do_sample_frames=False` (`Sampling.processor_kwargs(
frames=True)`): every frame kept, resized, the count padded to the temporal patch size,
patchified; Qwen2.5-VL's second_per_grid_ts and Qwen3-VL's timestamps from that fps.
pixel_values are compared bit for bit; frames of odd sizes and odd counts, PNG and JPEG.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from encoder_peers.chats import png
from test_video_preprocess import ORACLE_PY, ORACLE_SCRIPT, ROOT

from tandem.chat import ChatError, ImageInput, VideoOptions
from tandem.services.encoder.media.images import Budget, ImageLimits
from tandem.services.encoder.media.video import VideoLimits
from tandem.services.encoder.media.video_frames import decode_frames, plan_frames_source
from tandem.services.encoder.media.video_rules import (
    Sampling,
    VideoError,
    VideoRefusal,
    VideoSettings,
)

ARCHS = ("qwen2_5_vl", "qwen3_vl")
IMAGE = ImageLimits(max_image_bytes=1 << 22, max_source_pixels=1 << 24)


@dataclasses.dataclass(frozen=True)
class Frames:
    width: int
    height: int
    count: int
    fmt: str = "PNG"
    seed: int = 0

    def files(self) -> list[bytes]:
        return [png(self.width, self.height, self.seed * 1000 + i, self.fmt)
                for i in range(self.count)]


VIDEOS = {
    "odd": Frames(33, 25, 7),  # odd sides, odd count: the last frame pads the last group
    "jpeg": Frames(100, 60, 5, "JPEG"),
    "vga": Frames(640, 480, 4),  # shrunk by the pixel budget
    "tall": Frames(31, 97, 9, seed=3),
    "one": Frames(48, 40, 1),  # qwen2_vl pads it to a pair; qwen3_vl's smart_resize refuses
}
# (video, options, settings changes)
RUNS = {
    "odd": ("odd", VideoOptions(fps=2.0), {}),
    "jpeg": ("jpeg", VideoOptions(fps=1.5), {}),  # timestamps that are not whole seconds
    "vga": ("vga", VideoOptions(fps=4.0), {}),
    "pixels": ("tall", VideoOptions(fps=3.0, min_pixels=5000, max_pixels=30000), {}),
    "total_pixels": ("vga", VideoOptions(fps=0.5, total_pixels=200_000), {}),
    "cap": ("odd", VideoOptions(fps=24.0), {"cap_pixels_per_frame": True, "max_video_tokens": 8}),
    "one": ("one", VideoOptions(fps=1.0), {}),
}
TRANSFORMERS_FAILS = {"qwen3_vl-one": "ValueError"}
CASES = [f"{arch}-{run}" for arch in ARCHS for run in RUNS]


def _case(case_id: str, ckpt):
    arch, run = case_id.split("-", 1)
    video, options, changes = RUNS[run]
    settings = dataclasses.replace(VideoSettings.from_checkpoint(ckpt(arch)), **changes)
    return arch, video, options, settings


def prepare(files: list[bytes], settings, options, limits=None, budget=None):
    lim = limits or VideoLimits()
    planned = plan_frames_source(tuple(ImageInput(data=f) for f in files), settings, options,
                                 lim, IMAGE, "v.frames", budget)
    return decode_frames(planned, lim, IMAGE, budget)


@pytest.fixture(scope="module")
def frames(tmp_path_factory) -> dict[str, tuple[list[bytes], list[str]]]:
    d = tmp_path_factory.mktemp("frames")
    out = {}
    for key, v in VIDEOS.items():
        files = v.files()
        paths = []
        for i, raw in enumerate(files):
            paths.append(str(d / f"{key}-{i}.{v.fmt.lower()}"))
            Path(paths[-1]).write_bytes(raw)
        out[key] = (files, paths)
    return out


@pytest.fixture(scope="module")
def oracle(frames, checkpoint, tmp_path_factory) -> tuple[Path, dict]:
    if not ORACLE_PY.exists():
        pytest.fail(f"{ORACLE_PY.relative_to(ROOT)} is missing: `make test` builds it "
                    "(or `make oracle-venv` alone)")
    out = tmp_path_factory.mktemp("oracle")
    jobs = []
    for case_id in CASES:
        arch, video, options, settings = _case(case_id, checkpoint)
        init, call = Sampling.resolve_frames(settings, options).processor_kwargs(frames=True)
        jobs.append({"id": case_id, "frames": frames[video][1], "fps": options.fps,
                     "arch": arch, "checkpoint": str(checkpoint(arch)), "init": init,
                     "call": call})
    (out / "job.json").write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [str(ORACLE_PY), str(ORACLE_SCRIPT), str(out / "job.json"), str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, f"the oracle failed:\n{r.stderr[-4000:]}"
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("case_id", CASES)
def test_matches_transformers(case_id, frames, oracle, checkpoint):
    arch, video, options, settings = _case(case_id, checkpoint)
    out, results = oracle
    ref = results[case_id]
    files = frames[video][0]
    if case_id in TRANSFORMERS_FAILS:
        assert ref["error"].startswith(TRANSFORMERS_FAILS[case_id])
        with pytest.raises(VideoError) as e:
            prepare(files, settings, options)
        assert e.value.reason == VideoRefusal.TOO_SHORT
        return
    assert "error" not in ref, f"transformers refused the case: {ref['error']}"
    got = prepare(files, settings, options)
    plan = got.plan
    assert list(plan.indices) == ref["frames_indices"] == list(range(len(files)))
    assert list(got.grid) == ref["grid"]
    assert got.grid[0] == -(-len(files) // settings.temporal_patch_size)
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
    assert got.frames_decoded == len(files)


# -- identity --------------------------------------------------------------------------------


def test_cache_key_holds_the_frames_and_their_rate(checkpoint):
    s = VideoSettings.from_checkpoint(checkpoint("qwen2_5_vl"))
    files = VIDEOS["odd"].files()

    def key(fs, fps):
        return plan_frames_source(tuple(ImageInput(data=f) for f in fs), s,
                                  VideoOptions(fps=fps), VideoLimits(), IMAGE).key

    assert key(files, 2.0) == key(list(files), 2.0)
    # the same pixels, another time axis: another key (the prefix cache keys pages by it)
    assert key(files, 2.0) != key(files, 3.0)
    assert key(files, 2.0) != key(files[::-1], 2.0)
    assert key(files, 2.0) != key(files[:-1], 2.0)


# -- controls, limits and refusals -----------------------------------------------------------


@pytest.fixture(scope="module")
def settings(checkpoint) -> VideoSettings:
    return VideoSettings.from_checkpoint(checkpoint("qwen3_vl"))


@pytest.mark.parametrize("options", [
    VideoOptions(),  # no rate
    VideoOptions(fps=2.0, num_frames=4),
    VideoOptions(fps=2.0, min_frames=2),
    VideoOptions(fps=2.0, max_frames=8),
    VideoOptions(fps=-1.0),
])
def test_controls_that_do_not_apply_are_refused(settings, options):
    with pytest.raises(VideoError) as e:
        prepare(VIDEOS["odd"].files(), settings, options)
    assert (e.value.reason, e.value.field) == (VideoRefusal.OPTIONS, "v.frames")


@pytest.mark.parametrize(
    "limits, reason",
    [
        ({"max_video_bytes": 3000}, VideoRefusal.BYTES),
        ({"max_video_duration_s": 3.0}, VideoRefusal.DURATION),  # 7 frames at 2 per second
        ({"max_video_frames": 6}, VideoRefusal.FRAMES),
        ({"max_video_decoded_pixels": 33 * 25 * 7 - 1}, VideoRefusal.DECODED_PIXELS),
        ({"max_video_decode_s": 1e-9}, VideoRefusal.DECODE_TIME),
        ({"max_video_tokens": 1}, VideoRefusal.TOKENS),
    ],
    ids=lambda v: v.name if isinstance(v, VideoRefusal) else None,
)
def test_each_limit_is_refused_by_name(settings, limits, reason):
    files, options = VIDEOS["odd"].files(), VideoOptions(fps=2.0)
    assert prepare(files, settings, options, VideoLimits(**{k: 10**12 for k in limits}))
    with pytest.raises(VideoError) as e:
        prepare(files, settings, options, VideoLimits(**limits))
    assert (e.value.reason, e.value.field) == (reason, "v.frames")
    assert reason.value in e.value.message
    too_big = reason == VideoRefusal.BYTES  # the router's 413
    assert e.value.code == ("RESOURCE_EXHAUSTED" if too_big else "INVALID_ARGUMENT")


def test_each_frame_is_an_image_under_the_image_rules(settings):
    files, options = VIDEOS["odd"].files(), VideoOptions(fps=2.0)
    other = png(34, 25, 9)
    with pytest.raises(VideoError) as e:
        prepare(files[:3] + [other] + files[3:], settings, options)
    assert (e.value.reason, e.value.field) == (VideoRefusal.UNSUPPORTED, "v.frames[3]")
    for bad, says in [(b"not an image", "decodable"), (b"", "empty"),
                      (files[0] + b"x" * IMAGE.max_image_bytes, "over the limit")]:
        with pytest.raises(ChatError) as e:
            prepare(files[:2] + [bad], settings, options)
        assert e.value.field == "v.frames[2]" and says in e.value.message, e.value.message
    url = ImageInput(url="https://example.com/f.png")  # no host is allow-listed here
    with pytest.raises(ChatError) as e:
        plan_frames_source((ImageInput(data=files[0]), url), settings, options, VideoLimits(),
                           IMAGE, "v.frames")
    assert e.value.field == "v.frames[1]" and "allowed_url_hosts" in e.value.message
    data_url = "data:image/png;base64," + base64.b64encode(files[1]).decode()
    a = prepare(files[:2], settings, options)
    planned = plan_frames_source((ImageInput(data=files[0]), ImageInput(url=data_url)), settings,
                                 options, VideoLimits(), IMAGE, "v.frames")
    b = decode_frames(planned, VideoLimits(), IMAGE)
    assert a.key == b.key and np.array_equal(a.pixel_values, b.pixel_values)


def test_a_request_that_ended_stops_reading_the_frames(settings):
    budget = Budget()
    budget.stop.set()
    with pytest.raises(TimeoutError):
        prepare(VIDEOS["odd"].files(), settings, VideoOptions(fps=2.0), budget=budget)
