"""E/P/D (issue 39, services/language/handoff.py): a real encoder, a prefill instance
(`--role prefill`), a decode instance (`--role decode`) and a `both` instance, their
`run()`s in one event loop, driven as the router drives them: Generate(room, encoder,
prefill_address) on the decode instance and Encode(room, chat) on the encoder.

- Greedy output equals transformers `generate()` for image chats (three at once, MRoPE
  deltas that differ per prompt; Qwen3-VL's deepstack) and a text-only chat (the prefill
  instance tokenizes it): the first token from the prefill instance, the rest decoded on
  the decode instance from the KV pages it landed and checked (`--transfer.protect mac`).
- A seeded sampled request gives the same tokens as on a `both` instance (the sampler's
  generator goes with the pages), with logprobs; so do a video chat (given as frames),
  structured output (a JSON schema: the decode instance's matcher replays the first
  token) and a chat with tools, each against the `both` instance (whose answers equal
  transformers' in tests/test_e2e_video.py, tests/test_structured_output*.py).
- A request that ends at its first token (max_tokens 1) ends on the prefill instance, and
  no page moves.
- The roles refuse what is not theirs (FAILED_PRECONDITION).
- Another Mooncake engine hammering the decode instance's KV inbox slots with garbage
  during the hand-offs never changes an answer: each is exact or ends DATA_LOSS (its
  pages freed unread; the router would retry it), and the attack lands. (The cache the
  pages land in is never registered, so no peer can write a page in use:
  tests/test_kv_transfer.py.)
- Afterwards every KV page, embedding block and staging slot is free on both instances;
  each hand-off is counted on both sides (the bytes sent are the bytes landed and checked),
  with its descriptors.

No test here bounds a duration: every wait is a hang guard (tests/waiting.py).
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from inproc import HANG_GUARD_S, Services
from test_stream import expected
from waiting import wait_until

sys.path.insert(0, str(Path(__file__).parent))
from encoder_peers.chats import png, to_proto  # noqa: E402

from tandem.chat import ImageInput, Message, VideoInput, VideoOptions  # noqa: E402
from tandem.errors import CULPRIT_METADATA  # noqa: E402
from tandem.launch.procs import free_port  # noqa: E402
from tandem.v1 import (  # noqa: E402
    common_pb2,
    encoder_pb2,
    encoder_pb2_grpc,
    language_pb2,
    language_pb2_grpc,
)

pytestmark = pytest.mark.timeout(300)
MAX_NEW = 6  # (test_stream's `expected` generates as many)


def image_chat(seed: int) -> list[Message]:
    w, h = [(64, 48), (40, 150), (120, 90)][seed % 3]
    return [Message("system", ("You are terse.",)),
            Message("user", (f"Describe case {seed}:", ImageInput(data=png(w, h, seed)),
                             "in a word"))]


def text_chat() -> list[Message]:
    return [Message("user", ("Count from one to ten, slowly, and say why.",))]


class Cluster:
    """An encoder, a prefill, a decode and a `both` instance in one background loop."""

    def __init__(self, ckpt: Path, protect: str = "mac") -> None:
        from tandem.config import TransferConfig
        from tandem.services.encoder.config import EncoderConfig
        from tandem.services.language.config import LanguageConfig

        self.enc_cfg = EncoderConfig(
            model=str(ckpt), device="cpu", dtype="float32", port=free_port(),
            insecure_internal=True, linear_backend="torch",
            transfer=TransferConfig(timeout_s=20, protect=protect))

        def language(role: str) -> LanguageConfig:
            # 16-token pages, a 16-token prefill budget and 4 slots per chunk on the wire:
            # prompts of several chunks, each landed and checked on its own
            return LanguageConfig(
                model=str(ckpt), device="cpu", dtype="float32", port=free_port(),
                insecure_internal=True, kv_pages=128, kv_page_size=16, role=role,
                metrics_port=free_port(),
                embedding_block_size=16, default_reservation_tokens=64, max_prefill_tokens=16,
                kv_staging_pages=32, transfer=TransferConfig(timeout_s=20, protect=protect))

        self.cfgs = {r: language(r) for r in ("prefill", "decode", "both")}
        self.services = Services()

    def address(self, role: str) -> str:
        return f"127.0.0.1:{self.cfgs[role].port}"

    def start(self) -> Cluster:
        from tandem.services.encoder.main import run as run_encoder
        from tandem.services.language.main import run as run_language

        self.services.start(
            [lambda r, s: run_encoder(self.enc_cfg, r, s)]
            + [lambda r, s, c=c: run_language(c, r, s) for c in self.cfgs.values()])

        async def channels():
            self.enc = encoder_pb2_grpc.EncoderStub(
                grpc.aio.insecure_channel(f"127.0.0.1:{self.enc_cfg.port}"))
            self.stubs = {r: language_pb2_grpc.LanguageStub(grpc.aio.insecure_channel(
                self.address(r))) for r in self.cfgs}

        self.call(channels())
        return self

    def call(self, coro):
        return self.services.call(coro)

    def stop(self) -> None:
        self.services.stop()

    async def generate(self, messages: list[Message], sampling: common_pb2.SamplingParams,
                       on: str = "decode", tools_json: str = ""
                       ) -> list[language_pb2.LanguageGenerateResponse]:
        """The router's part: Generate on `on` (the decode instance naming the prefill
        instance, or the `both` one), Encode on the encoder when the chat has an image."""
        return (await self.answer(messages, sampling, on, tools_json)).messages

    async def answer(self, messages: list[Message], sampling: common_pb2.SamplingParams,
                     on: str = "decode", tools_json: str = "", prefill: str = "") -> Answer:
        """`generate`'s messages, and the instance the call's trailing metadata blames;
        `prefill`: the prefill instance named (the cluster's when "")."""
        room = secrets.randbits(62)
        media = any(isinstance(p, ImageInput | VideoInput) for m in messages for p in m.parts)
        req = language_pb2.LanguageGenerateRequest(
            room=room, sampling=sampling,
            encoder_address=f"127.0.0.1:{self.enc_cfg.port}" if media else "",
            messages=() if media else to_proto(messages), tools_json=tools_json,
            prefill_address=(prefill or self.address("prefill")) if on == "decode" else "")
        stream = self.stubs[on].Generate(req)
        encode = (asyncio.ensure_future(self.enc.Encode(encoder_pb2.EncodeRequest(
            room=room, messages=to_proto(messages)))) if media else None)
        out = [msg async for msg in stream]
        if encode is not None:
            await encode
        return Answer(out, dict(await stream.trailing_metadata()).get(CULPRIT_METADATA, ""))

    def metric(self, role: str, name: str, labels: str = "") -> float:
        """A sample of `role`'s metrics page (0 when absent)."""
        url = f"http://127.0.0.1:{self.cfgs[role].metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        want = f"{name}{{{labels}}}" if labels else name
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                   if ln.split(" ")[0] == want)

    def generate_sync(self, messages: list[Message]) -> list:
        return self.call(self.generate(messages, GREEDY))

    def loads(self, role: str):
        async def get():
            return await self.stubs[role].GetLoad(language_pb2.LanguageGetLoadRequest())

        return self.call(get())


