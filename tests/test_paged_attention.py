"""The flex attention path (attention.py): pages read where they lie, equal to a dense reference.

The path CUDA serves with (`select_attention("auto", cuda)`) runs here on the CPU, compiled
exactly as there (torch.compile(flex_attention); inductor's CPU kernel instead of Triton),
and must equal a dense float64 reference within float32 rounding for decode rows of mixed
lengths and widths (padding rows and columns included), prefill chunks with and without a
cached prefix, chunk boundaries off the page grid, chunks longer than one query block, GQA
and several page sizes. What issue 25 found on CUDA is tested on the path itself:

- finding 2: no SDPA call with a boolean mask together with GQA (the combination that sends
  CUDA to the math backend), no tensor of heads x chunk x context, no repeat of K/V;
- finding 3: no gather/index_select/indexing that reads the K/V cache (only the K/V write
  touches it); the compiled kernel loads only the listed pages (NaN everywhere else in the
  cache leaves the output finite); the CPU gather workspace is bounded by one layer's K/V.

The same checks run on the gather path too, where they DO fire: that is the proof that
they can fail (the gather path is what CUDA ran before). The `gpu` tests repeat the
equality in bfloat16/float32 on CUDA, with SDPA restricted so that a math fallback raises,
and bound the peak memory of a 4096-token chunk at 16K keys (`bench/paged_attention.py`,
`check_long_context`, the row `make gpu-check` records).
"""

from __future__ import annotations

from dataclasses import dataclass

import language_oracle as oracle
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.services.language.model.attention import (
    FLEX_Q_BLOCK,
    AttentionBackend,
    AttentionPath,
    PrefillChunkMeta,
    paged_attention,
    select_attention,
)
from tandem.services.language.runner.forward_batch import ForwardBatch, SeqChunk, decode_positions
from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings
from tandem.units import ceil_div

FLEX = AttentionPath(AttentionBackend.FLEX)
GATHER = AttentionPath(AttentionBackend.GATHER)


# -- a step: decode rows and prefill chunks over a random cache ---------------------------
@dataclass
class Seq:
    """One sequence of the step: `n` new tokens after `start` cached ones (n == 1: a row)."""

    start: int
    n: int
    table: list[int]  # its pages, covering [0, start + n)


