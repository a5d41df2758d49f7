"""Video through the whole cluster: `tandem up` (1 encoder + 1 language, float32 CPU) on the
tiny Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE checkpoints; chats with `video_url` parts go
router -> encoder (decode, sample, ViT) -> language, and the greedy answer equals
transformers `generate()` fed by transformers' own video processor
(tests/oracle/video_generate.py in `.oracle-venv`): videos alone and mixed with an image
and text, several per chat, odd frame counts and sides, 2-10 s clips, fps and frame-count
controls, over HTTP and the SDK, concurrently, and across resumed transfers (the language
side reserves 48 tokens). A repeated video is a counted encoder-cache hit with the same
answer; the same video at another rate is not. A video given as frames (qwen-vl-utils'
list of images) too: transformers fed the same PIL frames, a hit when repeated, none at
another rate.

Then the limits (one more Qwen2.5-VL cluster with tight ones): each is a 4xx naming the
video part and the limit — oversize (413), too long, too many frames, too many tokens,
corrupt, empty, not a video, wrong MIME type, too many videos, a slow URL — while a good
request running beside them is answered as usual; an image too narrow for the processor
is a 400 naming it.

No test here bounds a duration: waits end on the state they wait for.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import http.server
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from encoder_peers.chats import png
from test_video_preprocess import CLIPS, Clip, make_clip
from video_chats import Frames, Image, Video, VideoChat, oracle_results, write_clips

from tandem.chat import VideoOptions
from tandem.client import AsyncClient, Client, InvalidRequestError, image, video
from tandem.launch.cluster import LocalCluster
from tandem.models import tokenizer as tk
from tandem.v1 import common_pb2

pytestmark = pytest.mark.timeout(300)
ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
MAX_NEW = 10
CHATS = {
    "alone": VideoChat((Video("small"), "What happens in the clip?")),
    # avi: 10.2 s, 31x17, 20 frames sampled; with the image over the 48 reserved tokens
    "mixed": VideoChat(("Compare", Image(3, (64, 48)), "with", Video("avi"), "please.")),
    "fps": VideoChat((Video("mid"), "Describe it."), VideoOptions(fps=1.5)),  # qwen3: 7 frames
    "two": VideoChat(
        (Video("webm"), "and", Video("odd444"), "which is longer?"), VideoOptions(num_frames=6)
    ),
}
# the same video after other text (so that no prefix cache holds it), then at another rate
CACHE_CHATS = {
    "first": VideoChat(("First:", Video("mid"), "what?"), VideoOptions(fps=1.0)),
    "again": VideoChat(("Again:", Video("mid"), "what?"), VideoOptions(fps=1.0)),
    "other_rate": VideoChat(("Other:", Video("mid"), "what?"), VideoOptions(fps=2.0)),
}
# a video the language instance's prefix cache holds on the second send (the text after it
# fills more than the last KV page, which is always computed)
HELD = VideoChat(
    (
        Video("webm"),
        "Describe every colour, shape and motion you can see in "
        "this clip, frame by frame, from the first to the last, in detail.",
    )
)
CACHE_ARCHS = ("qwen2_5_vl", "qwen3_vl")
# a video given as frames (qwen-vl-utils' list of images): 7 PNG frames of odd sides taken
# at 2 per second; then the same frames after other text (no prefix cache holds them), and
# at another rate (the same pixels, other positions or timestamps)
FRAMES = Frames(7, (45, 33), seed=5)
FRAMES_CHATS = {
    "frames": VideoChat(("Watch:", FRAMES, "what moves?"), VideoOptions(fps=2.0)),
    "frames_again": VideoChat(("Again:", FRAMES, "what moves?"), VideoOptions(fps=2.0)),
    "frames_rate": VideoChat(("Slower:", FRAMES, "what moves?"), VideoOptions(fps=0.5)),
}
CASES = {f"{a}-{n}": (a, c) for a in ARCHS for n, c in CHATS.items()}
CASES |= {f"{a}-{n}": (a, c) for a in CACHE_ARCHS for n, c in CACHE_CHATS.items()}
CASES |= {f"{a}-{n}": (a, c) for a in CACHE_ARCHS for n, c in FRAMES_CHATS.items()}
CASES |= {f"{a}-held": (a, HELD) for a in CACHE_ARCHS}


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return write_clips(tmp_path_factory.mktemp("clips"))


@pytest.fixture(scope="module")
def expected(clips, checkpoint, tmp_path_factory) -> dict[str, list[int]]:
    """transformers' greedy tokens per case, EOS stripped (the router stops at it)."""
    res = oracle_results(CASES, checkpoint, clips[1], tmp_path_factory.mktemp("oracle"), MAX_NEW)
    return {case_id: without_eos(r["tokens"]) for case_id, r in res.items()}


