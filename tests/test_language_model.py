"""Our decoder + paged KV runner against transformers (float32, tiny and small checkpoints).

What must hold: prompt logits within 1e-4 of transformers' forward on the same prompt (0, 1
and 2 images; deepstack for Qwen3-VL); chunked prefill and mixed batches (prompt chunks of
some sequences beside decode tokens of others) give every sequence the logits it gets alone;
greedy decoding equals `generate()` token for token; bad batches are refused clearly.
The runner runs on `oracle.test_device()` (`pytest --device cuda`: float32 on the GPU, the
same 1e-4), the oracle on the CPU; references move to the runner's device to be compared.
"""

from __future__ import annotations

import language_oracle as oracle
import pytest
import torch

from tandem.services.language.engine.kv_pages import KVPagePool
from tandem.services.language.runner.forward_batch import ForwardBatch, SeqChunk, decode_positions
from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings
from tandem.units import ceil_div

ARCHS = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
TOL = 1e-4
DEVICE = oracle.test_device()
PAGE = oracle.page_size(DEVICE)  # small pages (4 on the CPU): chunk boundaries fall mid-page


class Seq:
    """Test-side bookkeeping of one sequence: its payload, pages and generated tokens."""

    def __init__(self, seq_id: int, payload, pool: KVPagePool) -> None:
        self.id, self.p, self.pool = seq_id, payload, pool
        self.pages: list[int] = []
        self.done = 0  # tokens in the KV cache
        self.generated: list[int] = []

    def _grow(self, total: int) -> None:
        more = ceil_div(total, self.pool.page_size) - len(self.pages)
        if more > 0:
            self.pages += self.pool.alloc(more)

    def prompt_chunk(self, n: int, want: bool = True) -> SeqChunk:
        a = self.done
        self._grow(a + n)
        self.done += n
        return SeqChunk(
            self.id, a, self.p.mrope_positions[:, a : a + n].long(), list(self.pages),
            input_embeds=self.p.input_embeds[a : a + n], want_prompt_logits=want,
        )

    def decode_chunk(self, token: int) -> SeqChunk:
        a = self.done
        self._grow(a + 1)
        self.done += 1
        pos = decode_positions(a, self.p.mrope_delta)
        return SeqChunk(self.id, a, pos, list(self.pages), token_ids=torch.tensor([token]))

    def free(self) -> None:
        self.pool.free(self.pages)
        self.pages = []


@pytest.fixture(scope="module", params=ARCHS)
def case(request, checkpoint):
    """(arch, hf model, weights, [(inputs, payload, reference prompt logits)] for 0/1/2 images)."""
    path = checkpoint(request.param)
    model, proc = oracle.load(path)
    prompts = []
    for n_img in (0, 1, 2):
        images = [
            oracle.make_image(10 * n_img + i, (56 + 28 * i, 84 - 28 * i)) for i in range(n_img)
        ]
        inputs = oracle.make_inputs(proc, f"Describe picture {n_img} in a few words.", images)
        ref = oracle.prompt_logits(model, inputs).to(DEVICE)
        prompts.append((inputs, oracle.payload(model, inputs), ref))
    return request.param, model, oracle.text_weights(path), prompts


def make_runner(weights, tokens: int = 384) -> tuple[ModelRunner, KVPagePool]:
    """A runner whose KV cache holds `tokens`, and the pool of its pages (the engine's
    scheduler holds it in service)."""
    pages = oracle.kv_pages(tokens, DEVICE)
    runner = ModelRunner(weights.copy(), RunnerSettings(page_size=PAGE), num_pages=pages, device=DEVICE)
    return runner, KVPagePool(pages, PAGE)


def test_prompt_logits_match_transformers(case):
    arch, model, weights, prompts = case
    runner, pool = make_runner(weights)
    for i, (_inputs, payload, ref) in enumerate(prompts):
        s = Seq(i, payload, pool)
        out = runner.forward(ForwardBatch([s.prompt_chunk(payload.num_tokens)]))
        got = out.prompt_logits[i]
        assert got.dtype == torch.float32 and got.shape == ref.shape
        assert (got - ref).abs().max().item() < TOL, f"{arch} {i} images"
        assert torch.equal(out.last_logits[0], got[-1])
        s.free()
    assert pool.num_free == pool.num_total


