"""One prompt split across encoders (issue 27 step 3, services/encoder/split.py): real
encoder and language services (a lead encoder and the language instance in this process,
so the test can hold a ViT input back and read the engine's chunks; the helper encoder in
this process too, or a real `tandem encoder` process to kill or freeze), driven as the
router drives them: Generate(room, lead) on the language side, Encode(room, chat,
helpers=[helper]) on the lead.

- Greedy outputs equal transformers `generate()` for Qwen2.5-VL, Qwen3-VL (deepstack) and
  Qwen3-VL-MoE, three chats at once, each with four images split over the two encoders,
  with 16-token blocks and prefill chunks (boundaries inside image spans and at their
  edges) and a 64-token reservation (ranges resume mid-way); each response names both
  writers; every page, block and room is free afterwards.
- Both encoders run their ViT at once, shown by causality, not timing: the lead's last
  image is held back in the ViT until the helper's image has been through it.
- The helper process is killed (SIGKILL) mid-prompt: the lead re-encodes its range
  (`fell_back`), the answer is still exact, nothing leaks.
- The helper process is frozen (SIGSTOP) before the chat: silent for the transfer timeout
  with no write of its outstanding, it is lost and the lead re-encodes its range, not at
  the request's deadline; every block is free. (Silent mid-write, the room fails:
  tests/test_split_faults.py.)
- A helper whose transfer protection is stricter than the lead's refuses its RangeWrite
  before any row went out: lost, the lead re-encodes it.

No test here bounds a duration: every wait is a hang guard (tests/waiting.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from waiting import wait_until

sys.path.insert(0, str(Path(__file__).parent))
from encoder_peers.chats import png, to_proto  # noqa: E402
from inproc import Services  # noqa: E402
from test_stream import HANG_GUARD_S, MAX_NEW, Gate, expected, grid_of  # noqa: E402

from tandem.chat import ImageInput, Message  # noqa: E402
from tandem.launch.procs import free_port  # noqa: E402
from tandem.v1 import (  # noqa: E402
    common_pb2,
    encoder_pb2,
    encoder_pb2_grpc,
    language_pb2,
    language_pb2_grpc,
)

pytestmark = pytest.mark.timeout(420)
SIZES = [(64, 48), (40, 150), (120, 90), (56, 84)]  # distinct grids: each can be held back
TRANSFER_TIMEOUT_S = 20


def four_image_chat(seed: int) -> list[Message]:
    parts: list = [f"Compare these, case {seed}:"]
    for k, (w, h) in enumerate(SIZES):
        parts += [ImageInput(data=png(w, h, seed * 10 + k)), f"and image {k}"]
    return [Message("system", ("You are terse.",)), Message("user", tuple(parts))]


class Trio:
    """A lead encoder, a language instance and (unless `external`) a helper encoder, in
    one background event loop; each service stops on its own event."""

    def __init__(self, ckpt: Path, external_helper: bool = False, stream: bool = True,
                 timeout_s: float = TRANSFER_TIMEOUT_S, protect: str = "none") -> None:
        from tandem.config import TransferConfig
        from tandem.services.encoder.config import EncoderConfig
        from tandem.services.language.config import LanguageConfig

        def encoder() -> EncoderConfig:
            return EncoderConfig(
                model=str(ckpt), device="cpu", dtype="float32", port=free_port(),
                metrics_port=free_port(), insecure_internal=True, linear_backend="torch",
                drain_timeout_s=1,
                transfer=TransferConfig(timeout_s=timeout_s, stream=stream, protect=protect))

        self.ckpt, self.timeout_s = ckpt, timeout_s
        self.lead_cfg = encoder()
        self.helper_cfg = None if external_helper else encoder()
        self.helper_port = free_port() if external_helper else self.helper_cfg.port
        self.helper_proc: subprocess.Popen | None = None
        self.lang_metrics = free_port()
        self.lang_cfg = LanguageConfig(
            model=str(ckpt), device="cpu", dtype="float32", port=free_port(),
            insecure_internal=True, metrics_port=self.lang_metrics, kv_pages=256, kv_page_size=16,
            embedding_block_size=16, default_reservation_tokens=64, max_prefill_tokens=16,
            transfer=TransferConfig(timeout_s=timeout_s, stream=stream, protect=protect))
        self.services = Services()

    def signal_helper(self, sig: int) -> None:
        """`sig` to the helper process and every process it forked (some start sessions
        of their own, so a process group would not reach them)."""
        tree, grew = {self.helper_proc.pid}, True
        while grew:
            grew = False
            for d in Path("/proc").iterdir():
                if d.name.isdigit() and int(d.name) not in tree:
                    with contextlib.suppress(OSError, IndexError, ValueError):
                        if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) in tree:
                            tree.add(int(d.name))
                            grew = True
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    @property
    def helper(self) -> str:
        return f"127.0.0.1:{self.helper_port}"

    def start(self) -> Trio:
        from tandem.services.encoder.main import run as run_encoder
        from tandem.services.language.main import run as run_language

        if self.helper_cfg is None:  # a real process, to kill or freeze
            self.helper_proc = subprocess.Popen(
                [sys.executable, "-m", "tandem.cli", "encoder", "--model", str(self.ckpt),
                 "--device", "cpu", "--dtype", "float32", "--port", str(self.helper_port),
                 "--insecure-internal", "--linear-backend", "torch",
                 "--transfer.timeout-s", str(self.timeout_s),
                 # the lead's transfer settings (a helper refuses a room protected less
                 # than its own minimum)
                 "--transfer.protect", self.lead_cfg.transfer.protect,
                 "--transfer.stream" if self.lead_cfg.transfer.stream
                 else "--no-transfer.stream"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cfgs = [(run_encoder, self.lead_cfg), (run_language, self.lang_cfg)]
        if self.helper_cfg is not None:
            cfgs.append((run_encoder, self.helper_cfg))
        self.services.start([lambda r, s, run=run, cfg=cfg: run(cfg, r, s)
                             for run, cfg in cfgs])

        async def boot():
            self.enc = encoder_pb2_grpc.EncoderStub(
                grpc.aio.insecure_channel(f"127.0.0.1:{self.lead_cfg.port}"))
            self.lang = language_pb2_grpc.LanguageStub(
                grpc.aio.insecure_channel(f"127.0.0.1:{self.lang_cfg.port}"))
            if self.helper_proc is not None:  # wait for the process's gRPC server
                ch = grpc.aio.insecure_channel(self.helper)
                await asyncio.wait_for(ch.channel_ready(), HANG_GUARD_S)
                await ch.close()

        self.call(boot())
        return self

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.services.loop

    def call(self, coro):
        return self.services.call(coro, HANG_GUARD_S + 120)

    def stop(self) -> None:
        if self.helper_proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.signal_helper(signal.SIGCONT)
                self.signal_helper(signal.SIGKILL)
            self.helper_proc.wait(30)
        self.services.stop()

    async def generate(self, messages: list[Message],
                       helpers: list[str] | None = None) -> tuple[list[int], object]:
        """The router's part: Generate and Encode (with the helper, unless `helpers`) on one
        room; the tokens and the EncodeResponse (or the Encode's error)."""
        room = secrets.randbits(62)
        sampling = common_pb2.SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
        stream = self.lang.Generate(language_pb2.LanguageGenerateRequest(
            room=room, encoder_address=f"127.0.0.1:{self.lead_cfg.port}", sampling=sampling))
        encode = asyncio.ensure_future(self.enc.Encode(encoder_pb2.EncodeRequest(
            room=room, messages=chat_proto(messages),
            helpers=[self.helper] if helpers is None else helpers)))
        tokens, error = [], None
        try:
            async for msg in stream:
                if msg.HasField("error") and msg.error.code:
                    error = msg.error
                    break
                tokens += msg.token_ids
        except grpc.aio.AioRpcError as e:
            error = e
        self.language_error = error
        try:
            return tokens, await encode
        except grpc.aio.AioRpcError as e:
            return tokens, e

    def loads(self):
        async def get():
            return await self.lang.GetLoad(language_pb2.LanguageGetLoadRequest())

        return self.call(get())

    def helper_load(self):
        async def get():
            async with grpc.aio.insecure_channel(self.helper) as ch:
                return await encoder_pb2_grpc.EncoderStub(ch).GetLoad(
                    encoder_pb2.EncoderGetLoadRequest())

        return self.call(get())


def chat_proto(messages: list[Message]):
    """encoder_peers.chats.to_proto (videos included)."""
    return to_proto(messages)


def assert_idle(trio: Trio) -> None:
    def idle():
        r = trio.loads()
        return (r.free_kv_pages == r.total_kv_pages
                and r.free_embedding_blocks == r.total_embedding_blocks
                and r.transferring + r.waiting + r.running == 0)

    wait_until(idle, timeout_s=HANG_GUARD_S, what="every KV page and embedding block free")


def assert_fell_back(trio: Trio, ckpt: Path, chat: list[Message], tokens: list[int],
                     res) -> None:
    """The chat answered exactly, the helper's range re-encoded by the lead."""
    assert isinstance(res, encoder_pb2.EncodeResponse), (res, trio.language_error)
    assert tokens == expected(ckpt, chat)
    assert [(r.encoder, r.fell_back) for r in res.ranges] == [("", False), (trio.helper, True)]


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


@pytest.fixture(scope="module")
def gate():
    """The ViT gate (test_stream.Gate), and `gate.seen`: every grid the ViTs of this
    process have finished."""
    from tandem.services.encoder.vit.runner import VisionRunner

    g = Gate()
    g.seen = set()
    held = g.wrap(VisionRunner.run)

    def run(runner, pixels, grids, **kw):
        out = held(runner, pixels, grids, **kw)
        g.seen.update(tuple(int(x) for x in gr) for gr in grids)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VisionRunner, "run", run)
        yield g


