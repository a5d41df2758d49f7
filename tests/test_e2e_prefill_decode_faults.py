"""E/P/D under faults (issue 39): `tandem up --prefill 2 --decode 2`, 32 concurrent
streamed image and text chats, and one instance killed (SIGKILL) or frozen (SIGSTOP)
once it holds work: a prefill instance mid-prefill, a decode instance mid-transfer.

Must hold: no request that had produced no output fails (the router retries it on other
instances: a broken or silent prefill instance ends the decode instance's request with
UNAVAILABLE before any output; a frozen one is ejected by the router's polls; a request
whose first token had gone out may end with an error event); afterwards every page, block
and room is free on every live instance (a killed one is restarted by `tandem up`).

The kill -9 of a prefill instance runs in CI; the other three are `slow` (make test-slow).
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
from test_e2e_cluster import openai_messages
from waiting import wait_until

from tandem.launch.cluster import LocalCluster

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


async def one(http: httpx.AsyncClient, url: str, i: int) -> tuple[bool, str]:
    """A streamed chat: (had output before its end, how it ended: "ok" or the error)."""
    await asyncio.sleep(i * 0.03)
    images = [(500 + i, (112, 84))] if i % 2 else []
    body = {"model": "", "max_tokens": 12, "temperature": 0, "stream": True,
            "ignore_eos": True, "messages": openai_messages(f"Request {i}: tell me more.",
                                                            images)}
    output = False
    async with http.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return False, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                return output, f"error event: {msg['error'].get('message', '')[:160]}"
            output |= any(c.get("delta", {}).get("content") for c in msg.get("choices", []))
    return output, "ok"


def fault_under_load(cluster, victim_name: str, sig: int) -> collections.Counter:
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
            os.kill(victim.pid, sig)
            if sig == signal.SIGSTOP:
                try:
                    await asyncio.sleep(FROZEN_S)
                finally:
                    os.kill(victim.pid, signal.SIGCONT)
            return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        results = asyncio.run(run())
    finally:
        if sig == signal.SIGSTOP:
            os.kill(victim.pid, signal.SIGCONT)
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

    def loads() -> dict:
        return {**cluster.loads("prefill"), **cluster.loads("decode")}

    def idle(loads: dict) -> bool:
        return len(loads) == 4 and all(
            r.free_kv_pages == r.total_kv_pages
            and r.free_embedding_blocks == r.total_embedding_blocks
            and r.transferring + r.waiting + r.running == 0 for r in loads.values())

    # a killed instance is back (tandem up restarts it): all four answer, every page free
    wait_until(loads, until=idle, timeout_s=180,
               what="every page and block free on the four instances")
    return outcomes


def test_kill9_of_a_prefill_instance_mid_prefill(cluster):
    fault_under_load(cluster, "prefill-0", signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize(("victim", "sig"), [
    ("prefill-1", signal.SIGSTOP), ("decode-0", signal.SIGKILL), ("decode-1", signal.SIGSTOP)],
    ids=["sigstop-prefill", "kill9-decode", "sigstop-decode"])
def test_other_faults_of_prefill_and_decode_instances(cluster, victim, sig):
    fault_under_load(cluster, victim, sig)
