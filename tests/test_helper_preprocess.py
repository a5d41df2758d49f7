"""A helper of a split prompt prepares only its share's images (issue 27; preprocess.py
`pixels_for`, pipeline `part`): the other images are grid-only, their grids computed from
their sizes by the processor's own smart_resize (ImageGeometry), never resized,
normalised, patchified or hashed.

- ImageGeometry's grid is the image processor's, for odd, tiny, very wide and large
  sizes and min/max pixel bounds, with each architecture's processor (Qwen2.5-VL: patch
  14; Qwen3-VL: patch 16), read off the processor.
- A chat preprocessed grid-only renders the same token ids, grids and token counts as
  the full path; a grid-only image's pixels and key refuse to be read (GridOnly).
- A helper's part calls the image processor only on its share's images, and its rows of
  the payload are the unsplit encode's, bit for bit; a header-only read is all an image
  outside its share gets (a truncated one passes, a corrupt header is a clean refusal).
- Given the lead's grids of the images outside its share (RangeStart.image_grids,
  MediaPart.grids), a helper fetches none of them (URL images on a local server
  that counts requests), its rows still bit-equal to the unsplit encode's; without them
  (a lead from before the field) it fetches them for their headers, as before. Every
  grid the processor gives is within ImageGeometry's bound; a wrong count or grid (a
  video's t, odd or empty sides, over the image's pixel bound, int32 extremes) is an
  INVALID_ARGUMENT on `image_grids`, before anything is fetched.
- End to end (a real lead, helper and language instance: test_split.Trio): the lead
  sends the grids and the bytes its share's URLs answered (services/encoder/chat.py
  `inline_fetched`), so every URL is fetched once, by the lead; the answer equals
  transformers' generate(); an EncodeRange with bad grids fails INVALID_ARGUMENT. A URL
  that would answer a second fetch with another image is never fetched again: the
  helper's range is its own, the answer the lead's images'. (A helper that did fetch
  another image refuses its range: the keys check, above.)
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import http.server
import io
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from encoder_peers.chats import chat, png, to_proto  # noqa: E402

from tandem.chat import ChatError, ImageInput, Message  # noqa: E402
from tandem.services.encoder.chat import EncodeJob  # noqa: E402
from tandem.services.encoder.config import EncoderConfig  # noqa: E402
from tandem.services.encoder.pipeline import NO_HOOKS, EncodePipeline  # noqa: E402
from tandem.services.encoder.preprocess import GridOnly, ImageGeometry  # noqa: E402
from tandem.services.encoder.split import MediaPart, grids_outside  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCHS = ["qwen2_5_vl", "qwen3_vl"]
# (w, h): odd, tiny (a 1x1 and a 3-pixel side, which transformers could take for
# channels), very wide and tall (aspect ratio up to the limit of 200), large
SIZES = [(1, 1), (3, 3), (3, 5), (5, 3), (2, 300), (300, 2), (1, 200), (200, 1), (13, 7),
         (27, 29), (28, 28), (57, 56), (1000, 7), (7, 1000), (224, 224), (1023, 769),
         (2000, 10), (4000, 3000)]




def pipe(checkpoint, arch: str, **config) -> EncodePipeline:
    return EncodePipeline.from_config(EncoderConfig(
        model=str(checkpoint(arch)), device="cpu", dtype="float32", linear_backend="torch",
        **config))


@pytest.mark.parametrize("arch", ARCHS)
def test_the_grid_rule_is_the_image_processors(checkpoint, arch):
    ip = pipe(checkpoint, arch).preprocessor.processor.image_processor
    geometry = ImageGeometry.of(ip)
    assert (geometry.patch, geometry.merge) == ((14, 2) if arch == "qwen2_5_vl" else (16, 2))
    f = geometry.patch * geometry.merge
    lo, hi = int(ip.size["shortest_edge"]), int(ip.size["longest_edge"])
    for w, h in SIZES:
        for bounds in [(lo, hi), (f * f, f * f * 4), (f * f * 16, f * f * 16), (1, 10**7),
                       (hi, hi * 4)]:
            out = ip(images=[Image.new("RGB", (w, h), (9, 99, 199))],
                     size={"shortest_edge": bounds[0], "longest_edge": bounds[1]},
                     return_tensors="pt")
            want = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
            assert geometry.grid(h, w, *bounds) == want, (w, h, bounds)
            # a lead's grid for it passes a helper's check (the bound holds)
            assert geometry.check(want, *bounds, w * h) is None, (w, h, bounds, want)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_grid_only_chat_renders_as_the_full_one(checkpoint, arch):
    pre = pipe(checkpoint, arch).preprocessor
    lim = pre.limits
    # per-image bounds (clamped into the server's), on sizes of every kind
    bounds = [(None, None), (None, lim.min_pixels * 3), (lim.max_pixels // 2, None),
              (lim.min_pixels * 5, lim.min_pixels * 5)]
    parts: list = ["Look:"]
    for k, (w, h) in enumerate(s for s in SIZES if s[0] * s[1] <= 300_000):  # 16 images
        lo, hi = bounds[k % len(bounds)]
        parts += [ImageInput(data=png(w, h, k), min_pixels=lo, max_pixels=hi), f"then {k}"]
    messages = [Message("user", tuple(parts))]
    full = pre(messages)
    grids = pre(messages, pixels_for=())
    assert torch.equal(full.input_ids, grids.input_ids)
    assert torch.equal(full.mm_token_type_ids, grids.mm_token_type_ids)
    assert [(m.grid, m.num_tokens, m.field) for m in grids.images] == [
        (m.grid, m.num_tokens, m.field) for m in full.images]
    assert all(m.prepared for m in full.images)
    for m in grids.images:
        assert not m.prepared and m.pixels is None and m.digest is None
        for attr in ("pixel_values", "hash", "key"):
            with pytest.raises(GridOnly):
                getattr(m, attr)
    # some prepared, some not: the ones named
    some = pre(messages, pixels_for={1, 3})
    assert [m.prepared for m in some.images] == [k in (1, 3) for k in range(len(some.images))]
    assert some.images[3].hash == full.images[3].hash
    assert torch.equal(some.images[1].pixel_values, full.images[1].pixel_values)


def _run(p: EncodePipeline, coro_fn):
    async def main():
        p.start()
        try:
            return await coro_fn()
        finally:
            await p.stop()

    return asyncio.run(main())


@pytest.mark.parametrize("arch", ARCHS)
def test_a_helper_prepares_only_its_share(checkpoint, arch, monkeypatch):
    p = pipe(checkpoint, arch)
    ip = p.preprocessor.processor.image_processor
    calls: list[tuple[int, int]] = []
    real = ip.preprocess

    def counting(images, *a, **kw):
        calls.extend(im.size for im in images)
        return real(images, *a, **kw)

    monkeypatch.setattr(ip, "preprocess", counting)
    messages = chat(4, seed=71)
    sizes = [Image.open(io.BytesIO(part.data)).size
             for part in messages[1].parts if isinstance(part, ImageInput)]

    async def encode_all():
        out = [await p.encode(EncodeJob(messages))]
        seen = [list(calls)]
        spans, total = out[0].payload.info.images, out[0].payload.num_tokens
        for first, end in shares:
            calls.clear()
            t1 = spans[end].start if end < len(spans) else total
            out.append(await p.encode(EncodeJob(messages), NO_HOOKS, MediaPart(0, first, end,
                                                                spans[first].start, t1)))
            seen.append(list(calls))
        return out, seen

    shares = [(2, 4), (1, 3)]
    (whole, *parts), seen = _run(p, encode_all)
    assert seen[0] == sizes  # the lead: every image
    spans, total = whole.payload.info.images, whole.payload.num_tokens
    for (first, end), res, called in zip(shares, parts, seen[1:], strict=True):
        t0 = spans[first].start
        t1 = spans[end].start if end < len(spans) else total
        assert called == sizes[first:end]  # only its share through the image processor
        assert res.image_hashes == whole.image_hashes[first:end]
        assert res.payload.info is None  # a helper announces nothing
        got, want = res.payload, whole.payload
        assert torch.equal(got.fill_ids, want.fill_ids)
        assert torch.equal(got.mrope_positions, want.mrope_positions)
        assert got.mrope_delta == want.mrope_delta
        assert torch.equal(got.input_embeds[t0:t1], want.input_embeds[t0:t1])


def test_a_helper_reads_only_the_header_of_an_image_outside_its_share(checkpoint):
    p = pipe(checkpoint, "qwen2_5_vl")
    good = png(120, 90, 5)
    truncated = good[: len(good) // 2]  # its header whole: the lead refuses it, not a helper
    corrupt = b"\x89PNG\r\n\x1a\n" + b"\0" * 64

    def with_first(data: bytes) -> list[Message]:
        return [Message("user", ("A", ImageInput(data=data), "B", ImageInput(data=good), "C"))]

    with pytest.raises(ChatError) as e:
        p.preprocessor(with_first(truncated))  # fully preprocessed (the lead): refused
    # Tandem's words (PIL's own, after them, say "truncated" too)
    assert e.value.field == "messages[0].content[1].image"
    assert e.value.message.startswith("image data is truncated or corrupt"), e.value.message

    async def encode_all():
        whole = await p.encode(EncodeJob(with_first(good)))
        span = whole.payload.info.images[1]
        part = MediaPart(0, 1, 2, span.start, whole.payload.num_tokens)
        res = await p.encode(EncodeJob(with_first(truncated)), NO_HOOKS, part)
        errors = []
        for chat_, part_ in [
                (with_first(corrupt), part),  # a header it cannot read
                # a range whose media are not where its tokens say
                (with_first(good), MediaPart(0, 0, 1, span.start, whole.payload.num_tokens))]:
            try:
                await p.encode(EncodeJob(chat_), NO_HOOKS, part_)
                errors.append(None)
            except ChatError as e:
                errors.append(e)
        return whole, span, res, errors

    whole, span, res, (corrupt_header, misplaced) = _run(p, encode_all)
    assert torch.equal(res.payload.input_embeds[span.start:],
                       whole.payload.input_embeds[span.start:])
    assert (corrupt_header.code, corrupt_header.field) == (
        "INVALID_ARGUMENT", "messages[0].content[1].image")  # a clean refusal, no crash
    assert (misplaced.code, misplaced.field) == ("INVALID_ARGUMENT", "range")


class _Images(http.server.BaseHTTPRequestHandler):
    """Serves `files` by path and counts each path's GETs (`gets`)."""

    files: dict[str, bytes] = {}
    gets: collections.Counter = collections.Counter()

    def do_GET(self):  # noqa: N802
        self.gets[self.path] += 1
        body = self.files.get(self.path)
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


