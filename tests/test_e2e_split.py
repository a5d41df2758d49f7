"""One prompt's media split across encoders, end to end (issue 27 step 3): `tandem up`
with 2 encoders + 1 language instance on the tiny Qwen2.5-VL and the router's
`--split-encoders 2`, so an Encode of a chat with >= 2 images names the other encoder as
its helper (services/router/dispatch/selection.py pick_helpers) and the lead encoder hands
it a range of the prompt (services/encoder/split.py). tests/test_split.py drives the
tiers in-process; here everything goes through the real router and real processes.

- Several chats of 3-4 distinct images each, at once over HTTP and one through the gRPC
  SDK: greedy answers equal transformers `generate()`; the router counted split prompts;
  each encoder wrote ranges both as a lead and as a helper (its own
  `tandem_transfer_ranges_total{role}`; the chats are picked so that the router's
  affinity rule sends some to each encoder); afterwards every page and block is free.
- An encoder SIGKILLed while it owes ViT work (GetLoad: patches queued or in its ViT; a
  round of six such chats in flight, another round if the polls missed it): every request still
  gets the exact answer, by one of the two recovery paths (a lead re-encodes a dead
  helper's range: the lead's `tandem_transfer_range_fallbacks_total`; or the router
  retries a request whose lead died: `tandem_router_encoder_retries_total` /
  `_request_retries_total`), of which at least one was taken; nothing leaks on the
  language instance. It kills an encoder, so it runs last.

No test here bounds a duration: waits end on the state they wait for (tests/waiting.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal

import httpx
import pytest
from language_oracle import generate, load, make_image, make_inputs
from test_e2e_cluster import openai_messages, png, strip_eos, wait_idle

from tandem.client import Client, image
from tandem.launch.cluster import LocalCluster
from tandem.services.router.dispatch.selection import Candidate, Selector
from tandem.v1 import encoder_pb2, encoder_pb2_grpc

ARCH = "qwen2_5_vl"
MAX_NEW = 6
TEXT = "Compare the pictures."
# distinct grids, so each image is its own ViT input with its own pad run
SIZES = [(56, 84), (84, 56), (112, 56), (56, 112)]

KILL_ROUNDS = 4  # rounds of 6 chats before the kill test gives up on catching ViT work

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint(ARCH)


@pytest.fixture(scope="module", params=["whole", "streamed"])
def cluster(ckpt, request):
    """Rows sent whole, or streamed (`--transfer.stream` on both tiers: the lead's piece
    then ends at the helper's range edge while its own last image may still be in the ViT;
    once such a round waited for rows past its piece, and the request for its deadline).
    `--split-max-helper-load 8`: every prompt is split, busy helpers too (by default only
    idle encoders help, and these chats run concurrently)."""
    rows = "--transfer.stream" if request.param == "streamed" else ""
    cl = LocalCluster(str(ckpt), encoders=2, languages=1, encoder_args=rows, language_args=rows,
                      router_args="--split-encoders 2 --split-max-helper-load 8 "
                                  "--load-refresh-s 0.2 "
                                  "--eject-after-failures 2")
    cl.start()
    yield cl
    cl.stop()


@pytest.fixture(scope="module")
def expected(ckpt):
    """`expected(images) -> (token ids, text)` of transformers' greedy `generate()`."""
    model, processor = load(ckpt)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list | tuple) else [eos])

    def run(images):
        inputs = make_inputs(processor, TEXT, [make_image(s, sz) for s, sz in images])
        tokens = strip_eos(generate(model, inputs, MAX_NEW)[0], eos)
        return tokens, processor.tokenizer.decode(tokens, skip_special_tokens=True)

    return run


def chat_images(seed: int, n: int) -> list[tuple[int, tuple[int, int]]]:
    """`n` distinct images (seed, size), none shared with another seed's chat."""
    return [(seed * 10 + k, SIZES[k]) for k in range(n)]


def lead_of(cluster, images) -> str:
    """The encoder the router's affinity rule sends this chat to on an idle cluster (the
    router's own Selector on its keys: each image's sha256)."""
    keys = [hashlib.sha256(png(s, sz)).hexdigest() for s, sz in images]
    pool = [Candidate(a, 0.0) for a in cluster.addresses("encoder")]
    return Selector().choose(pool, keys).address


def chats_led_by_each(cluster, per_encoder: int, first_seed: int) -> list[list]:
    """Chats of 3-4 images, `per_encoder` of them led by each encoder, interleaved."""
    by_lead: dict[str, list] = {a: [] for a in cluster.addresses("encoder")}
    seed = first_seed
    while any(len(v) < per_encoder for v in by_lead.values()):
        images = chat_images(seed, 3 + seed % 2)
        seed += 1
        got = by_lead[lead_of(cluster, images)]
        if len(got) < per_encoder:
            got.append(images)
    return [c for group in zip(*by_lead.values(), strict=True) for c in group]


def metrics_url(cluster, name: str) -> str:
    """An instance's Prometheus endpoint, from its `[up] <name> ready ... metrics <url>` line."""
    return next(m.group(1) for ln in list(cluster.lines)
                if ln.startswith(f"[up] {name} ") and (m := re.search(r"metrics (http\S+)", ln)))


