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

The five are views of one int64 block (`InputLayout`). A step fills the block's host
mirror (page-locked on CUDA) and uploads rows [0, bs) of every input with ONE asynchronous
copy; the mirror is static, so nothing the copy reads is freed under it, and it is written
again only after that copy has run (`UploadFence`).

Batch buckets are [1, 2, 4, 8] + range(16, max_bs + 1, 16); width buckets double from 16
pages up to max_pages (attention over a padded block table costs O(W), so a short batch
does not pay for max_seq_len). Graphs are captured largest first into ONE memory pool.
Attention runs as the owner's eager steps do (`attention.AttentionPath.metadata`; on CUDA
the flex path, whose block masks are built inside the graph from the static tables).
NOTE: with the gather path graphs cover sequences up to min(max_seq_len, GRAPH_MAX_SEQ_LEN)
tokens: the gathered K/V of the widest graph is max_bs * W * page_size rows per layer,
captured in the pool; longer sequences run eagerly, which gathers only the width they
need. The flex path copies no pages, so its graphs cover max_seq_len.

Graphs are captured by `capture()`, which the owner calls last, once the KV cache is final
(`kv_sizing.py`: the memory the pool will take was measured by `pool_bytes` and set aside
before the cache was sized); with tensor parallelism every rank captures at the same point.
On a machine without CUDA nothing is captured: `run` executes the very same `_step` over
the same static buffers eagerly, so padding and slicing are tested everywhere.

