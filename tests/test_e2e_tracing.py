"""One trace per request across the three tiers, checked at a real OTLP/gRPC receiver.

One cluster (`tandem up`: 2 encoders, 1 language instance of 2 tensor-parallel ranks,
languages reserving 64 tokens so long prompts resume) exports its spans, configured by the
standard OTEL_* variables only, to an in-process receiver serving the protocol's own
TraceService (tests/otlp_receiver.py). For requests over HTTP and the SDK, streaming and
not: each request is one trace whose spans all name its request id, whose only root is
the router's (a child of the caller's traceparent when it sent one), and whose spans link
tier to tier: router.encode -> encoder.encode, router.language -> language.generate,
language transfer.attach -> encoder.attach and -> rank 1's tp.gather. A prompt larger
than its reservation shows its resumes on both sides, a text-only chat has no encoder
span, and a request whose encoder is frozen shows the failed Encode, the Reattach and the
second encoder's Encode. The latency histograms carry the traces' ids as exemplars.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import signal

import httpx
import pytest
from otlp_receiver import OtlpReceiver, ReceivedSpan
from test_e2e_cluster import TEXT_LONG, data_url, openai_messages, png

from tandem.client import Client, image
from tandem.launch.cluster import LocalCluster
from tandem.services.router.dispatch.selection import PickReason, rendezvous_order

pytestmark = pytest.mark.timeout(300)
ARCH = "qwen2_5_vl"
REASONS = {r.value for r in PickReason}
SERVICES = {"router": "tandem-router", "encoder": "tandem-encoder",
            "language": "tandem-language", "transfer": None, "tp": "tandem-language"}
# every span an image chat makes, by the service that makes it
IMAGE_CHAT = {
    "tandem-router": {"router.admission", "router.attempt", "router.pick", "router.language",
                      "router.encode"},
    "tandem-encoder": {"encoder.encode", "encoder.queue", "encoder.preprocess",
                       "encoder.fetch", "encoder.announce", "encoder.cache", "encoder.vit_queue",
                       "encoder.vit_batch", "encoder.merge", "encoder.transfer",
                       "transfer.write", "encoder.attach"},
    "tandem-language": {"language.generate", "language.transfer", "language.room_wait",
                        "transfer.attach", "tp.gather", "language.queue", "language.prefill",
                        "language.prefill_chunk", "language.decode"},
}


@pytest.fixture(scope="module")
def rx():
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def cluster(rx, checkpoint):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=rx.endpoint, OTEL_BSP_SCHEDULE_DELAY="100")
    cl = LocalCluster(str(checkpoint(ARCH)), encoders=2, languages=1, env=env,
                      language_args="--tp 2 --embedding-block-size 16 "
                      "--default-reservation-tokens 64",
                      router_args="--load-refresh-s 0.2 --eject-after-failures 2")
    cl.start()
    yield cl
    cl.stop()


def new_parent() -> tuple[str, str, str]:
    """(trace id, span id, traceparent) of a caller's span."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _complete(spans: list[ReceivedSpan], want: dict[str, set[str]]) -> bool:
    """Every wanted span is in and every span's parent is (but the one root's)."""
    ids = {s.span_id for s in spans}
    have = {(s.service, s.name) for s in spans}
    return (all((svc, n) in have for svc, names in want.items() for n in names)
            and sum(s.parent_id not in ids for s in spans) == 1)


def one_trace(rx: OtlpReceiver, trace_id: str, want: dict[str, set[str]],
              caller_span: str = "") -> list[ReceivedSpan]:
    """The spans of `trace_id` once complete; checks what every trace must hold."""
    rx.wait_for(lambda _s: _complete(rx.trace(trace_id), want), f"trace {trace_id}")
    spans = rx.trace(trace_id)
    ids = {s.span_id for s in spans}
    (root,) = [s for s in spans if s.parent_id not in ids]
    assert root.service == "tandem-router" and root.kind == 2  # SERVER
    assert re.fullmatch(r"(chat|text_completion) \S+", root.name), root.name
    assert root.parent_id == caller_span  # "" when the caller sent no traceparent
    rid = root.request_id
    assert rid and all(s.request_id == rid for s in spans), {s.name for s in spans
                                                             if s.request_id != rid}
    for s in spans:  # each tier's spans come from that tier's process
        svc = SERVICES.get(s.name.split(".")[0], "tandem-router")
        if s.name.startswith("chat") or svc is None:
            continue
        assert s.service == svc, (s.name, s.service)
    return spans


