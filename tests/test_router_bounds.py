"""The router's request-level bounds (services/router/bounds.py) and the shape of its doors.

- `bounds.check` refuses, by the wire's field name, every bound of its table: n, timeout_ms,
  a stop string's length, n > 1 with tools, an image's, a video's and its frames' bytes.
- Both doors answer each refusal alike: HTTP 400/413 with OpenAI's error body naming the
  body's field, gRPC INVALID_ARGUMENT/RESOURCE_EXHAUSTED with the field in the trailing
  metadata; a value at its bound passes (the request then fails for want of tiers: 503 /
  UNAVAILABLE, which shows it went past the bounds to the dispatcher).
- The doors only translate: neither imports the bounds, the choices' fan-out, the
  dispatcher or the cache namespaces, nor calls the core's admission; the gRPC door
  builds no language-tier message; only the core imports the bounds.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient

from tandem.errors import FIELD_METADATA
from tandem.services.router import bounds
from tandem.services.router.config import RouterConfig
from tandem.services.router.core import RouterCore
from tandem.services.router.errors import RouterError
from tandem.services.router.grpc_api import RouterServicer
from tandem.services.router.openai.app import build_app
from tandem.services.router.request import Query
from tandem.services.router.tools import ToolMode, ToolSetup
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc

CFG = RouterConfig(insecure_internal=True, max_image_bytes=1024, max_video_bytes=4096)
ROUTER = Path(__file__).resolve().parents[1] / "services" / "router"


def query(**kw) -> Query:
    msg = common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="hi")])
    return Query(**{"messages": [msg], "sampling": common_pb2.SamplingParams(),
                    "request_id": "r", **kw})


def media(**part) -> list[common_pb2.ChatMessage]:
    return [common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(**part)])]


def frames(*sizes: int) -> common_pb2.VideoPart:
    return common_pb2.VideoPart(frames=common_pb2.VideoFrames(
        frames=[common_pb2.VideoFrame(data=b"x" * n) for n in sizes]), fps=2)


TOOLS = ToolSetup(ToolMode.AUTO, "[]")


@pytest.mark.parametrize("kw,code,param", [
    ({"n": 0}, "INVALID_ARGUMENT", "n"),
    ({"n": bounds.MAX_N + 1}, "INVALID_ARGUMENT", "n"),
    ({"timeout_ms": 0}, "INVALID_ARGUMENT", "timeout_ms"),
    ({"timeout_ms": bounds.MAX_TIMEOUT_MS + 1}, "INVALID_ARGUMENT", "timeout_ms"),
    ({"sampling": common_pb2.SamplingParams(stop=["ok", "x" * (bounds.MAX_STOP_CHARS + 1)])},
     "INVALID_ARGUMENT", "stop"),
    ({"n": 2, "tools": TOOLS}, "INVALID_ARGUMENT", "n"),
    ({"messages": media(image=common_pb2.ImagePart(data=b"x" * 1025))}, "TOO_LARGE",
     "messages[0].content[0].image"),
    ({"messages": media(video=common_pb2.VideoPart(data=b"x" * 4097))}, "TOO_LARGE",
     "messages[0].content[0].video"),
    ({"messages": media(video=frames(1000, 1025))}, "TOO_LARGE",
     "messages[0].content[0].video.frames[1]"),
    ({"messages": media(video=frames(1000, 1000, 1000, 1000, 97))}, "TOO_LARGE",
     "messages[0].content[0].video.frames"),
])
def test_each_bound_is_refused_by_the_wire_s_name(kw, code, param):
    with pytest.raises(RouterError) as e:
        bounds.check(query(**kw), CFG)
    assert (e.value.code, e.value.param) == (code, param)


@pytest.mark.parametrize("kw", [
    {}, {"n": bounds.MAX_N}, {"timeout_ms": bounds.MAX_TIMEOUT_MS}, {"timeout_ms": 1},
    {"sampling": common_pb2.SamplingParams(stop=["x" * bounds.MAX_STOP_CHARS])},
    {"tools": TOOLS},
    {"messages": media(image=common_pb2.ImagePart(data=b"x" * 1024))},
    {"messages": media(video=frames(1000, 1000, 1000, 1000, 96))},
])
def test_a_value_at_its_bound_passes(kw):
    bounds.check(query(**kw), CFG)


STOP_OVER = ["x" * (bounds.MAX_STOP_CHARS + 1)]
STOP_AT = ["x" * bounds.MAX_STOP_CHARS]


def http_chat(client: TestClient, **body):
    return client.post("/v1/chat/completions", json={
        "model": "", "messages": [{"role": "user", "content": "hi"}], **body})


@pytest.mark.parametrize("body,status,param", [
    ({"stop": STOP_OVER}, 400, "stop"),
    ({"n": 17}, 400, "n"),
    ({"timeout_ms": bounds.MAX_TIMEOUT_MS + 1}, 400, "timeout_ms"),
    ({"n": 2, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "n"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + "eHh4" * 342}}]}]}, 413,
     "messages[0].content[0].image_url"),
])
def test_the_http_door_answers_a_bound_with_openai_s_error(body, status, param):
    client = TestClient(build_app(RouterCore(CFG)))
    r = http_chat(client, **body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    r = client.post("/v1/completions", json={"model": "", "prompt": "hi", "stop": STOP_OVER})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "stop")


def test_the_http_door_passes_a_stop_string_at_its_bound():
    r = http_chat(TestClient(build_app(RouterCore(CFG))), stop=STOP_AT)
    assert r.status_code == 503, r.text  # past the bounds: no language instance here


def grpc_generate(requests: list[router_pb2.RouterGenerateRequest]) -> list[tuple]:
    """(status code, field metadata) of each request, over a real loopback gRPC server
    with a router that has no tiers."""

    async def go():
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(RouterCore(CFG)), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        out = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                for request in requests:
                    call = stub.Generate(request, timeout=30)
                    try:
                        async for _ in call:
                            pass
                        out.append((grpc.StatusCode.OK, None))
                    except grpc.aio.AioRpcError as e:
                        meta = dict(e.trailing_metadata() or ())
                        out.append((e.code(), meta.get(FIELD_METADATA)))
        finally:
            await server.stop(None)
        return out

    return asyncio.run(go())


def test_the_grpc_door_answers_the_same_bounds():
    hi = common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="hi")])

    def req(**kw):
        return router_pb2.RouterGenerateRequest(messages=kw.pop("messages", [hi]), **kw)

    got = grpc_generate([
        req(sampling=common_pb2.SamplingParams(stop=STOP_OVER)),
        req(n=17),
        req(timeout_ms=-1),
        req(n=2, tools_json='[{"type": "function", "function": {"name": "f"}}]'),
        req(messages=media(image=common_pb2.ImagePart(data=b"x" * 1025))),
        req(sampling=common_pb2.SamplingParams(stop=STOP_AT)),
    ])
    bad, too_large = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
    assert got == [(bad, "stop"), (bad, "n"), (bad, "timeout_ms"), (bad, "n"),
                   (too_large, "messages[0].content[0].image"),
                   (grpc.StatusCode.UNAVAILABLE, None)]


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def attributes(path: Path) -> set[str]:
    return {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}


DOORS = [ROUTER / "grpc_api.py", *sorted((ROUTER / "openai").glob("*.py"))]
CORE_ONLY = ("tandem.services.router.bounds", "tandem.services.router.choices",
             "tandem.services.router.dispatch", "tandem.services.router.tenants.cache_namespace")


@pytest.mark.parametrize("door", DOORS, ids=lambda p: str(p.relative_to(ROUTER)))
def test_the_doors_only_translate(door):
    got = imports(door)
    assert not [m for m in got if m.startswith(CORE_ONLY)], "a rule of the core in a door"
    assert not {"dispatcher", "admit", "start_trace"} & attributes(door)


def test_the_grpc_door_builds_no_language_message_and_no_openai_shape():
    got = imports(ROUTER / "grpc_api.py")
    assert "tandem.v1.language_pb2" not in got
    assert not [m for m in got if m.startswith("tandem.services.router.openai")]


def test_only_the_core_reads_the_bounds():
    readers = [p.relative_to(ROUTER) for p in sorted(ROUTER.rglob("*.py"))
               if "tandem.services.router.bounds" in imports(p)]
    assert readers == [Path("core.py")]
