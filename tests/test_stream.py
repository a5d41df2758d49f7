"""Streamed rows end to end (issue 27, docs/architecture.md, "Streamed rows"): a real encoder service and
a real language service (their `run()`s, in this process so the test can hold a ViT input
back and read the engine's chunks), driven as the router drives them: Generate(room,
encoder) on the language side and Encode(room, chat) on the encoder, concurrently.

- Greedy outputs equal transformers `generate()` for Qwen2.5-VL, Qwen3-VL (deepstack) and
  Qwen3-VL-MoE, three chats at once, each with three images, with a 16-token prefill budget
  and 16-token blocks (chunk boundaries inside image spans and at their edges) and a
  64-token reservation (every prompt resumes mid-stream); the engine's chunks never pass
  the rows that had arrived, and every page, block and room is free afterwards.
- Overlap, shown by causality, not timing: the last image's ViT input is held back; the
  language engine's `early_prefill_tokens` counter (moved after a forward over rows of a
  prompt whose later rows had not arrived) rises while it is held, and only then is it let
  go. Without streaming the counter never moves and the hang guard fails the test.
- Each answer's StageTimings carry the request's own figures: `early_prefill_tokens` (the
  engine counter's share of that request: the counter moves by exactly their sum) and
  `time_to_first_row_ms` (the time_to_first_row histogram's observation: its sum moves by
  exactly theirs).
- `--no-transfer.stream` on the language side alone: the prompt is taken whole (no
  early prefill, 0 in its timings), with the same tokens.

No test here bounds a duration: every wait is a hang guard (tests/waiting.py).
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest
from inproc import HANG_GUARD_S, Services
from language_oracle import generate, load
from waiting import wait_until

sys.path.insert(0, str(Path(__file__).parent))
from encoder_peers.chats import hf_messages, png, to_proto  # noqa: E402

from tandem.chat import ImageInput, Message  # noqa: E402
from tandem.launch.procs import free_port  # noqa: E402
from tandem.v1 import (  # noqa: E402
    common_pb2,
    encoder_pb2,
    encoder_pb2_grpc,
    language_pb2,
    language_pb2_grpc,
)

pytestmark = pytest.mark.timeout(300)
MAX_NEW = 6
SIZES = [(64, 48), (40, 150), (120, 90)]  # distinct grids: the last one can be held back


def three_image_chat(seed: int) -> list[Message]:
    parts: list = [f"Compare these, case {seed}:"]
    for k, (w, h) in enumerate(SIZES):
        parts += [ImageInput(data=png(w, h, seed * 10 + k)), f"and image {k}"]
    return [Message("system", ("You are terse.",)), Message("user", tuple(parts))]


class Gate:
    """Holds back ViT inputs of one grid until opened (patched into VisionRunner.run)."""

    def __init__(self) -> None:
        self.grids: set[tuple[int, int, int]] = set()
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.opened.set()

    def hold(self, grid) -> None:
        self.grids, self.entered = {tuple(grid)}, threading.Event()
        self.opened.clear()

    def wrap(self, run):
        gate = self

        def gated(runner, pixels, grids, **kw):
            if any(tuple(g) in gate.grids for g in grids):
                gate.entered.set()
                assert gate.opened.wait(HANG_GUARD_S), "the held ViT input was never let go"
            return run(runner, pixels, grids, **kw)

        return gated


class Pair:
    """An encoder and a language instance in one background event loop."""

    def __init__(self, ckpt: Path, stream_language: bool = True) -> None:
        from tandem.config import TransferConfig
        from tandem.services.encoder.config import EncoderConfig
        from tandem.services.language.config import LanguageConfig

        self.enc_cfg = EncoderConfig(
            model=str(ckpt), device="cpu", dtype="float32", port=free_port(),
            insecure_internal=True, linear_backend="torch",
            transfer=TransferConfig(timeout_s=20, stream=True))
        self.lang_metrics = free_port()
        self.lang_cfg = LanguageConfig(
            model=str(ckpt), device="cpu", dtype="float32", port=free_port(),
            insecure_internal=True, metrics_port=self.lang_metrics, kv_pages=256, kv_page_size=16,
            embedding_block_size=16, default_reservation_tokens=64, max_prefill_tokens=16,
            transfer=TransferConfig(timeout_s=20, stream=stream_language))
        self.services = Services()

    def start(self) -> Pair:
        from tandem.services.encoder.main import run as run_encoder
        from tandem.services.language.main import run as run_language

        self.services.start([lambda r, s: run_encoder(self.enc_cfg, r, s),
                             lambda r, s: run_language(self.lang_cfg, r, s)])

        async def channels():
            self.enc = encoder_pb2_grpc.EncoderStub(
                grpc.aio.insecure_channel(f"127.0.0.1:{self.enc_cfg.port}"))
            self.lang = language_pb2_grpc.LanguageStub(
                grpc.aio.insecure_channel(f"127.0.0.1:{self.lang_cfg.port}"))

        self.call(channels())
        return self

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.services.loop

    def call(self, coro):
        return self.services.call(coro)

    def stop(self) -> None:
        self.services.stop()

    async def generate(self, messages: list[Message]) -> tuple[list[int], common_pb2.StageTimings]:
        """The router's part: Generate and Encode on one room; the tokens, and the timings
        of the language side's last message."""
        room = secrets.randbits(62)
        sampling = common_pb2.SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
        stream = self.lang.Generate(language_pb2.LanguageGenerateRequest(
            room=room, encoder_address=f"127.0.0.1:{self.enc_cfg.port}", sampling=sampling))
        encode = asyncio.ensure_future(self.enc.Encode(encoder_pb2.EncodeRequest(
            room=room, messages=to_proto(messages))))
        tokens, timings = [], None
        async for msg in stream:
            assert not msg.HasField("error") or not msg.error.code, msg.error
            tokens += msg.token_ids
            timings = msg.timings
        await encode
        return tokens, timings

    def loads(self):
        async def get():
            return await self.lang.GetLoad(language_pb2.LanguageGetLoadRequest())

        return self.call(get())

    def overlap(self) -> tuple[float, float]:
        """The early prefill counter and the time-to-first-row histogram's sum (seconds)."""
        return (self.metric("tandem_language_early_prefill_tokens_total"),
                self.metric("tandem_language_time_to_first_row_seconds_sum"))

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.lang_metrics}/metrics").read()
        for line in text.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not exported")


