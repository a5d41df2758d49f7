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


def decode_batch(runner, pool, bs: int, context: int, per_seq: int,
                  g: torch.Generator) -> ForwardBatch:
    """`bs` decode rows, each after its own `context`-token prompt run eagerly (KV in place).
    Also bench/gpu_check.py's decode check."""
    chunks = []
    for i in range(bs):
        ids = torch.randint(0, runner.vocab_size, (context,), generator=g)
        pages = pool.alloc(per_seq)
        pos = torch.arange(context).expand(3, context)
        runner.forward_eager(ForwardBatch([SeqChunk(i, 0, pos, pages, token_ids=ids)]))
        chunks.append(SeqChunk(i, context, decode_positions(context, 0), pages,
                               token_ids=torch.tensor([int(ids[-1])])))
    return ForwardBatch(chunks)


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
    ap.add_argument("--cpu-bf16-compute", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="bfloat16 on the CPU: linear products in torch's bfloat16 GEMM or in "
                         "float32 over widened weights (RunnerSettings.cpu_bf16_compute)")
    ap.add_argument("--compile-step", default="off", choices=["off", "decode", "all"],
                    help="decode: the graph runner's buckets compiled by inductor at start-up "
                         "(RunnerSettings.compile_step); the table then gives CPU and wall ms "
                         "of the eager step and of the compiled one. all: the same, then a "
                         "table of prefill steps (--prefill-lengths, --mixed-rows) eager and "
                         "through the compiled mixed step")
    ap.add_argument("--prefill-lengths", type=int, nargs="+", default=[64, 512, 2048],
                    help="--compile-step all: prompt chunk lengths of the prefill table")
    ap.add_argument("--mixed-rows", type=int, default=0,
                    help="--compile-step all: decode rows (of --context tokens) in every "
                         "prefill step of the table (0: prefill steps alone)")
    ap.add_argument("--prefill-steps", type=int, default=3,
                    help="--compile-step all: steps timed per cell of the prefill table")
    ap.add_argument("--static-check", action="store_true",
                    help="--compile-step all: also compile the mixed step with static shapes "
                         "for each prefill length (one compile each) and time it beside "
                         "the dynamic graph")
    ap.add_argument("--compile-cache-dir", default="",
                    help="inductor's cache (TORCHINDUCTOR_CACHE_DIR; empty: its default)")
    ap.add_argument("--profile", action="store_true",
                    help="instead: CPU ms per step by component (decode at each batch size, "
                         "one prefill chunk) and the sampler's, on one torch thread")
    ap.add_argument("--sampler-vocab", type=int, nargs="+", default=[1024, 151936],
                    help="--profile: vocabulary sizes the sampler is measured at")
    args = ap.parse_args(argv)
    if args.profile:
        args.threads = 1
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
    lengths = args.prefill_lengths if args.compile_step == "all" else []
    max_len = max([args.context, *lengths]) + 8
    per_seq = ceil_div(args.context + 8, args.page_size)
    extra = args.mixed_rows * per_seq + ceil_div(max(lengths, default=0), args.page_size)
    weights = load_text_weights(path, dtype=dtype, device=device)
    t0 = time.perf_counter()
    runner = ModelRunner(
        weights, RunnerSettings(page_size=args.page_size, cuda_graph_max_bs=max(max_bs, 1),
                                max_seq_len=max_len, linear_backend=args.linear_backend,
                                attention_backend=args.attention_backend,
                                cpu_bf16_compute=args.cpu_bf16_compute,
                                compile_step=args.compile_step,
                                compile_cache_dir=args.compile_cache_dir),
        num_pages=max_bs * per_seq + extra + 1, device=device, dtype=dtype,
    )
    setup_s = time.perf_counter() - t0
    pool = KVPagePool(runner.num_pages, runner.page_size)
    gr = runner.graph_runner
    from tandem.cpu_kernels import cpu_model, isa

    print(f"kernels path {isa()} on {cpu_model()} | linears {args.linear_backend} "
          f"(products in {str(runner.linear_dtype).removeprefix('torch.')}) | "
          f"attention {args.attention_backend} | threads {torch.get_num_threads()}")
    print(f"model {path} | device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'})"
          f" | dtype {str(dtype).removeprefix('torch.')} | context {args.context} | graphs {len(gr.graphs)}"
          f" captured in {setup_s:.1f}s (incl. KV alloc)")

    if gr.compiled:
        print("compiled buckets: " + ", ".join(f"bs {b} {gr.compile_s[b]:.1f} s"
                                               for b in sorted(gr.compiled)))
    if runner.mixed_step is not None:
        print(f"compiled mixed step: {runner.mixed_step.compile_s:.1f} s")
    if args.profile:
        profile(runner, pool, args, args.sampler_vocab)
        return 0
    if gr.compiled:
        compiled_table(runner, pool, args)
        if runner.mixed_step is not None:
            prefill_table(runner, pool, args)
        return 0
    g = torch.Generator().manual_seed(0)
    print(f"\n{'bs':>4} | {'eager ms/step':>14} | {'graph ms/step':>14} | {'eager/graph':>11}")
    print(f"{'-' * 4}-+-{'-' * 14}-+-{'-' * 14}-+-{'-' * 11}")
    for bs in args.batch_sizes:
        batch = decode_batch(runner, pool, bs, args.context, per_seq, g)
        eager, graph = [], []
        for _ in range(args.repeats):
            eager.append(_time(lambda b=batch: runner.forward_eager(b), device, args.steps))
            graph.append(_time(lambda b=batch: gr.run(b), device, args.steps))
        e, gt = statistics.median(eager), statistics.median(graph)
        print(f"{bs:>4} | {e * 1e3:>14.3f} | {gt * 1e3:>14.3f} | {e / gt:>10.2f}x")
        for c in batch.chunks:
            pool.free(c.block_table)
    return 0


