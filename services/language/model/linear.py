"""Linear layers with the weight stored transposed, and the fused projections built from
a checkpoint's separate ones.

    DenseLinear: y = x @ weight_t (+ bias), weight_t [in, out] contiguous
                 or, once `pack`ed (CPU, float32), the same product by our own kernel over
                 column strips (`cpu_kernels`: 2-6x MKL's sgemm on this AMD CPU; the
                 packed copy replaces weight_t)
                 or, once `compute_in_float32` (a bfloat16 model on a CPU, unless it has
                 AMX), the product in float32 over the checkpoint's bfloat16 values: x is
                 cast up, y back down; packed, the weights stay bfloat16 (the kernel widens
                 them as it loads them), else weight_t holds them widened to float32.

NOTE (why float32 products for bfloat16 on such CPUs): torch 2.13's bfloat16 GEMM on an AMD
EPYC with AVX2 alone (no AVX512-BF16, no AMX) runs 10-60x slower than its float32 GEMM at
the decoder's shapes (docs/benchmarks.md, "bfloat16 on an AVX2 host"), and on an Intel Xeon
with AVX512-BF16 (no AMX) 0.65-0.8x our packed kernel over the same bfloat16 weights
(docs/benchmarks.md, "bfloat16 weights in the packed linears"); the float32 product of
bfloat16 values, rounded once to bfloat16, is what a bfloat16 GEMM with float32
accumulation computes (up to the order of the sums). Packed, the weights keep their
bfloat16 bytes; unpacked (linear_backend torch) they take twice the memory.

NOTE (why transposed): with MKL on this CPU (float32), `F.linear(x, W)` over a
checkpoint's W [out, in] costs 1.7-4x more than `x @ Wt` over a contiguous [in, out]
copy for 4-32 rows (decode batches), and the same for large prefill chunks; on CUDA both
layouts are one cuBLAS call. So (`copies_transposes`, the one rule) on the CPU weight_t is
a contiguous [in, out] copy that replaces the original; elsewhere (CUDA) it is a
transposed view of the checkpoint's [out, in] tensor: no copy is ever made.

Fusions (one GEMM where the checkpoint has several with the same input):

    qkv_proj  [hidden, (H + 2 * Hkv) * D] = [q_proj.T | k_proj.T | v_proj.T]  (+ biases)
    gate_up   [hidden, 2 * intermediate]  = [gate_proj.T | up_proj.T]
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.cpu_kernels import PackedLinear


class DenseLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed = None  # set by pack(): the same product on the CPU kernels
        # set by compute_in_float32(): the dtype the product runs in, when not x's
        self.compute_dtype: torch.dtype | None = None

    def compute_in_float32(self, widen_weight: bool = True) -> None:
        """Run the product in float32; `forward` casts x up and the result back to x's
        dtype. The bias is held in float32 (exactly the values it had: bfloat16 and float16
        widen without rounding), and so is weight_t, unless `widen_weight` is False: then
        `pack` must follow, which packs weight_t's bfloat16 values as they are (the packed
        kernel widens them as it loads them: the same products from half the bytes)."""
        if widen_weight:
            self.weight_t = nn.Parameter(self.weight_t.detach().float(), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.detach().float(), requires_grad=False)
        self.compute_dtype = torch.float32

    def pack(self, kernels) -> None:
        """Run on the CPU kernels' packed layout (`cpu_kernels.PackedLinear`); weight_t and
        bias are replaced by their packed forms (no second copy stays)."""
        self.packed = PackedLinear(self.weight_t, self.bias, kernels)
        del self.weight_t, self.bias
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out], in x's dtype."""
        if self.compute_dtype is not None and x.dtype != self.compute_dtype:
            return self.product(x.to(self.compute_dtype)).to(x.dtype)
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight_t (+ bias) with x already in the weights' dtype."""
        if self.packed is not None:
            return self.packed(x)
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


def copies_transposes(device: torch.device) -> bool:
    """Whether weight_t is a contiguous [in, out] copy (the CPU: MKL's fast layout) or a
    transposed view of the checkpoint's tensor (CUDA and the rest: either layout is one
    cuBLAS call, and a view costs no memory)."""
    return torch.device(device).type == "cpu"


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def fuse_checkpoint_tensors(tensors: dict[str, torch.Tensor], num_layers: int,
                            moe_layers: tuple[int, ...] = (), *, place=_keep,
                            copy_transposes: bool = True) -> dict:
    """The decoder's parameter dict from the loader's normalized checkpoint names.

    Every `*.weight` of a projection becomes `*.weight_t` ([in, out]: a contiguous copy with
    `copy_transposes`, else a transposed view); q/k/v become `qkv_proj`, gate/up become
    `gate_up_proj`; norms and embeddings pass through. A sparse MoE layer's router becomes
    `router.weight_t` and its experts `w_gate_up` [E, H, 2I] and `w_down` [E, I, H] (each
    expert's matrices transposed likewise). A tied head (`lm_head.weight` is the embedding
    tensor itself) reads the placed embedding.

    Consumes `tensors` one group at a time: each tensor is popped, `place`d (moved to the
    model's device and dtype) and fused or transposed, and the popped original is dropped
    before the next group. So at most one group (a layer's q/k/v or gate/up, or one
    transposed tensor) exists twice at any moment: loading peaks at the weights plus that
    group, never at twice the projections (tests/test_language_loading.py)."""

    def take(name: str) -> torch.Tensor:
        return place(tensors.pop(name))

    def transposed(w: torch.Tensor) -> torch.Tensor:  # [out, in] -> [in, out]
        return w.t().contiguous() if copy_transposes else w.t()

    def fused(names: list[str]) -> torch.Tensor:  # several [out_k, in] -> [in, sum out_k]
        parts = [take(n) for n in names]
        if copy_transposes:
            return torch.cat([w.t() for w in parts], dim=1)  # (a new contiguous tensor)
        return torch.cat(parts, dim=0).t()

    out: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        out[f"{a}qkv_proj.weight_t"] = fused([f"{a}{p}_proj.weight" for p in "qkv"])
        if f"{a}q_proj.bias" in tensors:
            out[f"{a}qkv_proj.bias"] = torch.cat([take(f"{a}{p}_proj.bias") for p in "qkv"])
        if i in moe_layers:
            out[f"{m}router.weight_t"] = transposed(take(f"{m}gate.weight"))
            for name, key in (("w_gate_up", "gate_up_proj"), ("w_down", "down_proj")):
                w = take(f"{m}experts.{key}").transpose(1, 2)
                out[f"{m}{name}"] = w.contiguous() if copy_transposes else w
                del w  # (with a copy, the original goes now)
        else:
            out[f"{m}gate_up_proj.weight_t"] = fused([f"{m}gate_proj.weight", f"{m}up_proj.weight"])
            out[f"{m}down_proj.weight_t"] = transposed(take(f"{m}down_proj.weight"))
        out[f"{a}o_proj.weight_t"] = transposed(take(f"{a}o_proj.weight"))
        if f"{a}o_proj.bias" in tensors:
            out[f"{a}o_proj.bias"] = take(f"{a}o_proj.bias")
    if "lm_head.weight" in tensors:  # a tied head has none: it reads the embedding table
        if tensors["lm_head.weight"] is tensors.get("embed_tokens.weight"):  # one tensor,
            del tensors["lm_head.weight"]  # two names: placed once
            head = out["embed_tokens.weight"] = take("embed_tokens.weight")
        else:
            head = take("lm_head.weight")
        out["lm_head.weight_t"] = transposed(head)
        del head
    for name in list(tensors):  # norms, q/k norms, the embedding table
        out[name] = take(name)
    return out
