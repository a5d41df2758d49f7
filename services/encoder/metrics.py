"""Prometheus metrics of the encode tier: one set per registry (`tandem.metrics`).

tandem_encoder_images_encoded_total     images run through the ViT
tandem_encoder_patches_total            vision patches run through the ViT
tandem_encoder_vit_seconds              ViT batch time (histogram)
tandem_encoder_preprocess_seconds       per-request preprocessing time (histogram)
tandem_encoder_cache_hits_total / _cache_misses_total / _cache_evictions_total
tandem_encoder_cache_bytes              bytes held by the embedding cache
tandem_encoder_queue_patches            patches waiting for the ViT
tandem_encoder_pending_patches          patches waiting for or in the ViT: the tier's scaling
                                        signal (0 when idle; docs/deploy.md "Autoscaling")
tandem_encoder_queued_requests          requests accepted and not yet answered
tandem_encoder_vit_stall_seconds        how long the most stuck device's ViT call has gone
                                        without progress (0 while idle); past vit_stall_s the
                                        encoder is out of service (scheduler.py)
tandem_encoder_batch_images             images per ViT batch (histogram)
tandem_encoder_videos_decoded_total     videos decoded (a cached or held one is not)
tandem_encoder_video_frames_decoded_total  frames decoded from them
tandem_encoder_video_decode_seconds     one video's decode + patchify time (histogram)
tandem_encoder_requests_total{code}     finished Encode calls by gRPC code name
tandem_encoder_vit_graphs               ViT CUDA graphs captured at start-up (all devices)
tandem_encoder_vit_graph_capture_failures_total  captures that failed (those buckets run
                                        eagerly; each is logged once)
tandem_model_info{model_name,tier}      the served model (`tandem.metrics.ModelInfo`)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem.metrics import MirroredCounter, model_info

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class EncoderMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        kw = {"registry": registry}
        p = "tandem_encoder_"
        self.images = Counter(p + "images_encoded", "Images run through the ViT.", **kw)
        self.patches = Counter(p + "patches", "Vision patches run through the ViT.", **kw)
        self.vit_seconds = Histogram(p + "vit_seconds", "ViT batch time.", buckets=_SECONDS, **kw)
        self.preprocess_seconds = Histogram(
            p + "preprocess_seconds", "Preprocessing time per request.", buckets=_SECONDS, **kw
        )
        self.cache_hits = Counter(p + "cache_hits", "Embedding cache hits.", **kw)
        self.cache_misses = Counter(p + "cache_misses", "Embedding cache misses.", **kw)
        # the cache keeps the running total: `cache_evictions.set(cache.evictions)`
        self.cache_evictions = MirroredCounter(
            Counter(p + "cache_evictions", "Embedding cache evictions.", **kw))
        self.cache_bytes = Gauge(p + "cache_bytes", "Bytes held by the embedding cache.", **kw)
        self.queue_patches = Gauge(p + "queue_patches", "Patches waiting for the ViT.", **kw)
        self.pending_patches = Gauge(p + "pending_patches", "Patches waiting for or in the "
                                     "ViT (the encoder tier's scaling signal).", **kw)
        self.queued_requests = Gauge(p + "queued_requests", "Requests in progress.", **kw)
        # read at each scrape: `vit_stall_seconds.set_function(scheduler.stalled_s)`
        self.vit_stall_seconds = Gauge(
            p + "vit_stall_seconds", "How long the most stuck device's ViT call has gone "
            "without progress (0 while idle).", **kw)
        self.batch_images = Histogram(
            p + "batch_images",
            "Images per ViT batch.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            **kw,
        )
        self.requests = Counter(p + "requests", "Finished Encode calls.", ["code"], **kw)
        self.videos_decoded = Counter(p + "videos_decoded", "Videos decoded.", **kw)
        self.video_frames_decoded = Counter(
            p + "video_frames_decoded", "Frames decoded from videos.", **kw)
        self.video_decode_seconds = Histogram(
            p + "video_decode_seconds", "One video's decode and patchify time.",
            buckets=_SECONDS + (30, 60), **kw)
        self.vit_graphs = Gauge(p + "vit_graphs", "ViT CUDA graphs captured at start-up.", **kw)
        self.vit_graph_capture_failures = Counter(
            p + "vit_graph_capture_failures",
            "ViT CUDA graph captures that failed at start-up (their buckets run eagerly).", **kw)

    def serving(self, model_name: str) -> None:
        model_info(self.registry, "encoder", model_name)

    def cache(self, hit: bool) -> None:
        (self.cache_hits if hit else self.cache_misses).inc()

    def video_decoded(self, frames: int, seconds: float) -> None:
        self.videos_decoded.inc()
        self.video_frames_decoded.inc(frames)
        self.video_decode_seconds.observe(seconds)

    def vit_graphs_recorded(self, stats: list) -> None:
        """At start-up: the runners' `GraphStats` (captures are made once, never again)."""
        self.vit_graphs.set(sum(s.captured for s in stats))
        self.vit_graph_capture_failures.inc(sum(s.failed for s in stats))

    def batch(self, images: int, patches: int, seconds: float) -> None:
        self.images.inc(images)
        self.patches.inc(patches)
        self.vit_seconds.observe(seconds)
        self.batch_images.observe(images)