@dataclass(frozen=True)
class Answer:
    messages: list[language_pb2.LanguageGenerateResponse]
    culprit: str  # the instance the call's trailing metadata blames (CULPRIT_METADATA)


def tokens_of(out) -> list[int]:
    last = out[-1]
    assert last.finish_reason in (common_pb2.FINISH_REASON_STOP,
                                  common_pb2.FINISH_REASON_LENGTH), last
    return [t for m in out for t in m.token_ids]


def assert_idle(c: Cluster) -> None:
    def idle():
        for role in ("prefill", "decode"):
            r = c.loads(role)
            if not (r.free_kv_pages == r.total_kv_pages
                    and r.free_embedding_blocks == r.total_embedding_blocks
                    and r.transferring + r.waiting + r.running == 0):
                return False
        return True

    wait_until(idle, timeout_s=HANG_GUARD_S, what="every KV page and block free on P and D")


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def cluster(request, checkpoint):
    ckpt = checkpoint(request.param)
    c = Cluster(ckpt).start()
    c.ckpt, c.arch = ckpt, request.param
    yield c
    c.stop()


GREEDY = common_pb2.SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def test_greedy_image_chats_equal_generate(cluster):
    chats = [image_chat(seed) for seed in (1, 2, 3)]
    want = [expected(cluster.ckpt, c) for c in chats]

    async def all_three():
        return await asyncio.gather(*[cluster.generate(c, GREEDY) for c in chats])

    outs = cluster.call(all_three())
    for out, w in zip(outs, want, strict=True):
        assert tokens_of(out) == w
        assert out[0].token_ids == w[:1]  # the first token: the prefill instance's
        assert out[-1].usage.completion_tokens == len(w)
        assert out[-1].usage.prompt_tokens > 16  # several pages moved
    assert_idle(cluster)


