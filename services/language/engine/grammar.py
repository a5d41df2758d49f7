"""Structured output: grammars compiled in worker processes, token masks per batch row.

    spec (GrammarSpec: JSON schema | any JSON object | regex | choice | EBNF)
      └─ Grammars.compile(spec, client) ─▶ Future[compiled]   cached by spec
           1. check_spec: size limits and `$ref` loops, at once (a GrammarError naming
              response_format)
           2. queued per client; `workers` slots take one job at a time, clients in turn
           3. a slot's worker process compiles it first (xgrammar): past
              `compile_timeout_s`, or once no request wants it (`abandon`), the process is
              killed (the next job gets a fresh one) and the spec is refused
           4. a spec the worker compiled in time is compiled again in this process, by the
              slot's thread (so it too ends within about the time the worker took)
           5. a grammar that admits no output at all is refused (a self-referencing schema)
    engine: a request whose grammar is still compiling waits in WAITING_FOR_GRAMMAR (never
            in the batch); once compiled it gets its own matcher and joins the queue; a
            request that ends meanwhile abandons its compile
    sampler: apply_masks(logits, reqs) -> each row with a matcher keeps only the tokens
            its grammar allows next; the engine feeds every chosen token back (`accept`)

Why processes: xgrammar compiles in C++ without deadlines or cancellation, and some schemas
under any reasonable size limit still take minutes (a long enum over a large vocabulary).
A thread cannot be stopped; a process can, so one client's pathological schema costs at
most `compile_timeout_s` of one slot, never the instance's CPU after its request is gone,
and never blocks drain. The workers are forks of one forkserver that has imported xgrammar,
so a fresh worker after a kill starts in milliseconds; only the instance's first
structured-output request pays the forkserver's start (about a second and a half).

Why compile twice: a compiled grammar cannot come back from the worker cheaply (xgrammar's
`serialize_json` grows with the square of the grammar: 121 MB and 3.6 s for a 100-property
schema that compiles in 27 ms). So the worker only proves the spec compiles in time, and
this process compiles it again with its own compiler, whose cache is bounded in bytes. The
price is twice the CPU of each distinct spec (milliseconds for typical schemas); a
repeated spec is compiled by neither.

The grammar engine is xgrammar (CPU and CUDA; vLLM's and SGLang's). Its tokenizer view is
built once, on first use, and handed to each worker serialized.
"""

from __future__ import annotations

import collections
import json
import logging
import multiprocessing
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tandem.errors import ServiceError
from tandem.sampling import GrammarKind, GrammarSpec

log = logging.getLogger("tandem.language.grammar")

_CPP_PREFIX = re.compile(r"\[[\d:]+\] \S+:\d+: ")
# A counted repetition in a regex or EBNF rule: x{n}, x{n,}, x{n,m}
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
# JSON-schema keywords whose value is a count the compiled grammar unrolls
_COUNT_KEYS = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties",
               "minProperties")


class GrammarError(ServiceError):
    """A structured-output spec that is refused: it does not compile, is over a limit, or
    admits no output."""

    code = "INVALID_ARGUMENT"
    field = "response_format"


@dataclass(frozen=True)
class GrammarLimits:
    """What one structured-output spec may ask of the compiler (LanguageConfig's
    grammar_* fields document each)."""

    compile_timeout_s: float = 10.0
    workers: int = 2
    max_spec_bytes: int = 256 << 10
    max_enum_values: int = 4096
    max_count: int = 4096
    max_properties: int = 4096
    max_depth: int = 32
    cache_bytes: int = 256 << 20


def check_spec(spec: GrammarSpec, limits: GrammarLimits) -> None:
    """Refuse a spec over a limit before it reaches the compiler (GrammarError)."""
    size = len(spec.text.encode())
    if size > limits.max_spec_bytes:
        raise GrammarError(f"the {spec.kind.value} is {size} bytes, over the limit of "
                           f"{limits.max_spec_bytes} (grammar_max_spec_bytes)")
    match spec.kind:
        case GrammarKind.JSON_SCHEMA:
            try:
                schema = json.loads(spec.text)
            except ValueError:
                raise GrammarError("the JSON schema is not valid JSON") from None
            _check_schema(schema, limits)
            _check_ref_cycles(schema)
        case GrammarKind.CHOICE:
            n = len(json.loads(spec.text))
            if n > limits.max_enum_values:
                raise GrammarError(f"{n} choices, over the limit of {limits.max_enum_values} "
                                   "(grammar_max_enum_values)")
        case GrammarKind.REGEX | GrammarKind.EBNF:
            _check_repeats(spec.text, spec.kind.value, limits)


