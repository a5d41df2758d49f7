"""The sparse MoE block's two sync-free ways against a loop over the experts (the block as
it was, transformers' way: each expert over its rows, outputs added in ascending expert
order): grouped GEMMs give the loop's bits on the CPU (float32 and bfloat16), every expert
on every token (CUDA's way for graph batches where grouped GEMMs would sync) agrees within
rounding; and which way each device and dtype takes (`MoEDispatch.for_device`)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from tandem.models.split import load_text_weights
from tandem.services.language.model.decoder import MoEDispatch, SparseMoE
from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings


def loop_reference(m: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(m.router(x).float(), dim=-1)
    weights, experts = torch.topk(probs, m.top_k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():  # ascending
        rows, slot = torch.where(experts == e)
        gate, up = (x[rows] @ m.w_gate_up[e]).split(m.intermediate, dim=1)
        out.index_add_(0, rows, ((F.silu(gate) * up) @ m.w_down[e]) * weights[rows, slot, None])
    return out


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def moe(request, checkpoint) -> SparseMoE:
    path = checkpoint("qwen3_vl_moe", "small")  # 8 experts, 2 per token, 512 wide
    runner = ModelRunner(load_text_weights(path, dtype=torch.float32, device="cpu"),
                         RunnerSettings(page_size=16, linear_backend="torch"), num_pages=4,
                         dtype=request.param)
    return next(m for m in runner.model.modules() if isinstance(m, SparseMoE))


@pytest.mark.parametrize("tokens", [1, 3, 8, 33, 130])
def test_grouped_gemms_give_the_expert_loops_bits_and_dense_agrees(moe, tokens):
    dtype = moe.w_gate_up.dtype
    x = torch.randn(tokens, moe.w_gate_up.shape[1], generator=torch.Generator().manual_seed(tokens))
    x = x.to(dtype)
    with torch.inference_mode():
        want = loop_reference(moe, x)
        moe.dispatch = MoEDispatch.for_device("cpu", dtype, 0)  # (the runner's on the CPU)
        assert torch.equal(moe(x), want)
        moe.dispatch = MoEDispatch(grouped_sync_free=False, dense_max_tokens=tokens)
        try:
            dense = moe(x)
        finally:
            moe.dispatch = MoEDispatch(grouped_sync_free=True)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(dense, want, atol=tol, rtol=tol)


def test_each_device_and_dtype_takes_its_way():
    assert MoEDispatch.for_device("cpu", torch.bfloat16, 32) == MoEDispatch(True, 0)
    for major, dtype, fast in ((9, torch.bfloat16, True), (10, torch.bfloat16, True),
                               (8, torch.bfloat16, False), (9, torch.float32, False)):
        with mock.patch.object(torch.cuda, "get_device_capability", return_value=(major, 0)):
            d = MoEDispatch.for_device("cuda", dtype, 32)
        assert d == MoEDispatch(fast, 32), (major, dtype)

    m = SparseMoE.__new__(SparseMoE)  # only the rule: the shapes, no weights
    torch.nn.Module.__init__(m)
    m.w_down = torch.nn.Parameter(torch.empty(8, 24, 64))  # [E, I, H]
    m.dispatch = MoEDispatch(grouped_sync_free=False, dense_max_tokens=32)
    bf16, fp32 = torch.zeros(32, 64, dtype=torch.bfloat16), torch.zeros(33, 64)
    assert m._runs_dense(bf16) and not m._runs_dense(torch.zeros(33, 64, dtype=torch.bfloat16))
    assert m._runs_dense(fp32)  # torch takes grouped GEMMs on CUDA in bfloat16 only
    m.dispatch = MoEDispatch(grouped_sync_free=True, dense_max_tokens=32)
    assert not m._runs_dense(bf16) and not m._runs_dense(fp32)
    m.w_down = torch.nn.Parameter(torch.empty(8, 12, 64))  # 12 bfloat16: 24-byte rows
    assert m._runs_dense(bf16) and not m._runs_dense(fp32)
