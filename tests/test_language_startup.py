"""The language tier's start-up on a GPU, checked on the CPU (issue 25, findings 1, 5, 10, 15).

- `--tp N` start-up: every rank builds its runner at the same time, so the collectives of
  its start-up (the page-count agreement, the graph capture's warm-up steps) meet. Real
  ranks (gloo), with graph capture replaced by what a CUDA capture's warm-up runs (a decode
  step: an all-reduce per layer and the logits gathered to rank 0): both ranks capture and
  the instance gets ready. Before, rank 0 captured inside ModelRunner() while rank 1 still
  waited for the page count rank 0 sent only afterwards: a hang (here it ends at the
  collective's timeout, and the instance never gets ready).
- the KV pool is sized last: torch.cuda's counters mocked (the runner is on the CPU), the
  events show the largest step measured, then the graphs, then `mem_get_info` (no weight
  left to adopt), then the cache allocated from what is free less both, then the capture.
- devices: rank r runs on the r-th GPU from rank 0's (`--device cuda:2`: 2 and 3), is bound
  to it (set_device) before the process group, which NCCL gets as `device_id`; graph
  capture runs with the runner's device current; a --tp the host lacks GPUs for is refused.
- the structured-output mask kernel is warmed while the service starts.
- the runner consumes its weights (finding 4's other half: nothing keeps the originals).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import subprocess
import sys
import textwrap

import language_oracle as oracle
import pytest
import torch
import torch.distributed as dist

from tandem.services.language.runner import kv_sizing
from tandem.services.language.runner.graph_runner import GraphRunner
from tandem.services.language.runner.kv_cache import KVCache
from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings
from tandem.services.language.tp import ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -- --tp start-up: the ranks' collectives meet ------------------------------------------

# Loaded by every process of the instance (PYTHONPATH): graph capture becomes what a CUDA
# capture's warm-up runs, on the CPU, and rank 0 keeps a graph runner on the CPU.
CAPTURE_HOOK = """
import dataclasses, os
import torch.distributed as dist
from tandem.services.language.runner.graph_runner import GraphRunner

def capture(self):
    self._step(self.batch_sizes[0], self.widths[0])  # all-reduces, then a gather to rank 0
    with open(os.environ["TANDEM_TEST_CAPTURE_LOG"], "a") as f:
        f.write(f"rank {dist.get_rank()} captured\\n")

GraphRunner.capture = capture
GraphRunner.use_graphs = property(lambda self: True, lambda self, value: None)

from tandem.services.language import main
_settings = main.runner_settings
main.runner_settings = lambda *a: dataclasses.replace(_settings(*a), cuda_graph_max_bs=1)
"""

RANK0 = """
import sys
from prometheus_client import CollectorRegistry
from tandem.metrics import metric_set
from tandem.services.language import main
from tandem.services.language.config import LanguageConfig
from tandem.services.language.metrics import LanguageMetrics

cfg = LanguageConfig(model=sys.argv[1], tp=2, kv_pages=16, kv_page_size=4, tp_timeout_s=30,
                     device="cpu")
