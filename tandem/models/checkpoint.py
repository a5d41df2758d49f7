"""Find a checkpoint and describe it: `resolve_model_path` and `read_spec` -> `ModelSpec`.

Torch-free: the spec comes from config.json, generation_config.json and the safetensors
headers (read with the standard library), so routers and launchers can use it cheaply.

Weight-name layouts (what `ModelSpec.text_prefix` / `visual_prefix` hold):

    layout                      text decoder              vision tower     lm head
    Qwen2.5-VL (hub, and        model.layers.* ,          visual.*         lm_head.weight
      transformers 5 saves)     model.embed_tokens, model.norm
    Qwen3-VL (hub and saves),   model.language_model.*    model.visual.*   lm_head.weight
      Qwen2.5-VL saved by
      transformers 4.52-4.57

`lm_head.weight` is absent when the head is tied to the embedding (tie_word_embeddings).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

ARCHS = {"qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL", "qwen3_vl_moe": "Qwen3-VL-MoE"}
QWEN3 = ("qwen3_vl", "qwen3_vl_moe")  # deepstack, interleaved MRoPE
# Files a checkpoint needs; anything else in a hub repo (other formats, docs) is not fetched.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]


class CheckpointError(ValueError):
    """A model name that resolves to nothing usable, or a checkpoint Tandem cannot read."""


def resolve_model_path(
    model: str | os.PathLike,
    *,
    local_files_only: bool | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """A local checkpoint directory for `model`: a directory, or a Hugging Face id.

    A hub id is looked up in the local Hugging Face cache first; only if it is missing
    there (and neither `local_files_only` nor HF_HUB_OFFLINE forbids it) is it downloaded.
    """
    p = Path(model).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise CheckpointError(f"model {str(model)!r}: directory has no config.json")
        return p.resolve()
    text = str(model)
    looks_like_path = text.startswith((".", "/", "~")) or text.count("/") > 1 or p.exists()
    if looks_like_path or not text:
        raise CheckpointError(f"model {text!r}: no such checkpoint directory")

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    only_local = offline if local_files_only is None else local_files_only
    attempts = [True] if only_local else [True, False]
    reason = ""
    for local in attempts:
        try:
            got = snapshot_download(
                text, allow_patterns=_HUB_PATTERNS, local_files_only=local, cache_dir=cache_dir
            )
        except HFValidationError as e:
            raise CheckpointError(
                f"model {text!r}: neither a directory nor a valid Hugging Face id ({e})"
            ) from e
        except Exception as e:  # not cached / offline / not found / gated: try the next way
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        path = Path(got)
        if (path / "config.json").is_file():
            return path
        reason = "the snapshot has no config.json"
    where = (
        "the local Hugging Face cache" if only_local else "the local cache or the Hugging Face Hub"
    )
    raise CheckpointError(
        f"model {text!r}: not a local directory, and not found in {where} ({reason}). "
        "Pass a checkpoint directory, or download it first (`hf download ID`)."
    )


@dataclass(frozen=True)
class ModelSpec:
    """What the tiers need to know about a checkpoint, read from its files."""

    path: Path
    arch: str  # "qwen2_5_vl" | "qwen3_vl" | "qwen3_vl_moe"
    config: dict = field(repr=False)  # config.json as written
    text_config: dict = field(repr=False)
    vision_config: dict = field(repr=False)
    # text decoder
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]  # (t, h, w) sections of head_dim // 2
    mrope_interleaved: bool  # Qwen3-VL interleaves t/h/w frequencies
    attention_bias: bool  # q/k/v projections carry biases (Qwen2.5-VL; read from the weights)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3-VL; read from the weights)
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    # sparse MoE (Qwen3-VL-MoE; 0 / () for dense models)
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_layers: tuple[int, ...]  # layers whose MLP is the sparse block
    # vision tower and the prompt layout
    num_deepstack: int  # 0 for Qwen2.5-VL
    embed_dim: int  # hidden_size * (1 + num_deepstack): one row of input_embeds on the wire
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    tokens_per_second: int  # Qwen2.5-VL video time scale (unused for images)
    eos_token_ids: tuple[int, ...]
    torch_dtype: str  # dtype the weights were saved in, e.g. "bfloat16"
    # weight layout
    text_prefix: str  # "model." or "model.language_model."
    visual_prefix: str  # "visual." or "model.visual."
    weight_map: dict[str, str] = field(repr=False)  # tensor name -> safetensors file name

    def files(self, names) -> dict[str, list[str]]:
        """Group tensor names by the file that holds them."""
        out: dict[str, list[str]] = {}
        for n in names:
            out.setdefault(self.weight_map[n], []).append(n)
        return out


def _safetensors_names(file: Path) -> list[str]:
    """Tensor names in a safetensors file, from its JSON header (no tensor data read)."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return [k for k in header if k != "__metadata__"]


