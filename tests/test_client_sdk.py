"""SDK plumbing on plain data: message forms -> protos, image and video helpers, typed errors,
stream folding. (The SDK against a live router: test_router_live.py and the e2e tests.)"""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from tandem.client import (
    AuthenticationError,
    ChatResult,
    DeadlineExceededError,
    EncoderRange,
    InternalError,
    InvalidRequestError,
    ResourceExhaustedError,
    UnavailableError,
    image,
    image_from_pil,
    to_messages,
    video,
)
from tandem.client.channel import backoff_s
from tandem.client.errors import error_from_code
from tandem.client.results import add, build_request
from tandem.v1 import common_pb2, router_pb2


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), "red").save(buf, format="PNG")
    return buf.getvalue()


def test_message_forms(tmp_path):
    raw = _png()
    path = tmp_path / "a.png"
    path.write_bytes(raw)
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    msgs = to_messages([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            image(str(path)), image(path), image(raw), image(url),
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "image", "image": Image.open(io.BytesIO(raw))},
            {"type": "text", "text": "and"}, "what?",
        ]},
    ])
    assert [m.role for m in msgs] == ["system", "user"]
    parts = msgs[1].content
    assert [p.WhichOneof("part") for p in parts] == ["image"] * 6 + ["text", "text"]
    assert all(p.image.data == raw for p in parts[:5])
    decoded = Image.open(io.BytesIO(parts[5].image.data))
    assert decoded.size == (8, 6) and decoded.getpixel((0, 0)) == (255, 0, 0)
    assert to_messages("hi")[0].content[0].text == "hi"
    remote = image("https://example.com/cat.png", max_pixels=50176).image
    assert remote.url == "https://example.com/cat.png" and remote.max_pixels == 50176
    pil = image_from_pil(Image.new("L", (4, 4)), min_pixels=784).image
    assert pil.min_pixels == 784 and pil.data.startswith(b"\x89PNG")


