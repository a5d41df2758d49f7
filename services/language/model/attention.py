"""Attention over the paged KV cache: decode rows and prefill chunks, three ways.

One forward holds T tokens flattened in this order (the runner lays them out):

    tokens:  [ single-token rows (decode)  |  chunk 0 (n0 > 1)  |  chunk 1  | ... ]
              <------ num_single ------->  <-------------- prefill chunks ------->

How they attend is chosen ONCE per runner, by `select_attention` (config
`attention_backend`), and travels in the step's `AttentionMetadata`:

  backend    single-token rows                          multi-token chunks
  ---------  -----------------------------------------  -----------------------------------
  paged_cpu  `decode_op`: the C++ kernel reading pages  float32 chunks without a cached
             in place (`csrc/paged_decode.cpp`)         prefix: `chunk_op`, the causal
                                                        kernel over the chunk's own rows
                                                        (`csrc/segment_attention.cpp`);
                                                        others: SDPA, one call per chunk
  gather     every row's pages gathered (index_select)  SDPA, one call per chunk (below)
             into a workspace, one batched SDPA call
             with a length mask
  flex       compiled `flex_attention` over the page    compiled `flex_attention`, one call
             table: ONE call for all rows              per chunk, over the page table

  auto: paged_cpu on the CPU where the kernel builds on a vector path, gather elsewhere on
  the CPU; flex on CUDA. `flex` runs on the CPU too when asked (the tests prove it there).

SDPA chunks (paged_cpu, gather): without a cached prefix the keys are the chunk's own
(`is_causal`); with one, the chunk's pages are gathered and a boolean mask [n, kv_len]
hides the future. NOTE: that is why CUDA must not take this path: SDPA with a mask and
GQA has no fused CUDA kernel (flash refuses masks, efficient refuses GQA), so it falls to
the math backend, which repeats K/V to every head and builds float32 scores of heads x
chunk x context (~15 GB for a 4096-token chunk over 32K keys at 7B sizes); the decode
gather copies every row's pages every layer every step (~0.5 GB a layer at 32 rows x 512
pages, inside the graph pool).

Flex (`flex_block_mask`): the K/V tensors of a layer, [pages, page_size, Hkv, D], are
viewed (no copy) as ONE key sequence of pages * page_size physical slots. A `BlockMask`
with KV blocks of one page lists, per query block, exactly the physical pages the query
sees, in logical order (its block table), so the kernel loads those pages and nothing
else: no gather, no mask tensor. Pages wholly visible to every query of the block are
"full" blocks (no mask evaluated); the rest (the partial last page, the causal diagonal
of a chunk) run `mask_mod`, which maps a physical slot back to its logical position
through an inverse table `page_to_logical` [groups, pages + 1] built once per step from
the block tables (-1: not this row's page) and keeps keys at positions <= the query's.
A decode row is a batch element with one query (K/V broadcast over the batch); a chunk
is one batch element of n queries at positions [kv_len - n, kv_len). Everything is built
with tensor ops from the block tables and lengths: no host sync, shapes fixed by (rows,
width), so the decode CUDA graphs capture it like the rest of the step. Memory of a step's
masks: page_to_logical, (rows + chunks) x (pages + 2) int32 (32 rows over 30K pages: 3.8
MB), and int32 index rows of the table width per query block; nothing scales with heads,
nor with queries x keys. The kernels are compiled (`_compiled_flex`; `AttentionPath.warm_up`
compiles them at start-up).

NOTE: K/V of the step are written into the cache (via `slot_mapping`) BEFORE anything
reads it, so a chunk sees its own new tokens and a decode row sees the token it is adding.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from tandem.cpu_kernels import decode_attention_op, for_trace, kernels


class AttentionBackend(enum.Enum):
    """How decode rows and prefill chunks attend (the table in the module docstring)."""

    PAGED_CPU = "paged_cpu"
    GATHER = "gather"
    FLEX = "flex"


# The values of the `attention_backend` setting (services/language/config.py).
ATTENTION_SETTINGS = ("auto", "gather", "paged_cpu", "flex")
# Query rows per flex block: the kernels' default sparse block (a multiple of their
# BLOCK_M on CUDA). KV blocks are one page, so a block's index IS a page id.
FLEX_Q_BLOCK = 128


@dataclass
class PrefillChunkMeta:
    """One multi-token chunk: query rows [q_start, q_start + q_len) of the flat batch."""

    q_start: int
    q_len: int
    kv_len: int  # start + q_len: keys [0, kv_len) of this sequence are visible
    pages: torch.Tensor  # [ceil(kv_len / page_size)] int64, on device


@dataclass
class FlexMasks:
    """The flex path's block masks of one step, built once and read by every layer."""

    single: BlockMask | None  # the num_single decode rows (None when there are none)
    chunks: list[BlockMask]  # one per prefill chunk, in `AttentionMetadata.prefill` order


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
    # Causal attention of a chunk's own rows (`cpu_kernels` segment_attention): (q, k, v
    # [n, heads, D] float32, cu [0, n] int64, causal, scale) -> [n, H, D]; float32 chunks
    # without a cached prefix take it. None: SDPA.
    chunk_op: Callable | None = None
    # The flex path's masks (`AttentionPath.metadata` builds them): when set, every row
    # and chunk attends through them and the fields above past `prefill` are unused.
    flex: FlexMasks | None = None
    # The dtype attention computes in when it differs from the cache's and q's (None: the
    # cache's): float32 over a bfloat16 cache (`AttentionPath.compute_dtype`).
    compute_dtype: torch.dtype | None = None
    # A compiled step's multi-token chunks (the graph runner's mixed step), in place of
    # `prefill`: one int64 tensor (`chunk_plan` lays it out) that `paged_attention` hands
    # to ONE opaque call, so a traced step holds no per-chunk Python structure and one
    # graph serves every count, length and prefix of chunks. Same per-chunk code, same bits.
    chunk_plan: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.flex is not None and (self.decode_op is not None or self.workspace is not None
                                      or self.chunk_op is not None):
            raise ValueError("flex masks exclude decode_op, chunk_op and a gather workspace")
        if self.flex is not None and self.compute_dtype is not None:
            raise ValueError("the flex path computes in its cache's dtype (no compute_dtype)")
        if self.chunk_plan is not None and (self.prefill or self.flex is not None):
            raise ValueError("a chunk plan replaces `prefill` and excludes the flex path")


