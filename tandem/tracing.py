"""OpenTelemetry traces of every Tandem process: this module owns them.

    tracing.setup(cfg.tracing, "tandem-router")    # once per process, at start (off: no-op)
    root = tracing.start("chat m", tracing.from_headers(headers), kind=SERVER,
                         attributes={tracing.REQUEST_ID: rid})
    child = tracing.start("router.pick", root)      # parents are always explicit
    stub.Encode(msg, metadata=tracing.metadata(child))   # W3C traceparent to the next tier
    tracing.fail(child, "UNAVAILABLE", "encoder gone"); child.end()

On / off. Tracing is on in a process when an OTLP endpoint is configured: the tier's
`--tracing.endpoint` flag, else `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else
`OTEL_EXPORTER_OTLP_ENDPOINT`, or `OTEL_TRACES_EXPORTER=otlp` alone (the SDK's default
endpoint, localhost:4317). `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` keep it
off. Off is the default and costs nothing: the SDK is not even imported, no exporter thread
runs, every span is the API's one no-op span (`OFF`), and the hot paths (the language
engine's step, the ViT batcher) test one plain field before doing any tracing work.

Settings, flag first, then the standard variable, then the default:

    --tracing.endpoint       OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT   (off)
    --tracing.service-name   OTEL_SERVICE_NAME                      tandem-<tier>
    --tracing.sampler        OTEL_TRACES_SAMPLER                    parentbased_always_on
    --tracing.sampler-arg    OTEL_TRACES_SAMPLER_ARG                1.0 (ratio samplers)

The exporter reads its other standard variables itself (OTEL_EXPORTER_OTLP_[TRACES_]
HEADERS, _INSECURE, _CERTIFICATE, _COMPRESSION, _TIMEOUT; OTEL_BSP_* for the batching) and
OTEL_RESOURCE_ATTRIBUTES adds resource attributes. Export is OTLP over gRPC only: another
OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL or OTEL_TRACES_EXPORTER is refused at start, never
ignored. Propagation is W3C trace context (`traceparent`, `tracestate`) on HTTP headers and
gRPC metadata, whatever OTEL_PROPAGATORS says.

Spans: every span's parent is passed explicitly (a Span or a Context; None starts a new
trace), never taken from the current context, so a span never leaks across the yields of
the async generators that stream a request. Every span carries the request id
(`tandem.request_id`): a process's first span of a request sets it, its children inherit
it (`_RequestIds`). Engine-thread work (the language scheduler's steps, ViT batches) only
records timestamps on the request; the request's own coroutine turns them into spans with
explicit start and end times (`start(..., start_ns=)`, `span.end(end_ns)`) once the stage
is over. `wall_ns` converts time.monotonic() readings.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from opentelemetry import trace
from opentelemetry.context import Context, create_key, get_value, set_value
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import BaseModel, Field

log = logging.getLogger("tandem.tracing")

__all__ = ["OFF", "Span", "SpanKind", "Link", "TracingConfig", "TracingError", "setup",
           "shutdown", "enabled", "start", "fail", "end", "append", "add", "metadata",
           "carrier", "from_metadata", "from_call", "from_headers", "from_carrier", "exemplar", "wall_ns"]

# ---- attribute names (OpenTelemetry GenAI semantic conventions where they exist) ---------
REQUEST_ID = "tandem.request_id"  # on every span
ROOM = "tandem.room"
OPERATION = "gen_ai.operation.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TOP_K = "gen_ai.request.top_k"
REQUEST_SEED = "gen_ai.request.seed"
REQUEST_STREAM = "gen_ai.request.stream"
REQUEST_CHOICES = "gen_ai.request.choice.count"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
FINISH_REASONS = "gen_ai.response.finish_reasons"
TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"  # seconds
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHED_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"  # the language prefix cache's
ERROR_TYPE = "error.type"
RPC_STATUS = "rpc.grpc.status_code"
SERVER_ADDRESS = "server.address"

_W3C = TraceContextTextMapPropagator()
_ROOT = Context()  # the parent of a span that starts a trace
_CALLER_RID = create_key("tandem.request_id")  # a remote parent's request id (x-request-id)
REQUEST_ID_HEADER = "x-request-id"  # how every internal call names its request
OFF: Span = trace.INVALID_SPAN  # the span every start() gives while tracing is off

Sampler = Literal["", "always_on", "always_off", "traceidratio", "parentbased_always_on",
                  "parentbased_always_off", "parentbased_traceidratio"]
_RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")


class TracingConfig(BaseModel):
    """OpenTelemetry traces over OTLP/gRPC (docs/deploy.md "Tracing"); each field falls
    back to its standard OTEL_* variable."""

    endpoint: str = Field(
        "", description="OTLP/gRPC collector to export spans to, e.g. http://collector:4317 "
        "(https:// for TLS). Empty: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
        "OTEL_EXPORTER_OTLP_ENDPOINT; tracing is off when none is set.")
    service_name: str = Field(
        "", description="service.name of this process's spans. Empty: OTEL_SERVICE_NAME, "
        "else tandem-<tier> (tandem-router, tandem-encoder, tandem-language).")
    sampler: Sampler = Field(
        "", description="Which traces are kept, as OTEL_TRACES_SAMPLER names them. Empty: "
        "OTEL_TRACES_SAMPLER, else parentbased_always_on (every request, or as the "
        "caller's traceparent says).")
    sampler_arg: float | None = Field(
        None, ge=0, le=1, description="The ratio of the traceidratio samplers (0 to 1). "
        "Unset: OTEL_TRACES_SAMPLER_ARG, else 1.0.")


class TracingError(ValueError):
    """A tracing setting that cannot be honoured (the process refuses to start)."""


@dataclass(frozen=True)
class TraceSettings:
    """The settings a process exports with, resolved from its flags and environment."""

    endpoint: str  # "" = the exporter's default (localhost:4317)
    service_name: str
    sampler: str
    sampler_arg: float


def resolve(cfg: TracingConfig, service_name: str,
            environ: Mapping[str, str] = os.environ) -> TraceSettings | None:
    """The settings `cfg` and `environ` ask for, or None when tracing is off; TracingError
    for a setting that is refused (see the module docstring)."""
    env = {k: v.strip() for k, v in environ.items() if k.startswith("OTEL_")}
    exporter = env.get("OTEL_TRACES_EXPORTER", "").lower()
    if exporter not in ("", "otlp", "none"):
        raise TracingError(f"OTEL_TRACES_EXPORTER={exporter}: traces are exported over OTLP "
                           "only (otlp, or none for off)")
    endpoint = (cfg.endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""))
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true" or exporter == "none":
        if cfg.endpoint:
            raise TracingError(f"--tracing.endpoint {cfg.endpoint} while "
                               "OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none")
        return None
    if not endpoint and exporter != "otlp":
        return None
    for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        if env.get(var, "grpc").lower() != "grpc":
            raise TracingError(f"{var}={env[var]}: traces are exported over OTLP/gRPC only")
    sampler = cfg.sampler or env.get("OTEL_TRACES_SAMPLER", "").lower() or "parentbased_always_on"
    if sampler not in get_args(Sampler) or not sampler:
        raise TracingError(f"OTEL_TRACES_SAMPLER={sampler}: not one of "
                           f"{', '.join(s for s in get_args(Sampler) if s)}")
    if cfg.sampler_arg is not None and sampler not in _RATIO_SAMPLERS:
        raise TracingError(f"--tracing.sampler-arg is the ratio of {' and '.join(_RATIO_SAMPLERS)}; "
                           f"the sampler here is {sampler}")
    arg = cfg.sampler_arg
    if arg is None and sampler in _RATIO_SAMPLERS and "OTEL_TRACES_SAMPLER_ARG" in env:
        try:
            arg = float(env["OTEL_TRACES_SAMPLER_ARG"])
        except ValueError:
            arg = -1.0
        if not 0.0 <= arg <= 1.0:
            raise TracingError(f"OTEL_TRACES_SAMPLER_ARG={env['OTEL_TRACES_SAMPLER_ARG']}: "
                               "a ratio from 0 to 1")
    name = cfg.service_name or env.get("OTEL_SERVICE_NAME") or service_name
    return TraceSettings(endpoint, name, sampler, 1.0 if arg is None else arg)


# ---- the process's tracer ---------------------------------------------------------------
_lock = threading.Lock()
_provider = None  # the SDK's TracerProvider while on
_tracer: trace.Tracer | None = None  # None: off


def enabled() -> bool:
    return _tracer is not None


def setup(cfg: TracingConfig, service_name: str, attributes: Mapping[str, object] | None = None,
          environ: Mapping[str, str] = os.environ) -> TraceSettings | None:
    """Turn tracing on for this process when `cfg` and the environment configure it (see
    the module docstring), spans named for `service_name` unless overridden; `attributes`
    are added to the resource (a tensor-parallel rank's number). Returns the settings, or
    None when off (then nothing is imported or started). The exporter is flushed and
    stopped at exit. TracingError for a refused setting."""
    settings = resolve(cfg, service_name, environ)
    if settings is None:
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace import sampling as s
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    import tandem

    samplers = {"always_on": s.ALWAYS_ON, "always_off": s.ALWAYS_OFF,
                "parentbased_always_on": s.DEFAULT_ON, "parentbased_always_off": s.DEFAULT_OFF,
                "traceidratio": s.TraceIdRatioBased(settings.sampler_arg),
                "parentbased_traceidratio": s.ParentBasedTraceIdRatio(settings.sampler_arg)}
    # NOTE: the resolved name last: Resource.create lets OTEL_SERVICE_NAME win over its
    # argument, but a --tracing.service-name flag must win over the variable
    resource = Resource.create({**(attributes or {}), "service.version": tandem.version()}
                               ).merge(Resource({"service.name": settings.service_name}))
    provider = TracerProvider(resource=resource, sampler=samplers[settings.sampler])
    provider.add_span_processor(_request_ids())
    exporter = OTLPSpanExporter(endpoint=settings.endpoint or None)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    global _provider, _tracer
    with _lock:
        old, _provider, _tracer = _provider, provider, provider.get_tracer("tandem",
                                                                           tandem.version())
    if old is not None:
        old.shutdown()
    else:
        atexit.register(shutdown)
    log.info("tracing on: spans of %s to %s (OTLP/gRPC), sampler %s%s", settings.service_name,
             settings.endpoint or "the OTLP default endpoint", settings.sampler,
             f" {settings.sampler_arg:g}" if settings.sampler in _RATIO_SAMPLERS else "")
    return settings


def shutdown() -> None:
    """Flush what is queued and stop exporting (at exit; tests). Tracing is off after."""
    global _provider, _tracer
    with _lock:
        provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def _request_ids():
    """A span processor: a span without a request id of its own takes its parent's (a span
    of this process), else the one its remote parent's call named (`x-request-id`, kept by
    `from_carrier`): so every span of a request carries it."""
    from opentelemetry.sdk.trace import SpanProcessor

    class RequestIds(SpanProcessor):
        def on_start(self, span, parent_context=None) -> None:
            if span.attributes.get(REQUEST_ID) is not None or parent_context is None:
                return
            parent = trace.get_current_span(parent_context)
            rid = ((getattr(parent, "attributes", None) and parent.attributes.get(REQUEST_ID))
                   or get_value(_CALLER_RID, parent_context))
            if rid:
                span.set_attribute(REQUEST_ID, rid)

    return RequestIds()


# ---- spans --------------------------------------------------------------------------------
Parent = Span | Context | None


def _context(parent: Parent) -> Context:
    if parent is None:
        return _ROOT
    if isinstance(parent, Context):
        return parent
    return trace.set_span_in_context(parent, _ROOT)


def start(name: str, parent: Parent, *, kind: SpanKind = SpanKind.INTERNAL,
          attributes: Mapping[str, object] | None = None, start_ns: int | None = None,
          links: Iterable[Link] = ()) -> Span:
    """A started span under `parent` (a Span, a Context from `from_*`, or None for a new
    trace); `OFF` while tracing is off. End it with `span.end()` (`end_time=` for a stage
    that ended earlier)."""
    tracer = _tracer
    if tracer is None:
        return OFF
    return tracer.start_span(name, _context(parent), kind, attributes, list(links),
                             start_ns, record_exception=False, set_status_on_exception=False)


def fail(span: Span, code: str, message: str = "") -> None:
    """Mark `span` failed with the error code (a gRPC code name: `error.type`)."""
    if span.is_recording():
        span.set_attribute(ERROR_TYPE, code)
        span.set_status(Status(StatusCode.ERROR, f"{code}: {message}" if message else code))


def end(span: Span, end_ns: int | None = None) -> None:
    """End `span` unless it has ended already (a span some exits share)."""
    if span.is_recording():
        span.end(end_ns)


def append(span: Span, key: str, value: str) -> None:
    """Add `value` to the list attribute `key` of a recording span."""
    if span.is_recording():
        span.set_attribute(key, [*span.attributes.get(key, ()), value])


def add(span: Span, key: str, n: int) -> None:
    """Add `n` to the number attribute `key` of a recording span."""
    if span.is_recording():
        span.set_attribute(key, span.attributes.get(key, 0) + n)


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as Unix nanoseconds (what span times are)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def exemplar(span: Span) -> dict[str, str] | None:
    """The Prometheus exemplar of an observation made for `span`'s request: its trace id,
    when the span is sampled (else None: no exemplar)."""
    ctx = span.get_span_context()
    if not ctx.trace_flags.sampled:
        return None
    return {"trace_id": format(ctx.trace_id, "032x")}


# ---- propagation (W3C trace context) -------------------------------------------------------
def carrier(span: Span) -> dict[str, str]:
    """`traceparent` (and `tracestate`) of `span`; empty while off or for the OFF span."""
    out: dict[str, str] = {}
    if _tracer is not None and span.get_span_context().is_valid:
        _W3C.inject(out, trace.set_span_in_context(span, _ROOT))
    return out


def metadata(span: Span) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying `span` to the next tier (empty while off)."""
    return tuple(carrier(span).items())


