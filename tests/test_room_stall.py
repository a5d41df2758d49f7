"""`tandem_transfer_room_stall_seconds` (tandem/transfer/metrics.py RoomStall): how long the
language side's most idle open room has gone without progress, the series the chart's
TandemRoomStuck alert reads.

An in-process encoder (EmbeddingSender) and receiver on one Mooncake engine. An encoder
that keeps `preparing` a payload heartbeats (AttachWorking) and the room stays open past
its transfer timeout; the heartbeats are not progress, so the gauge climbs past that
timeout, and falls back to 0 once the payload arrived. A room still queued for its first
blocks is not counted. No test bounds a duration: each wait is for a state, under a hang
guard (tests/waiting.py).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).parent / "transfer_peers"))
from harness import make_engine, make_receiver, release_all, start_sender  # noqa: E402
from peerlib import digest, make_payload  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from waiting import async_wait_until  # noqa: E402

from tandem.transfer import ReceiverState, TransferError  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")
HANG_GUARD_S = 60.0
STALL = "tandem_transfer_room_stall_seconds"


@pytest.fixture(autouse=True)
def _unregister():
    yield
    release_all()


def stall(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value(STALL)


async def test_heartbeats_without_progress_show_as_a_stalled_room():
    engine, cfg = make_engine(timeout_s=1.0)
    sender, server, address = await start_sender(engine, cfg, slots=2, slot_tokens=64)
    registry = CollectorRegistry()
    rx = make_receiver(engine, cfg, blocks=8, block_size=16, reserve=64, registry=registry)
    try:
        assert stall(registry) == 0.0  # registered with the receiver, 0 with no room open
        sender.preparing(7, True)  # the encoder works on the payload: heartbeats only
        room = asyncio.create_task(rx.receive(7, address))
        # past two transfer timeouts without progress, and the room still open: the
        # heartbeats kept it, so only the gauge tells it is going nowhere
        await async_wait_until(lambda: stall(registry), timeout_s=HANG_GUARD_S,
                               until=lambda s: s > 2 * cfg.timeout_s,
                               what="the room's stall past two transfer timeouts")
        assert rx.state(7) == ReceiverState.WAITING_FOR_INPUT and not room.done()
        sender.preparing(7, False)
        p = make_payload(100, 32, "float32", seed=7)
        await asyncio.wait_for(sender.send(7, p), HANG_GUARD_S)
        got = await asyncio.wait_for(room, HANG_GUARD_S)
        assert digest(got) == digest(p)
        assert stall(registry) == 0.0  # no room open
    finally:
        await server.stop(None)
        await rx.close()


async def test_a_room_queued_for_its_first_blocks_is_not_stalled():
    """Waiting for blocks is queueing (the block gauges show it), not a stalled transfer:
    only the room holding the pool counts."""
    engine, cfg = make_engine(timeout_s=30.0)
    sender, server, address = await start_sender(engine, cfg, slots=2, slot_tokens=64)
    rx = make_receiver(engine, cfg, blocks=4, block_size=16, reserve=64,
                       registry=CollectorRegistry())
    try:
        first = asyncio.create_task(rx.receive(1, address))
        await async_wait_until(lambda: rx.state(1) == ReceiverState.WAITING_FOR_INPUT,
                               timeout_s=HANG_GUARD_S, what="room 1 attached")
        second = asyncio.create_task(rx.receive(2, address))
        await async_wait_until(lambda: rx.state(2) == ReceiverState.BOOTSTRAPPING,
                               timeout_s=HANG_GUARD_S, what="room 2 queued for blocks")
        assert rx.allocator.num_free == 0 and len(rx.progress_times()) == 1
        for room, task in ((1, first), (2, second)):
            rx.abort(room)
            with pytest.raises(TransferError):
                await asyncio.wait_for(task, HANG_GUARD_S)
        assert rx.progress_times() == []
    finally:
        await server.stop(None)
        await rx.close()


async def test_an_encoder_waits_for_an_init_the_language_side_queues_past_the_timeout():
    """The language side queues a room for its first blocks up to the request's deadline
    (receiver.py); the encoder's wait for that room's Init is the same queueing and lasts
    as long: a room queued past the transfer timeout is delivered once blocks free up.
    (Before, the encoder failed it at the transfer timeout, "no progress while waiting for
    the language side's Init": under load, with one language instance frozen and its
    requests retried on the other, a retried request failed so.) Without a deadline the
    transfer timeout still bounds the wait: nothing else would end it."""
    engine, cfg = make_engine(timeout_s=1.0)
    sender, server, address = await start_sender(engine, cfg, slots=2, slot_tokens=64)
    rx = make_receiver(engine, cfg, blocks=4, block_size=16, reserve=64)
    try:
        # Room 1 holds every block while its encoder prepares the payload (heartbeats).
        sender.preparing(1, True)
        first = asyncio.create_task(rx.receive(1, address))
        await async_wait_until(lambda: rx.state(1) == ReceiverState.WAITING_FOR_INPUT,
                               timeout_s=HANG_GUARD_S, what="room 1 attached")
        second = asyncio.create_task(rx.receive(2, address, deadline=time.time() + HANG_GUARD_S))
        await async_wait_until(lambda: rx.state(2) == ReceiverState.BOOTSTRAPPING,
                               timeout_s=HANG_GUARD_S, what="room 2 queued for blocks")
        p1, p2 = make_payload(40, 32, "float32", seed=1), make_payload(50, 32, "float32", seed=2)
        sending = asyncio.create_task(sender.send(2, p2, deadline=time.time() + HANG_GUARD_S))
        # NOTE: a sleep, not a clock read: before the fix the send had failed after 1 s
        await asyncio.sleep(3 * cfg.timeout_s)
        assert not sending.done(), sending.exception()
        # The room's Init wait must still have ended at the timeout with no deadline given.
        with pytest.raises(TransferError, match="Init"):
            await asyncio.wait_for(sender.send(3, p1), HANG_GUARD_S)
        # Room 1 gets its payload and returns its blocks; room 2 then attaches and is served.
        sender.preparing(1, False)
        await asyncio.wait_for(sender.send(1, p1), HANG_GUARD_S)
        got1 = await asyncio.wait_for(first, HANG_GUARD_S)
        rx.release(got1)
        await asyncio.wait_for(sending, HANG_GUARD_S)
        got2 = await asyncio.wait_for(second, HANG_GUARD_S)
        assert (digest(got1), digest(got2)) == (digest(p1), digest(p2))
        rx.release(got2)
        assert rx.allocator.num_free == 4 and not sender.rooms
    finally:
        await server.stop(None)
        await rx.close()


async def test_a_room_waiting_for_a_staging_slot_heartbeats_and_waits_for_it():
    """An encoder's staging slots come back only when Mooncake is done with their writes
    (a frozen peer: its timeout, 30 s by default). A room waiting for one is queued, not
    stalled: it heartbeats, so its language side does not fail it at the transfer timeout,
    and it waits up to the request's deadline; once a slot is free it is delivered. (Before,
    with both slots held by writes to a frozen language instance, the encoder's rooms to
    the other instance failed one by one: "no progress while waiting for a staging slot".)"""
    engine, cfg = make_engine(timeout_s=1.0)
    sender, server, address = await start_sender(engine, cfg, slots=1, slot_tokens=64)
    rx = make_receiver(engine, cfg, blocks=4, block_size=16, reserve=64)
    try:
        held = await sender.staging.acquire()  # as a round whose writes never end would
        room = asyncio.create_task(rx.receive(1, address, deadline=time.time() + HANG_GUARD_S))
        await async_wait_until(lambda: rx.state(1) == ReceiverState.WAITING_FOR_INPUT,
                               timeout_s=HANG_GUARD_S, what="room 1 attached")
        # the Init named the language side's segment: opened before any write needs it
        await async_wait_until(lambda: engine.is_open(engine.session_id),
                               timeout_s=HANG_GUARD_S, what="the peer's segment opened")
        p = make_payload(50, 32, "float32", seed=3)
        sending = asyncio.create_task(sender.send(1, p, deadline=time.time() + HANG_GUARD_S))
        # NOTE: a sleep, not a clock read: without heartbeats and with the timeout, both
        # sides had failed the room after 1 s
        await asyncio.sleep(3 * cfg.timeout_s)
        assert not sending.done(), sending.exception()
        assert not room.done(), room.exception()
        sender.staging.release(held)
        await asyncio.wait_for(sending, HANG_GUARD_S)
        got = await asyncio.wait_for(room, HANG_GUARD_S)
        assert digest(got) == digest(p)
        rx.release(got)
        assert rx.allocator.num_free == 4 and not sender.rooms
    finally:
        await server.stop(None)
        await rx.close()
