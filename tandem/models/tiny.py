"""`build_tiny_model`: random-weight Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE checkpoints for
tests and benchmarks.

The checkpoint is a complete Hugging Face directory, written by transformers itself:

    config.json               Qwen2_5_VLConfig / Qwen3VLConfig
    generation_config.json    eos = [<|im_end|>, <|endoftext|>], greedy by default
    model.safetensors         float32; same (arch, size, seed) => byte-identical file
    tokenizer.json, tokenizer_config.json, chat_template.jinja
                              byte-level BPE trained offline (tandem.models.tokenizer)
    processor_config.json     Qwen2VLImageProcessor settings (min/max pixels, patch, merge)

Sizes: `tiny` is a few hundred thousand parameters (unit tests); `small` is about 50M
(benchmarks). The vision geometry is the real one (Qwen2.5-VL: patch 14, merge 2; Qwen3-VL:
patch 16, merge 2), so `smart_resize` and token counts behave as in the released models.
mrope_section sums to head_dim / 2, as the rotary embedding requires.
"""

from __future__ import annotations

from pathlib import Path

from tandem.models import tokenizer as tk

ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
SIZES = ("tiny", "small")

_TEXT = {
    # hidden, intermediate, layers, heads, kv heads, head_dim
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    ),
    "small": dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64,
    ),
}  # fmt: skip
_MROPE = {  # per arch and head_dim: sections of the rotary half-dim (t, h, w)
    ("qwen2_5_vl", 16): [2, 3, 3], ("qwen2_5_vl", 64): [8, 12, 12],
    ("qwen3_vl", 16): [4, 2, 2], ("qwen3_vl", 64): [12, 10, 10],
    ("qwen3_vl_moe", 16): [4, 2, 2], ("qwen3_vl_moe", 64): [12, 10, 10],
}  # fmt: skip
# Qwen3-VL-MoE's text decoder: experts, experts per token, expert width; every second
# layer sparse (decoder_sparse_step 2) and the last one dense (mlp_only_layers), so both
# kinds of MLP and both config rules are exercised.
_MOE = {
    "tiny": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                 decoder_sparse_step=1, mlp_only_layers=[1]),
    "small": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=320,
                  decoder_sparse_step=2, mlp_only_layers=[11]),
}  # fmt: skip
_VISION = {
    "tiny": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2),
    "small": dict(depth=6, hidden_size=384, intermediate_size=1024, num_heads=6),
}
# Which sizes tie lm_head to the embedding: both layouts occur in released models.
_TIED = {"qwen2_5_vl": False, "qwen3_vl": True, "qwen3_vl_moe": False}
_PIXELS = {"tiny": (4, 256), "small": (4, 1024)}  # min / max merged tokens per image


def _init_std(size: str) -> float:
    # Wider than transformers' 0.02 so random models are not near-uniform: greedy outputs
    # vary from token to token and depend on the image (oracle tests compare them).
    return round(1.6 / _TEXT[size]["hidden_size"] ** 0.5, 4)


