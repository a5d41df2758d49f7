"""A hung ViT is a stalled writer (issue 27: "a stalled writer fails its room within the
progress timeout and the request is retried"): heartbeats say the work progresses, not
only that the process lives (services/encoder/scheduler.py's stall watch,
EmbeddingSender.vouch).

- The stall watch: a runner reports progress after each of its tower's blocks (and a
  replay); the scheduler counts a device whose ViT call goes `stall_s` without any as
  stalled (on a clock of the test's: per block, not per call), and stops when the call
  ends; a stop does not wait for a stalled call (its device thread is a daemon).
- The transfer layer: an encoder that no longer vouches for its work sends no heartbeat
  for a room it prepares, so the room fails at the transfer timeout (UNAVAILABLE, the
  router's retry), not at the request's deadline; a stall shorter than the timeout keeps
  the room (the vouch is asked at every beat).
- A helper's ViT hangs before its Ready (services/encoder/split.py): its EncodeRange
  stream carries no more heartbeats, the lead takes it for lost after the transfer
  timeout and re-encodes its range, and the chat is answered exactly.
- End to end, over real services and a real router: the first ViT call in this process
  hangs (its thread blocked, the encoder's event loop alive and answering). The request
  is retried on the other encoder and answers exactly, before its deadline; meanwhile the
  hung encoder answers health checks NOT_SERVING, refuses a new Encode UNAVAILABLE, says
  `vit_stalled` in its load reports (the router picks it neither as lead nor as helper)
  and shows the stall in `tandem_encoder_vit_stall_seconds`; once the call ends it is back in
  service, and every page and block is free. Before, its heartbeats held the room (and
  the request) until the request's deadline.

No test here bounds a duration: every wait is a hang guard (tests/waiting.py).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "transfer_peers"))
from encoder_peers.chats import png  # noqa: E402
from harness import make_engine, make_receiver, release_all, start_sender  # noqa: E402
from peerlib import digest, make_payload  # noqa: E402
from test_split import metric  # noqa: E402
from test_stream import HANG_GUARD_S, MAX_NEW, expected  # noqa: E402
from waiting import async_wait_until, wait_until  # noqa: E402

from tandem.chat import ImageInput, Message  # noqa: E402
from tandem.client import Client, image_from_bytes  # noqa: E402
from tandem.launch.procs import free_port  # noqa: E402
from tandem.transfer import ReceiverState, TransferError  # noqa: E402
from tandem.v1 import encoder_pb2, encoder_pb2_grpc, language_pb2, language_pb2_grpc  # noqa: E402

pytestmark = pytest.mark.timeout(300)
STALL_S = 2.0  # the encoders' vit_stall_s
TRANSFER_TIMEOUT_S = 3.0  # every tier's transfer timeout (heartbeats every second)


class HangFirst:
    """The first ViT call in this process (of an input of `grid`, if given) blocks (its
    device thread, as a wedged kernel would) until `released`; every later call runs."""

    def __init__(self, grid: tuple[int, int, int] | None = None) -> None:
        self.grid = grid
        self.entered, self.released = threading.Event(), threading.Event()
        self._taken, self._lock = False, threading.Lock()

    def wrap(self, run):
        hang = self

        def gated(runner, pixels, grids, **kw):
            with hang._lock:
                mine = hang.grid is None or hang.grid in map(tuple, grids)
                first = mine and not hang._taken
                hang._taken = hang._taken or mine
            if first:
                hang.entered.set()
                assert hang.released.wait(HANG_GUARD_S), "the hung ViT call was never let go"
            return run(runner, pixels, grids, **kw)

        return gated


# ---- the stall watch ------------------------------------------------------------------------

def test_a_runner_reports_progress_per_block(checkpoint):
    """Eager: one report per block. Static (what a CUDA graph records, run on the CPU):
    one per block of the step, and one when the replay returns (on CUDA a replay runs no
    host code: that one alone)."""
    from tandem.services.encoder.vit.runner import VisionRunner

    runner, image, blocks = _tower(checkpoint)
    static = VisionRunner(runner.visual, max_patches=1024, mode="static")
    for r, want in ((runner, blocks), (static, blocks + 1)):
        ticks = []
        r.run(image.pixel_values, [image.grid], on_progress=lambda ticks=ticks: ticks.append(1))
        assert len(ticks) == want, r.mode


def test_the_stall_watch_follows_progress_and_ends_with_the_call(checkpoint):
    from tandem.services.encoder.cache import EmbeddingCache
    from tandem.services.encoder.scheduler import EncoderScheduler
    from tandem.services.encoder.vit.runner import VisionRunner

    runner, image, _ = _tower(checkpoint)

    hang = HangFirst()
    sched = EncoderScheduler([runner], EmbeddingCache(0), 1 << 20, stall_s=STALL_S)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VisionRunner, "run", hang.wrap(VisionRunner.run))

        async def go():
            sched.start()
            try:
                assert not sched.stalled() and sched.stalled_s() == 0.0  # idle
                job = asyncio.ensure_future(sched.encode([image]))
                await async_wait_until(sched.stalled, timeout_s=HANG_GUARD_S,
                                       what="the hung call seen as stalled")
                hang.released.set()
                got = await asyncio.wait_for(job, HANG_GUARD_S)
                assert got.features[0].embeds.shape[0] == image.num_tokens
                assert not sched.stalled() and sched.stalled_s() == 0.0  # the call ended
            finally:
                hang.released.set()
                await sched.stop()

        asyncio.run(go())


def _tower(checkpoint):
    import torch

    from tandem.models.split import load_vision_part
    from tandem.services.encoder.vit.runner import VisionRunner

    part = load_vision_part(checkpoint("qwen2_5_vl"), torch.float32, "cpu")
    runner = VisionRunner(part.visual, mode="eager")
    grid = (1, 2 * runner.merge, 2 * runner.merge)
    return runner, _Input(_pixels(part.visual, grid), grid, runner.unit), len(part.visual.blocks)


@pytest.mark.parametrize(("block_s", "stalled"), [(0.9, False), (1.1, True)])
def test_progress_is_per_block_not_per_call(checkpoint, block_s, stalled):
    """On a clock of the test's: a call whose every block takes 0.9 x stall_s is never
    stalled, though it runs longer than stall_s in all; one whose blocks take 1.1 x is
    stalled before each of its reports."""
    from tandem.services.encoder.cache import EmbeddingCache
    from tandem.services.encoder.scheduler import EncoderScheduler

    runner, image, blocks = _tower(checkpoint)
    now = [0.0]
    sched = EncoderScheduler([runner], EmbeddingCache(0), 1 << 20, stall_s=10.0,
                             clock=lambda: now[0])
    run, seen = runner.run, []

    def slowly(pixels, grids, on_progress):  # the scheduler's report, each block slowed
        def slow_block() -> None:  # on the device thread, at the end of each block
            now[0] += block_s * sched.stall_s
            seen.append(sched.stalled())
            on_progress()

        return run(pixels, grids, on_progress=slow_block)

    runner.run = slowly

    async def go():
        sched.start()
        try:
            await asyncio.wait_for(sched.encode([image]), HANG_GUARD_S)
        finally:
            await sched.stop()

    asyncio.run(go())
    assert blocks * 0.9 * sched.stall_s > sched.stall_s  # longer than stall_s in all
    assert seen == [stalled] * blocks
    assert not sched.stalled()  # the call ended


def test_a_stalled_call_does_not_hold_the_stop(checkpoint):
    """The device thread is a daemon and the stop does not wait for a stalled call (it
    used to join it, blocking the event loop and the process's exit for ever)."""
    from tandem.services.encoder.cache import EmbeddingCache
    from tandem.services.encoder.scheduler import EncoderScheduler
    from tandem.services.encoder.vit.runner import VisionRunner

    runner, image, _ = _tower(checkpoint)
    sched = EncoderScheduler([runner], EmbeddingCache(0), 1 << 20, stall_s=STALL_S)
    hang = HangFirst()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VisionRunner, "run", hang.wrap(VisionRunner.run))

        async def go():
            sched.start()
            job = asyncio.ensure_future(sched.encode([image]))
            await async_wait_until(sched.stalled, timeout_s=HANG_GUARD_S,
                                   what="the hung call seen as stalled")
            await asyncio.wait_for(sched.stop(), HANG_GUARD_S)  # returns, the call still hung
            job.cancel()

        try:
            asyncio.run(go())
            (device,) = sched.devices
            assert device.thread.daemon and device.thread.is_alive()  # still in the call
            assert not hang.released.is_set()
        finally:
            hang.released.set()


