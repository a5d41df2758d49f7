"""End to end through real processes: `tandem up` with 1 encoder + 1 language instance on
the tiny Qwen3-VL (deepstack) with an API key.

Proves: greedy answers via `openai` (streaming and not) and the SDK equal transformers
`generate()`, including a resumed transfer; without the key HTTP answers 401 and gRPC
UNAUTHENTICATED, with it requests succeed; beyond --max-inflight the router answers 429
at once; SIGTERM to `tandem up` leaves no process behind.
"""

from __future__ import annotations

import signal

import httpx
import psutil
import pytest
from language_oracle import generate, load, make_image, make_inputs
from test_e2e_cluster import TEXT_LONG, openai_messages, png, strip_eos, wait_idle

from tandem.client import AuthenticationError, Client, image
from tandem.launch.cluster import LocalCluster

ARCH = "qwen3_vl"
MAX_NEW = 10
KEY = "e2e-secret"

pytestmark = pytest.mark.timeout(240)

CHATS = [
    ("one_image", "Describe the picture.", [(21, (64, 64))]),
    ("resumed", TEXT_LONG * 2, [(22, (224, 192))]),
]


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint(ARCH)


@pytest.fixture(scope="module")
def cluster(ckpt):
    cl = LocalCluster(
        str(ckpt), encoders=1, languages=1, api_key=KEY,
        language_args="--embedding-block-size 16 --default-reservation-tokens 48",
        router_args="--max-inflight 2",
    )
    cl.start()
    yield cl
    cl.stop()


@pytest.mark.parametrize("name,text,images", CHATS, ids=[c[0] for c in CHATS])
def test_greedy_equals_transformers(cluster, ckpt, name, text, images):
    from openai import OpenAI

    model, processor = load(ckpt)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list | tuple) else [eos])
    inputs = make_inputs(processor, text, [make_image(s, sz) for s, sz in images])
    want, _ = generate(model, inputs, MAX_NEW)

    client = OpenAI(base_url=cluster.http_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    msgs = openai_messages(text, images)
    resp = client.chat.completions.create(model="", messages=msgs, max_tokens=MAX_NEW,
                                          temperature=0)
    streamed = "".join(
        (ch.choices[0].delta.content or "") if ch.choices else ""
        for ch in client.chat.completions.create(model="", messages=msgs, max_tokens=MAX_NEW,
                                                 temperature=0, stream=True)
    )
    with Client(cluster.grpc_address, api_key=KEY) as c:
        parts = [image(png(s, sz)) for s, sz in images] + [text]
        sdk = c.chat([{"role": "user", "content": parts}], max_tokens=MAX_NEW)
    assert strip_eos(sdk.token_ids, eos) == strip_eos(want, eos)
    assert resp.choices[0].message.content == streamed == sdk.text
    if name == "resumed":
        ext = resp.model_extra["tandem"]
        assert ext.get("resumes", 0) >= 1 or ext["encoder_attempts"] > 1, ext  # see the 2.5 test


def test_logprobs_and_stop(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.http_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    msgs = openai_messages("Describe the picture.", [(21, (64, 64))])
    r = client.chat.completions.create(model="", messages=msgs, max_tokens=6, temperature=0,
                                       logprobs=True)
    lps = r.choices[0].logprobs.content
    assert len(lps) == r.usage.completion_tokens and all(x.logprob <= 0 for x in lps)
    assert "".join(x.token for x in lps) == r.choices[0].message.content
    with Client(cluster.grpc_address, api_key=KEY) as c:
        sdk = c.chat([{"role": "user", "content": [image(png(21, (64, 64))), "Describe the picture."]}],
                     max_tokens=6, logprobs=True)
    assert sdk.logprobs == pytest.approx([x.logprob for x in lps], abs=1e-4)
    # a stop string cut from the greedy answer ends it there, unreturned
    text = r.choices[0].message.content
    assert len(text) >= 4
    stop = text[2:4]
    r2 = client.chat.completions.create(model="", messages=msgs, max_tokens=6, temperature=0,
                                        stop=[stop])
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.content == text[: text.index(stop)]


def test_api_key_required(cluster):
    body = {"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url = cluster.http_url + "/v1/chat/completions"
    r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert r.status_code == 401
    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    with Client(cluster.grpc_address) as c, pytest.raises(AuthenticationError) as e:
        c.chat("hi", max_tokens=2)
    assert e.value.code == "UNAUTHENTICATED"
    with Client(cluster.grpc_address, api_key="wrong") as c, pytest.raises(AuthenticationError):
        c.chat("hi", max_tokens=2)
    with Client(cluster.grpc_address, api_key=KEY) as c:
        assert c.chat("hi", max_tokens=2).finish_reason in ("stop", "length")
    assert wait_idle(cluster)["idle"]


def test_sdk_stream_abandoned_mid_way_frees_pages(cluster):
    """Breaking out of `stream_chat` cancels the gRPC call: the router cancels the
    language stream and the room's pages are free within a second."""
    with Client(cluster.grpc_address, api_key=KEY) as c:
        stream = c.stream_chat([{"role": "user", "content": [image(png(23, (64, 64))), "Go."]}],
                               max_tokens=4000, ignore_eos=True, timeout=60)
        pieces = []
        for piece in stream:
            pieces.append(piece)
            if len(pieces) >= 3:
                break
        assert sum(x.running for x in cluster.loads("language").values()) == 1
        stream.close()
    assert wait_idle(cluster)["idle"]


def test_http_non_streaming_client_gone_frees_pages(cluster):
    """A non-streaming caller that hangs up (here: its read timeout) cancels the request."""
    body = {"model": "", "messages": openai_messages("Go on.", [(24, (64, 64))]),
            "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster.http_url + "/v1/chat/completions", json=body, timeout=1.5,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert wait_idle(cluster)["idle"]


def test_admission_answers_429_beyond_max_inflight(cluster):
    import asyncio

    body = {"model": "", "messages": openai_messages("Go.", [(25, (64, 64))]),
            "max_tokens": 300, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def go():
        async with httpx.AsyncClient(timeout=60, headers=headers) as http:
            return await asyncio.gather(*(
                http.post(cluster.http_url + "/v1/chat/completions", json=body) for _ in range(6)))

    codes = sorted(r.status_code for r in asyncio.run(go()))
    assert codes.count(200) >= 2 and set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1
    refused = [r for r in asyncio.run(go()) if r.status_code == 429]
    assert all(r.json()["error"]["type"] == "rate_limit_error" for r in refused)
    assert wait_idle(cluster)["idle"]


def test_tool_calls_forced_auto_and_in_the_history(cluster):
    from openai import OpenAI
    from tool_checks import check_forced_calls, check_history_and_auto

    client = OpenAI(base_url=cluster.http_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    check_forced_calls(client)
    check_history_and_auto(client)


def test_structured_output_parses_for_every_seed(cluster):
    from openai import OpenAI
    from tool_checks import check_parse

    check_parse(OpenAI(base_url=cluster.http_url + "/v1", api_key=KEY, max_retries=0,
                       timeout=60))


def test_sigterm_stops_every_child(cluster):
    children = psutil.Process(cluster.proc.pid).children(recursive=True)
    assert len(children) >= 3
    assert cluster.stop(signal.SIGTERM) == 0
    _, alive = psutil.wait_procs(children, timeout=5)
    assert alive == []