@pytest.fixture(scope="module", params=ARCHS)
def cluster(request, checkpoint):
    cl = LocalCluster(
        str(checkpoint(request.param)),
        encoders=1,
        languages=1,
        language_args="--embedding-block-size 16 --default-reservation-tokens 48",
    )
    cl.arch = request.param
    cl.start()
    yield cl
    cl.stop()


def sdk_parts(chat: VideoChat, clips) -> list:
    controls = {k: v for k, v in dataclasses.asdict(chat.options).items() if v is not None}
    return [p if isinstance(p, str) else image(p.png()) if isinstance(p, Image)
            else video(p.files(), **controls) if isinstance(p, Frames)
            else video(clips[0][p.clip], **controls) for p in chat.parts]


def sdk_messages(chat: VideoChat, clips) -> list:
    return [
        {"role": "system", "content": chat.system},
        {"role": "user", "content": sdk_parts(chat, clips)},
    ]


def post(cl, messages, **kw) -> httpx.Response:
    body = {
        "model": "",
        "messages": messages,
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "logprobs": True,
        "return_tokens_as_token_ids": True,
        **kw,
    }
    return httpx.post(cl.http_url + "/v1/chat/completions", json=body, timeout=120)


def token_ids(resp: httpx.Response) -> list[int]:
    """The answer's token ids (return_tokens_as_token_ids spells each `token_id:N`)."""
    content = resp.json()["choices"][0]["logprobs"]["content"]
    return [int(t["token"].split(":", 1)[1]) for t in content]


# the tiny checkpoints' generation_config.json EOS ids (tandem/models/tiny.py)
EOS = {tk.IM_END_ID, tk.ENDOFTEXT_ID}


def without_eos(tokens: list[int]) -> list[int]:
    tokens = list(tokens)
    while tokens and tokens[-1] in EOS:
        tokens.pop()
    return tokens


@pytest.mark.parametrize("name", list(CHATS))
def test_greedy_equals_transformers(cluster, clips, expected, name):
    chat, want = CHATS[name], expected[f"{cluster.arch}-{name}"]
    r = post(cluster, chat.openai(clips[0]))
    assert r.status_code == 200, r.text
    assert without_eos(token_ids(r)) == want
    with Client(cluster.grpc_address) as c:
        sdk = c.chat(sdk_messages(chat, clips), max_tokens=MAX_NEW)
    assert without_eos(sdk.token_ids) == want
    assert sdk.usage.prompt_tokens == r.json()["usage"]["prompt_tokens"]
    if name == "mixed":  # longer than the 48 tokens the language side reserves
        ext = r.json()["tandem"]
        assert r.json()["usage"]["prompt_tokens"] > 48
        assert ext.get("resumes", 0) >= 1 or ext["encoder_attempts"] > 1, ext


def test_concurrent_chats_each_equal_transformers(cluster, clips, expected):
    async def go():
        async with AsyncClient(cluster.grpc_address) as c:
            return await asyncio.gather(
                *[
                    c.chat(sdk_messages(chat, clips), max_tokens=MAX_NEW)
                    for chat in CHATS.values()
                    for _ in range(2)
                ]
            )

    results = asyncio.run(go())
    want = [expected[f"{cluster.arch}-{n}"] for n in CHATS for _ in range(2)]
    assert [without_eos(r.token_ids) for r in results] == want


