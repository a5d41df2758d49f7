"""A chat in plain data, and the checkpoint's chat template: what every tier that reads a
chat shares (the encoder for every chat, the language tier for text-only chats it takes
directly).

Protos are converted into these dataclasses at the boundary (`messages_from_proto`);
nothing past it sees a proto. Every refusal is a `ChatError` naming the offending field the
way the client wrote it (`messages[0].content[1].image`), so one error line tells the
caller what to fix.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from tandem.errors import ServiceError

ROLES = ("system", "user", "assistant", "tool")


class ChatError(ServiceError):
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


def invalid(field: str, message: str) -> ChatError:
    return ChatError(message, field)


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
class VideoOptions:
    """A request's frame sampling controls for one video; None = the checkpoint's video
    processor setting. Each maps onto transformers' video processor kwargs (the encoder's
    `video_rules.Sampling.processor_kwargs`):

    fps          frames sampled per second of video (`fps`)
    num_frames   sample exactly this many frames instead (`num_frames`; not with fps).
                 qwen2_vl rounds it to the temporal patch size; qwen3_vl takes it as is
    min_frames,  bounds on the count that fps gives (`min_frames` / `max_frames`); a
    max_frames   request may lower max_frames, never raise it
    min_pixels   `size["shortest_edge"]`: the floor of a frame's area (qwen2_vl) or of
                 t * h * w (qwen3_vl)
    max_pixels   `size["longest_edge"]`: the cap on a frame's area (qwen2_vl) or on
                 t * h * w (qwen3_vl); never above the checkpoint's
    total_pixels the pixel budget of the whole clip. qwen2_vl: turns its per-frame cap on
                 (`cap_pixels_per_frame`: each frame's cap is max(min(max_pixels,
                 budget * 2 // T), int(1.05 * min_pixels))) with the budget in whole
                 tokens, `max_video_tokens` = floor(total_pixels / (0.9 * factor**2)), as
                 transformers derives the budget (int(max_video_tokens * factor**2 * 0.9));
                 never above the checkpoint's where its cap is on. qwen3_vl: the same knob
                 as max_pixels (the smaller of the two wins)

    Values are checked where the rules apply them (the encoder: a refusal names the part).
    """

    fps: float | None = None
    num_frames: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None


@dataclass(frozen=True)
class VideoInput:
    """One video as the client gave it: exactly one of `data` (the file's bytes), `url` (a
    data: or http(s) URL) and `frames` (the video as its frames, each an image source:
    every frame used, `options.fps` the rate they were taken at) is set; `options` are its
    sampling controls."""

    data: bytes | None = None
    url: str | None = None
    options: VideoOptions = field(default_factory=VideoOptions)
    frames: tuple[ImageInput, ...] = ()


# A content part of a chat message: text, an image or a video.
Part = str | ImageInput | VideoInput
# A chat's image or video, as the template places it.
Media = ImageInput | VideoInput


@dataclass(frozen=True)
class ToolCall:
    """A function call an assistant message made; `arguments` is a JSON object as text."""

    name: str
    arguments: str
    id: str = ""


@dataclass(frozen=True)
class Message:
    """One chat message; `parts` holds text (`str`), images (`ImageInput`) and videos
    (`VideoInput`) in order; an assistant message may carry the calls it made, a tool
    message the call it answers."""

    role: str
    parts: tuple[Part, ...]
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""  # the participant's name (OpenAI's), the template's `name` ("" = none)


def tools_from_json(text: str) -> list[dict] | None:
    """OpenAI's `tools` list from the wire's JSON text ("" = none)."""
    if not text:
        return None
    try:
        tools = json.loads(text)
    except ValueError:
        raise invalid("tools", "tools is not valid JSON") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise invalid("tools", "tools must be a list of objects")
    return tools


@dataclass(frozen=True)
class Limits:
    """Per-request limits (0 = the server's)."""

    max_prompt_tokens: int = 0
    max_images: int = 0


# chat_template_kwargs: a JSON object of the template's own variables, bounded in size and
# nesting. The names below are the server's to give (the chat, its tools, the generation
# prompt) or transformers' (the call's options, the tokenizer's special tokens, the
# template's helpers): a client setting one is refused by name, never let through.
MAX_TEMPLATE_KWARGS_BYTES = 16 << 10
MAX_TEMPLATE_KWARGS_DEPTH = 8
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "return_dict", "return_tensors", "processor_kwargs",
    "return_assistant_tokens_mask", "sanitize_control_tokens", "load_audio_from_video",
    "raise_exception", "strftime_now", "bos_token", "eos_token", "unk_token", "sep_token",
    "pad_token", "cls_token", "mask_token", "additional_special_tokens", "image_token",
    "video_token"})


