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
    buckets  each token's bucket by its distance below the max, `BUCKETS` equal slices of
             [0, span) (the last one also holds everything further: a mass below any
             float32 top_p's reach, `_span`); a bucket never holds a token more likely than
             one of an earlier bucket
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

Exactness: the kept set is the rule's in float64 arithmetic; the full sort's reference sums
float32 probabilities, so the two can differ only on a token whose mass before it is
within float32 rounding (~1e-7) of top_p, and in which of several exactly tied tokens a
cut through their tie keeps. The draw follows the kept weights exactly up to float64
rounding. Everything here reads values on the host as it goes (`int`, `nonzero`): this is
the CPU's path, where the data is on the host already; the CUDA path sorts instead and
never reads (sampler.py).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

NEG_INF = float("-inf")
BUCKETS = 4096  # (int16 bucket ids: the equality passes run on 2-byte lanes)


def _span(vocab: int) -> float:
    """The distance below the max (in units of logit / temperature) that the buckets
    slice: a token further down weighs under e^-span of the max token, and all of them
    together under vocab * e^-span = 2e-9 of the row, below float32's resolution of any
    top_p < 1 (6e-8): the cut never falls among them."""
    return math.log(vocab) + 20.0


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
        self.hist = torch.empty(BUCKETS, dtype=torch.float64)
        self.x_np, self.e64_np, self.w64_np, self.b16_np, self.hist_np = (
            t.numpy() for t in (self.x, self.e64, self.w64, self.b16, self.hist))
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


@dataclass
class Nucleus:
    """One row's kept tokens and what the draw reads. Buckets before `cut` survive whole
    (their kept weight is `cum[:cut]`), bucket `cut` only through `tail`. It reads the
    thread's workspace: valid until the thread's next `nucleus`."""

    ws: _Workspace
    weight: np.ndarray  # [V] float64: exp(x - max) where top-k and min-p keep, else 0
    cum: np.ndarray  # [BUCKETS] float64: running kept weight by bucket
    cut: int  # the bucket top-p cuts in (BUCKETS: no cut)
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
            run = self.weight[ids].cumsum()
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
    z = torch.sub(xt, top, out=ws.z)
    e = torch.exp(z, out=ws.e)
    torch.mul(z, -BUCKETS / _span(ws.vocab), out=ws.f).clamp_(max=BUCKETS - 1)
    ws.b16.copy_(ws.f)  # (truncation: the floor of a distance >= 0)
    bucket = ws.b64.copy_(ws.b16)
    ws.e64.copy_(e)
    cum = ws.hist.zero_().scatter_add_(0, bucket, ws.e64).cumsum(0).numpy()
    cut, tail = BUCKETS, np.empty(0, dtype=np.int64)
    top_p = _f32(top_p)
    if top_p < 1.0:
        target = top_p * float(cum[-1])
        cut = int(cum.searchsorted(target))  # the first bucket reaching it
        above = float(cum[cut - 1]) if cut else 0.0
        ids = ws.in_bucket(cut)
        # the rule's order: probability down, then token id (ids ascending, a stable sort)
        ids = ids[(-ws.x_np[ids]).argsort(kind="stable")]
        ei = ws.e64_np[ids]
        before = ei.cumsum() + above - ei
        over = before >= target
        tail = ids[: max(int(over.argmax()) if over.any() else ids.size, 1)]
    weight = ws.e64_np
    if min_p > 0.0:  # the most likely token weighs exp(0) = 1: keep e >= min_p
        ws.w64.copy_(torch.threshold(e, _below(_f32(min_p)), 0.0, out=ws.f))
        cum = ws.hist.zero_().scatter_add_(0, bucket, ws.w64).cumsum(0).numpy()
        weight = ws.w64_np
    above = float(cum[cut - 1]) if cut else 0.0
    if cut == BUCKETS:
        return Nucleus(ws, weight, cum, cut, tail, weight[:0], above, above)
    tail_cum = weight[tail].cumsum()
    return Nucleus(ws, weight, cum, cut, tail, tail_cum, above, above + float(tail_cum[-1]))
