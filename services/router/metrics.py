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

vLLM's names (`VllmAliases`, docs/sdk.md "Metrics"), so that dashboards and autoscalers
written for `vllm serve` find the same figures here, labelled `model_name` as vLLM's:

    vllm:num_requests_running, vllm:num_requests_waiting   the language tier's running
        batch and its queue (prompts in transfer included), summed over the healthy
        instances from their last GetLoad (so every router shows the whole tier: take
        max, not sum, across routers)
    vllm:kv_cache_usage_perc (and the older vllm:gpu_cache_usage_perc)   KV pages used, a
        fraction (1 = full), the mean over the healthy language instances
    vllm:time_to_first_token_seconds, vllm:e2e_request_latency_seconds   what
        tandem_router_ttft_seconds and tandem_router_request_seconds observe
    vllm:time_per_output_token_seconds, vllm:request_time_per_output_token_seconds
        (last token - first token) / (output tokens - 1), once per finished request of
        two or more tokens (vLLM observes the former per token: here the mean per request)
    vllm:prompt_tokens_total, vllm:generation_tokens_total   tokens of finished requests

promtool's lint refuses `:` in a metric name (Prometheus keeps it for recording rules);
vLLM's own page draws the same complaint. The page is otherwise clean, and so are the
aliases but for that character (tests/test_metrics_lint.py): a lint gate filters them out.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics import exposition as openmetrics

from tandem.metrics import model_info

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                 0.75, 1, 2.5)  # vLLM's time_per_output_token buckets (to 2.5 s)
_HELPER_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32, 63)  # split_encoders <= 64

# The `handler` label's values (bounded: any other path is "other").
_HANDLERS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize",
                       "/detokenize", "/health", "/ready", "/metrics"})


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
        )
        self.encode_helpers = Histogram(
            "tandem_router_encode_helpers", "Helper encoders named per Encode of a prompt "
            "that may be split (split_encoders > 1, at least 2 images/videos); 0: no other "
            "encoder of its model was eligible.", buckets=_HELPER_BUCKETS, registry=r,
        )
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
        )
        self.healthy = Gauge(
            "tandem_router_healthy_instances", "Healthy instances per tier.", ["tier"], registry=r
        )

        self.vllm = VllmAliases(r)

    def serving(self, model_name: str) -> None:
        model_info(self.registry, "router", model_name)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The page and its content type in the format `accept` (an Accept header) asks
        for: OpenMetrics, which carries exemplars, or the Prometheus text format."""
        encode, media_type = choose_encoder(accept)
        if media_type.startswith("application/openmetrics-text"):
            # NOTE: prometheus-client 0.26 escapes a sample's name by the label-name rules
            # under OpenMetrics, so `vllm:x` samples came out `vllm_x` beneath a `vllm:x`
            # family. Every name here is a valid classic name (`:` included), which no
            # escaping changes: render them as they are, the media type as negotiated.
            version = media_type.partition("version=")[2].partition(";")[0] or "1.0.0"
            return openmetrics.generate_latest(self.registry, escaping=openmetrics.ALLOWUTF8,
                                               version=version), media_type
        return encode(self.registry), media_type


class VllmAliases:
    """vLLM's metrics under vLLM's names (see the module), each labelled `model_name`."""

    def __init__(self, r: CollectorRegistry) -> None:
        m = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the language "
                             "tier's running batches (vLLM's name).", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for the "
                             "language tier's prefill, prompts in transfer included (vLLM's "
                             "name).", m, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full: the "
                              "mean over the language instances (vLLM's name).", m, registry=r)
        self.gpu_kv_usage = Gauge("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 = full "
                                  "(vLLM's older name of vllm:kv_cache_usage_perc).", m,
                                  registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token "
                              "(vLLM's name).", m, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token "
                              "after the first, one observation per request (vLLM's name).",
                              m, buckets=_TPOT_BUCKETS, registry=r)
        self.request_tpot = Histogram(
            "vllm:request_time_per_output_token_seconds", "Time per output token after the "
            "first, per request (vLLM's name).", m, buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, start "
                             "to last token (vLLM's name).", m, buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished "
                                     "requests (vLLM's name).", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Output tokens of "
                                         "finished requests (vLLM's name).", m, registry=r)

    def tier(self, model: str, running: int, waiting: int, kv_used: float) -> None:
        """The language tier's figures at a scrape (RouterCore.refresh_gauges)."""
        self.running.labels(model).set(running)
        self.waiting.labels(model).set(waiting)
        self.kv_usage.labels(model).set(kv_used)
        self.gpu_kv_usage.labels(model).set(kv_used)

    def finished(self, model: str, ttft_s: float, e2e_s: float, prompt_tokens: int,
                 output_tokens: int) -> None:
        """One finished request: its latencies and tokens."""
        self.ttft.labels(model).observe(ttft_s)
        self.e2e.labels(model).observe(e2e_s)
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(output_tokens)
        if output_tokens > 1:
            per_token = max(0.0, e2e_s - ttft_s) / (output_tokens - 1)
            self.tpot.labels(model).observe(per_token)
            self.request_tpot.labels(model).observe(per_token)


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