def test_repeated_video_is_an_encoder_cache_hit_and_another_rate_is_not(cluster, clips, expected):
    if cluster.arch not in CACHE_ARCHS:
        pytest.skip("the cache is the same code for every architecture")
    got = {}
    for name, chat in CACHE_CHATS.items():
        r = post(cluster, chat.openai(clips[0]))
        assert r.status_code == 200, r.text
        assert without_eos(token_ids(r)) == expected[f"{cluster.arch}-{name}"]
        got[name] = r.json()["tandem"]["cached_image_tokens"]
    assert got["first"] == 0  # no earlier test sends this video at this rate
    assert got["again"] > 0  # the video's tokens, from the encoder's cache
    assert got["other_rate"] == 0  # other frames: another key


def test_a_video_given_as_frames_equals_transformers(cluster, clips, expected):
    """qwen-vl-utils' list-of-images `video` over HTTP and the SDK: transformers' processor
    fed the same PIL frames with their rate as video_metadata (do_sample_frames=False). The
    same frames again are a counted encoder-cache hit; at another rate they are not (the
    same pixels, but other positions)."""
    if cluster.arch not in CACHE_ARCHS:
        pytest.skip("a video given as frames is the same code for every architecture")
    got = {}
    for name, chat in FRAMES_CHATS.items():
        want = expected[f"{cluster.arch}-{name}"]
        r = post(cluster, chat.openai(clips[0]))
        assert r.status_code == 200, r.text
        assert without_eos(token_ids(r)) == want, name
        got[name] = r.json()["tandem"]["cached_image_tokens"]
        if name == "frames":
            with Client(cluster.grpc_address) as c:
                sdk = c.chat(sdk_messages(chat, clips), max_tokens=MAX_NEW)
            assert without_eos(sdk.token_ids) == want
    assert got["frames"] == 0 and got["frames_again"] > 0 and got["frames_rate"] == 0, got


def test_a_video_the_language_side_holds_is_skipped(cluster, clips, expected):
    """Cache-aware transfer: the second send of a chat finds its pages, the video's too,
    in the language instance's prefix cache; the encoder neither decodes nor encodes it."""
    if cluster.arch not in CACHE_ARCHS:
        pytest.skip("the prefix cache is the same code for every architecture")
    with Client(cluster.grpc_address) as c:
        first, again = (c.chat(sdk_messages(HELD, clips), max_tokens=MAX_NEW) for _ in "12")
    want = expected[f"{cluster.arch}-held"]
    assert without_eos(first.token_ids) == without_eos(again.token_ids) == want
    assert (first.timings.skipped_images, again.timings.skipped_images) == (0, 1)
    assert again.usage.cached_tokens > 0 and again.usage.cached_image_tokens == 0


# ---- limits ------------------------------------------------------------------------

LIMITS = (
    "--max-video-bytes 100000 --max-video-duration-s 8 --max-video-frames 100 "
    "--max-video-tokens 100 --max-videos-per-request 2 --allowed-url-hosts 127.0.0.1 "
    "--allow-private-urls --url-timeout-s 1"
)
MANY_FRAMES = Clip(32, 24, 121, 30)  # 4 s, 121 frames


class _Clips(http.server.BaseHTTPRequestHandler):
    clip = b""

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "video/mp4")
        self.send_header("Content-Length", str(len(self.clip)))
        self.end_headers()
        try:
            if self.path == "/slow.mp4":  # a byte every 0.2 s: past the encoder's 1 s
                for b in self.clip[:20]:
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    time.sleep(0.2)
                return
            self.wfile.write(self.clip)
        except (BrokenPipeError, ConnectionResetError):  # the encoder gave up: as it should
            pass

    def log_message(self, *_):
        pass


@pytest.fixture(scope="module")
def clip_server(clips):
    _Clips.clip = clips[0]["small"]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Clips)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def limited(checkpoint):
    cl = LocalCluster(str(checkpoint("qwen2_5_vl")), encoders=1, languages=1, encoder_args=LIMITS)
    cl.start()
    yield cl
    cl.stop()


