"""tandem/tracing.py: when tracing is on and with what settings (flags over the standard
OTEL_* variables, refusals by name), that off starts no exporter thread in any tier's
process entry (serving.run_service with the tier's own parsed config) and imports no SDK,
propagation through gRPC metadata and carriers (the request id included), and the
exemplars the latency histograms carry in the OpenMetrics exposition. The cross-tier
traces themselves: tests/test_e2e_tracing.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from otlp_receiver import OtlpReceiver

from tandem import tracing
from tandem.tracing import TracingConfig, TracingError, resolve


@pytest.mark.parametrize("cfg,env,want", [
    ({}, {}, None),  # off by default
    ({}, {"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, None),  # no endpoint
    ({"endpoint": "http://c:4317"}, {}, ("http://c:4317", "tandem-x", "parentbased_always_on", 1.0)),
    ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317"}, ("http://a:4317", "tandem-x",
                                                            "parentbased_always_on", 1.0)),
    ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317",
          "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4317"}, ("http://t:4317", "tandem-x",
                                                                   "parentbased_always_on", 1.0)),
    ({}, {"OTEL_TRACES_EXPORTER": "otlp"}, ("", "tandem-x", "parentbased_always_on", 1.0)),
    ({"endpoint": "http://c:4317", "service_name": "flag"}, {"OTEL_SERVICE_NAME": "env"},
     ("http://c:4317", "flag", "parentbased_always_on", 1.0)),
    ({"endpoint": "http://c:4317"}, {"OTEL_SERVICE_NAME": "env", "OTEL_TRACES_SAMPLER":
     "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}, ("http://c:4317", "env",
                                                          "traceidratio", 0.25)),
    ({"endpoint": "http://c:4317", "sampler": "parentbased_traceidratio", "sampler_arg": 0.5},
     {"OTEL_TRACES_SAMPLER": "always_off", "OTEL_TRACES_SAMPLER_ARG": "0.1"},
     ("http://c:4317", "tandem-x", "parentbased_traceidratio", 0.5)),
    ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317", "OTEL_SDK_DISABLED": "true"}, None),
    ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317", "OTEL_TRACES_EXPORTER": "none"}, None),
])
def test_resolve(cfg, env, want):
    got = resolve(TracingConfig(**cfg), "tandem-x", env)
    assert (got and (got.endpoint, got.service_name, got.sampler, got.sampler_arg)) == want


@pytest.mark.parametrize("cfg,env,named", [
    ({}, {"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER=zipkin"),
    ({"endpoint": "http://c:4317"}, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
     "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"),
    ({"endpoint": "http://c:4317"}, {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
     "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
    ({"endpoint": "http://c:4317"}, {"OTEL_TRACES_SAMPLER": "jaeger_remote"},
     "OTEL_TRACES_SAMPLER=jaeger_remote"),
    ({"endpoint": "http://c:4317", "sampler": "always_on", "sampler_arg": 0.5}, {},
     "--tracing.sampler-arg"),
    ({"endpoint": "http://c:4317"}, {"OTEL_TRACES_SAMPLER": "traceidratio",
                                     "OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG"),
    ({"endpoint": "http://c:4317"}, {"OTEL_SDK_DISABLED": "true"}, "--tracing.endpoint"),
])
def test_refused_settings_are_named(cfg, env, named):
    with pytest.raises(TracingError, match=named.replace(".", r"\.")):
        resolve(TracingConfig(**cfg), "tandem-x", env)


def test_a_bad_flag_is_a_config_error():
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "router", "--tracing.sampler",
                        "sometimes"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "tracing.sampler" in r.stderr, r.stderr


# Each tier's process entry, as `tandem <tier>` runs it: the config parsed from its command
# line, then serving.run_service (which sets tracing up) running a coroutine that reports
# the process's threads from inside its event loop.
_TIERS = textwrap.dedent("""
    import json, sys, threading
    from tandem import serving
    from tandem.config import parse_settings
    from tandem.services.encoder.config import EncoderConfig
    from tandem.services.language.config import LanguageConfig
    from tandem.services.router.config import RouterConfig

    out = {}
    for name, cls, argv in (("router", RouterConfig, []),
                            ("encoder", EncoderConfig, ["--model", "m"]),
                            ("language", LanguageConfig, ["--model", "m"])):
        cfg = parse_settings(cls, argv, "tandem " + name)

        async def threads(name=name):
            out[name] = [t.name for t in threading.enumerate()]

        code = serving.run_service("tandem " + name, threads(), log_format=cfg.log_format,
                                   log_level="warning", tracing=cfg.tracing)
        assert code == 0
    out["sdk_imported"] = "opentelemetry.sdk.trace" in sys.modules
    print(json.dumps(out))
