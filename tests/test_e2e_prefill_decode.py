"""E/P/D end to end through real processes (issue 39): `tandem up --prefill 1 --decode 2`
on the tiny Qwen2.5-VL, mTLS between the tiers, driven by the `openai` client as a user
drives it.

Proves: greedy answers (an image chat, a text chat, streamed and not, `n` 2) equal
transformers `generate()`; each answer names the prefill instance that ran its prompt and
the decode instance that decoded it (the router's choice, in the response's `tandem`
extension); the prefill instance's mTLS certificate admits the new prefill -> decode path
(Prefill is refused to any other role: tests/test_internal_tls.py); every page, block and
room is free on every instance afterwards; the router's /health names the prefill tier.

No test here bounds a duration: waits end on the state they wait for (tests/waiting.py).
"""

from __future__ import annotations

import json

import httpx
import pytest
from test_e2e_cluster import MAX_NEW, data_url, oracle, png, strip_eos  # noqa: F401
from waiting import wait_until

from tandem.client import Client, image
from tandem.launch.cluster import LocalCluster

ARCH = "qwen2_5_vl"  # (the oracle fixture is test_e2e_cluster's, MAX_NEW tokens)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint(ARCH)


@pytest.fixture(scope="module")
def cluster(ckpt):
    cl = LocalCluster(
        str(ckpt), encoders=1, up_args=["--prefill", "1", "--decode", "2"],
        language_args="--embedding-block-size 16 --default-reservation-tokens 64 "
                      "--kv-staging-pages 64",
        router_args="--load-refresh-s 0.2")
    cl.start()
    yield cl
    cl.stop()


def messages(text: str, images) -> list:
    parts = [{"type": "image_url", "image_url": {"url": data_url(png(s, sz))}}
             for s, sz in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def wait_idle(cluster) -> None:
    def idle() -> bool:
        langs = {**cluster.loads("prefill"), **cluster.loads("decode")}
        return len(langs) == 3 and all(
            r.free_kv_pages == r.total_kv_pages
            and r.free_embedding_blocks == r.total_embedding_blocks
            and r.transferring + r.waiting + r.running == 0 for r in langs.values())

    wait_until(idle, timeout_s=120, what="every page and block free on P and both Ds")


@pytest.mark.parametrize(("text", "images"), [
    ("Describe the picture in detail.", [(1, (56, 56))]),
    ("Hello, who are you?", []),
])
def test_greedy_answers_equal_generate_and_name_both_instances(
        cluster, oracle, text, images):  # noqa: F811  (test_e2e_cluster's fixture)
    expected, eos = oracle
    want = expected(text, images)
    with Client(cluster.grpc_address) as c:
        parts = [image(png(s, sz)) for s, sz in images] + [text]
        sdk = c.chat([{"role": "user", "content": parts}], max_tokens=MAX_NEW)
    assert strip_eos(sdk.token_ids, eos) == strip_eos(want, eos)
    body = {"model": "", "messages": messages(text, images), "max_tokens": MAX_NEW,
            "temperature": 0, "n": 2}
    r = httpx.post(cluster.http_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [ch["message"]["content"] for ch in out["choices"]] == [sdk.text, sdk.text]
    ext = out["tandem"]
    assert ext["prefill"] in cluster.addresses("prefill"), ext
    assert ext["language"] in cluster.addresses("decode"), ext
    with httpx.stream("POST", cluster.http_url + "/v1/chat/completions", timeout=120,
                      json={**body, "n": 1, "stream": True}) as s:
        streamed = "".join(
            json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            for line in s.iter_lines()
            if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert streamed == sdk.text
    wait_idle(cluster)


def test_health_names_the_prefill_tier(cluster):
    h = httpx.get(cluster.http_url + "/health", timeout=10).json()
    assert h["tiers"]["prefill"] == {"state": "serving", "healthy": 1, "instances": 1}, h
    assert h["tiers"]["language"]["healthy"] == 2, h
