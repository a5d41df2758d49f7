"""Decode step time of the language runner: eager forward vs the decode graph runner.

    .venv/bin/python bench/language_runner.py [--model DIR | --arch qwen3_vl --size small]
        [--device auto] [--dtype auto] [--batch-sizes 1 32] [--context 256] [--steps 20]
        [--threads N] [--linear-backend auto|torch|packed_cpu] [--attention-backend ...]

For each batch size, `bs` sequences of `context` tokens are prefilled once; then the same
decode batch (one token per sequence) is timed `steps` times through `forward_eager` and
through the graph runner (CUDA graph replay on a GPU; on a CPU the same static-buffer path
runs eagerly, so the ratio there is ~1 and only shows the padding overhead). Re-running the
same decode step rewrites the same KV slots, so every step does identical work. Prints the
median step time of `--repeats` runs and the ratio eager / graph measured in the same run.
On a CPU, running it with each backend (our kernels, or torch's linears / gather + SDPA)
gives the decode step's profile by difference (docs/benchmarks.md).
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

from tandem.services.language.engine.kv_pages import KVPagePool  # noqa: E402
from tandem.services.language.runner.forward_batch import ForwardBatch, SeqChunk, decode_positions  # noqa: E402
from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings  # noqa: E402
from tandem.units import ceil_div  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, steps: int) -> float:
    """Median seconds of one call over `steps` calls (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: build a tiny-model one)")
    ap.add_argument("--arch", default="qwen3_vl", choices=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--linear-backend", default="auto", choices=["auto", "torch", "packed_cpu"],
                    help="the runner's linears (a decode-step profile: run once with each)")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "gather", "paged_cpu"])
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from tandem.devices import resolve_device, resolve_dtype
    from tandem.models.split import load_text_weights

    path = args.model
    if path is None:
        from latency import checkpoint  # bench/, the script's own folder

        path = checkpoint(args.arch, args.size)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    max_bs = max(args.batch_sizes)
    max_len = args.context + 8
    per_seq = ceil_div(max_len, args.page_size)
    weights = load_text_weights(path, dtype=dtype, device=device)
    t0 = time.perf_counter()
    runner = ModelRunner(
        weights, RunnerSettings(page_size=args.page_size, cuda_graph_max_bs=max(max_bs, 1),
                                max_seq_len=max_len, linear_backend=args.linear_backend,
                                attention_backend=args.attention_backend),
        num_pages=max_bs * per_seq + 1, device=device, dtype=dtype,
    )  # fmt: skip
    setup_s = time.perf_counter() - t0
    pool = KVPagePool(runner.num_pages, runner.page_size)
    gr = runner.graph_runner
    from tandem.cpu_kernels import cpu_model, isa

    print(f"kernels path {isa()} on {cpu_model()} | linears {args.linear_backend} | "
          f"attention {args.attention_backend} | threads {torch.get_num_threads()}")
    print(f"model {path} | device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'})"
          f" | dtype {str(dtype).removeprefix('torch.')} | context {args.context} | graphs {len(gr.graphs)}"
          f" captured in {setup_s:.1f}s (incl. KV alloc)")  # fmt: skip

    g = torch.Generator().manual_seed(0)
    print(f"\n{'bs':>4} | {'eager ms/step':>14} | {'graph ms/step':>14} | {'eager/graph':>11}")
    print(f"{'-' * 4}-+-{'-' * 14}-+-{'-' * 14}-+-{'-' * 11}")
    for bs in args.batch_sizes:
        chunks = []
        for i in range(bs):
            ids = torch.randint(0, runner.vocab_size, (args.context,), generator=g)
            pages = pool.alloc(per_seq)
            pos = torch.arange(args.context).expand(3, args.context)
            runner.forward_eager(ForwardBatch([SeqChunk(i, 0, pos, pages, token_ids=ids)]))
            chunks.append(SeqChunk(i, args.context, decode_positions(args.context, 0), pages,
                                   token_ids=torch.tensor([int(ids[-1])])))  # fmt: skip
        batch = ForwardBatch(chunks)
        eager, graph = [], []
        for _ in range(args.repeats):
            eager.append(_time(lambda b=batch: runner.forward_eager(b), device, args.steps))
            graph.append(_time(lambda b=batch: gr.run(b), device, args.steps))
        e, gt = statistics.median(eager), statistics.median(graph)
        print(f"{bs:>4} | {e * 1e3:>14.3f} | {gt * 1e3:>14.3f} | {e / gt:>10.2f}x")
        for c in chunks:
            pool.free(c.block_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
