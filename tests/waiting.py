"""Waiting for a state in a test, and the one place a test reads a clock.

A test checks behaviour (an exit status, an error line, the state reached, which mechanism
ended a wait), never how long something took: speed belongs in a benchmark (bench/), not in
a test that runs on a shared, noisy machine. So a wait here ends when its predicate holds,
and its timeout is only a hang guard: generous (at least `MIN_HANG_GUARD_S`), and when it
fires the failure says which state was not reached and what the state was instead.
tests/test_no_durations.py keeps every other test file off the clock.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

# NOTE: a wait shorter than this would be a speed claim in disguise.
MIN_HANG_GUARD_S = 30.0


def _end(timeout_s: float, what: str) -> float:
    if timeout_s < MIN_HANG_GUARD_S:
        raise ValueError(f"waiting for {what}: timeout_s={timeout_s} is a speed claim; a wait's "
                         f"timeout is a hang guard of at least {MIN_HANG_GUARD_S:.0f} s")
    return time.monotonic() + timeout_s


def _hung(what: str, timeout_s: float, shown: Any) -> AssertionError:
    return AssertionError(f"{what} not reached within {timeout_s} s (hang guard): {shown!r}")


def wait_until(predicate: Callable[[], Any], *, timeout_s: float, what: str,
               state: Callable[[], Any] | None = None, until: Callable[[Any], Any] | None = None,
               poll_s: float = 0.05) -> Any:
    """Poll `predicate` until it returns something truthy, and return that; or, with
    `until`, poll `predicate` for a value until `until(value)` holds, and return the value.
    Past `timeout_s` (a hang guard) raise AssertionError naming `what` and showing `state()`
    (default: the last value polled)."""
    end = _end(timeout_s, what)
    while True:
        got = predicate()
        if (until or bool)(got):
            return got
        if time.monotonic() >= end:
            raise _hung(what, timeout_s, state() if state else got)
        time.sleep(poll_s)


async def async_wait_until(predicate: Callable[[], Any], *, timeout_s: float, what: str,
                           state: Callable[[], Any] | None = None,
                           until: Callable[[Any], Any] | None = None,
                           poll_s: float = 0.05) -> Any:
    """`wait_until` for a coroutine: `predicate` may be sync or async; the loop keeps
    running between polls."""
    end = _end(timeout_s, what)
    while True:
        got = predicate()
        if inspect.isawaitable(got):
            got = await got
        if (until or bool)(got):
            return got
        if time.monotonic() >= end:
            raise _hung(what, timeout_s, state() if state else got)
        await asyncio.sleep(poll_s)


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not yet reaped by its parent, does
    not): the state a wait for a process to be gone polls."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
