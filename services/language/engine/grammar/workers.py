"""The compile processes: a worker compiles one spec at a time (xgrammar), timing its CPU
and measuring how much it grew the heap by, and is killed from outside when its compile
must stop; `Niced` runs this process's own compiles on a thread below decoding."""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import re
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from tandem.sampling import GrammarKind, GrammarSpec
from tandem.services.language.engine.grammar.memory import heap_bytes

_CPP_PREFIX = re.compile(r"\[[\d:]+\] \S+:\d+: ")


@dataclass(frozen=True)
class Checked:
    """A worker's answer: the spec compiled (error empty) or why it does not; the CPU its
    compile took; the bytes that compile grew the heap by; whether the grammar admits no
    output."""

    error: str = ""
    cpu_s: float = 0.0
    bytes: int = 0
    no_output: bool = False


# How a worker's run ended without an answer: the request's end (or close), the wall-clock
# deadline, or the CPU bound.
STOPPED, TIMED_OUT, OVER_CPU = "stopped", "timed out", "over CPU"


def compile_with(compiler, spec: GrammarSpec):
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
    """A worker process: compile each spec received, answer with a Checked, until the
    pipe closes. Killed from outside when a compile runs too long or is abandoned."""
    import xgrammar as xgr

    os.nice(nice)  # below the engine's decode steps: a slow compile takes idle time first
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(Checked())  # ready: a spec's deadline starts only now
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        heap = heap_bytes()
        t0 = time.thread_time()
        try:
            compiled = compile_with(compiler, spec)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors
            conn.send(Checked(error=_why(e), cpu_s=time.thread_time() - t0))
            continue
        cpu_s = time.thread_time() - t0
        # NOTE: at least xgrammar's own count (a small grammar may reuse freed blocks)
        counted = compiled.memory_size_bytes
        grown = heap_bytes() - heap if heap is not None else int(counted * 1.3)
        no_output = not admits_output(compiled)
        del compiled
        conn.send(Checked(cpu_s=cpu_s, bytes=max(grown, counted), no_output=no_output))


_CONTEXT = None


def _context():
    """The forkserver context whose server has imported xgrammar (made once per process)."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["xgrammar"])
        _CONTEXT = ctx
    return _CONTEXT


class Worker:
    """One compile process, started on demand, killed when a compile must stop."""

    def __init__(self, tokenizer_info_json: str, nice: int = 10) -> None:
        self.info_json = tokenizer_info_json
        self.nice = nice
        self.proc = None
        self.conn = None

    START_TIMEOUT_S = 120.0  # a fresh worker's start (the forkserver's too, the first time)
    POLL_S = 0.02  # how often a running compile's end, deadline and CPU are looked at

    def run(self, spec: GrammarSpec, timeout_s: float, cpu_s: float, stop: threading.Event
            ) -> Checked | str:
        """The worker's answer; else how the run ended (STOPPED: `stop` was set,
        TIMED_OUT: `timeout_s` passed, OVER_CPU: the compile took more than `cpu_s` of
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
                    ended = STOPPED
                    break
                if self.conn.poll(self.POLL_S):
                    return self.conn.recv()
                if time.monotonic() >= deadline:
                    ended = TIMED_OUT
                    break
                used = _cpu_s_of(self.proc.pid)
                if cpu0 is not None and used is not None and used - cpu0 > cpu_s:
                    ended = OVER_CPU
                    break
        except (EOFError, OSError):  # the worker died under it (out of memory, killed)
            self.kill()
            return Checked(error="the compiler's process died (out of memory?)")
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
            ready = self.conn.poll(self.START_TIMEOUT_S) and self.conn.recv() == Checked()
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


class Niced:
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


def admits_output(compiled) -> bool:
    """Whether any token may start an output (a grammar whose rules never end, such as a
    schema that only refers to itself, allows none: every row would be masked out)."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    m.fill_next_token_bitmask(bitmask, 0)
    return bool((bitmask != 0).any()) or m.is_terminated()
