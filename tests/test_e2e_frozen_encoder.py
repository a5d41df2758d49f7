"""A frozen encoder or language instance (SIGSTOP) under load must not stall the cluster
(issue 16, finding 2; issue 31, finding 4).

`tandem up` with 2 encoders + 2 language instances at their default sizes (64 embedding
blocks, 8 per room: 8 rooms per language instance), 120 concurrent image chats; encoder-0
is frozen once it holds work and stays frozen until every request has its answer. A
frozen process is only visible as silence: its rooms hold language blocks until the
router ejects it, and then each of its requests must move to the healthy encoder at once
(Reattach) instead of waiting out the transfer timeout while requests routed to the
healthy encoder starve for blocks.

Target (the issue's): no request fails, not even those the frozen encoder held.

The same for a language instance (60 concurrent image chats; language-0 frozen once it
holds work, thawed 25 s later): the router ejects it when its load polls go unanswered,
and every request that has no output yet moves to language-1 (a whole-request retry)
instead of waiting for the instance; a request already decoding there waits and finishes
once it wakes. Before, such requests got 504 "language: Deadline Exceeded": an encoder's
transfer to the frozen instance timed out, the retry's Reattach to it timed out too, and
that internal call's own 5 s timeout was reported as the request's deadline.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal

import pytest
from test_e2e_cluster import _many, _ok, wait_idle

from tandem.launch.cluster import LocalCluster

pytestmark = pytest.mark.timeout(300)
CONCURRENCY = 120
FROZEN_LANGUAGE_S = 25  # past ejection (three unanswered polls) and a transfer timeout + Reattach


@pytest.fixture(scope="module")
def cluster(checkpoint):
    cl = LocalCluster(str(checkpoint("qwen2_5_vl")), encoders=2, languages=2)
    cl.start()
    yield cl
    cl.stop()


def _busy(load, kind: str) -> bool:
    """The instance holds work (so a freeze catches requests in flight)."""
    if kind == "encoder":
        return load.queued_requests + load.open_rooms > 0
    return load.transferring + load.waiting + load.running > 0


def freeze_under_load(cluster, victim_name: str, n: int, timeout_ms: int, stagger_s: float,
                      thaw_after_s: float | None, log_words: tuple[str, ...]) -> None:
    """n concurrent image chats; `victim_name` SIGSTOPped once it holds work (thawed after
    `thaw_after_s`, else when every request has its answer); every request must succeed
    and, afterwards, every page and block be free everywhere."""
    victim = cluster.instances[victim_name]
    kind = victim_name.split("-")[0]

    async def freeze_while_it_works(tasks):
        for _ in range(500):
            load = (await asyncio.to_thread(cluster.loads, kind)).get(victim.address)
            if load is not None and _busy(load, kind):
                break
            await asyncio.sleep(0.01)
        os.kill(victim.pid, signal.SIGSTOP)
        if thaw_after_s is not None:
            try:
                await asyncio.sleep(thaw_after_s)
            finally:
                os.kill(victim.pid, signal.SIGCONT)

    try:
        results = asyncio.run(_many(cluster, n, timeout_ms=timeout_ms,
                                    on_progress=freeze_while_it_works, stagger_s=stagger_s,
                                    distinct_images=True))
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    outcomes = collections.Counter(
        "ok" if not isinstance(r, BaseException) and _ok(r)
        else repr(r)[:160] if isinstance(r, BaseException) else f"{r[0]}: {r[1][:160]}"
        for r in results)
    moved = [ln for ln in cluster.lines if any(w in ln for w in log_words)]
    print("SIGSTOP outcomes:", dict(outcomes))
    print("\n".join(moved[:8]))
    assert outcomes["ok"] == n, dict(outcomes)
    # Thawed, the frozen instance finds its rooms gone; everything is returned everywhere.
    assert wait_idle(cluster)["idle"]


def test_sigstop_of_one_encoder_under_load_fails_no_request(cluster):
    freeze_under_load(cluster, "encoder-0", CONCURRENCY, timeout_ms=60_000, stagger_s=0.02,
                      thaw_after_s=None, log_words=("ejected", "retrying"))


def test_sigstop_of_one_language_instance_under_load_fails_no_request(cluster):
    freeze_under_load(cluster, "language-0", 60, timeout_ms=120_000, stagger_s=0.05,
                      thaw_after_s=FROZEN_LANGUAGE_S,
                      log_words=("stopped answering", "did not answer"))
