"""Selection, affinity, ejection and admission on plain data (no network)."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from tandem.services.router.admission import Admission
from tandem.services.router.dispatch.health import HealthTracker, InstanceState
from tandem.services.router.dispatch.selection import (
    Candidate,
    NoInstanceError,
    Selector,
    rendezvous_order,
)
from tandem.services.router.errors import RouterError
from tandem.services.router.openai.errors import openai_body, openai_type
from tandem.services.router.tenants import DEFAULT_TENANT, Tenants, cache_namespace


def _h(i: int) -> str:
    return hashlib.sha256(f"img{i}".encode()).hexdigest()


def cands(*loads: float) -> list[Candidate]:
    return [Candidate(f"10.0.0.{i}:50061", load) for i, load in enumerate(loads)]


def test_least_load_picks_lowest_and_rotates_ties():
    s = Selector("least_load")
    assert s.pick(cands(3, 1, 2)) == "10.0.0.1:50061"
    tied = Counter(s.pick(cands(0, 0, 5)) for _ in range(10))
    assert set(tied) == {"10.0.0.0:50061", "10.0.0.1:50061"}


def test_round_robin_cycles_all():
    s = Selector("round_robin")
    got = [s.pick(cands(9, 0, 0)) for _ in range(6)]
    assert Counter(got) == {a.address: 2 for a in cands(0, 0, 0)}


def test_exclude_and_empty():
    s = Selector()
    assert s.pick(cands(0, 5), exclude={"10.0.0.0:50061"}) == "10.0.0.1:50061"
    with pytest.raises(NoInstanceError):
        s.pick(cands(0), exclude={"10.0.0.0:50061"})
    with pytest.raises(NoInstanceError):
        s.pick([])


def test_affinity_repeated_image_same_encoder_and_spread_across_images():
    s = Selector()
    pool = cands(0, 0, 0, 0)
    for i in range(20):
        first = s.pick(pool, [_h(i)])
        assert all(s.pick(pool, [_h(i)]) == first for _ in range(5))
    spread = Counter(s.pick(pool, [_h(i)]) for i in range(200))
    assert len(spread) == 4 and min(spread.values()) > 20  # hashing spreads distinct images


def test_affinity_is_consistent_when_an_encoder_leaves():
    s = Selector()
    pool = cands(0, 0, 0, 0)
    before = {i: s.pick(pool, [_h(i)]) for i in range(100)}
    gone = "10.0.0.2:50061"
    after = {i: s.pick([c for c in pool if c.address != gone], [_h(i)]) for i in range(100)}
    # Only the images that lived on the removed encoder move.
    assert all(after[i] == before[i] for i in range(100) if before[i] != gone)


def test_affinity_bounded_by_load():
    s = Selector(affinity_slack=0.25)
    key = _h(7)
    addrs = [c.address for c in cands(0, 0, 0)]
    preferred = rendezvous_order(key, addrs)[0]
    loads = {a: 1.0 for a in addrs}
    loads[preferred] = 50.0  # far over ceil(mean * 1.25) + 1
    pool = [Candidate(a, loads[a]) for a in addrs]
    picked = s.pick(pool, [key])
    assert picked != preferred
    assert picked == rendezvous_order(key, addrs)[1]  # next in the image's ranking
    loads[preferred] = 2.0  # within the bound: affinity wins over least-load
    assert s.pick([Candidate(a, loads[a]) for a in addrs], [key]) == preferred


def test_affinity_majority_of_images():
    s = Selector()
    pool = cands(0, 0, 0)
    addrs = [c.address for c in pool]
    keys = [_h(i) for i in range(30)]
    by_pref = {}
    for k in keys:
        by_pref.setdefault(rendezvous_order(k, addrs)[0], []).append(k)
    a, b = [v for v in by_pref.values() if len(v) >= 2][:2]
    # two images preferring A and one preferring B go to A
    assert s.pick(pool, [b[0], a[0], a[1]]) == rendezvous_order(a[0], addrs)[0]


def test_health_tracker_ejects_after_n_and_probes_back():
    t = HealthTracker(eject_after=3)
    assert t.state is InstanceState.UNKNOWN and not t.healthy
    t.record_success()
    assert t.healthy
    assert not t.record_failure() and not t.record_failure()
    t.record_success()  # resets the count
    assert not t.record_failure() and not t.record_failure()
    assert t.record_failure() and t.state is InstanceState.EJECTED
    assert not t.record_failure()  # already out: not ejected twice
    t.record_probe(serving=False)
    assert t.state is InstanceState.EJECTED
    t.record_probe(serving=True)
    assert t.healthy and t.consecutive_failures == 0 and t.ejections == 1


def test_admission_bound_and_release():
    a = Admission(2)
    a.acquire()
    a.acquire()
    with pytest.raises(RouterError) as e:
        a.acquire()
    assert e.value.http_status == 429 and e.value.grpc_name == "RESOURCE_EXHAUSTED"
    a.release()
    with a.slot():
        assert a.inflight == 2
    assert a.inflight == 1


def test_api_keys_name_tenants(tmp_path):
    assert Tenants().authenticate(None) == ""  # no key configured: open, tenant ""
    one = Tenants(api_key="s3cret-key")
    assert one.authenticate("Bearer s3cret-key") == DEFAULT_TENANT
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants:\n  acme: {keys: [acme-key-1, acme-key-2], max_inflight: 1}\n"
                    "  beta: {keys: [beta-key-1]}\n")
    many = Tenants(api_key="s3cret-key", keys_file=str(keys))
    assert [many.authenticate(f"Bearer {k}") for k in
            ("acme-key-1", "acme-key-2", "beta-key-1", "s3cret-key")] == [
                "acme", "acme", "beta", DEFAULT_TENANT]
    for bad in (None, "", "Bearer nope", "Basic acme-key-1", "acme-key-1"):
        with pytest.raises(RouterError) as e:
            many.authenticate(bad)
        assert e.value.http_status == 401 and e.value.grpc_name == "UNAUTHENTICATED"
    # a tenant's own bound on requests in flight, beside the router's
    a = Admission(10, tenants=many)
    a.acquire("acme")
    with pytest.raises(RouterError) as e:
        a.acquire("acme")
    assert e.value.http_status == 429 and "acme" in e.value.message
    a.acquire("beta")
    a.release("acme")
    a.acquire("acme")
    # one key for two tenants, or a short key, is refused when the file is read
    keys.write_text("tenants:\n  a: {keys: [same-key-1]}\n  b: {keys: [same-key-1]}\n")
    with pytest.raises(ValueError, match="also a key"):
        Tenants(keys_file=str(keys))
    keys.write_text("tenants:\n  a: {keys: [short]}\n")
    with pytest.raises(ValueError, match="8 characters"):
        Tenants(keys_file=str(keys))


def test_cache_namespaces_differ_per_tenant_and_salt():
    assert cache_namespace("", None) == cache_namespace("", "") == ""  # the shared cache
    spaces = {cache_namespace(t, s) for t in ("", "acme", "beta") for s in (None, "x", "y")}
    assert len(spaces) == 9  # every (tenant, salt) pair its own namespace
    assert cache_namespace("acme", None) == cache_namespace("acme", "")
    with pytest.raises(RouterError) as e:
        cache_namespace("acme", "s" * 300)
    assert e.value.param == "cache_salt"


def test_error_mapping():
    assert RouterError("INVALID_ARGUMENT", "x").http_status == 400
    assert RouterError("TOO_LARGE", "x").http_status == 413
    assert RouterError("TOO_LARGE", "x").grpc_name == "RESOURCE_EXHAUSTED"
    assert RouterError("UNAVAILABLE", "x").http_status == 503
    assert RouterError("DEADLINE_EXCEEDED", "x").http_status == 504
    body = openai_body(RouterError("NOT_FOUND", "no such model", "model"))
    assert body == {
        "error": {
            "message": "no such model",
            "type": "invalid_request_error",
            "param": "model",
            "code": "not_found",
        }
    }


def test_round_robin_per_tier_alternates_each_tier():
    """Each tier has its own selector: interleaved picks (language, encoder, language, ...)
    still cycle through every instance of each tier."""
    from tandem.services.router.config import RouterConfig
    from tandem.services.router.core import RouterCore

    core = RouterCore(RouterConfig(policy="round_robin", insecure_internal=True))
    enc, lang = core.selectors["encoder"], core.selectors["language"]
    assert enc is not lang
    picks = []
    for _ in range(4):
        lang.pick(cands(0, 0))
        picks.append(enc.pick(cands(0, 0)))
    assert Counter(picks) == {"10.0.0.0:50061": 2, "10.0.0.1:50061": 2}


def _chat(*turns: tuple[str, str]):
    from tandem.v1 import common_pb2

    return [common_pb2.ChatMessage(role=r, content=[common_pb2.ContentPart(text=t)])
            for r, t in turns]


def test_conversation_key_follows_the_conversation_and_picks_its_language_instance():
    from tandem.services.router.request import conversation_key

    sys, first = ("system", "Be brief."), ("user", "Hello")
    turn1 = _chat(sys, first)
    turn3 = _chat(sys, first, ("assistant", "Hi"), ("user", "More"), ("assistant", "Ok"),
                  ("user", "Again"))
    assert conversation_key(turn1) == conversation_key(turn3)
    assert conversation_key(_chat(sys, ("user", "Other"))) != conversation_key(turn1)
    assert conversation_key(_chat(("system", "Be long."), first)) != conversation_key(turn1)
    # every turn goes to the same instance while it is not overloaded ...
    s = Selector()
    key = conversation_key(turn1)
    home = s.pick(cands(0, 0, 0, 0), [key])
    assert all(s.pick(cands(1, 1, 1, 1), [conversation_key(turn3)]) == home for _ in range(5))
    # ... and elsewhere once it is (bounded load), and conversations spread
    busy = [Candidate(c.address, 20 if c.address == home else 0) for c in cands(0, 0, 0, 0)]
    assert s.pick(busy, [key]) != home
    homes = {s.pick(cands(0, 0, 0, 0), [conversation_key(_chat(sys, ("user", str(i))))])
             for i in range(40)}
    assert len(homes) == 4


def test_a_tiers_resource_exhausted_is_413_never_retried_only_overload_is_429():
    """A message over a tier's gRPC size limit (RESOURCE_EXHAUSTED from grpc itself: a
    text-only chat over the language tier's 4 MiB) is permanent: 413 too_large, in neither
    retry set; it was a 429 "rate limit". Decided by code and tier, never by the text."""
    import asyncio

    import grpc

    from tandem.services.router.errors import (
        RETRYABLE_ENCODER,
        RETRYABLE_REQUEST,
        Tier,
        from_error_info,
        from_rpc,
    )
    from tandem.v1 import common_pb2, language_pb2, language_pb2_grpc

    async def over_the_limit() -> grpc.RpcError:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 1024)])
        language_pb2_grpc.add_LanguageServicer_to_server(language_pb2_grpc.LanguageServicer(),
                                                         server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                req = language_pb2.LanguageGenerateRequest(
                    messages=[common_pb2.ChatMessage(role="user", content=[
                        common_pb2.ContentPart(text="x" * 4096)])])
                try:
                    async for _ in language_pb2_grpc.LanguageStub(ch).Generate(req, timeout=5):
                        pass
                except grpc.RpcError as e:
                    return e
        finally:
            await server.stop(None)
        raise AssertionError("the message passed the size limit")

    rpc_err = asyncio.run(over_the_limit())
    assert rpc_err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for tier in (Tier.LANGUAGE, Tier.ENCODER):
        err = from_rpc(rpc_err, tier)
        assert (err.code, err.http_status, openai_type(err)) == (
            "TOO_LARGE", 413, "invalid_request_error")
        assert err.grpc_name == "RESOURCE_EXHAUSTED"
        assert err.code not in RETRYABLE_ENCODER | RETRYABLE_REQUEST
    in_stream = from_error_info(common_pb2.ErrorInfo(code="RESOURCE_EXHAUSTED",
                                                     message="prompt needs 900 KV pages"),
                                Tier.LANGUAGE)
    assert in_stream.http_status == 413 and in_stream.code == "TOO_LARGE"
    overloaded = RouterError("OVERLOADED", "router at capacity")  # the router's own
    assert (overloaded.http_status, openai_type(overloaded)) == (429, "rate_limit_error")
    assert RouterError("REQUEST_TIMEOUT", "x").http_status == 408
    assert RouterError("REQUEST_TIMEOUT", "x").grpc_name == "DEADLINE_EXCEEDED"


def test_the_request_log_line_gives_each_figure_its_own_unit():
    """Stage times in ms; counts and flags as they are (a count was printed as "0ms")."""
    from tandem.services.router.request import Output
    from tandem.v1 import common_pb2, language_pb2

    timings = common_pb2.StageTimings(vit_ms=12.4, skipped_images=2, time_to_first_row_ms=7.2,
                                      early_prefill_tokens=40)
    line = Output(language_pb2.LanguageGenerateResponse(), timings=timings).summary()
    assert "vit=12ms" in line and "skipped_images=2 " in line
    assert "encoder_bypassed=0" in line and "skipped_images=2ms" not in line
    assert "time_to_first_row=7ms" in line and "early_prefill_tokens=40" in line
    assert "ranges" not in line  # one writer (or none): nothing to say
    timings.encoder_ranges.extend([
        common_pb2.EncoderRange(encoder="e1:1", tokens=30, media=1),
        common_pb2.EncoderRange(encoder="e2:2", first_token=30, tokens=12, first_media=1,
                                media=1, fell_back=True)])
    line = Output(language_pb2.LanguageGenerateResponse(), timings=timings).summary()
    assert "ranges e1:1[0,30) e2:2[30,42)(fell back)" in line
