"""Sampling parameters: one table of knobs, and every boundary's mapping and check from it.

A *knob* is a scalar field of the wire's `tandem.v1.SamplingParams`. `KNOBS` gives each
its type, the value it takes when absent, its bounds and its doc, and everything else is
derived from that one row:

    the language tier   from_proto(p) -> SamplingParams   (plain data, defaults resolved,
                                                           checked: SamplingError)
    the router, gRPC    from_proto(request.sampling)      (the same check, before routing)
    the router, HTTP    openai_fields() -> the OpenAI bodies' fields; to_proto(values),
                        then from_proto (the same check, a 400 naming the field)
    the SDK             to_proto(keyword arguments of build_request)

So a new knob is a field in common.proto, a row here (and its field in `SamplingParams`,
a literal dataclass a test holds to the table), and its use in the sampler
(services/language/engine/sampler.py). The few fields that are not scalars (stop strings,
stop token ids, logit bias, the output grammar) are spelled out below, once.

Absent and zero: a knob whose zero is not its default (`top_p`, `repetition_penalty`,
`max_tokens`, `seed`, `skip_special_tokens`) is `optional` in the proto, so absence travels as absence; any value
that is present is checked, zero included (top_p=0 is an error, not "off").

Light on purpose: the client SDK imports it (protobuf only; no pydantic, no torch).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

from tandem.v1 import common_pb2

MAX_STOP = 16  # stop strings per request
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024  # entries
MAX_TOKENS = 1 << 20  # bound of max_tokens, min_tokens and top_k
MAX_TOP_LOGPROBS = 20


class SamplingError(ValueError):
    """A sampling parameter out of its bounds; `field` names it (the wire's name)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"sampling.{field}: {message}")
        self.field = field
        self.reason = message


@dataclass(frozen=True)
class Knob:
    """One scalar knob. Bounds are inclusive unless `*_open`; None: unbounded."""

    name: str  # the wire's, OpenAI's and the SDK's name
    type: type  # float, int or bool
    default: float | int | bool | None  # its value when absent (None: decided later)
    doc: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    # A field of both OpenAI bodies as is. False: each API spells it its own way
    # (max_tokens / max_completion_tokens, chat's and completions' logprobs).
    openai: bool = True
    openai_default: float | None = None  # OpenAI's default where it is not the wire's

    def bounds(self) -> str:
        lo = "" if self.lo is None else ("(" if self.lo_open else "[") + f"{self.lo:g}"
        hi = "" if self.hi is None else f"{self.hi:g}" + (")" if self.hi_open else "]")
        return f"in {lo}, {hi}" if lo and hi else f">= {self.lo:g}" if lo else ""

    def check(self, value) -> None:
        if value is None or self.type is bool:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                self.type is int and not isinstance(value, int)) or value != value:
            raise SamplingError(self.name, f"must be a{'n integer' if self.type is int else ' number'}"
                                f", got {value!r}")
        low = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        high = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        if low or high:
            raise SamplingError(self.name, f"must be {self.bounds()}, got {value}")


KNOBS: tuple[Knob, ...] = (
    Knob("temperature", float, 0.0, "Softmax temperature; 0 is greedy decoding.", 0, 2,
         openai_default=1.0),
    Knob("top_p", float, 1.0, "Nucleus sampling: keep the most likely tokens whose mass "
         "reaches top_p; 1 keeps all.", 0, 1, lo_open=True),
    Knob("top_k", int, 0, "Keep the k most likely tokens; 0 or -1 (vLLM's 'off') keeps "
         "all.", -1, MAX_TOKENS),
    Knob("min_p", float, 0.0, "Drop tokens less likely than min_p times the most likely "
         "one.", 0, 1),
    Knob("presence_penalty", float, 0.0, "Subtracted once from the logit of every token "
         "generated so far (OpenAI).", -2, 2),
    Knob("frequency_penalty", float, 0.0, "Subtracted per occurrence from the logit of every "
         "token generated so far (OpenAI).", -2, 2),
    Knob("repetition_penalty", float, 1.0, "transformers' repetition penalty over prompt and "
         "output tokens (a positive logit divided by it, a negative one multiplied); 1 is "
         "off.", 0, 2, lo_open=True),
    Knob("typical_p", float, 1.0, "Locally typical sampling: keep the tokens whose "
         "information is closest to the entropy, up to this mass; 1 keeps all.", 0, 1,
         lo_open=True),
    Knob("min_tokens", int, 0, "EOS and stop token ids cannot end the output before this "
         "many tokens.", 0, MAX_TOKENS),
    Knob("seed", int, None, "Seed of the request's random generator; absent: a random "
         "one.", -(1 << 63), (1 << 63) - 1),
    Knob("ignore_eos", bool, False, "Keep generating past EOS (benchmarks)."),
    Knob("include_stop_str_in_output", bool, False, "Keep the matched stop string, or the "
         "text of the EOS or stop token that ended the output, at its end (vLLM's rule)."),
    Knob("skip_special_tokens", bool, True, "Leave the tokenizer's special tokens out of "
         "the output text (the token ids keep them)."),
    Knob("spaces_between_special_tokens", bool, True, "With special tokens in the text: "
         "false joins each added token's own text to its neighbours without a separator "
         "(the same text for byte-level tokenizers such as Qwen's)."),
    Knob("max_tokens", int, None, "Most tokens to generate; absent: the service's default "
         "(shortened to what the context leaves).", 1, MAX_TOKENS, openai=False),
    Knob("logprobs", bool, False, "Return each chosen token's log-probability.",
         openai=False),
    Knob("top_logprobs", int, 0, "Also return this many most likely tokens at each "
         "position (needs logprobs).", 0, MAX_TOP_LOGPROBS, openai=False),
)
KNOB = {k.name: k for k in KNOBS}


