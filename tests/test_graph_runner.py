"""The decode graph runner equals the plain forward for every bucket, padded sizes included.

On CPU the runner executes its captured step eagerly over its static buffers, so bucket
choice, padding rows (dummy page, seq_len 1) and slicing are exercised here; the `gpu` test
checks real capture/replay against eager on CUDA.
"""

from __future__ import annotations

import language_oracle as oracle
import pytest
import torch

from tandem.services.language.engine.kv_pages import KVPagePool
from tandem.services.language.runner.forward_batch import ForwardBatch, SeqChunk, decode_positions
from tandem.services.language.runner.graph_runner import batch_buckets, width_buckets
from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings
from tandem.units import ceil_div

PAGE = 4
MAX_BS = 32
MAX_SEQ = 256  # 64 pages: width buckets 16, 32, 64


def test_buckets():
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(5) == [1, 2, 4]
    assert width_buckets(64) == [16, 32, 64]
    assert width_buckets(100) == [16, 32, 64, 100]
    assert width_buckets(8) == [8]


def _prefill(runner: ModelRunner, pool: KVPagePool, n_seqs: int, seed: int):
    """n_seqs sequences of varied lengths (3..~200 tokens) prefilled from token ids."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n_seqs):
        n = int(torch.randint(3, MAX_SEQ - 60, (1,), generator=g))
        ids = torch.randint(0, runner.vocab_size, (n,), generator=g)
        pages = pool.alloc(ceil_div(n + 1, pool.page_size))
        pos = torch.arange(n).expand(3, n)
        runner.forward_eager(ForwardBatch([SeqChunk(i, 0, pos, pages, token_ids=ids)]))
        seqs.append((i, n, pages, int(ids[-1])))
    return seqs


def _decode_batch(seqs) -> ForwardBatch:
    return ForwardBatch(
        [SeqChunk(i, n, decode_positions(n, 0), pages, token_ids=torch.tensor([tok]))
         for i, n, pages, tok in seqs]
    )


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])  # MoE: graphed too
def runner(request, checkpoint):
    r = ModelRunner(
        oracle.text_weights(checkpoint(request.param)),
        RunnerSettings(page_size=PAGE, cuda_graph_max_bs=MAX_BS, max_seq_len=MAX_SEQ),
        num_pages=40 * ceil_div(MAX_SEQ, PAGE),
    )
    pool = KVPagePool(r.num_pages, PAGE)
    return r, pool, _prefill(r, pool, 36, seed=0)


@pytest.mark.parametrize("bs", [1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 32])
def test_graph_equals_eager_for_every_bucket(runner, bs):
    r, _pool, seqs = runner
    gr = r.graph_runner
    batch = _decode_batch(seqs[:bs])
    assert gr.can_run(batch)
    dummy = r.kv.dummy_page
    other = [p for s in seqs[bs:] for p in s[2]]
    before = [k[other].clone() for k in r.kv.k]
    got = gr.run(batch)
    # Padding rows wrote only to the dummy page: pages of sequences outside the batch are intact.
    assert all(torch.equal(k[other], b) for k, b in zip(r.kv.k, before, strict=True))
    if bs not in gr.batch_sizes:
        assert r.kv.k[0][dummy].abs().sum() > 0
    want = r.forward_eager(batch)
    assert got.last_logits.shape == (bs, r.vocab_size)
    torch.testing.assert_close(got.last_logits, want.last_logits, rtol=0, atol=1e-5)
    assert torch.equal(got.last_logits.argmax(-1), want.last_logits.argmax(-1))
    # ModelRunner.forward routes a pure decode batch through the graph runner.
    torch.testing.assert_close(r.forward(batch).last_logits, got.last_logits, rtol=0, atol=0)


def test_batches_the_graph_runner_cannot_serve_fall_back(runner):
    r, pool, seqs = runner
    gr = r.graph_runner
    too_many = _decode_batch(seqs[: MAX_BS + 1])
    assert not gr.can_run(too_many)
    assert r.forward(too_many).last_logits.shape == (MAX_BS + 1, r.vocab_size)
    i, n, pages, _tok = seqs[0]
    mixed = ForwardBatch([_decode_batch(seqs[1:3]).chunks[0],
                          SeqChunk(i, n - 2, torch.arange(n - 2, n).expand(3, 2), pages,
                                   token_ids=torch.tensor([5, 6]))])
    assert not mixed.is_pure_decode and not gr.can_run(mixed)
    with pytest.raises(ValueError, match="cannot serve"):
        gr.run(mixed)
    long_pages = pool.alloc(ceil_div(MAX_SEQ + 1, PAGE))
    try:
        too_long = ForwardBatch([SeqChunk(99, MAX_SEQ, decode_positions(MAX_SEQ, 0), long_pages,
                                          token_ids=torch.tensor([1]))])
        assert not gr.can_run(too_long)
        assert r.forward(too_long).last_logits.shape == (1, r.vocab_size)
    finally:
        pool.free(long_pages)


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager(checkpoint):
    page = oracle.page_size("cuda")
    r = ModelRunner(
        oracle.text_weights(checkpoint("qwen2_5_vl")),
        RunnerSettings(page_size=page, cuda_graph_max_bs=MAX_BS, max_seq_len=MAX_SEQ),
        num_pages=40 * ceil_div(MAX_SEQ, page), device="cuda",
    )
    gr = r.graph_runner
    assert gr.use_graphs and len(gr.graphs) == len(gr.batch_sizes) * len(gr.widths)
    seqs = _prefill(r, KVPagePool(r.num_pages, page), MAX_BS, seed=1)
    for bs in (1, 3, 8, 17, 32):
        batch = _decode_batch(seqs[:bs])
        got = gr.run(batch)
        want = r.forward_eager(batch)
        torch.testing.assert_close(got.last_logits, want.last_logits, rtol=0, atol=1e-4)
        # A second replay with the same inputs gives the same answer (buffers re-filled).
        torch.testing.assert_close(gr.run(batch).last_logits, got.last_logits, rtol=0, atol=0)
