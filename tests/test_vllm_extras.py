"""vLLM's request extras (issue 30): each honoured, checked against transformers or vLLM's
rule, or refused by name with its reason.

- chat_template_kwargs, add_generation_prompt, continue_final_message: the tiers' chat
  template renders the chat exactly as transformers' `apply_chat_template(..., **kwargs)`
  does, on the language tier's path (text-only chats) and the encoder's (image chats);
  a deployment's own template (`--chat-template`) as well.
- skip_special_tokens, spaces_between_special_tokens: the language tier's detokenizer.
- echo (chat), stream_options.continuous_usage_stats, return_tokens_as_token_ids: the
  router's response shapes.
- mm_processor_kwargs: min_pixels / max_pixels onto every image and video, fps,
  num_frames, min_frames, max_frames, total_pixels onto every video (a part's own control
  wins), any other key refused.
- every other vLLM extra: a 400 naming it, with the reason.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from encoder_peers.chats import png  # noqa: E402

from tandem.chat import (  # noqa: E402
    ChatError,
    ChatTemplate,
    ImageInput,
    Message,
    TemplateOptions,
    template_kwargs,
    template_options_from_proto,
)
from tandem.services.router.config import RouterConfig  # noqa: E402
from tandem.services.router.core import RouterCore  # noqa: E402
from tandem.services.router.openai.app import build_app  # noqa: E402
from tandem.services.router.openai.chat import (  # noqa: E402
    ChatCompletionRequest,
    to_chat_request,
)
from tandem.services.router.openai.sampling import VLLM_REFUSED  # noqa: E402
from tandem.v1 import common_pb2, language_pb2, router_pb2  # noqa: E402

# Qwen3's switch, as its text models' templates spell it: read only when given
THINKING = ("{% if add_generation_prompt and enable_thinking is defined and enable_thinking "
            "is false %}<think>\n\n</think>\n\n{% endif %}")
CFG = RouterConfig(insecure_internal=True)


def hf(messages: list[Message]) -> list[dict]:
    return [{"role": m.role, "content": [{"type": "text", "text": p} for p in m.parts]}
            for m in messages]


def reference_ids(processor, messages: list[Message], **kwargs) -> list[int]:
    """transformers' own token ids of a text-only chat."""
    out = processor.apply_chat_template(hf(messages), tokenize=True, **kwargs)
    return list(out[0] if out and isinstance(out[0], list) else out)


@pytest.fixture(scope="module")
def qwen3(checkpoint):
    from transformers import AutoProcessor

    import tandem  # noqa: F401  (registers the image-only processors)

    return AutoProcessor.from_pretrained(checkpoint("qwen3_vl"))


@pytest.fixture(scope="module")
def thinking_checkpoint(checkpoint, tmp_path_factory):
    """The tiny Qwen3-VL's tokenizer and processor with its chat template extended by
    Qwen3's enable_thinking branch (the weights are not needed to render a chat)."""
    src = checkpoint("qwen3_vl")
    out = tmp_path_factory.mktemp("thinking")
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    template = out / "chat_template.jinja"
    template.write_text(template.read_text() + THINKING)
    return out


CHAT = [Message("system", ("You are terse.",)), Message("user", ("Name a colour.",))]


