"""Token sampling: greedy, temperature, top-k, top-p, min-p, typical-p, penalties, a logit
bias and min_tokens, per-request seeded generators: one pass over the batch, and one host
sync per step.

A step (`sample`), each request's parameters touching only its own row:

    values   every per-row value (the rows to read, temperatures, top-k/p, min-p, the
             logprob rows) in one upload, non_blocking
    grammar  a structured-output row keeps only the tokens its grammar allows next
             (`grammar.apply_masks`)
    shape    a row with a bias, a penalty or min_tokens, in place, in this order:
             logit_bias (added), repetition_penalty (transformers': over prompt + output
             ids, a positive logit divided, a negative one multiplied), presence and
             frequency penalties (OpenAI: logit -= count * frequency + (count > 0) *
             presence, over generated ids), min_tokens (EOS and stop ids at -inf until that
             many tokens are out); if that leaves no token, the grammar's mask alone holds
             -- greedy rows too. Their inputs stay on the device (`PenaltyState`: the ids
             seen and generated, each once, with counts; a step uploads only what the token
             generated since adds), and each touches only the ids it names
    filter   the sampled rows together, each by its own values: temperature, top-k, top-p,
             min_p (a token below min_p * the top token's probability is dropped); typical_p
             (transformers' locally typical sampling) a row at a time. On the CPU by
             `nucleus.py`'s cuts, without sorting the vocabulary: a step's rows in one
             call of the compiled kernels (csrc/nucleus.cpp), or a row at a time where
             they are not built (a typical_p row a row at a time, through the sort first,
             which it needs)
    draw     a sampled row on CUDA: Exp(1) noise from the request's own generator, token =
             argmax(probs / noise) (torch.multinomial's one-sample draw, the same bits,
             without the host reads of its checks); on the CPU: one uniform number u from
             the request's generator, token = where the running kept mass passes u * the
             kept mass (`nucleus.py`; V exponentials cost 3.3 ms a row at a 152K
             vocabulary there); a greedy row: argmax
    out      ids, logprobs and top_logprobs in one copy to the host: the step's host sync
             (the CPU's sort-free path reads values as it goes: they are on the host, no
             device waits; CUDA's path never does, tests/test_host_syncs.py)

Logprobs (and top_logprobs) are those of the model's own distribution, softmax(logits /
temperature) before shaping and truncation (plain softmax for greedy), as the wire
contract says.

The seed contract. A request's draws come only from its own `torch.Generator` (seeded from
its `seed`; when it has none, from the engine's seeded sequence (`--seed`) or the OS's
randomness), one draw per generated token (CUDA: V exponentials; the CPU: one float64
uniform), on whatever device it runs; a retraction (which never re-samples a token) does
not change them. What a seed then fixes:

  CPU   the same tokens whatever else shares the batch: a row's logits do not depend on
        the batch (tests/test_language_engine.py), and every op here computes a row from
        that row alone, in the same order whatever the batch (tests/test_sampler.py). (The
        sort-free path changed which tokens a seed gives on the CPU: the same distribution,
        another draw. The compiled cut and the Python one can differ in the last bit of a
        weight, and then, rarely, in the token for a u: a seed's tokens are those of its
        build.)
  CUDA  the same tokens for the same batches (the same requests and steps, on the same GPU
        and software: the kernels are deterministic). Across batch compositions only the
        draws are the request's own: a decode graph pads the batch to its bucket, and
        cuBLAS picks GEMM kernels (and their reduction order) by shape, so a row's logits
        can differ in the last bits with the batch, and a draw that falls that close to
        the edge between two tokens can take the other one. Making it hold would take
        batch-invariant kernels for every GEMM, attention and reduction of the model.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from tandem.sampling import SamplingParams
from tandem.services.language.engine.grammar import apply_masks
from tandem.services.language.engine.nucleus import Nucleus, draw_rows, nucleus
from tandem.services.language.engine.request import Request

NEG_INF = float("-inf")


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]  # None where the request did not ask for logprobs
    top_logprobs: list[list[tuple[int, float]]]  # [] where it did not ask for them


@dataclass
class PenaltyState:
    """A shaping request's inputs on the sampling device (`SamplingState.penalties`), kept
    across its steps. The host keeps which ids they hold, so a step uploads only what is new
    since the last (the token generated since: an id, or the position of a count to raise),
    with the step's other values: neither the prompt nor the output travels again. The
    repetition and presence/frequency penalties read and write only the ids they hold."""

    device: torch.device
    vocab: int
    bias_ids: torch.Tensor | None = None  # [n] logit_bias ids below vocab (None: no bias)
    bias_values: torch.Tensor | None = None  # [n] float32, their biases
    ends: torch.Tensor | None = None  # [n] EOS and stop ids below vocab, for min_tokens
    seen: set[int] = field(default_factory=set)  # prompt and output ids (repetition)
    seen_ids: torch.Tensor | None = None  # [len(seen)] the same, on the device
    position: dict[int, int] = field(default_factory=dict)  # generated id -> its out_ids index
    out_ids: torch.Tensor | None = None  # [m] generated ids, each once (presence/frequency)
    out_counts: torch.Tensor | None = None  # [m] float32: how often each was generated
    num_counted: int = 0  # output ids folded in


@dataclass
class _PenaltyNews:
    """What one step adds to a row's `PenaltyState` (host values, staged for the upload)."""

    row: int
    state: PenaltyState
    first: bool  # a new state: the bias and end ids go up too
    seen: list[int]  # ids not seen before
    new_out: list[int]  # generated ids not generated before
    raised: list[int]  # out_ids positions of ids generated again


