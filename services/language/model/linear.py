"""Linear layers with the weight stored transposed, and the fused projections built from
a checkpoint's separate ones.

    DenseLinear: y = x @ weight_t (+ bias), weight_t [in, out] contiguous
                 or, once `pack`ed (CPU, float32), the same product by our own kernel over
                 column strips (`cpu_kernels`: 2-6x MKL's sgemm on this AMD CPU; the
                 packed copy replaces weight_t)

NOTE (why transposed): with MKL on this CPU (float32), `F.linear(x, W)` over a
checkpoint's W [out, in] costs 1.7-4x more than `x @ Wt` over a contiguous [in, out]
copy for 4-32 rows (decode batches), and the same for large prefill chunks; on CUDA both
layouts are one cuBLAS call. The transposed copy replaces the original (no extra memory).

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

    def pack(self, kernels) -> None:
        """Run on the CPU kernels' packed layout (`cpu_kernels.PackedLinear`); weight_t and
        bias are replaced by their packed forms (no second copy stays)."""
        self.packed = PackedLinear(self.weight_t, self.bias, kernels)
        del self.weight_t, self.bias
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        if self.packed is not None:
            return self.packed(x)
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


def fuse_checkpoint_tensors(tensors: dict[str, torch.Tensor], num_layers: int,
                            moe_layers: tuple[int, ...] = ()) -> dict:
    """The decoder's parameter dict from the loader's normalized checkpoint names.

    Every `*.weight` of a projection becomes `*.weight_t` (transposed, contiguous); q/k/v
    become `qkv_proj`, gate/up become `gate_up_proj`; norms and embeddings pass through.
    A sparse MoE layer's router becomes `router.weight_t` and its experts `w_gate_up`
    [E, H, 2I] and `w_down` [E, I, H] (each expert's matrices transposed likewise).
    Consumes `tensors` (entries are popped) so no two full copies are alive at once."""
    out: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        qkv = [tensors.pop(f"{a}{p}_proj.weight") for p in "qkv"]
        out[f"{a}qkv_proj.weight_t"] = torch.cat([w.t() for w in qkv], dim=1).contiguous()
        if f"{a}q_proj.bias" in tensors:
            out[f"{a}qkv_proj.bias"] = torch.cat([tensors.pop(f"{a}{p}_proj.bias") for p in "qkv"])
        if i in moe_layers:
            out[f"{m}router.weight_t"] = tensors.pop(f"{m}gate.weight").t().contiguous()
            out[f"{m}w_gate_up"] = tensors.pop(f"{m}experts.gate_up_proj").transpose(1, 2).contiguous()
            out[f"{m}w_down"] = tensors.pop(f"{m}experts.down_proj").transpose(1, 2).contiguous()
        else:
            gate_up = [tensors.pop(f"{m}{p}_proj.weight") for p in ("gate", "up")]
            out[f"{m}gate_up_proj.weight_t"] = torch.cat([w.t() for w in gate_up], dim=1).contiguous()
            out[f"{m}down_proj.weight_t"] = tensors.pop(f"{m}down_proj.weight").t().contiguous()
        for name in (f"{a}o_proj",):
            out[f"{name}.weight_t"] = tensors.pop(f"{name}.weight").t().contiguous()
            if f"{name}.bias" in tensors:
                out[f"{name}.bias"] = tensors.pop(f"{name}.bias")
    if "lm_head.weight" in tensors:  # a tied head has none: it reads the embedding table
        out["lm_head.weight_t"] = tensors.pop("lm_head.weight").t().contiguous()
    out.update(tensors)  # norms, q/k norms, the embedding table
    return out