def test_chat_template_kwargs_render_as_transformers_does(thinking_checkpoint, qwen3):
    """enable_thinking=False on a checkpoint whose template reads it: exactly
    transformers' ids with the same kwarg, and not the ids without it; the same through a
    deployment's --chat-template over the stock checkpoint."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(thinking_checkpoint)
    template = ChatTemplate(proc)
    off = TemplateOptions({"enable_thinking": False})
    got = template.text_only_ids(CHAT, 4096, None, off)
    assert got == reference_ids(proc, CHAT, add_generation_prompt=True, enable_thinking=False)
    assert got != template.text_only_ids(CHAT, 4096)
    assert proc.tokenizer.decode(got).endswith("<think>\n\n</think>\n\n")
    # a key the template does not read has no effect (as in vLLM), and is not refused
    assert template.text_only_ids(CHAT, 4096, None, TemplateOptions(
        {"enable_thinking": False, "reasoning_mode": "deep"})) == got
    # --chat-template: the stock checkpoint rendered with the extended template
    deployed = ChatTemplate(qwen3, qwen3.chat_template + THINKING)
    assert deployed.text_only_ids(CHAT, 4096, None, off) == got
    assert ChatTemplate(qwen3).text_only_ids(CHAT, 4096, None, off) == \
        reference_ids(qwen3, CHAT, add_generation_prompt=True)  # the stock one reads none


def test_continue_final_message_and_add_generation_prompt(qwen3):
    template = ChatTemplate(qwen3)
    prefilled = CHAT + [Message("assistant", ("The colour is",))]
    got = template.text_only_ids(prefilled, 4096, None, TemplateOptions(
        continue_final_message=True))
    assert got == reference_ids(qwen3, prefilled, continue_final_message=True)
    assert qwen3.tokenizer.decode(got).endswith("<|im_start|>assistant\nThe colour is")
    # no generation prompt on a chat ending with a user turn: as transformers renders it
    bare = template.text_only_ids(CHAT, 4096, None, TemplateOptions(add_generation_prompt=False))
    assert bare == reference_ids(qwen3, CHAT, add_generation_prompt=False)
    assert bare != template.text_only_ids(CHAT, 4096)
    # both: refused by name (vLLM refuses them together too)
    both = common_pb2.ChatTemplateOptions(add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatError) as e:
        template_options_from_proto(both)
    assert e.value.field == "continue_final_message"
    with pytest.raises(ChatError) as e:  # nothing to continue
        template.text_only_ids([Message("user", (ImageInput(data=b"x"),))], 4096, None,
                               TemplateOptions(continue_final_message=True))


def test_image_chats_render_the_kwargs_on_the_encoder(checkpoint):
    """The encoder's path: add_vision_id (read by the checkpoint's template) gives exactly
    processor(text=apply_chat_template(..., add_vision_id=True), images) ids."""
    from PIL import Image
    from transformers import AutoProcessor

    from tandem.services.encoder.config import EncoderConfig
    from tandem.services.encoder.pipeline import EncodePipeline

    path = checkpoint("qwen2_5_vl")
    pre = EncodePipeline.from_config(EncoderConfig(model=str(path), device="cpu",
                                                   dtype="float32")).preprocessor
    proc = AutoProcessor.from_pretrained(path)
    data = png(96, 64, 3)
    chat = [Message("user", (ImageInput(data=data), "What is this?"))]
    got = pre(chat, options=TemplateOptions({"add_vision_id": True})).input_ids.tolist()
    text = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
        tokenize=False, add_generation_prompt=True, add_vision_id=True)
    want = proc(text=[text], images=[Image.open(io.BytesIO(data)).convert("RGB")],
                return_tensors="pt")["input_ids"][0].tolist()
    assert got == want
    assert "Picture 1: " in proc.tokenizer.decode(got)
    assert got != pre(chat).input_ids.tolist()


@pytest.mark.parametrize("text,field", [
    ("[1, 2]", "chat_template_kwargs"),
    ('"on"', "chat_template_kwargs"),
    ("{nope", "chat_template_kwargs"),
    (json.dumps({"x": "y" * (16 << 10)}), "chat_template_kwargs"),
    (json.dumps({"x": [[[[[[[[[1]]]]]]]]]}), "chat_template_kwargs"),
    ("[" * 100_000, "chat_template_kwargs"),
    (json.dumps({"messages": []}), "chat_template_kwargs.messages"),
    (json.dumps({"add_generation_prompt": False}), "chat_template_kwargs.add_generation_prompt"),
    (json.dumps({"eos_token": "x"}), "chat_template_kwargs.eos_token"),
    (json.dumps({"not-a-name": 1}), "chat_template_kwargs.not-a-name"),
])
def test_bad_template_kwargs_are_refused_by_name(text, field):
    with pytest.raises(ChatError) as e:
        template_kwargs(text)
    assert e.value.field == field


def test_template_kwargs_may_not_spell_reserved_tokens(qwen3):
    template = ChatTemplate(qwen3)
    for kwargs, field in (({"note": "<|im_start|>system"}, "chat_template_kwargs.note"),
                          ({"pad_token": "x"}, "chat_template_kwargs.pad_token")):
        with pytest.raises(ChatError) as e:
            template.text_only_ids(CHAT, 4096, None, TemplateOptions(kwargs))
        assert e.value.field == field


# -- the language tier's detokenizer --


class SpacedTokenizer:
    """A tokenizer whose decoder puts a space between tokens (as SentencePiece-style
    decoders can around added tokens)."""

    vocab = {0: "a", 1: "b", 2: "<sep>"}
    added_tokens_decoder = {2: type("T", (), {"content": "<sep>"})()}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(self.vocab[i] for i in ids if not (skip_special_tokens and i == 2))


def detok(tok, ids, **kw) -> str:
    from tandem.services.language.engine.detokenizer import IncrementalDetokenizer

    d = IncrementalDetokenizer(tok, **kw)
    return "".join(d.add([t]) for t in ids) + d.flush()


def test_special_tokens_in_the_output(qwen3):
    tok = qwen3.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok("Hello there")["input_ids"] + [end] + tok(" more")["input_ids"]
    assert detok(tok, ids) == tok.decode(ids, skip_special_tokens=True) == "Hello there more"
    kept = detok(tok, ids, skip_special_tokens=False)
    assert kept == tok.decode(ids) == "Hello there<|im_end|> more"
    # byte-level BPE: no separators to drop, the same text either way
    assert detok(tok, ids, skip_special_tokens=False, spaces_between_special_tokens=False) == kept
    # a decoder that separates tokens: false joins each added token without them
    spaced = SpacedTokenizer()
    assert detok(spaced, [0, 2, 2, 1], skip_special_tokens=False) == "a <sep> <sep> b"
    assert detok(spaced, [0, 2, 2, 1], skip_special_tokens=False,
                 spaces_between_special_tokens=False) == "a<sep><sep>b"
    assert detok(spaced, [0, 2, 1]) == "a b"  # skipped: the option does not apply (vLLM)


# -- the router's HTTP edge --


def client() -> TestClient:
    return TestClient(build_app(RouterCore(CFG)))


def body(**kw) -> dict:
    return {"model": "", "messages": [{"role": "user", "content": "hi"}], **kw}


def request(**kw):
    return to_chat_request(ChatCompletionRequest.model_validate(body(**kw)), "x")


def test_template_options_reach_the_wire():
    req = request(chat_template_kwargs={"enable_thinking": False}, add_generation_prompt=False)
    opts = req.template_options
    assert json.loads(opts.kwargs_json) == {"enable_thinking": False}
    assert opts.HasField("add_generation_prompt") and not opts.add_generation_prompt
    assert not request().template_options.HasField("add_generation_prompt")
    # /tokenize takes the same fields
    from tandem.services.router.openai.chat import TokenizeBody, to_tokenize_request

    t = to_tokenize_request(TokenizeBody.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}))
    assert isinstance(t, language_pb2.TokenizeRequest) and t.template_options.continue_final_message


@pytest.mark.parametrize("extra,param", [
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"mm_processor_kwargs": {"nframes": 2}}, "mm_processor_kwargs.nframes"),
    ({"mm_processor_kwargs": {"fps": 0}}, "mm_processor_kwargs.fps"),
    ({"mm_processor_kwargs": {"fps": True}}, "mm_processor_kwargs.fps"),
    ({"mm_processor_kwargs": {"num_frames": 1}}, "mm_processor_kwargs.num_frames"),
    ({"mm_processor_kwargs": {"fps": 2, "num_frames": 4}}, "mm_processor_kwargs.num_frames"),
    ({"mm_processor_kwargs": {"max_pixels": "big"}}, "mm_processor_kwargs.max_pixels"),
    ({"mm_processor_kwargs": {"min_pixels": 5000, "max_pixels": 4000}},
     "mm_processor_kwargs.min_pixels"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
])
def test_bad_extras_are_400_naming_them(extra, param):
    r = client().post("/v1/chat/completions", json=body(**extra))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    # a field this server takes, its value refused (not the refusal of an unknown field)
    assert err["param"] == param and "not supported by this server" not in err["message"], err


def test_mm_processor_kwargs_bound_every_image():
    url = "data:image/png;base64," + __import__("base64").b64encode(png(8, 8, 1)).decode()
    part = {"type": "image_url", "image_url": {"url": url}}
    req = to_chat_request(ChatCompletionRequest.model_validate(body(
        messages=[{"role": "user", "content": [part, part, {"type": "text", "text": "?"}]}],
        mm_processor_kwargs={"min_pixels": 3136, "max_pixels": 200704})), "x")
    images = [p.image for p in req.messages[0].content if p.WhichOneof("part") == "image"]
    assert [(i.min_pixels, i.max_pixels) for i in images] == [(3136, 200704)] * 2


def test_mm_processor_kwargs_sample_every_video_unless_its_part_says_otherwise():
    url = "https://example.com/v.mp4"
    parts = [{"type": "video_url", "video_url": {"url": url}},
             {"type": "video_url", "video_url": {"url": url, "num_frames": 6, "max_pixels": 9999}},
             {"type": "video_url", "video_url": {"url": url, "fps": 0.5}}]
    req = to_chat_request(ChatCompletionRequest.model_validate(body(
        messages=[{"role": "user", "content": parts}],
        mm_processor_kwargs={"fps": 1.5, "max_frames": 12, "max_pixels": 50176,
                             "total_pixels": 10**9})), "x")
    got = [(p.video.fps, p.video.num_frames, p.video.max_frames, p.video.max_pixels,
            p.video.total_pixels) for p in req.messages[0].content]
    # a part's own control wins; a part that picks a rate or a count takes neither
    assert got == [(1.5, 0, 12, 50176, 10**9), (0, 6, 12, 9999, 10**9),
                   (0.5, 0, 12, 50176, 10**9)]


# vLLM's chat-completions request extras (vllm/entrypoints/openai/.../protocol.py,
# ChatCompletionRequest: the fields beyond OpenAI's)
VLLM_CHAT_EXTRAS = [
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking",
    "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "truncation_side", "prompt_logprobs", "logprob_token_ids",
    "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template",
    "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
    "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id",
    "session_id", "return_tokens_as_token_ids", "return_token_ids", "return_token_offsets",
    "return_prompt_text", "return_mm_kwargs", "routed_experts_prompt_start", "cache_salt",
    "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "repetition_detection",
    "stream_interval", "logits_processors", "thinking_token_budget", "include_reasoning",
    "reasoning_effort", "typical_p",
]


def test_every_vllm_chat_extra_is_honoured_or_refused_with_its_reason():
    served = set(ChatCompletionRequest.model_fields)
    c = client()
    refused = set()
    for name in VLLM_CHAT_EXTRAS:
        if name in served:
            continue
        r = c.post("/v1/chat/completions", json=body(**{name: {"x": 1}}))
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert err["param"] == name, err
        assert err["message"] == f"{name} is not supported: {VLLM_REFUSED[name]}", err
        refused.add(name)
    assert {"chat_template_kwargs", "add_generation_prompt", "continue_final_message", "echo",
            "skip_special_tokens", "spaces_between_special_tokens", "mm_processor_kwargs",
            "return_tokens_as_token_ids"} <= served
    assert {"chat_template", "prompt_logprobs", "use_beam_search"} <= refused
    # the completions API refuses the same extras with the same reasons
    r = c.post("/v1/completions", json={"model": "", "prompt": "x", "prompt_logprobs": 1})
    assert r.json()["error"]["message"] == f"prompt_logprobs is not supported: " \
        f"{VLLM_REFUSED['prompt_logprobs']}"


def test_grpc_door_checks_the_template_options():
    from tandem.services.router.errors import RouterError
    from tandem.services.router.grpc_api import _validate

    msg = common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="hi")])
    ok = _validate(router_pb2.RouterGenerateRequest(messages=[msg], template_options={
        "kwargs_json": '{"enable_thinking": false}'}))
    assert json.loads(ok.template_options.kwargs_json) == {"enable_thinking": False}
    with pytest.raises(RouterError) as e:
        _validate(router_pb2.RouterGenerateRequest(messages=[msg], template_options={
            "kwargs_json": "[]"}))
    assert (e.value.code, e.value.param) == ("INVALID_ARGUMENT", "chat_template_kwargs")


def test_sdk_keywords_build_the_template_options():
    from tandem.client.errors import InvalidRequestError
    from tandem.client.results import build_request

    r = build_request("hi", chat_template_kwargs={"enable_thinking": False},
                      continue_final_message=True, skip_special_tokens=False)
    assert json.loads(r.template_options.kwargs_json) == {"enable_thinking": False}
    assert r.template_options.continue_final_message and not r.sampling.skip_special_tokens
    with pytest.raises(InvalidRequestError) as e:
        build_request("hi", add_generation_prompt=True, continue_final_message=True)
    assert e.value.field == "continue_final_message"


# -- response shapes: echo, usage on every chunk, tokens as ids --


def outputs():
    """A choice's Outputs as the dispatcher yields them: two tokens, then the last one."""
    from tandem.services.router.request import Output, Usage

    def lp(tid, text):
        return common_pb2.TokenLogprob(token_id=tid, logprob=-0.5, top=[
            common_pb2.TopLogprob(token_id=tid, logprob=-0.5, text=text)])

    a = Output(language_pb2.LanguageGenerateResponse(
        token_ids=[11], text=" blue", logprobs=[lp(11, " blue")], usage={"prompt_tokens": 7}))
    b = Output(language_pb2.LanguageGenerateResponse(
        token_ids=[12], text="!", logprobs=[lp(12, "!")], usage={"prompt_tokens": 7}))
    last = Output(language_pb2.LanguageGenerateResponse(
        finish_reason=common_pb2.FINISH_REASON_STOP), usage=Usage(7, 2))
    return [a, b, last]


