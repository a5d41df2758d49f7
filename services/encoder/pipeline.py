"""The encode path without the wire: chat -> preprocess -> cache / ViT -> merged payload.

    EncodePipeline.encode(job: EncodeJob, hooks: EncodeHooks, role: split.SplitRole)
        preprocess (worker threads shared fairly among clients: fair_pool.py): images
           ready for the ViT, videos probed and planned (not decoded)
        -> announce(PromptInfo): the language side answers how many leading tokens it
           already holds (cache-aware transfer; 0 without `announce`)
        -> for each image and video not wholly inside the held prefix: the embedding
           cache (by key); a video that misses is decoded now (one job of the same pool
           each, the same client's share), so a cached or held video is never decoded
        -> scheduler.encode: batched ViT for the misses
        -> merge.build_payload (same threads, same client), rows from the held prefix's end on
        -> EncodeResult(payload, keys, cached tokens, timings)

Streamed (`on_payload` given: `--transfer.stream`, docs/architecture.md, "Streamed rows"): after the
cache lookups the payload is built at once without features (merge.StreamedPayload: text
rows, ids, positions and delta from the grids) and handed to `on_payload` (the servicer
starts sending it), the cache hits are spliced in, then each miss goes through the ViT
alone, in prompt order, and its rows are spliced in as soon as its features exist; the
payload's watermark (`arrived`) says how far its rows are final and the sender writes
only those. So the language side prefills the text and the first images while the
later images are still in the ViT.

Where the time goes (an 8-image prompt, one encoder, without streaming): preprocess
(decode, resize, patchify: a few ms per image, on the worker threads) -> ViT of all 8
(one batch; the largest share: ViT time grows with patches, ~8x one image) -> merge ->
transfer of every row (~0.5-1 GB/s on TCP here) -> the language side's whole prefill,
which starts only after Done. TTFT = preprocess + 8 ViT + merge + transfer + prefill(all).
Streamed: the transfer and prefill of image k's rows run while images k+1.. are in the
ViT, so TTFT ~ preprocess + 8 ViT + transfer and prefill of the LAST image's rows (and
the text after it): it saves up to 7/8 of the prefill and of the transfer. The ViT stays
on the critical path: cutting it needs several encoders (issue 27 step 3, not built).
ViT inputs of one streamed request run one at a time (batched with other requests'
inputs, not with each other): a batch of all 8 would give no features before the last.

Traces: under the caller's span (`trace`, the Encode's) one span per stage the request
went through: encoder.queue (waiting for a worker thread), encoder.preprocess (and
encoder.fetch, the time getting the media's bytes, summed), encoder.announce (the cached
prefix), encoder.cache (hits and misses), encoder.video_decode, per ViT input
encoder.vit_queue and encoder.vit_batch (the batch's size), encoder.merge. A stage that
fails leaves no span of its own: the Encode's span carries the failure.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from tandem import tracing
from tandem.chat import load_chat_template
from tandem.devices import resolve_device, resolve_dtype
from tandem.services.encoder.cache import CachedFeatures, EmbeddingCache
from tandem.services.encoder.chat import EncodeJob
from tandem.services.encoder.fair_pool import FairPool
from tandem.services.encoder.media.images import Budget, ImageLimits, local_media_root
from tandem.services.encoder.media.video import PlannedVideo, PreparedVideo, VideoLimits
from tandem.services.encoder.media.video_rules import ARCH_RULES, VideoSettings
from tandem.services.encoder.merge import (
    MediaKind,
    MergeModel,
    RopeRule,
    StreamedPayload,
    VisionGrid,
    build_payload,
    media_rows,
)
from tandem.services.encoder.preprocess import (
    Prepared,
    PreparedImage,
    PreprocessLimits,
    Preprocessor,
    in_namespace,
)
from tandem.services.encoder.scheduler import EncoderScheduler, FeatureResult
from tandem.services.encoder.split import (
    ALONE,
    Share,
    SplitRole,
    helper_start,
    units_in,
)
from tandem.services.encoder.units import Unit, VideoSlice, VitInput, groups_of, units, vit_inputs
from tandem.services.encoder.vit.kernels import pack_vision_tower
from tandem.services.encoder.vit.runner import VisionRunner
from tandem.transfer.payload import ImageSpan, PromptInfo, PromptPayload
from tandem.transfer.sender_room import RemoteRange

log = logging.getLogger(__name__)


class EncodeState(enum.Enum):
    """Where one Encode is; the servicer reports it in logs and deadline errors."""

    PREPROCESSING = "preprocessing"
    ANNOUNCING = "asking the language instance what it holds"
    DECODING = "decoding video frames"
    ENCODING = "waiting for the ViT"
    MERGING = "merging"
    SENDING = "delivering to the language instance"
    DONE = "done"
    FAILED = "failed"


@dataclass
class EncodeResult:
    payload: PromptPayload  # rows from payload.start (the language side's cached prefix)
    image_hashes: list[str]  # of the images it prepared (a helper: its share's), prompt order
    cached_image_tokens: int  # image and video tokens whose features came from the cache
    preprocess_ms: float  # preprocessing and video decoding
    vit_ms: float
    skipped_images: int = 0  # images and videos wholly inside the cached prefix: no ViT
    video_keys: list[str] = field(default_factory=list)
    decoded_videos: int = 0  # videos decoded (the others were cached or held)
    # a split prompt (split.py): its writers in prompt order (the lead's share first), and
    # the ranges other encoders write (the sender's `remote`)
    shares: list[Share] = field(default_factory=list)
    remote: list[RemoteRange] = field(default_factory=list)


@dataclass(frozen=True)
class VisionParts:
    """The model's side of the pipeline: the processor, the text embedding table (on the
    CPU: see EncodePipeline), one vision runner per device and the checkpoint's spec."""

    processor: object
    embed_tokens: torch.nn.Embedding
    runners: list[VisionRunner]
    spec: object


