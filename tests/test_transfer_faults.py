"""Failure semantics across two real processes: each fault ends the room on both sides
with a clear reason, and every block / staging slot / room-table entry is returned.

Kills and cuts must be noticed from the Attach stream: those tests run with a 10 s room
timeout and check what ended the room, its reason naming the stream ("Attach stream",
"closed") where a timeout's names the transfer timeout. Frozen peers (SIGSTOP) are only
visible as silence: the survivor fails at its timeout, and its reason says so. No test here
bounds a duration: every wait is a hang guard (tests/waiting.py).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest
import pytest_asyncio
import torch

sys.path.insert(0, str(Path(__file__).parent / "transfer_peers"))
from harness import Peer, make_engine, make_receiver, release_all, start_sender  # noqa: E402
from peerlib import digest, make_payload  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from waiting import async_wait_until  # noqa: E402

from tandem.transfer import ReceiverState, SenderState, TransferError  # noqa: E402
from tandem.transfer.buffers import RowProtection  # noqa: E402
from tandem.v1 import encoder_pb2, encoder_pb2_grpc  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")
HANG_GUARD_S = 60.0  # every wait's limit: a hang guard, never a speed claim


@pytest.fixture(autouse=True)
def _unregister():
    yield
    release_all()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def shared_enc(tmp_path_factory):
    """An encoder peer for the faults it survives (cuts, bad input, timeouts)."""
    peer = await Peer.start("encoder", tmp_path_factory.mktemp("enc"), timeout_s=10)
    yield peer
    await peer.stop()


async def until(pred, what: str = "the awaited state") -> None:
    await async_wait_until(pred, timeout_s=HANG_GUARD_S, what=what, poll_s=0.01)


async def fails(task) -> TransferError:
    """The TransferError `task` ends with; its code and reason say what ended it."""
    with pytest.raises(TransferError) as ei:
        await asyncio.wait_for(task, HANG_GUARD_S)
    return ei.value


def sender_failures(sender) -> dict[int, TransferError]:
    """Each room's failure as `sender` records it (what ended the room), from now on."""
    got: dict[int, TransferError] = {}
    fail = sender._fail

    def recording(r, err) -> None:
        if not r.terminal:  # the first failure is the one that counts (as in _fail)
            got.setdefault(r.room, err)
        fail(r, err)

    sender._fail = recording
    return got


def assert_rx_clean(rx) -> None:
    assert not rx.rooms and not rx.allocator.owners
    assert rx.allocator.num_free == rx.allocator.num_total


async def assert_peer_clean(peer: Peer) -> None:
    """The peer's room table is empty and its slots/blocks are all free (staging slots
    come back when Mooncake returns the writing thread, a moment after the room ends)."""
    await async_wait_until(peer.stats, timeout_s=HANG_GUARD_S,
                           until=lambda st: st["rooms"] == [] and st["free"] == st["total"],
                           what="the peer's rooms and slots free")


async def mid_transfer_on_receiver(rx, address: str, enc: Peer, tokens: int = 300):
    """Room 2 gets its first piece and then waits for blocks held by room 1."""
    holder = asyncio.create_task(rx.receive(1, address))
    room = asyncio.create_task(rx.receive(2, address))
    await until(lambda: rx.allocator.num_free == 0)
    enc.send(op="send", room=2, tokens=tokens, seed=5)
    await until(lambda: rx.state(2) == ReceiverState.TRANSFERRING and rx.allocator.num_free == 4)
    return holder, room


