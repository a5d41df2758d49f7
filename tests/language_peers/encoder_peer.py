"""An encoder peer for the language service test: `encoder_peer.py CHECKPOINT`.

It plays the encoder's transfer role only: hosts `Encoder.Attach` (an EmbeddingSender over
a registered staging area) and, on command, delivers the payload of prompt i (computed
with transformers, exactly as the encoder would) into a room.

stdin  {"op": "send", "room": R, "prompt": i} | {"op": "read", "room": R} | {"op": "exit"}
stdout {"event": "ready", "address": ...} then {"event": "sent", "room", "ok", ...}
       | {"event": "read", "room": R, "nonzero": [bytes per destination], "rc": [...]}

`read` reads back, with this process's own Mooncake engine, every block the room's Init
named in every destination (each tensor-parallel rank): what any process reaching the
language instance's transfer ports could do once it learned the addresses.
`--rank0-only` plays an encoder that ignores AttachInit.ranks (writes rank 0 only).
`--hold` reports nothing of a room (no Progress, Done) until {"op": "go", "room": R}; each
written chunk first emits {"event": "held", "room": R, "sessions": [every destination's
transfer session], "lengths": [its embedding buffer's bytes]}: a test acts after the rows
landed and before the language side copies them out.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import grpc  # noqa: E402
import language_oracle as oracle  # noqa: E402
import torch  # noqa: E402
from prompts import make_inputs  # noqa: E402

from tandem.config import TransferConfig  # noqa: E402
from tandem.transfer import EmbeddingSender, MooncakeEngine, StagingArea, TransferError  # noqa: E402
from tandem.v1 import encoder_pb2_grpc  # noqa: E402


def emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class Attach(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, sender: EmbeddingSender) -> None:
        self.sender = sender
        self.inits: dict[int, object] = {}  # room -> its AttachInit (for `read`)

    async def Attach(self, request_iterator, context):  # noqa: N802
        async def recording():
            async for req in request_iterator:
                if req.WhichOneof("msg") == "init":
                    self.inits[req.init.room] = req.init
                yield req

        await self.sender.attach(recording(), context)


def read_back(engine, sink, init) -> tuple[list[int], list[int]]:
    """Nonzero bytes (and read return codes) in the Init's blocks, per destination."""
    dests = [(init.session_id, init.layout)] + [(d.session_id, d.layout) for d in init.ranks]
    nonzero, rcs = [], []
    for session, lay in dests:
        es = 4 if lay.dtype == "float32" else 2
        rows = [(lay.embeddings_addr, lay.block_size * lay.embed_dim * es),
                (lay.fill_ids_addr, lay.block_size * 4), (lay.aux_addr, 16 * 4)]
        count = 0
        for b in init.block_ids:
            for base, n in rows:
                sink[:n].fill_(0xAB)
                rcs.append(engine._te.transfer_sync_read(session, sink.data_ptr(), base + b * n, n))
                count += int(sink[:n].count_nonzero())
        nonzero.append(count)
    return nonzero, sorted(set(rcs))


async def send(sender, room: int, payload) -> None:
    try:
        stats = await sender.send(room, payload)
        emit(event="sent", room=room, ok=True, resumes=stats.resumes)
    except TransferError as e:
        emit(event="sent", room=room, ok=False, code=e.code, reason=e.reason)


async def main() -> None:
    model, processor = oracle.load(sys.argv[1])
    cfg = TransferConfig(timeout_s=10.0)
    engine = MooncakeEngine(cfg)
    staging = StagingArea(4, 512, model.config.text_config.hidden_size * (
        1 + oracle.num_deepstack(model)), dtype=model.dtype)
    staging.register(engine)
    if "--rank0-only" in sys.argv:
        import dataclasses

        import tandem.transfer.sender as sender_module

        honest = sender_module.write_round
        sender_module.write_round = lambda w: honest(dataclasses.replace(w, dests=w.dests[:1]))
    released: dict[int, threading.Event] = {}  # --hold: room -> its `go`
    if "--hold" in sys.argv:
        import dataclasses

        import tandem.transfer.sender as sender_module

        honest_round = sender_module.write_round

        def holding(w):
            go = released.setdefault(w.target.room, threading.Event())

            def on_chunk(end, tag, report=w.on_chunk):  # the writer thread: the rows landed
                emit(event="held", room=w.target.room, sessions=[d.peer for d in w.dests],
                     lengths=[d.layout.num_blocks * d.layout.embed_row_bytes for d in w.dests])
                go.wait()
                report(end, tag)

            return honest_round(dataclasses.replace(w, on_chunk=on_chunk))

        sender_module.write_round = holding
    sink = torch.zeros(1 << 20, dtype=torch.uint8)
    engine.register(sink)
    sender = EmbeddingSender(engine, staging, cfg)
    server = grpc.aio.server()
    servicer = Attach(sender)
    encoder_pb2_grpc.add_EncoderServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    emit(event="ready", address=f"127.0.0.1:{port}")
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks = set()
    while line := await reader.readline():
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "go":
            released.setdefault(cmd["room"], threading.Event()).set()
            continue
        if cmd["op"] == "read":
            nonzero, rcs = await asyncio.to_thread(
                read_back, engine, sink, servicer.inits[cmd["room"]])
            emit(event="read", room=cmd["room"], nonzero=nonzero, rc=rcs)
            continue
        payload = oracle.payload(model, make_inputs(oracle, processor, cmd["prompt"]))
        t = asyncio.create_task(send(sender, cmd["room"], payload))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
    await server.stop(0.5)


if __name__ == "__main__":
    asyncio.run(main())
