"""Kernels of our own for the CPU, compiled once per machine with torch's extension builder.

    paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale) -> out
        decode attention that reads KV pages in place (csrc/paged_decode.cpp), instead of
        gathering every row's pages into a workspace in every layer of every step. A
        bfloat16 cache (q bfloat16 or float32) runs on the float32 fast path, its pages
        widened in registers: the float32 kernel's bits on the widened tensors, at its speed.
    pack_linear / pack_bias / packed_linear
        float32 linear layers over weights packed in column strips (csrc/linear.cpp):
        2-6x MKL's sgemm for 1-64 rows on an AVX-512 Zen 5, 1.5-2.5x for 4-8 rows and about
        1.0-1.4x for 16-64 on an AVX2 EPYC (docs/benchmarks.md, bench/kernels.py); each
        output within its summation's forward-error bound (tests/test_cpu_kernels.py).
    rms_norm / silu_mul / rope_qk
        the decoder's pointwise steps around the linears, one call each instead of ~30
        small torch ops per layer (csrc/pointwise.cpp).
    segment_attention(q, k, v, cu, causal, scale) -> out
        attention within packed segments of rows, each attending to its own (a prefill
        chunk, causal; the ViT's frames and windows) (csrc/segment_attention.cpp).
    nucleus_draw(x, temperature, top_k, top_p, min_p, u, buckets, span, spread, kept)
        the CPU sampler's cut and draw for a step's sampled rows in one call: the passes of
        services/language/engine/nucleus.py, whose `draw_rows` calls it (csrc/nucleus.cpp).

Every kernel is written once over the 16-lane vector of csrc/vec16.h, which has an AVX-512,
an AVX2+FMA, a NEON (aarch64) and a generic C++ path, chosen by the compiler's target. All
paths run the same operations in the same order, so a kernel's result is the same bits on
every CPU (tests/test_cpu_kernels.py checks it against forced builds); `isa()` says which
path a build runs. TANDEM_KERNEL_ISA forces one: `native` (default: what -march=native
gives), `avx2` (AVX-512 disabled: an AVX-512 host proves the AVX2 path) or `generic`.

The build is keyed by the sources, the compiler flags, the torch version, this CPU's flags
(it is compiled with -march=native), the forced path and the Python environment (not by
this file: editing a log line rebuilds nothing), and cached in
$TANDEM_KERNEL_DIR (default ~/.cache/tandem/kernels): `make setup` builds it ahead
(`python -m tandem.cpu_kernels`, 1-8 minutes on two cores: a line at least every 10 s
says how far it got), so no request ever waits for the compiler. Where it cannot be built (no compiler, no ninja), `kernels()` returns None once
with a warning and the runner keeps torch's ops (gather + SDPA, F.linear): slower, same
results within float32 rounding.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import sys
import sysconfig
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("tandem.language.kernels")

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    CSRC / f
    for f in ("bindings.cpp", "paged_decode.cpp", "linear.cpp", "pointwise.cpp", "strip_pool.cpp",
              "segment_attention.cpp", "nucleus.cpp")
)
HEADERS = (CSRC / "vec16.h",)

# TANDEM_KERNEL_ISA: the vector path to build (csrc/vec16.h), and the compiler flags for it.
ISA_ENV = "TANDEM_KERNEL_ISA"
ISA_FLAGS = {
    "native": [],  # whatever -march=native enables: avx512, avx2, neon or generic
    "avx2": ["-mno-avx512f"],  # x86-64 with AVX2+FMA: AVX-512 (and its subsets) off
    "generic": ["-DTANDEM_FORCE_GENERIC"],  # the plain C++ path
}
# NOTE: no contraction of a * b + c into one FMA where the source does not ask for it (the
# pointwise steps round as torch does); intrinsics still FMA.
# Tuples: torch's builder appends to the lists it is given, and a flag appended here would
# change the next key computed in this process (another build directory, a second compile).
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)
PROGRESS_S = 10.0  # a compile says how far it got at least this often


def requested_isa() -> str:
    """The path asked for by TANDEM_KERNEL_ISA (default native); refused if unknown or
    impossible on this CPU (never silently another one)."""
    isa = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV} must be one of {sorted(ISA_FLAGS)}, got {isa!r}")
    if isa == "avx2":
        if not {"avx2", "fma"} <= cpu_flags():
            raise ValueError(f"{ISA_ENV}=avx2: this CPU has no AVX2+FMA ({os.uname().machine})")
    return isa


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo: `flags` on x86, `Features` on aarch64);
    empty where they cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    """The CPU's model name (for logs and reports), or the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def build_dir() -> Path:
    """Where compiled sources live, one keyed folder each (also tandem/host_syncs.py's)."""
    root = os.environ.get("TANDEM_KERNEL_DIR") or Path.home() / ".cache" / "tandem" / "kernels"
    return Path(root)


def ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the venv's own (the `ninja` package) is not
    on PATH when the interpreter is called by its full path."""
    scripts = sysconfig.get_path("scripts")
    if scripts and scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def kernels():
    """The compiled module (its functions are listed above), or None where it cannot build."""
    ninja_on_path()
    path = requested_isa()  # a bad request is an error, not a fallback
    try:  # no source (an install without it), no compiler, no ninja: keep torch's ops
        key = hashlib.sha256(
            b"".join(p.read_bytes() for p in SOURCES + HEADERS)
            + " ".join((*CFLAGS, *ISA_FLAGS[path], *LDFLAGS)).encode()
            + torch.__version__.encode() + os.uname().machine.encode()
            + " ".join(sorted(cpu_flags())).encode() + path.encode()
            # NOTE: and the environment: the build embeds its torch/Python include paths, so
            # two venvs sharing one directory would rebuild it for each other in turn.
            + sys.prefix.encode()
        ).hexdigest()[:16]
        name = f"tandem_cpu_kernels_{key}"
        build = build_dir() / name
        (build / "src").mkdir(parents=True, exist_ok=True)
        # NOTE: one process builds or loads a key at a time, under an flock that the kernel
        # drops when its holder dies. torch's own `lock` file is not dropped: a process
        # killed mid-build (Ctrl-C in `make setup`, a test timeout) left it, and every later
        # start of a tier waited on it forever. Under the flock, a `lock` left is stale.
        with open(build / "build.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            if (build / "lock").exists():
                log.warning("CPU kernels: removing a stale build lock in %s (a build was "
                            "killed)", build)
                (build / "lock").unlink(missing_ok=True)
            # NOTE: compiled from copies inside the keyed directory, so every checkout with the
            # same sources (another clone, a snapshot) reuses the build instead of recompiling
            # because ninja saw other source paths.
            sources = []
            for p in SOURCES + HEADERS:
                copy = build / "src" / p.name
                if not copy.exists() or copy.read_bytes() != p.read_bytes():
                    copy.write_bytes(p.read_bytes())
                if p in SOURCES:
                    sources.append(str(copy))
            from torch.utils.cpp_extension import load

            with _progress(build, name, [Path(s).stem for s in sources], path):
                mod = load(name=name, sources=sources, build_directory=str(build),
                           extra_cflags=[*CFLAGS, *ISA_FLAGS[path]], extra_ldflags=[*LDFLAGS],
                           verbose=False)
    except Exception as e:
        log.warning("CPU kernels unavailable (%s); using torch's ops (gather + SDPA, F.linear)", e)
        return None
    if mod.isa() == "generic" and path == "native":
        log.warning("CPU kernels: no vector path for this CPU (%s: neither AVX-512, AVX2+FMA "
                    "nor NEON): backend 'auto' keeps torch's ops; 'packed_cpu'/'paged_cpu' "
                    "run the generic C++ path (slower)", os.uname().machine)
    return mod


class _progress:
    """While a build compiles (its module not built yet in `build`), a line at least every
    PROGRESS_S seconds: each source once it compiled, with the time it took, else how long
    the build has run. Nothing when the build is already there (a load)."""

    def __init__(self, build: Path, name: str, stems: list[str], path: str) -> None:
        self.build, self.stems, self.path = build, stems, path
        self.active = not (build / f"{name}.so").exists()
        self.done = threading.Event()

    def __enter__(self):
        if self.active:
            self.t0 = time.monotonic()
            log.info("CPU kernels: compiling %d sources for the %s path (once per machine "
                     "and environment; minutes on a few cores)", len(self.stems), self.path)
            threading.Thread(target=self._report, name="kernel-build", daemon=True).start()
        return self

    def _report(self) -> None:
        seen: set[str] = set()
        last = 0.0  # seconds into the build of the last line
        while not self.done.wait(1.0):
            now = time.monotonic() - self.t0
            fresh = [s for s in self.stems if s not in seen and (self.build / f"{s}.o").exists()]
            for s in fresh:
                seen.add(s)
                log.info("CPU kernels: %s compiled (%.0f s, %d of %d)", s, now, len(seen),
                         len(self.stems))
            if fresh:
                last = now
            elif now - last >= PROGRESS_S:
                last = now
                log.info("CPU kernels: still compiling (%.0f s, %d of %d sources done)",
                         now, len(seen), len(self.stems))

    def __exit__(self, *exc) -> None:
        self.done.set()
        if self.active and exc[0] is None:
            log.info("CPU kernels: built in %.0f s", time.monotonic() - self.t0)


def _auto_uses(mod) -> bool:
    """Whether backend 'auto' runs our kernels: only on a vector path. The generic C++ path
    is there to prove the others and for explicit requests; it runs 0.2-0.5x torch's ops
    (bench/kernels.py, docs/benchmarks.md)."""
    return mod is not None and mod.isa() != "generic"


def isa() -> str | None:
    """The vector path the kernels run (avx512, avx2, neon, generic), None where unbuilt."""
    mod = kernels()
    return None if mod is None else mod.isa()


def paged_decode_op():
    """The compiled `paged_decode_attention`, or None where the kernels cannot be built."""
    mod = kernels()
    return None if mod is None else mod.paged_decode_attention


BACKENDS = ("auto", "gather", "paged_cpu")


def decode_attention_op(backend: str, device: torch.device):
    """The decode attention the runner uses (`AttentionMetadata.decode_op`), by config:

    auto       the in-place kernel on CPU where it builds on a vector path; gather + SDPA
               otherwise
    gather     gather + SDPA everywhere (None)
    paged_cpu  the in-place kernel; refused on CUDA or where it cannot be built
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "gather" or (backend == "auto" and device.type != "cpu"):
        return None
    if device.type != "cpu":
        raise ValueError(f"attention_backend paged_cpu runs on the CPU, not on {device}")
    op = paged_decode_op()
    if backend == "auto" and not _auto_uses(kernels()):
        return None
    if op is None and backend == "paged_cpu":
        raise ValueError("attention_backend paged_cpu: the kernel could not be built (see log)")
    return op


