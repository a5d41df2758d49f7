"""Reuse across turns: the prefix cache on vs off, and text-only chats with vs without the
encoder, each pair side by side in one run on fresh `tandem up` clusters.

    .venv/bin/python bench/reuse.py [--size small] [--conversations 8] [--turns 6]
                                    [--max-tokens 16] [--text-requests 12] [--runs 3]
                                    [--text-concurrency 8] [--text-only] [--language-args FLAGS]
                                    [--out bench/results/reuse.md]

Multi-turn workload: `--conversations` chats run concurrently, each `--turns` turns in
sequence; every chat starts with the same system prompt (~300 tokens) and a user turn with
one 224x224 image (its own), later user turns are one short sentence, and each assistant
reply (temperature 0, `--max-tokens` tokens) goes back into the history. Reported per
cluster: TTFT p50/p99 of turns 2.. (where reuse can help) and of all turns, requests/s,
prompt tokens served from the prefix cache, and payload bytes the encoder wrote per
request (its transfer byte counter).

Text-only workload: `--text-requests` distinct chats (no image) of each size, short (a
sentence) and long (~300 words), one at a time, then short ones `--text-concurrency` at a
time (a server's usual state: the encoder path's extra work competes with prefill and decode
for the same cores): TTFT p50 through the language tier directly (the router's encoder
bypass) and through an encoder (`--no-encoder-bypass`). `--text-only` skips multi-turn.

Clusters (1 encoder + 1 language, float32 CPU): default; `--no-prefix-cache` on the
language tier; `--no-encoder-bypass` on the router. Each run starts all three fresh (cold
caches), in alternating order; medians over `--runs` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from latency import checkpoint, machine, pct, publish  # noqa: E402  (bench/, the script's own folder)

from tandem.launch.cluster import LocalCluster  # noqa: E402
from tandem.launch.procs import free_port  # noqa: E402

SYSTEM = ("You are a meticulous visual assistant. Describe what you see precisely, name "
          "colours and shapes, and keep each answer short and factual. ") * 9
FOLLOW_UPS = ["What colour stands out most?", "Is there any text in it?", "Describe the "
              "top-left corner.", "How many distinct shapes are there?", "Summarise it."]
TEXT_SIZES = {"short": 12, "long": 300}  # words of a text-only chat
CONFIGS = {
    "cache on": {},
    "cache off": {"language_args": "--no-prefix-cache"},
    "encoder path": {"router_args": "--no-encoder-bypass"},
}


def png(seed: int) -> str:
    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", (224, 224), bytes(rng.getrandbits(8) for _ in range(224 * 224 * 3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def scrape(port: int) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines():
        m = re.match(r"^([a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _failed(why: str) -> dict:
    print(f"request failed: {why}", file=sys.stderr, flush=True)
    return {"failed": True}


async def stream_chat(http, url: str, messages: list, max_tokens: int) -> dict:
    """One streamed chat. `ttft`: until the first generated token's chunk (a content chunk
    after the role chunk, even when the token's text is empty, or the finish chunk);
    `ttft_text`: until the first non-empty text. They differ when the first token has no
    text of its own (a random-weight model often samples a partial UTF-8 byte): then
    `ttft_text` also holds one or more decode steps, the same on every path."""
    body = {"model": "", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = first_text = None
    text, usage = "", {}
    async with http.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            return _failed(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return _failed(f"stream error: {ev['error']}")
            choice = (ev.get("choices") or [{}])[0]
            delta = choice.get("delta") or {}
            now = time.perf_counter()
            if ("content" in delta and "role" not in delta) or choice.get("finish_reason"):
                first = first or now
            # the first text, or an answer that ends without any (EOS at once)
            if delta.get("content") or choice.get("finish_reason"):
                first_text = first_text or now
                text += delta.get("content") or ""
            usage = ev.get("usage") or usage
    if first is None:
        return _failed(f"no answer (usage {usage})")
    return {"failed": False, "ttft": first - t0, "ttft_text": first_text - t0, "text": text,
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


async def multi_turn(url: str, run: int, conversations: int, turns: int, max_tokens: int):
    import httpx

    by_turn: list[list[float]] = [[] for _ in range(turns)]
    cached, failures = [], 0

    async def conversation(http, c: int) -> None:
        nonlocal failures
        history = [{"role": "system", "content": SYSTEM},
                   {"role": "user", "content": [
                       {"type": "image_url", "image_url": {"url": png(run * 1000 + c)}},
                       {"type": "text", "text": "What is in this picture?"}]}]
        for t in range(turns):
            r = await stream_chat(http, url, history, max_tokens)
            if r["failed"]:
                failures += 1
                return
            by_turn[t].append(r["ttft"])
            cached.append(r["cached"])
            history += [{"role": "assistant", "content": r["text"]},
                        {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]

    async with httpx.AsyncClient(timeout=600) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(http, c) for c in range(conversations)))
        wall = time.perf_counter() - t0
    n = sum(len(x) for x in by_turn)
    return {"later": [x for xs in by_turn[1:] for x in xs], "all": [x for xs in by_turn for x in xs],
            "rps": n / wall, "cached": sum(cached) / max(n, 1), "requests": n,
            "failures": failures}


async def text_only(url: str, run: int, n: int, n_words: int, concurrency: int = 1,
                    max_tokens: int = 2) -> dict:
    import httpx

    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    ttft, ttft_text, failures = [], [], 0
    gate = asyncio.Semaphore(concurrency)

    async def one(http, i: int) -> None:
        nonlocal failures
        rng = random.Random(run * 7919 + i)
        text = f"Note {run}-{i}: " + " ".join(rng.choice(words) for _ in range(n_words))
        async with gate:
            r = await stream_chat(http, url, [{"role": "user", "content": text}], max_tokens)
        if r["failed"]:
            failures += 1
        else:
            ttft.append(r["ttft"])
            ttft_text.append(r["ttft_text"])

    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(one(http, i) for i in range(n)))
    return {"ttft": ttft, "ttft_text": ttft_text, "failures": failures}


def one_cluster(model_dir: Path, name: str, run: int, args) -> dict:
    enc_port = free_port()
    kw = CONFIGS[name]
    cluster = LocalCluster(str(model_dir), encoders=1, languages=1,
                           encoder_args=f"--metrics-port {enc_port}",
                           language_args=f"{kw.get('language_args', '')} {args.language_args}".strip(),
                           router_args=kw.get("router_args", ""))
    out: dict = {}
    with cluster:
        url = cluster.http_url + "/v1/chat/completions"
        asyncio.run(text_only(url, -1 - run, 2, 8))  # warm-up (distinct prompts: nothing cached)
        if name in ("cache on", "cache off") and not args.text_only:
            before = scrape(enc_port)
            out["mt"] = asyncio.run(multi_turn(url, run, args.conversations, args.turns,
                                               args.max_tokens))
            after = scrape(enc_port)
            key = 'tandem_transfer_bytes_total{side="encoder"}'
            out["mt"]["bytes"] = (after.get(key, 0) - before.get(key, 0)) / out["mt"]["requests"]
        if name in ("cache on", "encoder path"):
            out["text"] = {size: asyncio.run(text_only(url, run, args.text_requests, words))
                           for size, words in TEXT_SIZES.items()}
            c = args.text_concurrency  # distinct prompts (run + 100): nothing cached
            out["text"]["concurrent"] = asyncio.run(text_only(
                url, run + 100, 4 * c, TEXT_SIZES["short"], concurrency=c, max_tokens=16))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--text-requests", type=int, default=12)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--text-concurrency", type=int, default=8)
    p.add_argument("--text-only", action="store_true", help="skip the multi-turn workload")
    p.add_argument("--language-args", default="",
                   help="extra flags for every cluster's language tier (a tried setting)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "reuse.md"))
    args = p.parse_args()

    model_dir = checkpoint(args.arch, args.size)
    names = ["cache on", "encoder path"] if args.text_only else list(CONFIGS)
    results: dict[str, list[dict]] = {name: [] for name in names}
    for run in range(args.runs):
        order = names if run % 2 == 0 else list(reversed(names))
        for name in order:
            results[name].append(one_cluster(model_dir, name, run, args))
            print(f"run {run}: {name} done", flush=True)

    med = statistics.median

    def mt(name: str, f) -> float:
        return med(f(r["mt"]) for r in results[name])

    def row(name: str) -> str:
        return (f"| {name} | {mt(name, lambda m: pct(m['later'], .5)) * 1e3:.0f} | "
                f"{mt(name, lambda m: pct(m['later'], .99)) * 1e3:.0f} | "
                f"{mt(name, lambda m: pct(m['all'], .5)) * 1e3:.0f} | "
                f"{mt(name, lambda m: m['rps']):.2f} | {mt(name, lambda m: m['cached']):.0f} | "
                f"{mt(name, lambda m: m['bytes']) / 1e3:.0f} | "
                f"{sum(r['mt']['failures'] for r in results[name])} |")

    sizes = [*TEXT_SIZES, "concurrent"]
    by, by_text = ({(n, size): med(pct(r["text"][size][key], .5) for r in results[n])
                    for n in ("cache on", "encoder path") for size in sizes}
                   for key in ("ttft", "ttft_text"))
    fails = {n: sum(r["text"][size]["failures"] for r in results[n] for size in sizes)
             for n in ("cache on", "encoder path")}
    c = args.text_concurrency
    lines = [f"# Reuse benchmark ({args.arch}, `{args.size}` preset, CPU)", ""]
    if not args.text_only:
        on_later = mt("cache on", lambda m: pct(m["later"], .5))
        off_later = mt("cache off", lambda m: pct(m["later"], .5))
        lines += [
            f"Multi-turn: {args.conversations} conversations x {args.turns} turns, concurrent "
            f"conversations, sequential turns; shared system prompt, one 224x224 image in the "
            f"first turn, short follow-ups, {args.max_tokens}-token replies fed back. 1 encoder "
            f"+ 1 language, fresh clusters, alternating order, median of {args.runs} runs. "
            f"Machine: {machine()}.",
            "",
            "| language prefix cache | TTFT p50 turns 2+ ms | TTFT p99 turns 2+ ms | TTFT p50 all "
            "ms | req/s | cached prompt tokens / req | encoder payload KB / req | failures |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            row("cache on"),
            row("cache off"),
            "",
            f"TTFT p50 of turns 2+, cache on / off: **{on_later / off_later:.2f}**.",
            "",
        ]
    lines += [
        f"Text-only: {args.text_requests} distinct chats per size (short: "
        f"{TEXT_SIZES['short']} words, long: {TEXT_SIZES['long']} words), one at a time, "
        f"2 tokens each; then {4 * c} distinct short chats {c} at a time, 16 tokens each. "
        f"1 encoder + 1 language, fresh clusters, alternating order, median of {args.runs} "
        f"runs. Machine: {machine()}.",
        "",
        f"| path | TTFT p50 short ms | TTFT p50 long ms | TTFT p50 short, {c} concurrent ms "
        "| failures |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(f"| {label} | " + " | ".join(f"{by[n, size] * 1e3:.0f}" for size in sizes)
          + f" | {fails[n]} |"
          for n, label in (("cache on", "straight to the language tier (encoder bypass)"),
                           ("encoder path", "through the encoder (`--no-encoder-bypass`)"))),
        "",
        "TTFT p50 bypass / encoder path: " + ", ".join(
            f"{size} **{by['cache on', size] / by['encoder path', size]:.2f}**"
            for size in sizes) + ".",
        "",
        "TTFT here is until the first generated token's chunk. Until the first non-empty "
        "text instead (which adds decode steps wherever the random model's first token has "
        "no text of its own), p50 ms bypass / encoder path: " + ", ".join(
            f"{size} {by_text['cache on', size] * 1e3:.0f} / "
            f"{by_text['encoder path', size] * 1e3:.0f} "
            f"({by_text['cache on', size] / by_text['encoder path', size]:.2f})"
            for size in sizes) + ".",
        "",
        "Regenerate: `.venv/bin/python bench/reuse.py` (options: `--help`).",
    ]
    publish("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
