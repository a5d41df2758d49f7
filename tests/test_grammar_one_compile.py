"""One bounded compile (issue 41): no compile of a request's grammar runs in the language
process without the deadline, the request's end and a slot share.

The probe's schema (an enum of 4,000 values of 60 characters, 256 KB) is refused at once
by its characters; let past that limit it is refused at the CPU bound (or the deadline)
in its worker, and nothing compiles here. A spec under the CPU bound is compiled here once
more, and that compile (which nothing can stop) costs about its worker's CPU: so a request
that ends during it leaves at most that much, under a second, of this process's CPU
behind. Clients flooding costly specs never hold the slot a third client's small schema
needs.

CPU is read from the threads' counters (/proc, through psutil), never from a clock."""

from __future__ import annotations

import json
import random
import string

import psutil
import pytest
from test_language_engine import collect
from test_structured_output import grammars, setup_of, structured
from waiting import wait_until

import tandem.services.language.engine.grammar.checks as grammar_checks
from tandem.sampling import GrammarKind, GrammarSpec
from tandem.services.language.engine.grammar import GrammarLimits, Grammars
from tandem.services.language.engine.request import RequestStatus

# past the static checks: the CPU bound is what a test here exercises
ROOMY = dict(max_enum_values=100_000, max_enum_chars=1 << 20, max_spec_bytes=1 << 20)


@pytest.fixture
def setup(checkpoint):
    return setup_of("qwen2_5_vl", checkpoint)


def enum(values: int, chars: int, seed: int) -> GrammarSpec:
    """A new enum of `values` random strings of `chars` characters (no cache helps)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(string.ascii_letters) for _ in range(chars))
             for _ in range(values)]
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"enum": words}))


def small(i: int) -> GrammarSpec:
    """A small object schema, new for each i (a json_object-like response_format)."""
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({
        "type": "object", "properties": {f"name_{i}": {"type": "string"},
                                         "n": {"type": "integer"}},
        "required": [f"name_{i}", "n"]}))


def slot_cpu_s(g: Grammars) -> float:
    """The CPU the compile slots' threads have used so far (their kernel counters)."""
    ids = set(g.slot_thread_ids())
    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id in ids)


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_probes_enum_is_refused_at_once_by_its_characters(setup):
    engine = setup.engine()
    try:
        last = collect(engine, [structured(1, setup, enum(4000, 60, 0), 0)])[1][-1]
        assert last.finish_reason is RequestStatus.FINISHED_ERROR
        assert last.error_code == "INVALID_ARGUMENT" and last.error_field == "response_format"
        assert "grammar_max_enum_chars" in last.error
        g = engine.grammars
        assert g.worker_pids() == [] and g.compiled == 0 and g.local_compiles == 0
    finally:
        engine.stop()


@pytest.mark.parametrize("bound", ["grammar_max_compile_cpu_s", "grammar_compile_timeout_s"])
def test_past_its_bound_the_enum_is_refused_and_nothing_compiles_here(setup, bound):
    """Let past the static limits, the probe's enum compiles for ~2 s of CPU on the tiny
    vocabulary: its worker is killed at the CPU bound (the deadline far), or at the
    deadline (the CPU bound far); the request ends with a 400 naming the bound, and this
    process never compiles it."""
    limits = dict(ROOMY, max_compile_cpu_s=0.3, compile_timeout_s=600) \
        if bound == "grammar_max_compile_cpu_s" else \
        dict(ROOMY, max_compile_cpu_s=600, compile_timeout_s=0.5)
    engine = setup.engine(grammar=GrammarLimits(**limits))
    g = engine.grammars
    try:
        engine.submit(structured(1, setup, enum(4000, 60, 1), 0), lambda d: None)
        (pid,) = wait_until(g.worker_pids, timeout_s=120, what="the enum's compile process")
        last = collect(engine, [structured(2, setup, enum(4000, 60, 2), 0)])[2][-1]
        assert last.finish_reason is RequestStatus.FINISHED_ERROR
        assert last.error_code == "INVALID_ARGUMENT" and last.error_field == "response_format"
        assert bound in last.error
        wait_until(lambda: g.over_cpu + g.timed_out == 2, timeout_s=120,
                   what="both refused", state=lambda: (g.over_cpu, g.timed_out))
        assert (g.over_cpu if bound == "grammar_max_compile_cpu_s" else g.timed_out) == 2
        assert gone(pid)  # the first one's process: killed at the bound
        assert g.compiling_here == 0 and g.local_compiles == 0
        # what the slots' threads did meanwhile was waiting on their workers
        assert slot_cpu_s(g) < 1.0
        # the same spec again: refused at once, from the cache
        again = collect(engine, [structured(3, setup, enum(4000, 60, 2), 0)])[3][-1]
        assert bound in again.error and g.over_cpu + g.timed_out == 2
    finally:
        engine.stop()
    assert engine.pool.num_free == engine.pool.num_total


