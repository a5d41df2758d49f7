"""An encoder peer for the language service test: `encoder_peer.py CHECKPOINT`.

It plays the encoder's transfer role only: hosts `Encoder.Attach` (an EmbeddingSender over
a registered staging area) and, on command, delivers the payload of prompt i (computed
with transformers, exactly as the encoder would) into a room.

stdin  {"op": "send", "room": R, "prompt": i} | {"op": "exit"}
stdout {"event": "ready", "address": ...} then {"event": "sent", "room", "ok", ...}
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import grpc  # noqa: E402
import language_oracle as oracle  # noqa: E402
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

    async def Attach(self, request_iterator, context):  # noqa: N802
        await self.sender.attach(request_iterator, context)


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
        1 + oracle.num_deepstack(model)), dtype=model.dtype)  # fmt: skip
    staging.register(engine)
    sender = EmbeddingSender(engine, staging, cfg)
    server = grpc.aio.server()
    encoder_pb2_grpc.add_EncoderServicer_to_server(Attach(sender), server)
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
        payload = oracle.payload(model, make_inputs(oracle, processor, cmd["prompt"]))
        t = asyncio.create_task(send(sender, cmd["room"], payload))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
    await server.stop(0.5)


if __name__ == "__main__":
    asyncio.run(main())
