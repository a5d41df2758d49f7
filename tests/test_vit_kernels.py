"""The vision tower on the CPU kernels (services/encoder/vit/kernels.py): which modules it
swaps, that the rotary split out of qkv and the MLP's silu and product in place give
transformers' bits and the attention kernel its values, that the whole
tower stays within the packed path's tolerance of transformers' (torch's linears) on
images and videos, that a row's features do not depend on its batch, and that the static
step runs the swapped modules as the eager path does. float32, one CPU thread."""

from __future__ import annotations

import copy

import pytest
import torch
from encoder_peers.chats import FEATURE_ATOL_OF_MAX, FEATURE_RTOL

from tandem.cpu_kernels import kernels, pack_linears
from tandem.services.encoder.vit.kernels import (
    SDPA_MIN_ROWS,
    InPlaceGatedMLP,
    KernelRMSNorm,
    KernelVisionAttention,
    PackedPatchEmbed,
    pack_vision_tower,
)
from tandem.services.encoder.vit.runner import StepAttention, VisionRunner

KERNELS = kernels()
pytestmark = [pytest.mark.skipif(KERNELS is None, reason="no C++ toolchain to build the kernels"), pytest.mark.usefixtures("one_torch_thread")]
ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# a video (two temporal groups, frames over one window of Qwen2.5-VL) and two images
GRIDS = [(2, 10, 12), (1, 4, 6), (1, 8, 4)]




@pytest.fixture(scope="module")
def towers(checkpoint):
    """Per architecture: transformers' tower (torch's linears) and the kernels' tower."""
    from tandem.models.split import load_vision_part

    out = {}
    for arch in ARCHS:
        ref = load_vision_part(checkpoint(arch), torch.float32, "cpu").visual.eval()
        swapped = copy.deepcopy(ref)
        counts = pack_vision_tower(swapped, KERNELS)
        out[arch] = ref, swapped, counts
    return out


