"""Transfer benchmark: two real processes over Mooncake TCP (run by `make bench`).

This process is the encoder (EmbeddingSender + StagingArea); a child process started
from this same file (`--role language`) is the language side (EmbeddingReceiver over
block buffers, plus a raw-bytes gRPC sink). Width 3584 x bfloat16 (a 7B-class model).

  1. prompt sizes 1K/4K/8K/16K: our Attach transfer end to end (Init already sent ->
     payload gathered out on the language side) vs one raw Mooncake transfer_sync_write
     of the same byte count, vs the same bytes as a gRPC byte stream.
  2. resume: 10K/20K/32K into an 8K reservation vs the same size reserved up front.
  3. protection (--transfer.protect): the same transfers with `none`, `mac` (the default,
     and what 1-2 run with) and `encrypt`, interleaved; and per reported range (one chunk)
     of 256/2048/16384 tokens, the cost of each side's work alone: tags over the payload
     (encoder), decrypt + verify of the private copy (language), against the staging copy.
Median of RUNS runs after a warm-up; tables printed and written to bench/results/transfer.md
(TANDEM_BENCH_PARTS=main,resume,protect picks parts; a subset writes transfer-<parts>.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import grpc
import torch

from tandem.config import TransferConfig
from tandem.transfer import (
    EmbeddingBuffers,
    EmbeddingReceiver,
    EmbeddingSender,
    MooncakeEngine,
    PromptPayload,
    SenderState,
    StagingArea,
)
from tandem.transfer.buffers import RowProtection, open_range
from tandem.transfer.staging import PieceTarget, tag_range

D, DTYPE, BS = 3584, torch.bfloat16, 1024
POOL_BLOCKS, SLOT_TOKENS = 32, 16384
RUNS = int(os.environ.get("TANDEM_BENCH_RUNS", "7"))
CHUNK = 4 << 20  # gRPC message size for the byte stream
PIPE_TOKENS = int(os.environ.get("TANDEM_BENCH_CHUNK_TOKENS", "2048"))  # write batch size
SIZES = [int(x) for x in os.environ.get("TANDEM_BENCH_SIZES", "1024,4096,8192,16384").split(",")]
ALL_PARTS = ["main", "resume", "protect"]
PARTS = os.environ.get("TANDEM_BENCH_PARTS", ",".join(ALL_PARTS)).split(",")
if os.environ.get("TANDEM_BENCH_RESUME") == "0" and "resume" in PARTS:  # the older knob
    PARTS.remove("resume")
OUT = Path(__file__).parent / "results" / (
    "transfer.md" if PARTS == ALL_PARTS else f"transfer-{'-'.join(PARTS)}.md")
MODES = ["none", "mac", "encrypt"]
RANGE_TOKENS = [256, 2048, 16384]
GRPC_OPTS = [("grpc.max_receive_message_length", 2 * CHUNK),
             ("grpc.max_send_message_length", 2 * CHUNK)]


def emit(**ev) -> None:
    sys.stdout.write(json.dumps(ev) + "\n")
    sys.stdout.flush()


def payload(n: int, seed: int) -> PromptPayload:
    g = torch.Generator().manual_seed(seed)
    return PromptPayload(torch.randn(n, D, generator=g).to(DTYPE),
                         torch.randint(0, 150000, (n,), generator=g, dtype=torch.int32),
                         torch.randint(0, 40000, (3, n), generator=g, dtype=torch.int32), 7)


# ---- language side (child process) -------------------------------------------------
async def language() -> None:
    cfg = TransferConfig(timeout_s=60, min_port=16000, max_port=16499)
    engine = MooncakeEngine(cfg)
    buffers = EmbeddingBuffers(POOL_BLOCKS, BS, D, DTYPE)
    buffers.register(engine)
    rx = EmbeddingReceiver(engine, buffers, cfg)
    sink = torch.empty(POOL_BLOCKS * BS * (D * 2 + 16), dtype=torch.uint8).zero_()

    async def put(request_iterator, context):
        off = 0
        async for chunk in request_iterator:
            sink[off : off + len(chunk)].copy_(torch.frombuffer(chunk, dtype=torch.uint8))
            off += len(chunk)
        return off.to_bytes(8, "little")

    server = grpc.aio.server(options=GRPC_OPTS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "tandem.bench.Sink", {"Put": grpc.stream_unary_rpc_method_handler(put)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    emit(event="ready", session=engine.session_id, sink=f"127.0.0.1:{port}",
         embeddings_addr=buffers.embeddings.data_ptr())

    async def receive(cmd) -> None:
        rx.reserve_tokens, rx.resume_tokens = cmd["reserve"], cmd.get("resume_tokens")
        rx.config = cfg.model_copy(update={"protect": cmd["protect"]})  # what the Init asks
        p = await rx.receive(cmd["room"], cmd["address"])
        emit(event="received", room=cmd["room"], t1=time.monotonic(),
             fill_sum=int(p.fill_ids.sum()), tokens=p.num_tokens)

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks = set()
    while line := await reader.readline():
        t = asyncio.create_task(receive(json.loads(line)))
        tasks.add(t)
        t.add_done_callback(tasks.discard)


# ---- encoder side (this process) ---------------------------------------------------
class Child:
    def __init__(self, proc) -> None:
        self.proc, self.events = proc, asyncio.Queue()
        self.pump = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        while line := await self.proc.stdout.readline():
            self.events.put_nowait(json.loads(line))

    def send(self, **cmd) -> None:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())

    async def next(self) -> dict:
        return await asyncio.wait_for(self.events.get(), 120)


async def until(pred) -> None:
    while not pred():
        await asyncio.sleep(0.0005)


async def encoder() -> str:
    # the encoder's floor is `none`: each room's protection is the one its Init asks for
    cfg = TransferConfig(timeout_s=60, min_port=16500, max_port=16999, protect="none")
    engine = MooncakeEngine(cfg)
    staging = StagingArea(1, SLOT_TOKENS, D, DTYPE)
    staging.register(engine)
    raw_src = torch.empty(SLOT_TOKENS * (D * 2 + 64), dtype=torch.uint8).fill_(1)
    engine.register(raw_src)
    sender = EmbeddingSender(engine, staging, cfg, chunk_tokens=PIPE_TOKENS)
    server = grpc.aio.server()
    from tandem.v1 import encoder_pb2_grpc

    class Svc(encoder_pb2_grpc.EncoderServicer):
        async def Attach(self, request_iterator, context):  # noqa: N802
            await sender.attach(request_iterator, context)

    encoder_pb2_grpc.add_EncoderServicer_to_server(Svc(), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--role", "language", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    child = Child(proc)
    ready = await child.next()
    peer, dst = ready["session"], ready["embeddings_addr"]
    channel = grpc.aio.insecure_channel(ready["sink"], options=GRPC_OPTS)
    put = channel.stream_unary("/tandem.bench.Sink/Put")
    room = iter(range(1, 1 << 30))
    last_send_s: list[float] = []  # encoder side: first write to Done on the stream

    async def ours(p: PromptPayload, reserve: int, resume_tokens=None, protect: str = "mac"
                   ) -> tuple[float, int, int]:
        r = next(room)
        child.send(room=r, address=address, reserve=reserve, resume_tokens=resume_tokens,
                   protect=protect)
        await until(lambda: sender.state(r) == SenderState.WAITING_FOR_PAYLOAD)
        t0 = time.monotonic()
        stats = await sender.send(r, p)
        ev = await child.next()
        assert ev["fill_sum"] == int(p.fill_ids.sum()) and ev["tokens"] == p.num_tokens
        last_send_s.append(stats.seconds)
        return ev["t1"] - t0, stats.bytes, stats.resumes

    def raw(nbytes: int) -> float:
        t0 = time.monotonic()
        engine.raw_write(peer, raw_src.data_ptr(), dst, nbytes)
        return time.monotonic() - t0

    async def grpc_bytes(p: PromptPayload) -> float:
        t0 = time.monotonic()
        views = [memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")
                 for t in (p.input_embeds, p.fill_ids, p.mrope_positions)]

        async def chunks():
            for v in views:
                for i in range(0, len(v), CHUNK):
                    yield bytes(v[i : i + CHUNK])
        n = int.from_bytes(await put(chunks()), "little")
        assert n == sum(len(v) for v in views)
        return time.monotonic() - t0

    def med(xs) -> float:
        return statistics.median(xs) * 1e3

    lines = ["## Transfer (bench/transfer.py)", "",
             f"Two processes on one host, Mooncake TCP over loopback, width {D} x bfloat16, "
             f"block size {BS}, median of {RUNS} runs after a warm-up. Host: "
             f"{os.cpu_count()} cores, load average at start {os.getloadavg()[0]:.1f} "
             "(shared); single runs vary by tens of percent."]
    if "main" in PARTS:
        lines += await main_tables(ours, raw, grpc_bytes, last_send_s, staging, med)
    if "resume" in PARTS:
        lines += await resume_table(ours, med)
    if "protect" in PARTS:
        lines += await protect_tables(ours, staging, med)
    proc.kill()
    await proc.wait()
    await channel.close()
    await server.stop(None)
    return "\n".join(lines) + "\n"


async def main_tables(ours, raw, grpc_bytes, last_send_s, staging, med) -> list[str]:
    lines = ["", "Ours is end to end (`--transfer.protect mac`, the default): Init already "
             "sent -> staging copy -> chunked async writes (sleep-polled) -> Done -> payload "
             "gathered out and verified on the language side. Raw is one `transfer_sync_write` "
             "of the same byte count between registered buffers. gRPC is the same bytes "
             "(embeddings, fill ids, positions) as a 4 MiB-chunk byte stream into a "
             "preallocated buffer. Ratios are medians of per-run ratios (the three are measured "
             "back to back in each run). NOTE: raw `transfer_sync_write` busy-polls a core while "
             "it waits; ours sleep-polls, which on this 2-core host is worth more than the "
             "copies ours adds.", "",
             "| tokens | bytes | ours ms | ours GB/s | raw ms | raw GB/s | ours / raw "
             "throughput | gRPC ms | gRPC time / ours |",
             "|---|---|---|---|---|---|---|---|---|"]
    ours_ms: dict[int, float] = {}
    send_ms: dict[int, float] = {}
    raw_ms: dict[int, float] = {}
    for n in SIZES:
        p = payload(n, n)
        await ours(p, n), raw(1 << 20), await grpc_bytes(p)  # warm-up
        o, rw, gr, nbytes = [], [], [], 0
        last_send_s.clear()
        for _ in range(RUNS):
            t, nbytes, _r = await ours(p, n)
            o.append(t)
            rw.append(raw(nbytes))
            gr.append(await grpc_bytes(p))
        ours_ms[n], raw_ms[n] = med(o), med(rw)
        send_ms[n] = med(last_send_s[1:])
        # Ratios are medians of per-run ratios (each run measures all three back to back),
        # which holds up better than a ratio of medians on a shared, noisy host.
        r_raw = statistics.median(b / a for a, b in zip(o, rw, strict=True))
        r_grpc = statistics.median(b / a for a, b in zip(o, gr, strict=True))
        lines.append(f"| {n} | {nbytes / 2**20:.1f} MiB | {med(o):.1f} | {nbytes / med(o) / 1e6:.2f} | "
                     f"{med(rw):.1f} | {nbytes / med(rw) / 1e6:.2f} | {r_raw:.2f} | "
                     f"{med(gr):.1f} | {r_grpc:.2f} |")
        print(lines[-1], flush=True)
    # Where the time goes: the two copies raw Mooncake does not make, timed alone here.
    local = EmbeddingBuffers(SLOT_TOKENS // BS, BS, D, DTYPE)
    lines += ["", "Where the time goes (same run, each step alone, median): staging copy "
              "(payload -> registered staging rows) and gather (blocks -> payload tensors) are "
              "the copies a raw write does not make; the writes are pipelined with them in "
              f"chunks of {PIPE_TOKENS} tokens.", "",
              "| tokens | staging copy ms | raw write ms | gather ms | copies + write ms | "
              "ours: encoder writes ms | ours: total ms |",
              "|---|---|---|---|---|---|---|"]
    for n, o_ms in ours_ms.items():
        p = payload(n, n)
        ids = list(range(-(-n // BS)))
        layout = local.layout()
        out = (torch.empty(n, D, dtype=DTYPE), torch.empty(n, dtype=torch.int32),
               torch.empty(3, n, dtype=torch.int32))
        st, ga = [], []
        for _ in range(RUNS):
            t0 = time.monotonic()
            staging.stage(0, p, PieceTarget(1, 1, ids, 0, n), layout, 0, n)
            st.append(time.monotonic() - t0)
            t0 = time.monotonic()
            local.gather_into(ids, n, *out, 0)
            ga.append(time.monotonic() - t0)
        w = raw_ms[n]
        lines.append(f"| {n} | {med(st):.1f} | {w:.1f} | {med(ga):.1f} | "
                     f"{med(st) + w + med(ga):.1f} | {send_ms[n]:.1f} | {o_ms:.1f} |")
        print(lines[-1], flush=True)
    return lines


async def resume_table(ours, med) -> list[str]:
    lines = ["", "Resume: an 8K reservation; `rest` reserves everything left at the first "
             "Resume (the default), `8K` reserves 8K per Resume (the seed's schedule). "
             "Baseline: the same prompt with its whole length reserved up front.", "",
             "| tokens | policy | resumes | ms | no-resume ms | ratio (median per run) |",
             "|---|---|---|---|---|---|"]
    for n in (10240, 20480, 32768):
        p = payload(n, n)
        await ours(p, n), await ours(p, 8192), await ours(p, 8192, 8192)  # warm-up
        base, rest, k8 = [], [], []
        for _ in range(RUNS):  # interleaved: load drift hits all three alike
            base.append((await ours(p, n))[0])
            rest.append(await ours(p, 8192))
            k8.append(await ours(p, 8192, 8192))
        for policy, runs in (("rest", rest), ("8K", k8)):
            ratio = statistics.median(r[0] / b for r, b in zip(runs, base, strict=True))
            lines.append(f"| {n} | {policy} | {runs[0][2]} | {med([r[0] for r in runs]):.1f} | "
                         f"{med(base):.1f} | {ratio:.2f} |")
            print(lines[-1], flush=True)
    return lines


async def protect_tables(ours, staging: StagingArea, med) -> list[str]:
    lines = ["", "Protection (`--transfer.protect`): the same end-to-end transfer with each "
             "mode, interleaved run by run; ratio = median of per-run ratios to `none`.", "",
             "| tokens | none ms | mac ms | encrypt ms | mac / none | encrypt / none |",
             "|---|---|---|---|---|---|"]
    for n in SIZES:
        p = payload(n, n)
        for m in MODES:  # warm-up
            await ours(p, n, protect=m)
        runs: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(RUNS):
            for m in MODES:
                runs[m].append((await ours(p, n, protect=m))[0])
        ratio = {m: statistics.median(a / b for a, b in zip(runs[m], runs["none"], strict=True))
                 for m in MODES}
        lines.append(f"| {n} | {med(runs['none']):.1f} | {med(runs['mac']):.1f} | "
                     f"{med(runs['encrypt']):.1f} | {ratio['mac']:.2f} | {ratio['encrypt']:.2f} |")
        print(lines[-1], flush=True)
    lines += ["", "Per reported range (one chunk; the sender's default is 2048 tokens), each "
              "side's work alone, one thread, median: `copy` is the staging copy the sender "
              "makes anyway (payload -> registered staging rows, plaintext); `tag` the "
              "sender's Poly1305 tags over the payload rows; `verify` the receiver's over its "
              "private copy; `seal`/`open` the encrypt mode's whole work per side (ChaCha20 "
              "into staging + tags / decrypt in place + verify). GB/s of the range's bytes.", "",
              "| tokens | MiB | copy ms | tag ms (GB/s) | verify ms (GB/s) | seal ms (GB/s) "
              "| open ms (GB/s) |", "|---|---|---|---|---|---|---|"]
    for n in RANGE_TOKENS:
        p = payload(n, n)
        nbytes = sum(t.numel() * t.element_size()
                     for t in (p.input_embeds, p.fill_ids, p.mrope_positions))
        ms = range_costs(staging, p)
        row = [f"{ms['copy']:.2f}"] + [f"{ms[k]:.2f} ({nbytes / ms[k] / 1e6:.1f})"
                                       for k in ("tag", "verify", "seal", "open")]
        lines.append(f"| {n} | {nbytes / 2**20:.1f} | " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    return lines


def range_costs(staging: StagingArea, p: PromptPayload) -> dict[str, float]:
    """Median ms of each side's work on one range (the whole of `p`, one staging round)."""
    n = p.num_tokens
    bs = min(n, 1024)
    dest = EmbeddingBuffers(-(-n // bs), bs, D, DTYPE)  # only its layout is used
    ids, nb = list(range(dest.num_blocks)), dest.num_blocks
    mac, enc = RowProtection.new("mac").seal(1, 1, 0, n), RowProtection.new("encrypt").seal(1, 1, 0, n)
    out = (torch.empty(n, D, dtype=DTYPE), torch.empty(n, dtype=torch.int32),
           torch.empty(3, n, dtype=torch.int32))
    times: dict[str, list[float]] = {k: [] for k in ("copy", "tag", "verify", "seal", "open")}

    @contextlib.contextmanager
    def timed(key: str):
        t0 = time.monotonic()
        yield
        times[key].append(time.monotonic() - t0)

    for _ in range(RUNS + 1):  # the first is a warm-up, dropped below
        with timed("copy"):
            staging.stage(0, p, PieceTarget(1, 1, ids, 0, n), dest.layout(), 0, n)
        aux = staging.aux[0][:nb].clone()
        with timed("tag"):
            mac_tag = mac.tag(p.input_embeds, p.fill_ids, p.mrope_positions, aux)
        for t, src in zip(out, (p.input_embeds, p.fill_ids, p.mrope_positions), strict=True):
            t.copy_(src)  # the receiver's private copy (plaintext under mac)
        with timed("verify"):
            open_range(mac, mac_tag, *out, aux)
        with timed("seal"):
            _, aux = staging.stage(0, p, PieceTarget(1, 1, ids, 0, n), dest.layout(), 0, n, seal=enc)
            enc_tag = tag_range(enc, p, 0, n, aux)
        out[0].copy_(staging.embeds[0][:n])  # ciphertext, as it lands
        out[1].copy_(staging.fill[0][:n])
        for k in range(3):  # (staged per block; the same ciphertext in token order)
            enc.encrypt_into(2 + k, p.mrope_positions[k], out[2][k])
        with timed("open"):
            open_range(enc, enc_tag, *out, aux)
        assert torch.equal(out[1], p.fill_ids)  # opened: the plaintext again
    return {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="encoder", choices=["encoder", "language"])
    if ap.parse_args().role == "language":
        asyncio.run(language())
        return
    text = asyncio.run(encoder())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