def from_carrier(values: Mapping[str, str]) -> Context | None:
    """The remote parent in `values` (lower-case keys: traceparent, tracestate, and the
    caller's `x-request-id`, which the spans started under it take), or None (off, or
    no traceparent)."""
    if _tracer is None or "traceparent" not in values:
        return None
    ctx = _W3C.extract(values)
    rid = values.get(REQUEST_ID_HEADER)
    return set_value(_CALLER_RID, rid, ctx) if rid else ctx


_PROPAGATED = ("traceparent", "tracestate", REQUEST_ID_HEADER)


def from_metadata(md: Iterable[tuple[str, str | bytes]] | None) -> Context | None:
    """The remote parent in a call's invocation metadata (None: off, or none sent)."""
    if _tracer is None or not md:
        return None
    return from_carrier({k.lower(): v for k, v in md
                         if k.lower() in _PROPAGATED and isinstance(v, str)})


def from_call(context) -> Context | None:
    """The remote parent of a gRPC server call (its `grpc.aio.ServicerContext`): None while
    off (its metadata is not even read) or when the caller sent none."""
    if _tracer is None:
        return None
    return from_metadata(context.invocation_metadata())


def from_headers(headers: Mapping[str, str]) -> Context | None:
    """The remote parent in HTTP headers (None: off, or none sent)."""
    if _tracer is None or "traceparent" not in headers:
        return None
    return from_carrier({k: headers[k] for k in ("traceparent", "tracestate") if k in headers})
