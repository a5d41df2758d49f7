"""Structured output in the engine with the real decoder and xgrammar, both architectures.

Random weights produce nonsense, so a valid output can only come from the grammar: a
pydantic model with nested objects, enums, arrays and required fields parses for 20 seeds
out of 20 at temperature 1.0, as do regexes and choices. A structured request batched with
free ones leaves them equal to `generate()` (the mask is per row). A large schema compiles
off the engine thread while decoding goes on. A schema that does not compile fails its
request alone, with INVALID_ARGUMENT naming `response_format`.
"""

from __future__ import annotations

import enum
import json
import re
import threading

import language_oracle as oracle
import pytest
from pydantic import BaseModel, Field
from test_language_engine import collect

from tandem.models.split import load_text_weights
from tandem.sampling import GrammarKind, GrammarSpec, SamplingParams
from tandem.services.language.engine.core import Engine, EngineConfig
from tandem.services.language.engine.grammar import GrammarLimits, Grammars
from tandem.services.language.engine.request import Request, RequestSpec, RequestStatus
from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings


class Colour(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Point(BaseModel):
    # NOTE: bounded, as every free-form part of the schema is: random weights pick digits
    # as often as anything else, so an unbounded number rarely ends within max_tokens
    x: int = Field(ge=-1000, le=1000)
    y: int = Field(ge=-1000, le=1000)


class Shape(BaseModel):
    # NOTE: a pattern, not max_length: xgrammar 0.2.8's rule for a length-bounded string
    # lets raw control characters through (invalid JSON); its plain string rule does not
    name: str = Field(pattern=r"^[a-z ]{1,8}$")
    colour: Colour
    corners: list[Point] = Field(max_length=4)
    filled: bool
    origin: Point


class Setup:
    def __init__(self, ckpt):
        self.model, self.processor = oracle.load(ckpt)
        self.tokenizer = self.processor.tokenizer
        self.weights = load_text_weights(ckpt)
        inputs = oracle.make_inputs(self.processor, "Describe a shape as JSON.", [])
        self.payload = oracle.payload(self.model, inputs)
        self.ref, _ = oracle.generate(self.model, inputs, 12)

    def engine(self, **cfg) -> Engine:
        runner = ModelRunner(self.weights.copy(), RunnerSettings(page_size=4), num_pages=1024)
        return Engine(runner, self.tokenizer, EngineConfig(**cfg)).start()


_setups: dict[str, Setup] = {}


def setup_of(arch: str, checkpoint) -> Setup:
    """One Setup per architecture in a test process (the grammar tests share it)."""
    if arch not in _setups:
        _setups[arch] = Setup(checkpoint(arch))
    return _setups[arch]


def grammars(setup: Setup, **limits) -> Grammars:
    """A Grammars component over `setup`'s tokenizer, with `limits` (GrammarLimits')."""
    return Grammars(setup.tokenizer, len(setup.tokenizer), (setup.tokenizer.eos_token_id,),
                    GrammarLimits(**limits))


@pytest.fixture(params=["qwen2_5_vl", "qwen3_vl"])
def setup(request, checkpoint):
    return setup_of(request.param, checkpoint)


def text_of(stream) -> str:
    return "".join(d.text for d in stream)


def structured(rid, setup, spec, seed, max_tokens=400, logit_bias=None):
    return Request(RequestSpec(rid, SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                                       grammar=spec, logit_bias=logit_bias or {}), setup.payload))