def make_config(arch: str, size: str):
    """The transformers config of a tiny/small model (no weights)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    text = dict(_TEXT[size], vocab_size=tk.VOCAB_SIZE, max_position_embeddings=32768,
                bos_token_id=tk.ENDOFTEXT_ID, eos_token_id=tk.IM_END_ID,
                tie_word_embeddings=_TIED[arch], initializer_range=_init_std(size))  # fmt: skip
    mrope = _MROPE[(arch, text["head_dim"])]
    vision = dict(_VISION[size], out_hidden_size=text["hidden_size"], spatial_merge_size=2,
                  temporal_patch_size=2, initializer_range=_init_std(size))  # fmt: skip
    ids = dict(
        image_token_id=tk.IMAGE_PAD_ID,
        video_token_id=tk.VIDEO_PAD_ID,
        vision_start_token_id=tk.VISION_START_ID,
        vision_end_token_id=tk.VISION_END_ID,
        tie_word_embeddings=_TIED[arch],
    )
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        del text["head_dim"]  # derived from hidden / heads in Qwen2
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": mrope,
        }
        depth = vision["depth"]
        vision.update(patch_size=14, window_size=112, tokens_per_second=2,
                      fullatt_block_indexes=[depth // 2 - 1, depth - 1] if depth > 2 else [depth - 1])  # fmt: skip
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    text["rope_parameters"] = {
        "rope_type": "default", "rope_theta": 5e6, "mrope_section": mrope, "mrope_interleaved": True,
    }  # fmt: skip
    depth = vision["depth"]
    vision.update(
        patch_size=16,
        hidden_act="gelu_pytorch_tanh",
        intermediate_size=vision["intermediate_size"] * 3 // 2,
        num_position_embeddings=2304,  # a 48 x 48 learned grid, interpolated per image
        deepstack_visual_indexes=[0, 1] if depth == 2 else [depth // 3, 2 * depth // 3],
    )
    if arch == "qwen3_vl_moe":
        text.update(_MOE[size])
        return Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids)
    return Qwen3VLConfig(text_config=text, vision_config=vision, **ids)


def make_processor(arch: str, size: str):
    """Tokenizer + image processor + chat template, as one (image-only) processor."""
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tandem.models.processor import ImageOnlyQwen2_5_VLProcessor, ImageOnlyQwen3VLProcessor

    vocab, merges = tk.vocab_and_merges(tk.train_tokenizer())
    # Specials sit right after the BPE entries, in Qwen's order, whatever order transformers
    # adds them in (added tokens already in the vocabulary keep their ids).
    vocab.update(tk.TOKEN_IDS)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=32768,
        extra_special_tokens=[t for t in tk.SPECIAL_TOKENS[1:] if tk.is_special(t)],
    )
    from tokenizers import AddedToken

    tokenizer.add_tokens(
        [AddedToken(t, special=False) for t in tk.SPECIAL_TOKENS if not tk.is_special(t)]
    )
    got = tokenizer.convert_tokens_to_ids(tk.SPECIAL_TOKENS)
    if got != [tk.TOKEN_IDS[t] for t in tk.SPECIAL_TOKENS]:
        raise RuntimeError(f"special token ids {got} do not follow the BPE vocabulary")

    patch = 14 if arch == "qwen2_5_vl" else 16
    factor = patch * 2
    lo, hi = _PIXELS[size]
    if arch == "qwen2_5_vl":
        mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    else:
        mean, std = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=lo * factor * factor,
        max_pixels=hi * factor * factor,
        patch_size=patch,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=mean,
        image_std=std,
    )
    if arch == "qwen2_5_vl":
        return ImageOnlyQwen2_5_VLProcessor(
            image_processor, tokenizer, chat_template=tk.CHAT_TEMPLATE_QWEN2_5
        )
    return ImageOnlyQwen3VLProcessor(
        image_processor, tokenizer, chat_template=tk.CHAT_TEMPLATE_QWEN3
    )


def build_tiny_model(out_dir, arch: str = "qwen2_5_vl", size: str = "tiny", seed: int = 0) -> Path:
    """Write a complete random-weight checkpoint to `out_dir` (created) and return its path."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    config = make_config(arch, size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    # NOTE: the weights depend only on (config, seed): a private generator state, float32,
    # CPU, and safetensors' fixed header (sorted names, metadata {"format": "pt"}).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tk.ENDOFTEXT_ID,
        eos_token_id=[tk.IM_END_ID, tk.ENDOFTEXT_ID],
        pad_token_id=tk.ENDOFTEXT_ID,
        do_sample=False,
    )
    model.save_pretrained(out)
    make_processor(arch, size).save_pretrained(out)
    write_video_processor_config(out)
    return out


def write_video_processor_config(ckpt: Path) -> None:
    """`video_preprocessor_config.json` beside the processor files, so stock transformers
    (which builds a video processor wherever torchvision is installed) loads the checkpoint
    too. Our image-only processor never reads it. The video processor's patching must match
    the image processor's, so the image settings are copied over."""
    import json

    cfg = json.loads((ckpt / "processor_config.json").read_text())
    if (ckpt / "video_preprocessor_config.json").exists() or "video_processor" in cfg:
        return
    img = cfg["image_processor"]
    keep = ("do_convert_rgb", "do_normalize", "do_rescale", "do_resize", "image_mean",
            "image_std", "merge_size", "patch_size", "resample", "rescale_factor", "size",
            "temporal_patch_size")  # fmt: skip
    video = {k: img[k] for k in keep if k in img}
    video["video_processor_type"] = "Qwen2VLVideoProcessor"
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")


def ensure_tiny_model(out_dir, arch: str = "qwen2_5_vl", size: str = "tiny", seed: int = 0) -> Path:
    """`out_dir` holding a complete tiny checkpoint, built on first use. Process-safe: built
    in a private temporary directory and renamed into place; `.complete` marks a whole one,
    and a process that loses the race drops its copy."""
    import os
    import shutil

    out = Path(out_dir)
    if (out / ".complete").exists():
        return out
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_model(tmp, arch=arch, size=size, seed=seed)
    (tmp / ".complete").touch()
    try:
        tmp.rename(out)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _builder_digest() -> str:
    """Hash of the checkpoint builder's sources (tandem/models): a change rebuilds."""
    import hashlib

    h = hashlib.sha256()
    for p in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def cached_tiny_model(cache_dir, arch: str, size: str = "tiny", seed: int = 0) -> Path:
    """A tiny checkpoint under `cache_dir`, keyed by the builder's sources and built on first
    use (process-safe); older builds of the same arch/size/seed are dropped. The tests'
    `checkpoint` fixture and the benchmarks share it. NOTE: no process-wide side effects
    (the test suite's thread settings live in tests/conftest.py, not here), so a benchmark
    that builds its model this way still runs its servers with their own defaults."""
    import shutil

    cache = Path(cache_dir)
    out = cache / f"{arch}-{size}-s{seed}-{_builder_digest()}"
    if (out / ".complete").exists():
        return out
    for stale in cache.glob(f"{arch}-{size}-s{seed}-*"):
        if stale != out and (stale / ".complete").exists():
            shutil.rmtree(stale, ignore_errors=True)
    return ensure_tiny_model(out, arch=arch, size=size, seed=seed)
