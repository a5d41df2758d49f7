"""Chat -> token ids, patch pixels and grid sizes, as the model's processor computes them.

Runs in a worker thread (the server's pool), never on the event loop. Each image goes
through the processor's image processor on its own, so per-image min/max pixel overrides
apply (Qwen `smart_resize`); the chat template is rendered with one image placeholder per
image, each placeholder expanded to the image's token count, and the text tokenized — the
same steps `processor(text=..., images=...)` takes, checked against it in the tests.

An image's identity (its cache key) is the sha256 of its processed patches and grid: equal
keys mean bit-identical ViT input.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.chat import ChatTemplate, ImageInput, Limits, Message, TemplateOptions, invalid
from tandem.services.encoder.images import Budget, ImageLimits, decode_image, image_bytes


@dataclass
class PreparedImage:
    """One image ready for the ViT."""

    hash: str  # sha256 hex of grid + processed patches
    pixel_values: torch.Tensor  # [num_patches, C * T * P * P] float32
    grid: tuple[int, int, int]  # (t, h, w) in patches
    num_tokens: int  # tokens after the spatial merge: t * h * w / merge**2
    field: str

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


@dataclass
class Prepared:
    """A preprocessed chat."""

    input_ids: torch.Tensor  # [L] int64
    mm_token_type_ids: torch.Tensor  # [L] int32 (0 text, 1 image)
    images: list[PreparedImage] = field(default_factory=list)
    preprocess_s: float = 0.0


@dataclass(frozen=True)
class PreprocessLimits:
    min_pixels: int
    max_pixels: int
    max_images: int
    max_prompt_tokens: int
    image: ImageLimits


class Preprocessor:
    """Turns a chat into `Prepared` with the checkpoint's processor. Thread-safe."""

    def __init__(self, processor, limits: PreprocessLimits,
                 chat_template: str | None = None) -> None:
        self.processor = processor
        self.limits = limits
        self.template = ChatTemplate(processor, chat_template)
        self.merge = int(processor.image_processor.merge_size)

    def __call__(self, messages: list[Message], req: Limits | None = None,
                 tools: list[dict] | None = None, budget: Budget | None = None,
                 options: TemplateOptions | None = None) -> Prepared:
        """`budget`: the request's deadline and stop flag, checked before each image and
        before tokenizing (TimeoutError once it has ended); `options`: how the chat
        template renders the chat."""
        t0 = time.perf_counter()
        req = req or Limits()
        budget = budget or Budget()
        lim = self.limits
        max_images = min(lim.max_images, req.max_images or lim.max_images)
        max_prompt_tokens = min(lim.max_prompt_tokens,
                                req.max_prompt_tokens or lim.max_prompt_tokens)
        hf_messages, image_parts = self.template.split(messages)
        if len(image_parts) > max_images:
            raise invalid(
                "messages",
                f"the chat has {len(image_parts)} images, over the limit of {max_images}",
            )
        images = [self._image(where, p, budget) for where, p in image_parts]
        budget.check()
        ids = self.template.token_ids(
            messages, hf_messages, [im.num_tokens for im in images], max_prompt_tokens, tools,
            options,
        )
        types = self.processor.create_mm_token_type_ids([ids])[0]
        return Prepared(
            input_ids=torch.tensor(ids, dtype=torch.long),
            mm_token_type_ids=torch.tensor(np.asarray(types), dtype=torch.int32),
            images=images,
            preprocess_s=time.perf_counter() - t0,
        )

    def _image(self, where: str, part: ImageInput, budget: Budget) -> PreparedImage:
        lim = self.limits
        budget.check()
        raw = image_bytes(part, where, lim.image, budget)
        pil = decode_image(raw, where, lim.image)
        # Overrides are clamped into the server's bounds: a client may tighten, never loosen.
        lo = min(max(part.min_pixels or lim.min_pixels, lim.min_pixels), lim.max_pixels)
        hi = max(min(part.max_pixels or lim.max_pixels, lim.max_pixels), lo)
        out = self.processor.image_processor(
            images=[pil], size={"shortest_edge": lo, "longest_edge": hi}, return_tensors="pt"
        )
        pixels = out["pixel_values"].to(torch.float32).contiguous()
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        h = hashlib.sha256()
        h.update(np.asarray(grid, dtype=np.int64).tobytes())
        h.update(pixels.numpy().tobytes())
        return PreparedImage(
            hash=h.hexdigest(),
            pixel_values=pixels,
            grid=grid,  # type: ignore[arg-type]
            num_tokens=grid[0] * grid[1] * grid[2] // (self.merge * self.merge),
            field=where,
        )