class _Input:
    """A ViT input (scheduler.VisionInput) of given pixels."""

    def __init__(self, pixels, grid, unit: int) -> None:
        self.pixel_values, self.grid, self.key = pixels, grid, "k"
        t, h, w = grid
        self.num_patches = t * h * w
        self.num_tokens = self.num_patches // unit


def _pixels(visual, grid):
    import torch

    cfg = visual.config
    t, h, w = grid
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    return torch.randn(t * h * w, width, generator=torch.Generator().manual_seed(0))


# ---- the transfer layer ---------------------------------------------------------------------

@pytest.mark.asyncio
async def test_a_room_prepared_without_vouching_fails_at_the_transfer_timeout():
    engine, cfg = make_engine(timeout_s=1.0)
    sender, server, address = await start_sender(engine, cfg, slots=2, slot_tokens=64)
    rx = make_receiver(engine, cfg, blocks=8, block_size=16, reserve=64)
    try:
        sender.vouch = lambda: False  # its ViT stalled
        sender.preparing(7, True)
        # (with its vouch, the room lives past two timeouts: tests/test_room_stall.py)
        with pytest.raises(TransferError) as e:
            await asyncio.wait_for(rx.receive(7, address), HANG_GUARD_S)
        assert e.value.code == "UNAVAILABLE", e.value  # the router retries it
        await async_wait_until(lambda: rx.allocator.num_free == 8, timeout_s=HANG_GUARD_S,
                               what="the room's blocks back")
    finally:
        sender.preparing(7, False)
        await server.stop(None)
        await rx.close()
        release_all()


