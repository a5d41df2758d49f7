"""transformers as the oracle for the language tier's runner tests.

From a `tandem tiny-model` checkpoint: the HF model, a chat prompt with images run through
the real processor, the prompt payload exactly as the encoder would produce it (text
embeddings with image features spliced in; deepstack features in extra columns for
Qwen3-VL; `get_rope_index` positions and delta), and the decoder weights through the split
loader the language service uses.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import torch

import tandem  # noqa: F401  (registers the image-only processors with AutoProcessor)
from tandem.transfer.payload import PromptPayload
from tandem.units import ceil_div

# The device the exactness tests run our runner on (the oracle always runs on the CPU):
# `pytest --device cuda` sets it (tests/conftest.py), `make gpu-check` runs the suite so.
DEVICE_ENV = "TANDEM_TEST_DEVICE"


def test_device() -> torch.device:
    """The runner's device in the exactness tests: $TANDEM_TEST_DEVICE, default cpu; a
    CUDA device that is not there is an error, never a silent CPU run."""
    name = os.environ.get(DEVICE_ENV, "cpu").strip() or "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"{DEVICE_ENV}={name!r} is not a torch device") from e
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV} must name cpu or cuda[:N], got {name!r}")
    if device.type == "cuda" and (
        not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()
    ):
        raise ValueError(f"{DEVICE_ENV}={name!r}: no such CUDA device here")
    return device


test_device.__test__ = False  # a helper, not a test (pytest collects test_* names)


def page_size(device: torch.device | str) -> int:
    """The KV page size of the runner tests on `device`: 4 on the CPU (chunk and prompt
    boundaries fall mid-page; its attention takes any size), 16 on CUDA, the least flex
    takes (it tiles a page by a power of two >= 16: `select_attention` refuses less; the
    first `make gpu-check` on an H200 failed every exactness case on page 4)."""
    return 4 if torch.device(device).type == "cpu" else 16


# On CUDA a test's KV cache has at least this many pages (2,048 tokens of 16). Flex
# attention is compiled per cache geometry, its page count included (`_compiled_flex` in
# services/language/model/attention.py; a server has one cache, so one geometry), and a
# compile costs seconds there: with a page count per test size the exactness suites paid
# a compile per test on a 15-minute lease, with one per model they pay one per model.
CUDA_MIN_PAGES = 128


def kv_pages(tokens: int, device: torch.device | str, page: int | None = None) -> int:
    """Pages of `page` tokens (default `page_size(device)`) that hold `tokens` tokens: a
    test sizes its KV cache in tokens. On the CPU that many; on CUDA at least
    CUDA_MIN_PAGES (above): a test whose point is a small pool makes it on the CPU."""
    need = ceil_div(tokens, page or page_size(device))
    return need if torch.device(device).type == "cpu" else max(need, CUDA_MIN_PAGES)


@lru_cache(maxsize=4)
def load(path: Path, dtype: torch.dtype = torch.float32):
    """(model, processor) in `dtype` (float32 unless a test says otherwise), eval mode."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tandem.models.processor import register

    register()  # NOTE: idempotent; covers a checkpoint built earlier in this process
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
    return model, AutoProcessor.from_pretrained(path)


def num_deepstack(model) -> int:
    return len(getattr(model.config.vision_config, "deepstack_visual_indexes", None) or ())


def text_weights(path: Path, dtype: torch.dtype = torch.float32):
    """The language tier's view of the checkpoint: `load_text_weights` (normalized names)."""
    from tandem.models.split import load_text_weights

    return load_text_weights(path, dtype=dtype)


def make_image(seed: int, size: tuple[int, int]):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(arr.numpy())


def make_inputs(processor, text: str, images: list) -> dict:
    """Processor outputs for one user turn with `images` (then `text`)."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(processor(text=[prompt], images=images or None, return_tensors="pt"))


@torch.inference_mode()
def payload(model, inputs: dict) -> PromptPayload:
    """What the encoder sends for these inputs (in the model's dtype, as an encoder running
    in that dtype would)."""
    ids = inputs["input_ids"]
    embeds = model.get_input_embeddings()(ids)[0]  # [L, hidden]
    hidden = embeds.shape[-1]
    nd = num_deepstack(model)
    extra = torch.zeros(embeds.shape[0], hidden * nd, dtype=embeds.dtype)
    if "pixel_values" in inputs:
        out = model.model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True
        )
        mask = ids[0] == model.config.image_token_id
        embeds = embeds.clone()
        embeds[mask] = torch.cat(out.pooler_output, dim=0).to(embeds.dtype)
        for k in range(nd):
            extra[mask, k * hidden : (k + 1) * hidden] = torch.cat(out.deepstack_features[k], dim=0)
    pos, delta = model.model.get_rope_index(
        ids,
        mm_token_type_ids=inputs.get("mm_token_type_ids", torch.zeros_like(ids)),
        image_grid_thw=inputs.get("image_grid_thw"),
    )
    return PromptPayload(
        input_embeds=torch.cat([embeds, extra], dim=1),
        fill_ids=ids[0].to(torch.int32),
        mrope_positions=pos[:, 0].to(torch.int32),
        mrope_delta=int(delta.reshape(-1)[0]),
    )


@torch.inference_mode()
def prompt_logits(model, inputs: dict) -> torch.Tensor:
    """transformers' logits [L, vocab] for the whole prompt (float32)."""
    return model(**inputs).logits[0].float()


@torch.inference_mode()
def generate(model, inputs: dict, max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy `generate()`: the new tokens and the raw logits [n, vocab] of every step."""
    out = model.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False,
        output_logits=True, return_dict_in_generate=True,
    )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens, torch.cat([step[0:1] for step in out.logits]).float()


def make_chat_inputs(processor, messages: list[dict], images: list) -> dict:
    """Processor outputs for a whole chat (HF message dicts, `{"type": "image"}` parts in
    the order of `images`), with the generation prompt."""
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(processor(text=[prompt], images=images or None, return_tensors="pt"))


def prompt_info(model, inputs: dict, image_keys: list[str]):
    """The announce the encoder would send: token ids and each image's pad run, named by
    `image_keys` (the test's stand-in for the content hash)."""
    from tandem.transfer.payload import ImageSpan, PromptInfo

    ids = inputs["input_ids"][0]
    pads = (ids == model.config.image_token_id).nonzero().flatten().tolist()
    runs: list[list[int]] = []
    for p in pads:
        if runs and p == runs[-1][-1] + 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    assert len(runs) == len(image_keys), "adjacent images: pass their spans by hand"
    spans = [ImageSpan(r[0], len(r), k) for r, k in zip(runs, image_keys, strict=True)]
    return PromptInfo(ids.tolist(), spans)
