"""The engine's plain data: its config, the events its inbox carries (dispatched by type),
and a live request's record on the engine thread."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.services.language.engine.detokenizer import IncrementalDetokenizer
from tandem.services.language.engine.grammar import GrammarLimits
from tandem.services.language.engine.request import Request, StreamDelta

Sink = Callable[[StreamDelta], None]


@dataclass
class EngineConfig:
    max_prefill_tokens: int = 4096
    max_running_requests: int = 64
    schedule_policy: str = "fcfs"
    max_model_len: int = 32768
    default_max_tokens: int = 256  # a request's max_tokens when it gives none
    init_new_token_ratio: float = 0.7  # share of max_tokens reserved at admission (decays)
    prefix_cache: bool = True  # share whole KV pages between requests with equal prefixes
    seed: int | None = None  # seeds the seeds of requests that give none (vLLM's --seed)
    grammar: GrammarLimits = field(default_factory=GrammarLimits)  # structured output's bounds


@dataclass
class Submit:
    """Inbox event: a request whose prompt is complete, and where its deltas go."""

    req: Request
    sink: Sink


@dataclass(frozen=True)
class HandOff:
    """E/P/D: what a decode instance's request continues from (the prefill instance's
    PrefillDone and first token): `Engine.submit(..., handoff=...)`."""

    first: int  # the first token, sampled on the prefill instance
    logprob: float | None  # its logprob (None when the request asked for none)
    cached_tokens: int  # prompt tokens the prefill side's prefix cache held
    generator_state: bytes  # the sampler's generator after that draw (b"": none made)


@dataclass
class Abort:
    """Inbox event: end `room`'s request with an error message and a gRPC code name, as
    aborted (its caller's doing) or failed (`error`: e.g. its streamed prompt's transfer
    failed after it was submitted)."""

    room: int
    reason: str
    code: str
    error: bool = False


@dataclass
class Live:
    req: Request
    sink: Sink
    detok: IncrementalDetokenizer