engine, _, _ = main.build_engine(cfg, metric_set(LanguageMetrics, CollectorRegistry()))
print("READY", engine.runner.num_pages, flush=True)
engine.runner.tp.workers.stop()
"""


def test_tp_ranks_capture_together_and_get_ready(checkpoint, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(CAPTURE_HOOK))
    log = tmp_path / "captures.log"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TANDEM_TEST_CAPTURE_LOG": str(log)}
    p = subprocess.Popen([sys.executable, "-c", RANK0, str(checkpoint("qwen2_5_vl"))], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         start_new_session=True)
    try:
        # a hang guard: a start-up that deadlocks ends at the collective's timeout (30 s)
        out, err = p.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # this test's own process group (rank 0, rank 1)
    assert p.returncode == 0 and "READY 16" in out, err[-3000:]
    assert sorted(log.read_text().splitlines()) == ["rank 0 captured", "rank 1 captured"]


# -- the KV pool is sized last --------------------------------------------------------------

FREE = 64 << 20  # what mem_get_info says is free
STEP, GRAPH = 3 << 20, 2 << 20  # the peaks the two measured steps reach


def test_kv_pool_is_sized_after_the_largest_step_and_the_graphs(checkpoint, monkeypatch):
    events: list = []
    weights = oracle.text_weights(checkpoint("qwen2_5_vl"))
    peaks = iter([STEP, GRAPH])
    cuda = torch.cuda
    monkeypatch.setattr(kv_sizing.DeviceMemory, "of", classmethod(lambda cls, d: cls(d)))
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: 1000)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: events.append("reset"))
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: 1000 + next(peaks))
    monkeypatch.setattr(cuda, "empty_cache", lambda: events.append("empty_cache"))

    def mem_get_info(device=None):
        events.append(("mem_get_info", len(weights.tensors)))
        return FREE, 4 * FREE

    monkeypatch.setattr(cuda, "mem_get_info", mem_get_info)
    spy(monkeypatch, ModelRunner, "forward_eager", lambda self, b: ("step", b.num_tokens))
    spy(monkeypatch, GraphRunner, "_step", lambda self, bs, width: ("graph step", bs, width))
    spy(monkeypatch, KVCache, "__init__", lambda self, layers, pages, *a: ("kv", pages))
    monkeypatch.setattr(GraphRunner, "capture", lambda self: events.append("capture"))
    spy.events = events

    settings = RunnerSettings(page_size=4, max_seq_len=64, cuda_graph_max_bs=2,
                              max_prefill_tokens=32, max_decode_rows=3)
    runner = ModelRunner(weights, settings, num_pages=0, kv_memory_fraction=0.5)

    gr = runner.graph_runner
    widest = (2, gr.widths[-1])
    assert events == [
        ("kv", 1),  # the provisional one-page cache the measured steps run over
        ("step", 35), "reset", ("step", 35),  # 32 prompt rows + 3 decode rows: warm, measure
        ("graph step", *widest), "reset", ("graph step", *widest),  # the graphs' (warm, measure)
        "empty_cache", ("mem_get_info", 0),  # every weight adopted by then
        ("kv", runner.num_pages), "capture",
    ]
    c = runner.cfg
    per_page = KVCache.bytes_per_page(c.num_layers, 4, c.local_kv_heads, c.head_dim, runner.dtype)
    pool = GRAPH + 4 * runner.vocab_size * sum(gr.batch_sizes) * len(gr.widths)
    assert runner.num_pages == math.floor(0.5 * (FREE - STEP - pool) / per_page) - 1 > 0
    assert runner.kv.num_pages == runner.limits.num_pages == runner.num_pages


def spy(monkeypatch, cls, name, event):
    real = getattr(cls, name)

    def wrapped(self, *a, **k):
        spy.events.append(event(self, *a, **k))
        return real(self, *a, **k)

    monkeypatch.setattr(cls, name, wrapped)


def test_kv_sizing_refuses_a_device_with_no_room():
    with pytest.raises(ValueError, match="no device memory left for the KV pool"):
        kv_sizing.pages_for(0.5, free=10 << 20, reserve=9 << 20, per_page=1 << 20)
    with pytest.raises(ValueError, match="needs CUDA; set kv_pages"):
        kv_sizing.DeviceMemory.of(torch.device("cpu"))


# -- devices ----------------------------------------------------------------------------------


def test_each_rank_takes_the_next_gpu_from_rank_0s():
    cuda = torch.device
    assert [ranks.rank_device(cuda("cuda", 2), r) for r in range(2)] == [cuda("cuda", 2),
                                                                          cuda("cuda", 3)]
    assert ranks.rank_device(cuda("cuda"), 0) == cuda("cuda", 0)
    assert ranks.rank_device(cuda("cuda"), 1) == cuda("cuda", 1)
    assert ranks.rank_device(cuda("cpu"), 3) == cuda("cpu")


def test_a_tp_the_host_has_no_gpus_for_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    ranks.check_devices(torch.device("cuda", 2), 2)
    with pytest.raises(ValueError, match=r"--tp 2 from cuda:3 needs GPUs 3\.\.4; this host has 4"):
        ranks.check_devices(torch.device("cuda", 3), 2)
    ranks.check_devices(torch.device("cpu"), 8)


def test_a_cuda_rank_binds_its_device_before_joining_the_group(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.append((backend, kw.get("device_id"))))
    # the rendezvous store: made first, waiting the start-up bound, not the collectives'
    stores = []
    monkeypatch.setattr(dist, "TCPStore", lambda host, port, size, **kw: stores.append(
        (host, port, size, kw["is_master"], kw["timeout"].total_seconds())))
    ranks.init_group(1, 2, "127.0.0.1:1", torch.device("cuda", 3), 5.0)
    assert stores == [("127.0.0.1", 1, 2, False, ranks.START_TIMEOUT_FLOOR_S)]
    assert calls == [("set_device", torch.device("cuda", 3)), ("nccl", torch.device("cuda", 3))]
    calls.clear()
    ranks.init_group(1, 2, "127.0.0.1:1", torch.device("cpu"), 5.0)
    assert calls == [("gloo", None)]


class _FakeCuda:
    """torch.cuda's capture API, recording which device is current at each call."""

    def __init__(self) -> None:
        self.current = torch.device("cuda", 0)
        self.seen: list = []

    @contextlib.contextmanager
    def device(self, d):
        before, self.current = self.current, torch.device(d)
        try:
            yield
        finally:
            self.current = before

    @contextlib.contextmanager
    def graph(self, g, pool=None, stream=None):
        self.seen.append(("graph", self.current, stream.device))
        yield

    def stream_of(self, d=None):
        self.seen.append(("stream", torch.device(d)))
        return type("Stream", (), {"device": torch.device(d), "wait_stream": lambda s, o: None})()

    def synchronize(self, d=None):
        self.seen.append(("synchronize", torch.device(d) if d is not None else self.current))


