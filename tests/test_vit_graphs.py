"""The ViT's static and graph paths (services/encoder/vit/runner.py) without a GPU.

- Buckets: a batch is padded up to a patch bucket; its features equal the eager path's bit
  for bit on the CPU (where the step runs eagerly over the same buffers, attending per
  segment as transformers does) for several patch counts and both architectures; the
  padding is a run of segments of its own (the masked attention, CUDA's float32 path, is
  checked within float32 tolerance).
- Captures: every key is recorded once, at start-up; a mix of image sizes replays them
  (nothing recorded again) and a batch over the largest bucket runs eagerly; a capture that
  fails is logged once, counted (stats, metrics) and leaves its bucket eager, never
  evicting or retrying.
- CUDA without a GPU (fake CUDA tensors from FakeTensorMode, torch.cuda's stream, graph
  and device calls mocked): a runner on cuda:1 makes its stream and graphs and captures on
  device 1 whatever the current device, and replays there; captures take one process-wide
  lock (two runners never capture at once) in "thread_local" mode; the varlen attention's
  max_q/max_k is the key's longest-segment bound (or the window size), never the batch,
  and the recorded step makes no host sync.
- The encoder's text embedding table stays on the CPU (the preprocessing threads run no
  GPU work during a capture).
- On a GPU (`gpu` mark): replay equals the static step run eagerly exactly, and transformers
  within tolerance, over a mix of sizes; two batches of one key give their own features.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch._subclasses import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from test_encoder_units import _images  # noqa: E402
from waiting import wait_until  # noqa: E402

import tandem.services.encoder.vit.runner as vr  # noqa: E402
from tandem.services.encoder.vit.runner import (  # noqa: E402
    GraphKey,
    StepAttention,
    VisionRunner,
    longest_buckets,
    patch_buckets,
)

# Batches of images (w, h): 16 to 1008 patches with the tiny Qwen2.5-VL (patch 14; 16 to 768
# with Qwen3-VL's patch 16) in buckets 256 to 1024, then one batch over 1024.
MIX = [[(64, 48)], [(200, 130)], [(120, 90), (40, 150)], [(300, 260)], [(400, 300), (64, 48)],
       [(500, 400)], [(500, 400), (400, 300)]]


@pytest.fixture(scope="module")
def parts(checkpoint):
    from tandem.models.split import load_vision_part

    return {a: load_vision_part(checkpoint(a), torch.float32, "cpu")
            for a in ("qwen2_5_vl", "qwen3_vl")}


def _patches(grids) -> int:
    return sum(t * h * w for t, h, w in grids)


# ----------------------------------------------------------------------------- buckets
def test_patch_buckets_pad_by_under_half_and_end_at_the_limit():
    b = patch_buckets(16384, 4)
    assert b[0] == 256 and b[-1] == 16384 and b == sorted(set(b))
    assert all(x % 4 == 0 for x in b)
    assert all(y <= x * 3 // 2 for x, y in zip(b, b[1:], strict=False))
    assert patch_buckets(1000, 4)[-1] == 1000 and patch_buckets(1001, 4)[-1] == 1004
    assert patch_buckets(100, 4) == [100]
    assert longest_buckets(768) == [256, 512, 768] and longest_buckets(256) == [256]
    with pytest.raises(ValueError):
        patch_buckets(0, 4)


# -------------------------------------------------------------- exactness on the CPU
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_the_padded_step_equals_eager_exactly_for_several_patch_counts(checkpoint, parts, arch):
    visual = parts[arch].visual
    runner = VisionRunner(visual, max_patches=1024, mode="static")
    eager = VisionRunner(visual, mode="eager")
    assert runner.attention is StepAttention.PER_SEGMENT
    seen, padded = set(), 0
    for sizes in MIX:
        pixels, grids = _images(checkpoint(arch), sizes)
        key = runner.key_for(grids)
        got, want = runner.run(pixels, grids), eager.run(pixels, grids)
        assert torch.equal(got.embeds, want.embeds), (sizes, key)
        for a, b in zip(got.deepstack, want.deepstack, strict=True):
            assert torch.equal(a, b), (sizes, key)
        if key is not None:
            padded += key.patches > _patches(grids)
            seen.add(key)
    assert len(seen) >= 4 and padded >= 4  # several buckets, padding rows in most batches
    # Every key recorded once at start-up and never again; the last batch ran eagerly.
    assert runner.stats.captured == len(runner.keys) == len(patch_buckets(1024, 4))
    assert (runner.stats.replays, runner.stats.eager, runner.stats.failed) == (len(MIX) - 1, 1, 0)


def test_padding_is_a_segment_of_its_own_on_the_masked_path(checkpoint, parts):
    """CUDA's float32 step (one SDPA, block-diagonal mask): padded batches within float32
    tolerance of eager; padding joined to the last image's segment would be off by ~0.1."""
    visual = parts["qwen2_5_vl"].visual
    runner = VisionRunner(visual, max_patches=1024, mode="static", attention=StepAttention.MASKED)
    eager = VisionRunner(visual, mode="eager")
    for sizes in MIX[:4]:
        pixels, grids = _images(checkpoint("qwen2_5_vl"), sizes)
        assert runner.key_for(grids).patches > _patches(grids)
        got, want = runner.run(pixels, grids), eager.run(pixels, grids)
        torch.testing.assert_close(got.embeds, want.embeds, rtol=1e-5, atol=1e-5)


