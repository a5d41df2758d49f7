"""The compiled steps (`compile_step` = decode | all, CPU): exact as the eager step is.

`decode`: every decode batch bucket compiled; `all`: those, and every other step (prompt
chunks of any length, several of them, after a cached prefix, beside decode rows) through
one compiled graph of dynamic token counts (graph_runner `MixedStep`).

Greedy decoding through the compiled steps (the prompts' step through the mixed step, the
decode steps through the buckets) equals transformers' `generate()` token for token with
every step's logits within the float32 bound of tests/test_language_model.py, and equals
the eager runner's tokens with logits within float32 rounding of its (inductor fuses the
q/k norms, rotary and residual adds in its own order; our kernels run as custom ops, the
same calls). The mixed step's layout itself (padding rows, the chunk plan) changes no bit:
run uncompiled it gives the eager step's logits exactly. Inductor's compiles take tens of
seconds each on a small CPU, so one architecture (qwen3_vl: q/k norm, interleaved MRoPE,
deepstack) at the tiny size, two buckets (1 and 2 rows) and the mixed step, each traced
as ONE graph (no break).
"""

from __future__ import annotations

import language_oracle as oracle
import pytest
import torch

from tandem.services.language.engine.kv_pages import KVPagePool
from tandem.services.language.runner.forward_batch import ForwardBatch, SeqChunk, decode_positions
from tandem.services.language.runner.graph_runner import MixedStep
from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings
from tandem.units import ceil_div

PAGE = 4
TOL = 1e-4  # against transformers: tests/test_language_model.py's
EAGER_TOL = 5e-5  # against our eager step: float32 rounding of the fused ops (1e-5 seen)
STEPS = 8


@pytest.fixture(scope="module")
def case(checkpoint, tmp_path_factory):
    path = checkpoint("qwen3_vl")
    model, proc = oracle.load(path)
    prompts = []
    for n_img in (0, 1):
        images = [oracle.make_image(10 * n_img, (56, 84))] if n_img else []
        inputs = oracle.make_inputs(proc, f"Describe picture {n_img} in a few words.", images)
        prompts.append((inputs, oracle.payload(model, inputs)))
    weights = oracle.text_weights(path)
    settings = RunnerSettings(page_size=PAGE, cuda_graph_max_bs=2, max_seq_len=256,
                              compile_step="all",
                              compile_cache_dir=str(tmp_path_factory.mktemp("inductor")))
    compiled = ModelRunner(weights.copy(), settings, num_pages=160)
    eager = ModelRunner(weights.copy(), RunnerSettings(page_size=PAGE), num_pages=160)
    return model, prompts, compiled, eager


