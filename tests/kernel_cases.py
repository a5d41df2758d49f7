"""Fixed, seeded inputs for every CPU kernel, and what a build of the kernels makes of them.

`outputs(mod)` runs one build (any vector path) on all cases; `references()` computes
torch's ops on the same inputs. tests/test_cpu_kernels.py compares a forced build's
outputs (run in a child process: `python tests/kernel_cases.py OUT.pt` under
TANDEM_KERNEL_ISA) with the native build's, bit for bit, and with torch's within the bounds
stated there.

The shapes are the awkward ones: N not a multiple of the 32-column strip, K not a multiple
of the 128-deep k block, rows 1..64 across register-tile edges, head dims 32/40/64/80/96/128
(40: not a multiple of 16), GQA, page edges, segments across key blocks and work items.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

LINEAR_SHAPES = [(300, 100), (129, 33), (512, 768), (64, 40)]  # (K, N)
# every tile remainder of every path; then rows across the linear's row blocks (at most MB = 240
# rows a task, blocks of one size: csrc/linear.cpp), a partial last block among them
ROWS = list(range(1, 65)) + [239, 240, 241, 487]
# rows the bfloat16-weight linear is run at: every tile height of every path once, a block
BF16_WEIGHT_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 32, 241]
HEAD_DIMS = [32, 40, 64, 80, 96, 128]
NORM_DIMS = [40, 100, 512]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def linear_case(k: int, n: int, m: int, bias: bool):
    g = _gen(k * 1000 + n * 10 + m)
    wt = torch.randn(k, n, generator=g) * k**-0.5
    b = torch.randn(n, generator=g) if bias else None
    return torch.randn(m, k, generator=g), wt, b


def attention_case(d: int, dtype: torch.dtype):
    """4 rows (lengths across page edges and 16-key blocks), 8 query heads over 2 kv heads."""
    g = _gen(d)
    b, h, hkv, ps, pages = 4, 8, 2, 16, 40
    lens = torch.tensor([1, 16, 47, 130], dtype=torch.int64)
    kc = torch.randn(pages, ps, hkv, d, generator=g).to(dtype)
    vc = torch.randn(pages, ps, hkv, d, generator=g).to(dtype)
    tables = torch.randperm(pages, generator=g)[: b * 9].view(b, 9).contiguous()
    q = torch.randn(b, h, d, generator=g).to(dtype)
    return q, kc, vc, tables, lens


def attention_ref(q, kc, vc, tables, lens, scale):
    """Plain float64 softmax attention over each row's keys (the reference)."""
    b, h, d = q.shape
    ps, hkv = kc.shape[1], kc.shape[2]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        slots = torch.arange(n)
        pages = tables[i][slots // ps]
        k = kc.double()[pages, slots % ps]  # [n, hkv, d]
        v = vc.double()[pages, slots % ps]
        rep = h // hkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v)
    return out


# segment_attention: (rows, query heads, kv heads, cumulative segment lengths, causal); every
# head dim of HEAD_DIMS. Segments across the 16- and 32-key blocks and the 32-row work items,
# an empty one, GQA, 1-row segments.
SEGMENT_CASES = [
    (75, 4, 2, [0, 75], True),  # a prefill chunk: 3 work items, the last partial
    (70, 2, 2, [0, 1, 17, 17, 50, 70], False),  # the ViT's frames/windows, one empty
    (40, 8, 1, [0, 33, 40], True),
]


def segment_case(i: int, d: int):
    """q [T, H, D], k [T, Hkv, D] and v [T, Hkv, D] as a strided view (as the runners'), cu."""
    t, h, hkv, cu, causal = SEGMENT_CASES[i]
    g = _gen(1000 * i + d)
    q, k = torch.randn(t, h, d, generator=g), torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, 3 * hkv, d, generator=g)[:, hkv : 2 * hkv]
    return q, k, v, torch.tensor(cu, dtype=torch.int64), causal


