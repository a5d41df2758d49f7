"""Router service configuration (`tandem router --help`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tandem.config import ServiceSettings


class RouterConfig(ServiceSettings):
    """The front door: OpenAI-compatible HTTP, the SDK's gRPC API, instance selection."""

    model: str = Field("", description="Model name reported by /v1/models (default: from tiers).")
    model_aliases: list[str] = Field(
        default_factory=list,
        description="Other names the model answers to, in a request's `model` and in "
        "/v1/models (vLLM's --served-model-name A B: every name after the first).",
    )
    # the values of reasoning.ReasoningParser (a Literal: --help lists the values)
    reasoning_parser: Literal["none", "qwen3"] = Field(
        "none",
        description="How a chat's thinking is split from its answer (vLLM's "
        "--reasoning-parser): `qwen3` puts the text before `</think>` (an opening `<think>` "
        "dropped) in message.reasoning_content / delta.reasoning_content and the rest in "
        "content, as vLLM's qwen3 parser; `none` leaves the whole output in content. Chat "
        "API only; an output bound by a grammar (response_format, structured_outputs, a "
        "forced tool call) is never split (services/router/reasoning.py).",
    )
    http_port: int = Field(8000, ge=1, le=65535, description="OpenAI-compatible HTTP port.")
    grpc_port: int = Field(50051, ge=1, le=65535, description="gRPC Router port (SDK).")
    http_keep_alive_s: int = Field(
        65, ge=1, le=3600,
        description="Idle HTTP keep-alive before the router closes a connection. Longer than "
        "common clients' own pool expiry (5 s in httpx/aiohttp), so a client never reuses a "
        "connection the router is closing at that moment (a reset under load).",
    )
    http_request_timeout_s: float = Field(
        60.0, gt=0, le=3600,
        description="Time a client has to send a whole HTTP request once it starts one: its "
        "headers (and, on a new connection, its first byte), then its body. Past it the "
        "router answers 408 and closes the connection, so a stalled or trickling client "
        "(slowloris) cannot hold connections.",
    )
    encoders: list[str] = Field(
        default_factory=list, description="Static encoder addresses (host:port)."
    )
    languages: list[str] = Field(
        default_factory=list, description="Static language addresses (host:port)."
    )
    encoder_dns: str = Field(
        "", description="DNS name:port resolving to all encoders (e.g. a headless Service)."
    )
    language_dns: str = Field("", description="DNS name:port resolving to all language pods.")
    prefills: list[str] = Field(
        default_factory=list,
        description="E/P/D: static addresses of prefill instances (language --role prefill). "
        "With any (or prefill_dns), `languages` are decode instances (--role decode): each "
        "request's prompt runs on a prefill instance, its decoding on a decode instance.",
    )
    prefill_dns: str = Field("", description="E/P/D: DNS name:port resolving to all prefill "
                             "pods.")
    dns_refresh_s: float = Field(10.0, gt=0, le=3600, description="DNS re-resolve period.")
    load_refresh_s: float = Field(0.5, gt=0, le=60, description="GetLoad polling period.")
    policy: str = Field(
        "least_load",
        pattern="^(least_load|round_robin)$",
        description="Instance selection policy (least_load uses image-hash affinity).",
    )
    eject_after_failures: int = Field(
        3, ge=1, le=100, description="Consecutive failures that eject an instance."
    )
    max_inflight: int = Field(
        256, ge=1, le=100000, description="In-flight requests; beyond it answer 429."
    )
    encoder_retries: int = Field(
        1, ge=0, le=10, description="Retries on another encoder before the prompt is delivered."
    )
    request_retries: int = Field(
        1, ge=0, le=5, description="Whole-request retries when instances fail before any output."
    )
    api_key: str = Field("", description="If set, required as Bearer token / gRPC metadata "
                         "(its callers are tenant 'default').")
    api_keys_file: str = Field(
        "",
        description="A YAML (or .json) file of tenants and their API keys, `tenants: {name: "
        "{keys: [...], max_inflight: N}}` (services/router/tenants.py): a request's key names "
        "its tenant; caches (prefix, image embeddings) are shared only within a tenant and "
        "its cache_salt, and a tenant's requests in flight are bounded by its max_inflight.",
    )
    client_id_header: str = Field(
        "", pattern="^[A-Za-z0-9-]*$",
        description="Header (HTTP) / metadata key (gRPC) whose first address names the "
        "client, e.g. 'x-forwarded-for', for the encoders' fair share of preprocessing per "
        "client. Set it only behind a proxy that sets it (a client could forge it); empty = "
        "the connection's remote address.",
    )
    refusal_bytes_per_s: int = Field(
        256 * 1024, ge=0,
        description="Per client (its address, see client_id_header), the budget of refused "
        "bytes refilled each second: every request answered 4xx (not 429) costs its size "
        "(at least 4 KiB); a client past its budget has its next requests held, unread, one "
        "at a time until it is repaid (services/router/refusals.py). Served requests cost "
        "nothing. 0 turns it off.",
    )
    refusal_burst_bytes: int = Field(
        4 * 1024 * 1024, ge=0, description="Refused bytes a client may send at once before "
        "it is held (the budget's size)."
    )
    refusal_max_hold_s: float = Field(
        30.0, gt=0, le=3600, description="Longest a client in debt is held; a request that "
        "would wait longer is answered 429 with Retry-After."
    )
    tls_cert: str = Field("", description="PEM certificate for the gRPC port (enables TLS).")
    tls_key: str = Field("", description="PEM private key for the gRPC port.")
    max_image_bytes: int = Field(
        20 * 1024 * 1024, ge=1024, description="Largest inline image accepted (bytes); 413 above."
    )
    max_video_bytes: int = Field(
        64 * 1024 * 1024, ge=1024,
        description="Largest inline video accepted (bytes); 413 above. A data URL is also "
        "bounded by max_request_bytes; the encoders' own max_video_bytes applies after.",
    )
    max_request_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Largest HTTP/gRPC request body (bytes); 413 above."
    )
    affinity_slack: float = Field(
        0.25, ge=0, le=10, description="Image affinity yields once load exceeds mean*(1+slack)+1."
    )
    split_encoders: int = Field(
        1, ge=1, le=64,
        description="Most encoders one prompt's media are split across: a prompt with at "
        "least 2 images/videos, or with a video (split by temporal groups; counted from the "
        "chat's parts), gets up to split_encoders-1 helpers (EncodeRequest.helpers), the "
        "least loaded other healthy encoders serving the same model, never more than its "
        "media count-1 without a video; the encoder it is sent to decides the ranges. "
        "1 = never split.",
    )
    split_max_helper_load: float = Field(
        0, ge=0,
        description="A helper of a split prompt carries at most this many requests in "
        "flight (this router's and, from GetLoad, others'); 0 = idle encoders only: under "
        "load every encoder's ViT is busy with its own requests, and a split would only "
        "move work around (plus the helper's own rendering of the whole chat).",
    )
    encoder_bypass: bool = Field(
        True, description="Send chats without an image straight to a language instance, "
        "which tokenizes them itself (no encoder, room or transfer); --no-encoder-bypass "
        "sends every chat through an encoder.",
    )
    drain_timeout_s: float = Field(
        10.0, ge=0, le=3600, description="On SIGTERM, wait this long for in-flight requests."
    )
