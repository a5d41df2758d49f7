"""Chat and image factories, and the transformers oracle for a chat's prompt payload."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch
from PIL import Image

from tandem.chat import ImageInput, Message


def png(w: int, h: int, seed: int, fmt: str = "PNG") -> bytes:
    """A seeded random-noise image file of size w x h."""
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


SIZES = [(64, 48), (120, 90), (40, 150), (200, 130), (96, 96), (50, 70)]


def chat(n_images: int, seed: int = 0, text: str = "Describe") -> list[Message]:
    """A system + user chat with `n_images` images of different sizes between text parts."""
    parts: list = [f"{text} these, case {seed}:"]
    for k in range(n_images):
        w, h = SIZES[(seed + k) % len(SIZES)]
        parts.append(ImageInput(data=png(w, h, seed * 10 + k)))
        parts.append(f"and image {k}")
    return [Message("system", ("You are terse.",)), Message("user", tuple(parts))]


def hf_messages(messages: list[Message]) -> tuple[list[dict], list[Image.Image]]:
    out, images = [], []
    for m in messages:
        content = []
        for p in m.parts:
            if isinstance(p, ImageInput):
                data = p.data if p.data is not None else base64.b64decode(p.url.split(",", 1)[1])
                images.append(Image.open(io.BytesIO(data)).convert("RGB"))
                content.append({"type": "image"})
            else:
                content.append({"type": "text", "text": p})
        out.append({"role": m.role, "content": content})
    return out, images


@torch.inference_mode()
def oracle(model, processor, messages: list[Message]) -> dict:
    """What transformers computes for the chat: ids, spliced embeddings, deepstack, positions."""
    msgs, images = hf_messages(messages)
    text = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    ids = inputs["input_ids"]
    inner = model.model
    embeds = inner.get_input_embeddings()(ids)
    deep = []
    grid = inputs.get("image_grid_thw")
    if images:
        out = inner.get_image_features(inputs["pixel_values"], grid, return_dict=True)
        feats = torch.cat(out.pooler_output).to(embeds.dtype)
        mask = (ids == model.config.image_token_id)[..., None]
        embeds = embeds.masked_scatter(mask, feats)
        for f in getattr(out, "deepstack_features", None) or []:
            z = torch.zeros_like(embeds[0])
            z[mask[0, :, 0]] = torch.cat(f).to(z.dtype)
            deep.append(z)
    pos, delta = inner.get_rope_index(ids, inputs["mm_token_type_ids"], image_grid_thw=grid)
    return {
        "ids": ids[0],
        "embeds": embeds[0],
        "deepstack": deep,
        "positions": pos[:, 0],
        "delta": int(delta.reshape(-1)[0]),
        "pixel_values": inputs.get("pixel_values"),
        "grid": grid,
    }


def to_proto(messages: list[Message]):
    """[Message] -> [tandem.v1.ChatMessage]."""
    from tandem.v1 import common_pb2

    out = []
    for m in messages:
        parts = []
        for p in m.parts:
            if isinstance(p, ImageInput):
                img = common_pb2.ImagePart(min_pixels=p.min_pixels, max_pixels=p.max_pixels)
                if p.data is not None:
                    img.data = p.data
                else:
                    img.url = p.url
                parts.append(common_pb2.ContentPart(image=img))
            else:
                parts.append(common_pb2.ContentPart(text=p))
        out.append(common_pb2.ChatMessage(role=m.role, content=parts))
    return out