async def test_encoder_killed_mid_transfer_and_reattach(tmp_path):
    enc = await Peer.start("encoder", tmp_path, timeout_s=10)
    engine, cfg = make_engine(timeout_s=10)
    sender, server, address2 = await start_sender(engine, cfg, slots=1, slot_tokens=64)
    rx = make_receiver(engine, cfg, blocks=8, block_size=16, reserve=64)
    rx2 = make_receiver(engine, cfg, blocks=8, block_size=16, reserve=64, grace=5.0)
    try:
        t5 = asyncio.create_task(rx2.receive(5, enc.ready["address"]))
        await until(lambda: rx2.state(5) == ReceiverState.WAITING_FOR_INPUT)
        holder, room = await mid_transfer_on_receiver(rx, enc.ready["address"], enc)
        enc.signal(signal.SIGKILL)
        err = await fails(room)
        assert err.code == "UNAVAILABLE" and "Attach stream" in err.reason, err
        err = await fails(holder)
        assert err.code == "UNAVAILABLE" and "Attach stream" in err.reason, err
        assert_rx_clean(rx)
        # Reattach (router retry): rx2's room saw the same break but has a grace period;
        # it keeps its reservation and completes from another encoder (this process).
        await until(lambda: rx2.rooms[5].call is None)
        assert rx2.allocator.num_free == 4 and not rx2.reattach(55, address2)
        assert rx2.reattach(5, address2)
        p = make_payload(150, 32, "float32", 5)
        stats = await asyncio.wait_for(sender.send(5, p), HANG_GUARD_S)
        got = await asyncio.wait_for(t5, HANG_GUARD_S)
        assert digest(got) == digest(p) and stats.resumes == 1
        assert_rx_clean(rx2)
        assert not sender.rooms and sender.staging.num_free == 1
    finally:
        await enc.stop()
        await server.stop(None)
        await rx.close()
        await rx2.close()


async def test_language_killed_mid_transfer(tmp_path):
    engine, cfg = make_engine(timeout_s=10)
    sender, server, address = await start_sender(engine, cfg, slots=2, slot_tokens=64)
    lang = await Peer.start("language", tmp_path, blocks=8, block_size=16, reserve=64,
                            timeout_s=10)
    failures = sender_failures(sender)
    try:
        for room in (1, 2):
            lang.send(op="receive", room=room, address=address)
        await until(lambda: sender.state(1) == sender.state(2) == SenderState.WAITING_FOR_PAYLOAD)
        task = asyncio.create_task(sender.send(2, make_payload(300, 32, "float32", 1)))
        await until(lambda: sender.state(2) == SenderState.WAITING_FOR_RESUME)
        lang.signal(signal.SIGKILL)
        err = await fails(task)
        # the stream ended (Tandem's words, whichever way it noticed: closed or broken;
        # "closed" alone could be gRPC's own text inside a broken stream's detail)
        assert err.code == "UNAVAILABLE" and "Attach stream" in err.reason, err
        await until(lambda: not sender.rooms and sender.staging.num_free == 2)
        # room 1 (Init, no payload yet) was ended by its stream closing, not its timeout
        assert "closed the Attach stream" in failures[1].reason, failures
    finally:
        await lang.stop()
        await server.stop(None)


class CutProxy:
    """A TCP relay whose connections can be cut mid-stream (both processes survive)."""

    def __init__(self, upstream: str) -> None:
        self.host, port = upstream.rsplit(":", 1)
        self.port, self.writers = int(port), []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _conn(self, r, w) -> None:
        ur, uw = await asyncio.open_connection(self.host, self.port)
        self.writers += [w, uw]

        async def pipe(src, dst):
            while data := await src.read(1 << 16):
                dst.write(data)
        await asyncio.gather(pipe(r, uw), pipe(ur, w), return_exceptions=True)

    def cut(self) -> None:
        for w in self.writers:
            w.transport.abort()
        self.server.close()


async def test_stream_cut(shared_enc):
    enc = shared_enc
    proxy = CutProxy(enc.ready["address"])
    engine, cfg = make_engine(timeout_s=10)
    rx = make_receiver(engine, cfg, blocks=8, block_size=16, reserve=64)
    try:
        holder, room = await mid_transfer_on_receiver(rx, await proxy.start(), enc)
        proxy.cut()
        err = await fails(room)
        assert err.code == "UNAVAILABLE" and "Attach stream" in err.reason, err
        sent = await enc.wait(lambda e: e["event"] == "sent" and e["room"] == 2, HANG_GUARD_S)
        assert not sent["ok"] and sent["code"] == "UNAVAILABLE", sent
        assert "Attach stream" in sent["reason"], sent  # the cut, not the 10 s timeout
        err = await fails(holder)
        assert "Attach stream" in err.reason, err
        assert_rx_clean(rx)
        await assert_peer_clean(enc)
    finally:
        await rx.close()