def _greedy(runner: ModelRunner, prompts) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Both prompts prefilled in one step, then decoded together (a 2-row bucket; a
    sequence that ends leaves the other in the 1-row bucket)."""
    pool = KVPagePool(runner.num_pages, PAGE)
    pages, done = [[] for _ in prompts], [0 for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]

    def grow(i: int, total: int) -> None:
        more = ceil_div(total, PAGE) - len(pages[i])
        if more > 0:
            pages[i] += pool.alloc(more)

    chunks = []
    for i, (_inputs, p) in enumerate(prompts):
        grow(i, p.num_tokens)
        done[i] = p.num_tokens
        chunks.append(SeqChunk(i, 0, p.mrope_positions.long(), list(pages[i]),
                               input_embeds=p.input_embeds))
    out = runner.forward(ForwardBatch(chunks))
    eos = set(runner.eos_token_ids)
    live = list(range(len(prompts)))
    for i in live:
        tokens[i].append(int(out.last_logits[i].argmax()))
        logits[i].append(out.last_logits[i])
    while True:
        live = [i for i in live if tokens[i][-1] not in eos and len(tokens[i]) < STEPS]
        if not live:
            break
        chunks = []
        for i in live:
            grow(i, done[i] + 1)
            pos = decode_positions(done[i], prompts[i][1].mrope_delta)
            chunks.append(SeqChunk(i, done[i], pos, list(pages[i]),
                                   token_ids=torch.tensor([tokens[i][-1]])))
            done[i] += 1
        out = runner.forward(ForwardBatch(chunks))
        for i, row in zip(live, out.last_logits, strict=True):
            tokens[i].append(int(row.argmax()))
            logits[i].append(row)
    return tokens, logits


def test_every_bucket_is_compiled_at_start_up(case):
    _model, _prompts, compiled, _eager = case
    gr = compiled.graph_runner
    assert gr is not None and not gr.use_graphs
    assert sorted(gr.compiled) == gr.batch_sizes == [1, 2]
    assert compiled.mixed_step is not None and compiled.mixed_step.fn is not None


def test_compiled_greedy_equals_generate_and_eager(case):
    model, prompts, compiled, eager = case
    gr, ms = compiled.graph_runner, compiled.mixed_step
    calls, originals, mixed = [], dict(gr.compiled), ms.fn
    for bs, fn in originals.items():  # count the compiled steps taken
        gr.compiled[bs] = lambda *a, fn=fn, bs=bs: (calls.append(bs), fn(*a))[1]
    ms.fn = lambda *a: (calls.append("mixed"), mixed(*a))[1]
    try:
        got, got_logits = _greedy(compiled, prompts)
    finally:
        gr.compiled.update(originals)
        ms.fn = mixed
    want, want_logits = _greedy(eager, prompts)
    # the prompts' step (two chunks) through the mixed step, every decode step a bucket
    assert calls[0] == "mixed" and len(calls) > 1 and set(calls[1:]) <= {1, 2}
    assert got == want
    for i, (inputs, _p) in enumerate(prompts):
        ref_tokens, ref = oracle.generate(model, inputs, STEPS)
        n = len(got[i])
        assert got[i] == ref_tokens[:n], i
        assert (torch.stack(got_logits[i]) - ref[:n]).abs().max().item() < TOL, i
        assert (torch.stack(got_logits[i]) - torch.stack(want_logits[i])).abs().max().item() < EAGER_TOL


def test_a_bucket_that_would_recompile_runs_eagerly_instead(case, caplog):
    """No compile in a request's step: a compiled bucket called with what it was not
    compiled for (another table width here) runs the eager step and leaves the compiled
    buckets; the others stay compiled."""
    _model, _prompts, compiled, _eager = case
    gr = compiled.graph_runner
    fn = gr.compiled[1]
    try:
        with torch.inference_mode():
            want = gr._step(1, gr.widths[0])
            got = gr._run_compiled(fn, 1, gr.widths[0])
        assert torch.equal(got, want)
        assert 1 not in gr.compiled and 2 in gr.compiled
        assert "runs eagerly from now on" in caplog.text
    finally:
        gr.compiled[1] = fn


def _mixed_steps(pool: KVPagePool, vocab: int) -> list[ForwardBatch]:
    """Steps of every kind the mixed step serves, over the sequences' pages in `pool`:
    prompt chunks alone (5, 17 tokens), beside decode rows, two chunks in one step, a chunk
    after the sequence's cached prefix (chunked prefill), prompt logits, a 2-token chunk
    beside five decode rows. Token ids drawn from a fixed seed."""
    g = torch.Generator().manual_seed(0)
    seqs: dict[int, tuple[int, list[int]]] = {}

    def chunk(i: int, n: int) -> SeqChunk:
        start, pages = seqs.get(i, (0, []))
        more = ceil_div(start + n, PAGE) - len(pages)
        pages = pages + (pool.alloc(more) if more > 0 else [])
        seqs[i] = (start + n, pages)
        ids = torch.randint(0, vocab, (n,), generator=g)
        pos = torch.arange(start, start + n).expand(3, n).contiguous()
        return SeqChunk(i, start, pos, list(pages), token_ids=ids, want_prompt_logits=i == 1)

    steps = [[chunk(0, 5)], [chunk(1, 17)], [chunk(0, 1), chunk(1, 1), chunk(2, 40)],
             [chunk(0, 1), chunk(3, 9), chunk(1, 1), chunk(4, 23)], [chunk(2, 12)],
             [chunk(2, 1), chunk(0, 7)], [chunk(i, 1) for i in range(5)] + [chunk(5, 2)]]
    return [ForwardBatch(s) for s in steps]


def _logits(out) -> list[torch.Tensor]:
    return [out.last_logits, *(out.prompt_logits[k] for k in sorted(out.prompt_logits))]


def test_every_other_step_through_one_compiled_graph(case):
    """Prefill chunks of any length, alone, several, after a prefix, beside decode rows:
    every step through the one compiled graph (no recompile), logits within float32
    rounding of the eager step's."""
    _model, _prompts, compiled, eager = case
    ms = compiled.mixed_step
    calls, fn = [], ms.fn
    ms.fn = lambda *a: (calls.append(1), fn(*a))[1]
    try:
        steps = _mixed_steps(KVPagePool(compiled.num_pages, PAGE), compiled.vocab_size)
        for batch in steps:
            got, want = compiled.forward(batch), eager.forward(batch)
            for g, w in zip(_logits(got), _logits(want), strict=True):
                assert (g - w).abs().max().item() < EAGER_TOL
    finally:
        ms.fn = fn
    assert len(calls) == len(steps)
    assert ms.fn is not None  # none of them would have recompiled


