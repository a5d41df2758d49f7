"""Prometheus metrics of the language tier: one set per registry (`tandem.metrics`), the
service's own, so several engines in one process (tests) never collide.

Per step (the engine): its time (busy_seconds), batch size and tokens, prompt / generation
token counters, retractions, queue and KV gauges. At a request's first token: time to first token. Per
finished request (`request_finished`, called by the engine's `_finish` from the request's
timestamps): latency, time per output token and, as vLLM names them, queue time (queued ->
first scheduled), prefill time (first scheduled -> first token), decode time (first token
-> last token), prompt and generation tokens.
`kv_cache_usage_ratio` is pages held by requests over the pool (idle cached pages count
as free: they are evicted on demand).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem.metrics import model_info

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_PHASE = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
          120)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_REQUEST_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                   50000, 100000)


def _value(gauge: Gauge) -> float:
    return gauge.collect()[0].samples[0].value


class LanguageMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = r = registry
        p = "tandem_language_"

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(p + name, doc, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.", _LATENCY)
        self.tpot = hist("time_per_output_token_seconds",
                         "Mean time between output tokens of a finished request.", _TPOT)
        self.e2e = hist("request_latency_seconds", "Arrival to finish.", _LATENCY)
        self.queue_time = hist("request_queue_time_seconds",
                               "Per request: waiting queue to first scheduled.", _PHASE)
        self.prefill_time = hist("request_prefill_time_seconds",
                                 "Per request: first scheduled to first token.", _PHASE)
        self.decode_time = hist("request_decode_time_seconds",
                                "Per request: first token to last token.", _PHASE)
        self.request_prompt_tokens = hist("request_prompt_tokens",
                                          "Prompt tokens per finished request.", _REQUEST_TOKENS)
        self.request_generation_tokens = hist(
            "request_generation_tokens", "Generated tokens per finished request.",
            _REQUEST_TOKENS)
        self.waiting = Gauge(p + "waiting_requests", "Requests in the waiting queue.", registry=r)
        self.running = Gauge(p + "running_requests", "Requests prefilling or decoding.",
                             registry=r)
        self.transferring = Gauge(p + "transferring_requests", "Rooms waiting for their prompt.",
                                  registry=r)
        self.kv_used = Gauge(p + "kv_pages_used", "KV pages held by requests.", registry=r)
        self.kv_total = Gauge(p + "kv_pages_capacity", "KV pages in the pool.", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio",
                              "KV pages held by requests over the pool (0 to 1).",
                              registry=r)
        # NOTE: derived at scrape time from the two gauges the engine sets, so the ratio
        # can never disagree with them.
        self.kv_usage.set_function(self._kv_ratio)
        self.retractions = Counter(p + "retractions", "Requests retracted for KV pages.",
                                   registry=r)
        self.batch_size = Histogram(p + "batch_size", "Sequences per forward step.",
                                    buckets=_BATCH, registry=r)
        self.batch_tokens = Histogram(p + "batch_tokens", "Tokens per forward step.",
                                      buckets=(1, 8, 32, 128, 512, 1024, 2048, 4096, 8192),
                                      registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.busy_seconds = Counter(p + "busy_seconds", "Time spent in forward steps (its "
                                    "rate is the instance's busy fraction).", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.",
                                         registry=r)
        self.tokens_per_s = Gauge(p + "generation_tokens_per_second",
                                  "Generated tokens per second over the last few seconds.",
                                  registry=r)
        self.finished = Counter(p + "requests_finished", "Finished requests by reason.",
                                ["reason"], registry=r)
        self.cache_query_tokens = Counter(
            p + "prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache "
            "(whole pages, at first admission).", registry=r)
        self.cache_hit_tokens = Counter(p + "prefix_cache_hit_tokens",
                                        "Prompt tokens found in the prefix cache.",
                                        registry=r)
        self.cache_pages = Gauge(p + "prefix_cache_pages", "KV pages with a prefix-cache key "
                                 "(idle or in use).", registry=r)
        self.cache_evictions = Counter(p + "prefix_cache_evictions",
                                       "Idle cached KV pages evicted for new allocations.",
                                       registry=r)
        # streamed rows (docs/architecture.md, "Streamed rows"): the prompt's first rows reach the engine
        # before the rest, and the prefill of what arrived overlaps the encoder's ViT
        self.first_row = hist("time_to_first_row_seconds", "Per encoded prompt: Generate to "
                              "its first rows in place (copied out and verified; without "
                              "streaming, to the whole prompt).", _LATENCY)
        self.streamed_prompts = Counter(p + "streamed_prompts", "Encoded prompts handed to "
                                        "the engine before all their rows arrived.", registry=r)
        self.streamed_rows = Counter(p + "streamed_rows", "Rows of streamed prompts counted "
                                     "in as they arrived (copied out and verified).",
                                     registry=r)
        self.early_prefill_tokens = Counter(
            p + "early_prefill_tokens", "Prompt tokens prefilled while their prompt's later "
            "rows were still on their way (the encode they overlapped).", registry=r)
        # E/P/D (services/language/handoff.py): a prompt's KV pages from a prefill instance
        # ("sent") to a decode instance ("received"), per request
        self.kv_transfers = Counter(p + "kv_transfers", "Prompts' KV hand-offs by direction "
                                    "and outcome (ok, or the gRPC code it failed with).",
                                    ["direction", "outcome"], registry=r)
        self.kv_transfer_bytes = Counter(p + "kv_transfer_bytes", "KV page bytes handed off "
                                         "(sent: written; received: landed and checked).",
                                         ["direction"], registry=r)
        self.kv_transfer_time = Histogram(
            p + "kv_transfer_seconds", "Per hand-off: sent, the pages' writes (pack, tag, "
            "stage, write); received, the room named to the pages all landed and checked.",
            ["direction"], buckets=_PHASE, registry=r)
        self.kv_transfer_descriptors = Histogram(
            p + "kv_transfer_descriptors", "Per hand-off sent: Mooncake write descriptors "
            "(one per run of consecutive staging slots within a chunk).", buckets=_BATCH,
            registry=r)
        self.kv_reserve_wait = Histogram(
            p + "kv_reserve_wait_seconds", "Per hand-off received: the prompt's length known "
            "to its pages and inbox slots reserved (the decode pre-allocation queue).",
            buckets=_PHASE, registry=r)
        self._cache_seen = (0, 0, 0)
        self._window_start = time.monotonic()
        self._window_tokens = 0

    def serving(self, model_name: str) -> None:
        model_info(self.registry, "language", model_name)

    def _kv_ratio(self) -> float:
        total = _value(self.kv_total)
        return _value(self.kv_used) / total if total > 0 else 0.0

    def request_finished(self, req, now: float) -> None:
        """Observe a finished `Request` (the engine's `_finish`, its one way out): latency,
        time per output token, its phases and sizes (a phase it never reached, e.g.
        prefill of a request aborted while queued, is not observed). A traced request's
        observations carry its trace id as their exemplar."""
        ex = req.trace.exemplar if req.trace is not None else None
        self.e2e.observe(now - req.times.created, ex)
        if len(req.output_ids) > 1 and req.times.first_token:
            self.tpot.observe((req.times.last_token - req.times.first_token) / (len(req.output_ids) - 1))
        if req.times.queued and req.times.first_scheduled:
            self.queue_time.observe(max(req.times.first_scheduled - req.times.queued, 0.0), ex)
        if req.times.first_scheduled and req.times.first_token:
            self.prefill_time.observe(max(req.times.first_token - req.times.first_scheduled,
                                          0.0), ex)
        if req.times.first_token and req.times.last_token:
            self.decode_time.observe(max(req.times.last_token - req.times.first_token, 0.0), ex)
        self.request_prompt_tokens.observe(req.prompt_len)
        self.request_generation_tokens.observe(len(req.output_ids))

    def prefix_cache(self, cache) -> None:
        """Bring the prefix-cache metrics up to `cache.stats` (counters move by the delta)."""
        st = cache.stats
        now = (st.query_tokens, st.hit_tokens, st.evictions)
        q, h, e = (a - b for a, b in zip(now, self._cache_seen, strict=True))
        self.cache_query_tokens.inc(q)
        self.cache_hit_tokens.inc(h)
        self.cache_evictions.inc(e)
        self._cache_seen = now
        self.cache_pages.set(cache.num_cached)

    def count_generated(self, n: int) -> None:
        self.generation_tokens.inc(n)
        self._window_tokens += n
        now = time.monotonic()
        if now - self._window_start >= 2.0:
            self.tokens_per_s.set(self._window_tokens / (now - self._window_start))
            self._window_start, self._window_tokens = now, 0
