"""End to end through real processes: `tandem up` with 2 encoders + 2 language instances on
the tiny Qwen2.5-VL, driven by the official `openai` client, raw HTTP and the SDK.

Proves: greedy answers (streaming and not, HTTP and SDK) equal transformers `generate()`,
including prompts that need resumed transfers (languages reserve only 64 tokens); repeated
images reach the encoder that caches them; bad input is a 4xx and the router stays healthy;
a client that disconnects mid-stream cancels its generation and frees the language pages;
200 concurrent requests succeed and leave every block and page free; kill -9 of an encoder
under load gives each request an answer or a clear error (none hangs past its client's
timeout) and the cluster keeps serving; kill -9 of a language instance mid-stream ends
that stream with an error event and the other instance serves what follows; every turn of
a conversation reaches the language instance whose prefix cache holds its earlier turns;
Ctrl-C of `tandem up` leaves no process behind.

No test here bounds a duration: waits end on the state they wait for (tests/waiting.py).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import io
import json
import os
import re
import signal

import httpx
import psutil
import pytest
from language_oracle import generate, load, make_image, make_inputs
from waiting import wait_until

from tandem.client import Client, TandemError, image
from tandem.launch.cluster import LocalCluster

ARCH = "qwen2_5_vl"
MAX_NEW = 10
TEXT_LONG = "Look carefully at the picture and describe every colour, shape and texture you see. "

pytestmark = pytest.mark.timeout(240)

# (name, text, [(seed, (w, h))])
CHATS = [
    ("text", "Hello, who are you?", []),
    ("one_image", "Describe the picture.", [(1, (56, 56))]),
    ("two_images", "Compare the two pictures.", [(2, (84, 56)), (3, (56, 112))]),
    ("resumed", TEXT_LONG * 2, [(4, (224, 224))]),  # ~64 image tokens + text > 64 reserved
]


def png(seed: int, size) -> bytes:
    buf = io.BytesIO()
    make_image(seed, size).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def openai_messages(text: str, images) -> list:
    parts = [{"type": "image_url", "image_url": {"url": data_url(png(s, sz))}} for s, sz in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint(ARCH)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    """The encoders' --allowed-local-media-path (file:// images are read under it only)."""
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def cluster(ckpt, media_dir):
    cl = LocalCluster(
        str(ckpt), encoders=2, languages=2,
        encoder_args=f"--allowed-local-media-path {media_dir}",
        language_args="--embedding-block-size 16 --default-reservation-tokens 64",
        router_args="--load-refresh-s 0.2 --eject-after-failures 2 --max-image-bytes 200000",
    )
    cl.start()
    yield cl
    cl.stop()


@pytest.fixture(scope="module")
def oracle(ckpt):
    model, processor = load(ckpt)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list | tuple) else [eos])
    cache = {}

    def expected(text, images):
        key = (text, tuple(images))
        if key not in cache:
            inputs = make_inputs(processor, text, [make_image(s, sz) for s, sz in images])
            tokens, _ = generate(model, inputs, MAX_NEW)
            cache[key] = tokens
        return cache[key]

    return expected, eos


def strip_eos(tokens, eos):
    tokens = list(tokens)
    while tokens and tokens[-1] in eos:
        tokens.pop()
    return tokens


def openai_client(cluster):
    from openai import OpenAI

    return OpenAI(base_url=cluster.http_url + "/v1", api_key="none", max_retries=0, timeout=60)


IDLE_HANG_GUARD_S = 120.0


def wait_idle(cluster) -> dict:
    """Poll every instance until nothing is held; return the loads then (with "idle":
    True). Past `IDLE_HANG_GUARD_S` (a hang guard: the claim is the state reached, not how
    soon), AssertionError with the last loads."""

    def loads() -> dict:
        langs, encs = cluster.loads("language"), cluster.loads("encoder")
        return {"language": langs, "encoder": encs, "idle": all(
            r.free_kv_pages == r.total_kv_pages
            and r.free_embedding_blocks == r.total_embedding_blocks
            and r.transferring + r.waiting + r.running == 0
            for r in langs.values()
        ) and all(r.queued_requests == 0 and r.open_rooms == 0 for r in encs.values())}

    return wait_until(loads, until=lambda state: state["idle"], timeout_s=IDLE_HANG_GUARD_S,
                      what="every instance idle (no page, block, room or request held)")


