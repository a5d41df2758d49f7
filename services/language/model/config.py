"""The decoder's shape, read once from a Hugging Face text config (object or dict)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Architectures we run and what sets them apart. transformers' defaults apply when a
# checkpoint's rope parameters omit `mrope_section`.
_ARCHS = {
    # model_type: (qkv bias, q/k RMSNorm, interleaved MRoPE, default mrope_section)
    "qwen2_5_vl_text": (True, False, False, (16, 24, 24)),
    "qwen3_vl_text": (None, True, True, (24, 20, 20)),  # None: config.attention_bias
}


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    num_deepstack: int  # deepstack feature blocks added after layers [0, num_deepstack)

    @property
    def embed_dim(self) -> int:
        """Width of a prompt payload row: hidden * (1 + num_deepstack)."""
        return self.hidden_size * (1 + self.num_deepstack)

    @classmethod
    def from_text_config(cls, text_config: Any, num_deepstack: int = 0) -> DecoderConfig:
        model_type = _get(text_config, "model_type")
        if model_type not in _ARCHS:
            raise ValueError(f"unsupported text decoder {model_type!r}; know {sorted(_ARCHS)}")
        qkv_bias, qk_norm, interleaved, default_section = _ARCHS[model_type]
        attention_bias = bool(_get(text_config, "attention_bias", False))
        if qkv_bias is None:
            qkv_bias = attention_bias
        o_bias = attention_bias and model_type == "qwen3_vl_text"
        act = _get(text_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (want silu)")
        if _get(text_config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        if model_type == "qwen3_vl_text":
            num_heads = int(_get(text_config, "num_attention_heads"))
            head_dim = int(
                _get(text_config, "head_dim") or _get(text_config, "hidden_size") // num_heads
            )
        else:
            # Qwen2.5-VL's attention always uses hidden // heads (head_dim is not a field).
            num_heads = int(_get(text_config, "num_attention_heads"))
            head_dim = int(_get(text_config, "hidden_size")) // num_heads
        rope = _get(text_config, "rope_parameters") or {}
        if rope.get("rope_type", "default") not in ("default", "mrope"):
            raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r}")
        section = tuple(int(s) for s in rope.get("mrope_section", default_section))
        if len(section) != 3 or sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {section} must be 3 parts summing to {head_dim // 2}")
        return cls(
            model_type=model_type,
            vocab_size=int(_get(text_config, "vocab_size")),
            hidden_size=int(_get(text_config, "hidden_size")),
            num_layers=int(_get(text_config, "num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(_get(text_config, "num_key_value_heads")),
            head_dim=head_dim,
            intermediate_size=int(_get(text_config, "intermediate_size")),
            rms_norm_eps=float(_get(text_config, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", _get(text_config, "rope_theta", 10000.0))),
            mrope_section=section,  # type: ignore[arg-type]
            mrope_interleaved=interleaved,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=qk_norm,
            num_deepstack=int(num_deepstack),
        )