def _penalty_news(j: int, req: Request, vocab: int, device: torch.device, eos: frozenset[int],
                  staged: _Staged) -> _PenaltyNews:
    """Stage what row `j`'s state lacks (a new state the first time, or for another device
    or vocabulary, or if the output is shorter than what it holds)."""
    p, st = req.sampling, req.sampler.penalties
    first = (st is None or st.device != device or st.vocab != vocab
             or st.num_counted > len(req.output_ids))
    if first:
        st = req.sampler.penalties = PenaltyState(device, vocab)
        bias = {t: b for t, b in p.logit_bias.items() if t < vocab}
        ends = sorted(t for t in set(eos) | set(p.stop_token_ids) if t < vocab)
        staged.add(f"bias_ids{j}", list(bias))
        staged.add(f"bias_values{j}", list(bias.values()), floating=True)
        staged.add(f"ends{j}", ends if p.min_tokens else [])
    news = _PenaltyNews(j, st, first, [], [], [])
    fresh = req.output_ids[st.num_counted:]
    if p.repetition_penalty != 1.0:
        for t in (req.prompt_token_ids() if first else []) + fresh:
            if t < vocab and t not in st.seen:
                st.seen.add(t)
                news.seen.append(t)
    if p.presence_penalty or p.frequency_penalty:
        for t in fresh:
            if t >= vocab:
                continue
            if t in st.position:
                news.raised.append(st.position[t])
            else:
                st.position[t] = len(st.position)
                news.new_out.append(t)
    st.num_counted = len(req.output_ids)
    staged.add(f"seen{j}", news.seen)
    staged.add(f"new_out{j}", news.new_out)
    staged.add(f"raised{j}", news.raised)
    return news


def _apply_news(news: _PenaltyNews, t: dict[str, torch.Tensor]) -> None:
    """Add a step's news (uploaded in `t`) to the row's state on the device. (What the
    state keeps is its own copy: a slice would keep the step's whole upload alive.)"""
    st, j = news.state, news.row
    if news.first:
        if t[f"bias_ids{j}"].numel():
            st.bias_ids = t[f"bias_ids{j}"].clone()
            st.bias_values = t[f"bias_values{j}"].clone()
        if t[f"ends{j}"].numel():
            st.ends = t[f"ends{j}"].clone()
    if news.seen:
        new = t[f"seen{j}"]
        st.seen_ids = new.clone() if st.seen_ids is None else torch.cat([st.seen_ids, new])
    if news.new_out:
        new = t[f"new_out{j}"]
        ones = torch.ones(new.shape[0], device=st.device)
        st.out_ids = new.clone() if st.out_ids is None else torch.cat([st.out_ids, new])
        st.out_counts = ones if st.out_counts is None else torch.cat([st.out_counts, ones])
    if news.raised:
        st.out_counts.index_add_(0, t[f"raised{j}"],
                                 torch.ones(len(news.raised), device=st.device))


def _shape_row(x: torch.Tensor, req: Request, st: PenaltyState) -> None:
    """Apply the request's bias, penalties and min_tokens to its row [V] in place (the
    module docstring gives the order)."""
    p = req.sampling
    if st.bias_ids is not None:
        x[st.bias_ids] += st.bias_values
    if st.seen_ids is not None:
        r, v = p.repetition_penalty, x[st.seen_ids]
        x[st.seen_ids] = torch.where(v > 0, v / r, v * r)
    if st.out_ids is not None:  # count > 0 at each: logit -= count * frequency + presence
        x[st.out_ids] -= st.out_counts * p.frequency_penalty + p.presence_penalty
    if st.ends is not None and len(req.output_ids) < p.min_tokens:
        x[st.ends] = NEG_INF


