"""The encoder's prompt payload for chats with videos equals what transformers computes from
its own video processor (tests/oracle/video_generate.py in `.oracle-venv`), bit for bit:
token ids (Qwen3-VL's timestamps included), every embedding row (video and image features,
Qwen3-VL's deepstack columns) with torch's linears in the vision tower, and
`get_rope_index`'s positions (Qwen2.5-VL's time axis scaled by second_per_grid_ts,
Qwen3-VL's per-group runs) and the decode positions generate() uses — for Qwen2.5-VL,
Qwen3-VL and
Qwen3-VL-MoE, videos alone and mixed with images and text, odd frame counts and sides,
2-10 s clips, fps and frame-count controls.

Then the caches: a repeated video is a counted embedding-cache hit with an identical payload
and is not decoded again; the same video at another rate that samples other frames is a
miss; a video wholly inside the prefix the language side holds is neither decoded nor run
through the ViT, and its span keys the prefix cache by its cache key.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from video_chats import Image, Video, VideoChat, oracle_results, write_clips

from tandem.chat import VideoOptions
from tandem.services.encoder.chat import EncodeJob
from tandem.services.encoder.config import EncoderConfig
from tandem.services.encoder.pipeline import EncodeHooks, EncodePipeline

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
CHATS = {
    "alone": VideoChat((Video("small"), "What happens in the clip?")),
    "mixed": VideoChat(("Compare", Image(3, (64, 48)), "with", Video("avi"), "please.")),
    "two_fps": VideoChat(
        (Video("mid"), Video("webm"), "Which is longer?"), VideoOptions(fps=1.5)
    ),  # qwen3_vl: 7 and 3 frames, odd counts
    "frames": VideoChat((Video("odd444"), "Describe."), VideoOptions(num_frames=6)),
}
CASES = {f"{arch}-{name}": (arch, chat) for arch in ARCHS for name, chat in CHATS.items()}




@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return write_clips(tmp_path_factory.mktemp("clips"))


@pytest.fixture(scope="module")
def oracle(clips, checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("oracle")
    return out, oracle_results(CASES, checkpoint, clips[1], out, max_new_tokens=2, payload=True)


_pipes: dict = {}


def pipeline(checkpoint, arch) -> EncodePipeline:
    if arch not in _pipes:  # torch's linears: the same operations as transformers'
        cfg = EncoderConfig(
            model=str(checkpoint(arch)), device="cpu", dtype="float32", linear_backend="torch"
        )
        _pipes[arch] = EncodePipeline.from_config(cfg)
    return _pipes[arch]


def run(pipe: EncodePipeline, coro_fn):
    async def main():
        pipe.start()
        try:
            return await coro_fn()
        finally:
            await pipe.scheduler.stop()
            pipe.scheduler.__init__(pipe.scheduler.runners, pipe.cache, pipe.scheduler.patch_budget,
                                    None)

    return asyncio.run(main())


@pytest.mark.parametrize("case_id", list(CASES))
def test_payload_equals_transformers(case_id, clips, oracle, checkpoint):
    arch, chat = CASES[case_id]
    out, results = oracle
    ref = results[case_id]
    pipe = pipeline(checkpoint, arch)
    res = run(pipe, lambda: pipe.encode(EncodeJob(chat.messages(clips[0]))))
    p = res.payload
    assert p.fill_ids.tolist() == ref["input_ids"]
    assert p.mrope_positions.tolist() == ref["positions"]
    # decode token i at i + delta, as generate() places it (one past the prompt's last
    # position; get_rope_index's delta, max + 1 - L, where the two agree)
    assert {tuple(d) for d in ref["decode_deltas"]} == {(p.mrope_delta,) * 3}
    if max(map(max, ref["positions"])) == max(r[-1] for r in ref["positions"]):
        assert p.mrope_delta == ref["delta"]
    want = torch.from_numpy(np.load(out / f"{case_id}.npy"))
    assert p.input_embeds.shape == want.shape
    assert torch.equal(p.input_embeds, want), "embedding rows differ"
    prep = pipe.preprocessor(chat.messages(clips[0]))
    assert [list(v.grid) for v in prep.videos] == ref["video_grid_thw"]
    if "second_per_grid_ts" in ref:
        got = [np.float32(v.plan.second_per_grid_t) for v in prep.videos]
        assert got == [np.float32(x) for x in ref["second_per_grid_ts"]]
    assert len(res.video_keys) == len(prep.videos) == res.decoded_videos


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_repeated_video_is_a_cache_hit_and_another_rate_is_not(arch, clips, checkpoint):
    pipe = pipeline(checkpoint, arch)
    chat = VideoChat((Video("mid"), "What happens?"), VideoOptions(fps=1.0))
    other = VideoChat((Video("mid"), "What happens?"), VideoOptions(fps=2.0))

    async def go():
        pipe.cache.entries.clear()
        pipe.cache.bytes_used = 0
        return [await pipe.encode(EncodeJob(c.messages(clips[0]))) for c in (chat, chat, other)]

    hits, misses = pipe.cache.hits, pipe.cache.misses
    first, again, other_rate = run(pipe, go)
    tokens = pipe.preprocessor(chat.messages(clips[0])).videos[0].num_tokens
    assert (first.decoded_videos, first.cached_image_tokens) == (1, 0)
    assert (again.decoded_videos, again.cached_image_tokens) == (0, tokens)  # not decoded
    assert torch.equal(again.payload.input_embeds, first.payload.input_embeds)
    assert torch.equal(again.payload.mrope_positions, first.payload.mrope_positions)
    assert other_rate.video_keys != first.video_keys
    assert (other_rate.decoded_videos, other_rate.cached_image_tokens) == (1, 0)
    assert (pipe.cache.hits - hits, pipe.cache.misses - misses) == (1, 2)


def test_a_video_the_language_side_holds_is_not_decoded(clips, checkpoint):
    pipe = pipeline(checkpoint, "qwen3_vl")
    chat = VideoChat((Video("small"), "Then", Image(5, (64, 64)), "what?"))
    seen = []

    async def holds_through_the_video(info):
        seen.append(info)
        return info.images[0].start + info.images[0].length + 1

    async def go():
        pipe.cache.entries.clear()
        pipe.cache.bytes_used = 0
        return await pipe.encode(EncodeJob(chat.messages(clips[0])),
                                 EncodeHooks(announce=holds_through_the_video))

    res = run(pipe, go)
    (info,) = seen
    video, image = info.images
    assert info.check() == ""
    assert video.hash == res.video_keys[0] and image.hash == res.image_hashes[0]
    # a Qwen3-VL video's span runs from its first pad to its last, timestamps between
    ids = info.token_ids[video.start : video.start + video.length]
    pad = pipe.spec.video_token_id
    assert ids[0] == ids[-1] == pad and ids.count(pad) < len(ids)
    assert (res.decoded_videos, res.skipped_images) == (0, 1)
    assert res.payload.start == video.start + video.length + 1


def _vit_inputs(pipe: EncodePipeline, clips) -> tuple[torch.Tensor, list]:
    """An image and a decoded video, batched as the scheduler batches them."""
    prep = pipe.preprocessor(CHATS["mixed"].messages(clips[0]))
    video = pipe.preprocessor.decode(prep.videos[0])
    image = prep.images[0]
    return torch.cat([image.pixel_values, video.pixel_values]), [image.grid, video.grid]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_the_static_vit_path_takes_videos_as_the_eager_one(clips, checkpoint, arch):
    """The graph-safe block loop (CUDA graphs' path, run eagerly on the CPU) over a batch
    holding a video: each frame is a segment of its own, as in transformers' tower."""
    from tandem.services.encoder.vit.runner import VisionRunner

    pipe = pipeline(checkpoint, arch)
    pixels, grids = _vit_inputs(pipe, clips)
    visual = pipe.scheduler.runners[0].visual
    eager = VisionRunner(visual, mode="eager").run(pixels, grids)
    runner = VisionRunner(visual, max_patches=8192, mode="static")
    static = runner.run(pixels, grids)
    assert runner.stats.replays == 1  # the batch fits a bucket: the static step ran
    assert torch.equal(static.embeds, eager.embeds)  # per segment on the CPU: bit-exact
    for s, e in zip(static.deepstack, eager.deepstack, strict=True):
        assert torch.equal(s, e)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_cuda_graphs_take_videos_as_eager(clips, checkpoint, arch, dtype):
    from tandem.models.split import load_vision_part
    from tandem.services.encoder.vit.runner import VisionRunner

    pixels, grids = _vit_inputs(pipeline(checkpoint, arch), clips)
    part = load_vision_part(checkpoint(arch), dtype, "cuda")
    tol = 2e-3 if dtype == torch.float32 else 5e-2
    graph = VisionRunner(part.visual, max_patches=8192, mode="graph")
    eager = VisionRunner(part.visual, mode="eager")
    for _ in range(2):  # replays of the graph captured at start-up
        g, e = graph.run(pixels, grids), eager.run(pixels, grids)
        torch.testing.assert_close(g.embeds, e.embeds, rtol=tol, atol=tol)
        for a, b in zip(g.deepstack, e.deepstack, strict=True):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert (graph.stats.captured, graph.stats.replays) == (len(graph.keys), 2)
