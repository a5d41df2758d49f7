"""E/P/D under faults (issue 39): `tandem up --prefill 2 --decode 2`, 32 concurrent
streamed image and text chats, and one instance killed (SIGKILL) or frozen (SIGSTOP)
once it holds work: a prefill instance mid-prefill, a decode instance mid-transfer.

Must hold: no request that had produced no output fails (the router retries it on other
instances: a broken or silent prefill instance ends the decode instance's request with
UNAVAILABLE before any output; a frozen one is ejected by the router's polls; a request
whose first token had gone out may end with an error event); afterwards every page, block
and room is free on every live instance (a killed one is restarted by `tandem up`).

"Output" is what the router streamed (`Verdict`): a chunk per token it relayed. A token's
text may be empty (the tiny model's tokenizer holds back a lone UTF-8 lead byte, and 10 of
the 32 chats' greedy first tokens are one): a request cut after such a first token has had
output (the router no longer retries it) though its client has read no text.

A draining instance (SIGTERM) fails no request at all: it finishes what it holds and
refuses the rest before any output.

The kill -9 of a prefill instance runs in CI; the others are `slow` (make test-slow).
No test here bounds a duration: waits end on the state they wait for (tests/waiting.py).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal

import httpx
import pytest
from fastapi.testclient import TestClient
from test_e2e_cluster import openai_messages
from waiting import process_alive, wait_until

from tandem.launch.cluster import LocalCluster
from tandem.services.router.config import RouterConfig
from tandem.services.router.core import RouterCore
from tandem.services.router.errors import RouterError, Tier
from tandem.services.router.openai.app import build_app
from tandem.services.router.request import Output
from tandem.v1 import language_pb2

pytestmark = pytest.mark.timeout(420)
CONCURRENCY = 32
FROZEN_S = 20  # past the router's ejection of the silent instance


@pytest.fixture(scope="module")
def cluster(checkpoint):
    cl = LocalCluster(
        str(checkpoint("qwen2_5_vl")), encoders=1, up_args=["--prefill", "2", "--decode", "2"],
        language_args="--kv-staging-pages 64",
        router_args="--load-refresh-s 0.2 --eject-after-failures 2")
    cl.start()
    yield cl
    cl.stop()


class Verdict:
    """One streamed chat's answer, read line by line (`read`): whether it had output before
    it ended, and how it ended ("ok" or the error).

    Output is a chunk carrying a token, as the router streams them (services/router/openai/
    app.py `_sse`): after the role chunk, one chunk per token message it relays, its
    `delta.content` the token's text, "" while that text is held back. Once one went out
    the router retries the request no more (dispatcher.py `_generate`: an attempt that
    yielded is not retried), and a failure after it is an error event. A failure before it
    is an HTTP error status (the stream starts at the first token), or an error event after
    no token chunk: either is a request without output that failed."""

    def __init__(self) -> None:
        self.output = False
        self.text = False  # some of that output was text (for the report only)
        self.ended: str | None = None  # "ok", or the error; None while the stream goes on

    def status(self, code: int, body: bytes) -> None:
        if code != 200:
            self.ended = f"HTTP {code}: {body[:200]!r}"

    def read(self, line: str) -> None:
        if self.ended is not None or not line.startswith("data: "):
            return
        if line == "data: [DONE]":
            self.ended = "ok"
            return
        msg = json.loads(line[6:])
        if "error" in msg:
            self.ended = f"error event: {msg['error'].get('message', '')[:160]}"
            return
        tokens = [c["delta"] for c in msg.get("choices", [])
                  if "content" in c.get("delta", {}) and "role" not in c["delta"]]
        self.output |= bool(tokens)
        self.text |= any(d["content"] for d in tokens)

    def result(self) -> tuple[bool, str]:
        ended = self.ended or "the stream ended without [DONE]"
        if self.output and not self.text and ended != "ok":
            ended += " (its output had no text yet)"
        return self.output, ended


async def one(http: httpx.AsyncClient, url: str, i: int) -> tuple[bool, str]:
    """A streamed chat: (had output before its end, how it ended: "ok" or the error)."""
    await asyncio.sleep(i * 0.03)
    images = [(500 + i, (112, 84))] if i % 2 else []
    body = {"model": "", "max_tokens": 12, "temperature": 0, "stream": True,
            "ignore_eos": True, "messages": openai_messages(f"Request {i}: tell me more.",
                                                            images)}
    verdict = Verdict()
    async with http.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            verdict.status(r.status_code, await r.aread())
        else:
            async for line in r.aiter_lines():
                verdict.read(line)
    return verdict.result()


def settled(cluster) -> None:
    """Wait until all four instances answer with every page, block and room free (a killed
    one is back: `tandem up` restarts it), and the router counts every instance healthy
    again (it re-admits an ejected one after its probes)."""
    def tiers() -> dict:
        return httpx.get(cluster.http_url + "/health", timeout=10).json()["tiers"]

    wait_until(tiers, until=lambda t: all(v["healthy"] == v["instances"] for v in t.values()),
               timeout_s=180, what="every instance healthy in the router's /health")

    def loads() -> dict:
        return {**cluster.loads("prefill"), **cluster.loads("decode")}

    def idle(loads: dict) -> bool:
        return len(loads) == 4 and all(
            r.free_kv_pages == r.total_kv_pages
            and r.free_embedding_blocks == r.total_embedding_blocks
            and r.transferring + r.waiting + r.running == 0 for r in loads.values())

    wait_until(loads, until=idle, timeout_s=180,
               what="every page and block free on the four instances")


def fault_under_load(cluster, victim_name: str, sig: int) -> collections.Counter:
    # NOTE: a test that failed before its own `settled` (below) leaves its victim
    # restarting: the next one starts from a whole cluster, never from that failure
    settled(cluster)
    victim = cluster.instances[victim_name]
    kind = victim_name.split("-")[0]
    url = cluster.http_url + "/v1/chat/completions"

    async def run():
        limits = httpx.Limits(max_connections=CONCURRENCY)
        async with httpx.AsyncClient(timeout=180, limits=limits) as http:
            tasks = [asyncio.ensure_future(one(http, url, i)) for i in range(CONCURRENCY)]
            for _ in range(1000):
                load = (await asyncio.to_thread(cluster.loads, kind)).get(victim.address)
                if load is not None and load.transferring + load.waiting + load.running > 0:
                    break
                await asyncio.sleep(0.01)
            os.kill(pid, sig)
            if sig == signal.SIGSTOP:
                try:
                    await asyncio.sleep(FROZEN_S)
                finally:
                    os.kill(pid, signal.SIGCONT)
            return await asyncio.gather(*tasks, return_exceptions=True)

    pid = victim.pid  # the process signalled (a restart gets another)
    try:
        results = asyncio.run(run())
    finally:
        if sig == signal.SIGSTOP:
            os.kill(pid, signal.SIGCONT)
    if sig == signal.SIGTERM:  # drained, it exits: gone before the cluster is whole again
        wait_until(lambda: not process_alive(pid), timeout_s=180, what=f"{victim_name} drained and gone")
    outcomes = collections.Counter(
        repr(r)[:160] if isinstance(r, BaseException)
        else ("ok" if r[1] == "ok" else f"{'after' if r[0] else 'BEFORE'} output: {r[1]}")
        for r in results)
    print(f"{signal.Signals(sig).name} {victim_name}:", dict(outcomes))
    print("\n".join([ln for ln in cluster.lines if "retrying" in ln or "ejected" in ln][:6]))
    failed_silent = {k: v for k, v in outcomes.items() if k != "ok" and not
                     k.startswith("after output")}
    assert not failed_silent, dict(outcomes)  # no request without output failed
    assert outcomes["ok"] >= CONCURRENCY // 2, dict(outcomes)
    settled(cluster)  # a killed instance is back: all four answer, every page free
    return outcomes


def test_kill9_of_a_prefill_instance_mid_prefill(cluster):
    fault_under_load(cluster, "prefill-0", signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize(("victim", "sig"), [
    ("prefill-1", signal.SIGSTOP), ("decode-0", signal.SIGKILL), ("decode-1", signal.SIGSTOP)],
    ids=["sigstop-prefill", "kill9-decode", "sigstop-decode"])
def test_other_faults_of_prefill_and_decode_instances(cluster, victim, sig):
    fault_under_load(cluster, victim, sig)


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["prefill-0", "decode-0"])
def test_a_draining_instance_finishes_what_it_holds(cluster, victim):
    """SIGTERM of a prefill or a decode instance once it holds work, under load: it drains
    (refuses new calls with UNAVAILABLE, its health NOT_SERVING, and finishes the calls it
    has: a prefill instance its Prefill streams, holding their pages until each decode
    instance has landed them; a decode instance its streams), then exits and `tandem up`
    restarts it. No request fails at all, not even after output: what it held ends on it,
    what it refused went elsewhere before any output."""
    outcomes = fault_under_load(cluster, victim, signal.SIGTERM)
    assert outcomes == {"ok": CONCURRENCY}, dict(outcomes)


@pytest.mark.parametrize("text", ["", "x"])
def test_a_token_streamed_before_a_failure_is_output_even_without_text(text):
    """The router's HTTP door over a stand-in dispatcher whose request relays one token
    (its text `text`: "" is a lone UTF-8 lead byte's, held back) and then fails as a
    decode instance whose prefill instance died mid-hand-off reports it: the client reads
    the token's chunk, then an error event; the verdict is "after output" with or without
    text. The same failure before the token is an HTTP error, judged "before output"."""
    broken = RouterError("UNAVAILABLE", "language: prefill instance p:1: UNAVAILABLE: "
                         "Stream removed", tier=Tier.LANGUAGE, culprit="p:1")

    def verdict_of(tokens: int) -> tuple[bool, str]:
        async def generate(req):
            for _ in range(tokens):
                yield Output(language_pb2.LanguageGenerateResponse(token_ids=[157], text=text))
            raise broken

        core = RouterCore(RouterConfig(insecure_internal=True))
        core.dispatcher.generate = generate
        body = {"model": "", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        verdict = Verdict()
        with TestClient(build_app(core)) as client, client.stream(
                "POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                verdict.status(r.status_code, r.read())
            else:
                for line in r.iter_lines():
                    verdict.read(line)
        return verdict.result()

    assert verdict_of(1) == (True, "error event: language: prefill instance p:1: UNAVAILABLE: "
                             f"Stream removed{'' if text else ' (its output had no text yet)'}")
    output, ended = verdict_of(0)
    assert not output and ended.startswith("HTTP 503: ") and "Stream removed" in ended
