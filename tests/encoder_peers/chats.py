"""Chat and image factories, and the transformers oracle for a chat's prompt payload."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch
from PIL import Image

from tandem.chat import ImageInput, Message, VideoInput


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
        "image_rows": ids[0] == model.config.image_token_id,
        "embeds": embeds[0],
        "deepstack": deep,
        "positions": pos[:, 0],
        "delta": int(delta.reshape(-1)[0]),
        "pixel_values": inputs.get("pixel_values"),
        "grid": grid,
    }


# How close the encoder's image features must be to transformers', by what computed them:
#   exact=True   the vision tower's linears are torch's (linear_backend "torch", or the packed
#                kernels unavailable): both sides run the same ops in the same order (one
#                thread, MKL_CBWR strict), so the payload is transformers' bits.
#   exact=False  our packed linears replace torch's (the CPU default): each product is
#                within its summation's error bound (tests/test_cpu_kernels.py), and those
#                differences pass through the tower's layers: the features must agree to
#                1e-4 relative, 1e-5 of their largest magnitude absolute. Whether they also
#                happen to be equal depends on the BLAS's internal summation order, which
#                differs between CPUs, so no test asserts it.
# Token ids, positions and the text rows (embedding lookups) are exact either way.
FEATURE_RTOL, FEATURE_ATOL_OF_MAX = 1e-4, 1e-5


def assert_payload_matches(payload, ref, num_deepstack: int | None, exact: bool) -> None:
    """The encoder's prompt payload against the oracle's (`oracle()`), under the rule above."""
    hidden = ref["embeds"].shape[1]
    assert torch.equal(payload.fill_ids.long(), ref["ids"])
    assert payload.input_embeds.dtype == torch.float32
    if num_deepstack is not None:
        assert payload.embed_dim == hidden * (1 + num_deepstack)
        assert len(ref["deepstack"]) in (0, num_deepstack)
    text = ~ref["image_rows"]
    for k, want in enumerate([ref["embeds"], *ref["deepstack"]]):
        got = payload.input_embeds[:, hidden * k : hidden * (k + 1)]
        if exact:
            assert torch.equal(got, want), f"column block {k} differs"
            continue
        assert torch.equal(got[text], want[text]), f"text rows of column block {k} differ"
        atol = FEATURE_ATOL_OF_MAX * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=FEATURE_RTOL, atol=atol)
    assert torch.equal(payload.mrope_positions.long(), ref["positions"])
    assert payload.mrope_delta == ref["delta"]


def to_proto(messages: list[Message]):
    """[Message] -> [tandem.v1.ChatMessage] (text, images, videos: file bytes, a URL or
    frames, with fps and num_frames)."""
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
            elif isinstance(p, VideoInput):
                o = p.options
                vid = common_pb2.VideoPart(fps=o.fps or 0.0, num_frames=o.num_frames or 0)
                if p.frames:
                    vid.frames.CopyFrom(common_pb2.VideoFrames(frames=[
                        common_pb2.VideoFrame(data=f.data) for f in p.frames]))
                elif p.data is not None:
                    vid.data = p.data
                else:
                    vid.url = p.url
                parts.append(common_pb2.ContentPart(video=vid))
            else:
                parts.append(common_pb2.ContentPart(text=p))
        out.append(common_pb2.ChatMessage(role=m.role, content=parts))
    return out
