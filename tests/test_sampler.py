"""Sampler: greedy, temperature, top-k/top-p on known distributions, seeded reproducibility
independent of batch composition, logprobs of the chosen tokens."""

from __future__ import annotations

import math

import pytest
import torch
from language_engine_helpers import PATHS, filter_logits, sampling_probs, shape_logits

from tandem.cpu_kernels import kernels
from tandem.sampling import SamplingParams
from tandem.services.language.engine import sampler
from tandem.services.language.engine.request import Request, RequestSpec
from tandem.services.language.engine.sampler import sample
from tandem.transfer.payload import PromptPayload

KERNELS = kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels could not be built")
P = torch.tensor([0.1, 0.2, 0.3, 0.4])
LOGITS = P.log()


def req(rid=1, **kw) -> Request:
    return Request(RequestSpec(rid, SamplingParams(**kw), PromptPayload.of_token_ids([1, 2, 3])))


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
@pytest.mark.parametrize("path", PATHS)
def test_truncated_distributions(params, expected, path):
    probs = sampling_probs(LOGITS, SamplingParams(**params), path)
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


@pytest.mark.parametrize("path", PATHS)
def test_top_k_minus_one_and_zero_keep_every_token(path):
    """vLLM's top_k=-1 is "off", as 0 is here."""
    x = torch.randn(50, generator=torch.Generator().manual_seed(3))
    plain = filter_logits(x, SamplingParams(temperature=1.0), path)
    assert not torch.isinf(plain).any()
    for k in (-1, 0):
        assert torch.equal(filter_logits(x, SamplingParams(temperature=1.0, top_k=k), path),
                           plain)


MIXED = [dict(temperature=0.0), dict(temperature=1.0, top_p=0.8, seed=None),
         dict(temperature=0.7, top_k=10, min_p=0.1, logprobs=True, top_logprobs=2),
         dict(temperature=1.0, repetition_penalty=1.5, logit_bias={5: 3.0}),
         dict(temperature=1.3, typical_p=0.7)]


@pytest.mark.parametrize("mine", [
    dict(temperature=0.9, min_p=0.05, seed=7),
    dict(temperature=1.2, typical_p=0.8, seed=7),
    dict(temperature=0.8, top_p=0.9, top_k=30, repetition_penalty=1.3, presence_penalty=0.4,
         frequency_penalty=0.2, logit_bias={3: 1.0}, min_tokens=3, stop_token_ids=[4], seed=7),
    dict(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5, logprobs=True,
         top_logprobs=3),
], ids=["min_p", "typical_p", "penalties", "greedy-penalties"])
@pytest.mark.parametrize("sort_free, pass_rows, compiled", [
    (True, 1, False), pytest.param(True, 1, True, marks=needs_kernels), (False, 1, False),
    (False, 64, False)], ids=["cpu-nucleus", "cpu-kernel", "sort-row-pass",
                              "sort-whole-batch-pass"])
def test_every_knob_keeps_a_seeds_tokens_whatever_shares_the_batch(mine, sort_free, pass_rows,
                                                                    compiled, monkeypatch):
    """A row's tokens and logprobs depend on its own row only, over steps in which the
    penalty state grows on the device (tokens appended as the engine does), whether the
    rows are cut and drawn by the CPU's sort-free path (in Python, or the compiled kernels
    for every row but a typical_p one), or filtered by the full sort and drawn one at a
    time or all at once (CUDA's)."""
    monkeypatch.setattr(sampler, "CPU_SORT_FREE", sort_free)
    compiled_kernels = KERNELS if compiled else None
    monkeypatch.setattr(sampler, "CPU_PASS_ROWS", pass_rows)
    g = torch.Generator().manual_seed(2)
    steps = [torch.randn(64, generator=g) * 2 for _ in range(12)]

    def run(others: int, position: int) -> list:
        me = req(1, **mine)
        rest = [req(10 + i, **MIXED[i % len(MIXED)]) for i in range(others)]
        noise = torch.Generator().manual_seed(others)
        out = []
        for row in steps:
            batch = rest[:position] + [me] + rest[position:]
            logits = torch.randn(len(batch), 64, generator=noise) * 2
            logits[position] = row
            res = sample(logits, batch, frozenset({2}), kernels=compiled_kernels)
            for r, t in zip(batch, res.token_ids, strict=True):
                r.append_output(t, None)
            out.append((res.token_ids[position], res.logprobs[position],
                        res.top_logprobs[position]))
        return out

    alone = run(0, 0)
    assert run(4, 2) == alone
    assert run(7, 7) == alone


def test_rows_pick_the_requests_rows_of_the_logits():
    """The engine passes the step's logits and the rows that sample (prompt chunks that do
    not are left out); each request reads its own row."""
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(4))
    reqs = [req(1), req(2, temperature=0.8, seed=3, logprobs=True), req(3, logit_bias={7: 50.0})]
    got = sample(logits, reqs, rows=[4, 1, 2])
    want = sample(logits[[4, 1, 2]].clone(), [req(1), req(2, temperature=0.8, seed=3,
                                                         logprobs=True),
                                              req(3, logit_bias={7: 50.0})])
    assert got == want and got.token_ids[0] == int(logits[4].argmax()) and got.token_ids[2] == 7


def test_penalty_state_stays_on_the_device_and_grows_by_what_each_step_adds():
    r = req(1, temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.5,
            presence_penalty=0.25)
    r.append_output(9, None)
    r.append_output(9, None)
    g = torch.Generator().manual_seed(5)
    first = None
    for _ in range(8):
        logits = torch.randn(1, 40, generator=g)
        want = logits[0].clone()  # the formulas, from the host's ids
        ids = sorted(set(r.prompt_token_ids() + r.output_ids))
        v = want[ids]
        want[ids] = torch.where(v > 0, v / 1.4, v * 1.4)
        for t in set(r.output_ids):
            want[t] -= r.output_ids.count(t) * 0.5 + 0.25
        assert torch.equal(shape_logits(logits[0], r, frozenset()), want)
        first = first or r.sampler.penalties
        assert r.sampler.penalties is first  # kept across steps, never remade
        t = sample(logits, [r]).token_ids[0]
        assert t == int(want.argmax())
        r.append_output(t, None)
    st = r.sampler.penalties
    assert sorted(st.seen_ids.tolist()) == sorted(set(r.prompt_token_ids() + r.output_ids[:-1]))
    counts = dict(zip(st.out_ids.tolist(), st.out_counts.tolist(), strict=True))
    assert counts == {t: r.output_ids[:-1].count(t) for t in set(r.output_ids[:-1])}
