"""A client whose requests keep being refused is held, one request at a time, until its
refused bytes are repaid (services/router/refusals.py; issue 16's text flood): the budget
itself, then the HTTP and gRPC front ends, with a second client served meanwhile."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from tandem.services.router.admission import client_id
from tandem.services.router.config import RouterConfig
from tandem.services.router.core import RouterCore
from tandem.services.router.openai.app import build_app
from tandem.services.router.refusals import FLOOR_BYTES, HeldTooLong, RefusalBudget


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_only_refusals_cost_and_time_repays_them():
    clock = Clock()
    b = RefusalBudget(rate=1000, burst=10_000, max_hold_s=30, clock=clock)

    async def go():
        for status in (200, 200, 429, 499, 503):  # served, our load, client gone, our fault
            (await b.enter("a")).answered(status, 50_000)
        assert b.level("a") == 10_000
        # three requests let in while the budget is positive, then refused one by one
        t1, t2, t3 = [await b.enter("a") for _ in range(3)]
        t1.answered(400, 10)  # a small refusal costs the floor
        assert b.level("a") == 10_000 - FLOOR_BYTES
        t2.answered(413, 8_000)
        assert b.level("a") == 10_000 - FLOOR_BYTES - 8_000 < 0
        t3.answered(400, 10**9)  # capped: max_hold_s of refill
        assert b.level("a") == -1000 * 30
        assert b.level("b") == 10_000  # another client is untouched
        clock.t += 40  # repaid, and refilled up to the burst only
        assert b.level("a") == 10_000

    asyncio.run(go())


def test_in_debt_requests_wait_one_at_a_time_and_the_queue_is_bounded():
    # a real clock: 2000 bytes of debt at 100 kB/s is repaid in 20 ms
    b = RefusalBudget(rate=100_000, burst=0, max_hold_s=0.5)

    async def go():
        (await b.enter("a")).answered(400, 2000)
        assert b.level("a") < 0
        first = await b.enter("a")  # waited for the debt; holds the client's gate
        second = asyncio.ensure_future(b.enter("a"))
        await asyncio.sleep(0.1)  # the debt is long repaid, yet the gate is held
        assert not second.done()
        first.answered(400, 2000)  # refused again: the next one waits for this debt too
        ticket = await second
        third = asyncio.ensure_future(b.enter("a"))
        with pytest.raises(HeldTooLong) as held:  # never let go of the gate: 429
            await third
        assert held.value.retry_after_s >= 1
        ticket.close()
        (await b.enter("a")).close()  # the gate is free again
        other = await b.enter("b")  # another client never waited on a's gate
        other.close()

    asyncio.run(go())


def test_off_when_rate_is_zero():
    """`rate` 0 turns the budget off: a refusal leaves no debt and no request waits. With a
    clock that never moves, a budget that were on would hold the next request until its
    hold ran out (HeldTooLong) or divide by the zero rate."""
    holds: list[str] = []
    b = RefusalBudget(rate=0, burst=0, max_hold_s=1, clock=Clock(), on_hold=holds.append)

    async def go():
        for status in (400, 401, 413):
            (await b.enter("a")).answered(status, 10**6)
            assert b.level("a") == 0  # no debt, however large the refusal
        # three at once, none closed: no gate is taken, so none waits on another
        tickets = await asyncio.gather(*(b.enter("a") for _ in range(3)))
        for t in tickets:
            t.answered(400, 10**6)
        assert b.level("a") == 0
        assert holds == []  # never held: neither "passed" after a wait nor "refused"

    asyncio.run(go())


def _client(core: RouterCore, host: str) -> TestClient:
    return TestClient(build_app(core), client=(host, 50000))


def test_http_holds_the_refused_client_and_serves_another():
    core = RouterCore(RouterConfig(insecure_internal=True, refusal_bytes_per_s=1,
                                   refusal_burst_bytes=0, refusal_max_hold_s=0.3))
    flooder, calm = _client(core, "10.0.0.1"), _client(core, "10.0.0.2")
    bad = {"model": "", "messages": []}  # 400
    passed = core.metrics.refusal_holds.labels("passed")  # process-wide: count deltas
    before = passed._value.get()
    assert calm.get("/v1/models").status_code == 200  # served: costs nothing
    assert calm.get("/v1/models").status_code == 200
    assert passed._value.get() == before
    assert flooder.post("/v1/chat/completions", json=bad).status_code == 400
    # in debt (FLOOR_BYTES at 1 B/s, capped at 0.3 s of refill: 0.3 bytes): held, passes
    first = flooder.post("/v1/chat/completions", json=bad)
    assert first.status_code == 400
    assert passed._value.get() == before + 1
    assert calm.get("/v1/models").status_code == 200  # its own budget: not held
    assert passed._value.get() == before + 1
    m = calm.get("/metrics").text
    assert 'tandem_router_refusal_holds_total{outcome="passed"}' in m


def test_http_a_queue_behind_a_held_request_gets_429_with_retry_after():
    core = RouterCore(RouterConfig(insecure_internal=True, refusal_bytes_per_s=1000,
                                   refusal_burst_bytes=0, refusal_max_hold_s=0.2))
    app = build_app(core)

    async def go():
        import httpx

        transport = httpx.ASGITransport(app=app, client=("10.0.0.9", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as c:
            r = await c.post("/v1/chat/completions", json={"model": "", "messages": []})
            assert r.status_code == 400
            # the client's gate is taken by a request that never answers (held in flight)
            blocker = await core.refusals.enter(client_id("10.0.0.9"))
            r = await c.post("/v1/chat/completions", json={"model": "", "messages": []})
            blocker.close()
            return r

    r = asyncio.run(go())
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "overloaded"
    assert "refused requests" in r.json()["error"]["message"]
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["connection"] == "close"


def test_grpc_holds_the_refused_client_one_at_a_time(tmp_path):
    """The SDK's gRPC port: a client in debt is held one request at a time; requests queued
    behind the others past the hold get RESOURCE_EXHAUSTED, the rest their own 400."""
    import sys
    from pathlib import Path

    import httpx

    sys.path.insert(0, str(Path(__file__).parent))
    from test_router_live import _serve_router

    from tandem.client import AsyncClient, InvalidRequestError, ResourceExhaustedError

    served = _serve_router(refusal_bytes_per_s=1000, refusal_burst_bytes=0,
                           refusal_max_hold_s=0.3)
    cfg = next(served)
    try:
        async def go():
            async with AsyncClient(f"127.0.0.1:{cfg.grpc_port}", api_key="k3y",
                                   retries=0) as c:
                async def bad():
                    try:
                        await c.chat([{"role": "wizard", "content": "x"}])
                    except (InvalidRequestError, ResourceExhaustedError) as e:
                        return e
                first = await bad()  # not in debt yet: refused at once, charged
                # each held one waits ~0.3 s for the last one's debt: the 8th is past the
                # hold (0.3 s + 1 s slack) while still queued
                rest = await asyncio.gather(*[bad() for _ in range(8)])
            return first, rest

        first, rest = asyncio.run(go())
        metrics = httpx.get(f"http://127.0.0.1:{cfg.http_port}/metrics").text
    finally:
        next(served, None)
    assert isinstance(first, InvalidRequestError)
    kinds = [type(e).__name__ for e in rest]
    assert "InvalidRequestError" in kinds and "ResourceExhaustedError" in kinds, kinds
    assert all("refused requests" in str(e) for e in rest if isinstance(e, ResourceExhaustedError))
    assert 'tandem_router_refusal_holds_total{outcome="refused"}' in metrics
