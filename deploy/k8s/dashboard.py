"""The chart's Grafana dashboard (tandem/files/dashboard.json), generated from the panels below.

    python deploy/k8s/dashboard.py          # rewrite files/dashboard.json
    python deploy/k8s/dashboard.py --check  # exit 1 if the committed file has drifted

One row per question an operator asks, each panel a Prometheus query over series the tiers
export (tests/test_chart_observability.py checks every name and label against the metric
sets, and that every query parses):

- Overview: answers by status, time to first token and latency as clients see them, healthy
  instances per tier.
- Saturation, per pod: the encoder's patches waiting for or in the ViT and its ViT busy
  fraction; the language tier's KV pages, waiting requests, embedding blocks reserved and
  busy fraction; the router's requests in flight and admission refusals (the autoscaling
  signals, docs/deploy.md "Autoscaling").
- Stage breakdown: p50 and p99 of each stage a request passes: language queue,
  preprocess, video decode, ViT batch, transfer (the encoder's write), prefill, decode.
- Caches: the encoder's embedding cache and the language prefix cache (hit rates,
  evictions, contents), and the tokens the router saw served from them.
- Retries, failovers and transfers: encoder failovers and whole-request retries (and per
  request), Resume rounds, failed rooms by reason, the most idle open room, the longest ViT
  call without progress.

Every latency-histogram query asks Grafana for exemplars (`exemplar: true`): where the
tiers attach trace ids to their observations and Prometheus stores exemplars, each dot
links to its trace through the Prometheus datasource's `exemplarTraceIdDestinations`
(the chart's `grafanaDashboard.datasource`, docs/deploy.md "Dashboard").

Rates use Grafana's `$__rate_interval`; the Prometheus datasource is the `datasource`
variable.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "k8s" / "tandem" / "files" / "dashboard.json"
RATE = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
WIDTH, HEIGHT = 24, 8  # Grafana's grid: 24 columns; panels 8 rows high


# ---- query builders --------------------------------------------------------------------------

def q(expr: str, legend: str, exemplar: bool = False) -> dict:
    """One target. `exemplar`: the query reads a latency histogram's buckets."""
    return {"expr": expr, "legendFormat": legend, "exemplar": exemplar}


def rate(series: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({series}[{RATE}]))"


def quantiles(histogram: str, legend: str, qs=(0.5, 0.99), by: str = "") -> list[dict]:
    """p50/p99 of a histogram (`name{matchers}` without `_bucket`), with exemplars."""
    name, _, matchers = histogram.partition("{")
    bucket = f"{name}_bucket" + (f"{{{matchers}" if matchers else "")
    keep = f"le, {by}" if by else "le"
    return [q(f"histogram_quantile({p}, {rate(bucket, keep)})",
              f"{legend} p{round(p * 100)}", exemplar=True) for p in qs]


def stage_quantile(p: float) -> list[dict]:
    """Each stage of a request at quantile `p` (its own histogram)."""
    stages = (
        ("queue (language)", "tandem_language_request_queue_time_seconds"),
        ("preprocess", "tandem_encoder_preprocess_seconds"),
        ("video decode", "tandem_encoder_video_decode_seconds"),
        ("ViT batch", "tandem_encoder_vit_seconds"),
        ("transfer (encoder write)", 'tandem_transfer_seconds{side="encoder"}'),
        ("prefill", "tandem_language_request_prefill_time_seconds"),
        ("decode", "tandem_language_request_decode_time_seconds"),
    )
    return [quantiles(h, legend, qs=(p,))[0] | {"legendFormat": legend} for legend, h in stages]


def ratio(num: str, den: str, by: str = "instance") -> str:
    """rate(num) / rate(den) per `by`; no data (not 0) where nothing was counted."""
    return f"{rate(num, by)} / {rate(den, by)}"


# ---- panels ----------------------------------------------------------------------------------

