"""One generation request inside the language tier, its state split by who writes it:

    spec            RequestSpec: room, sampling, prompt, id, priority, deadline (frozen)
    max_new_tokens  its token budget                              (given at construction)
    trace           StageTrace when traced (else None)            (given at construction;
                                                                   its chunks: the engine)
    status          through `transition()` only, which checks the order  (scheduler)
    output          through `append_output(token, logprob)` only         (scheduler)
    kv              KVState: block table, computed tokens, pins, keys    (scheduler)
    sampler         SamplingState: generator, penalty state, grammar     (sampler, engine)
    times           Timings: when each stage began                       (engine)
    early_prefill_tokens                                                 (engine)

Each owner is one module, and tests/test_request_ownership.py fails when another module of
services/ writes an owned field. A failure is not parked on the request: the scheduler
returns it (`Step.failed`: `Failure`s) and the engine reports it in the final delta.

A request's sequence is its prompt followed by its generated tokens:

    position  0 ........ L-1 | L ........ L+k-1
              prompt rows      | output_ids[0..k) (token ids)
              ^ kv.num_computed_tokens counts positions whose K/V are in the cache

The prompt is one type, `PromptPayload`: embedding rows from the encoder, or a text-only
prompt's ids (no embeddings; its rows are embedded from the ids at text positions).

The next step computes the *pending* range [num_computed_tokens, L + k). Normally that is
the last generated token (a decode step); after admission it is the prompt (chunked
prefill); after a retraction it is the whole sequence again (prompt from embeddings, then
generated tokens from their ids). A step whose chunk reaches L + k samples one new token.
"""

from __future__ import annotations

import enum
import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tandem.sampling import SamplingParams
from tandem.transfer.payload import ImageSpan, PromptPayload
from tandem.v1 import common_pb2


class RequestStatus(enum.IntEnum):
    """Ordered: a request only moves forward, except a retraction (back to WAITING) and a
    streamed prompt's pauses (PREFILLING <-> WAITING_FOR_ROWS).

    Everything after RUNNING is finished; `FINISH_REASONS` maps each finished status to
    the wire's FinishReason. Values start at 1 so that no status is falsy.
    """

    NEW = 1  # made with its whole prompt, not yet submitted to the engine
    WAITING_FOR_GRAMMAR = 2  # prompt complete; its structured-output grammar compiling
    WAITING = 3  # in the waiting queue (new, or retracted and to be recomputed)
    PREFILLING = 4  # admitted; pending range still longer than one token
    # admitted, its prompt streamed (PromptPayload.arrived) and every arrived row computed:
    # keeps its KV pages, takes no running slot and no step until more rows arrive
    WAITING_FOR_ROWS = 5
    RUNNING = 6  # decoding one token per step
    FINISHED_STOP = 7  # EOS, stop token id or stop string
    FINISHED_LENGTH = 8  # max_tokens reached
    FINISHED_ABORT = 9  # client abort, deadline, drain
    FINISHED_ERROR = 10  # server-side failure
    # (a prefill instance, `RequestSpec.hand_off`) its first token sampled and not an end:
    # its prompt's pages are held for the decode instance (`PrefixCache.hold`), which
    # goes on with the request. Not a finish of the request: no wire finish reason.
    FINISHED_HANDED_OFF = 11

    @property
    def finished(self) -> bool:
        return self > RequestStatus.RUNNING

    @property
    def scheduled(self) -> bool:
        """Admitted by the scheduler (holds or may hold KV pages)."""
        return RequestStatus.PREFILLING <= self <= RequestStatus.RUNNING

    @property
    def label(self) -> str:
        """Lower-case name, for metric labels and logs ("finished_stop")."""
        return self.name.lower()


class TransitionError(AssertionError):
    """A status change the order does not allow (a bug in the engine, never bad input)."""


def allowed(old: RequestStatus, new: RequestStatus) -> bool:
    """The order's one rule: forward only, never out of a finished status; the exceptions
    are a retraction (an admitted request back to WAITING) and a streamed prompt's pause
    (WAITING_FOR_ROWS back to PREFILLING)."""
    S = RequestStatus
    if old.finished:
        return False
    if new > old:
        return True
    return (new is S.WAITING and old.scheduled) or (old, new) == (S.WAITING_FOR_ROWS,
                                                                    S.PREFILLING)


