"""Rows are protected on the data plane (issue 31, finding 1): Mooncake lets any process
that reaches a language instance's transfer ports read and write its registered memory,
and its handshake tells such a process where the embedding buffer lies.

- In process: sealed rows (Poly1305 tags, ChaCha20 under `encrypt`) round-trip bit-exact
  through staging, scattered blocks and the private copy; one byte changed in any part the
  encoder writes (embeddings, token ids, positions, aux rows), a tag of another range or
  another attempt's key: DATA_LOSS.
- Across processes: an attacker with its own Mooncake engine (tests/transfer_peers/peer.py
  `reader`) learns the receiver's embedding buffer from the handshake and overwrites all of
  it after the encoder's write landed and before the copy-out (the encoder peer holds its
  reports: `--hold`). With `mac` the room fails with DATA_LOSS, nothing is returned and
  every block is free; with `none` (the control) the tampered rows come back as the
  prompt. With `encrypt` the attacker reads ciphertext in flight, and the prompt still
  arrives exact.
- An encoder never sends rows less protected than it is configured for.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
from pathlib import Path

import pytest
import pytest_asyncio
import torch

sys.path.insert(0, str(Path(__file__).parent / "transfer_peers"))
from harness import Peer, make_engine, make_receiver, release_all  # noqa: E402
from peerlib import digest, make_payload  # noqa: E402

from tandem.config import TransferConfig  # noqa: E402
from tandem.transfer import EmbeddingBuffers, StagingArea, TransferError  # noqa: E402
from tandem.transfer.buffers import (  # noqa: E402
    DTYPES,
    RangeSeal,
    RowProtection,
    open_range,
)
from tandem.transfer.staging import PieceTarget, tag_range  # noqa: E402
from tandem.units import ceil_div  # noqa: E402
from tandem.v1 import encoder_pb2  # noqa: E402

HANG_GUARD_S = 60.0  # every wait's limit: a hang guard, never a speed claim
TAMPER = 0x3C  # the byte the attacker writes


# ---- in process: what the tags cover --------------------------------------------------
def _apply(plan) -> None:
    for s, d, n in zip(*plan, strict=True):
        ctypes.memmove(d, s, n)


def _stage_all(prot: RowProtection, p, buf: EmbeddingBuffers, ids: list[int], room: int,
               gen: int, chunk: int = 16) -> list:
    """Stage and 'write' (memmove) the whole payload as one piece, in chunks (reported
    ranges); returns each range's (seal, tags)."""
    st = StagingArea(1, 32, buf.embed_dim, buf.dtype)
    sealed = []
    for t0 in range(0, p.num_tokens, chunk):
        t1 = min(t0 + chunk, p.num_tokens)
        seal = prot.seal(room, gen, t0, t1)
        plan, aux = st.stage(0, p, PieceTarget(room, gen, ids, 0, p.num_tokens), buf.layout(),
                             t0, t1, at=t0 % 32, seal=seal)
        _apply(plan)
        sealed.append((seal, tag_range(seal, p, t0, t1, aux)))
    return sealed