def test_greedy_text_chat_equals_generate(cluster):
    out = cluster.call(cluster.generate(text_chat(), GREEDY))
    assert tokens_of(out) == expected(cluster.ckpt, text_chat())
    assert_idle(cluster)


def test_seeded_sampling_continues_exactly_on_the_decode_instance(cluster):
    sampling = common_pb2.SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=1234,
                                         logprobs=True, ignore_eos=True)
    chat = image_chat(4)
    split = cluster.call(cluster.generate(chat, sampling))
    whole = cluster.call(cluster.generate(chat, sampling, on="both"))
    assert tokens_of(split) == tokens_of(whole)
    lps = [lp.logprob for m in split for lp in m.logprobs]
    assert lps == pytest.approx([lp.logprob for m in whole for lp in m.logprobs], abs=1e-5)
    assert_idle(cluster)


def test_a_request_that_ends_at_its_first_token_ends_on_the_prefill_instance(cluster):
    out = cluster.call(cluster.generate(text_chat(), common_pb2.SamplingParams(
        max_tokens=1, temperature=0.0)))
    assert tokens_of(out) == expected(cluster.ckpt, text_chat())[:1]
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert_idle(cluster)


def test_roles_refuse_what_is_not_theirs(cluster):
    plain = cluster.call(cluster.generate(text_chat(), GREEDY, on="both"))
    assert tokens_of(plain) == expected(cluster.ckpt, text_chat())  # `both` as before

    async def direct(role: str, prefill: str = ""):
        req = language_pb2.LanguageGenerateRequest(
            room=secrets.randbits(62), sampling=GREEDY, messages=to_proto(text_chat()),
            prefill_address=prefill)
        return [m async for m in cluster.stubs[role].Generate(req)]

    for role, prefill in (("decode", ""), ("prefill", ""), ("both", cluster.address("prefill")),
                          ("decode", cluster.address("both"))):
        out = cluster.call(direct(role, prefill))
        assert out[-1].finish_reason == common_pb2.FINISH_REASON_ERROR, (role, prefill)
        assert out[-1].error.code == "FAILED_PRECONDITION", (role, prefill, out[-1].error)
    assert cluster.loads("decode").role == "decode"
    assert_idle(cluster)


def test_handoffs_are_counted_on_both_sides(cluster):
    before = {(r, d): cluster.metric(r, "tandem_language_kv_transfers_total",
                                     f'direction="{d}",outcome="ok"')
              for r, d in (("prefill", "sent"), ("decode", "received"))}
    sent0 = cluster.metric("prefill", "tandem_language_kv_transfer_bytes_total",
                           'direction="sent"')
    got0 = cluster.metric("decode", "tandem_language_kv_transfer_bytes_total",
                          'direction="received"')
    cluster.call(cluster.generate(image_chat(5), GREEDY))
    assert cluster.metric("prefill", "tandem_language_kv_transfers_total",
                          'direction="sent",outcome="ok"') == before[("prefill", "sent")] + 1
    assert cluster.metric("decode", "tandem_language_kv_transfers_total",
                          'direction="received",outcome="ok"') == before[("decode", "received")] + 1
    sent = cluster.metric("prefill", "tandem_language_kv_transfer_bytes_total",
                          'direction="sent"') - sent0
    assert sent > 0
    assert cluster.metric("decode", "tandem_language_kv_transfer_bytes_total",
                          'direction="received"') - got0 == sent
    assert cluster.metric("prefill", "tandem_language_kv_transfer_descriptors_count") >= 1
    assert_idle(cluster)


def video_chat(seed: int) -> list[Message]:
    frames = tuple(ImageInput(data=png(56, 42, seed * 100 + i)) for i in range(4))
    return [Message("user", ("What happens in this clip?",
                             VideoInput(frames=frames, options=VideoOptions(fps=2.0)),
                             "Say it briefly."))]


SCHEMA = ('{"type": "object", "properties": {"name": {"type": "string"}, "n": '
          '{"type": "integer"}}, "required": ["name", "n"]}')
TOOLS = ('[{"type": "function", "function": {"name": "get_weather", "parameters": '
         '{"type": "object", "properties": {"city": {"type": "string"}}}}}]')


