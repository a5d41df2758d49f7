"""What the chat and completions APIs share: sampling and structured-output fields (OpenAI's
and vLLM's extensions), and their conversion to the wire's SamplingParams. Every field here
is honoured; a value out of range is a 400 naming it.

The sampling knobs are not spelled here: `SamplingFields` takes one field per row of
`tandem.sampling.KNOBS` that OpenAI's bodies share, and their bounds are checked by
`tandem.sampling.from_proto`, the check the gRPC front door and the language tier run."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from tandem import sampling as knobs
from tandem.services.router.errors import RouterError
from tandem.services.router.tools import forced as tool_forced
from tandem.v1 import common_pb2


class _Model(BaseModel):
    # NOTE: strict: a JSON value of the wrong type is a 400 (`"stream": "yes"` and
    # `"max_tokens": true` used to be coerced); an integer still passes for a float.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Model):
    include_usage: bool = False
    # vLLM: with include_usage, usage on every streamed chunk too (the tokens so far)
    continuous_usage_stats: bool = False


class JSONSchemaFormat(_Model):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced (strict or not)


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs` (one of its fields)."""

    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = Field(None, min_length=1, max_length=16384)
    choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    grammar: str | None = Field(None, min_length=1, max_length=1 << 20)


class _SamplingFields(_Model):
    """The request fields both APIs take besides the knobs (each API adds its prompt,
    logprobs and more)."""

    model: str = ""
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None  # bounds: tandem.sampling (max_tokens)
    stop: str | list[str] | None = None
    n: int = 1  # bounds: bounds.py (both doors')
    logit_bias: dict[str, float] | None = Field(None, max_length=knobs.MAX_LOGIT_BIAS)
    response_format: ResponseFormat | None = None
    # vLLM-compatible extensions
    stop_token_ids: list[int] | None = Field(None, max_length=knobs.MAX_STOP_TOKEN_IDS)
    # vLLM-compatible structured-output extensions (at most one constraint in all)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = Field(None, min_length=1, max_length=16384)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    guided_grammar: str | None = Field(None, min_length=1, max_length=1 << 20)
    timeout_ms: int | None = None  # extension: per-request deadline (bounds: bounds.py)
    priority: int = Field(0, ge=-(1 << 31), lt=1 << 31)  # extension
    # vLLM: caches (prefix pages, image embeddings) shared only with requests of the same
    # tenant giving the same salt (services/router/tenants.py; its length is checked there)
    cache_salt: str | None = None
    # vLLM: logprobs' tokens spelled "token_id:N" (tokens that are not valid UTF-8 alone)
    return_tokens_as_token_ids: bool = False
    # Hint only (accepted, no effect), as documented in docs/sdk.md.
    user: str | None = Field(None, max_length=256)


# vLLM's request extras that are refused, by name, and why (docs/sdk.md lists them): the
# 400 names the field and gives the reason, never a bare "extra fields not permitted". An
# extra either API honours is a field of its body instead.
VLLM_REFUSED = {
    "use_beam_search": "beam search is not served; n gives independent samples",
    "length_penalty": "it applies to beam search, which is not served",
    "best_of": "best_of is served by /v1/completions only; use n",
    "watermarking": "output watermarking is not served",
    "truncate_prompt_tokens": "prompts are never truncated: one over the limit is a 400",
    "truncation_side": "prompts are never truncated: one over the limit is a 400",
    "prompt_logprobs": "the prompt's logprobs are not computed (prefill keeps the last "
    "position's logits only)",
    "logprob_token_ids": "logprobs of chosen token ids are not served; use top_logprobs",
    "allowed_token_ids": "constrain the output with structured_outputs (choice, regex, "
    "grammar) instead",
    "bad_words": "ban tokens with logit_bias (-100) instead",
    "add_special_tokens": "the prompt's special tokens come from the chat template (or, "
    "for /v1/completions, the tokenizer's defaults)",
    "documents": "the served models' chat templates render no documents",
    "chat_template": "a request cannot bring its own template (a template is code the "
    "server runs); set one per deployment with --chat-template",
    "media_io_kwargs": "images and videos are decoded with the encoder's settings; resize "
    "bounds and a video's sampling go in mm_processor_kwargs (min_pixels, max_pixels, "
    "total_pixels, fps, num_frames, min_frames, max_frames) or in the video part",
    "request_id": "send the X-Request-Id header: it names the request in every tier's log",
    "session_id": "language affinity follows the conversation itself (its system and "
    "first user message)",
    "return_token_ids": "the prompt's token ids do not reach the router; POST /tokenize "
    "gives them, and the SDK returns the output's",
    "return_token_offsets": "there is no render endpoint",
    "return_prompt_text": "there is no render endpoint; POST /tokenize gives the prompt's "
    "token ids",
    "return_mm_kwargs": "there is no render endpoint",
    "routed_experts_prompt_start": "expert routing data is not returned",
    "kv_transfer_params": "Tandem's own tiers move the prompt; vLLM's KV connectors are "
    "not served",
    "ec_transfer_params": "Tandem's own tiers move the encoder's output; vLLM's connectors "
    "are not served",
    "vllm_xargs": "no custom extension runs per request",
    "logits_processors": "no custom code runs per request",
    "repetition_detection": "not served; repetition_penalty and frequency_penalty shape "
    "repeats instead",
    "stream_interval": "each token is streamed as it is produced (coalesced while the "
    "client reads slower)",
    "reasoning_effort": "there is no reasoning parser; pass the template's own switch in "
    "chat_template_kwargs (e.g. enable_thinking)",
    "thinking_token_budget": "there is no reasoning parser (the output is not split into "
    "reasoning and content)",
    "include_reasoning": "there is no reasoning parser (the output is not split into "
    "reasoning and content)",
    "structural_tag": "use structured_outputs (json, regex, choice, grammar)",
    "guided_decoding_backend": "xgrammar is the one grammar backend",
    "guided_whitespace_pattern": "JSON is generated compactly (no free whitespace)",
    "guided_json_object": "use response_format {\"type\": \"json_object\"}",
    "prompt_embeds": "prompts are text; embeddings are not accepted",
}