def test_json_schema_regex_and_choice_are_always_valid(setup):
    engine = setup.engine()
    try:
        schema = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(Shape.model_json_schema()))
        reqs = [structured(100 + s, setup, schema, s) for s in range(20)]
        regex = GrammarSpec(GrammarKind.REGEX, r"[a-z]{3}-[0-9]{2}")
        reqs += [structured(200 + s, setup, regex, s) for s in range(5)]
        choice = GrammarSpec(GrammarKind.CHOICE, json.dumps(["yes", "no", "maybe so"]))
        reqs += [structured(300 + s, setup, choice, s) for s in range(5)]
        # any object: keys and values are free, so nudge the closing tokens (the grammar
        # still decides where they may go) or random weights never stop
        obj = GrammarSpec(GrammarKind.JSON_OBJECT)
        ends = {setup.tokenizer.convert_tokens_to_ids(t): 6.0 for t in ('"', "}")}
        for s in range(5):
            reqs.append(structured(400 + s, setup, obj, s, logit_bias=ends))
        streams = collect(engine, reqs)
        for r in reqs:
            out = streams[r.room]
            assert out[-1].finish_reason is RequestStatus.FINISHED_STOP, (r.room, text_of(out))
        for r in reqs[:20]:
            Shape.model_validate_json(text_of(streams[r.room]))  # raises if invalid
        for r in reqs[20:25]:
            assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", text_of(streams[r.room]))
        for r in reqs[25:30]:
            assert text_of(streams[r.room]) in ("yes", "no", "maybe so")
        for r in reqs[30:]:
            assert isinstance(json.loads(text_of(streams[r.room])), dict)
        assert engine.pool.num_free == engine.pool.num_total
    finally:
        engine.stop()


def test_free_requests_batched_with_structured_ones_equal_generate(setup):
    engine = setup.engine()
    try:
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(Shape.model_json_schema()))
        free = [Request(RequestSpec(10 + i, SamplingParams(max_tokens=12), setup.payload)) for i in range(3)]
        shaped = [structured(20 + i, setup, spec, i) for i in range(3)]
        streams = collect(engine, [free[0], shaped[0], free[1], shaped[1], free[2], shaped[2]])
        for r in free:
            assert [t for d in streams[r.room] for t in d.token_ids] == setup.ref
        for r in shaped:
            Shape.model_validate_json(text_of(streams[r.room]))
    finally:
        engine.stop()


def test_a_large_schema_compiles_while_decoding_goes_on(setup):
    # NOTE: ~0.7 s of CPU to compile on the tiny vocabulary: over the default
    # grammar_max_compile_cpu_s (0.5 s), raised here as an operator would for such schemas
    engine = setup.engine(grammar=GrammarLimits(max_compile_cpu_s=10))
    try:
        props = {f"field_{i}": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"enum": ["x", "y", f"z{i}"]},
            "c": {"type": "array", "items": {"type": "string", "maxLength": 5}}},
            "required": ["a", "b"]} for i in range(400)}
        big = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(
            {"type": "object", "properties": props, "required": list(props)}))
        steps: dict[str, int] = {}
        compiled = threading.Event()
        long = Request(RequestSpec(1, SamplingParams(max_tokens=300, ignore_eos=True), setup.payload))
        got = {}
        engine.submit(long, lambda d: got.setdefault("first", engine.num_steps))
        while "first" not in got:  # the free request decodes before the compile starts
            pass
        steps["start"] = engine.num_steps
        fut = engine.grammars.compile(big)
        fut.add_done_callback(lambda _f: (steps.setdefault("end", engine.num_steps),
                                          compiled.set()))
        req = Request(RequestSpec(2, SamplingParams(max_tokens=1, grammar=big), setup.payload))
        req.sampler.grammar_future = fut
        out = collect(engine, [req])
        assert compiled.wait(30)
        assert steps["end"] > steps["start"], steps  # decode steps ran during the compile
        assert out[2][-1].finish_reason is RequestStatus.FINISHED_LENGTH
        engine.abort(1)
    finally:
        engine.stop()


@pytest.mark.parametrize("kind,text", [(GrammarKind.JSON_SCHEMA, '{"type": "nonsense"}'),
                                       (GrammarKind.REGEX, "([a-z"),
                                       (GrammarKind.EBNF, "root ::= ")])
def test_a_grammar_that_does_not_compile_fails_its_request_alone(setup, kind, text):
    engine = setup.engine()
    try:
        bad = structured(1, setup, GrammarSpec(kind, text), 0)
        ok = Request(RequestSpec(2, SamplingParams(max_tokens=12), setup.payload))
        streams = collect(engine, [bad, ok])
        last = streams[1][-1]
        assert last.finish_reason is RequestStatus.FINISHED_ERROR
        assert last.error_code == "INVALID_ARGUMENT" and last.error_field == "response_format"
        assert "does not compile" in last.error
        assert [t for d in streams[2] for t in d.token_ids] == setup.ref
        assert engine.pool.num_free == engine.pool.num_total
    finally:
        engine.stop()
