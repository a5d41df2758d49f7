"""The CPU's sort-free cut and draw (services/language/engine/nucleus.py), in Python and in
the compiled kernels (`draw_rows`, csrc/nucleus.cpp): the kept set is the full sort's (the
rule computed over a stable full sort in float64, and the sampler's float32 sort path
itself), ties, p near 0 and 1, flat and peaked rows, masked tokens, top-k and min-p
included; the draw follows the kept weights, and the kernel draws the tokens Python draws
(but where their exp differs in the last bit at the draw's point); a row's token does not
depend on the rows beside it; a seed's draws are one uniform per token, reproducible and
handed between instances by the generator state."""

from __future__ import annotations

import pytest
import torch
from language_engine_helpers import cut_row, filter_logits, kept_weights

from tandem.cpu_kernels import kernels
from tandem.sampling import SamplingParams
from tandem.services.language.engine import nucleus
from tandem.services.language.engine.request import Request, RequestSpec
from tandem.services.language.engine.sampler import generator_state, restore_generator, sample
from tandem.transfer.payload import PromptPayload

F32 = nucleus._f32
KERNELS = kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels could not be built")
IMPLS = ["python", pytest.param("kernel", marks=needs_kernels)]


def rule(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept [V] bool, margin [V] float64) by the rule over a full stable sort, in float64:
    top-k (ties at the k-th kept), top-p (drop a token when the mass before it, in order of
    probability down and then id, reaches top_p), min-p (drop e < min_p * the max's); a
    token more than `nucleus.SPAN` below the max weighs 0 (float32's softmax underflow).
    `margin`: how far each token's mass before it is from top_p's mark, relative to the
    row's mass (a token within rounding of it may go either way)."""
    xt = x / F32(temperature)
    if 0 < top_k < x.numel():
        xt = torch.where(xt >= torch.topk(xt, top_k).values[-1], xt, float("-inf"))
    e = torch.exp(xt - xt.max()).double()
    e[xt - xt.max() <= -nucleus.SPAN] = 0.0
    order = torch.sort(xt, descending=True, stable=True).indices
    w = e[order]
    before = w.cumsum(0) - w
    total = w.sum()
    keep = torch.ones_like(w, dtype=torch.bool)
    margin = torch.full_like(w, float("inf"))
    if F32(top_p) < 1.0:
        keep = before < F32(top_p) * total
        margin = (before - F32(top_p) * total).abs() / total
    kept = torch.zeros_like(keep).scatter(0, order, keep) & (e > 0)
    if min_p > 0:
        kept &= e >= F32(min_p)
    return kept, torch.zeros_like(margin).scatter(0, order, margin)


def mine(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
         ) -> torch.Tensor:
    nu = nucleus.nucleus(x, F32(temperature), top_k, top_p, min_p)
    return kept_weights(nu) > 0


def kernel_draws(x: torch.Tensor, cuts: list[tuple], us: list[float]
                 ) -> tuple[list[int], torch.Tensor]:
    """The kernel's tokens for rows `x` [S, V] (or one row [V] for every u), cut by `cuts`
    (one (temperature, top_k, top_p, min_p) per row), drawn at `us`; and their kept
    weights [S, V]."""
    s = len(us)
    x = (x[None].expand(s, -1) if x.dim() == 1 else x).contiguous()
    vocab = x.shape[-1]
    kept = torch.empty(s, vocab, dtype=torch.float64)
    ids = nucleus.draw_rows(
        KERNELS, x, torch.tensor([F32(c[0]) for c in cuts]),
        torch.tensor([c[1] if 0 < c[1] < vocab else 0 for c in cuts]),
        torch.tensor([F32(c[2]) for c in cuts]), torch.tensor([F32(c[3]) for c in cuts]),
        torch.tensor(us, dtype=torch.float64), kept)
    return ids.tolist(), kept


def kept_by(impl: str, x: torch.Tensor, *cut) -> torch.Tensor:
    """[V] bool: what `impl` (python: `nucleus`; kernel: `draw_rows`) keeps of row `x`."""
    if impl == "python":
        return mine(x, *cut)
    return kernel_draws(x, [cut], [0.5])[1][0] > 0


def rows(vocab: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(vocab, generator=g)
    masked = r * 3
    masked[torch.rand(vocab, generator=g) < 0.4] = float("-inf")
    one = torch.full((vocab,), float("-inf"))
    one[vocab // 3] = 0.5
    return {
        "flat": r,  # the benchmark's: at T 0.8 and p 0.95 two thirds of 152K survive
        "peaked": r * 6,
        "zipf": -1.1 * torch.log(torch.randperm(vocab, generator=g).double() + 1).float(),
        "ties": torch.randint(-12, 3, (vocab,), generator=g).float() / 2,  # big tie groups
        "bf16": (r * 2).bfloat16().float(),  # a bfloat16 model's logits: many exact ties
        "masked": masked,  # a grammar's -inf
        "one-token": one,
        "all-equal": torch.zeros(vocab),
    }


CUTS = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1e-6, 0.0), (0.8, 0, 0.05, 0.0), (1.0, 0, 0.5, 0.0), (0.8, 0, 0.95, 0.0),
    (1.3, 0, 0.999, 0.0), (1.0, 0, 0.9999999, 0.0), (0.3, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.0),
    (0.8, 40, 0.95, 0.0), (1.0, 1, 0.9, 0.0), (1.0, 7, 1.0, 0.0), (0.7, 0, 0.95, 0.05),
    (1.0, 0, 1.0, 0.3), (1.0, 0, 0.3, 0.5), (0.9, 20, 0.8, 0.1), (1e-6, 0, 0.9, 0.0),
    (0.2, 0, 1.0, 0.0), (0.25, 3, 1.0, 0.0),  # peaked: tokens past SPAN
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("vocab", [50, 1024, 151936])
def test_the_kept_set_is_the_rules_over_a_full_sort(vocab, impl):
    """Every case: the same kept set as the float64 rule, but for a token whose mass before
    it lies within 1e-12 of top_p's mark and not on it (the two sum in different orders;
    a mass exactly on the mark, as all-equal's at p 0.5, drops the token in both)."""
    cases = CUTS if vocab < 151936 else [c for c in CUTS if c[1] in (0, 40)][::2]
    for seed in range(2 if vocab < 151936 else 1):
        for name, x in rows(vocab, seed).items():
            for cut in cases:
                want, margin = rule(x, *cut)
                got = kept_by(impl, x, *cut)
                differ = got != want
                near = (margin > 0) & (margin < 1e-12)
                assert not (differ & ~near).any(), (name, cut, differ.nonzero())
                assert got.any(), (name, cut)


@pytest.mark.parametrize("vocab", [64, 4096])
def test_the_kept_set_is_the_sort_paths_float32_one(vocab):
    """Against the sampler's own float32 full-sort path (`_filter`, CUDA's): the same kept
    set where no token's mass before it is within float32 rounding of top_p, and, where
    ties straddle the cut (its sort keeps no particular tie order), as many tokens of the
    same mass. The rounding is that of the sort path's float32 cumsum over the vocabulary:
    at most (V - 1) u of the row's mass in any summation order (u = 2^-24), so the bound
    grows with V; the order is torch's and differs between CPUs (an Intel Xeon's cumsum
    over 4096 ties was 1.16e-6 off the float64 mark, past a fixed 1e-6)."""
    bound = vocab * 2.0**-24
    for seed in range(3):
        for name, x in rows(vocab, seed).items():
            for t, k, p, m in CUTS:
                if t < 1e-3:  # x / 1e-6 overflows float32's exp range: the rule's test only
                    continue
                params = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
                kept = filter_logits(x, params, "sort")
                # (a token SPAN below the max: a denormal probability there, 0 here)
                old = ~torch.isinf(kept) & (kept - kept.max() > -nucleus.SPAN)
                new = ~torch.isinf(filter_logits(x, params, "nucleus"))
                _, margin = rule(x, t, k, p, m)
                if (margin < bound).any():
                    continue
                if name in ("ties", "bf16", "all-equal", "one-token"):
                    assert int(old.sum()) == int(new.sum()), (name, t, k, p, m)
                    xt = x / F32(t)
                    assert torch.equal(xt[old].sort().values, xt[new].sort().values)
                else:
                    assert torch.equal(old, new), (name, t, k, p, m)


@pytest.mark.parametrize("impl", IMPLS)
def test_ties_at_the_cut_keep_the_lowest_ids(impl):
    """Four tokens tied at the top (weights 1 of 4.06 in all) and p = 0.5: the mass before
    the third is 2 of the mark's 2.03, so the first three by id survive."""
    x = torch.tensor([0.0, 5.0, -1.0, 5.0, 5.0, 2.0, 5.0])
    got = kept_by(impl, x, 1.0, 0, 0.5, 0.0)
    assert got.nonzero().squeeze(1).tolist() == [1, 3, 4]
    # a mass before exactly on the mark drops the token: 2 of 4 equal tokens at p 0.5
    four = kept_by(impl, torch.zeros(4), 1.0, 0, 0.5, 0.0)
    assert four.nonzero().squeeze(1).tolist() == [0, 1]
    # top-k keeps every token tied with the k-th
    assert kept_by(impl, x, 1.0, 2, 1.0, 0.0).nonzero().squeeze(1).tolist() == [1, 3, 4, 6]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ["flat", "peaked", "ties", "masked"])
@pytest.mark.parametrize("cut", [(1.0, 0, 1.0, 0.0), (0.8, 0, 0.95, 0.0), (1.0, 5, 0.9, 0.0),
                                 (0.7, 0, 0.9, 0.08)])
def test_the_draw_follows_the_kept_weights(case, cut, impl):
    """u on an even grid of N points: a token is drawn for the part of [0, 1) its weight
    takes, to within a grid point at each end (the kernel: every u a row of one call)."""
    x = rows(300, 7)[case]
    n = 4000
    us = [(i + 0.5) / n for i in range(n)] + [0.0, 1.0 - 2.0**-53]  # and the ends of [0, 1)
    if impl == "python":
        nu = nucleus.nucleus(x, F32(cut[0]), *cut[1:])
        w = kept_weights(nu)
        ids = [nu.draw(u) for u in us]
        assert nu.mass == pytest.approx(float(w.sum()), rel=1e-12)
    else:
        ids, kept = kernel_draws(x, [cut] * len(us), us)
        w = kept[0]
        assert torch.equal(kept, w[None].expand_as(kept))  # every row the same cut
    counts = torch.zeros(300, dtype=torch.float64)
    for t in ids[:n]:
        counts[t] += 1
    assert torch.all(counts[w == 0] == 0)
    assert w[ids[n]] > 0 and w[ids[n + 1]] > 0
    off = (counts - n * w / w.sum()).abs()
    assert torch.all(off <= 2.0), off.max()


@needs_kernels
@pytest.mark.parametrize("vocab", [50, 1024, 151936])
def test_the_kernel_draws_the_tokens_nucleus_draws(vocab):
    """Every row kind and cut, 48 uniforms each: the kernel keeps what `nucleus` keeps and
    draws the token it draws for the same u. Their weights' exp may differ in the last bit
    (torch's and csrc/vec16.h's exp_poly), which moves a token's edge in [0, 1) by ~1e-7 of
    its weight: a u that falls there may take the neighbour, at most 1 in 1,000 here."""
    g = torch.Generator().manual_seed(5)
    cases = CUTS if vocab < 151936 else CUTS[::3]
    same = total = 0
    for name, x in rows(vocab, 3).items():
        for cut in cases:
            us = torch.rand(48, dtype=torch.float64, generator=g).tolist()
            nu = nucleus.nucleus(x, F32(cut[0]), *cut[1:])
            ids, kept = kernel_draws(x, [cut] * len(us), us)
            assert torch.equal(kept[0] > 0, kept_weights(nu) > 0), (name, cut)
            assert all(kept[0, t] > 0 for t in ids), (name, cut)
            same += sum(nu.draw(u) == t for u, t in zip(us, ids, strict=True))
            total += len(us)
    assert total - same <= total // 1000, (total - same, total)


@needs_kernels
def test_a_kernel_row_is_drawn_alone_whatever_shares_the_call():
    """Rows of one call with their own cuts: each row's token and kept weights are those of
    the same row drawn alone (the seed contract: a row from that row only)."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(7, 5000, generator=g) * torch.tensor([1, 3, 0.5, 2, 1, 4, 6])[:, None]
    x[3, ::3] = float("-inf")
    cuts = [(0.8, 0, 0.95, 0.0), (1.0, 50, 0.9, 0.0), (1.2, 0, 0.3, 0.0), (0.5, 0, 1.0, 0.1),
            (1.0, 3, 1.0, 0.0), (0.9, 0, 0.999, 0.0), (1.0, 0, 0.5, 0.2)]
    us = torch.rand(7, dtype=torch.float64, generator=g).tolist()
    ids, kept = kernel_draws(x, cuts, us)
    for r in range(7):
        alone, kept_alone = kernel_draws(x[r:r + 1], cuts[r:r + 1], us[r:r + 1])
        assert alone == [ids[r]] and torch.equal(kept_alone[0], kept[r]), r
        assert torch.equal(kept[r] > 0, rule(x[r], *cuts[r])[0]), r


@needs_kernels
def test_the_kernel_refuses_what_it_cannot_read():
    x = torch.randn(2, 10)
    ok = dict(temperature=torch.ones(2), top_k=torch.zeros(2, dtype=torch.long),
              top_p=torch.ones(2), min_p=torch.zeros(2), u=torch.rand(2, dtype=torch.float64))
    assert len(nucleus.draw_rows(KERNELS, x, **ok)) == 2
    for name, bad in (("u", torch.rand(2)), ("temperature", torch.ones(3)),
                      ("top_k", torch.zeros(2))):
        with pytest.raises(RuntimeError, match=name):
            nucleus.draw_rows(KERNELS, x, **{**ok, name: bad})
    with pytest.raises(RuntimeError, match=r"x must be contiguous \[S, V\] float32"):
        nucleus.draw_rows(KERNELS, x.t(), **ok)
    with pytest.raises(RuntimeError, match="kept must be"):
        nucleus.draw_rows(KERNELS, x, **ok, kept=torch.empty(2, 10))


def test_rows_with_their_own_cuts_in_one_batch():
    """Rows of one step with different temperatures, top-k, top-p and min-p: each row's
    kept set is the rule's for its own values (`_cut_cpu` through the sampler's staging)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 2000, generator=g) * torch.tensor([1, 3, 0.5, 2, 1, 4])[:, None]
    cuts = [(0.8, 0, 0.95, 0.0), (1.0, 50, 0.9, 0.0), (1.2, 0, 0.3, 0.0), (0.5, 0, 1.0, 0.1),
            (1.0, 3, 1.0, 0.0), (0.9, 0, 0.999, 0.0)]
    for row, (t, k, p, m) in zip(x, cuts, strict=True):
        nu = cut_row(row, SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m))
        assert torch.equal(kept_weights(nu) > 0, rule(row, t, k, p, m)[0])


