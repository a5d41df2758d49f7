"""Chat -> token ids, patch pixels and grid sizes, as the model's processor computes them.

Runs in a worker thread (the server's pool), never on the event loop. Each image goes
through the processor's image processor on its own, so per-image min/max pixel overrides
apply (Qwen `smart_resize`). Each video is read and probed and its frames planned
(services/encoder/video.py: indices, size, grid, timing) but not decoded: that is
`decode`, a later job of the same pool, run only for the videos whose features no cache
holds (a video given as frames: services/encoder/video_frames.py, the same two steps).
The chat template is rendered with one placeholder per image and video, each
expanded as the processor expands it (an image's pads; a video's pads, and for Qwen3-VL
its frames' timestamps), and the text tokenized — the same steps `processor(text=...,
images=..., videos=...)` takes, checked against it in the tests.

Identities (cache keys): an image's is the sha256 of its processed patches and grid; a
video's is `VideoPlan.cache_key` (its file, sampled frames, size and normalization). Equal
keys mean bit-identical ViT input. A request in a cache namespace (the router's
cache_salt: its tenant and salt) has its media's keys taken in that namespace
(`in_namespace`), so equal keys also mean the same namespace: a cache hit, and the spans
the language side keys its prefix cache by, never cross tenants.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.chat import (
    ChatTemplate,
    ImageInput,
    Limits,
    Message,
    Placeholder,
    TemplateOptions,
    VideoInput,
    invalid,
)
from tandem.services.encoder.images import (
    Budget,
    ImageLimits,
    SourceRules,
    decode_image,
    image_bytes,
    source_bytes,
)
from tandem.services.encoder.video import (
    PlannedVideo,
    PreparedVideo,
    VideoLimits,
    decode,
    plan_source,
)
from tandem.services.encoder.video_frames import decode_frames, plan_frames_source
from tandem.services.encoder.video_rules import (
    VideoError,
    VideoRefusal,
    VideoSettings,
    VideoTokens,
    placeholder_text,
)

# transformers' smart_resize refuses an image whose sides' ratio is over this
MAX_ASPECT_RATIO = 200


@dataclass
class PreparedImage:
    """One image ready for the ViT."""

    hash: str  # sha256 hex of grid + processed patches
    pixel_values: torch.Tensor  # [num_patches, C * T * P * P] float32
    grid: tuple[int, int, int]  # (t, h, w) in patches
    num_tokens: int  # tokens after the spatial merge: t * h * w / merge**2
    field: str

    @property
    def key(self) -> str:
        """The embedding cache key: the content hash."""
        return self.hash

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


@dataclass
class Prepared:
    """A preprocessed chat: `media` are its images (ready for the ViT) and videos (planned,
    not decoded), in prompt order."""

    input_ids: torch.Tensor  # [L] int64
    mm_token_type_ids: torch.Tensor  # [L] int32 (0 text, 1 image, 2 video)
    media: list[PreparedImage | PlannedVideo] = field(default_factory=list)
    preprocess_s: float = 0.0
    fetch_s: float = 0.0  # of which getting the media's bytes (URLs fetched, data decoded)

    @property
    def images(self) -> list[PreparedImage]:
        return [m for m in self.media if isinstance(m, PreparedImage)]

    @property
    def videos(self) -> list[PlannedVideo]:
        return [m for m in self.media if isinstance(m, PlannedVideo)]


@dataclass(frozen=True)
class PreprocessLimits:
    min_pixels: int
    max_pixels: int
    max_images: int
    max_prompt_tokens: int
    image: ImageLimits
    max_videos: int = 0
    video: VideoLimits = field(default_factory=VideoLimits)


def in_namespace(medium, cache_salt: str) -> None:
    """Take `medium`'s cache key (an image's hash, a video's plan key) in namespace
    `cache_salt` (non-empty), in place, before anything looks it up or announces it."""
    def key(k: str) -> str:
        return hashlib.sha256(f"namespace|{cache_salt}|{k}".encode()).hexdigest()

    if isinstance(medium, PreparedImage):
        medium.hash = key(medium.hash)
    else:  # a planned video: its decoded form takes the plan, key included
        medium.plan = dataclasses.replace(medium.plan, cache_key=key(medium.plan.cache_key))


class Preprocessor:
    """Turns a chat into `Prepared` with the checkpoint's processor. Thread-safe.

    `video`: the checkpoint's video processor settings (None: the model takes no video)."""

    def __init__(self, processor, limits: PreprocessLimits,
                 chat_template: str | None = None, video: VideoSettings | None = None) -> None:
        self.processor = processor
        self.limits = limits
        self.template = ChatTemplate(processor, chat_template)
        self.merge = int(processor.image_processor.merge_size)
        self.video = video
        self.video_tokens = VideoTokens(
            processor.video_token,
            getattr(processor, "vision_start_token", "<|vision_start|>"),
            getattr(processor, "vision_end_token", "<|vision_end|>"),
        )

    def __call__(self, messages: list[Message], req: Limits | None = None,
                 tools: list[dict] | None = None, budget: Budget | None = None,
                 options: TemplateOptions | None = None) -> Prepared:
        """`budget`: the request's deadline and stop flag, checked before each image and
        video and before tokenizing (TimeoutError once it has ended); `options`: how the
        chat template renders the chat."""
        t0 = time.perf_counter()
        req = req or Limits()
        budget = budget or Budget()
        lim = self.limits
        max_images = min(lim.max_images, req.max_images or lim.max_images)
        max_prompt_tokens = min(lim.max_prompt_tokens,
                                req.max_prompt_tokens or lim.max_prompt_tokens)
        hf_messages, parts = self.template.split(messages)
        n_images = sum(isinstance(p, ImageInput) for _, p in parts)
        if n_images > max_images:
            raise invalid("messages", f"the chat has {n_images} images, over the limit of "
                          f"{max_images}")
        if len(parts) - n_images > lim.max_videos:
            raise invalid("messages", f"the chat has {len(parts) - n_images} videos, over the "
                          f"limit of {lim.max_videos} (the encoder's max_videos_per_request)")
        fetch = _Stopwatch()
        media = [self._image(where, p, budget, fetch) if isinstance(p, ImageInput)
                 else self._video(where, p, budget, fetch) for where, p in parts]  # fmt: skip
        budget.check()
        ids = self.template.token_ids(
            messages, hf_messages, [self._placeholder(m) for m in media], max_prompt_tokens,
            tools, options,
        )
        types = self.processor.create_mm_token_type_ids([ids])[0]
        return Prepared(
            input_ids=torch.tensor(ids, dtype=torch.long),
            mm_token_type_ids=torch.tensor(np.asarray(types), dtype=torch.int32),
            media=media,
            preprocess_s=time.perf_counter() - t0,
            fetch_s=fetch.seconds,
        )

    def decode(self, video: PlannedVideo, budget: Budget | None = None) -> PreparedVideo:
        """A planned video's frames, decoded and patchified (a pool job of its own)."""
        if video.frames:
            return decode_frames(video, self.limits.video, self.limits.image, budget)
        return decode(video, self.limits.video, budget)

    def _placeholder(self, m: PreparedImage | PlannedVideo) -> Placeholder:
        if isinstance(m, PreparedImage):
            return self.template.image_placeholder(m.num_tokens)
        return Placeholder(self.video_tokens.pad,
                           placeholder_text(m.plan, m.settings, self.video_tokens))

    def _image(self, where: str, part: ImageInput, budget: Budget,
               fetch: _Stopwatch) -> PreparedImage:
        lim = self.limits
        budget.check()
        with fetch:
            raw = image_bytes(part, where, lim.image, budget)
        pil = decode_image(raw, where, lim.image)
        w, h = pil.size
        if max(w, h) / min(w, h) > MAX_ASPECT_RATIO:  # NOTE: transformers' ValueError, as a 400
            raise invalid(where, f"image is {w}x{h}: its aspect ratio is over "
                          f"{MAX_ASPECT_RATIO}, which the model's processor refuses")
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

    def _video(self, where: str, part: VideoInput, budget: Budget,
               fetch: _Stopwatch) -> PlannedVideo:
        lim = self.limits
        budget.check()
        if self.video is None:
            raise invalid(where, "this model takes no video")
        if part.frames:  # NOTE: refusals name the wire's field, `...video.frames[k]`
            return plan_frames_source(part.frames, self.video, part.options, lim.video,
                                      lim.image, f"{where}.frames", budget)  # fmt: skip
        rules = SourceRules("video", lim.video.max_video_bytes, "video/", _video_oversize)
        with fetch:
            raw = source_bytes(part.data, part.url, where, lim.image, rules, budget)
        return plan_source(raw, self.video, part.options, lim.video, where)


class _Stopwatch:
    """Seconds spent inside its `with` blocks, summed (the time a chat's media took to
    fetch, for its trace)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.seconds += time.perf_counter() - self._t0


def _video_oversize(where: str, message: str) -> VideoError:
    return VideoError(where, VideoRefusal.BYTES, f"{message} (max_video_bytes)")
