"""The encode path without the wire: chat -> preprocess -> cache / ViT -> merged payload.

    EncodePipeline.encode(messages, limits, announce, client, deadline)
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

Streamed (`on_payload` given: `--transfer.stream`, DESIGN "Streamed rows"): after the
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
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from tandem import tracing
from tandem.chat import ChatError, Limits, Message, TemplateOptions, load_chat_template
from tandem.devices import resolve_device, resolve_dtype
from tandem.services.encoder.cache import CachedFeatures, EmbeddingCache
from tandem.services.encoder.fair_pool import FairPool
from tandem.services.encoder.images import Budget, ImageLimits, local_media_root
from tandem.services.encoder.merge import (
    MediaKind,
    RopeRule,
    StreamedPayload,
    VisionGrid,
    build_payload,
    media_rows,
)
from tandem.services.encoder.preprocess import (
    PreparedImage,
    PreprocessLimits,
    Preprocessor,
    in_namespace,
)
from tandem.services.encoder.scheduler import EncoderScheduler, FeatureResult
from tandem.services.encoder.split import HelperRange, Share, plan_split, units_in, with_media
from tandem.services.encoder.units import Unit, VideoSlice, VitInput, groups_of, units, vit_inputs
from tandem.services.encoder.video import PlannedVideo, PreparedVideo, VideoLimits
from tandem.services.encoder.video_rules import ARCH_RULES, VideoSettings
from tandem.services.encoder.vit_kernels import pack_vision_tower
from tandem.services.encoder.vit_runner import VisionRunner
from tandem.transfer.payload import ImageSpan, PromptInfo, PromptPayload
from tandem.transfer.sender_room import RemoteRange


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
class MediaPart:
    """A helper's share of another encoder's prompt (EncodeRange): media [first_media,
    end_media) into payload tokens [first_token, end_token), the payload starting at
    prompt token `payload_start` (the language side's cached prefix); `other_grids`: the
    lead's grids of the chat's images outside the share, prompt order (RangeStart's
    image_grids: those images are not fetched; None: a lead that sent none, their headers
    are read)."""

    payload_start: int
    first_media: int
    end_media: int
    first_token: int
    end_token: int
    other_grids: tuple[tuple[int, int, int], ...] | None = None
    # the lead's cache keys of media [first_media, end_media) (RangeStart.media_keys; ():
    # a lead from before them, not checked)
    keys: tuple[str, ...] = ()


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
        video: VideoSettings | None = None,
        video_chunk_patches: int = 0,
        vit_stall_s: float = 60.0,
    ) -> None:
        self.spec = spec
        # NOTE: the text embedding table lives on the CPU: its lookups run on the
        # preprocessing threads (merge.build_payload), which must run no GPU work: a sync
        # there could end a CUDA graph capture, and each lookup's copy back would wait on
        # the ViT's stream. A lookup is a row copy; its result is host memory anyway.
        if embed_tokens.weight.device.type != "cpu":
            raise ValueError(f"the text embedding table must be on the CPU, not "
                             f"{embed_tokens.weight.device} (see EncodePipeline.from_config)")
        self.embed_tokens = embed_tokens
        self.preprocessor = Preprocessor(processor, pre_limits, chat_template, video)
        self.rope = RopeRule(int(spec.spatial_merge_size), spec.arch in ("qwen3_vl", "qwen3_vl_moe"),
                             int(spec.tokens_per_second))
        self.cache = EmbeddingCache(cache_bytes)
        self.metrics = metrics
        self.scheduler = EncoderScheduler(runners, self.cache, patch_budget, metrics,
                                          vit_stall_s)
        if metrics:
            metrics.vit_graphs_recorded([r.stats for r in runners])
            metrics.vit_stall_seconds.set_function(self.scheduler.stalled_s)
        self.pool = FairPool(workers, client_share)
        self.num_deepstack = int(spec.num_deepstack)
        self.video_chunk_patches = video_chunk_patches  # streamed rows: see EncoderConfig

    @classmethod
    def from_config(cls, cfg, metrics=None) -> EncodePipeline:
        """Load the processor and one vision tower per device (no decoder weights)."""
        from transformers import AutoProcessor

        import tandem  # noqa: F401  (registers the image-only processors)
        from tandem.cpu_kernels import linear_kernels
        from tandem.models.checkpoint import resolve_model_path
        from tandem.models.split import load_vision_part

        path = resolve_model_path(cfg.model)
        processor = AutoProcessor.from_pretrained(path)
        devs = [resolve_device(d) for d in (cfg.devices or [cfg.device])]
        parts = [load_vision_part(path, resolve_dtype(cfg.dtype, d), d, embed_device="cpu")
                 for d in devs]  # the text table on the CPU: see __init__
        for p, d in zip(parts, devs, strict=True):  # float32 on CPU: our packed linears,
            kernels = linear_kernels(cfg.linear_backend, d, resolve_dtype(cfg.dtype, d))
            if kernels is not None:  # and the tower's other steps on the same kernels
                pack_vision_tower(p.visual, kernels)
        # NOTE: graph mode captures every graph here, at start-up, one runner at a time:
        # no pool or device thread exists yet, so no other GPU work runs during a capture.
        runners = [VisionRunner(p.visual, max_patches=cfg.cuda_graph_max_patches) for p in parts]
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
            video,
            cfg.video_chunk_patches,
            cfg.vit_stall_s,
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
        cache_salt: str = "",
        trace: tracing.Span = tracing.OFF,
        on_payload: Callable[[PromptPayload, list[RemoteRange]], None] | None = None,
        helpers: list[str] = (),
        open_helper: Callable[[Share, int, list[tuple[int, int, int]], list[str],
                               dict[int, bytes]], HelperRange] | None = None,
        part: MediaPart | None = None,
    ) -> EncodeResult:
        """`on_state(EncodeState)` is called as the request moves from stage to stage;
        `announce(info)` returns the leading tokens the language side already holds.
        `client` is the caller's key for the fair share of the worker threads ("" = a
        client of its own); `deadline` (Unix seconds) bounds the preprocessing;
        `template`: how the chat template renders the chat; `cache_salt`: the cache
        namespace (the router's; "" = shared) every medium's key is taken in, for the
        embedding cache and for the spans announced to the language side alike; `trace`:
        the span the stages' spans go under; `on_payload(payload)`: stream it (see the
        module docstring), called once before the ViT runs with the payload whose rows
        then fill in (its `arrived` watermark) and the ranges other encoders write;
        `helpers`: encoders that may take ranges of the prompt (split.py), each opened
        with `open_helper(share, payload_start, grids, keys, fetched)` (the servicer's; it
        starts the helper's work at once; `grids`: those of the images outside the share,
        prompt order, so the helper need not fetch them; `keys`: the share's media's cache
        keys, which the helper checks its own against; `fetched`: the bytes of the share's
        images that came from http(s) URLs, by media index, for the helper to take instead
        of fetching them again); `part`: encode only this share of the
        chat (a helper's EncodeRange: no announce, only these media's images prepared and
        run, the other images grid-only, the payload's other rows left zero, no
        PromptInfo)."""
        left = math.inf if deadline is None else deadline - time.time()
        budget = Budget(time.monotonic() + left)
        try:
            return await self._encode(messages, limits, on_state, announce, tools, client,
                                      budget, template, cache_salt, trace,
                                      on_payload, list(helpers), open_helper,
                                      part)  # fmt: skip
        finally:
            budget.stop.set()  # NOTE: a worker still on this request stops at its next check

    async def _encode(self, messages, limits, on_state, announce, tools, client,
                      budget: Budget, template: TemplateOptions | None,
                      cache_salt: str, trace: tracing.Span,
                      on_payload=None, helpers: list[str] = (), open_helper=None,
                      part: MediaPart | None = None) -> EncodeResult:  # fmt: skip
        step = on_state or (lambda _s: None)
        step(EncodeState.PREPROCESSING)
        queued_ns = time.time_ns()
        # a helper prepares only its share's images (their pixels and keys); the others'
        # grids alone lay its rendering out (the lead's, or from their headers)
        pixels_for = None if part is None else range(part.first_media, part.end_media)
        # a lead that may split keeps the bytes its URLs answered, for its helpers
        keep_fetched = bool(helpers) and open_helper is not None and part is None
        prep = await self.pool.run(client, self.preprocessor, messages, limits, tools, budget,
                                   template, pixels_for,
                                   None if part is None else part.other_grids, keep_fetched)
        if trace.is_recording():
            _trace_preprocess(trace, prep, queued_ns)
        if cache_salt:
            for m in prep.media:
                in_namespace(m, cache_salt)
        if self.metrics:
            self.metrics.preprocess_seconds.observe(prep.preprocess_s, tracing.exemplar(trace))
        spans = media_spans(prep.input_ids, prep.media, self.spec.image_token_id,
                            self.spec.video_token_id)
        # what the prompt announces: a helper announces nothing (its spans name only its
        # share's media) and its payload carries no PromptInfo
        info = None if part is not None else PromptInfo(prep.input_ids.tolist(), spans)
        cached = 0 if part is None else part.payload_start
        if announce is not None and part is None:
            step(EncodeState.ANNOUNCING)
            span = tracing.start("encoder.announce", trace)
            cached = await announce(info)
            span.set_attribute("tandem.cached_prefix_tokens", cached)
            span.end()
        need = [i for i, sp in enumerate(spans) if sp.start + sp.length > cached]
        rows = media_rows(prep.input_ids, [m.num_tokens for m in prep.media],
                          self.spec.image_token_id, self.spec.video_token_id)
        every = units(prep.media, rows, cached)  # each image, each video's temporal group
        only = None  # the units this payload waits for (a helper's, a split's lead's)
        if part is not None:  # a helper: only the media of its share
            _check_part(part, every, int(prep.input_ids.numel()))
            _check_keys(part, prep.media)
            only = {(u.medium, u.g0)
                    for u in units_in(every, cached, part.first_token, part.end_token)}
            need = [i for i in need if any(m == i for m, _ in only)]
        # Each needed medium is looked up once (a counted hit or miss); only then are the
        # missing videos decoded, so a cached video costs no decode.
        feats: list = [None] * len(spans)
        cached_tokens, misses = 0, []
        for i in need:
            hit = self.scheduler.lookup(prep.media[i].key)
            if hit is not None:
                feats[i] = hit
                cached_tokens += prep.media[i].num_tokens
            else:
                misses.append(i)
        if need and trace.is_recording():
            tracing.start("encoder.cache", trace, attributes={
                "tandem.cache.hits": len(need) - len(misses), "tandem.cache.misses": len(misses),
                "tandem.cached_image_tokens": cached_tokens}).end()
        # what this encoder runs: its misses, narrowed to its share of a split prompt
        work = [u for u in every if u.medium in misses]
        shares: list[Share] = []
        if helpers and open_helper is not None and part is None:
            shares = with_media(plan_split(
                [u.first_pad for u in every], [u.patches if u.medium in misses else 0
                                               for u in every],
                cached, int(prep.input_ids.numel()) - cached, helpers), every)
            if shares:  # the lead's share: the first; its payload waits for those alone
                # (the helpers' rows are theirs: `_fall_back` adds a lost one's back)
                only = {(u.medium, u.g0) for u in every[: shares[0].end_unit]}
        if only is not None:
            work = [u for u in work if (u.medium, u.g0) in only]
            # a writer of a split prompt counts the hits of its own units alone (a share
            # may hold a unit the lead had cached, which the helper counts or runs; a
            # video may lie in two shares), so the writers' counts add up
            cached_tokens = sum(_unit_tokens(prep.media[u.medium], u) for u in every
                                if (u.medium, u.g0) in only and feats[u.medium] is not None)
        remote: list[RemoteRange] = []
        stream = None
        if on_payload is not None or shares or part is not None:
            # built before any decode or ViT (streamed, split or a helper's part)
            stream = await self._start_stream(prep, info, cached, feats, client, rows, only)
            for sh in shares[1:]:  # each helper starts now, beside our own ViT
                h = open_helper(sh, cached, grids_outside(prep.media, sh.first_media,
                                                          sh.end_media),
                                [m.key for m in prep.media[sh.first_media:sh.end_media]],
                                {k: m.fetched for k, m in enumerate(
                                    prep.media[sh.first_media:sh.end_media], sh.first_media)
                                 if isinstance(m, PreparedImage) and m.fetched})
                h.fall_back = functools.partial(
                    self._fall_back, stream, prep, units_in(every, cached, sh.first_token,
                                                            sh.end_token),
                    feats, client, budget.deadline)
                remote.append(h.remote())
            if on_payload is not None:
                on_payload(stream.payload, remote)
        if keep_fetched:  # in the helpers' RangeStarts now (if any): not held any longer
            for m in prep.media:
                if isinstance(m, PreparedImage):
                    m.fetched = None
        if stream is None:  # the whole payload at once: every missed medium whole
            todo = [VitInput(i, 0, groups_of(prep.media[i]), True) for i in misses]
        else:  # streamed rows: a video goes in runs of groups, each sent when it ends
            todo = vit_inputs(work, prep.media,
                              self.video_chunk_patches if on_payload is not None else 0)
        to_decode = sorted({v.medium for v in todo if isinstance(prep.media[v.medium],
                                                                  PlannedVideo)})
        t0 = time.perf_counter()
        decoded: dict[int, PreparedVideo] = {}
        if to_decode:
            step(EncodeState.DECODING)
            span = tracing.start("encoder.video_decode", trace,
                                 attributes={"tandem.videos": len(to_decode)})
            try:
                videos = await self._decode([prep.media[i] for i in to_decode], client, budget)
            finally:
                span.end()
            decoded = dict(zip(to_decode, videos, strict=True))
        decode_s = time.perf_counter() - t0
        step(EncodeState.ENCODING)
        inputs = [_input(decoded.get(v.medium, prep.media[v.medium]), v) for v in todo]
        if stream is not None and on_payload is not None:
            got = await self._stream_vit(stream, todo, inputs, client)
        else:
            got = await self.scheduler.encode(inputs)
            if stream is not None:  # split or a part: whole, then placed
                await self.pool.run(client, _place_all, stream, todo, got.features)
        for v, f in zip(todo, got.features, strict=True):
            if v.whole:
                feats[v.medium] = f
        self._cache_assembled(todo, inputs, got.features, prep.media)
        if trace.is_recording():
            _trace_vit(trace, inputs, got.runs)
        step(EncodeState.MERGING)
        merge = tracing.start("encoder.merge", trace)
        items = _grids(prep.media)
        payload = stream.payload if stream is not None else await self.pool.run(
            client,
            lambda: build_payload(
                self.embed_tokens,
                prep.input_ids,
                prep.mm_token_type_ids,
                feats,
                items,
                image_token_id=self.spec.image_token_id,
                video_token_id=self.spec.video_token_id,
                rule=self.rope,
                num_deepstack=self.num_deepstack,
            ).rows_from(cached),
        )
        merge.end()
        if self.metrics:
            self.metrics.cache_bytes.set(self.cache.bytes_used)
            self.metrics.cache_evictions.set(self.cache.evictions)
        payload.info = info
        return EncodeResult(
            payload=payload,
            image_hashes=[im.hash for im in prep.images if im.prepared],
            cached_image_tokens=cached_tokens,
            preprocess_ms=(prep.preprocess_s + decode_s) * 1e3,
            vit_ms=got.vit_s * 1e3,
            skipped_images=len(spans) - len(need),
            video_keys=[v.key for v in prep.videos],
            decoded_videos=len(to_decode),
            shares=shares,
            remote=remote,
        )

    async def _start_stream(self, prep, info: PromptInfo | None, cached: int, feats: list,
                            client: str, rows: list[torch.Tensor],
                            only: set[tuple[int, int]] | None = None) -> StreamedPayload:
        """The streamed payload of rows [cached, L) with the cache hits already in (of the
        units `only`, when given: a helper's part)."""

        def build() -> StreamedPayload:
            out = StreamedPayload(self.embed_tokens, prep.input_ids, prep.mm_token_type_ids,
                                  _grids(prep.media), rows, start=cached, rule=self.rope,
                                  num_deepstack=self.num_deepstack,
                                  groups=[groups_of(m) for m in prep.media], only=only)
            for i, f in enumerate(feats):
                if f is not None and out.needs(i):
                    out.place(i, f)
            return out

        stream = await self.pool.run(client, build)
        stream.payload.info = info
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

    async def _fall_back(self, stream: StreamedPayload, prep, share_units: list[Unit],
                         feats: list, client: str, deadline: float) -> None:
        """A lost helper's units into the lead's own payload (its cache hits `feats`, the
        rest decoded and through the ViT), so the lead writes the rest of its range
        (split.py). The payload waits for them again first, so its rows there are never
        taken for final while zero."""
        budget = Budget(deadline)
        try:
            stream.expect({(u.medium, u.g0) for u in share_units})
            hits = [i for i in dict.fromkeys(u.medium for u in share_units)
                    if feats[i] is not None and stream.needs(i)]
            if hits:
                await self.pool.run(client, lambda: [stream.place(i, feats[i]) for i in hits])
            todo = vit_inputs([u for u in share_units if stream.needs(u.medium, u.g0)],
                              prep.media)
            videos = sorted({v.medium for v in todo
                             if isinstance(prep.media[v.medium], PlannedVideo)})
            decoded = dict(zip(videos, await self._decode([prep.media[i] for i in videos],
                                                          client, budget), strict=True))
            got = await self.scheduler.encode(
                [_input(decoded.get(v.medium, prep.media[v.medium]), v) for v in todo])
            await self.pool.run(client, _place_all, stream, todo, got.features)
        finally:
            budget.stop.set()

    async def _decode(self, videos: list[PlannedVideo], client: str,
                      budget: Budget) -> list[PreparedVideo]:
        """Decode `videos` at once, each a job in `client`'s share of the pool; the first
        failure cancels the jobs not started (started ones stop at their budget's end)."""
        jobs = [asyncio.ensure_future(self.pool.run(client, self.preprocessor.decode, v, budget))
                for v in videos]  # fmt: skip
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


def _check_part(part: MediaPart, every: list[Unit], prompt_tokens: int) -> None:
    """A helper's own rendering of the chat must put the lead's share where the lead said
    (the same chat, template and processor): its edges where units start, at least one
    unit in it, its units of media [first_media, end_media) from the first to the last
    (the media it prepared). A mismatch is a misconfigured tier."""
    if not 0 <= part.payload_start < prompt_tokens:
        raise ChatError(f"range: payload_start {part.payload_start} is outside the prompt's "
                        f"{prompt_tokens} tokens", "range")
    total = prompt_tokens - part.payload_start
    starts = {u.first_pad - part.payload_start for u in every}
    ok = (0 < part.first_token < part.end_token <= total and part.first_token in starts
          and (part.end_token == total or part.end_token in starts))
    if not ok:
        raise ChatError(f"range: tokens [{part.first_token}, {part.end_token}) of {total} do "
                        f"not start and end where this encoder's units (images, video "
                        f"groups) start", "range")
    media = [u.medium for u in units_in(every, part.payload_start, part.first_token,
                                        part.end_token)]
    if (media[0], media[-1] + 1) != (part.first_media, part.end_media):
        raise ChatError(f"range: tokens [{part.first_token}, {part.end_token}) hold media "
                        f"[{media[0]}, {media[-1] + 1}) here, not [{part.first_media}, "
                        f"{part.end_media})", "range")


def grids_outside(media: list, first_media: int, end_media: int) -> list[tuple[int, int, int]]:
    """The grids of the images outside media [first_media, end_media), prompt order: what a
    helper of that share is sent (RangeStart.image_grids; Preprocessor's `other_grids`)."""
    return [m.grid for k, m in enumerate(media)
            if isinstance(m, PreparedImage) and not first_media <= k < end_media]


def _unit_tokens(m, u: Unit) -> int:
    """The prompt tokens of unit `u` of medium `m` (its temporal groups' share)."""
    return m.num_tokens * (u.g1 - u.g0) // groups_of(m)


def _check_keys(part: MediaPart, media: list) -> None:
    """A helper's media of its share must be the lead's (the same cache keys): a URL is
    fetched again here and may answer differently (a signed URL expired, a random-image
    endpoint); their rows would then go out under the key the lead announced, and the
    language side's prefix cache would serve them to another chat. ABORTED: this range
    only (the lead encodes it itself)."""
    if not part.keys:
        return
    mine = [m.key for m in media[part.first_media:part.end_media]]
    if len(part.keys) != len(mine):
        raise ChatError(f"media_keys: {len(part.keys)} keys for the range's {len(mine)} media",
                        "media_keys")
    for i, (theirs, ours) in enumerate(zip(part.keys, mine, strict=True)):
        if theirs != ours:
            raise ChatError(f"medium {part.first_media + i}: its content here differs from "
                            "the lead's (a URL that answered differently)", "media_keys",
                            "ABORTED")


def _grids(media: list) -> list[VisionGrid]:
    """Each medium's place in the MRoPE layout (known before any ViT: from its grid)."""
    return [VisionGrid(MediaKind.IMAGE, m.grid) if isinstance(m, PreparedImage)
            else VisionGrid(MediaKind.VIDEO, m.grid, m.plan.second_per_grid_t)
            for m in media]  # fmt: skip


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
