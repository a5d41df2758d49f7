"""Metrics that do not mislead: every tier's /metrics after real traffic.

`tandem up` (1 encoder + 1 language instance, the tiny Qwen2.5-VL; it assigns and prints
the tiers' metrics ports) serves a few chats: with an image, text only, streamed, and bad
ones (an upload that is no image, an invalid field, an unknown model). Then:

- `promtool check metrics` passes on each tier's page (Debian's `prometheus` package;
  `make test` installs it where missing). The naming rules promtool applies are also
  checked here with prometheus-client's own parser, so they hold where promtool is absent.
- A client's bad image is the request's failure, not a transfer fault: the
  `tandem_transfer_failures_total{reason="transfer"}` series stay still on both tiers.
- The language tier observes per-request queue, prefill and decode time and prompt and
  generation tokens; it exports a KV usage ratio; every tier names its model once
  (`tandem_model_info`); the encoder counts cache evictions with a counter.
- The router counts HTTP answers by status code (4xx included) and streams by outcome.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_e2e_cluster import data_url, png

from tandem.launch.cluster import LocalCluster

ARCH = "qwen2_5_vl"
TIERS = ("encoder", "language", "router")
NOT_AN_IMAGE = "data:image/png;base64," + base64.b64encode(b"plain text, no image").decode()

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(checkpoint):
    cl = LocalCluster(str(checkpoint(ARCH)), encoders=1, languages=1,
                      router_args="--load-refresh-s 0.2")
    cl.start()
    # `tandem up` prints each tier's metrics URL on its ready line
    urls = dict(re.findall(r"^\[up\] (\w+)-0\s+ready .* metrics (\S+)$", cl.log_text(), re.M))
    assert set(urls) == {"encoder", "language"}, cl.log_text()[-2000:]
    cl.metrics_urls = {**urls, "router": cl.http_url + "/metrics"}
    try:
        _traffic(cl)
        yield cl
    finally:
        cl.stop()


def chat(content, **kw) -> dict:
    return {"model": "", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": content}], **kw}


def with_image(url: str, text: str = "What is this?") -> list:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]


def post(cl, body) -> httpx.Response:
    return httpx.post(cl.http_url + "/v1/chat/completions", json=body, timeout=60)


def _traffic(cl) -> None:
    """The module's requests: good ones of each kind and one bad of each kind."""
    assert post(cl, chat(with_image(data_url(png(1, (56, 56)))))).status_code == 200
    assert post(cl, chat("Hello there")).status_code == 200  # text only: no encoder
    with httpx.stream("POST", cl.http_url + "/v1/chat/completions", timeout=60,
                      json=chat(with_image(data_url(png(2, (56, 56)))), stream=True)) as r:
        assert r.status_code == 200
        assert r.read().rstrip().endswith(b"data: [DONE]")
    assert post(cl, chat(with_image(NOT_AN_IMAGE))).status_code == 400  # by the encoder
    assert post(cl, chat("hi", max_tokens=-1)).status_code == 400  # by the router
    assert post(cl, chat("hi", model="no-such-model")).status_code == 404
    time.sleep(0.5)  # a stream and a failed room are counted as they end