async def test_frozen_encoder_fails_at_timeout(tmp_path):
    enc = await Peer.start("encoder", tmp_path, timeout_s=10)
    engine, cfg = make_engine(timeout_s=1.0)
    rx = make_receiver(engine, cfg, blocks=8, block_size=16, reserve=64)
    try:
        holder, room = await mid_transfer_on_receiver(rx, enc.ready["address"], enc)
        enc.signal(signal.SIGSTOP)
        rx.abort(1)  # blocks come back: room 2 sends Resume into silence
        with pytest.raises(TransferError, match="aborted"):
            await holder
        err = await fails(room)
        # the transfer timed out, not the request (it has no deadline): UNAVAILABLE, which
        # the router retries, never the client's "deadline passed"
        assert err.code == "UNAVAILABLE" and "no data from encoder" in err.reason, err
        assert "transfer timeout" in err.reason, err
        assert_rx_clean(rx)
    finally:
        await enc.stop()
        await rx.close()


async def test_frozen_language_fails_at_timeout(tmp_path):
    engine, cfg = make_engine(timeout_s=1.0)
    sender, server, address = await start_sender(engine, cfg, slots=2, slot_tokens=64)
    lang = await Peer.start("language", tmp_path, blocks=8, block_size=16, reserve=64,
                            timeout_s=10)
    failures = sender_failures(sender)
    try:
        for room in (1, 2):
            lang.send(op="receive", room=room, address=address)
        await until(lambda: sender.state(1) == sender.state(2) == SenderState.WAITING_FOR_PAYLOAD)
        task = asyncio.create_task(sender.send(2, make_payload(300, 32, "float32", 1)))
        await until(lambda: sender.state(2) == SenderState.WAITING_FOR_RESUME)
        lang.signal(signal.SIGSTOP)
        err = await fails(task)
        assert err.code == "UNAVAILABLE" and "Resume" in err.reason, err
        assert "transfer timeout" in err.reason, err
        # Room 1 had an Init but no payload: it ends at the same timeout.
        await until(lambda: not sender.rooms and sender.staging.num_free == 2)
        assert "no payload after Init" in failures[1].reason, failures
        assert "transfer timeout" in failures[1].reason, failures
    finally:
        await lang.stop()
        await server.stop(None)


async def test_bad_block_ids_rejected(shared_enc):
    """A language side naming blocks outside its own pool gets Failed, nothing written."""
    enc = shared_enc
    engine, cfg = make_engine()
    rx = make_receiver(engine, cfg, blocks=8, block_size=16)
    try:
        import grpc
        async with grpc.aio.insecure_channel(enc.ready["address"]) as ch:
            call = encoder_pb2_grpc.EncoderStub(ch).Attach()
            await call.write(encoder_pb2.AttachRequest(init=encoder_pb2.AttachInit(
                room=9, session_id=engine.session_id, layout=rx.buffers.layout().to_proto(),
                block_ids=[0, 99], allocated_tokens=32,
                **RowProtection.new(cfg.protect).init_fields())))
            enc.send(op="send", room=9, tokens=20, seed=1)
            msg = await asyncio.wait_for(call.read(), HANG_GUARD_S)
            assert msg.failed.error.code == "INVALID_ARGUMENT"
            assert "bad destination block ids [99]" in msg.failed.error.message
        sent = await enc.wait(lambda e: e["event"] == "sent" and e["room"] == 9, HANG_GUARD_S)
        assert sent["code"] == "INVALID_ARGUMENT"
        assert torch.count_nonzero(rx.buffers.aux) == 0  # nothing landed
        await assert_peer_clean(enc)
    finally:
        await rx.close()