def _upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values on `device` without a host sync: a non_blocking copy (from page-locked
    memory on a real GPU; torch's caching host allocator keeps it until the copy ran)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    if torch.cuda.is_available():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class _Staged:
    """This step's host values, uploaded as one int64 and one float32 copy and sliced into
    named tensors on the device (`_upload`: no host sync)."""

    def __init__(self) -> None:
        self.ints: list[int] = []
        self.floats: list[float] = []
        self.spans: dict[str, tuple[bool, int, int]] = {}

    def add(self, name: str, values: list, floating: bool = False) -> None:
        buf = self.floats if floating else self.ints
        self.spans[name] = (floating, len(buf), len(buf) + len(values))
        buf.extend(values)

    def upload(self, device: torch.device) -> dict[str, torch.Tensor]:
        ints, floats = (_upload(v, dtype, device) if v else torch.empty(0, dtype=dtype,
                                                                      device=device)
                        for v, dtype in ((self.ints, torch.long), (self.floats, torch.float32)))
        return {name: (floats if f else ints)[a:b] for name, (f, a, b) in self.spans.items()}


def _stage_filters(staged: _Staged, ps: list[SamplingParams], vocab: int) -> None:
    """What `_filter` reads for rows with parameters `ps`: neutral values where a row
    does not use a filter (top-k index -1: off)."""
    staged.add("temperature", [max(p.temperature, 1e-6) for p in ps], floating=True)
    staged.add("top_k", [p.top_k - 1 if 0 < p.top_k < vocab else -1 for p in ps])
    staged.add("top_p", [p.top_p for p in ps], floating=True)
    staged.add("min_p", [p.min_p for p in ps], floating=True)


def _filter(x: torch.Tensor, ps: list[SamplingParams], t: dict[str, torch.Tensor]
            ) -> torch.Tensor:
    """Rows [S, V] -> temperature-scaled logits with truncated tokens at -inf: top-k, then
    top-p, min-p, typical-p, each row by its own parameters (`ps`, staged in `t`)."""
    vocab = x.shape[-1]
    x = x / t["temperature"][:, None]
    ks = [p.top_k for p in ps if 0 < p.top_k < vocab]
    if ks:
        kth = torch.topk(x, max(ks), dim=-1).values.gather(1, t["top_k"].clamp(min=0)[:, None])
        kth = torch.where(t["top_k"][:, None] >= 0, kth, NEG_INF)
        x = x.masked_fill(x < kth, NEG_INF)
    if any(p.top_p < 1.0 for p in ps):
        top_p = t["top_p"][:, None]
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the mass *before* it already reaches top_p: the smallest set
        # whose mass is >= top_p survives (never empty: the first token always stays).
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = (mass_before >= top_p) & (top_p < 1.0)
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), NEG_INF)
    if any(p.min_p > 0.0 for p in ps):
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < t["min_p"][:, None] * probs.amax(dim=-1, keepdim=True),
                          NEG_INF)
    for k, p in enumerate(ps):  # rare: a row at a time (a sum over the row: see above)
        if p.typical_p < 1.0:
            x[k] = _typical(x[k], p.typical_p)
    return x


def _typical(x: torch.Tensor, mass: float) -> torch.Tensor:
    """Keep the tokens whose surprise (-log p) is closest to the entropy, fewest first,
    until their mass reaches `mass` (transformers' TypicalLogitsWarper, one row)."""
    logp = torch.log_softmax(x, dim=-1)
    entropy = -(logp * logp.exp()).nansum()  # nansum: -inf * 0 of dropped tokens
    distance, order = torch.sort((-logp - entropy).abs())
    mass_upto = torch.softmax(x[order], dim=-1).cumsum(dim=-1)
    last = (mass_upto < mass).sum().clamp(max=x.numel() - 1)[None]  # (a 0-dim index: a read)
    drop_sorted = distance > distance[last]
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return x.masked_fill(drop, NEG_INF)


def _generator(req: Request, device: torch.device) -> torch.Generator:
    if req.sampler.generator is None or req.sampler.generator.device != device:
        seed = next((s for s in (req.sampling.seed, req.sampler.seed) if s is not None), None)
        if seed is None:
            seed = secrets.randbits(63)
        g = torch.Generator(device=device)
        g.manual_seed(seed & ((1 << 63) - 1))
        req.sampler.generator = g
    return req.sampler.generator


