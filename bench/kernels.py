"""Our CPU kernels against torch's own ops, side by side in one process, on this host.

    .venv/bin/python bench/kernels.py [--rows 1 4 8 16 32 64] [--threads 1 2] [--runs 5]
    TANDEM_KERNEL_ISA=generic .venv/bin/python bench/kernels.py   # another vector path

Linears: `packed_linear` against `F.linear` (torch's MKL/oneDNN sgemm) on the decoder's
shapes of the `small` preset (q/k/v fused 512 -> 768, o 512 -> 512, gate/up fused
512 -> 3072, down 1536 -> 512) and of a Qwen2.5-VL-3B-sized layer (2048 -> 11008 gate/up).
`--step`: instead, a decode step's projections of the `small` preset, the four above for
each of 12 layers with distinct weights (a step streams every weight once, so a shape
called again on the same cached weight flatters it), float32 and bfloat16 weights, against
`F.linear` in the same dtype (MKL's sgemm; oneDNN's bfloat16 GEMM).
Decode attention: the in-place paged kernel against gather + SDPA (`paged_attention`
with decode_op None) at 400 keys per row, head dims 64 and 128.

For each case the two sides run in alternating order (A B A B ...), each timing the median
of `--iters` calls; the figure quoted is the median over `--runs` of the per-run ratio
torch / ours (> 1: ours faster). Prints the CPU, the kernels' vector path and markdown
tables, also written to bench/results/kernels-PATH.md (`--out`; docs/benchmarks.md quotes
them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import latency  # noqa: E402  (bench/, the script's own folder)

from tandem.cpu_kernels import cpu_model, kernels  # noqa: E402

LINEARS = {  # name: (K, N)
    "small qkv 512x768": (512, 768),
    "small o 512x512": (512, 512),
    "small gate/up 512x3072": (512, 3072),
    "small down 1536x512": (1536, 512),
    "3B gate/up 2048x11008": (2048, 11008),
}


def median_call_s(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired(ours, theirs, runs: int, iters: int) -> tuple[float, float, float]:
    """Median per-call seconds of ours and theirs, and the median of the per-run ratios
    theirs / ours, the two timed in alternating order."""
    a, b, ratios = [], [], []
    for r in range(runs):
        pair = [("o", ours), ("t", theirs)] if r % 2 == 0 else [("t", theirs), ("o", ours)]
        got = {name: median_call_s(fn, iters) for name, fn in pair}
        a.append(got["o"])
        b.append(got["t"])
        ratios.append(got["t"] / got["o"])
    return statistics.median(a), statistics.median(b), statistics.median(ratios)


def bench_linears(mod, rows, runs, iters, out):
    g = torch.Generator().manual_seed(0)
    for name, (k, n) in LINEARS.items():
        w = torch.randn(n, k, generator=g) * k**-0.5
        wp = mod.pack_linear(w.t().contiguous())
        for m in rows:
            x = torch.randn(m, k, generator=g)
            ours_s, torch_s, ratio = paired(partial(mod.packed_linear, x, wp, None, n),
                                            partial(F.linear, x, w), runs, iters)
            gfs = 2 * m * k * n / ours_s / 1e9
            out.append(f"| linear {name} | {m} | {ours_s * 1e3:.3f} | {torch_s * 1e3:.3f} | "
                       f"**{ratio:.2f}x** | {gfs:.0f} |")
            print(out[-1], flush=True)


STEP_LAYERS = 12


def _step_ours(mod, layers, xs):
    """A step's projections on the packed kernels: (w, packed w, N) per projection."""
    for layer in layers:
        for w, wp, n in layer:
            mod.packed_linear(xs[w.shape[1]], wp, None, n)


def _step_theirs(layers, xt):
    """The same projections through F.linear in the weights' dtype."""
    for layer in layers:
        for w, _, _ in layer:
            F.linear(xt[w.shape[1]], w)


