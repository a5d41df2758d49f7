"""Incremental detokenization with stop strings, one instance per request.

Token ids arrive one (or a few) at a time; text leaves in pieces that are always final:

    ids   ... | prefix_offset ....... read_offset ....... len(ids)
                `---- already text ---'`---- not yet text ----'

Each call decodes the short window ids[prefix_offset:] and emits what it adds beyond
ids[prefix_offset:read_offset]. A window ending in U+FFFD is an incomplete UTF-8 sequence
(a multi-byte character split across tokens): nothing is emitted until it completes.

Stop strings: text is streamed only up to a point no stop string can still begin before.
A suffix that is a prefix of some stop string is held back until it either completes
the stop string (generation ends, everything after the match is dropped, and the match
too unless `include_stop`) or stops matching (it is released). The held text is released on a non-stop finish.

Special tokens (vLLM's options of the same names): `skip_special_tokens` leaves them out of
the text (the default); kept, `spaces_between_special_tokens=False` renders each added
token as its own text, joined to the text around it without a separator, where true (the
default) lets the tokenizer decode the whole window, as vLLM's fast detokenizer does. For a
byte-level tokenizer (Qwen's) the two are the same text: its decoder never adds spaces.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def added_tokens(tokenizer) -> dict[int, str]:
    """The tokenizer's added tokens (special or not): id -> its text."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {i: getattr(t, "content", str(t)) for i, t in decoder.items()}


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None,
                 include_stop: bool = False, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        # kept special tokens joined without the decoder's separators: id -> text
        self.added = ({} if skip_special_tokens or spaces_between_special_tokens
                      else added_tokens(tokenizer))
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop  # keep the matched stop string in the text
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # stable text so far (cut at the stop string once matched)
        self.sent = 0  # chars of self.text already streamed
        self.stopped = False  # a stop string matched

    def _decode(self, ids: list[int]) -> str:
        if not self.added:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)
        pieces, run = [], []
        for t in ids:
            if t in self.added:
                if run:
                    pieces.append(self.tokenizer.decode(run, skip_special_tokens=False))
                    run = []
                pieces.append(self.added[t])
            else:
                run.append(t)
        if run:
            pieces.append(self.tokenizer.decode(run, skip_special_tokens=False))
        return "".join(pieces)

    def _advance(self, final: bool) -> None:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset :])
        if len(window) > len(prefix) and (final or not window.endswith(REPLACEMENT)):
            self.text += window[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)

    def add(self, token_ids: list[int]) -> str:
        """Feed new token ids; return the text that may be streamed now."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        self._advance(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """The generation ended without a stop string: release everything held."""
        if self.stopped:
            return ""
        self._advance(final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop:
            hits = [(i, -len(s)) for s in self.stop if (i := self.text.find(s, self.sent)) >= 0]
            if hits:
                at, neg = min(hits)  # the earliest match (the longest stop string there)
                self.text = self.text[: at - neg if self.include_stop else at]
                self.stopped = True
                final = True
        end = len(self.text) if final else len(self.text) - self._held_suffix()
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out

    def _held_suffix(self) -> int:
        """Length of the longest unsent suffix that is a proper prefix of a stop string."""
        unsent = len(self.text) - self.sent
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, unsent), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
