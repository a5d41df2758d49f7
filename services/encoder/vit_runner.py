"""Runs the vision tower over a batch of images: eager, or CUDA graphs keyed by patch count.

The tower is split as in SGLang's ViTCudaGraphRunner:

    pixels ─▶ patch_embed (+ learned pos_embed, Qwen3-VL) ─▶ window permute (Qwen2.5-VL)
           ─▶ rotary cos/sin, cu_seqlens                          [outside the graph]
           ─▶ blocks ─▶ merger (+ deepstack mergers, Qwen3-VL)    [inside the graph]
           ─▶ un-permute windows, split per image                 [outside]

Two block paths:
- `eager`: transformers' own block modules with their per-segment attention. Bit-exact with
  `get_image_features` in float32 (the serving path on CPU, and the fallback on CUDA).
- `static`: a graph-safe block loop over static buffers (padded `cu_seqlens`, fixed max
  length): varlen flash attention on CUDA in bf16/fp16 (torch.nn.attention.varlen), a
  block-diagonal masked SDPA otherwise. On CUDA it is captured once per patch count (lazily; at most
  `max_graphs` kept, least recently used evicted) and replayed; on CPU it runs eagerly over
  the same buffers so its padding is tested everywhere.

Row invariance: in float32 on CPU with one intra-op thread, each output row of the eager path
does not depend on what else is in the batch, so batched results equal one-at-a-time ones.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.utils.generic import get_max_seqlen
from transformers.vision_utils import (
    get_vision_attention_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
    get_vision_window_index,
)


@dataclass
class VisionOutput:
    """Features of a batch, image after image in input order."""

    embeds: torch.Tensor  # [tokens, out_hidden]
    deepstack: list[torch.Tensor]  # per deepstack layer [tokens, out_hidden] (Qwen3-VL)


@dataclass
class _Prepared:
    hidden: torch.Tensor  # [N, D] after patch (+pos) embedding, window-permuted
    cos: torch.Tensor
    sin: torch.Tensor
    cu: torch.Tensor  # per-image (per-frame) segments, int32
    cu_window: torch.Tensor | None  # Qwen2.5-VL windows
    max_len: int | None
    max_window_len: int | None
    reverse: torch.Tensor | None  # undoes the window permutation of merged tokens


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope(q, k, cos, sin):
    """Vision rotary embedding, as transformers applies it (in float32)."""
    dq, dk = q.dtype, k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    return (q * cos + _rotate_half(q) * sin).to(dq), (k * cos + _rotate_half(k) * sin).to(dk)


class _Graph:
    """Static buffers and one captured graph for one patch count."""

    def __init__(self, n: int, d: int, hd: int, n_cu: int, device, dtype) -> None:
        self.hidden = torch.zeros(n, d, device=device, dtype=dtype)
        self.cos = torch.zeros(n, hd, device=device, dtype=torch.float32)
        self.sin = torch.zeros(n, hd, device=device, dtype=torch.float32)
        # NOTE: cu buffers are padded with n (zero-length tail segments) to a fixed length.
        self.cu = torch.full((n_cu,), n, device=device, dtype=torch.int32)
        self.cu_window = torch.full((n_cu,), n, device=device, dtype=torch.int32)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, list[torch.Tensor]] | None = None


class VisionRunner:
    """Owns one vision tower on one device. `run` is called from one thread at a time."""

    def __init__(self, visual: torch.nn.Module, max_graphs: int = 0, mode: str = "auto") -> None:
        self.visual = visual.eval()
        p = next(visual.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.cfg = visual.config
        self.merge = int(self.cfg.spatial_merge_size)
        self.is_qwen3 = hasattr(visual, "deepstack_merger_list")
        self.deepstack_layers = list(getattr(visual, "deepstack_visual_indexes", []) or [])
        cuda = self.device.type == "cuda"
        if mode == "auto":
            mode = "graph" if cuda and max_graphs > 0 else "eager"
        if mode not in ("eager", "static", "graph") or (mode == "graph" and not cuda):
            raise ValueError(f"mode {mode!r} is not possible on {self.device}")
        self.mode = mode
        self.max_graphs = max(1, max_graphs)
        self.graphs: OrderedDict[int, _Graph] = OrderedDict()
        self.graph_pool = None
        self.captures = 0
        self._lock = threading.Lock()
        self._varlen = None
        if cuda:
            try:
                from torch.nn.attention.varlen import varlen_attn

                self._varlen = varlen_attn
            except ImportError:
                pass

    # ------------------------------------------------------------------ public
    @torch.inference_mode()
    def run(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> VisionOutput:
        with self._lock:
            grid_thw = torch.tensor(grids, dtype=torch.long)
            prep = self._prepare(pixel_values, grid_thw)
            if self.mode == "eager":
                merged, deep = self._blocks_eager(prep)
            elif self.mode == "static":
                merged, deep = self._blocks_static(
                    prep.hidden, prep.cos, prep.sin, *self._padded_cu(prep, prep.hidden.shape[0])
                )
            else:
                merged, deep = self._run_graph(prep)
            if prep.reverse is not None:
                merged = merged[prep.reverse]
            return VisionOutput(embeds=merged, deepstack=deep)

    # ----------------------------------------------------------- outside graph
    def _prepare(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> _Prepared:
        v, dev = self.visual, self.device
        grid_dev = grid_thw.to(dev)
        pixels = pixels.to(dev).type(self.dtype)
        pos_ids = get_vision_position_ids(grid_dev, self.merge)
        cu, max_len = get_vision_attention_seqlens(grid_dev, self.cfg)
        hidden = v.patch_embed(pixels)
        n = hidden.shape[0]
        if self.is_qwen3:
            idx, w = get_vision_interpolation_indices_and_weights(
                grid_dev,
                num_grid_per_side=v.num_grid_per_side,
                mode=v.interpolation_mode,
                align_corners=v.interpolation_align_corners,
                spatial_merge_size=self.merge,
            )
            hidden = hidden + (v.pos_embed(idx) * w[:, :, None]).sum(1).to(hidden.dtype)
            cos, sin = v.rotary_pos_emb(hidden, pos_ids)
            return _Prepared(hidden.reshape(n, -1), cos, sin, cu, None, max_len, None, None)
        window_index, cu_window = get_vision_window_index(
            grid_dev,
            spatial_merge_size=self.merge,
            window_size=v.window_size,
            patch_size=v.patch_size,
        )
        max_window = get_max_seqlen(cu_window, self.cfg, kwarg_name="max_window_seqlen")
        hidden = v.permute_input_for_window_attn(hidden, window_index, seq_len=n)
        cos, sin = v.rotary_pos_emb(hidden, pos_ids)
        cos = v.permute_input_for_window_attn(cos, window_index, seq_len=n)
        sin = v.permute_input_for_window_attn(sin, window_index, seq_len=n)
        reverse = torch.argsort(window_index).to(dev)
        return _Prepared(hidden, cos, sin, cu, cu_window, max_len, max_window, reverse)

    # ------------------------------------------------------------ eager blocks
    def _blocks_eager(self, prep: _Prepared):
        v, h = self.visual, prep.hidden
        full = set(getattr(v, "fullatt_block_indexes", []) or [])
        deep = []
        for i, blk in enumerate(v.blocks):
            if self.is_qwen3 or i in full:
                cu, mx = prep.cu, prep.max_len
            else:
                cu, mx = prep.cu_window, prep.max_window_len
            h = blk(h, cu_seqlens=cu, max_seqlen=mx, position_embeddings=(prep.cos, prep.sin))
            if i in self.deepstack_layers:
                deep.append(v.deepstack_merger_list[self.deepstack_layers.index(i)](h))
        return v.merger(h), deep

    # ----------------------------------------------------------- static blocks
    def _padded_cu(self, prep: _Prepared, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = self._cu_len(n)
        cu = torch.full((size,), n, dtype=torch.int32, device=self.device)
        cu[: prep.cu.numel()] = prep.cu
        cw = torch.full((size,), n, dtype=torch.int32, device=self.device)
        src = prep.cu_window if prep.cu_window is not None else prep.cu
        cw[: src.numel()] = src
        return cu, cw

    def _cu_len(self, n: int) -> int:
        # Every segment (image frame or window) holds >= merge**2 patches.
        return n // (self.merge * self.merge) + 1

    def _attention(self, attn, x, cos, sin, cu, n):
        q, k, val = attn.qkv(x).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = _rope(q, k, cos, sin)
        if self._varlen is not None and q.dtype in (torch.bfloat16, torch.float16):
            o = self._varlen(q, k, val, cu, cu, n, n, scale=attn.scaling)
        else:  # block-diagonal mask from the (padded) cumulative lengths; graph-safe
            seg = torch.searchsorted(cu[1:], torch.arange(n, device=x.device), right=True)
            mask = (seg[:, None] == seg[None, :])[None, None]
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                val.transpose(0, 1)[None],
                attn_mask=mask,
                scale=attn.scaling,
            )[0].transpose(0, 1)
        return attn.proj(o.reshape(n, -1))

    def _blocks_static(self, h, cos, sin, cu, cu_window):
        v, n = self.visual, h.shape[0]
        full = set(getattr(v, "fullatt_block_indexes", []) or [])
        deep = []
        for i, blk in enumerate(v.blocks):
            seg = cu if (self.is_qwen3 or i in full) else cu_window
            h = h + self._attention(blk.attn, blk.norm1(h), cos, sin, seg, n)
            h = h + blk.mlp(blk.norm2(h))
            if i in self.deepstack_layers:
                deep.append(v.deepstack_merger_list[self.deepstack_layers.index(i)](h))
        return v.merger(h), deep

    # ------------------------------------------------------------ CUDA graphs
    def _run_graph(self, prep: _Prepared):
        n = prep.hidden.shape[0]
        g = self.graphs.get(n)
        if g is None:
            g = self._capture(n, prep)
            if g is None:  # capture failed: eager fallback, bit-exact with transformers
                return self._blocks_eager(prep)
        self.graphs.move_to_end(n)
        self._load(g, prep, n)
        g.graph.replay()
        merged, deep = g.out
        return merged.clone(), [d.clone() for d in deep]

    def _load(self, g: _Graph, prep: _Prepared, n: int) -> None:
        """Copy one call's inputs into graph `g`'s static buffers (capture and replay)."""
        cu, cw = self._padded_cu(prep, n)
        g.hidden.copy_(prep.hidden)
        g.cos.copy_(prep.cos)
        g.sin.copy_(prep.sin)
        g.cu.copy_(cu)
        g.cu_window.copy_(cw)

    def _capture(self, n: int, prep: _Prepared) -> _Graph | None:
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)  # LRU eviction frees its buffers and graph
        g = _Graph(
            n, prep.hidden.shape[1], prep.cos.shape[1], self._cu_len(n), self.device, self.dtype
        )
        self._load(g, prep, n)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside capture
                self._blocks_static(g.hidden, g.cos, g.sin, g.cu, g.cu_window)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                g.out = self._blocks_static(g.hidden, g.cos, g.sin, g.cu, g.cu_window)
            self.graph_pool = graph.pool()
            g.graph = graph
        except Exception:
            return None
        self.graphs[n] = g
        self.captures += 1
        return g
