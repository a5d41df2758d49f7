"""HTTP front-end without tiers: validation, auth, admission, unknown model, health —
every failure in OpenAI's error shape with the right status, never a 500."""

from __future__ import annotations

import base64
import json

import pytest
from fastapi.testclient import TestClient

from tandem.services.router.config import RouterConfig
from tandem.services.router.core import RouterCore
from tandem.services.router.openai.app import build_app

PNG_1PX = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


def make(**kw) -> tuple[RouterCore, TestClient]:
    core = RouterCore(RouterConfig(**{"insecure_internal": True, **kw}))
    return core, TestClient(build_app(core))


def chat(**kw) -> dict:
    body = {"model": "", "messages": [{"role": "user", "content": "hi"}]}
    body.update(kw)
    return body


def img_msg(url: str) -> list:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "what?"},
            ],
        }
    ]


def vid_msg(url: str, **controls) -> list:
    return [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url, **controls}},
        {"type": "text", "text": "what happens?"}]}]


PNG_URL = "data:image/png;base64," + base64.b64encode(PNG_1PX).decode()


def frames_msg(frames: list, **controls) -> list:
    """qwen-vl-utils' video given as frames (image URLs)."""
    return [{"role": "user", "content": [{"type": "video", "video": frames, **controls},
                                         {"type": "text", "text": "what happens?"}]}]


def assert_openai_error(r, status: int, code: str, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["message"]
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize(
    "body,param",
    [
        (chat(messages=[]), "messages"),
        (chat(max_tokens=-1), "max_tokens"),
        (chat(max_completion_tokens=0), "max_completion_tokens"),
        (chat(temperature=-0.5), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(n=17), "n"),
        (chat(top_logprobs=3), "top_logprobs"),  # without logprobs
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat(presence_penalty=5), "presence_penalty"),
        (chat(frequency_penalty=-2.5), "frequency_penalty"),
        (chat(repetition_penalty=0), "repetition_penalty"),
        (chat(min_p=1.5), "min_p"),
        (chat(logit_bias={"abc": 1}), "logit_bias"),
        (chat(logit_bias={"5": 101}), "logit_bias"),
        (chat(min_tokens=9, max_tokens=4), "min_tokens"),
        (chat(stop_token_ids=[-1]), "stop_token_ids"),
        (chat(stop=["a"] * 17), "stop"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), None),
        (chat(messages=[{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}]),
         "messages[0].content[0].video"),
        (chat(messages=frames_msg([PNG_URL, PNG_URL])), "messages[0].content[0].fps"),
        (chat(messages=frames_msg([PNG_URL], fps=-1)), "messages[0].content[0].fps"),
        (chat(messages=frames_msg([PNG_URL], fps=2, sample_fps=3)),
         "messages[0].content[0].sample_fps"),
        (chat(messages=frames_msg([PNG_URL], fps=2, num_frames=4)),
         "messages[0].content[0].num_frames"),
        (chat(messages=frames_msg([], fps=2)), "messages[0].content[0].video"),
        (chat(messages=frames_msg([PNG_URL, 7], fps=2)), "messages[0].content[0].video[1]"),
        (chat(messages=frames_msg([PNG_URL, "data:video/mp4;base64,aGk="], fps=2)),
         "messages[0].content[0].video[1]"),
        # (file: goes on to the encoder, which reads it only under its
        # --allowed-local-media-path: test_local_media, test_e2e_cluster)
        (chat(messages=frames_msg(["ftp://example.com/f.png"], fps=2)),
         "messages[0].content[0].video[0]"),
        (chat(messages=frames_msg([PNG_URL], fps=2), mm_processor_kwargs={"num_frames": 4}),
         "mm_processor_kwargs.num_frames"),
        (chat(messages=vid_msg("data:image/png;base64,aGk=")), "messages[0].content[0].video_url"),
        (chat(messages=vid_msg("data:video/mp4,rawbytes")), "messages[0].content[0].video_url"),
        (chat(messages=vid_msg("data:video/mp4;base64,@@")), "messages[0].content[0].video_url"),
        (chat(messages=vid_msg("ftp://example.com/v.mp4")), "messages[0].content[0].video_url"),
        (chat(messages=vid_msg("https://example.com/v.mp4", fps=2, num_frames=8)),
         "messages[0].content[0].video_url"),
        (chat(messages=vid_msg("https://example.com/v.mp4", fps=-1)),
         "messages[0].content[0].video_url.fps"),
        (chat(messages=vid_msg("https://example.com/v.mp4", num_frames=1)),
         "messages[0].content[0].video_url.num_frames"),
        (chat(messages=vid_msg("https://example.com/v.mp4", nframes=4)),
         "messages[0].content[0].video_url.nframes"),
        (
            chat(messages=img_msg("data:image/png;base64,@@notbase64@@")),
            "messages[0].content[0].image_url",
        ),
        (chat(messages=img_msg("data:image/png,rawbytes")), "messages[0].content[0].image_url"),
        (chat(messages=img_msg("data:text/plain;base64,aGk=")), "messages[0].content[0].image_url"),
        (chat(messages=img_msg("ftp://example.com/a.png")), "messages[0].content[0].image_url"),
        (chat(messages=[{"role": "user", "content": [{"type": "audio", "x": 1}]}]), None),
    ],
)
def test_bad_input_is_400(body, param):
    _, c = make()
    assert_openai_error(c.post("/v1/chat/completions", json=body), 400, "invalid_argument", param)