def _cpu_wall(fn, steps: int, warm: int = 3) -> tuple[float, float]:
    """Median CPU ms (the calling thread's) and wall ms of one call over `steps` calls."""
    for _ in range(warm):
        fn()
    cpu, wall = [], []
    for _ in range(steps):
        c, w = time.thread_time(), time.perf_counter()
        fn()
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(cpu) * 1e3, statistics.median(wall) * 1e3


def compiled_table(runner, pool, args) -> None:
    """--compile-step decode: the decode step eager (`forward_eager`) and compiled (the
    graph runner's bucket), alternating, each cell the median of `repeats` runs' medians
    of `steps` steps; CPU ms of the stepping thread (as --profile's total) and wall ms."""
    gr = runner.graph_runner
    g = torch.Generator().manual_seed(0)
    per_seq = ceil_div(args.context + 8, args.page_size)
    print(f"\n{'bs':>4} | {'eager CPU ms':>12} | {'compiled CPU ms':>15} | {'eager/compiled':>14} "
          f"| {'eager wall ms':>13} | {'compiled wall ms':>16}")
    for bs in args.batch_sizes:
        batch = decode_batch(runner, pool, bs, args.context, per_seq, g)
        e = gr.run(batch).last_logits
        diff = (e - runner.forward_eager(batch).last_logits).abs().max().item()
        runs: dict[str, list[tuple[float, float]]] = {"eager": [], "compiled": []}
        for _ in range(args.repeats):
            runs["eager"].append(_cpu_wall(lambda b=batch: runner.forward_eager(b), args.steps))
            runs["compiled"].append(_cpu_wall(lambda b=batch: gr.run(b), args.steps))
        med = {k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v))
               for k, v in runs.items()}
        (ec, ew), (cc, cw) = med["eager"], med["compiled"]
        print(f"{bs:>4} | {ec:>12.2f} | {cc:>15.2f} | {ec / cc:>13.2f}x | {ew:>13.2f} | "
              f"{cw:>16.2f}   (max |logit diff| {diff:.1e})")
        for c in batch.chunks:
            pool.free(c.block_table)


