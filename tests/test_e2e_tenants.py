"""Tenants cannot read each other's prompts or images through the caches (issue 31,
finding 3): with a keys file, each API key names a tenant, and the prefix cache and the
encoder's embedding cache are shared only within a tenant and its `cache_salt` (vLLM's
field). So `cached_tokens` / `cached_image_tokens` (and a ViT time of 0) that a caller
sees come only from its own tenant's requests.

Before: user B recovered a secret in user A's system prompt by reading cached_tokens, a
guess at a time, and learned that someone had sent an image by re-sending it."""

from __future__ import annotations

import base64

import httpx
import pytest
from encoder_peers.chats import png

from tandem.client import Client
from tandem.launch.cluster import LocalCluster

KEYS = {"acme": "acme-key-0001", "beta": "beta-key-0001"}
SECRET = ("You are the support bot of ACME. The door code is 4711; never tell it. " * 8)


@pytest.fixture(scope="module")
def cluster(checkpoint, tmp_path_factory):
    keys = tmp_path_factory.mktemp("tenants") / "keys.yaml"
    keys.write_text("tenants:\n" + "".join(f"  {t}: {{keys: [{k}]}}\n" for t, k in KEYS.items()))
    cl = LocalCluster(str(checkpoint("qwen2_5_vl")), router_args=f"--api-keys-file {keys}")
    cl.start()
    yield cl
    cl.stop()


def ask(cluster, tenant: str, content, cache_salt: str | None = None,
        system: str = SECRET) -> dict:
    body = {"model": "", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": content}]}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    r = httpx.post(cluster.http_url + "/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {KEYS[tenant]}"})
    assert r.status_code == 200, r.text
    out = r.json()
    return {"cached_tokens": out["usage"]["prompt_tokens_details"]["cached_tokens"],
            "cached_image_tokens": out["tandem"].get("cached_image_tokens", 0)}


def test_prompt_pages_are_shared_only_within_a_tenant_and_its_salt(cluster):
    question = "What is the door code?"
    assert ask(cluster, "acme", question)["cached_tokens"] == 0
    assert ask(cluster, "acme", question)["cached_tokens"] > 0  # its own cache works
    assert ask(cluster, "beta", question)["cached_tokens"] == 0  # acme's pages: invisible
    assert ask(cluster, "beta", question)["cached_tokens"] > 0
    assert ask(cluster, "acme", question, cache_salt="session-1")["cached_tokens"] == 0
    assert ask(cluster, "acme", question, cache_salt="session-1")["cached_tokens"] > 0
    # the SDK's cache_salt is the same field
    with Client(cluster.grpc_address, api_key=KEYS["beta"]) as c:
        msgs = [{"role": "system", "content": SECRET}, {"role": "user", "content": question}]
        first = c.chat(msgs, max_tokens=2, cache_salt="sdk")
        again = c.chat(msgs, max_tokens=2, cache_salt="sdk")
    assert first.usage.cached_tokens == 0 and again.usage.cached_tokens > 0


def test_an_image_one_tenant_sent_is_no_cache_hit_for_another(cluster):
    url = "data:image/png;base64," + base64.b64encode(png(64, 48, 4242)).decode()
    content = [{"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": "what is this?"}]
    system = "You describe pictures for ACME's catalogue, one line each. " * 4  # new to both
    assert ask(cluster, "acme", content, system=system)["cached_image_tokens"] == 0
    hit = ask(cluster, "acme", content, system=system)
    assert hit["cached_image_tokens"] > 0 or hit["cached_tokens"] > 0
    other = ask(cluster, "beta", content, system=system)
    assert other == {"cached_tokens": 0, "cached_image_tokens": 0}


def test_a_key_of_no_tenant_is_refused(cluster):
    r = httpx.post(cluster.http_url + "/v1/chat/completions", timeout=30,
                   headers={"Authorization": "Bearer not-a-key-at-all"},
                   json={"model": "", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401
