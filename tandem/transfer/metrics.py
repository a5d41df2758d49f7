"""Prometheus metrics of the transfer layer (one set per registry, shared by instances).

    tandem_transfer_bytes_total{side}                bytes written (encoder) / received
    tandem_transfer_tokens_total{side}               prompt tokens delivered
    tandem_transfer_seconds{side}                    room time, Init to Done (histogram)
    tandem_transfer_resumes_total{side}              Resume rounds
    tandem_transfer_failures_total{side,code}        failed rooms by gRPC code name
    tandem_transfer_blocks_free / _blocks_total      embedding blocks (language side)

Several senders/receivers in one process (tests) share the collectors of their registry,
so constructing a second instance never raises "Duplicated timeseries".
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem.metrics import metric_set

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        kw = {"registry": registry}
        self.bytes = Counter("tandem_transfer_bytes", "Payload bytes moved.", ["side"], **kw)
        self.tokens = Counter("tandem_transfer_tokens", "Prompt tokens delivered.", ["side"], **kw)
        self.seconds = Histogram(
            "tandem_transfer_seconds", "Room transfer time, Init to Done.", ["side"],
            buckets=_BUCKETS, **kw)
        self.resumes = Counter("tandem_transfer_resumes", "Resume rounds.", ["side"], **kw)
        self.failures = Counter(
            "tandem_transfer_failures", "Failed rooms by gRPC code.", ["side", "code"], **kw)
        self.blocks_free = Gauge("tandem_transfer_blocks_free", "Free embedding blocks.", **kw)
        self.blocks_total = Gauge("tandem_transfer_blocks_total", "All embedding blocks.", **kw)


def transfer_metrics(registry: CollectorRegistry | None = None) -> TransferMetrics:
    """The metric set of `registry` (default: the process registry), created once."""
    return metric_set(TransferMetrics, registry)