def test_malformed_json_is_400():
    _, c = make()
    r = c.post(
        "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert_openai_error(r, 400, "invalid_argument")
    # Tandem's words (the parser's own come after, as the detail)
    assert r.json()["error"]["message"].startswith("the request body is not valid JSON")


def test_oversized_image_is_413():
    _, c = make(max_image_bytes=1024)
    url = "data:image/png;base64," + base64.b64encode(b"\x89PNG" + b"\0" * 4096).decode()
    r = c.post("/v1/chat/completions", json=chat(messages=img_msg(url)))
    assert_openai_error(r, 413, "too_large", "messages[0].content[0].image_url")


def test_oversized_video_is_413():
    _, c = make(max_video_bytes=2048)
    url = "data:video/mp4;base64," + base64.b64encode(b"\0" * 4096).decode()
    r = c.post("/v1/chat/completions", json=chat(messages=vid_msg(url)))
    assert_openai_error(r, 413, "too_large", "messages[0].content[0].video_url")
    assert "max_video_bytes" in r.json()["error"]["message"]


def test_frames_over_the_router_s_video_bytes_are_413():
    _, c = make(max_video_bytes=1024)  # the 1-pixel PNG is 70 bytes: 14 of them fit
    r = c.post("/v1/chat/completions", json=chat(messages=frames_msg([PNG_URL] * 14, fps=2)))
    assert r.status_code != 413, r.text  # (no tier behind this router: 503)
    r = c.post("/v1/chat/completions", json=chat(messages=frames_msg([PNG_URL] * 15, fps=2)))
    assert_openai_error(r, 413, "too_large", "messages[0].content[0].video")
    assert "max_video_bytes" in r.json()["error"]["message"]


def test_a_video_given_as_frames_becomes_the_wire_s_frames():
    from tandem.services.router.openai.chat import ChatCompletionRequest, to_chat_request

    body = chat(messages=frames_msg([PNG_URL, "https://example.com/f1.jpg"], sample_fps=2.5,
                                    max_pixels=50176),
                mm_processor_kwargs={"min_pixels": 3136})
    req = to_chat_request(ChatCompletionRequest.model_validate(body), "x")
    v = req.messages[0].content[0].video
    assert v.WhichOneof("source") == "frames"
    assert [f.WhichOneof("source") for f in v.frames.frames] == ["data", "url"]
    assert (v.frames.frames[0].data, v.frames.frames[1].url) == (PNG_1PX,
                                                                  "https://example.com/f1.jpg")
    assert (v.fps, v.max_pixels, v.min_pixels, v.num_frames) == (2.5, 50176, 3136, 0)


def test_video_parts_become_the_wire_s_video_parts():
    from tandem.services.router.openai.chat import ChatCompletionRequest, to_chat_request

    clip = b"\0\0\0\x18ftypmp42"
    url = "data:video/webm;base64," + base64.b64encode(clip).decode()
    body = chat(messages=[{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url, "fps": 1.5, "max_pixels": 50176}},
        {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4",
                                            "num_frames": 8, "total_pixels": 1 << 40}},
        {"type": "text", "text": "compare"}]}])
    req = to_chat_request(ChatCompletionRequest.model_validate(body), "x")
    a, b, _ = req.messages[0].content
    assert (a.video.data, a.video.fps, a.video.max_pixels, a.video.num_frames) == (
        clip, 1.5, 50176, 0)
    assert (b.video.url, b.video.num_frames, b.video.total_pixels) == (
        "https://example.com/v.mp4", 8, 1 << 40)


