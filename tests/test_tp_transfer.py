"""Embeddings reach every tensor-parallel rank straight from the encoder (docs/architecture.md's "N destinations":
N destinations): a real `tandem language --tp 2` process (rank 0 + a rank-1 worker, each
with its own Mooncake engine and buffers) fed by real encoder-side transfer peers.

- The Attach Init names both ranks; the peer writes every piece to both (resumes
  included: 32 tokens reserved per room), rank 1 takes its rows from its own blocks (steps
  name them, not carry them), and greedy output equals `generate()`.
- Once each room ended, a separate Mooncake engine reads zeros from every block the room
  had, on both ranks (each rank wipes its blocks before they are reused).
- An encoder that writes rank 0 only (ignores AttachInit.ranks) is caught on rank 1 by
  the aux fence: DATA_LOSS naming the rank, never used; the instance stays up and the next
  request is exact; every block and page is free after.
- A rank hung (SIGSTOP) while rank 0 waits for its copy ends the instance within the
  tensor-parallel timeout, as a hung collective does.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from test_language_service import MAX_NEW, EncoderPeer, Language, drain, reference_tokens

from tandem.v1 import common_pb2

pytestmark = pytest.mark.timeout(300)
PROMPTS = [0, 1, 2, 3, 5, 7]  # text, one and two images, several needing resumes
_rooms = iter(range(5000, 1 << 40))


@pytest.fixture(scope="module")
def tp_cluster(checkpoint, tmp_path_factory):
    ckpt = checkpoint("qwen2_5_vl")
    tmp = tmp_path_factory.mktemp("tp_transfer")
    honest = EncoderPeer(ckpt, tmp / "honest.log")
    rogue = EncoderPeer(ckpt, tmp / "rogue.log", "--rank0-only")
    lang = Language(ckpt, tmp / "language.log", "--tp", "2", "--tp-timeout-s", "30")
    try:
        refs = reference_tokens(ckpt)
        honest.wait_ready()
        rogue.wait_ready()
        yield lang.wait_ready(), honest, rogue, refs
    finally:
        if lang.proc.poll() is None:
            lang.proc.kill()
        lang.proc.wait()
        honest.kill()
        rogue.kill()


def test_every_rank_receives_from_the_encoder_and_is_wiped_after(tp_cluster):
    lang, peer, _, refs = tp_cluster
    rooms = [next(_rooms) for _ in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futs = [pool.submit(drain, lang.generate(room, peer.address, MAX_NEW[i]))
                for i, room in zip(PROMPTS, rooms, strict=True)]
        for i, room in zip(PROMPTS, rooms, strict=True):
            peer.send(room, i)
        streams = [f.result() for f in futs]
    for i, msgs in zip(PROMPTS, streams, strict=True):
        assert [t for m in msgs for t in m.token_ids] == refs[i], f"prompt {i}: {msgs[-1]}"
    sent = [peer.wait_sent(room) for room in rooms]
    assert all(ev["ok"] for ev in sent), sent
    assert sum(ev["resumes"] > 0 for ev in sent) >= 2  # resumes went to both ranks too
    lang.assert_all_free()
    for room in rooms:
        got = peer.read(room)
        assert got["rc"] == [0] and len(got["nonzero"]) == 2, got  # both ranks were named
        assert got["nonzero"] == [0, 0], f"room {room}'s blocks still hold data: {got}"


def test_a_rank_the_encoder_did_not_write_fails_the_room_with_data_loss(tp_cluster):
    lang, peer, rogue, refs = tp_cluster
    room = next(_rooms)
    call = lang.generate(room, rogue.address, MAX_NEW[1])
    rogue.send(room, 1)
    msgs = drain(call)
    last = msgs[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_ERROR, last
    assert last.error.code == "DATA_LOSS" and "rank 1" in last.error.message, last.error
    assert not [t for m in msgs for t in m.token_ids]  # nothing generated from it
    lang.assert_all_free()
    # the instance is whole: the next request, from an honest encoder, is exact
    room = next(_rooms)
    call = lang.generate(room, peer.address, MAX_NEW[3])
    peer.send(room, 3)
    assert [t for m in drain(call) for t in m.token_ids] == refs[3]
    assert lang.proc.poll() is None
    lang.assert_all_free()


def test_a_rank_hung_during_a_copy_ends_the_instance(checkpoint, tmp_path):
    """A rank that stops answering (SIGSTOP) while rank 0 waits for its copy: bounded by
    `tp_timeout_s` like a collective, the whole instance ends (one line naming the rank)
    and the stream gets an error instead of hanging; the encoder peer's room is freed."""
    import signal

    import psutil

    ckpt = checkpoint("qwen2_5_vl")
    peer = EncoderPeer(ckpt, tmp_path / "peer.log")
    lang = Language(ckpt, tmp_path / "language.log", "--tp", "2", "--tp-timeout-s", "4")
    try:
        peer.wait_ready()
        lang.wait_ready()
        (worker,) = [p for p in psutil.Process(lang.proc.pid).children(recursive=True)
                     if "tp.worker" in " ".join(p.cmdline())]
        worker.send_signal(signal.SIGSTOP)
        room = next(_rooms)
        call = lang.generate(room, peer.address, MAX_NEW[1])
        peer.send(room, 1)
        try:
            msgs = drain(call)
            assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_ERROR, msgs[-1]
        except grpc.RpcError as e:  # the process ended under the stream
            assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), e
        assert lang.proc.wait(timeout=60) != 0  # a hang guard: the claim is that it ends
        # what ended it: rank 0's wait for the copy, bounded by tp_timeout_s
        assert "rank 1 did not answer within 4 s" in lang.log.read_text()
        assert not peer.wait_sent(room)["ok"]  # the encoder's side of the room ended too
    finally:
        for p in psutil.Process(lang.proc.pid).children(recursive=True) if lang.proc.poll() is None else []:
            p.kill()
        if lang.proc.poll() is None:
            lang.proc.kill()
        lang.proc.wait()
        peer.kill()
