"""A chat's thinking split from its answer (vLLM's `--reasoning-parser`; the router's
`reasoning_parser`). Front-end independent: text in, (reasoning, content) out; OpenAI's
`reasoning_content` fields are made at the HTTP edge (openai/format.py).

qwen3, as vLLM's Qwen3ReasoningParser (vllm/reasoning/qwen3_reasoning_parser.py) reads an
output, on its text:

    thinking on (the default)   an opening `<think>` (older templates: the model writes it;
                                newer ones put it in the prompt) is dropped; the text up to
                                the first `</think>` is reasoning, the rest content; an
                                output with no `</think>` was cut while thinking: all of it
                                is reasoning
    thinking off                (chat_template_kwargs.enable_thinking false: the template
                                closed an empty think block in the prompt) all content

One rule for both ways of answering: `StreamSplitter` yields, chunk by chunk, pieces whose
concatenation is exactly `split(whole text)`, however the text is cut into chunks — a
marker cut across chunks included: a chunk's tail that could still begin a marker is held
back until the next chunk (or the end) says what it is. Where vLLM itself differs between
its two paths, the streamed one is followed: text before a `<think>` stays reasoning
(vLLM's whole-answer path drops it), and with thinking off a `</think>` is content (its
streaming path never looks).

Not split: an output bound by a grammar (response_format, structured_outputs, a forced
tool call). The grammar binds the first token here, so such a model never thinks first;
splitting would file the JSON as reasoning (vLLM instead starts the grammar after the
thinking, which the language tier does not do). Qwen3.5's implicit end of thinking at a
`<tool_call><function=...>` is not read either: tool calls here are hermes's JSON blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

START, END = "<think>", "</think>"


class ReasoningParser(enum.Enum):
    NONE = "none"  # the whole output is content
    QWEN3 = "qwen3"  # <think>...</think>, as vLLM's qwen3 parser


@dataclass(frozen=True)
class Split:
    reasoning: str = ""
    content: str = ""

    def __add__(self, other: Split) -> Split:
        return Split(self.reasoning + other.reasoning, self.content + other.content)


def thinking_on(template_kwargs: dict | None) -> bool:
    """Qwen3's switch, as vLLM reads it: on unless chat_template_kwargs.enable_thinking is
    false (any false value)."""
    return bool((template_kwargs or {}).get("enable_thinking", True))


def split(text: str, thinking: bool = True) -> Split:
    """A whole output's (reasoning, content) under qwen3 (see the module)."""
    if not thinking:
        return Split(content=text)
    thought, sep, answer = text.partition(END)
    return Split(reasoning=thought.replace(START, "", 1), content=answer if sep else "")


def _partial_tail(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `marker`
    (0: none): what may still become the marker once the next chunk arrives."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _Phase(enum.Enum):
    BEFORE_START = "before_start"  # a first <think> would still be dropped
    THINKING = "thinking"  # the <think> is past: only </think> is looked for
    ANSWERING = "answering"  # </think> is past: everything is content


class StreamSplitter:
    """One choice's streamed split: `feed(chunk)` per chunk, `flush()` once at its end;
    the pieces add up to `split(all the chunks, thinking)` (see the module)."""

    def __init__(self, thinking: bool = True) -> None:
        self._phase = _Phase.BEFORE_START if thinking else _Phase.ANSWERING
        self._held = ""  # text not yet given out: it may begin a marker

    def feed(self, text: str) -> Split:
        out = Split()
        pending, self._held = self._held + text, ""
        while pending:
            if self._phase is _Phase.ANSWERING:
                return out + Split(content=pending)
            end = pending.find(END)
            start = pending.find(START) if self._phase is _Phase.BEFORE_START else -1
            if start != -1 and (end == -1 or start < end):
                out += Split(reasoning=pending[:start])  # the first <think>: dropped
                pending, self._phase = pending[start + len(START):], _Phase.THINKING
                continue
            if end != -1:
                out += Split(reasoning=pending[:end])
                pending, self._phase = pending[end + len(END):], _Phase.ANSWERING
                continue
            # no whole marker in it: hold back a tail that may begin one
            markers = (END, START) if self._phase is _Phase.BEFORE_START else (END,)
            keep = max(_partial_tail(pending, m) for m in markers)
            self._held = pending[len(pending) - keep:]
            return out + Split(reasoning=pending[:len(pending) - keep])
        return out

    def flush(self) -> Split:
        """The end of the output: what was held back was no marker."""
        held, self._held = self._held, ""
        if self._phase is _Phase.ANSWERING:
            return Split(content=held)
        return Split(reasoning=held)


@dataclass(frozen=True)
class Reasoning:
    """How one chat's output is split, once the parser is on (None where it is off: the
    answer has no reasoning field). `thinking` false: all of it is content (thinking off,
    or an output bound by a grammar), and the reasoning field is null."""

    thinking: bool

    def splitter(self) -> StreamSplitter:
        return StreamSplitter(self.thinking)

    def split(self, text: str) -> Split:
        return split(text, self.thinking)


def reasoning_of(parser: ReasoningParser, template_kwargs: dict | None,
                 bound_by_grammar: bool) -> Reasoning | None:
    """A chat's Reasoning under the router's `parser` (see the module)."""
    if parser is ReasoningParser.NONE:
        return None
    return Reasoning(thinking=thinking_on(template_kwargs) and not bound_by_grammar)
