"""The CPU's truncation and draw for a sampled row: top-k, top-p and min-p without sorting
the vocabulary, and the token drawn at one uniform number (`sampler.py` calls it).

The rules are the sampler's (transformers' and vLLM's): top-k keeps the tokens at or above
the k-th largest logit (ties with it included); top-p then orders the survivors by
probability, highest first, and drops a token when the mass before it already reaches
top_p (so the smallest such set survives, never empty); min-p then drops a token less likely
than min_p times the most likely one. Each keeps a prefix of that order, so their result is
the shortest of the three prefixes. Ties in probability are ordered by token id (a full
sort's tie order is its own: torch's unstable sort keeps no particular one).

How, at a 152K vocabulary, in a few passes over the row instead of a full sort (which
cost 13 ms a row of the sampler's 20 on an AVX2 core, docs/benchmarks.md):

    top-k    x kept at or above the k-th largest (`torch.topk`: no full sort either)
    weights  e = exp(x - max) (the softmax's numerators), summed in float64
    buckets  each token's bucket by its distance below the max, equal slices of [0, SPAN)
             (`buckets`: ~0.01 wide at a 152K vocabulary, fewer for fewer tokens); a bucket never holds a token more likely than one of an earlier
             bucket. A token further down (e < e^-86 = 4e-38, at the float32 softmax's
             underflow; masked tokens too) weighs 0: the full sort's path gives it a
             denormal probability, V of them under 1e-32 a step. It goes to one of `SPREAD`
             more buckets by its id: adds into one bucket wait on each other (a peaked or
             masked row's 100K far tokens in one bucket made the scatter-add 4x slower); and
             exp of an input below -87 takes a slow path (4-8x the pass), so x - max is
             floored there
    cut      the weights summed per bucket (one scatter-add) and accumulated: the first
             bucket whose running mass reaches top_p * total holds the cut. Every earlier
             bucket survives whole, every later one is dropped; only the cut bucket's
             tokens (a few hundred on a flat 152K row) are sorted, and the exact rule runs
             over them
    min-p    e kept at or above min_p (the most likely token weighs 1), the kept weights
             summed per bucket again for the draw
    draw     u in [0, 1) from the request's generator (one number per token); the token at
             which the running mass, in bucket order, passes u * the kept mass: the bucket
             found on the per-bucket sums, then the token among that bucket's (by id; the
             cut bucket's in their sorted order)

The same passes run in C++ for a step's rows at once (`draw_rows`, csrc/nucleus.cpp: the
rules and constants stay here, the kernel is given them): ~25 Python and torch calls a row
cost 2.9 ms a step at 32 rows of a 1,024-token vocabulary, the passes themselves a tenth of
that. Its weights come from the kernels' own exp (csrc/vec16.h's exp_poly) where `nucleus`
takes torch's: the two can differ in the last bit, and only then can they pick another
token for the same u. `nucleus` is the path where the kernels cannot be built, and the
reference the kernel is tested against.

Exactness: the kept set is the rule's in float64 arithmetic; the full sort's reference sums
float32 probabilities, so the two can differ only on a token whose mass before it is
within float32 rounding (~1e-7) of top_p, and in which of several exactly tied tokens a
cut through their tie keeps. The draw follows the kept weights exactly up to float64
rounding. Everything here reads values on the host as it goes (`int`, `nonzero`): this is
the CPU's path, where the data is on the host already; the CUDA path sorts instead and
never reads (sampler.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

NEG_INF = float("-inf")
SPAN = 86.0  # the distances below the max the buckets slice
FLOOR = -87.0  # x - max floored here: exp stays in float32's normal range (its fast path)
SPREAD = 64  # the far tokens' buckets, after the others


def buckets(vocab: int) -> int:
    """How many slices of [0, SPAN) a row of `vocab` tokens takes: 8192 (~0.01 each) at
    131K and more, about 16 tokens a slice down to 1024 slices (~0.08 each) at 16K and
    fewer tokens; few enough for int16 ids (the equality passes run on 2-byte lanes). Not
    fewer: a row's tokens lie within ~10 of its max, so at 64 slices (1.3 each) a 1,024-token
    row's cut bucket held hundreds of them, and their sort was 40% of the compiled path's
    time."""
    return min(8192, max(1024, vocab // 16))


def _f32(v: float) -> float:
    """`v` as the sampler stages it (float32): the reference compares in float32."""
    return float(np.float32(v))


def _below(v: float) -> float:
    """The float32 just below `v`: `torch.threshold(x, _below(v), ...)` keeps x >= v."""
    return float(np.nextafter(np.float32(v), np.float32(NEG_INF)))


class _Workspace:
    """A row's full-length buffers, made once per thread and vocabulary: a pass writes into
    them rather than into fresh tensors (a fresh 1.2 MB tensor is a fresh mapping from the
    allocator, page-faulted in: 1.3 ms a row, more than the passes themselves). The numpy
    views (`*_np`) share their memory: numpy's equality and nonzero over int16 and its
    small-array ops cost a fifth of torch's here."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.x = torch.empty(vocab)  # logits / temperature (top-k applied)
        self.z = torch.empty(vocab)  # x - max
        self.e = torch.empty(vocab)  # exp(z)
        self.f = torch.empty(vocab)  # bucket as a float; min-p's weights
        self.e64 = torch.empty(vocab, dtype=torch.float64)
        self.w64 = torch.empty(vocab, dtype=torch.float64)  # min-p's weights
        self.b16 = torch.empty(vocab, dtype=torch.int16)
        self.b64 = torch.empty(vocab, dtype=torch.long)  # (scatter_add_'s index type)
        self.buckets = buckets(vocab)
        self.all = self.buckets + SPREAD
        self.scale = -self.buckets / SPAN  # a bucket per (x - max) * scale
        self.hist = torch.empty(self.all, dtype=torch.float64)
        # a token's last bucket: a far one, by its id
        self.cap = (torch.arange(vocab) % SPREAD + self.buckets).float()
        self.x_np, self.e64_np, self.w64_np, self.b16_np = (
            t.numpy() for t in (self.x, self.e64, self.w64, self.b16))
        self.hit_np = np.empty(vocab, dtype=bool)

    def in_bucket(self, j: int) -> np.ndarray:
        """The ids of bucket `j`'s tokens, ascending."""
        return np.equal(self.b16_np, j, out=self.hit_np).nonzero()[0]


