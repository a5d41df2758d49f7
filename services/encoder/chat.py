"""The encoder's view of one Encode call in plain data (the chat types are `tandem.chat`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.chat import (
    Limits,
    Message,
    TemplateOptions,
    messages_from_proto,
    template_options_from_proto,
    tools_from_json,
)


@dataclass
class EncodeJob:
    """One Encode call in plain data."""

    room: int
    request_id: str
    messages: list[Message]
    limits: Limits = field(default_factory=Limits)
    deadline_unix_ms: int = 0
    tools: list[dict] | None = None  # OpenAI's `tools`, rendered by the chat template
    client_id: str = ""  # the caller's key for the fair share of preprocessing ("" = own)
    # how the chat template renders the chat (chat_template_kwargs, generation prompt)
    template: TemplateOptions = field(default_factory=TemplateOptions)
    cache_salt: str = ""  # the cache namespace its media keys live in ("" = shared)


def job_from_proto(req) -> EncodeJob:
    """`EncodeRequest` -> `EncodeJob`."""
    return EncodeJob(
        room=req.room,
        request_id=req.request_id,
        messages=messages_from_proto(req.messages),
        limits=Limits(
            max_prompt_tokens=max(0, req.limits.max_prompt_tokens),
            max_images=max(0, req.limits.max_images),
        ),
        deadline_unix_ms=req.deadline_unix_ms,
        tools=tools_from_json(req.tools_json),
        client_id=req.client_id,
        template=template_options_from_proto(req.template_options),
        cache_salt=req.cache_salt,
    )
