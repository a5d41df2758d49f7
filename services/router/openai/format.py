"""OpenAI chat-completion response shapes: full responses, SSE chunks, usage, logprobs,
and Tandem's `tandem` extension object."""

from __future__ import annotations

import json
import time

from tandem.services.router.choices import total_usage
from tandem.services.router.request import Piece
from tandem.services.router.tools import ToolSetup, parse_output


def logprobs(piece: Piece) -> dict | None:
    if not piece.logprobs:
        return None
    # NOTE: the language tier detokenizes incrementally; a piece usually holds one token, and
    # its text is that token's text. When it holds several, the text goes to the first.
    content = []
    for k, lp in enumerate(piece.logprobs):
        tok = piece.text if k == 0 else ""
        top = [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
               for t in lp.top]
        content.append(
            {"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()), "top_logprobs": top}
        )
    return {"content": content}


def extension(piece: Piece, request_id: str) -> dict:
    return {
        "timings": piece.timings or {},
        "cached_image_tokens": piece.usage.cached_image_tokens if piece.usage else 0,
        "request_id": request_id,
        **(piece.route.fields() if piece.route else {}),
    }


def answer(pieces: list[Piece], tools: ToolSetup) -> tuple[dict, str]:
    """(the assistant message, finish_reason) of a whole output: content, and tool calls
    when the request had tools and the model made any (finish_reason "tool_calls")."""
    last = pieces[-1]
    out = parse_output("".join(p.text for p in pieces), tools)
    message: dict = {"role": "assistant", "content": out.content}
    if out.tool_calls:
        message["tool_calls"] = out.tool_calls
        return message, "tool_calls"
    return message, last.finish_reason


def completion(choices: list[list[Piece]], request_id: str, model: str,
               tools: ToolSetup) -> dict:
    """A whole response: one entry per choice (each the pieces of one sample)."""
    out = []
    for i, pieces in enumerate(choices):
        lps = [c for p in pieces for c in (logprobs(p) or {"content": []})["content"]]
        message, finish = answer(pieces, tools)
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

    def piece(self, index: int, piece: Piece) -> bytes:
        return chunk(self.request_id, self.model, self.created, {"content": piece.text},
                     index=index, logprobs=logprobs(piece))

    def finish(self, index: int, piece: Piece) -> bytes:
        return chunk(self.request_id, self.model, self.created, {}, index=index,
                     finish_reason=piece.finish_reason,
                     tandem=extension(piece, self.request_id))

    def usage(self, last: list[Piece]) -> bytes:
        return sse({"id": self.request_id, "object": self.object_chunk,
                    "created": self.created, "model": self.model, "choices": [],
                    "usage": total_usage(last), "tandem": extension(last[0], self.request_id)})

    def complete(self, choices: list[list[Piece]]) -> dict:
        return completion(choices, self.request_id, self.model, self.tools)

    def tool_stream(self, pieces: list[Piece], include_usage: bool):
        """The SSE events of a whole output with tools: role, content, each call as one
        tool-call delta (id, name, all its arguments), the finish chunk, usage, [DONE]."""
        message, finish = answer(pieces, self.tools)
        yield self.start(0)
        if message["content"]:
            yield chunk(self.request_id, self.model, self.created, {"content": message["content"]})
        for k, call in enumerate(message.get("tool_calls", [])):
            yield chunk(self.request_id, self.model, self.created,
                        {"tool_calls": [{"index": k, **call}]})
        yield chunk(self.request_id, self.model, self.created, {}, finish_reason=finish,
                    tandem=extension(pieces[-1], self.request_id))
        if include_usage:
            yield self.usage(pieces[-1:])
        yield b"data: [DONE]\n\n"
