"""The engine end to end in one process: real decoder (our runner), real checkpoint loading,
transformers' `generate()` as the oracle.

16 chat prompts with 0-3 images of different sizes run concurrently, so prompt chunks and
decode tokens share steps; greedy output must equal `generate()` token for token, also
with a KV pool so small (and an admission ratio so optimistic) that requests are
retracted and recomputed. Afterwards every KV page is free.
"""

from __future__ import annotations

import queue
import time

import language_oracle as oracle
import pytest
import torch

from tandem.models.split import load_text_weights
from tandem.services.language.engine.core import Engine, EngineConfig
from tandem.services.language.engine.request import (
    Request,
    RequestSpec,
    RequestStatus,
    SamplingParams,
    StreamDelta,
)
from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings

SIZES = [(28, 28), (56, 84), (112, 56), (84, 140)]
N_PROMPTS = 16


class Case:
    def __init__(self, ckpt):
        self.model, self.processor = oracle.load(ckpt)
        self.tokenizer = self.processor.tokenizer
        self.weights = load_text_weights(ckpt)
        self.inputs, self.payloads, self.refs, self.max_new = [], [], [], []
        for i in range(N_PROMPTS):
            images = [oracle.make_image(10 * i + j, SIZES[(i + j) % 4]) for j in range(i % 4)]
            text = f"prompt {i}: describe these " + "words " * (3 * i)
            inputs = oracle.make_inputs(self.processor, text, images)
            self.inputs.append(inputs)
            self.payloads.append(oracle.payload(self.model, inputs))
            self.max_new.append(8 + i % 9)
            out = oracle.generate(self.model, inputs, self.max_new[-1])  # greedy, stops at EOS
            self.refs.append(out[0] if isinstance(out, tuple) else out)

    def engine(self, kv_tokens: int, device: str | None = None, **cfg) -> Engine:
        """An engine on `device` (default the tests' device) whose KV cache holds
        `kv_tokens` (pages of `oracle.page_size`; on CUDA at least oracle.CUDA_MIN_PAGES)."""
        device = torch.device(device) if device else oracle.test_device()
        pages = oracle.kv_pages(kv_tokens, device)
        runner = ModelRunner(self.weights.copy(), RunnerSettings(page_size=oracle.page_size(device)),
                             num_pages=pages, device=device)
        return Engine(runner, self.tokenizer, EngineConfig(**cfg)).start()


_cases: dict[str, Case] = {}