@dataclass(frozen=True)
class PipelineSettings:
    """How the pipeline runs (EncoderConfig's fields, resolved: from_config)."""

    pre_limits: PreprocessLimits
    cache_bytes: int
    patch_budget: int
    workers: int = 2
    client_share: int = 0  # FairPool's per-client share of the workers (0: fair split)
    chat_template: str | None = None
    video: VideoSettings | None = None
    video_chunk_patches: int = 0  # streamed rows: see EncoderConfig
    vit_stall_s: float = 60.0


@dataclass(frozen=True)
class EncodeHooks:
    """How one Encode's caller follows it: `on_state(EncodeState)` as the request moves
    from stage to stage; `announce(info)` returns the leading tokens the language side
    already holds (None: 0); `on_payload(payload, remote)`: stream it (see the module
    docstring), called once before the ViT runs with the payload whose rows then fill in
    (its `arrived` watermark) and the ranges other encoders write (None: the payload
    whole, in the result); `trace`: the span the stages' spans go under."""

    on_state: Callable[[EncodeState], None] = lambda _s: None
    announce: Callable[[PromptInfo], Awaitable[int]] | None = None
    on_payload: Callable[[PromptPayload, list[RemoteRange]], None] | None = None
    trace: tracing.Span = tracing.OFF


NO_HOOKS = EncodeHooks()


@dataclass
class _Encoding:
    """One Encode's state between the pipeline's steps (each step fills its part)."""

    job: EncodeJob
    hooks: EncodeHooks
    role: SplitRole
    budget: Budget
    prep: Prepared
    spans: list[ImageSpan]
    info: PromptInfo | None  # what the prompt announces (None: a helper's part)
    cached: int = 0  # the language side's cached prefix: the payload's first token
    rows: list[torch.Tensor] = field(default_factory=list)  # each medium's pad rows
    every: list[Unit] = field(default_factory=list)  # each image, each video's group
    need: list[int] = field(default_factory=list)  # media not wholly in the prefix
    feats: list = field(default_factory=list)  # cache hits, by medium (None: not one)
    misses: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    shares: list[Share] = field(default_factory=list)
    only: set[tuple[int, int]] | None = None  # the units this payload waits for
    work: list[Unit] = field(default_factory=list)  # the units this encoder runs
    stream: StreamedPayload | None = None
    remote: list[RemoteRange] = field(default_factory=list)

    @property
    def client(self) -> str:
        return self.job.client_id