# The one map from a finished status to the wire's finish reason.
FINISH_REASONS: dict[RequestStatus, int] = {
    RequestStatus.FINISHED_STOP: common_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORT: common_pb2.FINISH_REASON_ABORT,
    RequestStatus.FINISHED_ERROR: common_pb2.FINISH_REASON_ERROR,
}
assert set(FINISH_REASONS) == {s for s in RequestStatus if s.finished} - {
    RequestStatus.FINISHED_HANDED_OFF}


@dataclass
class StreamDelta:
    """What one step produced for one request (plain twin of LanguageGenerateResponse)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token
    finish_reason: RequestStatus | None = None  # set on the last delta
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    completion_tokens: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)  # queue, prefill, decode
    early_prefill_tokens: int = 0  # Request.early_prefill_tokens, on the last delta
    error: str = ""
    error_code: str = ""
    error_field: str = ""  # the request field an INVALID_ARGUMENT error is about

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_arrival = itertools.count()


@dataclass(frozen=True)
class RequestSpec:
    """What was asked: fixed when the request is made, never written after."""

    room: int  # the room id (unique per instance)
    sampling: SamplingParams
    # Embedding rows from the encoder (from `prompt.start` on: the tokens before it are
    # pinned cached pages), or a text-only prompt the tier tokenized itself (no embeddings).
    prompt: PromptPayload
    request_id: str = ""
    priority: int = 0
    deadline: float = float("inf")  # time.monotonic() seconds
    # Its prefix-cache namespace (the router's cache_salt, hex; "" = the shared cache): the
    # first page's key starts from it, so pages are shared only within it.
    cache_salt: str = ""
    # E/P/D, a prefill instance: end after the first token (unless it ends the request)
    # as FINISHED_HANDED_OFF, its prompt's pages held for the decode instance
    hand_off: bool = False


@dataclass
class KVState:
    """Where the request's KV lives. Written by the scheduler only (prefix_cache.py keeps
    the pages' own state, never the request's)."""

    block_table: list[int] = field(default_factory=list)  # KV page ids, in order
    num_computed_tokens: int = 0  # leading positions whose K/V are in the cache
    num_retractions: int = 0
    # Leading pages held for the request's whole life (kept across retraction): a cached
    # prefix pinned before its prompt arrived, which the encoder did not send.
    num_pinned_pages: int = 0
    page_keys: list[bytes] = field(default_factory=list)  # keys of its first whole pages
    num_keyed_pages: int = 0  # leading pages already offered to the cache
    cached_tokens: int | None = None  # prompt tokens found cached when first admitted


@dataclass
class SamplingState:
    """What drawing the request's tokens needs across steps. Written by sampler.py
    (generator, penalties) and by core.py (seed, the grammar's future and matcher)."""

    generator: torch.Generator | None = None  # made on first use
    seed: int | None = None  # the engine's seed for a request without one (EngineConfig.seed)
    penalties: object | None = None  # sampler.PenaltyState: bias/penalty inputs, on the device
    grammar_future: Future | None = None  # the compiling grammar (sampling.grammar)
    matcher: object | None = None  # its grammar matcher, once compiled


@dataclass
class Timings:
    """time.monotonic() of each stage's start (0: not reached). Written by scheduler.py
    (queued, first_scheduled) and core.py (first_token, last_token)."""

    created: float = field(default_factory=time.monotonic)
    queued: float = 0.0  # entered the waiting queue
    first_scheduled: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0

    def ms(self) -> dict[str, float]:
        def span(a: float, b: float) -> float:
            return max(b - a, 0.0) * 1e3 if a and b else 0.0

        return {
            "queue": span(self.queued, self.first_scheduled),
            "prefill": span(self.first_scheduled, self.first_token),
            "decode": span(self.first_token, self.last_token),
        }


@dataclass
class StageTrace:
    """What the engine thread records for a traced request, beside `Timings`, for its
    spans (made by the server once the request ended, never on the engine thread)."""

    exemplar: dict[str, str] | None  # its trace id, for the latency histograms' exemplars
    # each step that ran a chunk of its prompt: (time.monotonic() at the step's forward
    # and after it, the chunk's tokens, the step's sequences, the step's tokens)
    chunks: list[tuple[float, float, int, int, int]] = field(default_factory=list)


class Request:
    """A request from submission to finish: its spec (read-only), its token budget and
    trace (given at construction) and the state each owner writes (module docstring).
    Owned by the engine thread once submitted."""

    def __init__(self, spec: RequestSpec, *, grammar_future: Future | None = None,
                 max_new_tokens: int | None = None, trace: StageTrace | None = None) -> None:
        """`max_new_tokens`: the tokens it may generate; None takes the spec's max_tokens.
        Without either the engine refuses it: `Engine.request` builds one with the
        service's default budget (shortened to what the context leaves)."""
        self.spec = spec
        self.max_new_tokens: int | None = (max_new_tokens if max_new_tokens is not None
                                           else spec.sampling.max_tokens)
        self.trace = trace  # None: not traced
        self.status = RequestStatus.NEW
        self.arrival = next(_arrival)  # FCFS order
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []  # one per output id when logprobs are asked
        self.kv = KVState()
        self.sampler = SamplingState(grammar_future=grammar_future)
        self.times = Timings()
        # Prompt tokens computed while its streamed prompt's later rows were still on their
        # way (recomputed ones after a retraction count again, as in the engine's counter)
        self.early_prefill_tokens = 0

    def transition(self, status: RequestStatus) -> None:
        """The one writer of `status` (the scheduler calls it): raises TransitionError on
        a change the order does not allow (`allowed`)."""
        if not allowed(self.status, status):
            raise TransitionError(f"request {self.room}: {self.status.name} -> {status.name}")
        self.status = status

    def append_output(self, token: int, logprob: float | None) -> None:
        """The one writer of the output (the scheduler's commit): a generated token and its
        logprob (None when the request asked for none)."""
        self.output_ids.append(int(token))
        if logprob is not None:
            self.output_logprobs.append(logprob)

    # the spec's fields, read-only
    room = property(lambda self: self.spec.room)
    sampling = property(lambda self: self.spec.sampling)
    prompt = property(lambda self: self.spec.prompt)
    request_id = property(lambda self: self.spec.request_id)
    priority = property(lambda self: self.spec.priority)
    deadline = property(lambda self: self.spec.deadline)
    cache_salt = property(lambda self: self.spec.cache_salt)

    def __repr__(self) -> str:
        return f"Request(room={self.room}, status={self.status.name}, out={len(self.output_ids)})"

    @property
    def prompt_len(self) -> int:
        return self.prompt.end

    def prompt_token_ids(self) -> list[int]:
        """The whole prompt's ids (the repetition penalty, the cache keys); not a copy."""
        if self.prompt.info is not None:
            return self.prompt.info.token_ids
        return self.prompt.fill_ids.tolist()  # start is 0 without an announce

    def cache_content(self) -> tuple[list[int], list[ImageSpan]] | None:
        """The prompt's token ids and images for page keys; None when its images are not
        known (a payload sent without the announce), so its pages are never shared."""
        if self.prompt.info is None:
            return None
        return self.prompt.info.token_ids, self.prompt.info.images

    @property
    def rows_end(self) -> int:
        """End of the prompt rows that may be computed now: the whole prompt, or where a
        streamed prompt's arrived rows end (its watermark)."""
        return self.prompt.ready_end

    @property
    def rows_pending(self) -> bool:
        """Its prompt is streamed and the next row to compute has not arrived yet."""
        start = self.kv.num_computed_tokens
        return start < self.prompt_len and start >= self.rows_end

    @property
    def seq_len(self) -> int:
        """Known tokens: prompt plus generated."""
        return self.prompt_len + len(self.output_ids)

    @property
    def remaining_tokens(self) -> int:
        """Tokens it may still generate."""
        return max(self.max_new_tokens - len(self.output_ids), 0)

    def sort_key(self, by_priority: bool) -> tuple[int, int]:
        return (-self.priority if by_priority else 0, self.arrival)
