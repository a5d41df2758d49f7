"""Single-process parts of the transfer layer: the block allocator, the write plan that
StagingArea builds (executed here with memmove, so every address and length it names is
exercised), aux rows, gather, the Mooncake wrapper's bookkeeping, and metrics."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).parent / "transfer_peers"))
from harness import make_engine  # noqa: E402
from peerlib import make_payload  # noqa: E402

from tandem.transfer import (  # noqa: E402
    BlockAllocator,
    BufferLayout,
    EmbeddingBuffers,
    StagingArea,
    TransferError,
    transfer_metrics,
)
from tandem.transfer import buffers as B  # noqa: E402
from tandem.transfer.staging import PieceTarget, coalesce  # noqa: E402
from tandem.units import ceil_div  # noqa: E402


def test_allocator_all_or_none_fifo_and_errors():
    a = BlockAllocator(8, 16)
    assert a.num_total == 8 and a.num_free == 8 and ceil_div(17, a.block_size) == 2
    assert a.alloc(40, "r1") == [0, 1, 2]
    assert a.can_alloc(80) and not a.can_alloc(81) and not a.can_alloc(0)
    assert a.alloc(81, "r2") is None and a.num_free == 5  # all or none
    assert a.alloc(32, "r2") == [3, 4]
    a.free("r1")
    assert a.alloc(80, "r3") == [5, 6, 7, 0, 1]  # FIFO: freed blocks come back last
    with pytest.raises(KeyError, match="already holds"):
        a.alloc(1, "r3")
    with pytest.raises(KeyError, match="already freed"):
        a.free("r1")  # double free
    with pytest.raises(KeyError, match="unknown"):
        a.free("nobody")
    with pytest.raises(ValueError):
        a.alloc(0, "r4")
    a.free("r2")
    a.free("r3")
    assert a.num_free == 8 and a.owners == []


def test_coalesce_merges_only_continuations():
    assert coalesce([(0, 100, 8), (8, 108, 8), (16, 200, 8), (24, 208, 4)]) == [
        (0, 100, 16), (16, 200, 12)]
    assert coalesce([(0, 100, 8), (8, 100, 8)]) == [(0, 100, 8), (8, 100, 8)]


def _apply(plan) -> None:
    for s, d, n in zip(*plan, strict=True):
        ctypes.memmove(d, s, n)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_staged_writes_land_bit_exact_in_scattered_blocks(dtype):
    """Stage a 2-piece prompt in chunks at slot offsets, write it with memmove into
    out-of-order blocks, gather it back: bit-exact, and every aux row as documented."""
    bs, d, room, total = 8, 24, (7 << 40) | 0x9ABCDEF0, 61
    p = make_payload(total, d, dtype, seed=3)
    buf = EmbeddingBuffers(12, bs, d, B.DTYPES[dtype])
    st = StagingArea(1, 32, d, B.DTYPES[dtype])
    layout = buf.layout()
    out = (torch.empty(total, d, dtype=B.DTYPES[dtype]), torch.empty(total, dtype=torch.int32),
           torch.empty(3, total, dtype=torch.int32))
    pieces = [(0, 40, [9, 2, 3, 11, 0]), (40, 21, [5, 4, 10])]  # (start, tokens, blocks)
    for start, n, ids in pieces:
        for t0 in range(start, start + n, 16):  # chunks of 2 blocks, at offsets in the slot
            t1 = min(t0 + 16, start + n)
            plan, _aux = st.stage(0, p, PieceTarget(room, 3, ids, start, n), layout, t0, t1,
                                  at=(t0 - start) % 32)
            _apply(plan)
        buf.check_piece(B.PieceCheck(ids, room, 3, total, start, n, n))
        rows = buf.aux[torch.tensor(ids)]
        lo, hi = B.room_words(room)
        for i, row in enumerate(rows.tolist()):
            assert row[:10] == [total, p.mrope_delta, start, n, i, min(bs, n - i * bs), lo, hi, d, 3]
            assert row[10:] == [0] * 6
        buf.gather_into(ids, n, *out, start)
    assert torch.equal(out[0].view(torch.uint8), p.input_embeds.view(torch.uint8))
    assert torch.equal(out[1], p.fill_ids) and torch.equal(out[2], p.mrope_positions)
    with pytest.raises(TransferError, match="aux mismatch") as ei:
        buf.check_piece(B.PieceCheck([5, 4, 10], room + 1, 3, total, 40, 21, 21))  # another room's
    assert ei.value.code == "DATA_LOSS"
    with pytest.raises(TransferError, match="aux mismatch") as ei:
        buf.check_piece(B.PieceCheck([5, 4, 10], room, 4, total, 40, 21, 21))  # an earlier attempt's
    assert ei.value.code == "DATA_LOSS"
    with pytest.raises(TransferError, match="index"):
        buf.check_piece(B.PieceCheck([4, 5, 10], room, 3, total, 40, 21, 21))  # out of order


def test_layout_roundtrip_and_checks():
    buf = EmbeddingBuffers(4, 16, 32, torch.bfloat16)
    lay = buf.layout()
    assert BufferLayout.from_proto(lay.to_proto()) == lay
    assert lay.embed_row_bytes == 16 * 32 * 2 and lay.elem_size == 2
    assert lay.fill_ids_addr == buf.fill_ids.data_ptr() and lay.num_blocks == 4
    st = StagingArea(1, 32, 32, torch.bfloat16)
    good = make_payload(5, 32, "bfloat16", 0)
    assert st.check_layout(lay, good) is None
    assert "embed_dim mismatch" in st.check_layout(lay, make_payload(5, 48, "bfloat16", 0))
    assert "dtype mismatch" in st.check_layout(lay, make_payload(5, 32, "float32", 0))
    big = BufferLayout(**{**lay.__dict__, "block_size": 64})
    assert "block_size 64" in st.check_layout(big, good)


def test_a_closed_engine_frees_its_ports():
    """Engines are closed as services stop (encoder and language `run`): a process may
    start and stop more of them than its transfer port range holds at once (~500: two
    ports each), as this test suite does. Closed, an engine's RPC port is free again
    (bindable), what was registered is unregistered, and closing twice is harmless."""
    import socket

    from tandem.config import TransferConfig
    from tandem.transfer.engine import MooncakeEngine

    engine = MooncakeEngine(TransferConfig())
    host, port = engine.session_id.rsplit(":", 1)
    engine.register(torch.zeros(16))

    def bindable() -> bool:
        with socket.socket() as s:
            try:
                s.bind((host, int(port)))
                return True
            except OSError:
                return False

    assert not bindable()  # the engine listens there
    engine.close()
    engine.close()
    assert not engine._regions and bindable()


def test_engine_ports_registration_and_metrics():
    engine, cfg = make_engine()
    host, port = engine.session_id.rsplit(":", 1)
    # Mooncake fixes the port range when its library loads; in this shared test process
    # an earlier engine may have fixed it (test_port_range_confines_a_fresh_process proves
    # confinement where the configured range applies, as in a service).
    assert host == cfg.host and int(port) > 0
    if engine.port_range is not None:
        lo, hi = engine.port_range
        assert lo <= int(port) <= hi
    t = torch.zeros(1024)
    engine.register(t)
    assert engine.owns(t.data_ptr(), 4096) and not engine.owns(t.data_ptr() + 1, 4096)
    with pytest.raises(RuntimeError, match="already registered"):
        engine.register(t)
    engine.unregister(t)
    with pytest.raises(KeyError):
        engine.unregister(t)
    reg = CollectorRegistry()
    m1, m2 = transfer_metrics(reg), transfer_metrics(reg)  # no duplicate registration
    assert m1 is m2 and transfer_metrics() is transfer_metrics()
    m1.failures.labels("language", "UNAVAILABLE").inc()
    m1.failures.labels("language", "CANCELLED").inc()
    m1.failures.labels("encoder", "DEADLINE_EXCEEDED").inc()
    # the reason comes from the code: the request ended the room, or the transfer failed
    for side, code, reason in (("language", "UNAVAILABLE", "transfer"),
                               ("language", "CANCELLED", "request"),
                               ("encoder", "DEADLINE_EXCEEDED", "request")):
        assert reg.get_sample_value("tandem_transfer_failures_total",
                                    {"side": side, "code": code, "reason": reason}) == 1
    # block gauges only where blocks exist (the language side: BlockReservations)
    assert reg.get_sample_value("tandem_transfer_blocks_capacity") is None
    m1.blocks(3, 8)
    assert reg.get_sample_value("tandem_transfer_blocks_free") == 3
    assert reg.get_sample_value("tandem_transfer_blocks_capacity") == 8


def test_port_range_confines_a_fresh_process():
    """In a process's first engine (how services run) the configured range is in force."""
    import subprocess
    import sys

    code = (
        "from tandem.config import TransferConfig\n"
        "from tandem.transfer.engine import MooncakeEngine\n"
        "e = MooncakeEngine(TransferConfig(min_port=17100, max_port=17149))\n"
        "print('PORT', e.session_id.rsplit(':', 1)[1], *e.port_range)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("PORT"))
    port, lo, hi = map(int, line.split()[1:])
    assert (lo, hi) == (17100, 17149) and 17100 <= port <= 17149


def test_reservations_resume_goes_before_first_reservations():
    """A room mid-transfer waiting for its Resume blocks gets the next freed blocks ahead
    of a new room that has waited longer (the resuming room's encoder holds a staging slot
    meanwhile, and the room already holds the request's place); the new room waits on."""
    import asyncio

    from tandem.transfer.room import BlockReservations, ReceiverRoom

    async def main():
        res = BlockReservations(BlockAllocator(4, 16), transfer_metrics(CollectorRegistry()))
        holder, newcomer, resuming = ReceiverRoom(1, "a"), ReceiverRoom(2, "a"), ReceiverRoom(3, "a")
        key, _ = res.try_alloc(holder, 64)  # the whole pool
        first = asyncio.ensure_future(res.alloc(newcomer, 32, 5.0, lambda ev: None))
        await asyncio.sleep(0.05)  # the newcomer waits first...
        resume = asyncio.ensure_future(res.alloc(resuming, 48, 5.0, lambda ev: None, resume=True))
        await asyncio.sleep(0.05)
        assert not first.done() and not resume.done() and res.resumes_waiting == 1
        res.free(holder, key)  # ...but 4 free blocks cannot serve both (2 + 3)
        _, got = await asyncio.wait_for(resume, 1)
        assert len(got) == 3 and res.resumes_waiting == 0
        await asyncio.sleep(0.05)
        assert not first.done()  # 1 block left: the newcomer still waits
        res.free_all(resuming)
        _, got2 = await asyncio.wait_for(first, 1)
        assert len(got2) == 2
        res.free_all(newcomer)
        assert res.allocator.num_free == 4

    asyncio.run(main())


def test_one_client_holds_at_most_its_share_of_the_blocks():
    """`client_share` 0.5 of 8 blocks: client A's first room takes 4, its next room waits
    (a flood of stalled rooms from one client cannot pin the pool) while client B and an
    unnamed client are served at once; A's waiting room goes on when A's blocks come back.
    A client holding nothing may always take what it needs; resumes are not limited."""
    import asyncio

    from tandem.transfer.room import BlockReservations, ReceiverRoom

    async def main():
        res = BlockReservations(BlockAllocator(8, 16), transfer_metrics(CollectorRegistry()),
                                client_share=0.5)
        assert res.client_quota == 4
        a1, a2, a3 = (ReceiverRoom(i, "e", client="A") for i in (1, 2, 3))
        b, anon = ReceiverRoom(4, "e", client="B"), ReceiverRoom(5, "e")
        first = await res.alloc(a1, 64, 1.0, lambda ev: None)  # 4 blocks: A's share
        waiting = asyncio.ensure_future(res.alloc(a2, 16, 5.0, lambda ev: None))
        await asyncio.sleep(0.05)
        assert not waiting.done() and res.held_by == {"A": 4}
        await asyncio.wait_for(res.alloc(b, 32, 1.0, lambda ev: None), 1)  # B: served
        await asyncio.wait_for(res.alloc(anon, 16, 1.0, lambda ev: None), 1)  # unnamed too
        assert res.held_by == {"A": 4, "B": 2}
        # a resume of A's room goes beyond the share (the room is under way)
        extra = await asyncio.wait_for(res.alloc(a1, 16, 1.0, lambda ev: None, resume=True), 1)
        assert res.held_by["A"] == 5
        with pytest.raises(TransferError) as e:  # A is over its share: a third room waits
            await res.alloc(a3, 16, 0.1, lambda ev: None, timeout_code="DEADLINE_EXCEEDED")
        assert e.value.code == "DEADLINE_EXCEEDED"
        res.free(a1, first[0])
        res.free(a1, extra[0])
        _, got = await asyncio.wait_for(waiting, 1)  # A's blocks came back: it goes on
        assert len(got) == 1 and res.held_by == {"A": 1, "B": 2}
        for r in (a2, b, anon):
            res.free_all(r)
        assert res.held_by == {} and res.allocator.num_free == 8

    asyncio.run(main())
