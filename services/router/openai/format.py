"""OpenAI chat-completion response shapes: full responses, SSE chunks, usage, logprobs,
finish reasons, tool calls, and Tandem's `tandem` extension object. The router's Outputs
carry the wire's types; these shapes are made here (and in completions.py) only."""

from __future__ import annotations

import json
import time

from tandem.finish_reasons import TO_OPENAI
from tandem.services.router.choices import total_usage
from tandem.services.router.request import Output
from tandem.services.router.tools import ToolSetup, parse_output
from tandem.v1 import common_pb2


def finish_reason(output: Output) -> str:
    """OpenAI's finish_reason of a last Output."""
    return TO_OPENAI[output.finish_reason]


def tool_call(call: common_pb2.ToolCall) -> dict:
    """One of OpenAI's `tool_calls`."""
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def logprobs(output: Output) -> dict | None:
    if not output.logprobs:
        return None
    # NOTE: the language tier detokenizes incrementally; an Output usually holds one token,
    # and its text is that token's text. When it holds several, the text goes to the first.
    content = []
    for k, lp in enumerate(output.logprobs):
        tok = output.text if k == 0 else ""
        top = [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
               for t in lp.top]
        content.append(
            {"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()), "top_logprobs": top}
        )
    return {"content": content}


def extension(output: Output, request_id: str) -> dict:
    return {
        "timings": output.timings or {},
        "cached_image_tokens": output.usage.cached_image_tokens if output.usage else 0,
        "request_id": request_id,
        **(output.route.fields() if output.route else {}),
    }


def answer(outputs: list[Output], tools: ToolSetup) -> tuple[dict, str]:
    """(the assistant message, finish_reason) of a whole output: content, and tool calls
    when the request had tools and the model made any (finish_reason "tool_calls")."""
    out = parse_output("".join(o.text for o in outputs), tools)
    message: dict = {"role": "assistant", "content": out.content}
    if out.tool_calls:
        message["tool_calls"] = [tool_call(c) for c in out.tool_calls]
        return message, TO_OPENAI[common_pb2.FINISH_REASON_TOOL_CALLS]
    return message, finish_reason(outputs[-1])


def completion(choices: list[list[Output]], request_id: str, model: str,
               tools: ToolSetup) -> dict:
    """A whole response: one entry per choice (each the Outputs of one sample)."""
    out = []
    for i, outputs in enumerate(choices):
        lps = [c for o in outputs for c in (logprobs(o) or {"content": []})["content"]]
        message, finish = answer(outputs, tools)
        out.append({"index": i, "message": message,
                    "logprobs": {"content": lps} if lps else None, "finish_reason": finish})
    last = choices[0][-1]
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": total_usage([c[-1] for c in choices]),
        "tandem": extension(last, request_id),
    }


def chunk(request_id: str, model: str, created: int, delta: dict, index: int = 0,
          **extra) -> bytes:
    choice = {"index": index, "delta": delta, "logprobs": extra.pop("logprobs", None),
              "finish_reason": extra.pop("finish_reason", None)}
    body = {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [choice], **extra}
    return f"data: {json.dumps(body)}\n\n".encode()


def sse(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


class ChatShape:
    """The chat-completions API's response shapes for one request (streamed or whole)."""

    object_chunk = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, tools: ToolSetup) -> None:
        self.request_id, self.model, self.tools = request_id, model, tools
        self.created = int(time.time())

    def start(self, index: int) -> bytes:
        return chunk(self.request_id, self.model, self.created,
                     {"role": "assistant", "content": ""}, index=index)

    def output(self, index: int, output: Output) -> bytes:
        return chunk(self.request_id, self.model, self.created, {"content": output.text},
                     index=index, logprobs=logprobs(output))

    def finish(self, index: int, output: Output) -> bytes:
        return chunk(self.request_id, self.model, self.created, {}, index=index,
                     finish_reason=finish_reason(output),
                     tandem=extension(output, self.request_id))

    def usage(self, last: list[Output]) -> bytes:
        return sse({"id": self.request_id, "object": self.object_chunk,
                    "created": self.created, "model": self.model, "choices": [],
                    "usage": total_usage(last), "tandem": extension(last[0], self.request_id)})

    def complete(self, choices: list[list[Output]]) -> dict:
        return completion(choices, self.request_id, self.model, self.tools)

    def tool_stream(self, outputs: list[Output], include_usage: bool):
        """The SSE events of a whole output with tools: role, content, each call as one
        tool-call delta (id, name, all its arguments), the finish chunk, usage, [DONE]."""
        message, finish = answer(outputs, self.tools)
        yield self.start(0)
        if message["content"]:
            yield chunk(self.request_id, self.model, self.created, {"content": message["content"]})
        for k, call in enumerate(message.get("tool_calls", [])):
            yield chunk(self.request_id, self.model, self.created,
                        {"tool_calls": [{"index": k, **call}]})
        yield chunk(self.request_id, self.model, self.created, {}, finish_reason=finish,
                    tandem=extension(outputs[-1], self.request_id))
        if include_usage:
            yield self.usage(outputs[-1:])
        yield b"data: [DONE]\n\n"