def _grid(ckpt: Path, chat: list[Message], index: int) -> tuple[int, int, int]:
    return grid_of(str(ckpt), chat, index)


@pytest.mark.parametrize(("arch", "stream", "protect"), [
    ("qwen2_5_vl", True, "none"), ("qwen3_vl", True, "none"), ("qwen3_vl_moe", True, "none"),
    ("qwen2_5_vl", False, "encrypt")])
def test_split_greedy_equals_generate(checkpoint, gate, arch, stream, protect):
    """(`encrypt`: the helper's rows travel encrypted under the attempt's keys, and carry
    its tags, which the language side verifies as the lead's.)"""
    ckpt = checkpoint(arch)
    chats = [four_image_chat(seed) for seed in (1, 2, 3)]
    want = [expected(ckpt, c) for c in chats]
    trio = Trio(ckpt, stream=stream, protect=protect).start()
    try:
        async def all_three():
            return await asyncio.gather(*[trio.generate(c) for c in chats])

        for (tokens, res), w in zip(trio.call(all_three()), want, strict=True):
            assert isinstance(res, encoder_pb2.EncodeResponse), (res, trio.language_error)
            assert tokens == w
            writers = [r.encoder for r in res.ranges]
            assert writers == ["", trio.helper], res.ranges  # the lead, then the helper
            assert not any(r.fell_back for r in res.ranges)
            assert sum(r.tokens for r in res.ranges) == res.prompt_tokens - res.cached_prompt_tokens
            # each writer ran its own media (fresh images: no cache hit anywhere) and
            # prepared it
            assert all(r.vit_ms > 0 and r.cached_image_tokens == 0 and r.preprocess_ms > 0
                       for r in res.ranges)
        assert_idle(trio)

        # both ViTs at once: the lead's first image is held until the helper's last image
        # (always the helper's: the lead keeps the first share) has been through the ViT
        chat = four_image_chat(9)
        gate.hold(_grid(ckpt, chat, 0))
        fut = asyncio.run_coroutine_threadsafe(trio.generate(chat), trio.loop)
        wait_until(lambda: gate.entered.is_set(), timeout_s=HANG_GUARD_S,
                   what="the lead's image 0 in the ViT")
        last = _grid(ckpt, chat, 3)
        wait_until(lambda: last in gate.seen, timeout_s=HANG_GUARD_S,
                   what="the helper's image 3 through the ViT while the lead's is held")
        assert not fut.done()
        gate.opened.set()
        tokens, res = fut.result(HANG_GUARD_S)
        assert tokens == expected(ckpt, chat) and [r.encoder for r in res.ranges][1] == trio.helper
        assert_idle(trio)
    finally:
        gate.opened.set()
        trio.stop()


