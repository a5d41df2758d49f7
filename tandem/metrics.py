"""The one metrics convention of every Tandem service.

    registry = service_registry()                    # one per service instance
    metrics = metric_set(EncoderMetrics, registry)   # each metric set: a class taking it
    serve_metrics(cfg.metrics_port, cfg.host, registry)   # encoder, language: /metrics
    # the router renders the same registry on its own HTTP app (/metrics)

A service passes its registry to every component that counts something (its own metric
set, the transfer layer's), so one /metrics page shows them all, and several instances in
one process (tests, benchmarks) never share or collide. prometheus-client refuses to
register a metric name twice in one registry, yet several components ask for the same
set: `metric_set` creates each set once per registry and hands the same object back.

Naming (what `promtool check metrics` enforces, and tests/test_metrics_lint.py checks on
every tier): counters count (`*_total`), gauges hold a level and never end in `_total`
(a pool's size is `*_capacity`), base units in the name (`_seconds`, `_bytes`), ratios
in [0, 1] end in `_ratio`. The served model is one info series per service,
`tandem_model_info{model_name, tier} 1`, not a label on every series (see ModelInfo).
"""

from __future__ import annotations

import threading
import weakref
from typing import TypeVar

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Info,
    start_http_server,
)

M = TypeVar("M")

_lock = threading.Lock()
# NOTE: keyed by the registry object itself (weakly): an id() key could be reused by a new
# registry after the old one is collected and hand it a set bound to the dead one.
_sets: weakref.WeakKeyDictionary[CollectorRegistry, dict[type, object]] = (
    weakref.WeakKeyDictionary()
)


def service_registry() -> CollectorRegistry:
    """A fresh registry for one service instance, with the process, platform and GC
    collectors the process registry has (they read the process, so any registry may
    hold them)."""
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


def metric_set(cls: type[M], registry: CollectorRegistry | None = None) -> M:
    """The `cls(registry)` of `registry` (default: the process registry), created once."""
    reg = registry if registry is not None else REGISTRY
    with _lock:
        sets = _sets.setdefault(reg, {})
        m = sets.get(cls)
        if m is None:
            m = sets[cls] = cls(reg)
        return m  # type: ignore[return-value]


def serve_metrics(port: int, host: str, registry: CollectorRegistry) -> None:
    """Expose `registry` as /metrics over HTTP on `host:port` (a daemon thread)."""
    start_http_server(port, addr=host, registry=registry)


class ModelInfo:
    """`tandem_model_info{model_name, tier} 1`: the model a service serves.

    NOTE: an info series, Prometheus' convention for constant metadata (`python_info`,
    `prometheus_build_info`), instead of vLLM's `model_name` label on every series: a
    Tandem process serves one model, so the label would tell nothing within a target, and
    the name is a free string (a local path, a hub id) whose change on redeploy would
    replace every series of the target. Joined where a query needs it:
    `rate(x[5m]) * on(instance) group_left(model_name) tandem_model_info`.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.info = Info("tandem_model", "The model this service serves (value 1).",
                         registry=registry)

    def set(self, tier: str, model_name: str) -> None:
        self.info.info({"model_name": model_name, "tier": tier})


def model_info(registry: CollectorRegistry, tier: str, model_name: str) -> None:
    """Say which model `registry`'s service serves (`tandem_model_info`)."""
    metric_set(ModelInfo, registry).set(tier, model_name)


class MirroredCounter:
    """A Counter that follows a running total someone else keeps (a cache's eviction
    count): `set(total)` moves it up by what the total gained since the last call.

    NOTE: a total that goes down (its owner was rebuilt) starts a new run; the counter
    never does, as a counter must not."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self._seen = 0
        self._lock = threading.Lock()

    def set(self, total: float) -> None:
        with self._lock:
            gained = total - self._seen if total >= self._seen else total
            self._seen = total
        if gained > 0:
            self.counter.inc(gained)
