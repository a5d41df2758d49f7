"""Tensor parallelism at --tp 2 on CPU (gloo): real rank processes, real collectives.

Each case starts rank 0 in this process (the engine, scheduler and sampler) and rank 1 as
its own process (`tandem.services.language.tp.worker`), exactly as `tandem language --tp 2` does:
- prompt logits equal transformers' within 1e-4 for 0/1/2-image prompts;
- 16 concurrent greedy generations (0-3 images, shared steps, a KV pool small enough to
  retract) equal `generate()` token for token;
- each rank holds its part of the decoder: about 1/N of the split tensors, the replicated
  ones whole (listed in shard.py), and reads only its own slices from the files;
- kill -9 of rank 1 ends the instance (checked in a child process: rank 0 exits non-zero
  with one line naming the rank).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import language_oracle as oracle
import pytest
import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from test_language_engine import Case, check_greedy_streams, collect, greedy_requests
from test_language_model import PAGE, TOL, Seq

from tandem.metrics import metric_set
from tandem.models.checkpoint import read_spec
from tandem.models.split import load_text_weights
from tandem.services.language.config import LanguageConfig
from tandem.services.language.engine.kv_pages import KVPagePool
from tandem.services.language.main import build_engine
from tandem.services.language.metrics import LanguageMetrics
from tandem.services.language.model.shard import REPLICATED, Shard
from tandem.services.language.runner.forward_batch import ForwardBatch

pytestmark = pytest.mark.timeout(600)
ARCHS = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
_cases: dict[str, Case] = {}


def tp_engine(ckpt, num_pages: int, tp: int = 2, page: int = 4, **cfg):
    lc = LanguageConfig(model=str(ckpt), tp=tp, kv_pages=num_pages, kv_page_size=page,
                        tp_timeout_s=60, **cfg)
    engine, _spec, _tok = build_engine(lc, metric_set(LanguageMetrics, CollectorRegistry()))
    return engine


def stop(engine) -> None:
    engine.stop()
    engine.runner.tp.workers.stop()
    dist.destroy_process_group()


@pytest.fixture(params=ARCHS)
def case(request, checkpoint):
    arch = request.param
    if arch not in _cases:
        _cases[arch] = Case(checkpoint(arch))
    return arch, checkpoint(arch), _cases[arch]


def test_tp2_prompt_logits_and_concurrent_greedy_equal_transformers(case):
    arch, ckpt, c = case
    # 48 pages x 4 tokens: the longest prompt + output barely fits alone: retractions
    engine = tp_engine(ckpt, 48, max_prefill_tokens=64, init_new_token_ratio=0.05)
    try:
        runner = engine.runner
        assert runner.tp.size == 2 and runner.cfg.local_heads * 2 == runner.cfg.num_heads
        model, proc = oracle.load(ckpt)
        pool = KVPagePool(runner.num_pages, PAGE)
        engine.start()
        reqs = greedy_requests(c, 1000)
        streams = collect(engine, reqs)
        assert engine.scheduler.num_retractions > 0
        check_greedy_streams(c, engine, reqs, streams)
        assert engine.pool.num_free == engine.pool.num_total
        engine.stop()  # the engine thread is done: drive the runner directly
        for n_img in (0, 1, 2):
            images = [oracle.make_image(10 * n_img + i, (56 + 28 * i, 84 - 28 * i))
                      for i in range(n_img)]
            inputs = oracle.make_inputs(proc, f"Describe picture {n_img} in a few words.", images)
            payload, ref = oracle.payload(model, inputs), oracle.prompt_logits(model, inputs)
            s = Seq(n_img, payload, pool)
            got = runner.forward(ForwardBatch([s.prompt_chunk(payload.num_tokens)])).prompt_logits[n_img]
            assert got.shape == ref.shape
            assert (got - ref).abs().max().item() < TOL, f"{arch} {n_img} images"
            s.free()
    finally:
        stop(engine)


@pytest.mark.parametrize("arch,size,tp", [(a, "small", 2) for a in ARCHS]
                         + [pytest.param("qwen2_5_vl", "tiny", 4, marks=pytest.mark.slow),
                            ("qwen3_vl", "tiny", 4)])
def test_prompt_logits_and_greedy_small_preset_and_tp4(arch, size, tp, checkpoint):
    """The small preset at --tp 2 (12 layers, 8 heads, 2 KV heads), and --tp 4 on the tiny
    one, where the 2 KV heads are fewer than the ranks (each rank holds the one its query
    heads use; Qwen2.5's KV biases sliced the same way): chunked prompt logits within
    1e-4 of transformers and greedy decode equal to `generate()`."""
    path = checkpoint(arch, size)
    model, proc = oracle.load(path)
    inputs = oracle.make_inputs(proc, "What is in this image?", [oracle.make_image(7, (112, 84))])
    payload, ref = oracle.payload(model, inputs), oracle.prompt_logits(model, inputs)
    engine = tp_engine(path, 16, tp=tp, page=16)
    try:
        runner = engine.runner
        assert runner.cfg.local_heads * tp == runner.cfg.num_heads and runner.cfg.local_kv_heads == 1
        s = Seq(0, payload, KVPagePool(16, 16))
        half = payload.num_tokens // 2
        got = torch.cat([runner.forward(ForwardBatch([s.prompt_chunk(n)])).prompt_logits[0]
                         for n in (half, payload.num_tokens - half)])
        assert (got - ref).abs().max().item() < TOL
        s.generated.append(int(got[-1].argmax()))
        for _ in range(3):
            out = runner.forward(ForwardBatch([s.decode_chunk(s.generated[-1])]))
            s.generated.append(int(out.last_logits[0].argmax()))
        assert s.generated == oracle.generate(model, inputs, 4)[0]
    finally:
        stop(engine)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_rank_holds_and_reads_only_its_part(arch, checkpoint, monkeypatch):
    ckpt = checkpoint(arch)
    spec = read_spec(ckpt)
    whole = load_text_weights(spec).tensors
    read: dict[int, dict[str, list]] = {0: {}, 1: {}}
    import safetensors

    real_open = safetensors.safe_open

    class Spy:  # records every slice a rank reads; a whole get_tensor is recorded as None
        def __init__(self, rank, *a, **k):
            self.rank, self.f = rank, real_open(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            read[self.rank].setdefault(name, []).append(None)
            return self.f.get_tensor(name)

        def get_slice(self, name):
            stored, rank = self.f.get_slice(name), self.rank

            class Sl:
                def get_shape(self):
                    return stored.get_shape()

                def __getitem__(self, idx):
                    read[rank].setdefault(name, []).append(idx)
                    return stored[idx]

            return Sl()

    shards = {}
    for r in (0, 1):
        monkeypatch.setattr(safetensors, "safe_open", lambda *a, r=r, **k: Spy(r, *a, **k))
        shard = Shard.of(spec, r, 2)
        shards[r] = load_text_weights(spec, shard=shard).tensors
    monkeypatch.setattr(safetensors, "safe_open", real_open)

    def replicated(name: str) -> bool:
        return any(p in name for p in REPLICATED)

    n_whole = sum(t.numel() for n, t in whole.items() if not replicated(n))
    for r in (0, 1):
        mine = sum(t.numel() for n, t in shards[r].items() if not replicated(n))
        assert abs(mine - n_whole / 2) <= 0.01 * n_whole, (r, mine, n_whole)
        for n, t in shards[r].items():
            if replicated(n):
                assert torch.equal(t, whole[n]), n
    # split tensors were read as slices only, and the two ranks' slices never overlap
    split = [n for n in read[0] if any(i is not None for i in read[0][n])]
    assert split and all(None not in read[r][n] for r in (0, 1) for n in split)
    for n in split:
        for a, b in zip(read[0][n], read[1][n], strict=True):
            assert a != b, n


def test_kill9_of_rank_1_ends_the_instance(checkpoint, tmp_path):
    """Rank 0 in a child process (it exits): killing rank 1 makes it exit within seconds,
    non-zero, with one line naming the rank."""
    ckpt = checkpoint("qwen2_5_vl")
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        from prometheus_client import CollectorRegistry
        from tandem.services.language.config import LanguageConfig
        from tandem.services.language.main import build_engine
        from tandem.services.language.metrics import LanguageMetrics
        from tandem.metrics import metric_set
        lc = LanguageConfig(model={str(ckpt)!r}, tp=2, kv_pages=64, kv_page_size=4)
        engine, _, _ = build_engine(lc, metric_set(LanguageMetrics, CollectorRegistry()))
        print("PIDS", engine.runner.tp.workers.procs[0].pid, flush=True)
        time.sleep(120)
    """))
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        line = p.stdout.readline()
        assert line.startswith("PIDS"), (line, p.stderr.read()[-2000:] if p.poll() is not None else "")
        os.kill(int(line.split()[1]), signal.SIGKILL)
        # the instance ends itself (a hang guard, not a bound: the claim is that it ends, non-zero)
        code = p.wait(timeout=60)
        assert code != 0
        err = p.stderr.read()
        assert "rank 1 exited" in err and "ending this instance" in err, err[-2000:]
    finally:
        p.kill()