async def test_bad_address_fails_both_sides(shared_enc):
    """Addresses outside the language's registered memory: Mooncake refuses the write."""
    enc = shared_enc
    engine, cfg = make_engine(timeout_s=10)
    rx = make_receiver(engine, cfg, blocks=8, block_size=16)
    rx._layout.embeddings_addr += 1 << 40  # a corrupted layout, as a buggy peer would send
    try:
        task = asyncio.create_task(rx.receive(3, enc.ready["address"]))
        enc.send(op="send", room=3, tokens=40, seed=1)
        err = await fails(task)
        assert err.code == "UNAVAILABLE" and "encoder failed" in err.reason, err
        sent = await enc.wait(lambda e: e["event"] == "sent" and e["room"] == 3, HANG_GUARD_S)
        assert not sent["ok"] and "write" in sent["reason"], sent
        assert_rx_clean(rx)
        await assert_peer_clean(enc)
    finally:
        await rx.close()


@pytest.mark.parametrize("embed_dim,dtype,why", [
    (48, "float32", "embed_dim mismatch: language buffers 48, payload 32"),
    (32, "bfloat16", "dtype mismatch: language buffers bfloat16, payload float32"),
])
async def test_layout_mismatch(shared_enc, embed_dim, dtype, why):
    enc = shared_enc
    engine, cfg = make_engine(timeout_s=10)
    rx = make_receiver(engine, cfg, blocks=8, block_size=16, embed_dim=embed_dim, dtype=dtype)
    try:
        task = asyncio.create_task(rx.receive(4, enc.ready["address"]))
        enc.send(op="send", room=4, tokens=40, seed=1)
        err = await fails(task)
        assert err.code == "INVALID_ARGUMENT" and why in err.reason, err
        sent = await enc.wait(lambda e: e["event"] == "sent" and e["room"] == 4, HANG_GUARD_S)
        assert sent["code"] == "INVALID_ARGUMENT" and why in sent["reason"]
        assert_rx_clean(rx)
        await assert_peer_clean(enc)
    finally:
        await rx.close()


async def test_timeouts_abort_and_cancel(shared_enc):
    """No Init, no payload, abort, and cancellation of the awaiting task."""
    enc = shared_enc
    engine, cfg = make_engine(timeout_s=1.0)
    rx = make_receiver(engine, cfg, blocks=8, block_size=16, reserve=64)
    addr = enc.ready["address"]
    try:
        enc.send(op="send", room=11, tokens=10, seed=1, deadline_s=1.0)  # nobody attaches
        sent = await enc.wait(lambda e: e["event"] == "sent" and e["room"] == 11, HANG_GUARD_S)
        assert sent["code"] == "DEADLINE_EXCEEDED" and "Init" in sent["reason"], sent
        err = await fails(rx.receive(12, addr))  # nobody sends
        assert err.code in ("DEADLINE_EXCEEDED", "UNAVAILABLE"), err
        assert "no data" in err.reason or "no payload" in err.reason, err
        t3 = asyncio.create_task(rx.receive(13, addr))
        t4 = asyncio.create_task(rx.receive(14, addr))
        await until(lambda: rx.state(13) == rx.state(14) == ReceiverState.WAITING_FOR_INPUT)
        assert rx.abort(13) and not rx.abort(333)
        assert (await fails(t3)).code == "CANCELLED"
        t4.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t4
        assert_rx_clean(rx)
        await assert_peer_clean(enc)
    finally:
        await rx.close()


async def test_reattach_while_reserving(shared_enc):
    """A reattach that arrives while the room still waits for its first blocks simply
    points the room elsewhere; it then completes there, bit-exact."""
    engine, cfg = make_engine(timeout_s=10)
    sender, server, address2 = await start_sender(engine, cfg, slots=1, slot_tokens=64)
    rx = make_receiver(engine, cfg, blocks=4, block_size=16, reserve=64)
    try:
        holder = asyncio.create_task(rx.receive(21, shared_enc.ready["address"]))
        await until(lambda: rx.state(21) == ReceiverState.WAITING_FOR_INPUT)
        room = asyncio.create_task(rx.receive(22, shared_enc.ready["address"]))
        await until(lambda: rx.state(22) == ReceiverState.BOOTSTRAPPING)
        assert rx.reattach(22, address2)
        rx.abort(21)
        assert (await fails(holder)).code == "CANCELLED"
        p = make_payload(100, 32, "float32", 22)
        stats = await asyncio.wait_for(sender.send(22, p), HANG_GUARD_S)
        assert digest(await asyncio.wait_for(room, HANG_GUARD_S)) == digest(p) and stats.resumes == 1
        assert_rx_clean(rx)
        await assert_peer_clean(shared_enc)
    finally:
        await server.stop(None)
        await rx.close()


