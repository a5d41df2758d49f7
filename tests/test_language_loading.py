"""Loading the decoder never holds a projection twice (issue 25, finding 4).

The decoder adopts the loader's tensors group by group (model/linear.py,
fuse_checkpoint_tensors): each checkpoint tensor is popped from the caller's dict, fused or
transposed, and dropped before the next group. Measured here with a counting dispatch mode
over meta tensors of real model sizes (no memory is used): every storage made from the
weights is counted from its creation until it is freed, and the peak is compared with the
weights themselves.

- On the device path (CUDA: weight_t is a transposed view, fusions are one cat each) the
  peak stays within 5% above the weights, for Qwen2.5-VL-7B, Qwen3-VL-2B (tied head) and
  Qwen3-VL-30B-A3B (MoE) shapes.
- On the CPU path (weight_t a contiguous copy, MKL's layout) the peak is the weights plus
  the one largest tensor made at once (the head's transposed copy: 7% at 7B).
`ModelRunner` consumes the dict it is given (tests/test_language_startup.py).
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tandem.services.language.model.config import DecoderConfig
from tandem.services.language.model.decoder import QwenVLDecoder
from tandem.services.language.model.linear import fuse_checkpoint_tensors

BF16 = torch.bfloat16


class WeightBytes(TorchDispatchMode):
    """Live bytes of the weights and of every storage an op makes from them (a fused or
    transposed copy), from its creation until the storage is freed; and their peak.

    Only storages made from tracked ones count, so the decoder's skeleton (parameters
    allocated on the meta device and replaced by the weights: free in real life) does not.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def track(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        key = s._cdata
        if key in self.live:
            return
        self.live[key] = s.nbytes()
        self.now += s.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(s, self._freed, key)  # NOTE: fires when the storage itself dies

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.untyped_storage()._cdata in self.live for t in inputs):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.track(t)
        return out


# Real text-decoder shapes (the checkpoints' config.json text parts).
SHAPES = {
    "qwen2_5_vl-7b": dict(arch="qwen2_5_vl", vocab_size=152064, hidden_size=3584, num_layers=28,
                          num_heads=28, num_kv_heads=4, head_dim=128, intermediate_size=18944,
                          qkv_bias=True, qk_norm=False, tied=False),
    "qwen3_vl-2b": dict(arch="qwen3_vl", vocab_size=151936, hidden_size=2048, num_layers=28,
                        num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=6144,
                        qkv_bias=False, qk_norm=True, tied=True),
    "qwen3_vl_moe-30b-a3b": dict(arch="qwen3_vl_moe", vocab_size=151936, hidden_size=2048,
                                 num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                                 intermediate_size=6144, qkv_bias=False, qk_norm=True,
                                 tied=False, num_experts=128, num_experts_per_tok=8,
                                 moe_intermediate_size=768),
}


def config(shape: dict) -> DecoderConfig:
    s = {k: v for k, v in shape.items() if k != "tied"}
    moe = tuple(range(s["num_layers"])) if s.get("num_experts") else ()
    return DecoderConfig(**s, rms_norm_eps=1e-6, rope_theta=1e6, mrope_section=(16, 24, 24),
                         mrope_interleaved=s["arch"] != "qwen2_5_vl", o_bias=False,
                         num_deepstack=0, moe_layers=moe)


def meta_weights(shape: dict) -> dict[str, torch.Tensor]:
    """The loader's normalized tensors (tandem/models/split.py) at `shape`, on meta."""
    c = config(shape)
    h, d, i = c.hidden_size, c.head_dim, c.intermediate_size
    t = lambda *size: torch.empty(size, dtype=BF16, device="meta")  # noqa: E731
    out = {"embed_tokens.weight": t(c.vocab_size, h), "norm.weight": t(h)}
    out["lm_head.weight"] = out["embed_tokens.weight"] if shape["tied"] else t(c.vocab_size, h)
    for n in range(c.num_layers):
        a, m = f"layers.{n}.self_attn.", f"layers.{n}.mlp."
        out |= {f"layers.{n}.input_layernorm.weight": t(h),
                f"layers.{n}.post_attention_layernorm.weight": t(h),
                f"{a}q_proj.weight": t(c.num_heads * d, h),
                f"{a}k_proj.weight": t(c.num_kv_heads * d, h),
                f"{a}v_proj.weight": t(c.num_kv_heads * d, h),
                f"{a}o_proj.weight": t(h, c.num_heads * d)}
        if c.qkv_bias:
            out |= {f"{a}q_proj.bias": t(c.num_heads * d), f"{a}k_proj.bias": t(c.num_kv_heads * d),
                    f"{a}v_proj.bias": t(c.num_kv_heads * d)}
        if c.qk_norm:
            out |= {f"{a}q_norm.weight": t(d), f"{a}k_norm.weight": t(d)}
        if n in c.moe_layers:
            e, mi = c.num_experts, c.moe_intermediate_size
            out |= {f"{m}gate.weight": t(e, h), f"{m}experts.gate_up_proj": t(e, 2 * mi, h),
                    f"{m}experts.down_proj": t(e, h, mi)}
        else:
            out |= {f"{m}gate_proj.weight": t(i, h), f"{m}up_proj.weight": t(i, h),
                    f"{m}down_proj.weight": t(h, i)}
    return out


def weights_bytes(tensors: dict[str, torch.Tensor]) -> int:
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors.values()}
    return sum(storages.values())


def tracked(tensors: dict[str, torch.Tensor]) -> WeightBytes:
    counter = WeightBytes()
    for t in tensors.values():
        counter.track(t)
    return counter


@pytest.mark.parametrize("name", list(SHAPES))
def test_device_path_peaks_within_5_percent_of_the_weights(name):
    tensors = meta_weights(SHAPES[name])
    weights = weights_bytes(tensors)
    counter = tracked(tensors)
    with counter:
        model = QwenVLDecoder.build(config(SHAPES[name]), tensors, torch.device("meta"), BF16)
    assert not tensors  # consumed: the caller's dict holds no original
    over = counter.peak - weights
    assert over <= 0.05 * weights, f"{name}: loading peaked {over / weights:.1%} over the weights"
    # Afterwards the model holds the weights once: every original was adopted or freed.
    assert counter.now <= weights
    assert model.layers[0].self_attn.qkv_proj.weight_t.shape[0] == SHAPES[name]["hidden_size"]


@pytest.mark.parametrize("name", list(SHAPES))
def test_cpu_path_peaks_at_the_weights_plus_one_tensor(name):
    tensors = meta_weights(SHAPES[name])
    weights = weights_bytes(tensors)
    counter = tracked(tensors)
    c = config(SHAPES[name])
    with counter:
        out = fuse_checkpoint_tensors(tensors, c.num_layers, c.moe_layers, copy_transposes=True)
    largest = max(t.untyped_storage().nbytes() for t in out.values())
    head = out["lm_head.weight_t"].untyped_storage().nbytes()
    assert counter.peak - weights <= largest, f"{name}: more than one tensor alive twice"
    # A tied head's contiguous copy stays (the CPU kernels pack it anyway); else the same.
    assert counter.now <= weights + (head if SHAPES[name]["tied"] else 0)

