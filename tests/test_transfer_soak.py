"""Soak: 200 rooms through one encoder process -> language (this process) pair, random
sizes, a random tenth aborted, cancelled or timed out midway on either side. Every
success is bit-exact; at the end no block, staging slot or room-table entry is left."""

from __future__ import annotations

import asyncio
import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "transfer_peers"))
from harness import Peer, make_engine, make_receiver, release_all  # noqa: E402
from peerlib import digest, make_payload  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from waiting import async_wait_until  # noqa: E402

from tandem.transfer import TransferError  # noqa: E402

FAULTS = ["abort", "cancel", "no_send", "encoder_cancel", "no_attach"]


@pytest.mark.asyncio
async def test_soak_200_rooms(tmp_path):
    seed = int(os.environ.get("TANDEM_SOAK_SEED", "1234"))
    rng = random.Random(seed)
    enc = await Peer.start("encoder", tmp_path, timeout_s=1.0, slots=2, slot_tokens=128)
    engine, cfg = make_engine(timeout_s=1.0)
    rx = make_receiver(engine, cfg, blocks=48, block_size=16, reserve=64)
    addr = enc.ready["address"]
    gate = asyncio.Semaphore(8)
    outcome: dict[str, int] = {}

    async def one(room: int) -> None:
        n = rng.randint(1, 400)
        fault = rng.choice(FAULTS) if rng.random() < 0.1 else None
        delay = rng.uniform(0, 0.01)
        async with gate:
            task = None
            if fault != "no_attach":
                task = asyncio.create_task(rx.receive(room, addr))
            if fault != "no_send":
                enc.send(op="send", room=room, tokens=n, seed=room)
            if fault in ("abort", "cancel", "encoder_cancel"):
                await asyncio.sleep(delay)
                if fault == "abort":
                    rx.abort(room)
                elif fault == "cancel":
                    task.cancel()
                else:
                    enc.send(op="cancel", room=room)
            try:
                if task is not None:
                    done, _ = await asyncio.wait({task}, timeout=30)
                    assert done, (f"room {room} ({n} tokens, fault {fault}) stuck in "
                                  f"{rx.state(room)}; encoder: {await enc.stats()}")
                    got = task.result()
                    assert digest(got) == digest(make_payload(n, 32, "float32", room)), room
                    key = "ok"
                else:
                    key = "skipped"
            except (TransferError, asyncio.CancelledError) as e:
                assert fault is not None, f"room {room} ({n} tokens) failed: {e!r}"
                key = getattr(e, "code", "CANCELLED")
            outcome[key] = outcome.get(key, 0) + 1
            if fault != "no_send":
                try:
                    sent = await enc.wait(lambda e: e["event"] == "sent" and e["room"] == room, 30)
                except asyncio.TimeoutError:
                    raise AssertionError(f"encoder never ended room {room} ({n} tokens, fault "
                                         f"{fault}): {await enc.stats()}") from None
                assert sent["ok"] or fault is not None, sent

    try:
        await asyncio.gather(*[one(room) for room in range(1, 201)])
        assert outcome.get("ok", 0) >= 170, outcome
        assert not rx.rooms and not rx.allocator.owners
        assert rx.allocator.num_free == rx.allocator.num_total
        last = {}

        async def enc_clean() -> bool:
            last["stats"] = st = await enc.stats()
            return not st["rooms"] and st["free"] == st["total"]

        await async_wait_until(enc_clean, timeout_s=60, what="the encoder's rooms and slots free",
                               state=lambda: last.get("stats"))
    finally:
        await enc.stop()
        await rx.close()
        release_all()
