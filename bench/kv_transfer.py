"""KV pages between two language-instance processes over Mooncake TCP (tandem/transfer/kv.py)
against a raw Mooncake write of the same bytes (issue 39's transfer benchmark).

This process is the prefill side (its KV cache, a registered outbox); a child process
started from this file (`--role decode`) is the decode side (a registered inbox and its
own cache). A 7B-class KV shape (Qwen2.5-VL-7B: 28 layers, 4 KV heads of 128, bfloat16,
pages of 16 tokens: 56 KiB per token), prompts of 4K and 16K tokens, protection `mac`
(the default) and `none`. Per transfer, the time of each step:

    prefill   send: per chunk of pages (`chunk_plan`: ramped up and down), tag (Poly1305
              over the cache's own pages), pack (cache -> outbox, page-major), write
              (Mooncake, one descriptor per chunk), chunk k+1 staged while chunk k is on
              the wire; a chunk's outbox slots wiped once its write ended
    decode    per chunk as the prefill side reports it written: land (inbox slots -> the
              reserved cache pages, slots wiped), open (decrypt and verify the landed pages
              in place, before any step may read them); overlapped with later chunks

The KV path's time runs from the first pack to the decode side's last check (land and
open are sums over the chunks: most of them overlap the wire).

and the raw write: the same bytes from one registered buffer into the child's registered
memory in one descriptor, submitted and sleep-polled as the KV path's writes are
(`MooncakeEngine.write`; Mooncake's own `transfer_sync_write` busy-polls a core and was
slower here, so it would flatter the KV path). Medians of --runs, raw and KV alternating.
Writes bench/results/kv-transfer.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from tandem.config import TransferConfig
from tandem.transfer.kv import CHUNK_PAGES

LAYERS, HEADS, DIM, PAGE, DTYPE = 28, 4, 128, 16, torch.bfloat16
OUT = Path(__file__).resolve().parent / "results" / "kv-transfer.md"


def _cpu() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _cpu_s() -> float:
    """This process's CPU seconds so far, every thread (Mooncake's TCP threads too)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def decode_side(conn, pages: int, ports: tuple[int, int]) -> None:
    from tandem.services.language.runner.kv_cache import KVCache
    from tandem.transfer.buffers import RowProtection
    from tandem.transfer.engine import MooncakeEngine
    from tandem.transfer.kv import KVKeys, KVPageLayout, KVStaging

    torch.set_num_threads(1)
    engine = MooncakeEngine(TransferConfig(min_port=ports[0], max_port=ports[1]))
    cache = KVCache(LAYERS, pages, PAGE, HEADS, DIM, DTYPE, "cpu")
    inbox = KVStaging(KVPageLayout.of_cache(cache), pages)
    inbox.register(engine)
    conn.send((engine.session_id, inbox.base))
    while (msg := conn.recv()) is not None:
        n, mode, key, room = msg
        cpu0 = _cpu_s()
        if mode == "raw":  # nothing to do but count the CPU the write took here
            conn.send({})
            conn.recv()  # written
            conn.send({"cpu": _cpu_s() - cpu0})
            continue
        slots = inbox.reserve(n, room)
        assert slots == list(range(n)), slots
        conn.send(slots)
        t = {"land": 0.0, "open": 0.0}
        # chunk by chunk as the prefill side reports each written (its Progress messages)
        while (chunk := conn.recv()) is not None:
            first, count, tag = chunk
            part = list(range(first, first + count))
            t0 = time.perf_counter()
            inbox.land(room, cache, part, first=first)
            t1 = time.perf_counter()
            keys = KVKeys.derive(RowProtection(mode, key), room, 1, first, count)
            if keys is not None:
                keys.open_pages(cache, part, tag)
            t["land"] += t1 - t0
            t["open"] += time.perf_counter() - t1
        t["cpu"] = _cpu_s() - cpu0
        conn.send(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--modes", default="mac,none")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--chunk-pages", type=int, default=CHUNK_PAGES,
                    help="pages per chunk (send_pages' chunk_pages)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    from tandem.services.language.runner.kv_cache import KVCache
    from tandem.transfer.buffers import RowProtection
    from tandem.transfer.engine import MooncakeEngine
    from tandem.transfer.kv import KVDestination, KVPageLayout, KVStaging, send_pages

    torch.set_num_threads(1)
    sizes = [int(x) for x in a.tokens.split(",")]
    pages = max(sizes) // PAGE
    engine = MooncakeEngine(TransferConfig(min_port=16600, max_port=16699))
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=decode_side, args=(child, pages, (16700, 16799)))
    proc.start()
    peer, inbox_base = parent.recv()
    cache = KVCache(LAYERS, pages, PAGE, HEADS, DIM, DTYPE, "cpu")
    for t in cache.k + cache.v:
        t.normal_()
    layout = KVPageLayout.of_cache(cache)
    outbox = KVStaging(layout, pages)
    outbox.register(engine)
    rows_out: list[dict] = []
    room = 0
    for tokens in sizes:
        n = tokens // PAGE
        nbytes = n * layout.page_bytes
        for mode in a.modes.split(","):
            raw_s, raw_cpu, kv_runs = [], [], []
            for run in range(a.runs):
                for kind in (("raw", "kv") if run % 2 == 0 else ("kv", "raw")):
                    room += 1
                    if kind == "raw":
                        parent.send((n, "raw", b"", room))
                        parent.recv()
                        cpu0, t0 = _cpu_s(), time.perf_counter()
                        engine.write(peer, [outbox.base], [inbox_base], [nbytes])
                        raw_s.append(time.perf_counter() - t0)
                        cpu = _cpu_s() - cpu0
                        parent.send(None)
                        raw_cpu.append(cpu + parent.recv()["cpu"])
                        continue
                    secret = RowProtection.new(mode)
                    parent.send((n, mode, secret.key, room))
                    slots = parent.recv()
                    t = {}
                    cpu0, t0 = _cpu_s(), time.perf_counter()
                    sent = send_pages(
                        engine, cache, list(range(n)), outbox,
                        KVDestination(peer, inbox_base, slots, room, 1, secret),
                        on_chunk=lambda c: parent.send((c.first, c.pages, c.tag)),
                        chunk_pages=a.chunk_pages)
                    t["send"] = time.perf_counter() - t0
                    cpu = _cpu_s() - cpu0
                    parent.send(None)  # the prefill side's Done
                    t.update(parent.recv())
                    t["cpu"] += cpu  # both processes
                    t["total"] = time.perf_counter() - t0
                    t["descriptors"] = sent.descriptors
                    kv_runs.append(t)
            med = {k: statistics.median(r[k] for r in kv_runs) for k in kv_runs[0]}
            total = med.pop("total")
            raw = statistics.median(raw_s)
            ratios = sorted(r / k["total"] for r, k in zip(raw_s, kv_runs, strict=True))
            rows_out.append({"tokens": tokens, "mode": mode, "mib": nbytes / 2**20, "raw": raw,
                             "med": med, "total": total, "raw_cpu": statistics.median(raw_cpu),
                             "ratios": (ratios[0], ratios[-1])})
            print(f"[kv] {tokens} tokens {mode}: raw {raw * 1e3:.0f} ms "
                  f"({nbytes / raw / 1e9:.2f} GB/s), KV path {total * 1e3:.0f} ms "
                  f"({raw / total:.2f}x raw), " + ", ".join(
                      f"{k} {v * 1e3:.0f} ms" if k != "descriptors" else f"{k} {v:.0f}"
                      for k, v in med.items()), flush=True)
    parent.send(None)
    proc.join(30)
    write_table(a, rows_out)


