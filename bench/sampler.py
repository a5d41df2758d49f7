"""The engine's `sample()` on the CPU, per step: the sort-free path (engine/nucleus.py), in
Python a row at a time and in the compiled kernels for the whole step (`kernels=`, what the
engine runs where they build), beside the full-sort path it replaced there
(`sampler.CPU_SORT_FREE = False`, CUDA's path), in CPU ms of the calling thread
(`time.thread_time`, one torch thread; median of `--steps`), so other processes' load does
not count.

    .venv/bin/python bench/sampler.py [--vocab 1024 151936] [--rows 1 8 32] [--steps 7]
        [--runs 1] [--parts] [--out bench/results/sampler.md]

Rows: float32 logits, one request each; greedy, and temperature 0.8 + top-p 0.95 on two
kinds of row: `flat` (randn: at T 0.8 two thirds of the vocabulary survive top-p 0.95, the
worst case for a partial top-k, and `bench/language_runner.py --profile`'s rows) and
`peaked` (randn * 6: a few dozen survive, as on a confident model). `--parts`: one 152K row
of the sort-free path split into its passes, the same ops `nucleus()` runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tandem.cpu_kernels import kernels  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402
from tandem.services.language.engine import nucleus as nuc  # noqa: E402
from tandem.services.language.engine import sampler  # noqa: E402
from tandem.services.language.engine.request import Request, RequestSpec  # noqa: E402
from tandem.transfer.payload import PromptPayload  # noqa: E402

KINDS = {"flat": 1.0, "peaked": 6.0}  # the scale of randn logits


PATHS = ("sort", "python", "compiled")  # full sort; sort-free a row at a time; the kernels


def step_ms(vocab: int, rows: int, params: SamplingParams, scale: float, path: str,
            steps: int) -> float:
    """Median CPU ms of one `sample()` over [rows, vocab] logits by `path` (PATHS)."""
    sampler.CPU_SORT_FREE = path != "sort"
    mod = kernels() if path == "compiled" else None
    if path == "compiled" and mod is None:
        raise SystemExit("the CPU kernels could not be built: no compiled path to measure")
    reqs = [Request(RequestSpec(i + 1, params, PromptPayload.of_token_ids([1, 2, 3])))
            for i in range(rows)]
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * scale
    for _ in range(2):
        sampler.sample(logits, reqs, kernels=mod)
    times = []
    for _ in range(steps):
        t = time.thread_time()
        sampler.sample(logits, reqs, kernels=mod)
        times.append(time.thread_time() - t)
    sampler.CPU_SORT_FREE = True
    return statistics.median(times) * 1e3


def parts(vocab: int, steps: int) -> list[tuple[str, float]]:
    """CPU ms of each pass of `nucleus()` on one flat row at T 0.8, top-p 0.95 (the same ops
    in the same order, timed one by one), and of the draw."""
    x = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    ws = nuc._workspace(vocab)
    acc: dict[str, list[float]] = {}

    def lap(name: str, t0: float) -> float:
        t1 = time.thread_time()
        acc.setdefault(name, []).append(t1 - t0)
        return t1

    for _ in range(steps + 2):
        t = time.thread_time()
        xt = torch.div(x, 0.8, out=ws.x)
        t = lap("x / temperature", t)
        z = torch.sub(xt, xt.max(), out=ws.z).clamp_(min=nuc.FLOOR)
        t = lap("max, x - max (floored)", t)
        e = torch.exp(z, out=ws.e)
        t = lap("exp", t)
        torch.minimum(torch.mul(z, ws.scale, out=ws.f), ws.cap, out=ws.f)
        ws.b16.copy_(ws.f)
        bucket = ws.b64.copy_(ws.b16)
        t = lap("bucket ids (float, int16, int64)", t)
        ws.e64.copy_(e)
        cum = nuc._running(ws, bucket, ws.e64)
        t = lap("float64 weights, scatter-add, cumsum", t)
        target = nuc._f32(0.95) * float(cum[-1])
        cut = int(cum.searchsorted(target))
        above = float(cum[cut - 1]) if cut else 0.0
        ids = ws.in_bucket(cut)
        t = lap("the cut bucket's tokens", t)
        ids = ids[(-ws.x_np[ids]).argsort(kind="stable")]
        ei = ws.e64_np[ids]
        before = nuc._cumsum(ei) + above - ei
        over = before >= target
        tail = ids[: max(int(over.argmax()) if over.any() else ids.size, 1)]
        t = lap("their sort and the exact cut", t)
        tail_cum = nuc._cumsum(ws.e64_np[tail])
        nu = nuc.Nucleus(ws, ws.e64_np, cum, cut, tail, tail_cum, above,
                         above + float(tail_cum[-1]))
        t = time.thread_time()
        nu.draw(0.37)
        lap("draw (a bucket's tokens, one search)", t)
    return [(k, statistics.median(v[2:]) * 1e3) for k, v in acc.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[1024, 151936])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--runs", type=int, default=1,
                    help="each cell: the median of this many runs' medians, the runs one after "
                         "another over the whole table (a shared host's load drifts)")
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--out", help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from tandem.cpu_kernels import cpu_model

    greedy = SamplingParams(max_tokens=8)
    top_p = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=1)
    lines = [f"CPU: {cpu_model()}, torch {torch.__version__}, 1 thread; CPU ms of the "
             f"calling thread per sample() step, median of {args.steps} "
             f"(of {args.runs} such medians).", "",
             "| vocabulary | rows | greedy | T 0.8 + top-p 0.95, flat: full sort | sort-free "
             "| compiled | compiled vs sort-free | peaked: full sort | sort-free | compiled |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    cells: dict[tuple, list[float]] = {}
    for _ in range(args.runs):
        for v in args.vocab:
            for n in args.rows:
                cells.setdefault((v, n, "greedy"), []).append(
                    step_ms(v, n, greedy, 1.0, "python", args.steps))
                for k, s in KINDS.items():
                    for path in PATHS:
                        cells.setdefault((v, n, k, path), []).append(
                            step_ms(v, n, top_p, s, path, args.steps))
    for v in args.vocab:
        for n in args.rows:
            g = statistics.median(cells[v, n, "greedy"])
            got = {(k, path): statistics.median(cells[v, n, k, path])
                   for k in KINDS for path in PATHS}
            row = (f"| {v:,} | {n} | {g:.2f} | {got['flat', 'sort']:.2f} | "
                   f"{got['flat', 'python']:.2f} | {got['flat', 'compiled']:.2f} | "
                   f"{got['flat', 'python'] / got['flat', 'compiled']:.1f}x | "
                   f"{got['peaked', 'sort']:.2f} | {got['peaked', 'python']:.2f} | "
                   f"{got['peaked', 'compiled']:.2f} |")
            lines.append(row)
            print(row, flush=True)
    if args.parts:
        v = max(args.vocab)
        part = parts(v, max(args.steps, 15))
        head = ["", f"The sort-free path's passes, one flat row of {v:,} (CPU ms, median):", "",
                "| pass | ms |", "|---|---:|"]
        body = [f"| {k} | {ms:.3f} |" for k, ms in part]
        body.append(f"| sum | {sum(ms for _, ms in part):.3f} |")
        print("\n".join(head + body))
        lines += head + body
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