Compiled on the CPU (`compile` set: the runner's `compile_step` = decode): the same
`_step` of every batch bucket is compiled by `torch.compile` (inductor), at start-up in
`capture()` as graphs are captured on CUDA, never in a request's step. A compiled bucket
always reads the widest table (`max_pages` columns, the rest on the dummy page: the decode
kernel reads only the pages a row's seq_len covers), so one compile serves every width;
batch sizes are static (one graph each, as the CUDA graphs). Our kernels enter the graph
as custom ops (cpu_kernels.traced_ops: the same kernels, the same bits); inductor fuses
what runs as torch ops between them (residual adds, q/k norms, rotary, casts) and drops
the Python of the step. Each bucket has its own code object (dynamo's cache and recompile
limit are per code object); inductor's compiled code is cached on disk
(TORCHINDUCTOR_CACHE_DIR, the runner's `compile_cache_dir`), so a warm start traces but
does not compile C++ again.

`compile_step` all adds `MixedStep` (below): every step that is not a pure decode batch
(prompt chunks, several, after a prefix, beside decode rows) through ONE compiled graph
whose token counts are dynamic, the chunks' attention one opaque op over a chunk plan.

The runner is given what it reads and nothing more (the decoder, the KV tensors, the
logits head, the chunk limits); it never sees the `ModelRunner` that owns it.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.devices import host_empty
from tandem.services.language.model import QwenVLDecoder
from tandem.services.language.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionPath,
)
from tandem.services.language.runner.forward_batch import (
    ChunkLimits,
    ForwardBatch,
    ForwardOutput,
    decode_rows,
)
from tandem.services.language.runner.kv_cache import KVCache
from tandem.units import ceil_div

GRAPH_MAX_SEQ_LEN = 8192

log = logging.getLogger("tandem.language")


@dataclass(frozen=True)
class Inputs:
    """Views of one flat int64 block: a graph's inputs (see the module doc for shapes)."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor

    def fill_padding(self, dummy_page: int, dummy_slot: int) -> None:
        """Every row a padding row: token 0, position 0, seq_len 1, the dummy page/slot."""
        self.token_ids.zero_()
        self.positions.zero_()
        self.seq_lens.fill_(1)
        self.slot_mapping.fill_(dummy_slot)
        self.block_tables.fill_(dummy_page)


@dataclass(frozen=True)
class InputLayout:
    """The flat block of `n` rows: token_ids [n] | positions [3, n] | seq_lens [n] |
    slot_mapping [n] | block_tables [n, width], so rows [0, bs) of every input lie in
    its first `end(bs)` elements (one copy uploads a step)."""

    n: int
    width: int

    @property
    def size(self) -> int:
        return 6 * self.n + self.n * self.width

    def end(self, bs: int) -> int:
        return 6 * self.n + bs * self.width

    def views(self, flat: torch.Tensor) -> Inputs:
        n = self.n
        return Inputs(token_ids=flat[:n], positions=flat[n : 4 * n].view(3, n),
                      seq_lens=flat[4 * n : 5 * n], slot_mapping=flat[5 * n : 6 * n],
                      block_tables=flat[6 * n :].view(n, self.width))


class UploadFence:
    """Whether the host mirror may be written: on CUDA an event recorded behind the last
    upload from it (waited on before the next write; by then the step's logits have been
    read on the host, so the wait is over at once); on the CPU the copy is done when it
    returns."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.event = torch.cuda.Event() if device.type == "cuda" else None
        self.recorded = False

    def record(self) -> None:
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(self.device))
            self.recorded = True

    def wait(self) -> None:
        if self.recorded:
            self.event.synchronize()


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
        attention: AttentionPath,
        compile: bool = False,
        compile_cache_dir: str = "",
        threads_for: Callable[[int], int] | None = None,
    ) -> None:
        if max_bs < 1 or max_seq_len < 1:
            raise ValueError(f"bad graph runner limits: max_bs={max_bs}, max_seq_len={max_seq_len}")
        self.model, self.kv, self.compute_logits, self.limits = model, kv, compute_logits, limits
        self.device = device
        self.attention = attention  # the owner's path: graphs attend as eager steps do
        self.page_size = kv.page_size
        self.batch_sizes = batch_buckets(max_bs)
        gathers = attention.backend is AttentionBackend.GATHER
        covered = min(max_seq_len, GRAPH_MAX_SEQ_LEN) if gathers else max_seq_len
        self.max_pages = ceil_div(covered, self.page_size)
        self.widths = width_buckets(self.max_pages)
        n, dev = self.batch_sizes[-1], self.device
        self.dummy_page = kv.dummy_page
        self.dummy_slot = self.dummy_page * self.page_size
        # The static inputs: one int64 block on the device (the graphs read its views), and
        # its mirror in host memory, page-locked on CUDA (`host_empty`), which each step
        # fills and uploads with one asynchronous copy. NOTE: the mirror is written again
        # only once the last upload from it has run (`_uploaded`): a non_blocking copy
        # reads its source after the call returns.
        self.layout = InputLayout(n, self.max_pages)
        self._device_inputs = torch.empty(self.layout.size, dtype=torch.int64, device=dev)
        self._host_inputs = host_empty((self.layout.size,), torch.int64, dev)
        for flat in (self._device_inputs, self._host_inputs):
            self.layout.views(flat).fill_padding(self.dummy_page, self.dummy_slot)
        self.host = self.layout.views(self._host_inputs)
        inputs = self.layout.views(self._device_inputs)
        self.token_ids, self.positions = inputs.token_ids, inputs.positions
        self.seq_lens, self.slot_mapping = inputs.seq_lens, inputs.slot_mapping
        self.block_tables = inputs.block_tables
        self._uploaded = UploadFence(dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        # Captured by `capture()`, which the owner calls once the KV cache is final (every
        # tensor-parallel rank at the same point: the warm-up steps run collectives).
        self.use_graphs = self.device.type == "cuda"
        # CPU: each batch bucket's step compiled by inductor in `capture()` (module doc)
        self.compile = compile and not self.use_graphs
        self.compile_cache_dir = compile_cache_dir
        self.threads_for = threads_for  # torch threads a step of n rows runs on (owner's)
        self.compiled: dict[int, Callable] = {}
        self.compile_s: dict[int, float] = {}  # seconds each bucket's compile took

    # -- the step a graph records -----------------------------------------------------
    def _step(self, bs: int, width: int) -> torch.Tensor:
        """Logits [bs, vocab] float32 for rows [0, bs) of the static buffers (capture-safe)."""
        model = self.model
        meta = self.attention.metadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs, :width],
            seq_lens=self.seq_lens[:bs],
            page_size=self.page_size,
            cache_pages=self.kv.k[0].shape[0],
        )
        hidden = model.embed(self.token_ids[:bs])
        out = model(hidden, self.positions[:, :bs], meta, self.kv.k, self.kv.v)
        return self.compute_logits(out)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (bs, width) graph, largest first, into one shared memory pool, on
        this runner's device (nothing to capture without CUDA: `run` steps eagerly)."""
        if self.compile:
            self._compile()
        if not self.use_graphs:
            return
        # NOTE: torch.cuda.graph synchronises and begins capture on the CURRENT device; a
        # runner on cuda:1 (a tensor-parallel rank, --device cuda:1) must be that device.
        with torch.cuda.device(self.device):
            self._capture()

    def _capture(self) -> None:
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

    def _compile(self) -> None:
        """Compile every batch bucket's step (CPU), largest first, each run twice over the
        padding rows (nothing real is read or written: the dummy page)."""
        cache = _before_compile(self.compile_cache_dir)
        threads = torch.get_num_threads()
        start = time.monotonic()
        try:
            for bs in reversed(self.batch_sizes):
                if self.threads_for is not None:  # inductor's loops fix their thread count
                    torch.set_num_threads(self.threads_for(bs))
                t0 = time.monotonic()
                fn = _bucket_step(bs)
                for _ in range(2):
                    fn(self, bs, self.max_pages)
                self.compiled[bs] = fn
                self.compile_s[bs] = time.monotonic() - t0
        finally:
            torch.set_num_threads(threads)
        log.info("compiled decode step: %d batch buckets %s in %.1f s (%s; inductor cache %s)",
                 len(self.compiled), sorted(self.compiled), time.monotonic() - start,
                 ", ".join(f"bs {b}: {self.compile_s[b]:.1f} s" for b in sorted(self.compiled)),
                 cache)

    def _run_compiled(self, fn: Callable, bs: int, width: int) -> torch.Tensor:
        """A compiled bucket's step; never a compile in a request's step: should a guard of
        the bucket fail (what it was compiled for changed), `call_compiled` raises instead
        of compiling, and the bucket runs eagerly from then on (a warning says so)."""
        from torch._dynamo.exc import FailOnRecompileLimitHit

        try:
            return call_compiled(fn, self, bs, width)
        except FailOnRecompileLimitHit:
            self.compiled.pop(bs, None)
            log.warning("compiled decode step: bucket bs %d would recompile (its guards "
                        "failed: TORCH_LOGS=recompiles says which); it runs eagerly from now "
                        "on", bs)
            return self._step(bs, width)

    @torch.inference_mode()
    def pool_bytes(self, memory) -> int:
        """What the graphs' memory pool will hold, measured before the KV cache is sized
        (kv_sizing.py; `memory` a DeviceMemory): the peak of the largest bucket's step at
        the widest width, every row over every page of it (page 0), plus each graph's
        logits output, which stays in the pool."""
        bs, width = self.batch_sizes[-1], self.widths[-1]
        self.block_tables.fill_(0)
        self.seq_lens.fill_(width * self.page_size)
        self.slot_mapping.fill_(0)
        out = self._step(bs, width)  # warm-up (lazy inits), as capture does
        row = out[0].numel() * out.element_size()
        del out
        peak = memory.peak_of(lambda: self._step(bs, width))
        return peak + row * sum(self.batch_sizes) * len(self.widths)

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
        compiled = self.compiled.get(bs)
        # a compiled bucket reads the widest table (one compile for every width)
        width = self.max_pages if compiled else self.widths[bisect.bisect_left(self.widths, need)]
        for c in batch.chunks:
            self.limits.check(c)

        # Fill the host mirror's [bs] rows, padding rows included, then upload once.
        rows = decode_rows(batch.chunks, self.page_size, self.dummy_page, rows=bs, width=width)
        self._uploaded.wait()  # the last upload has read the mirror: it may change now
        h = self.host
        h.token_ids[:raw] = torch.cat([c.token_ids[:1] for c in batch.chunks])
        h.token_ids[raw:bs] = 0
        h.positions[:, :raw] = torch.cat([c.positions[:, :1] for c in batch.chunks], dim=1)
        h.positions[:, raw:bs] = 0
        h.block_tables[:bs, :width] = rows.block_tables
        h.seq_lens[:bs] = rows.seq_lens
        h.slot_mapping[:bs] = rows.slot_mapping
        end = self.layout.end(bs)  # rows [0, bs) of every input (column `width` on: unread)
        self._device_inputs[:end].copy_(self._host_inputs[:end], non_blocking=True)
        self._uploaded.record()

        if self.use_graphs:
            self.graphs[(bs, width)].replay()
            logits = self.outputs[(bs, width)][:raw].clone()
        elif compiled is not None:
            logits = self._run_compiled(compiled, bs, width)[:raw]
        else:
            logits = self._step(bs, width)[:raw]
        # A 1-token chunk's prompt logits are its last logits.
        prompt = {
            c.seq_id: logits[i : i + 1] for i, c in enumerate(batch.chunks) if c.want_prompt_logits
        }
        return ForwardOutput(last_logits=logits, prompt_logits=prompt)


