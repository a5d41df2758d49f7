"""Host syncs of a decode step, counted op by op on a fake CUDA device (no GPU needed).

What must hold: the body a decode CUDA graph records (embedding, decoder layers, dense and
sparse MoE, logits) makes no host sync; the rest of the step (the graph runner's host part
and the sampler) makes at most one, the drawn ids to the host; for plain rows and for rows
with penalties, a logit bias and min_tokens, in float32 and bfloat16 (where the MoE block
takes each of its two sync-free paths). And the counter itself: every kind of sync it
names is counted, the ops that are no sync are not.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tandem.host_syncs import HostSyncCounter, IncompleteCount, SyncKind, fake_cuda
from tandem.models.split import load_text_weights
from tandem.services.language.model.decoder import SparseMoE
from tandem.services.language.runner.model_runner import RunnerSettings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from step_syncs import decode_step_host_syncs, fake_cuda_runner  # noqa: E402  (bench/)

# gather attention: the compiled flex attention CUDA takes by default cannot be lowered for a
# fake device (its own claim of no host sync is checked on a GPU, `make gpu-check`)
SETTINGS = RunnerSettings(page_size=4, cuda_graph_max_bs=8, max_seq_len=64,
                          attention_backend="gather")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shaped", [False, True], ids=["plain", "shaped"])
@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_vl_moe"])
def test_a_decode_step_syncs_once_and_never_inside_the_graph(arch, shaped, dtype, checkpoint):
    weights = load_text_weights(checkpoint(arch), dtype=torch.float32, device="cpu")
    with fake_cuda():  # an sm90 device: bfloat16 MoE runs grouped, float32 dense
        runner = fake_cuda_runner(weights, SETTINGS, dtype)
        moe = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
        assert all(m.dispatch.grouped_sync_free == (dtype == torch.bfloat16) for m in moe)
        assert bool(moe) == (arch == "qwen3_vl_moe")
        steps = decode_step_host_syncs(runner, batch_size=6, shaped=shaped, steps=2)
    for i, step in enumerate(steps):
        assert step.complete and not step.captured and len(step.outside) <= 1, \
            f"step {i}: {step.describe()}"
        assert [e.kind for e in step.outside] == [SyncKind.TO_HOST], step.describe()
        assert "sampler" in step.outside[0].where


def _count(fn, inference: bool) -> list[SyncKind]:
    """(inference mode changes what reaches the counter: `aten.to` is not decomposed)"""
    with fake_cuda(), torch.inference_mode(inference):
        x = torch.randn(4, 8, device="cuda")
        with HostSyncCounter() as counter:
            try:
                fn(x)
            except IncompleteCount:
                pass
    return [e.kind for e in counter.events]


@pytest.mark.parametrize("fn, kinds", [
    (lambda x: x.sum().item(), [SyncKind.READ]),
    (lambda x: bool(x.isinf().any()), [SyncKind.READ]),
    (lambda x: x.argmax(-1).tolist(), [SyncKind.READ] * 4),  # a real one: one TO_HOST
    (lambda x: x.cpu(), [SyncKind.TO_HOST]),
    (lambda x: torch.tensor([1, 2], device=x.device), [SyncKind.UPLOAD]),
    (lambda x: torch.ones(3).to(x.device), [SyncKind.UPLOAD]),
    (lambda x: torch.nonzero(x > 0), [SyncKind.DATA_SHAPE]),
    (lambda x: torch.where(x > 0), [SyncKind.DATA_SHAPE]),
    (lambda x: torch.unique(x), [SyncKind.DATA_SHAPE]),
    (lambda x: x[x > 0], [SyncKind.DATA_SHAPE]),
    (lambda x: torch.bincount(x.long().flatten(), minlength=9), [SyncKind.DATA_SHAPE]),
    (lambda x: torch.multinomial(x.softmax(-1), 1), [SyncKind.CHECKED]),
    (lambda x: x.repeat_interleave(torch.tensor([1, 2, 1, 0]).to(x.device, non_blocking=True),
                                   dim=0), [SyncKind.DATA_SHAPE]),
    (lambda x: x[x.sum(-1).argmax()], [SyncKind.READ]),  # a 0-dim tensor index
], ids=["item", "bool", "tolist", "cpu", "tensor-on-device", "to-device", "nonzero",
        "where-cond", "unique", "mask-index", "bincount", "multinomial", "repeat-by-tensor",
        "0-dim-index"])
@pytest.mark.parametrize("inference", [False, True], ids=["grad", "inference"])
def test_the_counter_counts_each_kind_of_sync(fn, kinds, inference):
    assert _count(fn, inference) == kinds


@pytest.mark.parametrize("inference", [False, True], ids=["grad", "inference"])
def test_grouped_mm_outside_its_bfloat16_kernel_is_a_sync(inference):
    """(torch's meta check refuses it under fake tensors, after the count: a RuntimeError,
    whatever torch's words for it)"""
    def fp32(x):
        offs = torch.tensor([1, 4], dtype=torch.int32).to(x.device, non_blocking=True)
        with pytest.raises(RuntimeError):
            torch.nn.functional.grouped_mm(x, torch.randn(2, 8, 3, device=x.device), offs=offs)

    assert _count(fp32, inference) == [SyncKind.CHECKED]


@pytest.mark.parametrize("inference", [False, True], ids=["grad", "inference"])
def test_the_counter_counts_no_sync_where_there_is_none(inference):
    def work(x):
        idx = torch.tensor([0, 2]).to(x.device, non_blocking=True)
        y = x.index_select(0, idx).softmax(-1)
        v, i = torch.topk(y, 3)
        s, order = torch.sort(y, descending=True)
        z = torch.zeros_like(y).scatter(1, order, s.cumsum(-1))
        z[torch.arange(2, device=x.device), i[:, 0]] += 1.0
        q = torch.empty_like(z).exponential_()
        (z / q).argmax(-1)
        torch.nn.functional.grouped_mm(
            x.bfloat16(), torch.randn(2, 8, 16, device=x.device, dtype=torch.bfloat16),
            offs=torch.tensor([1, 4], dtype=torch.int32).to(x.device, non_blocking=True))
        torch.where(x > 0, x, -x)
        x.repeat_interleave(2, dim=0)
        x[x.sum(-1).argmax()[None]]  # a 1-element index: no read
        torch.ones(3).sum().item()  # the CPU's: no device involved

    assert _count(work, inference) == []