async def test_init_without_payload_sends_failed_and_does_not_spin():
    """An Attach whose Init is never followed by send() ends at the room timeout with an
    AttachFailed the language side sees ("no payload"), and the sender's loop sleeps while
    it waits (it once re-polled a zero timeout forever, one core busy, Failed never sent):
    counted in wake-ups of that loop (each takes one message from the room's outbox, or
    times out), a sleeping wait wakes about twice (its timeout, then the Failed it sends);
    a busy one, thousands of times."""
    engine, cfg = make_engine(timeout_s=1.0)
    _, patient = make_engine(timeout_s=10.0)  # the language side waits longer: it hears why
    sender, server, address = await start_sender(engine, cfg)
    rx = make_receiver(engine, patient, blocks=8, block_size=16, reserve=64)
    wakeups = 0
    room_of, counted = sender._room, set()

    def counting_room(room, state):  # count the gets on each room's outbox
        r = room_of(room, state)
        if room not in counted:
            counted.add(room)
            get = r.outbox.get

            def counted_get():
                nonlocal wakeups
                wakeups += 1
                return get()

            r.outbox.get = counted_get
        return r

    sender._room = counting_room
    try:
        err = await fails(rx.receive(7, address))
        assert "no payload" in err.reason, err
        await until(lambda: not sender.rooms)
        assert_rx_clean(rx)
        assert counted == {7} and 1 <= wakeups <= 10, ("the sender spun while waiting", wakeups)
        ended_at = wakeups
        await asyncio.sleep(0.5)  # pacing: room for a loop still running to show itself
        assert wakeups == ended_at, "the sender's loop went on after the room ended"
    finally:
        await server.stop(None)
        await rx.close()


async def test_stale_and_foreign_writes_are_detected_before_use(tmp_path):
    """Fenced transfers: writes labelled with an earlier attempt of the room (an encoder
    frozen mid-write that wakes after its room moved to another encoder) or with another
    room land in the room's blocks, and the room fails with DATA_LOSS before any block is
    used; a legitimate room beside them (with a resume) arrives bit-exact."""
    engine, cfg = make_engine(timeout_s=10)
    rx = make_receiver(engine, cfg, blocks=16, block_size=16, reserve=64)
    legit = await Peer.start("encoder", tmp_path, timeout_s=10)
    stale = await Peer.start("encoder", tmp_path, timeout_s=10, rogue_generation_delta=-1)
    foreign = await Peer.start("encoder", tmp_path, timeout_s=10, rogue_room_xor=1)
    try:
        # Room 1's first attempt went to `legit`, which never sends; the router moved it
        # to `stale` (attempt 2), whose writes carry attempt 1's generation.
        moved = asyncio.create_task(rx.receive(1, legit.ready["address"]))
        await until(lambda: rx.state(1) == ReceiverState.WAITING_FOR_INPUT)
        assert rx.reattach(1, stale.ready["address"])
        await until(lambda: rx.rooms[1].attempt == 1 and rx.state(1) == ReceiverState.WAITING_FOR_INPUT)
        misdirected = asyncio.create_task(rx.receive(2, foreign.ready["address"]))
        good = asyncio.create_task(rx.receive(3, legit.ready["address"]))
        await until(lambda: all(rx.state(r) == ReceiverState.WAITING_FOR_INPUT for r in (2, 3)))
        stale.send(op="send", room=1, tokens=40, seed=1)
        foreign.send(op="send", room=2, tokens=40, seed=2)
        p = make_payload(150, 32, "float32", 3)
        legit.send(op="send", room=3, tokens=150, seed=3)
        # the aux fields that differ: the generation (index 9), the room's low word (6)
        for task, mismatch in ((moved, "aux mismatch {9: 1}"), (misdirected, "aux mismatch {6: 3}")):
            err = await fails(task)
            assert err.code == "DATA_LOSS" and mismatch in err.reason, err
        got = await asyncio.wait_for(good, HANG_GUARD_S)
        assert digest(got) == digest(p)
        assert_rx_clean(rx)
        for peer in (legit, stale, foreign):
            await assert_peer_clean(peer)
    finally:
        for peer in (legit, stale, foreign):
            await peer.stop()
        await rx.close()


