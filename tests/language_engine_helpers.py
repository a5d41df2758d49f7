"""What tests read of the language engine that the engine itself never calls: one row's
shaped logits, filtered logits and sampling distribution (the sampler's own steps on a
batch of one), and a prefix cache's idle page count. Kept here, not in the package, so
that the package ships only what serving runs."""

from __future__ import annotations

import torch

from tandem.sampling import SamplingParams
from tandem.services.language.engine import sampler
from tandem.services.language.engine.prefix_cache import PrefixCache
from tandem.services.language.engine.request import Request


def shape_logits(x: torch.Tensor, req: Request, eos: frozenset[int]) -> torch.Tensor:
    """One row [V] of float32 logits with the request's bias, penalties and min_tokens
    applied (a new tensor; sampler.py's docstring gives the order)."""
    staged = sampler._Staged()
    news = sampler._penalty_news(0, req, x.shape[-1], x.device, eos, staged)
    sampler._apply_news(news, staged.upload(x.device))
    out = x.float().clone()
    sampler._shape_row(out, req, news.state)
    return out


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row [V] of logits -> temperature-scaled float32 logits with truncated tokens
    at -inf (the sampler's `_filter` on a batch of one). Greedy params are not filtered."""
    staged = sampler._Staged()
    sampler._stage_filters(staged, [params], logits.shape[-1])
    return sampler._filter(logits.float()[None], [params], staged.upload(logits.device))[0]


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request draws from."""
    return torch.softmax(filter_logits(logits, params), dim=-1)


def num_idle(cache: PrefixCache) -> int:
    """Cached pages no request references (evictable)."""
    return len(cache._idle)
