"""A video's temporal groups as units of ViT work (services/encoder/units.py, issue 27):
groups [g0, g1) through the tower give rows [g0, g1) of the whole video's features bit for
bit (the packed CPU linears are batch-invariant; each frame group is its own attention
segment), and a streamed payload filled group by group (`video_chunk_patches`: one group
per ViT input) equals the whole payload bit for bit, its watermark stopping at each run's
first pad. The whole payload is transformers' (tests/test_video_payload.py), so the
streamed and split ones are too. A video streamed in runs is cached whole as well: a
repeat is one counted hit."""

from __future__ import annotations

import pytest
import torch
from test_video_payload import run
from video_chats import Image, Video, VideoChat, write_clips

from tandem.services.encoder.chat import EncodeJob
from tandem.services.encoder.config import EncoderConfig
from tandem.services.encoder.pipeline import EncodeHooks, EncodePipeline

CHAT = VideoChat(("Compare", Image(3, (64, 48)), "with", Video("avi"), "please."))


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return write_clips(tmp_path_factory.mktemp("clips"))


def pipeline(checkpoint, arch, chunk: int = 0) -> EncodePipeline:
    cfg = EncoderConfig(model=str(checkpoint(arch)), device="cpu", dtype="float32",
                        video_chunk_patches=chunk)  # the default linears: packed on CPU
    return EncodePipeline.from_config(cfg)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_video_groups_through_the_vit_equal_the_whole_video(clips, checkpoint, arch):
    pipe = pipeline(checkpoint, arch)
    prep = pipe.preprocessor(CHAT.messages(clips[0]))
    video = pipe.preprocessor.decode(prep.videos[0])
    t, h, w = video.plan.grid
    assert t >= 4
    runner = pipe.scheduler.runners[0]
    whole = runner.run(video.pixel_values, [(t, h, w)])
    tok = video.num_tokens // t
    for g0, g1 in ((0, 1), (1, t), (0, t // 2), (t // 2, t), (t - 1, t)):
        part = runner.run(video.pixel_values[g0 * h * w : g1 * h * w], [(g1 - g0, h, w)])
        assert torch.equal(part.embeds, whole.embeds[g0 * tok : g1 * tok])
        for a, b in zip(part.deepstack, whole.deepstack, strict=True):
            assert torch.equal(a, b[g0 * tok : g1 * tok])


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_streamed_video_payload_fills_group_by_group_and_equals_the_whole(clips, checkpoint,
                                                                          arch):
    messages = CHAT.messages(clips[0])
    whole_pipe = pipeline(checkpoint, arch)
    whole = run(whole_pipe, lambda: whole_pipe.encode(EncodeJob(messages))).payload
    probe = whole_pipe.preprocessor(messages)
    t, h, w = probe.videos[0].grid
    pipe = pipeline(checkpoint, arch, chunk=h * w)  # one temporal group per ViT input
    seen: list[int] = []

    def on_payload(p, remote):
        assert remote == []
        p.arrived.on_advance = lambda: seen.append(p.arrived.rows)

    async def twice():
        first = await pipe.encode(EncodeJob(messages), EncodeHooks(on_payload=on_payload))
        return first, await pipe.encode(EncodeJob(messages))

    res, again = run(pipe, twice)
    got = res.payload
    for a, b in ((got.input_embeds, whole.input_embeds), (got.fill_ids, whole.fill_ids),
                 (got.mrope_positions, whole.mrope_positions)):
        assert torch.equal(a, b)
    assert got.mrope_delta == whole.mrope_delta
    # the watermark rose once per group of the video (and once at the end)
    ids = whole.fill_ids.tolist()
    vid = [i for i, x in enumerate(ids) if x == pipe.spec.video_token_id]
    per = len(vid) // t
    group_starts = [vid[g * per] for g in range(1, t)]
    assert all(g in seen for g in group_starts), (seen, group_starts)
    assert seen[-1] == got.num_tokens

    # streamed in runs, the video is cached whole too: a repeat is a hit, not a ViT run
    assert again.cached_image_tokens >= probe.videos[0].num_tokens
    assert torch.equal(again.payload.input_embeds, whole.input_embeds)
