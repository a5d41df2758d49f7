"""Long-context attention on the serving path: no math fallback, bounded peak memory (issue 25).

    .venv/bin/python bench/paged_attention.py              # CUDA: 16K and 32K keys (no CUDA:
                                                           # the dry run, as `make bench` has it)
    .venv/bin/python bench/paged_attention.py --dry-run    # CPU, tiny: the script works

`check_long_context(device, dtype, contexts, chunk, ...)` returns one `LongContextRow` per
context: a `chunk`-token prompt chunk whose first context - chunk keys are a cached prefix
(the case issue 25's finding 2 is about), one layer at Qwen2.5-VL-7B attention sizes (28
heads, 4 KV heads, head dim 128, 16-token pages shuffled over the cache), run through
`paged_attention` with the metadata of the path `select_attention(backend, device)` picks
(auto: flex on CUDA; the dry run asks for flex on the CPU). It runs under `sdpa_kernel(flash, efficient, cudnn)`: an SDPA call that
could only run on the math backend raises there, and is reported as `math_fallback`.
`make gpu-check` records these rows; `tests/test_paged_attention.py` asserts one.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="default: cuda where there is one")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, float32, tiny sizes: proves the script, measures nothing")
    a = ap.parse_args()
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