def named(spans, name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def child(spans, parent: ReceivedSpan, name: str) -> ReceivedSpan:
    (s,) = [s for s in spans if s.name == name and s.parent_id == parent.span_id]
    return s


def check_links(spans) -> None:
    """The spans that cross a process boundary hang under their caller's span."""
    for enc in named(spans, "router.encode"):
        if enc.status_code != 2:  # a delivered Encode's server span is in
            child(spans, enc, "encoder.encode")
    child(spans, named(spans, "router.language")[-1], "language.generate")
    for att in named(spans, "transfer.attach"):
        if att.status_code != 2:
            child(spans, att, "encoder.attach")
            gathers = [s for s in spans if s.name == "tp.gather" and s.parent_id == att.span_id]
            assert gathers and all(g.resource.get("tandem.tp.rank") == 1 for g in gathers)


def test_http_image_chat_is_one_trace_across_all_tiers(cluster, rx):
    trace_id, caller, tp = new_parent()
    r = httpx.post(cluster.http_url + "/v1/chat/completions", timeout=60,
                   headers={"traceparent": tp},
                   json={"model": "", "max_tokens": 6, "temperature": 0,
                         "messages": openai_messages("Describe it.", [(61, (56, 84))])})
    assert r.status_code == 200, r.text
    spans = one_trace(rx, trace_id, IMAGE_CHAT, caller)
    check_links(spans)
    root = spans[[s.parent_id for s in spans].index(caller)]
    usage = r.json()["usage"]
    assert root.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert root.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert root.attributes["gen_ai.response.finish_reasons"] == [r.json()["choices"][0]
                                                                 ["finish_reason"]]
    assert root.attributes["gen_ai.request.max_tokens"] == 6
    assert root.attributes["tandem.request_id"] == "chatcmpl-" + r.headers["x-request-id"]
    picks = named(spans, "router.pick")
    assert {p.attributes["tandem.tier"] for p in picks} == {"encoder", "language"}
    assert all(p.attributes["tandem.pick.reason"] in REASONS for p in picks)
    (batch,) = named(spans, "encoder.vit_batch")
    assert batch.attributes["tandem.vit.batch_inputs"] >= 1
    assert all(c.attributes["tandem.chunk.tokens"] > 0 for c in named(spans,
                                                                       "language.prefill_chunk"))
    (gen,) = named(spans, "language.generate")
    assert "first_token" in gen.events
    assert gen.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]


def test_http_stream_with_resumes_shows_them_on_both_sides(cluster, rx):
    trace_id, caller, tp = new_parent()
    body = {"model": "", "max_tokens": 5, "temperature": 0, "stream": True,
            "messages": openai_messages(TEXT_LONG * 2, [(62, (224, 224))])}
    with httpx.stream("POST", cluster.http_url + "/v1/chat/completions", json=body,
                      headers={"traceparent": tp}, timeout=60) as r:
        text = r.read().decode()
    assert r.status_code == 200 and "[DONE]" in text and '"error"' not in text, text[-300:]
    want = {k: set(v) for k, v in IMAGE_CHAT.items()}
    want["tandem-encoder"].add("transfer.resume_wait")
    want["tandem-language"].add("transfer.resume")
    spans = one_trace(rx, trace_id, want, caller)
    check_links(spans)
    root = [s for s in spans if s.parent_id == caller][0]
    assert root.attributes["gen_ai.request.stream"] is True
    (transfer,) = named(spans, "language.transfer")
    assert transfer.attributes["tandem.transfer.resumes"] >= 1
    assert len(named(spans, "tp.gather")) >= 2  # a range per piece at least