def test_graphs_are_captured_on_the_runners_device(checkpoint, monkeypatch):
    runner = ModelRunner(oracle.text_weights(checkpoint("qwen2_5_vl")),
                         RunnerSettings(page_size=4, max_seq_len=64, cuda_graph_max_bs=1),
                         num_pages=8)
    gr = runner.graph_runner
    fake = _FakeCuda()
    for name, value in [("device", fake.device), ("graph", fake.graph),
                        ("graph_pool_handle", lambda: object()), ("Stream", fake.stream_of),
                        ("current_stream", fake.stream_of), ("stream", lambda s: contextlib.nullcontext()),
                        ("CUDAGraph", lambda: object()), ("synchronize", fake.synchronize)]:
        monkeypatch.setattr(torch.cuda, name, value)
    gr.device, gr.use_graphs = torch.device("cuda", 1), True  # as a runner on cuda:1 is
    gr.capture()
    graphs = [s for s in fake.seen if s[0] == "graph"]
    assert len(graphs) == len(gr.batch_sizes) * len(gr.widths)
    cuda1 = torch.device("cuda", 1)
    assert all(s == ("graph", cuda1, cuda1) for s in graphs), graphs
    assert all(s[1] == cuda1 for s in fake.seen if s[0] in ("stream", "synchronize")), fake.seen


# -- the mask kernel is warmed at start-up ---------------------------------------------------


def test_service_start_warms_the_mask_kernel(checkpoint, monkeypatch):
    import xgrammar as xgr
    from prometheus_client import CollectorRegistry

    from tandem.metrics import metric_set
    from tandem.services.language.config import LanguageConfig
    from tandem.services.language.main import build_engine
    from tandem.services.language.metrics import LanguageMetrics

    calls = []
    real = xgr.apply_token_bitmask_inplace

    def counted(logits, bitmask, **kw):
        calls.append((logits.device, logits.dtype, tuple(logits.shape), len(kw["indices"])))
        return real(logits, bitmask, **kw)

    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace", counted)
    cfg = LanguageConfig(model=str(checkpoint("qwen2_5_vl")), kv_pages=16, kv_page_size=4)
    engine, _spec, _tok = build_engine(cfg, metric_set(LanguageMetrics, CollectorRegistry()))
    v = engine.runner.vocab_size
    # one call per specialisation of the kernel (rows: 1, not a multiple of 16, 16), at the
    # width and dtype apply_masks uses, before any request
    assert calls == [(engine.runner.device, torch.float32, (16, v), n) for n in (1, 2, 16)]