def write_table(a, rows_out: list[dict]) -> None:
    lines = [
        "# KV pages between two processes over Mooncake TCP (`bench/kv_transfer.py`)", "",
        f"Host: {_cpu()}, {os.cpu_count()} CPUs (shared), torch {torch.__version__}, one "
        f"torch thread per process. KV shape of a 7B-class model ({LAYERS} layers, {HEADS} "
        f"KV heads of {DIM}, bfloat16, pages of {PAGE} tokens); medians of {a.runs} runs, "
        "raw and KV alternating. Raw: one Mooncake write of the same bytes between two "
        "registered buffers (one descriptor). KV path: every step from the prefill "
        "instance's cache to the decode instance's cache pages (send: tag over the cache, "
        f"pack into the outbox and write, in chunks of up to {a.chunk_pages} pages ramped up "
        "and down, pipelined with the wire; the decode side lands and checks each chunk as "
        "it is reported written). Per-run range: raw / KV of each run's pair. CPU: both "
        "processes' CPU time (every thread, Mooncake's too) per transfer, medians: on a "
        "host whose cores the wire already keeps busy, the KV path's extra CPU is its "
        "extra time.", "",
        "| tokens | protect | MiB | raw ms | raw GB/s | KV path ms | KV / raw throughput "
        "| per-run range | descriptors | send ms | land ms (sum) | open ms (sum) "
        "| CPU ms raw / KV |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows_out:
        m = r["med"]
        lines.append(
            f"| {r['tokens']} | {r['mode']} | {r['mib']:.0f} | {r['raw'] * 1e3:.0f} | "
            f"{r['mib'] * 2**20 / r['raw'] / 1e9:.2f} | {r['total'] * 1e3:.0f} | "
            f"{r['raw'] / r['total']:.2f}x | {r['ratios'][0]:.2f}-{r['ratios'][1]:.2f}x | "
            f"{m['descriptors']:.0f} | "
            + " | ".join(f"{m[k] * 1e3:.0f}" for k in ("send", "land", "open"))
            + f" | {r['raw_cpu'] * 1e3:.0f} / {m['cpu'] * 1e3:.0f} |")
    lines += ["", "Regenerate: `.venv/bin/python bench/kv_transfer.py` (`--help`)."]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
