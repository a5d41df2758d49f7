"""Encoder throughput and cache benchmark (prints markdown tables).

    .venv/bin/python bench/encoder.py [--arch qwen2_5_vl] [--size small] [--runs 3]
        [--device auto|cpu|cuda[:N]] [--dtype auto|float32|bfloat16|float16] [--model DIR]

1. Images per second, each request one image of mixed sizes, for 1, 8 and 32 concurrent
   requests through `EncodePipeline.encode` (preprocess + batched ViT + merge; cache off),
   against transformers' `get_image_features` called one image at a time (with the same
   image preprocessing) in the same run, on the same device and dtype (`--device auto`: the
   GPU where there is one; `--dtype auto`: bfloat16 there, float32 on the CPU). Median of
   `--runs` rounds.
2. Encode latency of a repeated image (cache hit) against its first sight (miss).

With `--vit MODE` (CPU), the vision tower alone (`VisionRunner.run`), one image of each
of VIT_SIZES (or --vit-sizes) at a time, CPU time of the one thread:

    profile    where the time goes: linears, attention, rotary, norms, MLP pointwise, ...
    attention  long segments on torch's SDPA (as served) against all on our kernel
    compare    eager against the tower's blocks compiled by inductor (`_CompiledTower`, an
               experiment, not a serving path), alternating; the compile's time and breaks
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import statistics
import sys
import time
import types
from pathlib import Path

# The encoder process's own setting (services/encoder/main.py), before torch loads MKL: this
# benchmark runs the pipeline in its own process.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from latency import checkpoint  # noqa: E402  (bench/, the script's own folder)

from tandem.chat import ImageInput, Message  # noqa: E402
from tandem.devices import DTYPES, resolve_device, resolve_dtype  # noqa: E402
from tandem.services.encoder.chat import EncodeJob  # noqa: E402
from tandem.services.encoder.config import EncoderConfig  # noqa: E402
from tandem.services.encoder.pipeline import EncodePipeline  # noqa: E402

SIZES = [(224, 224), (448, 336), (640, 480), (320, 320), (512, 256), (160, 400), (384, 384)]


def make_png(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def request(data: bytes) -> list[Message]:
    return [Message("user", ("Describe this image.", ImageInput(data=data)))]


class Baseline:
    """transformers, one image at a time: image processor + get_image_features, its
    features copied to the host as the encoder's are (so a GPU's work is inside the time)."""

    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        import tandem  # noqa: F401

        self.device, self.dtype = device, dtype
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device)
        self.model.eval()
        self.proc = AutoProcessor.from_pretrained(path)

    @torch.inference_mode()
    def one(self, data: bytes) -> None:
        pil = Image.open(io.BytesIO(data)).convert("RGB")
        x = self.proc.image_processor(images=[pil], return_tensors="pt")
        pixels = x["pixel_values"].to(self.device, self.dtype)
        out = self.model.model.get_image_features(pixels, x["image_grid_thw"].to(self.device),
                                                  return_dict=True)
        torch.cat(out.pooler_output).cpu()

    def images_per_s(self, images: list[bytes]) -> float:
        t0 = time.perf_counter()
        for data in images:
            self.one(data)
        return len(images) / (time.perf_counter() - t0)


async def ours(pipe: EncodePipeline, images: list[bytes], concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(data):
        async with sem:
            await pipe.encode(EncodeJob(request(data)))

    t0 = time.perf_counter()
    await asyncio.gather(*[one(d) for d in images])
    return len(images) / (time.perf_counter() - t0)


async def hit_vs_miss(pipe: EncodePipeline, runs: int) -> tuple[float, float]:
    miss, hit = [], []
    for k in range(runs):
        data = make_png(448, 336, 10_000 + k)
        t0 = time.perf_counter()
        await pipe.encode(EncodeJob(request(data)))
        miss.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        r = await pipe.encode(EncodeJob(request(data)))
        hit.append(time.perf_counter() - t0)
        assert r.cached_image_tokens > 0
    return statistics.median(miss), statistics.median(hit)


# -- the vision tower alone (`--vit profile|attention|compare`) -----------------------------
# A small, a middle and a large image of the `small` checkpoints' range (at most 1024
# merged tokens), before smart_resize.
VIT_SIZES = [(224, 224), (448, 336), (896, 672)]


class _Charges:
    """CPU time of this thread charged to parts, exclusive of nested charged calls (a
    module's linears go to `linears`, not to the module): a stack of open charges."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.stack: list[list] = []  # [part, start, nested time]

    def open(self, part: str) -> None:
        self.stack.append([part, time.thread_time(), 0.0])

    def close(self) -> None:
        part, t0, nested = self.stack.pop()
        spent = time.thread_time() - t0
        self.total[part] = self.total.get(part, 0.0) + spent - nested
        if self.stack:
            self.stack[-1][2] += spent

    def wrap(self, part: str, fn):
        def charged(*a, **kw):
            self.open(part)
            try:
                return fn(*a, **kw)
            finally:
                self.close()
        return charged


class _TimedKernels:
    """The kernels' module with its calls charged (`_Charges`)."""

    PARTS = {"packed_linear": "linears", "rope_qk": "rotary", "segment_attention": "attention",
             "rms_norm": "norms", "silu_mul": "mlp pointwise"}

    def __init__(self, mod, charges: _Charges) -> None:
        self._mod = mod
        for name, part in self.PARTS.items():
            setattr(self, name, charges.wrap(part, getattr(mod, name)))

    def __getattr__(self, name):
        return getattr(self._mod, name)


def _charge_modules(visual, charges: _Charges) -> None:
    """Charge the tower's torch modules by class (what the kernels do not run)."""
    from tandem.cpu_kernels import PackedLinear

    def part(m) -> str | None:
        name = type(m).__name__
        if isinstance(m, torch.nn.Linear):
            return "linears"
        if isinstance(m, PackedLinear):
            return None  # its kernel call is charged
        if isinstance(m, torch.nn.LayerNorm) or name.endswith("RMSNorm"):
            return "norms"
        if "Attention" in name:
            return "attention"  # its glue (and on torch's path SDPA per segment)
        if "MLP" in name or name in ("GELUTanh", "SiLUActivation", "GELUActivation",
                                      "PytorchGELUTanh", "SiLU", "GELU"):
            return "mlp pointwise"
        if "Merger" in name:
            return "merger glue"
        if "Block" in name:
            return "block glue (residual adds)"
        return None

    for m in visual.modules():
        p = part(m)
        if p is None:
            continue
        m.register_forward_pre_hook(lambda mod, args, p=p: charges.open(p))
        m.register_forward_hook(lambda mod, args, out: charges.close())


def _sizes(args) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in s.split("x")) for s in args.vit_sizes] or VIT_SIZES