URLS = {"allowed_url_hosts": ["127.0.0.1"], "allow_private_urls": True}


SIZES_OF_URL_CHAT = ((64, 48), (40, 150), (120, 90), (56, 84))


def url_chat(server: str, seed: int, sizes=SIZES_OF_URL_CHAT,
             max_pixels: int | None = None) -> tuple[list[Message], list[Message], list[str]]:
    """The same chat with its images as URLs on `server` and as data; the URLs' paths.
    Image 0 carries a per-image max_pixels (its grid: the clamped bounds')."""
    url_parts: list = [f"Compare these, case {seed}:"]
    data_parts: list = list(url_parts)
    paths = []
    for k, (w, h) in enumerate(sizes):
        path = f"/{seed}/{k}.png"
        _Images.files[path] = png(w, h, seed * 10 + k)
        hi = max_pixels if k == 0 else None
        url_parts += [ImageInput(url=server + path, max_pixels=hi), f"and image {k}"]
        data_parts += [ImageInput(data=_Images.files[path], max_pixels=hi), f"and image {k}"]
        paths.append(path)
    system = Message("system", ("You are terse.",))
    return ([system, Message("user", tuple(url_parts))],
            [system, Message("user", tuple(data_parts))], paths)


def url_trio(ckpt: Path):
    """test_split.Trio (started) whose encoders fetch URLs from this test's image server."""
    from test_split import Trio

    trio = Trio(ckpt)
    trio.lead_cfg = trio.lead_cfg.model_copy(update=URLS)
    trio.helper_cfg = trio.helper_cfg.model_copy(update=URLS)
    return trio.start()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_helper_given_grids_fetches_nothing_outside_its_share(checkpoint, arch, image_server):
    p = pipe(checkpoint, arch, **URLS)
    lim = p.preprocessor.limits
    messages, _, paths = url_chat(image_server, 40 + ARCHS.index(arch),
                                  max_pixels=lim.min_pixels * 3)
    first, end = 1, 3  # images 0 and 3 outside the share

    async def encode_all():
        whole = await p.encode(EncodeJob(messages))
        fetched = {path: _Images.gets[path] for path in paths}
        lead = p.preprocessor(messages)  # what the lead sends: its grids of the others
        grids = tuple(grids_outside(lead.media, first, end))
        spans = whole.payload.info.images
        part = MediaPart(0, first, end, spans[first].start, spans[end].start, grids)
        _Images.gets.clear()
        given = await p.encode(EncodeJob(messages), NO_HOOKS, part)
        with_grids = {path: _Images.gets[path] for path in paths}
        _Images.gets.clear()  # a lead from before image_grids: the headers read
        old = await p.encode(EncodeJob(messages), NO_HOOKS, MediaPart(*[getattr(part, f) for f in (
            "start", "first_media", "end_media", "first_token", "end_token")]))
        without = {path: _Images.gets[path] for path in paths}
        return whole, fetched, grids, given, with_grids, old, without

    whole, fetched, grids, given, with_grids, old, without = _run(p, encode_all)
    assert fetched == dict.fromkeys(paths, 1)  # the lead fetches each image once
    assert len(grids) == 2
    # given grids: only its share's images fetched
    assert with_grids == {paths[0]: 0, paths[1]: 1, paths[2]: 1, paths[3]: 0}
    assert without == dict.fromkeys(paths, 1)  # the fallback: every image, for its header
    spans = whole.payload.info.images
    t0, t1 = spans[first].start, spans[end].start
    for res in (given, old):
        got, want = res.payload, whole.payload
        assert res.image_hashes == whole.image_hashes[first:end]
        assert torch.equal(got.fill_ids, want.fill_ids)
        assert torch.equal(got.mrope_positions, want.mrope_positions)
        assert got.mrope_delta == want.mrope_delta
        assert torch.equal(got.input_embeds[t0:t1], want.input_embeds[t0:t1])


