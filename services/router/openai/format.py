"""OpenAI chat-completion response shapes: full responses, SSE chunks, usage, logprobs,
finish reasons, tool calls, and Tandem's `tandem` extension object. The router's Outputs
carry the wire's types; these shapes are made here (and in completions.py) only.

vLLM's extras that shape a response (both APIs unless said): `echo` in chat (the reply
after the last message's text), `stream_options.continuous_usage_stats` (usage on every
streamed chunk: `ChunkUsage`), `return_tokens_as_token_ids` (logprobs' tokens spelled
"token_id:N": `token_text`)."""

from __future__ import annotations

import json
import time

from tandem.finish_reasons import TO_OPENAI
from tandem.services.router.reasoning import Reasoning, Split, StreamSplitter
from tandem.services.router.request import TIMING_FIELDS, Output
from tandem.services.router.tools import ToolSetup, parse_output
from tandem.v1 import common_pb2


def finish_reason(output: Output) -> str:
    """OpenAI's finish_reason of a last Output."""
    return TO_OPENAI[output.finish_reason]


def total_usage(last: list[Output]) -> dict:
    """OpenAI usage over all choices: the prompt once, the completions summed."""
    usages = [p.usage for p in last if p.usage]
    if not usages:
        return {}
    prompt = usages[0].prompt_tokens
    completion = sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": usages[0].cached_tokens}}


def tool_call(call: common_pb2.ToolCall) -> dict:
    """One of OpenAI's `tool_calls`."""
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def token_text(text: str, token_id: int, as_ids: bool) -> str:
    """A logprob's token as the response spells it: its text, or "token_id:N" when the
    request asked for ids (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_ids else text


class ChunkUsage:
    """vLLM's stream_options.continuous_usage_stats: the usage of each streamed chunk, the
    prompt's tokens (every message of the language tier carries them) and the tokens of
    the chunk's choice so far ({} when the request did not ask for it)."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.prompt = 0
        self.tokens: dict[int, int] = {}

    def __call__(self, index: int, output: Output | None = None, count: bool = False) -> dict:
        if not self.on:
            return {}
        if output is not None:
            if output.usage is not None:  # the last one: the request's own figures
                self.prompt = output.usage.prompt_tokens
                self.tokens[index] = output.usage.completion_tokens
            else:
                self.prompt = output.response.usage.prompt_tokens or self.prompt
                if count:
                    self.tokens[index] = self.tokens.get(index, 0) + len(output.token_ids)
        done = self.tokens.get(index, 0)
        return {"usage": {"prompt_tokens": self.prompt, "completion_tokens": done,
                          "total_tokens": self.prompt + done}}


