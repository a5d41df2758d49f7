"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Reproducibility: a request's draws come only from its own `torch.Generator` (seeded from
its `seed`, or randomly when it has none), one draw per generated token, and each row is
processed on its own. So the same seed gives the same tokens whatever else shares the
batch, and a retraction (which never re-samples a token) does not change them either.

Logprobs are those of the chosen token under softmax(logits / temperature), before top-k
and top-p truncation (plain softmax for greedy), as the wire contract says.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from services.language.request import Request, SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]  # None where the request did not ask for logprobs


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row [V] of float32 logits -> temperature-scaled logits with truncated tokens
    set to -inf (top-k, then top-p). Greedy params are not filtered here."""
    x = logits.float() / max(params.temperature, 1e-6)
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the mass *before* it already reaches top_p: the smallest set
        # whose mass is >= top_p survives (never empty: the first token always stays).
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request draws from (for tests and debugging)."""
    return torch.softmax(filter_logits(logits, params), dim=-1)


def _generator(req: Request, device: torch.device) -> torch.Generator:
    if req.generator is None or req.generator.device != device:
        seed = req.sampling.seed if req.sampling.seed is not None else secrets.randbits(63)
        g = torch.Generator(device=device)
        g.manual_seed(seed & ((1 << 63) - 1))
        req.generator = g
    return req.generator


def sample(logits: torch.Tensor, reqs: list[Request]) -> SampleResult:
    """Pick one token per row of `logits` [B, V] for `reqs[i]`."""
    if logits.dim() != 2 or logits.shape[0] != len(reqs):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(reqs)} requests")
    logits = logits.float()
    tokens = torch.argmax(logits, dim=-1)  # greedy for all rows; sampled rows overwrite
    for i, req in enumerate(reqs):
        p = req.sampling
        if p.greedy:
            continue
        probs = torch.softmax(filter_logits(logits[i], p), dim=-1)
        tokens[i] = torch.multinomial(probs, 1, generator=_generator(req, probs.device))[0]
    want = [i for i, r in enumerate(reqs) if r.sampling.logprobs]
    out_lp: list[float | None] = [None] * len(reqs)
    if want:
        idx = torch.tensor(want, device=logits.device)
        temps = torch.tensor(
            [reqs[i].sampling.temperature or 1.0 for i in want],
            device=logits.device,
        )
        lp = torch.log_softmax(logits[idx] / temps[:, None], dim=-1)
        chosen = lp.gather(1, tokens[idx][:, None])[:, 0].tolist()
        for i, v in zip(want, chosen, strict=True):
            out_lp[i] = float(v)
    return SampleResult(tokens.tolist(), out_lp)