def call_compiled(fn: Callable, *args):
    """`fn(*args)`, `fn` compiled with fullgraph, never compiling again: with dynamo's
    recompile limit at 1 for the call, a guard that fails raises
    torch._dynamo.exc.FailOnRecompileLimitHit (fullgraph turns the limit into that error)
    before anything is traced. (Dynamo's stance `fail_on_recompile` does the same but
    raises a bare RuntimeError, told apart only by its text.) The limit is restored after
    the call.
    NOTE: dynamo's config is the process's, not the thread's: a compile on another thread
    during the call would see the limit at 1 too. In a language process only the engine's
    step thread runs dynamo once it serves (its compiles ran at start-up; the flex path,
    which recompiles, is CUDA's and excludes a compiled CPU step)."""
    import torch._dynamo.config as dynamo_config

    limit = dynamo_config.recompile_limit
    dynamo_config.recompile_limit = 1
    try:
        return fn(*args)
    finally:
        dynamo_config.recompile_limit = limit


def _decode_step(runner: GraphRunner, bs: int, width: int) -> torch.Tensor:
    return runner._step(bs, width)


def _bucket_step(bs: int) -> Callable:
    """`_decode_step` compiled for one batch bucket, under its own code object.

    NOTE: dynamo keeps its cache and its recompile limit (8) per code object: one function
    recompiled per bucket would hit the limit past 8 buckets (max_bs 112) and then run
    eagerly, unseen; one code object per bucket never recompiles. Static shapes
    (dynamic=False): a bucket is one size. fullgraph: a graph break is an error at
    start-up, not a silent split of the step."""
    code = _decode_step.__code__.replace(co_name=f"_decode_step_bs{bs}")
    fn = types.FunctionType(code, _decode_step.__globals__)
    return torch.compile(fn, fullgraph=True, dynamic=False)