@pytest.mark.parametrize("case", ["video", "json_schema", "tools"])
def test_video_structured_output_and_tools_continue_exactly(cluster, case):
    sampling = common_pb2.SamplingParams(max_tokens=12, temperature=0.0)
    chat, tools = text_chat(), ""
    if case == "video":
        chat = video_chat(7)
    elif case == "json_schema":
        sampling.structured_output.json_schema = SCHEMA
    else:
        tools = TOOLS
    split = cluster.call(cluster.generate(chat, sampling, tools_json=tools))
    whole = cluster.call(cluster.generate(chat, sampling, on="both", tools_json=tools))
    assert tokens_of(split) == tokens_of(whole)
    assert "".join(m.text for m in split) == "".join(m.text for m in whole)
    assert split[-1].usage.prompt_tokens == whole[-1].usage.prompt_tokens > 16
    assert_idle(cluster)


def test_a_peer_overwriting_the_inbox_never_changes_an_answer(cluster, monkeypatch):
    if cluster.arch != "qwen2_5_vl":
        pytest.skip("one architecture shows it")
    from tandem.config import TransferConfig
    from tandem.services.language import handoff
    from tandem.transfer.engine import MooncakeEngine

    rooms: list[tuple[str, int, list[int], int]] = []
    reserve = handoff.DecodeLink.reserve

    async def spied(self, prompt, max_model_len):  # what the attacker is assumed to know
        await reserve(self, prompt, max_model_len)
        inbox = self.port.staging
        rooms.append((self.port.engine.session_id, inbox.base, inbox.held(self.room),
                      inbox.layout.page_bytes))

    monkeypatch.setattr(handoff.DecodeLink, "reserve", spied)
    attacker = MooncakeEngine(TransferConfig(timeout_s=5))
    garbage = torch.full((1 << 20,), 3.0)
    attacker.register(garbage)
    stop = threading.Event()

    def hammer():
        while not stop.is_set():
            for session, base, slots, size in list(rooms[-2:]):
                for s in slots:
                    n = min(size, garbage.numel() * 4)
                    try:
                        attacker.raw_write(session, garbage.data_ptr(), base + s * size, n)
                    except Exception:  # noqa: BLE001  (a refused write is the point)
                        pass

    t = threading.Thread(target=hammer, daemon=True)
    t.start()
    try:
        chats = [image_chat(seed) for seed in range(10, 16)]
        outcomes = []
        for chat in chats:
            answer = cluster.call(cluster.answer(chat, GREEDY))
            out = answer.messages
            if out[-1].finish_reason == common_pb2.FINISH_REASON_ERROR:
                assert out[-1].error.code == "DATA_LOSS", out[-1].error
                # the pages that came are not the prefill instance's: it is named (the
                # router's retry avoids it, and this decode instance too: DATA_LOSS)
                assert answer.culprit == cluster.address("prefill")
                outcomes.append("DATA_LOSS")
            else:
                assert tokens_of(out) == expected(cluster.ckpt, chat)
                assert answer.culprit == ""
                outcomes.append("exact")
    finally:
        stop.set()
        t.join(30)
        attacker.unregister(garbage)
        attacker.close()
    print("hand-offs under attack:", outcomes)
    assert "DATA_LOSS" in outcomes  # the attack landed, and was caught
    assert_idle(cluster)