class SyncCounter(TorchDispatchMode):
    """Counts the ops that read a device value on the host (a sync on CUDA)."""

    SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.syncs += func in self.SYNCS
        return func(*args, **(kwargs or {}))


def test_the_masked_step_makes_no_host_sync(parts):
    runner = VisionRunner(parts["qwen3_vl"].visual, max_patches=512, mode="static",
                          attention=StepAttention.MASKED)
    with torch.inference_mode(), SyncCounter() as c:
        runner._step(GraphKey(512, 0))
    assert c.syncs == 0


# ----------------------------------------------------------------------- failures
def test_a_failed_capture_is_logged_once_counted_and_its_bucket_runs_eagerly(
        checkpoint, parts, monkeypatch, caplog):
    visual = parts["qwen2_5_vl"].visual
    bad = GraphKey(256, 0)
    calls: dict[GraphKey, int] = {}
    step = VisionRunner._step

    def failing_step(self, key):
        calls[key] = calls.get(key, 0) + 1
        if key == bad:
            raise RuntimeError("operation not permitted when stream is capturing")
        return step(self, key)

    monkeypatch.setattr(VisionRunner, "_step", failing_step)
    with caplog.at_level(logging.WARNING, logger="tandem.encoder"):
        runner = VisionRunner(visual, max_patches=1024, mode="static")
    eager = VisionRunner(visual, mode="eager")
    assert runner.failed_keys == {bad}
    assert (runner.stats.captured, runner.stats.failed) == (len(runner.keys) - 1, 1)
    pixels, grids = _images(checkpoint("qwen2_5_vl"), [(300, 260)])  # 396 patches
    assert runner.key_for(grids).patches > 256
    for sizes in MIX[:3] + MIX[:1]:  # 16, 140, 68, 16 patches: the failed bucket
        px, g = _images(checkpoint("qwen2_5_vl"), sizes)
        assert runner.key_for(g) == bad
        assert torch.equal(runner.run(px, g).embeds, eager.run(px, g).embeds)
    runner.run(pixels, grids)  # another bucket still replays its recording
    assert (runner.stats.eager, runner.stats.replays) == (4, 1)
    assert calls[bad] == 1  # never retried
    failures = [r for r in caplog.records if "capture failed" in r.getMessage()]
    assert len(failures) == 1 and "256" in failures[0].getMessage()


def test_capture_failures_reach_the_metrics(checkpoint, parts):
    """The pipeline publishes its runners' start-up captures: graphs and failures."""
    from prometheus_client import CollectorRegistry

    from tandem.services.encoder.config import EncoderConfig
    from tandem.services.encoder.metrics import EncoderMetrics
    from tandem.services.encoder.pipeline import EncodePipeline, PipelineSettings, VisionParts

    pipe = EncodePipeline.from_config(EncoderConfig(model=str(checkpoint("qwen2_5_vl")),
                                                    device="cpu", dtype="float32"))
    ok, failed = (VisionRunner(parts["qwen2_5_vl"].visual) for _ in range(2))
    ok.stats, failed.stats = vr.GraphStats(captured=5), vr.GraphStats(captured=3, failed=2)
    registry = CollectorRegistry()
    EncodePipeline(VisionParts(pipe.preprocessor.processor, pipe.embed_tokens, [ok, failed],
                               pipe.spec),
                   PipelineSettings(pipe.preprocessor.limits, 0, 1024),
                   metrics=EncoderMetrics(registry))
    assert registry.get_sample_value("tandem_encoder_vit_graphs") == 8
    assert registry.get_sample_value("tandem_encoder_vit_graph_capture_failures_total") == 2