# -- the kernels as torch custom ops, for a compiled step (`compile_step`) ----------------
# NOTE: dynamo cannot trace into a pybind function: each call would break the graph (so a
# compiled decode step would be ~100 small graphs with Python between them). Registered as
# custom ops (namespace `tandem`) with fake implementations (shapes only), each is one
# opaque node of the graph, which inductor calls as it is: the same kernel on the same
# inputs, so the same bits as the eager path. Registered from Python (torch.library), not
# with TORCH_LIBRARY in the bindings: no rebuild of the kernels, and the eager path keeps
# its direct pybind calls (no dispatcher on the way; 1.9 us a call where the op costs 4).
# The modules pick them while dynamo traces (`for_trace`); eager steps never see them.
_TRACED = None


class _TracedOps:
    """The kernels' call names over `torch.ops.tandem.*` (same signatures as the module's)."""

    def __init__(self, mod) -> None:
        self._mod = mod
        for name in _SCHEMAS:  # the overloads: the wrapper calls them as they are
            setattr(self, name, getattr(torch.ops.tandem, name).default)

    def __getattr__(self, name):  # anything else (isa, pack_linear): the module's own
        return getattr(self._mod, name)


def traced_ops():
    """The kernels as custom ops (registered on the first call), or None where unbuilt."""
    global _TRACED
    if _TRACED is None:
        mod = kernels()
        if mod is None:
            return None
        _register_ops(mod)
        _TRACED = _TracedOps(mod)
    return _TRACED


def for_trace(mod):
    """`mod` (the kernels' module), or while dynamo traces a step its custom ops
    (`traced_ops`, registered by whoever compiles, before tracing)."""
    if torch.compiler.is_compiling() and _TRACED is not None:
        return _TRACED
    return mod