def segment_ref(q, k, v, cu, causal, scale):
    """Plain float64 softmax attention of each segment's rows over its own keys."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    rep = q.shape[1] // k.shape[1]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        if a == b:
            continue
        qs = q[a:b].double().transpose(0, 1)
        ks = k[a:b].double().repeat_interleave(rep, 1).transpose(0, 1)
        vs = v[a:b].double().repeat_interleave(rep, 1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * scale
        if causal:
            s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        out[a:b] = (torch.softmax(s, -1) @ vs).transpose(0, 1)
    return out


# The sampler's cut and draw (csrc/nucleus.cpp): rows of a 1,000-token vocabulary (not a
# whole number of vectors), each with its own (temperature, top_k, top_p, min_p).
NUCLEUS_CUTS = [(0.8, 0, 0.95, 0.0), (1.0, 40, 0.9, 0.0), (1.2, 0, 0.3, 0.0),
                (0.5, 0, 1.0, 0.1), (1.0, 3, 1.0, 0.0), (0.7, 0, 0.9, 0.05)]


def nucleus_case():
    """(x [S, 1000], the draw_rows arguments after x, as tensors)."""
    g = _gen(31)
    s = len(NUCLEUS_CUTS)
    x = torch.randn(s, 1000, generator=g) * torch.linspace(0.5, 6.0, s)[:, None]
    x[2, ::5] = float("-inf")
    cols = list(zip(*NUCLEUS_CUTS, strict=True))
    return x, (torch.tensor(cols[0]), torch.tensor(cols[1]), torch.tensor(cols[2]),
               torch.tensor(cols[3]), torch.rand(s, dtype=torch.float64, generator=g))


def outputs(mod) -> dict[str, torch.Tensor]:
    """Every kernel of build `mod` on every case, by name."""
    out: dict[str, torch.Tensor] = {}
    for k, n in LINEAR_SHAPES:
        wp = None
        for m in ROWS:
            for bias in (False, True):
                x, wt, b = linear_case(k, n, m, bias)
                wp = mod.pack_linear(wt)
                bp = mod.pack_bias(b) if bias else None
                out[f"linear/{k}x{n}/m{m}/bias{int(bias)}"] = mod.packed_linear(x, wp, bp, n)
                if m in BF16_WEIGHT_ROWS:  # bfloat16 weights, and their float32 widening
                    w16 = wt.bfloat16()
                    for name, w in (("bf16w", w16), ("bf16w-widened", w16.float())):
                        out[f"linear/{k}x{n}/m{m}/bias{int(bias)}/{name}"] = mod.packed_linear(
                            x, mod.pack_linear(w), bp, n)
    for d in HEAD_DIMS:
        for dtype in (torch.float32, torch.bfloat16):
            q, kc, vc, tables, lens = attention_case(d, dtype)
            out[f"attention/d{d}/{dtype}"] = mod.paged_decode_attention(
                q, kc, vc, tables, lens, d**-0.5)
        # a bfloat16 cache: with a float32 query (the runner's float32 products), and the
        # float32 kernel on the widened tensors, which both bfloat16 results must equal
        q, kc, vc, tables, lens = attention_case(d, torch.bfloat16)
        q32 = attention_case(d, torch.float32)[0]
        out[f"attention/d{d}/f32q-bf16kv"] = mod.paged_decode_attention(
            q32, kc, vc, tables, lens, d**-0.5)
        out[f"attention/d{d}/f32q-bf16kv-widened"] = mod.paged_decode_attention(
            q32, kc.float(), vc.float(), tables, lens, d**-0.5)
        out[f"attention/d{d}/bf16-widened"] = mod.paged_decode_attention(
            q.float(), kc.float(), vc.float(), tables, lens, d**-0.5)
    for d in NORM_DIMS:
        g = _gen(d)
        x, w = torch.randn(9, d, generator=g), torch.randn(d, generator=g)
        out[f"rms_norm/d{d}"] = mod.rms_norm(x, w, 1e-6)
        out[f"silu_mul/d{d}"] = mod.silu_mul(torch.randn(9, 2 * d, generator=g) * 4)
    g = _gen(7)
    h, hkv, d = 4, 2, 64
    qkv = torch.randn(5, (h + 2 * hkv) * d, generator=g)
    cos, sin = torch.randn(5, d, generator=g), torch.randn(5, d, generator=g)
    q, k = mod.rope_qk(qkv, cos, sin, h, hkv)
    out["rope/q"], out["rope/k"] = q, k
    for i in range(len(SEGMENT_CASES)):
        for d in HEAD_DIMS:
            q, k, v, cu, causal = segment_case(i, d)
            out[f"segments/{i}/d{d}"] = mod.segment_attention(q, k, v, cu, causal, d**-0.5)
    from tandem.services.language.engine.nucleus import draw_rows

    x, args = nucleus_case()
    out["nucleus/kept"] = torch.empty(x.shape, dtype=torch.float64)
    out["nucleus/ids"] = draw_rows(mod, x, *args, kept=out["nucleus/kept"])
    return out


if __name__ == "__main__":  # child process: this build's outputs, saved to argv[1]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tandem.cpu_kernels import kernels

    mod = kernels()
    if mod is None:
        sys.exit("kernels unavailable")
    torch.set_num_threads(1)
    torch.save({"isa": mod.isa(), "outputs": outputs(mod)}, sys.argv[1])
