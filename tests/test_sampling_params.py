"""Every sampling parameter against a reference: transformers' logits processors
(repetition penalty, min_p, min_tokens, sequence bias), OpenAI's formula (presence and
frequency penalties), the model's own log-softmax (top_logprobs), and the detokenizer's
stop strings with and without inclusion. Parameters shape only their own row."""

from __future__ import annotations

import pytest
import torch
from language_engine_helpers import PATHS, filter_logits, shape_logits
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TypicalLogitsWarper,
)

from tandem.sampling import SamplingParams
from tandem.services.language.engine.detokenizer import IncrementalDetokenizer
from tandem.services.language.engine.request import Request, RequestSpec
from tandem.services.language.engine.sampler import sample
from tandem.transfer.payload import PromptPayload

V = 50
PROMPT = [3, 7, 7, 11, 20]
OUTPUT = [7, 30, 30, 30, 41]
EOS = frozenset({2})


def logits(seed=0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3


def request(rid=1, **kw) -> Request:
    ids = torch.tensor(PROMPT, dtype=torch.int32)
    payload = PromptPayload(torch.zeros(len(PROMPT), 4), ids,
                            torch.zeros(3, len(PROMPT), dtype=torch.int32), 0)
    r = Request(RequestSpec(rid, SamplingParams(**kw), payload))
    for t in OUTPUT:
        r.append_output(t, None)
    return r


def hf(processor, x: torch.Tensor, ids=PROMPT + OUTPUT) -> torch.Tensor:
    return processor(torch.tensor([ids]), x[None].clone())[0]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    x = logits(1)
    got = shape_logits(x, request(repetition_penalty=penalty), EOS)
    torch.testing.assert_close(got, hf(RepetitionPenaltyLogitsProcessor(penalty), x))


@pytest.mark.parametrize("presence,frequency", [(0.5, 0.0), (0.0, 1.5), (-1.0, 0.7), (2, -2)])
def test_presence_and_frequency_penalties_follow_openai(presence, frequency):
    # OpenAI: mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence,
    # c[j] = how often token j was sampled before (the output, not the prompt)
    x = logits(2)
    got = shape_logits(x, request(presence_penalty=presence, frequency_penalty=frequency), EOS)
    want = x.clone()
    for j in set(OUTPUT):
        c = OUTPUT.count(j)
        want[j] -= c * frequency + presence
    torch.testing.assert_close(got, want)


def test_logit_bias_equals_transformers_sequence_bias():
    x = logits(3)
    bias = {5: 100.0, 9: -100.0, 30: 2.5}
    got = shape_logits(x, request(logit_bias=bias), EOS)
    ref = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    torch.testing.assert_close(got, hf(ref, x))
    assert sample(x[None], [request(logit_bias=bias)]).token_ids == [5]  # greedy follows it


@pytest.mark.parametrize("min_tokens", [3, 5, 6, 9])
def test_min_tokens_equals_transformers(min_tokens):
    x = logits(4)
    x[2] = 50.0  # EOS would win
    r = request(min_tokens=min_tokens, stop_token_ids=[17])
    got = shape_logits(x, r, EOS)
    # transformers counts new tokens from the prompt length; ours are OUTPUT (5 so far)
    ref = MinNewTokensLengthLogitsProcessor(len(PROMPT), min_tokens, [2, 17])
    torch.testing.assert_close(got, hf(ref, x))
    held = len(OUTPUT) < min_tokens
    assert sample(x[None], [r], EOS).token_ids[0] != 2 if held else True
    assert (sample(x[None], [r], EOS).token_ids[0] == 2) is not held


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("min_p,temperature", [(0.05, 1.0), (0.2, 0.7), (0.5, 1.5)])
def test_min_p_equals_transformers(min_p, temperature, path):
    x = logits(5)
    got = filter_logits(x, SamplingParams(temperature=temperature, min_p=min_p), path)
    want = hf(MinPLogitsWarper(min_p), hf(TemperatureLogitsWarper(temperature), x))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("typical_p,temperature", [(0.2, 1.0), (0.6, 0.7), (0.95, 1.3)])
def test_typical_p_equals_transformers(typical_p, temperature, path):
    x = logits(8)
    got = filter_logits(x, SamplingParams(temperature=temperature, typical_p=typical_p), path)
    want = hf(TypicalLogitsWarper(typical_p), hf(TemperatureLogitsWarper(temperature), x))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert 1 < int((~torch.isinf(got)).sum()) < V  # it kept some tokens and dropped others
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)])


def test_top_logprobs_are_the_models_own_log_softmax():
    x = logits(6)
    for temperature in (0.0, 0.8):
        r = request(temperature=temperature, logprobs=True, top_logprobs=5, seed=1)
        res = sample(x[None], [r])
        lp = torch.log_softmax(x / (temperature or 1.0), dim=-1)
        top = torch.topk(lp, 5)
        assert [t for t, _ in res.top_logprobs[0]] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in res.top_logprobs[0]]), top.values)
        assert res.logprobs[0] == pytest.approx(lp[res.token_ids[0]].item())


def test_parameters_shape_only_their_own_row():
    x = torch.stack([logits(7), logits(7), logits(7)])
    plain = sample(x, [request(1), request(2), request(3)]).token_ids
    mixed = sample(x, [request(1, repetition_penalty=2.0, presence_penalty=2.0),
                       request(2), request(3, logit_bias={0: 100.0})]).token_ids
    assert mixed[1] == plain[1] and mixed[2] == 0


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_with_and_without_inclusion(include):
    d = IncrementalDetokenizer(CharTokenizer(), ["END", "ND!"], include_stop=include)
    out = "".join(d.add([ord(c)]) for c in "abc ENDING")
    assert d.stopped
    assert out == ("abc END" if include else "abc ")


def test_out_of_range_parameters_are_refused():
    for kw in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
               {"min_p": 1.5}, {"logit_bias": {1: 500}}, {"min_tokens": 300, "max_tokens": 256},
               {"top_logprobs": 3}, {"top_logprobs": 25, "logprobs": True}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)