# ------------------------------------------------------------- CUDA without a GPU
class FakeCuda:
    """torch.cuda's device, stream and graph calls, recording on which device each
    happens; `current` is the current device (0 until a `device` context says otherwise)."""

    def __init__(self) -> None:
        self.current = 0
        self.events: list[tuple] = []
        self.capturing = 0
        self.most_capturing = 0
        fc = self

        class Stream:
            def __init__(self, device=None) -> None:
                self.device = fc.current if device is None else torch.device(device).index
                fc.events.append(("stream", self.device, fc.current))

            def wait_stream(self, other) -> None:
                pass

        class CUDAGraph:
            def __init__(self) -> None:
                fc.events.append(("graph", fc.current))

            def replay(self) -> None:
                fc.events.append(("replay", fc.current))

        self.Stream, self.CUDAGraph = Stream, CUDAGraph

    @contextlib.contextmanager
    def device(self, d):
        prev, self.current = self.current, torch.device("cuda", d).index if isinstance(d, int) \
            else torch.device(d).index
        try:
            yield
        finally:
            self.current = prev

    @contextlib.contextmanager
    def graph(self, graph, pool=None, stream=None, capture_error_mode="global"):
        self.events.append(("capture", self.current, stream.device, capture_error_mode,
                            vr._CAPTURE_LOCK.locked()))
        self.capturing += 1
        self.most_capturing = max(self.most_capturing, self.capturing)
        try:
            yield
        finally:
            self.capturing -= 1

    def of(self, kind: str) -> list[tuple]:
        return [e for e in self.events if e[0] == kind]


