"""The router's side of a prompt split across encoders (issue 27, `split_encoders`): which
helper encoders an Encode names (selection.pick_helpers, on plain data), and what a real
dispatcher sends over gRPC, a failover's Encode included.

The dispatcher tests run the router's own Registry and Dispatcher against small gRPC
servers that stand in for the tiers: they answer GetLoad with chosen figures (load, model,
draining) and record each EncodeRequest, which is what the router decides; the encoders'
own handling of `helpers` (EncodeRange) is tested with the encoder tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import grpc
import pytest
from prometheus_client import CollectorRegistry
from waiting import async_wait_until

from tandem.errors import CULPRIT_METADATA
from tandem.services.router.config import RouterConfig
from tandem.services.router.dispatch.dispatcher import Dispatcher
from tandem.services.router.dispatch.registry import Registry
from tandem.services.router.dispatch.selection import (
    EncoderState,
    Selector,
    pick_helpers,
    rendezvous_order,
)
from tandem.services.router.grpc_api import _to_proto
from tandem.services.router.metrics import RouterMetrics
from tandem.services.router.openai.format import timings
from tandem.services.router.request import ChatRequest, Output, image_hashes
from tandem.v1 import (
    common_pb2,
    encoder_pb2,
    encoder_pb2_grpc,
    language_pb2,
    language_pb2_grpc,
)

pytestmark = pytest.mark.timeout(120)


def enc(address: str, load: float = 0, patches: int = 0, model: str = "m", healthy: bool = True,
        draining: bool = False) -> EncoderState:
    return EncoderState(address, model, healthy, not draining, load, patches)


# ---- the rule, on plain data --------------------------------------------------------------

def test_helpers_are_the_least_loaded_others_up_to_split_encoders_minus_one():
    pool = [enc("lead", load=0), enc("a", load=5), enc("b", load=1), enc("c", load=1, patches=9),
            enc("d", load=1, patches=2), enc("e", load=0, patches=700)]
    # requests first, then patches waiting for or in the ViT, then address; the lead is never its own helper
    assert pick_helpers(pool, "lead", media=8, split_encoders=4) == ["e", "b", "d"]
    assert pick_helpers(pool, "lead", media=8, split_encoders=2) == ["e"]
    assert pick_helpers(pool, "lead", media=8, split_encoders=64) == ["e", "b", "d", "c", "a"]
    # never more helpers than media - 1: each writer encodes at least one image or video
    assert pick_helpers(pool, "lead", media=2, split_encoders=4) == ["e"]
    assert pick_helpers(pool, "lead", media=3, split_encoders=4) == ["e", "b"]


def test_helpers_exclude_unhealthy_draining_other_model_and_failed_encoders():
    pool = [enc("lead"), enc("sick", healthy=False), enc("leaving", draining=True),
            enc("other", model="x"), enc("unreported", model=""), enc("failed"),
            enc("ok", load=7)]
    assert pick_helpers(pool, "lead", 4, 8, exclude={"failed"}) == ["ok"]
    assert pick_helpers(pool, "lead", 4, 8) == ["failed", "ok"]
    # the model is the lead's, whatever it is
    assert pick_helpers(pool + [enc("x2", model="x")], "other", 4, 8) == ["x2"]


def test_no_helpers_for_fewer_than_two_media_or_split_encoders_one():
    pool = [enc("lead"), enc("a"), enc("b")]
    for media in (0, 1):
        assert pick_helpers(pool, "lead", media, split_encoders=3) == []
    assert pick_helpers(pool, "lead", 8, split_encoders=1) == []
    assert pick_helpers(pool, "gone", 8, split_encoders=3) == []  # the lead unknown
    assert pick_helpers([enc("lead")], "lead", 8, split_encoders=3) == []  # no other encoder


def test_one_video_may_be_split_by_its_temporal_groups():
    pool = [enc("lead"), enc("a", load=1), enc("b", load=2), enc("c", load=3)]
    # one video: as many helpers as split_encoders allows (the lead splits its groups)
    assert pick_helpers(pool, "lead", media=1, split_encoders=3, videos=1) == ["a", "b"]
    assert pick_helpers(pool, "lead", media=2, split_encoders=4, videos=1) == ["a", "b", "c"]
    assert pick_helpers(pool, "lead", media=1, split_encoders=1, videos=1) == []
    assert pick_helpers(pool, "lead", media=1, split_encoders=3, videos=0) == []  # one image


def test_by_default_only_idle_encoders_help():
    pool = [enc("lead", load=4), enc("idle"), enc("one", load=1), enc("busy", load=3)]
    assert pick_helpers(pool, "lead", media=8, split_encoders=4, max_load=0) == ["idle"]
    assert pick_helpers(pool, "lead", media=8, split_encoders=4, max_load=1) == ["idle", "one"]
    assert pick_helpers(pool[:1] + pool[2:], "lead", 8, 4, max_load=0) == []  # all busy
    assert RouterConfig(insecure_internal=True).split_max_helper_load == 0


def test_split_encoders_is_checked():
    from pydantic import ValidationError

    assert RouterConfig(insecure_internal=True).split_encoders == 1  # never split by default
    with pytest.raises(ValidationError):
        RouterConfig(insecure_internal=True, split_encoders=0)


# ---- a real dispatcher --------------------------------------------------------------------

class FakeEncoder(encoder_pb2_grpc.EncoderServicer):
    """Answers GetLoad with its figures; records each Encode; fails the first `fail` ones
    with UNAVAILABLE (an encoder that dies mid-prompt). Its answer names who wrote which
    rows as a lead does: itself ("") 6 tokens and one medium, then each helper 2 and one."""

    def __init__(self, load: int, patches: int = 0, model: str = "m", draining: bool = False,
                 fail: int = 0, blame: bool | str = False, vit_stalled: bool = False) -> None:
        self.load, self.patches, self.model, self.draining = load, patches, model, draining
        self.vit_stalled = vit_stalled
        self.fail, self.blame = fail, blame
        self.encodes: list[encoder_pb2.EncodeRequest] = []
        self.delivered = asyncio.Event()

    async def GetLoad(self, request, context):  # noqa: N802
        return encoder_pb2.EncoderGetLoadResponse(
            # its patches half queued, half in the ViT: the router ranks by the two together
            queued_requests=self.load, queued_patches=self.patches // 2,
            vit_patches=self.patches - self.patches // 2, model=self.model,
            draining=self.draining, vit_stalled=self.vit_stalled)

    async def Encode(self, request, context):  # noqa: N802
        self.encodes.append(request)
        if len(self.encodes) <= self.fail:
            # `blame`: a lead whose first helper stalled the room names it, as the encoder
            # tier does (services/encoder/server.py)
            culprit = self.blame if isinstance(self.blame, str) else (
                request.helpers[0] if self.blame else "")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "encoder died",
                                ((CULPRIT_METADATA, culprit),) if culprit else ())
        self.delivered.set()
        ranges = [common_pb2.EncoderRange(encoder="", tokens=6, media=1, vit_ms=4.0,
                                          cached_image_tokens=2, preprocess_ms=1.5)]
        ranges += [common_pb2.EncoderRange(encoder=h, first_token=6 + 2 * k, tokens=2,
                                            first_media=1 + k, media=1, fell_back=k == 1)
                   for k, h in enumerate(request.helpers)]
        return encoder_pb2.EncodeResponse(prompt_tokens=10, ranges=ranges,
                                          timings=common_pb2.StageTimings(vit_ms=4.0))


class FakeLanguage(language_pb2_grpc.LanguageServicer):
    """Finishes each request once an encoder delivered its prompt; accepts every Reattach."""

    def __init__(self, encoders: list[FakeEncoder]) -> None:
        self.encoders = encoders
        self.reattached: list[str] = []

    async def GetLoad(self, request, context):  # noqa: N802
        return language_pb2.LanguageGetLoadResponse(model="m", total_kv_pages=100,
                                                    free_kv_pages=100)

    async def Generate(self, request, context):  # noqa: N802
        waits = [asyncio.ensure_future(e.delivered.wait()) for e in self.encoders]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        yield language_pb2.LanguageGenerateResponse(
            token_ids=[1], text="x", finish_reason=common_pb2.FINISH_REASON_STOP,
            timings=common_pb2.StageTimings(time_to_first_row_ms=5.0, early_prefill_tokens=3,
                                            decode_ms=1.0))

    async def Reattach(self, request, context):  # noqa: N802
        self.reattached.append(request.encoder_address)
        return language_pb2.ReattachResponse(accepted=True)

    async def Abort(self, request, context):  # noqa: N802
        return language_pb2.AbortResponse()


@contextlib.asynccontextmanager
async def serving(servicers: list, add):
    """Each servicer on a gRPC server of its own; yields their addresses."""
    servers, addresses = [], []
    for s in servicers:
        server = grpc.aio.server()
        add(s, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    try:
        yield addresses
    finally:
        await asyncio.gather(*(s.stop(None) for s in servers))


@contextlib.asynccontextmanager
async def router(encoders: dict[str, FakeEncoder], extra_encoders: list[str] = (), **cfg):
    """A Registry (polled once) and Dispatcher over `encoders` (name -> servicer) and one
    language instance; yields (dispatcher, {name: address}, metrics, language)."""
    language = FakeLanguage(list(encoders.values()))
    async with (
        serving(list(encoders.values()), encoder_pb2_grpc.add_EncoderServicer_to_server) as eas,
        serving([language], language_pb2_grpc.add_LanguageServicer_to_server) as las,
    ):
        config = RouterConfig(encoders=[*eas, *extra_encoders], languages=las,
                              insecure_internal=True, **cfg)
        registry = Registry(config)
        await registry.refresh_membership()
        await asyncio.gather(registry.encoders.poll(), registry.languages.poll())
        metrics = RouterMetrics(CollectorRegistry())
        selectors = {k: Selector(config.policy, config.affinity_slack)
                     for k in ("encoder", "language")}
        try:
            yield (Dispatcher(registry, selectors, config, metrics),
                   dict(zip(encoders, eas, strict=True)), metrics, language)
        finally:
            await registry.stop()


def chat(urls: list[str]) -> ChatRequest:
    parts = [common_pb2.ContentPart(image=common_pb2.ImagePart(url=u)) for u in urls]
    parts.append(common_pb2.ContentPart(text="describe"))
    return ChatRequest(messages=[common_pb2.ChatMessage(role="user", content=parts)],
                       sampling=common_pb2.SamplingParams(max_tokens=1), timeout_s=60,
                       request_id="split-test")


def images_preferring(ranking: list[str], candidates: list[str], n: int) -> list[str]:
    """n image URLs whose affinity ranking over `candidates` starts with `ranking` (so the
    test knows which encoder leads, and which one a failover goes to)."""
    out = []
    for i in itertools.count():
        url = f"https://example.com/{i}.png"
        (key,) = image_hashes(chat([url]).messages)
        if rendezvous_order(key, candidates)[:len(ranking)] == ranking:
            out.append(url)
            if len(out) == n:
                return out


async def run(dispatcher: Dispatcher, req: ChatRequest) -> Output:
    async for out in dispatcher.generate(req):
        if out.finished:
            return out
    raise AssertionError("no final output")


def writers(out: Output) -> list[str]:
    """Who wrote which rows, as the gRPC API and the HTTP extension give them (the same)."""
    wire = [r.encoder for r in _to_proto(out, "rid").timings.encoder_ranges]
    assert [r["encoder"] for r in timings(out.timings)["encoder_ranges"]] == wire
    return wire


def _sample(metrics: RouterMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


def test_the_encode_names_the_least_loaded_eligible_encoders_and_a_failover_picks_afresh():
    """The lead (picked by image affinity) gets the least loaded other healthy encoders of
    its model that take work (neither draining nor with a stalled ViT) as helpers; when it dies, the Encode on the next encoder names
    helpers picked again, without the failed lead (healthy and idle as it still looks)."""
    fakes = {"lead": FakeEncoder(load=0, fail=1), "next": FakeEncoder(load=0, patches=500),
             "busy": FakeEncoder(load=3), "light": FakeEncoder(load=1),
             "draining": FakeEncoder(load=0, draining=True),
             "stalled": FakeEncoder(load=0, vit_stalled=True),
             "other_model": FakeEncoder(load=0, model="x")}

    async def go():
        # an address nothing answers on: never healthy, never a helper
        async with router(fakes, extra_encoders=["127.0.0.1:9"], split_encoders=3,
                          encoder_retries=1, split_max_helper_load=10) as (
                dispatcher, addr, metrics, language):
            candidates = [c.address for c in dispatcher.registry.encoders.candidates()]
            assert sorted(candidates) == sorted(addr[n] for n in fakes
                                                if n not in ("draining", "stalled"))
            encoders = dispatcher.registry.encoders.instances
            assert encoders[addr["next"]].pending_patches == 500  # queued + in its ViT
            urls = images_preferring([addr["lead"], addr["next"]], candidates, 3)
            out = await run(dispatcher, chat(urls))
            assert language.reattached == [addr["next"]]
            # the answering lead's ranges, itself by its address, beside the language's
            # figures and the encoder's; the same through both front ends
            assert writers(out) == [addr["next"], addr["light"], addr["busy"]]
            ranges = out.timings.encoder_ranges
            assert [(r.first_token, r.tokens, r.first_media, r.media, r.fell_back)
                    for r in ranges] == [(0, 6, 0, 1, False), (6, 2, 1, 1, False),
                                         (8, 2, 2, 1, True)]
            t = timings(out.timings)
            assert (t["time_to_first_row_ms"], t["early_prefill_tokens"], t["vit_ms"],
                    t["decode_ms"]) == (5.0, 3, 4.0, 1.0)
            lead = t["encoder_ranges"][0]  # each writer's own figures, as the lead sent them
            assert (lead["vit_ms"], lead["cached_image_tokens"], lead["preprocess_ms"]) == (
                4.0, 2, 1.5)
            (first,) = fakes["lead"].encodes
            assert list(first.helpers) == [addr["next"], addr["light"]]
            (second,) = fakes["next"].encodes
            assert list(second.helpers) == [addr["light"], addr["busy"]]
            assert first.room == second.room
            assert _sample(metrics, "tandem_router_split_prompts_total") == 2
            assert _sample(metrics, "tandem_router_encode_helpers_count") == 2
            assert _sample(metrics, "tandem_router_encode_helpers_sum") == 4
            # every helper's count is back to nothing once the Encodes ended
            assert all(i.outstanding == 0 for i in dispatcher.registry.encoders.instances.values())

    asyncio.run(go())


def test_the_failover_never_names_the_failed_lead():
    """With room for every helper, the failed lead (still healthy and idle in the
    registry's view: one failure does not eject it) is the one encoder left out."""
    fakes = {"lead": FakeEncoder(load=0, fail=1), "next": FakeEncoder(load=0),
             "a": FakeEncoder(load=1), "b": FakeEncoder(load=2)}

    async def go():
        async with router(fakes, split_encoders=8, encoder_retries=1,
                          split_max_helper_load=10) as (dispatcher, addr, metrics, _):
            candidates = [c.address for c in dispatcher.registry.encoders.candidates()]
            urls = images_preferring([addr["lead"], addr["next"]], candidates, 6)
            await run(dispatcher, chat(urls))
            (first,) = fakes["lead"].encodes
            assert list(first.helpers) == [addr["next"], addr["a"], addr["b"]]
            (second,) = fakes["next"].encodes
            assert list(second.helpers) == [addr["a"], addr["b"]]
            assert dispatcher.registry.encoders.instances[addr["lead"]].tracker.healthy

    asyncio.run(go())


def test_a_helper_blamed_for_a_stalled_room_is_neither_lead_nor_helper_again():
    """The lead's Encode fails UNAVAILABLE naming its helper as the culprit (it went silent
    past the transfer timeout: frozen, but still healthy and idle in the registry's view
    until its load polls go unanswered). The failover goes to neither: not to the culprit
    as lead, though the images' affinity ranks it next, nor to it as a helper, though it
    is the least loaded; and the router health-checks it (a fake answers no health check:
    one failure counted)."""
    fakes = {"lead": FakeEncoder(load=0, fail=1, blame=True), "frozen": FakeEncoder(load=0),
             "third": FakeEncoder(load=1), "fourth": FakeEncoder(load=1)}

    async def go():
        async with router(fakes, split_encoders=2, encoder_retries=1,
                          split_max_helper_load=10) as (dispatcher, addr, metrics, language):
            candidates = [c.address for c in dispatcher.registry.encoders.candidates()]
            urls = images_preferring([addr["lead"], addr["frozen"], addr["third"]],
                                     candidates, 4)
            out = await run(dispatcher, chat(urls))
            (first,) = fakes["lead"].encodes
            assert list(first.helpers) == [addr["frozen"]]
            assert not fakes["frozen"].encodes  # never the lead
            assert language.reattached == [addr["third"]]
            (second,) = fakes["third"].encodes
            assert list(second.helpers) == [addr["fourth"]]
            assert addr["frozen"] not in writers(out)
            tracker = dispatcher.registry.encoders.instances[addr["frozen"]].tracker
            await async_wait_until(lambda: tracker.consecutive_failures, until=lambda n: n >= 1,
                                   timeout_s=30, what="the culprit health-checked")

    asyncio.run(go())


def test_a_culprit_that_was_no_helper_of_the_attempt_is_not_avoided():
    """A (buggy) lead that blames an encoder it had no range with cannot keep that
    encoder off the request's retries: the failover goes where it would anyway."""
    fakes = {"lead": FakeEncoder(load=0, fail=1), "next": FakeEncoder(load=0),
             "third": FakeEncoder(load=0)}

    async def go():
        async with router(fakes, encoder_retries=1) as (dispatcher, addr, metrics, language):
            fakes["lead"].blame = addr["next"]  # no helpers (split_encoders 1): no culprit
            candidates = [c.address for c in dispatcher.registry.encoders.candidates()]
            urls = images_preferring([addr["lead"], addr["next"]], candidates, 2)
            await run(dispatcher, chat(urls))
            assert len(fakes["next"].encodes) == 1 and not fakes["third"].encodes
            assert language.reattached == [addr["next"]]

    asyncio.run(go())


def test_with_every_encoder_tried_a_retry_leads_with_the_blamed_helper_only_if_nothing_else():
    """A request whose every encoder failed it is tried on the same ones again (nothing
    else is healthy), but never on the helper named for a stalled room while another is
    left, though the images' affinity ranks it first: a helper with a hung ViT still
    answers its health checks and load polls."""
    from tandem import tracing

    fakes = {"frozen": FakeEncoder(load=0), "lead": FakeEncoder(load=0)}

    async def go():
        async with router(fakes, split_encoders=2) as (dispatcher, addr, metrics, _):
            candidates = [c.address for c in dispatcher.registry.encoders.candidates()]
            urls = images_preferring([addr["frozen"], addr["lead"]], candidates, 2)
            hashes = image_hashes(chat(urls).messages)
            both = {addr["frozen"], addr["lead"]}
            pick = dispatcher._pick_avoiding
            assert pick("encoder", hashes, both, tracing.OFF).address == addr["frozen"]
            assert pick("encoder", hashes, both, tracing.OFF,
                        {addr["frozen"]}).address == addr["lead"]
            # the blamed one is still better than no answer at all
            assert pick("encoder", hashes, both, tracing.OFF,
                        both).address == addr["frozen"]

    asyncio.run(go())


@pytest.mark.parametrize("images,split", [(1, 3), (3, 1)])
def test_no_helpers_for_one_image_or_split_encoders_one(images, split):
    fakes = {"lead": FakeEncoder(load=0), "a": FakeEncoder(load=0), "b": FakeEncoder(load=0)}

    async def go():
        async with router(fakes, split_encoders=split) as (dispatcher, addr, metrics, _):
            candidates = [c.address for c in dispatcher.registry.encoders.candidates()]
            out = await run(dispatcher,
                            chat(images_preferring([addr["lead"]], candidates, images)))
            assert writers(out) == [addr["lead"]]  # the lead alone, by its address
            (sent,) = fakes["lead"].encodes
            assert list(sent.helpers) == []
            assert _sample(metrics, "tandem_router_split_prompts_total") == 0
            assert _sample(metrics, "tandem_router_encode_helpers_count") == 0

    asyncio.run(go())
