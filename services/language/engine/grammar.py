"""Structured output: grammars compiled in worker processes, token masks per batch row.

    spec (GrammarSpec: JSON schema | any JSON object | regex | choice | EBNF)
      └─ Grammars.compile(spec, client) ─▶ Future[compiled]   cached by spec
           1. check_spec: size limits (bytes, enum characters, counts) and `$ref` loops, at
              once (a GrammarError naming response_format); it also says whether the spec
              is light (a few KiB, no enum or count of any size)
           2. queued per client, in one of two lanes: light specs, and the rest. `workers`
              shared slots take the other lane's jobs, clients in turn, one client holding
              at most half of them (at least one); one slot more takes light specs only
              (the shared ones help while it is busy), so clients flooding costly specs
              never hold the slot another client's small schema needs
           3. the slot's worker process compiles it (xgrammar), timing its CPU and
              measuring how much it grew the heap by. Past `compile_timeout_s`, past
              `max_compile_cpu_s` of its CPU, or once no request wants it (`abandon`), the
              process is killed (the next job gets a fresh one) and the spec is refused. A
              light spec past LIGHT_CPU_S on the light-only slot is moved to the other lane
              instead, and so are its client's later light specs
           4. a grammar that admits no output at all is refused (a self-referencing schema)
           5. compiled again here, on a niced thread of the slot's (see "Why compile
              twice"): the same work, so about the worker's CPU, at most
              `max_compile_cpu_s`: the one compile in this process, and how long one can
              outlive its request
           6. cached, charged what the worker's heap grew by; past `cache_bytes` the least
              recently asked are dropped, freed off the GIL once no request holds them,
              and the memory freed goes back to the OS
    engine: a request whose grammar is still compiling waits in WAITING_FOR_GRAMMAR (never
            in the batch); once compiled it gets its own matcher and joins the queue; a
            request that ends meanwhile abandons its compile
    sampler: apply_masks(logits, reqs) -> each row with a matcher keeps only the tokens
            its grammar allows next; the engine feeds every chosen token back (`accept`)

Why processes: xgrammar compiles in C++ without deadlines or cancellation, and some schemas
under any reasonable size limit still take minutes (an object with a few thousand optional
properties; a long enum over a large vocabulary). A thread cannot be stopped; a process
can, so one client's pathological schema costs at most `max_compile_cpu_s` of one slot,
never the instance's CPU after its request is gone, and never blocks drain. The workers
are forks of one forkserver that has imported xgrammar, so a fresh worker after a kill
starts in milliseconds; only the instance's first structured-output request pays the
forkserver's start (about a second and a half).

Why compile twice: a compiled grammar cannot come back from the worker cheaply, nor be made
here more cheaply than by compiling it. Measured on xgrammar 0.2.9 with a 150,000-token
vocabulary: a 4,000-value enum of 60-character strings compiles in 3.3 s of CPU, and
`serialize_json` takes 3.3 s more (47 MB of JSON), `deserialize_json` 2.0 s here; an
object of 100 small fields compiles in 1.4 s, serializes in 8 s (160 MB) and deserializes
in 3.5 s. CompiledGrammar does not pickle (tvm_ffi: no JSON graph for it). Compiling here
without the token masks (`enable_dynamic_compilation`) takes milliseconds, but then
decoding makes each mask the first time it needs it, unbounded: the enum's second state
took 85 s (its whole eager compile: 1.7 s). So the worker proves the spec compiles within
`max_compile_cpu_s`, and this process compiles it again, the same code on the same input:
its CPU is the worker's (within a few percent), so that compile, which nothing can stop
once started, is bounded before it starts. The price is twice the CPU of each distinct
spec (milliseconds for typical schemas); a repeated spec is compiled by neither.

One cache, ours: xgrammar's own compiler cache is off, here and in the workers. With it
on, that enum took 15.6 s of CPU to compile here instead of 1.7 s (the tiny test
vocabulary), and each new 1,500-value enum grew the process by ~8 MB with no plateau
whatever its limit (1.37 GB after 150). Each grammar in our cache is charged what its
compile grew the worker's heap by (glibc's bytes in use; about 1.3x xgrammar's own
`memory_size_bytes`, which counts only its larger arrays), which is what the same compile
allocates here. An evicted grammar goes to the releaser (`_Releaser`), which frees it once
no request's matcher holds it, on its own thread and outside the GIL (a grammar's
destructor is milliseconds of C++ that would otherwise stop every thread of the process),
and hands the memory back to the OS (`malloc_trim`) rather than leaving it in the
allocator's free lists.

The grammar engine is xgrammar (CPU and CUDA; vLLM's and SGLang's). Its tokenizer view is
built once, on first use, and handed to each worker serialized.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import json
import logging
import multiprocessing
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
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
    max_compile_cpu_s: float = 0.5
    workers: int = 2
    max_spec_bytes: int = 256 << 10
    max_enum_values: int = 4096
    max_enum_chars: int = 32 << 10
    max_count: int = 4096
    max_properties: int = 4096
    max_depth: int = 32
    cache_bytes: int = 256 << 20


# A light spec: what a typical response_format schema is, and what the light-only slot
# takes. Compiling one takes milliseconds (tens on a 150,000-token vocabulary); one that
# still runs past LIGHT_CPU_S on that slot is moved to the other lane.
LIGHT_MAX_BYTES = 8 << 10
LIGHT_MAX_ENUM_CHARS = 4 << 10
LIGHT_MAX_COUNT = 256
LIGHT_CPU_S = 0.25


@dataclass(frozen=True)
class SpecCost:
    """What check_spec read of a spec's cost: its bytes, the characters of its enum values
    (or choices), which the compiled grammar matches one by one, and its largest count."""

    bytes: int = 0
    enum_chars: int = 0
    largest_count: int = 0

    @property
    def light(self) -> bool:
        return (self.bytes <= LIGHT_MAX_BYTES and self.enum_chars <= LIGHT_MAX_ENUM_CHARS
                and self.largest_count <= LIGHT_MAX_COUNT)


def check_spec(spec: GrammarSpec, limits: GrammarLimits) -> SpecCost:
    """Refuse a spec over a limit before it reaches the compiler (GrammarError); else what
    it costs, as far as its text says."""
    size = len(spec.text.encode())
    if size > limits.max_spec_bytes:
        raise GrammarError(f"the {spec.kind.value} is {size} bytes, over the limit of "
                           f"{limits.max_spec_bytes} (grammar_max_spec_bytes)")
    enum_chars = largest = 0
    match spec.kind:
        case GrammarKind.JSON_SCHEMA:
            try:
                schema = json.loads(spec.text)
            except ValueError:
                raise GrammarError("the JSON schema is not valid JSON") from None
            enum_chars, largest = _check_schema(schema, limits)
            _check_ref_cycles(schema)
        case GrammarKind.CHOICE:
            choices = json.loads(spec.text)
            n = len(choices)
            if n > limits.max_enum_values:
                raise GrammarError(f"{n} choices, over the limit of {limits.max_enum_values} "
                                   "(grammar_max_enum_values)")
            enum_chars = sum(len(str(x)) for x in choices)
            _check_enum_chars(enum_chars, "choices", limits)
        case GrammarKind.REGEX | GrammarKind.EBNF:
            largest = _check_repeats(spec.text, spec.kind.value, limits)
    return SpecCost(size, enum_chars, largest)


def _check_enum_chars(n: int, what: str, limits: GrammarLimits) -> None:
    if n > limits.max_enum_chars:
        raise GrammarError(f"the {what} have {n} characters in all, over the limit of "
                           f"{limits.max_enum_chars} (grammar_max_enum_chars)")


def _check_repeats(text: str, what: str, limits: GrammarLimits) -> int:
    """The largest counted repetition in `text` (0: none); GrammarError over the limit."""
    largest = 0
    for m in _REPEAT.finditer(text):
        n = max(int(m.group(1)), int(m.group(2) or 0))
        if n > limits.max_count:
            raise GrammarError(f"the {what} repeats {n} times ({m.group(0)}), over the limit "
                               f"of {limits.max_count} (grammar_max_count)")
        largest = max(largest, n)
    return largest


# Keys whose value is data, not a schema: a schema's walk does not go into them (a flat
# 4,000-value enum is 4,000 strings it would otherwise push and pop one by one). Keys whose
# value maps names to schemas: every value there is a schema, whatever its name (a
# property called "enum" is walked like any other).
_DATA = frozenset({"enum", "const", "default", "examples"})
_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas", "dependencies"})


def _children(node: dict, is_map: bool):
    """(child, is_map) for each dict or list under a schema node (or a map of them)."""
    for k, v in node.items():
        if isinstance(v, dict | list) and (is_map or k not in _DATA):
            yield v, not is_map and k in _MAPS


def _literal_chars(value) -> int:
    """Characters the compiled grammar matches for one enum or const value."""
    return len(value) if isinstance(value, str) else len(json.dumps(value))


def _check_schema(schema, limits: GrammarLimits) -> tuple[int, int]:
    """Walk the schema once: nesting depth, enum values (and their characters) and
    properties in total, and every count the compiled grammar unrolls (string lengths,
    array and object sizes, a pattern's repetitions). Returns (enum characters, the
    largest count)."""
    enums = props = chars = largest = 0
    stack = [(schema, 1, False)]
    while stack:
        node, depth, is_map = stack.pop()
        if depth > limits.max_depth:
            raise GrammarError(f"the JSON schema nests deeper than {limits.max_depth} "
                               "(grammar_max_depth)")
        if isinstance(node, list):
            stack.extend((x, depth + 1, False) for x in node)
            continue
        if not isinstance(node, dict):
            continue
        stack.extend((v, depth + 1, m) for v, m in _children(node, is_map))
        if is_map:
            continue
        if isinstance(node.get("enum"), list):
            enums += len(node["enum"])
            chars += sum(_literal_chars(v) for v in node["enum"])
        if "const" in node:
            chars += _literal_chars(node["const"])
        if isinstance(node.get("properties"), dict):
            props += len(node["properties"])
        for key in _COUNT_KEYS:
            v = node.get(key)
            if isinstance(v, int | float) and v > limits.max_count:
                raise GrammarError(f"{key} {v} is over the limit of {limits.max_count} "
                                   "(grammar_max_count)")
            if isinstance(v, int | float):
                largest = max(largest, int(v))
        if isinstance(node.get("pattern"), str):
            largest = max(largest, _check_repeats(node["pattern"], "pattern", limits))
    if enums > limits.max_enum_values:
        raise GrammarError(f"the JSON schema has {enums} enum values, over the limit of "
                           f"{limits.max_enum_values} (grammar_max_enum_values)")
    _check_enum_chars(chars, "JSON schema's enum and const values", limits)
    if props > limits.max_properties:
        raise GrammarError(f"the JSON schema has {props} properties, over the limit of "
                           f"{limits.max_properties} (grammar_max_properties)")
    return chars, largest


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

    stack = [(schema, False)]
    while stack:
        node, is_map = stack.pop()
        if isinstance(node, list):
            stack.extend((x, False) for x in node)
            continue
        if not isinstance(node, dict) or (node is not schema and "$id" in node):
            continue
        stack.extend(_children(node, is_map))
        if is_map:
            continue
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
    """A worker's answer: the spec compiled (error empty) or why it does not; the CPU its
    compile took; the bytes that compile grew the heap by; whether the grammar admits no
    output."""

    error: str = ""
    cpu_s: float = 0.0
    bytes: int = 0
    no_output: bool = False


# How a worker's run ended without an answer: the request's end (or close), the wall-clock
# deadline, or the CPU bound.
_STOPPED, _TIMED_OUT, _OVER_CPU = "stopped", "timed out", "over CPU"


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


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def _heap_bytes() -> int | None:
    """Bytes the C heap holds in use (glibc's mallinfo2: small blocks and mmapped ones);
    None where there is no mallinfo2 (musl, glibc < 2.33)."""
    libc = _libc()
    f = getattr(libc, "mallinfo2", None)
    if f is None:
        return None
    f.restype = _MallInfo2
    m = f()
    return m.uordblks + m.hblkhd


def _trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; else a no-op)."""
    f = getattr(_libc(), "malloc_trim", None)
    if f is not None:
        f(0)


@functools.cache
def _tvm_ffi():
    """xgrammar's object runtime (tvm_ffi) through ctypes, whose calls release the GIL; None
    where it cannot be loaded (the compiled grammars are then freed where they drop)."""
    try:
        import tvm_ffi.libinfo

        lib = ctypes.CDLL(tvm_ffi.libinfo.find_libtvm_ffi())
    except (ImportError, OSError, RuntimeError):
        return None
    for f in (lib.TVMFFIObjectIncRef, lib.TVMFFIObjectDecRef):
        f.argtypes, f.restype = [ctypes.c_void_p], ctypes.c_int
    return lib


def _strong_refs(chandle: int) -> int:
    """The strong count of a live tvm_ffi object: the low half of the 64-bit counter that
    heads every object (tvm/ffi/c_api.h, TVMFFIObject.combined_ref_count)."""
    return ctypes.c_uint64.from_address(chandle).value & 0xFFFFFFFF


@dataclass(frozen=True)
class _Held:
    chandle: int  # the C++ object, with a strong reference of the releaser's
    bytes: int  # what the cache charged it (0: never cached)


class _Releaser:
    """Where compiled grammars die: on a thread of its own, outside the GIL.

    Freeing a compiled grammar is C++ work in proportion to its size (an 8 MB grammar: 3-4
    ms here, up to 20 ms with the cores contended). Where its last Python reference drops,
    that work runs inside the wrapper's dealloc with the GIL held, so every other thread
    of the process (the engine's step, the gRPC handlers) stops for it; the cache drops
    grammars on the thread that asked for a compile, and a request's end can drop the last
    one on the engine's. So the cache hands each grammar it lets go of here instead
    (`hand`): this thread takes a strong reference to the C++ object through tvm_ffi's C
    API, the Python wrappers then die cheaply (the object outlives them), and once that
    reference is the only one left (no future, matcher or cache holds the grammar) it is
    dropped with a ctypes call, which releases the GIL: the destructor runs beside the
    engine, not in front of it. Measured (a 1,500-value enum's grammar): the longest GIL
    gap another thread saw was 3.6-4.7 ms when the grammar was dropped in Python, 0.1 ms
    when freed here.

    It also hands the freed memory back to the OS (`malloc_trim`, a ctypes call too) once
    `trim_every_bytes()` of charged grammars have been freed since the last time."""

    POLL_S = 0.05  # how often grammars still held elsewhere are looked at again

    def __init__(self, trim_every_bytes: Callable[[], int]) -> None:
        self._trim_every_bytes = trim_every_bytes
        self._lib = _tvm_ffi()
        self._cond = threading.Condition()
        self._held: list[_Held] = []
        self._freed_bytes = 0  # since the last trim
        self._closed = False
        self._thread: threading.Thread | None = None
        self.freed = 0  # grammars freed here
        self.trims = 0

    def hand(self, compiled, charged: int) -> None:
        """Take `compiled` over: from now on this thread frees it, once nothing else holds
        it. The caller may drop its references at once."""
        if self._lib is None or compiled is None:
            return  # freed where the last reference drops
        chandle = compiled._handle.__chandle__()
        self._lib.TVMFFIObjectIncRef(chandle)
        with self._cond:
            self._held.append(_Held(chandle, charged))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="grammar-release",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    @property
    def held(self) -> int:
        """Grammars handed here and not yet freed (some request may still use them)."""
        with self._cond:
            return len(self._held)

    def close(self) -> None:
        """Let go of every grammar held (each freed where its last reference drops)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._closed:
                    self._cond.wait(self.POLL_S if self._held else None)
                ready, kept = [], []
                for h in self._held:  # ours the only reference left: nothing can take one
                    free = self._closed or _strong_refs(h.chandle) == 1
                    (ready if free else kept).append(h)
                self._held, closed = kept, self._closed
            for h in ready:  # NOTE: ctypes: the destructor runs without the GIL
                self._lib.TVMFFIObjectDecRef(h.chandle)
                self._freed_bytes += h.bytes
                self.freed += 1
            if self._freed_bytes and self._freed_bytes >= self._trim_every_bytes():
                self._freed_bytes = 0
                _trim_heap()
                self.trims += 1
            if closed:
                return


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_s_of(pid: int) -> float | None:
    """A process's CPU time so far (user + system, from /proc); None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, IndexError, ValueError):
        return None


def _worker_main(conn, tokenizer_info_json: str, nice: int) -> None:
    """A worker process: compile each spec received, answer with a _Checked, until the
    pipe closes. Killed from outside when a compile runs too long or is abandoned."""
    import xgrammar as xgr

    os.nice(nice)  # below the engine's decode steps: a slow compile takes idle time first
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(_Checked())  # ready: a spec's deadline starts only now
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        heap = _heap_bytes()
        t0 = time.thread_time()
        try:
            compiled = _compile_with(compiler, spec)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors
            conn.send(_Checked(error=_why(e), cpu_s=time.thread_time() - t0))
            continue
        cpu_s = time.thread_time() - t0
        # NOTE: at least xgrammar's own count (a small grammar may reuse freed blocks)
        counted = compiled.memory_size_bytes
        grown = _heap_bytes() - heap if heap is not None else int(counted * 1.3)
        no_output = not _admits_output(compiled)
        del compiled
        conn.send(_Checked(cpu_s=cpu_s, bytes=max(grown, counted), no_output=no_output))


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

    def __init__(self, tokenizer_info_json: str, nice: int = 10) -> None:
        self.info_json = tokenizer_info_json
        self.nice = nice
        self.proc = None
        self.conn = None

    START_TIMEOUT_S = 120.0  # a fresh worker's start (the forkserver's too, the first time)
    POLL_S = 0.02  # how often a running compile's end, deadline and CPU are looked at

    def run(self, spec: GrammarSpec, timeout_s: float, cpu_s: float, stop: threading.Event
            ) -> _Checked | str:
        """The worker's answer; else how the run ended (_STOPPED: `stop` was set,
        _TIMED_OUT: `timeout_s` passed, _OVER_CPU: the compile took more than `cpu_s` of
        the process's CPU), and then the process is killed (the next run starts a fresh
        one). The time a fresh worker takes to start is not the spec's."""
        if self.proc is None or not self.proc.is_alive():
            self._start()
        try:
            cpu0 = _cpu_s_of(self.proc.pid)
            self.conn.send(spec)
            deadline = time.monotonic() + timeout_s
            while True:
                if stop.is_set():
                    ended = _STOPPED
                    break
                if self.conn.poll(self.POLL_S):
                    return self.conn.recv()
                if time.monotonic() >= deadline:
                    ended = _TIMED_OUT
                    break
                used = _cpu_s_of(self.proc.pid)
                if cpu0 is not None and used is not None and used - cpu0 > cpu_s:
                    ended = _OVER_CPU
                    break
        except (EOFError, OSError):  # the worker died under it (out of memory, killed)
            self.kill()
            return _Checked(error="the compiler's process died (out of memory?)")
        self.kill()
        return ended

    def _start(self) -> None:
        ctx = _context()
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(theirs, self.info_json, self.nice),
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


class _Niced:
    """A thread below the process's priority that runs one call at a time for its slot."""

    def __init__(self, nice: int, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, args=(nice,), name=name,
                                       daemon=True)
        self.thread.start()

    def _loop(self, nice: int) -> None:
        if hasattr(os, "setpriority"):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        while (item := self._calls.get()) is not None:
            fn, fut = item
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller
                fut.set_exception(e)
            del fn, fut, item  # NOTE: no reference here outlives the call

    def call(self, fn):
        """fn() on this thread; its result (or exception) here."""
        fut: Future = Future()
        self._calls.put((fn, fut))
        return fut.result()

    def close(self) -> None:
        self._calls.put(None)


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
        self._releaser = _Releaser(
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
        self._workers: list[_Worker] = []  # one per slot, once it has run a job
        self._niced: list[_Niced] = []  # one per slot: its compiles here
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
        # is its own), the light-only slot's above the shared ones' (a small schema first).
        nice = 10 if light_only else 15
        below = _Niced(nice, f"{threading.current_thread().name}-here")
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
                        worker = _Worker(self._info_json, nice)
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

    def _run(self, job: _Job, worker: _Worker, light_only: bool, below: _Niced
             ) -> None:
        limits = self.limits
        bound = min(LIGHT_CPU_S, limits.max_compile_cpu_s) if light_only \
            else limits.max_compile_cpu_s
        answer = worker.run(job.spec, limits.compile_timeout_s, bound, job.stop)
        if answer == _OVER_CPU and bound < limits.max_compile_cpu_s:
            self._to_other_lane(job)
            return
        over_cpu = answer == _OVER_CPU or (
            isinstance(answer, _Checked) and answer.cpu_s > limits.max_compile_cpu_s)
        with self._lock:
            self.compiled += 1
            self.timed_out += answer == _TIMED_OUT
            self.over_cpu += over_cpu
        compiled = error = None
        what = job.spec.kind.value
        if job.stop.is_set():  # abandoned or closing: the future is cancelled already
            pass
        elif answer == _TIMED_OUT:  # NOTE: kept in the cache: the same spec would time out again
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
            return _compile_with(self._compiler, spec)
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