def test_sdk_requests_stream_and_not_text_only_has_no_encoder_span(cluster, rx):
    with Client(cluster.grpc_address, timeout=60) as c:
        whole = c.chat([{"role": "user", "content": [image(png(63, (56, 56))), "What?"]}],
                       max_tokens=4, request_id="sdk-whole")
        trace_id, caller, tp = new_parent()
        pieces = list(c.stream_chat("Hello there.", max_tokens=4, traceparent=tp))
    assert whole.text and pieces
    # without a traceparent the router starts the trace: found by the request id
    rx.wait_for(lambda spans: any(s.request_id == "sdk-whole" for s in spans), "sdk-whole")
    sdk_trace = next(s.trace_id for s in rx.spans if s.request_id == "sdk-whole")
    spans = one_trace(rx, sdk_trace, IMAGE_CHAT)
    check_links(spans)
    text_only = {"tandem-router": {"router.attempt", "router.pick", "router.language"},
                 "tandem-language": {"language.generate", "language.tokenize",
                                     "language.prefill", "language.decode"}}
    spans = one_trace(rx, trace_id, text_only, caller)
    assert not [s for s in spans if s.service == "tandem-encoder"]
    assert not named(spans, "router.encode") and not named(spans, "language.transfer")
    (pick,) = named(spans, "router.pick")
    assert pick.attributes["tandem.tier"] == "language"
    child(spans, named(spans, "router.language")[0], "language.generate")


def test_a_frozen_encoder_failover_is_visible_in_the_trace(cluster, rx):
    """The image's affinity names the encoder the router picks: frozen (SIGSTOP) before
    the request, it is ejected while the Encode waits; the trace shows that Encode failed
    and retried, the Reattach the language instance accepted, its second Attach and the
    other encoder's Encode."""
    raw = png(64, (56, 56))
    victim = rendezvous_order(hashlib.sha256(raw).hexdigest(), cluster.addresses("encoder"))[0]
    pid = next(i.pid for i in cluster.instances.values() if i.address == victim)
    trace_id, caller, tp = new_parent()
    body = {"model": "", "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(raw)}},
                                     {"type": "text", "text": "What is it?"}]}]}
    os.kill(pid, signal.SIGSTOP)
    try:
        r = httpx.post(cluster.http_url + "/v1/chat/completions", json=body, timeout=120,
                       headers={"traceparent": tp})
    finally:
        os.kill(pid, signal.SIGCONT)
    assert r.status_code == 200, r.text
    ext = r.json()["tandem"]
    assert ext["encoder_attempts"] == 2 and ext["encoder"] != victim, ext
    want = {"tandem-router": {"router.encode", "router.reattach", "router.pick"},
            "tandem-encoder": {"encoder.encode", "encoder.attach", "encoder.transfer"},
            # tp.gather: rank 1's copy, exported by its own process, may come in last
            "tandem-language": {"language.reattach", "transfer.attach", "language.decode",
                                "tp.gather"}}
    spans = one_trace(rx, trace_id, want, caller)
    check_links(spans)
    first, second = sorted(named(spans, "router.encode"),
                           key=lambda s: s.attributes["tandem.encoder.attempt"])
    assert first.attributes["server.address"] == victim and first.status_code == 2
    assert first.attributes["tandem.retried"] is True
    assert second.attributes["server.address"] == ext["encoder"] and second.status_code != 2
    encoder_picks = [p for p in named(spans, "router.pick") if p.attributes["tandem.tier"] ==
                     "encoder"]
    assert [p.attributes["tandem.pick.excluded"] for p in encoder_picks] == [0, 1]
    (reattach,) = named(spans, "router.reattach")
    assert reattach.attributes["tandem.reattach.accepted"] is True
    child(spans, reattach, "language.reattach")
    attaches = sorted(named(spans, "transfer.attach"),
                      key=lambda s: s.attributes["tandem.transfer.attempt"])
    assert [a.attributes["server.address"] for a in attaches] == [victim, ext["encoder"]]
    assert attaches[0].status_code == 2


def test_latency_histograms_carry_trace_ids_as_exemplars(cluster, rx):
    """OpenMetrics pages (the router's /metrics, the language instance's metrics port)
    carry exemplars naming traces the receiver holds; the Prometheus text page none."""
    accept = {"accept": "application/openmetrics-text; version=1.0.0"}
    traces = {s.trace_id for s in rx.spans}
    lang = next(m.group(1) for ln in cluster.lines
                if "language-0" in ln and (m := re.search(r"metrics (http\S+)", ln)))
    for url, metric in ((cluster.http_url + "/metrics", "tandem_router_ttft_seconds_bucket"),
                        (lang, "tandem_language_time_to_first_token_seconds_bucket")):
        page = httpx.get(url, headers=accept, timeout=10).text
        got = re.findall(rf'^{metric}{{[^}}]*}} \S+ # {{trace_id="([0-9a-f]{{32}})"}}', page,
                         re.M)
        assert got and set(got) <= traces, (url, got[:3])
        assert "trace_id=" not in httpx.get(url, timeout=10).text
