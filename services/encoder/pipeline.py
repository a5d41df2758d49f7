"""The encode path without the wire: chat -> preprocess -> cache / ViT -> merged payload.

    EncodePipeline.encode(messages, limits)
        preprocess (worker pool, off the event loop)
        -> scheduler.features (cache hits, batched ViT for the rest)
        -> merge.build_payload (worker pool)
        -> EncodeResult(payload, hashes, cached tokens, timings)

The gRPC servicer adds delivery (transfer) and status mapping on top.
"""

from __future__ import annotations

import asyncio
import enum
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tandem.devices import resolve_device, resolve_dtype
from tandem.transfer.payload import PromptPayload

from .cache import EmbeddingCache
from .chat import Limits, Message
from .images import ImageLimits
from .merge import build_payload
from .preprocess import PreprocessLimits, Preprocessor
from .scheduler import EncoderScheduler
from .vit_runner import VisionRunner


class EncodeState(enum.Enum):
    """Where one Encode is; the servicer reports it in logs and deadline errors."""

    PREPROCESSING = "preprocessing"
    ENCODING = "waiting for the ViT"
    MERGING = "merging"
    SENDING = "delivering to the language instance"
    DONE = "done"
    FAILED = "failed"


@dataclass
class EncodeResult:
    payload: PromptPayload
    image_hashes: list[str]
    cached_image_tokens: int
    preprocess_ms: float
    vit_ms: float


class EncodePipeline:
    def __init__(
        self,
        processor,
        embed_tokens,
        runners: list[VisionRunner],
        spec,
        pre_limits: PreprocessLimits,
        cache_bytes: int,
        patch_budget: int,
        workers: int = 2,
        metrics=None,
    ) -> None:
        self.spec = spec
        self.embed_tokens = embed_tokens
        self.preprocessor = Preprocessor(processor, pre_limits)
        self.cache = EmbeddingCache(cache_bytes)
        self.metrics = metrics
        self.scheduler = EncoderScheduler(runners, self.cache, patch_budget, metrics)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="preprocess")
        self.num_deepstack = int(spec.num_deepstack)

    @classmethod
    def from_config(cls, cfg, metrics=None) -> EncodePipeline:
        """Load the processor and one vision tower per device (no decoder weights)."""
        from transformers import AutoProcessor

        import tandem  # noqa: F401  (registers the image-only processors)
        from tandem.cpu_kernels import linear_kernels, pack_linears
        from tandem.models.checkpoint import resolve_model_path
        from tandem.models.split import load_vision_part

        path = resolve_model_path(cfg.model)
        processor = AutoProcessor.from_pretrained(path)
        devs = [resolve_device(d) for d in (cfg.devices or [cfg.device])]
        parts = [load_vision_part(path, resolve_dtype(cfg.dtype, d), d) for d in devs]
        for p, d in zip(parts, devs, strict=True):  # float32 on CPU: our packed linears
            kernels = linear_kernels(cfg.linear_backend, d, resolve_dtype(cfg.dtype, d))
            if kernels is not None:
                pack_linears(p.visual, kernels)
        runners = [VisionRunner(p.visual, max_graphs=cfg.cuda_graph_max) for p in parts]
        size = processor.image_processor.size
        lo = cfg.min_pixels or int(size["shortest_edge"])
        hi = max(cfg.max_pixels or int(size["longest_edge"]), lo)
        limits = PreprocessLimits(
            min_pixels=lo,
            max_pixels=hi,
            max_images=cfg.max_images_per_request,
            max_prompt_tokens=cfg.max_prompt_tokens,
            image=ImageLimits(
                max_image_bytes=cfg.max_image_bytes,
                max_source_pixels=cfg.max_source_pixels,
                allowed_url_hosts=tuple(cfg.allowed_url_hosts),
                allow_private_urls=cfg.allow_private_urls,
                url_timeout_s=cfg.url_timeout_s,
            ),
        )
        return cls(
            processor,
            parts[0].embed_tokens,
            runners,
            parts[0].spec,
            limits,
            cfg.cache_bytes,
            cfg.patch_budget,
            cfg.preprocess_workers,
            metrics,
        )

    def start(self) -> None:
        self.scheduler.start()

    async def stop(self) -> None:
        await self.scheduler.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def encode(
        self, messages: list[Message], limits: Limits | None = None, on_state=None
    ) -> EncodeResult:
        """`on_state(EncodeState)` is called as the request moves from stage to stage."""
        step = on_state or (lambda _s: None)
        loop = asyncio.get_running_loop()
        step(EncodeState.PREPROCESSING)
        prep = await loop.run_in_executor(self.pool, self.preprocessor, messages, limits)
        if self.metrics:
            self.metrics.preprocess_seconds.observe(prep.preprocess_s)
        step(EncodeState.ENCODING)
        feats = await self.scheduler.features(prep.images)
        step(EncodeState.MERGING)
        payload = await loop.run_in_executor(
            self.pool,
            lambda: build_payload(
                self.embed_tokens,
                prep.input_ids,
                prep.mm_token_type_ids,
                feats.features,
                [im.grid for im in prep.images],
                image_token_id=self.spec.image_token_id,
                merge=self.spec.spatial_merge_size,
                num_deepstack=self.num_deepstack,
            ),
        )
        if self.metrics:
            self.metrics.cache_bytes.set(self.cache.bytes_used)
            self.metrics.cache_evictions.set(self.cache.evictions)
        return EncodeResult(
            payload=payload,
            image_hashes=[im.hash for im in prep.images],
            cached_image_tokens=feats.cached_tokens,
            preprocess_ms=prep.preprocess_s * 1e3,
            vit_ms=feats.vit_s * 1e3,
        )

    def load_figures(self) -> dict:
        return {
            "queued_patches": self.scheduler.queued_patches,
            "cache_bytes": self.cache.bytes_used,
            "cache_capacity_bytes": self.cache.capacity,
        }
