"""Plain data of one generation request through the router (front-end independent): what
its door translated (Query), who sent it (Caller), what the dispatcher runs (ChatRequest),
what comes back (Output)."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry.context import Context

from tandem import tracing
from tandem.services.router.tools import ToolSetup, parse_output
from tandem.v1 import common_pb2, encoder_pb2, language_pb2

# StageTimings' figures, in the order the request's log line and the HTTP extension give
# them: stage timings (ms); what the stages skipped: images the encoder did not run through
# the ViT (inside the language side's cached prefix), the whole encoder (a text-only chat);
# the streamed rows' overlap: Generate to the first rows, prompt tokens prefilled while
# later rows were on their way. Beside them, `encoder_ranges` (who wrote which rows).
TIMING_FIELDS = ("preprocess_ms", "vit_ms", "transfer_ms", "queue_ms", "prefill_ms", "decode_ms",
                 "skipped_images", "encoder_bypassed", "time_to_first_row_ms",
                 "early_prefill_tokens")
# those the encoder's answer gives (the language side's are replaced by them)
ENCODER_TIMINGS = ("preprocess_ms", "vit_ms", "transfer_ms", "skipped_images")

class Door(enum.Enum):
    """The front end a request came in by (the `api` label of its metrics and spans)."""

    HTTP = "http"
    GRPC = "grpc"


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as its door established it (the door reads the peer and the
    credentials; RouterCore.generate gives these to the request it makes, which never
    changes them)."""

    door: Door
    # The caller's key (admission.client_id): the encoders share their preprocessing
    # threads fairly among these keys (EncodeRequest.client_id). "" = a client of its own.
    client_id: str = ""
    tenant: str = ""  # its API key's tenant (tenants.py); "" on an open router
    trace_parent: Context | None = None  # its traceparent, when it sent one


@dataclass(frozen=True)
class Query:
    """A generation request as its door translated it from its wire format (an OpenAI
    body, a RouterGenerateRequest): front-end independent, its input checked, its
    request-level bounds not yet (bounds.check, which RouterCore.generate runs before
    making the ChatRequest of it, with its Caller)."""

    messages: list[common_pb2.ChatMessage]
    sampling: common_pb2.SamplingParams
    request_id: str
    timeout_ms: int | None = None  # None: the router's request_timeout_s
    n: int = 1  # choices: independent samples of the same prompt
    stream: bool = True  # answered as it is made (the gRPC door always streams)
    priority: int = 0
    tools: ToolSetup = field(default_factory=ToolSetup)  # tools rendered / calls parsed
    prompt: str = ""  # a raw text prompt (completions API) instead of messages
    # How the chat template renders the chat (checked; unset = the template's defaults)
    template_options: common_pb2.ChatTemplateOptions = field(
        default_factory=common_pb2.ChatTemplateOptions)
    cache_salt: str | None = None  # the wire's, as asked (its namespace: tenants.py)


@dataclass(frozen=True)
class ChatRequest:
    """One choice of an admitted request, as the dispatcher runs it: the Query's fields
    with its caller's identity and its root span, complete at construction
    (RouterCore.generate makes it; choices.choice_requests copies it per choice)."""

    messages: list[common_pb2.ChatMessage]
    sampling: common_pb2.SamplingParams
    timeout_s: float
    request_id: str
    priority: int = 0
    tools: ToolSetup = field(default_factory=ToolSetup)  # tools rendered / calls parsed
    prompt: str = ""  # a raw text prompt (completions API) instead of messages
    client_id: str = ""  # Caller.client_id
    tenant: str = ""  # Caller.tenant
    # its cache namespace (tenants.cache_namespace; the wire's cache_salt): "" = shared
    cache_salt: str = ""
    # How the chat template renders the chat (checked; unset = the template's defaults)
    template_options: common_pb2.ChatTemplateOptions = field(
        default_factory=common_pb2.ChatTemplateOptions)
    # Its root span (RouterCore.start_trace; the n choices of one request share it)
    trace: tracing.Span = tracing.OFF


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_image_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens from the language instance's prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Route:
    """Where one attempt of a request ran and how its transfer went (reported on the
    last Output; the HTTP response carries these fields as extensions)."""

    attempts: int  # whole-request attempts so far (1 = no retry)
    language: str = ""  # language instance address (E/P/D: the decode instance)
    prefill: str = ""  # E/P/D: the prefill instance's address ("" when not split)
    encoder: str = ""  # encoder address of the latest Encode
    encoder_attempts: int = 0  # Encode calls of this attempt (> 1: retried on another)
    resumes: int | None = None  # resumed transfers, once the encoder reported delivery

    def fields(self) -> dict:
        """The extension fields of a response (`resumes` only once known)."""
        out = {"attempts": self.attempts, "language": self.language, "encoder": self.encoder,
               "encoder_attempts": self.encoder_attempts}
        if self.prefill:
            out["prefill"] = self.prefill
        if self.resumes is not None:
            out["resumes"] = self.resumes
        return out


