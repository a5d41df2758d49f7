"""How many encoders per language instance a workload needs, from the tiers' own metrics
(docs/deploy.md "Autoscaling"). Run `python bench/ratio.py [--requests 48] [--concurrency 8]`;
the figures go to bench/results/ratio.md.

A `tandem up` cluster of 1 encoder and 1 language instance (the tiny qwen2_5_vl, or
`--model`) serves `--requests` image chats (one distinct `--image` image each, 224x168 by
default, 16 output tokens) at `--concurrency`. From each tier's /metrics before and after:
- the encoder's busy fraction: ViT seconds (tandem_encoder_vit_seconds_sum) per second of
  wall time, and the patches it ran per ViT second (its capacity);
- the language instance's busy fraction: forward-step seconds
  (tandem_language_busy_seconds_total) per second of wall time;
- the scaling signals, sampled every 100 ms: patches waiting for or in the ViT
  (tandem_encoder_pending_patches), requests waiting for KV pages, KV use.
With both tiers fed by the same stream of requests, the busy fractions' ratio is the
encoders per language instance that keep both equally busy for this mix.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from encoder_peers.chats import png  # noqa: E402

from tandem.launch.cluster import LocalCluster  # noqa: E402
from tandem.launch.plan import default_model  # noqa: E402
from tandem.launch.procs import free_port  # noqa: E402

OUT = Path(__file__).parent / "results" / "ratio.md"
COUNTERS = ("tandem_encoder_vit_seconds_sum", "tandem_encoder_patches_total",
            "tandem_language_busy_seconds_total")
GAUGES = ("tandem_encoder_pending_patches", "tandem_language_waiting_requests",
          "tandem_language_kv_cache_usage_ratio")


def scrape(urls: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for url in urls:
        for line in httpx.get(url, timeout=5).text.splitlines():
            if line.startswith("tandem_") and " " in line and "{" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
    return out


async def load(url: str, n: int, concurrency: int, size: tuple[int, int], metrics: list[str],
               samples: list) -> float:
    gate = asyncio.Semaphore(concurrency)
    done = asyncio.Event()

    async def one(client: httpx.AsyncClient, i: int) -> None:
        image = "data:image/png;base64," + base64.b64encode(png(*size, 1000 + i)).decode()
        body = {"model": "", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "text", "text": f"Request {i}: what is shown?"}]}]}
        async with gate:
            r = await client.post(url, json=body)
            r.raise_for_status()

    async def sample() -> None:
        while not done.is_set():
            snap = await asyncio.to_thread(scrape, metrics)
            samples.append({k: snap.get(k, 0.0) for k in GAUGES})
            await asyncio.sleep(0.1)

    async with httpx.AsyncClient(timeout=300) as client:
        sampler = asyncio.ensure_future(sample())
        t0 = time.monotonic()
        await asyncio.gather(*(one(client, i) for i in range(n)))
        wall = time.monotonic() - t0
        done.set()
        await sampler
    return wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--model", default="", help="Checkpoint (default: the tiny qwen2_5_vl).")
    ap.add_argument("--image", default="224x168", help="Each chat's image size, WxH.")
    a = ap.parse_args()
    w, h = (int(x) for x in a.image.split("x"))
    model = a.model or str(default_model("qwen2_5_vl"))
    enc_port, lang_port = free_port(), free_port()
    cluster = LocalCluster(model, encoders=1, languages=1,
                           encoder_args=f"--metrics-port {enc_port}",
                           language_args=f"--metrics-port {lang_port}")
    metrics = [f"http://127.0.0.1:{p}/metrics" for p in (enc_port, lang_port)]
    samples: list[dict[str, float]] = []
    with cluster:
        url = cluster.http_url + "/v1/chat/completions"
        asyncio.run(load(url, 4, 4, (w, h), metrics, []))  # warm-up
        before = scrape(metrics)
        wall = asyncio.run(load(url, a.requests, a.concurrency, (w, h), metrics, samples))
        after = scrape(metrics)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
    enc_busy = d["tandem_encoder_vit_seconds_sum"] / wall
    lang_busy = d["tandem_language_busy_seconds_total"] / wall
    capacity = d["tandem_encoder_patches_total"] / max(d["tandem_encoder_vit_seconds_sum"], 1e-9)
    mean = {k: statistics.mean(s[k] for s in samples) for k in GAUGES}
    lines = [
        "## Encoders per language instance from the tiers' metrics (`bench/ratio.py`)", "",
        f"1 encoder x 1 language instance, {Path(model).name}, {a.requests} image chats "
        f"(one distinct {a.image} image each, 16 output tokens) at concurrency "
        f"{a.concurrency}; {os.cpu_count()} cores (shared by both tiers, the router and the "
        f"client). Wall time {wall:.1f} s ({a.requests / wall:.2f} req/s).", "",
        "| tier | busy fraction | signal (mean while loaded) |", "|---|---:|---|",
        f"| encoder | {enc_busy:.2f} (ViT s per s) | {mean['tandem_encoder_pending_patches']:.0f}"
        f" patches pending; ViT capacity {capacity:.0f} patches/s |",
        f"| language | {lang_busy:.2f} (step s per s) | "
        f"{mean['tandem_language_waiting_requests']:.1f} waiting, KV use "
        f"{mean['tandem_language_kv_cache_usage_ratio']:.3f} |", "",
        f"Encoders per language instance for this mix: busy fractions' ratio "
        f"**{enc_busy / max(lang_busy, 1e-9):.2f}**."]
    text = "\n".join(lines) + "\n"
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
