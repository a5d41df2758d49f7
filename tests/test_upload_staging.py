"""Host rows uploaded to a CUDA model are page-locked, and no asynchronous upload reads
memory that may change or be freed under it (issue 25, finding 14).

- `host_empty` asks for page-locked memory exactly when the rows go to a CUDA device
  (torch.empty's pin_memory recorded; pinning itself needs CUDA), and the embedding
  buffers' private rows, which a prefill uploads, come from it (the registered blocks are
  only copied on the host and stay pageable).
- the decode graph runner uploads each step with one non_blocking copy whose source is
  its static host mirror (made by `host_empty` for its device), never a temporary; the
  mirror is written only after the fence of the previous upload was waited on, and the
  fence is recorded right behind each upload (a recording fence on the CPU, where the
  real one is a CUDA event). Checked by a dispatch mode that sees every write and copy.
"""

from __future__ import annotations

import language_oracle as oracle
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.devices import host_empty
from tandem.services.language.engine.kv_pages import KVPagePool
from tandem.services.language.runner import graph_runner
from tandem.services.language.runner.forward_batch import ForwardBatch, SeqChunk, decode_positions
from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings
from tandem.transfer import EmbeddingBuffers
from tandem.units import ceil_div

PAGE = 4


def pin_requests(monkeypatch) -> list:
    """torch.empty's pin_memory argument, recorded (and dropped: no CUDA here)."""
    asked, real = [], torch.empty

    def empty(*a, pin_memory=False, **k):
        asked.append(pin_memory)
        return real(*a, **k)

    monkeypatch.setattr(torch, "empty", empty)
    return asked


def test_rows_uploaded_to_cuda_are_page_locked(monkeypatch):
    asked = pin_requests(monkeypatch)
    assert host_empty((4, 8), torch.float32, "cuda:1").shape == (4, 8)
    host_empty((4, 8), torch.float32, torch.device("cpu"))
    assert asked == [True, False]


def test_a_prefills_private_rows_are_page_locked_for_a_cuda_model(monkeypatch):
    for device, pinned in (("cuda", True), ("cpu", False)):
        buffers = EmbeddingBuffers(2, 4, 8, torch.float32, upload_device=device)
        asked = pin_requests(monkeypatch)
        rows = buffers.private_embeds(5)
        monkeypatch.undo()
        assert asked == [pinned] and rows.shape == (5, 8) and rows.dtype == torch.float32


class Fence:
    def __init__(self, events: list) -> None:
        self.events = events

    def wait(self) -> None:
        self.events.append("wait")

    def record(self) -> None:
        self.events.append("record")


class HostTraffic(TorchDispatchMode):
    """Every write into the mirror's storage, and every non_blocking copy (its source)."""

    def __init__(self, mirror: torch.Tensor, events: list) -> None:
        super().__init__()
        self.mirror, self.events = mirror.untyped_storage()._cdata, events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            t = args[i] if i < len(args) else kwargs.get(arg.name)
            written = arg.alias_info is not None and arg.alias_info.is_write
            if written and isinstance(t, torch.Tensor) and self._mirror(t):
                self.events.append("write mirror")
        if func is torch.ops.aten.copy_.default:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            if non_blocking:
                self.events.append(("upload from", "mirror" if self._mirror(args[1]) else "temp"))
        return func(*args, **kwargs)

    def _mirror(self, t: torch.Tensor) -> bool:
        return t.untyped_storage()._cdata == self.mirror


def test_graph_runner_uploads_from_its_static_mirror_behind_a_fence(checkpoint, monkeypatch):
    made = []
    real_host_empty = graph_runner.host_empty
    monkeypatch.setattr(graph_runner, "host_empty",
                        lambda shape, dtype, device: made.append(device) or
                        real_host_empty(shape, dtype, device))
    runner = ModelRunner(oracle.text_weights(checkpoint("qwen2_5_vl")),
                         RunnerSettings(page_size=PAGE, max_seq_len=64, cuda_graph_max_bs=4),
                         num_pages=64)
    gr = runner.graph_runner
    assert made == [runner.device]  # the mirror: host memory for this device (pinned on CUDA)
    pool, seqs = KVPagePool(runner.num_pages, PAGE), []
    for i, n in enumerate((5, 9, 17)):
        pages = pool.alloc(ceil_div(n + 1, PAGE))
        runner.forward_eager(ForwardBatch([SeqChunk(i, 0, torch.arange(n).expand(3, n), pages,
                                                    token_ids=torch.arange(n) % 7)]))
        seqs.append((i, n, pages))
    events: list = []
    gr._uploaded = Fence(events)
    for rows in (3, 1, 2):
        batch = ForwardBatch([SeqChunk(i, n, decode_positions(n, 0), pages,
                                       token_ids=torch.tensor([i + 1]))
                              for i, n, pages in seqs[:rows]])
        want = runner.forward_eager(batch).last_logits
        with HostTraffic(gr._host_inputs, events):
            got = gr.run(batch).last_logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    steps = "|".join(str(e) for e in events).split("wait|")[1:]
    assert len(steps) == 3 and events[0] == "wait", events
    for step in steps:  # the mirror filled, then one upload from it, then the fence
        parts = step.rstrip("|").split("|")
        assert parts[-2:] == ["('upload from', 'mirror')", "record"], parts
        assert set(parts[:-2]) == {"write mirror"}, parts


@pytest.mark.gpu
def test_on_cuda_the_uploaded_rows_are_pinned_and_replays_follow_each_batch(checkpoint):
    assert host_empty((4,), torch.float32, "cuda").is_pinned()
    assert EmbeddingBuffers(2, 4, 8, torch.float32, upload_device="cuda").private_embeds(3).is_pinned()
    page = oracle.page_size("cuda")  # flex on CUDA takes pages of 16 and more
    runner = ModelRunner(oracle.text_weights(checkpoint("qwen2_5_vl")),
                         RunnerSettings(page_size=page, max_seq_len=64, cuda_graph_max_bs=4),
                         num_pages=oracle.kv_pages(256, "cuda"), device="cuda")
    gr = runner.graph_runner
    assert gr._host_inputs.is_pinned() and gr.use_graphs
    pool, seqs = KVPagePool(runner.num_pages, page), []
    for i, n in enumerate((5, 9, 17)):
        pages = pool.alloc(ceil_div(n + 1, page))
        runner.forward_eager(ForwardBatch([SeqChunk(i, 0, torch.arange(n).expand(3, n), pages,
                                                    token_ids=torch.arange(n) % 7)]))
        seqs.append((i, n, pages))
    # back-to-back steps of different batches: each replay reads its own upload
    for rows in (3, 1, 2, 3, 1):
        batch = ForwardBatch([SeqChunk(i, n, decode_positions(n, 0), pages,
                                       token_ids=torch.tensor([i + rows]))
                              for i, n, pages in seqs[:rows]])
        got = gr.run(batch).last_logits
        torch.testing.assert_close(got, runner.forward_eager(batch).last_logits, rtol=0, atol=1e-4)