def test_a_helper_whose_url_answers_differently_refuses_its_range(checkpoint, image_server):
    """The lead sends the keys of the share's media (RangeStart.media_keys); a helper that
    fetched another image under the same URL (same size: the same grid and tokens) refuses
    its range (ABORTED: the lead encodes it) instead of writing that image's rows under the
    key the lead announced; the same image passes; a wrong count is INVALID_ARGUMENT."""
    p = pipe(checkpoint, "qwen2_5_vl", **URLS)
    messages, _, paths = url_chat(image_server, 60)
    first, end = 1, 3

    async def encode_all():
        whole = await p.encode(EncodeJob(messages))
        lead = p.preprocessor(messages)
        keys = tuple(m.key for m in lead.media[first:end])
        spans = whole.payload.info.images
        part = MediaPart(0, first, end, spans[first].start, spans[end].start,
                         tuple(grids_outside(lead.media, first, end)), keys)
        same = await p.encode(EncodeJob(messages), NO_HOOKS, part)
        errors = []
        for part_ in (dataclasses.replace(part, keys=keys[:1]), part):
            if part_ is part:  # image 2's URL now answers with another image, same size
                _Images.files[paths[2]] = png(120, 90, 999)
            try:
                await p.encode(EncodeJob(messages), NO_HOOKS, part_)
                errors.append(None)
            except ChatError as e:
                errors.append(e)
        return same, errors

    same, (miscounted, changed) = _run(p, encode_all)
    assert same.image_hashes  # its own keys equal the lead's: encoded
    assert (miscounted.code, miscounted.field) == ("INVALID_ARGUMENT", "media_keys")
    assert (changed.code, changed.field) == ("ABORTED", "media_keys")
    assert "medium 2" in changed.message