def logprobs(output: Output, as_ids: bool = False) -> dict | None:
    if not output.logprobs:
        return None
    # NOTE: the language tier detokenizes incrementally; an Output usually holds one token,
    # and its text is that token's text. When it holds several, the text goes to the first.
    content = []
    for k, lp in enumerate(output.logprobs):
        tok = token_text(output.text if k == 0 else "", lp.token_id, as_ids)
        top = [{"token": (t_tok := token_text(t.text, t.token_id, as_ids)),
                "logprob": t.logprob, "bytes": list(t_tok.encode())} for t in lp.top]
        content.append(
            {"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()), "top_logprobs": top}
        )
    return {"content": content}


def timings(t: common_pb2.StageTimings | None) -> dict:
    """The extension's `timings`: each figure (TIMING_FIELDS) and `encoder_ranges`, who
    wrote which rows of the prompt ({encoder, first_token, tokens, first_media, media,
    fell_back, vit_ms, cached_image_tokens, preprocess_ms} each, in prompt order)."""
    if t is None:
        return {}
    out: dict = {f: getattr(t, f) for f in TIMING_FIELDS}
    out["encoder_ranges"] = [
        {"encoder": r.encoder, "first_token": r.first_token, "tokens": r.tokens,
         "first_media": r.first_media, "media": r.media, "fell_back": r.fell_back,
         "vit_ms": r.vit_ms, "cached_image_tokens": r.cached_image_tokens,
         "preprocess_ms": r.preprocess_ms}
        for r in t.encoder_ranges]
    return out


def extension(output: Output, request_id: str) -> dict:
    return {
        "timings": timings(output.timings),
        "cached_image_tokens": output.usage.cached_image_tokens if output.usage else 0,
        "request_id": request_id,
        **(output.route.fields() if output.route else {}),
    }


def answer(outputs: list[Output], tools: ToolSetup, echo: str = "",
           reasoning: Reasoning | None = None) -> tuple[dict, str]:
    """(the assistant message, finish_reason) of a whole output: content (after `echo`),
    and tool calls when the request had tools and the model made any (finish_reason
    "tool_calls"). Under a reasoning parser (`reasoning`), the thinking goes to
    `reasoning_content` and only the rest is content, parsed for tool calls (as vLLM:
    null where empty)."""
    text = "".join(o.text for o in outputs)
    parts = reasoning.split(text) if reasoning is not None else Split(content=text)
    out = parse_output(parts.content, tools)
    content = echo + (out.content or "") if echo else out.content
    message: dict = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["content"] = content or None
        message["reasoning_content"] = parts.reasoning or None
    if out.tool_calls:
        message["tool_calls"] = [tool_call(c) for c in out.tool_calls]
        return message, TO_OPENAI[common_pb2.FINISH_REASON_TOOL_CALLS]
    return message, finish_reason(outputs[-1])


def completion(choices: list[list[Output]], request_id: str, model: str,
               tools: ToolSetup, echo: str = "", as_ids: bool = False,
               reasoning: Reasoning | None = None) -> dict:
    """A whole response: one entry per choice (each the Outputs of one sample), each
    message's content after `echo` (its thinking apart, under `reasoning`)."""
    out = []
    for i, outputs in enumerate(choices):
        lps = [c for o in outputs for c in (logprobs(o, as_ids) or {"content": []})["content"]]
        message, finish = answer(outputs, tools, echo, reasoning)
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


def delta_of(part: Split) -> dict:
    """A streamed piece of a split output as a chunk's delta (empty parts left out)."""
    delta = {}
    if part.reasoning:
        delta["reasoning_content"] = part.reasoning
    if part.content:
        delta["content"] = part.content
    return delta


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
    """The chat-completions API's response shapes for one request (streamed or whole).
    `echo`: the text before the reply (vLLM's echo); `continuous_usage`: usage on every
    streamed chunk; `as_ids`: logprobs' tokens as "token_id:N"; `reasoning`: the split of
    the thinking (reasoning_content), None when the router has no reasoning parser."""

    object_chunk = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, tools: ToolSetup, echo: str = "",
                 continuous_usage: bool = False, as_ids: bool = False,
                 reasoning: Reasoning | None = None) -> None:
        self.request_id, self.model, self.tools = request_id, model, tools
        self.echo, self.as_ids = echo, as_ids
        self.chunk_usage = ChunkUsage(continuous_usage)
        self.created = int(time.time())
        self.reasoning = reasoning
        self._splitters: dict[int, StreamSplitter] = {}  # per choice, under `reasoning`

    def start(self, index: int, first: Output | None = None) -> bytes:
        """The role chunk (and the echoed text) of a choice, before its `first` Output."""
        usage = self.chunk_usage(index, first)
        out = chunk(self.request_id, self.model, self.created,
                    {"role": "assistant", "content": ""}, index=index, **usage)
        if self.echo:
            out += chunk(self.request_id, self.model, self.created, {"content": self.echo},
                         index=index, **usage)
        return out

    def output(self, index: int, output: Output) -> bytes:
        """The chunk of one Output; b"" when a reasoning split holds all its text back (a
        marker's first characters) and it carries no logprobs."""
        lps = logprobs(output, self.as_ids)
        usage = self.chunk_usage(index, output, count=True)
        if self.reasoning is None:
            delta = {"content": output.text}
        else:
            splitter = self._splitters.setdefault(index, self.reasoning.splitter())
            delta = delta_of(splitter.feed(output.text))
            if not delta and lps is None:
                return b""
        return chunk(self.request_id, self.model, self.created, delta, index=index,
                     logprobs=lps, **usage)

    def finish(self, index: int, output: Output) -> bytes:
        """The finish chunk of a choice, after the text a reasoning split still held."""
        held = b""
        if self.reasoning is not None:
            rest = self._splitters.pop(index, self.reasoning.splitter()).flush()
            if delta := delta_of(rest):
                held = chunk(self.request_id, self.model, self.created, delta, index=index,
                             **self.chunk_usage(index))
        return held + chunk(self.request_id, self.model, self.created, {}, index=index,
                            finish_reason=finish_reason(output),
                            tandem=extension(output, self.request_id),
                            **self.chunk_usage(index, output))

    def usage(self, last: list[Output]) -> bytes:
        return sse({"id": self.request_id, "object": self.object_chunk,
                    "created": self.created, "model": self.model, "choices": [],
                    "usage": total_usage(last), "tandem": extension(last[0], self.request_id)})

    def complete(self, choices: list[list[Output]]) -> dict:
        return completion(choices, self.request_id, self.model, self.tools, self.echo,
                          self.as_ids, self.reasoning)

    def tool_stream(self, outputs: list[Output], include_usage: bool):
        """The SSE events of a whole output with tools: role, content, each call as one
        tool-call delta (id, name, all its arguments), the finish chunk, usage, [DONE]
        (with continuous usage, every chunk carries the whole output's)."""
        message, finish = answer(outputs, self.tools, self.echo, self.reasoning)
        usage = self.chunk_usage(0, outputs[-1])
        yield chunk(self.request_id, self.model, self.created,
                    {"role": "assistant", "content": ""}, **usage)
        if message.get("reasoning_content"):
            yield chunk(self.request_id, self.model, self.created,
                        {"reasoning_content": message["reasoning_content"]}, **usage)
        if message["content"]:
            yield chunk(self.request_id, self.model, self.created,
                        {"content": message["content"]}, **usage)
        for k, call in enumerate(message.get("tool_calls", [])):
            yield chunk(self.request_id, self.model, self.created,
                        {"tool_calls": [{"index": k, **call}]}, **usage)
        yield chunk(self.request_id, self.model, self.created, {}, finish_reason=finish,
                    tandem=extension(outputs[-1], self.request_id), **usage)
        if include_usage:
            yield self.usage(outputs[-1:])
        yield b"data: [DONE]\n\n"
