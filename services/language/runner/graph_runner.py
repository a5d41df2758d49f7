"""Decode CUDA-graph runner: static buffers, batch-size x KV-width buckets, pad and slice.

A graph replays fixed kernels on fixed addresses, so every input lives in a static buffer
allocated once, and a graph exists per (batch bucket, KV width bucket):

    token_ids     [max_bs]                 int64
    positions     [3, max_bs]              int64   (t, h, w rows; equal for decode)
    block_tables  [max_bs, max_pages]      int64   pages of each row, padded with DUMMY
    seq_lens      [max_bs]                 int64   keys visible to each row (>= 1)
    slot_mapping  [max_bs]                 int64   cache slot the new K/V goes to

    graph (bs, W) reads   token_ids[:bs], positions[:, :bs], block_tables[:bs, :W], ...
    rows [raw_bs, bs) are padding: token 0, position 0, seq_len 1, every page and the
    slot on the KV cache's dummy page, so they touch no real KV; their logits are sliced off.
    Tables, seq_lens and slots come from `forward_batch.decode_rows`, as in the eager path.

Batch buckets are [1, 2, 4, 8] + range(16, max_bs + 1, 16); width buckets double from 16
pages up to max_pages (attention over a padded block table costs O(W), so a short batch
does not pay for max_seq_len). Graphs are captured largest first into ONE memory pool.
NOTE: graphs cover sequences up to min(max_seq_len, GRAPH_MAX_SEQ_LEN) tokens: the gathered
K/V of the widest graph is max_bs * W * page_size rows per layer, captured in the pool;
longer sequences run eagerly, which gathers only the width they need.

On a machine without CUDA nothing is captured: `run` executes the very same `_step` over
the same static buffers eagerly, so padding and slicing are tested everywhere.

The runner is given what it reads and nothing more (the decoder, the KV tensors, the
logits head, the chunk limits); it never sees the `ModelRunner` that owns it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from tandem.services.language.model import QwenVLDecoder
from tandem.services.language.model.attention import AttentionMetadata
from tandem.services.language.runner.forward_batch import (
    ChunkLimits,
    ForwardBatch,
    ForwardOutput,
    decode_rows,
)
from tandem.services.language.runner.kv_cache import KVCache
from tandem.units import ceil_div

GRAPH_MAX_SEQ_LEN = 8192


def batch_buckets(max_bs: int) -> list[int]:
    return [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 16))


def width_buckets(max_pages: int, smallest: int = 16) -> list[int]:
    out, w = [], smallest
    while w < max_pages:
        out.append(w)
        w *= 2
    return out + [max_pages]


class GraphRunner:
    def __init__(
        self,
        model: QwenVLDecoder,
        kv: KVCache,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        limits: ChunkLimits,
        device: torch.device,
        max_bs: int,
        max_seq_len: int,
    ) -> None:
        if max_bs < 1 or max_seq_len < 1:
            raise ValueError(f"bad graph runner limits: max_bs={max_bs}, max_seq_len={max_seq_len}")
        self.model, self.kv, self.compute_logits, self.limits = model, kv, compute_logits, limits
        self.device = device
        self.page_size = kv.page_size
        self.batch_sizes = batch_buckets(max_bs)
        self.max_pages = ceil_div(min(max_seq_len, GRAPH_MAX_SEQ_LEN), self.page_size)
        self.widths = width_buckets(self.max_pages)
        n, dev = self.batch_sizes[-1], self.device
        self.dummy_page = kv.dummy_page
        self.dummy_slot = self.dummy_page * self.page_size
        self.token_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(3, n, dtype=torch.int64, device=dev)
        self.block_tables = torch.full(
            (n, self.max_pages), self.dummy_page, dtype=torch.int64, device=dev
        )
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), self.dummy_slot, dtype=torch.int64, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.use_graphs = self.device.type == "cuda"
        if self.use_graphs:
            self.capture()

    # -- the step a graph records -----------------------------------------------------
    def _step(self, bs: int, width: int) -> torch.Tensor:
        """Logits [bs, vocab] float32 for rows [0, bs) of the static buffers (capture-safe)."""
        model = self.model
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            num_single=bs,
            single_block_tables=self.block_tables[:bs, :width],
            single_seq_lens=self.seq_lens[:bs],
        )
        hidden = model.embed_tokens(self.token_ids[:bs])
        out = model(hidden, self.positions[:, :bs], meta, self.kv.k, self.kv.v)
        return self.compute_logits(out)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (bs, width) graph, largest first, into one shared memory pool."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bs in reversed(self.batch_sizes):
            for width in reversed(self.widths):
                # Warm up on a side stream (lazy inits, allocator) before recording.
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self._step(bs, width)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self._step(bs, width)
                self.graphs[(bs, width)] = graph
                self.outputs[(bs, width)] = out
        torch.cuda.synchronize(self.device)

    # -- serving ---------------------------------------------------------------------------
    def can_run(self, batch: ForwardBatch) -> bool:
        if not batch.is_pure_decode or len(batch.chunks) > self.batch_sizes[-1]:
            return False
        return all(c.start + 1 <= self.max_pages * self.page_size for c in batch.chunks)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> ForwardOutput:
        if not self.can_run(batch):
            raise ValueError("graph runner cannot serve this batch (use the eager path)")
        raw = len(batch.chunks)
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, raw)]
        need = max(ceil_div(c.start + 1, self.page_size) for c in batch.chunks)
        width = self.widths[bisect.bisect_left(self.widths, need)]
        for c in batch.chunks:
            self.limits.check(c)

        # Build the [bs]-row inputs on the host, padding rows included, then copy once.
        ids = torch.zeros(bs, dtype=torch.int64)
        pos = torch.zeros(3, bs, dtype=torch.int64)
        for i, c in enumerate(batch.chunks):
            ids[i] = c.token_ids[0]
            pos[:, i] = c.positions[:, 0]
        rows = decode_rows(batch.chunks, self.page_size, self.dummy_page, rows=bs, width=width)
        self.token_ids[:bs].copy_(ids, non_blocking=True)
        self.positions[:, :bs].copy_(pos, non_blocking=True)
        self.block_tables[:bs, :width].copy_(rows.block_tables, non_blocking=True)
        self.seq_lens[:bs].copy_(rows.seq_lens, non_blocking=True)
        self.slot_mapping[:bs].copy_(rows.slot_mapping, non_blocking=True)

        if self.use_graphs:
            self.graphs[(bs, width)].replay()
            logits = self.outputs[(bs, width)][:raw].clone()
        else:
            logits = self._step(bs, width)[:raw]
        # A 1-token chunk's prompt logits are its last logits.
        prompt = {
            c.seq_id: logits[i : i + 1] for i, c in enumerate(batch.chunks) if c.want_prompt_logits
        }
        return ForwardOutput(last_logits=logits, prompt_logits=prompt)
