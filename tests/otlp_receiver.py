"""An OTLP/gRPC trace receiver for tests: the protocol's own `TraceService` (the protobuf
service of opentelemetry-proto, as a collector serves it) on a local port, keeping every
span it is sent.

    with OtlpReceiver() as rx:                      # rx.endpoint = "http://127.0.0.1:PORT"
        ... run something exporting to rx.endpoint ...
        spans = rx.wait_for(lambda spans: ..., what="...")   # [ReceivedSpan]

Spans come back as plain `ReceivedSpan`s (hex ids, the service name of the resource that
sent them, attributes as Python values) so tests read them without the protobuf types.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from waiting import wait_until


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class ReceivedSpan:
    service: str  # service.name of the resource that exported it
    resource: dict
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a trace's root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    status_code: int  # 0 unset, 1 ok, 2 error
    events: list[str] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)

    @property
    def request_id(self) -> str:
        return self.attributes.get("tandem.request_id", "")


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, store: OtlpReceiver) -> None:
        self.store = store

    def Export(self, request, context):  # noqa: N802
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(
                        service=resource.get("service.name", ""), resource=resource,
                        name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(), kind=s.kind,
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        status_code=s.status.code, events=[e.name for e in s.events],
                        links=[(lk.trace_id.hex(), lk.span_id.hex()) for lk in s.links]))
        with self.store._lock:
            self.store._spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=None)

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, done: Callable[[list[ReceivedSpan]], object], what: str,
                 timeout_s: float = 60.0) -> list[ReceivedSpan]:
        """Every span received once `done(spans)` holds (a hang guard otherwise)."""
        return wait_until(lambda: self.spans, until=done, timeout_s=timeout_s, what=what,
                          state=lambda: sorted({(s.service, s.name) for s in self.spans}))
