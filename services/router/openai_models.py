"""OpenAI chat-completions request schema (pydantic, with bounds) and its conversion to
the wire protos. Nothing is silently dropped: every field is honoured, hint-only (`user`,
`parallel_tool_calls`, an image's `detail`: OpenAI treats them as hints too), or refused
with a 400 naming it (`param`): unknown fields by `extra="forbid"`, and values we cannot
serve (n > 16) by their bounds. docs/sdk.md lists them."""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.router.config import RouterConfig
from services.router.errors import RouterError
from services.router.request import ChatRequest
from services.router.tools import ToolSetup, tool_setup
from tandem.v1 import common_pb2


class _Model(BaseModel):
    # NOTE: strict: a JSON value of the wrong type is a 400 (`"stream": "yes"` and
    # `"max_tokens": true` used to be coerced); an integer still passes for a float.
    model_config = ConfigDict(extra="forbid", strict=True)


class ImageURL(_Model):
    url: str = Field(min_length=1)
    detail: str | None = None


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImageURLPart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImageURLPart, Field(discriminator="type")]


class FunctionCall(_Model):
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=1 << 20)  # a JSON object as text


class ToolCall(_Model):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: FunctionCall


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)  # assistant
    tool_call_id: str | None = Field(None, min_length=1, max_length=256)  # tool


class FunctionDef(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=16384)
    parameters: dict | None = None  # a JSON schema; none = no arguments
    strict: bool | None = None  # arguments always validate when the call is forced


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


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


class ChatCompletionRequest(_Model):
    model: str = ""
    messages: list[Message] = Field(min_length=1, max_length=4096)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=1 << 20)
    max_completion_tokens: int | None = Field(None, ge=1, le=1 << 20)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1 << 20)  # extension
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)
    # vLLM-compatible extensions
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0, le=1 << 20)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # vLLM-compatible structured-output extensions (at most one constraint in all)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = Field(None, min_length=1, max_length=16384)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    guided_grammar: str | None = Field(None, min_length=1, max_length=1 << 20)
    ignore_eos: bool = False  # extension (benchmarks)
    timeout_ms: int | None = Field(None, ge=1, le=86_400_000)  # extension: per-request deadline
    priority: int = Field(0, ge=-(1 << 31), lt=1 << 31)  # extension
    # Hints only (accepted, no effect), as documented in docs/sdk.md.
    user: str | None = Field(None, max_length=256)
    parallel_tool_calls: bool | None = None  # a forced call is one call


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


