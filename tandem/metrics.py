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