def test_padding_rows_and_the_chunk_plan_change_no_bit(case):
    """The mixed step's layout run uncompiled (padding rows first, the widest tables, the
    chunks through their plan, deepstack zeros): the eager step's logits bit for bit. So
    what differs compiled is inductor's fusion alone."""
    _model, _prompts, _compiled, eager = case
    layout = MixedStep(eager.model, eager.kv, eager.attention, 256)  # never compiled
    steps = _mixed_steps(KVPagePool(eager.num_pages, PAGE), eager.vocab_size)
    with torch.inference_mode():
        for batch in steps:
            got, want = eager._run(batch, layout), eager.forward_eager(batch)
            for g, w in zip(_logits(got), _logits(want), strict=True):
                assert torch.equal(g, w)


def _warm_inputs(ms: MixedStep, singles: int, n: int, deepstack: bool):
    """Inputs of a mixed step over the dummy page: `singles` rows and one n-token chunk."""
    from tandem.services.language.model.attention import chunk_plan

    t, cfg = singles + n, ms.model.cfg
    dummy = ms.dummy_page
    return (torch.zeros(t, cfg.hidden_size), torch.zeros(3, t, dtype=torch.int64),
            dummy * PAGE + torch.arange(t) % PAGE,
            torch.full((singles, ms.max_pages), dummy, dtype=torch.int64),
            torch.ones(singles, dtype=torch.int64),
            chunk_plan([(0, n, n, [dummy] * ceil_div(n, PAGE))]),
            torch.zeros(t, cfg.num_deepstack * cfg.hidden_size) if deepstack else None)


def _step_args(ms: MixedStep, run_args) -> tuple:
    """`MixedStep._step`'s arguments for `run`'s: the rotary's cos/sin after the positions."""
    hidden, positions, *rest = run_args
    return (hidden, positions, ms._rope(positions, hidden.dtype), *rest)


def test_a_mixed_step_that_would_recompile_runs_eagerly_instead(case, caplog):
    """No compile in a request's step: called with what it was not compiled for (no
    deepstack rows on a deepstack model), the mixed step raises dynamo's typed
    FailOnRecompileLimitHit inside, runs the eager step and stays eager."""
    _model, _prompts, compiled, _eager = case
    ms = compiled.mixed_step
    fn = ms.fn
    try:
        args = _warm_inputs(ms, 2, 5, deepstack=False)
        with torch.inference_mode():
            want = ms._step(ms, *_step_args(ms, args))
            got = ms.run(*args)
        assert torch.equal(got, want)
        assert ms.fn is None
        assert "run eagerly from now on" in caplog.text
    finally:
        ms.fn = fn


