"""Grammars: the one compiler of a language instance: per-client queues in two lanes,
the slots that run them on worker processes, and the cache of compiled grammars with its
memory budget (see the package's docstring for the whole path)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

from tandem.sampling import GrammarSpec
from tandem.services.language.engine.grammar.checks import (
    LIGHT_CPU_S,
    GrammarError,
    GrammarLimits,
    check_spec,
    no_output_error,
)
from tandem.services.language.engine.grammar.memory import Releaser
from tandem.services.language.engine.grammar.workers import (
    OVER_CPU,
    TIMED_OUT,
    Checked,
    Niced,
    Worker,
    compile_with,
)

log = logging.getLogger("tandem.language.grammar")


@dataclass(eq=False)
class _Job:
    spec: GrammarSpec
    client: str
    light: bool = False  # in the light lane (SpecCost.light, and its client not moved out)
    future: Future = field(default_factory=Future)
    interest: int = 1  # requests that want it; 0: abandoned
    stop: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class _Evicted:
    future: Future  # done, or abandoned before its compile ended
    bytes: int  # what the cache had charged it


class Grammars:
    """Compiles grammars for one tokenizer and vocabulary; thread-safe."""

    HEAVY_CLIENTS_KEPT = 4096  # clients whose light specs go to the other lane (LRU)
    # Nice values of a slot's worker process and of its thread that compiles here
    # (decoding runs at 0). The shared slots' costly compiles at 15: they take idle time
    # first. The light-only slot's at 5, not 10: a small schema's compile wakes two of
    # them in turn, and the kernel (EEVDF) lets a running task finish its slice before a
    # waking one only 3x its weight (10 against 15), so under a flood of costly compiles
    # each waited 4-12 ms for a core (measured on the runqueue, /proc/<tid>/schedstat)
    # and a fresh small schema's p99 was ~2.1x its unloaded one; 9x the weight (5) takes
    # the core at once (bench/results/grammar-flood.md). Still a third of decoding's
    # weight, and one compile at a time, each bounded by LIGHT_CPU_S.
    LIGHT_NICE = 5
    SHARED_NICE = 15
    # Evicted bytes between two malloc_trim calls: at least this, and a quarter of the
    # budget (a trim walks the whole heap, its arenas locked: ~50 ms on a large one)
    TRIM_EVERY_BYTES = 32 << 20

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 limits: GrammarLimits | None = None, cache_size: int = 256) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.limits = limits or GrammarLimits()
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()  # compiled or compiling
        # Bytes charged to each compiled grammar in the cache: what its compile grew the
        # worker's heap by (read there, once). Invariant: _cached_bytes ==
        # sum(_sizes.values()), keys a subset of _cache's.
        self._sizes: dict[GrammarSpec, int] = {}
        self._cached_bytes = 0
        # NOTE: every compiled grammar this object lets go of goes there, never dropped here
        self._releaser = Releaser(
            lambda: max(self.TRIM_EVERY_BYTES, self.limits.cache_bytes // 4))
        self._jobs: dict[Future, _Job] = {}  # not yet done
        # per lane (True: light), per client, in turn from the longest waiting
        self._queues: dict[bool, OrderedDict[str, collections.deque[_Job]]] = {
            True: OrderedDict(), False: OrderedDict()}
        self._running: collections.Counter[str] = collections.Counter()  # on shared slots
        self._heavy_clients: OrderedDict[str, None] = OrderedDict()
        self._light_busy = False  # the light-only slot is running a job
        self._closed = False
        self._info = None  # xgrammar.TokenizerInfo, made on first use
        self._info_json = ""  # ... serialized, for the workers
        self._compiler = None  # this process's xgrammar.GrammarCompiler (thread-safe)
        self._info_lock = threading.Lock()
        self._slots: list[threading.Thread] = []
        self._workers: list[Worker] = []  # one per slot, once it has run a job
        self._niced: list[Niced] = []  # one per slot: its compiles here
        self.compiled = 0  # grammars compiled (cache misses)
        self.timed_out = 0  # refused: past compile_timeout_s
        self.over_cpu = 0  # refused: past max_compile_cpu_s
        self.abandoned = 0
        self.demoted = 0  # light specs moved to the other lane
        self.compiling_here = 0  # compiles in this process right now
        self.local_compiles = 0  # compiles done in this process ...
        self.local_cpu_s = 0.0  # ... and their CPU (the slot threads')
        self.expected_cpu_s = 0.0  # the worker's CPU for the same compiles

    # -- the engine's side --

    def compile(self, spec: GrammarSpec, client: str = "") -> Future:
        """The compiled grammar of `spec` (a shared future; a refused one raises
        GrammarError). Each call is one request's interest: the caller `abandon`s it if
        the request ends before the future is done."""
        with self._lock:
            fut = self._shared(spec)
        if fut is not None:
            return fut
        try:  # NOTE: off the lock: parsing a 256 KB schema takes milliseconds
            cost = check_spec(spec, self.limits)
        except GrammarError as e:
            fut = Future()
            fut.set_exception(e)
            return fut
        with self._lock:
            fut = self._shared(spec)  # asked by another request meanwhile
            if fut is not None:
                return fut
            job = _Job(spec, client, light=cost.light and client not in self._heavy_clients)
            if self._closed:
                job.future.cancel()
                return job.future
            self._cache[spec] = job.future
            self._jobs[job.future] = job
            self._queues[job.light].setdefault(client, collections.deque()).append(job)
            self._start_slots()
            self._work.notify_all()
            evicted = self._trim_cache()
        self._release(evicted)
        return job.future

    def _shared(self, spec: GrammarSpec) -> Future | None:  # lock held
        """The cached future of `spec`, with one more request's interest; None if none."""
        fut = self._cache.get(spec)
        if fut is None or not _reusable(fut):
            return None
        self._cache.move_to_end(spec)
        job = self._jobs.get(fut)
        if job is not None:
            job.interest += 1
        return fut

    def abandon(self, fut: Future) -> None:
        """One request no longer wants `fut`: when none does, its compile stops (dropped
        from the queue, or its worker killed). No-op once the future is done."""
        with self._lock:
            job = self._jobs.get(fut)
            if job is None:
                return
            job.interest -= 1
            if job.interest > 0:
                return
            job.stop.set()
            self.abandoned += 1
            self._forget(job)
        job.future.cancel()  # queued: never runs; running: its slot sees `stop`

    def close(self) -> None:
        """Stop every compile (workers killed) and the slots; pending futures cancelled."""
        with self._lock:
            self._closed = True
            jobs = list(self._jobs.values())
            for job in jobs:
                job.stop.set()
                self._forget(job)
            self._work.notify_all()
        for job in jobs:
            job.future.cancel()
        for t in self._slots:
            t.join(timeout=5)
        self._releaser.close()

    def worker_pids(self) -> list[int]:
        """The compile processes alive now (one per slot at most)."""
        with self._lock:
            procs = [w.proc for w in self._workers]
        return [p.pid for p in procs if p is not None and p.is_alive()]

    def slot_thread_ids(self) -> list[int]:
        """The native ids of the slots' threads and of the threads that compile here for
        them: the only threads that work for compiles in this process."""
        with self._lock:
            threads = self._slots + [n.thread for n in self._niced]
        return [t.native_id for t in threads if t.native_id is not None]

    @property
    def releasing(self) -> int:
        """Compiled grammars let go of and not yet freed (a request may still use them)."""
        return self._releaser.held

    @property
    def trims(self) -> int:
        """Times the freed memory was handed back to the OS."""
        return self._releaser.trims

    @property
    def cached_bytes(self) -> int:
        """Bytes charged to the compiled grammars in the cache now."""
        with self._lock:
            return self._cached_bytes

    # -- internals (the lock is held where a name says so) --

    def _forget(self, job: _Job) -> None:  # lock held
        self._jobs.pop(job.future, None)
        if self._cache.get(job.spec) is job.future:
            self._uncache(job.spec)
        lane = self._queues[job.light]
        q = lane.get(job.client)
        if q is not None and job in q:
            q.remove(job)
            if not q:
                del lane[job.client]

    def _uncache(self, spec: GrammarSpec) -> _Evicted:  # lock held
        self._cached_bytes -= (charged := self._sizes.pop(spec, 0))
        return _Evicted(self._cache.pop(spec), charged)

    def _trim_cache(self) -> list[_Evicted]:  # lock held
        """Keep at most `cache_size` grammars and `cache_bytes` of compiled ones; the least
        recently asked go first (a compiling one is kept: requests wait on it). Returns what
        was dropped: the caller hands it to the releaser off the lock (`_release`)."""
        dropped = []
        for spec in list(self._cache):
            if (len(self._cache) <= self.cache_size
                    and self._cached_bytes <= self.limits.cache_bytes):
                break
            if self._cache[spec].done():
                dropped.append(self._uncache(spec))
        return dropped

    def _release(self, dropped: list[_Evicted]) -> None:
        """Hand the compiled grammars dropped from the cache to the releaser, which frees
        each once no request holds it any more, outside the GIL."""
        for evicted in dropped:
            fut = evicted.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._releaser.hand(fut.result(), evicted.bytes)

    def _start_slots(self) -> None:  # lock held
        while len(self._slots) < self.limits.workers + 1:
            light_only = len(self._slots) == self.limits.workers  # the last one
            name = "grammar-light" if light_only else f"grammar-{len(self._slots)}"
            t = threading.Thread(target=self._slot, args=(light_only,), name=name,
                                 daemon=True)
            self._slots.append(t)
            t.start()

    def _share(self) -> int:
        """Shared slots one client may hold at once: half of them (at least one), so a
        client flooding with slow specs always leaves a slot for everyone else."""
        return max(1, self.limits.workers // 2)

    def _take(self, lane: OrderedDict[str, collections.deque[_Job]], share: int | None
              ) -> _Job | None:  # lock held: the next client's oldest job in `lane`
        for client, q in lane.items():  # in turn, from the longest waiting
            if share is not None and self._running[client] >= share:
                continue  # it holds its share: the next client's job goes first
            job = q.popleft()
            del lane[client]
            if q:
                lane[client] = q  # to the back: clients take turns
            return job
        return None

    def _next_job(self, light_only: bool) -> _Job | None:  # lock held
        """A light-only slot's next job: the light lane's next client's. A shared slot's:
        while the light-only slot is busy, the light lane's; else the other lane's; from a
        client under its share. (A light spec waits for the light-only slot when it is
        free: its worker and thread run above the shared ones.)"""
        while not self._closed:
            if light_only:
                job = self._take(self._queues[True], None)
                self._light_busy = job is not None
                if job is not None and self._queues[True]:
                    self._work.notify_all()  # busy now: the shared slots may take the rest
            else:
                job = None
                if self._light_busy:
                    job = self._take(self._queues[True], self._share())
                if job is None:
                    job = self._take(self._queues[False], self._share())
                if job is not None:
                    self._running[job.client] += 1
            if job is not None:
                return job
            self._work.wait()
        return None

    def _done_running(self, job: _Job) -> None:  # lock held
        self._running[job.client] -= 1
        if not self._running[job.client]:
            del self._running[job.client]
        self._work.notify_all()  # a client under its share again may have jobs waiting

    def _tokenizer_info(self):
        with self._info_lock:
            return self._make_tokenizer_info()

    def _make_tokenizer_info(self):
        if self._info is None:
            import xgrammar as xgr

            self._info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            self._info_json = self._info.serialize_json()
            # NOTE: no cache of xgrammar's own (see "One cache, ours")
            self._compiler = xgr.GrammarCompiler(self._info, max_threads=1,
                                                 cache_enabled=False)
        return self._info

    def _slot(self, light_only: bool) -> None:
        """One compile at a time on this slot's worker, until close()."""
        # NOTE: the slot's own thread keeps the process's priority: it holds the GIL for
        # its bookkeeping and to free evicted grammars (milliseconds each), and a thread
        # descheduled while holding it stalls every other (the engine's) for as long. Its
        # worker and its compiles here run below decoding (on Linux a thread's nice value
        # is its own), the light-only slot's well above the shared ones' (LIGHT_NICE).
        nice = self.LIGHT_NICE if light_only else self.SHARED_NICE
        below = Niced(nice, f"{threading.current_thread().name}-here")
        with self._lock:
            self._niced.append(below)
        worker = None
        try:
            while True:
                with self._lock:
                    job = self._next_job(light_only)
                if job is None:
                    return
                try:
                    if job.stop.is_set():
                        continue
                    self._tokenizer_info()
                    if worker is None:
                        worker = Worker(self._info_json, nice)
                        with self._lock:
                            self._workers.append(worker)
                    self._run(job, worker, light_only, below)
                except Exception as e:  # the grammar engine itself failed: not the caller's
                    log.exception("compiling a %s failed", job.spec.kind.value)
                    with self._lock:
                        self._forget(job)
                    if job.future.set_running_or_notify_cancel():
                        job.future.set_exception(e)
                finally:
                    if not light_only:
                        with self._lock:
                            self._done_running(job)
                    # NOTE: not kept while the slot waits: its future holds the grammar,
                    # which the releaser frees only once nothing else does
                    job = None
        finally:
            below.close()
            if worker is not None:
                worker.kill()

    def _run(self, job: _Job, worker: Worker, light_only: bool, below: Niced
             ) -> None:
        limits = self.limits
        bound = min(LIGHT_CPU_S, limits.max_compile_cpu_s) if light_only \
            else limits.max_compile_cpu_s
        answer = worker.run(job.spec, limits.compile_timeout_s, bound, job.stop)
        if answer == OVER_CPU and bound < limits.max_compile_cpu_s:
            self._to_other_lane(job)
            return
        over_cpu = answer == OVER_CPU or (
            isinstance(answer, Checked) and answer.cpu_s > limits.max_compile_cpu_s)
        with self._lock:
            self.compiled += 1
            self.timed_out += answer == TIMED_OUT
            self.over_cpu += over_cpu
        compiled = error = None
        what = job.spec.kind.value
        if job.stop.is_set():  # abandoned or closing: the future is cancelled already
            pass
        elif answer == TIMED_OUT:  # NOTE: kept in the cache: the same spec would time out again
            error = GrammarError(f"the {what} did not compile within "
                                 f"{limits.compile_timeout_s:g} s (grammar_compile_timeout_s): "
                                 "make it smaller or simpler")
        elif over_cpu:  # NOTE: kept in the cache too
            error = GrammarError(f"the {what} takes more than {limits.max_compile_cpu_s:g} s "
                                 "of CPU to compile (grammar_max_compile_cpu_s): make it "
                                 "smaller or simpler (fewer or shorter enum values, fewer "
                                 "optional properties, smaller counts)")
        elif answer.error:
            error = GrammarError(f"{what} does not compile: {answer.error}")
        elif answer.no_output:
            error = no_output_error(
                job.spec.kind, "no token can start it: a reference without a base case?")
        else:  # it compiles within the CPU bound: now here (see "Why compile twice")
            compiled = below.call(lambda: self._compile_here(job.spec, answer.cpu_s))
        self._finished(job)
        if job.stop.is_set() or not job.future.set_running_or_notify_cancel():
            self._releaser.hand(compiled, 0)  # abandoned meanwhile: never cached
            return
        if error is not None:
            job.future.set_exception(error)
            return
        job.future.set_result(compiled)
        with self._lock:
            if self._cache.get(job.spec) is job.future:
                self._sizes[job.spec] = answer.bytes
                self._cached_bytes += answer.bytes
            evicted = self._trim_cache()
        self._release(evicted)

    def _finished(self, job: _Job) -> None:
        with self._lock:
            self._jobs.pop(job.future, None)

    def _compile_here(self, spec: GrammarSpec, worker_cpu_s: float):
        """This process's compile of a spec its worker compiled in `worker_cpu_s` (at most
        max_compile_cpu_s): the same work, which nothing can stop once started. On the
        slot's niced thread."""
        with self._lock:
            self.compiling_here += 1
        t0 = time.thread_time()
        try:
            return compile_with(self._compiler, spec)
        finally:
            cpu_s = time.thread_time() - t0
            with self._lock:
                self.compiling_here -= 1
                self.local_compiles += 1
                self.local_cpu_s += cpu_s
                self.expected_cpu_s += worker_cpu_s
            log.debug("compiled a %s here in %.3f s of CPU (its worker: %.3f s)",
                      spec.kind.value, cpu_s, worker_cpu_s)

    def _to_other_lane(self, job: _Job) -> None:
        """A light spec that ran past LIGHT_CPU_S on the light-only slot: queued again in
        the other lane, first of its client's; its client's later light specs go there
        too."""
        with self._lock:
            self.demoted += 1
            self._heavy_clients[job.client] = None
            self._heavy_clients.move_to_end(job.client)
            while len(self._heavy_clients) > self.HEAVY_CLIENTS_KEPT:
                self._heavy_clients.popitem(last=False)
            if job.stop.is_set() or self._jobs.get(job.future) is not job:
                return  # abandoned meanwhile
            job.light = False
            lane = self._queues[False]
            lane.setdefault(job.client, collections.deque()).appendleft(job)
            self._work.notify_all()


def _reusable(fut: Future) -> bool:
    """A cached future another request may share: compiling, compiled, or refused for the
    spec itself (GrammarError: the same spec is refused again); not one that was cancelled
    or failed inside the grammar engine (those compile anew)."""
    if not fut.done():
        return True
    if fut.cancelled():
        return False
    e = fut.exception()
    return e is None or isinstance(e, GrammarError)
