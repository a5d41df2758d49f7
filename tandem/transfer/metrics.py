"""Prometheus metrics of the transfer layer (one set per registry, shared by instances).

    tandem_transfer_bytes_total{side}                bytes written (encoder) / received
    tandem_transfer_tokens_total{side}               prompt tokens delivered
    tandem_transfer_seconds{side}                    room time, Init to Done (histogram)
    tandem_transfer_resumes_total{side}              Resume rounds
    tandem_transfer_failures_total{side,code,reason} failed rooms by gRPC code name and
                                                     reason (`failure_reason`): alert on
                                                     reason="transfer"
    tandem_transfer_blocks_free / _blocks_capacity   embedding blocks (language side only)

Several senders/receivers in one process (tests) share the collectors of their registry,
so constructing a second instance never raises "Duplicated timeseries".
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem.metrics import metric_set

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

# Codes with which the request, not the transfer, ended a room: its caller cancelled it
# (the client went away, or the request failed outside the transfer, e.g. a bad image:
# the router then cancels the room on both sides), or its own deadline passed (which
# includes queueing for blocks under load). Every other code is a transfer fault.
REQUEST_CODES = frozenset({"CANCELLED", "DEADLINE_EXCEEDED"})


def failure_reason(code: str) -> str:
    """`reason` of a failed room, decided by its gRPC code name: "request" or "transfer"."""
    return "request" if code in REQUEST_CODES else "transfer"


class FailureCounter:
    """`failures.labels(side, code).inc()` counts a failed room under the reason its code
    gives (`failure_reason`), so every caller classifies the same way."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter

    def labels(self, side: str, code: str):
        return self.counter.labels(side, code, failure_reason(code))


class BlockGauges:
    """The language side's embedding blocks (registered only where blocks exist)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        kw = {"registry": registry}
        self.free = Gauge("tandem_transfer_blocks_free", "Free embedding blocks.", **kw)
        self.capacity = Gauge("tandem_transfer_blocks_capacity", "All embedding blocks.", **kw)


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        kw = {"registry": registry}
        self.bytes = Counter("tandem_transfer_bytes", "Payload bytes moved.", ["side"], **kw)
        self.tokens = Counter("tandem_transfer_tokens", "Prompt tokens delivered.", ["side"], **kw)
        self.seconds = Histogram(
            "tandem_transfer_seconds", "Room transfer time, Init to Done.", ["side"],
            buckets=_BUCKETS, **kw)
        self.resumes = Counter("tandem_transfer_resumes", "Resume rounds.", ["side"], **kw)
        self.failures = FailureCounter(Counter(
            "tandem_transfer_failures",
            'Failed rooms by gRPC code; reason="transfer" for faults of the transfer, '
            '"request" when the request ended the room (cancelled, its deadline).',
            ["side", "code", "reason"], **kw))
        self._blocks: BlockGauges | None = None

    def blocks(self, free: int, capacity: int) -> None:
        """Set the embedding-block gauges (the first call registers them)."""
        g = self._blocks = self._blocks or metric_set(BlockGauges, self.registry)
        g.free.set(free)
        g.capacity.set(capacity)


def transfer_metrics(registry: CollectorRegistry | None = None) -> TransferMetrics:
    """The metric set of `registry` (default: the process registry), created once."""
    return metric_set(TransferMetrics, registry)