def _pixels(visual, grids, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    width = visual.patch_embed.proj.in_features if isinstance(visual.patch_embed, PackedPatchEmbed) \
        else visual.patch_embed.proj.weight[0].numel()
    return torch.randn(sum(t * h * w for t, h, w in grids), width, generator=g)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_module_the_kernels_take_is_swapped(towers, arch):
    ref, swapped, counts = towers[arch]
    depth = len(ref.blocks)
    qwen25 = arch == "qwen2_5_vl"
    assert counts["patch_embed"] == 1 and isinstance(swapped.patch_embed, PackedPatchEmbed)
    assert counts["attention"] == depth
    assert all(isinstance(b.attn, KernelVisionAttention) for b in swapped.blocks)
    assert counts["gated_mlp"] == (depth if qwen25 else 0)  # Qwen3-VL's MLP is not gated
    assert all(isinstance(b.mlp, InPlaceGatedMLP) == qwen25 for b in swapped.blocks)
    # Qwen2.5-VL: two norms a block and the merger's; Qwen3-VL's are LayerNorms
    assert counts["rms_norm"] == (2 * depth + 1 if qwen25 else 0)
    assert not any(isinstance(m, torch.nn.Linear) for m in swapped.modules())  # all packed
    assert not any(isinstance(m, torch.nn.Conv3d) for m in swapped.modules())


@pytest.mark.parametrize("arch", ARCHS)
def test_rotary_and_mlp_give_transformers_bits_and_attention_its_values(towers, arch):
    """With the same packed linears on both sides: the rotary split out of qkv by rope_qk
    and the MLP (silu and product in place) equal transformers' bit for bit; the attention
    kernel over the segments equals transformers' per-segment SDPA within float32
    rounding (another summation order)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    ref, swapped, _ = towers[arch]
    blk_ref = copy.deepcopy(ref.blocks[0])
    pack_linears(blk_ref, KERNELS)
    blk = swapped.blocks[0]
    g = torch.Generator().manual_seed(1)
    n, dim = 40, blk_ref.attn.qkv.in_features
    heads, hd = blk_ref.attn.num_heads, blk_ref.attn.head_dim
    x = torch.randn(n, dim, generator=g)
    angles = torch.randn(n, hd // 2, generator=g) * 3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    cu = torch.tensor([0, 16, 20, 36, 40], dtype=torch.int32)  # segments of 16, 4, 16, 4
    with torch.inference_mode():
        qkv = blk.attn.qkv(x)
        q, k = KERNELS.rope_qk(qkv, cos, sin, heads, heads)
        q_ref, k_ref, _ = qkv.reshape(n, 3, heads, hd).permute(1, 0, 2, 3).unbind(0)
        want_q, want_k = apply_rotary_pos_emb_vision(q_ref, k_ref, cos, sin)
        assert torch.equal(q, want_q) and torch.equal(k, want_k)
        want = blk_ref.attn(x, cu_seqlens=cu, position_embeddings=(cos, sin))
        got = blk.attn(x, cu_seqlens=cu, position_embeddings=(cos, sin))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
        # each segment attends to itself alone: another segment's rows change nothing
        x2 = x.clone()
        x2[20:] = torch.randn(20, dim, generator=g)
        assert torch.equal(blk.attn(x2, cu_seqlens=cu, position_embeddings=(cos, sin))[:20],
                           got[:20])
        if arch == "qwen2_5_vl":
            assert torch.equal(blk.mlp(x), blk_ref.mlp(x))


@pytest.mark.parametrize("arch", ARCHS)
def test_long_segments_attend_through_sdpa_as_transformers_does(towers, arch, monkeypatch):
    """Segments of SDPA_MIN_ROWS rows or more go to torch's SDPA, shorter ones (in runs) to
    the kernel: the output equals transformers' per-segment attention within float32
    rounding, each segment's rows equal that segment attended alone (whatever its
    neighbours), and the kernel is called for the runs of short segments only."""
    ref, swapped, _ = towers[arch]
    blk_ref = copy.deepcopy(ref.blocks[0])
    pack_linears(blk_ref, KERNELS)
    attn = swapped.blocks[0].attn
    g = torch.Generator().manual_seed(4)
    long = SDPA_MIN_ROWS + 16
    # short, long, two short, long, short: runs of short segments around the long ones
    lengths = [16, long, 4, 12, SDPA_MIN_ROWS, 8]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    n, dim, hd = int(cu[-1]), blk_ref.attn.qkv.in_features, blk_ref.attn.head_dim
    x = torch.randn(n, dim, generator=g)
    angles = torch.randn(n, hd // 2, generator=g) * 3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    calls = []
    real = KERNELS.segment_attention

    class Spy:  # the kernels with segment_attention's rows recorded
        def __getattr__(self, name):
            return getattr(KERNELS, name)

        def segment_attention(self, q, k, v, c, causal, scale):
            calls.append(c.tolist())
            return real(q, k, v, c, causal, scale)

    monkeypatch.setattr(attn, "kernels", Spy())
    with torch.inference_mode():
        want = blk_ref.attn(x, cu_seqlens=cu, position_embeddings=(cos, sin))
        got = attn(x, cu_seqlens=cu, position_embeddings=(cos, sin))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
        assert calls == [[0, 16], [0, 4, 16], [0, 8]]  # the short runs, rebased
        for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:], strict=True):
            alone = attn(x[a:b], cu_seqlens=torch.tensor([0, b - a]), position_embeddings=(
                cos[a:b], sin[a:b]))
            assert torch.equal(alone, got[a:b]), (a, b)


@pytest.mark.parametrize("arch", ARCHS)
def test_features_within_the_packed_tolerance_of_transformers(towers, arch):
    ref, swapped, _ = towers[arch]
    px = _pixels(ref, GRIDS)
    want = VisionRunner(ref).run(px, GRIDS)
    got = VisionRunner(swapped).run(px, GRIDS)
    for a, b in zip([got.embeds, *got.deepstack], [want.embeds, *want.deepstack], strict=True):
        atol = FEATURE_ATOL_OF_MAX * b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=FEATURE_RTOL, atol=atol)
        assert not torch.equal(a, b)  # the swapped tower really ran (its linears round otherwise)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_medium_has_the_same_features_alone_or_in_a_batch(towers, arch):
    _, swapped, _ = towers[arch]
    runner = VisionRunner(swapped)
    px = _pixels(swapped, GRIDS, seed=2)
    batch = runner.run(px, GRIDS)
    start = rows = 0
    merge = runner.unit
    for grid in GRIDS:
        n = grid[0] * grid[1] * grid[2]
        alone = runner.run(px[start : start + n], [grid])
        assert torch.equal(alone.embeds, batch.embeds[rows : rows + n // merge]), grid
        for a, b in zip(alone.deepstack, batch.deepstack, strict=True):
            assert torch.equal(a, b[rows : rows + n // merge])
        start, rows = start + n, rows + n // merge


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tower_with_long_segments_stays_within_tolerance_and_row_invariant(towers, arch):
    """An image whose frame is a segment of SDPA_MIN_ROWS rows or more (SDPA) beside a small
    one (the kernel): the features within the packed path's tolerance of transformers',
    and each image's rows equal to its rows encoded alone."""
    ref, swapped, _ = towers[arch]
    grids = [(1, 12, 16), (1, 4, 6)]  # a frame of 192 rows, then one of 24
    assert 12 * 16 >= SDPA_MIN_ROWS > 4 * 6
    px = _pixels(ref, grids, seed=5)
    want = VisionRunner(ref).run(px, grids)
    runner = VisionRunner(swapped)
    got = runner.run(px, grids)
    for a, b in zip([got.embeds, *got.deepstack], [want.embeds, *want.deepstack], strict=True):
        atol = FEATURE_ATOL_OF_MAX * b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=FEATURE_RTOL, atol=atol)
    first = 12 * 16
    for px_one, grid, rows in ((px[:first], grids[0], slice(0, first // runner.unit)),
                               (px[first:], grids[1], slice(first // runner.unit, None))):
        alone = runner.run(px_one, [grid])
        assert torch.equal(alone.embeds, got.embeds[rows]), grid
        for a, b in zip(alone.deepstack, got.deepstack, strict=True):
            assert torch.equal(a, b[rows])


@pytest.mark.parametrize("attention", [StepAttention.PER_SEGMENT, StepAttention.MASKED])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_static_step_runs_the_swapped_tower_as_the_eager_path(towers, arch, attention):
    _, swapped, _ = towers[arch]
    px = _pixels(swapped, GRIDS, seed=3)
    eager = VisionRunner(swapped).run(px, GRIDS)
    static = VisionRunner(swapped, max_patches=1024, mode="static", attention=attention)
    got = static.run(px, GRIDS)
    assert static.stats.replays == 1
    if attention is StepAttention.PER_SEGMENT:  # the same modules, padded: the same bits
        assert torch.equal(got.embeds, eager.embeds)
    else:  # one masked SDPA over the bucket: another summation order
        torch.testing.assert_close(got.embeds, eager.embeds, rtol=1e-5, atol=1e-5)


def test_the_norm_takes_any_leading_shape(towers):
    _, swapped, _ = towers["qwen2_5_vl"]
    norm = swapped.blocks[0].norm1
    assert isinstance(norm, KernelRMSNorm)
    x = torch.randn(3, 5, norm.weight.numel())
    assert torch.equal(norm(x), norm(x.reshape(15, -1)).view(3, 5, -1))


def test_only_float32_on_the_cpu_is_taken(checkpoint):
    from tandem.models.split import load_vision_part

    visual = load_vision_part(checkpoint("qwen2_5_vl"), torch.bfloat16, "cpu").visual
    with pytest.raises(ValueError, match="float32 on the CPU"):
        pack_vision_tower(visual, KERNELS)


def test_the_encoder_runs_the_swapped_tower_where_its_linears_are_packed(checkpoint):
    from tandem.services.encoder.config import EncoderConfig
    from tandem.services.encoder.pipeline import EncodePipeline

    for backend, swapped in (("packed_cpu", True), ("torch", False)):
        cfg = EncoderConfig(model=str(checkpoint("qwen2_5_vl")), device="cpu", dtype="float32",
                            linear_backend=backend)
        visual = EncodePipeline.from_config(cfg).scheduler.runners[0].visual
        assert isinstance(visual.patch_embed, PackedPatchEmbed) == swapped, backend
        assert isinstance(visual.blocks[0].attn, KernelVisionAttention) == swapped, backend