class EncodePipeline:
    def __init__(self, model: VisionParts, settings: PipelineSettings,
                 metrics=None) -> None:
        spec = self.spec = model.spec
        # NOTE: the text embedding table lives on the CPU: its lookups run on the
        # preprocessing threads (merge.build_payload), which must run no GPU work: a sync
        # there could end a CUDA graph capture, and each lookup's copy back would wait on
        # the ViT's stream. A lookup is a row copy; its result is host memory anyway.
        embed_tokens = model.embed_tokens
        if embed_tokens.weight.device.type != "cpu":
            raise ValueError(f"the text embedding table must be on the CPU, not "
                             f"{embed_tokens.weight.device} (see EncodePipeline.from_config)")
        self.embed_tokens = embed_tokens
        self.preprocessor = Preprocessor(model.processor, settings.pre_limits,
                                         settings.chat_template, settings.video)
        self.rope = RopeRule(int(spec.spatial_merge_size), spec.arch in ("qwen3_vl", "qwen3_vl_moe"),
                             int(spec.tokens_per_second))
        self.num_deepstack = int(spec.num_deepstack)
        self.merge_model = MergeModel(embed_tokens, spec.image_token_id, spec.video_token_id,
                                      self.rope, self.num_deepstack)
        self.cache = EmbeddingCache(settings.cache_bytes)
        self.metrics = metrics
        self.scheduler = EncoderScheduler(model.runners, self.cache, settings.patch_budget,
                                          metrics, settings.vit_stall_s)
        if metrics:
            metrics.vit_graphs_recorded([r.stats for r in model.runners])
            metrics.vit_stall_seconds.set_function(self.scheduler.stalled_s)
        self.pool = FairPool(settings.workers, settings.client_share)
        self.video_chunk_patches = settings.video_chunk_patches

    @classmethod
    def from_config(cls, cfg, metrics=None) -> EncodePipeline:
        """Load the processor and one vision tower per device (no decoder weights)."""
        from transformers import AutoProcessor

        import tandem  # noqa: F401  (registers the image-only processors)
        from tandem.cpu_kernels import linear_compute_dtype, linear_kernels
        from tandem.models.checkpoint import resolve_model_path
        from tandem.models.split import load_vision_part

        path = resolve_model_path(cfg.model)
        processor = AutoProcessor.from_pretrained(path)
        devs = [resolve_device(d) for d in (cfg.devices or [cfg.device])]
        dtypes = [resolve_dtype(cfg.dtype, d) for d in devs]
        # bfloat16 on a CPU whose products run in float32 (`auto`: no AMX; the rule in
        # cpu_kernels.linear_compute_dtype): the tower loaded in float32 (the
        # checkpoint's values widened, its rotary tables computed in float32), its rows
        # rounded to bfloat16 once (VisionRunner's out_dtype); the text table, whose rows
        # the payload carries, stays in the model's dtype
        computes = [linear_compute_dtype(cfg.cpu_bf16_compute, d, dt)
                    for d, dt in zip(devs, dtypes, strict=True)]
        parts = [load_vision_part(path, c, d, embed_device="cpu")
                 for d, c in zip(devs, computes, strict=True)]  # the text table on the CPU: see __init__
        for p, d, dt, c in zip(parts, devs, dtypes, computes, strict=True):
            if c != dt:
                p.embed_tokens.to(dt)
                log.info("bfloat16 on a CPU: the vision "
                         "tower runs in float32 over the same weight values, its rows sent "
                         "in bfloat16 (cpu_bf16_compute=%s)", cfg.cpu_bf16_compute)
            kernels = linear_kernels(cfg.linear_backend, d, c)
            if kernels is not None:  # float32 on CPU: our packed linears, and the tower's
                pack_vision_tower(p.visual, kernels)  # other steps on the same kernels
        # NOTE: graph mode captures every graph here, at start-up, one runner at a time:
        # no pool or device thread exists yet, so no other GPU work runs during a capture.
        runners = [VisionRunner(p.visual, max_patches=cfg.cuda_graph_max_patches, out_dtype=dt)
                   for p, dt in zip(parts, dtypes, strict=True)]
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
                local_media_root=local_media_root(cfg.allowed_local_media_path),
            ),
            max_videos=cfg.max_videos_per_request,
            video=VideoLimits(
                max_video_bytes=cfg.max_video_bytes,
                max_video_duration_s=cfg.max_video_duration_s,
                max_video_frames=cfg.max_video_frames,
                max_video_decoded_pixels=cfg.max_video_decoded_pixels,
                max_video_decode_s=cfg.max_video_decode_s,
                max_video_tokens=cfg.max_video_tokens,
                video_decode_pixels_per_byte=cfg.video_decode_pixels_per_byte,
                video_decode_s_per_mib=cfg.video_decode_s_per_mib,
                video_decode_min_bytes=cfg.video_decode_min_bytes,
            ),
        )
        video = VideoSettings.from_checkpoint(path) if parts[0].spec.arch in ARCH_RULES else None
        return cls(
            VisionParts(processor, parts[0].embed_tokens, runners, parts[0].spec),
            PipelineSettings(
                limits,
                cfg.cache_bytes,
                cfg.patch_budget,
                workers=cfg.preprocess_workers,
                client_share=cfg.preprocess_client_share,
                chat_template=load_chat_template(cfg.chat_template),
                video=video,
                video_chunk_patches=cfg.video_chunk_patches,
                vit_stall_s=cfg.vit_stall_s,
            ),
            metrics,
        )

    def start(self) -> None:
        self.scheduler.start()

    async def stop(self) -> None:
        await self.scheduler.stop()
        self.pool.shutdown()

    async def encode(self, job: EncodeJob, hooks: EncodeHooks = NO_HOOKS,
                     role: SplitRole = ALONE) -> EncodeResult:
        """Encode `job`'s chat (its limits, tools, template; `client_id`: the caller's key
        for the fair share of the worker threads, "" = a client of its own; `deadline`
        bounds the preprocessing; `cache_salt`: the cache namespace, "" = shared, every
        medium's key is taken in, for the embedding cache and for the spans announced to
        the language side alike), followed by `hooks`. `role`: what this encoder is in a
        split prompt (split.py): alone, a lead that may hand ranges to helpers (each opened
        by the role's opener, which starts the helper's work at once), or a helper's
        share (MediaPart)."""
        left = math.inf if job.deadline is None else job.deadline - time.time()
        budget = Budget(time.monotonic() + left)
        try:
            return await self._encode(job, hooks, role, budget)
        finally:
            budget.stop.set()  # NOTE: a worker still on this request stops at its next check

    async def _encode(self, job: EncodeJob, hooks: EncodeHooks, role: SplitRole,
                      budget: Budget) -> EncodeResult:
        e = await self._prepare(job, hooks, role, budget)
        self._lookup(e)
        self._plan(e)
        if hooks.on_payload is not None or e.shares or e.only is not None:
            # built before any decode or ViT (streamed, split or a helper's part)
            await self._open_stream(e)
        if role.keeps_fetched():  # in the helpers' RangeStarts now (if any): not held longer
            for m in e.prep.media:
                if isinstance(m, PreparedImage):
                    m.fetched = None
        if e.stream is None:  # the whole payload at once: every missed medium whole
            todo = [VitInput(i, 0, groups_of(e.prep.media[i]), True) for i in e.misses]
        else:  # streamed rows: a video goes in runs of groups, each sent when it ends
            todo = vit_inputs(e.work, e.prep.media,
                              self.video_chunk_patches if hooks.on_payload is not None else 0)
        to_decode = sorted({v.medium for v in todo if isinstance(e.prep.media[v.medium],
                                                                  PlannedVideo)})
        t0 = time.perf_counter()
        decoded = await self._decode_for(e, to_decode)
        decode_s = time.perf_counter() - t0
        got = await self._run_vit(e, todo, decoded)
        payload = await self._merge(e)
        return EncodeResult(
            payload=payload,
            image_hashes=[im.hash for im in e.prep.images if im.prepared],
            cached_image_tokens=e.cached_tokens,
            preprocess_ms=(e.prep.preprocess_s + decode_s) * 1e3,
            vit_ms=got.vit_s * 1e3,
            skipped_images=len(e.spans) - len(e.need),
            video_keys=[v.key for v in e.prep.videos],
            decoded_videos=len(to_decode),
            shares=e.shares,
            remote=e.remote,
        )

    async def _prepare(self, job: EncodeJob, hooks: EncodeHooks, role: SplitRole,
                       budget: Budget) -> _Encoding:
        """Preprocess (a helper prepares only its share's images, their pixels and keys;
        the others' grids alone lay its rendering out: the lead's, or from their headers;
        a lead that may split keeps the bytes its URLs answered, for its helpers), then
        announce the prompt and lay its units out."""
        hooks.on_state(EncodeState.PREPROCESSING)
        queued_ns, trace = time.time_ns(), hooks.trace
        prep = await self.pool.run(job.client_id, self.preprocessor, job.messages, job.limits,
                                   job.tools, budget, job.template, role.pixels_for(),
                                   role.other_grids(), role.keeps_fetched())
        if trace.is_recording():
            _trace_preprocess(trace, prep, queued_ns)
        if job.cache_salt:
            for m in prep.media:
                in_namespace(m, job.cache_salt)
        if self.metrics:
            self.metrics.preprocess_seconds.observe(prep.preprocess_s, tracing.exemplar(trace))
        spans = media_spans(prep.input_ids, prep.media, self.spec.image_token_id,
                            self.spec.video_token_id)
        # what the prompt announces: a helper announces nothing (its spans name only its
        # share's media) and its payload carries no PromptInfo
        fixed = role.payload_start()
        info = None if fixed is not None else PromptInfo(prep.input_ids.tolist(), spans)
        e = _Encoding(job, hooks, role, budget, prep, spans, info, fixed or 0)
        if hooks.announce is not None and fixed is None:
            hooks.on_state(EncodeState.ANNOUNCING)
            span = tracing.start("encoder.announce", trace)
            e.cached = await hooks.announce(info)
            span.set_attribute("tandem.cached_prefix_tokens", e.cached)
            span.end()
        e.need = [i for i, sp in enumerate(spans) if sp.start + sp.length > e.cached]
        e.rows = media_rows(prep.input_ids, [m.num_tokens for m in prep.media],
                            self.spec.image_token_id, self.spec.video_token_id)
        e.every = units(prep.media, e.rows, e.cached)  # each image, each video's group
        # a helper: only the media of its share (checked against its own rendering)
        e.only = role.own_units(e.every, int(prep.input_ids.numel()), prep.media)
        if e.only is not None:
            e.need = [i for i in e.need if any(m == i for m, _ in e.only)]
        return e

    def _lookup(self, e: _Encoding) -> None:
        """Each needed medium looked up once (a counted hit or miss); only then are the
        missing videos decoded, so a cached video costs no decode."""
        e.feats = [None] * len(e.spans)
        for i in e.need:
            hit = self.scheduler.lookup(e.prep.media[i].key)
            if hit is not None:
                e.feats[i] = hit
                e.cached_tokens += e.prep.media[i].num_tokens
            else:
                e.misses.append(i)
        if e.need and e.hooks.trace.is_recording():
            tracing.start("encoder.cache", e.hooks.trace, attributes={
                "tandem.cache.hits": len(e.need) - len(e.misses),
                "tandem.cache.misses": len(e.misses),
                "tandem.cached_image_tokens": e.cached_tokens}).end()

    def _plan(self, e: _Encoding) -> None:
        """What this encoder runs: its misses, narrowed to its share of a split prompt."""
        e.work = [u for u in e.every if u.medium in e.misses]
        e.shares = e.role.plan(e.every, [u.patches if u.medium in e.misses else 0
                                         for u in e.every],
                               e.cached, int(e.prep.input_ids.numel()))
        if e.shares:  # the lead's share: the first; its payload waits for those alone
            # (the helpers' rows are theirs: `_fall_back` adds a lost one's back)
            e.only = {(u.medium, u.g0) for u in e.every[: e.shares[0].end_unit]}
        if e.only is not None:
            e.work = [u for u in e.work if (u.medium, u.g0) in e.only]
            # a writer of a split prompt counts the hits of its own units alone (a share
            # may hold a unit the lead had cached, which the helper counts or runs; a
            # video may lie in two shares), so the writers' counts add up
            e.cached_tokens = sum(_unit_tokens(e.prep.media[u.medium], u) for u in e.every
                                  if (u.medium, u.g0) in e.only and e.feats[u.medium] is not None)

    async def _open_stream(self, e: _Encoding) -> None:
        """The streamed payload, then each helper's range opened (it starts now, beside
        our own ViT), then the payload handed to `on_payload`."""
        e.stream = await self._start_stream(e)
        for sh in e.shares[1:]:
            mine = units_in(e.every, e.cached, sh.first_token, sh.end_token)
            h = e.role.open(sh, helper_start(e.prep.media, sh, e.cached),
                            functools.partial(self._fall_back, e, mine))
            e.remote.append(h.remote())
        if e.hooks.on_payload is not None:
            e.hooks.on_payload(e.stream.payload, e.remote)

    async def _decode_for(self, e: _Encoding, to_decode: list[int]) -> dict[int, PreparedVideo]:
        """The videos `to_decode` (media indices) decoded, by index."""
        if not to_decode:
            return {}
        e.hooks.on_state(EncodeState.DECODING)
        span = tracing.start("encoder.video_decode", e.hooks.trace,
                             attributes={"tandem.videos": len(to_decode)})
        try:
            videos = await self._decode([e.prep.media[i] for i in to_decode], e.client,
                                        e.budget)
        finally:
            span.end()
        return dict(zip(to_decode, videos, strict=True))

    async def _run_vit(self, e: _Encoding, todo: list[VitInput],
                       decoded: dict[int, PreparedVideo]) -> FeatureResult:
        """`todo` through the ViT: into the stream as each ends (streamed), else at once
        (placed into a split's or a part's payload)."""
        e.hooks.on_state(EncodeState.ENCODING)
        inputs = [_input(decoded.get(v.medium, e.prep.media[v.medium]), v) for v in todo]
        if e.stream is not None and e.hooks.on_payload is not None:
            got = await self._stream_vit(e.stream, todo, inputs, e.client)
        else:
            got = await self.scheduler.encode(inputs)
            if e.stream is not None:  # split or a part: whole, then placed
                await self.pool.run(e.client, _place_all, e.stream, todo, got.features)
        for v, f in zip(todo, got.features, strict=True):
            if v.whole:
                e.feats[v.medium] = f
        self._cache_assembled(todo, inputs, got.features, e.prep.media)
        if e.hooks.trace.is_recording():
            _trace_vit(e.hooks.trace, inputs, got.runs)
        return got

    async def _merge(self, e: _Encoding) -> PromptPayload:
        """The payload (the streamed one, or built now from the features), rows from the
        held prefix's end on."""
        e.hooks.on_state(EncodeState.MERGING)
        merge = tracing.start("encoder.merge", e.hooks.trace)
        prep = e.prep
        payload = e.stream.payload if e.stream is not None else await self.pool.run(
            e.client,
            lambda: build_payload(self.merge_model, prep.input_ids, prep.mm_token_type_ids,
                                  e.feats, _grids(prep.media)).rows_from(e.cached),
        )
        merge.end()
        if self.metrics:
            self.metrics.cache_bytes.set(self.cache.bytes_used)
            self.metrics.cache_evictions.set(self.cache.evictions)
        payload.info = e.info
        return payload

    async def _start_stream(self, e: _Encoding) -> StreamedPayload:
        """The streamed payload of rows [cached, L) with the cache hits already in (of the
        units `only`, when given: a helper's part, a split's lead)."""
        prep = e.prep

        def build() -> StreamedPayload:
            out = StreamedPayload(self.merge_model, prep.input_ids, prep.mm_token_type_ids,
                                  _grids(prep.media), e.rows, start=e.cached,
                                  groups=[groups_of(m) for m in prep.media], only=e.only)
            for i, f in enumerate(e.feats):
                if f is not None and out.needs(i):
                    out.place(i, f)
            return out

        stream = await self.pool.run(e.client, build)
        stream.payload.info = e.info
        return stream

    async def _stream_vit(self, stream: StreamedPayload, todo: list[VitInput], inputs: list,
                          client: str) -> FeatureResult:
        """The inputs through the ViT one at a time in prompt order, each spliced into
        the streamed payload (raising its watermark) as soon as its features exist."""
        res = FeatureResult(features=[])
        for v, m in zip(todo, inputs, strict=True):
            got = await self.scheduler.encode([m])
            res.features += got.features
            res.runs += got.runs
            res.vit_s += got.vit_s
            await self.pool.run(client, stream.place, v.medium, got.features[0], v.g0, v.g1)
        return res

    def _cache_assembled(self, todo: list[VitInput], inputs: list, features: list,
                         media: list) -> None:
        """A video this encoder ran whole but in runs of groups (streamed) is cached whole
        too, so a repeat of it is one hit, as without streaming."""
        parts: dict[int, list] = {}
        for v, f in zip(todo, features, strict=True):
            if not v.whole:
                parts.setdefault(v.medium, []).append((v.g0, v.g1, f))
        for i, ps in parts.items():
            ps.sort(key=lambda p: p[0])
            if ps[0][0] != 0 or ps[-1][1] != groups_of(media[i]) or any(
                    a[1] != b[0] for a, b in zip(ps, ps[1:], strict=False)):
                continue  # only some of its groups ran here (a split)
            fs = [f for *_, f in ps]
            self.cache.put(media[i].key, CachedFeatures(
                torch.cat([f.embeds for f in fs]),
                tuple(torch.cat([f.deepstack[k] for f in fs]) for k in range(len(fs[0].deepstack)))))

    async def _fall_back(self, e: _Encoding, share_units: list[Unit]) -> None:
        """A lost helper's units into the lead's own payload (its cache hits, the rest
        decoded and through the ViT), so the lead writes the rest of its range (split.py).
        The payload waits for them again first, so its rows there are never taken for
        final while zero. Its own budget: the request's ended with its encode."""
        budget, stream, prep, feats = Budget(e.budget.deadline), e.stream, e.prep, e.feats
        try:
            stream.expect({(u.medium, u.g0) for u in share_units})
            hits = [i for i in dict.fromkeys(u.medium for u in share_units)
                    if feats[i] is not None and stream.needs(i)]
            if hits:
                await self.pool.run(e.client, lambda: [stream.place(i, feats[i]) for i in hits])
            todo = vit_inputs([u for u in share_units if stream.needs(u.medium, u.g0)],
                              prep.media)
            videos = sorted({v.medium for v in todo
                             if isinstance(prep.media[v.medium], PlannedVideo)})
            decoded = dict(zip(videos, await self._decode([prep.media[i] for i in videos],
                                                          e.client, budget), strict=True))
            got = await self.scheduler.encode(
                [_input(decoded.get(v.medium, prep.media[v.medium]), v) for v in todo])
            await self.pool.run(e.client, _place_all, stream, todo, got.features)
        finally:
            budget.stop.set()

    async def _decode(self, videos: list[PlannedVideo], client: str,
                      budget: Budget) -> list[PreparedVideo]:
        """Decode `videos` at once, each a job in `client`'s share of the pool; the first
        failure cancels the jobs not started (started ones stop at their budget's end)."""
        jobs = [asyncio.ensure_future(self.pool.run(client, self.preprocessor.decode, v, budget))
                for v in videos]
        try:
            out = await asyncio.gather(*jobs)
        except BaseException:
            for j in jobs:
                j.cancel()
            raise
        if self.metrics:
            for v in out:
                self.metrics.video_decoded(v.frames_decoded, v.decode_s + v.process_s)
        return out

    def load_figures(self) -> dict:
        return {
            "queued_patches": self.scheduler.queued_patches,
            "vit_patches": self.scheduler.vit_patches,
            "cache_bytes": self.cache.bytes_used,
            "cache_capacity_bytes": self.cache.capacity,
        }