def _vit_inputs(path: Path, sizes) -> list[tuple[torch.Tensor, list[tuple[int, int, int]], str]]:
    from transformers import AutoProcessor

    import tandem  # noqa: F401  (registers the image-only processors)

    proc = AutoProcessor.from_pretrained(path).image_processor
    out = []
    for i, (w, h) in enumerate(sizes):
        pil = Image.open(io.BytesIO(make_png(w, h, seed=i))).convert("RGB")
        x = proc(images=[pil], return_tensors="pt")
        grids = [tuple(int(v) for v in g) for g in x["image_grid_thw"]]
        out.append((x["pixel_values"], grids, f"{w}x{h}"))
    return out


def _vit_runner(path: Path, dtype: torch.dtype, compute: str, charges: _Charges | None):
    """A CPU VisionRunner as the encoder builds it (EncodePipeline.from_config)."""
    from tandem.cpu_kernels import linear_compute_dtype, linear_kernels
    from tandem.models.split import load_vision_part
    from tandem.services.encoder.vit.kernels import pack_vision_tower
    from tandem.services.encoder.vit.runner import VisionRunner

    dev = torch.device("cpu")
    c = linear_compute_dtype(compute, dev, dtype)
    part = load_vision_part(path, c, dev)
    kernels = linear_kernels("auto", dev, c)
    if kernels is not None:
        pack_vision_tower(part.visual, kernels if charges is None else
                          _TimedKernels(kernels, charges))
    if charges is not None:
        _charge_modules(part.visual, charges)
    return VisionRunner(part.visual, out_dtype=dtype), c


