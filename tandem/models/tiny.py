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

Real sizes (REAL_SIZES) take a released model's text and vision shapes from its config.json,
vocabulary size included: `7b` Qwen2.5-VL-7B, `8b` Qwen3-VL-8B, `30b-a3b` Qwen3-VL-30B-A3B
(the size names the model, so it implies the arch). Their weights are random bfloat16,
streamed to safetensors shards tensor by tensor (`random_weights.py`: about one block in
memory, never the model), the config says dtype bfloat16, and the processor keeps the
released pixel limits. Ids past the tokenizer's 1024 entries decode to nothing (a random
model emits them; the released vocabularies have unused ids too). `dry_run` writes every
file but the shards (the index names them), for checking shapes without the ~16-62 GB.
"""

from __future__ import annotations

from pathlib import Path

from tandem.models import tokenizer as tk

ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
SIZES = ("tiny", "small")  # transformers' own init, written by save_pretrained (float32)
REAL_SIZES = {"7b": "qwen2_5_vl", "8b": "qwen3_vl", "30b-a3b": "qwen3_vl_moe"}  # size -> arch
ALL_SIZES = SIZES + tuple(REAL_SIZES)

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
}
_MROPE = {  # per arch and head_dim: sections of the rotary half-dim (t, h, w)
    ("qwen2_5_vl", 16): [2, 3, 3], ("qwen2_5_vl", 64): [8, 12, 12],
    ("qwen3_vl", 16): [4, 2, 2], ("qwen3_vl", 64): [12, 10, 10],
    ("qwen3_vl_moe", 16): [4, 2, 2], ("qwen3_vl_moe", 64): [12, 10, 10],
}
# Qwen3-VL-MoE's text decoder: experts, experts per token, expert width; every second
# layer sparse (decoder_sparse_step 2) and the last one dense (mlp_only_layers), so both
# kinds of MLP and both config rules are exercised.
_MOE = {
    "tiny": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                 decoder_sparse_step=1, mlp_only_layers=[1]),
    "small": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=320,
                  decoder_sparse_step=2, mlp_only_layers=[11]),
}
_VISION = {
    "tiny": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2),
    "small": dict(depth=6, hidden_size=384, intermediate_size=1024, num_heads=6),
}
# Which sizes tie lm_head to the embedding: both layouts occur in released models.
_TIED = {"qwen2_5_vl": False, "qwen3_vl": True, "qwen3_vl_moe": False}
_PIXELS = {"tiny": (4, 256), "small": (4, 1024)}  # min / max merged tokens per image

# The released models' shapes (their config.json); vision out_hidden_size = text hidden.
_REAL = {
    "7b": dict(  # Qwen/Qwen2.5-VL-7B-Instruct
        text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                  num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                  max_position_embeddings=128000, rms_norm_eps=1e-6),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                    fullatt_block_indexes=[7, 15, 23, 31]),
        mrope=[16, 24, 24], pixels=(4, 16384),
    ),
    "8b": dict(  # Qwen/Qwen3-VL-8B-Instruct
        text=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  vocab_size=151936, max_position_embeddings=262144, rms_norm_eps=1e-6),
        vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                    deepstack_visual_indexes=[8, 16, 24]),
        mrope=[24, 20, 20], pixels=(64, 16384),
    ),
    "30b-a3b": dict(  # Qwen/Qwen3-VL-30B-A3B-Instruct
        text=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                  num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  vocab_size=151936, max_position_embeddings=262144, rms_norm_eps=1e-6,
                  num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                  decoder_sparse_step=1, mlp_only_layers=[]),
        vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                    deepstack_visual_indexes=[8, 16, 24]),
        mrope=[24, 20, 20], pixels=(64, 16384),
    ),
}
REAL_DTYPE = "bfloat16"  # as released


def _init_std(size: str) -> float:
    # Wider than transformers' 0.02 so random models are not near-uniform: greedy outputs
    # vary from token to token and depend on the image (oracle tests compare them).
    return round(1.6 / _TEXT[size]["hidden_size"] ** 0.5, 4)


def resolve_arch(arch: str | None, size: str) -> str:
    """The arch a build makes: a real size's own (another one is refused), else `arch`
    (default qwen2_5_vl)."""
    if size not in ALL_SIZES:
        raise ValueError(f"size must be one of {ALL_SIZES}, got {size!r}")
    if size in REAL_SIZES:
        if arch is not None and arch != REAL_SIZES[size]:
            raise ValueError(f"size {size} is {REAL_SIZES[size]}'s shape, not {arch}'s")
        return REAL_SIZES[size]
    arch = arch or "qwen2_5_vl"
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    return arch


def make_config(arch: str, size: str):
    """The transformers config of a model of this arch and size (no weights)."""
    arch = resolve_arch(arch, size)
    ids_text = dict(bos_token_id=tk.ENDOFTEXT_ID, eos_token_id=tk.IM_END_ID)
    if size in REAL_SIZES:
        real = _REAL[size]
        text = dict(real["text"], **ids_text, tie_word_embeddings=False, initializer_range=0.02)
        vision = dict(real["vision"], out_hidden_size=text["hidden_size"], spatial_merge_size=2,
                      temporal_patch_size=2, initializer_range=0.02)
        mrope = real["mrope"]
    else:
        text = dict(_TEXT[size], vocab_size=tk.VOCAB_SIZE, max_position_embeddings=32768,
                    **ids_text, tie_word_embeddings=_TIED[arch],
                    initializer_range=_init_std(size))
        mrope = _MROPE[(arch, text["head_dim"])]
        vision = dict(_VISION[size], out_hidden_size=text["hidden_size"], spatial_merge_size=2,
                      temporal_patch_size=2, initializer_range=_init_std(size))
        depth = vision["depth"]
        if arch == "qwen2_5_vl":
            vision["fullatt_block_indexes"] = (
                [depth // 2 - 1, depth - 1] if depth > 2 else [depth - 1]
            )
        else:
            # NOTE: the tiny ViT MLP is 1.5x wider for Qwen3-VL (as it has been built so far)
            vision["intermediate_size"] = vision["intermediate_size"] * 3 // 2
            vision["deepstack_visual_indexes"] = (
                [0, 1] if depth == 2 else [depth // 3, 2 * depth // 3]
            )
            if arch == "qwen3_vl_moe":
                text.update(_MOE[size])
    ids = dict(
        image_token_id=tk.IMAGE_PAD_ID,
        video_token_id=tk.VIDEO_PAD_ID,
        vision_start_token_id=tk.VISION_START_ID,
        vision_end_token_id=tk.VISION_END_ID,
        tie_word_embeddings=text["tie_word_embeddings"],
    )
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        text.pop("head_dim", None)  # derived from hidden / heads in Qwen2
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": mrope,
        }
        vision.update(patch_size=14, window_size=112, tokens_per_second=2)
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    text["rope_parameters"] = {
        "rope_type": "default", "rope_theta": 5e6, "mrope_section": mrope, "mrope_interleaved": True,
    }
    vision.update(
        patch_size=16,
        hidden_act="gelu_pytorch_tanh",
        num_position_embeddings=2304,  # a 48 x 48 learned grid, interpolated per image
    )
    if arch == "qwen3_vl_moe":
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
    lo, hi = _REAL[size]["pixels"] if size in REAL_SIZES else _PIXELS[size]
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


def _generation_config():
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=tk.ENDOFTEXT_ID,
        eos_token_id=[tk.IM_END_ID, tk.ENDOFTEXT_ID],
        pad_token_id=tk.ENDOFTEXT_ID,
        do_sample=False,
    )


def plan_tiny_model(arch: str | None, size: str):
    """What a streamed build of (arch, size) writes: `random_weights.WeightPlan` (every
    tensor's name, shape and start value; the dtype; the shards). No weight is made."""
    import torch

    from tandem.models.random_weights import plan_weights

    arch = resolve_arch(arch, size)
    dtype = getattr(torch, REAL_DTYPE) if size in REAL_SIZES else torch.float32
    return plan_weights(make_config(arch, size), dtype)


def build_tiny_model(
    out_dir, arch: str | None = None, size: str = "tiny", seed: int = 0, *,
    stream: bool | None = None, dry_run: bool = False, device: str = "cpu",
) -> Path:
    """Write a complete random-weight checkpoint to `out_dir` (created) and return its path.

    `arch` None: the real size's own, else qwen2_5_vl. `stream` (default: real sizes only)
    writes the weights tensor by tensor (`random_weights.py`), generated on `device`;
    otherwise transformers builds the model and saves it (tiny and small: transformers' own
    initialisation, float32, CPU). `dry_run` writes every file but the weight shards (the
    index names them): the checkpoint's shapes without its size."""
    import torch

    arch = resolve_arch(arch, size)
    stream = size in REAL_SIZES if stream is None else stream
    if size in REAL_SIZES and not stream:
        raise ValueError(f"size {size} is only written streamed (it would not fit in memory twice)")
    if not stream and not dry_run and torch.device(device).type != "cpu":
        raise ValueError("device: only a streamed build generates its weights off the CPU")
    config = make_config(arch, size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if stream or dry_run:
        from tandem.models.random_weights import write_index, write_weights

        plan = plan_tiny_model(arch, size)
        for c in (config, config.text_config, config.vision_config):  # as save_pretrained
            c.dtype = str(plan.dtype).removeprefix("torch.")
        config.architectures = [plan.model_class]
        config.save_pretrained(out)
        _generation_config().save_pretrained(out)
        if dry_run:
            write_index(plan, out)
        else:
            write_weights(plan, out, seed=seed, device=device)
    else:
        from transformers import AutoModelForImageTextToText

        # NOTE: the weights depend only on (config, seed): a private generator state, float32,
        # CPU, and safetensors' fixed header (sorted names, metadata {"format": "pt"}).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        model.generation_config = _generation_config()
        model.save_pretrained(out)
    make_processor(arch, size).save_pretrained(out)
    write_video_processor_config(out)
    # NOTE: readable by all, as a downloaded checkpoint is: transformers writes the weights
    # owner-only (0600), which a pod running as another user cannot read from a volume
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o644)
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
            "temporal_patch_size")
    video = {k: img[k] for k in keep if k in img}
    video["video_processor_type"] = "Qwen2VLVideoProcessor"
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")


def ensure_tiny_model(out_dir, arch: str | None = None, size: str = "tiny",
                      seed: int = 0, device: str = "cpu") -> Path:
    """`out_dir` holding a complete tiny checkpoint, built on first use. Process-safe: built
    in a private temporary directory and renamed into place; `.complete` marks a whole one,
    and a process that loses the race drops its copy. `device`: where a streamed (real
    size) build generates its weights."""
    import os
    import shutil

    out = Path(out_dir)
    if (out / ".complete").exists():
        return out
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_model(tmp, arch=arch, size=size, seed=seed, device=device)
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