def bench_step(mod, rows, runs, iters, out):
    g = torch.Generator().manual_seed(0)
    shapes = [kn for name, kn in LINEARS.items() if name.startswith("small")]
    ws = [[torch.randn(n, k, generator=g) * k**-0.5 for k, n in shapes]
          for _ in range(STEP_LAYERS)]
    flops_per_row = 2 * STEP_LAYERS * sum(k * n for k, n in shapes)
    for dtype in (torch.float32, torch.bfloat16):
        layers = [[(w.to(dtype), mod.pack_linear(w.t().contiguous().to(dtype)), w.shape[0])
                   for w in layer] for layer in ws]
        for m in rows:
            xs = {k: torch.randn(m, k, generator=g) for k, _ in shapes}
            xt = {k: x.to(dtype) for k, x in xs.items()}  # torch's side in the weights' dtype

            ours_s, torch_s, ratio = paired(partial(_step_ours, mod, layers, xs),
                                            partial(_step_theirs, layers, xt), runs, iters)
            name = str(dtype).removeprefix("torch.")
            out.append(f"| step projections, {STEP_LAYERS} layers, {name} weights | {m} | "
                       f"{ours_s * 1e3:.3f} | {torch_s * 1e3:.3f} | **{ratio:.2f}x** | "
                       f"{flops_per_row * m / ours_s / 1e9:.0f} |")
            print(out[-1], flush=True)


def bench_attention(rows, runs, iters, out):
    from tandem.cpu_kernels import paged_decode_op
    from tandem.services.language.model.attention import AttentionMetadata, paged_attention

    op = paged_decode_op()
    g = torch.Generator().manual_seed(1)
    ctx, ps = 400, 16
    for d, h, hkv in ((64, 8, 2), (128, 16, 2)):
        for b in rows:
            pages = b * (ctx // ps + 1)
            kc = torch.randn(pages + 1, ps, hkv, d, generator=g)
            vc = torch.randn(pages + 1, ps, hkv, d, generator=g)
            tables = torch.arange(pages, dtype=torch.int64).view(b, -1)
            lens = torch.full((b,), ctx, dtype=torch.int64)
            q = torch.randn(b, h, d, generator=g)
            kv = torch.zeros(b, hkv, d)
            slots = torch.full((b,), pages * ps, dtype=torch.int64)

            metas = [AttentionMetadata(slot_mapping=slots, num_single=b,
                                       single_block_tables=tables, single_seq_lens=lens,
                                       decode_op=o) for o in (op, None)]
            ours, theirs = (partial(paged_attention, q, kv, kv, kc, vc, m, d**-0.5)
                            for m in metas)

            ours_s, torch_s, ratio = paired(ours, theirs, runs, iters)
            out.append(f"| decode attention D={d} H={h}/{hkv}, {ctx} keys | {b} | "
                       f"{ours_s * 1e3:.3f} | {torch_s * 1e3:.3f} | **{ratio:.2f}x** | |")
            print(out[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--step", action="store_true",
                    help="instead: a decode step's projections (12 layers, distinct weights)")
    ap.add_argument("--out", default=None,
                    help="markdown file for the tables (default bench/results/kernels-PATH.md, "
                    "PATH the kernels' vector path)")
    args = ap.parse_args()
    mod = kernels()
    if mod is None:
        sys.exit("the CPU kernels could not be built (see the log)")
    head = (f"CPU: {cpu_model()}, {os.cpu_count()} cores; kernel path {mod.isa()}; "
            f"torch {torch.__version__}")
    print(head)
    tables = [f"# bench/kernels.py, path {mod.isa()}, {time.strftime('%Y-%m-%d %H:%M')}\n",
              head, f"`{' '.join(['bench/kernels.py', *sys.argv[1:]])}`"]
    for threads in args.threads:
        torch.set_num_threads(threads)
        out = [f"\n{threads} torch thread(s), path {mod.isa()}, {cpu_model()}\n",
               "| case | rows | ours ms | torch ms | torch / ours | ours GF/s |",
               "| --- | ---: | ---: | ---: | ---: | ---: |"]
        print("\n".join(out), flush=True)
        if args.step:
            bench_step(mod, args.rows, args.runs, args.iters, out)
            tables += out
            continue
        bench_linears(mod, args.rows, args.runs, args.iters, out)
        if not args.no_attention:
            bench_attention([r for r in args.rows if r <= 32], args.runs, args.iters, out)
        tables += out
    # rows were printed as measured (a run takes minutes); publish prints the whole again
    latency.publish("\n".join(tables) + "\n",
                    args.out or str(ROOT / "bench" / "results"
                                    / f"kernels-{'step-' if args.step else ''}{mod.isa()}.md"))


if __name__ == "__main__":
    main()