def _check_repeats(text: str, what: str, limits: GrammarLimits) -> None:
    for m in _REPEAT.finditer(text):
        n = max(int(m.group(1)), int(m.group(2) or 0))
        if n > limits.max_count:
            raise GrammarError(f"the {what} repeats {n} times ({m.group(0)}), over the limit "
                               f"of {limits.max_count} (grammar_max_count)")


def _check_schema(schema, limits: GrammarLimits) -> None:
    """Walk the schema once: nesting depth, enum values and properties in total, and every
    count the compiled grammar unrolls (string lengths, array and object sizes, a pattern's
    repetitions)."""
    enums = props = 0
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limits.max_depth:
            raise GrammarError(f"the JSON schema nests deeper than {limits.max_depth} "
                               "(grammar_max_depth)")
        if isinstance(node, list):
            stack.extend((x, depth + 1) for x in node)
            continue
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("enum"), list):
            enums += len(node["enum"])
        if isinstance(node.get("properties"), dict):
            props += len(node["properties"])
        for key in _COUNT_KEYS:
            v = node.get(key)
            if isinstance(v, int | float) and v > limits.max_count:
                raise GrammarError(f"{key} {v} is over the limit of {limits.max_count} "
                                   "(grammar_max_count)")
        if isinstance(node.get("pattern"), str):
            _check_repeats(node["pattern"], "pattern", limits)
        stack.extend((v, depth + 1) for v in node.values() if isinstance(v, dict | list))
    if enums > limits.max_enum_values:
        raise GrammarError(f"the JSON schema has {enums} enum values, over the limit of "
                           f"{limits.max_enum_values} (grammar_max_enum_values)")
    if props > limits.max_properties:
        raise GrammarError(f"the JSON schema has {props} properties, over the limit of "
                           f"{limits.max_properties} (grammar_max_properties)")


# Keys that say nothing about the value a schema admits: a node with only these beside its
# `$ref` admits exactly what the reference admits.
_ANNOTATIONS = frozenset({"$ref", "$id", "$schema", "$comment", "$defs", "definitions",
                          "title", "description", "default", "examples", "deprecated",
                          "readOnly", "writeOnly"})


def no_output_error(kind: GrammarKind, why: str) -> GrammarError:
    """The one refusal for a spec that admits no output, whichever check finds it (the
    static `$ref` walk below or the compiled grammar's first mask): Tandem's words, so the
    answer does not change with the grammar engine's version or which layer noticed first."""
    return GrammarError(f"the {kind.value} admits no output at all ({why})")


def _check_ref_cycles(schema) -> None:
    """Refuse a schema with a `$ref` chain that returns to itself through nodes that are
    nothing but references (`{"$ref": "#/$defs/n"}` inside `n`): no value can ever satisfy
    it. Checked here rather than left to the compiler, whose versions disagree on whether
    and how they report it (xgrammar 0.2.9 refuses it with its own message, 0.2.8 compiles
    a grammar that masks every token). Only local JSON pointers (`#/...`) from the document
    root are followed: a subschema with its own `$id` changes what `#` means inside it, so
    neither the walk nor a pointer enters one; those, and anything else, are the compiler's
    to judge."""
    def resolve(ref: str):
        node = schema
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
            if isinstance(node, dict) and "$id" in node:
                return None  # another base: its `#` is not this document's
        return node

    def pure_ref(node) -> str | None:
        if isinstance(node, dict) and isinstance(node.get("$ref"), str) \
                and node["$ref"].startswith("#") and node.keys() <= _ANNOTATIONS:
            return node["$ref"]
        return None

    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict) or (node is not schema and "$id" in node):
            continue
        stack.extend(v for v in node.values() if isinstance(v, dict | list))
        chain, seen, ref = [], set(), pure_ref(node)
        while ref is not None:
            if ref in seen:
                loop = " -> ".join(chain[chain.index(ref):] + [ref])
                raise no_output_error(GrammarKind.JSON_SCHEMA,
                                      f"the $ref chain {loop} never reaches a schema")
            seen.add(ref)
            chain.append(ref)
            ref = pure_ref(resolve(ref))