@pytest.mark.asyncio
async def test_a_short_stall_does_not_fail_a_room_being_prepared():
    """The vouch is asked again at every beat: a ViT that stalls past one beat and moves
    again within the transfer timeout keeps its rooms (before, one refusal failed the room
    a whole timeout later, however soon the ViT recovered)."""
    engine, cfg = make_engine(timeout_s=3.0)
    sender, server, address = await start_sender(engine, cfg, slots=2, slot_tokens=64)
    rx = make_receiver(engine, cfg, blocks=8, block_size=16, reserve=64)
    asked: list[bool] = []

    def vouch() -> bool:  # stalled at the first beat only
        asked.append(bool(asked))
        return asked[-1]

    try:
        sender.vouch = vouch
        sender.preparing(7, True)
        room = asyncio.create_task(rx.receive(7, address))
        await async_wait_until(lambda: len(asked) >= 4, timeout_s=HANG_GUARD_S,
                               what="four beats' vouches (one refused)")
        assert not room.done() and rx.state(7) == ReceiverState.WAITING_FOR_INPUT
        sender.preparing(7, False)
        p = make_payload(100, 32, "float32", seed=7)
        await asyncio.wait_for(sender.send(7, p), HANG_GUARD_S)
        assert digest(await asyncio.wait_for(room, HANG_GUARD_S)) == digest(p)
    finally:
        sender.preparing(7, False)
        await server.stop(None)
        await rx.close()
        release_all()


# ---- end to end -----------------------------------------------------------------------------

