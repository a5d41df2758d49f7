"""One metric set per Prometheus registry.

prometheus-client refuses to register a metric name twice in one registry, yet several
components (or several instances in one test process) ask for the same set. `metric_set`
creates each set once per registry and hands the same object back afterwards.
"""

from __future__ import annotations

import threading
from typing import TypeVar

from prometheus_client import REGISTRY, CollectorRegistry

M = TypeVar("M")

_lock = threading.Lock()
_sets: dict[tuple[type, int], object] = {}


def metric_set(cls: type[M], registry: CollectorRegistry | None = None) -> M:
    """The `cls(registry)` of `registry` (default: the process registry), created once."""
    reg = registry if registry is not None else REGISTRY
    key = (cls, id(reg))
    with _lock:
        m = _sets.get(key)
        if m is None:
            m = _sets[key] = cls(reg)
        return m  # type: ignore[return-value]