@dataclass
class Output:
    """What a request produced since its previous Output: the language tier's message as
    received (its text, tokens and logprobs, the wire's types), and on the last one
    (`finished`) what the router adds. OpenAI's shapes are made at the HTTP edge only."""

    response: language_pb2.LanguageGenerateResponse
    usage: Usage | None = None  # the last one: merged with the encoder's figures
    # The last one: the language side's timings merged with the encoder's (merge_timings)
    timings: common_pb2.StageTimings | None = None
    # Set on the last one: where it ran and how the transfer went.
    route: Route | None = None
    # The last one of a request with tools: the calls the model made (then the finish
    # reason is TOOL_CALLS, set by the router, and the text is the content before them).
    tool_calls: list[common_pb2.ToolCall] = field(default_factory=list)

    @classmethod
    def whole(cls, outputs: list[Output], tools: ToolSetup) -> Output:
        """The Outputs of one choice as one last Output (a request with tools is answered
        so: its calls are known only at the end): its content and its calls (then its
        finish reason is TOOL_CALLS), all its tokens and logprobs."""
        out = parse_output("".join(o.text for o in outputs), tools)
        last = outputs[-1]
        response = language_pb2.LanguageGenerateResponse(
            text=out.content or "", finish_reason=last.response.finish_reason,
            token_ids=[t for o in outputs for t in o.token_ids],
            logprobs=[lp for o in outputs for lp in o.logprobs])
        return dataclasses.replace(last, response=response, tool_calls=out.tool_calls)

    @property
    def text(self) -> str:
        return self.response.text

    @property
    def token_ids(self) -> Sequence[int]:
        return self.response.token_ids

    @property
    def logprobs(self) -> Sequence[common_pb2.TokenLogprob]:
        return self.response.logprobs

    @property
    def finish_reason(self) -> common_pb2.FinishReason.ValueType:
        """The wire's reason; UNSPECIFIED on all but the last one."""
        if self.tool_calls:
            return common_pb2.FINISH_REASON_TOOL_CALLS
        return self.response.finish_reason

    @property
    def finished(self) -> bool:
        return self.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED

    def summary(self) -> str:
        """The last one's tokens, stage times and route, for the request's log line."""
        u, parts = self.usage, []
        if u is not None:
            parts.append(f"tokens {u.prompt_tokens} in ({u.cached_tokens} cached) "
                         f"{u.completion_tokens} out")
        if self.timings is not None:
            # each figure with its own unit: stage times in ms, counts and flags as they are
            t = self.timings
            parts.append("stages " + " ".join(
                f"{k.removesuffix('_ms')}={v:.0f}ms" if k.endswith("_ms") else f"{k}={v:g}"
                for k, v in ((k, getattr(t, k)) for k in TIMING_FIELDS)))
            if len(t.encoder_ranges) > 1:  # a split prompt: each writer's tokens
                parts.append("ranges " + " ".join(
                    f"{r.encoder}[{r.first_token},{r.first_token + r.tokens})"
                    + ("(fell back)" if r.fell_back else "") for r in t.encoder_ranges))
        if self.route is not None:
            parts.append(f"via {self.route.encoder or '-'} -> {self.route.language}")
        return (": " + ", ".join(parts)) if parts else ""


def merge_timings(language: common_pb2.StageTimings, encoded: encoder_pb2.EncodeResponse | None,
                  lead: str) -> common_pb2.StageTimings:
    """A request's timings as its client gets them: the language side's, with the
    encoder's ENCODER_TIMINGS and the lead's ranges (`lead`: its address, which names the
    lead's own range) where its Encode answer reached the router."""
    out = common_pb2.StageTimings()
    out.CopyFrom(language)
    if encoded is not None:
        for f in ENCODER_TIMINGS:
            setattr(out, f, getattr(encoded.timings, f))
        out.encoder_ranges.extend(encoded.ranges)
        for r in out.encoder_ranges:
            r.encoder = r.encoder or lead
    return out


def conversation_key(messages: list[common_pb2.ChatMessage]) -> str:
    """The language-affinity key of a chat: a hash of its system messages and its first
    user message (text and images). Every later turn of the conversation starts with
    them, so it maps to the instance whose prefix cache holds the earlier turns."""
    h = hashlib.sha256()
    for m in messages:
        h.update(m.SerializeToString(deterministic=True))
        if m.role == "user":
            break
    return h.hexdigest()


def prompt_key(prompt: str) -> str:
    """The language-affinity key of a raw prompt: its first 1 KiB (a shared preamble)."""
    return hashlib.sha256(prompt[:1024].encode()).hexdigest()


def image_hashes(messages: list[common_pb2.ChatMessage]) -> list[str]:
    """sha256 of each image's and video's raw bytes (or of its URL) in order: the encoder
    affinity keys (a chat without any goes straight to a language instance)."""
    out = []
    for m in messages:
        for part in m.content:
            kind = part.WhichOneof("part")
            if kind in ("image", "video"):
                src = part.image if kind == "image" else part.video
                if src.WhichOneof("source") == "frames":  # each frame's bytes or URL, in order
                    raw = b"".join(hashlib.sha256(f.data or f.url.encode()).digest()
                                   for f in src.frames.frames)
                else:
                    raw = src.data if src.WhichOneof("source") == "data" else src.url.encode()
                out.append(hashlib.sha256(raw).hexdigest())
    return out
