"""The vision tower on our CPU kernels (tandem/cpu_kernels.py): float32 on the CPU, where
the encoder packs its linears (`linear_backend` auto or packed_cpu).

`pack_vision_tower(visual, kernels)` swaps transformers' modules of a Qwen2.5-VL or
Qwen3-VL tower for ones that call the kernels, then packs every nn.Linear left
(`cpu_kernels.pack_linears`):

    patch_embed   a Conv3d whose kernel is its stride, over patches already flattened in
                  the kernel's (C, T, P, P) order: one packed linear (MKL-DNN's Conv3d ran
                  it at ~1/6 of the packed kernel's pace: 160 ms of a 30 s clip's 1.0 s ViT)
    attention     packed qkv -> `rope_qk` (the rotary, split out of qkv) -> each frame
                  or window attends to itself: segments under SDPA_MIN_ROWS rows (windows,
                  small images) by `segment_attention`, one call for a run of them instead
                  of one SDPA call each; longer ones by torch's SDPA, one call each (its
                  CPU flash kernel runs them 1.3-2x faster than ours here) -> packed proj
    MLP           Qwen2.5-VL's gated MLP: torch's silu and product in place on the gate's
                  output (Qwen3-VL's MLP is not gated: its linears are packed, as all)
    RMSNorm       Qwen2.5-VL's: `rms_norm` (Qwen3-VL's LayerNorms stay torch's)

Each module keeps the call signature and the attributes the vision runner reads
(`attn.qkv`, `attn.proj`, `attn.num_heads`, `attn.scaling`: runner.py's static step), so
the eager and the static paths both run them.

Row invariance (runner.py's module doc) holds: the packed linear is batch-invariant,
`rope_qk`, `rms_norm` and the MLP's pointwise steps work row by row, and a segment's
attention reads that segment alone, on a path its length alone picks. Against transformers
(one SDPA call per segment: a long segment's is the same call here): `rope_qk` rounds each
product before the sum, as torch does, and the MLP runs torch's own silu and product (the
same bits); the packed linears, the attention kernel and `rms_norm`'s sum of squares round
otherwise, within the tolerance the packed path is held to (tests/encoder_peers/chats.py).
The torch backend (`linear_backend` torch) keeps transformers' own modules throughout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.cpu_kernels import PackedLinear, pack_linears

# transformers' vision attention classes this module's attention replaces (the same
# forward: qkv, rotate-half rotary, per-segment SDPA, proj), by class name
ATTENTION_CLASSES = ("Qwen2_5_VLVisionAttention", "Qwen3VLVisionAttention",
                     "Qwen3VLMoeVisionAttention")
# A segment of at least this many rows attends through torch's SDPA (its CPU flash kernel),
# a shorter one through `segment_attention`. Measured on the AVX2 EPYC, one thread, one
# segment alone (kernel / SDPA time): 6 heads of 64: 0.90 at 64 rows, 1.32 at 128, 1.47-1.56
# at 256-1024, 1.99 at 3072; 16 heads of 72 or 80: 1.05-1.20 at 64, 1.36-1.64 at 128,
# 1.9 at 1024. Many short segments still favour the kernel's one call over a call each
# (768 rows in windows of 64: 2.25 ms against 2.59), so windows stay on the kernel.
SDPA_MIN_ROWS = 128
GATED_MLP_CLASSES = ("Qwen2_5_VLMLP",)  # gate_proj, up_proj, down_proj; silu
RMS_NORM_CLASSES = ("Qwen2_5_VLRMSNorm",)  # weight, variance_epsilon


class PackedPatchEmbed(nn.Module):
    """A Conv3d patch embedding whose kernel equals its stride, as one packed linear over
    the flattened patches [N, C * T * P * P] -> [N, embed_dim]."""

    def __init__(self, embed: nn.Module, kernels) -> None:
        super().__init__()
        conv = embed.proj
        if not _is_patchwise(conv):
            raise ValueError(f"patch embedding {conv} is not one product per patch")
        self.embed_dim = conv.out_channels
        weight_t = conv.weight.detach().reshape(conv.out_channels, -1).t().contiguous()
        self.proj = PackedLinear(weight_t, conv.bias, kernels)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, self.proj.in_features).to(torch.float32).contiguous()
        return self.proj(x)


class KernelVisionAttention(nn.Module):
    """transformers' vision attention (qkv, rotary, attention per segment of `cu_seqlens`,
    proj) with the rotary split out of qkv by `rope_qk` and the short segments' attention by
    `segment_attention` (one call for each run of them; module doc)."""

    def __init__(self, attn: nn.Module, kernels) -> None:
        super().__init__()
        self.num_heads, self.head_dim = attn.num_heads, attn.head_dim
        self.scaling, self.kernels = attn.scaling, kernels
        self.qkv = _packed(attn.qkv, kernels)
        self.proj = _packed(attn.proj, kernels)

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], max_seqlen=None,
                **kwargs) -> torch.Tensor:
        n, h, d = hidden_states.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv(hidden_states)  # [n, 3 * h * d]: q heads, k heads, v heads
        cos, sin = position_embeddings
        q, k = self.kernels.rope_qk(qkv, cos.float().contiguous(), sin.float().contiguous(), h, h)
        v = qkv[:, 2 * h * d :].view(n, h, d)
        cu = cu_seqlens.to(device="cpu", dtype=torch.int64)
        bounds = cu.tolist()
        # windows and small images: the kernel alone, one call
        if all(b - a < SDPA_MIN_ROWS for a, b in zip(bounds[:-1], bounds[1:], strict=True)):
            out = self.kernels.segment_attention(q, k, v, cu, False, self.scaling)
        else:
            out = self._mixed(q, k, v, bounds)
        return self.proj(out.view(n, h * d))

    def _mixed(self, q, k, v, bounds: list[int]) -> torch.Tensor:
        """Each segment of SDPA_MIN_ROWS rows or more by torch's SDPA on its own rows (as
        transformers attends to it), each run of consecutive shorter ones by one kernel call;
        which one a segment takes depends on its length alone (row invariance)."""
        out = torch.empty_like(q)
        run = 0  # the first row of the run of short segments not attended yet
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            if b - a < SDPA_MIN_ROWS:
                continue
            if run < a:
                self._kernel_run(q, k, v, bounds, run, a, out)
            o = F.scaled_dot_product_attention(
                *(x[a:b].transpose(0, 1)[None] for x in (q, k, v)), scale=self.scaling)
            out[a:b] = o[0].transpose(0, 1)
            run = b
        if run < bounds[-1]:
            self._kernel_run(q, k, v, bounds, run, bounds[-1], out)
        return out

    def _kernel_run(self, q, k, v, bounds: list[int], lo: int, hi: int, out) -> None:
        """The kernel over the consecutive segments that tile rows [lo, hi)."""
        cu = torch.tensor([b - lo for b in bounds if lo <= b <= hi], dtype=torch.int64)
        out[lo:hi] = self.kernels.segment_attention(q[lo:hi], k[lo:hi], v[lo:hi], cu, False,
                                                    self.scaling)


class InPlaceGatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), transformers' ops in transformers' order, with silu and
    the product in place on gate's output: no new [N, intermediate] tensors (two fewer
    passes over memory and allocations). NOTE: gate and up stay two linears: one packed
    linear of both (2 * intermediate columns) ran 1.5x slower at 5760 rows here, and
    `silu_mul`'s scalar exp 1.5x slower than torch's silu."""

    def __init__(self, mlp: nn.Module, kernels) -> None:
        super().__init__()
        self.gate_proj = _packed(mlp.gate_proj, kernels)
        self.up_proj = _packed(mlp.up_proj, kernels)
        self.down_proj = _packed(mlp.down_proj, kernels)

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate_proj(hidden_state), inplace=True)
        return self.down_proj(h.mul_(self.up_proj(hidden_state)))