def vit_profile(args, path: Path, dtype: torch.dtype) -> None:
    """Where one image's tower time goes (CPU time of the one thread), median of --runs."""
    charges = _Charges()
    runner, compute = _vit_runner(path, dtype, args.cpu_bf16_compute, charges)
    inputs = _vit_inputs(path, _sizes(args))
    parts = ["linears", "attention", "rotary", "norms", "mlp pointwise",
             "block glue (residual adds)",
             "merger glue", "prepare"]
    prep = runner._prepare
    runner._prepare = charges.wrap("prepare", prep)  # patch embed's linear: `linears`
    print(f"\n### ViT profile ({args.arch} {args.size}, {dtype_name(dtype)} model, compute "
          f"{dtype_name(compute)}, {args.threads} thread, CPU ms, median of {args.runs})\n")
    print("| image (patches) | " + " | ".join(parts) + " | other | total |")
    print("|---|" + "---:|" * (len(parts) + 2))
    for pixels, grids, name in inputs:
        runner.run(pixels, grids)  # warm-up
        rows = []
        for _ in range(args.runs):
            charges.total.clear()
            t0 = time.thread_time()
            runner.run(pixels, grids)
            total = time.thread_time() - t0
            row = [charges.total.get(p, 0.0) for p in parts]
            rows.append(row + [total - sum(row), total])
        med = [statistics.median(r[i] for r in rows) * 1e3 for i in range(len(parts) + 2)]
        n = sum(t * h * w for t, h, w in grids)
        print(f"| {name} ({n}) | " + " | ".join(f"{v:.1f}" for v in med[:-1])
              + f" | **{med[-1]:.1f}** |")


# The compiled tower `--vit compare` measures (issue 45: "the ViT compiled where it pays"):
# an experiment, not a serving path: measured within the noise of eager on the AVX2 EPYC
# (0.91-1.09x, docs/benchmarks.md "Compiling the vision tower"), so not built.
# The blocks and mergers of runner._blocks_eager under torch.compile (inductor, fullgraph,
# the patch and segment counts dynamic), our kernels opaque: the tandem::* ops of
# tandem/cpu_kernels.py (traced_ops) and segment_attention, which that file does not
# register, as tandem_vit_bench::segment_attention here. The eager tower is the same
# modules: in both arms the attention and the RMSNorm run the forwards below (their own
# call the kernels' module directly, a graph break each; and the attention's choice of
# SDPA for long segments reads the lengths on the host), which call the ops while dynamo
# traces and the kernels otherwise: both arms attend every segment with our kernel.
_SEGMENT_LIB = None


def _register_segment_attention(mod) -> None:
    global _SEGMENT_LIB
    if _SEGMENT_LIB is not None:
        return
    lib = torch.library.Library("tandem_vit_bench", "DEF")
    lib.define("segment_attention(Tensor q, Tensor k, Tensor v, Tensor cu, bool causal, "
               "float scale) -> Tensor")
    lib.impl("segment_attention", mod.segment_attention, "CPU")
    torch.library.register_fake("tandem_vit_bench::segment_attention",
                                lambda q, k, v, cu, causal, scale: q.new_empty(q.shape), lib=lib)
    _SEGMENT_LIB = lib


def _traceable_attention(self, hidden_states, cu_seqlens, position_embeddings, max_seqlen=None,
                         **kwargs):
    """KernelVisionAttention.forward with its two kernel calls as torch ops while traced."""
    from tandem.cpu_kernels import for_trace

    n, h, d = hidden_states.shape[0], self.num_heads, self.head_dim
    qkv = self.qkv(hidden_states)
    cos, sin = position_embeddings
    q, k = for_trace(self.kernels).rope_qk(qkv, cos.float().contiguous(),
                                           sin.float().contiguous(), h, h)
    v = qkv[:, 2 * h * d :].view(n, h, d)
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64)
    attend = (torch.ops.tandem_vit_bench.segment_attention.default
              if torch.compiler.is_compiling() else self.kernels.segment_attention)
    out = attend(q, k, v, cu, False, self.scaling)
    return self.proj(out.view(n, h * d))