def page(cl, tier: str) -> str:
    return httpx.get(cl.metrics_urls[tier], timeout=5).text


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(name, labels): value} of every sample on a page (prometheus-client's parser)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(text: str, name: str, **labels) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples(text).items() if n == name and want <= ls)


# ---- naming --------------------------------------------------------------------------

_NON_BASE_UNITS = ("milliseconds", "microseconds", "nanoseconds", "minutes", "hours", "days",
                   "kilobytes", "megabytes", "gigabytes", "bits", "percent")


def naming_problems(text: str) -> list[str]:
    """The checks of `promtool check metrics` (its lint), on the text format: a TYPE and a
    HELP per family, counters end in `_total`, nothing else does, snake case, base units;
    and the whole page must parse."""
    problems = []
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    helps = set(re.findall(r"^# HELP (\S+) ", text, re.M))
    for name, kind in types.items():
        if name not in helps:
            problems.append(f"{name}: no HELP")
        if kind == "counter" and not name.endswith("_total"):
            problems.append(f"{name}: counter without _total")
        if kind != "counter" and name.endswith("_total"):
            problems.append(f"{name}: {kind} with _total")
        if not re.fullmatch(r"[a-z_:][a-z0-9_:]*", name):
            problems.append(f"{name}: not snake_case")
        if any(f"_{u}" in name for u in _NON_BASE_UNITS):
            problems.append(f"{name}: not a base unit")
    list(text_string_to_metric_families(text))  # raises on a malformed page
    return problems


def _promtool() -> str:
    promtool = shutil.which("promtool") or next(
        (str(p) for p in [Path(__file__).parent.parent / ".tools" / "promtool"] if p.exists()),
        None)
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`; `make test` installs "
                    "it); test_naming_rules checks the same rules without it")
    return promtool


def promtool_clean(text: str) -> tuple[bool, str]:
    """(passes `promtool check metrics` with nothing to say, what it said)."""
    out = subprocess.run([_promtool(), "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=30)
    said = out.stdout + out.stderr
    return out.returncode == 0 and not said.strip(), said


def vllm_lines(text: str, keep: bool) -> str:
    """The page's lines of vLLM's `vllm:` families (keep) or all the others (not keep)."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if line.startswith(("vllm:", "# HELP vllm:", "# TYPE vllm:")) == keep)


@pytest.mark.parametrize("tier", TIERS)
def test_promtool_check_metrics(cluster, tier):
    """Each tier's page; the router's without vLLM's `vllm:` names, which promtool refuses
    for their `:` alone (test_vllm_aliases_pass_promtool_but_for_their_colon)."""
    text = page(cluster, tier)
    ok, said = promtool_clean(vllm_lines(text, keep=False))
    assert ok, f"{tier}: {said}"


def test_vllm_aliases_pass_promtool_but_for_their_colon(cluster):
    """vLLM's names on the router's page (issue 42): with `:` spelled `_` they pass promtool
    with nothing to say (HELP, TYPE, _total, base units); as they are, promtool refuses
    them (the reserved `:`, which vLLM's own page has too), and only them: the rest of the
    page passes (test_promtool_check_metrics)."""
    aliases = vllm_lines(page(cluster, "router"), keep=True)
    assert aliases
    ok, said = promtool_clean(aliases.replace("vllm:", "vllm_"))
    assert ok, said
    assert not promtool_clean(aliases)[0]  # the control: promtool does refuse the colon


def test_vllm_aliases_measure_what_the_router_measures(cluster):
    """The aliases hold the router's own figures: as many e2e latencies as
    tandem_router_request_seconds (every request here finished), the same sums; tokens of
    the finished requests; the language tier's load and KV usage from its GetLoad, labelled
    with the served model's name."""
    text = page(cluster, "router")
    e2e = total(text, "vllm:e2e_request_latency_seconds_count")
    assert e2e == total(text, "tandem_router_request_seconds_count") >= 3
    assert total(text, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(
        total(text, "tandem_router_request_seconds_sum"))
    assert total(text, "vllm:time_to_first_token_seconds_count") == e2e
    assert total(text, "vllm:time_per_output_token_seconds_count") == e2e  # 4 tokens each
    assert total(text, "vllm:generation_tokens_total") == 4 * e2e
    assert total(text, "vllm:prompt_tokens_total") > 4 * e2e
    from pathlib import PurePath

    model = PurePath(cluster.model).name
    running = [ls for (n, ls), _ in samples(text).items() if n == "vllm:num_requests_running"]
    assert running == [frozenset({("model_name", model)})]
    assert total(text, "vllm:num_requests_running") == total(text, "vllm:num_requests_waiting") == 0
    # at rest: the prefix cache keeps pages, so usage is whatever the language page says
    assert total(text, "vllm:kv_cache_usage_perc") == pytest.approx(
        total(page(cluster, "language"), "tandem_language_kv_cache_usage_ratio"), abs=0.05)


@pytest.mark.parametrize("tier", TIERS)
def test_naming_rules(cluster, tier):
    assert naming_problems(page(cluster, tier)) == []


def test_naming_rules_catch_what_promtool_rejects():
    bad = ("# HELP a_total x\n# TYPE a_total gauge\na_total 1\n"
           "# HELP b x\n# TYPE b counter\nb 1\n"
           "# HELP c_milliseconds x\n# TYPE c_milliseconds gauge\nc_milliseconds 1\n")
    assert len(naming_problems(bad)) == 3


# ---- a bad image is the request's failure, not a transfer fault ----------------------

def _faults(cl, tier: str) -> float:
    return total(page(cl, tier), "tandem_transfer_failures_total", reason="transfer")


def _bad_images(cl, n: int) -> None:
    for _ in range(n):
        r = post(cl, chat(with_image(NOT_AN_IMAGE)))
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_argument"
    time.sleep(0.5)


def test_bad_image_is_no_transfer_fault_on_the_language_side(cluster):
    before = _faults(cluster, "language"), page(cluster, "language")
    _bad_images(cluster, 5)
    after = page(cluster, "language")
    assert _faults(cluster, "language") == before[0]
    # where its room had opened, the language side counts it as the request's ending
    assert (total(after, "tandem_transfer_failures_total", reason="request")
            >= total(before[1], "tandem_transfer_failures_total", reason="request"))


def test_bad_image_is_no_transfer_fault_on_the_encoder_side(cluster):
    before = _faults(cluster, "encoder")
    _bad_images(cluster, 5)
    assert _faults(cluster, "encoder") == before


# ---- the language tier's per-request histograms, KV ratio, model info ---------------

def test_language_request_histograms_have_observations(cluster):
    text = page(cluster, "language")
    finished = total(text, "tandem_language_requests_finished_total")
    assert finished >= 3
    for name in ("queue_time_seconds", "prefill_time_seconds", "decode_time_seconds",
                 "prompt_tokens", "generation_tokens"):
        assert total(text, f"tandem_language_request_{name}_count") == finished, name
        assert total(text, f"tandem_language_request_{name}_sum") > 0, name
    # every request here generated 4 tokens (max_tokens) from a prompt of > 4
    assert total(text, "tandem_language_request_generation_tokens_bucket", le="2.0") == 0
    assert total(text, "tandem_language_request_generation_tokens_bucket", le="5.0") == finished


def test_kv_gauges_and_usage_ratio(cluster):
    text = page(cluster, "language")
    capacity = total(text, "tandem_language_kv_pages_capacity")
    used = total(text, "tandem_language_kv_pages_used")
    assert capacity > 0
    assert total(text, "tandem_language_kv_cache_usage_ratio") == pytest.approx(used / capacity)
    assert total(text, "tandem_transfer_blocks_capacity") > 0
    # the encoder holds no embedding blocks: no block gauges there
    assert "tandem_transfer_blocks" not in page(cluster, "encoder")


def test_the_room_stall_gauge_is_on_the_language_page(cluster):
    """`tandem_transfer_room_stall_seconds` (TandemRoomStuck's series) is on the language
    tier's page, so promtool checks it there, and at rest no room is open: 0. The encoder
    receives no rooms: not there."""
    text = page(cluster, "language")
    assert "# TYPE tandem_transfer_room_stall_seconds gauge" in text
    assert total(text, "tandem_transfer_room_stall_seconds") == 0
    assert "tandem_transfer_room_stall_seconds" not in page(cluster, "encoder")


@pytest.mark.parametrize("tier", TIERS)
def test_openmetrics_page_parses(cluster, tier):
    """What a Prometheus that stores exemplars scrapes (it asks for OpenMetrics, where the
    latency histograms carry trace ids while tracing is on) parses under the format's own
    strict parser, and has the series of the text page promtool checks."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om

    r = httpx.get(cluster.metrics_urls[tier], timeout=5,
                  headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.headers["content-type"].startswith("application/openmetrics-text"), r.headers
    names = {s.name for f in om(r.text) for s in f.samples}
    text_names = {n for n, _ in samples(page(cluster, tier))}
    assert names == text_names, names ^ text_names


def test_every_tier_names_its_model_once(cluster):
    """The tiers name the checkpoint they loaded; the router the name the API serves it
    under (`tandem up --served-model-name`, by default the checkpoint directory's name)."""
    names = {}
    for tier in TIERS:
        info = [dict(ls) for (n, ls), v in samples(page(cluster, tier)).items()
                if n == "tandem_model_info" and v == 1]
        assert len(info) == 1 and info[0]["tier"] == tier, (tier, info)
        names[tier] = info[0]["model_name"]
    from pathlib import PurePath

    assert names == {"encoder": cluster.model, "language": cluster.model,
                     "router": PurePath(cluster.model).name}


def test_encoder_counts_cache_evictions_with_a_counter(cluster):
    text = page(cluster, "encoder")
    assert "# TYPE tandem_encoder_cache_evictions_total counter" in text
    assert total(text, "tandem_encoder_cache_misses_total") >= 2


# ---- the router ----------------------------------------------------------------------

def test_router_counts_4xx_by_status_code(cluster):
    text = page(cluster, "router")
    chats = "/v1/chat/completions"
    assert total(text, "tandem_router_http_requests_total", handler=chats, code="400") >= 2
    assert total(text, "tandem_router_http_requests_total", handler=chats, code="404") >= 1
    assert total(text, "tandem_router_http_requests_total", handler=chats, code="200") >= 3
    # the request counter has the refusals its handler raised, by code
    assert total(text, "tandem_router_requests_total", api="http",
                 outcome="invalid_argument") >= 1


def test_router_counts_streams_by_outcome(cluster):
    text = page(cluster, "router")
    assert not total(text, "tandem_router_requests_total", outcome="started")
    assert total(text, "tandem_router_requests_total", api="http", outcome="ok") >= 3


# ---- the router's counting, without tiers --------------------------------------------

def test_http_status_counter_counts_every_answer():
    from fastapi.testclient import TestClient

    from tandem.services.router.config import RouterConfig
    from tandem.services.router.core import RouterCore
    from tandem.services.router.metrics import HttpStatusCounter
    from tandem.services.router.openai.app import build_app

    core = RouterCore(RouterConfig(api_key="k", max_request_bytes=4096, model="m", insecure_internal=True))
    app = build_app(core)
    assert any(m.cls is HttpStatusCounter for m in app.user_middleware)
    c, key = TestClient(app), {"Authorization": "Bearer k"}
    url = "/v1/chat/completions"
    assert c.post(url, json=chat("hi")).status_code == 401  # refused by the API-key guard
    assert c.post(url, json=chat("x" * 5000), headers=key).status_code == 413
    assert c.post(url, json=chat("hi", max_tokens=-1), headers=key).status_code == 400
    assert c.post(url, json=chat("hi", model="other"), headers=key).status_code == 404
    assert c.post(url, json=chat("hi"), headers=key).status_code == 503  # no instances
    assert c.get("/v1/models", headers=key).status_code == 200
    assert c.get("/v1/models/m", headers=key).status_code == 200
    assert c.get("/nowhere").status_code == 404
    text = core.metrics.render()[0].decode()
    for handler, code in ((url, "401"), (url, "413"), (url, "400"), (url, "404"), (url, "503"),
                          ("/v1/models", "200"), ("/v1/models/{model}", "200"),
                          ("other", "404")):
        assert total(text, "tandem_router_http_requests_total",
                     handler=handler, code=code) == 1, (handler, code)


def test_a_stream_is_counted_once_by_how_it_ended():
    """The SSE relay reports each stream's outcome once, at its end: "ok", the code of a
    failure after output, "cancelled" when the client left first; every inner stream is
    closed and the admission slot released on each path."""
    import asyncio

    from tandem.services.router.core import Run
    from tandem.services.router.errors import RouterError
    from tandem.services.router.openai.app import _sse
    from tandem.services.router.request import ChatRequest, Output
    from tandem.v1 import common_pb2, language_pb2

    class Shape:  # the four chunk kinds of a real shape, as bytes
        def start(self, i, o):
            return b"s"

        def output(self, i, o):
            return o.text.encode()

        def finish(self, i, o):
            return b"f"

        def usage(self, last):
            return b"u"

    outcomes, closed, released = [], [], []

    def output(text: str, last: bool = False):
        return Output(language_pb2.LanguageGenerateResponse(
            text=text, finish_reason=common_pb2.FINISH_REASON_STOP if last else None))

    async def outputs(n: int, fail: str = ""):
        try:
            for i in range(1, n):
                yield 0, output(str(i), last=i == n - 1)
            if fail:
                raise RouterError(fail, "it broke")
        finally:
            closed.append(n)

    def relay(n: int, fail: str = ""):
        req = ChatRequest(messages=[], sampling=common_pb2.SamplingParams(), timeout_s=1.0,
                          request_id=f"r{n}")
        run = Run(req, 1, outputs(n, fail), lambda: released.append(n), outcomes.append)
        return _sse(run, (0, output("0")), Shape(), True)

    async def main():
        assert b"".join([c async for c in relay(3)]).endswith(b"data: [DONE]\n\n")
        body = b"".join([c async for c in relay(2, "UNAVAILABLE")])
        assert b"it broke" in body
        early = relay(5)
        for _ in range(3):  # start, output 0, output 1 (the inner stream has started)
            await early.__anext__()
        await early.aclose()  # the client went away mid-stream

    asyncio.run(main())
    assert outcomes == ["ok", "unavailable", "cancelled"]
    assert sorted(closed) == [2, 3, 5] and sorted(released) == [2, 3, 5]