def generator_state(req: Request) -> bytes:
    """The request's generator state (b"" when no draw made one): E/P/D hands it from the
    prefill instance to the decode instance with the first token."""
    g = req.sampler.generator
    return bytes(g.get_state().numpy().tobytes()) if g is not None else b""


def restore_generator(req: Request, state: bytes, device: torch.device) -> None:
    """Continue the draws of a request handed off by a prefill instance: its generator as
    `generator_state` gave it there (nothing when b""), so the seed contract holds across
    the two instances. NOTE: a CPU generator's state; a CUDA one's differs (P/D is CPU only)."""
    if not state:
        return
    g = torch.Generator(device=device)
    g.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    req.sampler.generator = g


# The CPU's sampled rows take `nucleus.py` (cuts without sorting the vocabulary, the draw at
# one uniform number): a full sort and V exponentials cost 16 of a row's 20 ms at a 152K
# vocabulary on an AVX2 core (docs/benchmarks.md). False: the CPU runs CUDA's path below (tests
# check both).
CPU_SORT_FREE = True
# CUDA's path: rows filtered and drawn in one pass, all of them (kernel launches are the
# cost); on the CPU (CPU_SORT_FREE off) one at a time, where a row's chain of ops then stays
# in cache (a 32-row pass over a 152K vocabulary streams 19 MB through every op: 1.1-1.4x
# slower, docs/benchmarks.md).
CPU_PASS_ROWS = 1


_FILTERS = ("temperature", "top_k", "top_p", "min_p")


def _cut_cpu(x: torch.Tensor, p: SamplingParams, t: dict[str, torch.Tensor],
             host: dict[str, list], k: int) -> Nucleus:
    """Row `x` [V] of the k-th sampled request (parameters `p`, staged in `t`, read back
    in `host`) cut by `nucleus`; a typical_p row first by `_filter`, whose sort it needs."""
    if p.typical_p < 1.0:  # rare: the sorting filters, typical-p last
        part = {n: t[n][k:k + 1] for n in _FILTERS}
        return nucleus(_filter(x[None], [p], part)[0], 1.0, 0, 1.0, 0.0)
    # (the division as _filter's: by the staged float32 temperature)
    return nucleus(x, host["temperature"][k], host["top_k"][k] + 1, host["top_p"][k],
                   host["min_p"][k])


def _draw_cpu(xs: torch.Tensor, reqs: list[Request], t: dict[str, torch.Tensor], kernels
              ) -> torch.Tensor:
    """Token ids [S] drawn for the sampled rows `xs` [S, V] of `reqs` on the CPU: each row
    cut as `nucleus` cuts it, then drawn at one uniform number from its request's generator
    (drawn first, in row order): all of them in one call of the compiled kernels
    (`nucleus.draw_rows`) where `kernels` is given, else, and for a typical_p row, a row at
    a time by `_cut_cpu`."""
    u = torch.tensor([torch.rand((), dtype=torch.float64, generator=_generator(r, xs.device))
                      .item() for r in reqs], dtype=torch.float64)
    fast = [k for k, r in enumerate(reqs) if kernels is not None and r.sampling.typical_p == 1.0]
    slow = sorted(set(range(len(reqs))) - set(fast))
    drawn = torch.zeros(len(reqs), dtype=torch.long)
    if fast:
        x, cuts = xs, (t["temperature"], t["top_k"] + 1, t["top_p"], t["min_p"], u)
        if slow:  # the fast rows only
            at = torch.tensor(fast)
            x, cuts = x.index_select(0, at), tuple(c.index_select(0, at) for c in cuts)
        got = draw_rows(kernels, x.contiguous(), *cuts)
        drawn = drawn.index_copy_(0, at, got) if slow else got
    if slow:
        host = {n: t[n].tolist() for n in _FILTERS}
        for k in slow:
            drawn[k] = _cut_cpu(xs[k], reqs[k].sampling, t, host, k).draw(float(u[k]))
    return drawn


