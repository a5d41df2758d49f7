"""Structured output cannot stall an instance: a spec over a size limit is refused at once,
a compile past its deadline is refused and its process killed while other clients are
served, a compile nobody waits for any more stops, clients' compiles take turns, a schema
that admits no output is a 400 (not a 500 when its first token is masked out), and a
stopping engine never waits for a compile.

The slow spec is an enum of 20,000 values (seconds of xgrammar work on the tiny vocabulary,
over a limit raised for the test); the deadline is a tenth of that or less."""

from __future__ import annotations

import json

import psutil
import pytest
from test_language_engine import collect
from test_structured_output import grammars, setup_of, structured
from waiting import wait_until

from tandem.sampling import GrammarKind, GrammarSpec
from tandem.services.language.engine.grammar import (
    GrammarError,
    GrammarLimits,
    check_spec,
)
from tandem.services.language.engine.request import RequestStatus

SLOW = GrammarSpec(GrammarKind.JSON_SCHEMA,
                   json.dumps({"enum": [f"v{i}" for i in range(20_000)]}))
# lets SLOW past the size checks, and its compile run as long as a test's deadline says
ROOMY = dict(max_enum_values=100_000, max_enum_chars=1 << 20, max_spec_bytes=1 << 20,
             max_compile_cpu_s=600)
CHOICE = GrammarSpec(GrammarKind.CHOICE, json.dumps(["yes", "no"]))


@pytest.fixture
def setup(checkpoint):
    return setup_of("qwen2_5_vl", checkpoint)


def schema(s) -> GrammarSpec:
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(s))


