"""The router's health answers (issue 42 point 5, issue 41 point 5), without tiers.

- /health is 200 while the router can serve some request (a language instance: text
  chats, completions, /tokenize), 503 with none or while draining; /ready and gRPC's
  "tandem.v1.Router" only while every tier is serving; each tier's state in the body.
- /health, /ready and /metrics pass outside every throttle: an address in refusal debt
  (two refused 8 MB /tokenize calls, the second still held) gets its /health while the
  second is still held; a body over the limit or a missing key does not touch them either.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.testclient import TestClient

from tandem.services.router.config import RouterConfig
from tandem.services.router.core import RouterCore
from tandem.services.router.dispatch.health import HealthTracker, InstanceState
from tandem.services.router.dispatch.registry import Instance
from tandem.services.router.openai.app import build_app


def make(**kw) -> RouterCore:
    return RouterCore(RouterConfig(**{"insecure_internal": True, "model": "m", **kw}))


def add(core: RouterCore, kind: str, healthy: bool) -> None:
    """An instance the pool knows, healthy or ejected (no channel: nothing is called)."""
    pool = core.registry.pool(kind)
    address = f"{kind}-{len(pool.instances)}:1"
    state = InstanceState.HEALTHY if healthy else InstanceState.EJECTED
    pool.instances[address] = Instance(kind, address, None, None, None,
                                       HealthTracker(3, state=state))


@pytest.mark.parametrize("encoder,language,health,ready,status", [
    ((True,), (True,), 200, 200, "ok"),
    ((False,), (True,), 200, 503, "degraded"),  # an encoder down: text chats still served
    ((), (True,), 200, 503, "degraded"),
    ((True,), (False,), 503, 503, "unavailable"),  # nothing is served without a language
    ((True,), (), 503, 503, "unavailable"),
    ((), (), 503, 503, "unavailable"),
])
def test_health_is_200_while_some_request_is_served(encoder, language, health, ready, status):
    core = make()
    for up in encoder:
        add(core, "encoder", up)
    for up in language:
        add(core, "language", up)
    c = TestClient(build_app(core))
    h, r = c.get("/health"), c.get("/ready")
    assert (h.status_code, r.status_code) == (health, ready)
    assert h.json() == r.json()  # one body, two questions
    body = h.json()
    assert body["status"] == status and body["ready"] is (ready == 200)
    for tier, ups in (("encoder", encoder), ("language", language)):
        state = "serving" if any(ups) else ("down" if ups else "absent")
        assert body["tiers"][tier] == {"state": state, "healthy": sum(ups),
                                       "instances": len(ups)}
    assert core.ready() is (ready == 200)  # gRPC's "tandem.v1.Router" (main._health_loop)
    assert c.head("/health").status_code == health


def test_draining_is_unavailable():
    core = make()
    add(core, "encoder", True)
    add(core, "language", True)
    core.draining = True
    c = TestClient(build_app(core))
    assert c.get("/health").status_code == 503 and c.get("/ready").status_code == 503
    assert c.get("/health").json()["draining"] is True


def test_health_answers_at_once_from_an_address_in_refusal_debt():
    """Issue 41's case: two refused 8 MB /tokenize calls from one address (the second
    held for the first's debt, as the probe saw), then /health from that address answers
    while that call is still held, and so do /ready and /metrics. The same calls show the hold is real: a third
    /tokenize from the address waits behind the debt."""
    core = make()
    add(core, "encoder", True)
    add(core, "language", True)
    app = build_app(core)
    refused = b'{"prompt": "' + b"x" * (8 << 20) + b'", "model": 7}'  # 400: model not a string

    async def main() -> None:
        transport = httpx.ASGITransport(app=app, client=("203.0.113.7", 4000))
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as c:
            first = await c.post("/tokenize", content=refused,
                                 headers={"content-type": "application/json"})
            assert first.status_code == 400
            held = asyncio.create_task(c.post("/tokenize", content=refused, headers={
                "content-type": "application/json"}))
            await asyncio.sleep(0.2)
            assert not held.done()  # held for the debt: the throttle is on this address
            for path in ("/health", "/ready", "/metrics"):
                r = await c.get(path)
                # answered while the debt still holds the refused call: not queued behind
                # it (the hold lasts seconds; the state, not a clock, shows the order)
                assert r.status_code == 200 and not held.done(), path
            held.cancel()

    asyncio.run(main())


def test_health_and_metrics_pass_the_body_limit_and_the_key():
    core = make(api_key="k", max_request_bytes=4096)
    add(core, "language", True)
    c = TestClient(build_app(core))
    big = {"content-length": "100000"}
    assert c.post("/v1/chat/completions", headers=big, content=b"x" * 100000).status_code == 413
    assert c.request("GET", "/health", headers=big, content=b"x" * 100000).status_code == 200
    assert c.get("/metrics").status_code == 200
    assert c.get("/v1/models").status_code == 401  # the API still wants its key
