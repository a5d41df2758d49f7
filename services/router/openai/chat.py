"""OpenAI chat-completions request schema (pydantic, with bounds; the sampling fields it
shares with the completions API are `sampling.py`) and its conversion to the wire
protos (text, image_url and video_url parts, and qwen-vl-utils' `video` given as frames).
Nothing is silently dropped: every field is honoured, hint-only (`user`, `parallel_tool_calls`, an image's `detail`: OpenAI treats them
as hints too), or refused with a 400 naming it (`param`): unknown fields by
`extra="forbid"` (vLLM's extras that are not served with their reason,
`sampling.VLLM_REFUSED`), and values we cannot serve by their bounds (the request-level ones, n, timeout_ms, media
bytes, stop strings' length: bounds.py, checked by the router core for both doors). docs/sdk.md
lists them.

vLLM's chat extras honoured here: chat_template_kwargs, add_generation_prompt and
continue_final_message (how the tiers' chat template renders the chat: the wire's
ChatTemplateOptions), echo (the reply after the last message's text: format.ChatShape),
mm_processor_kwargs (min_pixels / max_pixels: every image's and video's resize bounds;
fps, num_frames, min_frames, max_frames, total_pixels: every video's frame sampling)."""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.chat import VIDEO_CONTROLS, ChatError, template_options_from_proto
from tandem.services.router.errors import RouterError
from tandem.services.router.openai.sampling import SamplingFields, _Model, _utf8, sampling_params
from tandem.services.router.request import Query
from tandem.services.router.tools import NamedToolChoice, Tool, tool_setup_of
from tandem.v1 import common_pb2, language_pb2


class ImageURL(_Model):
    url: str = Field(min_length=1)
    detail: str | None = None


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImageURLPart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Model):
    """A video and its frame sampling controls (docs/video.md; absent = the checkpoint's,
    a request may tighten its bounds, never loosen them)."""

    url: str = Field(min_length=1)
    fps: float | None = Field(None, gt=0, le=1000)
    num_frames: int | None = Field(None, ge=2, lt=1 << 31)
    min_frames: int | None = Field(None, ge=1, lt=1 << 31)
    max_frames: int | None = Field(None, ge=1, lt=1 << 31)
    min_pixels: int | None = Field(None, ge=1, lt=1 << 31)
    max_pixels: int | None = Field(None, ge=1, lt=1 << 31)
    total_pixels: int | None = Field(None, ge=1, lt=1 << 63)


class VideoURLPart(_Model):
    type: Literal["video_url"]
    video_url: VideoURL


class VideoFramesPart(_Model):
    """qwen-vl-utils' `video` part given as its frames: image URLs in order (each as an
    image_url's: a data:image/... URL or an allow-listed http(s) one), every frame used,
    none sampled (docs/video.md, "A video given as frames"). `fps` (or qwen-vl-utils'
    name for it, `sample_fps`) is the rate they were taken at, required; the resize
    bounds are a video_url's. A `video` given as one string (a video file) is refused by
    name: that is a video_url part."""

    type: Literal["video"]
    video: Annotated[list[str], Field(min_length=1, max_length=1 << 16)] | str
    fps: float | None = Field(None, gt=0, le=1000)
    sample_fps: float | None = Field(None, gt=0, le=1000)
    min_pixels: int | None = Field(None, ge=1, lt=1 << 31)
    max_pixels: int | None = Field(None, ge=1, lt=1 << 31)
    total_pixels: int | None = Field(None, ge=1, lt=1 << 63)


class UnservedPart(BaseModel):
    """A content part OpenAI or vLLM define that is not served here (audio, files): parsed
    only so that it is refused by name (`chat_messages`), not as a schema error."""

    model_config = ConfigDict(extra="allow")
    type: Literal["input_audio", "audio_url", "file"]


UNSERVED = {"input_audio": "audio input is not supported",
            "audio_url": "audio input is not supported",
            "file": "file inputs are not supported"}
Part = Annotated[TextPart | ImageURLPart | VideoURLPart | VideoFramesPart | UnservedPart,
                 Field(discriminator="type")]


class FunctionCall(_Model):
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=1 << 20)  # a JSON object as text


class ToolCall(_Model):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: FunctionCall


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)  # assistant
    tool_call_id: str | None = Field(None, min_length=1, max_length=256)  # tool
    # the participant's name: to the chat template, which renders it where it reads it
    name: str | None = Field(None, min_length=1, max_length=256)


