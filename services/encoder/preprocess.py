"""Chat -> token ids, patch pixels and grid sizes, as the model's processor computes them.

Runs in a worker thread (the server's pool), never on the event loop. Each image goes
through the processor's image processor on its own, so per-image min/max pixel overrides
apply (Qwen `smart_resize`); a helper of a split prompt prepares only its share's images
(`pixels_for`), the others grid-only: their grids as the lead sends them (`other_grids`,
checked against this encoder's bounds; the images never fetched), or from their sizes by
the processor's own `smart_resize` (ImageGeometry), nothing resized, patchified or
hashed. Each video is read and probed and its frames planned (services/encoder/media/video.py:
indices, size, grid, timing) but not decoded: that is `decode`, a later job of the same
pool, run only for the videos whose features no cache holds (a video given as frames:
services/encoder/media/video_frames.py, the same two steps).
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
import inspect
import math
import time
from collections.abc import Callable, Container, Sequence
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
from tandem.services.encoder.media.images import (
    Budget,
    ImageLimits,
    SourceRules,
    decode_image,
    fetched_url,
    image_bytes,
    open_image,
    source_bytes,
)
from tandem.services.encoder.media.video import (
    PlannedVideo,
    PreparedVideo,
    VideoLimits,
    decode,
    plan_source,
)
from tandem.services.encoder.media.video_frames import decode_frames, plan_frames_source
from tandem.services.encoder.media.video_rules import (
    VideoError,
    VideoRefusal,
    VideoSettings,
    VideoTokens,
    placeholder_text,
)

# transformers' smart_resize refuses an image whose sides' ratio is over this
MAX_ASPECT_RATIO = 200


class GridOnly(RuntimeError):
    """The pixels or cache key of an image prepared grid-only were asked for: a bug (an
    encoder's lookups and ViT work hold only the images it prepared)."""


@dataclass
class PreparedImage:
    """One image of a chat: its grid and pad tokens always (they lay the prompt out), its
    ViT input and cache key only when `prepared`. An encoder prepares the images it may run:
    a helper of a split prompt only its share's (Preprocessor's `pixels_for`); the others
    are grid-only (their pixels never resized, normalised, patchified or hashed), and asking
    for their `pixel_values`, `hash` or `key` raises GridOnly."""

    grid: tuple[int, int, int]  # (t, h, w) in patches
    num_tokens: int  # tokens after the spatial merge: t * h * w / merge**2
    field: str
    pixels: torch.Tensor | None = None  # [num_patches, C * T * P * P] float32; None: grid-only
    digest: str | None = None  # sha256 hex of grid + processed patches (in_namespace: of
    # that too); None: grid-only
    # the bytes an http(s) URL answered, kept when asked (`keep_fetched`): a split's lead
    # hands them to the helper whose share holds the image, which then fetches nothing
    fetched: bytes | None = None

    @property
    def prepared(self) -> bool:
        return self.pixels is not None

    @property
    def pixel_values(self) -> torch.Tensor:
        if self.pixels is None:
            raise GridOnly(f"{self.field}: prepared grid-only, it has no pixels here")
        return self.pixels

    @property
    def hash(self) -> str:
        if self.digest is None:
            raise GridOnly(f"{self.field}: prepared grid-only, it has no cache key here")
        return self.digest

    @property
    def key(self) -> str:
        """The embedding cache key: the content hash."""
        return self.hash

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


@dataclass
class Prepared:
    """A preprocessed chat: `media` are its images (ready for the ViT, or grid-only: those
    not in `pixels_for`) and videos (planned, not decoded), in prompt order."""

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


@dataclass(frozen=True)
class ImageGeometry:
    """How the checkpoint's image processor sizes an image, read off the processor: its
    module's `smart_resize` (Qwen's: sides rounded to multiples of patch * merge, the pixel
    count brought into [min_pixels, max_pixels]), patch and merge sizes, whether it resizes.
    `grid` is the grid the processor's call gives, from the image's size alone (checked
    against the processor: tests/test_helper_preprocess.py)."""

    smart_resize: Callable[..., tuple[int, int]]
    patch: int
    merge: int
    resize: bool

    @classmethod
    def of(cls, image_processor) -> ImageGeometry:
        module = inspect.getmodule(type(image_processor))
        rule = getattr(module, "smart_resize", None)
        if rule is None:
            raise ValueError(f"{type(image_processor).__name__}'s module has no smart_resize: "
                             f"not a Qwen image processor, its grids cannot be computed")
        return cls(rule, int(image_processor.patch_size), int(image_processor.merge_size),
                   bool(image_processor.do_resize))

    def grid(self, height: int, width: int, min_pixels: int,
             max_pixels: int) -> tuple[int, int, int]:
        if self.resize:
            height, width = self.smart_resize(height, width, factor=self.patch * self.merge,
                                              min_pixels=min_pixels, max_pixels=max_pixels)
        # NOTE: t is 1 whatever temporal_patch_size: a still image is one frame repeated to
        # fill one temporal patch (transformers' grid is [1, h, w])
        return (1, height // self.patch, width // self.patch)

    def most_patches(self, min_pixels: int, max_pixels: int, source_pixels: int) -> int:
        """A bound on h * w of any `grid` with these pixel bounds, of an image with at most
        `source_pixels` pixels and sides within MAX_ASPECT_RATIO of each other (what a
        grid computed elsewhere, a split's lead's, is checked against). smart_resize (f =
        patch * merge, sides H, W, ratio r = max/min <= 200) ends in one of three branches:
        rounded, H' * W' <= max_pixels; scaled down and floored (over max_pixels), at most
        max_pixels, or with the short side held at f, f * sqrt(r * max_pixels); scaled up
        to min_pixels and ceiled (under it), (a + f)(b + f) with a * b = min_pixels,
        a + b <= sqrt(min_pixels) * (sqrt(r) + 1 / sqrt(r)). Without resizing: the source
        image's own size."""
        area = self.patch * self.patch
        if not self.resize:
            return source_pixels // area
        f, r = self.patch * self.merge, MAX_ASPECT_RATIO
        pixels = max(max_pixels, f * math.sqrt(r * max_pixels),
                     min_pixels + f * math.sqrt(min_pixels) * (math.sqrt(r) + 1 / math.sqrt(r))
                     + f * f)
        return math.ceil(pixels) // area

    def check(self, grid: tuple[int, int, int], min_pixels: int, max_pixels: int,
              source_pixels: int) -> str | None:
        """Why `grid` (t, h, w) is not one `grid` could give under these bounds (None:
        it could): a still image's one temporal patch, sides whole merge units, at most
        `most_patches` patches."""
        t, h, w = grid
        if t != 1:
            return f"a still image's grid has 1 temporal patch, not {t}"
        if h < self.merge or w < self.merge or h % self.merge or w % self.merge:
            return (f"{h}x{w} patches is not whole {self.merge}x{self.merge} merge units "
                    f"(at least one)")
        most = self.most_patches(min_pixels, max_pixels, source_pixels)
        if h * w > most:
            return (f"{h}x{w} = {h * w} patches, over the {most} this encoder's image "
                    f"processor gives an image under its pixel limits "
                    f"[{min_pixels}, {max_pixels}]")
        return None


def in_namespace(medium, cache_salt: str) -> None:
    """Take `medium`'s cache key (an image's hash, a video's plan key) in namespace
    `cache_salt` (non-empty), in place, before anything looks it up or announces it."""
    def key(k: str) -> str:
        return hashlib.sha256(f"namespace|{cache_salt}|{k}".encode()).hexdigest()

    if isinstance(medium, PreparedImage):
        if medium.prepared:  # a grid-only image has no key to take
            medium.digest = key(medium.digest)
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
        self.geometry = ImageGeometry.of(processor.image_processor)
        self.video = video
        self.video_tokens = VideoTokens(
            processor.video_token,
            getattr(processor, "vision_start_token", "<|vision_start|>"),
            getattr(processor, "vision_end_token", "<|vision_end|>"),
        )

    def __call__(self, messages: list[Message], req: Limits | None = None,
                 tools: list[dict] | None = None, budget: Budget | None = None,
                 options: TemplateOptions | None = None,
                 pixels_for: Container[int] | None = None,
                 other_grids: Sequence[tuple[int, int, int]] | None = None,
                 keep_fetched: bool = False) -> Prepared:
        """`budget`: the request's deadline and stop flag, checked before each image and
        video and before tokenizing (TimeoutError once it has ended); `options`: how the
        chat template renders the chat; `pixels_for`: the media (indices, prompt order)
        whose images are prepared for the ViT (None: every image), the other images
        grid-only: read as far as their header (format, size: a bad one still refused),
        their grids computed as the processor would (ImageGeometry), no pixel touched. A
        helper's share of a split prompt; an index naming no image prepares nothing (the
        helper checks its range against the rendering: split.MediaPart.own_units).
        `other_grids` (with `pixels_for`): the grids of the images outside it, in prompt
        order (a split's lead's, RangeStart.image_grids): those images are neither fetched
        nor read, each grid checked against this encoder's bounds for its image
        (ImageGeometry.check; a wrong count or grid is an INVALID_ARGUMENT on
        `image_grids`); None: their headers are read as above. `keep_fetched`: each
        prepared image from an http(s) URL keeps the bytes it answered
        (`PreparedImage.fetched`; a split's lead passes them on to its helpers)."""
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
        grids = self._given_grids(parts, pixels_for, other_grids)
        fetch = _Stopwatch()
        media = [self._image(where, p, budget, fetch, pixels_for is None or k in pixels_for,
                             grids.get(k), keep_fetched)
                 if isinstance(p, ImageInput) else self._video(where, p, budget, fetch)
                 for k, (where, p) in enumerate(parts)]
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

    def _given_grids(self, parts: list, pixels_for: Container[int] | None,
                     other_grids: Sequence[tuple[int, int, int]] | None,
                     ) -> dict[int, tuple[int, int, int]]:
        """`other_grids` by medium index, one per image outside `pixels_for`, each checked
        against this encoder's bounds for its image, all before anything is fetched."""
        if other_grids is None:
            return {}
        if pixels_for is None:
            raise ValueError("other_grids names the images outside pixels_for: give both")
        outside = [k for k, (_, p) in enumerate(parts)
                   if isinstance(p, ImageInput) and k not in pixels_for]
        if len(other_grids) != len(outside):
            raise invalid("image_grids", f"{len(other_grids)} grids for the {len(outside)} "
                          f"images of the chat outside this encoder's range")
        for k, grid in zip(outside, other_grids, strict=True):
            where, part = parts[k]
            wrong = self.geometry.check(grid, *self._pixel_bounds(part),
                                        self.limits.image.max_source_pixels)
            if wrong is not None:
                raise invalid("image_grids", f"the grid given for {where}: {wrong}")
        return dict(zip(outside, other_grids, strict=True))

    def _pixel_bounds(self, part: ImageInput) -> tuple[int, int]:
        """The image's [min_pixels, max_pixels]: its overrides clamped into the server's
        bounds (a client may tighten, never loosen)."""
        lim = self.limits
        lo = min(max(part.min_pixels or lim.min_pixels, lim.min_pixels), lim.max_pixels)
        return lo, max(min(part.max_pixels or lim.max_pixels, lim.max_pixels), lo)

    def _image(self, where: str, part: ImageInput, budget: Budget, fetch: _Stopwatch,
               pixels: bool, grid: tuple[int, int, int] | None = None,
               keep_fetched: bool = False) -> PreparedImage:
        """The image, prepared for the ViT, or grid-only when not `pixels`: its `grid` as
        given (checked already: _given_grids; the image neither fetched nor read), or
        without one its header read and checked, not decoded (the lead, which prepares
        every image, refuses a truncated one)."""
        if grid is not None:
            return PreparedImage(grid, grid[0] * grid[1] * grid[2] // (self.merge * self.merge),
                                 where)
        lim = self.limits
        lo, hi = self._pixel_bounds(part)
        budget.check()
        with fetch:
            raw = image_bytes(part, where, lim.image, budget)
        pil = decode_image(raw, where, lim.image) if pixels else open_image(raw, where, lim.image)
        w, h = pil.size
        if max(w, h) / min(w, h) > MAX_ASPECT_RATIO:  # NOTE: transformers' ValueError, as a 400
            raise invalid(where, f"image is {w}x{h}: its aspect ratio is over "
                          f"{MAX_ASPECT_RATIO}, which the model's processor refuses")
        if not pixels:
            grid = self.geometry.grid(h, w, lo, hi)
            return PreparedImage(grid, grid[0] * grid[1] * grid[2] // (self.merge * self.merge),
                                 where)
        out = self.processor.image_processor(
            images=[pil], size={"shortest_edge": lo, "longest_edge": hi}, return_tensors="pt"
        )
        values = out["pixel_values"].to(torch.float32).contiguous()
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        h = hashlib.sha256()
        h.update(np.asarray(grid, dtype=np.int64).tobytes())
        h.update(values.numpy().tobytes())
        return PreparedImage(
            grid=grid,  # type: ignore[arg-type]
            num_tokens=grid[0] * grid[1] * grid[2] // (self.merge * self.merge),
            field=where,
            pixels=values,
            digest=h.hexdigest(),
            fetched=raw if keep_fetched and fetched_url(part.url) else None,
        )

    def _video(self, where: str, part: VideoInput, budget: Budget,
               fetch: _Stopwatch) -> PlannedVideo:
        lim = self.limits
        budget.check()
        if self.video is None:
            raise invalid(where, "this model takes no video")
        if part.frames:  # NOTE: refusals name the wire's field, `...video.frames[k]`
            return plan_frames_source(part.frames, self.video, part.options, lim.video,
                                      lim.image, f"{where}.frames", budget)
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
