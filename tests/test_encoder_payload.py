"""The encoder's prompt payload equals what transformers computes (float32): bit for bit
where the vision tower's linears are torch's, as on the oracle's side; within the stated
bound where our packed kernels replace them (encoder_peers/chats.py says which and why).

For every architecture and chats with 0, 1 and 3 images of different sizes: token ids,
text embeddings with image features spliced in (`get_input_embeddings` + `get_image_features`
+ `masked_scatter`), the Qwen3-VL deepstack columns, and `get_rope_index`'s positions and
delta. Then: batching many requests in one ViT call gives the same payloads as encoding
each alone, and a repeated image is a counted cache hit with an identical payload.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from encoder_peers.chats import assert_payload_matches, chat, oracle  # noqa: E402

from tandem.services.encoder.chat import EncodeJob  # noqa: E402
from tandem.services.encoder.config import EncoderConfig  # noqa: E402
from tandem.services.encoder.pipeline import EncodeHooks, EncodePipeline  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCHS = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]




_models: dict = {}


def oracle_model(path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import tandem  # noqa: F401

    if path not in _models:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        _models[path] = (model, AutoProcessor.from_pretrained(path))
    return _models[path]


def pipeline(path, **kw) -> EncodePipeline:
    cfg = EncoderConfig(model=str(path), device="cpu", dtype="float32", **kw)
    return EncodePipeline.from_config(cfg)


def run(coro_fn, pipe: EncodePipeline):
    async def main():
        pipe.start()
        try:
            return await coro_fn()
        finally:
            await pipe.stop()

    return asyncio.run(main())


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("arch", ARCHS)
def test_payload_matches_transformers(checkpoint, arch, backend):
    from tandem.cpu_kernels import kernels

    path = checkpoint(arch)
    model, processor = oracle_model(path)
    pipe = pipeline(path, linear_backend=backend)
    exact = backend == "torch" or kernels() is None  # "auto" packs them where they build
    nd = pipe.num_deepstack
    assert nd == (2 if arch.startswith("qwen3") else 0)
    chats = [chat(0, seed=1), chat(1, seed=2), chat(3, seed=3)]

    async def go():
        return [await pipe.encode(EncodeJob(c)) for c in chats]

    results = run(go, pipe)
    for c, res in zip(chats, results, strict=True):
        ref = oracle(model, processor, c)
        assert_payload_matches(res.payload, ref, nd, exact=exact)
        n_img = sum(1 for m in c for p in m.parts if not isinstance(p, str))
        assert len(res.image_hashes) == n_img and len(set(res.image_hashes)) == n_img
        if n_img:  # the images really differ in size, and pixels/grids match the processor
            prep = pipe.preprocessor(c)
            assert torch.equal(torch.tensor([im.grid for im in prep.images]), ref["grid"])
            assert len({im.grid for im in prep.images}) == n_img
            assert torch.equal(
                torch.cat([im.pixel_values for im in prep.images]), ref["pixel_values"]
            )
        else:
            assert res.payload.mrope_delta == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_equals_alone_and_cache_hits(checkpoint, arch):
    path = checkpoint(arch)
    chats = [chat(n, seed=10 + i) for i, n in enumerate([2, 1, 3, 0, 1, 2, 3])]
    chats.append(chat(2, seed=10))  # the same images as the first chat, arriving together

    alone_pipe = pipeline(path)

    async def alone():
        out = []
        for c in chats:
            alone_pipe.cache.entries.clear()
            alone_pipe.cache.bytes_used = 0
            out.append(await alone_pipe.encode(EncodeJob(c)))
        return out

    singles = run(alone, alone_pipe)
    assert alone_pipe.scheduler.batches == sum(len(r.image_hashes) and 1 or 0 for r in singles)

    pipe = pipeline(path)
    prepared = [pipe.preprocessor(c) for c in chats]
    n_images = sum(len(p.images) for p in prepared)

    async def together():
        # Every request enqueues before the batcher runs: one ViT call under the budget.
        feats = await asyncio.gather(*[pipe.scheduler.features(p.images) for p in prepared])
        return feats, [await pipe.encode(EncodeJob(c)) for c in chats]

    feats, again = run(together, pipe)
    assert pipe.scheduler.batches == 1
    distinct = len({im.hash for p in prepared for im in p.images})
    assert distinct < n_images  # the duplicate chat shared in-flight jobs
    for res_alone, f, p, res_again in zip(singles, feats, prepared, again, strict=True):
        emb = torch.cat([x.embeds for x in f.features]) if f.features else None
        alone_emb = res_alone.payload.input_embeds[p.input_ids == pipe.spec.image_token_id]
        if emb is not None:
            hidden = emb.shape[1]
            assert torch.equal(alone_emb[:, :hidden], emb)
        # second pass: every image is a cache hit, and the payload is identical
        assert res_again.cached_image_tokens == sum(im.num_tokens for im in p.images)
        assert torch.equal(res_again.payload.input_embeds, res_alone.payload.input_embeds)
        assert torch.equal(res_again.payload.mrope_positions, res_alone.payload.mrope_positions)
        assert torch.equal(res_again.payload.fill_ids, res_alone.payload.fill_ids)
    assert pipe.cache.hits == n_images  # the whole second pass
    assert pipe.cache.misses == n_images  # first pass: all missed (dupes shared jobs)
    assert pipe.scheduler.batches == 1  # hits never reach the ViT


@pytest.mark.parametrize("arch", ARCHS)
def test_streamed_payload_equals_whole(checkpoint, arch):
    """Streamed rows (`on_payload`): the payload is handed on before any ViT with its text
    rows, ids, positions and delta final, each image's rows fill in prompt order (one ViT
    call each), and the watermark stops at each image's first pad until its features are
    in; the finished payload equals the whole one bit for bit, also from a cached prefix
    that ends inside an image (its rows before the prefix's end are cut)."""
    path = checkpoint(arch)
    c = chat(3, seed=40)
    whole_pipe = pipeline(path)
    whole = run(lambda: whole_pipe.encode(EncodeJob(c)), whole_pipe).payload
    spans = whole.info.images
    assert len(spans) == 3
    for cached in (0, spans[1].start + 2):  # nothing held; a prefix ending inside image 1
        pipe = pipeline(path)
        seen, handed = [], []

        def on_payload(p, remote, handed=handed, seen=seen):
            assert remote == []  # no helpers: nothing written by another encoder
            handed.append((p.arrived.rows, p.mrope_delta, p.fill_ids.clone(),
                           p.mrope_positions.clone()))
            p.arrived.on_advance = lambda p=p, seen=seen: seen.append(p.arrived.rows)

        async def held(_info, cached=cached):
            return cached

        async def go(pipe=pipe, on_payload=on_payload, held=held):
            return await pipe.encode(EncodeJob(c), EncodeHooks(announce=held,
                                                                on_payload=on_payload))

        res = run(go, pipe)
        ref = whole.rows_from(cached) if cached else whole
        got = res.payload
        assert got.start == cached and got.arrived.complete
        for a, b in ((got.input_embeds, ref.input_embeds), (got.fill_ids, ref.fill_ids),
                     (got.mrope_positions, ref.mrope_positions)):
            assert torch.equal(a, b)
        assert got.mrope_delta == ref.mrope_delta
        # handed on before any ViT: the text before the first needed image, ids, positions
        rows0, delta0, ids0, pos0 = handed[0]
        first = next(sp for sp in spans if sp.start + sp.length > cached)
        assert rows0 == max(first.start - cached, 0)
        assert delta0 == ref.mrope_delta and torch.equal(ids0, ref.fill_ids)
        assert torch.equal(pos0, ref.mrope_positions)
        # the watermark then stops at each later image's first pad, and ends at the end
        later = [sp.start - cached for sp in spans if sp.start > max(cached, first.start)]
        assert seen == later + [ref.num_tokens]
        assert pipe.scheduler.batches == sum(1 for sp in spans if sp.start + sp.length > cached)