def panel(title: str, description: str, unit: str, targets: list[dict], width: int = 8,
          stack: bool = False) -> dict:
    custom = {"stacking": {"mode": "normal" if stack else "none"},
              "fillOpacity": 20 if stack else 0}
    return {
        "type": "timeseries", "title": title, "description": description,
        "datasource": DATASOURCE, "w": width,
        "fieldConfig": {"defaults": {"unit": unit, "min": 0, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": targets,
    }


ROWS: list[tuple[str, list[dict]]] = [
    ("Overview", [
        panel("Answers by status (router HTTP)", "Every HTTP answer of the router by status "
              "code, 4xx refused before any handler included.", "reqps",
              [q(rate("tandem_router_http_requests_total", "code"), "{{code}}")], width=6),
        panel("Time to first token (router)", "As clients see it. Exemplar dots link to the "
              "request's trace.", "s", quantiles("tandem_router_ttft_seconds", "TTFT"), width=6),
        panel("Request latency (router)", "Start to last token, as clients see it.", "s",
              quantiles("tandem_router_request_seconds", "latency"), width=6),
        panel("Healthy instances per tier", "Instances the routers route to (the fewest any "
              "router sees); 0 for a tier means nothing can be served.", "short",
              [q("min by (tier) (tandem_router_healthy_instances)", "{{tier}}")], width=6),
    ]),
    ("Saturation", [
        panel("Encoder: patches pending", "Vision patches waiting for or in the ViT, per pod: "
              "the encoder tier's scaling signal (0 when idle).", "short",
              [q("tandem_encoder_pending_patches", "{{instance}}")]),
        panel("Encoder: ViT busy", "Share of time each encoder pod's ViT runs batches (ViT "
              "seconds per second; a pod with several devices may exceed 100%).",
              "percentunit", [q(rate("tandem_encoder_vit_seconds_sum", "instance"),
                                "{{instance}}")]),
        panel("Encoder: requests in progress", "Encode calls accepted and not yet answered, "
              "per pod.", "short", [q("tandem_encoder_queued_requests", "{{instance}}")]),
        panel("Language: KV pages", "KV pages held by requests, pages holding a cached "
              "prefix (idle or in use), and the pool, per pod.", "short", [
                  q("tandem_language_kv_pages_used", "in use {{instance}}"),
                  q("tandem_language_prefix_cache_pages", "cached {{instance}}"),
                  q("tandem_language_kv_pages_capacity", "capacity {{instance}}")]),
        panel("Language: KV cache usage", "Pages held by requests over the pool (idle cached "
              "pages count as free): a scaling signal.", "percentunit",
              [q("tandem_language_kv_cache_usage_ratio", "{{instance}}")]),
        panel("Language: requests by state", "Waiting for KV pages (a scaling signal), "
              "prefilling or decoding, and waiting for their prompt from an encoder.", "short", [
                  q("tandem_language_waiting_requests", "waiting {{instance}}"),
                  q("tandem_language_running_requests", "running {{instance}}"),
                  q("tandem_language_transferring_requests", "transferring {{instance}}")]),
        panel("Language: embedding blocks reserved", "Embedding blocks held by prompts on "
              "their way from the encoders, and the pool, per pod: a scaling signal.", "short", [
                  q("tandem_transfer_blocks_capacity - tandem_transfer_blocks_free",
                    "reserved {{instance}}"),
                  q("tandem_transfer_blocks_capacity", "capacity {{instance}}")]),
        panel("Language: busy", "Share of time each language pod spends in forward steps "
              "(busy seconds per second).", "percentunit",
              [q(rate("tandem_language_busy_seconds_total", "instance"), "{{instance}}")]),
        panel("Language: retractions", "Requests preempted for KV pages, per second: the KV "
              "pool is too small for the running batch.", "ops",
              [q(rate("tandem_language_retractions_total", "instance"), "{{instance}}")]),
        panel("Router: requests in flight", "Per router pod: its scaling signal.", "short",
              [q("tandem_router_inflight", "{{instance}}")]),
        panel("Router: admission refusals and holds", "Requests refused by admission "
              "control (429), and requests held because their client's refusals were over "
              "its budget, by outcome (passed, or refused: 429).", "reqps", [
                  q(rate("tandem_router_rejected_total"), "admission"),
                  q(rate("tandem_router_refusal_holds_total", "outcome"), "held: {{outcome}}")]),
    ]),
    ("Stage breakdown", [
        panel("Stage time p50", "The median of each stage a request passes (each its own "
              "histogram; the ViT's is per batch, the transfer's the encoder's write of one "
              "room). Exemplar dots link to traces.", "s", stage_quantile(0.5), width=12),
        panel("Stage time p99", "The 99th percentile of each stage.", "s",
              stage_quantile(0.99), width=12),
        panel("Language: time to first token", "Arrival at the language tier to first token "
              "(includes the transfer and queueing).", "s",
              quantiles("tandem_language_time_to_first_token_seconds", "TTFT"), width=12),
        panel("Language: time per output token", "Mean inter-token time of finished "
              "requests.", "s",
              quantiles("tandem_language_time_per_output_token_seconds", "TPOT"), width=12),
    ]),
    ("Caches", [
        panel("Encoder: embedding cache hit rate", "Images whose embeddings came from the "
              "cache over all lookups, per encoder pod.", "percentunit", [q(
                  f"{rate('tandem_encoder_cache_hits_total', 'instance')} / "
                  f"({rate('tandem_encoder_cache_hits_total', 'instance')} + "
                  f"{rate('tandem_encoder_cache_misses_total', 'instance')})",
                  "{{instance}}")]),
        panel("Language: prefix cache hit rate", "Prompt tokens found in the prefix cache "
              "over tokens looked up, per language pod.", "percentunit", [q(
                  ratio("tandem_language_prefix_cache_hit_tokens_total",
                        "tandem_language_prefix_cache_query_tokens_total"),
                  "{{instance}}")]),
        panel("Cache evictions", "Embeddings evicted from encoder caches and idle cached KV "
              "pages evicted for new allocations, per second.", "ops", [
                  q(rate("tandem_encoder_cache_evictions_total", "instance"),
                    "encoder {{instance}}"),
                  q(rate("tandem_language_prefix_cache_evictions_total", "instance"),
                    "prefix pages {{instance}}")]),
        panel("Tokens served from caches (router)", "Image tokens from encoder caches and "
              "prompt tokens from prefix caches, per second.", "short", [
                  q(rate("tandem_router_cached_image_tokens_total"), "image tokens"),
                  q(rate("tandem_router_cached_prompt_tokens_total"), "prompt tokens")],
              width=12),
        panel("Encoder: embedding cache size", "Bytes the embedding cache holds, per pod.",
              "bytes", [q("tandem_encoder_cache_bytes", "{{instance}}")], width=12),
    ]),
    ("Retries, failovers and transfers", [
        panel("Retries and failovers (router)", "Encodes failed over to another encoder, and "
              "requests retried as a whole before any output, per second.", "ops", [
                  q(rate("tandem_router_encoder_retries_total"), "encoder failover"),
                  q(rate("tandem_router_request_retries_total"), "request retry")], width=6),
        panel("Retries per request", "Failovers and retries over finished requests: the "
              "TandemRetryStorm alert's ratio.", "percentunit", [q(
                  f"({rate('tandem_router_encoder_retries_total')} + "
                  f"{rate('tandem_router_request_retries_total')}) / "
                  f"{rate('tandem_router_requests_total')}", "retries per request")], width=6),
        panel("Transfer: resumes and failed rooms", "Resume rounds (prompts longer than their "
              "reservation) and failed rooms by reason: `transfer` is a fault of the "
              "transfer, `request` the request's own end (cancelled, its deadline).", "ops", [
                  q(rate("tandem_transfer_resumes_total", "side"), "resumes ({{side}})"),
                  q(rate("tandem_transfer_failures_total", "reason"), "failed: {{reason}}")],
              width=6),
        panel("Transfer: longest room without progress", "Per language pod, how long its most "
              "idle open room has gone without progress (heartbeats do not count); beyond a "
              "few transfer timeouts the room is stuck (TandemRoomStuck).", "s",
              [q("max by (instance) (tandem_transfer_room_stall_seconds)", "{{instance}}")],
              width=6),
        panel("Encoder: ViT call without progress", "Per encoder pod, how long its most "
              "stuck device's ViT call has gone without finishing a layer (0 while idle); past "
              "the encoder's vit_stall_s it is out of service: its rooms fail, its health is "
              "NOT_SERVING and the router sends it nothing.", "s",
              [q("max by (instance) (tandem_encoder_vit_stall_seconds)", "{{instance}}")],
              width=6),
        panel("Transfer: room time", "A room from Init to Done on each side (the language "
              "side's includes waiting for the encoder's work).", "s",
              quantiles("tandem_transfer_seconds", "{{side}}", by="side"), width=18),
    ]),
]


# ---- layout ----------------------------------------------------------------------------------

def layout(rows: list[tuple[str, list[dict]]]) -> list[dict]:
    """Rows one under another, each row's panels left to right, wrapping at the grid's
    width; ids and refIds in order."""
    out, y, ids = [], 0, iter(range(1, 1000))
    for title, panels in rows:
        out.append({"id": next(ids), "type": "row", "title": title, "collapsed": False,
                    "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": y}, "panels": []})
        y, x = y + 1, 0
        for p in panels:
            p = dict(p)
            w = p.pop("w")
            if x + w > WIDTH:
                x, y = 0, y + HEIGHT
            p["id"] = next(ids)
            p["gridPos"] = {"h": HEIGHT, "w": w, "x": x, "y": y}
            p["targets"] = [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, **t}
                            for i, t in enumerate(p["targets"])]
            out.append(p)
            x += w
        y += HEIGHT
    return out


def generated() -> dict:
    return {
        "title": "Tandem",
        "uid": "tandem-overview",
        "description": "Tandem's tiers: saturation, stage breakdown, caches, retries "
                       "(deploy/k8s/dashboard.py; docs/deploy.md \"Dashboard\").",
        "schemaVersion": 39,
        "version": 2,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "tags": ["tandem"],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus",
             "label": "Data source"},
        ]},
        "panels": layout(ROWS),
    }


def main() -> int:
    want = json.dumps(generated(), indent=2) + "\n"
    if "--check" in sys.argv:
        if not DASHBOARD.exists() or DASHBOARD.read_text() != want:
            print(f"{DASHBOARD} has drifted from deploy/k8s/dashboard.py: run "
                  f"python deploy/k8s/dashboard.py", file=sys.stderr)
            return 1
        return 0
    DASHBOARD.write_text(want)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
