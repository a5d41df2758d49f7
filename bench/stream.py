"""Streamed rows (issue 27): TTFT with `--transfer.stream` on and off, in one run.

    .venv/bin/python bench/stream.py [--arch qwen2_5_vl] [--size small] [--images 1,4,8]
                                     [--concurrency 1,8] [--requests 16] [--runs 3]
                                     [--encoders 1] [--image-size 224] [--max-tokens 4]
                                     [--out bench/results/stream.md]

Two `tandem up` clusters on the same checkpoint (`--encoders` encoders, one language
instance each), one with `--transfer.stream` and one with `--no-transfer.stream` (the default)
on both tiers, are up for the whole run; each cell (images per prompt x concurrency) sends
`--requests` chats to each cluster, the order of the two alternating from run to run (so
neither always goes first on a warm or a cold machine). Every image is fresh (no encoder
cache or prefix cache hit: the comparison is of the encode path). TTFT = request sent to
the first streamed content token over HTTP; p50/p99 per cell are medians over `--runs`.
Targets (issue 27): 8 images at concurrency 1 with 2 encoders <= 0.6x the unstreamed TTFT,
1 image <= 1.05x.

`--split` compares splitting instead: "split" (the router's `--split-encoders` set to
`--encoders`, so a prompt's images go to all of them; rows streamed when `--split-stream`)
against "off" (today's path: the same encoders, no split, no streaming).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from latency import checkpoint, machine, pct, publish, sse_events  # noqa: E402  (bench/, the script's own folder)

from tandem.launch.cluster import LocalCluster  # noqa: E402


def png(seed: int, size: int) -> bytes:
    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


async def ttfts(url: str, n_images: int, requests: int, concurrency: int, max_tokens: int,
                image_size: int, seed: int) -> tuple[list[float], int]:
    """TTFT (s) of `requests` chats of `n_images` fresh images each; and the failures."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    out, failures = [], 0

    async def one(http, i: int) -> None:
        nonlocal failures
        content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                    base64.b64encode(png(seed * 1_000_003 + i * 101 + k, image_size)).decode()}}
                   for k in range(n_images)]  # fmt: skip
        content.append({"type": "text", "text": "Describe each picture in one word."})
        body = {"model": "", "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
        async with sem:
            t0 = time.perf_counter()
            async with http.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    failures += 1
                    return
                async for ev in sse_events(resp):
                    if "error" in ev:
                        failures += 1
                        return
                    if ev.get("choices") and ev["choices"][0]["delta"].get("content"):
                        out.append(time.perf_counter() - t0)
                        return
            failures += 1

    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(one(http, i) for i in range(requests)))
    return out, failures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--images", default="1,4,8")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests", type=int, default=16, help="chats per cell, mode and run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--encoders", type=int, default=1)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--split", action="store_true",
                   help="compare splitting each prompt over the encoders with today's path")
    p.add_argument("--split-stream", action="store_true",
                   help="with --split: stream the rows too")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.out = args.out or str(ROOT / "bench" / "results" /
                               ("split.md" if args.split else "stream.md"))
    images = [int(x) for x in args.images.split(",")]
    concs = [int(x) for x in args.concurrency.split(",")]
    model_dir = checkpoint(args.arch, args.size)
    on, off = "--transfer.stream", "--no-transfer.stream"
    first = "split" if args.split else "on"
    both = on if not args.split or args.split_stream else off
    clusters = {
        first: LocalCluster(str(model_dir), encoders=args.encoders, languages=1,
                            encoder_args=both, language_args=both,
                            router_args=f"--split-encoders {args.encoders}" if args.split else ""),
        "off": LocalCluster(str(model_dir), encoders=args.encoders, languages=1,
                            encoder_args=off, language_args=off),
    }
    MODES = (first, "off")  # noqa: N806
    # (images, concurrency, mode) -> per run (p50, p99); failures summed
    got: dict[tuple, list[tuple[float, float]]] = {}
    failures = 0
    for c in clusters.values():
        c.start()
    try:
        urls = {m: c.http_url + "/v1/chat/completions" for m, c in clusters.items()}
        for m in MODES:  # warm-up: first requests load kernels and caches
            asyncio.run(ttfts(urls[m], max(images), 2, 1, 2, args.image_size, seed=-1 - len(m)))
        seed = 0
        for run in range(args.runs):
            order = MODES if run % 2 == 0 else MODES[::-1]
            for n in images:
                for conc in concs:
                    for m in order:
                        seed += 1
                        xs, f = asyncio.run(ttfts(urls[m], n, args.requests, conc,
                                                  args.max_tokens, args.image_size, seed))
                        failures += f
                        got.setdefault((n, conc, m), []).append((pct(xs, 0.5), pct(xs, 0.99)))
                        print(f"run {run} images {n} c={conc} {m}: p50 "
                              f"{pct(xs, 0.5) * 1e3:.0f} ms ({len(xs)} ok, {f} failed)",
                              flush=True)
    finally:
        for c in clusters.values():
            c.stop()

    med = statistics.median
    title = (f"# Split prompts: TTFT with each prompt split over {args.encoders} encoders "
             f"({'rows streamed' if args.split_stream else 'rows not streamed'}) and without "
             f"(today's path)" if args.split else
             "# Streamed rows: TTFT with `--transfer.stream` on and off")
    lines = [
        f"{title} ({args.arch}, `{args.size}` preset, CPU)",
        "",
        f"{args.encoders} encoder(s) + 1 language instance per mode; {args.requests} chats per "
        f"cell, mode and run, each image fresh ({args.image_size}x{args.image_size} px noise), "
        f"{args.max_tokens} tokens (`ignore_eos`), streaming over HTTP; medians over "
        f"{args.runs} runs, the modes' order alternating. Machine: {machine()}.",
        "",
        f"| images | concurrency | TTFT p50 {first} ms | TTFT p50 off ms | {first}/off p50 | "
        f"TTFT p99 {first} ms | TTFT p99 off ms | {first}/off p99 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in images:
        for conc in concs:
            on50, on99 = (med(x[k] for x in got[(n, conc, first)]) * 1e3 for k in (0, 1))
            off50, off99 = (med(x[k] for x in got[(n, conc, "off")]) * 1e3 for k in (0, 1))
            lines.append(f"| {n} | {conc} | {on50:.0f} | {off50:.0f} | {on50 / off50:.2f}x | "
                         f"{on99:.0f} | {off99:.0f} | {on99 / off99:.2f}x |")
    lines += ["", f"Failures: {failures}.", "",
              f"Regenerate: `.venv/bin/python bench/stream.py "
              f"{'--split ' if args.split else ''}{'--split-stream ' if args.split_stream else ''}"
              f"--encoders {args.encoders}` (options: `--help`)."]
    publish("\n".join(lines) + "\n", args.out)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
