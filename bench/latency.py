"""What the serving benchmarks share (e2e.py, peer.py, reuse.py, language.py): percentiles,
per-run medians, the machine's one-line description, writing a result table, and the
cached tiny checkpoint."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path


def checkpoint(arch: str, size: str) -> Path:
    """The tests' cached tiny checkpoint (.cache/test-models), built on first use. NOTE: not
    through tests/conftest.py, whose OMP_NUM_THREADS=1 would reach every benchmarked server."""
    from tandem.models.tiny import cached_tiny_model

    return cached_tiny_model(Path(__file__).resolve().parent.parent / ".cache" / "test-models",
                             arch, size)


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


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs (shared), {platform.python_version()}"


def publish(text: str, out: str) -> None:
    """Print a result table and write it to `out` (its folder made)."""
    print(text)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)


async def sse_events(resp):
    """The JSON events of an OpenAI streaming response (`data: {...}` lines; `[DONE]` and
    anything else skipped)."""
    async for line in resp.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])