def test_the_prefill_instance_tags_pages_as_its_prefill_computes_them(cluster, monkeypatch):
    """Under `mac` each chunk's tag is taken on the prefill instance's tagger thread once
    the prefill step that completes its pages ran (Engine.watch_prefill -> KVTagger), not
    in the transfer; the answers stay exact; both sides' staging slots are wiped after the
    pages may be used and come back free as zeros."""
    if cluster.arch != "qwen2_5_vl":
        pytest.skip("one architecture shows it")
    from tandem.transfer import kv

    plan = kv.chunk_plan
    monkeypatch.setattr(kv, "chunk_plan", lambda n, chunk_pages=2: plan(n, 2))  # chunks
    progress, tagged, sent, areas = [], [], [], set()
    real_progress, real_tag, real_send = kv.KVTagger.progress, kv.KVKeys.tag, kv.send_pages
    real_land = kv.KVStaging.land

    def spied_progress(self, pages, computed, epoch):
        real_progress(self, pages, computed, epoch)
        progress.append((self.room, computed < self.prompt_tokens, len(self._jobs)))

    def spied_tag(self, cache, pages):
        tagged.append(threading.current_thread().name)
        return real_tag(self, cache, pages)

    def spied_send(engine, cache, pages, outbox, dest, *a, **kw):
        areas.add(outbox)
        out = real_send(engine, cache, pages, outbox, dest, *a, **kw)
        sent.append(len(out.chunks))
        return out

    def spied_land(self, *a, **kw):
        areas.add(self)
        return real_land(self, *a, **kw)

    from tandem.services.language import handoff
    monkeypatch.setattr(kv.KVTagger, "progress", spied_progress)
    monkeypatch.setattr(kv.KVKeys, "tag", spied_tag)
    monkeypatch.setattr(handoff, "send_pages", spied_send)
    monkeypatch.setattr(kv.KVStaging, "land", spied_land)
    chats = [image_chat(4), [Message("user", ("Say why, in order: " + "one, two, three, " * 12,))]]
    for chat in chats:
        assert tokens_of(cluster.generate_sync(chat)) == expected(cluster.ckpt, chat)
    assert len(sent) == 2 and sent[1] >= 3  # the long one: several chunks
    # every chunk tagged once, on the tagger thread: none in the transfer
    assert len(tagged) == sum(sent) and all(n.startswith("kv-tag") for n in tagged), tagged
    # the engine reported the prompt's progress step by step (16-token steps), and the
    # long prompt's first chunks were queued before it was all computed
    rooms = list(dict.fromkeys(r for r, _, _ in progress))
    assert len(rooms) == 2
    assert any(early and jobs > 0 for r, early, jobs in progress if r == rooms[1])
    assert_idle(cluster)
    assert len(areas) == 2  # the prefill instance's outbox, the decode instance's inbox
    # (slots retired by an earlier test's failed hand-offs come back at a later reserve)
    wait_until(lambda: all(a.num_free + a.num_retired == a.num_slots for a in areas),
               timeout_s=HANG_GUARD_S, what="every staging slot free (or retired)")
    for a in areas:  # a slot that comes back free is zeros
        free = a.free_slots()
        assert free and not a.rows[free].any()


def test_cancel_and_deadline_free_everything_on_both_sides(cluster):
    """A caller gone after its first token, and a deadline that passes while decoding:
    the pages, blocks and slots of both instances all come back."""
    # more tokens than the deadline below leaves time for (and than fit the pages' 2048)
    long = common_pb2.SamplingParams(max_tokens=1800, temperature=0.0, ignore_eos=True)

    async def cancel_after_first():
        req = language_pb2.LanguageGenerateRequest(
            room=secrets.randbits(62), sampling=long, messages=to_proto(text_chat()),
            prefill_address=cluster.address("prefill"))
        call = cluster.stubs["decode"].Generate(req)
        first = await call.read()
        call.cancel()
        return first

    first = cluster.call(cancel_after_first())
    assert len(first.token_ids) == 1
    assert_idle(cluster)

    async def past_deadline():
        import time

        req = language_pb2.LanguageGenerateRequest(
            room=secrets.randbits(62), sampling=long, messages=to_proto(text_chat()),
            prefill_address=cluster.address("prefill"),
            deadline_unix_ms=int(time.time() * 1000) + 1000)
        return [m async for m in cluster.stubs["decode"].Generate(req)]

    out = cluster.call(past_deadline())
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_ABORT, out[-1]
    assert out[-1].error.code == "DEADLINE_EXCEEDED", out[-1].error
    assert_idle(cluster)


def test_the_decode_instance_blames_the_prefill_instance_only_for_its_failures(cluster):
    """The decode instance's failure names the prefill instance (CULPRIT_METADATA in the
    call's trailing metadata) when it is the prefill instance's doing, and no one when it
    is its own: the router's retry avoids whom it names (tests/test_router_prefill_decode)."""
    if cluster.arch != "qwen2_5_vl":
        pytest.skip("one architecture shows it")
    # a prefill instance that is not there: the Prefill stream breaks at once
    gone = f"127.0.0.1:{free_port()}"
    answer = cluster.call(cluster.answer(text_chat(), GREEDY, prefill=gone))
    assert answer.messages[-1].finish_reason == common_pb2.FINISH_REASON_ERROR
    assert answer.messages[-1].error.code == "UNAVAILABLE", answer.messages[-1].error
    assert answer.culprit == gone
    # a prompt over this decode instance's KV inbox (32 slots of 16 tokens): its own
    # capacity, refused when the prefill instance says the prompt's length
    long = [Message("user", ("Count from one to ten, slowly, and say why. " * 60,))]
    answer = cluster.call(cluster.answer(long, GREEDY))
    assert answer.messages[-1].error.code == "RESOURCE_EXHAUSTED", answer.messages[-1].error
    assert "--kv-staging-pages" in answer.messages[-1].error.message
    assert answer.culprit == ""
    # a success names no one
    assert cluster.call(cluster.answer(text_chat(), GREEDY)).culprit == ""
    assert_idle(cluster)


