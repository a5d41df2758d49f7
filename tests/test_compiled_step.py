"""The compiled decode step (`compile_step` = decode, CPU): exact as the eager step is.

Greedy decoding through the compiled buckets equals transformers' `generate()` token for
token with every step's logits within the float32 bound of tests/test_language_model.py,
and equals the eager runner's tokens with logits within float32 rounding of its (inductor
fuses the q/k norms, rotary and residual adds in its own order; our kernels run as custom
ops, the same calls). Inductor's compiles take tens of seconds a bucket on a small CPU, so
one architecture (qwen3_vl: q/k norm, interleaved MRoPE, deepstack) at the tiny size, two
buckets (1 and 2 rows), and a decode forward traced as ONE graph (no break).
"""

from __future__ import annotations

import language_oracle as oracle
import pytest
import torch

from tandem.services.language.engine.kv_pages import KVPagePool
from tandem.services.language.runner.forward_batch import ForwardBatch, SeqChunk, decode_positions
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
                              compile_step="decode",
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


def test_compiled_greedy_equals_generate_and_eager(case):
    model, prompts, compiled, eager = case
    gr = compiled.graph_runner
    calls, originals = [], dict(gr.compiled)
    for bs, fn in originals.items():  # count the compiled steps taken
        gr.compiled[bs] = lambda *a, fn=fn, bs=bs: (calls.append(bs), fn(*a))[1]
    try:
        got, got_logits = _greedy(compiled, prompts)
    finally:
        gr.compiled.update(originals)
    want, want_logits = _greedy(eager, prompts)
    assert calls and set(calls) <= {1, 2}
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
    bound of transformers' bfloat16, every decode step through the compiled 1-row bucket."""
    from test_bf16 import BF16, bf16_oracle, finish, run_case

    path = checkpoint("qwen3_vl")
    prompts = bf16_oracle(path, "qwen3_vl", "tiny")
    settings = RunnerSettings(page_size=PAGE, cuda_graph_max_bs=1, max_seq_len=256,
                              compile_step="decode", compile_cache_dir=str(tmp_path))
    runner = ModelRunner(oracle.text_weights(path, BF16), settings, num_pages=64, dtype=BF16)
    gr = runner.graph_runner
    assert sorted(gr.compiled) == [1]
    calls, step = [], gr.compiled[1]
    gr.compiled[1] = lambda *a: (calls.append(1), step(*a))[1]
    finish(run_case(runner, 64, prompts, "qwen3_vl tiny compiled"), record_property)
    assert len(calls) == sum(len(p.tokens) - 1 for p in prompts)