# -- the worker process --


@dataclass(frozen=True)
class _Checked:
    """A worker's answer: the spec compiled (error empty), or why it does not."""

    error: str = ""


def _compile_with(compiler, spec: GrammarSpec):
    match spec.kind:
        case GrammarKind.JSON_SCHEMA:
            return compiler.compile_json_schema(spec.text, any_whitespace=False,
                                                strict_mode=True)
        case GrammarKind.JSON_OBJECT:
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        case GrammarKind.REGEX:
            return compiler.compile_regex(spec.text)
        case GrammarKind.CHOICE:
            choices = json.loads(spec.text)
            alts = " | ".join(json.dumps(str(x), ensure_ascii=False) for x in choices)
            return compiler.compile_grammar(f"root ::= {alts}")
        case GrammarKind.EBNF:
            return compiler.compile_grammar(spec.text)
    raise AssertionError(spec.kind)


def _why(e: Exception) -> str:
    return _CPP_PREFIX.sub("", str(e)).strip()  # "[hh:mm:ss] file.cc:83: " off


def _worker_main(conn, tokenizer_info_json: str) -> None:
    """A worker process: compile each spec received, answer with a _Checked, until the
    pipe closes. Killed from outside when a compile runs too long or is abandoned."""
    import os

    import xgrammar as xgr

    os.nice(10)  # below the engine's decode steps: a slow compile takes idle time first
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(_Checked())  # ready: a spec's deadline starts only now
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            _compile_with(compiler, spec)
            conn.send(_Checked())
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors
            conn.send(_Checked(error=_why(e)))


_CONTEXT = None