def req(rid=1, **kw) -> Request:
    return Request(RequestSpec(rid, SamplingParams(**kw), PromptPayload.of_token_ids([1, 2, 3])))


def test_a_seed_takes_one_uniform_per_token_and_its_state_hands_over():
    """A sampled token takes one float64 uniform from the request's generator (the whole
    draw: the old path took V exponentials); a second instance given the generator state
    (E/P/D's handoff) continues the same tokens."""
    g = torch.Generator().manual_seed(3)
    steps = [torch.randn(1, 5000, generator=g) * 2 for _ in range(8)]
    a = req(temperature=0.8, top_p=0.9, seed=21)
    first = [sample(s, [a]).token_ids[0] for s in steps[:3]]
    state = generator_state(a)
    rest = [sample(s, [a]).token_ids[0] for s in steps[3:]]

    twin = torch.Generator().manual_seed(21)
    for _ in range(3):
        torch.rand((), dtype=torch.float64, generator=twin)
    assert torch.equal(torch.frombuffer(bytearray(state), dtype=torch.uint8),
                       twin.get_state())

    b = req(temperature=0.8, top_p=0.9, seed=99)
    restore_generator(b, state, torch.device("cpu"))
    assert [sample(s, [b]).token_ids[0] for s in steps[3:]] == rest
    again = req(temperature=0.8, top_p=0.9, seed=21)
    assert [sample(s, [again]).token_ids[0] for s in steps] == first + rest


@pytest.mark.parametrize("impl", IMPLS)
def test_no_token_left_draws_the_first(impl):
    """A row with every token at -inf (nothing upstream leaves one; the old path's softmax
    of NaNs drew token 0): token 0, no error."""
    x = torch.full((1, 10), float("-inf"))
    k = KERNELS if impl == "kernel" else None
    assert sample(x, [req(temperature=1.0, top_p=0.9, seed=1)], kernels=k).token_ids == [0]


def test_the_workspace_is_per_thread_and_per_vocabulary():
    import threading

    seen = []
    t = threading.Thread(target=lambda: seen.append(nucleus._workspace(77)))
    t.start()
    t.join()
    here = nucleus._workspace(77)
    assert seen[0] is not here and here is nucleus._workspace(77)
    assert nucleus._workspace(78) is not here
