"""Test-side helpers: a peer process driven over JSON lines, and in-process endpoints."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import grpc

from tandem.config import TransferConfig
from tandem.transfer import (
    EmbeddingBuffers,
    EmbeddingReceiver,
    EmbeddingSender,
    MooncakeEngine,
    ReceiverLimits,
    StagingArea,
)
from tandem.transfer.buffers import DTYPES
from tandem.v1 import encoder_pb2_grpc

HERE = Path(__file__).resolve().parent


class Peer:
    """A peer.py process; `events` collects its stdout lines as dicts."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.proc, self.log, self.events = proc, log, []
        self._cond = asyncio.Condition()
        self._task = asyncio.create_task(self._pump())
        self.ready: dict = {}

    @classmethod
    async def start(cls, role: str, tmp: Path, env: dict | None = None, **opts) -> Peer:
        args = [sys.executable, str(HERE / "peer.py"), role]
        for k, v in opts.items():  # `flag=True` passes a bare --flag
            args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
        log = tmp / f"{role}-{os.urandom(3).hex()}.log"
        proc = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=open(log, "wb"), env={**os.environ, "MC_TRANSFER_TIMEOUT": "5", **(env or {})})
        peer = cls(proc, log)
        peer.ready = await peer.wait(lambda e: e["event"] == "ready", 60)
        return peer

    async def _pump(self) -> None:
        while line := await self.proc.stdout.readline():
            async with self._cond:
                self.events.append(json.loads(line))
                self._cond.notify_all()

    def send(self, **cmd) -> None:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())

    async def wait(self, pred, timeout: float = 30.0) -> dict:
        async def find():
            async with self._cond:
                while True:
                    for e in self.events:
                        if pred(e):
                            self.events.remove(e)
                            return e
                    if self.proc.returncode is not None and self._task.done():
                        raise RuntimeError(f"peer exited; log: {self.log.read_text()[-2000:]}")
                    await self._cond.wait()
        return await asyncio.wait_for(find(), timeout)

    async def stats(self) -> dict:
        self.send(op="stats")
        return await self.wait(lambda e: e["event"] == "stats")

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            try:  # NOTE: SIGKILL ends a stopped process too; never SIGCONT a frozen writer
                self.proc.kill()
            except ProcessLookupError:
                pass
        await self.proc.wait()
        self._task.cancel()


class Attach(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, sender: EmbeddingSender) -> None:
        self.sender = sender

    async def Attach(self, request_iterator, context):  # noqa: N802
        await self.sender.attach(request_iterator, context)


_ENGINE: list[MooncakeEngine] = []
_REGISTERED: list = []  # buffers / staging areas to unregister when a test ends


def release_all() -> None:
    while _REGISTERED:
        _REGISTERED.pop().unregister()


def make_engine(timeout_s: float = 3.0) -> tuple[MooncakeEngine, TransferConfig]:
    """This process's one Mooncake engine (shared by the test modules) and a room config."""
    cfg = TransferConfig(timeout_s=timeout_s)
    if not _ENGINE:
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")
        _ENGINE.append(MooncakeEngine(cfg))
    return _ENGINE[0], cfg


def make_receiver(engine, cfg, blocks=64, block_size=16, embed_dim=32, dtype="float32",
                  reserve=64, grace=0.0, registry=None) -> EmbeddingReceiver:
    buffers = EmbeddingBuffers(blocks, block_size, embed_dim, DTYPES[dtype])
    buffers.register(engine)
    _REGISTERED.append(buffers)
    return EmbeddingReceiver(engine, buffers, cfg,
                             ReceiverLimits(reserve_tokens=reserve, reattach_grace_s=grace),
                             registry=registry)


async def start_sender(engine, cfg, slots=2, slot_tokens=256, embed_dim=32, dtype="float32",
                       chunk_tokens=32):
    staging = StagingArea(slots, slot_tokens, embed_dim, DTYPES[dtype])
    staging.register(engine)
    _REGISTERED.append(staging)
    sender = EmbeddingSender(engine, staging, cfg, chunk_tokens=chunk_tokens)
    server = grpc.aio.server()
    encoder_pb2_grpc.add_EncoderServicer_to_server(Attach(sender), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return sender, server, f"127.0.0.1:{port}"
