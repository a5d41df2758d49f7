"""OpenAI's error shape of a RouterError: `{"error": {"message", "type", "param", "code"}}`,
its `type` from the HTTP status, its `param` the body's name for the input the error names
(a tier names it as the wire spells it)."""

from __future__ import annotations

import re

from tandem.services.router.errors import RouterError

# HTTP status -> OpenAI error type; unlisted: server_error
_OPENAI_TYPE = {
    400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
    401: "authentication_error", 403: "permission_error", 408: "timeout_error",
    429: "rate_limit_error", 504: "timeout_error",
}

# The wire's parts of a chat message that an OpenAI body spells otherwise: a content
# part's `image` / `video` (the encoder's names for them) is the body's `image_url` /
# `video_url`; a video's `frames` (the frames form) is the body's `video` list.
_WIRE_MEDIA_PART = re.compile(r"^(messages\[\d+\]\.content\[\d+\])\.(image|video)(?=$|\.)")
_WIRE_FRAMES = re.compile(r"^(messages\[\d+\]\.content\[\d+\])\.video\.frames(?=$|[\[.])")


def openai_param(wire: str) -> str:
    """A tier's name for an input (the wire's) as an OpenAI body spells it: a sampling
    field sits at the top level there (`sampling.max_tokens` -> `max_tokens`), an image
    part is `image_url` (`messages[0].content[1].image` -> `...content[1].image_url`), a
    video part `video_url`, and a video given as frames the `video` list
    (`...content[1].video.frames[2]` -> `...content[1].video[2]`)."""
    wire = wire.removeprefix("sampling.")
    if frames := _WIRE_FRAMES.match(wire):
        return f"{frames.group(1)}.video{wire[frames.end():]}"
    return _WIRE_MEDIA_PART.sub(r"\1.\2_url", wire)


def openai_type(err: RouterError) -> str:
    return _OPENAI_TYPE.get(err.http_status, "server_error")


def openai_body(err: RouterError) -> dict:
    return {
        "error": {
            "message": err.message,
            "type": openai_type(err),
            "param": openai_param(err.param) if err.param else None,
            "code": err.code.lower(),
        }
    }