@torch.inference_mode()
def prefill_table(runner, pool, args) -> None:
    """--compile-step all: a prompt chunk of each --prefill-lengths length (token ids, no
    cached prefix; with --mixed-rows decode rows beside it) eager (`forward_eager`) and
    through the compiled mixed step (`forward_mixed`), alternating, each cell the median
    of `repeats` runs' medians of `prefill_steps` steps (after one warm-up); CPU ms of the
    stepping thread and wall ms. Re-running a step rewrites the same KV slots: every step
    does the same work. --static-check: a static-shape compile of the same step per
    length too (dynamic=False), to tell what the dynamic sizes cost."""
    from tandem.services.language.runner.graph_runner import MixedStep

    g = torch.Generator().manual_seed(1)
    per_seq = ceil_div(args.context + 8, args.page_size)
    rows = (decode_batch(runner, pool, args.mixed_rows, args.context, per_seq, g).chunks
            if args.mixed_rows else [])
    print(f"\nprefill steps ({args.mixed_rows} decode rows of {args.context} tokens beside "
          "the chunk)")
    print(f"{'tokens':>6} | {'eager CPU ms':>12} | {'compiled CPU ms':>15} | {'eager/compiled':>14} "
          f"| {'eager wall ms':>13} | {'compiled wall ms':>16}" +
          (f" | {'static CPU ms':>13} | {'static compile s':>16}" if args.static_check else ""))
    for n in args.prefill_lengths:
        ids = torch.randint(0, runner.vocab_size, (n,), generator=g)
        pages = pool.alloc(ceil_div(n, args.page_size))
        chunk = SeqChunk(10_000, 0, torch.arange(n).expand(3, n).contiguous(), pages, token_ids=ids)
        batch = ForwardBatch([*rows, chunk])
        e, c = runner.forward_eager(batch).last_logits, runner.forward_mixed(batch).last_logits
        diff = (e - c).abs().max().item()
        modes = {"eager": lambda b=batch: runner.forward_eager(b),
                 "compiled": lambda b=batch: runner.forward_mixed(b)}
        static_s = 0.0
        if args.static_check:  # the same step, its shapes static (compiled at its first call)
            ms = runner.mixed_step
            static = MixedStep(ms.model, ms.kv, ms.attention, ms.max_pages * ms.page_size)
            static.fn = torch.compile(static._step, fullgraph=True, dynamic=False)
            t0 = time.perf_counter()
            runner._run(batch, static)
            static_s = time.perf_counter() - t0
            if static.fn is None:
                raise RuntimeError(f"the static compile at {n} tokens fell back to eager")
            modes["static"] = lambda b=batch, st=static: runner._run(b, st)
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in modes}
        for r in range(args.repeats):  # the order reversed every other run
            for k in (list(modes) if r % 2 == 0 else list(reversed(modes))):
                runs[k].append(_cpu_wall(modes[k], args.prefill_steps, warm=1))
        med = {k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v))
               for k, v in runs.items()}
        (ec, ew), (cc, cw) = med["eager"], med["compiled"]
        extra = (f" | {med['static'][0]:>13.2f} | {static_s:>16.1f}" if args.static_check else "")
        print(f"{n:>6} | {ec:>12.2f} | {cc:>15.2f} | {ec / cc:>13.2f}x | {ew:>13.2f} | "
              f"{cw:>16.2f}{extra}   (max |logit diff| {diff:.1e}; runs eager "
              + ", ".join(f"{x:.1f}" for x, _ in runs["eager"]) + " compiled "
              + ", ".join(f"{x:.1f}" for x, _ in runs["compiled"]) + ")", flush=True)
        pool.free(pages)


# -- --profile: where a step's CPU time goes, by component -----------------------------
class _Charge:
    """Exclusive CPU time of the stepping thread per component: wrapped callables charge
    the time since the last mark to the innermost component open (a linear inside the
    logits head counts as the head), the rest of a step to "other" (Python glue, residual
    adds, the decoder's loop). `time.thread_time`: the shared host's other load does not
    count (a descheduled thread's wait is not its CPU time)."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = {}
        self.stack = ["other"]
        self.mark = time.thread_time()

    def _flush(self) -> None:
        now = time.thread_time()
        top = self.stack[-1]
        self.acc[top] = self.acc.get(top, 0.0) + now - self.mark
        self.mark = now

    def wrap(self, name: str, fn):
        def inner(*a, **k):
            self._flush()
            self.stack.append(name)
            try:
                return fn(*a, **k)
            finally:
                self._flush()
                self.stack.pop()
        return inner

    def reset(self) -> None:
        self.acc, self.mark = {}, time.thread_time()


COMPONENTS = ("linears", "attention", "norms", "rope", "activation", "logits", "runner prep",
              "other")


def _instrument(runner) -> _Charge:
    """Charge the decoder's parts (patched on their classes/modules: this process only)."""
    from tandem.services.language.model import decoder as dec
    from tandem.services.language.model import linear as lin

    ch = _Charge()
    lin.DenseLinear.forward = ch.wrap("linears", lin.DenseLinear.forward)
    dec.RowParallel.forward = ch.wrap("linears", dec.RowParallel.forward)
    dec.paged_attention = ch.wrap("attention", dec.paged_attention)
    dec.RMSNorm.forward = ch.wrap("norms", dec.RMSNorm.forward)
    dec.apply_rotary = ch.wrap("rope", dec.apply_rotary)
    dec.F.silu = ch.wrap("activation", dec.F.silu)
    m = runner.model
    m.rope.cos_sin = ch.wrap("rope", m.rope.cos_sin)
    m.logits = ch.wrap("logits", m.logits)
    m.embed_tokens.forward = ch.wrap("runner prep", m.embed_tokens.forward)
    runner._metadata = ch.wrap("runner prep", runner._metadata)
    runner._embed = ch.wrap("runner prep", runner._embed)
    for mod in m.modules():  # the kernels' fused calls (float32 on the CPU)
        k = getattr(mod, "kernels", None)
        if k is not None and not isinstance(k, _KernelsProxy):
            mod.kernels = _KernelsProxy(k, ch)
    return ch