def events(stream: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in stream.decode().split("\n\n")
            if line.startswith("data: {")]


def test_chat_shapes_echo_continuous_usage_and_token_ids():
    from tandem.services.router.openai.format import ChatShape
    from tandem.services.router.tools import ToolSetup

    shape = ChatShape("id", "m", ToolSetup(), echo="The sky is", continuous_usage=True,
                      as_ids=True)
    outs = outputs()
    got = events(shape.start(0, outs[0]) + shape.output(0, outs[0]) + shape.output(0, outs[1])
                 + shape.finish(0, outs[2]))
    assert [e["choices"][0]["delta"].get("content") for e in got] == [
        "", "The sky is", " blue", "!", None]
    assert [e["usage"]["completion_tokens"] for e in got] == [0, 0, 1, 2, 2]
    assert {e["usage"]["prompt_tokens"] for e in got} == {7}
    lps = got[2]["choices"][0]["logprobs"]["content"][0]
    assert lps["token"] == "token_id:11" and lps["top_logprobs"][0]["token"] == "token_id:11"
    whole = shape.complete([outs])
    assert whole["choices"][0]["message"]["content"] == "The sky is blue!"
    assert whole["choices"][0]["logprobs"]["content"][1]["token"] == "token_id:12"
    plain = ChatShape("id", "m", ToolSetup())
    assert "usage" not in events(plain.output(0, outs[0]))[0]


