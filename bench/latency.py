"""Percentiles and per-run medians shared by the serving benchmarks (e2e.py, peer.py)."""

from __future__ import annotations

import statistics


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs by nearest rank (nan when empty)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def summary(runs: list[dict], medians: tuple[str, ...] = ("rps",)) -> dict:
    """Medians over runs of each run's `medians` fields and of its TTFT/TPOT p50/p99 (ms);
    failures summed. Each run holds lists `ttft`, `tpot` (seconds) and `failures`."""
    med = statistics.median
    out = {k: med(r[k] for r in runs) for k in medians}
    for name in ("ttft", "tpot"):
        for q in (50, 99):
            out[f"{name}{q}"] = med(pct(r[name], q / 100) for r in runs) * 1e3
    out["failures"] = sum(r["failures"] for r in runs)
    return out