def _open_all(buf: EmbeddingBuffers, ids: list[int], total: int, sealed: list):
    """The receiver's copy-out: gather into private rows, then open every range there."""
    out = (torch.empty(total, buf.embed_dim, dtype=buf.dtype),
           torch.empty(total, dtype=torch.int32), torch.empty(3, total, dtype=torch.int32))
    buf.gather_into(ids, total, *out, 0)
    aux = buf.aux_rows(ids, total)
    bs = buf.block_size
    for seal, tag in sealed:
        k = seal.start // bs
        open_range(seal, tag, *out, aux[k : k + ceil_div(seal.end - seal.start, bs)])
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("mode", ["mac", "encrypt"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sealed_rows_round_trip_and_every_written_part_is_covered(mode, dtype):
    bs, d, room, gen, total = 8, 24, (5 << 40) | 77, 2, 61
    p = make_payload(total, d, dtype, seed=11)
    buf = EmbeddingBuffers(12, bs, d, DTYPES[dtype])
    ids = [9, 2, 3, 11, 0, 5, 4, 10]  # scattered, out of order
    prot = RowProtection.new(mode)
    sealed = _stage_all(prot, p, buf, ids, room, gen)
    landed = [buf.embeddings[b].clone() for b in ids], [buf.fill_ids[b].clone() for b in ids]

    out = _open_all(buf, ids, total, sealed)
    assert torch.equal(_bytes(out[0]), _bytes(p.input_embeds))
    assert torch.equal(out[1], p.fill_ids) and torch.equal(out[2], p.mrope_positions)

    # what lies in the registered blocks: the plaintext with `mac`, ciphertext with `encrypt`
    rows = torch.cat([e.view(-1)[: bs * d] for e in landed[0]])[: total * d]
    same = (_bytes(rows) == _bytes(p.input_embeds.reshape(-1))).float().mean().item()
    fill = torch.cat(landed[1])[:total]
    if mode == "mac":
        assert same == 1.0 and torch.equal(fill, p.fill_ids)
    else:
        assert same < 0.05 and not torch.equal(fill, p.fill_ids), same

    # one byte changed in any part the encoder wrote is caught; the aux rows' reserved
    # words too (the fence does not read them, the tag covers them)
    row = ids[1]  # a full block of the first range
    for name, t, offset in [("embeddings", buf.embeddings, 5), ("fill_ids", buf.fill_ids, 3),
                            ("mrope_positions", buf.mrope_positions, 4 * bs + 1),
                            ("aux reserved word", buf.aux, 4 * 12)]:
        flat = t[row].view(torch.uint8)
        flat[offset] ^= 0x01
        with pytest.raises(TransferError) as ei:
            _open_all(buf, ids, total, sealed)
        assert ei.value.code == "DATA_LOSS", name
        flat[offset] ^= 0x01
    _open_all(buf, ids, total, sealed)  # restored: opens again

    # a range's tags verify that range only, under this attempt's key only
    (s0, t0), (s1, t1) = sealed[0], sealed[1]
    swapped = [(s0, t1), (s1, t0)] + sealed[2:]
    other = RowProtection.new(mode)
    foreign = [(other.seal(room, gen, s.start, s.end), t) for s, t in sealed]
    for bad in (swapped, foreign):
        with pytest.raises(TransferError) as ei:
            _open_all(buf, ids, total, bad)
        assert ei.value.code == "DATA_LOSS"


def test_a_rank_opens_its_embeddings_with_what_rank_0_sends_it():
    """A tensor-parallel rank > 0 gets, per range, the embeddings' key, cipher and tag over
    its own socket (`for_rank`, JSON), and checks its private copy with them."""
    bs, d, room, total = 8, 16, 3, 40
    p = make_payload(total, d, "float32", seed=2)
    buf = EmbeddingBuffers(6, bs, d, torch.float32)
    ids = [4, 1, 0, 5, 2]
    sealed = _stage_all(RowProtection.new("encrypt"), p, buf, ids, room, 1)
    wire = [seal.for_rank(tag) for seal, tag in sealed]
    rows = torch.empty(total, d)
    buf.gather_into(ids, total, rows, None, None, 0)
    for w in wire:
        open_range(*RangeSeal.of_rank(w), rows)
    assert torch.equal(rows, p.input_embeds)
    buf.embeddings[ids[2]].view(torch.uint8)[0] ^= 0x80
    buf.gather_into(ids, total, rows, None, None, 0)
    with pytest.raises(TransferError) as ei:
        for w in wire:
            open_range(*RangeSeal.of_rank(w), rows)
    assert ei.value.code == "DATA_LOSS"


def test_an_init_names_its_protection_consistently():
    init = encoder_pb2.AttachInit(room=1, **RowProtection.new("mac").init_fields())
    assert RowProtection.of_init(init).mode == "mac"
    assert RowProtection.of_init(encoder_pb2.AttachInit(room=1)).mode == "none"
    for bad in (encoder_pb2.AttachInit(room=1, protection=encoder_pb2.ROW_PROTECTION_MAC),
                encoder_pb2.AttachInit(room=1, protection_key=b"k" * 32),
                encoder_pb2.AttachInit(room=1, protection=encoder_pb2.ROW_PROTECTION_ENCRYPT,
                                       protection_key=b"short")):
        with pytest.raises(TransferError) as ei:
            RowProtection.of_init(bad)
        assert ei.value.code == "INVALID_ARGUMENT"
    with pytest.raises(ValueError):
        TransferConfig(protect="rot13")


# ---- across processes: a real attacker ------------------------------------------------
@pytest.fixture(autouse=True)
def _unregister():
    yield
    release_all()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def attacker(tmp_path_factory):
    """A process with its own Mooncake engine: reads and writes whatever it can reach."""
    # NOTE: no descriptor cache: each test registers new buffers in this process
    peer = await Peer.start("reader", tmp_path_factory.mktemp("attacker"),
                            env={"MC_DISABLE_METACACHE": "1"})
    yield peer
    await peer.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def held_enc(tmp_path_factory):
    """An encoder peer (protect floor `none`) that reports nothing until told `go`."""
    peer = await Peer.start("encoder", tmp_path_factory.mktemp("enc"), timeout_s=20,
                            hold=True, protect="none")
    yield peer
    await peer.stop()


async def _hold_room(rx, enc: Peer, room: int, tokens: int, seed: int):
    """Start a room; return (its receive task, its blocks) once the encoder's first chunk
    landed in the receiver's blocks and nothing was reported (so nothing copied out)."""
    task = asyncio.create_task(rx.receive(room, enc.ready["address"]))
    enc.send(op="send", room=room, tokens=tokens, seed=seed)
    held = await enc.wait(lambda e: e["event"] == "held" and e["room"] == room, HANG_GUARD_S)
    assert held["sessions"] == [rx.engine.session_id]
    return task, list(rx.rooms[room].ids)


async def _tamper(attacker: Peer, rx) -> None:
    """The attacker overwrites the receiver's whole embedding buffer, having learned where
    it lies from Mooncake's handshake alone."""
    n = rx.buffers.embeddings.numel() * rx.buffers.embeddings.element_size()
    attacker.send(op="tamper", session=rx.engine.session_id, length=n, byte=TAMPER)
    ev = await attacker.wait(lambda e: e["event"] == "tampered", HANG_GUARD_S)
    assert ev["rc"] == 0 and ev["addr"] == rx.buffers.embeddings.data_ptr(), ev
    assert bool((rx.buffers.embeddings.view(torch.uint8) == TAMPER).all())  # it landed


async def _sent(enc: Peer, room: int) -> dict:
    return await enc.wait(lambda e: e["event"] == "sent" and e["room"] == room, HANG_GUARD_S)


def _assert_rx_clean(rx) -> None:
    assert not rx.rooms and not rx.allocator.owners
    assert rx.allocator.num_free == rx.allocator.num_total


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("mode", ["mac", "encrypt"])
async def test_a_foreign_write_before_the_copy_out_fails_the_room(attacker, held_enc, mode):
    engine, _ = make_engine()
    rx = make_receiver(engine, TransferConfig(timeout_s=20, protect=mode), blocks=16,
                       reserve=256)
    room = 3100 + len(mode)
    try:
        task, _ = await _hold_room(rx, held_enc, room, tokens=100, seed=4)
        await _tamper(attacker, rx)
        held_enc.send(op="go", room=room)
        with pytest.raises(TransferError) as ei:
            await asyncio.wait_for(task, HANG_GUARD_S)
        assert ei.value.code == "DATA_LOSS", ei.value
        assert "do not carry the encoder's tag" in ei.value.reason  # the MAC, not the fence
        await _sent(held_enc, room)  # (its Done may have been written before the hang-up)
        # NOTE: no claim that the freed blocks are still zero: the encoder, released by `go`,
        # may land its next chunk after the room failed and its blocks were wiped (a stale
        # write into free blocks, which the aux fence refuses on reuse:
        # test_transfer_faults.py); CI saw exactly that once
        _assert_rx_clean(rx)
    finally:
        await rx.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_without_protection_the_same_write_becomes_the_prompt(attacker, held_enc):
    """The control: with `none` the tampered rows pass the aux fence and are returned as
    the prompt (what a prefill would have run on)."""
    engine, _ = make_engine()
    rx = make_receiver(engine, TransferConfig(timeout_s=20, protect="none"), blocks=16,
                       reserve=256)
    room = 3200
    try:
        task, _ = await _hold_room(rx, held_enc, room, tokens=100, seed=4)
        await _tamper(attacker, rx)
        held_enc.send(op="go", room=room)
        got = await asyncio.wait_for(task, HANG_GUARD_S)
        want = make_payload(100, 32, "float32", 4)
        first = got.input_embeds[:32].contiguous().view(torch.uint8)  # the held chunk
        assert bool((first == TAMPER).all()) and digest(got) != digest(want)
        assert (await _sent(held_enc, room))["ok"]
        _assert_rx_clean(rx)
    finally:
        await rx.close()


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("mode", ["mac", "encrypt"])
async def test_rows_in_flight_are_readable_unless_encrypted(attacker, held_enc, mode):
    """The attacker reads the room's first block between the write and the copy-out: the
    prompt's rows with `mac`, none of them with `encrypt`; the prompt arrives exact."""
    engine, _ = make_engine()
    rx = make_receiver(engine, TransferConfig(timeout_s=20, protect=mode), blocks=16,
                       reserve=256)
    room = 3300 + len(mode)
    want = make_payload(100, 32, "float32", 6)
    try:
        task, ids = await _hold_room(rx, held_enc, room, tokens=100, seed=6)
        b = rx.buffers
        seen = {}
        for name, t, row in (("embeddings", b.embeddings, want.input_embeds[:16]),
                             ("fill_ids", b.fill_ids, want.fill_ids[:16])):
            n = t[0].numel() * t.element_size()
            attacker.send(op="read", session=engine.session_id, addr=t[ids[0]].data_ptr(),
                          length=n, hex=True)
            ev = await attacker.wait(lambda e: e["event"] == "read", HANG_GUARD_S)
            assert ev["rc"] == 0, ev
            seen[name] = bytes.fromhex(ev["hex"]) == _bytes(row).numpy().tobytes()
        assert seen == ({"embeddings": True, "fill_ids": True} if mode == "mac"
                        else {"embeddings": False, "fill_ids": False}), seen
        held_enc.send(op="go", room=room)
        got = await asyncio.wait_for(task, HANG_GUARD_S)
        assert digest(got) == digest(want)
        assert (await _sent(held_enc, room))["ok"]
        _assert_rx_clean(rx)
    finally:
        await rx.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_an_encoder_never_sends_rows_less_protected_than_its_setting(tmp_path):
    """A language side asking for `none` from an encoder set to `mac` (the default): the
    room fails on both sides with FAILED_PRECONDITION, nothing is written."""
    enc = await Peer.start("encoder", tmp_path, timeout_s=20)
    engine, _ = make_engine()
    rx = make_receiver(engine, TransferConfig(timeout_s=20, protect="none"), blocks=8)
    try:
        task = asyncio.create_task(rx.receive(3400, enc.ready["address"]))
        enc.send(op="send", room=3400, tokens=40, seed=1)
        with pytest.raises(TransferError) as ei:
            await asyncio.wait_for(task, HANG_GUARD_S)
        assert ei.value.code == "FAILED_PRECONDITION", ei.value
        assert (await _sent(enc, 3400))["code"] == "FAILED_PRECONDITION"
        assert torch.count_nonzero(rx.buffers.aux) == 0  # nothing landed
        _assert_rx_clean(rx)
    finally:
        await enc.stop()
        await rx.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_what_a_mooncake_engine_listens_on(attacker):
    """docs/deploy.md's table, kept true: an engine opens two TCP listeners (handshake RPC,
    data), both inside the configured port range (what the NetworkPolicy opens) and both on
    every interface though the engine was started on 127.0.0.1 (Mooncake 0.3.13 has no bind
    option). A Mooncake that binds to the host makes this fail: update the docs then."""
    import psutil

    cfg = TransferConfig()
    listening = [c.laddr for c in psutil.Process(attacker.proc.pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN]
    session_port = int(attacker.ready["session"].rsplit(":", 1)[1])
    assert len(listening) == 2 and session_port in {a.port for a in listening}, listening
    assert all(cfg.min_port <= a.port <= cfg.max_port for a in listening), listening
    assert sorted(a.ip for a in listening) == ["0.0.0.0", "::"], listening
