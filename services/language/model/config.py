"""The decoder's shape, from the checkpoint spec and the tensors actually loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.services.language.model.shard import Shard

ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


@dataclass(frozen=True)
class DecoderConfig:
    arch: str
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
    qkv_bias: bool  # Qwen2.5-VL: q/k/v carry biases
    o_bias: bool  # Qwen3-VL with attention_bias: o_proj too
    qk_norm: bool  # Qwen3-VL: per-head RMSNorm on q and k
    num_deepstack: int  # deepstack feature blocks added after layers [0, num_deepstack)
    # sparse MoE (Qwen3-VL-MoE): layers whose MLP routes each token to top-k experts
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # tensor parallelism: this rank's part (None: the whole model on one device)
    shard: Shard | None = None

    # ---- this rank's sizes (the whole model's without a shard) -------------------------
    @property
    def local_heads(self) -> int:
        return self.shard.heads if self.shard else self.num_heads

    @property
    def local_kv_heads(self) -> int:
        return self.shard.kv_heads if self.shard else self.num_kv_heads

    @property
    def local_intermediate(self) -> int:
        return self.shard.intermediate if self.shard else self.intermediate_size

    @property
    def local_moe_intermediate(self) -> int:
        return self.shard.moe_intermediate if self.shard else self.moe_intermediate_size

    @property
    def local_vocab(self) -> int:
        return len(self.shard.vocab) if self.shard else self.vocab_size

    @property
    def embed_dim(self) -> int:
        """Width of a prompt payload row: hidden * (1 + num_deepstack)."""
        return self.hidden_size * (1 + self.num_deepstack)

    @classmethod
    def from_weights(cls, spec: Any, tensors: dict, shard: Shard | None = None) -> DecoderConfig:
        """`spec` is a `tandem.models.checkpoint.ModelSpec`; biases and q/k norms are read
        off the tensors that were loaded, so config and weights cannot disagree."""
        if spec.arch not in ARCHS:
            raise ValueError(f"unsupported architecture {spec.arch!r}; know {ARCHS}")
        act = spec.text_config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (want silu)")
        if spec.text_config.get("use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        rope_type = (spec.text_config.get("rope_parameters") or {}).get("rope_type", "default")
        if rope_type not in ("default", "mrope"):
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        section = tuple(int(s) for s in spec.mrope_section)
        if len(section) != 3 or 2 * sum(section) != spec.head_dim:
            raise ValueError(f"mrope_section {section} must be 3 parts summing to head_dim/2")
        return cls(
            arch=spec.arch,
            vocab_size=int(spec.vocab_size),
            hidden_size=int(spec.hidden_size),
            num_layers=int(spec.num_hidden_layers),
            num_heads=int(spec.num_attention_heads),
            num_kv_heads=int(spec.num_key_value_heads),
            head_dim=int(spec.head_dim),
            intermediate_size=int(spec.intermediate_size),
            rms_norm_eps=float(spec.rms_norm_eps),
            rope_theta=float(spec.rope_theta),
            mrope_section=section,  # type: ignore[arg-type]
            mrope_interleaved=bool(spec.mrope_interleaved),
            qkv_bias="layers.0.self_attn.q_proj.bias" in tensors,
            o_bias="layers.0.self_attn.o_proj.bias" in tensors,
            qk_norm="layers.0.self_attn.q_norm.weight" in tensors,
            num_deepstack=int(spec.num_deepstack),
            moe_layers=tuple(spec.moe_layers),
            num_experts=int(spec.num_experts),
            num_experts_per_tok=int(spec.num_experts_per_tok),
            moe_intermediate_size=int(spec.moe_intermediate_size),
            shard=shard,
        )