def _draw(xs: torch.Tensor, reqs: list[Request], t: dict[str, torch.Tensor], kernels
          ) -> torch.Tensor:
    """Token ids [S] drawn for the sampled rows `xs` [S, V] of `reqs`."""
    device, n = xs.device, xs.shape[0]
    if device.type == "cpu" and CPU_SORT_FREE:
        return _draw_cpu(xs, reqs, t, kernels)
    step = CPU_PASS_ROWS if device.type == "cpu" else n
    drawn = []
    for a in range(0, n, step):
        b = min(a + step, n)
        part = {k: t[k][a:b] for k in _FILTERS}
        probs = torch.softmax(_filter(xs[a:b], [r.sampling for r in reqs[a:b]], part), dim=-1)
        # torch.multinomial's draw of one sample, without its checks' host reads: each
        # row's own Exp(1) noise from its own generator, then argmax(probs / noise)
        noise = torch.empty_like(probs)
        for k, r in enumerate(reqs[a:b]):
            noise[k].exponential_(generator=_generator(r, device))
        drawn.append((probs / noise).argmax(dim=-1))
    return drawn[0] if len(drawn) == 1 else torch.cat(drawn)


def sample(logits: torch.Tensor, reqs: list[Request], eos: frozenset[int] = frozenset(),
           rows: list[int] | None = None, kernels=None) -> SampleResult:
    """Pick one token for each of `reqs`: request j reads row `rows[j]` of `logits`
    [N, V] (row j when `rows` is None). `eos` are the model's end ids (held back by
    min_tokens). `kernels`: tandem.cpu_kernels' compiled module, which cuts and draws the
    CPU's sampled rows in one call (None: `nucleus` a row at a time; the engine passes its
    runner's, `ModelRunner.sampler_kernels`). One host sync: the result's copy to the
    host."""
    n = len(reqs)
    if logits.dim() != 2 or (logits.shape[0] != n if rows is None else len(rows) != n):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {n} requests")
    device, vocab = logits.device, logits.shape[-1]
    sampled = [j for j, r in enumerate(reqs) if not r.sampling.greedy]
    shaped = [j for j, r in enumerate(reqs) if r.sampling.shapes_logits]
    want = [j for j, r in enumerate(reqs) if r.sampling.logprobs]
    staged = _Staged()
    select = rows is not None and list(rows) != list(range(logits.shape[0]))
    if select:
        staged.add("rows", list(rows))
    if 0 < len(sampled) < n:
        staged.add("sampled", sampled)
    _stage_filters(staged, [reqs[j].sampling for j in sampled], vocab)
    if 0 < len(want) < n:
        staged.add("want", want)
    staged.add("want_temperature", [reqs[j].sampling.temperature or 1.0 for j in want],
               floating=True)
    news = [_penalty_news(j, reqs[j], vocab, device, eos, staged) for j in shaped]
    t = staged.upload(device)

    raw = (logits.index_select(0, t["rows"]) if select else logits).float()
    masked = apply_masks(raw, [r.sampler.matcher for r in reqs])  # structured output
    x = masked
    if shaped:
        x = masked.clone()
        for j, nw in zip(shaped, news, strict=True):
            _apply_news(nw, t)
            _shape_row(x[j], reqs[j], nw.state)
            # shaping took away every token the grammar allows: the grammar's mask holds
            x[j] = torch.where(torch.isinf(x[j]).all(), masked[j], x[j])
    tokens = torch.argmax(x, dim=-1) if len(sampled) < n else None  # greedy rows
    if sampled:
        xs = x if len(sampled) == n else x.index_select(0, t["sampled"])
        drawn = _draw(xs, [reqs[j] for j in sampled], t, kernels)
        tokens = drawn if tokens is None else tokens.index_copy(0, t["sampled"], drawn)

    parts = [tokens.double()]
    top_n = max((reqs[j].sampling.top_logprobs for j in want), default=0)
    if want:
        rw = raw if len(want) == n else raw.index_select(0, t["want"])
        tw = tokens if len(want) == n else tokens.index_select(0, t["want"])
        lp = torch.log_softmax(rw / t["want_temperature"][:, None], dim=-1)
        parts.append(lp.gather(1, tw[:, None])[:, 0].double())
        if top_n:
            top = torch.topk(lp, top_n, dim=-1)
            parts += [top.indices.double().flatten(), top.values.double().flatten()]
    host = torch.cat(parts).cpu().tolist()  # the step's one host sync

    out_lp: list[float | None] = [None] * n
    out_top: list[list[tuple[int, float]]] = [[] for _ in reqs]
    w = len(want)
    for k, j in enumerate(want):
        out_lp[j] = host[n + k]
        m = reqs[j].sampling.top_logprobs
        a = n + w + k * top_n
        b = n + w + w * top_n + k * top_n
        out_top[j] = [(int(i), v) for i, v in zip(host[a : a + m], host[b : b + m], strict=True)]
    return SampleResult([int(v) for v in host[:n]], out_lp, out_top)
