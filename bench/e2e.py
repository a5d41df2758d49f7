"""End-to-end HTTP load against `tandem up` clusters, against one transformers process.

    .venv/bin/python bench/e2e.py [--size small] [--configs 1x1,1x2,2x1,2x2,2x2rr]
                                  [--requests 32] [--concurrency 8] [--max-tokens 16]
                                  [--runs 3] [--out bench/results/e2e.md]

Workload (fixed seed): chats with 0 or 1 image (sizes 112..448 px), short or long text,
a share of them repeating an image sent at least `--concurrency` requests earlier in the
same run (the encoder cache's case);
`ignore_eos` so every request generates exactly `--max-tokens` tokens. Each run uses fresh
images (so the cache starts cold each run) with the same repetition pattern.

Per cluster config (ENCODERSxLANGUAGES; `rr` = round-robin instead of least-load +
image affinity): requests/s, TTFT and TPOT p50/p99 over streaming requests, and the image
cache hit rate (image requests served with cached image tokens) next to the ideal (the
share of image requests that repeat an image). Baseline: the same requests, one at a time,
through `transformers` `generate()` in this process. Medians over `--runs` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from latency import checkpoint, machine, publish, sse_events, summary  # noqa: E402  (bench/, the script's own folder)

from tandem.launch.cluster import LocalCluster  # noqa: E402

LONG = "Please describe the scene in detail, including colours, shapes, layout and mood. " * 4


@dataclass
class Req:
    text: str
    image_key: int | None  # index into the run's image pool
    size: tuple[int, int]
    repeat: bool


def workload(n: int, seed: int, gap: int) -> list[Req]:
    """A repeat reuses an image first sent at least `gap` requests earlier (with `gap` =
    the concurrency, its first encode has usually finished, so a cache can serve it)."""
    rng = random.Random(seed)
    reqs, seen = [], []  # seen: (image key, size, index of the request that introduced it)
    for i in range(n):
        text = rng.choice(["What is in this picture?", LONG, "Name the main colour."])
        roll = rng.random()
        old = [(k, sz) for k, sz, at in seen if i - at >= gap]
        if roll < 0.15:
            reqs.append(Req(text, None, (0, 0), False))
        elif roll < 0.5 and old:
            key, size = rng.choice(old)
            reqs.append(Req(text, key, size, True))
        else:
            size = (rng.choice([112, 224, 336, 448]), rng.choice([112, 224, 336]))
            seen.append((len(seen), size, i))
            reqs.append(Req(text, len(seen) - 1, size, False))
    return reqs


def make_png(run: int, key: int, size) -> bytes:
    from PIL import Image

    rng = random.Random(run * 100_003 + key)
    img = Image.frombytes("RGB", size, bytes(rng.getrandbits(8) for _ in range(size[0] * size[1] * 3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


async def run_http(url: str, reqs: list[Req], run: int, concurrency: int, max_tokens: int):
    import httpx

    sem = asyncio.Semaphore(concurrency)
    ttft, tpot, hits, image_reqs, failures = [], [], 0, 0, 0

    async def one(http, r: Req):
        nonlocal hits, image_reqs, failures
        content = [{"type": "text", "text": r.text}]
        if r.image_key is not None:
            b64 = base64.b64encode(make_png(run, r.image_key, r.size)).decode()
            content.insert(0, {"type": "image_url",
                               "image_url": {"url": f"data:image/png;base64,{b64}"}})
        body = {"model": "", "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        async with sem:
            t0 = time.perf_counter()
            first = last = None
            ext, usage = {}, None
            async with http.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    failures += 1
                    return
                async for ev in sse_events(resp):
                    if "error" in ev:
                        failures += 1
                        return
                    if ev.get("choices") and ev["choices"][0]["delta"].get("content"):
                        last = time.perf_counter()
                        first = first or last
                    ext = ev.get("tandem") or ext
                    usage = ev.get("usage") or usage
        if first is None:
            failures += 1
            return
        ttft.append(first - t0)
        n = (usage or {}).get("completion_tokens", max_tokens)
        if n > 1:
            tpot.append((last - first) / (n - 1))
        if r.image_key is not None:
            image_reqs += 1
            hits += ext.get("cached_image_tokens", 0) > 0

    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(http, r) for r in reqs))
        wall = time.perf_counter() - t0
    return {"rps": len(reqs) / wall, "ttft": ttft, "tpot": tpot,
            "hit": hits / image_reqs if image_reqs else 0.0, "failures": failures}


def run_baseline(model_dir: Path, reqs: list[Req], run: int, max_tokens: int):
    """The same requests through transformers generate(), one at a time."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from transformers.generation.streamers import BaseStreamer

    import tandem  # noqa: F401  (registers the processors)

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(model_dir)

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    from PIL import Image

    ttft, tpot = [], []
    t_all = time.perf_counter()
    for r in reqs:
        images = []
        if r.image_key is not None:
            images = [Image.open(io.BytesIO(make_png(run, r.image_key, r.size))).convert("RGB")]
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": r.text}]
        t0 = time.perf_counter()
        prompt = proc.apply_chat_template([{"role": "user", "content": content}],
                                          add_generation_prompt=True, tokenize=False)
        inputs = proc(text=[prompt], images=images or None, return_tensors="pt")
        clock = Clock()
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           do_sample=False, streamer=clock)
        # put() #0 is the prompt, #1 the first new token
        ttft.append(clock.times[1] - t0)
        if len(clock.times) > 2:
            tpot.append((clock.times[-1] - clock.times[1]) / (len(clock.times) - 2))
    wall = time.perf_counter() - t_all
    return {"rps": len(reqs) / wall, "ttft": ttft, "tpot": tpot, "hit": 0.0, "failures": 0}