def _traceable_rms_norm(self, x):
    """KernelRMSNorm.forward with its kernel call a torch op while traced."""
    from tandem.cpu_kernels import for_trace

    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return for_trace(self.kernels).rms_norm(rows, self.weight, self.eps).view(x.shape)


def _tower(visual, h, cos, sin, cu, cu_window, full: tuple[int, ...], deep_at: tuple[int, ...]):
    """runner._blocks_eager's loop without its progress calls (a graph cannot make them)."""
    deep = []
    for i, blk in enumerate(visual.blocks):
        seg = cu if cu_window is None or i in full else cu_window
        h = blk(h, cu_seqlens=seg, position_embeddings=(cos, sin))
        if i in deep_at:
            deep.append(visual.deepstack_merger_list[deep_at.index(i)](h))
    return visual.merger(h), deep


class _CompiledTower:
    """Swaps a VisionRunner's `_blocks_eager` for `_tower` compiled (see above)."""

    def __init__(self, runner, fullgraph: bool) -> None:
        # fullgraph: our kernels' tower, one graph with the patch and segment counts dynamic.
        # Otherwise (torch's modules: transformers' attention reads the segment lengths on
        # the host, a break per layer, and specialises the shapes) static shapes: a compile
        # per image size, enough to measure what it would buy, not a serving path.
        self.dynamic = fullgraph
        from tandem.cpu_kernels import kernels, traced_ops
        from tandem.services.encoder.vit.kernels import KernelRMSNorm, KernelVisionAttention

        self.runner = runner
        self.eager = runner._blocks_eager
        if traced_ops() is not None:
            _register_segment_attention(kernels())
        for m in runner.visual.modules():
            if isinstance(m, KernelVisionAttention):
                m.forward = types.MethodType(_traceable_attention, m)
            elif isinstance(m, KernelRMSNorm):
                m.forward = types.MethodType(_traceable_rms_norm, m)
        self.full = tuple(sorted(runner.full_layers))
        self.deep_at = tuple(runner.deepstack_layers)
        self.fn = torch.compile(_tower, fullgraph=fullgraph, dynamic=False)

    def args(self, prep):
        cu = prep.cu.to(torch.int64)
        cw = prep.cu_window.to(torch.int64) if prep.cu_window is not None else None
        for t in (prep.hidden, prep.cos, prep.sin, cu) + ((cw,) if cw is not None else ()):
            if self.dynamic:
                torch._dynamo.mark_dynamic(t, 0)
        return (self.runner.visual, prep.hidden, prep.cos, prep.sin, cu, cw, self.full,
                self.deep_at)

    def blocks(self, prep):
        return self.fn(*self.args(prep))

    def explain(self, prep):
        return torch._dynamo.explain(_tower)(*self.args(prep))

    def use(self, compiled: bool) -> None:
        self.runner._blocks_eager = self.blocks if compiled else self.eager