def log_tiers(cluster, rid: str) -> set[str]:
    """The tiers (router, encoder, language) whose log lines name `rid`."""
    return {ln.split("|")[0].strip().split("-")[0]
            for ln in cluster.log_text().splitlines() if rid in ln}


def request_log_lines(cluster, rid: str) -> dict[str, str]:
    """The one line per finished request of each tier that logged `rid`: the router's
    "<rid>: <outcome> in <n> ms ..." and the language's "<rid> room <n>: <outcome>"."""
    out = {}
    for ln in cluster.log_text().splitlines():
        tier = ln.split("|")[0].strip().split("-")[0]
        if tier == "router" and re.search(rf"{re.escape(rid)}: .+ in \d+ ms", ln):
            out["router"] = ln
        elif tier == "language" and re.search(rf"{re.escape(rid)} room \d+: ", ln):
            out["language"] = ln
    return out


@pytest.mark.parametrize("name,text,images", CHATS, ids=[c[0] for c in CHATS])
def test_greedy_equals_transformers(cluster, oracle, name, text, images):
    expected, eos = oracle
    want = expected(text, images)
    client = openai_client(cluster)
    msgs = openai_messages(text, images)
    resp = client.chat.completions.create(model="", messages=msgs, max_tokens=MAX_NEW,
                                          temperature=0)
    streamed, finish, usage = "", None, None
    for chunk in client.chat.completions.create(
        model="", messages=msgs, max_tokens=MAX_NEW, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            streamed += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    with Client(cluster.grpc_address) as c:
        parts = [image(png(s, sz)) for s, sz in images] + [text]
        sdk = c.chat([{"role": "user", "content": parts}], max_tokens=MAX_NEW)
        pieces = list(c.stream_chat([{"role": "user", "content": parts}], max_tokens=MAX_NEW))

    assert strip_eos(sdk.token_ids, eos) == strip_eos(want, eos)
    assert resp.choices[0].message.content == streamed == sdk.text == "".join(pieces)
    want_finish = "stop" if len(strip_eos(want, eos)) < MAX_NEW else "length"
    assert resp.choices[0].finish_reason == finish == sdk.finish_reason == want_finish
    assert resp.usage.completion_tokens == usage.completion_tokens == sdk.usage.completion_tokens
    assert resp.usage.prompt_tokens == sdk.usage.prompt_tokens > 0
    ext = resp.model_extra["tandem"]
    t = ext["timings"]
    assert set(t) >= {"preprocess_ms", "vit_ms", "transfer_ms", "queue_ms", "prefill_ms",
                      "decode_ms", "time_to_first_row_ms", "early_prefill_tokens",
                      "encoder_ranges"}
    if not images:  # straight to the language tier: no rows, no encoder
        assert t["encoder_bypassed"] and t["encoder_ranges"] == []
        assert t["time_to_first_row_ms"] == 0 and sdk.timings.encoder_ranges == ()
    else:
        # no split here: one range, the encoder's own, named by its address (gRPC alike);
        # rows not streamed: no early prefill
        assert t["time_to_first_row_ms"] > 0 and sdk.timings.time_to_first_row_ms > 0
        assert t["early_prefill_tokens"] == sdk.timings.early_prefill_tokens == 0
        if name != "resumed" or "resumes" in ext:  # the Encode's answer reached the router
            assert [(r["encoder"], r["first_media"], r["media"], r["fell_back"])
                    for r in t["encoder_ranges"]] == [(ext["encoder"], 0, len(images), False)]
            assert t["encoder_ranges"][0]["tokens"] > 0
        if name != "resumed" or sdk.timings.encoder_ranges:
            (sdk_range,) = sdk.timings.encoder_ranges
            assert sdk_range.encoder and sdk_range.media == len(images)
    if name == "resumed":
        assert resp.usage.prompt_tokens > 64
        # NOTE: `resumes` comes from the Encode answer; when the encoder reports a failure
        # after delivery (then Reattach is declined: the language already has the prompt),
        # there is no answer to read it from.
        assert ext.get("resumes", 0) >= 1 or ext["encoder_attempts"] > 1, ext


def test_a_file_url_under_the_allowed_path_answers_as_its_data_url(cluster, media_dir,
                                                                  tmp_path):
    """Through the router's HTTP door: a file:// image the encoders may read (their
    --allowed-local-media-path) gives the answer of the same image sent as a data URL; one
    outside that directory, or a symlink inside it that points out, is a 400 naming it."""
    raw = png(7, (56, 84))
    (media_dir / "cat.png").write_bytes(raw)
    (tmp_path / "out.png").write_bytes(raw)
    (media_dir / "link.png").symlink_to(tmp_path / "out.png")

    def chat(url: str) -> httpx.Response:
        body = {"model": "", "max_tokens": MAX_NEW, "temperature": 0, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what is it?"}]}]}
        return httpx.post(f"{cluster.http_url}/v1/chat/completions", json=body, timeout=120)

    by_data, by_file = chat(data_url(raw)), chat(f"file://{media_dir / 'cat.png'}")
    assert by_data.status_code == by_file.status_code == 200, by_file.text
    assert by_file.json()["choices"][0]["message"] == by_data.json()["choices"][0]["message"]
    for outside in (tmp_path / "out.png", media_dir / "link.png"):
        r = chat(f"file://{outside}")
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages[0].content[0].image_url"


def test_repeated_image_reaches_the_caching_encoder(cluster):
    client = openai_client(cluster)
    msgs = openai_messages("What is this?", [(11, (112, 112))])
    exts = []
    for _ in range(3):
        r = client.chat.completions.create(model="", messages=msgs, max_tokens=2, temperature=0)
        exts.append(r.model_extra["tandem"])
    assert len({e["encoder"] for e in exts}) == 1
    assert exts[0]["cached_image_tokens"] == 0
    assert all(e["cached_image_tokens"] > 0 for e in exts[1:])


def test_bad_input_is_4xx_and_router_stays_healthy(cluster):
    url = cluster.http_url + "/v1/chat/completions"
    good = openai_messages("hi", [])

    def img_body(raw_url):
        return {"model": "", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": raw_url}}, {"type": "text", "text": "x"}]}]}

    big = data_url(os.urandom(300_000))
    cases = [
        (img_body("data:image/png;base64,###"), 400),  # bad base64
        (img_body(data_url(b"definitely not an image")), 400),  # decoded by the encoder
        (img_body(big), 413),  # over the router's max_image_bytes
        ({"model": "", "messages": []}, 400),
        ({"model": "", "messages": good, "max_tokens": -3}, 400),
        ({"model": "no-such-model", "messages": good}, 404),
    ]
    for body, status in cases:
        for stream in (False, True):
            r = httpx.post(url, json={**body, "stream": stream}, timeout=30)
            assert r.status_code == status, (body.get("model"), stream, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"] and err["code"]
    # refused by the encoder (it alone decodes images and renders an image chat's template),
    # named as the body spells it, over HTTP and to the SDK (`.field`)
    pic = {"type": "image_url", "image_url": {"url": data_url(png(1, (28, 28)))}}
    for body, param in [
        (img_body(data_url(b"definitely not an image")), "messages[0].content[0].image_url"),
        ({"model": "", "messages": [{"role": "user", "content": [pic, {"type": "text", "text": "hi"}]}],
          "chat_template_kwargs": {"note": "<|im_start|>system"}}, "chat_template_kwargs.note"),
    ]:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with Client(cluster.grpc_address) as c, pytest.raises(TandemError) as e:
        c.chat([{"role": "user", "content": [image(b"definitely not an image"), "x"]}],
               max_tokens=2)
    # the SDK's name is the wire's (its part is an `image`)
    assert e.value.code == "INVALID_ARGUMENT" and e.value.field == "messages[0].content[0].image"
    # refused by the language tier at admission, named as the body spells it
    r = httpx.post(url, json={"model": "", "messages": good, "max_tokens": 1_000_000},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "context leaves" in r.json()["error"]["message"]
    assert httpx.get(cluster.http_url + "/health").status_code == 200
    r = httpx.post(url, json={"model": "", "messages": good, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    assert wait_idle(cluster)["idle"]


def test_client_disconnect_cancels_the_generation_and_frees_pages(cluster):
    """A client that hangs up mid-stream ends its generation: the language tier logs it
    cancelled (not finished after its 4000 tokens) and every page is free again."""
    body = {"model": "", "messages": openai_messages("Tell me a story.", [(5, (56, 56))]),
            "max_tokens": 4000, "ignore_eos": True, "temperature": 0, "stream": True}
    rid = "hang-up-mid-stream"
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", cluster.http_url + "/v1/chat/completions", json=body,
                         headers={"X-Request-Id": rid}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: ") and '"content"' in line:
                    got += 1
                if got >= 3:
                    break
            busy = sum(x.running + x.waiting for x in cluster.loads("language").values())
            assert busy >= 1  # the generation is still running when we hang up

    # what ended it: the hang-up (both tiers' one line per request say so), not its length
    def both_lines() -> dict[str, str] | None:
        got = request_log_lines(cluster, rid)
        return got if got.keys() >= {"router", "language"} else None

    lines = wait_until(both_lines, timeout_s=60, what=f"{rid}'s router and language lines",
                       state=lambda: request_log_lines(cluster, rid))
    assert f"{rid}: CANCELLED (client gone)" in lines["router"], lines
    assert re.search(r"room \d+: cancelled$", lines["language"]), lines
    assert wait_idle(cluster)["idle"]


def test_deadline_gives_504_or_error_event_and_frees(cluster):
    url = cluster.http_url + "/v1/chat/completions"
    body = {"model": "", "messages": openai_messages("Go on and on.", [(6, (56, 56))]),
            "max_tokens": 4000, "ignore_eos": True, "timeout_ms": 400}
    r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
    r = httpx.post(url, json={**body, "stream": True}, timeout=30)
    if r.status_code == 200:  # the deadline passed mid-stream: an error event, then [DONE]
        assert '"deadline_exceeded"' in r.text and r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.status_code == 504
    assert wait_idle(cluster)["idle"]


async def _many(cluster, n: int, timeout_ms: int, on_progress=None, stagger_s: float = 0.0,
                distinct_images: bool = False) -> list:
    url = cluster.http_url + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=timeout_ms / 1000 + 15, limits=limits) as http:

        async def one(i: int):
            await asyncio.sleep(i * stagger_s)
            img = (300 + i, (224, 168)) if distinct_images else (100 + i % 8, (56 + 28 * (i % 3), 56))
            body = {"model": "", "max_tokens": 4 + i % 5, "temperature": 0,
                    "timeout_ms": timeout_ms,
                    "messages": openai_messages(f"Request {i}: what is shown?", [img])}
            if i % 4 == 0:  # some streaming
                body["stream"] = True
                async with http.stream("POST", url, json=body) as r:
                    text = (await r.aread()).decode()
                    return r.status_code, text
            r = await http.post(url, json=body)
            return r.status_code, r.text

        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        if on_progress is not None:
            await on_progress(tasks)
        return await asyncio.gather(*tasks, return_exceptions=True)


def _ok(status_text) -> bool:
    status, text = status_text
    if status != 200:
        return False
    return '"error"' not in text and ("[DONE]" in text or '"finish_reason"' in text)


def test_200_concurrent_requests_then_everything_free(cluster):
    results = asyncio.run(_many(cluster, 200, timeout_ms=120_000))
    bad = [r for r in results if isinstance(r, BaseException) or not _ok(r)]
    assert not bad, bad[:3]
    state = wait_idle(cluster)
    assert state["idle"], state


def test_kill9_encoder_during_load(cluster):
    victim = cluster.instances["encoder-0"].pid
    timeout_ms = 30_000

    victim_addr = cluster.instances["encoder-0"].address

    async def kill_while_it_works(tasks):
        # Requests arrive over ~2.5 s; kill encoder-0 once it holds work, so some encodes
        # die mid-flight (retried elsewhere) and later requests meet a dead instance.
        await asyncio.sleep(0.5)
        for _ in range(200):
            load = (await asyncio.to_thread(cluster.loads, "encoder")).get(victim_addr)
            if load is not None and load.queued_requests + load.open_rooms > 0:
                break
            await asyncio.sleep(0.01)
        os.kill(victim, signal.SIGKILL)

    results = asyncio.run(_many(cluster, 50, timeout_ms, on_progress=kill_while_it_works,
                                stagger_s=0.05, distinct_images=True))
    for r in results:
        # nobody hung: each client's own timeout (its deadline + 15 s) would land here
        assert not isinstance(r, BaseException), r
        status, text = r
        if not _ok(r):  # a clear error: OpenAI error shape, 5xx status or error event
            assert status in (200, 502, 503, 504) and '"error"' in text, (status, text[:300])
    outcomes = collections.Counter("ok" if _ok(r) else f"{r[0]}: {r[1][:120]}" for r in results)
    retried = [ln for ln in cluster.lines if "retrying" in ln or "ejected" in ln]
    print("kill -9 outcomes:", dict(outcomes), "router retries/ejections:", len(retried))
    print("\n".join(retried[:5]))
    assert outcomes["ok"] >= 5
    # The cluster serves the next requests normally (on the surviving encoder).
    after = asyncio.run(_many(cluster, 10, timeout_ms))
    assert all(_ok(r) for r in after), after
    assert wait_idle(cluster)["idle"]


def stream_and_kill(cluster, victim_of) -> list[str]:
    """Stream a long chat; once 3 content chunks have arrived, SIGKILL `victim_of(pid of
    the language instance serving it)`; read the stream to its end (a read that waits
    past the client's 30 s timeout raises: the stream must end, not stall). Returns its
    `data:` events."""
    body = {"model": "", "messages": openai_messages("Keep talking.", [(7, (56, 56))]),
            "max_tokens": 4000, "ignore_eos": True, "stream": True, "timeout_ms": 60_000}
    pid_of = {i.address: i.pid for n, i in cluster.instances.items()
              if n.startswith("language-")}
    events = []
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", cluster.http_url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                events.append(line)
                if sum('"content"' in e for e in events) >= 3:
                    break
            busy = [a for a, x in cluster.loads("language").items() if x.running]
            assert len(busy) == 1
            os.kill(victim_of(pid_of[busy[0]]), signal.SIGKILL)
            events.extend(lines)  # the rest of the stream: it must end, with an error
    return [e for e in events if e.startswith("data: ")]


def test_kill9_language_mid_stream_ends_with_error_event(cluster):
    data = stream_and_kill(cluster, lambda pid: pid)
    assert data[-1] == "data: [DONE]" and '"error"' in data[-2], data[-3:]
    assert '"finish_reason": "stop"' not in "".join(data)
    # the surviving language instance serves the next requests
    after = asyncio.run(_many(cluster, 6, 30_000))
    assert all(_ok(r) for r in after), after


def test_conversation_turns_reach_the_language_instance_holding_their_prefix(cluster):
    client = openai_client(cluster)
    for conv in range(3):
        image_turn = openai_messages("What is it?", [(30 + conv, (56, 56))])[0]
        history = [{"role": "system", "content": f"Conversation {conv}. " * 30}, image_turn]
        langs, cached = [], []
        for turn in range(3):
            r = client.chat.completions.create(model="", messages=history, max_tokens=4,
                                               temperature=0)
            langs.append(r.model_extra["tandem"]["language"])
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            history += [{"role": "assistant", "content": r.choices[0].message.content},
                        {"role": "user", "content": f"And {turn}?"}]
        assert len(set(langs)) == 1, langs  # an idle cluster: affinity is never overruled
        assert cached[0] == 0  # its system prompt differs from the others' in page 0
        assert all(c > 0 for c in cached[1:]), cached


def test_request_id_is_echoed_and_greps_across_the_three_tiers(cluster):
    url = cluster.http_url + "/v1/chat/completions"
    # with an image, so it crosses all three tiers (a text-only chat skips the encoder)
    body = {"model": "", "messages": openai_messages("hi", [(5, (28, 28))]), "max_tokens": 3}
    for stream in (False, True):
        rid = f"abc-123-{int(stream)}"
        r = httpx.post(url, json={**body, "stream": stream}, headers={"X-Request-Id": rid},
                       timeout=30)
        assert r.status_code == 200 and r.headers["x-request-id"] == rid
        first = r.json() if not stream else json.loads(r.text.split("data: ", 2)[1])
        assert first["id"] == f"chatcmpl-{rid}"
        # the children's log lines arrive through pipes
        wait_until(lambda r=rid: log_tiers(cluster, r) >= {"router", "encoder", "language"},
                   timeout_s=60, what=f"{rid} in the router's, an encoder's and a language's log",
                   state=lambda r=rid: log_tiers(cluster, r))
        # the router's one line per finished request: status, tokens, stage times, route
        (line,) = [ln for ln in cluster.log_text().splitlines()
                   if ln.startswith("router") and f"{rid}: OK" in ln]
        assert " INFO " in line and "tokens " in line and " out" in line, line
        assert "stages " in line and "via " in line, line
    bad = httpx.post(url, json=body, headers={"X-Request-Id": "no spaces"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"


def test_ctrl_c_stops_every_child(cluster):
    up = psutil.Process(cluster.proc.pid)
    children = up.children(recursive=True)
    assert len(children) >= 3  # router, 1 surviving language, 1 surviving encoder
    assert cluster.stop(signal.SIGINT) == 0
    _, alive = psutil.wait_procs(children, timeout=60)  # a hang guard: the claim is none left
    assert alive == [], alive
    assert "[up] stopped" in cluster.log_text()

