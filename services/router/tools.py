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
only known once its closing tag is out.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass

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
