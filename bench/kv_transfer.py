"""KV pages between two language-instance processes over Mooncake TCP (tandem/transfer/kv.py)
against a raw Mooncake write of the same bytes (issue 39's transfer benchmark).

This process is the prefill side (its KV cache, a registered outbox); a child process
started from this file (`--role decode`) is the decode side (a registered inbox and its
own cache). A 7B-class KV shape (Qwen2.5-VL-7B: 28 layers, 4 KV heads of 128, bfloat16,
pages of 16 tokens: 56 KiB per token), prompts of 4K and 16K tokens, protection `mac`
(the default) and `none`. Variants of the KV path (`--variants`), in rotating order with
raw:

    inline    (the fourth version) prefill side, per chunk of pages (`chunk_plan`: ramped
              up and down): tag (Poly1305 over the cache's own pages), pack (cache ->
              outbox, page-major), write (Mooncake, one descriptor per chunk), chunk k+1
              staged while chunk k is on the wire, a chunk's outbox slots wiped once its
              write ended; decode side, per chunk as reported written: land (inbox slots
              -> the reserved cache pages, slots wiped), open (decrypt and verify the
              landed pages in place, before any step may read them)
    ahead     the tags taken before the transfer, as a prefill instance takes them while
              its prefill computes the pages (`KVTagger`, on a thread of its own: timed
              apart, its CPU reported, and as a share of that prompt's prefill estimated
              from this host's measured GEMM rate); the transfer packs and writes only;
              the decode side lands and checks, and both sides wipe their slots after the
              window (timed and counted apart: the CPU of the wipes after)
    staged    as `ahead`, and the outbox packed before the transfer too (what packing each
              chunk as the prefill completes it would give): an emulation in this file
              (the transfer's pipeline without its packs), not built in `send_pages`

The KV path's time runs from the first pack to the moment the decode side may use the
pages (every chunk checked and the prefill side's Done received; land and open are sums
over the chunks: most of them overlap the wire).

Against it, the raw write: the same bytes from one registered buffer into the child's
registered memory in one descriptor, submitted and sleep-polled as the KV path's writes are
(`MooncakeEngine.write`; Mooncake's own `transfer_sync_write` busy-polls a core and was
slower here, so it would flatter the KV path). Medians of --runs. Writes
bench/results/kv-transfer.md (--out).
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
        n, mode, key, room, variant = msg
        cpu0 = _cpu_s()
        if mode == "raw":  # nothing to do but count the CPU the write took here
            conn.send({})
            conn.recv()  # written
            conn.send({"cpu": _cpu_s() - cpu0, "ready": time.monotonic()})
            continue
        late = variant != "inline"  # the inbox wiped after the pages may be used
        slots = inbox.reserve(n, room)
        assert slots == list(range(n)), slots
        conn.send(slots)
        t = {"land": 0.0, "open": 0.0}
        # chunk by chunk as the prefill side reports each written (its Progress messages)
        while (chunk := conn.recv()) is not None:
            first, count, tag = chunk
            part = list(range(first, first + count))
            t0 = time.perf_counter()
            inbox.land(room, cache, part, first=first, wipe=not late)
            t1 = time.perf_counter()
            keys = KVKeys.derive(RowProtection(mode, key), room, 1, first, count)
            if keys is not None:
                keys.open_pages(cache, part, tag)
            t["land"] += t1 - t0
            t["open"] += time.perf_counter() - t1
        # Done came and every chunk passed its check: the pages may be used from here
        t["ready"] = time.monotonic()
        t["cpu"] = _cpu_s() - cpu0
        cpu1, t1 = _cpu_s(), time.perf_counter()
        if late:
            inbox.sweep(room)
        assert inbox.num_free == inbox.num_slots and not inbox.holds(room)
        t["wipe_after"] = time.perf_counter() - t1
        t["cpu_after"] = _cpu_s() - cpu1
        conn.send(t)


def gemm_rate(tokens: int = 512) -> float:
    """FLOP/s of one thread on one 7B-class MLP projection ([tokens, 3584] x [3584, 18944],
    float32, the fastest dtype of this host's CPU GEMMs): what a CPU prefill runs at best."""
    x, w = torch.randn(tokens, 3584), torch.randn(3584, 18944)
    x @ w
    t0 = time.perf_counter()
    x @ w
    return 2 * tokens * 3584 * 18944 / (time.perf_counter() - t0)


def prefill_flops(tokens: int) -> float:
    """A 7B-class prefill of `tokens` (Qwen2.5-VL-7B's language model: ~6.5e9 weights in
    its layers' matmuls, 28 layers of hidden 3584, causal attention): 2 x weights per token
    plus the attention scores and values (2 x 2 x tokens^2 / 2 x hidden per layer)."""
    return 2 * 6.5e9 * tokens + 2 * tokens * tokens * 3584 * LAYERS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--modes", default="mac,none")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--variants", default="inline,ahead",
                    help="inline: tags taken in the transfer, each chunk's outbox slots wiped "
                    "while the next is on the wire, the inbox's as each lands (the fourth "
                    "version); ahead: tags taken before the transfer (at the prefill: "
                    "KVTagger), both sides' slots wiped once the pages may be used; "
                    "staged: as ahead, and the outbox packed before the transfer too (an "
                    "emulation in this file, not built in send_pages)")
    ap.add_argument("--chunk-pages", type=int, default=CHUNK_PAGES,
                    help="pages per chunk (send_pages' chunk_pages)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    from concurrent.futures import ThreadPoolExecutor

    from tandem.services.language.runner.kv_cache import KVCache
    from tandem.transfer.buffers import RowProtection
    from tandem.transfer.engine import MooncakeEngine
    from tandem.transfer.kv import (
        KVDestination,
        KVPageLayout,
        KVStaging,
        KVTagger,
        chunk_plan,
        pack_into_slots,
        runs,
        send_pages,
    )

    torch.set_num_threads(1)
    sizes = [int(x) for x in a.tokens.split(",")]
    variants = a.variants.split(",")
    pages = max(sizes) // PAGE
    engine = MooncakeEngine(TransferConfig(min_port=16600, max_port=16699))
    tag_pool = ThreadPoolExecutor(1, thread_name_prefix="kv-tag")  # the prefill's tagger
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
    rate = gemm_rate()
    print(f"[kv] GEMM rate, one thread: {rate / 1e9:.0f} GFLOP/s", flush=True)
    rows_out: list[dict] = []
    room = 0

    def kv_run(n: int, mode: str, variant: str) -> dict:
        nonlocal room
        room += 1
        secret = RowProtection.new(mode)
        parent.send((n, mode, secret.key, room, variant))
        slots = parent.recv()
        t: dict = {}
        tags = None
        plan = chunk_plan(n, a.chunk_pages)
        dest = KVDestination(peer, inbox_base, slots, room, 1, secret)
        if variant in ("ahead", "staged"):  # the prefill's tagger, as pages are computed
            tags = KVTagger(cache, secret, room, 1, n * PAGE, PAGE, tag_pool, a.chunk_pages)
            cpu0, t0 = _cpu_s(), time.perf_counter()
            tags.progress(list(range(n)), n * PAGE, 0)
            for c0, c1 in plan:
                tags.get(c0, c1, list(range(c0, c1)))
            if variant == "staged":  # packed ahead too (an emulation: not in send_pages)
                owner = object()
                oslots = outbox.reserve(n, owner)
                pack_into_slots(cache, list(range(n)), outbox.rows, oslots)
            t["tag_ahead"], t["cpu_tag_ahead"] = time.perf_counter() - t0, _cpu_s() - cpu0
        window: dict = {}

        def written(_sent) -> None:  # the prefill side's Done: then its wipe
            window["cpu"] = _cpu_s() - cpu0
            parent.send(None)

        cpu0, t0, m0 = _cpu_s(), time.perf_counter(), time.monotonic()
        if variant == "staged":  # send_pages' pipeline without its packs
            descriptors, in_flight, pending = 0, [], None
            for c0, c1 in plan:
                srcs, dsts, lens = runs(outbox.base, oslots[c0:c1], inbox_base, slots[c0:c1],
                                        layout.page_bytes)
                started = engine.submit(peer, srcs, dsts, lens)
                descriptors += len(srcs)
                if in_flight:
                    engine.wait(peer, in_flight)
                    parent.send(pending)
                in_flight = started
                pending = (c0, c1 - c0, tags.get(c0, c1, list(range(c0, c1))) or b"")
            engine.wait(peer, in_flight)
            parent.send(pending)
            written(None)
            outbox.drop(owner)
            sent = type("Sent", (), {"descriptors": descriptors})
        else:
            sent = send_pages(
                engine, cache, list(range(n)), outbox, dest,
                on_chunk=lambda c: parent.send((c.first, c.pages, c.tag)),
                chunk_pages=a.chunk_pages, tags=tags,
                on_written=written if variant == "ahead" else None)
        t["send"] = time.perf_counter() - t0
        cpu = _cpu_s() - cpu0
        if variant == "inline":
            window["cpu"] = cpu
            parent.send(None)  # the prefill side's Done
        got = parent.recv()
        t["total"] = got.pop("ready") - m0  # until the decode side may use the pages
        t["cpu_prefill"], t["cpu_decode"] = window["cpu"], got["cpu"]
        t["cpu"] = window["cpu"] + got.pop("cpu")  # both processes, in the window
        t["cpu_after"] = cpu - window["cpu"] + got.pop("cpu_after")  # the wipes after it
        t.update(got)
        t["descriptors"] = sent.descriptors
        assert outbox.num_free == outbox.num_slots
        return t

    for tokens in sizes:
        n = tokens // PAGE
        nbytes = n * layout.page_bytes
        for mode in a.modes.split(","):
            raw_s, raw_cpu = [], []
            kv_runs: dict[str, list[dict]] = {v: [] for v in variants}
            for run in range(a.runs):
                order = ["raw", *variants]
                order = order[run % len(order):] + order[: run % len(order)]  # rotating
                for kind in order:
                    if kind != "raw":
                        kv_runs[kind].append(kv_run(n, mode, kind))
                        r = kv_runs[kind][-1]
                        print(f"  run {run} {kind}: {r['total'] * 1e3:.0f} ms, CPU "
                              f"{r['cpu_prefill'] * 1e3:.0f} + {r['cpu_decode'] * 1e3:.0f} ms",
                              flush=True)
                        continue
                    room += 1
                    parent.send((n, "raw", b"", room, "raw"))
                    parent.recv()
                    cpu0, t0 = _cpu_s(), time.perf_counter()
                    engine.write(peer, [outbox.base], [inbox_base], [nbytes])
                    raw_s.append(time.perf_counter() - t0)
                    cpu = _cpu_s() - cpu0
                    parent.send(None)
                    decode_cpu = parent.recv()["cpu"]
                    raw_cpu.append(cpu + decode_cpu)
                    print(f"  run {run} raw: {raw_s[-1] * 1e3:.0f} ms, CPU {cpu * 1e3:.0f} + "
                          f"{decode_cpu * 1e3:.0f} ms", flush=True)
            raw = statistics.median(raw_s)
            for v in variants:
                runs_v = kv_runs[v]
                med = {k: statistics.median(r.get(k, 0.0) for r in runs_v)
                       for k in runs_v[-1]}
                total = med.pop("total")
                ratios = sorted(r / k["total"] for r, k in zip(raw_s, runs_v, strict=True))
                prefill_s = prefill_flops(tokens) / (2 * rate)  # both cores at the GEMM rate
                rows_out.append({"tokens": tokens, "mode": mode, "variant": v,
                                 "mib": nbytes / 2**20, "raw": raw, "med": med,
                                 "total": total, "raw_cpu": statistics.median(raw_cpu),
                                 "ratios": (ratios[0], ratios[-1]), "prefill_s": prefill_s})
                print(f"[kv] {tokens} tokens {mode} {v}: raw {raw * 1e3:.0f} ms "
                      f"({nbytes / raw / 1e9:.2f} GB/s), KV path {total * 1e3:.0f} ms "
                      f"({raw / total:.2f}x raw; runs {ratios[0]:.2f}-{ratios[-1]:.2f}x), "
                      + ", ".join(f"{k} {x * 1e3:.0f} ms" if k != "descriptors"
                                  else f"{k} {x:.0f}" for k, x in med.items()), flush=True)
    parent.send(None)
    proc.join(30)
    tag_pool.shutdown()
    write_table(a, rows_out, rate)


def write_table(a, rows_out: list[dict], rate: float) -> None:
    lines = [
        "# KV pages between two processes over Mooncake TCP (`bench/kv_transfer.py`)", "",
        f"Host: {_cpu()}, {os.cpu_count()} CPUs (shared), torch {torch.__version__}, one "
        f"torch thread per process. KV shape of a 7B-class model ({LAYERS} layers, {HEADS} "
        f"KV heads of {DIM}, bfloat16, pages of {PAGE} tokens); medians of {a.runs} runs, "
        "raw and the KV variants in rotating order. Raw: one Mooncake write of the same "
        "bytes between two registered buffers (one descriptor). KV path: every step from "
        "the prefill instance's cache to the decode instance's cache pages, until the decode "
        "side may use them (its last check passed and Done came): pack into the outbox and "
        f"write, in chunks of up to {a.chunk_pages} pages ramped up and down, pipelined "
        "with the wire; the decode side lands and checks each chunk as it is reported "
        "written. Variants: `inline` tags in the transfer, wipes each chunk's slots as it "
        "goes (the fourth version); `ahead` takes the tags before (at the prefill, "
        "`KVTagger`: its CPU in the tag-ahead column, and as a share of the prompt's "
        "prefill estimated at this host's measured one-thread GEMM rate, "
        f"{rate / 1e9:.0f} GFLOP/s, on both cores) and wipes both sides' slots after the "
        "window (their CPU in the after column); `staged` packs the outbox ahead too (an "
        "emulation in the bench: the hand-off does not do it). Per-run range: raw / KV of each run's "
        "pair. CPU: both processes' CPU time (every thread, Mooncake's too), medians: on "
        "a host whose cores the wire already keeps busy, the KV path's extra CPU is its "
        "extra time.", "",
        "| tokens | protect | variant | MiB | raw ms | raw GB/s | KV path ms "
        "| KV / raw throughput | per-run range | descriptors | send ms | land ms (sum) "
        "| open ms (sum) | CPU ms raw / KV in window | CPU ms of wipes after "
        "| CPU ms ahead: tags (+ pack, staged) (share of prefill) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows_out:
        m = r["med"]
        ahead = m.get("cpu_tag_ahead", 0.0)
        lines.append(
            f"| {r['tokens']} | {r['mode']} | {r['variant']} | {r['mib']:.0f} | "
            f"{r['raw'] * 1e3:.0f} | {r['mib'] * 2**20 / r['raw'] / 1e9:.2f} | "
            f"{r['total'] * 1e3:.0f} | {r['raw'] / r['total']:.2f}x | "
            f"{r['ratios'][0]:.2f}-{r['ratios'][1]:.2f}x | {m['descriptors']:.0f} | "
            + " | ".join(f"{m[k] * 1e3:.0f}" for k in ("send", "land", "open"))
            + f" | {r['raw_cpu'] * 1e3:.0f} / {m['cpu'] * 1e3:.0f} | "
            f"{m['cpu_after'] * 1e3:.0f} | "
            + (f"{ahead * 1e3:.0f} ({100 * ahead / r['prefill_s']:.3f}% of "
               f"~{r['prefill_s']:.0f} s) |" if ahead >= 5e-4 else "- |"))
    lines += ["", "Regenerate: `.venv/bin/python bench/kv_transfer.py` (`--help`)."]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
