"""Attention over the paged KV cache with `scaled_dot_product_attention`.

One forward holds T tokens flattened in this order (the runner lays them out):

    tokens:  [ single-token rows (decode)  |  chunk 0 (n0 > 1)  |  chunk 1  | ... ]
              <------ num_single ------->  <-------------- prefill chunks ------->

* Single-token rows (a decode token, or a 1-token prompt chunk) attend together in ONE
  batched SDPA call: each row gathers its pages through a block table padded to a common
  width W, and a length mask hides the slots past its `seq_len`. Shapes depend only on
  (num_single, W), so this path is CUDA-graph capturable (no host syncs, no data-dependent
  shapes) — the graph runner calls exactly this with its static buffers.
* Multi-token chunks run one SDPA call each (a Python loop over chunks, never over
  tokens): queries attend to the cached prefix plus causally within the chunk.

NOTE: K/V of the step are written into the cache (via `slot_mapping`) BEFORE any gather,
so a chunk sees its own new tokens and a decode row sees the token it is adding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunkMeta:
    """One multi-token chunk: query rows [q_start, q_start + q_len) of the flat batch."""

    q_start: int
    q_len: int
    kv_len: int  # start + q_len: keys [0, kv_len) of this sequence are visible
    pages: torch.Tensor  # [ceil(kv_len / page_size)] int64, on device


@dataclass
class AttentionMetadata:
    """Where this step's K/V go and which cached K/V each query sees."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each token's K/V
    num_single: int  # rows [0, num_single) are single-token rows
    single_block_tables: torch.Tensor  # [num_single, W] int64 (pad: any valid page)
    single_seq_lens: torch.Tensor  # [num_single] int64, >= 1: keys [0, seq_len) visible
    prefill: list[PrefillChunkMeta] = field(default_factory=list)
    # Optional reusable gather buffers (K, V), each [>= num_single * W, page_size, Hkv, D].
    # NOTE: on CPU a fresh multi-MB gather per layer costs more in page faults than the
    # copy itself; the runner hands in one buffer pair that every layer reuses.
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None
    # Decode attention that reads the pages in place (`cpu_kernels.paged_decode_op`):
    # (q [B, H, D], k_cache, v_cache, block_tables, seq_lens, scale) -> [B, H, D].
    # None: gather the pages into the workspace and run SDPA.
    decode_op: Callable | None = None


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k, v
) -> None:
    """Scatter this step's k, v [T, Hkv, D] into the caches [P, page_size, Hkv, D]."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,  # [T, H, D] (rotary applied)
    k: torch.Tensor,  # [T, Hkv, D] (rotary applied)
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention output [T, H, D] for every token of the step."""
    write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
    kv_heads, head_dim = k_cache.shape[-2:]
    gqa = q.shape[1] != kv_heads
    parts: list[torch.Tensor] = []

    ns = meta.num_single
    if ns and meta.decode_op is not None:
        parts.append(
            meta.decode_op(
                q[:ns].contiguous(), k_cache, v_cache, meta.single_block_tables,
                meta.single_seq_lens, scale,
            )  # fmt: skip
        )
    elif ns:
        bt = meta.single_block_tables  # [B, W]
        flat = bt.reshape(-1)
        width = bt.shape[1] * k_cache.shape[1]
        if meta.workspace is None:
            kg, vg = k_cache.index_select(0, flat), v_cache.index_select(0, flat)
        else:
            kg = torch.index_select(k_cache, 0, flat, out=meta.workspace[0][: flat.numel()])
            vg = torch.index_select(v_cache, 0, flat, out=meta.workspace[1][: flat.numel()])
        # [B*W, ps, Hkv, D] -> [B, Hkv, W*ps, D]
        ks = kg.view(ns, width, kv_heads, head_dim).transpose(1, 2)
        vs = vg.view(ns, width, kv_heads, head_dim).transpose(1, 2)
        visible = torch.arange(width, device=q.device)[None, :] < meta.single_seq_lens[:, None]
        out = F.scaled_dot_product_attention(
            q[:ns].unsqueeze(2),  # [B, H, 1, D]
            ks,
            vs,
            attn_mask=visible[:, None, None, :],
            scale=scale,
            enable_gqa=gqa,
        )
        parts.append(out.squeeze(2))

    for c in meta.prefill:
        qc = q[c.q_start : c.q_start + c.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if c.kv_len == c.q_len:
            # No cached prefix: keys are exactly this chunk's (already in registers).
            kc = k[c.q_start : c.q_start + c.q_len]
            vc = v[c.q_start : c.q_start + c.q_len]
            mask, causal = None, True
        else:
            kc = k_cache[c.pages].view(-1, kv_heads, head_dim)[: c.kv_len]
            vc = v_cache[c.pages].view(-1, kv_heads, head_dim)[: c.kv_len]
            start = c.kv_len - c.q_len
            qpos = torch.arange(start, c.kv_len, device=q.device)
            mask = torch.arange(c.kv_len, device=q.device)[None, :] <= qpos[:, None]
            causal = False
        out = F.scaled_dot_product_attention(
            qc,
            kc.transpose(0, 1).unsqueeze(0),
            vc.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=gqa,
        )
        parts.append(out[0].transpose(0, 1))

    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