def test_a_request_ending_during_the_compile_here_leaves_under_a_second_of_cpu(setup):
    """A compile here cannot be stopped: it costs about what its worker's did, which the
    CPU bound (0.9 s here, so that there is one long enough to catch) caps. A request that
    ends while it runs: its future is cancelled at once, the compile ends on its own, and
    the slot's threads used under a second of CPU from the request's end to its own."""
    g = grammars(setup, max_compile_cpu_s=0.9, compile_timeout_s=600, **ROOMY)
    try:
        g.compile(small(0)).result(timeout=120)  # the workers' server started
        for seed in range(10):  # a compile that ends before the test sees it: another spec
            fut = g.compile(enum(1500, 60, 100 + seed), "c")
            wait_until(lambda f=fut: g.compiling_here or f.done(), timeout_s=120,
                       what="the enum compiling here")
            cpu_at_end = slot_cpu_s(g)
            g.abandon(fut)  # a no-op once it is done
            if fut.cancelled():
                break
        else:
            pytest.fail("never saw a compile here in progress")
        wait_until(lambda: g.compiling_here == 0, timeout_s=120, what="the compile here ended")
        assert slot_cpu_s(g) - cpu_at_end < 1.0
        assert g.abandoned == 1 and all(f is not fut for f in g._cache.values())
        # what it cost here is about what its worker measured
        assert g.local_cpu_s <= 1.5 * g.expected_cpu_s + 0.05 * g.local_compiles
    finally:
        g.close()


def test_the_compile_here_costs_what_the_workers_did(setup):
    g = grammars(setup, max_compile_cpu_s=5, **ROOMY)
    try:
        specs = [enum(1500, 18, 200 + i) for i in range(3)] + [
            GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({
                "type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                 for i in range(250)}})),
            GrammarSpec(GrammarKind.REGEX, "([a-z]{1,200}-){1,200}")]
        for spec in specs:
            g.compile(spec).result(timeout=120)
        assert g.local_compiles == len(specs) and g.over_cpu == 0
        assert g.local_cpu_s <= 1.5 * g.expected_cpu_s + 0.05 * len(specs), (
            g.local_cpu_s, g.expected_cpu_s)
    finally:
        g.close()


def test_a_small_schema_is_compiled_while_two_clients_flood_costly_ones(setup):
    """Clients a and b each queue costly enums (seconds of compiling each) and hold both
    shared slots; client c's new small schema is compiled on the light-only slot before any
    of theirs is done (before, it waited for one of them)."""
    g = grammars(setup, workers=2, max_compile_cpu_s=600, compile_timeout_s=600, **ROOMY)
    try:
        g.compile(small(-1), "c").result(timeout=120)  # the workers' server started
        heavies = [g.compile(enum(4000, 60, 300 + 10 * k + i), client)
                   for i in range(3) for k, client in enumerate("ab")]
        wait_until(lambda: len(g.worker_pids()) >= 3, timeout_s=120,
                   what="both shared slots compiling a costly enum")
        done_when_c_was: list[int] = []
        fut = g.compile(small(0), "c")
        fut.add_done_callback(
            lambda _f: done_when_c_was.append(sum(h.done() for h in heavies)))
        assert fut.result(timeout=120) is not None
        assert done_when_c_was == [0], done_when_c_was
        assert g.demoted == 0
    finally:
        g.close()


def test_a_light_spec_that_compiles_slowly_moves_to_the_other_lane(setup, monkeypatch):
    """A spec its text calls light but whose compile runs past LIGHT_CPU_S on the
    light-only slot is queued again in the other lane and compiled there; its client's
    next light specs go there too."""
    monkeypatch.setattr(grammar_checks, "LIGHT_MAX_ENUM_CHARS", 1 << 30)
    monkeypatch.setattr(grammar_checks, "LIGHT_MAX_BYTES", 1 << 30)
    g = grammars(setup, workers=1, max_compile_cpu_s=600, compile_timeout_s=600, **ROOMY)
    try:
        slow = g.compile(enum(4000, 60, 400), "d")
        assert slow.result(timeout=300) is not None
        assert g.demoted == 1 and g.over_cpu == 0
        with g._lock:
            assert "d" in g._heavy_clients
        nxt = g.compile(small(1), "d")
        with g._lock:
            job = g._jobs.get(nxt)
            assert job is None or not job.light
        assert nxt.result(timeout=120) is not None
    finally:
        g.close()