def _patches(m) -> int:
    t, h, w = m.grid
    return t * h * w


def _place_all(stream: StreamedPayload, todo: list[VitInput], features: list) -> None:
    for v, f in zip(todo, features, strict=True):
        stream.place(v.medium, f, v.g0, v.g1)


def _input(m, v: VitInput):
    """What the ViT runs for `v`: the medium itself when whole, else its groups' slice."""
    return m if v.whole else VideoSlice(m, v.g0, v.g1)


def _unit_tokens(m, u: Unit) -> int:
    """The prompt tokens of unit `u` of medium `m` (its temporal groups' share)."""
    return m.num_tokens * (u.g1 - u.g0) // groups_of(m)


def _grids(media: list) -> list[VisionGrid]:
    """Each medium's place in the MRoPE layout (known before any ViT: from its grid)."""
    return [VisionGrid(MediaKind.IMAGE, m.grid) if isinstance(m, PreparedImage)
            else VisionGrid(MediaKind.VIDEO, m.grid, m.plan.second_per_grid_t)
            for m in media]


def _trace_preprocess(trace: tracing.Span, prep, queued_ns: int) -> None:
    """encoder.queue and encoder.preprocess (with encoder.fetch) from the preprocessing's
    own clock: it ended now and lasted `prep.preprocess_s`."""
    end = time.time_ns()
    begin = max(queued_ns, end - int(prep.preprocess_s * 1e9))
    tracing.start("encoder.queue", trace, start_ns=queued_ns).end(begin)
    span = tracing.start("encoder.preprocess", trace, start_ns=begin, attributes={
        "tandem.images": len(prep.images), "tandem.videos": len(prep.videos),
        tracing.INPUT_TOKENS: int(prep.input_ids.numel())})
    if prep.media:
        tracing.start("encoder.fetch", span, start_ns=begin, attributes={
            "tandem.media": len(prep.media)}).end(begin + int(prep.fetch_s * 1e9))
    span.end(end)