def test_an_encoder_refusal_of_a_video_names_the_body_s_part():
    from tandem.services.router.errors import RouterError
    from tandem.services.router.openai.errors import openai_body

    err = RouterError("INVALID_ARGUMENT", "too long", "messages[2].content[1].video")
    assert openai_body(err)["error"]["param"] == "messages[2].content[1].video_url"
    # a video given as frames: the wire's `frames` list is the body's `video` list
    err = RouterError("INVALID_ARGUMENT", "bad", "messages[2].content[1].video.frames[3]")
    assert openai_body(err)["error"]["param"] == "messages[2].content[1].video[3]"
    err = RouterError("INVALID_ARGUMENT", "bad", "messages[2].content[1].video.frames")
    assert openai_body(err)["error"]["param"] == "messages[2].content[1].video"


def test_oversized_body_is_413():
    _, c = make(max_request_bytes=2048)
    r = c.post(
        "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": "x" * 5000}])
    )
    assert_openai_error(r, 413, "too_large")


def test_unknown_model_is_404():
    _, c = make(model="tiny-vlm")
    assert c.get("/v1/models").json()["data"][0]["id"] == "tiny-vlm"
    assert_openai_error(
        c.post("/v1/chat/completions", json=chat(model="gpt-9")), 404, "not_found", "model"
    )


def test_no_instances_is_503_and_health_not_ready():
    _, c = make()
    url = "data:image/png;base64," + base64.b64encode(PNG_1PX).decode()
    assert_openai_error(
        c.post("/v1/chat/completions", json=chat(messages=img_msg(url))), 503, "unavailable"
    )
    assert_openai_error(c.post("/v1/chat/completions", json=chat(stream=True)), 503, "unavailable")
    r = c.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "unavailable"
    assert b"tandem_router_inflight 0.0" in c.get("/metrics").content


def test_api_key_401_and_accepted():
    core, c = make(api_key="s3cret")
    assert_openai_error(c.post("/v1/chat/completions", json=chat()), 401, "unauthenticated")
    r = c.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer wrong"})
    assert_openai_error(r, 401, "unauthenticated")
    assert_openai_error(c.get("/v1/models"), 401, "unauthenticated")
    ok = c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    # with the key the request passes auth and reaches selection (no instances here: 503)
    r = c.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer s3cret"})
    assert_openai_error(r, 503, "unavailable")
    assert c.get("/health").status_code == 503  # probes need no key


def test_admission_full_is_429_and_slot_is_not_leaked():
    core, c = make(max_inflight=1)
    core.admission.acquire()  # one request in flight
    assert_openai_error(c.post("/v1/chat/completions", json=chat()), 429, "overloaded")
    core.admission.release()
    for _ in range(3):  # failing requests give their slot back
        assert_openai_error(c.post("/v1/chat/completions", json=chat()), 503, "unavailable")
    assert core.admission.inflight == 0


def test_http_socket_connections_have_nodelay():
    """Accepted connections have TCP_NODELAY (asyncio sets it only when the listener's
    proto says TCP): without it each SSE chunk waits for the client's delayed ACK."""
    import asyncio
    import socket

    from tandem.services.router.main import http_socket

    async def main() -> int:
        sock = http_socket("127.0.0.1", 0)
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                s = transport.get_extra_info("socket")
                got.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        try:
            return await asyncio.wait_for(got, 5)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(main()) != 0


def _openai_fields(typed_dict) -> set[str]:
    import typing

    return set(typing.get_type_hints(typed_dict))


def test_every_openai_chat_parameter_is_honoured_or_refused_by_name():
    """Walks the `openai` package's chat-completions request type: each parameter is a
    field we serve (or a documented hint), or a 400 whose `param` names it. Never a 200
    that silently drops it."""
    from openai.types.chat import completion_create_params as ccp

    from tandem.services.router.openai.chat import ChatCompletionRequest

    served = set(ChatCompletionRequest.model_fields)
    core, client = make()
    refused = set()
    for name in sorted(_openai_fields(ccp.CompletionCreateParamsBase) | {"stream"}):
        if name in served:
            continue
        r = client.post("/v1/chat/completions", json=chat(**{name: {"x": 1}}))
        assert r.status_code == 400, (name, r.status_code)
        err = r.json()["error"]
        assert err["param"] == name and "not supported" in err["message"], (name, err)
        refused.add(name)
    # what we cannot serve yet is refused (issue 14 turns these into honoured fields)
    assert {"presence_penalty", "frequency_penalty", "logit_bias", "top_logprobs",
            "response_format", "tools", "tool_choice"} <= served
    assert {"n", "functions", "function_call", "audio", "modalities"} & refused


