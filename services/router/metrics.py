"""Prometheus metrics of one router: one set per registry (`tandem.metrics`), the router's
own, which its HTTP app renders on /metrics (so tests can build many routers).

The latency histograms (ttft, request seconds) carry the request's trace id as an exemplar
when it is traced and sampled (tandem/tracing.py); /metrics serves them in OpenMetrics to
a scraper that asks for it.

Every request is counted once, when its answer has ended:

    tandem_router_requests_total{api, outcome}     chat / completion requests that reached
        a front end's handler: outcome "ok" or the error code in lower case; a stream is
        counted at its end (openai/app.py, _sse): "ok", the code it failed with after output,
        or "cancelled" when the client left first
    tandem_router_http_requests_total{handler, code}   every HTTP answer by route and status
        code (`HttpStatusCounter`), those refused before any handler included (401, 413,
        400 for a body that does not validate); 499 when the client left before any answer
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from tandem.metrics import model_info

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_HELPER_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32, 63)  # split_encoders <= 64

# The `handler` label's values (bounded: any other path is "other").
_HANDLERS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize",
                       "/detokenize", "/health", "/ready", "/metrics"})  # fmt: skip


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = self.registry
        self.requests = Counter(
            "tandem_router_requests", "Requests by front end and outcome (ok or the error "
            "code), counted when the answer ends (a stream at its end).",
            ["api", "outcome"], registry=r,
        )
        self.http_requests = Counter(
            "tandem_router_http_requests", "HTTP answers by handler and status code.",
            ["handler", "code"], registry=r,
        )
        self.inflight = Gauge("tandem_router_inflight", "Requests in flight.", registry=r)
        # bounded: the tenants of the keys file, "default" (api_key) and "-" (open router)
        self.tenant_requests = Counter("tandem_router_tenant_requests",
                                       "Requests admitted, by tenant.", ["tenant"], registry=r)
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
        # issue 27: a prompt's media split across encoders (split_encoders > 1)
        self.split_prompts = Counter(
            "tandem_router_split_prompts", "Encodes sent with at least one helper encoder "
            "(EncodeRequest.helpers; a failover's Encode counts again).", registry=r,
        )  # fmt: skip
        self.encode_helpers = Histogram(
            "tandem_router_encode_helpers", "Helper encoders named per Encode of a prompt "
            "that may be split (split_encoders > 1, at least 2 images/videos); 0: no other "
            "encoder of its model was eligible.", buckets=_HELPER_BUCKETS, registry=r,
        )  # fmt: skip
        self.encoder_bypassed = Counter(
            "tandem_router_encoder_bypassed", "Text-only chats sent straight to a language "
            "instance (no encoder).", registry=r,
        )
        self.cached_prompt_tokens = Counter(
            "tandem_router_cached_prompt_tokens",
            "Prompt tokens served from language instances' prefix caches.", registry=r,
        )
        self.refusal_holds = Counter(
            "tandem_router_refusal_holds", "Requests held because their client's "
            "refused requests were over its budget, by outcome (passed, refused: 429).",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.healthy = Gauge(
            "tandem_router_healthy_instances", "Healthy instances per tier.", ["tier"], registry=r
        )

    def serving(self, model_name: str) -> None:
        model_info(self.registry, "router", model_name)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The page and its content type in the format `accept` (an Accept header) asks
        for: OpenMetrics, which carries exemplars, or the Prometheus text format."""
        encode, media_type = choose_encoder(accept)
        return encode(self.registry), media_type


def handler_of(path: str) -> str:
    """The `handler` label of a request path (bounded: unknown paths are "other")."""
    if path in _HANDLERS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class HttpStatusCounter:
    """ASGI middleware counting every HTTP answer by handler and status code
    (`tandem_router_http_requests_total`). Add it last (outermost), so that answers of the
    middlewares inside it (the API key's 401, the body limit's 413) are counted too:
    `app.add_middleware(HttpStatusCounter, metrics=core.metrics)`."""

    def __init__(self, app, metrics: RouterMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def counting_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except asyncio.CancelledError:
            status = status or 499  # the client left before any answer
            raise
        except BaseException:
            status = status or 500  # Starlette's outermost handler answers 500
            raise
        finally:
            code = str(status or 499)
            self.metrics.http_requests.labels(handler_of(scope.get("path", "")), code).inc()
