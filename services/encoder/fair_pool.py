"""The preprocessing worker threads, shared fairly among clients.

    run(client, fn, *args) ─▶ the client's FIFO ─┐
                                                 ├─▶ a free thread takes the next job of the
    run(other, fn, *args)  ─▶ the other's FIFO ──┘   waiting client that holds the fewest
                                                     threads and is under its share (ties:
                                                     the least thread time used lately,
                                                     then in turn, round-robin)

The share rule lives here and only here: a client runs at most `share` jobs at once
(default: half the threads, at least one), and a free thread goes to the client holding
the fewest, not to the oldest job overall. A flood of slow jobs from one client (an image
URL that trickles, a huge image or text) therefore holds at most `share` threads; while
`share < workers` another client's job starts at once, and otherwise it takes the first
thread that frees. A request without a client key is a client of its own.

Time is shared too, not only threads: each client's thread time (its jobs' seconds on a
thread, decaying with a half-life of USAGE_HALF_LIFE_S) breaks the ties, so among clients
waiting with as many threads, the one that used the threads least lately goes first. A
client whose videos each decode for tens of seconds (every one within its per-byte budget)
thus takes its turn after a client with a short job, rather than alternating with it job
for job; the pool stays work-conserving (an idle thread always takes a waiting job).

A job cancelled before it starts is dropped. A started job cannot be interrupted (a
thread); it holds its thread, and its client's share, until it returns: the share counts
threads really busy. Jobs bound their own time (the preprocessor's `Budget`).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

_anonymous = itertools.count()


def share_of(workers: int, share: int) -> int:
    """The most threads one client may hold: `share`, or half of `workers` when 0, never
    under 1 nor over `workers`."""
    return max(1, min(workers, share or workers // 2))


# A client's thread time counts half after this long (the window its share is judged on)
USAGE_HALF_LIFE_S = 60.0
# Clients whose usage is remembered, the largest first when pruned
USAGE_CLIENTS_KEPT = 4096


@dataclass(eq=False)
class _Job:
    client: str
    call: Callable[[], Any]
    future: asyncio.Future
    started: bool = False
    started_at: float = 0.0  # on the pool's clock


@dataclass
class _Usage:
    """A client's thread seconds, decayed to `at` on the pool's clock."""

    seconds: float
    at: float

    def now(self, t: float) -> float:
        return self.seconds * 0.5 ** ((t - self.at) / USAGE_HALF_LIFE_S)


class FairPool:
    """`workers` threads; at most `share_of(workers, share)` of them per client. One event
    loop drives it at a time (its bookkeeping runs on that loop, never in the threads)."""

    def __init__(self, workers: int, share: int = 0, name: str = "preprocess",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.workers = workers
        self.share = share_of(workers, share)
        self._clock = clock
        self._usage: dict[str, _Usage] = {}  # thread time used lately, per client
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix=name)
        # client -> its waiting jobs; the dict's order is the turn (served clients move last)
        self._waiting: dict[str, collections.deque[_Job]] = {}
        self._running: collections.Counter[str] = collections.Counter()
        self.busy = 0  # threads running a job

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    async def run(self, client: str | None, fn: Callable, *args) -> Any:
        """`fn(*args)` on a worker thread, in `client`'s turn; None or "": a client of its
        own."""
        key = client if client else f"\0anonymous-{next(_anonymous)}"
        job = _Job(key, functools.partial(fn, *args), asyncio.get_running_loop().create_future())
        self._waiting.setdefault(key, collections.deque()).append(job)
        self._dispatch()
        try:
            return await job.future
        finally:
            if not job.started:  # cancelled while waiting: it never runs
                self._drop(job)

    def shutdown(self) -> None:
        for q in self._waiting.values():
            for job in q:
                job.future.cancel()
        self._waiting.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ turns
    def usage(self, client: str) -> float:
        """`client`'s thread seconds lately (decayed; 0 for one never seen)."""
        u = self._usage.get(client)
        return u.now(self._clock()) if u is not None else 0.0

    def _dispatch(self) -> None:
        while self.busy < self.workers:
            ready = [c for c in self._waiting if self._running[c] < self.share]
            if not ready:
                return
            # NOTE: min keeps the first of equal keys: in turn among clients never served
            client = min(ready, key=lambda c: (self._running[c], self.usage(c)))
            q = self._waiting.pop(client)  # NOTE: re-inserted last: its turn is used
            job = q.popleft()
            if q:
                self._waiting[client] = q
            self._start(job)

    def _start(self, job: _Job) -> None:
        job.started = True
        job.started_at = self._clock()
        self.busy += 1
        self._running[job.client] += 1
        done = asyncio.get_running_loop().run_in_executor(self._threads, job.call)
        done.add_done_callback(functools.partial(self._finished, job))

    def _finished(self, job: _Job, done: asyncio.Future) -> None:
        self._charge(job.client, self._clock() - job.started_at)
        self.busy -= 1
        self._running[job.client] -= 1
        if self._running[job.client] <= 0:
            del self._running[job.client]
        if done.cancelled():
            job.future.cancel()
        elif done.exception() is not None:  # NOTE: read even when nobody waits any more
            if not job.future.done():
                job.future.set_exception(done.exception())
        elif not job.future.done():
            job.future.set_result(done.result())
        self._dispatch()

    def _charge(self, client: str, seconds: float) -> None:
        now = self._clock()
        self._usage[client] = _Usage(self.usage(client) + seconds, now)
        if len(self._usage) > USAGE_CLIENTS_KEPT:  # forget those that used the least
            for c in sorted(self._usage, key=lambda c: self._usage[c].now(now))[
                    :len(self._usage) - USAGE_CLIENTS_KEPT]:
                del self._usage[c]

    def _drop(self, job: _Job) -> None:
        q = self._waiting.get(job.client)
        if q is not None and job in q:
            q.remove(job)
            if not q:
                del self._waiting[job.client]