@dataclass(frozen=True)
class TemplateOptions:
    """How the chat template renders one chat (vLLM's request extras of these names).

    kwargs: the template's own variables (`chat_template_kwargs`, checked by
    `template_kwargs`). add_generation_prompt: None = unless the chat ends with an
    assistant message or continues its last one. continue_final_message: leave the last
    message open (the model continues it)."""

    kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False

    def generation_prompt(self, messages: list[Message]) -> bool:
        if self.add_generation_prompt is not None:
            return self.add_generation_prompt
        return messages[-1].role != "assistant" and not self.continue_final_message


def _depth(value, level: int = 1) -> int:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level)
    return level - 1


def template_kwargs(text: str, where: str = "chat_template_kwargs") -> dict:
    """`chat_template_kwargs` from its JSON text ("" = none): an object of at most
    MAX_TEMPLATE_KWARGS_BYTES, nested at most MAX_TEMPLATE_KWARGS_DEPTH deep, whose keys
    are identifiers the server does not give the template itself (ChatError names them)."""
    if not text:
        return {}
    if len(text.encode()) > MAX_TEMPLATE_KWARGS_BYTES:
        raise invalid(where, f"at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON")
    try:
        kwargs = json.loads(text)
    except (ValueError, RecursionError):
        raise invalid(where, "not valid JSON") from None
    if not isinstance(kwargs, dict):
        raise invalid(where, "must be a JSON object (the chat template's variables by name)")
    if _depth(kwargs) > MAX_TEMPLATE_KWARGS_DEPTH:
        raise invalid(where, f"nested more than {MAX_TEMPLATE_KWARGS_DEPTH} deep")
    for key in kwargs:
        if not key.isidentifier():
            raise invalid(f"{where}.{key}", "a template variable's name is an identifier")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise invalid(f"{where}.{key}", "set by the server itself, not by a request"
                          + (f" (use the request's {key} field)"
                             if key in ("tools", "add_generation_prompt",
                                        "continue_final_message") else ""))
    return kwargs


def template_options_from_proto(opts) -> TemplateOptions:
    """The wire's ChatTemplateOptions, checked (ChatError names the field as vLLM does)."""
    add = opts.add_generation_prompt if opts.HasField("add_generation_prompt") else None
    if add and opts.continue_final_message:
        raise invalid("continue_final_message", "cannot go with add_generation_prompt: "
                      "the last message is either continued or followed by a new turn")
    return TemplateOptions(template_kwargs(opts.kwargs_json), add, opts.continue_final_message)


def load_chat_template(value: str) -> str | None:
    """A deployment's chat template (`--chat-template`, as vLLM takes it): a file's path,
    or the template itself ("\\n" escapes allowed, for one line); "" = the checkpoint's.
    ValueError when it is neither a readable file nor a template."""
    if not value:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:
        pass
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"{value!r} is neither a readable file nor a template")
    if "\n" in value or "\\" not in value:  # a whole template, or one without escapes
        return value
    try:
        return codecs.decode(value, "unicode_escape")
    except UnicodeError:
        return value


