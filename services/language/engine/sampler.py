"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Reproducibility: a request's draws come only from its own `torch.Generator` (seeded from
its `seed`; when it has none, from the engine's seeded sequence (`--seed`) or the OS's
randomness), one draw per generated token, and each row is
processed on its own. So the same seed gives the same tokens whatever else shares the
batch, and a retraction (which never re-samples a token) does not change them either.

Per row, in this order (each request's parameters touch only its own row):

    shape   logit_bias (added), repetition_penalty (transformers': over prompt + output
            ids, a positive logit divided, a negative one multiplied), presence and
            frequency penalties (OpenAI: logit -= count * frequency + (count > 0) *
            presence, over generated ids), min_tokens (EOS and stop ids at -inf until
            that many tokens are out)                         -- greedy rows too
    filter  temperature, top-k, top-p, min_p (a token below min_p * the top token's
            probability is dropped), typical_p (transformers' locally typical
            sampling)                                         -- sampled rows only

Before both, a structured-output row keeps only the tokens its grammar allows next
(`grammar.apply_masks`); if shaping then leaves no token, the grammar's mask alone holds.

Logprobs (and top_logprobs) are those of the model's own distribution, softmax(logits /
temperature) before shaping and truncation (plain softmax for greedy), as the wire
contract says.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from tandem.sampling import SamplingParams
from tandem.services.language.engine.grammar import apply_masks
from tandem.services.language.engine.request import Request


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]  # None where the request did not ask for logprobs
    top_logprobs: list[list[tuple[int, float]]]  # [] where it did not ask for them


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row [V] of float32 logits -> temperature-scaled logits with truncated tokens
    set to -inf (top-k, then top-p). Greedy params are not filtered here."""
    x = logits.float() / max(params.temperature, 1e-6)
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0 or params.min_p > 0.0:
        x = _top_p_min_p(x, params)
    if params.typical_p < 1.0:
        x = _typical(x, params.typical_p)
    return x


def _typical(x: torch.Tensor, mass: float) -> torch.Tensor:
    """Keep the tokens whose surprise (-log p) is closest to the entropy, fewest first,
    until their mass reaches `mass` (transformers' TypicalLogitsWarper, one row)."""
    logp = torch.log_softmax(x, dim=-1)
    entropy = -(logp * logp.exp()).nansum()  # nansum: -inf * 0 of dropped tokens
    distance, order = torch.sort((-logp - entropy).abs())
    mass_upto = torch.softmax(x[order], dim=-1).cumsum(dim=-1)
    last = min(int((mass_upto < mass).sum()), x.numel() - 1)
    drop_sorted = distance > distance[last]
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def _top_p_min_p(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the mass *before* it already reaches top_p: the smallest set
        # whose mass is >= top_p survives (never empty: the first token always stays).
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return x


def shape_logits(x: torch.Tensor, req: Request, eos: frozenset[int]) -> torch.Tensor:
    """One row [V] of float32 logits with the request's bias, penalties and min_tokens
    applied (a new tensor; the module docstring gives the order)."""
    p, vocab = req.sampling, x.shape[-1]
    x = x.clone()
    if p.logit_bias:
        ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.long,
                           device=x.device)
        x[ids] += torch.tensor([p.logit_bias[int(t)] for t in ids.tolist()], dtype=x.dtype,
                               device=x.device)
    out = torch.tensor(req.output_ids, dtype=torch.long, device=x.device)
    if p.repetition_penalty != 1.0:
        seen = torch.unique(torch.cat([_prompt_ids(req).to(x.device), out]))
        seen = seen[seen < vocab]
        v = x[seen]
        x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and len(out):
        counts = torch.bincount(out[out < vocab], minlength=vocab).to(x.dtype)
        x -= counts * p.frequency_penalty + (counts > 0).to(x.dtype) * p.presence_penalty
    if len(req.output_ids) < p.min_tokens:
        ends = [t for t in (set(eos) | set(p.stop_token_ids)) if t < vocab]
        x[torch.tensor(ends, dtype=torch.long, device=x.device)] = float("-inf")
    return x


def _prompt_ids(req: Request) -> torch.Tensor:
    """The prompt's ids as a tensor, made once per request."""
    if req.sampler.prompt_ids_tensor is None:
        req.sampler.prompt_ids_tensor = torch.tensor(req.prompt_token_ids(), dtype=torch.long)
    return req.sampler.prompt_ids_tensor


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request draws from (for tests and debugging)."""
    return torch.softmax(filter_logits(logits, params), dim=-1)


def _generator(req: Request, device: torch.device) -> torch.Generator:
    if req.sampler.generator is None or req.sampler.generator.device != device:
        seed = next((s for s in (req.sampling.seed, req.sampler.seed) if s is not None), None)
        if seed is None:
            seed = secrets.randbits(63)
        g = torch.Generator(device=device)
        g.manual_seed(seed & ((1 << 63) - 1))
        req.sampler.generator = g
    return req.sampler.generator


def sample(logits: torch.Tensor, reqs: list[Request], eos: frozenset[int] = frozenset()
           ) -> SampleResult:
    """Pick one token per row of `logits` [B, V] for `reqs[i]`; `eos` are the model's end
    ids (held back by min_tokens)."""
    if logits.dim() != 2 or logits.shape[0] != len(reqs):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(reqs)} requests")
    raw = logits.float()
    logits = apply_masks(raw, [r.sampler.matcher for r in reqs])  # structured output, per row
    tokens = torch.argmax(logits, dim=-1)  # greedy for all rows; the others overwrite
    for i, req in enumerate(reqs):
        p = req.sampling
        if p.greedy and not p.shapes_logits:
            continue
        x = shape_logits(logits[i], req, eos) if p.shapes_logits else logits[i]
        if torch.isinf(x).all():  # shaping took away every token the grammar allows
            x = logits[i]
        if p.greedy:
            tokens[i] = torch.argmax(x)
            continue
        probs = torch.softmax(filter_logits(x, p), dim=-1)
        tokens[i] = torch.multinomial(probs, 1, generator=_generator(req, probs.device))[0]
    want = [i for i, r in enumerate(reqs) if r.sampling.logprobs]
    out_lp: list[float | None] = [None] * len(reqs)
    out_top: list[list[tuple[int, float]]] = [[] for _ in reqs]
    if want:
        idx = torch.tensor(want, device=logits.device)
        temps = torch.tensor(
            [reqs[i].sampling.temperature or 1.0 for i in want],
            device=logits.device,
        )
        lp = torch.log_softmax(raw[idx] / temps[:, None], dim=-1)
        chosen = lp.gather(1, tokens[idx][:, None])[:, 0].tolist()
        for k, (i, v) in enumerate(zip(want, chosen, strict=True)):
            out_lp[i] = float(v)
            n = reqs[i].sampling.top_logprobs
            if n:
                top = torch.topk(lp[k], n)
                out_top[i] = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return SampleResult(tokens.tolist(), out_lp, out_top)