def _fake_copy(copy):
    """Tensor.copy_'s Python binding wants a real device for a fake CUDA destination; the
    op itself is fine under FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensor

    def copy_(self, src, non_blocking=False):
        if isinstance(self, FakeTensor):
            return torch.ops.aten.copy_.default(self, src, non_blocking)
        return copy(self, src, non_blocking)

    return copy_


@pytest.fixture
def fake_cuda(monkeypatch):
    fc = FakeCuda()
    for name, value in {
        "device": fc.device, "Stream": fc.Stream, "CUDAGraph": fc.CUDAGraph, "graph": fc.graph,
        "stream": lambda s: contextlib.nullcontext(), "current_stream": lambda d=None: fc.Stream(d),
        "graph_pool_handle": lambda: (0, 1), "synchronize": lambda d=None: None,
        "memory_reserved": lambda d=None: 0,
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.Tensor, "copy_", _fake_copy(torch.Tensor.copy_))
    fc.mode = FakeTensorMode(allow_non_fake_inputs=True)
    return fc


def _fake_tower(checkpoint, arch: str, device: str, dtype=torch.bfloat16):
    """Transformers' vision tower with fake parameters on a CUDA device."""
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights

    from tandem.models.split import _vision_class

    cfg = AutoConfig.from_pretrained(checkpoint(arch)).vision_config
    with FakeTensorMode(allow_non_fake_inputs=True), no_init_weights(), torch.device(device):
        visual = _vision_class(arch)._from_config(cfg, dtype=dtype)
    return visual.eval().requires_grad_(False)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_a_runner_on_cuda1_captures_and_replays_on_device_1(checkpoint, fake_cuda, arch):
    visual = _fake_tower(checkpoint, arch, "cuda:1")
    with fake_cuda.mode:
        runner = VisionRunner(visual, max_patches=1024)
    assert (runner.mode, runner.attention) == (vr.RunMode.GRAPH, StepAttention.VARLEN)
    assert fake_cuda.current == 0  # the caller's device is left as it was
    assert runner.stats.captured == len(runner.keys) == len(fake_cuda.of("graph"))
    assert {e[1] for e in fake_cuda.of("stream")} == {1}  # made for device 1 ...
    assert {e[1] for e in fake_cuda.of("graph")} == {1}  # ... and under it
    # every capture on device 1, on the runner's stream, thread-local, under the lock
    assert set(fake_cuda.of("capture")) == {("capture", 1, 1, "thread_local", True)}
    assert fake_cuda.most_capturing == 1

    grids = [(1, 16, 16), (1, 8, 12)]  # 352 patches: bucket 384
    n = _patches(grids)
    with fake_cuda.mode:
        hidden = torch.empty(n, visual.config.hidden_size, device="cuda:1", dtype=torch.bfloat16)
        hd = visual.config.hidden_size // visual.config.num_heads
        rope = torch.empty(n, hd, device="cuda:1")
        cu = torch.tensor([0, 256, n], dtype=torch.int32)
        windows = None if arch == "qwen3_vl" else cu
        reverse = None if arch == "qwen3_vl" else torch.arange(n // 4, device="cuda:1")
        prep = vr._Prepared(hidden, rope, rope, cu, windows, None, None, reverse)
        runner._prepare = lambda pixels, g: prep
        out = runner.run(None, grids)
    assert out.embeds.shape[0] == n // 4 and out.embeds.device == torch.device("cuda:1")
    assert fake_cuda.of("replay") == [("replay", 1)]
    assert runner.stats.replays == 1


class WatchedLock:
    """A lock that says how many threads wait for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waiting = 0

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self):
        self.waiting += 1
        self._lock.acquire()
        self.waiting -= 1
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


def test_two_runners_never_capture_at_once(fake_cuda, monkeypatch):
    lock = WatchedLock()
    monkeypatch.setattr(vr, "_CAPTURE_LOCK", lock)
    a, b = vr._CudaRecorder(torch.device("cuda:0")), vr._CudaRecorder(torch.device("cuda:1"))
    other: list[threading.Thread] = []

    def capture(recorder) -> None:
        with recorder.session():
            recorder.record(step)

    def step():
        if fake_cuda.capturing and not other:  # device 0's capture: device 1 starts its own
            other.append(threading.Thread(target=capture, args=(b,)))
            other[0].start()
            wait_until(lambda: lock.waiting, timeout_s=30, what="device 1 waiting to capture")
            assert fake_cuda.capturing == 1 and fake_cuda.of("capture")[-1][1] == 0
        return torch.zeros(1), []

    capture(a)
    other[0].join(timeout=30)
    assert not other[0].is_alive()
    assert [e[1] for e in fake_cuda.of("capture")] == [0, 1]  # one after the other
    assert fake_cuda.most_capturing == 1


class VarlenSpy:
    """Records (rows, max_q, max_k) of each varlen call and runs the op (fake kernel)."""

    def __init__(self, real) -> None:
        self.real, self.calls = real, []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, num_splits=None):
        self.calls.append((q.shape[0], max_q, max_k))
        return self.real(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, num_splits=num_splits)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_varlen_bounds_are_the_longest_segment_and_the_step_never_syncs(
        checkpoint, fake_cuda, monkeypatch, arch):
    import torch.nn.attention.varlen as varlen

    spy = VarlenSpy(varlen.varlen_attn)
    monkeypatch.setattr(varlen, "varlen_attn", spy)
    visual = _fake_tower(checkpoint, arch, "cuda:0")
    with fake_cuda.mode:
        runner = VisionRunner(visual, max_patches=1024)
    window = runner.window_patches
    assert window == (0 if arch == "qwen3_vl" else 64)
    # Each key's capture (and its warm-up) bounds full attention by the key's longest
    # segment and window attention by one window; never by the batch's patches.
    want = {(k.patches, k.longest) for k in runner.keys}
    if window:
        want |= {(k.patches, window) for k in runner.keys}
    assert {(rows, q) for rows, q, _ in spy.calls} == want
    assert all(q == k for _, q, k in spy.calls)
    # The key of a batch, from its grids on the host: frames are segments.
    assert runner.key_for([(1, 16, 16)] * 3) == GraphKey(768, 256)  # 768 patches, 256 each
    assert runner.key_for([(1, 20, 24)]) == GraphKey(512, 512)  # one 480-patch frame
    assert runner.key_for([(4, 12, 12)]) == GraphKey(768, 256)  # a video: 4 frames of 144
    assert runner.key_for([(1, 32, 34)]) is None  # 1088 > 1024: eager
    with fake_cuda.mode, torch.inference_mode(), SyncCounter() as c:
        runner._step(GraphKey(768, 256))
    assert c.syncs == 0


# ------------------------------------------------------------------ text embeddings
def test_the_encoder_keeps_the_text_embedding_table_on_the_cpu(checkpoint, monkeypatch):
    """The preprocessing threads look text embeddings up (merge.build_payload) while a
    device thread may capture: the table is loaded onto the CPU, whatever the tower's
    device, and a pipeline refuses one elsewhere."""
    import tandem.models.split as split
    from tandem.services.encoder.config import EncoderConfig
    from tandem.services.encoder.pipeline import EncodePipeline, PipelineSettings, VisionParts

    asked = []
    real = split.load_vision_part

    def load(path, dtype, device, **kw):  # the tower on the CPU: no GPU here
        asked.append((str(device), str(kw.get("embed_device"))))
        return real(path, dtype, "cpu", **kw)

    monkeypatch.setattr(split, "load_vision_part", load)
    cfg = EncoderConfig(model=str(checkpoint("qwen2_5_vl")), devices=["cuda:0", "cuda:1"],
                        dtype="float32", linear_backend="torch")
    pipe = EncodePipeline.from_config(cfg)
    assert asked == [("cuda:0", "cpu"), ("cuda:1", "cpu")]
    assert pipe.embed_tokens.weight.device.type == "cpu"

    meta = torch.nn.Embedding(8, 4, device="meta")
    with pytest.raises(ValueError, match="must be on the CPU"):
        EncodePipeline(VisionParts(pipe.preprocessor.processor, meta, pipe.scheduler.runners,
                                   pipe.spec),
                       PipelineSettings(pipe.preprocessor.limits, 0, 1024))


# ------------------------------------------------------------------ make gpu-check
def test_the_gpu_check_row_runs_dry(checkpoint):
    """bench/vit_graphs.py's row (bench/gpu_check.py calls it) in its CPU dry run."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from vit_graphs import SKIPPED, check_vit_graphs

    (row,) = check_vit_graphs(checkpoint("qwen2_5_vl"), "cpu", torch.float32, dry_run=True)
    assert row["ok"], row
    assert row["captured"] == row["keys"] == row["captured_after_mix"] and row["failed"] == 0
    assert row["eager_batches"] == 1 and row["replay_equals_static"]
    assert row["speedup"] == row["capture_mib"] == SKIPPED
    with pytest.raises(ValueError, match="dry_run"):
        check_vit_graphs(checkpoint("qwen2_5_vl"), "cpu", torch.float32, dry_run=False)


# ------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_replay_equals_the_static_step_over_a_mix_of_sizes(checkpoint, arch, dtype):
    from tandem.models.split import load_vision_part

    dev = f"cuda:{torch.cuda.device_count() - 1}"  # the last GPU: not the current device
    visual = load_vision_part(checkpoint(arch), dtype, dev).visual
    graph = VisionRunner(visual, max_patches=1024, mode="graph")
    static = VisionRunner(visual, max_patches=1024, mode="static", attention=graph.attention)
    eager = VisionRunner(visual, mode="eager")
    assert graph.stats.captured == len(graph.keys) and not graph.failed_keys
    tol = 2e-3 if dtype == torch.float32 else 5e-2
    for sizes in MIX:
        pixels, grids = _images(checkpoint(arch), sizes)
        g, s, e = graph.run(pixels, grids), static.run(pixels, grids), eager.run(pixels, grids)
        assert torch.equal(g.embeds, s.embeds), sizes
        torch.testing.assert_close(g.embeds, e.embeds, rtol=tol, atol=tol)
        for a, b, c in zip(g.deepstack, s.deepstack, e.deepstack, strict=True):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, c, rtol=tol, atol=tol)
    assert graph.stats.captured == len(graph.keys)
    assert (graph.stats.replays, graph.stats.eager) == (len(MIX) - 1, 1)
    # Two images of one grid, one key: each replay gives its own image's features (a graph
    # recorded on another device's stream would give the capture's, every time).
    pixels, grids = _images(checkpoint(arch), MIX[0])
    other = pixels.flip(0)  # the same grid, other patches
    first, second = graph.run(pixels, grids).embeds, graph.run(other, grids).embeds
    assert not torch.equal(first, second)
    torch.testing.assert_close(second, eager.run(other, grids).embeds, rtol=tol, atol=tol)