def test_echo_in_chat_follows_vllm():
    from tandem.services.router.openai.chat import echo_text

    def echo(**kw):
        return echo_text(ChatCompletionRequest.model_validate(body(**kw)))

    prefilled = [{"role": "user", "content": "Colour?"},
                 {"role": "assistant", "content": [{"type": "text", "text": "The sky"},
                                                   {"type": "text", "text": "is"}]}]
    assert echo(messages=prefilled, echo=True) == "The sky\nis"
    assert echo(messages=prefilled) == ""
    assert echo(echo=True) == ""  # a new assistant turn follows a user message: nothing
    assert echo(echo=True, add_generation_prompt=False) == "hi"


def test_completions_logprobs_as_token_ids_and_usage_on_every_chunk():
    from tandem.services.router.openai.completions import CompletionShape

    shape = CompletionShape("id", "m", "", continuous_usage=True, as_ids=True)
    outs = outputs()
    got = events(shape.start(0, outs[0]) + shape.output(0, outs[0]) + shape.finish(0, outs[2]))
    assert [e["usage"]["total_tokens"] for e in got] == [7, 8, 9]
    assert got[1]["choices"][0]["logprobs"]["tokens"] == ["token_id:11"]
    assert got[1]["choices"][0]["logprobs"]["top_logprobs"] == [{"token_id:11": -0.5}]


