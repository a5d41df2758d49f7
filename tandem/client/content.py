"""Building chat messages: text, images from a path, bytes or a PIL image, and videos from a
path, bytes or a URL.

`messages` passed to the client may be a plain string (one user turn), or a list of
OpenAI-style dicts whose `content` is a string or a list of parts. A part is a string, a
`ContentPart` from the helpers below, `{"type": "text", "text": ...}`,
`{"type": "image_url", "image_url": {"url": ...}}`, `{"type": "image", "image": X}`
where X is a path, bytes or a PIL image, `{"type": "video_url", "video_url": {"url": ...,
"fps": ..., ...}}`, or `{"type": "video", "video": X, "fps": ..., ...}` where X is a path,
bytes, a URL, or a list of frames (images as `image` takes them; qwen-vl-utils' form, whose
`sample_fps` is also read as `fps`). PIL is imported only when a PIL image is given.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterable
from pathlib import Path

from tandem.chat import VIDEO_CONTROLS
from tandem.v1 import common_pb2


def text(s: str) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(text=s)


def image_from_bytes(data: bytes, *, min_pixels: int = 0, max_pixels: int = 0):
    """An image part from encoded file bytes (PNG, JPEG, WebP, ...)."""
    if not isinstance(data, bytes | bytearray | memoryview) or not data:
        raise ValueError("image bytes must be a non-empty bytes object")
    part = common_pb2.ImagePart(data=bytes(data), min_pixels=min_pixels, max_pixels=max_pixels)
    return common_pb2.ContentPart(image=part)


def image_from_path(path: str | os.PathLike, **kw) -> common_pb2.ContentPart:
    """An image part from a file on disk."""
    return image_from_bytes(Path(path).read_bytes(), **kw)


def image_from_pil(img, *, format: str = "PNG", **kw) -> common_pb2.ContentPart:
    """An image part from a PIL image (encoded losslessly as PNG by default)."""
    buf = io.BytesIO()
    img.save(buf, format=format)
    return image_from_bytes(buf.getvalue(), **kw)


def image_from_url(url: str, **kw) -> common_pb2.ContentPart:
    """A data: URL (decoded here) or an http(s) URL (fetched by the encoder if allowed)."""
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise ValueError("data URL must be base64-encoded")
        return image_from_bytes(base64.b64decode(payload, validate=True), **kw)
    part = common_pb2.ImagePart(url=url, **{k: v for k, v in kw.items() if v})
    return common_pb2.ContentPart(image=part)


def image(source, **kw) -> common_pb2.ContentPart:
    """An image part from a path, bytes, a data/http URL string or a PIL image."""
    if isinstance(source, bytes | bytearray | memoryview):
        return image_from_bytes(bytes(source), **kw)
    if isinstance(source, Path):
        return image_from_path(source, **kw)
    if isinstance(source, str):
        if source.startswith(("data:", "http://", "https://", "file:")):
            return image_from_url(source, **kw)  # file: the encoder reads it (its own path)
        return image_from_path(source, **kw)
    if hasattr(source, "save") and hasattr(source, "size"):
        return image_from_pil(source, **kw)
    raise TypeError(f"cannot make an image from {type(source).__name__}")


def video(source, *, fps: float | None = None, num_frames: int | None = None,
          min_frames: int | None = None, max_frames: int | None = None,
          min_pixels: int | None = None, max_pixels: int | None = None,
          total_pixels: int | None = None) -> common_pb2.ContentPart:
    """A video part from a path, `bytes` (the file: MP4, WebM, ...), or a `data:video/...`
    or http(s) URL string, with its frame sampling controls: `fps` (frames per second of
    video) or `num_frames` (a count), `min_frames` / `max_frames` (bounds on what fps
    gives), `min_pixels` / `max_pixels` / `total_pixels` (resize bounds). An unset control
    is the model's; a request may tighten the model's bounds, never loosen them.

    Or from a list of frames, each an image as `image` takes it (a path, bytes, a
    `data:image/...` or http(s) URL, a PIL image, an [H, W, 3] uint8 array), all one size:
    every frame is used, none sampled, so `fps` (the rate they were taken at) is required
    and num_frames / min_frames / max_frames do not apply (docs/video.md)."""
    given = (fps, num_frames, min_frames, max_frames, min_pixels, max_pixels, total_pixels)
    controls = {k: v for k, v in zip(VIDEO_CONTROLS, given, strict=True) if v is not None}
    if fps is not None and num_frames is not None:
        raise ValueError("fps and num_frames cannot go together: sample at a rate or a count")
    for k, v in controls.items():  # NOTE: 0 on the wire means "the model's": never send it
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
            raise ValueError(f"{k} must be a positive number, got {v!r}")
    if isinstance(source, list | tuple):
        return _frames(source, controls)
    if isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
    elif isinstance(source, str) and source.startswith("data:"):
        header, _, payload = source.partition(",")
        if ";base64" not in header or not header.startswith("data:video/"):
            raise ValueError("a video data URL must be data:video/<type>;base64,...")
        data = base64.b64decode(payload, validate=True)
    elif isinstance(source, str) and source.startswith(("http://", "https://", "file:")):
        return common_pb2.ContentPart(video=common_pb2.VideoPart(url=source, **controls))
    elif isinstance(source, str | os.PathLike):
        data = Path(source).read_bytes()
    else:
        raise TypeError(f"cannot make a video from {type(source).__name__}")
    if not data:
        raise ValueError("video bytes must be a non-empty bytes object")
    return common_pb2.ContentPart(video=common_pb2.VideoPart(data=data, **controls))


def _frames(frames, controls: dict) -> common_pb2.ContentPart:
    """A video given as frames (see `video`)."""
    if not frames:
        raise ValueError("a video given as frames needs at least one frame")
    if "fps" not in controls:
        raise ValueError("a video given as frames needs fps: the rate its frames were taken at")
    sampled = [k for k in ("num_frames", "min_frames", "max_frames") if k in controls]
    if sampled:
        raise ValueError(f"{sampled[0]} does not apply to a video given as frames: every "
                         "frame is used")
    out = common_pb2.VideoFrames()
    for f in frames:
        if hasattr(f, "__array_interface__") and not hasattr(f, "save"):  # an array of pixels
            from PIL import Image

            f = Image.fromarray(f)
        img = image(f).image
        out.frames.add(**{img.WhichOneof("source"): getattr(img, img.WhichOneof("source"))})
    return common_pb2.ContentPart(video=common_pb2.VideoPart(frames=out, **controls))


def _part(p) -> common_pb2.ContentPart:
    if isinstance(p, common_pb2.ContentPart):
        return p
    if isinstance(p, str):
        return text(p)
    if isinstance(p, dict):
        kind = p.get("type")
        if kind == "text":
            return text(p["text"])
        if kind == "image_url":
            ref = p["image_url"]
            return image_from_url(ref["url"] if isinstance(ref, dict) else ref)
        if kind == "image":
            return image(p["image"])
        if kind == "video_url":
            ref = dict(p["video_url"]) if isinstance(p["video_url"], dict) else {
                "url": p["video_url"]}
            return video(ref.pop("url"), **ref)
        if kind == "video":
            controls = {k: p[k] for k in VIDEO_CONTROLS if k in p}
            if "sample_fps" in p:  # qwen-vl-utils' name for a list of frames' rate
                if controls.setdefault("fps", p["sample_fps"]) != p["sample_fps"]:
                    raise ValueError("fps and sample_fps name the same rate and differ")
            return video(p["video"], **controls)
        raise ValueError(f"unknown content part type {kind!r}")
    return image(p)  # a Path, bytes or PIL image given bare


def to_messages(messages) -> list[common_pb2.ChatMessage]:
    """Normalize the accepted message forms into protos."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    out = []
    for m in messages:
        if isinstance(m, common_pb2.ChatMessage):
            out.append(m)
            continue
        content = m.get("content")
        parts: Iterable = [] if content is None else [content] if isinstance(content, str) else content
        # tool calls as OpenAI writes them ({"id", "function": {"name", "arguments"}}) or
        # as ChatResult.tool_calls holds them (.id, .name, .arguments)
        calls = [common_pb2.ToolCall(id=c["id"], name=c["function"]["name"],
                                     arguments=c["function"]["arguments"])
                 if isinstance(c, dict) else
                 common_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                 for c in m.get("tool_calls") or []]
        out.append(common_pb2.ChatMessage(role=m["role"], content=[_part(p) for p in parts],
                                          tool_calls=calls,
                                          tool_call_id=m.get("tool_call_id") or ""))
    if not out:
        raise ValueError("messages must not be empty")
    return out