def assert_idle(pair: Pair) -> None:
    def idle():
        r = pair.loads()
        return (r.free_kv_pages == r.total_kv_pages
                and r.free_embedding_blocks == r.total_embedding_blocks
                and r.transferring + r.waiting + r.running == 0)

    wait_until(idle, timeout_s=HANG_GUARD_S, what="every KV page and embedding block free")


@pytest.fixture(scope="module")
def patched():
    """Every scheduled chunk (room, start, tokens, rows arrived, prompt length, complete),
    and the ViT gate; patched at class level for the services in this process."""
    from tandem.services.encoder.vit.runner import VisionRunner
    from tandem.services.language.engine.scheduler import Scheduler

    chunks: list[tuple] = []
    gate = Gate()
    real_schedule = Scheduler.schedule

    def schedule(self):
        step = real_schedule(self)
        if step is not None:
            for c in step.chunks:
                p = c.req.prompt
                chunks.append((c.req.room, c.start, c.num_tokens, c.req.rows_end,
                               c.req.prompt_len, p.arrived is None or p.arrived.complete))
        return step

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Scheduler, "schedule", schedule)
        mp.setattr(VisionRunner, "run", gate.wrap(VisionRunner.run))
        yield chunks, gate


_oracles: dict = {}


def expected(ckpt: Path, messages: list[Message]) -> list[int]:
    key = (str(ckpt), repr(messages))
    if key not in _oracles:
        model, processor = load(ckpt)
        msgs, images = hf_messages(messages)
        text = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        inputs = dict(processor(text=[text], images=images or None, return_tensors="pt"))
        _oracles[key] = generate(model, inputs, MAX_NEW)[0]
    return _oracles[key]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_streamed_greedy_equals_generate_and_prefill_overlaps_the_vit(checkpoint, patched,
                                                                        arch):
    chunks, gate = patched
    ckpt = checkpoint(arch)
    chats = [three_image_chat(seed) for seed in (1, 2, 3)]
    want = [expected(ckpt, c) for c in chats]
    pair = Pair(ckpt).start()
    try:
        # 1. three at once: exact, with chunks ending only at arrived rows
        del chunks[:]
        early0, first_row0 = pair.overlap()

        async def all_three():
            return await asyncio.gather(*[pair.generate(c) for c in chats])

        got = pair.call(all_three())
        for (g, _), w in zip(got, want, strict=True):
            assert g and g == w
        prompt = [c for c in chunks if c[1] < c[4]]
        assert all(start + n <= rows for _, start, n, rows, _, _ in prompt)
        assert any(not complete for *_, complete in prompt)  # prefill before the last row
        # each request's own share of the counter and of the histogram
        early1, first_row1 = pair.overlap()
        timings = [t for _, t in got]
        assert sum(t.early_prefill_tokens for t in timings) == early1 - early0
        assert all(t.time_to_first_row_ms > 0 and not t.encoder_bypassed for t in timings)
        assert sum(t.time_to_first_row_ms for t in timings) / 1e3 == pytest.approx(
            first_row1 - first_row0, rel=1e-9)
        assert_idle(pair)

        # 2. the last image held back in the ViT: the first rows are prefilled meanwhile
        chat = three_image_chat(7)
        w = expected(ckpt, chat)
        model_grid = grid_of(pair.enc_cfg.model, chat, index=2)
        gate.hold(model_grid)
        before = pair.metric("tandem_language_early_prefill_tokens_total")
        fut = asyncio.run_coroutine_threadsafe(pair.generate(chat), pair.loop)
        wait_until(lambda: pair.metric("tandem_language_early_prefill_tokens_total"),
                   until=lambda v: v > before, timeout_s=HANG_GUARD_S,
                   what="a prefill of the first rows while the last image is held")
        assert not fut.done()  # its last image has not been through the ViT
        gate.opened.set()
        g, t = fut.result(HANG_GUARD_S)
        assert gate.entered.is_set() and g == w
        # the prefill that ran while the image was held is this request's (alone in flight)
        early1, _ = pair.overlap()
        assert t.early_prefill_tokens == early1 - before > 0
        assert pair.metric("tandem_language_streamed_prompts_total") >= 4
        assert_idle(pair)
    finally:
        gate.opened.set()
        pair.stop()


