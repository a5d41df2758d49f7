"""The encode path without the wire: chat -> preprocess -> cache / ViT -> merged payload.

    EncodePipeline.encode(messages, limits, announce, client, deadline)
        preprocess (worker threads shared fairly among clients: fair_pool.py)
        -> announce(PromptInfo): the language side answers how many leading tokens it
           already holds (cache-aware transfer; 0 without `announce`)
        -> scheduler.features (cache hits, batched ViT for the rest; images wholly inside
           the held prefix are skipped)
        -> merge.build_payload (same threads, same client), rows from the held prefix's end on
        -> EncodeResult(payload, hashes, cached tokens, timings)

The gRPC servicer adds delivery (transfer) and status mapping on top.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from tandem.chat import Limits, Message, TemplateOptions, load_chat_template
from tandem.devices import resolve_device, resolve_dtype
from tandem.services.encoder.cache import EmbeddingCache
from tandem.services.encoder.fair_pool import FairPool
from tandem.services.encoder.images import Budget, ImageLimits
from tandem.services.encoder.merge import build_payload
from tandem.services.encoder.preprocess import PreprocessLimits, Preprocessor
from tandem.services.encoder.scheduler import EncoderScheduler
from tandem.services.encoder.vit_runner import VisionRunner
from tandem.transfer.payload import ImageSpan, PromptInfo, PromptPayload


class EncodeState(enum.Enum):
    """Where one Encode is; the servicer reports it in logs and deadline errors."""

    PREPROCESSING = "preprocessing"
    ANNOUNCING = "asking the language instance what it holds"
    ENCODING = "waiting for the ViT"
    MERGING = "merging"
    SENDING = "delivering to the language instance"
    DONE = "done"
    FAILED = "failed"


@dataclass
class EncodeResult:
    payload: PromptPayload  # rows from payload.start (the language side's cached prefix)
    image_hashes: list[str]
    cached_image_tokens: int
    preprocess_ms: float
    vit_ms: float
    skipped_images: int = 0  # wholly inside the cached prefix: no ViT


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
        client_share: int = 0,
        chat_template: str | None = None,
    ) -> None:
        self.spec = spec
        self.embed_tokens = embed_tokens
        self.preprocessor = Preprocessor(processor, pre_limits, chat_template)
        self.cache = EmbeddingCache(cache_bytes)
        self.metrics = metrics
        self.scheduler = EncoderScheduler(runners, self.cache, patch_budget, metrics)
        self.pool = FairPool(workers, client_share)
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
            cfg.preprocess_client_share,
            load_chat_template(cfg.chat_template),
        )

    def start(self) -> None:
        self.scheduler.start()

    async def stop(self) -> None:
        await self.scheduler.stop()
        self.pool.shutdown()

    async def encode(
        self,
        messages: list[Message],
        limits: Limits | None = None,
        on_state=None,
        announce: Callable[[PromptInfo], Awaitable[int]] | None = None,
        tools: list[dict] | None = None,
        client: str = "",
        deadline: float | None = None,
        template: TemplateOptions | None = None,
    ) -> EncodeResult:
        """`on_state(EncodeState)` is called as the request moves from stage to stage;
        `announce(info)` returns the leading tokens the language side already holds.
        `client` is the caller's key for the fair share of the worker threads ("" = a
        client of its own); `deadline` (Unix seconds) bounds the preprocessing;
        `template`: how the chat template renders the chat."""
        left = math.inf if deadline is None else deadline - time.time()
        budget = Budget(time.monotonic() + left)
        try:
            return await self._encode(messages, limits, on_state, announce, tools, client,
                                      budget, template)  # fmt: skip
        finally:
            budget.stop.set()  # NOTE: a worker still on this request stops at its next check

    async def _encode(self, messages, limits, on_state, announce, tools, client,
                      budget: Budget, template: TemplateOptions | None) -> EncodeResult:  # fmt: skip
        step = on_state or (lambda _s: None)
        step(EncodeState.PREPROCESSING)
        prep = await self.pool.run(client, self.preprocessor, messages, limits, tools, budget,
                                   template)
        if self.metrics:
            self.metrics.preprocess_seconds.observe(prep.preprocess_s)
        spans = image_spans(prep.input_ids, [im.num_tokens for im in prep.images],
                            [im.hash for im in prep.images], self.spec.image_token_id)
        cached = 0
        if announce is not None:
            step(EncodeState.ANNOUNCING)
            cached = await announce(PromptInfo(prep.input_ids.tolist(), spans))
        need = [i for i, sp in enumerate(spans) if sp.start + sp.length > cached]
        step(EncodeState.ENCODING)
        got = await self.scheduler.features([prep.images[i] for i in need])
        feats: list = [None] * len(spans)
        for i, f in zip(need, got.features, strict=True):
            feats[i] = f
        step(EncodeState.MERGING)
        payload = await self.pool.run(
            client,
            lambda: build_payload(
                self.embed_tokens,
                prep.input_ids,
                prep.mm_token_type_ids,
                feats,
                [im.grid for im in prep.images],
                image_token_id=self.spec.image_token_id,
                merge=self.spec.spatial_merge_size,
                num_deepstack=self.num_deepstack,
            ).rows_from(cached),
        )
        if self.metrics:
            self.metrics.cache_bytes.set(self.cache.bytes_used)
            self.metrics.cache_evictions.set(self.cache.evictions)
        payload.info = PromptInfo(prep.input_ids.tolist(), spans)
        return EncodeResult(
            payload=payload,
            image_hashes=[im.hash for im in prep.images],
            cached_image_tokens=got.cached_tokens,
            preprocess_ms=prep.preprocess_s * 1e3,
            vit_ms=got.vit_s * 1e3,
            skipped_images=len(spans) - len(need),
        )

    def load_figures(self) -> dict:
        return {
            "queued_patches": self.scheduler.queued_patches,
            "cache_bytes": self.cache.bytes_used,
            "cache_capacity_bytes": self.cache.capacity,
        }


def image_spans(
    input_ids: torch.Tensor, lengths: list[int], hashes: list[str], image_token_id: int
) -> list[ImageSpan]:
    """Each image's run of pad tokens, in order (the preprocessor expands each image's
    placeholder into `length` consecutive pads)."""
    pads = (input_ids == image_token_id).nonzero().flatten().tolist()
    out, k = [], 0
    for n, h in zip(lengths, hashes, strict=True):
        start = pads[k]
        if pads[k + n - 1] != start + n - 1:
            raise ValueError(f"image {len(out)}'s pad tokens are not contiguous")
        out.append(ImageSpan(start, n, h))
        k += n
    if k != len(pads):
        raise ValueError(f"{len(pads)} image pad tokens for {k} image tokens")
    return out
