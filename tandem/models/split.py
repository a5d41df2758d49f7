"""Split loading: each tier reads only its own tensors from the checkpoint.

    encoder tier   load_vision_part  -> transformers' own vision tower + the token embedding
    language tier  load_text_weights -> decoder layers, final norm, lm_head (normalized names)

Tensors are read one by one with `safetensors.safe_open` (memory-mapped; only the named
tensors are ever read), so neither side materialises the other side's weights. The vision
tower is transformers' class built with initialisation switched off, then filled with
`load_state_dict(strict=True)`: every parameter comes from the checkpoint, and its output
equals the full model's `get_image_features` bit for bit.

Normalized text names (`TextWeights.tensors`), whatever the checkpoint's layout:

    embed_tokens.weight                           [vocab, hidden]
    layers.{i}.input_layernorm.weight             [hidden]
    layers.{i}.self_attn.{q,k,v}_proj.weight      [heads * head_dim | kv_heads * head_dim, hidden]
    layers.{i}.self_attn.{q,k,v}_proj.bias        (Qwen2.5-VL only)
    layers.{i}.self_attn.o_proj.weight            [hidden, heads * head_dim]
    layers.{i}.self_attn.{q,k}_norm.weight        [head_dim] (Qwen3-VL only)
    layers.{i}.post_attention_layernorm.weight    [hidden]
    layers.{i}.mlp.{gate,up}_proj.weight          [intermediate, hidden]      (dense layers)
    layers.{i}.mlp.down_proj.weight               [hidden, intermediate]      (dense layers)
    layers.{i}.mlp.gate.weight                    [experts, hidden]           (MoE router)
    layers.{i}.mlp.experts.gate_up_proj           [experts, 2 * moe_inter, hidden]
    layers.{i}.mlp.experts.down_proj              [experts, hidden, moe_inter]
                                                  (transformers' in-memory layout, whether the
                                                  file holds it transposed, as the released
                                                  checkpoints do, or per expert)
    norm.weight                                   [hidden]
    lm_head.weight                                [vocab, hidden] (the embedding tensor itself when tied)
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass

import torch
from torch import nn

from tandem.models.checkpoint import CheckpointError, ModelSpec, read_spec, resolve_model_path

log = logging.getLogger("tandem.models")
PROGRESS_S = 10.0  # reading a checkpoint says how far it got at least this often

_TEXT_NAME = re.compile(r"^(embed_tokens\.weight|norm\.weight|layers\.\d+\.(?!.*rotary_emb).+)$")


def _spec(model: str | os.PathLike | ModelSpec) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else read_spec(resolve_model_path(model))


def read_tensors(spec: ModelSpec, names, dtype: torch.dtype, device, plan=None
                 ) -> dict[str, torch.Tensor]:
    """The named tensors, converted to `dtype` on `device`; nothing else is read.

    `plan(name, shape)` (tensor parallelism: `tandem.services.language.model.shard.Shard.plan`,
    called with the stored name) may return a read plan: then only its parts are read
    from the file (safetensors slices) and concatenated on its `dim`."""
    from safetensors import safe_open

    missing = [n for n in names if n not in spec.weight_map]
    if missing:
        raise CheckpointError(f"{spec.path}: missing tensors {missing[:5]}")
    out: dict[str, torch.Tensor] = {}
    files = spec.files(names)
    t0 = last = time.monotonic()
    for k, (file, group) in enumerate(files.items(), 1):
        with safe_open(str(spec.path / file), framework="pt", device=str(device)) as f:
            for j, name in enumerate(group, 1):
                if time.monotonic() - last >= PROGRESS_S:  # a big file: say how far it is
                    last = time.monotonic()
                    log.info("weights: reading %s (%d of %d tensors, %.0f s)", file, j,
                             len(group), last - t0)
                how = None
                if plan is not None:
                    stored = f.get_slice(name)
                    how = plan(name, tuple(stored.get_shape()))
                if how is None:
                    out[name] = f.get_tensor(name).to(dtype)
                else:
                    parts = [stored[idx].to(dtype) for idx in how.parts]
                    out[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=how.dim)
        last = time.monotonic()
        log.info("weights: read %s (%d tensors; file %d of %d, %.0f s)", file, len(group), k,
                 len(files), last - t0)
    return out


@dataclass
class VisionPart:
    """What the encoder tier runs: the vision tower and the token-embedding table."""

    spec: ModelSpec
    visual: nn.Module  # Qwen2_5_VisionTransformerPretrainedModel | Qwen3VLVisionModel
    embed_tokens: nn.Embedding

    @torch.inference_mode()
    def encode_images(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Merged image embeddings `[N, hidden]` for all images in order, and the deepstack
        features (one `[N, hidden]` tensor per deepstack layer; empty for Qwen2.5-VL)."""
        pixel_values = pixel_values.to(next(self.visual.parameters()).device, self.visual.dtype)
        out = self.visual(pixel_values, grid_thw=grid_thw, return_dict=True)
        deepstack = list(getattr(out, "deepstack_features", None) or [])
        return out.pooler_output, deepstack


def _vision_class(arch: str):
    if arch == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as cls,
        )
    elif arch == "qwen3_vl_moe":
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
            Qwen3VLMoeVisionModel as cls,
        )
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as cls
    return cls