class Cluster:
    """Two encoders, a language instance and a router, in one background event loop."""

    def __init__(self, ckpt: Path, stream: bool) -> None:
        from tandem.config import TransferConfig
        from tandem.services.encoder.config import EncoderConfig
        from tandem.services.language.config import LanguageConfig
        from tandem.services.router.config import RouterConfig

        transfer = TransferConfig(timeout_s=TRANSFER_TIMEOUT_S, stream=stream)
        self.encoders = [EncoderConfig(
            model=str(ckpt), device="cpu", dtype="float32", port=free_port(),
            metrics_port=free_port(), insecure_internal=True, linear_backend="torch",
            drain_timeout_s=1, vit_stall_s=STALL_S, transfer=transfer) for _ in range(2)]
        self.language = LanguageConfig(
            model=str(ckpt), device="cpu", dtype="float32", port=free_port(),
            insecure_internal=True, metrics_port=free_port(), kv_pages=256, kv_page_size=16,
            transfer=transfer)
        self.router = RouterConfig(
            http_port=free_port(), grpc_port=free_port(), insecure_internal=True,
            load_refresh_s=0.1, encoders=[f"127.0.0.1:{c.port}" for c in self.encoders],
            languages=[f"127.0.0.1:{self.language.port}"])
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> Cluster:
        from tandem.services.encoder.main import run as run_encoder
        from tandem.services.language.main import run as run_language
        from tandem.services.router.main import run_router

        self.thread.start()

        async def boot():
            self.stops = [asyncio.Event() for _ in range(4)]
            tiers = [(run_encoder, c) for c in self.encoders] + [(run_language, self.language)]
            ready = [asyncio.Event() for _ in tiers]
            self.tasks = [asyncio.ensure_future(run(cfg, r, s)) for (run, cfg), r, s
                          in zip(tiers, ready, self.stops, strict=False)]
            for r in ready:
                await asyncio.wait_for(r.wait(), HANG_GUARD_S)
            self.tasks.append(asyncio.ensure_future(run_router(self.router, self.stops[3])))

        self.call(boot())
        wait_until(lambda: self.health(f"127.0.0.1:{self.router.grpc_port}") == "SERVING",
                   timeout_s=HANG_GUARD_S, what="the router serving")
        return self

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(HANG_GUARD_S + 60)

    def health(self, address: str) -> str:
        async def check():
            async with grpc.aio.insecure_channel(address) as ch:
                try:
                    r = await health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service=""), timeout=10)
                except grpc.RpcError as e:
                    return e.code().name
                return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

        return self.call(check())

    def vit_stalled(self, address: str) -> bool:
        """What the encoder's load report says (the router's selection reads it)."""
        async def load():
            async with grpc.aio.insecure_channel(address) as ch:
                return await encoder_pb2_grpc.EncoderStub(ch).GetLoad(
                    encoder_pb2.EncoderGetLoadRequest(), timeout=10)

        return self.call(load()).vit_stalled

    def encode_refusal(self, address: str) -> tuple[str, str]:
        async def encode():
            async with grpc.aio.insecure_channel(address) as ch:
                try:
                    await encoder_pb2_grpc.EncoderStub(ch).Encode(
                        encoder_pb2.EncodeRequest(room=999_999), timeout=10)
                except grpc.RpcError as e:
                    return e.code().name, e.details()
                return "OK", ""

        return self.call(encode())

    def language_idle(self) -> bool:
        async def load():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{self.language.port}") as ch:
                return await language_pb2_grpc.LanguageStub(ch).GetLoad(
                    language_pb2.LanguageGetLoadRequest(), timeout=10)

        r = self.call(load())
        return (r.free_kv_pages == r.total_kv_pages
                and r.free_embedding_blocks == r.total_embedding_blocks
                and r.transferring + r.waiting + r.running == 0)

    def stop(self) -> None:
        async def down():
            for s in self.stops:
                s.set()
            await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True),
                                   HANG_GUARD_S)

        try:
            self.call(down())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(HANG_GUARD_S)