async def test_an_encoder_still_preparing_the_payload_keeps_its_room_alive(tmp_path):
    """A payload prepared for longer than the transfer timeout (a long video waiting for the
    ViT) is work, not a stall: while `preparing`, the encoder's Attach stream carries
    heartbeats (AttachWorking) every third of the timeout, so neither side gives the room
    up, and the payload then arrives whole. Without them both sides time out after 1 s."""
    engine, cfg = make_engine(timeout_s=1.0)
    sender, server, address = await start_sender(engine, cfg, slots=2, slot_tokens=64)
    lang = await Peer.start("language", tmp_path, blocks=8, block_size=16, reserve=64,
                            timeout_s=1.0)
    try:
        sender.preparing(7, True)
        lang.send(op="receive", room=7, address=address)
        await until(lambda: sender.state(7) == SenderState.WAITING_FOR_PAYLOAD)
        await asyncio.sleep(3.5)  # three and a half transfer timeouts of preparing
        assert sender.state(7) == SenderState.WAITING_FOR_PAYLOAD
        sender.preparing(7, False)
        p = make_payload(100, 32, "float32", seed=7)
        await asyncio.wait_for(sender.send(7, p), HANG_GUARD_S)
        got = await lang.wait(lambda e: e["event"] == "received" and e["room"] == 7)
        assert got["ok"] and got["digest"] == digest(p), got
        assert not sender.rooms and sender.staging.num_free == 2
    finally:
        await lang.stop()
        await server.stop(None)


# ---- streamed rows (issue 27) ------------------------------------------------------------


async def test_streamed_rows_wait_for_the_vit_then_a_stalled_writer_fails_its_room(tmp_path):
    """A streamed payload whose later rows are not final yet (still in the ViT): the room
    is handed on at its first rows (`on_open`) and outlives several transfer timeouts
    while the encoder waits for rows (its AttachWorking heartbeats: work, not a stall),
    then completes with the payload sent, resumes included. Then an encoder frozen
    (SIGSTOP) mid-stream after the first rows were handed on is cut by the room's
    progress timeout (UNAVAILABLE, which the router retries), not reattached (its first
    rows may be in a prefill already), and every block comes back."""
    enc = await Peer.start("encoder", tmp_path, timeout_s=1.0)
    engine, cfg = make_engine(timeout_s=1.0)
    rx = make_receiver(engine, cfg, blocks=8, block_size=16, reserve=64, grace=5.0)
    address = enc.ready["address"]
    try:
        # 1. rows held past three timeouts, then released: the room completes
        opened: list = []
        task = asyncio.create_task(rx.receive(1, address, on_open=opened.append))
        await until(lambda: rx.state(1) == ReceiverState.WAITING_FOR_INPUT)
        enc.send(op="stream_send", room=1, tokens=150, seed=3, first=40)
        await until(lambda: opened and opened[0].arrived.rows == 32)  # whole blocks only
        assert not opened[0].arrived.complete and rx.state(1) == ReceiverState.TRANSFERRING
        stalls = rx.rooms[1].progressed
        await asyncio.sleep(3.5)  # NOTE: not a speed claim: three timeouts must pass
        assert rx.state(1) == ReceiverState.TRANSFERRING and not task.done()
        assert rx.rooms[1].progressed == stalls  # heartbeats are not progress
        enc.send(op="rows", room=1, rows=150)
        got = await asyncio.wait_for(task, HANG_GUARD_S)
        assert got is opened[0] and got.arrived.complete and len(opened) == 1
        assert digest(got) == digest(make_payload(150, 32, "float32", 3))
        sent = await enc.wait(lambda e: e["event"] == "sent" and e["room"] == 1, HANG_GUARD_S)
        assert sent["ok"] and sent["resumes"] == 1, sent  # 64 reserved, then the rest
        assert_rx_clean(rx)

        # 2. the writer freezes after the first rows were handed on
        opened.clear()
        task = asyncio.create_task(rx.receive(2, address, on_open=opened.append))
        await until(lambda: rx.state(2) == ReceiverState.WAITING_FOR_INPUT)
        enc.send(op="stream_send", room=2, tokens=150, seed=4, first=20)
        await until(lambda: opened and opened[0].arrived.rows == 16)
        enc.signal(signal.SIGSTOP)
        assert not rx.reattach(2, address)  # handed on: never reattached
        err = await fails(task)
        assert err.code == "UNAVAILABLE" and "no data from encoder" in err.reason, err
        assert "transfer timeout" in err.reason, err
        assert opened[0].arrived.rows == 16 and not opened[0].arrived.complete
        assert_rx_clean(rx)
    finally:
        await enc.stop()
        await rx.close()