def _weight_map(path: Path) -> dict[str, str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no safetensors weights (model.safetensors or an index)")
    return {name: f.name for f in files for name in _safetensors_names(f)}


def _prefixes(names) -> tuple[str, str]:
    names = list(names)
    if any(n.startswith("model.language_model.") for n in names):
        text = "model.language_model."
    elif any(n.startswith("model.embed_tokens.") or n.startswith("model.layers.") for n in names):
        text = "model."
    else:
        raise CheckpointError(
            "cannot find the text decoder's tensors (model.layers.* or model.language_model.*)"
        )
    if any(n.startswith("model.visual.") for n in names):
        visual = "model.visual."
    elif any(n.startswith("visual.") for n in names):
        visual = "visual."
    else:
        raise CheckpointError("cannot find the vision tower's tensors (visual.* or model.visual.*)")
    return text, visual


def read_spec(path: str | os.PathLike) -> ModelSpec:
    """The `ModelSpec` of a local checkpoint directory (see `resolve_model_path`)."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: no config.json") from e
    arch = config.get("model_type")
    if arch not in ARCHS:
        raise CheckpointError(
            f"{path}: model_type {arch!r} is not supported (supported: {', '.join(ARCHS)})"
        )
    # Old Qwen2.5-VL configs keep the text fields at the top level.
    text = dict(
        config.get("text_config") or {k: v for k, v in config.items() if k != "vision_config"}
    )
    vision = dict(config["vision_config"])
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    heads = text["num_attention_heads"]
    hidden = text["hidden_size"]
    head_dim = text.get("head_dim") or hidden // heads
    mrope = tuple(rope.get("mrope_section") or ())
    if 2 * sum(mrope) != head_dim:
        raise CheckpointError(
            f"{path}: mrope_section {list(mrope)} does not cover head_dim/2 = {head_dim // 2}"
        )
    deepstack = len(vision.get("deepstack_visual_indexes") or ()) if arch in QWEN3 else 0
    experts = int(text.get("num_experts", text.get("num_local_experts", 0)) or 0)
    step = int(text.get("decoder_sparse_step", 1) or 1)
    dense_only = set(text.get("mlp_only_layers") or ())
    moe_layers = tuple(i for i in range(text["num_hidden_layers"]) if experts > 0
                       and i not in dense_only and (i + 1) % step == 0)  # transformers' rule

    eos = text.get("eos_token_id", config.get("eos_token_id"))
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
    eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])

    weight_map = _weight_map(path)
    text_prefix, visual_prefix = _prefixes(weight_map)
    tie = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    if not tie and "lm_head.weight" not in weight_map:
        raise CheckpointError(f"{path}: lm_head.weight is missing and the head is not tied")
    return ModelSpec(
        path=path,
        arch=arch,
        config=config,
        text_config=text,
        vision_config=vision,
        hidden_size=hidden,
        num_hidden_layers=text["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=text["intermediate_size"],
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
        mrope_section=mrope,
        mrope_interleaved=bool(rope.get("mrope_interleaved", arch in QWEN3)),
        attention_bias=f"{text_prefix}layers.0.self_attn.q_proj.bias" in weight_map,
        qk_norm=f"{text_prefix}layers.0.self_attn.q_norm.weight" in weight_map,
        vocab_size=text["vocab_size"],
        tie_word_embeddings=tie,
        max_position_embeddings=text.get("max_position_embeddings", 32768),
        num_experts=experts,
        num_experts_per_tok=int(text.get("num_experts_per_tok", 0) or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size", 0) or 0),
        moe_layers=moe_layers,
        num_deepstack=deepstack,
        embed_dim=hidden * (1 + deepstack),
        image_token_id=config["image_token_id"],
        video_token_id=config["video_token_id"],
        vision_start_token_id=config["vision_start_token_id"],
        vision_end_token_id=config.get("vision_end_token_id", config["vision_start_token_id"] + 1),
        patch_size=vision.get("patch_size", 14),
        temporal_patch_size=vision.get("temporal_patch_size", 2),
        spatial_merge_size=vision.get("spatial_merge_size", 2),
        tokens_per_second=vision.get("tokens_per_second", 2),
        eos_token_ids=eos_ids,
        torch_dtype=str(
            config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or "float32"
        ),
        text_prefix=text_prefix,
        visual_prefix=visual_prefix,
        weight_map=weight_map,
    )