def test_step_messages_are_plain_data_not_pickle():
    """A step crosses to the other ranks as safetensors bytes with a JSON header (no pickle
    across the process boundary): every field of every chunk survives, non-contiguous
    embedding rows included, and the bytes hold no pickle opcode stream. Rows the ranks
    hold (the transfer wrote them to every rank) are named, not carried."""
    import safetensors.torch

    from tandem.services.language.runner.forward_batch import SeqChunk, decode_positions
    from tandem.services.language.tp import wire

    rows = torch.randn(12, 10)[:, :8]  # a strided view, as a payload slice can be
    batch = ForwardBatch([
        SeqChunk(3, 0, torch.arange(5).expand(3, 5), [4, 1], input_embeds=rows[2:7]),
        SeqChunk(9, 17, decode_positions(17, -3), [0, 6], token_ids=torch.tensor([42]),
                 want_prompt_logits=True),
        SeqChunk(5, 4, torch.arange(3).expand(3, 3), [2, 3], input_embeds=rows[0:3],
                 embeds_key=77, embeds_row=4),
    ])
    held = {77: torch.cat([torch.zeros(4, 8), rows[0:3]])}  # payload 77's rows on a rank
    data = wire.encode_step(batch)
    assert not data.startswith(b"\x80")  # pickle protocol 2+ header
    carried = set(safetensors.torch.load(data))
    assert "0.input_embeds" in carried and "2.input_embeds" not in carried
    taken = []
    got = wire.decode_step(data, lambda k, r, n: taken.append((k, r, n)) or held[k][r:r + n])
    assert taken == [(77, 4, 3)]
    for want, have in zip(batch.chunks, got.chunks, strict=True):
        assert (have.seq_id, have.start, have.block_table, have.want_prompt_logits,
                have.embeds_key, have.embeds_row) == (
            want.seq_id, want.start, want.block_table, want.want_prompt_logits,
            want.embeds_key, want.embeds_row)
        for name in ("positions", "input_embeds", "token_ids"):
            a, b = getattr(want, name), getattr(have, name)
            assert (a is None and b is None) or torch.equal(a, b), name
    assert wire.decode_json(wire.encode_json({"num_pages": 7})) == {"num_pages": 7}
