"""Plain results of the SDK, and the request/response plumbing both clients share."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tandem.chat import ChatError, template_options_from_proto
from tandem.client.content import to_messages
from tandem.client.errors import InvalidRequestError, error_from_code
from tandem.finish_reasons import TO_OPENAI
from tandem.sampling import SamplingError, to_proto
from tandem.v1 import common_pb2, router_pb2


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_image_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass(frozen=True)
class EncoderRange:
    """One encoder's share of a prompt's rows: payload tokens [first_token, first_token +
    tokens) and media [first_media, first_media + media); `fell_back`: that helper failed
    and the lead re-encoded its range; `vit_ms`: the writer's ViT time for it (the lead's:
    its own; 0 when re-encoded); `cached_image_tokens`: its media tokens served from the
    writer's embedding cache (each writer counts its own media's); `preprocess_ms`: the
    writer's preprocessing time (the lead's: the whole chat's; 0 when re-encoded)."""

    encoder: str  # its address
    first_token: int
    tokens: int
    first_media: int
    media: int
    fell_back: bool = False
    vit_ms: float = 0.0
    cached_image_tokens: int = 0
    preprocess_ms: float = 0.0


@dataclass(frozen=True)
class StageTimings:
    """Milliseconds per stage: encoder (preprocess, vit, transfer), language (queue,
    prefill, decode); and the streamed rows' overlap and who wrote which rows."""

    preprocess_ms: float = 0.0
    vit_ms: float = 0.0
    transfer_ms: float = 0.0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    skipped_images: int = 0  # images whose ViT run the prefix cache made unnecessary
    encoder_bypassed: bool = False  # a text-only chat: no encoder at all
    time_to_first_row_ms: float = 0.0  # Generate to the prompt's first rows usable
    early_prefill_tokens: int = 0  # prompt tokens prefilled while later rows were on their way
    encoder_ranges: tuple[EncoderRange, ...] = ()  # in prompt order; one without a split


@dataclass(frozen=True)
class ToolCall:
    """A function call the model made; `arguments` is a JSON object as text."""

    id: str
    name: str
    arguments: str


@dataclass
class ChatResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: Usage = field(default_factory=Usage)
    timings: StageTimings = field(default_factory=StageTimings)
    logprobs: list[float] = field(default_factory=list)
    # per generated token: its most likely alternatives, (token id, logprob, text)
    top_logprobs: list[list[tuple[int, float, str]]] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)  # with tools: the calls made
    request_id: str = ""


def build_request(
    messages,
    *,
    model: str = "",
    stop: list[str] | str | None = None,
    stop_token_ids: list[int] | None = None,
    logit_bias: dict[int, float] | None = None,
    json_schema: dict | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: list[str] | None = None,
    grammar: str | None = None,
    tools: list[dict] | None = None,
    tool_choice: str | None = None,
    n: int = 1,
    timeout: float | None = None,
    request_id: str = "",
    priority: int = 0,
    chat_template_kwargs: dict | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool = False,
    cache_salt: str = "",
    **knobs,
) -> router_pb2.RouterGenerateRequest:
    """`knobs` are the sampling parameters of `tandem.sampling.KNOBS` by name (max_tokens,
    temperature, top_p, top_k, min_p, seed, presence_penalty, skip_special_tokens, ...;
    an unknown name is a TypeError); each means what it means in the HTTP API
    (docs/sdk.md). Left out, a knob takes the service's default: temperature 0 (greedy
    decoding), top_p 1, ... `chat_template_kwargs`, `add_generation_prompt` (None: unless
    the chat ends with an assistant message) and `continue_final_message`: how the
    model's chat template renders the chat, as vLLM's request fields of these names.
    `cache_salt` (vLLM's): cached prompt pages and image embeddings are shared only with
    requests of the same tenant (API key) and the same salt."""
    try:  # refused here as the router would refuse it, without a round trip
        sampling = to_proto(**knobs)
    except SamplingError as e:
        raise InvalidRequestError("INVALID_ARGUMENT", str(e), f"sampling.{e.field}") from None
    sampling.stop.extend([stop] if isinstance(stop, str) else list(stop or []))
    sampling.stop_token_ids.extend(stop_token_ids or [])
    sampling.logit_bias.update(logit_bias or {})
    asked = [k for k, v in (("json_schema", json_schema), ("json_object", json_object),
                            ("regex", regex), ("choice", choice), ("grammar", grammar)) if v]
    if len(asked) > 1:
        raise ValueError(f"at most one output constraint, got {asked}")
    so = sampling.structured_output
    if json_schema:
        so.json_schema = json.dumps(json_schema)
    elif json_object:
        so.json_object = True
    elif regex:
        so.regex = regex
    elif choice:
        so.choice.choices.extend(choice)
    elif grammar:
        so.ebnf = grammar
    template = common_pb2.ChatTemplateOptions(
        kwargs_json=json.dumps(chat_template_kwargs) if chat_template_kwargs is not None else "",
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message)
    try:  # refused here as the router would refuse it, without a round trip
        template_options_from_proto(template)
    except ChatError as e:
        raise InvalidRequestError("INVALID_ARGUMENT", e.detail, e.field) from None
    return router_pb2.RouterGenerateRequest(
        template_options=template,
        tools_json=json.dumps(tools) if tools else "",
        n=n,
        tool_choice=tool_choice or "",
        model=model,
        messages=to_messages(messages),
        sampling=sampling,
        timeout_ms=int(timeout * 1000) if timeout else 0,
        request_id=request_id,
        priority=priority,
        cache_salt=cache_salt,
    )


def check(msg: router_pb2.RouterGenerateResponse) -> None:
    """Raise the typed error a stream's last message carries, if any."""
    if msg.finish_reason == common_pb2.FINISH_REASON_ERROR:
        e = msg.error
        raise error_from_code(e.code or "INTERNAL", e.message or "request failed", e.field)


def collect(messages, n: int) -> list[ChatResult]:
    """The n ChatResults of a stream whose messages name their choice (`index`)."""
    results = [ChatResult() for _ in range(n)]
    for msg in messages:
        add(results[msg.index], msg)
    return results


def add(result: ChatResult, msg: router_pb2.RouterGenerateResponse) -> None:
    """Fold one streamed message into `result`."""
    check(msg)
    result.text += msg.text
    result.token_ids.extend(msg.token_ids)
    result.logprobs.extend(lp.logprob for lp in msg.logprobs)
    result.top_logprobs.extend([(t.token_id, t.logprob, t.text) for t in lp.top]
                               for lp in msg.logprobs)
    result.request_id = msg.request_id or result.request_id
    result.tool_calls.extend(ToolCall(c.id, c.name, c.arguments) for c in msg.tool_calls)
    if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
        result.finish_reason = TO_OPENAI.get(msg.finish_reason, "")
        u = msg.usage
        result.usage = Usage(u.prompt_tokens, u.completion_tokens, u.total_tokens,
                             u.cached_image_tokens, u.cached_tokens)
        t = msg.timings
        result.timings = StageTimings(
            t.preprocess_ms, t.vit_ms, t.transfer_ms, t.queue_ms, t.prefill_ms, t.decode_ms,
            t.skipped_images, t.encoder_bypassed, t.time_to_first_row_ms, t.early_prefill_tokens,
            tuple(EncoderRange(r.encoder, r.first_token, r.tokens, r.first_media, r.media,
                               r.fell_back, r.vit_ms, r.cached_image_tokens,
                               r.preprocess_ms)
                  for r in t.encoder_ranges))