def _trace_vit(trace: tracing.Span, inputs: list, runs: list) -> None:
    """Per ViT input: its wait for a batch and the batch it ran in (VitRun)."""
    for m, run in zip(inputs, runs, strict=True):
        if run is None:  # cached meanwhile: no ViT
            continue
        tracing.start("encoder.vit_queue", trace, start_ns=run.queued_ns).end(run.start_ns)
        tracing.start("encoder.vit_batch", trace, start_ns=run.start_ns, attributes={
            "tandem.vit.batch_inputs": run.batch_inputs,
            "tandem.vit.batch_patches": run.batch_patches,
            "tandem.vit.patches": m.num_patches, "tandem.vit.shared": run.shared,
        }).end(run.end_ns)


def media_spans(input_ids: torch.Tensor, media: list[PreparedImage | PlannedVideo],
                image_token_id: int, video_token_id: int) -> list[ImageSpan]:
    """Each image's and video's tokens, in prompt order, named by its cache key: from its
    first pad to its last (a grid-only image, one a helper does not run, has no key: "",
    a span never announced). The preprocessor expands an image's placeholder into
    `num_tokens` consecutive pads, a video's into its pads (for Qwen3-VL with each temporal
    group's timestamp text and vision start/end tokens between them)."""
    ids = input_ids.tolist()
    pads = [i for i, t in enumerate(ids) if t in (image_token_id, video_token_id)]
    out, k = [], 0
    for m in media:
        image = isinstance(m, PreparedImage)
        mine = pads[k : k + m.num_tokens]
        if len(mine) < m.num_tokens or any(
                ids[p] != (image_token_id if image else video_token_id) for p in mine):
            raise ValueError(f"medium {len(out)}'s pad tokens are not where the media put them")
        start, end = mine[0], mine[-1] + 1
        if image and end - start != m.num_tokens:
            raise ValueError(f"image {len(out)}'s pad tokens are not contiguous")
        out.append(ImageSpan(start, end - start,
                             m.key if not image or m.prepared else ""))
        k += m.num_tokens
    if k != len(pads):
        raise ValueError(f"{len(pads)} pad tokens for {k} image and video tokens")
    return out