# ... and one field per knob of tandem.sampling.KNOBS (temperature, top_p, top_k, min_p,
# the penalties, min_tokens, seed, ignore_eos, include_stop_str_in_output, ...).
SamplingFields = create_model(
    "SamplingFields", __base__=_SamplingFields, __doc__=_SamplingFields.__doc__,
    **{name: (typ, Field(default, description=doc))
       for name, (typ, default, doc) in knobs.openai_fields().items()})


def _utf8(text: str, param: str) -> str:
    """`text` if it is valid Unicode for the wire; a lone surrogate (JSON allows "\ud800")
    is a 400 naming the field, not a 500 from the protobuf encoder."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RouterError("INVALID_ARGUMENT", "text is not valid Unicode (lone surrogate)",
                          param) from None
    return text


def _stop_list(stop: str | list[str] | None) -> list[str]:
    """OpenAI's string or list (how many, and none empty: tandem.sampling)."""
    if stop is None:
        return []
    return [_utf8(s, "stop") for s in ([stop] if isinstance(stop, str) else stop)]


def _schema_text(schema, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise RouterError("INVALID_ARGUMENT", "the JSON schema is not valid JSON",
                              param) from None
    if not isinstance(schema, dict):
        raise RouterError("INVALID_ARGUMENT", "a JSON schema must be an object", param)
    return json.dumps(schema)


def structured_output(body: SamplingFields) -> common_pb2.StructuredOutput | None:
    """The one output constraint the body asks for (None: free text); two is a 400."""
    so = body.structured_outputs
    asked: list[tuple[str, common_pb2.StructuredOutput]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", common_pb2.StructuredOutput(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise RouterError("INVALID_ARGUMENT", "response_format json_schema needs "
                              "json_schema.schema", "response_format")
        asked.append(("response_format", common_pb2.StructuredOutput(
            json_schema=_schema_text(rf.json_schema.schema_, "response_format"))))
    for param, value in (("guided_json", body.guided_json),
                         ("structured_outputs", so.json_ if so else None)):
        if value is not None:
            asked.append((param, common_pb2.StructuredOutput(
                json_schema=_schema_text(value, param))))
    if so is not None and so.json_object:
        asked.append(("structured_outputs", common_pb2.StructuredOutput(json_object=True)))
    for param, regex in (("guided_regex", body.guided_regex),
                         ("structured_outputs", so.regex if so else None)):
        if regex is not None:
            asked.append((param, common_pb2.StructuredOutput(regex=regex)))
    for param, choice in (("guided_choice", body.guided_choice),
                          ("structured_outputs", so.choice if so else None)):
        if choice is not None:
            asked.append((param, common_pb2.StructuredOutput(
                choice=common_pb2.Choices(choices=choice))))
    for param, ebnf in (("guided_grammar", body.guided_grammar),
                        ("structured_outputs", so.grammar if so else None)):
        if ebnf is not None:
            asked.append((param, common_pb2.StructuredOutput(ebnf=ebnf)))
    if len(asked) > 1:
        raise RouterError("INVALID_ARGUMENT", "at most one output constraint (response_format, "
                          "guided_*, structured_outputs)", asked[1][0])
    return asked[0][1] if asked else None


def _token_ids(ids: list[int] | None) -> list[int]:
    """Ids the wire's int32 can carry (their bounds: tandem.sampling)."""
    if any(not -(1 << 31) <= t < 1 << 31 for t in ids or []):
        raise knobs.SamplingError("stop_token_ids", "token ids must be in [0, 2^31)")
    return list(ids or [])


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's {"token id": bias}: keys are token ids (the biases' bounds: tandem.sampling)."""
    out = {}
    for key, value in (bias or {}).items():
        if not key.isdigit() or int(key) >= 1 << 31:
            raise RouterError("INVALID_ARGUMENT", f"logit_bias key {key!r}: keys are token ids",
                              "logit_bias")
        out[int(key)] = float(value)
    return out


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: bool,
                    top_logprobs: int, forced: common_pb2.StructuredOutput | None = None,
                    spelled: dict[str, str] | None = None) -> common_pb2.SamplingParams:
    """The wire's SamplingParams of a body, checked as every tier checks it (a 400 naming
    the field as the API spells it: `spelled` maps a wire name to the body's, e.g.
    max_tokens -> max_completion_tokens); `forced` is a forced tool call's grammar, which
    excludes any other constraint (tools.forced)."""
    values = {}
    for name in knobs.openai_fields():
        value = getattr(body, name)
        default = knobs.KNOB[name].openai_default
        values[name] = default if value is None and default is not None else value
    structured = tool_forced(forced, structured_output(body))
    try:
        sampling = knobs.to_proto(**values, max_tokens=max_tokens, logprobs=logprobs,
                                  top_logprobs=top_logprobs)
        sampling.stop.extend(_stop_list(body.stop))
        sampling.stop_token_ids.extend(_token_ids(body.stop_token_ids))
        sampling.logit_bias.update(_logit_bias(body.logit_bias))
        if structured is not None:
            sampling.structured_output.CopyFrom(structured)
        knobs.from_proto(sampling)
    except knobs.SamplingError as e:
        raise RouterError("INVALID_ARGUMENT", f"{e.field}: {e.reason}",
                          (spelled or {}).get(e.field, e.field)) from None
    return sampling