@dataclass(frozen=True)
class AttentionPath:
    """How one runner attends, for its whole life (`select_attention` picks it)."""

    backend: AttentionBackend
    decode_op: Callable | None = None  # PAGED_CPU: the in-place kernel; None otherwise
    chunk_op: Callable | None = None  # PAGED_CPU: the causal segment kernel; None otherwise
    # Attention in float32 over a bfloat16 cache and bfloat16 activations (the runner's
    # `cpu_bf16_compute` float32 products with a bfloat16 KV cache; `paged_attention`);
    # None: in the cache's dtype. The flex path refuses it.
    compute_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.backend is AttentionBackend.FLEX and self.compute_dtype is not None:
            raise ValueError("the flex path computes in its cache's dtype (no compute_dtype)")

    def metadata(
        self,
        *,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        page_size: int,
        cache_pages: int,
        prefill: Sequence[PrefillChunkMeta] = (),
        workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> AttentionMetadata:
        """The step's metadata; the one constructor both runners use. `block_tables`
        [rows, W] / `seq_lens` [rows] are the single-token rows' (`decode_rows`);
        `cache_pages` is the K/V tensors' first dimension (pages + the dummy page). The
        flex masks are built here, once per step, with tensor ops only (capture-safe)."""
        flex = None
        if self.backend is AttentionBackend.FLEX:
            rows = block_tables.shape[0]
            single = (
                flex_block_mask(block_tables, seq_lens, 1, page_size, cache_pages)
                if rows
                else None
            )
            chunks = [
                flex_block_mask(
                    c.pages[None], torch.full((1,), c.kv_len, device=c.pages.device),
                    c.q_len, page_size, cache_pages,
                )
                for c in prefill
            ]
            flex, workspace = FlexMasks(single, chunks), None
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            num_single=block_tables.shape[0],
            single_block_tables=block_tables,
            single_seq_lens=seq_lens,
            prefill=list(prefill),
            workspace=workspace,
            decode_op=self.decode_op,
            chunk_op=self.chunk_op,
            flex=flex,
            compute_dtype=self.compute_dtype,
        )

    def warm_up(self, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, scale: float) -> None:
        """Flex: compile the kernels for this cache before the first request does. Decode
        rows x table width (2 x 2, 3 x 3: the sizes go dynamic; 1 x 3, 1 x 1: the sizes
        dynamo specialises at 1) and chunks of 2, 3, 40, 41, 130 and 260 tokens (one query
        block and one page, then more of each); every table and K/V write falls on the
        dummy page and the outputs are dropped. Shapes outside these compile when met."""
        if self.backend is not AttentionBackend.FLEX:
            return
        pages, ps, kv_heads, head_dim = k_cache.shape
        dev, dtype, dummy = k_cache.device, k_cache.dtype, pages - 1
        qb = FLEX_Q_BLOCK
        rows_cases = [(2, 2, 0), (3, 3, 0), (1, 3, 0), (1, 1, 0)]
        chunk_cases = [(0, 0, n) for n in (2, 3, 40, 41, qb + 2, 2 * qb + 4)]
        for rows, width, n in rows_cases + chunk_cases:
            chunk = []
            if n:
                table = torch.full((-(-n // ps),), dummy, dtype=torch.int64, device=dev)
                chunk = [PrefillChunkMeta(rows, n, n, table)]
            t = rows + n
            meta = self.metadata(
                slot_mapping=dummy * ps + torch.arange(t, device=dev) % ps,
                block_tables=torch.full((rows, width), dummy, dtype=torch.int64, device=dev),
                seq_lens=torch.ones(rows, dtype=torch.int64, device=dev),
                page_size=ps, cache_pages=pages, prefill=chunk,
            )
            q = torch.zeros(t, heads, head_dim, dtype=dtype, device=dev)
            kv = torch.zeros(t, kv_heads, head_dim, dtype=dtype, device=dev)
            with torch.inference_mode():  # as the runner's steps (dynamo guards on it)
                paged_attention(q, kv, kv, k_cache, v_cache, meta, scale)


def select_attention(setting: str, device: torch.device | str, page_size: int) -> AttentionPath:
    """THE choice of attention path, by the `attention_backend` setting and the device:

    auto       CPU: paged_cpu where the kernel builds on a vector path, else gather;
               any other device (CUDA): flex
    gather     gather + SDPA (refused nowhere; on CUDA it is the math-fallback path)
    paged_cpu  the in-place C++ kernel; refused off the CPU or where it cannot build
    flex       compiled flex_attention over the page table, on any device (CPU: tests)
    """
    if setting not in ATTENTION_SETTINGS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_SETTINGS}, got {setting!r}")
    device = torch.device(device)
    if setting == "flex" or (setting == "auto" and device.type != "cpu"):
        # NOTE: the CUDA kernels tile a KV block (= one page) by BLOCK_N, a power of two
        # >= 16 (Triton's dot); the CPU kernel takes any page size.
        if device.type != "cpu" and (page_size < 16 or page_size & (page_size - 1)):
            raise ValueError(
                f"attention_backend flex on {device.type} needs a power-of-two KV page size "
                f">= 16, got {page_size}"
            )
        return AttentionPath(AttentionBackend.FLEX)
    op = decode_attention_op(setting, device)
    if op is None:
        return AttentionPath(AttentionBackend.GATHER)
    # NOTE: built with the decode kernel (one module): where one is, so is the other.
    return AttentionPath(AttentionBackend.PAGED_CPU, op, kernels().segment_attention)


def flex_block_mask(
    tables: torch.Tensor,  # [G, W] int64: page ids of each group's keys, in logical order
    kv_lens: torch.Tensor,  # [G] int64: keys [0, kv_len) of each group exist
    q_len: int,  # each group's queries are its positions [kv_len - q_len, kv_len)
    page_size: int,
    cache_pages: int,  # K/V tensors' first dimension: the key sequence is cache_pages * page_size slots
) -> BlockMask:
    """Which physical cache slots each of G groups' queries sees (module docstring, Flex).

    Query block i of group g holds positions first = kv_len - q_len + i * FLEX_Q_BLOCK up
    to first + FLEX_Q_BLOCK - 1; it touches logical pages [0, seen) with seen =
    ceil(min(first + FLEX_Q_BLOCK, kv_len) / page_size), of which [0, full) with full =
    floor((first + 1) / page_size) are wholly visible to all its queries (no mask_mod). Table
    columns past a group's pages (padding: any valid page id) are never listed.
    """
    dev = tables.device
    groups, width = tables.shape
    ps, qb = page_size, FLEX_Q_BLOCK
    blocks = -(-q_len // qb)
    q_first = kv_lens - q_len  # [G] logical position of each group's query 0
    first = q_first[:, None] + torch.arange(blocks, device=dev) * qb  # [G, blocks]
    seen = (torch.minimum(first + qb, kv_lens[:, None]) + ps - 1) // ps
    full = torch.minimum((first + 1) // ps, seen)
    # NOTE (CPU): inductor's CPU kernel wants the index rows to span the whole key sequence
    # (it asserts kv_len <= columns * block); the CUDA kernels read only the counted ones.
    span = max(cache_pages, width) if dev.type == "cpu" else width
    padded = F.pad(tables, (0, span - width)).to(torch.int32)
    full_idx = padded[:, None, :].expand(groups, blocks, span)
    cols = torch.arange(span, device=dev)
    partial_idx = torch.gather(full_idx, 2, (full[..., None] + cols).clamp_(max=span - 1))
    # page_to_logical[g, p]: the logical index of physical page p in group g's table, -1
    # where p is not one of its pages; column cache_pages takes the padding columns' writes.
    page_to_logical = torch.full((groups, cache_pages + 1), -1, dtype=torch.int32, device=dev)
    live = cols[None, :width] < ((kv_lens + ps - 1) // ps)[:, None]
    page_to_logical.scatter_(
        1, torch.where(live, tables, cache_pages), cols[:width].to(torch.int32).expand(groups, width)
    )

    def mask_mod(b, h, q_idx, kv_idx):
        logical = page_to_logical[b, kv_idx // ps]
        return (logical >= 0) & (logical * ps + kv_idx % ps <= q_first[b] + q_idx)

    return BlockMask.from_kv_blocks(
        (seen - full).to(torch.int32)[:, None],
        partial_idx[:, None].contiguous(),
        full.to(torch.int32)[:, None],
        full_idx[:, None].contiguous(),
        BLOCK_SIZE=(qb, ps),
        mask_mod=mask_mod,
        seq_lengths=(q_len, cache_pages * ps),
        compute_q_blocks=False,  # forward only: no transposed (query-major) indices
    )


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
    """Attention output [T, H, D] for every token of the step, in q's dtype.

    bfloat16 on a CPU whose products run in float32 (the runner's `cpu_bf16_compute`)
    attends in float32 over the same values, two ways:
    - a bfloat16 cache with `meta.compute_dtype` float32 (the runner's choice with the
      paged_cpu kernels): K/V are stored as they come (bfloat16); the decode kernel widens
      q and the pages in registers and rounds its output to q's dtype (csrc/paged_decode.cpp);
      chunks (and gathered decode rows) widen q, k, v and the pages they read, attend in
      float32 and round the output. Every result equals, bit for bit, that of the float32
      cache below (the cache holds the same values; tests/test_cpu_kernels.py).
    - a cache wider than the activations (float32; the gather and flex paths): it holds
      their values exactly: q, k, v are widened, attention runs in the cache's dtype, and
      the output is rounded back to q's dtype."""
    if q.dtype != k_cache.dtype:
        out = paged_attention(q.to(k_cache.dtype), k.to(k_cache.dtype), v.to(k_cache.dtype),
                              k_cache, v_cache, meta, scale)
        return out.to(q.dtype)
    write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
    # The dtype everything below attends in (only a CPU bfloat16 cache differs: float32);
    # `.to(cd)` is a no-op where it is q's.
    cd = meta.compute_dtype or q.dtype
    if meta.flex is not None:
        return _flex_attention(q, k_cache, v_cache, meta, scale)
    kv_heads, head_dim = k_cache.shape[-2:]
    gqa = q.shape[1] != kv_heads
    parts: list[torch.Tensor] = []
    ns = meta.num_single
    if ns and meta.decode_op is not None:
        # NOTE: traced (a compiled step), the same kernel as a custom op (cpu_kernels.py)
        traced = for_trace(None)
        op = meta.decode_op if traced is None else traced.paged_decode_attention
        # NOTE: the kernel computes in float32 whatever the cache (it widens as it loads)
        # and rounds to q's dtype: a float32 `cd` needs no cast here
        parts.append(
            op(
                q[:ns].contiguous(), k_cache, v_cache, meta.single_block_tables,
                meta.single_seq_lens, scale,
            )
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
            q[:ns].unsqueeze(2).to(cd),  # [B, H, 1, D]
            ks.to(cd),
            vs.to(cd),
            attn_mask=visible[:, None, None, :],
            scale=scale,
            enable_gqa=gqa,
        )
        parts.append(out.squeeze(2).to(q.dtype))

    if meta.chunk_plan is not None:
        # NOTE: traced (a compiled step), one custom op over every chunk (cpu_kernels.py);
        # its CPU implementation is `chunk_plan_attention`, the loop below
        traced = for_trace(None)
        op = chunk_plan_attention if traced is None else traced.chunk_attention
        parts.append(op(q[ns:], k[ns:], v[ns:], k_cache, v_cache, meta.chunk_plan, scale,
                        cd == torch.float32))
    for c in meta.prefill:
        parts.append(_chunk_attention(q, k, v, k_cache, v_cache, c, meta.chunk_op, cd, scale))

    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def chunk_plan(chunks: Sequence[tuple[int, int, int, Sequence[int]]]) -> torch.Tensor:
    """The int64 plan of multi-token chunks (`AttentionMetadata.chunk_plan`): [C, then
    (q_start, q_len, kv_len, pages) per chunk, then each chunk's page ids], from (q_start
    counted from the first chunk row, q_len, kv_len, page ids covering kv_len) each."""
    head = [len(chunks)]
    pages: list[int] = []
    for q_start, q_len, kv_len, ids in chunks:
        head += [q_start, q_len, kv_len, len(ids)]
        pages += list(ids)
    return torch.tensor(head + pages, dtype=torch.int64)


def chunk_plan_attention(q, k, v, k_cache, v_cache, plan: torch.Tensor, scale: float,
                         widen: bool) -> torch.Tensor:
    """Attention [rows, H, D] of the chunks a plan lists (`chunk_plan`) over q, k, v [rows,
    ...] (the step's chunk rows), each as `paged_attention` attends a chunk (the same calls:
    the same bits); `widen`: in float32 (else q's dtype). The CPU implementation of the
    custom op `tandem::chunk_attention` (cpu_kernels.py), and what an untraced plan runs."""
    values = plan.tolist()
    count, at = values[0], 1 + 4 * values[0]
    cd = torch.float32 if widen else q.dtype
    mod = kernels()
    chunk_op = None if mod is None else mod.segment_attention
    parts = []
    for i in range(count):
        q_start, q_len, kv_len, n = values[1 + 4 * i : 5 + 4 * i]
        c = PrefillChunkMeta(q_start, q_len, kv_len, plan[at : at + n])
        at += n
        parts.append(_chunk_attention(q, k, v, k_cache, v_cache, c, chunk_op, cd, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _chunk_attention(q, k, v, k_cache, v_cache, c: PrefillChunkMeta, chunk_op, cd, scale):
    """One multi-token chunk's attention [q_len, H, D] in q's dtype, computed in `cd`."""
    kv_heads, head_dim = k_cache.shape[-2:]
    gqa = q.shape[1] != kv_heads
    if c.kv_len == c.q_len and chunk_op is not None and cd == torch.float32:
        # No cached prefix: the kernel over the chunk's own rows, causal (about 2x
        # SDPA's CPU flash kernel at 1481 tokens: csrc/segment_attention.cpp). It reads
        # the step's k, v (not the cache): widened here, n x Hkv x D, a copy per chunk.
        rows = slice(c.q_start, c.q_start + c.q_len)
        cu = torch.tensor([0, c.q_len], dtype=torch.int64)
        return chunk_op(q[rows].to(cd), k[rows].to(cd), v[rows].to(cd), cu, True,
                        scale).to(q.dtype)
    qc = q[c.q_start : c.q_start + c.q_len].transpose(0, 1).unsqueeze(0).to(cd)  # [1, H, n, D]
    if c.kv_len == c.q_len:
        # No cached prefix: keys are exactly this chunk's (already in registers).
        kc = k[c.q_start : c.q_start + c.q_len].to(cd)
        vc = v[c.q_start : c.q_start + c.q_len].to(cd)
        mask, causal = None, True
    else:
        kc = k_cache[c.pages].view(-1, kv_heads, head_dim)[: c.kv_len].to(cd)
        vc = v_cache[c.pages].view(-1, kv_heads, head_dim)[: c.kv_len].to(cd)
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
    return out[0].transpose(0, 1).to(q.dtype)


def _dynamo():
    """torch._dynamo, imported on the flex path's first use: importing it costs ~1.3 s of
    CPU, which every language process (and tensor-parallel rank) paid at start-up when
    it was imported with this module, though only the flex path compiles."""
    import torch._dynamo as dynamo

    return dynamo


def _flex_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The flex path: every row and chunk reads its pages where they lie."""
    dynamo = _dynamo()
    pages, page_size, kv_heads, head_dim = k_cache.shape
    slots = pages * page_size
    # [pages, page_size, Hkv, D] -> [1, Hkv, slots, D]: a view, the pages are not moved.
    keys = k_cache.view(1, slots, kv_heads, head_dim).transpose(1, 2)
    values = v_cache.view(1, slots, kv_heads, head_dim).transpose(1, 2)
    # NOTE: heads, head size and the cache are fixed for a runner's life: compiled as
    # constants, never as dynamic sizes (only rows, widths and chunk lengths vary).
    for t in (k_cache, v_cache, keys, values):
        dynamo.mark_static(t)
    gqa = q.shape[1] != kv_heads
    options = _flex_kernel_options(q.device, page_size)
    geometry = (q.device.type, q.dtype, pages, page_size, q.shape[1], kv_heads, head_dim)
    parts: list[torch.Tensor] = []
    ns = meta.num_single
    if ns:
        qr = q[:ns].unsqueeze(2)  # [B, H, 1, D]
        dynamo.mark_static(qr, [1, 2, 3])
        out = _compiled_flex("rows", geometry)(qr, keys, values, meta.flex.single, scale, gqa, options)
        parts.append(out.squeeze(2))  # [B, H, 1, D] -> [B, H, D]
    for c, mask in zip(meta.prefill, meta.flex.chunks, strict=True):
        qc = q[c.q_start : c.q_start + c.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        dynamo.mark_static(qc, [0, 1, 3])
        out = _compiled_flex("chunk", geometry)(qc, keys, values, mask, scale, gqa, options)
        parts.append(out[0].transpose(0, 1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _flex_kernel_options(device: torch.device, page_size: int) -> dict | None:
    """CUDA: a KV tile (BLOCK_N) must divide the KV block, which is one page."""
    return None if device.type == "cpu" else {"BLOCK_N": min(page_size, 64)}


def _flex(q, keys, values, block_mask, scale, gqa, options):
    return flex_attention(
        q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=gqa, kernel_options=options
    )


_compiled: dict[tuple, Callable] = {}


def _compiled_flex(kind: str, geometry: tuple) -> Callable:
    """`_flex` compiled for decode rows or chunks ("rows" / "chunk") of one geometry (device,
    dtype, cache pages, page size, heads, KV heads, head size), each under its own code
    object.

    NOTE: dynamo keeps its compile cache, its recompile count and its record of which sizes
    varied per code object. One per (kind, geometry) means: a runner's shapes settle after
    a recompile or two (rows, widths, chunk lengths go dynamic), decode and prefill do not
    spend each other's recompiles, other runners in the process (another cache, another
    model) start their own, and the page size (a constant in the mask) never turns
    symbolic because another runner has another (inductor's CPU kernel miscompiles a
    symbolic one, torch 2.13). Uncompiled, flex_attention is a dense
    reference that scores every query against all pages * page_size slots, so a hit of
    the recompile limit (dynamo would then run it uncompiled) raises instead."""
    key = (kind, geometry)
    fn = _compiled.get(key)
    if fn is None:
        code = _flex.__code__.replace(co_name=f"_flex_{kind}_{len(_compiled)}")
        compiled = torch.compile(types.FunctionType(code, _flex.__globals__), fullgraph=True)

        def fn(*args, compiled=compiled):
            with _dynamo().config.patch(fail_on_recompile_limit_hit=True):
                return compiled(*args)

        _compiled[key] = fn
    return fn