def test_a_prefill_stream_cut_while_its_first_token_is_sampled_frees_the_held_pages(
        cluster, monkeypatch):
    """The decode side goes away (its call cancelled) while the prefill instance's engine
    is finishing the request as handed off: the prefill side's call ends (abort, unpin)
    before the engine has moved the prompt's pages to the room's hold, and the abort comes
    too late. The hold is released all the same (a SIGSTOP of a prefill instance, thawed,
    left 3 pages held this way)."""
    if cluster.arch != "qwen2_5_vl":
        pytest.skip("one architecture shows it")
    from tandem.services.language.engine.prefix_cache import PrefixCache
    from tandem.services.language.engine.request import RequestStatus
    from tandem.services.language.engine.scheduler import Scheduler

    reached, release = threading.Event(), threading.Event()
    held_at: list = []  # the prefill instance's page pool, once its engine hands one off
    unpinned: list = []  # (pool, room) of every unpin
    finish, unpin = Scheduler.finish, PrefixCache.unpin

    def finish_held_back(self, req, status):  # the engine thread
        if status is RequestStatus.FINISHED_HANDED_OFF and not reached.is_set():
            held_at.append(self.pool)
            reached.set()
            release.wait(HANG_GUARD_S)
        finish(self, req, status)

    def recorded(self, room):
        unpinned.append((self, room))
        unpin(self, room)

    monkeypatch.setattr(Scheduler, "finish", finish_held_back)
    monkeypatch.setattr(PrefixCache, "unpin", recorded)
    room = secrets.randbits(62)
    req = language_pb2.LanguageGenerateRequest(
        room=room, sampling=GREEDY, messages=to_proto(text_chat()),
        prefill_address=cluster.address("prefill"))
    calls = {}

    async def start():
        calls["generate"] = cluster.stubs["decode"].Generate(req)
        calls["read"] = asyncio.ensure_future(calls["generate"].read())

    async def cancel():
        calls["generate"].cancel()
        await asyncio.gather(calls["read"], return_exceptions=True)

    try:
        cluster.call(start())
        wait_until(reached.is_set, timeout_s=HANG_GUARD_S,
                   what="the prefill instance finishing the request as handed off")
        cluster.call(cancel())
        wait_until(lambda: any(pool is held_at[0] and r == room for pool, r in unpinned),
                   timeout_s=HANG_GUARD_S, what="the prefill side's call ended (its unpin)")
    finally:
        release.set()
    assert_idle(cluster)


def test_a_decode_instance_lost_after_the_first_token_leaves_the_prompt_on_the_prefill_side(
        cluster):
    """Issue 39, point 5: the decode instance goes away while the prefill instance writes
    its pages (its call cut once the first token is out). The prefill instance keeps the
    prompt's pages in its prefix cache, so the router's retry, which keeps the prefill
    instance when the decode side failed (tests/test_router_prefill_decode), gets them back
    computed: every whole page of the prompt is cached there and sent again, not run
    again, and the answer equals the `both` instance's."""
    if cluster.arch != "qwen2_5_vl":
        pytest.skip("one architecture shows it")
    chat = [Message("user", (f"Lost decode {secrets.randbits(32)}: say something long, "
                             "about rivers and the sea and what lies between them.",))]
    req = language_pb2.LanguageGenerateRequest(
        room=secrets.randbits(62), sampling=GREEDY, messages=to_proto(chat),
        prefill_address=cluster.address("prefill"))

    async def cut_after_first():
        call = cluster.stubs["decode"].Generate(req)
        first = await call.read()
        call.cancel()
        return first

    first = cluster.call(cut_after_first())
    assert len(first.token_ids) == 1 and first.usage.prompt_tokens > 2 * 16, first
    assert_idle(cluster)  # every page of both sides back (P's: idle in its prefix cache)
    retry = cluster.call(cluster.generate(chat, GREEDY))  # the retry: same P, a decode side
    prompt = retry[-1].usage.prompt_tokens
    assert retry[-1].usage.cached_tokens == (prompt - 1) // 16 * 16, retry[-1].usage
    assert tokens_of(retry) == tokens_of(cluster.call(cluster.generate(chat, GREEDY,
                                                                       on="both")))
    assert tokens_of(retry)[0] == first.token_ids[0]
    assert_idle(cluster)
