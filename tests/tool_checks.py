"""Tool-call checks shared by the e2e modules (one per architecture): tool_choice
"required" and a named function, streaming and not, for many seeds at temperature 1.0;
a history with tool calls and tool results; tool_choice "auto"."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Booking(BaseModel):
    model_config = ConfigDict(extra="forbid")
    people: int = Field(ge=1, le=12)
    time: str = Field(pattern=r"^[0-2][0-9]:[0-5][0-9]$")
    area: Literal["inside", "terrace"]


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Oslo", "Lima", "Pune"]
    days: int = Field(ge=1, le=7)


def _tool(name: str, model: type[BaseModel]) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                             "parameters": model.model_json_schema()}}


TOOLS = [_tool("book_table", Booking), _tool("get_weather", Weather)]
MODELS = {"book_table": Booking, "get_weather": Weather}
ASK = [{"role": "user", "content": "Book a table for two at 19:30 on the terrace."}]


def _streamed_calls(stream) -> tuple[list[dict], str]:
    calls: dict[int, dict] = {}
    finish = ""
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        finish = c.finish_reason or finish
        for d in c.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += d.id or ""
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
    return [calls[k] for k in sorted(calls)], finish


def check_forced_calls(client, seeds: int = 20, stream_seeds: int = 5) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        for stream, n in ((False, seeds), (True, stream_seeds)):
            for seed in range(n):
                kw = dict(model="", messages=ASK, tools=TOOLS, tool_choice=choice,
                          temperature=1.0, seed=seed, max_tokens=200)
                if stream:
                    calls, finish = _streamed_calls(client.chat.completions.create(
                        stream=True, **kw))
                else:
                    r = client.chat.completions.create(**kw)
                    finish = r.choices[0].finish_reason
                    calls = [{"id": c.id, "name": c.function.name,
                              "arguments": c.function.arguments}
                             for c in r.choices[0].message.tool_calls or []]
                assert finish == "tool_calls" and len(calls) == 1, (choice, seed, calls)
                call = calls[0]
                assert call["id"].startswith("call_")
                if choice is named:
                    assert call["name"] == "get_weather"
                MODELS[call["name"]].model_validate(json.loads(call["arguments"]))


def check_history_and_auto(client) -> None:
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "book_table",
                         "arguments": '{"people": 2, "time": "19:30", "area": "terrace"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"ok": true, "table": 7}'},
    ]
    r = client.chat.completions.create(model="", messages=history, tools=TOOLS, max_tokens=8,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 100  # the tools and the call history were rendered
    r = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="auto",
                                       max_tokens=16, temperature=0)
    for c in r.choices[0].message.tool_calls or []:
        json.loads(c.function.arguments)


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class Answer(BaseModel):
    """Nested objects, an enum, an array, required fields; every free part bounded (random
    weights pick digits and letters as often as anything else)."""

    kind: str = Field(pattern=r"^[a-z]{1,6}$")
    mood: Literal["calm", "busy", "odd"]
    points: list[Point] = Field(max_length=3)
    sure: bool


def check_parse(client, seeds: int = 20) -> None:
    """`chat.completions.parse(response_format=Answer)` at temperature 1.0: a parsed object
    for every seed."""
    msgs = [{"role": "user", "content": "Answer as JSON."}]
    for seed in range(seeds):
        r = client.chat.completions.parse(model="", messages=msgs, response_format=Answer,
                                          temperature=1.0, seed=seed, max_tokens=300)
        assert isinstance(r.choices[0].message.parsed, Answer), r.choices[0].message.content
