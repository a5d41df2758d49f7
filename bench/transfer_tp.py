"""Embeddings to every tensor-parallel rank: direct (the encoder writes each rank's buffers,
docs/architecture.md, "N destinations") vs broadcast (rank 0 receives, then sends the rows to the
other ranks over the process group, gloo here). Run by `make bench` (with the other
bench/*.py), or alone: `python bench/transfer_tp.py`; the table goes to
bench/results/transfer_tp.md.

Processes, all real: this one is the encoder (EmbeddingSender); `--role rank0` is the
language instance's rank 0 (its receiver, Mooncake engine, buffers); `--role rank1`, started
by rank 0, is rank 1 (its own engine and mirrored buffers, `WorkerBuffers`; in the same
gloo process group as rank 0). The production classes move the data: `RankBuffers` /
`WorkerBuffers` (services/language/tp/buffers.py) for direct, `dist.broadcast` for the
alternative. Each run times one prompt from the encoder's `send` to "rank 1 holds its rows"
(both ranks' clocks are the host's CLOCK_MONOTONIC).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tandem.config import TransferConfig  # noqa: E402
from tandem.transfer import (
    # noqa: E402,
    EmbeddingBuffers,
    EmbeddingReceiver,
    EmbeddingSender,
    MooncakeEngine,
    PromptPayload,
    ReceiverLimits,
    SenderState,
    StagingArea,
)

D, DTYPE, BS, POOL_BLOCKS = 3584, torch.bfloat16, 1024, 17
RUNS = int(os.environ.get("TANDEM_BENCH_RUNS", "7"))
SIZES = [int(x) for x in os.environ.get("TANDEM_BENCH_TP_SIZES", "1024,4096,16384").split(",")]
OUT = Path(__file__).parent / "results" / "transfer_tp.md"


def emit(**ev) -> None:
    sys.stdout.write(json.dumps(ev) + "\n")
    sys.stdout.flush()


def payload(n: int) -> PromptPayload:
    g = torch.Generator().manual_seed(n)
    return PromptPayload(torch.randn(n, D, generator=g).to(DTYPE),
                         torch.randint(0, 150000, (n,), generator=g, dtype=torch.int32),
                         torch.randint(0, 40000, (3, n), generator=g, dtype=torch.int32), 7)


def group(rank: int, address: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=2)


# ---- rank 1 --------------------------------------------------------------------------
def rank1(control: str, dist_address: str) -> None:
    from tandem.services.language.tp.buffers import WorkerBuffers

    engine = MooncakeEngine(TransferConfig(timeout_s=60, min_port=17000, max_port=17499))
    buffers = EmbeddingBuffers(POOL_BLOCKS, BS, D, DTYPE)
    buffers.register(engine)
    host, port = control.rsplit(":", 1)
    key = bytes.fromhex(os.environ["TANDEM_BENCH_AUTHKEY"])
    data, ctl = Client((host, int(port)), authkey=key), Client((host, int(port)), authkey=key)
    data.send_bytes(json.dumps({"session_id": engine.session_id,
                                "layout": buffers.layout().__dict__}).encode())
    WorkerBuffers(data, buffers).start()  # direct: rank 0 tells it what to copy
    group(1, dist_address)
    rows = torch.empty(POOL_BLOCKS * BS * D * 2, dtype=torch.uint8)
    while True:  # broadcast: rank 0 names the byte count, then broadcasts the rows
        try:
            n = json.loads(ctl.recv_bytes())["bytes"]
        except EOFError:
            return
        dist.broadcast(rows[:n], src=0)
        ctl.send_bytes(b"{}")


# ---- rank 0 --------------------------------------------------------------------------
async def rank0() -> None:
    import subprocess

    from tandem.services.language.tp.buffers import RankBuffers

    cfg = TransferConfig(timeout_s=60, min_port=16000, max_port=16499)
    engine = MooncakeEngine(cfg)
    direct_buf, bcast_buf = (EmbeddingBuffers(POOL_BLOCKS, BS, D, DTYPE) for _ in range(2))
    direct_buf.register(engine)
    bcast_buf.register(engine)
    authkey = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    from tandem.launch.procs import free_port

    dist_address = f"127.0.0.1:{free_port()}"
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "rank1", "--control",
         "{}:{}".format(*listener.address), "--dist", dist_address],
        env={**os.environ, "TANDEM_BENCH_AUTHKEY": authkey.hex()})
    data, ctl = listener.accept(), listener.accept()
    ready = json.loads(data.recv_bytes())
    group(0, dist_address)
    ranks = RankBuffers([data], [ready], fail=lambda why: sys.exit(f"rank 1: {why}"))
    ranks.check_mirror(direct_buf.layout())
    whole = ReceiverLimits(reserve_tokens=POOL_BLOCKS * BS)
    direct = EmbeddingReceiver(engine, direct_buf, cfg, whole, ranks=ranks)
    bcast = EmbeddingReceiver(engine, bcast_buf, cfg, whole)
    emit(event="ready")

    def broadcast(rows: torch.Tensor) -> None:
        flat = rows.contiguous().view(torch.uint8).reshape(-1)
        ctl.send_bytes(json.dumps({"bytes": flat.numel()}).encode())
        dist.broadcast(flat, src=0)
        ctl.recv_bytes()  # rank 1 holds them

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        cmd = json.loads(line)
        if cmd["mode"] == "direct":
            p = await direct.receive(cmd["room"], cmd["address"])
            t1 = time.monotonic()
            direct.release(p)
        elif cmd["mode"] == "rank0":  # the baseline: one destination, nothing for rank 1
            p = await bcast.receive(cmd["room"], cmd["address"])
            t1 = time.monotonic()
        else:
            p = await bcast.receive(cmd["room"], cmd["address"])
            await loop.run_in_executor(None, broadcast, p.input_embeds)
            t1 = time.monotonic()
        emit(event="received", t1=t1, tokens=p.num_tokens)
    child.kill()


# ---- the encoder (this process) ------------------------------------------------------
async def measure() -> list[str]:
    import grpc

    from tandem.v1 import encoder_pb2_grpc

    cfg = TransferConfig(timeout_s=60, min_port=16500, max_port=16999)
    engine = MooncakeEngine(cfg)
    staging = StagingArea(1, 16384, D, DTYPE)
    staging.register(engine)
    sender = EmbeddingSender(engine, staging, cfg)

    class Svc(encoder_pb2_grpc.EncoderServicer):
        async def Attach(self, request_iterator, context):  # noqa: N802
            await sender.attach(request_iterator, context)

    server = grpc.aio.server()
    encoder_pb2_grpc.add_EncoderServicer_to_server(Svc(), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--role", "rank0", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    assert json.loads(await proc.stdout.readline())["event"] == "ready"
    rooms = iter(range(1, 1 << 30))

    async def once(p: PromptPayload, mode: str) -> float:
        r = next(rooms)
        proc.stdin.write((json.dumps({"room": r, "address": address, "mode": mode}) + "\n").encode())
        while sender.state(r) != SenderState.WAITING_FOR_PAYLOAD:
            await asyncio.sleep(0.0005)
        t0 = time.monotonic()
        await sender.send(r, p)
        ev = json.loads(await asyncio.wait_for(proc.stdout.readline(), 120))
        assert ev["tokens"] == p.num_tokens
        return ev["t1"] - t0

    lines = ["| tokens | MiB per rank | rank 0 only ms | direct ms | broadcast ms | "
             "direct / broadcast (median per run) |", "|---|---|---|---|---|---|"]
    modes = ("direct", "broadcast", "rank0")
    for n in SIZES:
        p = payload(n)
        for mode in modes:  # warm-up
            await once(p, mode)
        t: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(RUNS):  # rotating order: drift hits all alike
            for mode in modes[i % 3:] + modes[: i % 3]:
                t[mode].append(await once(p, mode))
        ratio = statistics.median(x / y for x, y in zip(t["direct"], t["broadcast"], strict=True))
        mib = n * D * 2 / 2**20
        ms = {m: statistics.median(v) * 1e3 for m, v in t.items()}
        lines.append(f"| {n} | {mib:.1f} | {ms['rank0']:.1f} | {ms['direct']:.1f} | "
                     f"{ms['broadcast']:.1f} | {ratio:.2f} |")
        print(lines[-1], flush=True)
    proc.stdin.close()
    proc.kill()
    await proc.wait()
    await server.stop(None)
    sender.close()
    return lines


def section() -> str:
    head = ["## Tensor-parallel delivery (bench/transfer_tp.py)", "",
            f"One prompt to a `--tp 2` language instance's two ranks, width {D} x bfloat16, "
            f"block size {BS}, median of {RUNS} runs, alternating order, after a warm-up; "
            "from the encoder's `send` until rank 1 holds its rows. Direct: the Attach Init "
            "names both ranks and the encoder writes each piece to both (Mooncake TCP), each "
            "rank copies its rows out of its own blocks. Broadcast: the encoder writes rank 0 "
            "only, rank 0 copies out, then `dist.broadcast` (gloo) sends the embeddings to "
            f"rank 1. Host: {os.cpu_count()} cores (shared), load average at start "
            f"{os.getloadavg()[0]:.1f}.", ""]
    return "\n".join(head + asyncio.run(measure())) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="encoder", choices=["encoder", "rank0", "rank1"])
    ap.add_argument("--control", default="")
    ap.add_argument("--dist", default="")
    a = ap.parse_args()
    if a.role == "rank1":
        rank1(a.control, a.dist)
    elif a.role == "rank0":
        asyncio.run(rank0())
    else:
        text = section()
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(text)
        print(text)


if __name__ == "__main__":
    main()
