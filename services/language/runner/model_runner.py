"""Runs one `ForwardBatch` through the decoder over the paged KV cache.

The chunk invariants and the positions convention are `forward_batch.py`'s. Flat token
layout of one step (see attention.py): single-token chunks first, then the multi-token
chunks; logits come back in the batch's chunk order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.cpu_kernels import decode_attention_op, linear_kernels
from tandem.services.language.model import DecoderConfig, QwenVLDecoder
from tandem.services.language.model.attention import AttentionMetadata, PrefillChunkMeta
from tandem.services.language.runner.forward_batch import (
    ChunkLimits,
    ForwardBatch,
    ForwardOutput,
    SeqChunk,
    chunk_slots,
    decode_rows,
)
from tandem.services.language.runner.graph_runner import GraphRunner
from tandem.services.language.runner.kv_cache import KVCache
from tandem.units import ceil_div

if TYPE_CHECKING:
    from tandem.models.split import TextWeights
    from tandem.services.language.tp.ranks import TensorParallel


@dataclass(frozen=True)
class RunnerSettings:
    """How a runner runs its model, the same on every tensor-parallel rank (rank 0 sends
    them to the others, `tp/ranks.py` RankArgs.runner). Built once from the service's
    config (`language/main.py`, runner_settings)."""

    page_size: int = 16  # tokens per KV page
    max_seq_len: int = 4096  # the longest sequence a decode graph holds
    cuda_graph_max_bs: int = 0  # decode batch sizes captured as CUDA graphs (0: none)
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    # CPU: a step of fewer tokens runs on one thread (0: every step uses them all), and
    # with `cpu_small_step_pool` its linears still use every core through the claim pool
    cpu_parallel_min_tokens: int = 0
    cpu_small_step_pool: bool = False
    cpu_pool_spin_us: int = 1000


class ModelRunner:
    """Owns the decoder, the KV tensors and (optionally) the decode graph runner.

    It holds no page bookkeeping: whoever schedules (the `Engine`'s scheduler) builds a
    `KVPagePool(runner.num_pages, runner.page_size)` and hands out the page ids.

    `weights` is a `tandem.models.split.TextWeights` (`load_text_weights(path, dtype,
    device)`): `.spec` (ModelSpec) and `.tensors` under normalized names.
    """

    def __init__(
        self,
        weights: TextWeights,
        settings: RunnerSettings = RunnerSettings(),  # noqa: B008 (frozen)
        *,
        num_pages: int = 0,
        kv_memory_fraction: float = 0.5,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        tp: TensorParallel | None = None,
    ) -> None:
        """`num_pages` 0: as many as `kv_memory_fraction` of the device's free memory holds
        (CUDA). `settings` is what every tensor-parallel rank runs with (rank 0's)."""
        s = self.settings = settings
        page_size = s.page_size
        spec = weights.spec
        self.device = torch.device(device)
        self.dtype = dtype
        self.spec = spec
        # Tensor parallelism (tp/ranks.py): `weights` hold this rank's shard; every rank runs every
        # step (rank 0 sends it to the others first), logits are gathered to rank 0.
        self.tp = tp
        self.cfg = DecoderConfig.from_weights(spec, weights.tensors, tp.shard if tp else None)
        self.eos_token_ids: tuple[int, ...] = tuple(int(t) for t in spec.eos_token_ids)
        extra = {"reduce": tp.all_reduce} if tp else {}
        self.model = QwenVLDecoder.build(self.cfg, weights.tensors, self.device, dtype, **extra)
        self.linear_kernels = linear_kernels(s.linear_backend, self.device, dtype)
        if self.linear_kernels is not None:
            self.model.adopt_cpu_kernels(self.linear_kernels)

        c = self.cfg
        if num_pages <= 0:
            num_pages = KVCache.pages_for_memory(
                kv_memory_fraction, self.device, c.num_layers, page_size, c.local_kv_heads,
                c.head_dim, dtype,
            )  # fmt: skip
        self.kv = KVCache(
            c.num_layers, num_pages, page_size, c.local_kv_heads, c.head_dim, dtype, self.device
        )
        # What the engine, the scheduler and the limits read; fixed for the runner's life.
        self.num_pages, self.page_size = num_pages, page_size
        self.vocab_size, self.hidden_size, self.embed_dim = c.vocab_size, c.hidden_size, c.embed_dim
        self.limits = ChunkLimits(c.vocab_size, c.embed_dim, c.hidden_size, num_pages, page_size)
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self.decode_op = decode_attention_op(s.attention_backend, self.device)
        # NOTE (CPU): a step of fewer tokens runs on one torch thread. On a host whose cores
        # the other tiers (router, encoder) and clients share, a small step's OpenMP regions
        # wait for a descheduled thread more than they gain from the second one (measured
        # in docs/benchmarks.md); big steps (prefill, wide decode batches) use them all.
        # With `cpu_small_step_pool` a small step's linears (most of it: it streams every
        # weight) still use every core, through the claim-based pool, which never waits
        # for a helper that has not started (csrc/strip_pool.cpp).
        self.max_threads = torch.get_num_threads()
        self.parallel_min_tokens = s.cpu_parallel_min_tokens if self.device.type == "cpu" else 0
        if (s.cpu_small_step_pool and self.parallel_min_tokens and self.max_threads > 1
                and self.linear_kernels is not None):
            self.linear_kernels.set_pool_helpers(self.max_threads - 1, s.cpu_pool_spin_us)
        self.graph_runner: GraphRunner | None = None
        # NOTE: a sparse MoE layer routes with a data-dependent loop over experts, which a
        # CUDA graph cannot capture: MoE models decode eagerly.
        if s.cuda_graph_max_bs > 0 and not self.model.cfg.moe_layers:
            self.graph_runner = GraphRunner(
                self.model, self.kv, self.compute_logits, self.limits, self.device,
                max_bs=s.cuda_graph_max_bs, max_seq_len=s.max_seq_len,
            )  # fmt: skip

    # -- forward -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Graph runner when it can serve the batch (pure decode, small enough), else eager."""
        if self.tp is None:
            return self._forward(batch)
        workers = self.tp.workers
        if workers is not None:  # rank 0: a batch the checks refuse never reaches the others
            if not batch.chunks:
                raise ValueError("empty ForwardBatch")
            for c in batch.chunks:
                self.limits.check(c)
            workers.send_step(batch)
        try:
            return self._forward(batch)
        except Exception as e:  # NOTE: past the send every rank is in this step: fatal
            if workers is None:
                raise
            workers.fail(f"step failed on rank 0: {type(e).__name__}: {e}")
            raise

    def _forward(self, batch: ForwardBatch) -> ForwardOutput:
        if self.parallel_min_tokens and self.max_threads > 1:
            small = batch.num_tokens < self.parallel_min_tokens
            threads = 1 if small else self.max_threads
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.run(batch)
        return self.forward_eager(batch)

    @torch.inference_mode()
    def forward_eager(self, batch: ForwardBatch) -> ForwardOutput:
        chunks = batch.chunks
        if not chunks:
            raise ValueError("empty ForwardBatch")
        for c in chunks:
            self.limits.check(c)
        # Flat order: single-token chunks first (batched attention), then longer chunks.
        order = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
        order += [i for i, c in enumerate(chunks) if c.num_tokens > 1]
        ordered = [chunks[i] for i in order]
        meta, row_start = self._metadata(ordered)
        hidden, deepstack = self._embed(ordered, row_start)
        positions = torch.cat([c.positions for c in ordered], dim=1).to(self.device, torch.int64)
        out = self.model(hidden, positions, meta, self.kv.k, self.kv.v, deepstack)

        # Logits only for the rows anyone reads (one lm_head call): the last row of each
        # chunk, or all its rows when prompt logits are asked for (last = their final row).
        flat_of = dict(zip(order, range(len(order)), strict=True))
        rows, spans = [], []
        for i, c in enumerate(chunks):
            a = row_start[flat_of[i]]
            lo = a if c.want_prompt_logits else a + c.num_tokens - 1
            spans.append((len(rows), len(rows) + a + c.num_tokens - lo))
            rows.extend(range(lo, a + c.num_tokens))
        logits = self.compute_logits(out[torch.tensor(rows, device=self.device)])
        last_logits = logits[torch.tensor([e - 1 for _, e in spans], device=self.device)]
        prompt_logits = {
            c.seq_id: logits[b:e]
            for c, (b, e) in zip(chunks, spans, strict=True)
            if c.want_prompt_logits
        }
        return ForwardOutput(last_logits=last_logits, prompt_logits=prompt_logits)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.logits(hidden)
        return logits if self.tp is None else self.tp.gather_vocab(logits)

    # -- helpers -----------------------------------------------------------------------
    def _metadata(self, ordered: list[SeqChunk]) -> tuple[AttentionMetadata, list[int]]:
        ps = self.page_size
        row_start, row = [], 0
        for c in ordered:
            row_start.append(row)
            row += c.num_tokens
        singles = [c for c in ordered if c.num_tokens == 1]
        rows = decode_rows(singles, ps, self.kv.dummy_page)
        prefill, slots = [], [rows.slot_mapping]
        for i, c in enumerate(ordered[len(singles) :], start=len(singles)):
            kv_len = c.start + c.num_tokens
            pages = torch.tensor(c.block_table[: ceil_div(kv_len, ps)], dtype=torch.int64)
            prefill.append(
                PrefillChunkMeta(row_start[i], c.num_tokens, kv_len, pages.to(self.device))
            )
            slots.append(chunk_slots(c, ps))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev),
            num_single=len(singles),
            single_block_tables=rows.block_tables.to(dev),
            single_seq_lens=rows.seq_lens.to(dev),
            prefill=prefill,
            workspace=(
                None if self.decode_op else self._gather_workspace(rows.block_tables.numel())
            ),
            decode_op=self.decode_op,
        )
        return meta, row_start

    def _gather_workspace(self, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V gather buffers for `pages` pages, grown (never shrunk) and reused across steps."""
        if self._workspace is None or self._workspace[0].shape[0] < pages:
            k = self.kv.k[0]
            grow = max(pages, 2 * (0 if self._workspace is None else self._workspace[0].shape[0]))
            shape = (grow, *k.shape[1:])
            self._workspace = (
                torch.empty(shape, dtype=k.dtype, device=k.device),
                torch.empty(shape, dtype=k.dtype, device=k.device),
            )
        return self._workspace

    def _embed(self, ordered: list[SeqChunk], row_start: list[int]):
        """hidden [T, hidden] and the deepstack blocks [T, nd*hidden] (None if unused)."""
        hs, nd = self.cfg.hidden_size, self.cfg.num_deepstack
        total = row_start[-1] + ordered[-1].num_tokens
        hidden = torch.empty(total, hs, dtype=self.dtype, device=self.device)
        deepstack = None
        if nd and any(c.input_embeds is not None and c.input_embeds.shape[1] > hs for c in ordered):
            deepstack = torch.zeros(total, nd * hs, dtype=self.dtype, device=self.device)
        tok_rows, tok_ids = [], []
        for a, c in zip(row_start, ordered, strict=True):
            if c.token_ids is not None:
                tok_rows.append(torch.arange(a, a + c.num_tokens))
                tok_ids.append(c.token_ids)
                continue
            e = c.input_embeds.to(self.device, self.dtype)
            hidden[a : a + c.num_tokens] = e[:, :hs]
            if deepstack is not None and e.shape[1] > hs:
                deepstack[a : a + c.num_tokens] = e[:, hs:]
        if tok_ids:
            ids = torch.cat(tok_ids).to(self.device, torch.int64)
            hidden[torch.cat(tok_rows).to(self.device)] = self.model.embed_tokens(ids)
        return hidden, deepstack