def grid_of(model: str, chat: list[Message], index: int) -> tuple[int, int, int]:
    """The ViT grid of image `index` of `chat`, as the encoder's preprocessor makes it."""
    from transformers import AutoProcessor

    import tandem  # noqa: F401

    processor = AutoProcessor.from_pretrained(model)
    _, images = hf_messages(chat)
    out = processor.image_processor(images=[images[index]], return_tensors="pt")
    return tuple(int(x) for x in out["image_grid_thw"][0])


def test_language_side_off_takes_the_prompt_whole(checkpoint, patched):
    chunks, _ = patched
    ckpt = checkpoint("qwen2_5_vl")
    chat = three_image_chat(5)
    pair = Pair(ckpt, stream_language=False).start()
    try:
        del chunks[:]
        got, t = pair.call(pair.generate(chat))
        assert got == expected(ckpt, chat)
        assert chunks and all(complete for *_, complete in chunks)
        assert pair.metric("tandem_language_early_prefill_tokens_total") == 0
        assert t.early_prefill_tokens == 0
        # the whole prompt's arrival: the histogram's one observation
        assert t.time_to_first_row_ms > 0
        assert t.time_to_first_row_ms / 1e3 == pytest.approx(
            pair.metric("tandem_language_time_to_first_row_seconds_sum"), rel=1e-9)
        assert pair.metric("tandem_language_streamed_prompts_total") == 0
        assert_idle(pair)
    finally:
        pair.stop()