# A template that reads a message's `name` (Qwen's do not): `<|im_start|>user (Ann)`.
NAMED = ("{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %} ({{ m.name }})"
         "{% endif %}\n{% for c in m.content %}{{ c.text }}{% endfor %}<|im_end|>\n"
         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_message_s_name_is_rendered_where_the_template_reads_it(qwen3):
    """OpenAI's messages[].name (issue 42): from the wire to the template's `name`, exactly
    as transformers renders the same chat; a template that does not read it renders as
    without it; a name spelling a reserved token is refused by its field."""
    from tandem.chat import messages_from_proto

    wire = [common_pb2.ChatMessage(role="user", name="Ann", content=[
        common_pb2.ContentPart(text="Hello")])]
    named = messages_from_proto(wire)
    assert named == [Message("user", ("Hello",), name="Ann")]
    got = ChatTemplate(qwen3, NAMED).text_only_ids(named, 4096)
    ref = qwen3.apply_chat_template(
        [{"role": "user", "name": "Ann", "content": [{"type": "text", "text": "Hello"}]}],
        chat_template=NAMED, tokenize=True, add_generation_prompt=True)
    assert got == list(ref[0] if ref and isinstance(ref[0], list) else ref)
    assert "<|im_start|>user (Ann)" in qwen3.tokenizer.decode(got)
    stock = ChatTemplate(qwen3)
    assert stock.text_only_ids(named, 4096) == stock.text_only_ids(
        [Message("user", ("Hello",))], 4096)
    with pytest.raises(ChatError) as e:
        ChatTemplate(qwen3, NAMED).text_only_ids(
            [Message("user", ("x",), name="a<|im_end|>")], 4096)
    assert e.value.field == "messages[0].name"
