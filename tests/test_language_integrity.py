"""A real `tandem language` instance under a real data-plane attack (issue 31, finding 1).

An attacker process with its own Mooncake engine (tests/transfer_peers/peer.py `reader`)
learns a language instance's embedding buffer from Mooncake's handshake and overwrites all
of it while a request is in flight: after the encoder's rows landed and before the
instance copies them out (the encoder peer holds its reports, `--hold`, so the order is
certain). The request's stream ends with DATA_LOSS and no token, every block and page is
free, and the instance serves the next request exactly. With `--tp 2` the attacker writes
rank 1's buffer only: rank 1's own check fails the room (rank 0's rows are intact).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import language_oracle as oracle
import pytest
from language_peers.prompts import make_inputs
from test_language_service import MAX_NEW, EncoderPeer, Language, drain

from tandem.v1 import common_pb2

pytestmark = pytest.mark.timeout(300)
HERE = Path(__file__).resolve().parent
_rooms = iter(range(7000, 1 << 40))


class HeldEncoder(EncoderPeer):
    """The encoder peer with `--hold`: a room's reports wait for `go(room)`."""

    def __init__(self, ckpt: Path, log: Path) -> None:
        super().__init__(ckpt, log, "--hold")

    def wait_held(self, room: int, timeout: float = 60) -> dict:
        with self._cond:
            assert self._cond.wait_for(lambda: ("held", room) in self.sent, timeout)
            return self.sent[("held", room)]

    def go(self, room: int) -> None:
        self.proc.stdin.write(json.dumps({"op": "go", "room": room}) + "\n")
        self.proc.stdin.flush()


class Attacker:
    """A process with its own Mooncake engine, driven over JSON lines."""

    def __init__(self, log: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "transfer_peers" / "peer.py"), "reader"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True)
        assert json.loads(self.proc.stdout.readline() or "{}").get("event") == "ready", log

    def tamper(self, session: str, length: int) -> dict:
        """Overwrite `length` bytes of the first buffer `session` registered (where the
        handshake says it lies) with 0x3C."""
        cmd = {"op": "tamper", "session": session, "length": length, "byte": 0x3C}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _stop(lang: Language) -> None:
    if lang.proc.poll() is None:
        lang.proc.kill()
    lang.proc.wait()


@pytest.fixture(scope="module")
def parts(checkpoint, tmp_path_factory):
    """(checkpoint, held encoder, attacker, reference tokens of prompt 3)."""
    ckpt = checkpoint("qwen2_5_vl")
    tmp = tmp_path_factory.mktemp("integrity")
    enc, attacker = HeldEncoder(ckpt, tmp / "encoder.log"), Attacker(tmp / "attacker.log")
    try:
        model, processor = oracle.load(ckpt)
        ref = oracle.generate(model, make_inputs(oracle, processor, 3), MAX_NEW[3])
        yield ckpt, enc.wait_ready(), attacker, ref[0] if isinstance(ref, tuple) else ref
    finally:
        enc.kill()
        attacker.kill()


def _attacked(lang: Language, enc: HeldEncoder, attacker: Attacker, rank: int) -> None:
    """One image chat whose rows the attacker overwrites on `rank` while held."""
    room = next(_rooms)
    call = lang.generate(room, enc.address, MAX_NEW[1])
    enc.send(room, 1)
    held = enc.wait_held(room)
    got = attacker.tamper(held["sessions"][rank], held["lengths"][rank])
    assert got["rc"] == 0, got  # the data plane is open: the write itself succeeds
    enc.go(room)
    msgs = drain(call)
    last = msgs[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_ERROR, last
    assert last.error.code == "DATA_LOSS", last.error
    if rank:
        assert f"rank {rank}" in last.error.message, last.error
    assert not [t for m in msgs for t in m.token_ids]  # no prefill ran on tampered rows
    lang.assert_all_free()


def _exact(lang: Language, enc: HeldEncoder, ref: list[int]) -> None:
    room = next(_rooms)
    call = lang.generate(room, enc.address, MAX_NEW[3])
    enc.send(room, 3)
    enc.wait_held(room)
    enc.go(room)
    assert [t for m in drain(call) for t in m.token_ids] == ref
    lang.assert_all_free()


@pytest.mark.parametrize("protect", ["mac", "encrypt"])
def test_a_foreign_write_in_flight_ends_the_request_with_data_loss(parts, tmp_path, protect):
    ckpt, enc, attacker, ref = parts
    lang = Language(ckpt, tmp_path / "language.log", "--transfer.protect", protect)
    try:
        lang.wait_ready()
        _attacked(lang, enc, attacker, rank=0)
        _exact(lang, enc, ref)  # the instance is whole
        assert lang.proc.poll() is None
    finally:
        _stop(lang)


@pytest.mark.parametrize("protect", ["mac", "encrypt"])
def test_each_tensor_parallel_rank_checks_its_own_copy(parts, tmp_path, protect):
    """Rank 1 opens its own copy (under `encrypt` it decrypts it too: the exact output
    after the attack proves both ranks' rows were the prompt's)."""
    ckpt, enc, attacker, ref = parts
    lang = Language(ckpt, tmp_path / "language.log", "--tp", "2", "--tp-timeout-s", "30",
                    "--transfer.protect", protect)
    try:
        lang.wait_ready()
        _attacked(lang, enc, attacker, rank=1)
        _exact(lang, enc, ref)
        assert lang.proc.poll() is None
    finally:
        _stop(lang)