def messages_from_proto(msgs) -> list[Message]:
    """`repeated ChatMessage` -> `[Message]`; refuses unknown roles and empty parts."""
    if not msgs:
        raise invalid("messages", "the chat has no messages")
    out: list[Message] = []
    for i, m in enumerate(msgs):
        if m.role not in ROLES:
            raise invalid(f"messages[{i}].role", f"role {m.role!r} is not one of {ROLES}")
        parts: list[Part] = []
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
            elif kind == "video":
                parts.append(_video_from_proto(p.video, f"{where}.video"))
            else:
                raise invalid(where, "content part is empty (neither text, image nor video)")
        calls = []
        for j, c in enumerate(m.tool_calls):
            try:
                ok = isinstance(json.loads(c.arguments), dict) and bool(c.name)
            except ValueError:
                ok = False
            if not ok or m.role != "assistant":
                raise invalid(f"messages[{i}].tool_calls[{j}]", "a tool call needs a name and "
                              "JSON-object arguments, on an assistant message")
            calls.append(ToolCall(c.name, c.arguments, c.id))
        out.append(Message(role=m.role, parts=tuple(parts), tool_calls=tuple(calls),
                           tool_call_id=m.tool_call_id, name=m.name))
    return out


# VideoPart's sampling controls, by name; 0 on the wire is None here (the checkpoint's).
VIDEO_CONTROLS = ("fps", "num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels",
                  "total_pixels")


def _video_from_proto(v, where: str) -> VideoInput:
    src = v.WhichOneof("source")
    if src is None:
        raise invalid(where, "video has neither data, url nor frames")
    options = VideoOptions(**{k: getattr(v, k) or None for k in VIDEO_CONTROLS})
    frames = []
    for k, f in enumerate(v.frames.frames if src == "frames" else ()):
        kind = f.WhichOneof("source")
        if kind is None:
            raise invalid(f"{where}.frames[{k}]", "frame has neither data nor url")
        frames.append(ImageInput(data=f.data if kind == "data" else None,
                                 url=f.url if kind == "url" else None))
    if src == "frames" and not frames:
        raise invalid(f"{where}.frames", "a video given as frames has no frame")
    return VideoInput(data=v.data if src == "data" else None, url=v.url if src == "url" else None,
                      options=options, frames=tuple(frames))


# Tokens a client's text may not spell. NOTE: control tokens come only from the chat
# template. Image placeholders would desynchronise image tokens; a user closing its turn
# with <|im_end|> could open a system turn. The checkpoint's own special tokens are added
# to these at start-up (`ChatTemplate.reserved`).
_RESERVED = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


# No token of a real tokenizer spells more characters than this (long runs of spaces or
# '=' are the longest, far below): a text longer than max_prompt_tokens times it cannot
# fit, and is refused before the tokenizer spends seconds and gigabytes on it.
MAX_CHARS_PER_TOKEN = 64
# Characters tokenized per slice when a long text is first counted (`_certainly_over`).
COUNT_SLICE_CHARS = 1 << 17


def words_in(text: str) -> int:
    """Whitespace-separated words: a lower bound on the tokens of `text`, for the
    checkpoints' tokenizers (byte-level BPE after a regex pre-tokenizer, as Qwen's, or
    SentencePiece splitting by whitespace): no token spans two words. Counted in a few ms
    per MB, so a text far over the limit is refused before the template renders it."""
    return len(text.split())


@dataclass(frozen=True)
class Placeholder:
    """What one image's or video's placeholder becomes in the prompt's text: `token` is the
    placeholder the template writes for it (the processor's image or video token), `text`
    what the processor expands it to (the image's pad tokens; a video's pads, and for
    Qwen3-VL its frames' timestamps and vision start/end tokens)."""

    token: str
    text: str