def test_bad_grids_are_refused_before_anything_is_fetched(checkpoint, image_server):
    p = pipe(checkpoint, "qwen2_5_vl", **URLS)
    pre = p.preprocessor
    lim = pre.limits
    messages, _, paths = url_chat(image_server, 50, max_pixels=lim.min_pixels * 3)
    grids = grids_outside(pre(messages).media, 1, 3)  # images 0 (small max_pixels) and 3
    geometry, big = pre.geometry, 2**31 - 1
    most0 = geometry.most_patches(lim.min_pixels, lim.min_pixels * 3,
                                  lim.image.max_source_pixels)
    most3 = geometry.most_patches(lim.min_pixels, lim.max_pixels, lim.image.max_source_pixels)
    assert grids[0][1] * grids[0][2] <= most0 < most3
    # just over image 0's bound (its max_pixels override), within the encoder's own
    over0 = next((1, 2, w) for w in range(2, 10**6, 2) if 2 * w > most0)
    assert 2 * over0[2] <= most3
    bad = {
        "none for one image": grids[:1],
        "one too many": [*grids, grids[0]],
        "a video's t": [(2, *grids[0][1:]), grids[1]],
        "odd side": [(1, grids[0][1] + 1, grids[0][2]), grids[1]],
        "no rows": [(1, 0, grids[0][2]), grids[1]],
        "negative": [grids[0], (1, -2, -2)],
        "over image 0's pixels": [over0, grids[1]],
        "int32 extremes": [grids[0], (1, big - 1, big - 1)],
        "int32 t": [(big, 2, 2), grids[1]],
    }
    _Images.gets.clear()
    for name, given in bad.items():
        with pytest.raises(ChatError) as e:
            pre(messages, pixels_for=range(1, 3), other_grids=given)
        assert (e.value.code, e.value.field) == ("INVALID_ARGUMENT", "image_grids"), name
    assert not _Images.gets  # refused before any fetch
    # the good ones pass, fetching only the share
    out = pre(messages, pixels_for=range(1, 3), other_grids=grids)
    assert [m.grid for k, m in enumerate(out.media) if k in (0, 3)] == grids
    assert dict(_Images.gets) == {paths[1]: 1, paths[2]: 1}


