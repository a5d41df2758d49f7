"""What the chat and completions APIs share: sampling and structured-output fields with
OpenAI's bounds (and vLLM's extensions), and their conversion to the wire's
SamplingParams. Every field here is honoured; a value out of range is a 400 naming it."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.services.router.errors import RouterError
from tandem.services.router.request import MAX_TIMEOUT_MS
from tandem.v1 import common_pb2


class _Model(BaseModel):
    # NOTE: strict: a JSON value of the wrong type is a 400 (`"stream": "yes"` and
    # `"max_tokens": true` used to be coerced); an integer still passes for a float.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Model):
    include_usage: bool = False


class JSONSchemaFormat(_Model):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced (strict or not)


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs` (one of its fields)."""

    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = Field(None, min_length=1, max_length=16384)
    choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    grammar: str | None = Field(None, min_length=1, max_length=1 << 20)


class SamplingFields(_Model):
    """The request fields both APIs take (each API adds its prompt, logprobs and more)."""

    model: str = ""
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=1 << 20)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)
    response_format: ResponseFormat | None = None
    # vLLM-compatible extensions
    top_k: int | None = Field(None, ge=0, le=1 << 20)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0, le=1 << 20)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    include_stop_str_in_output: bool = False
    # vLLM-compatible structured-output extensions (at most one constraint in all)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = Field(None, min_length=1, max_length=16384)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    guided_grammar: str | None = Field(None, min_length=1, max_length=1 << 20)
    ignore_eos: bool = False  # extension (benchmarks)
    timeout_ms: int | None = Field(None, ge=1, le=MAX_TIMEOUT_MS)  # extension: per-request deadline
    priority: int = Field(0, ge=-(1 << 31), lt=1 << 31)  # extension
    # Hint only (accepted, no effect), as documented in docs/sdk.md.
    user: str | None = Field(None, max_length=256)


def _utf8(text: str, param: str) -> str:
    """`text` if it is valid Unicode for the wire; a lone surrogate (JSON allows "\ud800")
    is a 400 naming the field, not a 500 from the protobuf encoder."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RouterError("INVALID_ARGUMENT", "text is not valid Unicode (lone surrogate)",
                          param) from None  # fmt: skip
    return text


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [_utf8(s, "stop") for s in ([stop] if isinstance(stop, str) else stop)]
    if len(stops) > 16:
        raise RouterError("INVALID_ARGUMENT", "at most 16 stop sequences", "stop")
    if any(not s for s in stops):
        raise RouterError("INVALID_ARGUMENT", "stop sequences must be non-empty", "stop")
    return stops


def _schema_text(schema, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise RouterError("INVALID_ARGUMENT", "the JSON schema is not valid JSON",
                              param) from None  # fmt: skip
    if not isinstance(schema, dict):
        raise RouterError("INVALID_ARGUMENT", "a JSON schema must be an object", param)
    return json.dumps(schema)


def structured_output(body: SamplingFields) -> common_pb2.StructuredOutput | None:
    """The one output constraint the body asks for (None: free text); two is a 400."""
    so = body.structured_outputs
    asked: list[tuple[str, common_pb2.StructuredOutput]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", common_pb2.StructuredOutput(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise RouterError("INVALID_ARGUMENT", "response_format json_schema needs "
                              "json_schema.schema", "response_format")  # fmt: skip
        asked.append(("response_format", common_pb2.StructuredOutput(
            json_schema=_schema_text(rf.json_schema.schema_, "response_format"))))
    for param, value in (("guided_json", body.guided_json),
                         ("structured_outputs", so.json_ if so else None)):
        if value is not None:
            asked.append((param, common_pb2.StructuredOutput(
                json_schema=_schema_text(value, param))))
    if so is not None and so.json_object:
        asked.append(("structured_outputs", common_pb2.StructuredOutput(json_object=True)))
    for param, regex in (("guided_regex", body.guided_regex),
                         ("structured_outputs", so.regex if so else None)):
        if regex is not None:
            asked.append((param, common_pb2.StructuredOutput(regex=regex)))
    for param, choice in (("guided_choice", body.guided_choice),
                          ("structured_outputs", so.choice if so else None)):
        if choice is not None:
            asked.append((param, common_pb2.StructuredOutput(
                choice=common_pb2.Choices(choices=choice))))
    for param, ebnf in (("guided_grammar", body.guided_grammar),
                        ("structured_outputs", so.grammar if so else None)):
        if ebnf is not None:
            asked.append((param, common_pb2.StructuredOutput(ebnf=ebnf)))
    if len(asked) > 1:
        raise RouterError("INVALID_ARGUMENT", "at most one output constraint (response_format, "
                          "guided_*, structured_outputs)", asked[1][0])  # fmt: skip
    return asked[0][1] if asked else None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's {"token id": bias} with biases in [-100, 100]."""
    out = {}
    for key, value in (bias or {}).items():
        if not key.isdigit() or not -100 <= value <= 100:
            raise RouterError("INVALID_ARGUMENT", f"logit_bias {{{key!r}: {value}}}: keys are "
                              "token ids, biases in [-100, 100]", "logit_bias")  # fmt: skip
        out[int(key)] = float(value)
    return out


def _token_ids(ids: list[int] | None, param: str) -> list[int]:
    if any(not 0 <= t < 1 << 31 for t in ids or []):
        raise RouterError("INVALID_ARGUMENT", "token ids must be in [0, 2^31)", param)
    return list(ids or [])


def _min_tokens(min_tokens: int | None, max_tokens: int) -> int:
    if min_tokens and max_tokens and min_tokens > max_tokens:
        raise RouterError("INVALID_ARGUMENT", f"min_tokens {min_tokens} is more than "
                          f"max_tokens {max_tokens}", "min_tokens")  # fmt: skip
    return min_tokens or 0


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: bool, top_logprobs: int,
                    forced: common_pb2.StructuredOutput | None = None,
                    forced_by: str = "") -> common_pb2.SamplingParams:
    """The wire's SamplingParams of a validated body; `forced` is a constraint the API
    adds itself (a forced tool call), which excludes any other (`forced_by` names it)."""
    sampling = common_pb2.SamplingParams(
        # NOTE: OpenAI's default temperature is 1.0; our proto reads 0 as greedy.
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p or 0.0,
        top_k=body.top_k or 0,
        max_tokens=max_tokens,
        stop=_stop_list(body.stop),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 0.0,
        min_p=body.min_p or 0.0,
        logit_bias=_logit_bias(body.logit_bias),
        min_tokens=_min_tokens(body.min_tokens, max_tokens),
        stop_token_ids=_token_ids(body.stop_token_ids, "stop_token_ids"),
        include_stop_str_in_output=body.include_stop_str_in_output,
    )
    structured = structured_output(body)
    if forced is not None:
        if structured is not None:
            raise RouterError("INVALID_ARGUMENT", "a forced tool call and another output "
                              "constraint cannot go together", forced_by)  # fmt: skip
        structured = forced
    if structured is not None:
        if body.ignore_eos:
            raise RouterError("INVALID_ARGUMENT", "ignore_eos cannot go with structured "
                              "output (the grammar ends the output)", "ignore_eos")  # fmt: skip
        sampling.structured_output.CopyFrom(structured)
    if body.seed is not None:
        sampling.seed = body.seed
    return sampling