@pytest.mark.parametrize("stream", [False, True])
def test_a_hung_vit_fails_its_room_and_the_request_is_retried_elsewhere(checkpoint, stream):
    """(`stream`: the rows streamed, so the room waits for its rows, not its payload.)"""
    from tandem.services.encoder.vit.runner import VisionRunner

    ckpt = checkpoint("qwen2_5_vl")
    data = png(64, 48, 27)
    chat = [Message("user", (ImageInput(data=data), "What is in the picture?"))]
    want = expected(ckpt, chat)
    hang = HangFirst()
    cluster = Cluster(ckpt, stream).start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(VisionRunner, "run", hang.wrap(VisionRunner.run))
            answer: dict = {}

            def ask():
                try:
                    with Client(f"127.0.0.1:{cluster.router.grpc_port}") as c:
                        answer["result"] = c.chat([{"role": "user", "content": [
                            image_from_bytes(data), "What is in the picture?"]}],
                            max_tokens=MAX_NEW, timeout=HANG_GUARD_S)
                except Exception as e:  # noqa: BLE001  (shown by the assertion below)
                    answer["error"] = e

            asker = threading.Thread(target=ask)
            asker.start()
            try:
                assert hang.entered.wait(HANG_GUARD_S), "no ViT call began"
                # the hung encoder: the one whose metrics show the stall
                hung = wait_until(
                    lambda: next((c for c in cluster.encoders if metric(
                        c.metrics_port, "tandem_encoder_vit_stall_seconds") > STALL_S), None),
                    timeout_s=HANG_GUARD_S, what="an encoder's ViT stall past vit_stall_s")
                address = f"127.0.0.1:{hung.port}"
                wait_until(lambda: cluster.health(address), timeout_s=HANG_GUARD_S,
                           until=lambda s: s == "NOT_SERVING", what="the hung encoder's health")
                code, details = cluster.encode_refusal(address)
                assert code == "UNAVAILABLE" and "ViT stalled" in details, (code, details)
                assert cluster.vit_stalled(address)  # the router picks it for nothing
                asker.join(HANG_GUARD_S)
                assert not asker.is_alive(), "the request was not answered (hang guard)"
            finally:
                hang.released.set()
                asker.join(HANG_GUARD_S)
        assert "error" not in answer, answer  # before: DEADLINE_EXCEEDED at its deadline
        assert answer["result"].token_ids == want
        # the call ended: back in service, and nothing held anywhere
        wait_until(lambda: cluster.health(address), timeout_s=HANG_GUARD_S,
                   until=lambda s: s == "SERVING", what="the encoder back in service")
        assert metric(hung.metrics_port, "tandem_encoder_vit_stall_seconds") == 0.0
        assert not cluster.vit_stalled(address)
        wait_until(cluster.language_idle, timeout_s=HANG_GUARD_S,
                   what="every KV page and embedding block free")
    finally:
        cluster.stop()


def test_a_helper_whose_vit_hangs_is_lost_and_its_range_re_encoded(checkpoint):
    from test_split import Trio, _grid, assert_fell_back, assert_idle, four_image_chat

    from tandem.services.encoder.vit.runner import VisionRunner

    ckpt = checkpoint("qwen2_5_vl")
    chat = four_image_chat(31)
    hang = HangFirst(_grid(ckpt, chat, 3))  # the last image: the helper's range
    trio = Trio(ckpt, timeout_s=TRANSFER_TIMEOUT_S)
    trio.lead_cfg = trio.lead_cfg.model_copy(update={"vit_stall_s": STALL_S})
    trio.helper_cfg = trio.helper_cfg.model_copy(update={"vit_stall_s": STALL_S})
    trio.start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(VisionRunner, "run", hang.wrap(VisionRunner.run))
            try:
                tokens, res = trio.call(trio.generate(chat))
            finally:
                hang.released.set()
        assert hang.entered.is_set()
        assert_fell_back(trio, ckpt, chat, tokens, res)  # before: held until the deadline
        assert_idle(trio)
    finally:
        trio.stop()