def test_a_helpers_cache_hits_are_the_answers(checkpoint):
    """A chat whose helper-share images the helper encoded before (its share of an earlier
    chat with the same sizes) and the lead never did: the lead misses them all, so it plans
    the same split, and they are the helper's cache hits: counted in the answer's
    cached_image_tokens and in the helper's range."""
    ckpt = checkpoint("qwen2_5_vl")
    first = four_image_chat(31)
    trio = Trio(ckpt).start()
    try:
        _, res = trio.call(trio.generate(first))
        lead, helper = res.ranges
        assert helper.encoder == trio.helper and not res.cached_image_tokens
        share = range(helper.first_media, helper.first_media + helper.media)
        user = list(first[1].parts)
        for k in range(len(SIZES)):  # the lead's images new, the helper's as before
            if k not in share:
                w, h = SIZES[k]
                user[1 + 2 * k] = ImageInput(data=png(w, h, 3200 + k))
        user[0] = "Now compare these:"
        second = [first[0], Message("user", tuple(user))]
        helper_tokens = sum(math.prod(_grid(ckpt, first, k)) // 4 for k in share)
        tokens, res = trio.call(trio.generate(second))
        assert tokens == expected(ckpt, second)
        lead, helper = res.ranges
        assert (helper.encoder, helper.cached_image_tokens, lead.cached_image_tokens) == (
            trio.helper, helper_tokens, 0), res.ranges
        assert res.cached_image_tokens == helper_tokens and lead.vit_ms > 0
        assert_idle(trio)
    finally:
        trio.stop()


def test_helper_killed_mid_prompt_its_range_is_re_encoded(checkpoint, gate, monkeypatch):
    from tandem.services.encoder.split import HelperRange

    ckpt = checkpoint("qwen2_5_vl")
    chats = [four_image_chat(seed) for seed in (4, 5, 8)]  # image 0 of each: one grid
    want = [expected(ckpt, c) for c in chats]
    # each HelperRange's end, once its reader has seen it: the gate opens only then, so
    # the lead reaches each helper piece knowing the helper is gone (a RangeWrite sent
    # before the lead's reader saw the reset is one that may be in flight: the room fails,
    # by the rule in split.py's docstring, which test_split_faults.py covers)
    ended: list[Exception] = []
    read_all = HelperRange._read_all

    async def recorded(self) -> None:
        await read_all(self)
        ended.append(self.ended)

    monkeypatch.setattr(HelperRange, "_read_all", recorded)
    trio = Trio(ckpt, external_helper=True).start()
    try:
        # three chats at once; the lead's image 0 is held in its ViT while the helper
        # process is killed: every prompt is in flight on both encoders
        gate.hold(_grid(ckpt, chats[0], 0))

        async def all_three():
            return await asyncio.gather(*[trio.generate(c) for c in chats])

        fut = asyncio.run_coroutine_threadsafe(all_three(), trio.loop)
        wait_until(lambda: gate.entered.is_set(), timeout_s=HANG_GUARD_S,
                   what="the lead's image 0 in the ViT")
        wait_until(trio.helper_load, until=lambda r: r.queued_requests >= 3,
                   timeout_s=HANG_GUARD_S, what="the helper working on every chat's range")
        trio.signal_helper(signal.SIGKILL)
        trio.helper_proc.wait(30)
        wait_until(lambda: len(ended) >= len(chats), timeout_s=HANG_GUARD_S,
                   what="the lead seeing every helper stream end")
        gate.opened.set()
        for (tokens, res), w in zip(fut.result(HANG_GUARD_S), want, strict=True):
            assert isinstance(res, encoder_pb2.EncodeResponse), res
            assert tokens == w
            assert [r.encoder for r in res.ranges] == ["", trio.helper]
            assert res.ranges[1].fell_back
        assert metric(trio.lead_cfg.metrics_port, "tandem_transfer_range_fallbacks_total") >= 1
        assert_idle(trio)
    finally:
        gate.opened.set()
        trio.stop()


def test_a_frozen_helper_is_lost_after_the_transfer_timeout_and_its_range_re_encoded(
        checkpoint):
    """A helper process frozen (SIGSTOP) before the chat reaches it: silent for the
    transfer timeout before its Ready, so it holds no destination and nothing of it can
    land; the lead re-encodes its range and the chat is answered exactly. (Silent while a
    write is outstanding, it fails the room instead: tests/test_split_faults.py.) Thawed,
    the helper writes its ranges again."""
    ckpt = checkpoint("qwen2_5_vl")
    chat = four_image_chat(6)
    trio = Trio(ckpt, external_helper=True, timeout_s=3).start()
    try:
        trio.signal_helper(signal.SIGSTOP)
        tokens, res = trio.call(trio.generate(chat))
        assert_fell_back(trio, ckpt, chat, tokens, res)
        assert_idle(trio)
        trio.signal_helper(signal.SIGCONT)
        chat = four_image_chat(7)
        tokens, res = trio.call(trio.generate(chat))
        assert tokens == expected(ckpt, chat), trio.language_error
        assert [(r.encoder, r.fell_back) for r in res.ranges] == [("", False),
                                                                  (trio.helper, False)]
        assert_idle(trio)
    finally:
        trio.signal_helper(signal.SIGCONT)
        trio.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_one_video_split_by_temporal_groups(checkpoint, gate, tmp_path, stream):
    """An image and a video of several temporal groups: the helper's range starts inside
    the video (a group's first pad), both encoders run part of it, and the answer is the
    one the lead gives alone (which tests/test_video_payload.py proves transformers')."""
    from video_chats import Image, Video, VideoChat, write_clips

    ckpt = checkpoint("qwen2_5_vl")
    clips, _ = write_clips(tmp_path)
    chat = VideoChat(("Compare", Image(3, (64, 48)), "with", Video("avi"), "please."))
    messages = chat.messages(clips)
    trio = Trio(ckpt, stream=stream).start()
    try:
        # split first (the lead's embedding cache would otherwise hold it all: no split)
        tokens, res = trio.call(trio.generate(messages))
        assert isinstance(res, encoder_pb2.EncodeResponse), res
        lead, helper = res.ranges
        alone, res1 = trio.call(trio.generate(messages, helpers=[]))
        assert isinstance(res1, encoder_pb2.EncodeResponse) and len(res1.ranges) == 1
        assert tokens == alone and tokens
        assert helper.encoder == trio.helper
        # the video (medium 1) is in both shares: its groups are split
        assert lead.first_media + lead.media - 1 == 1 == helper.first_media
        assert_idle(trio)
    finally:
        trio.stop()


def test_a_helper_stricter_than_the_room_is_lost_not_the_rooms_failure(checkpoint):
    """The helper requires `encrypt`, the room is `none`: it refuses its RangeWrite before
    any row goes out (AttachFailed.nothing_in_flight), so the lead re-encodes its range
    and the chat is answered (the room failed FAILED_PRECONDITION before, a code the
    router retries at no level)."""
    from tandem.config import TransferConfig

    ckpt = checkpoint("qwen2_5_vl")
    chat = four_image_chat(77)
    trio = Trio(ckpt)
    t = trio.helper_cfg.transfer
    trio.helper_cfg = trio.helper_cfg.model_copy(update={"transfer": TransferConfig(
        timeout_s=t.timeout_s, stream=t.stream, protect="encrypt")})
    trio.start()
    try:
        tokens, res = trio.call(trio.generate(chat))
        assert_fell_back(trio, ckpt, chat, tokens, res)
        assert_idle(trio)
    finally:
        trio.stop()


def test_cache_hits_are_counted_once_by_the_writer_whose_unit_it_is(checkpoint):
    """Image A, encoded by the lead in the first chat, closes the next two chats: the lead
    has it cached (weight 0), so it joins the helper's share; the helper runs it the first
    time and hits the second. Each writer counts the hits of its own units alone, so the
    answer's cached_image_tokens is A's tokens once where the helper hit it, and nothing
    where only the lead had it (before: the lead counted it as well, over the whole
    prompt)."""

    def chat(images, text):
        parts: list = [text]
        for k, im in enumerate(images):
            parts += [ImageInput(data=im), f"and image {k}"]
        return [Message("system", ("You are terse.",)), Message("user", tuple(parts))]

    ckpt = checkpoint("qwen2_5_vl")
    a = png(*SIZES[0], 500)
    chats = [chat([a] + [png(*SIZES[k], 500 + k) for k in (1, 2, 3)], "one")]
    chats += [chat([png(*SIZES[k], n + k) for k in (1, 2, 3)] + [a], text)
              for n, text in ((600, "two"), (700, "three"))]
    a_tokens = math.prod(_grid(ckpt, chats[0], 0)) // 4
    trio = Trio(ckpt).start()
    try:
        got = []
        for c in chats:
            tokens, res = trio.call(trio.generate(c))
            assert tokens == expected(ckpt, c)
            got.append((res.cached_image_tokens,
                        [(r.encoder, r.cached_image_tokens) for r in res.ranges]))
        assert got == [(0, [("", 0), (trio.helper, 0)]),
                       (0, [("", 0), (trio.helper, 0)]),
                       (a_tokens, [("", 0), (trio.helper, a_tokens)])]
        assert_idle(trio)
    finally:
        trio.stop()
