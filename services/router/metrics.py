"""Prometheus metrics of one router: one set per registry (`tandem.metrics`), the router's
own, which its HTTP app renders on /metrics (so tests can build many routers)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = self.registry
        self.requests = Counter(
            "tandem_router_requests", "Chat requests by front-end and outcome.",
            ["api", "outcome"], registry=r,
        )
        self.inflight = Gauge("tandem_router_inflight", "Requests in flight.", registry=r)
        self.rejected = Counter(
            "tandem_router_rejected", "Requests refused by admission control (429).", registry=r
        )
        self.ttft = Histogram(
            "tandem_router_ttft_seconds", "Time to first token.", buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "tandem_router_request_seconds", "Request latency, start to last token.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.encoder_retries = Counter(
            "tandem_router_encoder_retries", "Encodes retried on another encoder.", registry=r
        )
        self.request_retries = Counter(
            "tandem_router_request_retries", "Requests retried as a whole before any output.",
            registry=r,
        )
        self.cached_image_tokens = Counter(
            "tandem_router_cached_image_tokens", "Image tokens served from encoder caches.",
            registry=r,
        )
        self.encoder_bypassed = Counter(
            "tandem_router_encoder_bypassed", "Text-only chats sent straight to a language "
            "instance (no encoder).", registry=r,
        )
        self.cached_prompt_tokens = Counter(
            "tandem_router_cached_prompt_tokens",
            "Prompt tokens served from language instances' prefix caches.", registry=r,
        )
        self.healthy = Gauge(
            "tandem_router_healthy_instances", "Healthy instances per tier.", ["tier"], registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
