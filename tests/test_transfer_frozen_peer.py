"""A frozen peer must not stall an engine's writes to every other peer (MooncakeEngine.open).

Measured with Mooncake's non-CUDA build over TCP: the first write to a peer does the
segment handshake inside `transfer_submit_write`, and when that peer is frozen (SIGSTOP)
the handshake blocks ~60 s holding a lock that every other submit of the engine waits on,
whatever its peer. With language-0 frozen, an encoder that had not written to it yet held
every write to language-1 until the thaw. Once a peer's segment is open (`open`, which the
encoder's sender calls as soon as an Init names the peer), a write to it while it is frozen
blocks nothing else.

Three real processes: this one's engine, and two peers (each its own engine and a
registered buffer). No test here bounds a duration: the write to the live peer is waited
for under a hang guard of 30 s, which the old handshake (~60 s) overran.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent / "transfer_peers"))
from harness import make_engine  # noqa: E402

HANG_GUARD_S = 30.0

PEER = """
import sys, time, torch
from tandem.config import TransferConfig
from tandem.transfer.engine import MooncakeEngine
e = MooncakeEngine(TransferConfig())
buf = torch.zeros(1 << 20, dtype=torch.uint8)
e.register(buf)
print(e.session_id, buf.data_ptr(), flush=True)
sys.stdin.read()  # until the test closes it
"""


def _peer() -> tuple[subprocess.Popen, str, int]:
    p = subprocess.Popen([sys.executable, "-c", PEER], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True,
                         cwd=str(Path(__file__).parents[1]))
    session, addr = p.stdout.readline().split()
    return p, session, int(addr)


def test_a_frozen_peer_whose_segment_is_open_blocks_no_write_to_another():
    engine, _ = make_engine()
    src = torch.ones(1 << 20, dtype=torch.uint8)
    engine.register(src)
    live, frozen = _peer(), _peer()
    try:
        (_, live_id, live_addr), (fp, frozen_id, frozen_addr) = live, frozen
        assert engine.open(live_id) and engine.open(frozen_id)
        assert engine.open(frozen_id)  # once per peer: the second call asks nothing
        assert not engine.open("127.0.0.1:1")  # nobody there
        os.kill(fp.pid, signal.SIGSTOP)
        stuck: list = []
        writer = threading.Thread(target=lambda: stuck.extend(
            engine.submit(frozen_id, [src.data_ptr()], [frozen_addr], [1 << 20])), daemon=True)
        writer.start()
        writer.join(HANG_GUARD_S)  # NOTE: the submit itself returns at once: it is open
        assert not writer.is_alive(), "a submit to the frozen (open) peer blocked"
        done = threading.Event()

        def to_live() -> None:
            engine.wait(live_id, engine.submit(live_id, [src.data_ptr()], [live_addr], [4096]))
            done.set()

        threading.Thread(target=to_live, daemon=True).start()
        assert done.wait(HANG_GUARD_S), "a write to a live peer waited on the frozen one"
        os.kill(fp.pid, signal.SIGCONT)
        assert engine.drain(stuck)
    finally:
        for p, _, _ in (live, frozen):
            os.kill(p.pid, signal.SIGCONT)
            p.stdin.close()
            p.wait(HANG_GUARD_S)
        engine.unregister(src)
