"""Plain-data chat requests and the encoder's typed errors.

The servicer converts proto messages into these dataclasses at the boundary; nothing past
it sees a proto. Every refusal is an `EncodeError` naming the offending field the way the
client wrote it (`messages[0].content[1].image`), so one error line tells the caller what
to fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.errors import ServiceError

ROLES = ("system", "user", "assistant")


class EncodeError(ServiceError):
    """A refusal: `code` is a gRPC status code name, `field` the part of the request it
    concerns (empty when the whole request is meant).

    Every per-request limit (image bytes, pixels, image count, prompt tokens) is an
    INVALID_ARGUMENT: the request itself is too big and retrying it elsewhere cannot help.
    RESOURCE_EXHAUSTED is kept for server capacity, UNAVAILABLE for a draining server.
    """

    code = "INVALID_ARGUMENT"

    def __init__(self, message: str, field: str = "", code: str | None = None) -> None:
        super().__init__(message, code)
        self.field = field

    @property
    def detail(self) -> str:
        """The status message the client sees: the field first, then what is wrong."""
        return f"{self.field}: {self.message}" if self.field else self.message


def invalid(field: str, message: str) -> EncodeError:
    return EncodeError(message, field)


@dataclass(frozen=True)
class ImageInput:
    """One image as the client gave it: exactly one of `data` and `url` is set.

    min_pixels / max_pixels: per-image overrides, 0 = the server's bounds (overrides are
    clamped into the server's [min_pixels, max_pixels], never loosened).
    """

    data: bytes | None = None
    url: str | None = None
    min_pixels: int = 0
    max_pixels: int = 0


@dataclass(frozen=True)
class Message:
    """One chat message; `parts` holds text (`str`) and images (`ImageInput`) in order."""

    role: str
    parts: tuple[str | ImageInput, ...]


@dataclass(frozen=True)
class Limits:
    """Per-request limits (0 = the server's)."""

    max_prompt_tokens: int = 0
    max_images: int = 0


@dataclass
class EncodeJob:
    """One Encode call in plain data."""

    room: int
    request_id: str
    messages: list[Message]
    limits: Limits = field(default_factory=Limits)
    deadline_unix_ms: int = 0


def messages_from_proto(msgs) -> list[Message]:
    """`repeated ChatMessage` -> `[Message]`; refuses unknown roles and empty parts."""
    if not msgs:
        raise invalid("messages", "the chat has no messages")
    out: list[Message] = []
    for i, m in enumerate(msgs):
        if m.role not in ROLES:
            raise invalid(f"messages[{i}].role", f"role {m.role!r} is not one of {ROLES}")
        parts: list[str | ImageInput] = []
        for j, p in enumerate(m.content):
            kind = p.WhichOneof("part")
            where = f"messages[{i}].content[{j}]"
            if kind == "text":
                parts.append(p.text)
            elif kind == "image":
                img = p.image
                src = img.WhichOneof("source")
                if src is None:
                    raise invalid(f"{where}.image", "image has neither data nor url")
                if img.min_pixels < 0 or img.max_pixels < 0:
                    raise invalid(f"{where}.image", "min_pixels/max_pixels must be >= 0")
                parts.append(
                    ImageInput(
                        data=img.data if src == "data" else None,
                        url=img.url if src == "url" else None,
                        min_pixels=img.min_pixels,
                        max_pixels=img.max_pixels,
                    )
                )
            else:
                raise invalid(where, "content part is empty (neither text nor image)")
        out.append(Message(role=m.role, parts=tuple(parts)))
    return out


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
    )
