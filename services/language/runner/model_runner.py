"""Runs one `ForwardBatch` through the decoder over the paged KV cache.

The chunk invariants and the positions convention are `forward_batch.py`'s. Flat token
layout of one step (see attention.py): single-token chunks first, then the multi-token
chunks; logits come back in the batch's chunk order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from tandem.cpu_kernels import linear_compute_dtype, linear_kernels, sampler_kernels
from tandem.services.language.model import DecoderConfig, QwenVLDecoder
from tandem.services.language.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    PrefillChunkMeta,
    chunk_plan,
    select_attention,
)
from tandem.services.language.model.decoder import MoEDispatch
from tandem.services.language.runner.forward_batch import (
    ChunkLimits,
    ForwardBatch,
    ForwardOutput,
    SeqChunk,
    chunk_slots,
    decode_rows,
)
from tandem.services.language.runner.graph_runner import GraphRunner, MixedStep
from tandem.services.language.runner.kv_cache import KVCache
from tandem.services.language.runner.kv_sizing import DeviceMemory, pages_for
from tandem.units import ceil_div

if TYPE_CHECKING:
    from tandem.models.split import TextWeights
    from tandem.services.language.tp.ranks import TensorParallel

log = logging.getLogger("tandem.language")


COMPILE_STEP = ("off", "decode", "all")  # the values of `compile_step` (config.py)


@dataclass(frozen=True)
class RunnerSettings:
    """How a runner runs its model, the same on every tensor-parallel rank (rank 0 sends
    them to the others, `tp/ranks.py` RankArgs.runner). Built once from the service's
    config (`language/main.py`, runner_settings)."""

    page_size: int = 16  # tokens per KV page
    max_seq_len: int = 4096  # the longest sequence (a decode graph holds this many)
    # The largest step the engine schedules (its max_prefill_tokens, max_running_requests):
    # what sizing the KV pool by free memory measures and sets aside (kv_sizing.py)
    max_prefill_tokens: int = 4096
    max_decode_rows: int = 64
    cuda_graph_max_bs: int = 0  # decode batch sizes captured as CUDA graphs (0: none)
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    # CPU: a step of fewer tokens runs on one thread (0: every step uses them all), and
    # with `cpu_small_step_pool` its linears still use every core through the claim pool
    cpu_parallel_min_tokens: int = 0
    cpu_small_step_pool: bool = False
    cpu_pool_spin_us: int = 1000
    # A bfloat16 model on the CPU: its linear products in float32 over the same weights, or
    # in torch's bfloat16 GEMM (`linear_compute_dtype`: auto | bfloat16 | float32)
    cpu_bf16_compute: str = "auto"
    # CPU: each decode batch bucket's step compiled by inductor at start-up ("decode"), and
    # with "all" every other step through one graph of dynamic token counts (graph_runner
    # `MixedStep`), or none ("off"); inductor's cache under compile_cache_dir ("": its
    # default, under /tmp)
    compile_step: str = "off"
    compile_cache_dir: str = ""


class ModelRunner:
    """Owns the decoder, the KV tensors and (optionally) the decode graph runner and, on
    the CPU with compile_step all, the compiled mixed step (graph_runner `MixedStep`).

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
        once the largest step and the graphs are set aside (CUDA; kv_sizing.py).
        `settings` is what every tensor-parallel rank runs with (rank 0's).

        Consumes `weights.tensors` (the decoder adopts them, and no duplicate may stay
        alive while it does): a second runner over the same load takes `weights.copy()`."""
        if not weights.tensors:
            raise ValueError("these TextWeights were consumed by an earlier ModelRunner (it "
                             "adopts the tensors): load them again, or pass weights.copy()")
        s = self.settings = settings
        if s.compile_step not in COMPILE_STEP:
            raise ValueError(f"compile_step must be one of {COMPILE_STEP}, got {s.compile_step!r}")
        if s.compile_step != "off" and tp is not None:
            # NOTE: the row-parallel products' all-reduce is a collective dynamo cannot
            # trace as one graph here (gloo); not built
            raise ValueError(f"compile_step {s.compile_step} is not supported with tensor "
                             "parallelism")
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
        # Sparse MoE blocks: a decode graph's batch (<= cuda_graph_max_bs rows) never syncs.
        self.model.set_moe_dispatch(
            MoEDispatch.for_device(self.device, dtype, settings.cuda_graph_max_bs))
        # The products' dtype: the model's, or float32 for bfloat16 on a CPU without AMX
        # (over the same weight values: packed in bfloat16, else widened; activations and
        # KV stay bfloat16).
        self.linear_dtype = linear_compute_dtype(s.cpu_bf16_compute, self.device, dtype)
        self.linear_kernels = linear_kernels(s.linear_backend, self.device, self.linear_dtype)
        if self.linear_dtype != dtype:
            self.model.compute_linears_in_float32(packed=self.linear_kernels is not None)
        if self.linear_kernels is not None:
            self.model.adopt_cpu_kernels(self.linear_kernels, pointwise=dtype == torch.float32)
        # What the engine's sampler cuts and draws the sampled rows with (sampler.sample)
        self.sampler_kernels = sampler_kernels(self.device)

        c = self.cfg
        # What the engine, the scheduler and the limits read; fixed for the runner's life
        # (num_pages, kv and limits once the KV cache exists, below).
        self.page_size = page_size
        self.vocab_size, self.hidden_size, self.embed_dim = c.vocab_size, c.hidden_size, c.embed_dim
        # How attention runs (attention.py: paged_cpu / gather / flex), chosen once here.
        self.attention = select_attention(s.attention_backend, self.device, page_size)
        # The KV cache's dtype: the model's. With float32 products over a bfloat16 model
        # (above), attention runs in float32 over the same K/V values: on the paged_cpu
        # kernels over a bfloat16 cache, half the memory (the decode kernel widens pages
        # in registers as it loads them: the float32 kernel's bits, at its speed or faster
        # with half the bytes to read; docs/benchmarks.md); the gather and flex paths keep
        # a float32 cache (twice it).
        self.kv_dtype = dtype
        if self.linear_dtype != dtype:
            if self.attention.backend is AttentionBackend.PAGED_CPU:
                self.attention = replace(self.attention, compute_dtype=self.linear_dtype)
            else:
                self.kv_dtype = self.linear_dtype
            log.info("bfloat16 on a CPU: linear products and attention in float32 over the "
                     "same weight and K/V values, weights held in %s, KV cache in %s "
                     "(cpu_bf16_compute=%s, attention %s)",
                     "bfloat16 (packed)" if self.linear_kernels is not None else "float32",
                     str(self.kv_dtype).removeprefix("torch."), s.cpu_bf16_compute,
                     self.attention.backend.value)
        if (s.compile_step != "off" and self.device.type == "cpu"
                and self.attention.backend is not AttentionBackend.PAGED_CPU):
            # NOTE: a compiled bucket reads the widest block table, which only the in-place
            # decode kernel reads no further than each row's seq_len (gather would copy it)
            raise ValueError(f"compile_step {s.compile_step} runs with the paged_cpu attention "
                             f"(the CPU decode kernel), not {self.attention.backend.value}")
        if s.compile_step != "off" and self.device.type == "cpu" and self.cfg.moe_layers:
            # NOTE: torch 2.13's fake (meta) grouped_mm takes bfloat16 only, where the CPU
            # kernel runs float32: a float32 MoE step does not trace (the dense way would,
            # at E/k times the expert reads); not built
            raise ValueError(f"compile_step {s.compile_step} is not supported for sparse MoE "
                             "models")
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None  # gather on CPU only
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
        self.mixed_step: MixedStep | None = None  # compile_step all (CPU): every other step
        # The KV cache last, then the graphs (kv_sizing.py: the order, the same on every
        # rank, so the collectives of the measured steps, the agreement and the captures
        # meet). With kv_pages given every rank has the same count from rank 0's args.
        if num_pages <= 0:
            num_pages = self._pages_for_memory(kv_memory_fraction)
            if tp is not None:
                num_pages = tp.agree_min(num_pages)
        self._allocate_kv(num_pages)
        # Flex (CUDA): its kernels compile here, not in the first requests (attention.py).
        self.attention.warm_up(self.kv.k[0], self.kv.v[0], c.local_heads, c.head_dim**-0.5)
        if self._uses_graphs():
            self.graph_runner = self._new_graph_runner()
            self.graph_runner.capture()
        if s.compile_step == "all" and self.device.type == "cpu":
            self.mixed_step = MixedStep(self.model, self.kv, self.attention, s.max_seq_len,
                                        s.compile_cache_dir)
            self.mixed_step.compile()  # at start-up, never in a request's step

    # -- start-up: the KV cache and the graphs (kv_sizing.py) --------------------------
    def _allocate_kv(self, num_pages: int) -> None:
        c, ps = self.cfg, self.page_size
        self.kv = None  # (a provisional cache goes before the next is allocated)
        self.kv = KVCache(c.num_layers, num_pages, ps, c.local_kv_heads, c.head_dim,
                          self.kv_dtype, self.device)
        self.num_pages = num_pages
        self.limits = ChunkLimits(c.vocab_size, c.embed_dim, c.hidden_size, num_pages, ps)

    def _uses_graphs(self) -> bool:
        return self.settings.cuda_graph_max_bs > 0

    def _new_graph_runner(self) -> GraphRunner:
        s = self.settings
        return GraphRunner(
            self.model, self.kv, self.compute_logits, self.limits, self.device,
            max_bs=s.cuda_graph_max_bs, max_seq_len=s.max_seq_len, attention=self.attention,
            compile=s.compile_step != "off", compile_cache_dir=s.compile_cache_dir,
            threads_for=self._threads_for,
        )

    def _threads_for(self, tokens: int) -> int:
        """The torch threads a step of `tokens` tokens runs on (`_forward`)."""
        if self.parallel_min_tokens and self.max_threads > 1:
            return 1 if tokens < self.parallel_min_tokens else self.max_threads
        return torch.get_num_threads()

    @torch.inference_mode()
    def _pages_for_memory(self, fraction: float) -> int:
        """KV pages from free CUDA memory, once the largest step and the graphs are measured
        over a provisional one-page cache (kv_sizing.py)."""
        memory = DeviceMemory.of(self.device)
        c = self.cfg
        self._allocate_kv(1)
        worst = self._worst_step()
        self.forward_eager(worst)  # grows the workspaces: allocated from here on
        eager = memory.peak_of(lambda: self.forward_eager(worst))
        graphs = 0
        if self._uses_graphs():
            gr = self._new_graph_runner()
            graphs = gr.pool_bytes(memory)
            del gr
        self.kv = None
        free = memory.free_bytes()
        per_page = KVCache.bytes_per_page(c.num_layers, self.page_size, c.local_kv_heads,
                                          c.head_dim, self.kv_dtype)
        pages = pages_for(fraction, free, eager + graphs, per_page)
        log.info("KV pool: %d pages of %d tokens (%.2f GiB free after the weights; set aside "
                 "%.2f GiB for the largest step, %.2f GiB for the decode graphs; fraction %g)",
                 pages, self.page_size, free / 2**30, eager / 2**30, graphs / 2**30, fraction)
        return pages

    def _worst_step(self) -> ForwardBatch:
        """The largest step the engine schedules, every row at max_seq_len of context, every
        page id 0 (a one-page cache): a `max_prefill_tokens` prompt chunk (embedding rows,
        deepstack included) and `max_decode_rows` decode rows."""
        s, ps = self.settings, self.page_size
        ctx = s.max_seq_len
        n = min(s.max_prefill_tokens, ctx)
        table = [0] * ceil_div(ctx, ps)
        chunks = [SeqChunk(1 + i, ctx - 1, torch.full((3, 1), ctx - 1, dtype=torch.int64), table,
                           token_ids=torch.zeros(1, dtype=torch.int64))
                  for i in range(s.max_decode_rows)]
        chunks.append(SeqChunk(0, ctx - n, torch.arange(ctx - n, ctx).expand(3, n), table,
                               input_embeds=torch.zeros(n, self.embed_dim, dtype=self.dtype)))
        return ForwardBatch(chunks)

    # -- forward -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Graph runner when it can serve the batch (pure decode, small enough), else the
        compiled mixed step when there is one (a step with a chunk), else eager."""
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
        if self.mixed_step is not None and self.mixed_step.can_run(batch):
            return self._run(batch, self.mixed_step)
        return self.forward_eager(batch)

    @torch.inference_mode()
    def forward_eager(self, batch: ForwardBatch) -> ForwardOutput:
        return self._run(batch, None)

    @torch.inference_mode()
    def forward_mixed(self, batch: ForwardBatch) -> ForwardOutput:
        """The step through the compiled mixed step (compile_step all; `MixedStep.can_run`)."""
        if self.mixed_step is None or not self.mixed_step.can_run(batch):
            raise ValueError("the compiled mixed step cannot serve this batch")
        return self._run(batch, self.mixed_step)

    def _run(self, batch: ForwardBatch, mixed: MixedStep | None) -> ForwardOutput:
        """The step eagerly, or through `mixed` (its padding rows first, then the same
        rows; the logits of the same rows)."""
        chunks = batch.chunks
        if not chunks:
            raise ValueError("empty ForwardBatch")
        for c in chunks:
            self.limits.check(c)
        # Flat order: single-token chunks first (batched attention), then longer chunks.
        order = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
        singles = len(order)
        order += [i for i, c in enumerate(chunks) if c.num_tokens > 1]
        ordered = [chunks[i] for i in order]
        pad = 0
        if mixed is None:
            meta, row_start = self._metadata(ordered)
            hidden, deepstack = self._embed(ordered, row_start)
        else:
            pad = mixed.padding(singles)
            ordered = [self._padding_row() for _ in range(pad)] + ordered
            row_start = _row_starts(ordered)
            hidden, deepstack = self._embed(ordered, row_start, always_deepstack=True)
        positions = torch.cat([c.positions for c in ordered], dim=1).to(self.device, torch.int64)
        if mixed is None:
            out = self.model(hidden, positions, meta, self.kv.k, self.kv.v, deepstack)
        else:
            inputs = self._mixed_inputs(ordered, row_start, pad + singles, mixed.max_pages)
            out = mixed.run(hidden, positions, *inputs, deepstack)

        # Logits only for the rows anyone reads (one lm_head call): the last row of each
        # chunk, or all its rows when prompt logits are asked for (last = their final row).
        flat_of = dict(zip(order, range(pad, pad + len(order)), strict=True))
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

    @property
    def decode_op(self):
        """The in-place CPU decode kernel this runner attends with (paged_cpu), else None."""
        return self.attention.decode_op

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.logits(hidden)
        return logits if self.tp is None else self.tp.gather_vocab(logits)

    # -- helpers -----------------------------------------------------------------------
    def _padding_row(self) -> SeqChunk:
        """A single-token row on the dummy page (token 0, position 0; `decode_rows` gives
        it seq_len 1 and the dummy page's first slot), as a decode bucket's padding."""
        return SeqChunk(-1, 0, torch.zeros(3, 1, dtype=torch.int64), [self.kv.dummy_page],
                        token_ids=torch.zeros(1, dtype=torch.int64))

    def _mixed_inputs(self, ordered: list[SeqChunk], row_start: list[int], singles: int,
                      width: int):
        """The compiled mixed step's attention inputs: slots [T], the single rows' tables
        [singles, width] (the widest: the decode kernel reads a row's seq_len of pages) and
        seq_lens, and the chunks' plan (attention.py `chunk_plan`)."""
        ps = self.page_size
        rows = decode_rows(ordered[:singles], ps, self.kv.dummy_page, width=width)
        slots, plan = [rows.slot_mapping], []
        first = row_start[singles] if singles < len(ordered) else 0
        for a, c in zip(row_start[singles:], ordered[singles:], strict=True):
            kv_len = c.start + c.num_tokens
            plan.append((a - first, c.num_tokens, kv_len, c.block_table[: ceil_div(kv_len, ps)]))
            slots.append(chunk_slots(c, ps))
        return torch.cat(slots), rows.block_tables, rows.seq_lens, chunk_plan(plan)

    def _metadata(self, ordered: list[SeqChunk]) -> tuple[AttentionMetadata, list[int]]:
        ps = self.page_size
        row_start = _row_starts(ordered)
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
        gather = self.attention.backend is AttentionBackend.GATHER and singles
        meta = self.attention.metadata(
            slot_mapping=torch.cat(slots).to(dev),
            block_tables=rows.block_tables.to(dev),
            seq_lens=rows.seq_lens.to(dev),
            page_size=ps,
            cache_pages=self.kv.k[0].shape[0],
            prefill=prefill,
            workspace=self._gather_workspace(rows.block_tables.numel()) if gather else None,
        )
        return meta, row_start

    def _gather_workspace(self, pages: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K/V gather buffers for `pages` pages, reused across steps (gather path only).

        NOTE: they exist for the CPU, where a fresh multi-MB gather per layer costs more in
        page faults than the copy; elsewhere the allocator reuses freed blocks (None:
        `paged_attention` gathers into temporaries). They hold at most one layer's K/V
        (`cache_pages` pages, 1/num_layers of the pool): a step that needs more (padded or
        shared pages) gathers into temporaries freed with the step, so the extra memory
        next to the pool is bounded by the pool, not by the largest step ever seen."""
        cap = self.kv.k[0].shape[0]
        if self.device.type != "cpu" or pages > cap:
            return None
        if self._workspace is None or self._workspace[0].shape[0] < pages:
            k = self.kv.k[0]
            grow = min(cap, max(pages, 2 * (0 if self._workspace is None else self._workspace[0].shape[0])))
            shape = (grow, *k.shape[1:])
            self._workspace = (
                torch.empty(shape, dtype=k.dtype, device=k.device),
                torch.empty(shape, dtype=k.dtype, device=k.device),
            )
        return self._workspace

    def _embed(self, ordered: list[SeqChunk], row_start: list[int], always_deepstack: bool = False):
        """hidden [T, hidden] and the deepstack blocks [T, nd*hidden] (None if unused; zeros
        with `always_deepstack` for a deepstack model: the compiled mixed step's one graph)."""
        hs, nd = self.cfg.hidden_size, self.cfg.num_deepstack
        total = row_start[-1] + ordered[-1].num_tokens
        hidden = torch.empty(total, hs, dtype=self.dtype, device=self.device)
        deepstack = None
        if nd and (always_deepstack or any(
                c.input_embeds is not None and c.input_embeds.shape[1] > hs for c in ordered)):
            deepstack = torch.zeros(total, nd * hs, dtype=self.dtype, device=self.device)
        tok_rows, tok_ids = [], []
        for a, c in zip(row_start, ordered, strict=True):
            if c.token_ids is not None:
                tok_rows.append(torch.arange(a, a + c.num_tokens))
                tok_ids.append(c.token_ids)
                continue
            # NOTE: asynchronous on CUDA: the rows are page-locked (EmbeddingBuffers.
            # private_embeds) and the request holds them past the step (torch's host
            # allocator also keeps a freed page-locked block until its copies are done)
            e = c.input_embeds.to(self.device, self.dtype, non_blocking=True)
            hidden[a : a + c.num_tokens] = e[:, :hs]
            if deepstack is not None and e.shape[1] > hs:
                deepstack[a : a + c.num_tokens] = e[:, hs:]
        if tok_ids:
            ids = torch.cat(tok_ids).to(self.device, torch.int64)
            hidden[torch.cat(tok_rows).to(self.device)] = self.model.embed(ids)
        return hidden, deepstack


def _row_starts(ordered: list[SeqChunk]) -> list[int]:
    """The first flat row of each chunk, in `ordered`'s order."""
    out, row = [], 0
    for c in ordered:
        out.append(row)
        row += c.num_tokens
    return out
