"""Payloads cross two real processes over Mooncake TCP and arrive bit for bit.

Encoder peer process -> in-process EmbeddingReceiver (float32, width 32), and in-process
EmbeddingSender -> language peer process (bfloat16, width 48): single pieces, block
boundaries, blocks scattered out of order, and prompts needing 1, 2 and 3 resumes.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from prometheus_client import REGISTRY

sys.path.insert(0, str(Path(__file__).parent / "transfer_peers"))
from harness import Peer, make_engine, make_receiver, release_all, start_sender  # noqa: E402
from peerlib import digest, make_payload  # noqa: E402

from tandem.transfer import TransferError  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(autouse=True)
def _unregister():
    yield
    release_all()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def encoder(tmp_path_factory):
    peer = await Peer.start("encoder", tmp_path_factory.mktemp("enc"), timeout_s=5)
    yield peer
    await peer.stop()


async def _roundtrip(rx, enc: Peer, room: int, n: int, seed: int):
    task = asyncio.create_task(rx.receive(room, enc.ready["address"]))
    enc.send(op="send", room=room, tokens=n, seed=seed)
    got = await asyncio.wait_for(task, 30)
    sent = await enc.wait(lambda e: e["event"] == "sent" and e["room"] == room)
    want = make_payload(n, 32, "float32", seed)
    assert sent["ok"], sent
    assert torch.equal(got.input_embeds.view(torch.int32), want.input_embeds.view(torch.int32))
    assert torch.equal(got.fill_ids, want.fill_ids)
    assert torch.equal(got.mrope_positions, want.mrope_positions)
    assert got.mrope_delta == want.mrope_delta
    return sent


async def _clean(rx, enc: Peer) -> None:
    assert rx.allocator.num_free == rx.allocator.num_total and not rx.rooms
    assert not rx.allocator.owners
    # nothing of any prompt stays in registered memory, where another Mooncake peer could
    # read it (issue 16, finding 1): every block was wiped as its room let it go
    assert not any(t.any() for t in rx.buffers.tensors())
    st = await enc.stats()
    assert st["rooms"] == [] and st["free"] == st["total"], st


@pytest.mark.parametrize("n", [1, 15, 16, 17, 63, 64])
async def test_single_piece_bit_exact(encoder, n):
    engine, cfg = make_engine(timeout_s=5)
    rx = make_receiver(engine, cfg, blocks=8, block_size=16, reserve=64)
    sent = await _roundtrip(rx, encoder, 100 + n, n, seed=n)
    assert sent["resumes"] == 0
    await _clean(rx, encoder)


@pytest.mark.parametrize("n,resumes", [(65, 1), (100, 1), (300, 2), (400, 3)])
async def test_resumes_bit_exact(encoder, n, resumes):
    # Pool of 8 blocks x 16 = 128 tokens, 64 reserved: pieces of 64, then <= 128.
    engine, cfg = make_engine(timeout_s=5)
    rx = make_receiver(engine, cfg, blocks=8, block_size=16, reserve=64)
    sent = await _roundtrip(rx, encoder, 200 + n, n, seed=7 * n)
    assert sent["resumes"] == resumes
    await _clean(rx, encoder)


@pytest.mark.parametrize("n,cached,resumes", [(40, 32, 0), (300, 48, 2), (100, 0, 1)])
async def test_announce_then_only_the_uncached_rest_with_resumes(encoder, n, cached, resumes):
    # The language side holds `cached` leading tokens: the encoder sends the other
    # n - cached (resumed past the 64 reserved), every count is of that rest.
    engine, cfg = make_engine(timeout_s=5)
    seen = []

    def on_prompt(room, info):
        seen.append(info)
        return cached

    rx = make_receiver(engine, cfg, blocks=8, block_size=16, reserve=64)
    rx.on_prompt = on_prompt
    room = 500 + n
    task = asyncio.create_task(rx.receive(room, encoder.ready["address"]))
    encoder.send(op="announce_send", room=room, tokens=n, seed=n, images=[[4, 8, "ab" * 32]])
    got = await asyncio.wait_for(task, 30)
    sent = await encoder.wait(lambda e: e["event"] == "sent" and e["room"] == room)
    want = make_payload(n, 32, "float32", n)
    assert sent["ok"] and sent["cached"] == cached and sent["resumes"] == resumes, sent
    assert got.start == cached and got.num_tokens == n - cached and got.end == n
    assert got.info == seen[0] and got.info.token_ids == want.fill_ids.tolist()
    assert got.info.images[0].hash == "ab" * 32
    assert torch.equal(got.input_embeds, want.input_embeds[cached:])
    assert torch.equal(got.mrope_positions, want.mrope_positions[:, cached:])
    assert got.mrope_delta == want.mrope_delta
    await _clean(rx, encoder)


async def test_announce_answer_beyond_the_prompt_fails_the_room(encoder):
    engine, cfg = make_engine(timeout_s=5)
    rx = make_receiver(engine, cfg, blocks=8, block_size=16, reserve=64)
    rx.on_prompt = lambda room, info: len(info.token_ids)  # would leave nothing to send
    task = asyncio.create_task(rx.receive(601, encoder.ready["address"]))
    encoder.send(op="announce_send", room=601, tokens=20, seed=1, images=[])
    with pytest.raises(TransferError) as e:
        await asyncio.wait_for(task, 30)
    sent = await encoder.wait(lambda e: e["event"] == "sent" and e["room"] == 601)
    assert not sent["ok"] and e.value.code == "INVALID_ARGUMENT"
    await _clean(rx, encoder)


async def test_scattered_out_of_order_blocks(encoder):
    engine, cfg = make_engine(timeout_s=5)
    rx = make_receiver(engine, cfg, blocks=16, block_size=16, reserve=96)
    a = rx.allocator
    for owner in "abcd":
        a.alloc(64, owner)
    for owner in "cadb":  # the free list is FIFO: 8-11, 0-3, 12-15, 4-7
        a.free(owner)
    # The room reserves 96 tokens -> blocks [8, 9, 10, 11, 0, 1] (a run, then a jump back);
    # its Resume for the other 154 tokens gets [2, 3, 12, 13, 14, 15, 4, 5, 6, 7].
    assert a.held("a") == [] and a.num_free == 16
    sent = await _roundtrip(rx, encoder, 300, 250, seed=3)
    assert sent["resumes"] == 1
    await _clean(rx, encoder)


def _sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_concurrent_rooms_and_metrics(encoder):
    engine, cfg = make_engine(timeout_s=5)
    rx = make_receiver(engine, cfg, blocks=32, block_size=16, reserve=64)
    sizes = [5, 64, 130, 200, 33, 257]
    before = {k: _sample(f"tandem_transfer_{k}_total", side="language")
              for k in ("tokens", "resumes", "bytes")}
    results = await asyncio.gather(*[
        _roundtrip(rx, encoder, 400 + i, n, seed=40 + i) for i, n in enumerate(sizes)])
    assert [r["ok"] for r in results] == [True] * len(sizes)
    await _clean(rx, encoder)
    got = {k: _sample(f"tandem_transfer_{k}_total", side="language") - v
           for k, v in before.items()}
    assert got["tokens"] == sum(sizes)
    assert got["resumes"] == sum(r["resumes"] for r in results) == 3  # 130, 200, 257 > 64
    assert got["bytes"] == sum(n * (32 * 4 + 4 + 12) for n in sizes)
    assert _sample("tandem_transfer_blocks_free") == _sample("tandem_transfer_blocks_capacity") == 32


async def test_sender_in_process_to_language_process(tmp_path):
    """The other direction, bfloat16 at width 48, into a 1 + 2 + 3-resume schedule."""
    engine, cfg = make_engine(timeout_s=5)
    sender, server, address = await start_sender(engine, cfg, slots=2, slot_tokens=32,
                                                 embed_dim=48, dtype="bfloat16")
    lang = await Peer.start("language", tmp_path, embed_dim=48, dtype="bfloat16", blocks=8,
                            block_size=16, reserve=64, timeout_s=5)
    try:
        for room, n, resumes in [(1, 40, 0), (2, 100, 1), (3, 300, 2), (4, 400, 3)]:
            lang.send(op="receive", room=room, address=address)
            p = make_payload(n, 48, "bfloat16", seed=room)
            stats = await asyncio.wait_for(sender.send(room, p), 30)
            got = await lang.wait(lambda e, r=room: e["event"] == "received" and e["room"] == r)
            assert got["ok"] and got["digest"] == digest(p), got
            assert stats.resumes == resumes and stats.tokens == n
        st = await lang.stats()
        assert st["free"] == st["total"] and st["rooms"] == [] and st["owners"] == []
        assert not sender.rooms and sender.staging.num_free == 2
    finally:
        await lang.stop()
        await server.stop(None)


async def test_encoder_channels_are_bounded():
    # one channel per encoder address, the least recently used closed beyond the bound:
    # addresses named once (departed pods, a bad caller) are not kept open forever
    engine, cfg = make_engine(timeout_s=1)
    rx = make_receiver(engine, cfg, blocks=4, block_size=16, reserve=16)
    rx.channels.max_channels = 2
    a = rx.channels.get("127.0.0.1:1")
    rx.channels.get("127.0.0.1:2")
    assert rx.channels.get("127.0.0.1:1") is a  # reused, and now the most recent
    rx.channels.get("127.0.0.1:3")
    assert list(rx.channels.open) == ["127.0.0.1:1", "127.0.0.1:3"]
    await rx.close()
    assert not rx.channels.open


async def test_an_outsider_reads_nothing_of_a_prompt_after_its_room(encoder, tmp_path):
    """Issue 16, finding 1: a separate process with its own Mooncake engine can read any
    registered memory it can reach; after a room ends, the language side's blocks and the
    encoder's staging slots hold nothing of the prompt (zeros), so it reads nothing."""
    engine, cfg = make_engine(timeout_s=5)
    rx = make_receiver(engine, cfg, blocks=8, block_size=16, reserve=64)
    reader = await Peer.start("reader", tmp_path)
    regions = [(engine.session_id, t.data_ptr(), t.numel() * t.element_size())
               for t in rx.buffers.tensors()]
    regions += [(encoder.ready["session"], addr, n) for addr, n in encoder.ready["staging"]]

    async def read(session: str, addr: int, n: int) -> dict:
        reader.send(op="read", session=session, addr=addr, length=n)
        ev = await reader.wait(lambda e: e["event"] == "read")  # (taken off the list)
        assert ev["rc"] == 0, ev  # the read itself works: the memory is reachable
        return ev

    try:
        # control: the outsider does see what a block holds while it holds something
        rx.buffers.fill_ids[3].fill_(7)
        assert (await read(*regions[1]))["nonzero"] == 16  # one byte of each int32 7
        rx.buffers.fill_ids[3].zero_()
        await _roundtrip(rx, encoder, 900, 300, seed=9)  # resumes: every block used
        await _clean(rx, encoder)
        for session, addr, n in regions:
            assert (await read(session, addr, min(n, 1 << 20)))["nonzero"] == 0, (session, n)
    finally:
        await reader.stop()
        await rx.close()
