"""The completions API (`/v1/completions`): a raw text prompt, no chat template, sent
straight to a language instance (no encoder); and its legacy response shapes (`text`,
`logprobs` as tokens / token_logprobs / top_logprobs / text_offset).

Honoured: everything `SamplingFields` holds, `prompt` (a string, or a list of one),
`logprobs` (0-20 alternatives per token), `echo` (the prompt's text before the output;
not with logprobs: that needs the prompt's own logprobs, which are not computed), `n`.
Refused by name: `suffix` (no fill-in-the-middle), `best_of` > 1, a list of prompts."""

from __future__ import annotations

import time

from pydantic import Field

from tandem.services.router.errors import RouterError
from tandem.services.router.openai.format import (
    ChunkUsage,
    extension,
    finish_reason,
    sse,
    token_text,
    total_usage,
)
from tandem.services.router.openai.sampling import SamplingFields, _utf8, sampling_params
from tandem.services.router.request import Output, Query

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    logprobs: int | None = None  # how many alternatives: the wire's top_logprobs
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=16)


def to_completion_request(body: CompletionRequest, request_id: str) -> Query:
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise RouterError("INVALID_ARGUMENT", "one prompt per request", "prompt")
        prompt = prompt[0]
    if not prompt:
        raise RouterError("INVALID_ARGUMENT", "the prompt is empty", "prompt")
    if body.suffix is not None:
        raise RouterError("INVALID_ARGUMENT", "suffix (fill-in-the-middle) is not served",
                          "suffix")
    if body.best_of is not None and body.best_of != 1:
        raise RouterError("INVALID_ARGUMENT", "best_of > 1 is not served; use n", "best_of")
    if body.echo and body.logprobs is not None:
        raise RouterError("INVALID_ARGUMENT", "echo with logprobs needs the prompt's "
                          "logprobs, which are not computed", "echo")
    wants_lp = body.logprobs is not None
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    sampling = sampling_params(body, max_tokens, wants_lp,
                               body.logprobs or 0, spelled={"top_logprobs": "logprobs"})
    return Query(
        messages=[], sampling=sampling, request_id=f"cmpl-{request_id}",
        timeout_ms=body.timeout_ms, n=body.n, stream=body.stream, priority=body.priority,
        prompt=_utf8(prompt, "prompt"), cache_salt=body.cache_salt,
    )


def legacy_logprobs(outputs: list[Output], offset: int, as_ids: bool = False) -> dict | None:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset
    (an Output's text goes to its first token, as in the chat shape; with `as_ids`, each
    token is spelled "token_id:N" and the offsets still count the text)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for o in outputs:
        for k, lp in enumerate(o.logprobs):
            tok = o.text if k == 0 else ""
            out["tokens"].append(token_text(tok, lp.token_id, as_ids))
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({token_text(t.text, t.token_id, as_ids): t.logprob
                                        for t in lp.top})
            out["text_offset"].append(offset)
            offset += len(tok)
    return out if out["tokens"] else None


class CompletionShape:
    """The completions API's response shapes for one request (streamed or whole); as
    format.ChatShape for `continuous_usage` and `as_ids`."""

    def __init__(self, request_id: str, model: str, echo: str,
                 continuous_usage: bool = False, as_ids: bool = False) -> None:
        self.request_id, self.model, self.echo, self.as_ids = request_id, model, echo, as_ids
        self.chunk_usage = ChunkUsage(continuous_usage)
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}

    def _chunk(self, index: int, text: str, logprobs=None, finish=None, **extra) -> bytes:
        return sse({"id": self.request_id, "object": "text_completion",
                    "created": self.created, "model": self.model,
                    "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": finish}], **extra})

    def start(self, index: int, first: Output | None = None) -> bytes:
        self.offsets[index] = len(self.echo)
        return self._chunk(index, self.echo, **self.chunk_usage(index, first))

    def output(self, index: int, output: Output) -> bytes:
        lps = legacy_logprobs([output], self.offsets[index], self.as_ids)
        self.offsets[index] += len(output.text)
        return self._chunk(index, output.text, lps,
                           **self.chunk_usage(index, output, count=True))

    def finish(self, index: int, output: Output) -> bytes:
        return self._chunk(index, "", finish=finish_reason(output),
                           tandem=extension(output, self.request_id),
                           **self.chunk_usage(index, output))

    def usage(self, last: list[Output]) -> bytes:
        return sse({"id": self.request_id, "object": "text_completion",
                    "created": self.created, "model": self.model, "choices": [],
                    "usage": total_usage(last), "tandem": extension(last[0], self.request_id)})

    def complete(self, choices: list[list[Output]]) -> dict:
        out = [{"index": i, "text": self.echo + "".join(o.text for o in outputs),
                "logprobs": legacy_logprobs(outputs, len(self.echo), self.as_ids),
                "finish_reason": finish_reason(outputs[-1])}
               for i, outputs in enumerate(choices)]
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": out,
                "usage": total_usage([c[-1] for c in choices]),
                "tandem": extension(choices[0][-1], self.request_id)}
