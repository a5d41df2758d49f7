"""The CPU kernels: the in-place paged decode kernel equals the gather + SDPA path, the
packed linear equals x @ W within its summation's error bound and is batch-invariant, every
vector path (AVX-512, AVX2, NEON, generic) gives the same bits, and each backend choice is
honoured or refused (never silently changed)."""

from __future__ import annotations

import pytest
import torch

from tandem.cpu_kernels import (
    decode_attention_op,
    kernels,
    linear_kernels,
    paged_decode_op,
)
from tandem.services.language.model.attention import AttentionMetadata, paged_attention
from tandem.services.language.model.linear import DenseLinear

op = paged_decode_op()
needs_kernel = pytest.mark.skipif(op is None, reason="no C++ toolchain to build the kernel")


def _case(B, H, Hkv, D, ps, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = 64
    kc = torch.randn(pages + 1, ps, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(pages + 1, ps, Hkv, D, generator=g).to(dtype)
    width = max(-(-n // ps) for n in lens)
    perm = torch.randperm(pages, generator=g)
    tables = torch.full((B, width), pages, dtype=torch.int64)  # padding: the dummy page
    for i, n in enumerate(lens):
        used = -(-n // ps)
        tables[i, :used] = perm[i * 4 : i * 4 + used] if used <= 4 else perm[:used]
    q = torch.randn(B, H, D, generator=g).to(dtype)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int64)


def _attend(q, kc, vc, tables, lens, decode_op):
    """paged_attention over single-token rows; k/v of the step are already in the cache
    (written to the dummy slot here, so the cache under test is not changed)."""
    B, _, D = q.shape
    Hkv = kc.shape[2]
    meta = AttentionMetadata(
        slot_mapping=torch.full((B,), (kc.shape[0] - 1) * kc.shape[1], dtype=torch.int64),
        num_single=B,
        single_block_tables=tables,
        single_seq_lens=lens,
        decode_op=decode_op,
    )
    kv = torch.zeros(B, Hkv, D, dtype=q.dtype)
    return paged_attention(q, kv, kv, kc, vc, meta, D**-0.5)


@needs_kernel
@pytest.mark.parametrize(
    "B,H,Hkv,D,ps,lens",
    [
        (1, 8, 2, 64, 16, [1]),  # one key
        (3, 4, 4, 32, 16, [16, 17, 33]),  # page edges, no GQA
        (5, 8, 2, 64, 4, [1, 5, 9, 12, 13]),  # GQA 4, small pages
        (4, 14, 2, 64, 16, [40, 41, 200, 7]),  # Qwen2.5-VL-7B-like head counts
    ],
)
def test_kernel_equals_gather_sdpa_float32(B, H, Hkv, D, ps, lens):
    q, kc, vc, tables, seq = _case(B, H, Hkv, D, ps, lens, torch.float32)
    ref = _attend(q, kc, vc, tables, seq, None)
    got = _attend(q, kc, vc, tables, seq, op)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)


@needs_kernel
def test_kernel_bfloat16_close_to_float32_reference():
    q, kc, vc, tables, seq = _case(3, 8, 2, 64, 16, [5, 50, 130], torch.bfloat16)
    ref = _attend(q.float(), kc.float(), vc.float(), tables, seq, None)
    got = _attend(q, kc, vc, tables, seq, op)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


def test_backend_choice_is_honoured_or_refused():
    cpu = torch.device("cpu")
    assert decode_attention_op("gather", cpu) is None
    assert decode_attention_op("auto", torch.device("cuda")) is None
    with pytest.raises(ValueError, match="runs on the CPU"):
        decode_attention_op("paged_cpu", torch.device("cuda"))
    with pytest.raises(ValueError, match="attention_backend must be"):
        decode_attention_op("flash", cpu)
    if op is not None:
        assert decode_attention_op("auto", cpu) is op
        assert decode_attention_op("paged_cpu", cpu) is op


def test_unbuildable_kernels_fall_back_to_torch_or_are_refused(monkeypatch):
    from pathlib import Path

    from tandem import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "SOURCES", (Path("/nonexistent/linear.cpp"),))
    cpu_kernels.kernels.cache_clear()
    try:
        cpu = torch.device("cpu")
        assert cpu_kernels.kernels() is None and cpu_kernels.paged_decode_op() is None
        assert decode_attention_op("auto", cpu) is None  # auto: the gather path serves
        assert linear_kernels("auto", cpu, torch.float32) is None  # auto: F.linear serves
        with pytest.raises(ValueError, match="could not be built"):
            decode_attention_op("paged_cpu", cpu)  # asked for explicitly: refused
        with pytest.raises(ValueError, match="could not be built"):
            linear_kernels("packed_cpu", cpu, torch.float32)
    finally:
        cpu_kernels.kernels.cache_clear()


@needs_kernel
@pytest.mark.parametrize("n", [32, 100, 768])  # whole strips, a tail, several strips
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_batch_invariant(n, bias):
    """A row's result is the same bits alone or among others, whatever the tile it lands in
    (the error bound against float64 is checked below, on every vector path)."""
    g = torch.Generator().manual_seed(n)
    k = 300  # not a multiple of the kernel's k block
    wt = torch.randn(k, n, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    mod = kernels()
    wp, bp = mod.pack_linear(wt), (mod.pack_bias(b) if bias else None)
    for m in (1, 3, 8, 9, 40, 241, 500):  # below, at, past one register tile; row blocks
        x = torch.randn(m, k, generator=g)
        got = mod.packed_linear(x, wp, bp, n)
        assert got.shape == (m, n)
        for i in (0, m // 2, m - 1):
            assert torch.equal(mod.packed_linear(x[i : i + 1], wp, bp, n), got[i : i + 1])
        if m > 240:  # a later row block alone (its rows start a block of their own)
            assert torch.equal(mod.packed_linear(x[240:], wp, bp, n), got[240:])


@needs_kernel
@pytest.mark.parametrize("causal", [False, True])
def test_segment_attention_reads_each_segment_alone(causal):
    """A segment's rows are the same bits alone or among other segments (the encoder's
    batch invariance; a prefill chunk's rows whatever else the step holds), and a causal
    row's output does not depend on the rows after it; bad layouts are refused."""
    mod = kernels()
    g = torch.Generator().manual_seed(3)
    cu = [0, 7, 40, 40, 111, 150]
    q, k = torch.randn(150, 4, 64, generator=g), torch.randn(150, 2, 64, generator=g)
    v = torch.randn(150, 2, 64, generator=g)
    every = mod.segment_attention(q, k, v, torch.tensor(cu), causal, 0.125)
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        alone = mod.segment_attention(q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]), causal, 0.125)
        assert torch.equal(alone, every[a:b]), (a, b)
    if causal:  # the first 50 rows of a segment, alone: the same bits as within 111
        head = mod.segment_attention(q[40:90], k[40:90], v[40:90], torch.tensor([0, 50]), True, 0.125)
        assert torch.equal(head, every[40:90])
    with pytest.raises(RuntimeError, match="cu must run from 0 to T"):
        mod.segment_attention(q, k, v, torch.tensor([0, 149]), causal, 0.125)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        mod.segment_attention(q, k[:, :1].expand(150, 3, 64).contiguous(), v, torch.tensor(cu), causal, 1.0)


@needs_kernel
def test_dense_linear_packed_equals_unpacked():
    torch.manual_seed(0)
    lin = DenseLinear(64, 96, bias=True)
    with torch.no_grad():
        lin.weight_t.normal_()
        lin.bias.normal_()
    x = torch.randn(5, 64)
    with torch.inference_mode():
        before = lin(x)
        lin.pack(kernels())
        after = lin(x)
    assert "weight_t" not in dict(lin.named_parameters())  # replaced, not copied
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_linear_backend_choice_is_honoured_or_refused():
    cpu = torch.device("cpu")
    assert linear_kernels("torch", cpu, torch.float32) is None
    assert linear_kernels("auto", torch.device("cuda"), torch.float32) is None
    assert linear_kernels("auto", cpu, torch.bfloat16) is None
    with pytest.raises(ValueError, match="float32 on the CPU"):
        linear_kernels("packed_cpu", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="linear_backend must be"):
        linear_kernels("onednn", cpu, torch.float32)
    if kernels() is not None:
        assert linear_kernels("auto", cpu, torch.float32) is kernels()


@needs_kernel
def test_pointwise_kernels_equal_the_torch_steps_they_replace():
    from tandem.services.language.model.decoder import RMSNorm
    from tandem.services.language.model.rope import apply_rotary

    mod = kernels()
    g = torch.Generator().manual_seed(3)
    t, h, hkv, d = 7, 4, 2, 16
    x = torch.randn(t, 48, generator=g)
    norm = RMSNorm(48, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
    torch.testing.assert_close(mod.rms_norm(x, norm.weight.detach(), 1e-6), norm(x).detach(),
                               atol=1e-6, rtol=1e-6)
    gu = torch.randn(t, 2 * 40, generator=g)
    gate, up = gu.split(40, dim=1)
    torch.testing.assert_close(mod.silu_mul(gu), torch.nn.functional.silu(gate) * up,
                               atol=1e-6, rtol=1e-6)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g)
    angles = torch.randn(t, d // 2, generator=g)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q, k = mod.rope_qk(qkv, cos, sin, h, hkv)
    q_ref = apply_rotary(qkv[:, : h * d].reshape(t, h, d), cos, sin)
    k_ref = apply_rotary(qkv[:, h * d : (h + hkv) * d].reshape(t, hkv, d), cos, sin)
    assert q.is_contiguous() and k.is_contiguous()
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)  # same products, same rounding


@needs_kernel
def test_pack_linears_swaps_every_linear_and_keeps_results():
    from tandem.cpu_kernels import PackedLinear, pack_linears

    torch.manual_seed(0)
    tower = torch.nn.Sequential(
        torch.nn.Linear(40, 70), torch.nn.GELU(),
        torch.nn.Sequential(torch.nn.Linear(70, 33, bias=False)),
    )
    x = torch.randn(2, 5, 40)  # leading dims pass through, as with nn.Linear
    with torch.inference_mode():
        before = tower(x)
        assert pack_linears(tower, kernels()) == 2
        after = tower(x)
    assert not any(isinstance(m, torch.nn.Linear) for m in tower.modules())
    assert sum(isinstance(m, PackedLinear) for m in tower.modules()) == 2
    assert after.shape == before.shape
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_claim_pool_protocol_runs_every_task_once_inside_its_job():
    """The pool's protocol over many back-to-back jobs of alternating sizes (its own
    selftest in csrc/strip_pool.cpp): every task runs exactly once and only inside its job.
    Before the counter was sealed at a job's end, a helper that read the job's generation
    late could read the next, larger job's size and run a task past the end of the
    finished job (tens of such tasks per 200,000 jobs on a 2-core host; in serving, a
    strip written past a linear's output — CI saw a segfault)."""
    k = kernels()
    if k is None:
        pytest.skip("CPU kernels unavailable")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for spin_us in (0, 1000):
            k.set_pool_helpers(1, spin_us)
            assert k.pool_selftest(100_000) == 0
    finally:
        k.set_pool_helpers(0)
        torch.set_num_threads(before)


def test_claim_pool_linears_equal_one_thread_bit_for_bit():
    """A one-thread step's linears on the claim-based pool (csrc/strip_pool.cpp): every
    strip is computed whole by one thread, so the result is bit-identical to one thread
    alone, whichever thread took which strip, over many back-to-back jobs (each job's
    counter generation keeps a late helper out of the next one); a second caller while
    the pool is busy runs alone."""
    import threading

    k = kernels()
    if k is None:
        pytest.skip("CPU kernels unavailable")
    g = torch.Generator().manual_seed(7)
    shapes = [(1, 512, 768), (3, 512, 3072), (8, 1536, 512), (1, 64, 40),  # N not a strip multiple
              (300, 64, 40)]  # two row blocks: tasks are (row block, strip) pairs
    cases = []
    for m, kk, n in shapes:
        wp = k.pack_linear(torch.randn(kk, n, generator=g))
        bp = k.pack_bias(torch.randn(n, generator=g))
        x = torch.randn(m, kk, generator=g)
        cases.append((x, wp, bp, n))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        k.set_pool_helpers(0)
        alone = [k.packed_linear(x, wp, bp, n) for x, wp, bp, n in cases]
        for spin_us in (0, 1000):
            k.set_pool_helpers(1, spin_us)
            assert k.pool_helpers() == 1
            for _ in range(200):
                for (x, wp, bp, n), want in zip(cases, alone, strict=True):
                    assert torch.equal(k.packed_linear(x, wp, bp, n), want)
        # two callers at once: one gets the pool, the other runs alone; both exact
        errors = []

        def caller():
            torch.set_num_threads(1)
            for _ in range(100):
                for (x, wp, bp, n), want in zip(cases, alone, strict=True):
                    if not torch.equal(k.packed_linear(x, wp, bp, n), want):
                        errors.append(n)

        threads = [threading.Thread(target=caller) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
    finally:
        k.set_pool_helpers(0)
        torch.set_num_threads(before)
    assert k.pool_helpers() == 0


def test_claim_pool_in_a_forked_child_runs_alone():
    """A child forked while the pool has helpers has none of their threads: it must run
    its linears alone, not wait for helpers that do not exist (pthread_atfork)."""
    import os

    k = kernels()
    if k is None:
        pytest.skip("CPU kernels unavailable")
    wp = k.pack_linear(torch.randn(512, 3072))
    x = torch.randn(2, 512)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        k.set_pool_helpers(1)
        want = k.packed_linear(x, wp, None, 3072)
        pid = os.fork()
        if pid == 0:  # the child: exact, and alone
            ok = k.pool_helpers() == 0 and torch.equal(k.packed_linear(x, wp, None, 3072), want)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert k.pool_helpers() == 1  # the parent keeps its helper
    finally:
        k.set_pool_helpers(0)
        torch.set_num_threads(before)


# --- every vector path: the same bits, each within its bound of torch ----------------------
#
# The native build runs here; the other paths this host can run are built on purpose
# (TANDEM_KERNEL_ISA) and run in a child process: `generic` everywhere, and `avx2` where the
# native path is avx512. All paths run the same operations in the same order (csrc/vec16.h),
# so their outputs must equal the native build's bit for bit; and each must lie within the
# bounds below of torch's ops (checked on every path's own outputs, so a broken path fails
# here even if the native one is broken the same way).


def _forced_paths() -> list[str]:
    mod = kernels()
    if mod is None:
        return []
    return ["generic"] + (["avx2"] if mod.isa() == "avx512" else [])


@pytest.fixture(scope="module")
def path_outputs(tmp_path_factory):
    import os
    import subprocess
    import sys
    from pathlib import Path

    import kernel_cases

    got: dict[str, dict] = {"native": kernel_cases.outputs(kernels())}

    def run(isa: str) -> dict:
        if isa not in got:
            out = tmp_path_factory.mktemp("isa") / f"{isa}.pt"
            env = {**os.environ, "TANDEM_KERNEL_ISA": isa}
            script = Path(kernel_cases.__file__)
            r = subprocess.run([sys.executable, str(script), str(out)], env=env,
                               capture_output=True, text=True, timeout=900)
            assert r.returncode == 0, r.stderr[-3000:]
            saved = torch.load(out)
            assert saved["isa"] == isa  # the build really runs the path asked for
            got[isa] = saved["outputs"]
        return got[isa]

    return run


@needs_kernel
@pytest.mark.parametrize("isa", [
    "native",
    # NOTE: slow (`make test-slow`): building a forced path takes about a minute on 2 cores;
    # CI hosts have AVX2 at least, so the scalar fallback is the one path no CI host runs
    pytest.param("generic", marks=pytest.mark.slow),
    # NOTE: slow too: on an AVX-512 host the forced AVX2 build costs ~90 s of CI (an AVX2
    # host's CI runs that path natively, above); `make test-slow` builds and compares it
    pytest.param("avx2", marks=pytest.mark.slow),
])
def test_each_path_within_its_bound_of_torch(path_outputs, isa):
    """Linear, at rows 1..64 and odd K, N: bfloat16 weights give the bits of their float32
    widening; each output within the forward-error bound of its summation against float64, |y - y64| <= (KC + ceil(K / KC) + 1) u (|x| |W| + |b|) with
    u = 2^-24 and KC = 128 (an FMA chain of at most KC terms per k block, the blocks' sums
    added in order, the bias once). Attention (decode and segments): within 2e-6 + 1e-5 relative of a float64 softmax (float32 cache), 2e-2
    (bfloat16). RMSNorm and SiLU-mul: 1e-6 of torch's steps; rotary: torch's bits. The
    sampler's cut: the Python passes' kept set."""
    import kernel_cases as kc

    if isa not in ["native", *_forced_paths()]:
        pytest.skip(f"{isa}: not buildable on this CPU (native path {kernels().isa()})")
    out = path_outputs(isa)
    for k, n in kc.LINEAR_SHAPES:
        for m in kc.ROWS:
            for bias in (False, True):
                x, wt, b = kc.linear_case(k, n, m, bias)
                got = out[f"linear/{k}x{n}/m{m}/bias{int(bias)}"]
                ref = x.double() @ wt.double() + (b.double() if bias else 0)
                mag = x.double().abs() @ wt.double().abs() + (b.double().abs() if bias else 0)
                bound = (128 + -(-k // 128) + 1) * 2.0**-24 * mag
                assert got.shape == (m, n)
                worst = ((got.double() - ref).abs() / bound).max().item()
                assert worst <= 1, (isa, k, n, m, worst)
                if m in kc.BF16_WEIGHT_ROWS:  # widened as loaded: the float32 copy's bits
                    key = f"linear/{k}x{n}/m{m}/bias{int(bias)}/bf16w"
                    assert torch.equal(out[key], out[key + "-widened"]), (isa, key)
    for d in kc.HEAD_DIMS:
        for dtype, tol in ((torch.float32, (2e-6, 1e-5)), (torch.bfloat16, (2e-2, 2e-2))):
            q, kcache, vcache, tables, lens = kc.attention_case(d, dtype)
            ref = kc.attention_ref(q, kcache, vcache, tables, lens, d**-0.5)
            got = out[f"attention/d{d}/{dtype}"]
            assert got.dtype == dtype
            torch.testing.assert_close(got.double(), ref, atol=tol[0], rtol=tol[1])
        # a bfloat16 cache is read at the float32 standard: the float32 kernel's bits on
        # the widened tensors (rounded to bfloat16 where q is bfloat16), on every path
        widened = out[f"attention/d{d}/f32q-bf16kv-widened"]
        mixed = out[f"attention/d{d}/f32q-bf16kv"]
        assert mixed.dtype == torch.float32 and torch.equal(mixed, widened), (isa, d)
        bf16 = out[f"attention/d{d}/{torch.bfloat16}"]
        assert torch.equal(bf16, out[f"attention/d{d}/bf16-widened"].bfloat16()), (isa, d)
    for i in range(len(kc.SEGMENT_CASES)):
        for d in kc.HEAD_DIMS:
            q, k, v, cu, causal = kc.segment_case(i, d)
            ref = kc.segment_ref(q, k, v, cu, causal, d**-0.5)
            got = out[f"segments/{i}/d{d}"]
            torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=1e-5)
    from tandem.services.language.model.decoder import RMSNorm

    for d in kc.NORM_DIMS:
        g = kc._gen(d)
        x, w = torch.randn(9, d, generator=g), torch.randn(d, generator=g)
        norm = RMSNorm(d, 1e-6)
        with torch.no_grad():
            norm.weight.copy_(w)
            torch.testing.assert_close(out[f"rms_norm/d{d}"], norm(x), atol=1e-6, rtol=1e-6)
        gu = torch.randn(9, 2 * d, generator=g) * 4
        gate, up = gu.split(d, dim=1)
        torch.testing.assert_close(out[f"silu_mul/d{d}"], torch.nn.functional.silu(gate) * up,
                                   atol=1e-6, rtol=1e-6)
    # the sampler's cut: the kept set of engine/nucleus.py's Python passes, the token drawn
    # one of it (tests/test_nucleus.py checks the rules and the draw at length)
    from language_engine_helpers import kept_weights

    from tandem.services.language.engine import nucleus

    x, (temperature, top_k, top_p, min_p, _) = kc.nucleus_case()
    for r in range(x.shape[0]):
        nu = nucleus.nucleus(x[r], float(temperature[r]), int(top_k[r]), float(top_p[r]),
                             float(min_p[r]))
        kept = out["nucleus/kept"][r]
        assert torch.equal(kept > 0, kept_weights(nu) > 0), (isa, r)
        assert kept[int(out["nucleus/ids"][r])] > 0, (isa, r)


@needs_kernel
@pytest.mark.parametrize("isa", [pytest.param("generic", marks=pytest.mark.slow),
                                 pytest.param("avx2", marks=pytest.mark.slow)])
def test_every_path_gives_the_native_bits(path_outputs, isa):
    if isa not in _forced_paths():
        pytest.skip(f"{isa}: not buildable on this CPU (native path {kernels().isa()})")
    native, other = path_outputs("native"), path_outputs(isa)
    assert native.keys() == other.keys()
    differ = [k for k in native if not torch.equal(native[k], other[k])]
    assert differ == [], f"{isa} differs from {kernels().isa()} in {differ[:10]}"


def test_a_forced_path_is_honoured_or_refused(monkeypatch):
    from tandem import cpu_kernels

    monkeypatch.setenv("TANDEM_KERNEL_ISA", "sse9")
    with pytest.raises(ValueError, match="TANDEM_KERNEL_ISA must be one of"):
        cpu_kernels.requested_isa()
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"fpu", "sse2"}))
    monkeypatch.setenv("TANDEM_KERNEL_ISA", "avx2")
    with pytest.raises(ValueError, match="no AVX2"):
        cpu_kernels.requested_isa()
    monkeypatch.setenv("TANDEM_KERNEL_ISA", "generic")
    assert cpu_kernels.requested_isa() == "generic"


@needs_kernel
def test_a_build_killed_midway_does_not_block_later_starts():
    """torch's builder leaves its `lock` file behind when the building process is killed;
    a later process must not wait on it forever (the child's timeout is a hang guard)."""
    import subprocess
    import sys
    from pathlib import Path

    build = Path(kernels().__file__).parent
    (build / "lock").write_text("")  # what a build killed mid-way leaves
    code = "from tandem.cpu_kernels import kernels; assert kernels() is not None; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    assert "removing a stale build lock" in r.stderr
    assert not (build / "lock").exists()


def test_auto_keeps_torch_ops_where_only_the_generic_path_builds(monkeypatch):
    """The generic C++ path runs 0.2-0.5x torch's ops: `auto` must not pick it; an explicit
    request still gets it."""
    from tandem import cpu_kernels

    class Generic:
        def isa(self):
            return "generic"

        def paged_decode_attention(self, *a):
            raise AssertionError("not called here")

    fake = Generic()
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: fake)
    cpu = torch.device("cpu")
    assert cpu_kernels.linear_kernels("auto", cpu, torch.float32) is None
    assert cpu_kernels.decode_attention_op("auto", cpu) is None
    assert cpu_kernels.linear_kernels("packed_cpu", cpu, torch.float32) is fake
    assert cpu_kernels.decode_attention_op("paged_cpu", cpu) == fake.paged_decode_attention


def test_a_compile_reports_each_source_it_finishes(tmp_path, caplog):
    """`make setup` and a tier's first start say how far the kernels' compile got: a line
    per source as its object appears (and one at least every PROGRESS_S seconds); nothing
    when the module is already built."""
    import logging

    from waiting import wait_until

    from tandem.cpu_kernels import _progress

    caplog.set_level(logging.INFO, logger="tandem.language.kernels")
    with _progress(tmp_path, "mod", ["linear", "pointwise"], "avx2") as p:
        assert p.active
        (tmp_path / "linear.o").write_bytes(b"")
        wait_until(lambda: "linear compiled" in caplog.text, timeout_s=30,
                   what="the compiled-source line", state=lambda: caplog.text)
    assert "compiling 2 sources for the avx2 path" in caplog.text
    assert "built in" in caplog.text
    (tmp_path / "mod.so").write_bytes(b"")
    caplog.clear()
    with _progress(tmp_path, "mod", ["linear"], "avx2") as p:
        assert not p.active
    assert caplog.text == ""
