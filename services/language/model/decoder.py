"""The Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE text decoder over a paged KV cache.

Parameter names equal the split loader's normalized names (`embed_tokens.weight`,
`layers.{i}.self_attn.q_proj.weight`, ..., `norm.weight`, `lm_head.weight`), so a
`TextWeights.tensors` dict loads with `load_state_dict(strict=True)`.

Differences between the two architectures are flags on `DecoderConfig`:
q/k/v bias (Qwen2.5), q/k RMSNorm over head_dim (Qwen3), interleaved MRoPE (Qwen3), and
deepstack: for Qwen3-VL a prompt row carries num_deepstack extra hidden-size blocks, and
block k is added to the hidden states right AFTER decoder layer k (zeros at text rows);
and for Qwen3-VL-MoE, the layers in `moe_layers` use the sparse block (`SparseMoE`).

Tensor parallelism (`cfg.shard`, see shard.py): every module is built at this rank's sizes
(its heads, KV heads, intermediate and vocabulary slices); `reduce` (an all-reduce over the
ranks, identity without TP) follows each row-parallel product: o_proj, down_proj and the
MoE block's weighted sum, each before its bias. `logits` returns this rank's vocabulary
slice; the runner gathers the slices.

Expert parallelism (later): `SparseMoE` is the one place experts live. Under EP each rank
would hold E/N whole experts and the block would become route -> all-to-all dispatch of
token rows to their experts' ranks -> local expert GEMMs -> all-to-all combine; the router,
the top-k normalisation and the weighted sum stay as they are here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.cpu_kernels import for_trace
from tandem.services.language.model.attention import AttentionMetadata, paged_attention
from tandem.services.language.model.config import DecoderConfig
from tandem.services.language.model.linear import (
    DenseLinear,
    copies_transposes,
    fuse_checkpoint_tensors,
)
from tandem.services.language.model.rope import MRope, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = None  # the CPU kernels' module, once adopted (float32 on CPU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dim() == 2 and x.is_contiguous():
            return for_trace(self.kernels).rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


class SelfAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig, reduce=_no_reduce) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.local_heads,
            cfg.local_kv_heads,
            cfg.head_dim,
        )
        self.scale = cfg.head_dim**-0.5
        h = cfg.hidden_size
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = DenseLinear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallel(self.q_size, h, cfg.o_bias, reduce)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.kernels = None  # the CPU kernels' module, once adopted (float32 on CPU)

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.kernels is not None and self.q_norm is None:  # one call: split + rotary
            q, k = for_trace(self.kernels).rope_qk(qkv, cos, sin, self.num_heads,
                                                   self.num_kv_heads)
            v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
            out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
            return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class RowParallel(DenseLinear):
    """A projection whose input is split across ranks: partial product, all-reduce, then the
    bias (added once, after the sum)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, reduce) -> None:
        super().__init__(in_features, out_features, bias)
        self.reduce = reduce

    def pack(self, kernels) -> None:
        if self.reduce is _no_reduce:
            return super().pack(kernels)
        bias, self.bias = self.bias, None  # packed without it: added once, after the sum
        super().pack(kernels)
        self.bias = bias

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce is _no_reduce:
            return super().product(x)
        y = self.reduce(self.packed(x) if self.packed is not None else x @ self.weight_t)
        return y if self.bias is None else y + self.bias


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, reduce=_no_reduce) -> None:
        super().__init__()
        self.intermediate = cfg.local_intermediate
        self.gate_up_proj = DenseLinear(cfg.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = RowParallel(self.intermediate, cfg.hidden_size, False, reduce)
        self.kernels = None  # the CPU kernels' module, once adopted (float32 on CPU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.down_proj(for_trace(self.kernels).silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=1)
        return self.down_proj(F.silu(gate) * up)


@dataclass(frozen=True)
class MoEDispatch:
    """How `SparseMoE` runs its experts on a runner's device; chosen once (`for_device`).

    grouped_sync_free: `F.grouped_mm` runs without a host read: on the CPU (its loop over
        the groups reads host memory: no device to wait for) and on CUDA in bfloat16 on
        sm90/sm100 (its kernel takes the group offsets on the device). On other CUDA
        devices torch 2.13 loops over the groups with the offsets read on the host, and
        its checks take bfloat16 only.
    dense_max_tokens: where it is not sync-free, a step of at most this many tokens runs
        every expert on every token (one batched GEMM each way; each token keeps its k
        rows): the decode graphs' batches, which a graph captures only without a sync.
        A longer step (prefill, eager) runs grouped in bfloat16 (one host read of the
        offsets per call) and dense in other dtypes.
    """

    grouped_sync_free: bool = True
    dense_max_tokens: int = 0

    @classmethod
    def for_device(cls, device: torch.device | str, dtype: torch.dtype,
                   dense_max_tokens: int) -> MoEDispatch:
        device = torch.device(device)
        if device.type == "cpu":
            return cls(grouped_sync_free=True)
        fast = (device.type == "cuda" and dtype == torch.bfloat16
                and torch.cuda.get_device_capability(device)[0] in (9, 10))
        return cls(grouped_sync_free=fast, dense_max_tokens=dense_max_tokens)


class SparseMoE(nn.Module):
    """Qwen3-VL-MoE's sparse block, as transformers computes it: router softmax (float32),
    top-k experts per token, weights renormalised over the k, each expert a SiLU-gated MLP;
    the token's output is the weighted sum of its k experts' outputs, added in ascending
    expert order (as transformers adds them; on the CPU the same bits as a loop over the
    experts, which this replaced).

    No host sync and shapes fixed by the token count, so a decode CUDA graph captures it
    (`MoEDispatch` says which of the two ways runs):

      grouped  the T*k (token, expert) rows sorted by expert (stable: tokens ascending
               within an expert), the group ends found on the device (searchsorted), two
               grouped GEMMs over the experts' row ranges (`F.grouped_mm`), rows put back
      dense    every expert over every token (x @ w_gate_up as [E, T, 2I]), each token's
               k rows picked: E/k times the FLOPs, each expert's weights read once; also
               wherever a row of hidden or expert width is not a multiple of 16 bytes
               (grouped GEMMs refuse it)
    """

    def __init__(self, cfg: DecoderConfig, reduce=_no_reduce) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.local_moe_intermediate
        self.num_experts, self.top_k, self.intermediate = e, cfg.num_experts_per_tok, i
        self.reduce = reduce
        self.router = DenseLinear(h, e, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(e, h, 2 * i))  # x @ w_gate_up[e]
        self.w_down = nn.Parameter(torch.empty(e, i, h))
        self.dispatch: MoEDispatch | None = None  # the runner's; None: for x's device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        experts, ascending = experts.sort(dim=-1)  # each token's experts in adding order
        weights = weights.gather(1, ascending)
        y = self._dense(x, experts) if self._runs_dense(x) else self._grouped(x, experts)
        y = y * weights[..., None]  # [T, k, H]
        out = y[:, 0]
        for j in range(1, self.top_k):
            out = out + y[:, j]
        return self.reduce(out)

    def _runs_dense(self, x: torch.Tensor) -> bool:
        # NOTE: grouped GEMMs need rows of a multiple of 16 bytes (hidden and expert width:
        # real models have them; a tiny test model's bfloat16 expert slice under TP may not)
        row = x.element_size()
        if (self.w_down.shape[1] * row) % 16 or (self.w_down.shape[2] * row) % 16:
            return True
        d = self.dispatch or MoEDispatch.for_device(x.device, x.dtype, 0)
        if d.grouped_sync_free:
            return False
        return x.shape[0] <= d.dense_max_tokens or x.dtype != torch.bfloat16

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """[T, k, H]: row (t, j) is expert experts[t, j] applied to token t."""
        t, k = experts.shape
        by_expert, order = experts.flatten().sort(stable=True)
        ids = torch.arange(self.num_experts, device=x.device, dtype=by_expert.dtype)
        ends = torch.searchsorted(by_expert, ids, right=True).to(torch.int32)
        rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
        h = F.grouped_mm(rows, self.w_gate_up, offs=ends)
        gate, up = h.split(self.intermediate, dim=1)
        y = F.grouped_mm(F.silu(gate) * up, self.w_down, offs=ends)
        return y.new_empty(y.shape).index_copy_(0, order, y).view(t, k, -1)

    def _dense(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """As `_grouped`, by running every expert on every token."""
        gate, up = torch.matmul(x, self.w_gate_up).split(self.intermediate, dim=-1)
        y = torch.bmm(F.silu(gate) * up, self.w_down)  # [E, T, H]
        tokens = torch.arange(x.shape[0], device=x.device)[:, None]
        return y[experts, tokens]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, index: int, reduce=_no_reduce) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, reduce)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg, reduce) if index in cfg.moe_layers else MLP(cfg, reduce)

    def forward(self, x, cos, sin, meta, k_cache, v_cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class QwenVLDecoder(nn.Module):
    """hidden [T, hidden] + positions [3, T] -> final-normed hidden [T, hidden]."""

    def __init__(
        self, cfg: DecoderConfig, device: torch.device | str = "cpu", tied_head: bool = False,
        reduce=_no_reduce,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i, reduce) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # A tied head reads the embedding table (no transposed copy of vocab x hidden).
        self.lm_head = (
            None if tied_head else DenseLinear(cfg.hidden_size, cfg.local_vocab, bias=False)
        )
        self.rope = MRope(
            cfg.head_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved, device
        )
        # The activations' dtype where the embedding table is held wider (set by
        # compute_linears_in_float32), else None: rows come out as the table holds them.
        self.act_dtype: torch.dtype | None = None

    @classmethod
    def build(
        cls, cfg: DecoderConfig, tensors: dict[str, torch.Tensor], device: torch.device, dtype,
        reduce=_no_reduce,
    ) -> QwenVLDecoder:
        """A decoder that adopts `tensors` (moved to device/dtype, fused and transposed as
        `linear.py` says): built on the meta device, so no throwaway random initialisation
        and no second copy of the weights. Consumes `tensors` (emptied, one group at a
        time: `fuse_checkpoint_tensors`): the caller's dict holds no original while its
        fused copy is made, so loading peaks at the weights plus one layer's group."""
        tied = "lm_head.weight" not in tensors
        with torch.device("meta"):
            model = cls(cfg, device=device, tied_head=tied, reduce=reduce)
        tensors = fuse_checkpoint_tensors(
            tensors, cfg.num_layers, cfg.moe_layers,
            place=lambda t: t.to(device=device, dtype=dtype),
            copy_transposes=copies_transposes(device))
        missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(
                f"decoder weights do not match the config: missing {sorted(missing)[:8]}, "
                f"unexpected {sorted(unexpected)[:8]}"
            )
        return model.eval()

    def set_moe_dispatch(self, dispatch: MoEDispatch) -> None:
        """How every sparse MoE block runs its experts (`MoEDispatch`, the runner's)."""
        for m in self.modules():
            if isinstance(m, SparseMoE):
                m.dispatch = dispatch

    def adopt_cpu_kernels(self, kernels, pointwise: bool = True) -> None:
        """Run on the CPU kernels (`cpu_kernels`, float32 products): every projection (and
        an untied head) in the packed layout, and with `pointwise` RMSNorm, rotary and
        SiLU-mul as one call each (float32 activations only: a bfloat16 model whose
        products run in float32 packs its projections alone, their weights in bfloat16).
        NOTE: a tied head keeps reading the embedding table through F.linear (packing it
        would keep a second vocab x hidden copy)."""
        for m in self.modules():
            if isinstance(m, DenseLinear):
                m.pack(kernels)
            elif pointwise and isinstance(m, (RMSNorm, SelfAttention, MLP)):
                m.kernels = kernels

    def compute_linears_in_float32(self, packed: bool) -> None:
        """A bfloat16 decoder on a CPU whose products run in float32 (the runner's
        `cpu_bf16_compute`, linear.py's NOTE): every projection and the head run their
        products in float32 over the same values: `packed` (the CPU kernels are adopted
        next), over the bfloat16 weights as they are, which the packed kernel widens as
        it loads them; else over float32 copies (which replace the originals). A tied
        head's embedding table is widened (the head reads it through F.linear; `embed`
        returns its rows in the model's dtype). Activations, norms and the KV cache keep
        the model's dtype."""
        self.act_dtype = self.norm.weight.dtype
        for m in self.modules():
            if isinstance(m, DenseLinear):
                m.compute_in_float32(widen_weight=not packed)
        if self.lm_head is None:
            w = self.embed_tokens.weight
            self.embed_tokens.weight = nn.Parameter(w.detach().float(), requires_grad=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token rows [T, hidden] in the model's dtype."""
        rows = self.embed_tokens(ids)
        return rows if self.act_dtype is None else rows.to(self.act_dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        deepstack: torch.Tensor | None = None,  # [T, num_deepstack * hidden] or None
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`rope`: cos, sin of `positions` (`self.rope.cos_sin`) computed by the caller, else
        here. NOTE: a compiled step passes them in, computed outside its graph: traced,
        inductor recomputes them inside every layer's fused rotary kernel, per element of
        q and k (docs/benchmarks.md, the compiled prefill)."""
        cos, sin = rope if rope is not None else self.rope.cos_sin(positions, hidden.dtype)
        hs = self.cfg.hidden_size
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, meta, k_caches[i], v_caches[i])
            if deepstack is not None and i < self.cfg.num_deepstack:
                hidden = hidden + deepstack[:, i * hs : (i + 1) * hs]
        return self.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] final-normed -> [T, vocab] float32."""
        if self.lm_head is None:
            w = self.embed_tokens.weight
            return F.linear(hidden.to(w.dtype), w).float()
        return self.lm_head(hidden).float()