@pytest.mark.parametrize("body,kind,text", [
    (chat(response_format={"type": "json_object"}), "json_object", True),
    (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object"}, "strict": True}}), "json_schema",
     '{"type": "object"}'),
    (chat(guided_json='{"type": "integer"}'), "json_schema", '{"type": "integer"}'),
    (chat(guided_regex="[0-9]+"), "regex", "[0-9]+"),
    (chat(guided_choice=["a", "b"]), "choice", None),
    (chat(guided_grammar='root ::= "x"'), "ebnf", 'root ::= "x"'),
    (chat(structured_outputs={"regex": "a+"}), "regex", "a+"),
    (chat(response_format={"type": "text"}), None, None),
])
def test_structured_output_fields_reach_the_sampling_proto(body, kind, text):
    from tandem.services.router.openai.chat import ChatCompletionRequest, to_chat_request

    core, _ = make()
    req = to_chat_request(ChatCompletionRequest.model_validate(body), "x")
    so = req.sampling.structured_output
    assert so.WhichOneof("kind") == kind
    if kind == "choice":
        assert list(so.choice.choices) == ["a", "b"]
    elif kind is not None:
        assert getattr(so, kind) == text


@pytest.mark.parametrize("body,param", [
    (chat(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "p"}}),
     "response_format"),
    (chat(guided_json="{not json"), "guided_json"),
    (chat(guided_choice=[]), "guided_choice"),
    (chat(response_format={"type": "json_object"}, ignore_eos=True), "ignore_eos"),
    (chat(response_format={"type": "xml"}), "response_format.type"),
])
def test_bad_structured_output_is_400_naming_the_field(body, param):
    _, c = make()
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_message_fields_are_refused_by_name():
    core, client = make()
    body = chat(messages=[{"role": "user", "content": "hi", "nickname": "ann"}])
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[0].nickname"


def test_a_message_s_name_reaches_the_wire():
    """OpenAI's `messages[].name` (LangChain's HumanMessage(name=...)) is taken and sent to
    the tiers, whose chat template renders it where it reads it (test_vllm_extras)."""
    from tandem.services.router.openai.chat import ChatCompletionRequest, to_chat_request

    body = chat(messages=[{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "hi", "name": "Ann Lee"}])
    req = to_chat_request(ChatCompletionRequest.model_validate(body), "x")
    assert [m.name for m in req.messages] == ["", "Ann Lee"]
    _, client = make()
    for bad, param in (("", "messages[0].name"), ("x" * 257, "messages[0].name"),
                       (7, "messages[0].name")):
        r = client.post("/v1/chat/completions", json=chat(messages=[
            {"role": "user", "content": "hi", "name": bad}]))
        assert_openai_error(r, 400, "invalid_argument", param)
    r = client.post("/v1/chat/completions", content=b'{"model": "", "messages": [{"role": '
                    b'"user", "content": "hi", "name": "\\ud800"}]}',
                    headers={"content-type": "application/json"})
    assert_openai_error(r, 400, "invalid_argument", "messages[0].name")


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ('{"model": "", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
         "messages[0].content"),
        ('{"model": "", "messages": [{"role": "user", "content": [{"type": "text", '
         '"text": "x\\udfff"}]}]}', "messages[0].content[0].text"),
        ('{"model": "", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}',
         "stop"),
        ('{"model": "", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}',
         "stream"),
        ('{"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": true}',
         "max_tokens"),
    ],
)
def test_hostile_text_and_wrong_types_are_400_never_500(raw, param):
    """Lone surrogates (legal JSON escapes) and wrongly typed values (no coercion)."""
    _, c = make()
    r = c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, "invalid_argument", param)


def test_chunked_upload_over_the_limit_is_413():
    """No content-length (chunked transfer-encoding): the limit holds on the bytes read."""
    _, c = make(max_request_bytes=4096)
    big = b'{"model": "", "messages": [{"role": "user", "content": "' + b"x" * 8000 + b'"}]}'

    def chunks():
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    r = c.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in {k.lower() for k in r.request.headers}
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large", r.text
    small = b'{"model": "", "messages": [{"role": "user", "content": "hi"}], "stream": "no"}'
    r = c.post("/v1/chat/completions", content=iter([small]), headers={"content-type": "application/json"})
    assert r.status_code == 400  # under the limit: read and validated as usual


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}


