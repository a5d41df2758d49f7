"""Structured output: grammars compiled off the engine thread, token masks per batch row.

    spec (GrammarSpec: JSON schema | any JSON object | regex | choice | EBNF)
      └─ Grammars.compile(spec) ─▶ Future[compiled]   one worker thread, cached by spec
    engine: a request whose grammar is still compiling waits in WAITING_FOR_GRAMMAR (never
            in the batch); once compiled it gets its own matcher and joins the queue
    sampler: apply_masks(logits, reqs) -> each row with a matcher keeps only the tokens
            its grammar allows next; the engine feeds every chosen token back (`accept`)

The grammar engine is xgrammar (CPU and CUDA; vLLM's and SGLang's). Its tokenizer view
and compiler are built on first use, in the worker thread, so a service that never sees
structured output never pays for them. A spec that does not compile is a GrammarError
(INVALID_ARGUMENT naming `response_format`), found before the request takes a slot.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tandem.errors import ServiceError
from tandem.sampling import GrammarKind, GrammarSpec

_CPP_PREFIX = re.compile(r"\[[\d:]+\] \S+:\d+: ")


class GrammarError(ServiceError):
    """A structured-output spec that does not compile."""

    code = "INVALID_ARGUMENT"
    field = "response_format"


class Grammars:
    """Compiles grammars for one tokenizer and vocabulary; thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 cache_size: int = 256) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None  # made in the worker thread on first use
        self.compiled = 0  # grammars compiled (cache misses)

    def compile(self, spec: GrammarSpec) -> Future:
        """The compiled grammar of `spec` (a shared future; a failed one raises GrammarError)."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(spec)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GrammarSpec):
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        c = self._compiler
        self.compiled += 1
        try:
            match spec.kind:
                case GrammarKind.JSON_SCHEMA:
                    return c.compile_json_schema(spec.text, any_whitespace=False, strict_mode=True)
                case GrammarKind.JSON_OBJECT:
                    return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
                case GrammarKind.REGEX:
                    return c.compile_regex(spec.text)
                case GrammarKind.CHOICE:
                    choices = json.loads(spec.text)
                    alts = " | ".join(json.dumps(str(x), ensure_ascii=False) for x in choices)
                    return c.compile_grammar(f"root ::= {alts}")
                case GrammarKind.EBNF:
                    return c.compile_grammar(spec.text)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors
            why = _CPP_PREFIX.sub("", str(e)).strip()  # "[hh:mm:ss] file.cc:83: " off
            raise GrammarError(f"{spec.kind.value} does not compile: {why}") from None
        raise AssertionError(spec.kind)


def matcher(compiled):
    """A fresh matcher (one per request) over a compiled grammar."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


def apply_masks(logits: torch.Tensor, matchers: list) -> torch.Tensor:
    """`logits` [B, V] with each row whose matcher is not None masked to the tokens its
    grammar allows next (a new tensor when any row is masked)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    out = logits.float().clone()
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), indices=rows)
    return out