class KernelRMSNorm(nn.Module):
    """Qwen2.5-VL's RMSNorm on `rms_norm` (rows of a contiguous [T, D] float32 input)."""

    def __init__(self, norm: nn.Module, kernels) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps, self.kernels = float(norm.variance_epsilon), kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return self.kernels.rms_norm(rows, self.weight, self.eps).view(x.shape)


def pack_vision_tower(visual: nn.Module, kernels) -> dict[str, int]:
    """Swap `visual`'s modules for the kernels' (module doc), then pack every nn.Linear
    left; returns how many of each were swapped ("linear": the ones packed as they are).
    float32 on the CPU only (the packed linears' own rule)."""
    p = next(visual.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        raise ValueError(f"the CPU kernels run float32 on the CPU, not {p.dtype} on {p.device}")
    counts = {"patch_embed": 0, "attention": 0, "gated_mlp": 0, "rms_norm": 0}
    embed = getattr(visual, "patch_embed", None)
    if embed is not None and _is_patchwise(getattr(embed, "proj", None)):
        visual.patch_embed = PackedPatchEmbed(embed, kernels)
        counts["patch_embed"] += 1
    swaps = ((ATTENTION_CLASSES, KernelVisionAttention, "attention"),
             (GATED_MLP_CLASSES, InPlaceGatedMLP, "gated_mlp"),
             (RMS_NORM_CLASSES, KernelRMSNorm, "rms_norm"))
    for parent in list(visual.modules()):
        for name, child in list(parent.named_children()):
            for classes, cls, what in swaps:
                if type(child).__name__ in classes and _fits(child, what):
                    setattr(parent, name, cls(child, kernels))
                    counts[what] += 1
                    break
    counts["linear"] = pack_linears(visual, kernels)
    return counts


def _is_patchwise(conv) -> bool:
    """A Conv3d that is one product per patch: kernel == stride, no padding, no groups."""
    return (isinstance(conv, nn.Conv3d) and tuple(conv.kernel_size) == tuple(conv.stride)
            and all(x == 0 for x in conv.padding) and all(x == 1 for x in conv.dilation)
            and conv.groups == 1 and conv.padding_mode == "zeros")


def _fits(module: nn.Module, what: str) -> bool:
    """Whether `module` has the shape the kernels' version assumes (else it stays)."""
    if what == "attention":
        return (isinstance(module.qkv, nn.Linear) and isinstance(module.proj, nn.Linear)
                and module.head_dim % 2 == 0
                and module.qkv.out_features == 3 * module.num_heads * module.head_dim)
    if what == "gated_mlp":
        return _is_silu(module.act_fn) and all(
            isinstance(getattr(module, n), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
    return module.weight.dim() == 1


def _is_silu(act: nn.Module) -> bool:
    """transformers' ACT2FN["silu"] (SiLUActivation) or torch's nn.SiLU."""
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _packed(linear: nn.Linear, kernels) -> PackedLinear:
    return PackedLinear.from_linear(linear, kernels)  # `_fits` checked it is an nn.Linear