@dataclass
class Step:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    k_cache: torch.Tensor  # [pages + 1, page_size, Hkv, D] (last: the dummy page)
    v_cache: torch.Tensor
    seqs: list[Seq]  # rows first, then chunks: the flat order of q
    page_size: int

    def metadata(self, path: AttentionPath, width: int | None = None, rows: int | None = None):
        """The runner's metadata for this step on `path` (tables padded as `decode_rows` does)."""
        ps, dummy = self.page_size, self.k_cache.shape[0] - 1
        singles = [s for s in self.seqs if s.n == 1]
        rows = len(singles) if rows is None else rows
        width = max((ceil_div(s.start + 1, ps) for s in singles), default=0) if width is None else width
        tables = torch.full((rows, width), dummy, dtype=torch.int64)
        lens = torch.ones(rows, dtype=torch.int64)
        slots = [torch.full((rows,), dummy * ps, dtype=torch.int64)]
        for i, s in enumerate(singles):
            used = ceil_div(s.start + 1, ps)
            tables[i, :used] = torch.tensor(s.table[:used])
            lens[i] = s.start + 1
            slots[0][i] = s.table[s.start // ps] * ps + s.start % ps
        prefill, row = [], rows
        for s in self.seqs[len(singles) :]:
            kv_len = s.start + s.n
            pages = torch.tensor(s.table[: ceil_div(kv_len, ps)])
            prefill.append(PrefillChunkMeta(row, s.n, kv_len, pages))
            pos = torch.arange(s.start, kv_len)
            slots.append(pages[pos // ps] * ps + pos % ps)
            row += s.n
        dev = self.k_cache.device
        for c in prefill:
            c.pages = c.pages.to(dev)
        return path.metadata(
            slot_mapping=torch.cat(slots).to(dev), block_tables=tables.to(dev),
            seq_lens=lens.to(dev), page_size=ps, cache_pages=self.k_cache.shape[0],
            prefill=prefill,
        )

    def run(self, path: AttentionPath, **kw) -> torch.Tensor:
        """paged_attention on fresh copies of the caches (the step writes its K/V into them);
        padding rows (`rows` past the step's) get zero q/k/v and are dropped from the output."""
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        meta = self.metadata(path, **kw)
        ns = sum(s.n == 1 for s in self.seqs)
        pad = meta.num_single - ns

        def padded(x):
            return torch.cat([x[:ns], x.new_zeros(pad, *x.shape[1:]), x[ns:]])

        out = paged_attention(padded(self.q), padded(self.k), padded(self.v), kc, vc, meta,
                              self.q.shape[-1] ** -0.5)
        return torch.cat([out[:ns], out[ns + pad :]])

    def reference(self) -> torch.Tensor:
        """Dense float64 attention of every query over its sequence's keys [0, position],
        computed on the CPU, returned on the step's device in its dtype."""
        ps = self.page_size
        kc, vc = self.k_cache.double().cpu(), self.v_cache.double().cpu()
        q, k, v = self.q.double().cpu(), self.k.double().cpu(), self.v.double().cpu()
        heads, kv_heads, d = q.shape[1], kc.shape[2], q.shape[2]
        out, row = [], 0
        for s in self.seqs:
            pos = torch.arange(s.start, s.start + s.n)
            table = torch.tensor(s.table)
            kc[table[pos // ps], pos % ps] = k[row : row + s.n]
            vc[table[pos // ps], pos % ps] = v[row : row + s.n]
            keys = kc[table].reshape(-1, kv_heads, d)[: s.start + s.n]
            vals = vc[table].reshape(-1, kv_heads, d)[: s.start + s.n]
            keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # [L, H, D]
            vals = vals.repeat_interleave(heads // kv_heads, dim=1)
            scores = torch.einsum("nhd,lhd->hnl", q[row : row + s.n], keys) * d**-0.5
            visible = torch.arange(s.start + s.n)[None, :] <= pos[:, None]
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out.append(torch.einsum("hnl,lhd->nhd", probs, vals))
            row += s.n
        return torch.cat(out).to(self.q.device, self.q.dtype)


def make_step(spec: list[tuple[int, int]], page_size: int, heads: int, kv_heads: int,
              head_dim: int = 16, spare_pages: int = 7, seed: int = 0,
              dtype: torch.dtype = torch.float32, device: str = "cpu",
              num_pages: int | None = None) -> Step:
    """A step over `spec` = [(start, n)] (rows first), pages shuffled over a random cache of
    `num_pages` pages (default: the step's own + `spare_pages`) and the dummy page."""
    g = torch.Generator().manual_seed(seed)
    need = [ceil_div(start + n, page_size) for start, n in spec]
    num_pages = sum(need) + spare_pages if num_pages is None else num_pages
    perm = torch.randperm(num_pages, generator=g).tolist()
    seqs, at = [], 0
    for (start, n), k in zip(spec, need, strict=True):
        seqs.append(Seq(start, n, perm[at : at + k]))
        at += k
    t = sum(n for _, n in spec)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    cache = (num_pages + 1, page_size, kv_heads, head_dim)
    return Step(rnd(t, heads, head_dim), rnd(t, kv_heads, head_dim), rnd(t, kv_heads, head_dim),
                rnd(*cache), rnd(*cache), seqs, page_size)


# Decode rows (start, 1) of mixed lengths: one ends a page exactly, one is in its first
# page; chunks (start, n): a whole prompt, a cached prefix ending mid-page, a chunk longer
# than one query block whose prefix is page-aligned, and a 2-token chunk.
ROWS = [(0, 1), (6, 1), (15, 1), (40, 1), (23, 1)]
CHUNKS = [(0, 9), (13, 20), (32, FLEX_Q_BLOCK + 37), (50, 2)]
CASES = [  # page size, heads, kv heads
    pytest.param(4, 6, 2, id="page4-gqa3"),
    # NOTE: each geometry compiles anew (a cold compile is ~13 s of CI on this 2-core host):
    # the first case runs in CI, the others with --run-slow
    pytest.param(16, 4, 4, id="page16-mha", marks=pytest.mark.slow),
    pytest.param(8, 8, 2, id="page8-gqa4", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("page_size, heads, kv_heads", CASES)
def test_flex_equals_dense_reference(page_size, heads, kv_heads):
    step = make_step(ROWS + CHUNKS, page_size, heads, kv_heads)
    want = step.reference()
    got = step.run(FLEX)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    # ... and the SDPA path the CPU serves with gives the same within float32 rounding.
    torch.testing.assert_close(got, step.run(GATHER), rtol=0, atol=2e-5)


@pytest.mark.slow  # rows and chunks alone: test_flex_equals_dense_reference has them together
def test_flex_rows_alone_chunks_alone_and_padded_tables():
    """Rows only (padded to the graph runner's wider tables and extra dummy rows), a single
    chunk without a prefix, a single chunk with one: each equals the reference."""
    rows = make_step(ROWS, 4, 6, 2, seed=1)
    want = rows.reference()
    got = rows.run(FLEX, width=32, rows=8)  # 3 dummy rows, columns past each row's pages
    torch.testing.assert_close(got[: len(ROWS)], want, rtol=0, atol=2e-5)
    for spec in ([(0, 30)], [(29, 3)], [(17, 200)]):
        step = make_step(spec, 4, 6, 2, seed=2)
        torch.testing.assert_close(step.run(FLEX), step.reference(), rtol=0, atol=2e-5)


def test_flex_kernel_reads_only_the_listed_pages():
    """NaN in every page no sequence owns (the dummy page included) leaves the compiled
    kernel's output finite: it loads the listed pages and nothing else. A dense read of the
    cache (uncompiled flex_attention scores every slot) would turn it NaN."""
    # NOTE: the geometry and shapes of test_flex_equals_dense_reference's first case (other
    # values), so the kernel it compiled serves here: a cold compile is ~30 s of CI
    step = make_step(ROWS + CHUNKS, 4, 6, 2, seed=3)
    owned = torch.zeros(step.k_cache.shape[0], dtype=torch.bool)
    owned[[p for s in step.seqs for p in s.table]] = True
    want = step.reference()
    step.k_cache[~owned] = float("nan")
    step.v_cache[~owned] = float("nan")
    got = step.run(FLEX)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_flex_runs_compiled_under_the_host_sync_counter():
    """bench/step_syncs.py counts a decode step's syncs with flex attention on a GPU: under
    the counter (a dispatch mode) the compiled kernel must still run compiled, not be
    skipped by dynamo into an uncompiled flex_attention the mode cannot take."""
    from tandem.host_syncs import HostSyncCounter

    # NOTE: test_flex_equals_dense_reference's first geometry and shapes, so the kernel
    # compiled for that test serves this one (no compile of its own in CI)
    step = make_step(ROWS + CHUNKS, 4, 6, 2, seed=5)
    with HostSyncCounter() as counter:
        got = step.run(FLEX)
    torch.testing.assert_close(got, step.reference(), rtol=0, atol=2e-5)
    assert counter.events == []  # CPU tensors: nothing to count, nothing missed on the way


# -- findings 2 and 3 on the path CUDA selects --------------------------------------------
class FunctionLog(TorchFunctionMode):
    """SDPA calls with their mask / GQA arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.sdpa: list[dict] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.sdpa.append({"mask": kwargs.get("attn_mask") is not None,
                              "gqa": bool(kwargs.get("enable_gqa"))})
        return func(*args, **kwargs)


class AtenLog(TorchDispatchMode):
    """aten ops outside compiled code: which read the K/V cache, the largest tensor made,
    host syncs, uncompiled (dense) flex_attention calls, repeats of K/V."""

    supports_higher_order_operators = True
    SYNCS = ("aten._local_scalar_dense", "aten.item")

    # What may touch the cache outside the kernel: views of it and the K/V write.
    VIEWS_AND_WRITE = {"view", "_unsafe_view", "transpose", "unsqueeze", "squeeze", "slice",
                       "select", "as_strided", "detach", "alias", "expand", "permute",
                       "index_copy_"}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """The compiled kernel runs compiled, as in service; its insides are not seen."""
        return True

    def __init__(self, caches: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {c.untyped_storage().data_ptr() for c in caches}
        self.cache_reads: list[str] = []
        self.largest = 0
        self.syncs = 0
        self.flex_calls = 0
        self.repeats = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if isinstance(func, torch._ops.HigherOrderOperator):  # flex_attention run uncompiled
            self.flex_calls += name == "flex_attention"
            return func(*args, **kwargs)
        if any(name.startswith(s) for s in self.SYNCS):
            self.syncs += 1
        if "repeat_interleave" in name or name.startswith("aten.repeat."):
            self.repeats += 1
        reads = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages]
        op = func.overloadpacket.__name__
        if reads and op not in self.VIEWS_AND_WRITE:
            self.cache_reads.append(name)
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _record(step: Step, path: AttentionPath):
    """Build the step's metadata and attend, recording both levels."""
    kc, vc = step.k_cache.clone(), step.v_cache.clone()
    scale = step.q.shape[-1] ** -0.5
    with FunctionLog() as fn, AtenLog([kc, vc]) as aten:
        meta = step.metadata(path)
        out = paged_attention(step.q, step.k, step.v, kc, vc, meta, scale)
    torch.testing.assert_close(out, step.reference(), rtol=0, atol=2e-5)
    return fn, aten


def test_the_cpu_kernel_path_takes_chunks_without_a_prefix_on_the_segment_kernel():
    """paged_cpu: a float32 chunk without a cached prefix attends through the causal
    segment kernel (no SDPA call), one with a prefix through SDPA with its mask, decode rows
    through the decode kernel; all equal the dense reference. bfloat16 chunks keep SDPA."""
    from tandem.cpu_kernels import kernels

    if kernels() is None:
        pytest.skip("no C++ toolchain to build the kernels")
    path = select_attention("paged_cpu", "cpu", 4)
    assert path.chunk_op is not None
    step = make_step([(6, 1), (23, 1), (0, 9), (0, FLEX_Q_BLOCK + 37), (13, 20)], 4, 6, 2)
    fn, _ = _record(step, path)  # equal to the reference (asserted inside)
    assert fn.sdpa == [{"mask": True, "gqa": True}]  # only the chunk after a prefix
    bf16 = make_step([(0, 9)], 4, 6, 2, dtype=torch.bfloat16)
    with FunctionLog() as fn:
        meta = bf16.metadata(path)
        paged_attention(bf16.q, bf16.k, bf16.v, bf16.k_cache.clone(), bf16.v_cache.clone(),
                        meta, 0.25)
    assert len(fn.sdpa) == 1


@pytest.mark.parametrize("head_dim", [64, 40])  # the decode kernel's fast path; its generic one
def test_a_bfloat16_cache_attends_in_float32_to_the_float32_caches_bits(head_dim):
    """`compute_dtype` float32 over a bfloat16 cache (the runner's choice for a bfloat16 model
    with float32 products on the paged_cpu kernels) gives, bit for bit, what the float32
    cache of the same values gave (q, k, v widened, the output rounded): decode rows on the
    kernel, a chunk without a prefix on the segment kernel, chunks after a prefix on SDPA;
    and gathered rows likewise. The K/V the step writes are its own values in both."""
    from dataclasses import replace

    from tandem.cpu_kernels import kernels

    if kernels() is None:
        pytest.skip("no C++ toolchain to build the kernels")
    step = make_step([(6, 1), (23, 1), (40, 1), (0, 9), (13, 20), (50, 2)], 4, 6, 2,
                     head_dim=head_dim, dtype=torch.bfloat16)
    for path in (select_attention("paged_cpu", "cpu", 4), GATHER):
        in_float32 = replace(path, compute_dtype=torch.float32)
        kc, vc = step.k_cache.clone(), step.v_cache.clone()
        got = paged_attention(step.q, step.k, step.v, kc, vc, step.metadata(in_float32),
                              head_dim**-0.5)
        kw, vw = step.k_cache.float(), step.v_cache.float()
        want = paged_attention(step.q, step.k, step.v, kw, vw, step.metadata(path),
                               head_dim**-0.5)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), path.backend
        assert torch.equal(kc.float(), kw) and torch.equal(vc.float(), vw)
        torch.testing.assert_close(got.float(), step.reference().float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="flex path computes in its cache's dtype"):
        replace(FLEX, compute_dtype=torch.float32)


def test_cuda_selects_the_flex_path():
    """The one place that chooses: CUDA attends through flex unless told otherwise; the CPU
    keeps its kernel (or the gather path); flex is refused where its kernels cannot tile."""
    for dev in ("cuda", "cuda:1"):
        assert select_attention("auto", dev, 16).backend is AttentionBackend.FLEX
        assert select_attention("flex", dev, 64).backend is AttentionBackend.FLEX
        with pytest.raises(ValueError, match="power-of-two"):
            select_attention("auto", dev, 24)
        with pytest.raises(ValueError, match="runs on the CPU"):
            select_attention("paged_cpu", dev, 16)
    cpu = select_attention("auto", "cpu", 4)
    assert cpu.backend in (AttentionBackend.PAGED_CPU, AttentionBackend.GATHER)
    assert (cpu.decode_op is not None) == (cpu.backend is AttentionBackend.PAGED_CPU)
    assert select_attention("flex", "cpu", 4) == FLEX  # explicit: how the CPU tests it
    assert select_attention("gather", "cpu", 4) == GATHER
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        select_attention("sdpa", "cpu", 16)


def test_finding2_no_mask_with_gqa_no_scores_tensor_on_the_cuda_path():
    """A cached-prefix chunk (and decode rows) with GQA on the CUDA path: no SDPA call with a
    mask and GQA, no K/V repeated per head, nothing near heads x chunk x context made."""
    chunk, prefix = 96, 160
    step = make_step([(31, 1), (70, 1), (prefix, chunk)], 4, 8, 2, seed=4)
    path = select_attention("auto", "cuda", 16)  # what a GPU runs ...
    fn, aten = _record(step, path)  # ... run here on CPU tensors
    assert not any(c["mask"] and c["gqa"] for c in fn.sdpa)
    assert fn.sdpa == []  # flex only, compiled (an uncompiled call would show here)
    assert aten.flex_calls == 0 and aten.repeats == 0 and aten.syncs == 0
    scores = 8 * chunk * (prefix + chunk)
    assert aten.largest < scores // 4, aten.largest
    # The detector fires on the path CUDA ran before (gather + SDPA): the test can fail.
    fn, aten = _record(step, GATHER)
    assert any(c["mask"] and c["gqa"] for c in fn.sdpa)


def test_finding3_no_copy_of_cache_pages_on_the_cuda_path():
    """Decode rows and a prefix chunk on the CUDA path read the cache only inside the kernel:
    no gather / index_select / indexing of K/V pages per layer; the gather path does."""
    # NOTE: finding 2's step (decode rows and a prefix chunk), so the kernel compiled there
    # (under the same logging modes) serves here: a cold compile is ~17 s of CI
    step = make_step([(31, 1), (70, 1), (160, 96)], 4, 8, 2, seed=5)
    _fn, aten = _record(step, select_attention("auto", "cuda", 16))
    assert aten.cache_reads == [] and aten.flex_calls == 0
    _fn, aten = _record(step, GATHER)
    assert any("index_select" in op for op in aten.cache_reads)  # the decode gather
    assert any(op.startswith("aten.index.") for op in aten.cache_reads)  # the chunk's pages


def test_flex_metadata_makes_no_host_sync():
    """The block masks are built from the tables with tensor ops only: graph-capturable."""
    step = make_step(ROWS + CHUNKS, 4, 6, 2, seed=6)
    with AtenLog([]) as aten:
        step.metadata(FLEX, width=16, rows=8)
    assert aten.syncs == 0


@pytest.mark.slow  # 16 s of compiles; the runners' tests below would hit the limit too
def test_flex_shapes_settle_without_hitting_the_recompile_limit():
    """Many batch sizes, widths and chunk lengths over one cache (a runner's life): the
    compiled kernels go dynamic after a recompile or two (hitting the limit would raise,
    never fall back to the dense path)."""
    shapes = [(1, 3), (2, 17), (5, 64), (9, 130), (3, 250), (12, 7), (7, 129), (4, 40),
              (16, 2), (6, 300)]
    for i, (rows, chunk) in enumerate(shapes):
        spec = [(7 * j + i, 1) for j in range(rows)] + [(i * 5, chunk)]
        step = make_step(spec, 4, 6, 2, seed=10 + i, num_pages=400)
        torch.testing.assert_close(step.run(FLEX), step.reference(), rtol=0, atol=2e-5)


# -- the runner on the flex path ----------------------------------------------------------
PAGE = 4


@pytest.fixture(scope="module")
def runners(checkpoint):
    path = checkpoint("qwen2_5_vl")

    def make(backend: str, **kw):
        settings = RunnerSettings(page_size=PAGE, attention_backend=backend, **kw)
        return ModelRunner(oracle.text_weights(path), settings, num_pages=96)

    return make


def _five_steps(r: ModelRunner) -> list:
    """Two sequences: prompt chunks (the second over a cached prefix, beside a decode row of
    the other), then three pure decode steps (the graph runner's, where there is one)."""
    ids = torch.randint(0, r.vocab_size, (45,), generator=torch.Generator().manual_seed(0))
    pages_a, pages_b = list(range(0, 13)), list(range(20, 24))
    out = []
    pos = lambda a, n: torch.arange(a, a + n).expand(3, n)  # noqa: E731
    out.append(r.forward(ForwardBatch([SeqChunk(0, 0, pos(0, 18), pages_a, token_ids=ids[:18]),
                                       SeqChunk(1, 0, pos(0, 5), pages_b, token_ids=ids[:5])])))
    out.append(r.forward(ForwardBatch([
        SeqChunk(0, 18, pos(18, 23), pages_a, token_ids=ids[18:41], want_prompt_logits=True),
        SeqChunk(1, 5, decode_positions(5, 0), pages_b, token_ids=ids[5:6])])))
    for i in range(3):
        out.append(r.forward(ForwardBatch([
            SeqChunk(0, 41 + i, decode_positions(41 + i, 0), pages_a, token_ids=ids[i : i + 1]),
            SeqChunk(1, 6 + i, decode_positions(6 + i, 0), pages_b, token_ids=ids[i : i + 1])])))
    return out


def _assert_same_steps(got: list, want: list, atol: float) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.last_logits.cpu(), b.last_logits, rtol=0, atol=atol)
        for sid, logits in b.prompt_logits.items():
            torch.testing.assert_close(a.prompt_logits[sid].cpu(), logits, rtol=0, atol=atol)


@pytest.mark.slow  # the flex runner against transformers (below) runs in CI
def test_runner_flex_equals_the_cpu_path_for_chunks_rows_and_graph_steps(runners):
    """The five steps on a flex runner and on the CPU's default runner: the same logits
    within float32 rounding; the graph runner's step (run eagerly here over its static
    buffers) attends on flex too."""
    flex = runners("flex", cuda_graph_max_bs=4, max_seq_len=128)
    cpu = runners("auto")
    assert flex.attention == FLEX and flex.graph_runner.attention == FLEX
    _assert_same_steps(_five_steps(flex), _five_steps(cpu), atol=1e-4)
    assert flex._workspace is None  # no gather buffers on the flex path


# qwen2_5_vl is slow: a second cold flex compile (~60 s of CI) for the same attention
# code (the architectures differ in the layers around it, which the CPU path's exactness
# tests cover); make test-slow runs it
@pytest.mark.parametrize("arch", [pytest.param("qwen2_5_vl", marks=pytest.mark.slow),
                                  "qwen3_vl"])
def test_flex_runner_matches_transformers(arch, checkpoint):
    """A prompt with an image in three chunks (the second and third over a cached prefix,
    edges mid-page), then greedy decoding through the graph runner's step, all on the flex
    path: prompt logits within 1e-4 of transformers' forward, tokens equal to generate()."""
    path = checkpoint(arch)
    model, proc = oracle.load(path)
    inputs = oracle.make_inputs(proc, "Describe the picture in a few words.",
                                [oracle.make_image(3, (56, 84))])
    ref = oracle.prompt_logits(model, inputs)
    want_tokens, want_logits = oracle.generate(model, inputs, 6)
    p = oracle.payload(model, inputs)
    runner = ModelRunner(
        oracle.text_weights(path),
        RunnerSettings(page_size=PAGE, attention_backend="flex", cuda_graph_max_bs=4, max_seq_len=256),
        num_pages=64,
    )
    n = p.num_tokens
    pages = list(range(3, 3 + ceil_div(n + 8, PAGE)))
    got = []
    for a, b in ((0, 9), (9, n - 7), (n - 7, n)):
        chunk = SeqChunk(0, a, p.mrope_positions[:, a:b].long(), pages,
                         input_embeds=p.input_embeds[a:b], want_prompt_logits=True)
        got.append(runner.forward(ForwardBatch([chunk])).prompt_logits[0])
    assert (torch.cat(got) - ref).abs().max().item() < 1e-4
    tokens, logits = [int(got[-1][-1].argmax())], [got[-1][-1]]
    for i in range(5):
        step = SeqChunk(0, n + i, decode_positions(n + i, p.mrope_delta), pages,
                        token_ids=torch.tensor([tokens[-1]]))
        assert runner.graph_runner.can_run(ForwardBatch([step]))
        logits.append(runner.forward(ForwardBatch([step])).last_logits[0])
        tokens.append(int(logits[-1].argmax()))
    assert tokens == want_tokens
    assert (torch.stack(logits) - want_logits).abs().max().item() < 1e-4


def test_gather_workspace_is_bounded_by_one_layer_of_kv(runners):
    """The CPU gather path's reused buffers never exceed one layer's K/V (the pool's pages):
    a step whose padded tables need more gathers into temporaries freed with the step."""

    r = runners("gather")
    cap = r.kv.k[0].shape[0]
    long = list(range(0, 40))  # 160 tokens
    batch = ForwardBatch(
        [SeqChunk(0, 150, decode_positions(150, 0), long, token_ids=torch.tensor([1]))]
        + [SeqChunk(1 + i, 0, decode_positions(0, 0), [41 + i], token_ids=torch.tensor([2]))
           for i in range(4)]
    )
    r.forward(batch)  # 5 rows x 38 columns = 190 pages gathered > 97
    assert 5 * 38 > cap
    assert r._workspace is None or r._workspace[0].shape[0] <= cap
    r.forward(ForwardBatch(batch.chunks[1:]))  # 4 rows x 1 column: kept, small
    assert r._workspace is not None and r._workspace[0].shape[0] <= cap


# -- CUDA -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cuda_flex_equals_reference_without_math_fallback(dtype, atol):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    step = make_step(ROWS + CHUNKS, 16, 8, 2, head_dim=64, seed=7, dtype=dtype, device="cuda")
    path = select_attention("auto", "cuda", 16)
    assert path.backend is AttentionBackend.FLEX
    # NOTE: math is not among the allowed backends, so any SDPA call that would fall back to
    # it raises; the flex path makes none.
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.CUDNN_ATTENTION]):
        got = step.run(path)
    torch.testing.assert_close(got.float(), step.reference().float(), rtol=0, atol=atol)


@pytest.mark.gpu
def test_cuda_runner_attends_on_flex_without_math_fallback(checkpoint):
    """A runner on CUDA (float32, decode graphs captured) picks flex by itself and, with SDPA
    restricted to its fused kernels (math would raise), gives the CPU runner's logits."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    path = checkpoint("qwen2_5_vl")

    def make(device, **kw):
        return ModelRunner(oracle.text_weights(path), RunnerSettings(page_size=16, **kw),
                           num_pages=oracle.kv_pages(1024, device, page=16), device=device)

    gpu = make("cuda", cuda_graph_max_bs=4, max_seq_len=256)
    assert gpu.attention.backend is AttentionBackend.FLEX and gpu.graph_runner.use_graphs
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.CUDNN_ATTENTION]):
        got = _five_steps(gpu)
    _assert_same_steps(got, _five_steps(make("cpu")), atol=1e-3)


@pytest.mark.gpu
def test_cuda_long_chunk_peak_memory_is_bounded():
    """A 4096-token chunk over 16K keys at 7B attention sizes (28 heads, 4 KV heads, head dim
    128, bfloat16): peak memory beside the cache stays under the bound (the math fallback
    needed ~7.5 GB of float32 scores here)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from paged_attention import check_long_context

    (row,) = check_long_context("cuda", torch.bfloat16, contexts=(16384,))
    assert row.math_fallback is False and row.max_abs_err <= 2e-2, row
    assert row.peak_extra_bytes <= row.bound_bytes, row