def test_refused_where_it_cannot_run(checkpoint):
    """Settings it cannot serve are refused when the runner is built, before any compile."""
    weights = oracle.text_weights(checkpoint("qwen3_vl"))
    for settings, match in (
        (RunnerSettings(page_size=PAGE, cuda_graph_max_bs=1, compile_step="prefill"),
         "compile_step must be one of"),
        # gather would copy the widest table a compiled bucket reads
        (RunnerSettings(page_size=PAGE, cuda_graph_max_bs=1, compile_step="decode",
                        attention_backend="gather"), "paged_cpu"),
    ):
        with pytest.raises(ValueError, match=match):
            ModelRunner(weights.copy(), settings, num_pages=8)
    # torch 2.13's fake grouped_mm refuses float32: a MoE step does not trace
    with pytest.raises(ValueError, match="MoE"):
        ModelRunner(oracle.text_weights(checkpoint("qwen3_vl_moe")),
                    RunnerSettings(page_size=PAGE, cuda_graph_max_bs=1, compile_step="decode"),
                    num_pages=8)


def test_a_mixed_forward_is_one_graph(case):
    """torch._dynamo.explain over the mixed step: one graph, no break (the chunks' attention
    is one custom op over their plan; decode rows the decode kernel's op)."""
    import torch._dynamo as dynamo

    from tandem.services.language.runner.graph_runner import _mixed_step

    _model, _prompts, compiled, _eager = case
    ms = compiled.mixed_step
    with torch.inference_mode():
        args = _step_args(ms, _warm_inputs(ms, 3, 11, deepstack=True))
        explained = dynamo.explain(_mixed_step)(ms, *args)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_a_decode_forward_is_one_graph(case):
    """torch._dynamo.explain over the runner's step: one graph, no break (the kernels are
    custom ops; a pybind call would break the graph at each of them)."""
    import torch._dynamo as dynamo

    from tandem.services.language.runner.graph_runner import _decode_step

    _model, _prompts, compiled, _eager = case
    gr = compiled.graph_runner
    with torch.inference_mode():
        explained = dynamo.explain(_decode_step)(gr, 1, gr.max_pages)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.slow  # a third compile (~25 s here): the float32 tests above run in CI
def test_compiled_bf16_within_bound_of_transformers(checkpoint, record_property, tmp_path):
    """bfloat16 (float32 products on a CPU without bf16 matrix instructions, as `auto`
    picks here; bfloat16 norms and rotary, which inductor fuses) within tests/test_bf16.py's
    bound of transformers' bfloat16, every prompt chunk through the compiled mixed step
    and every decode step through the compiled 1-row bucket."""
    from test_bf16 import BF16, bf16_oracle, finish, run_case

    path = checkpoint("qwen3_vl")
    prompts = bf16_oracle(path, "qwen3_vl", "tiny")
    settings = RunnerSettings(page_size=PAGE, cuda_graph_max_bs=1, max_seq_len=256,
                              compile_step="all", compile_cache_dir=str(tmp_path))
    runner = ModelRunner(oracle.text_weights(path, BF16), settings, num_pages=64, dtype=BF16)
    gr, ms = runner.graph_runner, runner.mixed_step
    assert sorted(gr.compiled) == [1] and ms.fn is not None
    calls, step, mixed = [], gr.compiled[1], ms.fn
    gr.compiled[1] = lambda *a: (calls.append(1), step(*a))[1]
    ms.fn = lambda *a: (calls.append("mixed"), mixed(*a))[1]
    finish(run_case(runner, 64, prompts, "qwen3_vl tiny compiled"), record_property)
    # each prompt in two chunks (the second after the first's prefix), then its decode steps
    assert calls.count("mixed") == 2 * len(prompts)
    assert calls.count(1) == sum(len(p.tokens) - 1 for p in prompts)
