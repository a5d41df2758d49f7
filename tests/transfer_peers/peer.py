"""A transfer peer process: `peer.py encoder|language [options]`, driven by JSON lines.

stdin  {"op": ...} commands; stdout {"event": ...} results. First line: {"event": "ready"}.
encoder: hosts a grpc.aio server whose Encoder.Attach is an EmbeddingSender.
    send {room, tokens, seed, deadline_s?}   -> sent {room, ok, resumes|code, reason}
    stream_send {room, tokens, seed, first}  -> sent ...: a streamed payload whose rows
        [0, first) are final; rows {room, rows} makes more of them final
    cancel {room}
language: an EmbeddingReceiver over its own buffers.
    receive {room, address, deadline_s?}     -> received {room, ok, digest, tokens|code, reason}
    abort {room}, reattach {room, address}
both: stats -> stats {free, total, rooms}; exit
reader: an outsider with its own Mooncake engine, reading others' registered memory.
    read {session, addr, length, hex?}       -> read {rc, nonzero, hex?: the bytes read}
    tamper {session, length, byte}           -> tampered {addr, rc}: learns the address of
        the segment's first registered buffer (a language instance's embeddings) from
        Mooncake's own handshake and overwrites `length` bytes of it with `byte`
    tamper_loop {session, length, byte}      -> tampering: the same overwrite, again and
        again, from a thread, until tamper_stop -> tamper_stopped {addr, passes, rc}
A rogue encoder (`--rogue-generation-delta`, `--rogue-room-xor`) speaks the protocol but
labels its writes with another generation or room, as a stale or misdirected writer does.
`--hold`: the encoder reports nothing of a room (no Progress, Done) until `go {room}`;
each written chunk first emits held {room, end, sessions} (every destination's session):
a test acts between the write landing and the language side's copy-out, deterministically.
`--protect`: both roles' TransferConfig.protect.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpc  # noqa: E402
from harness import Attach  # noqa: E402
from peerlib import digest, emit, make_payload  # noqa: E402

from tandem.config import TransferConfig  # noqa: E402
from tandem.transfer import (
    # noqa: E402,
    EmbeddingBuffers,
    EmbeddingReceiver,
    EmbeddingSender,
    MooncakeEngine,
    ReceiverLimits,
    StagingArea,
    TransferError,
)
from tandem.transfer.buffers import DTYPES  # noqa: E402
from tandem.transfer.payload import ImageSpan, PromptInfo, RowWatermark  # noqa: E402
from tandem.v1 import encoder_pb2_grpc  # noqa: E402


def _deadline(cmd) -> float | None:
    return time.time() + cmd["deadline_s"] if cmd.get("deadline_s") else None


async def _report(kind: str, room: int, coro, extra) -> None:
    asyncio.current_task().started = True
    try:
        res = await coro
        emit(event=kind, room=room, ok=True, **extra(res))
    except TransferError as e:
        emit(event=kind, room=room, ok=False, code=e.code, reason=e.reason)
    except asyncio.CancelledError:
        emit(event=kind, room=room, ok=False, code="CANCELLED", reason="task cancelled")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["encoder", "language", "reader"])
    ap.add_argument("--embed-dim", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--timeout-s", type=float, default=3.0)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--slot-tokens", type=int, default=256)
    ap.add_argument("--chunk-tokens", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reserve", type=int, default=64)
    ap.add_argument("--grace", type=float, default=0.0)
    ap.add_argument("--rogue-generation-delta", type=int, default=0)
    ap.add_argument("--rogue-room-xor", type=int, default=0)
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--protect", default="mac")
    a = ap.parse_args()
    if a.rogue_generation_delta or a.rogue_room_xor:
        import dataclasses

        import tandem.transfer.sender as sender_module

        honest = sender_module.write_round
        sender_module.write_round = lambda w: honest(dataclasses.replace(
            w, target=dataclasses.replace(
                w.target, generation=w.target.generation + a.rogue_generation_delta,
                room=w.target.room ^ a.rogue_room_xor)))
    released: dict[int, threading.Event] = {}  # --hold: room -> its `go`
    if a.hold:
        import dataclasses

        import tandem.transfer.sender as sender_module

        honest_round = sender_module.write_round

        def holding(w):
            go = released.setdefault(w.target.room, threading.Event())

            def on_chunk(end, tag, report=w.on_chunk):  # the writer thread: the rows landed
                emit(event="held", room=w.target.room, end=end, sessions=[d.peer for d in w.dests])
                go.wait()
                report(end, tag)

            return honest_round(dataclasses.replace(w, on_chunk=on_chunk))

        sender_module.write_round = holding
    cfg = TransferConfig(timeout_s=a.timeout_s, protect=a.protect)
    engine = MooncakeEngine(cfg)
    dtype = DTYPES[a.dtype]
    tasks: dict[int, asyncio.Task] = {}
    streams: dict[int, RowWatermark] = {}  # streamed payloads' watermarks, by room
    loop = asyncio.get_running_loop()
    if a.role == "encoder":
        staging = StagingArea(a.slots, a.slot_tokens, a.embed_dim, dtype)
        staging.register(engine)
        sender = EmbeddingSender(engine, staging, cfg, chunk_tokens=a.chunk_tokens)
        server = grpc.aio.server()
        encoder_pb2_grpc.add_EncoderServicer_to_server(Attach(sender), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        regions = [(t.data_ptr(), t.numel() * t.element_size())
                   for t in (staging.embeds, staging.fill, staging.mrope, staging.aux)]
        emit(event="ready", address=f"127.0.0.1:{port}", session=engine.session_id,
             staging=regions)
    elif a.role == "reader":
        import torch

        sink = torch.zeros(1 << 20, dtype=torch.uint8)
        engine.register(sink)
        emit(event="ready", session=engine.session_id)
    else:
        buffers = EmbeddingBuffers(a.blocks, a.block_size, a.embed_dim, dtype)
        buffers.register(engine)
        receiver = EmbeddingReceiver(engine, buffers, cfg, ReceiverLimits(
            reserve_tokens=a.reserve, reattach_grace_s=a.grace))
        alloc = receiver.allocator
        emit(event="ready", session=engine.session_id)

    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        cmd = json.loads(line)
        op, room = cmd["op"], cmd.get("room", 0)
        if op == "exit":
            break
        if op == "send":
            p = make_payload(cmd["tokens"], a.embed_dim, a.dtype, cmd["seed"])
            tasks[room] = asyncio.create_task(_report(
                "sent", room, sender.send(room, p, _deadline(cmd)),
                extra=lambda s: {"resumes": s.resumes, "bytes": s.bytes}))
        elif op == "stream_send":  # streamed rows: [0, first) final now, the rest on "rows"
            p = make_payload(cmd["tokens"], a.embed_dim, a.dtype, cmd["seed"])
            p.arrived = streams[room] = RowWatermark(p.num_tokens)
            p.arrived.advance(cmd["first"])
            tasks[room] = asyncio.create_task(_report(
                "sent", room, sender.send(room, p, _deadline(cmd)),
                extra=lambda s: {"resumes": s.resumes, "bytes": s.bytes}))
        elif op == "rows":  # more of a streamed payload's rows are final
            streams[room].advance(cmd["rows"])
        elif op == "announce_send":  # cache-aware: announce, then send only the rest
            p = make_payload(cmd["tokens"], a.embed_dim, a.dtype, cmd["seed"])
            info = PromptInfo(p.fill_ids.tolist(), [ImageSpan(*im) for im in cmd["images"]])

            async def announce_send(room=room, p=p, info=info, cmd=cmd):
                cached = await sender.announce(room, info, _deadline(cmd))
                stats = await sender.send(room, p.rows_from(cached), _deadline(cmd))
                stats.cached = cached
                return stats

            tasks[room] = asyncio.create_task(_report(
                "sent", room, announce_send(),
                extra=lambda s: {"resumes": s.resumes, "bytes": s.bytes, "cached": s.cached}))
        elif op == "receive":
            tasks[room] = asyncio.create_task(_report(
                "received", room, receiver.receive(room, cmd["address"], _deadline(cmd)),
                extra=lambda p: {"digest": digest(p), "tokens": p.num_tokens}))
        elif op == "cancel":
            task = tasks[room]
            if task.cancel() and not getattr(task, "started", False):  # never ran: say so
                emit(event="sent", room=room, ok=False, code="CANCELLED", reason="never started")
        elif op == "abort":
            emit(event="aborted", room=room, found=receiver.abort(room))
        elif op == "read":  # NOTE: the raw engine: what any process with Mooncake can do
            n = cmd["length"]
            sink[:n].fill_(0xAB)
            rc = await asyncio.to_thread(engine._te.transfer_sync_read, cmd["session"],
                                         sink.data_ptr(), cmd["addr"], n)
            extra = {"hex": sink[:n].numpy().tobytes().hex()} if cmd.get("hex") else {}
            emit(event="read", rc=rc, nonzero=int(sink[:n].count_nonzero()), **extra)
        elif op == "tamper":  # the handshake names the first registered buffer, then write
            te, session = engine._te, cmd["session"]
            addr = await asyncio.to_thread(te.get_first_buffer_address, session)
            rc, step = 0, sink.numel()
            sink.fill_(cmd["byte"])
            for off in range(0, cmd["length"], step):
                n = min(step, cmd["length"] - off)
                rc = rc or await asyncio.to_thread(te.transfer_sync_write, session,
                                                   sink.data_ptr(), addr + off, n)
            emit(event="tampered", addr=addr, rc=rc)
        elif op == "tamper_loop":  # the same write, over and over, until tamper_stop
            stop_tamper = threading.Event()

            def overwrite_until_stopped(te=engine._te, session=cmd["session"],
                                        length=cmd["length"], byte=cmd["byte"],
                                        stop=stop_tamper) -> dict:
                addr, passes, step = te.get_first_buffer_address(session), 0, sink.numel()
                sink.fill_(byte)
                while not stop.is_set():
                    for off in range(0, length, step):
                        rc = te.transfer_sync_write(session, sink.data_ptr(), addr + off,
                                                    min(step, length - off))
                        if rc:
                            return {"addr": addr, "passes": passes, "rc": rc}
                    passes += 1
                return {"addr": addr, "passes": passes, "rc": 0}

            tamper_loop = (stop_tamper, asyncio.create_task(
                asyncio.to_thread(overwrite_until_stopped)))
            emit(event="tampering")
        elif op == "tamper_stop":
            stop_tamper, task = tamper_loop
            stop_tamper.set()
            emit(event="tamper_stopped", **await task)
        elif op == "go":
            released.setdefault(room, threading.Event()).set()
        elif op == "reattach":
            emit(event="reattached", room=room, ok=receiver.reattach(room, cmd["address"]))
        elif op == "stats":
            if a.role == "encoder":
                emit(event="stats", rooms=list(sender.rooms), free=staging.num_free,
                     total=staging.slots, states={k: v.state.value for k, v in sender.rooms.items()})
            else:
                emit(event="stats", rooms=list(receiver.rooms), free=alloc.num_free,
                     total=alloc.num_total, owners=[str(o) for o in alloc.owners],
                     states={k: v.state.value for k, v in receiver.rooms.items()})


if __name__ == "__main__":
    asyncio.run(main())
