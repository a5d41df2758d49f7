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
    """One Encode call in plain data: what the pipeline encodes, whole (EncodePipeline.encode
    takes it as it is)."""

    messages: list[Message]
    room: int = 0
    request_id: str = ""
    limits: Limits = field(default_factory=Limits)
    # when the work must end (Unix seconds; None: no bound): the call's deadline, resolved
    # by the servicer (the request's, or its default timeout)
    deadline: float | None = None
    tools: list[dict] | None = None  # OpenAI's `tools`, rendered by the chat template
    client_id: str = ""  # the caller's key for the fair share of preprocessing ("" = own)
    # how the chat template renders the chat (chat_template_kwargs, generation prompt)
    template: TemplateOptions = field(default_factory=TemplateOptions)
    cache_salt: str = ""  # the cache namespace its media keys live in ("" = shared)


def inline_fetched(messages, fetched: dict[int, bytes]) -> None:
    """In `messages` (a chat's `repeated ChatMessage`, changed in place), each image whose
    media index (its place among the chat's images and videos, in prompt order: as
    `ChatTemplate.split` lists them) is in `fetched` gets those bytes in place of its URL
    (its other fields kept): what the URL answered the lead, so a split's helper neither
    fetches it again nor can get another answer."""
    k = 0
    for m in messages:
        for p in m.content:
            kind = p.WhichOneof("part")
            if kind not in ("image", "video"):
                continue
            if k in fetched:
                if kind != "image":
                    raise ValueError(f"media {k} is a video: only images are passed on")
                p.image.data = fetched[k]  # NOTE: the `source` oneof: clears the url
            k += 1


def job_from_proto(req, deadline: float | None) -> EncodeJob:
    """`EncodeRequest` -> `EncodeJob`, bounded by `deadline` (serving.deadline_from_proto's
    answer for it)."""
    return EncodeJob(
        room=req.room,
        request_id=req.request_id,
        messages=messages_from_proto(req.messages),
        limits=Limits(
            max_prompt_tokens=max(0, req.limits.max_prompt_tokens),
            max_images=max(0, req.limits.max_images),
        ),
        deadline=deadline,
        tools=tools_from_json(req.tools_json),
        client_id=req.client_id,
        template=template_options_from_proto(req.template_options),
        cache_salt=req.cache_salt,
    )