def load_vision_part(
    model: str | os.PathLike | ModelSpec, dtype: torch.dtype = torch.float32, device="cpu",
    embed_device=None,
) -> VisionPart:
    """The vision tower (transformers' class) on `device` and the embedding table on
    `embed_device` (default: `device`; the encoder's stays on the CPU); no decoder weight is
    read."""
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights

    spec = _spec(model)
    vision_config = AutoConfig.from_pretrained(spec.path).vision_config
    names = [n for n in spec.weight_map if n.startswith(spec.visual_prefix)]
    embed_name = spec.text_prefix + "embed_tokens.weight"
    tensors = read_tensors(spec, names, dtype, device)
    table = read_tensors(spec, [embed_name], dtype, device if embed_device is None else embed_device)

    # NOTE: parameters are allocated empty (no init) and every one is overwritten below;
    # non-persistent buffers (rotary inv_freq) are computed by the constructors as usual.
    with no_init_weights(), torch.device(device):
        visual = _vision_class(spec.arch)._from_config(vision_config, dtype=dtype)
    visual.load_state_dict({n[len(spec.visual_prefix) :]: tensors[n] for n in names}, strict=True)
    visual.eval().requires_grad_(False)
    embed = nn.Embedding.from_pretrained(table[embed_name], freeze=True)
    return VisionPart(spec=spec, visual=visual, embed_tokens=embed)


@dataclass
class TextWeights:
    """What the language tier loads: decoder, final norm and head, under normalized names."""

    spec: ModelSpec
    tensors: dict[str, torch.Tensor]

    def copy(self) -> TextWeights:
        """Another dict over the same tensors: a `ModelRunner` consumes the dict it is
        given (so no duplicate outlives loading), and a caller building several runners
        from one load hands each its own."""
        return TextWeights(self.spec, dict(self.tensors))


def text_tensor_names(spec: ModelSpec) -> dict[str, str]:
    """Normalized name -> checkpoint name for every text-side tensor (no lm_head when tied)."""
    out = {}
    for name in spec.weight_map:
        if name.startswith(spec.visual_prefix) or not name.startswith(spec.text_prefix):
            continue
        rel = name[len(spec.text_prefix) :]
        if _TEXT_NAME.match(rel):
            out[rel] = name
    if "lm_head.weight" in spec.weight_map and not spec.tie_word_embeddings:
        out["lm_head.weight"] = "lm_head.weight"
    return out


def load_text_weights(
    model: str | os.PathLike | ModelSpec, dtype: torch.dtype = torch.float32, device="cpu",
    shard=None,
) -> TextWeights:
    """The text decoder's tensors, normalized names (see module doc); no `visual` tensor is
    read. With `shard` (`tandem.services.language.model.shard.Shard`, tensor parallelism) only
    that rank's slices of the split tensors are read (its `plan`), the rest whole."""
    spec = _spec(model)
    names = text_tensor_names(spec)
    norm_of = {stored: norm for norm, stored in names.items()}
    plan = None if shard is None else (lambda stored, shape: shard.plan(norm_of[stored], shape))
    raw = read_tensors(spec, list(names.values()), dtype, device, plan)
    tensors = {norm: raw[name] for norm, name in names.items()}
    if "lm_head.weight" not in tensors:  # tied: one tensor, two names (a rank: its rows)
        embed = tensors["embed_tokens.weight"]
        tensors["lm_head.weight"] = embed if shard is None else embed[shard.vocab.start : shard.vocab.stop]
    moe_inter = spec.moe_intermediate_size if shard is None else shard.moe_intermediate
    for i in spec.moe_layers:
        _normalize_experts(tensors, spec, f"layers.{i}.mlp.", moe_inter)
    want = {"embed_tokens.weight", "norm.weight"} | {
        f"layers.{i}.{part}"
        for i in range(spec.num_hidden_layers)
        for part in (
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "mlp.experts.down_proj" if i in spec.moe_layers else "mlp.down_proj.weight",
        )
    }
    if missing := sorted(want - tensors.keys()):
        raise CheckpointError(f"{spec.path}: text decoder tensors missing: {missing[:5]}")
    return TextWeights(spec=spec, tensors=tensors)


def _normalize_experts(tensors: dict[str, torch.Tensor], spec: ModelSpec, m: str,
                       moe_inter: int) -> None:
    """One MoE layer's experts as `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj`
    [E, H, I] (in place): stacked from per-expert tensors, or transposed from the released
    checkpoints' [E, H, 2I] / [E, I, H]. A file whose layout the shapes cannot tell apart
    (H == 2I) is read as transformers writes it, untransposed."""
    e, i, h = spec.num_experts, moe_inter, spec.hidden_size
    per = f"{m}experts.0.gate_proj.weight"
    if per in tensors:
        gate_up, down = [], []
        for k in range(e):
            p = f"{m}experts.{k}."
            gate_up.append(torch.cat([tensors.pop(p + "gate_proj.weight"),
                                      tensors.pop(p + "up_proj.weight")]))
            down.append(tensors.pop(p + "down_proj.weight"))
        tensors[f"{m}experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{m}experts.down_proj"] = torch.stack(down)
    for name, want, flipped in (("gate_up_proj", (e, 2 * i, h), (e, h, 2 * i)),
                                ("down_proj", (e, h, i), (e, i, h))):
        t = tensors.get(f"{m}experts.{name}")
        if t is None:
            raise CheckpointError(f"{spec.path}: {m}experts.{name} is missing")
        if tuple(t.shape) != want and tuple(t.shape) == flipped:
            t = tensors[f"{m}experts.{name}"] = t.transpose(1, 2).contiguous()
        if tuple(t.shape) != want:
            raise CheckpointError(f"{spec.path}: {m}experts.{name} has shape "
                                  f"{tuple(t.shape)}, expected {want}")
