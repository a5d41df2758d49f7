"""Tandem's gRPC SDK. Light: imports grpc and the generated protos, never torch.

    from tandem.client import Client, image, video
    with Client("127.0.0.1:50051") as c:
        r = c.chat([{"role": "user", "content": [image("cat.png"), "What is this?"]}])
        r = c.chat([{"role": "user", "content": [video("clip.mp4", fps=1), "What happens?"]}])
        print(r.text, r.usage, r.finish_reason, r.timings)
"""

from tandem.client.aio import AsyncClient
from tandem.client.content import (
    image,
    image_from_bytes,
    image_from_path,
    image_from_pil,
    image_from_url,
    text,
    to_messages,
    video,
)
from tandem.client.errors import (
    AuthenticationError,
    DeadlineExceededError,
    InternalError,
    InvalidRequestError,
    NotFoundError,
    RequestCancelledError,
    ResourceExhaustedError,
    TandemError,
    UnavailableError,
)
from tandem.client.results import ChatResult, EncoderRange, StageTimings, ToolCall, Usage
from tandem.client.sync import Client

__all__ = [
    "AsyncClient", "AuthenticationError", "ChatResult", "Client", "DeadlineExceededError",
    "EncoderRange", "InternalError", "InvalidRequestError", "NotFoundError", "RequestCancelledError",
    "ResourceExhaustedError", "StageTimings", "TandemError", "ToolCall", "UnavailableError",
    "Usage",
    "image", "image_from_bytes", "image_from_path", "image_from_pil", "image_from_url", "text",
    "to_messages", "video",
]