class ChatTemplate:
    """The checkpoint's chat template and tokenizer (from its processor): chat -> prompt
    token ids, each image or video placeholder expanded as the processor expands it.
    Thread-safe."""

    def __init__(self, processor, chat_template: str | None = None) -> None:
        """`chat_template`: the deployment's own template (`load_chat_template`); None:
        the checkpoint's."""
        self.processor = processor
        self.chat_template = chat_template
        self.image_token: str = processor.image_token
        self.image_token_id: int = processor.image_token_id
        self.video_token: str = processor.video_token
        self._placeholder = re.compile(
            "|".join(re.escape(t) for t in (self.image_token, self.video_token)))
        added = getattr(processor.tokenizer, "added_tokens_decoder", {}).values()
        self.reserved = tuple(sorted(set(_RESERVED) | {t.content for t in added if t.special}))

    def split(self, messages: list[Message]) -> tuple[list[dict], list[tuple[str, Media]]]:
        """(the chat as the template's message dicts, its images and videos in order with
        their field names); refuses text that spells a reserved token."""
        hf_messages, media = [], []
        for i, m in enumerate(messages):
            content = []
            for j, p in enumerate(m.parts):
                where = f"messages[{i}].content[{j}]"
                if isinstance(p, ImageInput):
                    media.append((f"{where}.image", p))
                    content.append({"type": "image"})
                elif isinstance(p, VideoInput):
                    media.append((f"{where}.video", p))
                    content.append({"type": "video"})
                else:
                    for tok in self.reserved:
                        if tok in p:
                            raise invalid(f"{where}.text", f"text contains reserved token {tok}")
                    content.append({"type": "text", "text": p})
            msg = {"role": m.role, "content": content}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments}
                                     for c in m.tool_calls]
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            if m.name:  # rendered only by a template that reads it (Qwen's do not)
                for tok in self.reserved:
                    if tok in m.name:
                        raise invalid(f"messages[{i}].name", f"name contains reserved token {tok}")
                msg["name"] = m.name
            hf_messages.append(msg)
        return hf_messages, media

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the checkpoint's template puts a `tools` list into the prompt (a probe
        render); if not, a chat with tools is refused rather than silently toolless."""
        probe = [{"type": "function", "function": {"name": "tandem_probe_fn", "parameters": {}}}]
        text = self.processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "text", "text": "x"}]}], tools=probe,
            chat_template=self.chat_template, tokenize=False, add_generation_prompt=True)
        return "tandem_probe_fn" in text

    @functools.cached_property
    def variables(self) -> frozenset[str]:
        """The variables the template reads (its undeclared names): the only
        chat_template_kwargs passed on, as transformers itself splits them."""
        from transformers.utils.chat_template_utils import _get_template_variables

        source = self.chat_template or self.processor.chat_template
        if isinstance(source, dict):  # several named templates: the default one renders
            source = source.get("default")
        return _get_template_variables(source)

    def render_kwargs(self, options: TemplateOptions) -> dict:
        """The request's chat_template_kwargs the template reads (a key it does not read
        has no effect, as in vLLM); a special token's name or a string spelling a reserved
        token is refused (ChatError), as in a message's text."""
        special = set(getattr(self.processor.tokenizer, "special_tokens_map", {}) or {})
        out = {}
        for key, value in options.kwargs.items():
            where = f"chat_template_kwargs.{key}"
            if key in special:
                raise invalid(where, "set by the server itself, not by a request")
            text = json.dumps(value, ensure_ascii=False)
            for tok in self.reserved:
                if tok in text:
                    raise invalid(where, f"contains reserved token {tok}")
            if key in self.variables:
                out[key] = value
        return out

    def image_placeholder(self, num_tokens: int) -> Placeholder:
        """An image's placeholder: its pad token repeated `num_tokens` times."""
        return Placeholder(self.image_token, self.image_token * num_tokens)

    def token_ids(self, messages: list[Message], hf_messages: list[dict],
                  placeholders: list[Placeholder], max_prompt_tokens: int,
                  tools: list[dict] | None = None,
                  options: TemplateOptions | None = None) -> list[int]:
        """The prompt's ids: the template rendered (with the generation prompt unless the
        chat ends with an assistant turn or `options` say otherwise, `tools` when given,
        the options' kwargs), the i-th image or video placeholder replaced by
        placeholders[i].text (transformers' `get_text_with_replacements`); refuses a
        template that does not place the chat's images and videos in order, and a prompt
        over `max_prompt_tokens`."""
        options = options or TemplateOptions()
        if tools and not self.renders_tools:
            raise invalid("tools", "this model's chat template does not render tools")
        kwargs = self.render_kwargs(options)
        if options.continue_final_message and not any(
                isinstance(p, str) and p.strip() for p in messages[-1].parts):
            raise invalid("continue_final_message", "the last message has no text to continue")
        texts = [p for m in messages for p in m.parts if isinstance(p, str)]
        chars = sum(len(p) for p in texts)
        if chars > max_prompt_tokens * MAX_CHARS_PER_TOKEN:  # NOTE: before the costly render
            raise invalid("messages", f"the chat's text is {chars} characters, more than a "
                          f"prompt of at most {max_prompt_tokens} tokens can hold")
        words = sum(words_in(p) for p in texts)
        if words > max_prompt_tokens:
            raise invalid("messages", f"the chat's text is {words} words, more than a prompt "
                          f"of at most {max_prompt_tokens} tokens can hold")
        try:
            text = self.processor.apply_chat_template(
                hf_messages, chat_template=self.chat_template, tools=tools or None,
                tokenize=False, add_generation_prompt=options.generation_prompt(messages),
                continue_final_message=options.continue_final_message, **kwargs)
        except ValueError as e:  # transformers: the template dropped the continued message
            if not options.continue_final_message:
                raise
            raise invalid("continue_final_message", f"the chat template cannot continue the "
                          f"last message: {str(e).splitlines()[0]}") from None
        found = self._placeholder.findall(text)
        if found != [p.token for p in placeholders]:  # dropped, duplicated or reordered
            raise invalid("messages", "the chat template does not place every image and "
                          "video in order")
        parts = self._placeholder.split(text)
        expanded = parts[0] + "".join(
            p.text + part for p, part in zip(placeholders, parts[1:], strict=True))
        if self._certainly_over(expanded, max_prompt_tokens):
            raise invalid("messages", f"the prompt is over the limit of {max_prompt_tokens} tokens")
        ids = self.processor.tokenizer(expanded)["input_ids"]
        if len(ids) > max_prompt_tokens:
            raise invalid("messages", f"the prompt is {len(ids)} tokens, over the limit of "
                          f"{max_prompt_tokens}")
        return ids

    def _certainly_over(self, text: str, limit: int) -> bool:
        """True when `text` has more than `limit` tokens, found by tokenizing it slice by
        slice and stopping as soon as the count passes the limit: refusing a long text
        costs about what a legal one does, not what its length would (a flood of 2 MB texts
        took the encoder's CPU from other clients). Slices end before a space (where the
        pre-tokenizer splits anyway); each cut may still add a token, so `limit` plus one
        per slice must be passed. False means: tokenize the whole and count exactly."""
        if len(text) <= COUNT_SLICE_CHARS:
            return False
        n = slices = start = 0
        tok = self.processor.tokenizer
        while start < len(text):
            end = min(len(text), start + COUNT_SLICE_CHARS)
            if end < len(text):
                cut = text.rfind(" ", start + COUNT_SLICE_CHARS // 2, end)
                end = cut if cut > start else end
            n += len(tok(text[start:end], add_special_tokens=False)["input_ids"])
            slices += 1
            if n > limit + slices:
                return True
            start = end
        return False

    def raw_ids(self, prompt: str, max_prompt_tokens: int) -> list[int]:
        """A raw prompt's ids (the completions API: no chat template)."""
        if len(prompt) > max_prompt_tokens * MAX_CHARS_PER_TOKEN:
            raise invalid("prompt", f"the prompt is {len(prompt)} characters, more than "
                          f"{max_prompt_tokens} tokens can hold")
        if words_in(prompt) > max_prompt_tokens:
            raise invalid("prompt", f"the prompt is {words_in(prompt)} words, more than "
                          f"{max_prompt_tokens} tokens can hold")
        if self._certainly_over(prompt, max_prompt_tokens):
            raise invalid("prompt", f"the prompt is over the limit of {max_prompt_tokens} tokens")
        ids = self.processor.tokenizer(prompt)["input_ids"]
        if len(ids) > max_prompt_tokens:
            raise invalid("prompt", f"the prompt is {len(ids)} tokens, over the limit of "
                          f"{max_prompt_tokens}")
        return ids

    def text_only_ids(self, messages: list[Message], max_prompt_tokens: int,
                      tools: list[dict] | None = None,
                      options: TemplateOptions | None = None) -> list[int]:
        """A chat without images or videos -> its prompt ids (either is refused)."""
        hf_messages, media = self.split(messages)
        if media:
            raise invalid(media[0][0], "this path takes text-only chats")
        return self.token_ids(messages, hf_messages, [], max_prompt_tokens, tools, options)