class GrammarKind(enum.Enum):
    """The output constraints the wire's StructuredOutput can name."""

    JSON_SCHEMA = "json_schema"  # text: the schema, JSON
    JSON_OBJECT = "json_object"  # any JSON object; text unused
    REGEX = "regex"  # text: the pattern
    CHOICE = "choice"  # text: a JSON list of the allowed strings
    EBNF = "ebnf"  # text: the grammar (xgrammar's EBNF, GBNF-like)


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    text: str = ""


def _check(p) -> None:
    """Every bound of one SamplingParams: the knobs' rows, then the other fields."""
    for k in KNOBS:
        k.check(getattr(p, k.name))
    if len(p.stop) > MAX_STOP or any(not s for s in p.stop):
        raise SamplingError("stop", f"at most {MAX_STOP} strings, none empty")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(
            not 0 <= t < 1 << 31 for t in p.stop_token_ids):
        raise SamplingError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, each "
                            "in [0, 2^31)")
    bad = [t for t, b in p.logit_bias.items() if t < 0 or not -100 <= b <= 100]
    if bad or len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise SamplingError("logit_bias", f"token ids >= 0, biases in [-100, 100], at most "
                            f"{MAX_LOGIT_BIAS} entries (bad: {bad[:5]})")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise SamplingError("min_tokens", f"{p.min_tokens} is more than max_tokens "
                            f"{p.max_tokens}")
    if p.top_logprobs and not p.logprobs:
        raise SamplingError("top_logprobs", "needs logprobs")
    if p.grammar is not None and p.ignore_eos:
        raise SamplingError("ignore_eos", "cannot go with structured output (the grammar "
                            "ends the output)")


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling parameters: the plain-data twin of the wire's SamplingParams,
    defaults resolved. One field per knob, in KNOBS' order, of its type and with its
    default (None where KNOBS leaves it to be decided later); then the fields that are not
    scalars. tests/test_sampling_knobs.py checks the fields against KNOBS, so a new knob
    is a row there and a field here. Frozen: it is the request's spec (what the engine
    decides, e.g. how many tokens a default max_tokens allows, lives on the request).
    Checked on construction (SamplingError)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    typical_p: float = 1.0
    min_tokens: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    max_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        _check(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def shapes_logits(self) -> bool:
        """Anything to apply to the logits before picking (penalties, bias, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens)


def grammar_from_proto(so: common_pb2.StructuredOutput) -> GrammarSpec | None:
    """The wire's StructuredOutput -> GrammarSpec (None: it names no constraint)."""
    match so.WhichOneof("kind"):
        case "json_schema":
            return GrammarSpec(GrammarKind.JSON_SCHEMA, so.json_schema)
        case "json_object":
            return GrammarSpec(GrammarKind.JSON_OBJECT) if so.json_object else None
        case "regex":
            return GrammarSpec(GrammarKind.REGEX, so.regex)
        case "choice":
            if not so.choice.choices:
                raise SamplingError("structured_output", "choice needs at least one choice")
            return GrammarSpec(GrammarKind.CHOICE, json.dumps(list(so.choice.choices)))
        case "ebnf":
            return GrammarSpec(GrammarKind.EBNF, so.ebnf)
    return None


def from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """The wire's SamplingParams, checked (SamplingError names the bad field)."""
    knobs = {k.name: getattr(p, k.name) for k in KNOBS
             if not _optional(k) or p.HasField(k.name)}
    return SamplingParams(
        **knobs, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
        logit_bias=dict(p.logit_bias),
        grammar=grammar_from_proto(p.structured_output)
        if p.HasField("structured_output") else None)


def _optional(k: Knob) -> bool:
    """Whether the proto field has presence (`optional`): a default that is not zero
    (a bool whose default is true included)."""
    return k.default is None or k.default != 0


def to_proto(**values) -> common_pb2.SamplingParams:
    """The wire's SamplingParams from knob values by name (None: absent); the non-scalar
    fields (stop, stop_token_ids, logit_bias, structured_output) are set by the caller.
    An unknown name is a TypeError, as for a function's keyword argument; a value out of
    its knob's bounds is a SamplingError here already (one the wire cannot even carry,
    e.g. a seed past 64 bits, must not reach the protobuf encoder)."""
    unknown = sorted(set(values) - set(KNOB))
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {', '.join(unknown)}")
    out = common_pb2.SamplingParams()
    for name, value in values.items():
        if value is not None:
            KNOB[name].check(value)
            setattr(out, name, value)
    return out


def openai_fields() -> dict[str, tuple[type, object, str]]:
    """The knobs the OpenAI bodies take as they are: name -> (type, default, description).
    Each is optional there (None: OpenAI's default, the wire's unless `openai_default`);
    the bounds are checked by `from_proto`, not by the body's schema."""
    return {k.name: (k.type | None, None, f"{k.doc} {k.bounds().capitalize()}".strip())
            for k in KNOBS if k.openai}