""")


def _tier_threads(env: dict) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    r = subprocess.run([sys.executable, "-c", _TIERS], capture_output=True, text=True,
                       env={**clean, **env}, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_off_no_exporter_thread_in_any_tier_and_no_sdk_imported():
    got = _tier_threads({})
    for tier in ("router", "encoder", "language"):
        assert not [t for t in got[tier] if t.startswith("Otel")], (tier, got[tier])
    assert got["sdk_imported"] is False
    # the same check sees the exporter thread once an endpoint is configured
    on = _tier_threads({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    for tier in ("router", "encoder", "language"):
        assert [t for t in on[tier] if t.startswith("OtelBatch")], (tier, on[tier])


@pytest.fixture
def traced(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the batch processor's (ms)
    with OtlpReceiver() as rx:
        tracing.setup(TracingConfig(endpoint=rx.endpoint), "tandem-test", environ={})
        try:
            yield rx
        finally:
            tracing.shutdown()


def test_propagation_through_metadata_and_carriers_keeps_the_request_id(traced):
    rx = traced
    root = tracing.start("root", None, kind=tracing.SpanKind.SERVER,
                         attributes={tracing.REQUEST_ID: "r-1"})
    call = tracing.start("call", root, kind=tracing.SpanKind.CLIENT)
    md = (("x-request-id", "r-1"), *tracing.metadata(call))
    assert [k for k, _ in md] == ["x-request-id", "traceparent"]
    server = tracing.start("server", tracing.from_metadata(md))  # the next process's first span
    rank = tracing.start("rank", tracing.from_carrier({**tracing.carrier(server),
                                                       "x-request-id": "r-1"}))
    for s in (rank, server, call, root):
        s.end()
    assert tracing.exemplar(root) == {"trace_id": format(root.get_span_context().trace_id,
                                                         "032x")}
    assert tracing.exemplar(tracing.OFF) is None and tracing.metadata(tracing.OFF) == ()
    assert tracing.from_metadata((("x-request-id", "r-1"),)) is None  # no traceparent
    spans = {s.name: s for s in rx.wait_for(lambda s: len(s) == 4, "four spans")}
    assert len({s.trace_id for s in spans.values()}) == 1
    assert spans["server"].parent_id == spans["call"].span_id
    assert spans["rank"].parent_id == spans["server"].span_id
    assert spans["call"].parent_id == spans["root"].span_id and spans["root"].parent_id == ""
    assert {s.request_id for s in spans.values()} == {"r-1"}
    assert {s.service for s in spans.values()} == {"tandem-test"}


def test_off_gives_the_noop_span_and_no_context():
    assert not tracing.enabled()
    span = tracing.start("x", None)
    assert span is tracing.OFF and not span.is_recording()
    assert tracing.metadata(span) == () and tracing.carrier(span) == {}
    assert tracing.from_headers({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) \
        is None


def test_router_latency_exemplars_in_openmetrics_only(traced):
    from prometheus_client import CollectorRegistry

    from tandem.services.router.metrics import RouterMetrics

    m = RouterMetrics(CollectorRegistry())
    span = tracing.start("chat m", None)
    m.ttft.observe(0.2, tracing.exemplar(span))
    m.latency.observe(0.3, tracing.exemplar(tracing.OFF))  # untraced: no exemplar
    span.end()
    trace_id = format(span.get_span_context().trace_id, "032x")
    om, media = m.render("application/openmetrics-text; version=1.0.0")
    assert media.startswith("application/openmetrics-text")
    assert f'tandem_router_ttft_seconds_bucket{{le="0.25"}} 1.0 # {{trace_id="{trace_id}"}} 0.2' \
        in om.decode()
    assert "request_seconds_bucket" in om.decode() and om.decode().count("trace_id=") == 1
    text, media = m.render(None)
    assert media.startswith("text/plain") and b"trace_id" not in text