@pytest.mark.parametrize("bad", [
    [],
    [{"role": "user", "content": [{"type": "audio", "x": 1}]}],
    [{"role": "user", "content": [b""]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png,x"}}]}],
    [{"role": "user", "content": [{"type": "image", "image": 42}]}],
])
def test_bad_message_forms_raise(bad):
    with pytest.raises((ValueError, TypeError)):
        to_messages(bad)


def test_video_forms(tmp_path):
    clip = b"\0\0\0\x18ftypmp42 not really a clip"
    path = tmp_path / "a.mp4"
    path.write_bytes(clip)
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    msgs = to_messages([{"role": "user", "content": [
        video(str(path)), video(path, fps=1.5), video(clip, num_frames=8), video(url),
        {"type": "video_url", "video_url": {"url": url, "max_pixels": 50176}},
        {"type": "video", "video": path, "total_pixels": 1 << 33, "max_frames": 12},
        "what happens?"]}])
    parts = msgs[0].content
    assert [p.WhichOneof("part") for p in parts] == ["video"] * 6 + ["text"]
    assert all(p.video.data == clip for p in parts[:6])
    assert (parts[1].video.fps, parts[2].video.num_frames, parts[4].video.max_pixels) == (
        1.5, 8, 50176)
    assert (parts[5].video.total_pixels, parts[5].video.max_frames) == (1 << 33, 12)
    remote = video("https://example.com/v.webm", min_frames=4).video
    assert remote.url == "https://example.com/v.webm" and remote.min_frames == 4


def test_a_video_given_as_frames(tmp_path):
    import numpy as np

    path = tmp_path / "f.png"
    Image.new("RGB", (4, 2), (9, 9, 9)).save(path)
    raw = path.read_bytes()
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    pixels = np.full((2, 4, 3), 9, np.uint8)
    v = video([path, str(path), raw, url, "https://example.com/f.png", Image.open(path), pixels],
              fps=2, max_pixels=50176).video
    assert v.WhichOneof("source") == "frames" and (v.fps, v.max_pixels) == (2, 50176)
    kinds = [f.WhichOneof("source") for f in v.frames.frames]
    assert kinds == ["data"] * 4 + ["url"] + ["data"] * 2
    assert [f.data for f in v.frames.frames[:4]] == [raw] * 4
    assert v.frames.frames[4].url == "https://example.com/f.png"
    for f in v.frames.frames[5:]:  # pixels: PNG, lossless
        assert np.array_equal(np.array(Image.open(io.BytesIO(f.data))), np.array(Image.open(path)))
    # qwen-vl-utils' message form and its name for the rate
    msgs = to_messages([{"role": "user", "content": [
        {"type": "video", "video": [raw, raw], "sample_fps": 1.5}, "what?"]}])
    assert msgs[0].content[0].video.fps == 1.5 and len(msgs[0].content[0].video.frames.frames) == 2


@pytest.mark.parametrize("call", [
    lambda: video([b"x"]),  # a video given as frames needs its rate
    lambda: video([], fps=2),
    lambda: video([b"x"], fps=2, num_frames=4),  # nothing is sampled from frames
    lambda: video([b"x"], fps=2, max_frames=4),
    lambda: to_messages([{"role": "user", "content": [
        {"type": "video", "video": [b"x"], "fps": 2, "sample_fps": 3}]}]),
    lambda: video(b""),
    lambda: video(b"x", fps=1, num_frames=4),  # a rate or a count, not both
    lambda: video(b"x", fps=0),  # 0 on the wire is "the model's": never sent
    lambda: video(b"x", max_pixels=-5),
    lambda: video("data:image/png;base64,aGk="),
    lambda: video(3.5),
])
def test_bad_videos_raise(call):
    with pytest.raises((ValueError, TypeError)):
        call()


def test_build_request_defaults_to_greedy():
    r = build_request("hi", max_tokens=5, stop="x", seed=3, timeout=2.5, ignore_eos=True)
    assert r.sampling.temperature == 0 and r.sampling.max_tokens == 5
    assert list(r.sampling.stop) == ["x"] and r.sampling.seed == 3 and r.sampling.ignore_eos
    assert r.timeout_ms == 2500


def test_error_classes_by_code():
    assert isinstance(error_from_code("INVALID_ARGUMENT", "m", "f"), InvalidRequestError)
    assert isinstance(error_from_code("RESOURCE_EXHAUSTED", "m"), ResourceExhaustedError)
    assert isinstance(error_from_code("UNAUTHENTICATED", "m"), AuthenticationError)
    assert isinstance(error_from_code("UNAVAILABLE", "m"), UnavailableError)
    assert isinstance(error_from_code("DEADLINE_EXCEEDED", "m"), DeadlineExceededError)
    assert isinstance(error_from_code("DATA_LOSS", "m"), InternalError)
    e = error_from_code("INVALID_ARGUMENT", "not an image", "messages[0].content[1].image")
    assert e.field == "messages[0].content[1].image" and "not an image" in str(e)


def test_stream_folding_and_error_message():
    res = ChatResult()
    add(res, router_pb2.RouterGenerateResponse(text="Hel", token_ids=[1, 2], request_id="r1"))
    add(res, router_pb2.RouterGenerateResponse(
        text="lo", token_ids=[3], finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=7, completion_tokens=3, total_tokens=10),
        timings=common_pb2.StageTimings(
            vit_ms=1.5, decode_ms=2.0, time_to_first_row_ms=3.5, early_prefill_tokens=12,
            encoder_ranges=[common_pb2.EncoderRange(encoder="e1:1", tokens=20, media=1,
                                                    vit_ms=4.5, cached_image_tokens=8,
                                                    preprocess_ms=2.5),
                            common_pb2.EncoderRange(encoder="e2:2", first_token=20, tokens=9,
                                                    first_media=1, media=2, fell_back=True)])))
    assert (res.text, res.token_ids, res.finish_reason, res.request_id) == ("Hello", [1, 2, 3],
                                                                            "length", "r1")
    assert res.usage.total_tokens == 10 and res.timings.vit_ms == 1.5
    t = res.timings
    assert (t.time_to_first_row_ms, t.early_prefill_tokens) == (3.5, 12)
    assert t.encoder_ranges == (EncoderRange("e1:1", 0, 20, 0, 1, vit_ms=4.5,
                                             cached_image_tokens=8, preprocess_ms=2.5),
                                EncoderRange("e2:2", 20, 9, 1, 2, fell_back=True))
    with pytest.raises(UnavailableError, match="language gone"):
        add(res, router_pb2.RouterGenerateResponse(
            finish_reason=common_pb2.FINISH_REASON_ERROR,
            error=common_pb2.ErrorInfo(code="UNAVAILABLE", message="language gone")))


def test_backoff_is_bounded_and_grows():
    assert all(0 <= backoff_s(a, 0.1) <= min(5.0, 0.1 * 2**a) for a in range(10) for _ in range(20))