def _image_part(url: str, param: str, max_bytes: int) -> common_pb2.ImagePart:
    """data: URLs are decoded here (bad base64 -> 400, too large -> 413) and sent as bytes;
    http(s) URLs go to the encoder, whose allow-list decides."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise RouterError("INVALID_ARGUMENT", "image data URL must be base64-encoded", param)
        if not header.startswith("data:image/"):  # e.g. data:text/plain: not an image
            raise RouterError("INVALID_ARGUMENT", "image data URL must have an image/* type",
                              param)  # fmt: skip
        if len(payload) * 3 // 4 > max_bytes:
            raise RouterError("TOO_LARGE", f"image larger than {max_bytes} bytes", param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RouterError("INVALID_ARGUMENT", "image data URL is not valid base64", param) from None
        if not data:
            raise RouterError("INVALID_ARGUMENT", "image data URL is empty", param)
        return common_pb2.ImagePart(data=data)
    if url.startswith(("http://", "https://")):
        return common_pb2.ImagePart(url=url)
    raise RouterError("INVALID_ARGUMENT", "image_url must be a data: or http(s) URL", param)


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


def structured_output(body: ChatCompletionRequest) -> common_pb2.StructuredOutput | None:
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


def _tool_setup(body: ChatCompletionRequest) -> ToolSetup:
    choice = body.tool_choice
    if choice is not None and not body.tools:
        raise RouterError("INVALID_ARGUMENT", "tool_choice needs tools", "tool_choice")
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise RouterError("INVALID_ARGUMENT", "tool names must be unique", "tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise RouterError("INVALID_ARGUMENT", f"tool_choice names {choice.function.name!r}, "
                              "which is not in tools", "tool_choice")  # fmt: skip
        choice = choice.function.name
    return tool_setup(tools, choice)


def _top_logprobs(body: ChatCompletionRequest) -> int:
    if body.top_logprobs and not body.logprobs:
        raise RouterError("INVALID_ARGUMENT", "top_logprobs needs logprobs: true", "top_logprobs")
    return body.top_logprobs or 0


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


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id_from_header(value: str | None) -> str:
    """The caller's X-Request-Id (letters, digits, `._:-`, at most 128), or a new one;
    anything else is a 400 rather than an id we would log or echo unchecked."""
    if value is None:
        return uuid.uuid4().hex[:24]
    if not _REQUEST_ID.fullmatch(value):
        raise RouterError("INVALID_ARGUMENT", "X-Request-Id must be 1-128 characters of "
                          "letters, digits and ._:-", "X-Request-Id")  # fmt: skip
    return value


def to_chat_request(body: ChatCompletionRequest, cfg: RouterConfig, request_id: str) -> ChatRequest:
    """Validated body -> front-end-independent request (raises RouterError on bad input);
    `request_id` (request_id_from_header) becomes the response id's suffix."""
    messages = []
    for i, m in enumerate(body.messages):
        role = "system" if m.role == "developer" else m.role
        msg = common_pb2.ChatMessage(role=role, tool_call_id=m.tool_call_id or "")
        if m.role == "tool" and not m.tool_call_id:
            raise RouterError("INVALID_ARGUMENT", "a tool message needs tool_call_id",
                              f"messages[{i}].tool_call_id")  # fmt: skip
        if m.tool_calls and m.role != "assistant":
            raise RouterError("INVALID_ARGUMENT", "only an assistant message has tool_calls",
                              f"messages[{i}].tool_calls")  # fmt: skip
        for j, call in enumerate(m.tool_calls or []):
            param = f"messages[{i}].tool_calls[{j}].function.arguments"
            try:
                ok = isinstance(json.loads(call.function.arguments), dict)
            except ValueError:
                ok = False
            if not ok:
                raise RouterError("INVALID_ARGUMENT", "arguments must be a JSON object", param)
            msg.tool_calls.add(id=call.id, name=call.function.name,
                               arguments=_utf8(call.function.arguments, param))
        if isinstance(m.content, str):
            msg.content.add(text=_utf8(m.content, f"messages[{i}].content"))
        elif m.content is not None:
            for j, part in enumerate(m.content):
                if isinstance(part, TextPart):
                    msg.content.add(text=_utf8(part.text, f"messages[{i}].content[{j}].text"))
                else:
                    param = f"messages[{i}].content[{j}].image_url"
                    msg.content.add(image=_image_part(part.image_url.url, param, cfg.max_image_bytes))
        messages.append(msg)
    max_tokens = body.max_completion_tokens or body.max_tokens or 0
    sampling = common_pb2.SamplingParams(
        # NOTE: OpenAI's default temperature is 1.0; our proto reads 0 as greedy.
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p or 0.0,
        top_k=body.top_k or 0,
        max_tokens=max_tokens,
        stop=_stop_list(body.stop),
        ignore_eos=body.ignore_eos,
        logprobs=body.logprobs,
        top_logprobs=_top_logprobs(body),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 0.0,
        min_p=body.min_p or 0.0,
        logit_bias=_logit_bias(body.logit_bias),
        min_tokens=_min_tokens(body.min_tokens, max_tokens),
        stop_token_ids=_token_ids(body.stop_token_ids, "stop_token_ids"),
        include_stop_str_in_output=body.include_stop_str_in_output,
    )
    tools = _tool_setup(body)
    structured = structured_output(body)
    if tools.grammar is not None:
        if structured is not None:
            raise RouterError("INVALID_ARGUMENT", "a forced tool call and another output "
                              "constraint cannot go together", "tool_choice")  # fmt: skip
        structured = tools.grammar
    if structured is not None:
        if body.ignore_eos:
            raise RouterError("INVALID_ARGUMENT", "ignore_eos cannot go with structured "
                              "output (the grammar ends the output)", "ignore_eos")  # fmt: skip
        sampling.structured_output.CopyFrom(structured)
    if body.seed is not None:
        sampling.seed = body.seed
    timeout_s = body.timeout_ms / 1000 if body.timeout_ms else cfg.request_timeout_s
    return ChatRequest(
        messages=messages,
        sampling=sampling,
        timeout_s=timeout_s,
        request_id=f"chatcmpl-{request_id}",
        priority=body.priority,
        tools=tools,
    )
