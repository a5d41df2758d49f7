"""Long-context attention on the serving path: no math fallback, bounded peak memory (issue 25).

    .venv/bin/python bench/paged_attention.py              # CUDA: 16K and 32K keys (no CUDA:
                                                           # the dry run, as `make bench` has it)
    .venv/bin/python bench/paged_attention.py --dry-run    # CPU, tiny: the script works
    .venv/bin/python bench/paged_attention.py --cpu-decode # the CPU decode kernel by KV dtype

`check_long_context(device, dtype, contexts, chunk, ...)` returns one `LongContextRow` per
context: a `chunk`-token prompt chunk whose first context - chunk keys are a cached prefix
(the case issue 25's finding 2 is about), one layer at Qwen2.5-VL-7B attention sizes (28
heads, 4 KV heads, head dim 128, 16-token pages shuffled over the cache), run through
`paged_attention` with the metadata of the path `select_attention(backend, device)` picks
(auto: flex on CUDA; the dry run asks for flex on the CPU). It runs under `sdpa_kernel(flash, efficient, cudnn)`: an SDPA call that
could only run on the math backend raises there, and is reported as `math_fallback`.
`make gpu-check` records these rows; `tests/test_paged_attention.py` asserts one.

`--cpu-decode`: the CPU decode kernel alone (`paged_decode_attention`, one layer, one torch
thread, CPU ms of the calling thread, median of `--runs` runs of `--steps` calls each) at
the qwen3_vl small preset's heads (8 over 2, head dim 64) and 7B-like ones (28 over 4, 128),
batch 1/8/32 at each `--decode-contexts`, by KV cache dtype: float32 (q float32), bfloat16
with a float32 query (the runner's `cpu_bf16_compute` float32 products), bfloat16 with a
bfloat16 query (a bfloat16 model's own step). Rows' pages are shuffled over the cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tandem.services.language.model.attention import (  # noqa: E402
    PrefillChunkMeta,
    paged_attention,
    select_attention,
)


@dataclass(frozen=True)
class LongContextRow:
    device: str
    dtype: str
    backend: str  # the attention path that ran (flex on CUDA)
    context: int  # keys the chunk's last query sees
    chunk: int  # queries
    math_fallback: bool  # an SDPA call found no fused kernel (raised under the restriction)
    peak_extra_bytes: int | None  # peak allocated during the call minus before (CUDA only)
    bound_bytes: int  # what the path may take beside its inputs (4 outputs + 64 MiB)
    math_scores_bytes: int  # what the math fallback's float32 scores alone would take
    max_abs_err: float  # against a dense float32 reference
    seconds: float  # median call after a warm-up


def check_long_context(
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    contexts: tuple[int, ...] = (16384, 32768),
    chunk: int = 4096,
    heads: int = 28,
    kv_heads: int = 4,
    head_dim: int = 128,
    page_size: int = 16,
    runs: int = 3,
    backend: str = "auto",
) -> list[LongContextRow]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device(device)
    path = select_attention(backend, device, page_size)
    cuda = device.type == "cuda"
    rows = []
    for context in contexts:
        g = torch.Generator().manual_seed(context)
        pages = -(-context // page_size)
        table = torch.randperm(pages + 8, generator=g)[:pages]  # shuffled, some pages unused

        def rnd(*shape, g=g):
            return torch.randn(*shape, generator=g).to(device, dtype)

        cache = (pages + 8 + 1, page_size, kv_heads, head_dim)  # + the dummy page
        k_cache, v_cache = rnd(*cache), rnd(*cache)
        q, k, v = rnd(chunk, heads, head_dim), rnd(chunk, kv_heads, head_dim), rnd(chunk, kv_heads, head_dim)
        pos = torch.arange(context - chunk, context)
        tab = table.to(device)
        slots = tab[pos.to(device) // page_size] * page_size + pos.to(device) % page_size
        empty = torch.zeros(0, 0, dtype=torch.int64, device=device)

        def step(k_cache=k_cache, v_cache=v_cache, q=q, k=k, v=v, slots=slots, tab=tab,
                 context=context, empty=empty):
            meta = path.metadata(
                slot_mapping=slots, block_tables=empty, seq_lens=empty.new_zeros(0), page_size=page_size,
                cache_pages=k_cache.shape[0], prefill=[PrefillChunkMeta(0, chunk, context, tab)],
            )
            return paged_attention(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)

        math_fallback = False
        times: list[float] = []
        peak = None
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                          SDPBackend.CUDNN_ATTENTION]):
            try:
                out = step()  # warm-up: compiles
                if cuda:
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                for _ in range(runs):
                    t = time.perf_counter()
                    out = step()
                    if cuda:
                        torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - t)
                if cuda:
                    peak = torch.cuda.max_memory_allocated(device) - before
            except RuntimeError as e:
                if "No available kernel" not in str(e):
                    raise
                math_fallback, out = True, None
        err = float("nan") if out is None else _max_err(out, q, k_cache, v_cache, tab, context, page_size)
        rows.append(LongContextRow(
            device=str(device), dtype=str(dtype).removeprefix("torch."), backend=path.backend.value,
            context=context, chunk=chunk, math_fallback=math_fallback, peak_extra_bytes=peak,
            bound_bytes=4 * chunk * heads * head_dim * q.element_size() + (64 << 20),
            math_scores_bytes=4 * heads * chunk * context,
            max_abs_err=err, seconds=statistics.median(times) if times else float("nan"),
        ))
    return rows


def _max_err(out, q, k_cache, v_cache, table, context, page_size, block: int = 128) -> float:
    """Dense float32 reference over the step's keys (K/V already written), `block` queries
    at a time so that the reference itself stays small."""
    kv_heads, head_dim = k_cache.shape[-2:]
    keys = k_cache[table].reshape(-1, kv_heads, head_dim)[:context].float()
    vals = v_cache[table].reshape(-1, kv_heads, head_dim)[:context].float()
    group = q.shape[1] // kv_heads
    keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
    start, worst = context - q.shape[0], 0.0
    for a in range(0, q.shape[0], block):
        qb = q[a : a + block].float()
        s = torch.einsum("nhd,lhd->hnl", qb, keys) * head_dim**-0.5
        qpos = torch.arange(start + a, start + a + qb.shape[0], device=q.device)
        s.masked_fill_(torch.arange(context, device=q.device)[None, :] > qpos[:, None], float("-inf"))
        ref = torch.einsum("hnl,lhd->nhd", s.softmax(-1), vals)
        worst = max(worst, (out[a : a + block].float() - ref).abs().max().item())
    return worst


@dataclass(frozen=True)
class DecodeKernelRow:
    heads: int
    kv_heads: int
    head_dim: int
    batch: int
    context: int
    ms: dict[str, float]  # case -> CPU ms per call (median)


DECODE_CASES = ("f32 q, f32 KV", "f32 q, bf16 KV", "bf16 q, bf16 KV")


def cpu_decode_kernel(contexts: tuple[int, ...], batches: tuple[int, ...] = (1, 8, 32),
                      shapes: tuple[tuple[int, int, int], ...] = ((8, 2, 64), (28, 4, 128)),
                      steps: int = 20, runs: int = 5, page_size: int = 16) -> list[DecodeKernelRow]:
    """The decode kernel per call by KV dtype (the module docstring's `--cpu-decode`). The
    cases of one shape alternate within each run, so the host's load falls on all alike."""
    from tandem.cpu_kernels import paged_decode_op

    op = paged_decode_op()
    if op is None:
        raise SystemExit("the CPU kernels do not build here")
    torch.set_num_threads(1)
    rows = []
    for heads, kv_heads, head_dim in shapes:
        for context in contexts:
            for bs in batches:
                g = torch.Generator().manual_seed(bs * 100_003 + context)
                per_row = -(-context // page_size)
                pages = bs * per_row
                shape = (pages + 1, page_size, kv_heads, head_dim)
                kc = torch.randn(*shape, generator=g)
                vc = torch.randn(*shape, generator=g)
                tables = torch.randperm(pages, generator=g).view(bs, per_row).contiguous()
                lens = torch.full((bs,), context, dtype=torch.int64)
                q = torch.randn(bs, heads, head_dim, generator=g)
                kb, vb, qb = kc.bfloat16(), vc.bfloat16(), q.bfloat16()
                args = {DECODE_CASES[0]: (q, kc, vc), DECODE_CASES[1]: (q, kb, vb),
                        DECODE_CASES[2]: (qb, kb, vb)}
                times: dict[str, list[float]] = {c: [] for c in DECODE_CASES}
                for case, (qq, kk, vv) in list(args.items()):  # warm-up
                    try:
                        op(qq, kk, vv, tables, lens, head_dim**-0.5)
                    except RuntimeError:  # a build without that case (mixed dtypes)
                        del args[case]
                        times[case].append(float("nan"))
                for _ in range(runs):
                    for case, (qq, kk, vv) in args.items():
                        t = time.thread_time()
                        for _ in range(steps):
                            op(qq, kk, vv, tables, lens, head_dim**-0.5)
                        times[case].append((time.thread_time() - t) / steps * 1e3)
                rows.append(DecodeKernelRow(heads, kv_heads, head_dim, bs, context,
                                            {c: statistics.median(v) for c, v in times.items()}))
                del kc, vc, kb, vb
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="default: cuda where there is one")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, float32, tiny sizes: proves the script, measures nothing")
    ap.add_argument("--cpu-decode", action="store_true",
                    help="instead: the CPU decode kernel per call by KV dtype (docstring)")
    ap.add_argument("--decode-contexts", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    if a.cpu_decode:
        from tandem.cpu_kernels import cpu_model, isa

        print(f"CPU decode kernel, {cpu_model()}, path {isa()}, 1 thread; CPU ms per call, "
              f"median of {a.runs} runs of {a.steps} calls")
        print("| heads / kv / dim | batch | context | " + " | ".join(DECODE_CASES)
              + " | bf16 KV / f32 KV (f32 q) | bf16 q / f32 |")
        print("|---|---:|---:|" + "---:|" * (len(DECODE_CASES) + 2))
        for r in cpu_decode_kernel(tuple(a.decode_contexts), tuple(a.batches), steps=a.steps,
                                   runs=a.runs):
            m = [r.ms[c] for c in DECODE_CASES]
            print(f"| {r.heads} / {r.kv_heads} / {r.head_dim} | {r.batch} | {r.context} | "
                  + " | ".join(f"{x:.3f}" for x in m)
                  + f" | {m[1] / m[0]:.2f} | {m[2] / m[0]:.2f} |")
        return
    if a.device is None and not torch.cuda.is_available():
        print("no CUDA here: the dry run (CPU, tiny sizes)")
        a.dry_run = True
    if a.dry_run:
        rows = check_long_context("cpu", torch.float32, contexts=(512,), chunk=160, heads=4,
                                  kv_heads=2, head_dim=32, runs=1, backend="flex")
    else:
        rows = check_long_context(a.device or "cuda", getattr(torch, a.dtype), tuple(a.contexts),
                                  a.chunk)
    print("| device | dtype | path | context | chunk | math fallback | peak extra MiB | bound MiB "
          "| math scores MiB | max abs err | ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = asdict(r)
        peak = "n/a" if r.peak_extra_bytes is None else f"{r.peak_extra_bytes / 2**20:.0f}"
        print(f"| {d['device']} | {r.dtype} | {r.backend} | {r.context} | {r.chunk} | "
              f"{'YES' if r.math_fallback else 'no'} | {peak} | {r.bound_bytes / 2**20:.0f} | "
              f"{r.math_scores_bytes / 2**20:.0f} | {r.max_abs_err:.2e} | {r.seconds * 1e3:.1f} |")


if __name__ == "__main__":
    main()
