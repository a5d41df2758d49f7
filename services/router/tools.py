"""Tool calls: what a request's `tools` / `tool_choice` ask of the tiers, and the model's
output turned back into tool calls (the wire's `ToolCall`; OpenAI's `tool_calls` shape is
made at the HTTP edge, openai/format.py).

    tool_choice  "none"      tools not rendered; plain text out
                 "auto"      tools rendered by the chat template; the output's
                             <tool_call>{"name", "arguments"}</tool_call> blocks (Qwen's
                             format) become tool calls, the text before them the content
                 "required"  tools rendered, and the output forced by the grammar engine
                 named       to one {"name", "arguments"} JSON object whose arguments
                             validate against that function's parameters schema (any of the
                             tools for "required", the named one otherwise); one cut before
                             its end is no call and no content (finish_reason "length")

A request with tools is answered whole at the end (also when streaming): a tool call is
only known once its closing tag is out (core.Run.whole; n > 1 with tools is refused by
bounds.py).

The tools themselves come in one format on both doors, OpenAI's function tools (the HTTP
body's `tools`, the gRPC wire's `tools_json`): `Tool` validates it and `tool_setup_of`
applies the rules of `tools` and `tool_choice` for both.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from tandem.services.router.errors import RouterError
from tandem.v1 import common_pb2

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolMode(enum.Enum):
    NONE = "none"  # no tools, or tool_choice "none"
    AUTO = "auto"  # the model decides; its <tool_call> blocks are parsed
    FORCED = "forced"  # "required" or a named function: the grammar forces one call


@dataclass(frozen=True)
class ToolSetup:
    mode: ToolMode = ToolMode.NONE
    tools_json: str = ""  # what the chat template renders ("" = nothing)
    grammar: common_pb2.StructuredOutput | None = None  # FORCED: the call's schema


def tool_setup(tools: list[dict], choice: str | dict | None) -> ToolSetup:
    """`tools` are validated OpenAI function tools (dicts); `choice` is "none", "auto",
    "required" or the name of one of them (None = "auto" with tools)."""
    if not tools or choice == "none":
        return ToolSetup()
    text = json.dumps(tools)
    if choice in (None, "auto"):
        return ToolSetup(ToolMode.AUTO, text)
    fns = [t["function"] for t in tools]
    if choice != "required":
        fns = [f for f in fns if f["name"] == choice]
    calls = [{"type": "object", "properties": {
        "name": {"const": f["name"]},
        "arguments": f.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return ToolSetup(ToolMode.FORCED, text,
                     common_pb2.StructuredOutput(json_schema=json.dumps(schema)))


class _Strict(BaseModel):
    # as the OpenAI bodies' models (openai/sampling._Model): unknown fields and values of
    # the wrong type are refused, not dropped or coerced
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=16384)
    parameters: dict | None = None  # a JSON schema; none = no arguments
    strict: bool | None = None  # arguments always validate when the call is forced


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


_TOOLS = TypeAdapter(list[Tool])


def tools_from_json(text: str) -> list[Tool] | None:
    """The gRPC wire's `tools_json` (OpenAI's `tools`, as JSON; "" = none), validated as
    the HTTP body's `tools` are."""
    if not text:
        return None
    try:
        return _TOOLS.validate_json(text)
    except ValidationError as e:
        raise RouterError("INVALID_ARGUMENT", f"tools: {e.errors()[0]['msg']}",
                          "tools") from None


def tool_setup_of(tools_in: list[Tool] | None,
                  choice: str | NamedToolChoice | None) -> ToolSetup:
    """Validated tools and tool_choice (HTTP or gRPC) -> ToolSetup (RouterError if bad)."""
    if choice is not None and not tools_in:
        raise RouterError("INVALID_ARGUMENT", "tool_choice needs tools", "tool_choice")
    if choice not in (None, "none", "auto", "required") and isinstance(choice, str):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice))
    tools = [t.model_dump(exclude_none=True) for t in tools_in or []]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise RouterError("INVALID_ARGUMENT", "tool names must be unique", "tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise RouterError("INVALID_ARGUMENT", f"tool_choice names {choice.function.name!r}, "
                              "which is not in tools", "tool_choice")
        choice = choice.function.name
    return tool_setup(tools, choice)


def forced(grammar: common_pb2.StructuredOutput | None,
           asked: common_pb2.StructuredOutput | None) -> common_pb2.StructuredOutput | None:
    """The output constraint of a request: a forced call's `grammar` (ToolSetup.grammar),
    which excludes any other constraint the request `asked` for (a 400 naming
    tool_choice), or else the one it asked for."""
    if grammar is None:
        return asked
    if asked is not None:
        raise RouterError("INVALID_ARGUMENT", "a forced tool call and another output "
                          "constraint cannot go together", "tool_choice")
    return grammar


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[common_pb2.ToolCall]  # arguments: a JSON object as text


def _call(obj) -> common_pb2.ToolCall | None:
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)
            and isinstance(obj.get("arguments", {}), dict)):
        return None
    try:  # NOTE: a name the wire cannot carry (a lone surrogate, \ud800) is no call
        obj["name"].encode()
    except UnicodeEncodeError:
        return None
    return common_pb2.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=obj["name"],
                               arguments=json.dumps(obj.get("arguments", {})))


def parse_output(text: str, setup: ToolSetup) -> ParsedOutput:
    """The model's whole output as content and tool calls."""
    if setup.mode is ToolMode.NONE:
        return ParsedOutput(text, [])
    if setup.mode is ToolMode.FORCED:
        # NOTE: the grammar lets the model write nothing but the call, so an output that
        # does not parse was cut (max_tokens, a stop string): it is neither a call nor an
        # answer. No content and no call: a client that shows content or runs the call
        # gets nothing half-written (docs/sdk.md); the finish reason says why it was cut
        # ("length" for max_tokens, "stop" for a stop string the client asked for).
        try:
            call = _call(json.loads(text))
        except ValueError:
            call = None
        return ParsedOutput(None, [call] if call else [])
    calls = []
    for m in _CALL.finditer(text):
        try:
            call = _call(json.loads(m.group(1)))
        except ValueError:
            call = None
        if call:
            calls.append(call)
    if not calls:
        return ParsedOutput(text, [])
    before = text[: text.find("<tool_call>")].strip()
    return ParsedOutput(before or None, calls)
