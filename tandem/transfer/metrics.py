"""Prometheus metrics of the transfer layer (one set per registry, shared by instances).

    tandem_transfer_bytes_total{side}                bytes written (encoder) / received
    tandem_transfer_tokens_total{side}               prompt tokens delivered
    tandem_transfer_seconds{side}                    room time, Init to Done (histogram)
    tandem_transfer_resumes_total{side}              Resume rounds
    tandem_transfer_failures_total{side,code,reason} failed rooms by gRPC code name and
                                                     reason (`failure_reason`): alert on
                                                     reason="transfer"
    tandem_transfer_ranges_total{role}               payload ranges written for split prompts:
                                                     role="lead" (pieces a lead handed to a
                                                     helper), "helper" (pieces written for a lead)
    tandem_transfer_range_fallbacks_total            helper ranges the lead re-encoded (helper lost)
    tandem_transfer_blocks_free / _blocks_capacity   embedding blocks (language side only)
    tandem_transfer_room_stall_seconds               longest an open room has gone without
                                                     progress (language side only; `RoomStall`)

Several senders/receivers in one process (tests) share the collectors of their registry,
so constructing a second instance never raises "Duplicated timeseries".
"""

from __future__ import annotations

import threading
import time
import weakref

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


class RoomStall:
    """`tandem_transfer_room_stall_seconds`: how long the most idle open room of the
    language side has gone without progress, read at scrape time (0 with no room open).

    Progress is what moves a room on: its Init (its blocks reserved, or a reattach) and
    each announce, Progress or Done from its encoder. A heartbeat (AttachWorking: the
    encoder still prepares the payload) is not progress, and a room still queued for its
    first blocks has not started (that wait is queueing: `tandem_transfer_blocks_free`).
    The receiver fails a room whose encoder stays silent for the transfer timeout, so a
    room idle for several timeouts is stuck: its encoder keeps beating over a pipeline
    that never delivers (a wedged preprocess or ViT), or the language process' event
    loop no longer runs its timers (the gauge is computed on the metrics thread, so it
    rises then too). The chart's TandemRoomStuck alert reads it.

    Every receiver of the registry is watched (tests run several in one process)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._receivers: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()  # watch() on the event loop, reads on the metrics thread
        self.gauge = Gauge("tandem_transfer_room_stall_seconds",
                           "Longest time an open room (language side) has gone without "
                           "progress; 0 with no room open.", registry=registry)
        self.gauge.set_function(self.longest)

    def watch(self, receiver) -> None:
        """Count `receiver`'s rooms (it has `progress_times()`: its open rooms' last
        progress, `time.monotonic()` values)."""
        with self._lock:
            self._receivers.add(receiver)

    def longest(self) -> float:
        with self._lock:
            receivers = list(self._receivers)
        now = time.monotonic()
        return max((now - t for rx in receivers for t in _progress_times(rx)), default=0.0)


def _progress_times(receiver, tries: int = 8) -> list[float]:
    """`receiver.progress_times()` from the metrics thread. NOTE: its copy of the room table
    runs without a thread switch unless a garbage collection during the copy runs Python
    code; then the event loop may resize the table and the copy raises RuntimeError: take
    it again (a scrape never fails for it)."""
    for _ in range(tries):
        try:
            return receiver.progress_times()
        except RuntimeError:
            continue
    return []


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
        self.ranges = Counter(
            "tandem_transfer_ranges", "Pieces of split prompts: handed to a helper (role=lead) "
            "or written for a lead (role=helper).", ["role"], **kw)
        self.range_fallbacks = Counter(
            "tandem_transfer_range_fallbacks",
            "Helper ranges the lead re-encoded itself (the helper was lost).", **kw)
        self._blocks: BlockGauges | None = None

    def blocks(self, free: int, capacity: int) -> None:
        """Set the embedding-block gauges (the first call registers them)."""
        g = self._blocks = self._blocks or metric_set(BlockGauges, self.registry)
        g.free.set(free)
        g.capacity.set(capacity)

    def watch_rooms(self, receiver) -> None:
        """Report `receiver`'s idlest room (`RoomStall`; the first call registers it)."""
        metric_set(RoomStall, self.registry).watch(receiver)


def transfer_metrics(registry: CollectorRegistry | None = None) -> TransferMetrics:
    """The metric set of `registry` (default: the process registry), created once."""
    return metric_set(TransferMetrics, registry)