def video_url(raw: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def one_video(url: str, copies: int = 1, **controls) -> list:
    """A user turn: the video (`copies` times), then a question."""
    part = {"type": "video_url", "video_url": {"url": url, **controls}}
    return [{"role": "user", "content": [part] * copies + [{"type": "text", "text": "What?"}]}]


def frames_video(frames: list[bytes]) -> list:
    """A user turn: a video given as frames (PNG data URLs, 2 per second), then a question."""
    urls = ["data:image/png;base64," + base64.b64encode(f).decode() for f in frames]
    part = {"type": "video", "video": urls, "fps": 2.0}
    return [{"role": "user", "content": [part, {"type": "text", "text": "What?"}]}]


def flat(w: int, h: int, shade: int) -> bytes:
    """A one-colour PNG: many pixels in few bytes."""
    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.new("RGB", (w, h), (shade, 2 * shade, 3 * shade)).save(buf, "PNG")
    return buf.getvalue()


def _cut(tmp_path) -> bytes:
    """A clip whose index is up front (faststart) and whose frames are cut off."""
    whole = make_clip(CLIPS["small"], tmp_path / "fs.mp4", movflags="faststart")
    return whole[: len(whole) * 6 // 10]


def test_each_limit_is_a_4xx_naming_it_and_others_are_served(
    limited, clips, expected, clip_server, tmp_path
):
    raw = clips[0]
    part = "messages[0].content[0].video_url"
    cases = {  # name: (messages, status, what the message names)
        "oversize": (one_video(video_url(raw["mid"])), 413, "max_video_bytes"),
        "too_long": (one_video(video_url(raw["avi"])), 400, "max_video_duration_s"),
        "too_many_frames": (one_video(video_url(make_clip(MANY_FRAMES))), 400, "max_video_frames"),
        "too_many_tokens": (
            one_video(video_url(raw["odd444"]), num_frames=60),
            400,
            "max_video_tokens",
        ),
        "corrupt": (one_video(video_url(_cut(tmp_path))), 400, "corrupt"),
        "empty": (one_video("data:video/mp4;base64,"), 400, "empty"),
        "not_a_video": (one_video(video_url(png(64, 48, 1))), 400, "not a decodable video"),
        "wrong_mime": (one_video(video_url(raw["small"], "image/png")), 400, "video/*"),
        "slow_url": (one_video(clip_server + "/slow.mp4"), 400, "timed out"),
        "too_many_videos": (
            one_video(video_url(raw["small"]), copies=3),
            400,
            "max_videos_per_request",
        ),
        "frames_tokens": (frames_video([flat(320, 240, i) for i in range(3)]), 400,
                          "max_video_tokens"),
        "frames_sizes": (
            frames_video([png(64, 48, 1), png(64, 48, 2), png(48, 64, 3)]),
            400,
            "one size",
        ),
    }
    params = {"too_many_videos": "messages", "frames_tokens": "messages[0].content[0].video",
              "frames_sizes": "messages[0].content[0].video[2]"}
    good = CHATS["alone"]
    with ThreadPoolExecutor(len(cases) + 1) as pool:
        served = pool.submit(post, limited, good.openai(raw))
        refused = {name: pool.submit(post, limited, msgs)
                   for name, (msgs, _, _) in cases.items()}
        for name, (_, status, names) in cases.items():
            r = refused[name].result()
            err = r.json()["error"]
            assert r.status_code == status, (name, r.text)
            assert err["param"] == params.get(name, part), name
            assert names in err["message"], (name, err)
        r = served.result()
    assert r.status_code == 200, r.text
    assert without_eos(token_ids(r)) == expected["qwen2_5_vl-alone"]
    # an allow-listed URL is fetched by the encoder: the same answer as the bytes
    url_chat = good.openai(raw)
    url_chat[1]["content"][0]["video_url"]["url"] = clip_server + "/clip.mp4"
    r = post(limited, url_chat)
    assert r.status_code == 200, r.text
    assert without_eos(token_ids(r)) == expected["qwen2_5_vl-alone"]


def test_an_empty_video_over_grpc_is_refused_by_the_encoder(limited):
    empty = common_pb2.ContentPart(video=common_pb2.VideoPart(data=b""))
    with Client(limited.grpc_address) as c, pytest.raises(InvalidRequestError) as e:
        c.chat([{"role": "user", "content": [empty, "what?"]}], max_tokens=2)
    assert e.value.field == "messages[0].content[0].video" and "empty" in e.value.message


def test_an_image_too_narrow_for_the_processor_is_a_400_naming_it(limited):
    url = "data:image/png;base64," + base64.b64encode(png(2000, 8, 1)).decode()
    parts = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    r = post(limited, [{"role": "user", "content": parts}])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[0].content[1].image_url"
