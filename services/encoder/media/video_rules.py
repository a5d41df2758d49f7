"""transformers' video processor rules, operation for operation (transformers 5.24:
`Qwen2VLVideoProcessor`, which Qwen2.5-VL uses, and `Qwen3VLVideoProcessor`): which frames
are sampled, the size they are resized to, the grid, the timing positions need, and the
normalization and patch order of `pixel_values_videos`. Pure arithmetic over a
`VideoHeader`; decoding and its limits are services/encoder/media/video.py.

    header (N frames, rate r, H x W) + Sampling (checkpoint settings + request options)
      -> sample_indices: qwen2_vl  n from fps (or num_frames), floored (rounded) to a multiple
                                   of the temporal patch size; indices arange(0, N, N / n)
                         qwen3_vl  n = int(N / r * fps) in [min_frames, max_frames] (or
                                   num_frames); indices linspace(0, N - 1, n).round()
      -> target_size:    smart_resize: sides multiples of patch * merge, the area bounded per
                         frame (qwen2_vl) or over t * h * w (qwen3_vl), optional per-frame cap
      -> VideoPlan:      grid (ceil(n / 2), h / patch, w / patch), token count, Qwen2.5-VL's
                         second_per_grid_t, Qwen3-VL's per-group timestamps, cache key
    frames [n, 3, h, w] uint8 -> normalize_and_patchify -> [t * h * w, 3 * 2 * P * P] float32
    VideoPlan -> placeholder_text: what the processor writes for the video in the prompt

Every refusal of a video is a `VideoError` (a ChatError) whose `reason` names the rule or
limit; callers decide on `reason`, never on the message.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tandem.chat import ChatError, VideoOptions

RULES = ("qwen2_vl", "qwen3_vl")  # the video processor classes whose rules are built here
ARCH_RULES = {"qwen2_5_vl": "qwen2_vl", "qwen2_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl",
              "qwen3_vl_moe": "qwen3_vl"}
# transformers' Qwen2VLVideoProcessor has no frame rate of its own (it keeps every frame unless
# told): ours samples at qwen-vl-utils' 2 frames per second when neither side names a rate.
DEFAULT_FPS = 2.0


class VideoRefusal(str, enum.Enum):
    """Why a video was refused. A limit's value is its name: the field of `VideoLimits` and
    of the encoder's config."""

    BYTES = "max_video_bytes"
    DURATION = "max_video_duration_s"
    FRAMES = "max_video_frames"
    DECODED_PIXELS = "max_video_decoded_pixels"
    DECODE_TIME = "max_video_decode_s"
    DECODE_WORK = "video_decode_pixels_per_byte"  # more decode work than its bytes buy
    DECODE_BUDGET = "video_decode_s_per_mib"  # decoded longer than its bytes buy
    TOKENS = "max_video_tokens"
    EMPTY = "empty"  # 0 bytes
    ZERO_DURATION = "zero_duration"  # a video stream without frames or without a frame rate
    TOO_SHORT = "too_short"  # fewer frames than the rules sample (a still, not a clip)
    UNDECODABLE = "undecodable"  # not a video FFmpeg opens with an allowed demuxer
    CORRUPT = "corrupt"  # opens, then fails or ends early while decoding
    UNSUPPORTED = "unsupported"  # decodes, but the rules cannot take it (aspect, frame size)
    OPTIONS = "options"  # the request's sampling controls are invalid


class VideoError(ChatError):
    """A refused video: `reason` says which rule or limit. INVALID_ARGUMENT, except a file
    over max_video_bytes: RESOURCE_EXHAUSTED (the router's 413, as for a body too large)."""

    def __init__(self, field: str, reason: VideoRefusal, message: str) -> None:
        super().__init__(
            message, field, "RESOURCE_EXHAUSTED" if reason is VideoRefusal.BYTES else None
        )
        self.reason = reason


