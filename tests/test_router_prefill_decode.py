"""The router's retry after an E/P/D attempt failed (issue 39): whom it avoids, decided on
the failure's typed fields (tier, code, and the instance the decode instance blames:
CULPRIT_METADATA), never on its text.

- The rule, on plain data (`Avoid.record`): a decode instance's own failure (or its
  death: no answer, no culprit) avoids it and keeps the prefill instance, whose prefix
  cache holds the conversation; a failure it blames on the prefill instance avoids that
  one and keeps it; DATA_LOSS avoids both (the pages failed their check where they
  landed); an encoder's failure avoids the prefill instance too (its death shows first
  as the encoder's closed Attach). Without prefill instances the rule is what it was.
- A real dispatcher over gRPC, two decode and two prefill instances standing in for the
  tiers: the first Generate fails as a decode instance reports each kind of failure
  (in-stream, with or without the culprit in the trailing metadata; a failed call, with
  or without it), and the retry's Generate names the pair the rule says.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client import CollectorRegistry
from test_router_split import run, serving
from waiting import async_wait_until

from tandem.errors import abort, blame
from tandem.services.router.config import RouterConfig
from tandem.services.router.dispatch.dispatcher import Avoid, Dispatcher
from tandem.services.router.dispatch.registry import Registry
from tandem.services.router.dispatch.selection import Selector
from tandem.services.router.errors import RouterError, Tier
from tandem.services.router.metrics import RouterMetrics
from tandem.services.router.request import ChatRequest, Route
from tandem.v1 import common_pb2, language_pb2, language_pb2_grpc

pytestmark = pytest.mark.timeout(120)

P, P2, D, E = "p:1", "p:2", "d:1", "e:1"


def avoided(err: RouterError, prefill: str = P) -> tuple[set[str], set[str], set[str]]:
    """(prefill, language, encoder) instances a retry stays off after `err`."""
    avoid = Avoid()
    added = avoid.record(Route(attempts=1, language=D, prefill=prefill, encoder=E), err)
    assert set(added) == avoid.prefills | avoid.languages | avoid.encoders
    return avoid.prefills, avoid.languages, avoid.encoders


def test_a_decode_instances_own_failure_keeps_the_prefill_instance():
    for err in (RouterError("UNAVAILABLE", "language: stream ended early", tier=Tier.LANGUAGE),
                RouterError("INTERNAL", "language: engine failed", tier=Tier.LANGUAGE),
                # the culprit names someone else than the attempt's prefill instance
                RouterError("UNAVAILABLE", "x", tier=Tier.LANGUAGE, culprit="other:1")):
        assert avoided(err) == (set(), {D}, {E}), err


def test_a_failure_the_decode_instance_blames_on_the_prefill_instance_avoids_only_it():
    for code in ("UNAVAILABLE", "INTERNAL", "ABORTED"):
        err = RouterError(code, "language: x", tier=Tier.LANGUAGE, culprit=P)
        assert avoided(err) == ({P}, set(), {E}), code


def test_data_loss_avoids_both_and_an_encoder_failure_avoids_the_prefill_instance():
    loss = RouterError("DATA_LOSS", "language: x", tier=Tier.LANGUAGE, culprit=P)
    assert avoided(loss) == ({P}, {D}, {E})
    assert avoided(RouterError("DATA_LOSS", "x", tier=Tier.LANGUAGE)) == (set(), {D}, {E})
    encoder = RouterError("UNAVAILABLE", "encoder: x", tier=Tier.ENCODER)
    assert avoided(encoder) == ({P}, set(), {E})


def test_without_prefill_instances_the_rule_is_unchanged():
    lang = RouterError("UNAVAILABLE", "x", tier=Tier.LANGUAGE, culprit=D)  # (a Reattach's)
    assert avoided(lang, prefill="") == (set(), {D}, {E})
    assert avoided(RouterError("UNAVAILABLE", "x", tier=Tier.ENCODER), prefill="") == (
        set(), set(), {E})


# ---- a real dispatcher --------------------------------------------------------------------

@dataclass(frozen=True)
class Call:
    decode: str  # the decode instance the Generate went to
    prefill: str  # the prefill instance it names


class Calls:
    """Every Generate of the test, in order; the first fails as `failure` says."""

    def __init__(self, failure: str) -> None:
        self.failure = failure
        self.seen: list[Call] = []


class FakeDecode(language_pb2_grpc.LanguageServicer):
    """A decode instance: answers one token, except the test's first Generate, which fails:
    "own" (in-stream UNAVAILABLE, naming no one: its own failure), "blame" (in-stream
    UNAVAILABLE, the prefill instance named in the trailing metadata, as the decode side
    does when P's stream broke), "data_loss" (in-stream DATA_LOSS, P named), "dies" (the
    call fails UNAVAILABLE with no metadata: what a dead instance gives), "aborts_blaming"
    (the call fails UNAVAILABLE naming P: the encoder tier's way, the same key)."""

    def __init__(self, calls: Calls, name: str) -> None:
        self.calls, self.name = calls, name

    async def GetLoad(self, request, context):  # noqa: N802
        return language_pb2.LanguageGetLoadResponse(model="m", total_kv_pages=100,
                                                    free_kv_pages=100, role="decode")

    async def Generate(self, request, context):  # noqa: N802
        self.calls.seen.append(Call(self.name, request.prefill_address))
        if len(self.calls.seen) == 1:
            failure, p = self.calls.failure, request.prefill_address
            if failure in ("dies", "aborts_blaming"):
                await abort(context, grpc.StatusCode.UNAVAILABLE, "gone",
                            culprit=p if failure == "aborts_blaming" else "")
            if failure in ("blame", "data_loss"):
                blame(context, p)
            code = "DATA_LOSS" if failure == "data_loss" else "UNAVAILABLE"
            yield language_pb2.LanguageGenerateResponse(
                finish_reason=common_pb2.FINISH_REASON_ERROR,
                error=common_pb2.ErrorInfo(code=code, message=failure))
            return
        yield language_pb2.LanguageGenerateResponse(
            token_ids=[1], text="x", finish_reason=common_pb2.FINISH_REASON_STOP)

    async def Abort(self, request, context):  # noqa: N802
        return language_pb2.AbortResponse()


class FakePrefill(language_pb2_grpc.LanguageServicer):
    async def GetLoad(self, request, context):  # noqa: N802
        return language_pb2.LanguageGetLoadResponse(model="m", total_kv_pages=100,
                                                    free_kv_pages=100, role="prefill")


@contextlib.asynccontextmanager
async def epd_router(calls: Calls):
    """A Registry (polled once) and Dispatcher over two decode and two prefill fakes;
    yields (dispatcher, {address: name})."""
    decodes = [FakeDecode(calls, f"d{i}") for i in range(2)]
    add = language_pb2_grpc.add_LanguageServicer_to_server
    async with serving(decodes, add) as das, serving([FakePrefill(), FakePrefill()], add) as pas:
        for d, a in zip(decodes, das, strict=True):
            d.name = a
        config = RouterConfig(languages=das, prefills=pas, insecure_internal=True,
                              request_retries=1)
        registry = Registry(config)
        await registry.refresh_membership()
        await asyncio.gather(registry.languages.poll(), registry.prefills.poll())
        selectors = {k: Selector(config.policy, config.affinity_slack)
                     for k in ("encoder", "language", "prefill")}
        try:
            yield Dispatcher(registry, selectors, config, RouterMetrics(CollectorRegistry()))
        finally:
            await registry.stop()


def text_chat() -> ChatRequest:
    parts = [common_pb2.ContentPart(text="tell me more")]
    return ChatRequest(messages=[common_pb2.ChatMessage(role="user", content=parts)],
                       sampling=common_pb2.SamplingParams(max_tokens=1), timeout_s=60,
                       request_id="epd-retry-test")


def retried(failure: str) -> tuple[Call, Call]:
    """(the failed attempt's Generate, the retry's), for a first attempt failing so."""
    calls = Calls(failure)

    async def go():
        async with epd_router(calls) as dispatcher:
            out = await run(dispatcher, text_chat())
            assert out.route.attempts == 2
            assert (out.route.language, out.route.prefill) == (calls.seen[1].decode,
                                                               calls.seen[1].prefill)

    asyncio.run(go())
    assert len(calls.seen) == 2, calls.seen
    return calls.seen[0], calls.seen[1]


@pytest.mark.parametrize("failure", ["own", "dies"])
def test_the_retry_after_a_decode_failure_keeps_the_prefill_instance(failure):
    first, second = retried(failure)
    assert second.decode != first.decode
    assert second.prefill == first.prefill  # its prefix cache holds the conversation


@pytest.mark.parametrize("failure", ["blame", "aborts_blaming"])
def test_the_retry_after_a_prefill_failure_avoids_it_and_keeps_the_decode_instance(failure):
    first, second = retried(failure)
    assert second.prefill != first.prefill
    assert second.decode == first.decode


def test_the_retry_after_data_loss_avoids_both():
    first, second = retried("data_loss")
    assert second.prefill != first.prefill
    assert second.decode != first.decode


def test_prefill_dns_is_resolved_again_as_the_others_are():
    """A router whose prefill instances come only from DNS re-resolves them every
    `dns_refresh_s` (its loop ran only for encoder_dns or language_dns)."""
    async def go():
        cfg = RouterConfig(languages=["127.0.0.1:9"], prefill_dns="localhost:50081",
                           dns_refresh_s=0.05, load_refresh_s=60, insecure_internal=True)
        reg = Registry(cfg)
        await reg.start()
        try:
            assert "127.0.0.1:50081" in reg.prefills.instances
            reg.cfg = cfg.model_copy(update={"prefill_dns": "localhost:50082"})
            await async_wait_until(lambda: "127.0.0.1:50082" in reg.prefills.instances,
                                   timeout_s=30, what="the prefill DNS name resolved again")
        finally:
            await reg.stop()

    asyncio.run(go())