# -- the runner consumes its weights ----------------------------------------------------------


def test_the_runner_consumes_its_weights(checkpoint):
    weights = oracle.text_weights(checkpoint("qwen2_5_vl"))
    spare = weights.copy()
    runner = ModelRunner(weights, RunnerSettings(page_size=4), num_pages=8)
    assert not weights.tensors and runner.num_pages == 8
    with pytest.raises(ValueError, match=r"consumed.*weights\.copy\(\)"):
        ModelRunner(weights, RunnerSettings(page_size=4), num_pages=8)
    assert spare.tensors  # a copy taken before: another dict over the same tensors
    assert dataclasses.is_dataclass(spare)


# -- on a GPU ----------------------------------------------------------------------------------


# What the sized-pool test leaves free on the GPU, the rest held by a ballast tensor (as
# another process's memory would be): at 0.9 of an H200's ~140 GB the tiny model's pool
# would be ~30M pages, each layer's K and V tensors ~2^34 elements, far past any real
# model's (a 3B model's there: ~2^30) and past what 32-bit offsets in a kernel can reach.
SIZED_POOL_ROOM = 8 << 30


@pytest.mark.gpu
def test_on_cuda_the_sized_pool_leaves_room_for_the_graphs_and_the_largest_step(checkpoint):
    """Sized at a fraction of 0.9 of what is free (SIZED_POOL_ROOM: the pool takes most of
    it), the graphs were captured after it and the largest step the engine schedules still
    runs beside it. Everything is let go at the end: the `gpu` tests share one process."""
    import gc

    free, _total = torch.cuda.mem_get_info()
    ballast = torch.empty(max(0, free - SIZED_POOL_ROOM), dtype=torch.uint8, device="cuda")
    runner = None
    try:
        settings = RunnerSettings(page_size=16, max_seq_len=2048, cuda_graph_max_bs=16,
                                  max_prefill_tokens=1024, max_decode_rows=16)
        runner = ModelRunner(oracle.text_weights(checkpoint("qwen2_5_vl"), torch.bfloat16),
                             settings, num_pages=0, kv_memory_fraction=0.9, device="cuda",
                             dtype=torch.bfloat16)
        gr = runner.graph_runner
        assert len(gr.graphs) == len(gr.batch_sizes) * len(gr.widths)
        c = runner.cfg
        per_page = KVCache.bytes_per_page(c.num_layers, 16, c.local_kv_heads, c.head_dim,
                                          runner.dtype)
        free, _total = torch.cuda.mem_get_info()
        assert runner.num_pages * per_page > 4 * free  # the pool took most of what was free
        out = runner.forward_eager(runner._worst_step())  # no out-of-memory beside the pool
        assert out.last_logits.shape == (settings.max_decode_rows + 1, runner.vocab_size)
    finally:
        del ballast, runner  # (a runner and its graph runner refer to each other: gc)
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_a_runner_on_the_second_gpu_captures_there(checkpoint):
    from test_graph_runner import _decode_batch, _prefill

    page = oracle.page_size("cuda:1")
    runner = ModelRunner(oracle.text_weights(checkpoint("qwen2_5_vl")),
                         RunnerSettings(page_size=page, max_seq_len=256, cuda_graph_max_bs=8),
                         num_pages=oracle.kv_pages(8 * 256, "cuda:1"), device="cuda:1")
    from tandem.services.language.engine.kv_pages import KVPagePool

    seqs = _prefill(runner, KVPagePool(runner.num_pages, page), 8, seed=3)
    for bs in (1, 3, 8):  # replays on cuda:1 equal eager there (stale graphs would not)
        batch = _decode_batch(seqs[:bs])
        got = runner.graph_runner.run(batch).last_logits
        torch.testing.assert_close(got, runner.forward_eager(batch).last_logits, rtol=0, atol=1e-4)