@pytest.mark.timeout(420)
def test_the_lead_sends_grids_end_to_end(checkpoint, image_server):
    """A real lead, helper and language instance (test_split.Trio), the chat's images URLs
    on the counting server: the lead fetches each once and hands the helper (the second
    share: images 2 and 3) the bytes of its own, so the helper fetches nothing; the answer
    equals generate(); an EncodeRange whose grids are wrong fails."""
    from test_stream import HANG_GUARD_S, expected

    from tandem.v1 import encoder_pb2, encoder_pb2_grpc

    ckpt = checkpoint("qwen2_5_vl")
    messages, data, paths = url_chat(image_server, 60)
    want = expected(ckpt, data)
    trio = url_trio(ckpt)
    try:
        _Images.gets.clear()
        tokens, res = trio.call(trio.generate(messages))
        assert isinstance(res, encoder_pb2.EncodeResponse), (res, trio.language_error)
        assert tokens == want
        lead, helper = res.ranges
        assert helper.encoder == trio.helper and not helper.fell_back
        mine = range(helper.first_media, helper.first_media + helper.media)
        assert len(mine) and 0 not in mine
        # every image once, by the lead: the helper got its share's bytes from it
        assert dict(_Images.gets) == dict.fromkeys(paths, 1)

        async def range_with(grids) -> encoder_pb2.EncodeRangeResponse:
            async with grpc.aio.insecure_channel(trio.helper) as ch:
                start = encoder_pb2.RangeStart(
                    request=encoder_pb2.EncodeRequest(room=7, messages=to_proto(messages)),
                    first_media=1, media=2, first_token=1, end_token=2, image_grids=grids)
                call = encoder_pb2_grpc.EncoderStub(ch).EncodeRange(
                    iter([encoder_pb2.EncodeRangeRequest(start=start)]))
                async for msg in call:
                    if msg.WhichOneof("msg") == "failed":
                        return msg
                raise AssertionError("the range ended without failing")

        _Images.gets.clear()
        for grids in ([encoder_pb2.ImageGrid(temporal=1, height=4, width=4)],
                      [encoder_pb2.ImageGrid(temporal=1, height=2**30, width=2**30)] * 2):
            failed = asyncio.run_coroutine_threadsafe(range_with(grids), trio.loop).result(
                HANG_GUARD_S)
            assert failed.failed.error.code == "INVALID_ARGUMENT", failed
            assert failed.failed.error.message.startswith("image_grids: "), failed
        assert not _Images.gets
    finally:
        trio.stop()