def _before_compile(cache_dir: str) -> str:
    """What every compile of this module does first: inductor's cache under `cache_dir`
    (when given) and the kernels registered as torch ops before anything is traced; the
    cache in use, for the log."""
    from tandem.cpu_kernels import traced_ops

    if cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache_dir)
    traced_ops()
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "inductor's default")


class MixedStep:
    """Every step that is not a pure decode batch, compiled once on the CPU (`compile_step`
    all): prompt chunks of any length, several prompts, chunks after a cached prefix, and
    decode rows mixed with chunks, through ONE graph whose token counts are dynamic.

    A step's structure (how many chunks, their lengths and prefixes) lives in tensors, not
    in Python: the single-token rows attend through the decode kernel's op (rows dynamic,
    the widest table as a decode bucket reads it), the chunks through ONE opaque op that
    takes the step's chunk plan (attention.py `chunk_plan`, `chunk_plan_attention`: per
    chunk the same segment kernel or SDPA call as an eager step). So what the graph holds
    is the decoder's token-wise work (our kernels as ops; inductor fuses the q/k norms,
    rotary, residual and deepstack adds and casts between them) over T rows, with three
    dynamic sizes: T, the single rows, the plan's length. A deepstack model always gets its
    deepstack rows (zeros where a step has no image: x + 0 is x), so one graph serves both.

    Single rows number at least MIN_SINGLE (padding rows on the dummy page go first, as in
    a decode bucket: every row's products and norms are computed on its own, so padding
    changes no real row's bits; tests/test_compiled_step.py): dynamo specialises a size of
    0 or 1, and with both a prompt-only step would need a graph of its own.

    Compiled in `compile()` at start-up over padding rows and one chunk on the dummy page;
    a step whose guards would fail (what it was compiled for changed) runs eagerly from
    then on (`call_compiled`), never compiling in a request's step."""

    MIN_SINGLE = 2
    # NOTE: the rotary's cos/sin are computed outside the graph, once a step, and passed in
    # (`_rope`): traced, inductor recomputes them in every layer's fused kernel, per element
    # of q and k. Less work and the eager step's cos/sin bits; measured against the traced
    # rotary in one process (docs/benchmarks.md): no difference beyond this host's
    # run-to-run noise (+-10 %) at 64, 512 or 2048 tokens
    # The warm-up's sizes, distinct so dynamo gives each dynamic size its own symbol
    # (equal sizes at trace time would share one: later steps would fail its guards)
    _WARM_SINGLE, _WARM_CHUNK = 3, 58
    _count = 0

    def __init__(self, model: QwenVLDecoder, kv: KVCache, attention: AttentionPath,
                 max_seq_len: int, compile_cache_dir: str = "") -> None:
        if attention.backend is not AttentionBackend.PAGED_CPU:
            raise ValueError("a compiled mixed step attends with the paged_cpu kernels")
        self.model, self.kv, self.attention = model, kv, attention
        self.page_size = kv.page_size
        self.max_pages = ceil_div(max_seq_len, self.page_size)
        self.dummy_page = kv.dummy_page
        self.compile_cache_dir = compile_cache_dir
        self.fn: Callable | None = None  # the compiled step; None: eager (`run`)
        self.compile_s = 0.0
        MixedStep._count += 1  # one code object per instance (dynamo's cache is per code)
        code = _mixed_step.__code__.replace(co_name=f"_mixed_step_{MixedStep._count}")
        self._step = types.FunctionType(code, _mixed_step.__globals__)

    def padding(self, singles: int) -> int:
        """Padding rows a step of `singles` single-token rows gets (first, on the dummy page)."""
        return max(0, self.MIN_SINGLE - singles)

    def can_run(self, batch: ForwardBatch) -> bool:
        """A step with a chunk of 2+ tokens whose single rows fit the widest table."""
        singles = [c for c in batch.chunks if c.num_tokens == 1]
        return (len(singles) < len(batch.chunks)
                and all(c.start + 1 <= self.max_pages * self.page_size for c in singles))

    @torch.inference_mode()
    def compile(self) -> None:
        """Trace and compile the step once (start-up), over padding rows and one chunk on
        the dummy page (nothing real is read or written), run twice."""
        from tandem.cpu_kernels import define_traced_op
        from tandem.services.language.model.attention import chunk_plan, chunk_plan_attention

        cache = _before_compile(self.compile_cache_dir)
        define_traced_op(
            "chunk_attention",
            "chunk_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, "
            "Tensor plan, float scale, bool widen) -> Tensor",
            chunk_plan_attention, _chunk_attention_shape)
        ns, n, ps = self._WARM_SINGLE, self._WARM_CHUNK, self.page_size
        t, dev = ns + n, self.kv.k[0].device
        cfg, dtype = self.model.cfg, self.model.norm.weight.dtype
        tables = torch.full((ns, self.max_pages), self.dummy_page, dtype=torch.int64)
        seq_lens = torch.ones(ns, dtype=torch.int64)
        slots = self.dummy_page * ps + torch.arange(t, dtype=torch.int64) % ps
        plan = chunk_plan([(0, n, n, [self.dummy_page] * ceil_div(n, ps))])
        hidden = torch.zeros(t, cfg.hidden_size, dtype=dtype, device=dev)
        positions = torch.zeros(3, t, dtype=torch.int64, device=dev)
        deepstack = (torch.zeros(t, cfg.num_deepstack * cfg.hidden_size, dtype=dtype, device=dev)
                     if cfg.num_deepstack else None)
        rope = self._rope(positions, dtype)
        self.fn = torch.compile(self._step, fullgraph=True)
        start = time.monotonic()
        for _ in range(2):
            self._mark(hidden, positions, slots, tables, seq_lens, plan, deepstack, rope)
            self.fn(self, hidden, positions, rope, slots, tables, seq_lens, plan, deepstack)
        self.compile_s = time.monotonic() - start
        log.info("compiled mixed step (prefill chunks, mixed with decode rows or not; token "
                 "counts dynamic) in %.1f s (inductor cache %s)", self.compile_s, cache)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin of the step's rows, for the graph (computed outside it: the NOTE above)."""
        return self.model.rope.cos_sin(positions, dtype)

    @staticmethod
    def _mark(hidden, positions, slots, tables, seq_lens, plan, deepstack, rope) -> None:
        """The dynamic sizes (the module doc): T rows, the single rows, the plan."""
        import torch._dynamo as dynamo

        big = 1 << 30  # no bound above (dynamo wants one with a bound below)
        rows = ((hidden, 0), (positions, 1), (slots, 0), (deepstack, 0), *((x, 0) for x in rope))
        for x, dim in rows:
            if x is not None:  # at least the padding rows and one chunk of 2 tokens
                dynamo.mark_dynamic(x, dim, min=MixedStep.MIN_SINGLE + 2, max=big)
        dynamo.mark_dynamic(tables, 0, min=MixedStep.MIN_SINGLE, max=big)
        dynamo.mark_dynamic(seq_lens, 0, min=MixedStep.MIN_SINGLE, max=big)
        dynamo.mark_dynamic(plan, 0, min=6, max=big)  # one chunk of one page at least

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            tables: torch.Tensor, seq_lens: torch.Tensor, plan: torch.Tensor,
            deepstack: torch.Tensor | None) -> torch.Tensor:
        """The final-normed hidden [T, hidden] of a step's rows (`ModelRunner` lays them
        out: padding rows, single rows, chunk rows), compiled, or eagerly once its guards
        failed."""
        from torch._dynamo.exc import FailOnRecompileLimitHit

        rope = self._rope(positions, hidden.dtype)
        args = (self, hidden, positions, rope, slot_mapping, tables, seq_lens, plan, deepstack)
        if self.fn is not None:
            try:
                return call_compiled(self.fn, *args)
            except FailOnRecompileLimitHit:
                self.fn = None
                log.warning("compiled mixed step: a step would recompile (its guards failed: "
                            "TORCH_LOGS=recompiles says which); such steps run eagerly from "
                            "now on")
        return self._step(*args)


def _mixed_step(step: MixedStep, hidden, positions, rope, slot_mapping, tables, seq_lens,
                plan, deepstack) -> torch.Tensor:
    path = step.attention
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, num_single=tables.shape[0], single_block_tables=tables,
        single_seq_lens=seq_lens, decode_op=path.decode_op, chunk_op=path.chunk_op,
        compute_dtype=path.compute_dtype, chunk_plan=plan)
    return step.model(hidden, positions, meta, step.kv.k, step.kv.v, deepstack, rope=rope)


def _chunk_attention_shape(q, k, v, k_cache, v_cache, plan, scale, widen):
    """tandem::chunk_attention's fake: [rows, H, D] in q's dtype."""
    return torch.empty_like(q)
