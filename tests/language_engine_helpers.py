"""What tests read of the language engine that the engine itself never calls: one row's
shaped logits, filtered logits and sampling distribution (the sampler's own steps on a
batch of one), and a prefix cache's idle page count. Kept here, not in the package, so
that the package ships only what serving runs."""

from __future__ import annotations

import torch

from tandem.sampling import SamplingParams
from tandem.services.language.engine import sampler
from tandem.services.language.engine.nucleus import Nucleus
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


PATHS = ("sort", "nucleus")  # the sampler's two filters: CUDA's full sort, the CPU's cut


def kept_weights(nu: Nucleus) -> torch.Tensor:
    """[V] float64: each token's weight in a `Nucleus`'s draw, 0 where it is cut."""
    w = torch.from_numpy(nu.weight).clone()
    w[torch.from_numpy(nu.ws.b16_np >= min(nu.cut, nu.ws.buckets))] = 0.0  # far: weigh 0
    tail = torch.from_numpy(nu.tail)
    w[tail] = torch.from_numpy(nu.weight)[tail]
    return w


def cut_row(logits: torch.Tensor, params: SamplingParams) -> Nucleus:
    """One row [V] of logits cut by the CPU's path (`sampler._cut_cpu`, a batch of one)."""
    staged = sampler._Staged()
    sampler._stage_filters(staged, [params], logits.shape[-1])
    t = staged.upload(logits.device)
    host = {n: t[n].tolist() for n in sampler._FILTERS}
    return sampler._cut_cpu(logits.float(), params, t, host, 0)


def filter_logits(logits: torch.Tensor, params: SamplingParams, path: str = "sort"
                  ) -> torch.Tensor:
    """One row [V] of logits -> temperature-scaled float32 logits with truncated tokens
    at -inf: the sampler's `_filter` on a batch of one ("sort"), or what the CPU's
    `nucleus` keeps ("nucleus"). Greedy params are not filtered."""
    if path == "nucleus":
        nu = cut_row(logits, params)  # (its workspace's x: the row / temperature, top-k cut)
        return torch.where(kept_weights(nu) > 0, nu.ws.x, float("-inf"))
    staged = sampler._Staged()
    sampler._stage_filters(staged, [params], logits.shape[-1])
    return sampler._filter(logits.float()[None], [params], staged.upload(logits.device))[0]


def sampling_probs(logits: torch.Tensor, params: SamplingParams, path: str = "sort"
                   ) -> torch.Tensor:
    """The distribution a non-greedy request draws from (float32)."""
    if path == "nucleus":
        nu = cut_row(logits, params)
        return (kept_weights(nu) / nu.mass).float()
    return torch.softmax(filter_logits(logits, params), dim=-1)


def num_idle(cache: PrefixCache) -> int:
    """Cached pages no request references (evictable)."""
    return len(cache._idle)