@pytest.mark.timeout(420)
def test_a_url_that_would_answer_again_differently_is_fetched_once(checkpoint,
                                                                     image_server):
    """The helper's share's first image is a URL that would answer a second fetch with
    another image of the same size. Nothing fetches it twice: the helper takes the bytes
    the lead got, its range is its own (no fall back), and the answer is the one for the
    images the lead fetched, never a mix (before the lead passed its bytes on, the helper
    fetched the other image, and only the keys check kept its rows out)."""
    from test_stream import expected

    from tandem.v1 import encoder_pb2

    ckpt = checkpoint("qwen2_5_vl")
    messages, data, paths = url_chat(image_server, 70)
    want = expected(ckpt, data)
    trio = url_trio(ckpt)
    first_of_share, share_size = None, None
    original = dict(_Images.files)

    serve = _Images.do_GET

    def swapping(self):
        """The share's first image answers its second GET with another image."""
        if self.path == first_of_share and self.gets[self.path] == 1:
            w, h = share_size  # the same size: the same grid and tokens
            self.files[self.path] = png(w, h, 7777)
        serve(self)

    try:
        # which image opens the helper's share: the split of the same chat, unchanged
        _, res = trio.call(trio.generate(messages))
        helper = res.ranges[1]
        share_size = SIZES_OF_URL_CHAT[helper.first_media]
        messages, data, paths = url_chat(image_server, 71)  # fresh URLs, no cache hit
        want = expected(ckpt, data)
        first_of_share = paths[helper.first_media]
        _Images.gets.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_Images, "do_GET", swapping)
            tokens, res = trio.call(trio.generate(messages))
        assert isinstance(res, encoder_pb2.EncodeResponse), (res, trio.language_error)
        assert _Images.gets[first_of_share] == 1  # the lead's fetch alone
        assert tokens == want
        assert [(r.encoder, r.fell_back) for r in res.ranges] == [("", False),
                                                                  (trio.helper, False)]
    finally:
        _Images.files.clear()
        _Images.files.update(original)
        trio.stop()


def test_inline_fetched_replaces_the_urls_of_the_given_media_only():
    """Media are counted as the chat template lists them (images and videos, prompt order,
    across messages); a named image's URL becomes the bytes, its pixel bounds kept; a
    video is never replaced."""
    from tandem.services.encoder.chat import inline_fetched
    from tandem.v1 import common_pb2

    def image(url: str, **kw) -> common_pb2.ContentPart:
        return common_pb2.ContentPart(image=common_pb2.ImagePart(url=url, **kw))

    video = common_pb2.ContentPart(video=common_pb2.VideoPart(url="http://h/v.mp4"))
    messages = [
        common_pb2.ChatMessage(role="system", content=[common_pb2.ContentPart(text="hi")]),
        common_pb2.ChatMessage(role="user", content=[
            image("http://h/0.png"), common_pb2.ContentPart(text="and"), video]),
        common_pb2.ChatMessage(role="user", content=[image("http://h/2.png", max_pixels=9),
                                                     image("http://h/3.png")]),
    ]
    inline_fetched(messages, {2: b"two"})
    parts = [p for m in messages for p in m.content if p.WhichOneof("part") != "text"]
    assert [p.image.WhichOneof("source") if p.WhichOneof("part") == "image" else "video"
            for p in parts] == ["url", "video", "data", "url"]
    assert (parts[2].image.data, parts[2].image.max_pixels) == (b"two", 9)
    with pytest.raises(ValueError, match="video"):
        inline_fetched(messages, {1: b"x"})
