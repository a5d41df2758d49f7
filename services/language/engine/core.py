"""The engine thread: scheduler -> runner -> sampler -> detokenizer -> per-request sinks.

Threads:

    gRPC asyncio loop ──submit()/abort()──▶ inbox (SimpleQueue) ──▶ engine thread
    engine thread ──sink(StreamDelta)──▶ caller (the server hops back to its loop with
                                          call_soon_threadsafe)

Everything about a request after `submit()` (its pages, counters, detokenizer) is touched
only by the engine thread. `submit()` validates synchronously (the scheduler's one
admission check) so bad input fails fast with a clear error; `abort()` only posts an
`Abort`. The inbox carries `Submit` and `Abort` events, dispatched by type.

KV pages: the engine builds the page pool and the prefix cache over it (`PrefixCache`)
and hands them to the scheduler; one engine per runner at a time. The only page work off
the engine thread is a room's pin (`pin_prefix`, under the cache's lock): the cached
prefix of a prompt still in transfer, which `submit()` hands to the request.

NOTE: every way out of the engine for a request (finish, stop string, deadline, abort,
runner failure, shutdown) goes through `_finish()`, which frees its KV pages and sends
exactly one final delta.

Traces: a traced request (`req.trace`, given at its construction) gets each prefill chunk's step
recorded on it (`StageTrace.chunks`); a step reads the clock for it only while some live
request is traced (`_traced`, a count), so tracing off costs one integer test per step.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future

from prometheus_client import CollectorRegistry

from tandem.sampling import SamplingParams
from tandem.services.language.engine.detokenizer import IncrementalDetokenizer
from tandem.services.language.engine.grammar import GrammarError, Grammars, matcher
from tandem.services.language.engine.kv_pages import KVPagePool
from tandem.services.language.engine.policy import NewTokenRatio
from tandem.services.language.engine.prefix_cache import PrefixCache
from tandem.services.language.engine.request import (
    Request,
    RequestSpec,
    RequestStatus,
    StageTrace,
    StreamDelta,
)
from tandem.services.language.engine.sampler import restore_generator, sample
from tandem.services.language.engine.scheduler import AdmissionError, ScheduleLimits, Scheduler
from tandem.services.language.engine.types import (
    Abort,
    EngineConfig,
    HandOff,
    Live,
    Sink,
    Submit,
)
from tandem.services.language.metrics import LanguageMetrics
from tandem.transfer.payload import PromptInfo
from tandem.units import ceil_div

log = logging.getLogger("tandem.language.engine")

class Engine:
    def __init__(
        self,
        runner,
        tokenizer,
        cfg: EngineConfig,
        eos_token_ids: tuple[int, ...] = (),
        metrics: LanguageMetrics | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.eos = frozenset(eos_token_ids or getattr(runner, "eos_token_ids", ()))
        self.metrics = metrics or LanguageMetrics(CollectorRegistry())  # a registry of its own
        self.pool = PrefixCache(KVPagePool(runner.num_pages, runner.page_size), cfg.prefix_cache)
        self.grammars = Grammars(tokenizer, runner.vocab_size, tuple(self.eos), cfg.grammar)
        self._namespaces: dict[int, str] = {}  # rooms whose prompt is on its way -> namespace
        # unseeded requests' seeds, in submit order (under _known_lock); None: the OS's
        self._seeds = random.Random(cfg.seed) if cfg.seed is not None else None
        self._compiling: list[Live] = []  # WAITING_FOR_GRAMMAR (engine thread only)
        limits = ScheduleLimits(cfg.max_prefill_tokens, cfg.max_running_requests,
                                policy=cfg.schedule_policy, max_model_len=cfg.max_model_len,
                                embed_dims=(runner.embed_dim, runner.hidden_size))
        self.scheduler = Scheduler(self.pool, runner.page_size, limits,
                                   ratio=NewTokenRatio(init=cfg.init_new_token_ratio))
        self.metrics.kv_total.set(self.pool.num_total)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[int, Live] = {}  # engine thread only
        self._known: set[int] = set()  # rids submitted and not yet finished (any thread)
        self._known_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._traced = 0  # live requests with a StageTrace (engine thread only)
        # E/P/D, a prefill instance: room -> what hears of its prompt's progress
        # (`watch_prefill`; set on the event loop, called and dropped on the engine thread)
        self._prefill_watch: dict[int, Callable[[list[int], int, int], object]] = {}
        self.num_steps = 0
        # where the engine thread's time goes: forward seconds of steps with prompt
        # tokens (prefill/mixed) and of pure decode steps, and the rest of the step
        self.profile = {"mixed_s": 0.0, "mixed_steps": 0, "decode_s": 0.0, "decode_steps": 0,
                        "host_s": 0.0}
        # opt-in (bench/language.py --engine-profile): CPU seconds of the engine thread
        # (time.thread_time) per part of a step, summed; None (the default) reads no clock
        self.part_times: dict[str, float] | None = None

    # ---- any thread -------------------------------------------------------------------

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name="language-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left and stop the thread."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.grammars.close()

    def expect_prompt(self, room: int, cache_salt: str) -> None:
        """`room`'s prompt is on its way and belongs to cache namespace `cache_salt`: its
        pin (`pin_prefix`) looks only there. Any thread; forgotten at `unpin`/`submit`."""
        if cache_salt:
            self._namespaces[room] = cache_salt

    def pin_prefix(self, room: int, info: PromptInfo) -> int:
        """Pin the cached pages that start `info`'s prompt for `room` (in its namespace,
        `expect_prompt`) and return how many leading tokens they hold: the encoder then
        sends only the rest, and `submit()` hands the pages to the request. Any thread (the
        receiver's `on_prompt`).
        NOTE: the caller must `unpin(room)` on every path where the request is not submitted."""
        return self.pool.pin(room, info.token_ids, info.images, self._namespaces.get(room, ""))

    def unpin(self, room: int) -> None:
        """Release `room`'s pin, if it still has one (no-op after `submit`), and its prefill
        watch. Any thread."""
        self._prefill_watch.pop(room, None)
        self._namespaces.pop(room, None)
        self.pool.unpin(room)

    def wake(self) -> None:
        """Something a waiting request needs arrived (a streamed prompt's rows). Any thread."""
        self._wake.set()

    def max_new_tokens(self, sampling: SamplingParams, prompt_len: int) -> int:
        """The token budget a request is made with (`Request(max_new_tokens=...)`): its
        max_tokens when given, else the service's default shortened to what the context
        leaves. `submit` checks it (after the prompt's own checks)."""
        if sampling.max_tokens is not None:
            return sampling.max_tokens
        return max(min(self.cfg.default_max_tokens, self.cfg.max_model_len - prompt_len), 0)

    def request(self, spec: RequestSpec, *, grammar_future: Future | None = None,
                trace: StageTrace | None = None) -> Request:
        """A `Request` made complete with its token budget (`max_new_tokens`)."""
        return Request(spec, grammar_future=grammar_future, trace=trace,
                       max_new_tokens=self.max_new_tokens(spec.sampling, spec.prompt.end))

    def reserve_pages(self, room: int, prompt_tokens: int) -> list[int] | None:
        """E/P/D, a decode instance: hold the KV pages of a `prompt_tokens`-token prompt for
        `room` while the prefill instance writes them (the decode pre-allocation) and
        return them; None (nothing held) while too few are free. Any thread;
        `submit(..., handoff=...)` takes them, `unpin(room)` releases them on every other
        path."""
        return self.pool.reserve(room, ceil_div(prompt_tokens, self.runner.page_size))

    def watch_prefill(self, room: int, fn: Callable[[list[int], int, int], object]) -> None:
        """E/P/D, a prefill instance: `fn(pages, computed, epoch)` on the engine thread
        after each step that computed rows of `room`'s prompt: its block table, how many
        leading positions have their K/V in the cache, and its retraction count (a page
        all of whose positions are computed is written by no later step while the request
        holds it; a retraction frees and recomputes them, and changes the count). The
        hand-off tags pages as they complete (`KVTagger.progress`). `fn` must be cheap and
        must not raise (a failure is logged, and the watch dropped). Dropped when the
        request finishes or at `unpin(room)`. Any thread."""
        self._prefill_watch[room] = fn

    def reserved_pages(self, room: int) -> list[int]:
        """The pages `room` holds (a prefill instance: a handed-off request's prompt)."""
        return self.pool.held(room)

    def submit(self, req: Request, sink: Sink, handoff: HandOff | None = None) -> None:
        """Queue a request; raises AdmissionError on bad input. Its prompt is complete, or
        streamed (`prompt.arrived`: the engine prefills the rows that have arrived and
        waits for the rest; its watermark's `on_advance`, given at its construction, should
        call `wake`).
        A prompt that starts after a pinned prefix (`prompt.start` > 0) takes the pin. A
        structured-output request's grammar starts compiling here unless the caller
        started it earlier (`Request(grammar_future=engine.grammars.compile(spec))`).
        `handoff` (a decode instance): the prefill instance computed the whole prompt
        (`prompt.start` is its length, its pages the room's reservation, landed and
        checked) and sampled its first token; the request goes on from there."""
        vocab = self.runner.vocab_size
        outside = sorted(t for t in req.sampling.logit_bias if t >= vocab)
        if outside:  # as vLLM: a bias on no token is a mistake, not a no-op
            raise AdmissionError(f"logit_bias names token ids outside the vocabulary "
                                 f"[0, {vocab}): {outside[:8]}", field="sampling.logit_bias")
        self.scheduler.check(req)
        if req.sampling.grammar is not None and req.sampler.grammar_future is None:
            req.sampler.grammar_future = self.grammars.compile(req.sampling.grammar)
        budget, sp = req.max_new_tokens, req.sampling
        if budget is None:  # made with neither a budget nor max_tokens
            raise AdmissionError(f"request {req.room} has no token budget (make it with "
                                 f"Engine.request)", "INTERNAL")
        tokens_left = self.cfg.max_model_len - req.prompt_len  # > 0: check() passed
        if budget > tokens_left:
            raise AdmissionError(
                f"max_tokens {budget} is more than the context leaves: "
                f"{self.cfg.max_model_len} (max_model_len) - {req.prompt_len} (prompt) = "
                f"{tokens_left}", field="sampling.max_tokens")
        if sp.min_tokens > budget:  # (validate_sampling holds it for a given max_tokens)
            raise AdmissionError(
                f"min_tokens {sp.min_tokens} is more than the "
                f"{'default ' if sp.max_tokens is None else ''}max_tokens here ({budget})"
                f"{': give max_tokens' if sp.max_tokens is None else ''}",
                field="sampling.min_tokens")
        with self._known_lock:
            if req.room in self._known:
                raise AdmissionError(f"request {req.room} is already running")
            self._known.add(req.room)
            if self._seeds is not None and req.sampling.seed is None:
                req.sampler.seed = self._seeds.getrandbits(63)
        start = req.prompt.start
        self._namespaces.pop(req.room, None)
        try:
            pages = self.pool.take_pin(req.room, start)
        except ValueError as e:
            with self._known_lock:
                self._known.discard(req.room)
            raise AdmissionError(f"request {req.room}: {e}", "INTERNAL") from None
        if handoff is None:
            self.scheduler.adopt_pin(req, pages)
        else:
            self.scheduler.adopt_handoff(req, pages, handoff.first, handoff.logprob,
                                         handoff.cached_tokens)
            restore_generator(req, handoff.generator_state, self.runner.device)
            req.times.first_token = req.times.last_token = time.monotonic()
        self._inbox.put(Submit(req, sink))
        self._wake.set()

    def abort(self, room: int, reason: str = "aborted", code: str = "CANCELLED",
              error: bool = False) -> bool:
        """Abort a submitted request at any stage (`error`: end it as failed, not aborted);
        False when it is unknown or finished."""
        with self._known_lock:
            if room not in self._known:
                return False
        self._inbox.put(Abort(room, reason, code, error))
        self._wake.set()
        return True

    def load(self) -> dict[str, int]:
        """Racy but consistent-enough counters for GetLoad."""
        return {
            "waiting": self.scheduler.num_waiting,
            "running": self.scheduler.num_running,
            "free_kv_pages": self.pool.num_free,
            "total_kv_pages": self.pool.num_total,
            "cached_kv_pages": self.pool.num_cached,
        }

    @property
    def num_active(self) -> int:
        with self._known_lock:
            return len(self._known)

    # ---- engine thread ----------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # NOTE: before draining, so a submit racing with us still wakes
            self._drain_inbox()
            self._admit_compiled()
            self._check_deadlines()
            try:
                progressed = self._step()
            except Exception as e:  # a runner failure ends the requests in it, not the loop
                log.exception("engine step failed")
                for live in list(self._live.values()):
                    if live.req.status.scheduled:
                        self._finish(live, RequestStatus.FINISHED_ERROR, f"engine: {e}", "INTERNAL")
                progressed = True
            if not progressed:
                self._wake.wait(0.05)
        self._drain_inbox()
        for live in list(self._live.values()):
            self._finish(live, RequestStatus.FINISHED_ABORT, "server shutting down", "UNAVAILABLE")

    def _drain_inbox(self) -> None:
        while True:
            try:
                event = self._inbox.get_nowait()
            except queue.Empty:
                return
            match event:
                case Submit(req, sink):
                    sp = req.sampling
                    detok = IncrementalDetokenizer(
                        self.tokenizer, sp.stop, sp.include_stop_str_in_output,
                        sp.skip_special_tokens, sp.spaces_between_special_tokens)
                    live = self._live[req.room] = Live(req, sink, detok)
                    if req.output_ids:  # handed off: its first token's text went out there
                        detok.add(list(req.output_ids))
                    if req.trace is not None:
                        self._traced += 1
                    if req.sampler.grammar_future is not None:  # joins the queue once compiled
                        self.scheduler.await_grammar(req)
                        self._compiling.append(live)
                        req.sampler.grammar_future.add_done_callback(lambda _f: self._wake.set())
                        continue
                    self._add(live)
                case Abort(room, reason, code, error) if room in self._live:
                    status = RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_ABORT
                    self._finish(self._live[room], status, reason, code)

    def _add(self, live: Live) -> None:
        try:
            self.scheduler.add(live.req)
        except AdmissionError as e:
            self._finish(live, RequestStatus.FINISHED_ERROR, e.message, e.code)

    def _admit_compiled(self) -> None:
        """Requests whose grammar finished compiling join the queue (or fail)."""
        for live in [c for c in self._compiling if c.req.sampler.grammar_future.done()]:
            self._compiling.remove(live)
            if live.req.status.finished:  # aborted or past its deadline meanwhile
                continue
            try:
                m = live.req.sampler.matcher = matcher(live.req.sampler.grammar_future.result())
                # handed off: the prefill instance's matcher accepted its first token
                if not all(m.accept_token(t) for t in live.req.output_ids):
                    raise GrammarError("the handed-off tokens break the request's grammar",
                                       "INTERNAL")
            except CancelledError:  # the compiler was closed under it: the engine is stopping
                self._finish(live, RequestStatus.FINISHED_ABORT, "the instance is stopping",
                             "UNAVAILABLE")
                continue
            except GrammarError as e:
                self._finish(live, RequestStatus.FINISHED_ERROR, e.message, e.code,
                             StreamDelta(error_field=e.field))
                continue
            except Exception as e:  # the grammar engine itself failed: not the caller's fault
                log.exception("grammar of request %s failed to compile", live.req.room)
                self._finish(live, RequestStatus.FINISHED_ERROR, f"grammar: {e!r}", "INTERNAL")
                continue
            self._add(live)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for live in list(self._live.values()):
            if now >= live.req.deadline:
                self._finish(
                    live, RequestStatus.FINISHED_ABORT, "deadline exceeded", "DEADLINE_EXCEEDED"
                )

    def _step(self) -> bool:
        retractions = self.scheduler.num_retractions
        pt = self.part_times
        if pt is not None:
            c0 = time.thread_time()
        t_sched = time.perf_counter()
        step = self.scheduler.schedule()
        if pt is not None:
            c1 = time.thread_time()
            pt["schedule"] += c1 - c0
        self._update_gauges()
        if pt is not None:
            c0 = time.thread_time()
            pt["gauges"] += c0 - c1
        if step is None:
            return False
        for f in step.failed:
            self._finish(self._live[f.req.room], f.req.status, f.message, f.code)
        if not step.chunks:
            return True
        self.num_steps += 1
        m = self.metrics
        m.batch_size.observe(len(step.chunks))
        m.batch_tokens.observe(step.num_tokens)
        m.retractions.inc(self.scheduler.num_retractions - retractions)
        m.prompt_tokens.inc(sum(c.num_tokens for c in step.chunks if c.start < c.req.prompt_len))
        early = [c for c in step.chunks if c.start < c.req.prompt_len
                 and c.req.prompt.arrived is not None and not c.req.prompt.arrived.complete]

        t0 = time.perf_counter()
        if pt is not None:
            c1 = time.thread_time()
            pt["metrics"] += c1 - c0
        traced_at = time.monotonic() if self._traced else 0.0
        out = self.runner.forward(step.batch)
        if pt is not None:
            c0 = time.thread_time()
            pt["forward" if step.batch.is_pure_decode else "forward_mixed"] += c0 - c1
        # NOTE: counted after the forward, from the watermarks read before it: these rows
        # were computed while later rows of their prompts were still on their way
        for c in early:
            c.req.early_prefill_tokens += c.num_tokens
        m.early_prefill_tokens.inc(sum(c.num_tokens for c in early))
        rows = [i for i, c in enumerate(step.chunks) if c.samples]
        tokens: list[int | None] = [None] * len(step.chunks)
        logprobs: list[float | None] = [None] * len(step.chunks)
        tops: list[list] = [[] for _ in step.chunks]
        if rows:
            res = sample(out.last_logits, [step.chunks[i].req for i in rows], self.eos,
                         rows=rows,  # (the sampler selects the rows: no host sync)
                         kernels=self.runner.sampler_kernels)
            for i, t, lp, top in zip(rows, res.token_ids, res.logprobs, res.top_logprobs,
                                     strict=True):
                tokens[i], logprobs[i], tops[i] = t, lp, top
        if pt is not None:
            c1 = time.thread_time()
            pt["sample"] += c1 - c0
        self.scheduler.commit(step, tokens, logprobs)
        if self._prefill_watch:  # before `_on_token`, which may hand the request off
            self._prefill_progress(step)
        if pt is not None:
            c0 = time.thread_time()
            pt["commit"] += c0 - c1
        now = time.monotonic()
        t2 = time.perf_counter()
        if traced_at:
            for c in step.chunks:
                if c.req.trace is not None and c.start < c.req.prompt_len:
                    c.req.trace.chunks.append((traced_at, now, c.num_tokens, len(step.chunks),
                                               step.num_tokens))
        m.count_generated(len(rows))
        if pt is not None:
            c1 = time.thread_time()
            pt["metrics"] += c1 - c0
        for i in rows:
            self._on_token(self._live[step.chunks[i].req.room], tokens[i], logprobs[i], tops[i],
                           now)
        if pt is not None:
            c0 = time.thread_time()
            pt["on_token"] += c0 - c1
        kind = "decode" if step.batch.is_pure_decode else "mixed"
        m.busy_seconds.inc(t2 - t0)
        self.profile[kind + "_s"] += t2 - t0
        self.profile[kind + "_steps"] += 1
        self.profile["host_s"] += time.perf_counter() - t2 + (t0 - t_sched)
        if pt is not None:
            pt["metrics"] += time.thread_time() - c0
            pt["steps_decode" if step.batch.is_pure_decode else "steps_mixed"] += 1
        return True

    def _prefill_progress(self, step) -> None:
        for c in step.chunks:
            req = c.req
            fn = self._prefill_watch.get(req.room)
            if fn is None or c.start >= req.prompt_len or req.status.finished:
                continue
            try:
                fn(list(req.kv.block_table), req.kv.num_computed_tokens,
                   req.kv.num_retractions)
            except Exception:  # its tags are then taken in the transfer: slower, not wrong
                log.exception("prefill watch of room %d failed: dropped", req.room)
                self._prefill_watch.pop(req.room, None)

    def _on_token(self, live: Live, token: int, logprob: float | None, top: list,
                  now: float) -> None:
        req, p = live.req, live.req.sampling
        if not req.times.first_token:
            req.times.first_token = now
            self.metrics.ttft.observe(now - req.times.created,
                                      req.trace.exemplar if req.trace is not None else None)
        req.times.last_token = now
        delta = StreamDelta(token_ids=[token], prompt_tokens=req.prompt_len)
        if req.sampler.matcher is not None and not req.sampler.matcher.accept_token(token):
            self._finish(live, RequestStatus.FINISHED_ERROR,
                         f"token {token} breaks the request's grammar", "INTERNAL", delta)
            return
        if logprob is not None:  # (on the request since the scheduler's commit)
            delta.logprobs = [logprob]
            delta.top_logprobs = [top]
        if (token in self.eos and not p.ignore_eos) or token in p.stop_token_ids:
            # the ending token's text only with include_stop_str_in_output (as vLLM): then
            # an EOS shows as its text where skip_special_tokens is false
            if p.include_stop_str_in_output:
                delta.text = live.detok.add([token])
            self._finish(live, RequestStatus.FINISHED_STOP, delta=delta)
            return
        delta.text = live.detok.add([token])
        if live.detok.stopped:
            self._finish(live, RequestStatus.FINISHED_STOP, delta=delta)
        elif len(req.output_ids) >= req.max_new_tokens:
            self._finish(live, RequestStatus.FINISHED_LENGTH, delta=delta)
        elif req.spec.hand_off:  # a prefill instance: the decode instance goes on
            self._finish(live, RequestStatus.FINISHED_HANDED_OFF, delta=delta)
        else:
            self._emit(live, delta)

    def _finish(
        self,
        live: Live,
        status: RequestStatus,
        error: str = "",
        code: str = "",
        delta: StreamDelta | None = None,
    ) -> None:
        req = live.req
        self.scheduler.finish(req, status)  # frees its pages, ends its status (idempotent)
        if live in self._compiling:  # ended while its grammar compiles: it wants it no more
            self._compiling.remove(live)
            self.grammars.abandon(req.sampler.grammar_future)
        self._live.pop(req.room, None)
        self._prefill_watch.pop(req.room, None)
        if req.trace is not None:
            self._traced -= 1
        with self._known_lock:
            self._known.discard(req.room)
        delta = delta or StreamDelta()
        if status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOP):
            delta.text += live.detok.flush()  # held-back text that never became a stop string
        delta.finish_reason = status
        delta.prompt_tokens = req.prompt_len
        delta.cached_tokens = req.kv.cached_tokens or 0
        delta.completion_tokens = len(req.output_ids)
        delta.timings_ms = req.times.ms()
        delta.early_prefill_tokens = req.early_prefill_tokens
        delta.error, delta.error_code = error, code
        m = self.metrics
        m.finished.labels(status.label).inc()
        m.request_finished(req, time.monotonic())
        self._emit(live, delta)

    def _emit(self, live: Live, delta: StreamDelta) -> None:
        try:
            live.sink(delta)
        except Exception:  # a broken sink must not take the engine down
            log.exception("sink of request %s failed", live.req.room)
            if not delta.finished:
                self._finish(live, RequestStatus.FINISHED_ABORT, "output sink failed", "INTERNAL")

    def _update_gauges(self) -> None:
        m = self.metrics
        m.waiting.set(self.scheduler.num_waiting)
        m.running.set(self.scheduler.num_running)
        m.kv_used.set(self.pool.num_total - self.pool.num_free)
        m.prefix_cache(self.pool)
