"""Split loading: the encoder side (vision tower + embedding) reproduces the full model's
`get_image_features` bit for bit, the language side gets the decoder under normalized names,
neither side reads the other's tensors, and both weight layouts and hub ids resolve."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

import tandem  # noqa: F401  (processor hook)
from tandem.models.checkpoint import CheckpointError, read_spec, resolve_model_path
from tandem.models.split import load_text_weights, load_vision_part

ARCHS = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]


def make_image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def pixels(path: Path, sizes):
    from transformers import AutoProcessor

    ip = AutoProcessor.from_pretrained(path).image_processor
    images = [make_image(w, h, i) for i, (w, h) in enumerate(sizes)]
    out = ip(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


_FULL: dict = {}


def full_model(path: Path, dtype=torch.float32):
    from transformers import AutoModelForImageTextToText

    key = (str(path), dtype)
    if key not in _FULL:
        _FULL[key] = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
    return _FULL[key]


def all_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def copy_with(src: Path, dst: Path, shards: dict[str, dict[str, torch.Tensor]]) -> Path:
    """`src`'s non-weight files plus the given safetensors shards (with an index if several)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", ".complete"))
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    if len(shards) > 1:
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


@pytest.mark.parametrize("sizes", [[(90, 60)], [(90, 60), (50, 130)]], ids=["1img", "2img"])
@pytest.mark.parametrize("arch", ARCHS)
def test_vision_part_equals_get_image_features(checkpoint, arch, sizes):
    path = checkpoint(arch)
    pv, grid = pixels(path, sizes)
    full = full_model(path)
    with torch.inference_mode():
        ref = full.model.get_image_features(pv, grid)
    part = load_vision_part(path)
    embeds, deepstack = part.encode_images(pv, grid)

    assert type(part.visual) is type(full.model.visual)
    assert embeds.shape == (int(grid.prod(-1).sum()) // 4, part.spec.hidden_size)
    assert torch.equal(embeds, torch.cat(ref.pooler_output))
    assert len(deepstack) == part.spec.num_deepstack == (2 if arch.startswith("qwen3") else 0)
    for mine, theirs in zip(deepstack, getattr(ref, "deepstack_features", None) or [], strict=True):
        assert torch.equal(mine, torch.cat(theirs))
    assert torch.equal(part.embed_tokens.weight, full.get_input_embeddings().weight)


@pytest.mark.parametrize("arch", ARCHS)
def test_vision_part_bf16_equals_full_model_bf16(checkpoint, arch):
    path = checkpoint(arch)
    pv, grid = pixels(path, [(70, 70)])
    full = full_model(path, torch.bfloat16)
    with torch.inference_mode():
        ref = full.model.get_image_features(pv, grid)
    part = load_vision_part(path, dtype=torch.bfloat16)
    assert part.embed_tokens.weight.dtype == torch.bfloat16
    embeds, deepstack = part.encode_images(pv, grid)
    assert embeds.dtype == torch.bfloat16
    assert torch.equal(embeds, torch.cat(ref.pooler_output))


def _expected_text_names(spec) -> set[str]:
    names = {"embed_tokens.weight", "norm.weight", "lm_head.weight"}
    for i in range(spec.num_hidden_layers):
        p = f"layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {f"{p}self_attn.{x}_proj.weight" for x in "qkvo"}
        if i in spec.moe_layers:  # transformers' fused experts and the router
            names |= {f"{p}mlp.experts.gate_up_proj", f"{p}mlp.experts.down_proj",
                      f"{p}mlp.gate.weight"}
        else:
            names |= {f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        if spec.attention_bias:
            names |= {f"{p}self_attn.{x}_proj.bias" for x in "qkv"}
        if spec.qk_norm:
            names |= {f"{p}self_attn.{x}_norm.weight" for x in "qk"}
    return names


@pytest.mark.parametrize("arch", ARCHS)
def test_text_weights_and_parameter_counts(checkpoint, arch):
    path = checkpoint(arch)
    full = full_model(path)
    text = load_text_weights(path)
    vision = load_vision_part(path)
    spec = text.spec

    assert set(text.tensors) == _expected_text_names(spec)
    assert spec.attention_bias == (arch == "qwen2_5_vl")
    assert spec.qk_norm == arch.startswith("qwen3")
    for name, t in text.tensors.items():
        ref = (
            full.lm_head.weight
            if name == "lm_head.weight"
            else full.model.language_model.get_parameter(name)
        )
        assert torch.equal(t, ref), name
    tied = text.tensors["lm_head.weight"] is text.tensors["embed_tokens.weight"]
    assert tied == spec.tie_word_embeddings == (arch == "qwen3_vl")
    assert spec.moe_layers == ((0,) if arch == "qwen3_vl_moe" else ())  # tiny: layer 1 dense

    # The language side holds no visual parameter, the encoder side no decoder layer.
    assert not any("visual" in n or "merger" in n or "blocks." in n for n in text.tensors)
    vision_names = [n for n, _ in vision.visual.named_parameters()]
    assert vision_names and not any(
        n.startswith("layers.") or "language_model" in n for n in vision_names
    )

    unique_text = {id(t): t.numel() for t in text.tensors.values()}
    n_text = sum(unique_text.values())
    n_vision = sum(p.numel() for p in vision.visual.parameters())
    n_embed = vision.embed_tokens.weight.numel()
    n_full = sum(p.numel() for p in full.parameters())
    assert n_vision == sum(p.numel() for p in full.model.visual.parameters())
    assert n_text + n_vision + n_embed == n_full + n_embed  # the embedding lives on both sides


@pytest.mark.parametrize("arch", ARCHS)
def test_each_side_reads_only_its_own_shard(checkpoint, tmp_path, arch):
    """Re-shard the checkpoint (vision / embedding / decoder), then delete the shard a side
    must not touch: its loader still works and gives the same result."""
    src = checkpoint(arch)
    spec = read_spec(src)
    tensors = all_tensors(src)
    embed = spec.text_prefix + "embed_tokens.weight"
    shards = {
        "vision.safetensors": {
            k: v for k, v in tensors.items() if k.startswith(spec.visual_prefix)
        },
        "embed.safetensors": {embed: tensors[embed]},
        "decoder.safetensors": {
            k: v for k, v in tensors.items() if not k.startswith(spec.visual_prefix) and k != embed
        },
    }
    pv, grid = pixels(src, [(64, 96)])
    ref_embeds, ref_deep = load_vision_part(src).encode_images(pv, grid)
    ref_text = load_text_weights(src).tensors

    enc_dir = copy_with(src, tmp_path / "enc", shards)
    (enc_dir / "decoder.safetensors").unlink()
    embeds, deep = load_vision_part(enc_dir).encode_images(pv, grid)
    assert torch.equal(embeds, ref_embeds)
    assert all(torch.equal(a, b) for a, b in zip(deep, ref_deep, strict=True))

    lang_dir = copy_with(src, tmp_path / "lang", shards)
    (lang_dir / "vision.safetensors").unlink()
    text = load_text_weights(lang_dir).tensors
    assert text.keys() == ref_text.keys()
    assert all(torch.equal(text[k], ref_text[k]) for k in text)


@pytest.mark.parametrize(
    ("arch", "text_prefix", "visual_prefix"),
    [
        ("qwen2_5_vl", "model.language_model.", "model.visual."),  # transformers 4.52-4.57 saves
        ("qwen3_vl", "model.", "visual."),  # the older top-level style
    ],
)
def test_other_weight_layouts(checkpoint, tmp_path, arch, text_prefix, visual_prefix):
    src = checkpoint(arch)
    spec = read_spec(src)

    def rename(k: str) -> str:
        if k.startswith(spec.visual_prefix):
            return visual_prefix + k[len(spec.visual_prefix) :]
        if k.startswith(spec.text_prefix):
            return text_prefix + k[len(spec.text_prefix) :]
        return k

    renamed = {rename(k): v for k, v in all_tensors(src).items()}
    dst = copy_with(src, tmp_path / "renamed", {"model.safetensors": renamed})
    other = read_spec(dst)
    assert (other.text_prefix, other.visual_prefix) == (text_prefix, visual_prefix)

    pv, grid = pixels(src, [(80, 50)])
    a, _ = load_vision_part(src).encode_images(pv, grid)
    b, _ = load_vision_part(dst).encode_images(pv, grid)
    assert torch.equal(a, b)
    ta, tb = load_text_weights(src).tensors, load_text_weights(dst).tensors
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_spec_fields(checkpoint):
    s25, s3 = read_spec(checkpoint("qwen2_5_vl")), read_spec(checkpoint("qwen3_vl"))
    assert (s25.num_deepstack, s25.embed_dim) == (0, s25.hidden_size)
    assert (s3.num_deepstack, s3.embed_dim) == (2, 3 * s3.hidden_size)
    assert (s25.patch_size, s3.patch_size, s25.spatial_merge_size) == (14, 16, 2)
    assert 2 * sum(s25.mrope_section) == s25.head_dim and 2 * sum(s3.mrope_section) == s3.head_dim
    assert s3.mrope_interleaved and not s25.mrope_interleaved
    assert s25.eos_token_ids == s3.eos_token_ids and len(s25.eos_token_ids) == 2
    assert (s25.text_prefix, s25.visual_prefix) == ("model.", "visual.")
    assert (s3.text_prefix, s3.visual_prefix) == ("model.language_model.", "model.visual.")


def test_resolve_model_path(checkpoint, tmp_path):
    src = checkpoint("qwen3_vl")
    assert resolve_model_path(src) == src.resolve()
    assert resolve_model_path(str(src)) == src.resolve()
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_model_path(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        resolve_model_path(str(tmp_path / "missing"))

    # A hub id served from a Hugging Face cache (the layout huggingface_hub writes).
    cache = tmp_path / "hf"
    repo = cache / "models--tandem-test--tiny-qwen3-vl"
    commit = "0" * 40
    shutil.copytree(src, repo / "snapshots" / commit, ignore=shutil.ignore_patterns(".complete"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    got = resolve_model_path("tandem-test/tiny-qwen3-vl", local_files_only=True, cache_dir=cache)
    assert got == repo / "snapshots" / commit
    assert load_text_weights(read_spec(got)).tensors.keys() == load_text_weights(src).tensors.keys()

    with pytest.raises(CheckpointError, match="not found in the local Hugging Face cache"):
        resolve_model_path("tandem-test/no-such-model", local_files_only=True, cache_dir=cache)


def test_read_spec_rejects_unsupported_checkpoints(checkpoint, tmp_path):
    src = checkpoint("qwen2_5_vl")
    dst = tmp_path / "llama"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model_type"] = "llama"
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="model_type 'llama' is not supported"):
        read_spec(dst)
    (dst / "model.safetensors").unlink()
    cfg["model_type"] = "qwen2_5_vl"
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        read_spec(dst)


def test_flat_hub_config_reads_the_same(checkpoint, tmp_path):
    """Released Qwen2.5-VL configs keep the text fields at the top level, with
    `rope_scaling: {type: mrope}` and `torch_dtype`; the spec and the vision part agree."""
    src = checkpoint("qwen2_5_vl")
    cfg = json.loads((src / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {k: v for k, v in text.items() if k not in ("model_type", "dtype")}
    flat.update(cfg, rope_theta=rope["rope_theta"], torch_dtype=cfg.pop("dtype"))
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    flat.pop("dtype", None)
    dst = tmp_path / "flat"
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(json.dumps(flat))

    a, b = read_spec(src), read_spec(dst)
    fields = [
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "mrope_section",
        "mrope_interleaved", "vocab_size", "tie_word_embeddings", "embed_dim", "image_token_id",
        "vision_start_token_id", "eos_token_ids", "torch_dtype", "patch_size", "spatial_merge_size",
    ]
    assert {f: getattr(b, f) for f in fields} == {f: getattr(a, f) for f in fields}
    pv, grid = pixels(src, [(60, 60)])
    ea, _ = load_vision_part(src).encode_images(pv, grid)
    eb, _ = load_vision_part(dst).encode_images(pv, grid)
    assert torch.equal(ea, eb)


def test_moe_experts_load_from_every_layout(checkpoint, tmp_path):
    """The same experts whether the file holds transformers' in-memory layout, the released
    checkpoints' transposed one, or one tensor per expert (older MoE checkpoints)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = checkpoint("qwen3_vl_moe")
    ref = load_text_weights(src).tensors
    raw = load_file(str(src / "model.safetensors"))
    p = "model.language_model.layers.0.mlp.experts."
    variants = {
        "transposed": {**raw, p + "gate_up_proj": raw[p + "gate_up_proj"].transpose(1, 2),
                       p + "down_proj": raw[p + "down_proj"].transpose(1, 2)},
        "per_expert": {k: v for k, v in raw.items() if not k.startswith(p)},
    }
    e, inter = 8, 24
    for k in range(e):
        gu, d = raw[p + "gate_up_proj"][k], raw[p + "down_proj"][k]
        variants["per_expert"][f"{p}{k}.gate_proj.weight"] = gu[:inter].clone()
        variants["per_expert"][f"{p}{k}.up_proj.weight"] = gu[inter:].clone()
        variants["per_expert"][f"{p}{k}.down_proj.weight"] = d.clone()
    for name, tensors in variants.items():
        out = tmp_path / name
        shutil.copytree(src, out)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        got = load_text_weights(out).tensors
        for key in ("layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj"):
            assert torch.equal(got[key], ref[key]), (name, key)
        assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_vl_moe"