class _KernelsProxy:
    """The CPU kernels' module with rms_norm / rope_qk / silu_mul charged to their part."""

    PART = {"rms_norm": "norms", "rope_qk": "rope", "silu_mul": "activation"}

    def __init__(self, mod, ch: _Charge) -> None:
        self._mod, self._ch = mod, ch

    def __getattr__(self, name):
        fn = getattr(self._mod, name)
        return self._ch.wrap(self.PART[name], fn) if name in self.PART else fn


def _sampler_ms(vocab: int, bs: int, sampled: bool, steps: int, kernels) -> float:
    """CPU ms of one `sample()` over [bs, vocab] logits (greedy, or temperature 0.8 +
    top-p 0.95), the engine's sampler as a step calls it (with the runner's
    `sampler_kernels`)."""
    from tandem.sampling import SamplingParams
    from tandem.services.language.engine.request import Request, RequestSpec
    from tandem.services.language.engine.sampler import sample
    from tandem.transfer.payload import PromptPayload

    sp = (SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=1) if sampled
          else SamplingParams(max_tokens=8))
    pay = PromptPayload(torch.zeros(1, 8), torch.zeros(1, dtype=torch.int32),
                        torch.zeros(3, 1, dtype=torch.int32), 0)
    reqs = [Request(RequestSpec(i + 1, sp, pay)) for i in range(bs)]
    logits = torch.randn(bs, vocab, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        sample(logits, reqs, kernels=kernels)
    times = []
    for _ in range(steps):
        t = time.thread_time()
        sample(logits, reqs, kernels=kernels)
        times.append(time.thread_time() - t)
    return statistics.median(times) * 1e3


def profile(runner, pool, args, vocab_sizes: list[int]) -> None:
    """The per-step table: decode at each batch size, one prefill chunk of `context`
    tokens; median CPU ms per component over `steps` steps (one torch thread)."""
    ch = _instrument(runner)
    g = torch.Generator().manual_seed(0)
    per_seq = ceil_div(args.context + 8, args.page_size)
    rows = []
    for bs in args.batch_sizes:
        chunks = []
        for i in range(bs):
            ids = torch.randint(0, runner.vocab_size, (args.context,), generator=g)
            pages = pool.alloc(per_seq)
            pos = torch.arange(args.context).expand(3, args.context)
            emb = runner.model.embed_tokens.weight[ids].clone()
            chunks.append(SeqChunk(i, 0, pos, pages, input_embeds=emb))
        prefill = ForwardBatch([chunks[0]])
        runner.forward_eager(prefill)
        for c in chunks[1:]:
            runner.forward_eager(ForwardBatch([c]))
        decode = ForwardBatch([SeqChunk(c.seq_id, args.context, decode_positions(args.context, 0),
                                        c.block_table, token_ids=torch.tensor([1]))
                               for c in chunks])
        kinds = [(f"decode bs={bs}", decode)] + ([("prefill 1x" + str(args.context), prefill)]
                                                 if bs == args.batch_sizes[0] else [])
        for name, batch in kinds:
            samples: list[dict[str, float]] = []
            for s in range(args.steps + 2):
                ch.reset()
                t = time.thread_time()
                runner.forward_eager(batch)
                total = time.thread_time() - t
                ch._flush()
                if s >= 2:
                    samples.append(dict(ch.acc, total=total))
            med = {k: statistics.median(x.get(k, 0.0) for x in samples) * 1e3
                   for k in (*COMPONENTS, "total")}
            rows.append((name, med))
        for c in batch.chunks:
            pool.free(c.block_table)
    head = " | ".join(f"{c:>10}" for c in (*COMPONENTS, "total"))
    print(f"\nCPU ms per step by component (1 thread; median of {args.steps}):")
    print(f"{'step':>16} | {head}")
    for name, med in rows:
        print(f"{name:>16} | " + " | ".join(f"{med[c]:>10.2f}" for c in (*COMPONENTS, "total")))
    print("\nsampler CPU ms per step (engine's sample(), float32 logits):")
    k = runner.sampler_kernels
    for v in vocab_sizes:
        for bs in args.batch_sizes:
            gr, sa = (_sampler_ms(v, bs, False, args.steps, k),
                      _sampler_ms(v, bs, True, args.steps, k))
            print(f"  vocab {v:>6} bs {bs:>3}: greedy {gr:8.2f} | temperature 0.8 + top-p 0.95 {sa:8.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