_OPS_LIB = None  # the torch.library.Library that holds the definitions (kept alive)
_SCHEMAS = {
    "packed_linear": "packed_linear(Tensor x, Tensor wp, Tensor? bias, int n) -> Tensor",
    "rms_norm": "rms_norm(Tensor x, Tensor w, float eps) -> Tensor",
    "silu_mul": "silu_mul(Tensor gu) -> Tensor",
    "rope_qk": "rope_qk(Tensor qkv, Tensor cos, Tensor sin, int h, int hkv) -> (Tensor, Tensor)",
    "paged_decode_attention": "paged_decode_attention(Tensor q, Tensor k_cache, "
                              "Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
                              "float scale) -> Tensor",
}


def _register_ops(mod) -> None:
    """Define `tandem::*` (schemas above), their CPU kernels (the module's functions
    themselves: they release the GIL as in eager steps) and fake kernels (shapes).

    NOTE: through `torch.library.Library` + `impl`, not `torch.library.custom_op`: a call
    through a custom_op's Python wrapper cost 18 us on this AVX2 EPYC against 1.9 us for the
    pybind call itself (a decode step makes ~100 of them: 1.6 ms, more than the compile
    saved); `impl` over the pybind function costs 4 us."""
    global _OPS_LIB
    lib = torch.library.Library("tandem", "DEF")
    for schema in _SCHEMAS.values():
        lib.define(schema)
    lib.impl("packed_linear", mod.packed_linear, "CPU")
    lib.impl("rms_norm", mod.rms_norm, "CPU")
    lib.impl("silu_mul", mod.silu_mul, "CPU")
    lib.impl("rope_qk", lambda qkv, cos, sin, h, hkv: tuple(mod.rope_qk(qkv, cos, sin, h, hkv)),
             "CPU")
    lib.impl("paged_decode_attention", mod.paged_decode_attention, "CPU")

    def fake(name):
        return lambda fn: torch.library.register_fake(f"tandem::{name}", fn, lib=lib)

    @fake("packed_linear")
    def _(x, wp, bias, n):
        return x.new_empty(x.shape[0], n)

    @fake("rms_norm")
    def _(x, w, eps):
        return torch.empty_like(x)

    @fake("silu_mul")
    def _(gu):
        return gu.new_empty(gu.shape[0], gu.shape[1] // 2)

    @fake("rope_qk")
    def _(qkv, cos, sin, h, hkv):
        t, d = qkv.shape[0], cos.shape[1]
        return qkv.new_empty(t, h, d), qkv.new_empty(t, hkv, d)

    @fake("paged_decode_attention")
    def _(q, k_cache, v_cache, block_tables, seq_lens, scale):
        return torch.empty_like(q)

    _OPS_LIB = lib


def define_traced_op(name: str, schema: str, cpu_impl, fake_impl) -> None:
    """A tier's own opaque op next to the kernels' (`tandem::<name>`, same library), for
    what a compiled step must not trace into (the language runner's chunk attention: a
    Python loop over a step's chunks); `traced_ops().<name>` calls it. Defined once per
    process; `cpu_impl` runs on CPU tensors, `fake_impl` gives the shapes. Needs the
    kernels (`traced_ops` not None)."""
    traced = traced_ops()
    if traced is None:
        raise ValueError(f"tandem::{name}: the CPU kernels are not built")
    if name not in vars(traced):  # (defined once: `traced` holds it from then on)
        _OPS_LIB.define(schema)
        _OPS_LIB.impl(name, cpu_impl, "CPU")
        torch.library.register_fake(f"tandem::{name}", fake_impl, lib=_OPS_LIB)
        setattr(traced, name, getattr(torch.ops.tandem, name).default)


class PackedLinear(torch.nn.Module):
    """y = x @ weight_t (+ bias) on the kernels' packed layout, any leading dims: x, y and
    the bias float32, the weight float32 or bfloat16 (widened as the kernel loads it).
    The one packed linear: the language decoder's `DenseLinear.pack` and the encoder's
    `pack_linears` both build it. Holds only the packed copies."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None, kernels) -> None:
        super().__init__()
        self.in_features, self.out_features = weight_t.shape
        self.kernels = kernels
        self.register_buffer("weight_p", kernels.pack_linear(weight_t.detach()), persistent=False)
        packed_bias = None if bias is None else kernels.pack_bias(bias.detach())
        self.register_buffer("bias_p", packed_bias, persistent=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, kernels) -> PackedLinear:
        return cls(linear.weight.detach().t().contiguous(), linear.bias, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = for_trace(self.kernels).packed_linear(flat, self.weight_p, self.bias_p,
                                                  self.out_features)
        return y.view(*x.shape[:-1], self.out_features)


def pack_linears(module: torch.nn.Module, kernels) -> int:
    """Replace every `nn.Linear` under `module` by a PackedLinear; returns how many."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, PackedLinear.from_linear(child, kernels))
            n += 1
        else:
            n += pack_linears(child, kernels)
    return n


CPU_BF16_COMPUTE = ("auto", "bfloat16", "float32")
# x86 flags of the bfloat16 matrix units that `auto` leaves bfloat16 products to (torch's
# GEMM through oneDNN). Without AVX512-BF16 that GEMM is 10-60x its float32 GEMM (an AMD
# EPYC with AVX2 alone: docs/benchmarks.md, "bfloat16 on an AVX2 host"); with it but no AMX
# (an Intel Xeon, 1 thread, the decoder's shapes) it is 0.65-0.8x the packed float32
# kernel over the same bfloat16 weights at 1-256 rows ("bfloat16 weights in the packed
# linears"). AMX was not measured: where it is, torch's GEMM keeps the products.
NATIVE_BF16_FLAGS = frozenset({"amx_bf16"})


def linear_compute_dtype(choice: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype a tier's linear products run in (its `cpu_bf16_compute` setting: the
    language runner's, the encoder's vision tower's): the model's, except for a bfloat16
    model on a CPU, where `float32` computes in float32 over the same weight values (packed
    in bfloat16, or widened), `bfloat16` keeps torch's bfloat16 GEMM, and `auto` is
    bfloat16 where the CPU has AMX (NATIVE_BF16_FLAGS), float32 where it has not."""
    if choice not in CPU_BF16_COMPUTE:
        raise ValueError(f"cpu_bf16_compute must be one of {CPU_BF16_COMPUTE}, got {choice!r}")
    if device.type != "cpu" or dtype != torch.bfloat16 or choice == "bfloat16":
        return dtype
    if choice == "auto" and cpu_flags() & NATIVE_BF16_FLAGS:
        return dtype
    return torch.float32


LINEAR_BACKENDS = ("auto", "torch", "packed_cpu")


def linear_kernels(backend: str, device: torch.device, dtype: torch.dtype):
    """The kernels a model tier runs its linears on (`DenseLinear.pack`, `pack_linears`),
    by config:

    auto        packed on CPU in float32 where the kernels build on a vector path; torch's
                F.linear otherwise
    torch       torch's ops everywhere (None)
    packed_cpu  packed; refused on CUDA, in another dtype, or where it cannot be built
    """
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    fits = device.type == "cpu" and dtype == torch.float32
    if backend == "torch" or (backend == "auto" and not fits):
        return None
    if not fits:
        raise ValueError(f"linear_backend packed_cpu runs float32 on the CPU, not {dtype} on {device}")
    mod = kernels()
    if mod is None and backend == "packed_cpu":
        raise ValueError("linear_backend packed_cpu: the kernels could not be built (see log)")
    return mod if backend == "packed_cpu" or _auto_uses(mod) else None


def sampler_kernels(device: torch.device):
    """The kernels a language tier's sampler cuts and draws its sampled rows with
    (`nucleus_draw`, engine/sampler.py): the compiled module on the CPU, on any path (the
    kernel is mostly scalar passes: the generic build runs it near the vector builds'
    speed); None on another device (CUDA sorts) or where it cannot be built (the sampler
    then cuts a row at a time in Python: the same rules, 6x slower at 32 rows of a
    1,024-token vocabulary, 2x at 152K; docs/benchmarks.md)."""
    return kernels() if device.type == "cpu" else None


if __name__ == "__main__":  # `make setup`: build ahead of the first request
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mod = kernels()
    print("CPU kernels:", f"built, path {mod.isa()} ({requested_isa()} build on {cpu_model()})"
          if mod is not None else "UNAVAILABLE")
    sys.exit(0 if mod is not None else 1)
