"""Sampler: greedy, temperature, top-k/top-p on known distributions, seeded reproducibility
independent of batch composition, logprobs of the chosen tokens."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.sampling import SamplingParams
from tandem.services.language.engine.request import Request
from tandem.services.language.engine.sampler import filter_logits, sample, sampling_probs
from tandem.transfer.payload import PromptPayload

P = torch.tensor([0.1, 0.2, 0.3, 0.4])
LOGITS = P.log()


def req(rid=1, **kw) -> Request:
    return Request(rid, SamplingParams(**kw), PromptPayload.of_token_ids([1, 2, 3]))


def test_greedy_is_argmax_and_top_k_one_is_greedy():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [req(i) for i in range(4)] + [req(9, temperature=1.5, top_k=1)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


@pytest.mark.parametrize(
    "params, expected",
    [
        (dict(temperature=1.0), [0.1, 0.2, 0.3, 0.4]),
        (dict(temperature=1.0, top_k=2), [0, 0, 3 / 7, 4 / 7]),
        (dict(temperature=1.0, top_p=0.6), [0, 0, 3 / 7, 4 / 7]),
        (dict(temperature=1.0, top_p=0.7), [0, 0, 3 / 7, 4 / 7]),  # 0.4+0.3 reaches 0.7
        (dict(temperature=1.0, top_p=0.71), [0, 2 / 9, 3 / 9, 4 / 9]),
        (dict(temperature=1.0, top_p=0.3), [0, 0, 0, 1]),
        (dict(temperature=1.0, top_k=3, top_p=0.5), [0, 0, 3 / 7, 4 / 7]),
        (dict(temperature=0.5), (P**2 / (P**2).sum()).tolist()),  # p^(1/T), renormalised
    ],
)
def test_truncated_distributions(params, expected):
    probs = sampling_probs(LOGITS, SamplingParams(**params))
    assert torch.allclose(probs, torch.tensor(expected, dtype=torch.float32), atol=1e-6)


def test_draws_follow_the_truncated_distribution():
    r = req(temperature=1.0, top_k=3, seed=123)
    counts = torch.zeros(4)
    for _ in range(3000):
        counts[sample(LOGITS[None], [r]).token_ids[0]] += 1
    assert counts[0] == 0  # cut by top-k
    freq = counts / counts.sum()
    expected = torch.tensor([0, 2 / 9, 3 / 9, 4 / 9])
    # 3000 draws: the standard error is < 0.01; a seeded generator makes this exact anyway
    assert torch.allclose(freq, expected, atol=0.04), freq


def test_same_seed_same_tokens_across_runs_and_batch_compositions():
    g = torch.Generator().manual_seed(1)
    steps = [torch.randn(64, generator=g) for _ in range(30)]

    def run(batch_size: int, position: int, seed: int) -> list[int]:
        me = req(1, temperature=0.9, top_p=0.95, top_k=40, seed=seed)
        others = [req(10 + i, temperature=1.0, seed=None) for i in range(batch_size - 1)]
        noise = torch.Generator().manual_seed(batch_size)
        out = []
        for row in steps:
            batch = others[:position] + [me] + others[position:]
            logits = torch.randn(batch_size, 64, generator=noise)
            logits[position] = row
            out.append(sample(logits, batch).token_ids[position])
        return out

    alone = run(1, 0, seed=42)
    assert run(1, 0, seed=42) == alone
    assert run(5, 3, seed=42) == alone
    assert run(8, 0, seed=42) == alone
    assert run(1, 0, seed=43) != alone


def test_logprobs_of_chosen_tokens():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(3))
    reqs = [req(1, logprobs=True), req(2), req(3, temperature=0.7, top_k=5, seed=1, logprobs=True)]
    out = sample(logits, reqs)
    t0, t2 = out.token_ids[0], out.token_ids[2]
    assert out.logprobs[1] is None
    assert math.isclose(out.logprobs[0], torch.log_softmax(logits[0], -1)[t0].item(), abs_tol=1e-5)
    # under softmax(logits / T) *before* top-k truncation
    lp2 = torch.log_softmax(logits[2] / 0.7, -1)[t2].item()
    assert math.isclose(out.logprobs[2], lp2, abs_tol=1e-5)
    assert t2 in torch.topk(logits[2], 5).indices.tolist()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_params_are_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="do not match"):
        sample(torch.zeros(2, 5), [req()])


def test_top_k_minus_one_and_zero_keep_every_token():
    """vLLM's top_k=-1 is "off", as 0 is here."""
    x = torch.randn(50, generator=torch.Generator().manual_seed(3))
    plain = filter_logits(x, SamplingParams(temperature=1.0))
    for k in (-1, 0):
        assert torch.equal(filter_logits(x, SamplingParams(temperature=1.0, top_k=k)), plain)