class TemplateFields(_Model):
    """vLLM's extras on how the chat template renders a chat (chat and /tokenize)."""

    chat_template_kwargs: dict | None = None  # the template's own variables
    add_generation_prompt: bool | None = None  # None: unless the chat ends with assistant
    continue_final_message: bool = False

    def template_options(self) -> common_pb2.ChatTemplateOptions:
        """The wire's ChatTemplateOptions, checked as the tiers check them (a 400 naming
        the field: chat_template_kwargs.<key>, continue_final_message)."""
        opts = common_pb2.ChatTemplateOptions(
            continue_final_message=self.continue_final_message)
        if self.add_generation_prompt is not None:
            opts.add_generation_prompt = self.add_generation_prompt
        if self.chat_template_kwargs is not None:
            opts.kwargs_json = _utf8(json.dumps(self.chat_template_kwargs, ensure_ascii=False),
                                     "chat_template_kwargs")
        try:
            template_options_from_proto(opts)
        except ChatError as e:
            raise RouterError("INVALID_ARGUMENT", e.detail, e.field) from None
        return opts


class ChatCompletionRequest(SamplingFields, TemplateFields):
    messages: list[Message] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = None  # max_tokens' new name (bounds: tandem.sampling)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # Hint only (accepted, no effect), as documented in docs/sdk.md.
    parallel_tool_calls: bool | None = None  # a forced call is one call
    # vLLM extensions
    echo: bool = False  # the reply after the last message's text, when it continues it
    mm_processor_kwargs: dict | None = None  # images' resize bounds, videos' sampling