async def test_reattach_while_the_init_cannot_be_written():
    """A first Attach to an encoder that never answers (a frozen process: its kernel
    accepts the connection, nothing reads it) cannot even write its Init. A Reattach (the
    router's retry on another encoder) must still move the room at once, and without one
    the room fails at the transfer timeout, as after any silence."""
    import socket
    import threading

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    held = []  # connections accepted and never read, as by a process that froze

    def hold():
        while True:
            try:
                held.append(silent.accept()[0])
            except OSError:
                return

    threading.Thread(target=hold, daemon=True).start()
    frozen = f"127.0.0.1:{silent.getsockname()[1]}"
    engine, cfg = make_engine(timeout_s=10)
    sender, server, address2 = await start_sender(engine, cfg, slots=1, slot_tokens=64)
    rx = make_receiver(engine, cfg, blocks=8, block_size=16, reserve=64)
    quick_engine, quick = make_engine(timeout_s=1.0)
    rx_quick = make_receiver(quick_engine, quick, blocks=8, block_size=16, reserve=64)
    try:
        room = asyncio.create_task(rx.receive(31, frozen))
        await until(lambda: 31 in rx.rooms and rx.rooms[31].call is not None)
        assert rx.reattach(31, address2)
        p = make_payload(50, 32, "float32", 31)
        await asyncio.wait_for(sender.send(31, p), HANG_GUARD_S)
        assert digest(await asyncio.wait_for(room, HANG_GUARD_S)) == digest(p)
        assert_rx_clean(rx)
        err = await fails(asyncio.create_task(rx_quick.receive(32, frozen)))
        assert err.code == "UNAVAILABLE" and "transfer timeout" in err.reason, err
        assert_rx_clean(rx_quick)
    finally:
        silent.close()
        for c in held:
            c.close()
        await server.stop(None)
        await rx.close()
        await rx_quick.close()


async def test_the_encoders_answer_may_be_read_before_the_init_write_completes():
    """On a loaded host the encoder's first message (its answer to the Init) can be read
    before the Init's own write is seen to complete: it is the protocol's next step, kept
    in order and handled, not an interruption (it once failed the room: "unexpected
    prompt from the encoder"). The Init's write here completes only once that answer is
    in the room's events."""
    engine, cfg = make_engine(timeout_s=10)
    sender, server, address = await start_sender(engine, cfg)
    rx = make_receiver(engine, cfg, blocks=8, block_size=16, reserve=64)
    write = rx._write

    async def init_seen_late(r, req):
        await write(r, req)
        if req.WhichOneof("msg") == "init":
            await until(r.wake.is_set, "the encoder's answer read")  # set by each event

    rx._write = init_seen_late
    try:
        room = asyncio.create_task(rx.receive(41, address))
        p = make_payload(50, 32, "float32", 41)
        await asyncio.wait_for(sender.send(41, p), HANG_GUARD_S)
        assert digest(await asyncio.wait_for(room, HANG_GUARD_S)) == digest(p)
        assert_rx_clean(rx)
    finally:
        await server.stop(None)
        await rx.close()