_local = threading.local()


def _workspace(vocab: int) -> _Workspace:
    ws = getattr(_local, "ws", None)
    if ws is None or ws.vocab != vocab:
        ws = _local.ws = _Workspace(vocab)
    return ws


def _cumsum(a: np.ndarray) -> np.ndarray:
    """(numpy's is 4x slower than torch's on a long array, a 152K tie's; faster on a short)"""
    return a.cumsum() if a.size < 4096 else torch.from_numpy(a).cumsum(0).numpy()


def _running(ws: _Workspace, bucket: torch.Tensor, weight: torch.Tensor) -> np.ndarray:
    """[ws.all] float64: the running weight by bucket; the far buckets' tokens weigh 0."""
    hist = ws.hist.zero_().scatter_add_(0, bucket, weight)
    hist[ws.buckets:] = 0.0
    return hist.cumsum(0).numpy()


@dataclass
class Nucleus:
    """One row's kept tokens and what the draw reads. Buckets before `cut` survive whole
    (their kept weight is `cum[:cut]`), bucket `cut` only through `tail`. It reads the
    thread's workspace: valid until the thread's next `nucleus`."""

    ws: _Workspace
    weight: np.ndarray  # [V] float64: exp(x - max) where top-k and min-p keep, else 0
    cum: np.ndarray  # [ws.all] float64: running kept weight by bucket (flat past the far)
    cut: int  # the bucket top-p cuts in (ws.all: no cut)
    tail: np.ndarray  # [n] int64: bucket `cut`'s kept tokens, in the rule's order
    tail_cum: np.ndarray  # [n] float64: their running weight
    above: float  # the weight of buckets before `cut`
    mass: float  # the kept weight: above + the tail's

    def draw(self, u: float) -> int:
        """The token at which the running kept weight, in bucket order, passes u * mass
        (u in [0, 1))."""
        t = u * self.mass
        if t < self.above:
            j = int(self.cum[:self.cut].searchsorted(t, side="right"))
            ids = self.ws.in_bucket(j)
            run = _cumsum(self.weight[ids])
            local = t - (float(self.cum[j - 1]) if j else 0.0)
        else:
            ids, run, local = self.tail, self.tail_cum, t - self.above
        k = int(run.searchsorted(local, side="right"))
        # rounding can put `local` at the bucket's end: its last token of positive weight
        last = int(run.searchsorted(run[-1]))
        return int(ids[min(k, last)])