def _image_part(url: str, param: str) -> common_pb2.ImagePart:
    """data: URLs are decoded here (bad base64 -> 400; too large -> 413 by bounds.py) and
    sent as bytes; http(s) URLs go to the encoder, whose allow-list decides."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise RouterError("INVALID_ARGUMENT", "image data URL must be base64-encoded", param)
        if not header.startswith("data:image/"):  # e.g. data:text/plain: not an image
            raise RouterError("INVALID_ARGUMENT", "image data URL must have an image/* type",
                              param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RouterError("INVALID_ARGUMENT", "image data URL is not valid base64", param) from None
        if not data:
            raise RouterError("INVALID_ARGUMENT", "image data URL is empty", param)
        return common_pb2.ImagePart(data=data)
    if url.startswith(REMOTE_SCHEMES):
        return common_pb2.ImagePart(url=url)
    raise RouterError("INVALID_ARGUMENT", "image_url must be a data:, http(s) or file: URL",
                      param)


# URLs the router passes on unread: the encoder fetches http(s) under its allow-list and
# reads file: only under its --allowed-local-media-path (refused there when unset), so
# the rule for each lives in one place, the encoder's media code.
REMOTE_SCHEMES = ("http://", "https://", "file:")


def _video_part(v: VideoURL, param: str) -> common_pb2.VideoPart:
    """As `_image_part`, for a video (a data URL must be video/*); its sampling controls go
    along as given (the encoder checks them against the checkpoint's rules)."""
    if v.fps is not None and v.num_frames is not None:
        raise RouterError("INVALID_ARGUMENT", "fps and num_frames cannot go together: "
                          "sample at a rate or a count", param)
    controls = {k: getattr(v, k) for k in VIDEO_CONTROLS if getattr(v, k) is not None}
    url = v.url
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise RouterError("INVALID_ARGUMENT", "video data URL must be base64-encoded", param)
        if not header.startswith("data:video/"):  # e.g. data:image/png: not a video
            raise RouterError("INVALID_ARGUMENT", "video data URL must have a video/* type "
                              "(video/mp4, video/webm, ...)", param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RouterError("INVALID_ARGUMENT", "video data URL is not valid base64", param) from None
        if not data:
            raise RouterError("INVALID_ARGUMENT", "video data URL is empty", param)
        return common_pb2.VideoPart(data=data, **controls)
    if url.startswith(REMOTE_SCHEMES):
        return common_pb2.VideoPart(url=url, **controls)
    raise RouterError("INVALID_ARGUMENT", "video_url must be a data:, http(s) or file: URL",
                      param)


def _frames_part(p: VideoFramesPart, where: str) -> common_pb2.VideoPart:
    """A video given as frames -> a VideoPart with `frames`: each frame an image URL, read
    as an image_url's (`_image_part`: a data URL decoded here; http(s) for the encoder's
    allow-list; their bytes bounded by bounds.py). Errors name the wire's fields
    (`...video.frames[k]`), which the body spells `...video[k]` (openai/errors.py)."""
    if isinstance(p.video, str):
        raise RouterError("INVALID_ARGUMENT", "a `video` part is a list of frames (image "
                          "URLs); a video file is a video_url part ({\"type\": \"video_url\", "
                          "\"video_url\": {\"url\": ...}})", f"{where}.video.frames")
    if None not in (p.fps, p.sample_fps) and p.fps != p.sample_fps:
        raise RouterError("INVALID_ARGUMENT", "fps and sample_fps name the same rate and "
                          "differ", f"{where}.sample_fps")
    fps = p.fps if p.fps is not None else p.sample_fps
    if fps is None:
        raise RouterError("INVALID_ARGUMENT", "a video given as frames needs fps (or "
                          "sample_fps): the rate its frames were taken at", f"{where}.fps")
    frames = common_pb2.VideoFrames()
    for k, url in enumerate(p.video):
        img = _image_part(url, f"{where}.video.frames[{k}]")
        frames.frames.add(**{img.WhichOneof("source"): getattr(img, img.WhichOneof("source"))})
    pixels = {k: getattr(p, k) for k in ("min_pixels", "max_pixels", "total_pixels")
              if getattr(p, k) is not None}
    return common_pb2.VideoPart(frames=frames, fps=fps, **pixels)


class TokenizeBody(TemplateFields):
    """vLLM's /tokenize: a raw `prompt` or text-only `messages` (rendered as for a chat,
    with the same template options)."""

    model: str = ""
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1, max_length=4096)


class DetokenizeBody(_Model):
    model: str = ""
    tokens: list[int] = Field(max_length=1 << 20)


def to_tokenize_request(body: TokenizeBody) -> language_pb2.TokenizeRequest:
    if (body.prompt is None) == (body.messages is None):
        raise RouterError("INVALID_ARGUMENT", "give exactly one of prompt and messages",
                          "prompt")
    if body.prompt is not None:
        return language_pb2.TokenizeRequest(prompt=_utf8(body.prompt, "prompt"))
    msgs = chat_messages(body.messages)
    if any(p.WhichOneof("part") in ("image", "video") for m in msgs for p in m.content):
        raise RouterError("INVALID_ARGUMENT", "/tokenize takes text-only messages", "messages")
    return language_pb2.TokenizeRequest(messages=msgs, template_options=body.template_options())


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id_from_header(value: str | None) -> str:
    """The caller's X-Request-Id (letters, digits, `._:-`, at most 128), or a new one;
    anything else is a 400 rather than an id we would log or echo unchecked."""
    if value is None:
        return uuid.uuid4().hex[:24]
    if not _REQUEST_ID.fullmatch(value):
        raise RouterError("INVALID_ARGUMENT", "X-Request-Id must be 1-128 characters of "
                          "letters, digits and ._:-", "X-Request-Id")
    return value


def chat_messages(body_messages: list[Message]) -> list[common_pb2.ChatMessage]:
    """Validated messages -> the wire's ChatMessages (raises RouterError on bad input)."""
    messages = []
    for i, m in enumerate(body_messages):
        role = "system" if m.role == "developer" else m.role
        msg = common_pb2.ChatMessage(role=role, tool_call_id=m.tool_call_id or "",
                                     name=_utf8(m.name or "", f"messages[{i}].name"))
        if m.role == "tool" and not m.tool_call_id:
            raise RouterError("INVALID_ARGUMENT", "a tool message needs tool_call_id",
                              f"messages[{i}].tool_call_id")
        if m.tool_calls and m.role != "assistant":
            raise RouterError("INVALID_ARGUMENT", "only an assistant message has tool_calls",
                              f"messages[{i}].tool_calls")
        for j, call in enumerate(m.tool_calls or []):
            param = f"messages[{i}].tool_calls[{j}].function.arguments"
            try:
                ok = isinstance(json.loads(call.function.arguments), dict)
            except ValueError:
                ok = False
            if not ok:
                raise RouterError("INVALID_ARGUMENT", "arguments must be a JSON object", param)
            msg.tool_calls.add(id=call.id, name=call.function.name,
                               arguments=_utf8(call.function.arguments, param))
        if isinstance(m.content, str):
            msg.content.add(text=_utf8(m.content, f"messages[{i}].content"))
        elif m.content is not None:
            for j, part in enumerate(m.content):
                if isinstance(part, TextPart):
                    msg.content.add(text=_utf8(part.text, f"messages[{i}].content[{j}].text"))
                elif isinstance(part, UnservedPart):
                    raise RouterError("INVALID_ARGUMENT", UNSERVED[part.type],
                                      f"messages[{i}].content[{j}]")
                elif isinstance(part, VideoURLPart):
                    param = f"messages[{i}].content[{j}].video_url"
                    msg.content.add(video=_video_part(part.video_url, param))
                elif isinstance(part, VideoFramesPart):
                    msg.content.add(video=_frames_part(part, f"messages[{i}].content[{j}]"))
                else:
                    param = f"messages[{i}].content[{j}].image_url"
                    msg.content.add(image=_image_part(part.image_url.url, param))
        messages.append(msg)
    return messages


# mm_processor_kwargs: the processor's options a request may set. min_pixels / max_pixels
# bound every image's and video's resize (as transformers' processor applies them to both);
# the others are videos' sampling controls (docs/video.md).
MM_IMAGE_KWARGS = ("min_pixels", "max_pixels")
MM_PROCESSOR_KWARGS = VIDEO_CONTROLS
# The kwargs that sample a video's frames: a video given as frames is not sampled.
MM_SAMPLING_KWARGS = ("fps", "num_frames", "min_frames", "max_frames")


def _mm_kwarg(key: str, value) -> None:
    param = f"mm_processor_kwargs.{key}"
    if key not in MM_PROCESSOR_KWARGS:
        raise RouterError("INVALID_ARGUMENT", f"{param} is not supported: only "
                          f"{', '.join(MM_PROCESSOR_KWARGS)} (the images' and videos' resize "
                          "bounds, the videos' frame sampling) are honoured", param)
    if key == "fps":
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not 0 < value <= 1000):
            raise RouterError("INVALID_ARGUMENT", f"{param} must be a number in (0, 1000]",
                              param)
        return
    top = 1 << 63 if key == "total_pixels" else 1 << 31
    low = 2 if key == "num_frames" else 1
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < top:
        raise RouterError("INVALID_ARGUMENT", f"{param} must be an integer in [{low}, "
                          f"2^{top.bit_length() - 1})", param)


def apply_mm_processor_kwargs(kwargs: dict | None,
                              messages: list[common_pb2.ChatMessage]) -> None:
    """vLLM's mm_processor_kwargs onto every image and video: min_pixels / max_pixels
    become each image's resize bounds (the encoder clamps them into its own: tighter, never
    looser) and each video's; fps, num_frames, min_frames, max_frames and total_pixels each
    video's sampling controls. A part's own control wins over the kwarg of its name; a
    part that sets fps or num_frames takes neither from the kwargs (they exclude each
    other). A video given as frames takes the resize bounds only, and a chat holding one
    refuses the sampling kwargs (its rate is the part's fps; nothing is sampled). Any
    other key is refused by name."""
    kwargs = kwargs or {}
    for key, value in kwargs.items():
        _mm_kwarg(key, value)
    if "fps" in kwargs and "num_frames" in kwargs:
        raise RouterError("INVALID_ARGUMENT", "fps and num_frames cannot go together: sample "
                          "at a rate or a count", "mm_processor_kwargs.num_frames")
    lo, hi = (kwargs.get(k, 0) for k in MM_IMAGE_KWARGS)
    if lo and hi and lo > hi:
        raise RouterError("INVALID_ARGUMENT", f"min_pixels {lo} is more than max_pixels {hi}",
                          "mm_processor_kwargs.min_pixels")
    for m in messages:
        for part in m.content:
            kind = part.WhichOneof("part")
            if kind == "image":
                part.image.min_pixels, part.image.max_pixels = lo, hi
            elif kind == "video" and part.video.WhichOneof("source") == "frames":
                for key, value in kwargs.items():
                    if key in MM_SAMPLING_KWARGS:
                        raise RouterError("INVALID_ARGUMENT", f"{key} does not apply to a "
                                          "video given as frames (the chat has one): every "
                                          "frame is used, at the rate its part's fps states",
                                          f"mm_processor_kwargs.{key}")
                    if not getattr(part.video, key):
                        setattr(part.video, key, value)
            elif kind == "video":
                v = part.video
                rate_set = bool(v.fps or v.num_frames)
                for key, value in kwargs.items():
                    if key in ("fps", "num_frames") and rate_set:
                        continue
                    if not getattr(v, key):  # 0: the part leaves it to the kwargs
                        setattr(v, key, value)


def echo_text(body: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's text, which the reply continues when it is
    an assistant message or no generation prompt opens a new turn ("" otherwise)."""
    last = body.messages[-1]
    continued = (last.role == "assistant" or body.add_generation_prompt is False
                 or body.continue_final_message)
    if not body.echo or not continued:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(p.text for p in last.content or [] if isinstance(p, TextPart))


def to_chat_request(body: ChatCompletionRequest, request_id: str) -> Query:
    """Validated body -> front-end-independent request (raises RouterError on bad input);
    `request_id` (request_id_from_header) becomes the response id's suffix."""
    messages = chat_messages(body.messages)
    apply_mm_processor_kwargs(body.mm_processor_kwargs, messages)
    template = body.template_options()
    newer = body.max_completion_tokens is not None
    tools = tool_setup_of(body.tools, body.tool_choice)
    sampling = sampling_params(
        body, body.max_completion_tokens if newer else body.max_tokens, body.logprobs,
        body.top_logprobs or 0, forced=tools.grammar,
        spelled={"max_tokens": "max_completion_tokens"} if newer else None)
    return Query(
        messages=messages,
        sampling=sampling,
        request_id=f"chatcmpl-{request_id}",
        timeout_ms=body.timeout_ms,
        n=body.n,
        stream=body.stream,
        priority=body.priority,
        tools=tools,
        template_options=template,
        cache_salt=body.cache_salt,
    )