def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if m := re.match(r"^(tandem_[a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line):
            out[m.group(1)] = float(m.group(2))
    return out


def router_metrics(cluster) -> dict[str, float]:
    return scrape(cluster.http_url + "/metrics")


async def ask_all(cluster, chats: list[list], timeout_ms: int = 60_000) -> list[dict]:
    """All `chats` at once over HTTP (every other one streamed): per chat its status,
    text (the content, or the body when it failed) and `tandem` extension."""
    url = cluster.http_url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=timeout_ms / 1000 + 30) as http:

        async def one(i: int, images) -> dict:
            body = {"model": "", "max_tokens": MAX_NEW, "temperature": 0,
                    "timeout_ms": timeout_ms, "messages": openai_messages(TEXT, images)}
            if i % 2:
                body["stream"] = True
                async with http.stream("POST", url, json=body) as r:
                    raw = (await r.aread()).decode()
                text, ext = "", {}
                for line in raw.splitlines():
                    if not line.startswith("data: {"):
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        return {"status": r.status_code, "text": raw, "ext": {}}
                    for c in ev.get("choices", []):
                        text += c["delta"].get("content") or ""
                    ext = ev.get("tandem", ext)
                return {"status": r.status_code, "text": text, "ext": ext}
            r = await http.post(url, json=body)
            if r.status_code != 200:
                return {"status": r.status_code, "text": r.text, "ext": {}}
            got = r.json()
            return {"status": 200, "text": got["choices"][0]["message"]["content"],
                    "ext": got["tandem"]}

        return await asyncio.gather(*(one(i, c) for i, c in enumerate(chats)))


def sdk_chat(cluster, images) -> list[int]:
    with Client(cluster.grpc_address) as c:
        parts = [image(png(s, sz)) for s, sz in images] + [TEXT]
        return c.chat([{"role": "user", "content": parts}], max_tokens=MAX_NEW,
                      timeout=90).token_ids


def delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_split_prompts_are_exact_and_both_encoders_lead_and_help(cluster, expected):
    encoders = {n: metrics_url(cluster, n) for n in ("encoder-0", "encoder-1")}
    enc0 = {n: scrape(u) for n, u in encoders.items()}
    router0 = router_metrics(cluster)
    http_chats = chats_led_by_each(cluster, 2, first_seed=100)
    sdk_images = chat_images(99, 4)

    async def everything():
        sdk = asyncio.to_thread(sdk_chat, cluster, sdk_images)
        return await asyncio.gather(ask_all(cluster, http_chats), sdk)

    answers, sdk_tokens = asyncio.run(everything())

    assert [(a["status"], a["text"]) for a in answers] == [
        (200, expected(c)[1]) for c in http_chats]
    assert sdk_tokens == expected(sdk_images)[0]
    both = set(cluster.addresses("encoder"))
    assert {a["ext"]["encoder"] for a in answers} == both  # each encoder led some
    for a in answers:  # every prompt written by both encoders, none re-encoded
        ranges = a["ext"]["timings"]["encoder_ranges"]
        assert {r["encoder"] for r in ranges} == both and not any(
            r["fell_back"] for r in ranges), a["ext"]
    router1 = router_metrics(cluster)
    assert delta(router0, router1, "tandem_router_split_prompts_total") >= len(http_chats) + 1
    for name, url in encoders.items():
        enc1 = scrape(url)
        for role in ("lead", "helper"):
            key = f'tandem_transfer_ranges_total{{role="{role}"}}'
            assert delta(enc0[name], enc1, key) > 0, (name, role, enc1)
        assert delta(enc0[name], enc1, "tandem_transfer_range_fallbacks_total") == 0
    assert wait_idle(cluster)["idle"]


def test_encoder_killed_mid_prompt_every_answer_exact_nothing_leaks(cluster, expected):
    """Runs last: it kills encoder-0. The kill lands while encoder-0 has patches waiting
    for its ViT (as a lead or as a helper), so rows it owes are certainly unwritten and
    one recovery path must be taken; a round of chats whose ViT work the polls never
    caught (a tiny model's ViT is quick) is answered and followed by a fresh round."""
    victim = cluster.instances["encoder-0"]
    survivor = metrics_url(cluster, "encoder-1")
    before, router0 = scrape(survivor), router_metrics(cluster)

    async def kill_while_it_works(load, chats):
        asking = asyncio.ensure_future(ask_all(cluster, chats))
        while not asking.done():
            got = await asyncio.to_thread(load, encoder_pb2.EncoderGetLoadRequest(), timeout=5)
            if got.queued_patches + got.vit_patches > 0:  # rows it owes are not written yet
                os.kill(victim.pid, signal.SIGKILL)
                return await asking, True
        return await asking, False

    killed, rounds = False, 0
    # one channel for the polls (a new one per poll would be a TLS handshake each)
    with cluster.channel(victim.address) as ch:
        while not killed and rounds < KILL_ROUNDS:
            chats = chats_led_by_each(cluster, 3, first_seed=200 + 100 * rounds)  # fresh images
            answers, killed = asyncio.run(kill_while_it_works(
                encoder_pb2_grpc.EncoderStub(ch).GetLoad, chats))
            rounds += 1
            assert [(a["status"], a["text"]) for a in answers] == [
                (200, expected(c)[1]) for c in chats]
    assert killed, f"encoder-0 never had patches queued in {rounds} rounds of chats"
    after, router1 = scrape(survivor), router_metrics(cluster)
    recovered = {
        "fell_back": delta(before, after, "tandem_transfer_range_fallbacks_total"),
        "encoder_retries": delta(router0, router1, "tandem_router_encoder_retries_total"),
        "request_retries": delta(router0, router1, "tandem_router_request_retries_total"),
    }
    print("rounds:", rounds, "recovery:", recovered, "attempts:",
          [(a["ext"].get("attempts"), a["ext"].get("encoder_attempts")) for a in answers])
    assert any(recovered.values()), recovered
    state = wait_idle(cluster)
    assert list(state["encoder"]) == [cluster.instances["encoder-1"].address], state