def nested(depth: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(depth):
        s = {"type": "array", "items": s}
    return s


@pytest.mark.parametrize("spec,limit", [
    (schema({"enum": list(range(30_000))}), "grammar_max_enum_values"),
    # the probe's enum: 4,000 values of 60 characters, under every count limit
    (schema({"enum": [f"{i:04d}" + "x" * 56 for i in range(4000)]}), "grammar_max_enum_chars"),
    (schema({"const": "c" * 140_000}), "grammar_max_enum_chars"),
    # a property named like a data keyword is a schema all the same
    (schema({"type": "object", "properties": {"default": {"type": "string",
                                                          "maxLength": 100_000}}}),
     "grammar_max_count"),
    (schema({"$defs": {"enum": {"enum": list(range(30_000))}}, "$ref": "#/$defs/enum"}),
     "grammar_max_enum_values"),
    (GrammarSpec(GrammarKind.CHOICE, json.dumps(["y" * 100] * 1400)), "grammar_max_enum_chars"),
    (schema({"type": "string", "maxLength": 100_000}), "grammar_max_count"),
    (schema({"type": "array", "items": {"type": "string"}, "minItems": 10_000}),
     "grammar_max_count"),
    (schema({"type": "string", "pattern": "^a{1,100000}$"}), "grammar_max_count"),
    (GrammarSpec(GrammarKind.REGEX, "[a-z]{50000}"), "grammar_max_count"),
    (GrammarSpec(GrammarKind.EBNF, 'root ::= "a"{0,99999}'), "grammar_max_count"),
    (schema(nested(40)), "grammar_max_depth"),
    (schema({"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                              for i in range(5000)}}),
     "grammar_max_properties"),
    (GrammarSpec(GrammarKind.CHOICE, json.dumps([str(i) for i in range(5000)])),
     "grammar_max_enum_values"),
    (schema({"description": "x" * (300 << 10)}), "grammar_max_spec_bytes"),
])
def test_a_spec_over_a_limit_is_refused_at_once(setup, spec, limit):
    g = grammars(setup)
    try:
        fut = g.compile(spec)
        assert fut.done()  # never queued: no process, no wait
        e = fut.exception()
        assert isinstance(e, GrammarError) and e.field == "response_format" and limit in str(e)
        assert g.worker_pids() == []
    finally:
        g.close()


def test_a_compile_past_its_deadline_is_refused_killed_and_others_are_served(setup):
    engine = setup.engine(grammar=GrammarLimits(compile_timeout_s=0.3, **ROOMY))
    try:
        slow, choice = structured(1, setup, SLOW, 0), structured(2, setup, CHOICE, 0)
        streams = collect(engine, [slow, choice])
        last = streams[1][-1]
        assert last.finish_reason is RequestStatus.FINISHED_ERROR
        assert last.error_code == "INVALID_ARGUMENT" and last.error_field == "response_format"
        assert "grammar_compile_timeout_s" in last.error
        assert "".join(d.text for d in streams[2]) in ("yes", "no")
        assert engine.grammars.timed_out == 1 and engine.grammars.over_cpu == 0
        assert engine.grammars.local_compiles == 1  # CHOICE's alone: SLOW never compiled here
        # the same spec again is refused at once (cached), with no second compile
        again = collect(engine, [structured(3, setup, SLOW, 0)])[3][-1]
        assert again.finish_reason is RequestStatus.FINISHED_ERROR and engine.grammars.timed_out == 1
        assert engine.pool.num_free == engine.pool.num_total
    finally:
        engine.stop()
    assert engine.grammars.worker_pids() == []


def test_a_compile_nobody_waits_for_stops_and_stop_never_waits(setup):
    engine = setup.engine(grammar=GrammarLimits(compile_timeout_s=120, **ROOMY))
    try:
        engine.submit(structured(1, setup, SLOW, 0), lambda d: None)
        (pid,) = wait_until(engine.grammars.worker_pids, timeout_s=60,
                            what="a compile process for the slow spec")
        engine.abort(1)
        wait_until(lambda: not psutil.pid_exists(pid) or
                   psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
                   timeout_s=60, what="the abandoned compile's process to end")
        assert engine.grammars.abandoned == 1
        # a stopping engine kills a compile in progress rather than waiting for it
        engine.submit(structured(2, setup, SLOW, 0), lambda d: None)
        (pid,) = wait_until(engine.grammars.worker_pids, timeout_s=60,
                            what="a compile process for the slow spec")
    finally:
        engine.stop()
    assert engine.grammars.worker_pids() == []
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert engine.pool.num_free == engine.pool.num_total


def heavy(i: int) -> GrammarSpec:
    """A spec of the other lane (a count over LIGHT_MAX_COUNT) that compiles at once."""
    return GrammarSpec(GrammarKind.REGEX, f"[a-z]{{{300 + i}}}")


@pytest.mark.parametrize("workers", [1, 2])
def test_clients_take_turns_and_one_holds_at_most_its_share(setup, workers):
    """One shared slot: clients' queued compiles alternate. Two: a client compiling a slow
    spec holds one, and another client's compile runs beside it, not after."""
    g = grammars(setup, workers=workers, **ROOMY)
    try:
        order: list[str] = []
        futures = []

        def ask(name, spec, client):
            futures.append(g.compile(spec, client))
            futures[-1].add_done_callback(lambda _f: order.append(name))

        ask("a1", SLOW, "a")
        for i in (2, 3):
            ask(f"a{i}", heavy(i), "a")
        ask("b1", heavy(1), "b")
        wait_until(lambda: len(order) == 4, timeout_s=120, what="four compiles")
        assert [f.exception() for f in futures] == [None] * 4  # each compiled
        assert order.index("b1") < order.index("a3"), order
        if workers == 2:  # a1 holds a's share: a2 and a3 wait for it, b1 does not
            assert order[0] == "b1" and order[1] == "a1", order
        assert g.demoted == 0
    finally:
        g.close()


def test_a_schema_that_admits_no_output_is_refused_by_name(setup):
    engine = setup.engine()
    try:
        loop = schema({"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"})
        last = collect(engine, [structured(1, setup, loop, 0)])[1][-1]
        assert last.finish_reason is RequestStatus.FINISHED_ERROR
        assert last.error_code == "INVALID_ARGUMENT" and last.error_field == "response_format"
        # Tandem's words (check_spec's $ref walk), not the grammar engine's: xgrammar 0.2.9
        # refuses this schema with a message of its own, 0.2.8 compiled it
        assert last.error.startswith("the json_schema admits no output at all")
        assert engine.pool.num_free == engine.pool.num_total
    finally:
        engine.stop()


@pytest.mark.parametrize("loop", [
    {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"},
    {"$defs": {"a": {"$ref": "#/$defs/b", "description": "x"}, "b": {"$ref": "#/$defs/a"}},
     "type": "object", "properties": {"k": {"$ref": "#/$defs/a"}}},
    {"$ref": "#"},
])
def test_a_ref_loop_is_refused_before_the_compiler(loop):
    with pytest.raises(GrammarError) as e:
        check_spec(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(loop)), GrammarLimits())
    assert e.value.message.startswith("the json_schema admits no output at all (the $ref chain ")
    assert e.value.field == "response_format" and e.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("fine", [
    # recursion with a base case: a list node whose `next` may be null
    {"$defs": {"node": {"type": "object", "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}},
     "$ref": "#/$defs/node"},
    # a chain of references that ends in a schema
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "integer"}}, "$ref": "#/$defs/a"},
    # a reference the walk cannot follow is the compiler's to judge
    {"$ref": "https://example.com/schema.json"},
    # inside a subschema with its own $id, `#` is that subschema: not followed from the root
    # (read from the root, inner's "#/$defs/inner" would be inner itself: a false loop)
    {"$defs": {"inner": {"$id": "urn:inner", "$defs": {"inner": {"type": "integer"}},
                         "$ref": "#/$defs/inner"}}, "$ref": "#/$defs/inner"},
])
def test_references_with_a_base_case_pass_the_check(fine):
    check_spec(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(fine)), GrammarLimits())


def test_the_cache_charges_what_the_worker_measured_and_keeps_its_byte_budget(setup, monkeypatch):
    """Each grammar is charged the bytes its compile grew the worker's heap by, read there
    once: never `memory_size_bytes` in this process (it walks a grammar's token-mask cache:
    60 ms for a 4,000-value enum, which once stalled every other request's compile call)."""
    import xgrammar as xgr

    reads = []
    real = xgr.CompiledGrammar.memory_size_bytes
    monkeypatch.setattr(xgr.CompiledGrammar, "memory_size_bytes",
                        property(lambda self: reads.append(1) or real.fget(self)))
    specs = [GrammarSpec(GrammarKind.REGEX, f"[a-z]{{{i}}}x") for i in range(1, 10)]
    g = grammars(setup)
    try:
        for spec in specs[:-1]:
            g.compile(spec).result(timeout=120)
        assert reads == []  # the worker read what it grew by; nothing read here
        charged = dict(g._sizes)
        assert len(charged) == len(specs) - 1 and all(n > 0 for n in charged.values())
        for spec, n in charged.items():  # at least what xgrammar itself counts
            assert n >= real.fget(g._cache[spec].result()), spec
        assert g.cached_bytes == sum(charged.values())
        g.limits = GrammarLimits(cache_bytes=sum(charged.values()) // 2)
        g.compile(specs[-1]).result(timeout=120)
        assert 0 < len(g._sizes) < len(specs) and g.cached_bytes <= sum(charged.values()) // 2
        assert g.cached_bytes == sum(g._sizes.values())
    finally:
        g.close()