def _context():
    """The forkserver context whose server has imported xgrammar (made once per process)."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["xgrammar"])
        _CONTEXT = ctx
    return _CONTEXT


class _Worker:
    """One compile process, started on demand, killed when a compile must stop."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self.info_json = tokenizer_info_json
        self.proc = None
        self.conn = None

    START_TIMEOUT_S = 120.0  # a fresh worker's start (the forkserver's too, the first time)

    def run(self, spec: GrammarSpec, timeout_s: float, stop: threading.Event
            ) -> _Checked | None:
        """The worker's answer; None when `stop` was set or `timeout_s` passed first, and
        then the process is killed (the next run starts a fresh one). The time a fresh
        worker takes to start is not the spec's."""
        if self.proc is None or not self.proc.is_alive():
            self._start()
        try:
            self.conn.send(spec)
            deadline = time.monotonic() + timeout_s
            while not stop.is_set() and time.monotonic() < deadline:
                if self.conn.poll(0.05):
                    return self.conn.recv()
        except (EOFError, OSError):  # the worker died under it (out of memory, killed)
            self.kill()
            return _Checked(error="the compiler's process died (out of memory?)")
        self.kill()
        return None

    def _start(self) -> None:
        ctx = _context()
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(theirs, self.info_json),
                                name="grammar-compile", daemon=True)
        self.proc.start()
        theirs.close()
        try:
            ready = self.conn.poll(self.START_TIMEOUT_S) and self.conn.recv() == _Checked()
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.kill()
            raise RuntimeError("the grammar compile process did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
            self.conn.close()
            self.proc = None


@dataclass(eq=False)
class _Job:
    spec: GrammarSpec
    client: str
    future: Future = field(default_factory=Future)
    interest: int = 1  # requests that want it; 0: abandoned
    stop: threading.Event = field(default_factory=threading.Event)


class Grammars:
    """Compiles grammars for one tokenizer and vocabulary; thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 limits: GrammarLimits | None = None, cache_size: int = 256) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.limits = limits or GrammarLimits()
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()  # compiled or compiling
        # Bytes of each compiled grammar in the cache, read once as it is compiled
        # (`memory_size_bytes` walks the grammar's token-mask cache: 60 ms for a 4,000-value
        # enum; summed on every trim under the lock, it stalled every other request's compile
        # call). Invariant: _cached_bytes == sum(_sizes.values()), keys a subset of _cache's.
        self._sizes: dict[GrammarSpec, int] = {}
        self._cached_bytes = 0
        self._jobs: dict[Future, _Job] = {}  # not yet done
        self._queues: OrderedDict[str, collections.deque[_Job]] = OrderedDict()  # per client
        self._running: collections.Counter[str] = collections.Counter()  # compiles per client
        self._closed = False
        self._info = None  # xgrammar.TokenizerInfo, made on first use
        self._info_json = ""  # ... serialized, for the workers
        self._compiler = None  # this process's xgrammar.GrammarCompiler (thread-safe)
        self._info_lock = threading.Lock()
        self._slots: list[threading.Thread] = []
        self._workers: list[_Worker] = []  # one per slot, once it has run a job
        self.compiled = 0  # grammars compiled (cache misses)
        self.timed_out = 0
        self.abandoned = 0

    # -- the engine's side --

    def compile(self, spec: GrammarSpec, client: str = "") -> Future:
        """The compiled grammar of `spec` (a shared future; a refused one raises
        GrammarError). Each call is one request's interest: the caller `abandon`s it if
        the request ends before the future is done."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None and _reusable(fut):
                self._cache.move_to_end(spec)
                job = self._jobs.get(fut)
                if job is not None:
                    job.interest += 1
                return fut
            job = _Job(spec, client)
            try:
                check_spec(spec, self.limits)
            except GrammarError as e:
                job.future.set_exception(e)
                return job.future
            if self._closed:
                job.future.cancel()
                return job.future
            self._cache[spec] = job.future
            self._jobs[job.future] = job
            self._queues.setdefault(client, collections.deque()).append(job)
            self._start_slots()
            self._work.notify()
            self._trim_cache()
            return job.future

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

    def worker_pids(self) -> list[int]:
        """The compile processes alive now (one per slot at most)."""
        with self._lock:
            procs = [w.proc for w in self._workers]
        return [p.pid for p in procs if p is not None and p.is_alive()]

    # -- internals (the lock is held where a name says so) --

    def _forget(self, job: _Job) -> None:  # lock held
        self._jobs.pop(job.future, None)
        if self._cache.get(job.spec) is job.future:
            self._uncache(job.spec)
        q = self._queues.get(job.client)
        if q is not None and job in q:
            q.remove(job)
            if not q:
                del self._queues[job.client]

    def _uncache(self, spec: GrammarSpec) -> None:  # lock held
        del self._cache[spec]
        self._cached_bytes -= self._sizes.pop(spec, 0)

    def _trim_cache(self) -> None:  # lock held
        """Keep at most `cache_size` grammars and `cache_bytes` of compiled ones; the least
        recently asked go first (a compiling one is kept: requests wait on it)."""
        for spec in list(self._cache):
            if (len(self._cache) <= self.cache_size
                    and self._cached_bytes <= self.limits.cache_bytes):
                return
            if self._cache[spec].done():
                self._uncache(spec)

    def _start_slots(self) -> None:  # lock held
        while len(self._slots) < self.limits.workers:
            t = threading.Thread(target=self._slot, name=f"grammar-{len(self._slots)}",
                                 daemon=True)
            self._slots.append(t)
            t.start()

    def _share(self) -> int:
        """Slots one client may hold at once: half of them (at least one), so a client
        flooding with slow specs always leaves a slot for everyone else."""
        return max(1, self.limits.workers // 2)

    def _next_job(self) -> _Job | None:  # lock held: the next client's oldest job
        while not self._closed:
            for client, q in self._queues.items():  # in turn, from the longest waiting
                if self._running[client] >= self._share():
                    continue  # it holds its share: the next client's job goes first
                job = q.popleft()
                del self._queues[client]
                if q:
                    self._queues[client] = q  # to the back: clients take turns
                self._running[client] += 1
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
            self._compiler = xgr.GrammarCompiler(self._info, max_threads=1,
                                                 cache_limit_bytes=self.limits.cache_bytes)
        return self._info

    def _slot(self) -> None:
        """One compile at a time on this slot's worker, until close()."""
        import os

        if hasattr(os, "setpriority"):  # NOTE: on Linux a thread's nice value is its own
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # as the workers'
        worker = None
        try:
            while True:
                with self._lock:
                    job = self._next_job()
                if job is None:
                    return
                try:
                    if job.stop.is_set():
                        continue
                    self._tokenizer_info()
                    if worker is None:
                        worker = _Worker(self._info_json)
                        with self._lock:
                            self._workers.append(worker)
                    self._run(job, worker)
                except Exception as e:  # the grammar engine itself failed: not the caller's
                    log.exception("compiling a %s failed", job.spec.kind.value)
                    with self._lock:
                        self._forget(job)
                    if job.future.set_running_or_notify_cancel():
                        job.future.set_exception(e)
                finally:
                    with self._lock:
                        self._done_running(job)
        finally:
            if worker is not None:
                worker.kill()

    def _run(self, job: _Job, worker: _Worker) -> None:
        answer = worker.run(job.spec, self.limits.compile_timeout_s, job.stop)
        with self._lock:
            self.compiled += 1
            self._jobs.pop(job.future, None)
        if job.stop.is_set():  # abandoned or closing: the future is cancelled already
            return
        if answer is None:  # NOTE: kept in the cache: the same spec would time out again
            self.timed_out += 1
            error = GrammarError(f"the {job.spec.kind.value} did not compile within "
                                 f"{self.limits.compile_timeout_s:g} s "
                                 "(grammar_compile_timeout_s): make it smaller or simpler")
        elif answer.error:
            error = GrammarError(f"{job.spec.kind.value} does not compile: {answer.error}")
        else:  # it compiles in time: now here (see "Why compile twice")
            compiled = _compile_with(self._compiler, job.spec)
            error = None if _admits_output(compiled) else no_output_error(
                job.spec.kind, "no token can start it: a reference without a base case?")
            size = compiled.memory_size_bytes  # read here, off the lock (see _sizes)
        if not job.future.set_running_or_notify_cancel():
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(compiled)
            with self._lock:
                if self._cache.get(job.spec) is job.future:
                    self._sizes[job.spec] = size
                    self._cached_bytes += size
                self._trim_cache()


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


def _admits_output(compiled) -> bool:
    """Whether any token may start an output (a grammar whose rules never end, such as a
    schema that only refers to itself, allows none: every row would be masked out)."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    m.fill_next_token_bitmask(bitmask, 0)
    return bool((bitmask != 0).any()) or m.is_terminated()


def matcher(compiled):
    """A fresh matcher (one per request) over a compiled grammar."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


def apply_masks(logits: torch.Tensor, matchers: list) -> torch.Tensor:
    """`logits` [B, V] with each row whose matcher is not None masked to the tokens its
    grammar allows next (a new tensor when any row is masked)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    out = logits.float().clone()
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), indices=rows)
    return out


def warm_masks(device: torch.device, vocab_size: int) -> None:
    """Run the mask kernel as `apply_masks` does, once per shape it specialises on, at
    start-up: so its first-use cost is not paid by the first structured request, on the
    engine thread, with every running stream waiting. On CUDA that is xgrammar's Triton
    kernel, compiled per specialisation (a row count of 1, a multiple of 16, any other);
    on the CPU the import of xgrammar (under a second) and its C++ kernel's first call."""
    import xgrammar as xgr

    t0 = time.monotonic()
    logits = torch.zeros(16, vocab_size, dtype=torch.float32, device=device)
    bitmask = xgr.allocate_token_bitmask(16, vocab_size).to(device)
    for rows in (1, 2, 16):
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=list(range(rows)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info("structured output: mask kernel ready on %s (%.1f s)", device,
             time.monotonic() - t0)