def vit_compare(args, path: Path, dtype: torch.dtype) -> None:
    """Eager against the compiled tower (`_CompiledTower`) on the same modules, images of
    VIT_SIZES, alternating (eager first in even rounds, compiled first in odd ones); CPU ms
    of the one thread, median of --runs; the compile's time, its graphs and breaks, and how
    far the compiled rows are from the eager ones."""
    if args.compile_cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(args.compile_cache_dir)
    runner, compute = _vit_runner(path, dtype, args.cpu_bf16_compute, None)
    packed = compute == torch.float32  # our kernels (linear_backend auto) vs torch's modules
    inputs = _vit_inputs(path, _sizes(args))
    tower = _CompiledTower(runner, fullgraph=packed)
    with torch.inference_mode():
        ex = tower.explain(runner._prepare(*inputs[0][:2]))
    print(f"dynamo: {ex.graph_count} graph(s), {ex.graph_break_count} break(s)"
          + "".join(f"\n  break: {b.reason}" for b in ex.break_reasons[:8]))
    torch._dynamo.reset()  # explain's graphs are not the measured ones
    tower.use(True)
    firsts = []
    for i, (pixels, grids, _) in enumerate(inputs):
        # dynamic: the first size compiles, the others must not (the stance raises)
        stance = "fail_on_recompile" if tower.dynamic and i else "default"
        with torch.compiler.set_stance(stance):
            t0 = time.perf_counter()
            runner.run(pixels, grids)
            firsts.append(time.perf_counter() - t0)
    print(f"first compiled calls ({', '.join(n for _, _, n in inputs)}): "
          f"{', '.join(f'{s:.2f}' for s in firsts)} s wall ("
          + ("dynamic: one compile, at the first" if tower.dynamic else "a compile each")
          + f"); inductor cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'default')}")
    times = {(name, c): [] for _, _, name in inputs for c in (False, True)}
    diffs = {}
    with torch.compiler.set_stance("fail_on_recompile" if tower.dynamic else "default"):
        for r in range(args.runs):
            for pixels, grids, name in inputs:
                for c in ((False, True) if r % 2 == 0 else (True, False)):
                    tower.use(c)
                    t0 = time.thread_time()
                    out = runner.run(pixels, grids)
                    times[(name, c)].append(time.thread_time() - t0)
                    if r == 0:
                        diffs.setdefault(name, []).append(out.embeds.float())
    print(f"\n### ViT eager vs compiled ({args.arch} {args.size}, {dtype_name(dtype)} model, "
          f"compute {dtype_name(compute)}, {args.threads} thread, CPU ms, alternating, median of "
          f"{args.runs})\n")
    print("| image (patches) | eager ms (runs) | compiled ms (runs) | eager / compiled | "
          "median of the runs' ratios | max abs diff of rows |")
    print("|---|---|---|---:|---:|---:|")
    for _, grids, name in inputs:
        e, c = times[(name, False)], times[(name, True)]
        a, b = diffs[name]
        n = sum(t * h * w for t, h, w in grids)
        print(f"| {name} ({n}) | {', '.join(f'{x * 1e3:.1f}' for x in e)} | "
              f"{', '.join(f'{x * 1e3:.1f}' for x in c)} | "
              f"**{statistics.median(e) / statistics.median(c):.3f}x** | "
              f"{statistics.median(x / y for x, y in zip(e, c, strict=True)):.3f}x | "
              f"{(a - b).abs().max().item():.2e} |")


def vit_attention(args, path: Path, dtype: torch.dtype) -> None:
    """The packed tower with long segments on torch's SDPA (SDPA_MIN_ROWS, as served)
    against every segment on `segment_attention` (the threshold past any segment), on the
    same modules, alternating; CPU ms of the one thread, median of --runs."""
    from tandem.services.encoder.vit import kernels as vit_kernels

    runner, compute = _vit_runner(path, dtype, args.cpu_bf16_compute, None)
    if compute != torch.float32:
        raise SystemExit("--vit attention: the packed tower (float32 compute) only")
    inputs = _vit_inputs(path, _sizes(args))
    served = vit_kernels.SDPA_MIN_ROWS
    times: dict[tuple[str, bool], list[float]] = {}
    rows: dict[tuple[str, bool], torch.Tensor] = {}
    for r in range(args.runs):
        for pixels, grids, name in inputs:
            for sdpa in ((True, False) if r % 2 == 0 else (False, True)):
                vit_kernels.SDPA_MIN_ROWS = served if sdpa else 1 << 62
                t0 = time.thread_time()
                out = runner.run(pixels, grids)
                times.setdefault((name, sdpa), []).append(time.thread_time() - t0)
                rows[(name, sdpa)] = out.embeds
    vit_kernels.SDPA_MIN_ROWS = served
    print(f"\n### ViT attention: long segments on SDPA vs all on segment_attention ({args.arch} "
          f"small, float32, {args.threads} thread, CPU ms, alternating, median of {args.runs})\n")
    print("| image (patches) | kernel only ms (runs) | SDPA >= "
          f"{served} rows ms (runs) | kernel only / SDPA | max abs diff of rows |")
    print("|---|---|---|---:|---:|")
    for _, grids, name in inputs:
        k, q = times[(name, False)], times[(name, True)]
        n = sum(t * h * w for t, h, w in grids)
        diff = (rows[(name, False)] - rows[(name, True)]).abs().max().item()
        print(f"| {name} ({n}) | {', '.join(f'{x * 1e3:.1f}' for x in k)} | "
              f"{', '.join(f'{x * 1e3:.1f}' for x in q)} | "
              f"**{statistics.median(k) / statistics.median(q):.2f}x** | {diff:.2e} |")

def dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
    ap.add_argument("--size", default="small")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--images", type=int, default=32, help="images per round")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda[:N]")
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                    help="auto: bfloat16 on CUDA, float32 on the CPU (both sides)")
    ap.add_argument("--model", help="checkpoint directory (default: a tiny-model --size one)")
    ap.add_argument("--vit", choices=["profile", "compare", "attention"],
                    help="the vision tower alone on the CPU, images of VIT_SIZES: 'profile' "
                    "charges its CPU time to parts; 'compare' times eager against the "
                    "compiled tower (an experiment: _CompiledTower), 'attention' long "
                    "segments on SDPA against all on our kernel, alternating")
    ap.add_argument("--cpu-bf16-compute", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="--vit with --dtype bfloat16: the encoder's cpu_bf16_compute")
    ap.add_argument("--vit-sizes", nargs="*", default=[],
                    help="--vit: image sizes WxH (default: 224x224 448x336 896x672)")
    ap.add_argument("--compile-cache-dir", default="",
                    help="--vit compare: inductor's cache (TORCHINDUCTOR_CACHE_DIR); a fresh "
                    "folder measures a cold compile, a second run in it a warm one")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device here")
    dtype = resolve_dtype(args.dtype, device)
    path = Path(args.model) if args.model else checkpoint(args.arch, args.size)
    if args.vit:
        if device.type != "cpu":
            ap.error("--vit runs on the CPU")
        modes = {"profile": vit_profile, "compare": vit_compare, "attention": vit_attention}
        return modes[args.vit](args, path, dtype)
    images = [make_png(*SIZES[i % len(SIZES)], seed=i) for i in range(args.images)]

    base_model = Baseline(path, device, dtype)
    base_model.one(images[0])  # warm-up
    cfg = EncoderConfig(
        model=str(path),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        cache_bytes=0,
        cpu_threads=args.threads,
        preprocess_workers=2,
    )
    pipe = EncodePipeline.from_config(cfg)
    base: list[float] = []
    ours_by_c: dict[int, list[float]] = {1: [], 8: [], 32: []}

    async def run_all():
        pipe.start()
        try:
            await pipe.encode(EncodeJob(request(images[0])))  # warm-up
            for _ in range(args.runs):  # NOTE: interleaved, so load drift hits both sides
                base.append(base_model.images_per_s(images))
                for c, out in ours_by_c.items():
                    out.append(await ours(pipe, images, c))
            cached = EncodePipeline.from_config(cfg.model_copy(update={"cache_bytes": 1 << 28}))
            cached.start()
            try:
                return await hit_vs_miss(cached, max(3, args.runs))
            finally:
                await cached.stop()
        finally:
            await pipe.stop()

    miss, hit = asyncio.run(run_all())
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    what = args.model or f"{args.arch}, {args.size}"
    print(
        f"\n### Encoder throughput ({what}, {dev}, {str(dtype).removeprefix('torch.')}, "
        f"{args.threads} torch threads, {args.images} images of {len(SIZES)} sizes, "
        f"median of {args.runs})\n"
    )
    print("| concurrent requests | images/s | vs transformers one-at-a-time |")
    print("|---:|---:|---:|")
    b = statistics.median(base)
    print(f"| baseline (get_image_features, 1 by 1) | {b:.2f} | 1.00x |")
    for c, runs in ours_by_c.items():
        ips = statistics.median(runs)
        print(f"| {c} | {ips:.2f} | {ips / b:.2f}x |")
    print("\n### Cache hit vs first sight (one 448x336 image, whole encode)\n")
    print("| | latency ms | ratio |")
    print("|---|---:|---:|")
    print(f"| first sight (miss) | {miss * 1e3:.1f} | 1.00 |")
    print(f"| repeat (hit) | {hit * 1e3:.1f} | {hit / miss:.3f} |")


if __name__ == "__main__":
    main()