def nucleus(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
            ) -> Nucleus:
    """Row `x` [V] (float32 logits, -inf where masked) divided by `temperature`, then cut
    by top-k (0: off), top-p (1: off) and min-p (0: off), each as the sampler stages it."""
    ws = _workspace(x.numel())
    xt = torch.div(x, temperature, out=ws.x)
    if 0 < top_k < ws.vocab:
        kth = torch.topk(xt, top_k, sorted=False).values.min().item()
        torch.threshold(xt, _below(kth), NEG_INF, out=xt)  # keeps x >= kth, ties included
    top = xt.max()
    if top.item() == NEG_INF:  # no token left (a softmax of NaNs before): the first
        return Nucleus(ws, ws.e64_np, ws.e64_np[:0], 0, np.zeros(1, np.int64), np.ones(1),
                       0.0, 1.0)
    z = torch.sub(xt, top, out=ws.z).clamp_(min=FLOOR)
    e = torch.exp(z, out=ws.e)
    torch.minimum(torch.mul(z, ws.scale, out=ws.f), ws.cap, out=ws.f)
    ws.b16.copy_(ws.f)  # (truncation: the floor of a distance >= 0)
    bucket = ws.b64.copy_(ws.b16)
    ws.e64.copy_(e)
    cum = _running(ws, bucket, ws.e64)
    cut, tail = ws.all, np.empty(0, dtype=np.int64)
    top_p = _f32(top_p)
    if top_p < 1.0:
        target = top_p * float(cum[-1])
        cut = int(cum.searchsorted(target))  # the first bucket reaching it
        above = float(cum[cut - 1]) if cut else 0.0
        ids = ws.in_bucket(cut)
        # the rule's order: probability down, then token id (ids ascending, a stable sort)
        ids = ids[(-ws.x_np[ids]).argsort(kind="stable")]
        ei = ws.e64_np[ids]
        before = _cumsum(ei) + above - ei
        over = before >= target
        tail = ids[: max(int(over.argmax()) if over.any() else ids.size, 1)]
    weight = ws.e64_np
    if min_p > 0.0:  # the most likely token weighs exp(0) = 1: keep e >= min_p
        ws.w64.copy_(torch.threshold(e, _below(_f32(min_p)), 0.0, out=ws.f))
        cum = _running(ws, bucket, ws.w64)
        weight = ws.w64_np
    above = float(cum[cut - 1]) if cut else 0.0
    if cut == ws.all:
        return Nucleus(ws, weight, cum, cut, tail, weight[:0], above, above)
    tail_cum = _cumsum(weight[tail])
    return Nucleus(ws, weight, cum, cut, tail, tail_cum, above, above + float(tail_cum[-1]))


def draw_rows(kernels, x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
              top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor,
              kept: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids [S] for rows `x` [S, V] (float32, contiguous), each cut as `nucleus` cuts
    it (temperature [S] float32, top_k [S] int64 with 0 off, top_p [S] float32, min_p [S]
    float32) and drawn at its own u [S] (float64, in [0, 1)), by the compiled kernels
    (`kernels`: tandem.cpu_kernels' module). `kept` [S, V] float64, when given, receives
    each token's weight in its row's draw (0 where cut)."""
    return kernels.nucleus_draw(x, temperature, top_k, top_p, min_p, u,
                                buckets(x.shape[-1]), SPAN, SPREAD, kept)