@pytest.fixture(params=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def case(request, checkpoint):
    arch = request.param
    if arch not in _cases:
        _cases[arch] = Case(checkpoint(arch))
    return _cases[arch]


def collect(engine: Engine, reqs: list[Request], timeout: float = 120) -> dict[int, list]:
    """Submit all, gather every request's deltas until each has finished."""
    q: queue.Queue = queue.Queue()
    for r in reqs:
        engine.submit(r, lambda d, rid=r.room: q.put((rid, d)))
    out: dict[int, list[StreamDelta]] = {r.room: [] for r in reqs}
    pending = len(reqs)
    while pending:
        rid, d = q.get(timeout=timeout)
        out[rid].append(d)
        pending -= d.finished
    return out


def greedy_requests(case: Case, base: int) -> list[Request]:
    return [
        Request(RequestSpec(base + i, SamplingParams(max_tokens=n), p))
        for i, (p, n) in enumerate(zip(case.payloads, case.max_new, strict=True))
    ]


def check_greedy_streams(case: Case, engine: Engine, reqs: list[Request], streams) -> None:
    """Every request's tokens, text, finish reason and usage equal the oracle's."""
    for r, ref, n in zip(reqs, case.refs, case.max_new, strict=True):
        deltas = streams[r.room]
        assert [t for d in deltas for t in d.token_ids] == ref, f"request {r.room}"
        last = deltas[-1]
        stopped = ref[-1] in engine.eos
        assert len(ref) == n or stopped
        assert last.finish_reason is (
            RequestStatus.FINISHED_STOP if stopped else RequestStatus.FINISHED_LENGTH
        )
        assert (last.prompt_tokens, last.completion_tokens) == (r.prompt_len, len(ref))
        text = case.tokenizer.decode(ref[:-1] if stopped else ref, skip_special_tokens=True)
        assert "".join(d.text for d in deltas) == text


@pytest.mark.parametrize("pool", ["roomy", "tiny"])
def test_concurrent_greedy_equals_generate(case, pool):
    if pool == "tiny" and oracle.test_device().type != "cpu":
        pytest.skip("a tiny pool is the CPU's case: on CUDA every test cache has at least "
                    "oracle.CUDA_MIN_PAGES pages (one flex compile per model)")
    if pool == "roomy":
        engine = case.engine(kv_tokens=2048, max_prefill_tokens=64)
    else:  # the longest prompt + output fits alone, in whole pages, and nothing more
        need = max(p.num_tokens + n for p, n in zip(case.payloads, case.max_new, strict=True))
        engine = case.engine(kv_tokens=need, max_prefill_tokens=64, init_new_token_ratio=0.05)
    try:
        reqs = greedy_requests(case, 1000)
        streams = collect(engine, reqs)
        mixed = engine.num_steps < sum(len(r) for r in case.refs)  # steps were shared
        assert mixed
        if pool == "tiny":
            assert engine.scheduler.num_retractions > 0
            assert any(r.kv.num_retractions for r in reqs)
        check_greedy_streams(case, engine, reqs, streams)
        assert engine.pool.num_free == engine.pool.num_total
    finally:
        engine.stop()


def test_seeded_sampling_is_independent_of_batch_composition(checkpoint):
    case = _cases.get("qwen2_5_vl") or Case(checkpoint("qwen2_5_vl"))
    engine = case.engine(kv_tokens=2048, max_prefill_tokens=48)
    try:
        params = dict(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, ignore_eos=True)

        def mine(rid, seed=7):
            return Request(RequestSpec(rid, SamplingParams(seed=seed, **params), case.payloads[5]))

        alone = collect(engine, [mine(1)])[1]
        crowd = [Request(RequestSpec(10 + i, SamplingParams(**params), p)) for i, p in enumerate(case.payloads)]
        together = collect(engine, crowd[:6] + [mine(2)] + crowd[6:])[2]
        other_seed = collect(engine, [mine(3, seed=8)])[3]

        def toks(ds):
            return [t for d in ds for t in d.token_ids]

        assert toks(alone) == toks(together)
        assert "".join(d.text for d in alone) == "".join(d.text for d in together)
        assert toks(other_seed) != toks(alone)
        assert engine.pool.num_free == engine.pool.num_total
    finally:
        engine.stop()


def test_the_engine_seed_replays_unseeded_requests_and_yields_to_a_request_seed(checkpoint):
    """EngineConfig.seed (vLLM's --seed): the n-th unseeded request after a start draws the
    same seed on every start with that seed, so a replayed sequence gives the same tokens;
    another seed gives others; a request's own seed wins over the engine's."""
    case = _cases.get("qwen2_5_vl") or Case(checkpoint("qwen2_5_vl"))
    runner = ModelRunner(case.weights.copy(), RunnerSettings(page_size=4), num_pages=256)
    params = dict(temperature=1.0, max_tokens=10, ignore_eos=True)

    def replay(engine_seed, request_seed=None) -> list[list[int]]:
        engine = Engine(runner, case.tokenizer, EngineConfig(seed=engine_seed)).start()
        try:
            out = []
            for i in range(3):  # one after another: the engine's draw order is the arrival order
                req = Request(RequestSpec(i, SamplingParams(seed=request_seed, **params), case.payloads[i]))
                out.append([t for d in collect(engine, [req])[i] for t in d.token_ids])
            assert engine.pool.num_free == engine.pool.num_total
            return out
        finally:
            engine.stop()

    first = replay(11)
    assert replay(11) == first
    assert replay(12) != first
    assert replay(11, request_seed=5) == replay(None, request_seed=5)


def test_stop_string_stop_token_and_eos(checkpoint):
    case = _cases.get("qwen2_5_vl") or Case(checkpoint("qwen2_5_vl"))
    engine = case.engine(kv_tokens=1024)
    try:
        ref = case.refs[3]
        full = case.tokenizer.decode(ref)
        stop = full[len(full) // 3 : len(full) // 3 + 3]
        assert stop and stop in full
        expected = full[: full.index(stop)]
        reqs = [
            Request(RequestSpec(1, SamplingParams(max_tokens=len(ref), ignore_eos=True, stop=[stop]), case.payloads[3])),
            Request(RequestSpec(2, SamplingParams(max_tokens=len(ref), ignore_eos=True,
                                      stop_token_ids=[ref[2]]), case.payloads[3])),
        ]
        out = collect(engine, reqs)
        text = "".join(d.text for d in out[1])
        assert text == expected and stop not in text
        assert out[1][-1].finish_reason is RequestStatus.FINISHED_STOP
        stopped = [t for d in out[2] for t in d.token_ids]
        assert stopped == ref[: ref.index(ref[2]) + 1]
        assert out[2][-1].finish_reason is RequestStatus.FINISHED_STOP
        # EOS ends a request unless ignore_eos: make EOS the greedy token by asking for
        # it as the engine's EOS id set
        eos_engine = Engine(engine.runner, case.tokenizer, EngineConfig(), eos_token_ids=(ref[1],))
        engine.stop()
        engine = eos_engine.start()
        out = collect(engine, [
            Request(RequestSpec(3, SamplingParams(max_tokens=len(ref)), case.payloads[3])),
            Request(RequestSpec(4, SamplingParams(max_tokens=len(ref), include_stop_str_in_output=True,
                                      skip_special_tokens=False), case.payloads[3])),
        ])
        upto = ref[: ref.index(ref[1]) + 1]
        for room in (3, 4):
            assert [t for d in out[room] for t in d.token_ids] == upto
            assert out[room][-1].finish_reason is RequestStatus.FINISHED_STOP
        # the ending token's text is left out unless include_stop_str_in_output (vLLM's rule
        # for EOS and stop_token_ids alike)
        assert "".join(d.text for d in out[3]) == case.tokenizer.decode(upto[:-1])
        assert "".join(d.text for d in out[4]) == case.tokenizer.decode(upto)
        assert engine.pool.num_free == engine.pool.num_total
    finally:
        engine.stop()


def test_abort_deadline_and_shutdown_free_every_page(checkpoint):
    case = _cases.get("qwen2_5_vl") or Case(checkpoint("qwen2_5_vl"))
    engine = case.engine(kv_tokens=1024, max_prefill_tokens=32)
    try:
        q: queue.Queue = queue.Queue()
        long = dict(max_tokens=10_000, ignore_eos=True)
        a = Request(RequestSpec(1, SamplingParams(**long), case.payloads[9]))
        b = Request(RequestSpec(2, SamplingParams(**long), case.payloads[10], deadline=time.monotonic() - 1))
        c = Request(RequestSpec(3, SamplingParams(**long), case.payloads[11]))
        for r in (a, b, c):
            engine.submit(r, lambda d, rid=r.room: q.put((rid, d)))
        finals: dict[int, StreamDelta] = {}
        aborted = False
        while 2 not in finals or 1 not in finals:
            rid, d = q.get(timeout=60)
            if d.finished:
                finals[rid] = d
            elif rid == 1 and not aborted:  # a is decoding: abort it mid-stream
                assert engine.abort(1)
                aborted = True
        assert finals[1].finish_reason is RequestStatus.FINISHED_ABORT
        assert finals[2].finish_reason is RequestStatus.FINISHED_ABORT
        assert finals[2].error_code == "DEADLINE_EXCEEDED"
        assert not engine.abort(1)  # already gone
        engine.stop()  # c is still running: shutdown aborts it
        while 3 not in finals:
            rid, d = q.get(timeout=60)
            if d.finished:
                finals[rid] = d
        assert finals[3].finish_reason is RequestStatus.FINISHED_ABORT
        assert engine.pool.num_free == engine.pool.num_total
        assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    finally:
        engine.stop()


def test_bad_input_is_rejected_before_queueing(checkpoint):
    from tandem.services.language.engine.scheduler import AdmissionError

    case = _cases.get("qwen2_5_vl") or Case(checkpoint("qwen2_5_vl"))
    # a pool too small for payload 15 ("needs"): admission decides before any step, so the
    # CPU's runner (on CUDA a 2-page pool would be a flex geometry of its own to compile)
    engine = case.engine(kv_tokens=32, device="cpu", max_model_len=64)
    try:
        with pytest.raises(AdmissionError, match="max_model_len"):
            engine.submit(Request(RequestSpec(1, SamplingParams(), case.payloads[15])), print)
        with pytest.raises(AdmissionError, match="needs"):
            big = Engine(engine.runner, case.tokenizer, EngineConfig())
            big.submit(Request(RequestSpec(2, SamplingParams(), case.payloads[15])), print)
        with pytest.raises(AdmissionError, match="outside the vocabulary") as e:
            big.submit(Request(RequestSpec(3, SamplingParams(logit_bias={1_000_000_000: 5.0}), case.payloads[0])), print)
        assert e.value.field == "sampling.logit_bias"
        assert engine.num_active == 0
    finally:
        engine.stop()


def test_max_tokens_beyond_the_context_is_refused_not_shortened(checkpoint):
    """An explicit max_tokens the context cannot hold is a clear error naming the numbers
    (it used to be shortened silently); the service's default is fitted to the context."""
    from tandem.services.language.engine.scheduler import AdmissionError

    case = _cases.get("qwen2_5_vl") or Case(checkpoint("qwen2_5_vl"))
    payload = case.payloads[0]
    prompt = payload.num_tokens
    engine = case.engine(kv_tokens=256, max_model_len=prompt + 10)
    try:
        asked = SamplingParams(max_tokens=11)
        with pytest.raises(AdmissionError, match=rf"max_tokens 11 .* - {prompt} \(prompt\) = 10"):
            engine.submit(Request(RequestSpec(1, asked, payload)), print)
        # no max_tokens: the service's default (256), shortened to what the context leaves
        with pytest.raises(AdmissionError, match=r"min_tokens 11 is more than the default"):
            engine.submit(engine.request(RequestSpec(4, SamplingParams(min_tokens=11), payload)), print)
        with pytest.raises(AdmissionError, match=r"no token budget"):  # made without one
            engine.submit(Request(RequestSpec(5, SamplingParams(), payload)), print)
        default = engine.request(RequestSpec(2, SamplingParams(), payload))  # complete at construction
        assert default.max_new_tokens == 10 and default.sampling.max_tokens is None
        q: queue.Queue = queue.Queue()
        engine.submit(default, q.put)
        fits = Request(RequestSpec(3, SamplingParams(max_tokens=10), payload))
        engine.submit(fits, q.put)
        assert fits.max_new_tokens == 10
    finally:
        engine.stop()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_small_checkpoint_concurrent_greedy_equals_generate(arch, checkpoint):
    """The same 16 concurrent prompts on the ~50M-parameter `small` checkpoints."""
    case = Case(checkpoint(arch, "small"))
    engine = case.engine(kv_tokens=4096, max_prefill_tokens=128)
    try:
        reqs = greedy_requests(case, 3000)
        streams = collect(engine, reqs, timeout=300)
        assert engine.num_steps < sum(len(r) for r in case.refs)  # steps were shared
        check_greedy_streams(case, engine, reqs, streams)
        assert engine.pool.num_free == engine.pool.num_total
    finally:
        engine.stop()


def test_shaped_rows_leave_free_rows_equal_to_generate(checkpoint):
    # every free request shares its steps with a penalized / biased / min_tokens twin:
    # the free ones still equal generate() token for token, the twins differ
    case = _cases.get("qwen2_5_vl") or Case(checkpoint("qwen2_5_vl"))
    engine = case.engine(kv_tokens=2048, max_prefill_tokens=64)
    try:
        free = greedy_requests(case, 3000)[:8]
        twins = [
            Request(RequestSpec(4000 + i, SamplingParams(
                max_tokens=n, repetition_penalty=1.8, presence_penalty=1.5,
                frequency_penalty=1.0, min_tokens=n, logit_bias={7: 4.0},
                logprobs=True, top_logprobs=4), p))
            for i, (p, n) in enumerate(zip(case.payloads[:8], case.max_new[:8], strict=True))
        ]
        streams = collect(engine, free + twins)
        for r, ref in zip(free, case.refs[:8], strict=True):
            assert [t for d in streams[r.room] for t in d.token_ids] == ref, f"request {r.room}"
        twin_tokens = [[t for d in streams[r.room] for t in d.token_ids] for r in twins]
        assert twin_tokens != case.refs[:8]
        for r, toks in zip(twins, twin_tokens, strict=True):
            assert len(toks) == r.sampling.max_tokens  # min_tokens: no early EOS
            tops = [t for d in streams[r.room] for t in d.top_logprobs]
            assert len(tops) == len(toks) and all(len(t) == 4 for t in tops)
        assert engine.pool.num_free == engine.pool.num_total
    finally:
        engine.stop()