def summarize(runs: list[dict]) -> dict:
    return summary(runs, medians=("rps", "hit"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--configs", default="1x1,1x2,2x1,2x2,2x2rr")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "e2e.md"))
    args = p.parse_args()

    model_dir = checkpoint(args.arch, args.size)
    base = workload(args.requests, seed=1234, gap=args.concurrency)
    ideal = sum(r.repeat for r in base) / max(1, sum(r.image_key is not None for r in base))
    rows = []
    print(f"model {args.arch}/{args.size}; {args.requests} requests x {args.runs} runs, "
          f"concurrency {args.concurrency}, {args.max_tokens} tokens each", flush=True)
    baseline = summarize([run_baseline(model_dir, base, run, args.max_tokens)
                          for run in range(args.runs)])
    rows.append(("transformers generate() (1 process, sequential)", baseline))
    print("baseline done", flush=True)
    for spec in args.configs.split(","):
        rr = spec.endswith("rr")
        e, l_ = (int(x) for x in spec.rstrip("r").split("x"))
        cluster = LocalCluster(str(model_dir), encoders=e, languages=l_,
                               router_args="--policy round_robin" if rr else "")
        with cluster:
            url = cluster.http_url + "/v1/chat/completions"
            asyncio.run(run_http(url, base[:4], -1, args.concurrency, 4))  # warm-up
            runs = [asyncio.run(run_http(url, base, run, args.concurrency, args.max_tokens))
                    for run in range(args.runs)]
        label = f"tandem {e} enc x {l_} lang" + (" (round-robin)" if rr else "")
        rows.append((label, summarize(runs)))
        print(f"{label} done", flush=True)

    b = baseline["rps"]
    lines = [
        f"# End-to-end benchmark ({args.arch}, `{args.size}` preset, CPU)",
        "",
        f"{args.requests} chat requests per run (mixed 0/1 image of 112-448 px, short/long "
        f"text, image repeat share {ideal:.0%} of image requests), {args.max_tokens} generated "
        f"tokens each (`ignore_eos`), concurrency {args.concurrency}, streaming over HTTP. "
        f"Median of {args.runs} runs. Machine: {machine()}.",
        "",
        "| setup | req/s | vs baseline | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
        "| image cache hits (ideal) | failures |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, s in rows:
        hit = "-" if label.startswith("transformers") else f"{s['hit']:.0%} ({ideal:.0%})"
        lines.append(f"| {label} | {s['rps']:.2f} | {s['rps'] / b:.2f}x | {s['ttft50']:.0f} | "
                     f"{s['ttft99']:.0f} | {s['tpot50']:.1f} | {s['tpot99']:.1f} | {hit} | "
                     f"{s['failures']} |")
    lines += ["", "Regenerate: `.venv/bin/python bench/e2e.py` (options: `--help`)."]
    publish("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
