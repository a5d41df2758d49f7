"""Streamed rows (issue 27): TTFT with `--transfer.stream` on and off, in one run.

    .venv/bin/python bench/stream.py [--arch qwen2_5_vl] [--size small] [--images 1,4,8]
                                     [--video 30] [--clip 224x168]
                                     [--concurrency 1,8] [--requests 16] [--runs 3]
                                     [--encoders 1] [--image-size 224] [--max-tokens 4]
                                     [--out bench/results/stream.md]

Two `tandem up` clusters on the same checkpoint (`--encoders` encoders, one language
instance each), one with `--transfer.stream` and one with `--no-transfer.stream` (the default)
on both tiers, are up for the whole run; each cell (prompt kind x concurrency) sends
`--requests` chats to each cluster, the order of the two alternating from run to run (so
neither always goes first on a warm or a cold machine). Every image and video is fresh (no
encoder cache or prefix cache hit: the comparison is of the encode path). TTFT = request sent to
the first streamed content token over HTTP (each request is then read to its end, for the
writers its answer names); p50/p99 per cell are medians over `--runs`. A cell's bodies are
all made before its first request is sent.

Prompt kinds: `--images` (a list of image counts, each image `--image-size` px square) and
`--video` (a list of clip lengths in seconds; "" by default, and `--images ""` leaves only
the videos): one fresh mp4 per request, made with PyAV as bench/video.py makes its clips
(`make_clip`: moving gradients and blocky noise, `--clip` WxH at 4 frames per second),
sent as a `video_url` data URL with the `fps` control 2.

Targets (issue 27): 8 images at concurrency 1 with 2 encoders <= 0.6x the unstreamed TTFT,
1 image <= 1.05x.

`--split` compares splitting instead: "split" (the router's `--split-encoders` set to
`--encoders`, so a prompt's images go to all of them; rows streamed when `--split-stream`)
against "off" (today's path: the same encoders, no split, no streaming). The table's
"writers" column is the mean number of encoders named in an answer's `encoder_ranges`
(the split's writers; 1 = the prompt was not split, as always without `--split`). A split cuts the prompt's ViT work
into runs of units: an image is one unit; a video is one medium, but each of its temporal
groups is a unit of its own (services/encoder/units.py), and the router names helpers for
any prompt with a video (selection.pick_helpers), so one long video is split across the
encoders at group boundaries; a video of a single temporal group, like a single image,
cannot be split (a split needs >= 2 units of uncached ViT work). The issue's long-video
row: `--split --encoders 2 --images "" --video 30`.
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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from latency import checkpoint, machine, pct, publish, sse_events  # noqa: E402  (bench/, the script's own folder)
from video import make_clip  # noqa: E402  (bench/video.py)

from tandem.launch.cluster import LocalCluster  # noqa: E402

CLIP_RATE = 4  # frames per second of a --video clip (bench/video.py's default --rate)
VIDEO_FPS = 2.0  # the request's fps control: frames sampled per second of video


@dataclass(frozen=True)
class Prompt:
    """One cell's prompt kind: `images` fresh images, or one fresh `video_s`-second clip."""

    images: int = 0
    video_s: float = 0.0

    @property
    def label(self) -> str:
        return f"video {self.video_s:g} s" if self.video_s else f"{self.images} images"

    def content(self, seed: int, image_size: int, clip: tuple[int, int]) -> list[dict]:
        """The user turn's parts, fresh media from `seed` (>= 0; images: seeds seed..+images)."""
        if self.video_s:
            url = "data:video/mp4;base64," + base64.b64encode(
                make_clip(self.video_s, seed, clip, CLIP_RATE)).decode()
            return [{"type": "video_url", "video_url": {"url": url, "fps": VIDEO_FPS}},
                    {"type": "text", "text": "What happens in this clip?"}]
        return [*({"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                   base64.b64encode(png(seed + k, image_size)).decode()}}
                  for k in range(self.images)),
                {"type": "text", "text": "Describe each picture in one word."}]


def png(seed: int, size: int) -> bytes:
    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


async def ttfts(url: str, prompt: Prompt, requests: int, concurrency: int, max_tokens: int,
                image_size: int, clip: tuple[int, int], seed: int,
                ) -> tuple[list[float], list[int], int]:
    """TTFT (s) of `requests` chats of `prompt`'s kind (fresh media each), the writers each
    answer names (encoders in its `encoder_ranges`), and the failures."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    out, writers, failures = [], [], 0
    bodies = [{"model": "", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
               "stream": True, "messages": [{"role": "user", "content": prompt.content(
                   seed * 1_000_003 + i * 101, image_size, clip)}]}
              for i in range(requests)]

    async def one(http, body: dict) -> None:
        nonlocal failures
        async with sem:
            t0, ttft = time.perf_counter(), None
            async with http.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    failures += 1
                    return
                async for ev in sse_events(resp):
                    if "error" in ev:
                        failures += 1
                        return
                    if ttft is None and ev.get("choices") and \
                            ev["choices"][0]["delta"].get("content"):
                        ttft = time.perf_counter() - t0
                    if "tandem" in ev:  # the last chunk: where the request ran
                        ranges = ev["tandem"]["timings"].get("encoder_ranges", [])
                        writers.append(len({r["encoder"] for r in ranges}))
            if ttft is None:
                failures += 1
            else:
                out.append(ttft)

    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(one(http, b) for b in bodies))
    return out, writers, failures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--images", default="1,4,8", help='images per prompt, a list ("": none)')
    p.add_argument("--video", default="",
                   help="long-video prompts: clip lengths in seconds, a list (one video each)")
    p.add_argument("--clip", default="224x168", help="a --video clip's size, WxH")
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
    prompts = [Prompt(images=int(x)) for x in args.images.split(",") if x.strip()]
    prompts += [Prompt(video_s=float(x)) for x in args.video.split(",") if x.strip()]
    if not prompts or any(q.images < 1 and not q.video_s for q in prompts):
        p.error("--images and --video: at least one prompt kind, each with >= 1 image or > 0 s")
    clip = tuple(int(x) for x in args.clip.split("x"))
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
    # (prompt, concurrency, mode) -> per run (p50, p99); writers per answer; failures summed
    got: dict[tuple, list[tuple[float, float]]] = {}
    writers: dict[tuple, list[int]] = {}
    failures = 0
    for c in clusters.values():
        c.start()
    try:
        urls = {m: c.http_url + "/v1/chat/completions" for m, c in clusters.items()}
        # warm-up: first requests load kernels and caches (the most images, the shortest
        # video; seeds past the runs' own)
        warm = [max((q for q in prompts if not q.video_s), key=lambda q: q.images, default=None),
                min((q for q in prompts if q.video_s), key=lambda q: q.video_s, default=None)]
        for k, m in enumerate(MODES):
            for q in filter(None, warm):
                asyncio.run(ttfts(urls[m], q, 2, 1, 2, args.image_size, clip,
                                  seed=1_000_000 + k))
        seed = 0
        for run in range(args.runs):
            order = MODES if run % 2 == 0 else MODES[::-1]
            for q in prompts:
                for conc in concs:
                    for m in order:
                        seed += 1
                        xs, ws, f = asyncio.run(ttfts(urls[m], q, args.requests, conc,
                                                      args.max_tokens, args.image_size, clip,
                                                      seed))
                        failures += f
                        got.setdefault((q, conc, m), []).append((pct(xs, 0.5), pct(xs, 0.99)))
                        writers.setdefault((q, conc, m), []).extend(ws)
                        print(f"run {run} {q.label} c={conc} {m}: p50 "
                              f"{pct(xs, 0.5) * 1e3:.0f} ms ({len(xs)} ok, {f} failed, "
                              f"writers {statistics.mean(ws or [0]):.2f})", flush=True)
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
        f"each video fresh ({args.clip} at {CLIP_RATE} frames/s, sampled at fps "
        f"{VIDEO_FPS:g}), {args.max_tokens} tokens (`ignore_eos`), streaming over HTTP; "
        f"medians over {args.runs} runs, the modes' order alternating. Machine: {machine()}.",
        "",
        f"| prompt | concurrency | TTFT p50 {first} ms | TTFT p50 off ms | {first}/off p50 | "
        f"TTFT p99 {first} ms | TTFT p99 off ms | {first}/off p99 | writers {first} |",
        "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for q in prompts:
        for conc in concs:
            on50, on99 = (med(x[k] for x in got[(q, conc, first)]) * 1e3 for k in (0, 1))
            off50, off99 = (med(x[k] for x in got[(q, conc, "off")]) * 1e3 for k in (0, 1))
            ws = writers[(q, conc, first)] or [0]
            lines.append(f"| {q.label} | {conc} | {on50:.0f} | {off50:.0f} | "
                         f"{on50 / off50:.2f}x | {on99:.0f} | {off99:.0f} | "
                         f"{on99 / off99:.2f}x | {statistics.mean(ws):.2f} |")
    lines += ["", f"Failures: {failures}.", "",
              f"Regenerate: `.venv/bin/python bench/stream.py "
              f"{'--split ' if args.split else ''}{'--split-stream ' if args.split_stream else ''}"
              f"--encoders {args.encoders} --images '{args.images}'"
              f"{f' --video {args.video}' if args.video else ''}` (options: `--help`)."]
    publish("\n".join(lines) + "\n", args.out)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