def test_chunked_prefill_matches_whole_prompt(case):
    _arch, _model, weights, prompts = case
    runner, pool = make_runner(weights)
    _inputs, payload, ref = prompts[2]  # two images: chunk edges cut through image runs
    s = Seq(0, payload, pool)
    sizes, left = [], payload.num_tokens
    for n in (7, 1, 13):  # includes a 1-token prompt chunk (the batched single-row path)
        sizes.append(n)
        left -= n
    sizes.append(left)
    parts = [runner.forward(ForwardBatch([s.prompt_chunk(n)])).prompt_logits[0] for n in sizes]
    assert (torch.cat(parts) - ref).abs().max().item() < TOL
    s.free()


def _greedy_alone(runner, pool, payload, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    s = Seq(0, payload, pool)
    logits = [
        runner.forward(ForwardBatch([s.prompt_chunk(payload.num_tokens, False)])).last_logits[0]
    ]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits.append(runner.forward(ForwardBatch([s.decode_chunk(tokens[-1])])).last_logits[0])
        tokens.append(int(logits[-1].argmax()))
    s.free()
    return tokens, logits


def test_mixed_batch_matches_each_sequence_alone(case):
    """Two prompt chunks of A and B beside decode tokens of C and D, over several steps."""
    _arch, _model, weights, prompts = case
    runner, pool = make_runner(weights, tokens=640)
    alone = [_greedy_alone(runner, pool, p[1], 4) for p in prompts]  # tokens + logits per prompt

    a, b = Seq(10, prompts[2][1], pool), Seq(11, prompts[1][1], pool)
    c, d = Seq(12, prompts[0][1], pool), Seq(13, prompts[1][1], pool)
    # C and D are already decoding when A and B arrive.
    for s in (c, d):
        first = runner.forward(ForwardBatch([s.prompt_chunk(s.p.num_tokens, False)])).last_logits[0]
        s.generated.append(int(first.argmax()))
    half_a, half_b = a.p.num_tokens // 2, b.p.num_tokens - 5
    out = runner.forward(
        ForwardBatch([a.prompt_chunk(half_a), c.decode_chunk(c.generated[-1]),
                      b.prompt_chunk(half_b), d.decode_chunk(d.generated[-1])])
    )
    pa, pb = out.prompt_logits[10], out.prompt_logits[11]
    c.generated.append(int(out.last_logits[1].argmax()))
    d.generated.append(int(out.last_logits[3].argmax()))
    assert torch.equal(out.last_logits[0], pa[-1]) and torch.equal(out.last_logits[2], pb[-1])
    # Second step: the rest of A and B beside C and D decoding.
    out = runner.forward(
        ForwardBatch([c.decode_chunk(c.generated[-1]), a.prompt_chunk(a.p.num_tokens - half_a),
                      d.decode_chunk(d.generated[-1]), b.prompt_chunk(5)])
    )
    pa, pb = torch.cat([pa, out.prompt_logits[10]]), torch.cat([pb, out.prompt_logits[11]])
    c.generated.append(int(out.last_logits[0].argmax()))
    d.generated.append(int(out.last_logits[2].argmax()))
    assert (pa - prompts[2][2]).abs().max().item() < TOL
    assert (pb - prompts[1][2]).abs().max().item() < TOL
    assert c.generated == alone[0][0][:3] and d.generated == alone[1][0][:3]
    assert int(pa[-1].argmax()) == alone[2][0][0] and int(pb[-1].argmax()) == alone[1][0][0]
    # Third step: a pure decode batch over four different context lengths (padded tables).
    out = runner.forward(
        ForwardBatch(
            [
                s.decode_chunk(t)
                for s, t in (
                    (a, int(pa[-1].argmax())),
                    (b, int(pb[-1].argmax())),
                    (c, c.generated[-1]),
                    (d, d.generated[-1]),
                )
            ]
        )
    )
    for row, (s, ref) in enumerate(
        ((a, alone[2][1][1]), (b, alone[1][1][1]), (c, alone[0][1][3]), (d, alone[1][1][3]))
    ):
        assert (out.last_logits[row] - ref).abs().max().item() < TOL, s.id
    for s in (a, b, c, d):
        s.free()
    assert pool.num_free == pool.num_total


def test_greedy_decode_equals_generate(case):
    """All three prompts decode together (one batch per step) and match generate()."""
    _arch, model, weights, prompts = case
    steps = 10
    runner, pool = make_runner(weights, tokens=640)
    eos = set(runner.eos_token_ids)
    seqs = [Seq(i, p[1], pool) for i, p in enumerate(prompts)]
    out = runner.forward(ForwardBatch([s.prompt_chunk(s.p.num_tokens, False) for s in seqs]))
    logits: dict[int, list[torch.Tensor]] = {s.id: [] for s in seqs}
    for s, row in zip(seqs, out.last_logits, strict=True):
        s.generated.append(int(row.argmax()))
        logits[s.id].append(row)
    live = [s for s in seqs if s.generated[-1] not in eos]
    while live and max(len(s.generated) for s in live) < steps:
        out = runner.forward(ForwardBatch([s.decode_chunk(s.generated[-1]) for s in live]))
        for s, row in zip(live, out.last_logits, strict=True):
            s.generated.append(int(row.argmax()))
            logits[s.id].append(row)
        live = [s for s in live if s.generated[-1] not in eos and len(s.generated) < steps]
    for s, (inputs, _p, _r) in zip(seqs, prompts, strict=True):
        tokens, ref = oracle.generate(model, inputs, steps)
        ref = ref.to(DEVICE)
        assert s.generated == tokens, s.id
        # Every decode step's logits, not just the argmax, agree with transformers'.
        assert (torch.stack(logits[s.id]) - ref).abs().max().item() < TOL, s.id
        s.free()


def test_resume_recomputes_prompt_and_generated_tokens_in_one_step(case):
    """After a retraction the scheduler re-prefills prompt embeddings plus the generated
    tokens (as token ids): two chunks of ONE sequence in one batch, the second attending
    to the first's fresh K/V. The next logits equal those of uninterrupted decoding."""
    _arch, _model, weights, prompts = case
    runner, pool = make_runner(weights, tokens=384)
    payload = prompts[1][1]
    tokens, logits = _greedy_alone(runner, pool, payload, 5)
    s = Seq(0, payload, pool)
    first = s.prompt_chunk(payload.num_tokens, want=False)
    a = s.done
    s._grow(a + 4)
    s.done += 4
    pos = torch.arange(a, a + 4).expand(3, 4) + payload.mrope_delta
    again = SeqChunk(0, a, pos, list(s.pages), token_ids=torch.tensor(tokens[:4]))
    out = runner.forward(ForwardBatch([first, again]))
    assert (out.last_logits[0] - logits[0]).abs().max().item() < TOL
    assert (out.last_logits[1] - logits[4]).abs().max().item() < TOL
    assert int(out.last_logits[1].argmax()) == tokens[4]
    s.free()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_small_checkpoint_prompt_logits_and_greedy(arch, checkpoint):
    path = checkpoint(arch, "small")
    model, proc = oracle.load(path)
    inputs = oracle.make_inputs(proc, "What is in this image?", [oracle.make_image(7, (112, 84))])
    payload, ref = oracle.payload(model, inputs), oracle.prompt_logits(model, inputs).to(DEVICE)
    # (the engine suite's small-checkpoint cache: on CUDA one flex geometry for both)
    pages = oracle.kv_pages(4096, DEVICE, page=16)
    runner = ModelRunner(oracle.text_weights(path), RunnerSettings(page_size=16), num_pages=pages,
                         device=DEVICE)
    s = Seq(0, payload, KVPagePool(pages, 16))
    half = payload.num_tokens // 2
    got = torch.cat([runner.forward(ForwardBatch([s.prompt_chunk(n)])).prompt_logits[0]
                     for n in (half, payload.num_tokens - half)])
    assert (got - ref).abs().max().item() < TOL
    s.generated.append(int(got[-1].argmax()))
    for _ in range(3):
        s.generated.append(
            int(
                runner.forward(ForwardBatch([s.decode_chunk(s.generated[-1])]))
                .last_logits[0]
                .argmax()
            )
        )
    assert s.generated == oracle.generate(model, inputs, 4)[0]


def test_bad_batches_are_refused(case):
    _arch, _model, weights, prompts = case
    runner, _pool = make_runner(weights, tokens=32)
    payload = prompts[0][1]
    n = PAGE + 4  # more tokens than the one page the block table names
    pos = payload.mrope_positions[:, :n].long()
    with pytest.raises(ValueError, match="block table"):
        runner.forward(
            ForwardBatch([SeqChunk(0, 0, pos, [0], input_embeds=payload.input_embeds[:n])])
        )
    with pytest.raises(ValueError, match="input_embeds"):
        runner.forward(ForwardBatch([SeqChunk(0, 0, pos, [0, 1], input_embeds=torch.zeros(8, 3))]))
    with pytest.raises(ValueError, match="token id"):
        runner.forward(
            ForwardBatch([SeqChunk(0, 0, pos[:, :1], [0], token_ids=torch.tensor([10**7]))])
        )
    with pytest.raises(ValueError, match="empty"):
        runner.forward(ForwardBatch([]))