@dataclass(frozen=True)
class VideoSettings:
    """The checkpoint's video processor settings, named as transformers names them.

    `rules` picks the class whose rules apply: by architecture (config.json's model_type),
    since that is what the model was trained with. `min_pixels` / `max_pixels` are the
    processor's `size["shortest_edge"]` / `size["longest_edge"]`: per frame for qwen2_vl,
    over the whole clip (t * h * w) for qwen3_vl. `cap_pixels_per_frame` unset in the file
    is False (transformers 5.24's behaviour, with a warning there).
    """

    rules: str
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float = 1 / 255
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128_000

    @classmethod
    def defaults(cls, rules: str) -> VideoSettings:
        """The class attributes of transformers' processor for `rules`."""
        if rules == "qwen2_vl":
            clip = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
            return cls("qwen2_vl", 14, 2, 2, 128 * 28 * 28, 28 * 28 * 768, *clip)
        if rules == "qwen3_vl":
            return cls("qwen3_vl", 16, 2, 2, 128 * 32 * 32, 32 * 32 * 768, (0.5,) * 3, (0.5,) * 3,
                       fps=2.0, max_video_tokens=768)
        raise ValueError(f"no video rules {rules!r} (known: {', '.join(RULES)})")

    @classmethod
    def from_dict(cls, rules: str, d: dict) -> VideoSettings:
        """A processor dict over the class defaults, as `from_pretrained` builds it."""
        if (
            d.get("resample", 3) != 3
            or not all(d.get(k, True) for k in ("do_resize", "do_rescale", "do_normalize"))
            or d.get("do_center_crop")
        ):
            raise ValueError("video processor: only bicubic resize + rescale + normalize is built")
        s = cls.defaults(rules)
        size = d.get("size") or {}
        lo, hi = size.get("shortest_edge", s.min_pixels), size.get("longest_edge", s.max_pixels)
        if rules == "qwen2_vl":  # Qwen2VLVideoProcessor.__init__: these keys override `size`
            lo, hi = d.get("min_pixels") or lo, d.get("max_pixels") or hi
        keys = ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "fps",
                "num_frames", "min_frames", "max_frames", "max_video_tokens")
        over = {k: d[k] for k in keys if k in d}
        return dataclasses.replace(
            s, min_pixels=int(lo), max_pixels=int(hi),
            image_mean=tuple(d.get("image_mean", s.image_mean)),
            image_std=tuple(d.get("image_std", s.image_std)),
            cap_pixels_per_frame=bool(d.get("cap_pixels_per_frame")), **over,
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> VideoSettings:
        """From a local checkpoint, finding the dict where transformers does: the nested
        `video_processor` of processor_config.json, else video_preprocessor_config.json,
        else preprocessor_config.json (the image processor's, for checkpoints without one)."""
        p = Path(path)
        model_type = json.loads((p / "config.json").read_text())["model_type"]
        if model_type not in ARCH_RULES:
            raise ValueError(f"no video rules for model_type {model_type!r}")
        d = None
        if (p / "processor_config.json").exists():
            d = json.loads((p / "processor_config.json").read_text()).get("video_processor")
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if d is None and (p / name).exists():
                d = json.loads((p / name).read_text())
        return cls.from_dict(ARCH_RULES[model_type], d or {})

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class Sampling:
    """The effective settings of one video: the checkpoint's, tightened by the request's.
    Exactly one of `fps` and `num_frames` is set. `cap_pixels_per_frame` and
    `max_video_tokens` mean what they mean to the rules' processor (see VideoOptions)."""

    settings: VideoSettings
    fps: float | None
    num_frames: int | None
    min_frames: int
    max_frames: int
    min_pixels: int
    max_pixels: int
    cap_pixels_per_frame: bool
    max_video_tokens: int

    @classmethod
    def resolve(cls, s: VideoSettings, o: VideoOptions, field: str = "video") -> Sampling:
        def bad(msg: str) -> VideoError:
            return VideoError(field, VideoRefusal.OPTIONS, msg)

        if o.fps is not None and o.num_frames is not None:
            raise bad("fps and num_frames are mutually exclusive")
        if o.fps is not None and (isinstance(o.fps, bool) or not isinstance(o.fps, (int, float))
                                  or not (math.isfinite(o.fps) and o.fps > 0)):
            raise bad(f"fps must be a positive number, got {o.fps!r}")
        ints = ("num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels",
                "total_pixels")
        for k in ints:
            v = getattr(o, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise bad(f"{k} must be a positive integer, got {v!r}")
        tps, f2 = s.temporal_patch_size, s.factor * s.factor
        max_frames = min(s.max_frames, o.max_frames or s.max_frames)
        if o.num_frames is not None and not tps <= o.num_frames <= max_frames:
            raise bad(f"num_frames must be in [{tps}, {max_frames}], got {o.num_frames}")
        fps, num = o.fps, o.num_frames
        if fps is None and num is None:
            fps, num = (s.fps, None) if s.num_frames is None else (None, s.num_frames)
            fps = DEFAULT_FPS if fps is None and num is None else fps
        max_pixels = min(s.max_pixels, o.max_pixels or s.max_pixels)
        cap, tokens = s.cap_pixels_per_frame, s.max_video_tokens
        if o.total_pixels is not None and s.rules == "qwen3_vl":
            max_pixels = min(max_pixels, o.total_pixels)  # its longest_edge is the clip's
        elif o.total_pixels is not None:
            # qwen2_vl's clip budget is int(max_video_tokens * factor**2 * 0.9) pixels: the
            # request's budget in whole tokens (rounded down), never above the checkpoint's.
            want = max(1, math.floor(o.total_pixels / (f2 * 0.9)))
            cap, tokens = True, min(tokens, want) if cap else want
        min_pixels = min(o.min_pixels or s.min_pixels, max_pixels)
        min_frames = min(o.min_frames or s.min_frames, max_frames)
        return cls(s, fps, num, min_frames, max_frames, min_pixels, max_pixels, cap, tokens)

    @classmethod
    def resolve_frames(cls, s: VideoSettings, o: VideoOptions, field: str = "video") -> Sampling:
        """The settings of a video given as frames. Nothing is sampled: every frame is used,
        as transformers' processor with `do_sample_frames=False`, so the frame count
        controls (num_frames, min_frames, max_frames) are refused. `fps`, the rate the
        frames were taken at (transformers' `video_metadata.fps`), is required: without it
        transformers times the frames at 24 per second and qwen-vl-utils at 2, and no
        default is both. The pixel bounds apply as to a file."""
        for k in ("num_frames", "min_frames", "max_frames"):
            if getattr(o, k) is not None:
                raise VideoError(field, VideoRefusal.OPTIONS, f"{k} does not apply to a video "
                                 "given as frames: every frame is used, none sampled")
        if o.fps is None:
            raise VideoError(field, VideoRefusal.OPTIONS, "a video given as frames needs fps: "
                             "the rate its frames were taken at (qwen-vl-utils' sample_fps)")
        return cls.resolve(s, o, field)

    def processor_kwargs(self, frames: bool = False) -> tuple[dict, dict]:
        """(from_pretrained overrides, call kwargs) that make transformers' video processor
        for these rules compute what `prepare_video` computes. NOTE: qwen3_vl's
        `sample_frames` reads min_frames / max_frames from the processor, not the call.
        `frames`: for a video given as frames (`resolve_frames`), whose call samples
        nothing; its `video_metadata` is {"total_num_frames": n, "fps": fps,
        "frames_indices": range(n)} (`plan_frames`)."""
        if frames:
            init, _ = self.processor_kwargs()
            return init, {"do_sample_frames": False}
        init: dict = {"min_frames": self.min_frames, "max_frames": self.max_frames,
                      "cap_pixels_per_frame": self.cap_pixels_per_frame,
                      "max_video_tokens": self.max_video_tokens}
        if self.settings.rules == "qwen2_vl":
            init |= {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels}
        else:
            init["size"] = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
        call = {"do_sample_frames": True, "fps": self.fps, "num_frames": self.num_frames}
        return init, call

    def key(self) -> str:
        """What besides the indices and target size decides the pixels (for cache keys)."""
        s = self.settings
        return repr((s.rules, s.patch_size, s.temporal_patch_size, s.merge_size,
                     s.image_mean, s.image_std, s.rescale_factor))


@dataclass(frozen=True)
class VideoHeader:
    """What the container says, as transformers' PyAV loader reads it (`read_video_pyav`):
    `num_frames` the stream's frame count (counted by demuxing where the header has none,
    e.g. WebM), `fps` its average rate, `duration_s` = num_frames / fps."""

    num_frames: int
    fps: float
    width: int
    height: int
    format: str
    codec: str

    @property
    def duration_s(self) -> float:
        return self.num_frames / self.fps


@dataclass(frozen=True)
class VideoPlan:
    """Everything about a video's ViT input except the pixels, known before decoding.

    indices        source frames sampled, in order (qwen3_vl may repeat one)
    size           (height, width) every sampled frame is resized to
    grid           (t, h, w) in patches: t = ceil(len(indices) / temporal_patch_size)
    second_per_grid_t  Qwen2.5-VL's `second_per_grid_ts` entry: temporal_patch_size /
                   sampled fps, sampled fps = len(indices) / N * r
    timestamps_s   Qwen3-VL: per temporal group, the mean of its first and last frame's
                   time (index / r), the last group padded with its last frame
    cache_key      sha256 of the content hash, indices, size and normalization: equal keys
                   mean bit-identical pixel_values (another fps sampling the same frames
                   hits); a video given as frames: of their hash, size, normalization and
                   fps (`plan_frames`)
    """

    indices: tuple[int, ...]
    size: tuple[int, int]
    grid: tuple[int, int, int]
    num_tokens: int
    second_per_grid_t: float
    timestamps_s: tuple[float, ...]
    cache_key: str

    def timestamp_text(self) -> list[str]:
        """Qwen3-VL's text before each temporal group, as its processor writes it."""
        return [f"<{t:.1f} seconds>" for t in self.timestamps_s]


def sample_indices(rules: str, n_total: int, fps: float, smp: Sampling) -> list[int]:
    """Source frame indices: `Qwen2VLVideoProcessor.sample_frames` /
    `Qwen3VLVideoProcessor.sample_frames` with do_sample_frames=True. An empty list means
    the clip is too short for the rules (transformers divides by zero or refuses there)."""
    tps = smp.settings.temporal_patch_size
    if rules == "qwen2_vl":
        if smp.num_frames is not None:
            n = round(smp.num_frames / tps) * tps
        else:
            cap = math.floor(min(smp.max_frames, n_total) / tps) * tps
            n = n_total / fps * smp.fps
            n = min(max(n, smp.min_frames), cap, n_total)
            n = math.floor(n / tps) * tps
        if n == 0 or n > n_total:
            return []
        # NOTE: a float32 arange, then truncation, as transformers computes it (so in torch).
        # Its length is ceil(N / (N / n)) in float64, n + 1 for many (N, n) (61 frames, 14
        # sampled), the extra index being N itself: transformers' processor then fails
        # (IndexError) and we keep the n it meant. Everywhere it works, this is its answer.
        return torch.arange(0, n_total, n_total / n).int().tolist()[:n]
    if smp.num_frames is not None:
        n = smp.num_frames
    else:
        n = int(n_total / fps * smp.fps)
        n = min(max(n, smp.min_frames), smp.max_frames, n_total)
    if n < tps:  # Qwen3-VL's smart_resize refuses t < temporal_factor
        return []
    return np.linspace(0, n_total - 1, n).round().astype(int).tolist()


def smart_resize_qwen2(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """transformers' Qwen2-VL smart_resize: sides divisible by factor, area in range."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError("absolute aspect ratio must be smaller than 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_qwen3(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """transformers' Qwen3-VL video smart_resize: the area bounds apply to t * h * w."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError("absolute aspect ratio must be smaller than 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def target_size(smp: Sampling, n_sampled: int, height: int, width: int) -> tuple[int, int]:
    """The resize of each processor's `resize` (cap_pixels_per_frame included)."""
    s = smp.settings
    f, tps = s.factor, s.temporal_patch_size
    if s.rules == "qwen2_vl":
        max_pixels = smp.max_pixels
        if smp.cap_pixels_per_frame:  # an even share of the clip's budget, with a floor
            total = int(smp.max_video_tokens * f * f * 0.9)
            max_pixels = max(min(max_pixels, total * tps // n_sampled),
                             int(smp.min_pixels * 1.05))
        return smart_resize_qwen2(height, width, f, smp.min_pixels, max_pixels)
    max_pixels = smp.max_pixels
    if smp.cap_pixels_per_frame:  # at most max_video_tokens a frame, and an even share
        per_frame = max(min(smp.max_video_tokens * f * f, smp.max_pixels // n_sampled),
                        int(smp.min_pixels * 1.05))
        max_pixels = per_frame * n_sampled
    return smart_resize_qwen3(n_sampled, height, width, tps, f, smp.min_pixels, max_pixels)


def plan_video(
    header: VideoHeader, smp: Sampling, content_hash: str, field: str = "video"
) -> VideoPlan:
    """The plan for a probed video (no decoding): indices, size, grid, timing, cache key."""
    indices = sample_indices(smp.settings.rules, header.num_frames, header.fps, smp)
    if not indices:
        asked = f" {smp.num_frames} (num_frames)" if smp.num_frames is not None else ""
        raise VideoError(
            field,
            VideoRefusal.TOO_SHORT,
            f"video has {header.num_frames} frames, too few to sample{asked}",
        )
    return _plan(header, smp, indices, (content_hash, indices), field)


def plan_frames(
    header: VideoHeader, smp: Sampling, content_hash: str, field: str = "video"
) -> VideoPlan:
    """The plan for a video given as frames (`Sampling.resolve_frames`): `header` holds
    their count, the request's fps and their size. Every frame, in order: transformers'
    processor with `do_sample_frames=False` and `video_metadata` {"total_num_frames": n,
    "fps": fps, "frames_indices": range(n)}, so the timing is Qwen2.5-VL's
    second_per_grid_t = temporal_patch_size / fps and Qwen3-VL's timestamps index / fps.
    An odd count is padded by the last frame (patchify), as for a file. The cache key
    holds the rate as well: the same frames at another fps are the same pixels but other
    positions (Qwen2.5-VL's time axis, Qwen3-VL's timestamps), and the language side's
    prefix cache keys pages by this key."""
    s = smp.settings
    least = s.temporal_patch_size if s.rules == "qwen3_vl" else 1  # Qwen3-VL's smart_resize
    if header.num_frames < least:
        raise VideoError(field, VideoRefusal.TOO_SHORT, f"video has {header.num_frames} "
                         f"frames; these rules take at least {least}")
    return _plan(header, smp, list(range(header.num_frames)),
                 ("frames", content_hash, header.fps), field)


def _plan(header: VideoHeader, smp: Sampling, indices: list[int], identity: tuple,
          field: str) -> VideoPlan:
    """Size, grid, timing and cache key of the frames `indices` of `header`; `identity`:
    what, besides the size and normalization, decides the video's tokens."""
    s = smp.settings
    tps = s.temporal_patch_size
    try:
        size = target_size(smp, len(indices), header.height, header.width)
    except ValueError as e:
        raise VideoError(field, VideoRefusal.UNSUPPORTED, f"video frames: {e}") from None
    t = -(-len(indices) // tps)
    grid = (t, size[0] // s.patch_size, size[1] // s.patch_size)
    # Qwen2.5-VL's processor: sampled_fps, then temporal_patch_size / sampled_fps.
    sampled_fps = len(indices) / header.num_frames * header.fps
    # Qwen3-VL's processor (_calculate_timestamps): pad with the last index, average pairs.
    padded = indices + [indices[-1]] * (-len(indices) % tps)
    times = [i / header.fps for i in padded]
    stamps = tuple((times[i] + times[i + tps - 1]) / 2 for i in range(0, len(times), tps))
    key = hashlib.sha256(repr((*identity, size, smp.key())).encode()).hexdigest()
    return VideoPlan(tuple(indices), size, grid, grid[0] * grid[1] * grid[2] // s.merge_size**2,
                     tps / sampled_fps, stamps, key)


@dataclass(frozen=True)
class VideoTokens:
    """The processor's video pad and vision start/end tokens (text)."""

    pad: str
    vision_start: str
    vision_end: str


def placeholder_text(plan: VideoPlan, s: VideoSettings, tokens: VideoTokens) -> str:
    """What the processor writes in place of the chat template's video token
    (`replace_video_token`). Qwen2.5-VL: the pad token once per vision token. Qwen3-VL: per
    temporal group its timestamp text, then the vision start token, the group's pads and
    the vision end token (inside the template's own vision start/end pair)."""
    if s.rules == "qwen2_vl":
        return tokens.pad * plan.num_tokens
    per_group = plan.grid[1] * plan.grid[2] // s.merge_size**2
    return "".join(f"{stamp}{tokens.vision_start}{tokens.pad * per_group}{tokens.vision_end}"
                   for stamp in plan.timestamp_text())


def normalize_and_patchify(frames: torch.Tensor, s: VideoSettings) -> torch.Tensor:
    """[T, C, H, W] uint8 -> [t * h * w, C * tps * P * P] float32: the processor's fused
    rescale+normalize, then its `patchify` (T padded with copies of the last frame)."""
    mean = torch.tensor(list(s.image_mean)) * (1.0 / s.rescale_factor)
    std = torch.tensor(list(s.image_std)) * (1.0 / s.rescale_factor)
    x = frames.to(torch.float32)
    x.sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    tps, p, m = s.temporal_patch_size, s.patch_size, s.merge_size
    if pad := -x.shape[0] % tps:
        x = torch.cat((x, x[-1:].expand(pad, -1, -1, -1)), dim=0)
    n, c, h, w = x.shape
    gt, gh, gw = n // tps, h // p, w // p
    x = x.view(gt, tps, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, h/m, w/m, m, m, C, tps, P, P
    return x.reshape(gt * gh * gw, c * tps * p * p)


def resize_frame(rgb: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    """[H, W, 3] uint8 -> [3, h, w] uint8: torchvision's resize of a uint8 tensor on the CPU
    (native uint8 bicubic with antialias; none at all when the size is unchanged). NOTE:
    one frame at a time equals transformers' resize of the stacked clip: the kernel works
    plane by plane."""
    x = torch.from_numpy(rgb).permute(2, 0, 1).contiguous()
    if tuple(x.shape[-2:]) == size:
        return x
    out = torch.nn.functional.interpolate(
        x[None], size=list(size), mode="bicubic", align_corners=False, antialias=True
    )
    return out[0]
