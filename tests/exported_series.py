"""The series the tiers export, read from their metric sets, and a checker for the PromQL the
chart's dashboard, alerts and prometheus-adapter rules run over them.

`exported_series()` builds every metric set of the three tiers (encoder, language, router,
the transfer layer's, the model info) in a registry of its own and names each series a
scrape shows, with its labels: a counter's `_total`, a histogram's `_bucket` (with `le`),
`_sum` and `_count`, a gauge as itself, an info's `_info`. `selector_problems(expr)` says
what in a query names a series or a label no tier exports, so a panel or an alert can never
wait on a series that does not exist (tests/test_chart_observability.py,
tests/test_helm_chart.py).
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

# Labels Prometheus adds to every scraped series (the target's, and the Prometheus
# Operator's ServiceMonitor ones): a query may group or match on them.
TARGET_LABELS = frozenset({"instance", "job", "namespace", "pod", "service", "endpoint",
                           "container"})

_SELECTOR = re.compile(r"\b(tandem_[a-z0-9_]+)\b(?:\{([^}]*)\})?")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def _wrappers(obj, depth: int = 0):
    """The prometheus-client metrics a metric set holds (directly, or in a wrapper of its
    own such as FailureCounter or MirroredCounter)."""
    for value in vars(obj).values():
        if isinstance(value, MetricWrapperBase):
            yield value
        elif depth < 2 and type(value).__module__.startswith("tandem"):
            yield from _wrappers(value, depth + 1)


def _metric_sets():
    from tandem.metrics import ModelInfo
    from tandem.services.encoder.metrics import EncoderMetrics
    from tandem.services.language.metrics import LanguageMetrics
    from tandem.services.router.metrics import RouterMetrics
    from tandem.transfer.metrics import BlockGauges, RoomStall, TransferMetrics

    return (EncoderMetrics, LanguageMetrics, RouterMetrics, TransferMetrics, BlockGauges,
            RoomStall, ModelInfo)


def exported_series() -> dict[str, frozenset[str]]:
    """{series name: its label names} of every series the tiers export."""
    out: dict[str, frozenset[str]] = {}
    for cls in _metric_sets():
        for metric in _wrappers(cls(CollectorRegistry())):
            (family,) = metric.describe()
            # NOTE: prometheus-client keeps a metric's label names private; an info's are
            # its value's keys, set at run time (tandem_model_info: ModelInfo.set)
            labels = frozenset(metric._labelnames)
            name = family.name
            match family.type:
                case "counter":
                    out[f"{name}_total"] = labels
                case "histogram":
                    out[f"{name}_bucket"] = labels | {"le"}
                    out[f"{name}_sum"] = out[f"{name}_count"] = labels
                case "info":
                    out[f"{name}_info"] = frozenset({"model_name", "tier"})
                case _:
                    out[name] = labels
    return out


def selector_problems(expr: str, exported: dict[str, frozenset[str]]) -> list[str]:
    """What in `expr` no tier exports: a series name, a label a selector matches on, or a
    label it groups or joins by (which must be a label of one of its series or a target's)."""
    problems, seen = [], set(TARGET_LABELS)
    for name, matchers in _SELECTOR.findall(expr):
        if name not in exported:
            problems.append(f"{name}: no tier exports it")
            continue
        seen |= exported[name]
        for label in _MATCHER.findall(matchers):
            if label not in exported[name] | TARGET_LABELS:
                problems.append(f"{name}: has no label {label!r}")
    for group in _GROUPING.findall(expr):
        for label in filter(None, (g.strip() for g in group.split(","))):
            if label not in seen:
                problems.append(f"grouping by {label!r}: none of the query's series has it")
    return problems
