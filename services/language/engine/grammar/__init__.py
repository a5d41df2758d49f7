"""Structured output: grammars compiled in worker processes, token masks per batch row.

The package by role: checks.py (the static limits, before any compile), workers.py (the
compile processes and the niced thread of this process's compiles), memory.py (heap
bytes, malloc_trim, the releaser), compiler.py (Grammars: queues, slots, the cache),
masks.py (matchers and the per-row masks).

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
allocates here. An evicted grammar goes to the releaser (`Releaser`), which frees it once
no request's matcher holds it, on its own thread and outside the GIL (a grammar's
destructor is milliseconds of C++ that would otherwise stop every thread of the process),
and hands the memory back to the OS (`malloc_trim`) rather than leaving it in the
allocator's free lists.

The grammar engine is xgrammar (CPU and CUDA; vLLM's and SGLang's). Its tokenizer view is
built once, on first use, and handed to each worker serialized.
"""

from tandem.services.language.engine.grammar.checks import (
    GrammarError,
    GrammarLimits,
    check_spec,
)
from tandem.services.language.engine.grammar.compiler import Grammars
from tandem.services.language.engine.grammar.masks import apply_masks, matcher, warm_masks

__all__ = ["GrammarError", "GrammarLimits", "Grammars", "apply_masks", "check_spec", "matcher",
           "warm_masks"]