def test_tool_choice_shapes_the_request():
    from tandem.services.router.openai.chat import ChatCompletionRequest, to_chat_request
    from tandem.services.router.tools import ToolMode

    core, _ = make()

    def build(**kw):
        body = ChatCompletionRequest.model_validate(chat(tools=[WEATHER, CLOCK], **kw))
        return to_chat_request(body, "x")

    auto = build()
    assert auto.tools.mode is ToolMode.AUTO and "get_weather" in auto.tools.tools_json
    assert not auto.sampling.HasField("structured_output")
    assert build(tool_choice="none").tools.mode is ToolMode.NONE
    req = build(tool_choice="required")
    schema = json.loads(req.sampling.structured_output.json_schema)
    assert [c["properties"]["name"]["const"] for c in schema["anyOf"]] == ["get_weather",
                                                                           "get_time"]
    named = build(tool_choice={"type": "function", "function": {"name": "get_time"}})
    schema = json.loads(named.sampling.structured_output.json_schema)
    assert schema["properties"]["arguments"] == CLOCK["function"]["parameters"]


def test_tool_output_parsing():
    from tandem.services.router.tools import ParsedOutput, ToolMode, ToolSetup, parse_output

    auto = ToolSetup(ToolMode.AUTO, "[]")
    out = parse_output('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
                       '</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>', auto)
    assert out.content == "Let me look." and [c.name for c in out.tool_calls] == ["f", "g"]
    assert json.loads(out.tool_calls[0].arguments) == {"a": 1}
    assert out.tool_calls[0].id.startswith("call_")
    assert parse_output("<tool_call>{broken</tool_call>", auto).tool_calls == []
    # a name the wire's ToolCall cannot carry (a lone surrogate) is no call
    assert parse_output('<tool_call>{"name": "\\ud800"}</tool_call>', auto).tool_calls == []
    forced = ToolSetup(ToolMode.FORCED, "[]")
    assert parse_output('{"name": "f", "arguments": {"x": true}}', forced).content is None
    # cut by max_tokens: neither a call nor content (no half-written JSON for a client)
    assert parse_output('{"name": "f", "argu', forced) == ParsedOutput(None, [])


@pytest.mark.parametrize("body,param", [
    (chat(tool_choice="auto"), "tool_choice"),
    (chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (chat(tools=[WEATHER, WEATHER]), "tools"),
    (chat(tools=[WEATHER], tool_choice="required", guided_regex="a"), "tool_choice"),
    (chat(messages=[{"role": "tool", "content": "12C"}]), "messages[0].tool_call_id"),
    (chat(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]),
     "messages[0].tool_calls[0].function.arguments"),
    (chat(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
     "messages[0].tool_calls"),
])
def test_bad_tool_requests_are_400_naming_the_field(body, param):
    _, c = make()
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_every_openai_completions_parameter_is_honoured_or_refused_by_name():
    """The same walk over the `openai` package's completions request type."""
    from openai.types import completion_create_params as ccp

    from tandem.services.router.openai.completions import CompletionRequest

    served = set(CompletionRequest.model_fields)
    _, client = make()
    refused = set()
    for name in sorted(_openai_fields(ccp.CompletionCreateParamsBase) | {"stream"}):
        if name in served:
            continue
        r = client.post("/v1/completions", json={"model": "", "prompt": "x", name: {"x": 1}})
        assert r.status_code == 400, (name, r.status_code)
        assert r.json()["error"]["param"] == name, (name, r.json())
        refused.add(name)
    assert {"prompt", "echo", "logprobs", "suffix", "best_of", "n", "logit_bias"} <= served
    # served fields that cannot be honoured are refused by value, by name
    for body, param in (({"suffix": "z"}, "suffix"), ({"best_of": 3}, "best_of"),
                        ({"prompt": ["a", "b"]}, "prompt"), ({"logprobs": 21}, "logprobs")):
        r = client.post("/v1/completions", json={"model": "", "prompt": "x", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_openapi_declares_the_statuses_the_router_answers():
    """/openapi.json lists, for each API route, the error statuses the router really
    answers (with OpenAI's error body), and not FastAPI's 422, which it never sends (a
    body that does not validate is a 400)."""
    from fastapi.testclient import TestClient

    from tandem.services.router.config import RouterConfig
    from tandem.services.router.core import RouterCore
    from tandem.services.router.openai.app import build_app
    from tandem.services.router.openai.openapi import ERROR_STATUSES

    doc = TestClient(build_app(RouterCore(RouterConfig(model="m", insecure_internal=True)))).get("/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        got = doc["paths"][path]["post"]["responses"]
        assert "422" not in got, path
        assert {str(c) for c in ERROR_STATUSES} <= set(got), (path, sorted(got))
        ref = got["400"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/ErrorBody")
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    # and a body that does not validate is indeed a 400, not a 422
    c = TestClient(build_app(RouterCore(RouterConfig(model="m", insecure_internal=True))))
    assert c.post("/v1/chat/completions", json={"model": "m"}).status_code == 400
