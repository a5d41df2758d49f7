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
"""

from __future__ import annotations

import asyncio
import io
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from encoder_peers.chats import chat, png  # noqa: E402

from tandem.chat import ChatError, ImageInput, Message  # noqa: E402
from tandem.services.encoder.config import EncoderConfig  # noqa: E402
from tandem.services.encoder.pipeline import EncodePipeline, MediaPart  # noqa: E402
from tandem.services.encoder.preprocess import GridOnly, ImageGeometry  # noqa: E402

ARCHS = ["qwen2_5_vl", "qwen3_vl"]
# (w, h): odd, tiny (a 1x1 and a 3-pixel side, which transformers could take for
# channels), very wide and tall (aspect ratio up to the limit of 200), large
SIZES = [(1, 1), (3, 3), (3, 5), (5, 3), (2, 300), (300, 2), (1, 200), (200, 1), (13, 7),
         (27, 29), (28, 28), (57, 56), (1000, 7), (7, 1000), (224, 224), (1023, 769),
         (2000, 10), (4000, 3000)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # NOTE: float32 rows are batch-invariant on CPU with one intra-op thread: the helper's
    # rows (its share alone in the ViT) equal the unsplit encode's (all in one batch)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def pipe(checkpoint, arch: str) -> EncodePipeline:
    return EncodePipeline.from_config(EncoderConfig(
        model=str(checkpoint(arch)), device="cpu", dtype="float32", linear_backend="torch"))


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
        out = [await p.encode(messages)]
        seen = [list(calls)]
        spans, total = out[0].payload.info.images, out[0].payload.num_tokens
        for first, end in shares:
            calls.clear()
            t1 = spans[end].start if end < len(spans) else total
            out.append(await p.encode(messages, part=MediaPart(0, first, end,
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
    assert e.value.field == "messages[0].content[1].image" and "truncated" in e.value.message

    async def encode_all():
        whole = await p.encode(with_first(good))
        span = whole.payload.info.images[1]
        part = MediaPart(0, 1, 2, span.start, whole.payload.num_tokens)
        res = await p.encode(with_first(truncated), part=part)
        errors = []
        for chat_, part_ in [
                (with_first(corrupt), part),  # a header it cannot read
                # a range whose media are not where its tokens say
                (with_first(good), MediaPart(0, 0, 1, span.start, whole.payload.num_tokens))]:
            try:
                await p.encode(chat_, part=part_)
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
