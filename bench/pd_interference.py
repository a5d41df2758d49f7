"""Decode TPOT while a long prompt is prefilled: the interference E/P/D exists to remove
(issue 39's second benchmark).

Two clusters of `tandem up`, in turn (alternating, --runs each), on the same model and
cores:

    both   --languages 1: the language instance on every core (`taskset -a -c 0-1`)
    epd    --prefill 1 --decode 1: the prefill instance on core 0, the decode instance
           on core 1 (`taskset -a -c`, every thread of the process)

(the encoder and the router stay where the launcher put them: text prompts skip the
encoder). Workload: --streams streams (raw completions, a short prompt, --stream-tokens
tokens each, ignore_eos) decode; once every stream has --warm tokens, one prompt of
--long-tokens tokens (max_tokens 1) is sent. A stream's inter-token gaps (client-side
arrival of each SSE chunk) are "idle" before the long prompt is sent and "during" from
then until its answer. Reported per mode: the median over runs of p50 and p99 of the gaps,
and the ratio during/idle of p99 (target <= 1.2 for E/P/D). Writes
bench/results/pd-interference.md.

    .venv/bin/python bench/pd_interference.py --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import httpx
from kv_transfer import _cpu  # the host's CPU model, as the KV benchmark names it

from tandem.launch.cluster import LocalCluster

OUT = Path(__file__).resolve().parent / "results" / "pd-interference.md"


def _pin(pid: int, cores: str) -> None:
    subprocess.run(["taskset", "-a", "-c", "-p", cores, str(pid)], check=True,
                   stdout=subprocess.DEVNULL)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _workload(url: str, args) -> tuple[list[float], list[float], float]:
    """(idle gaps, gaps during the long prefill, the long prompt's seconds), in ms/s."""
    arrivals: list[list[float]] = [[] for _ in range(args.streams)]
    long_window: list[float] = []
    warm = asyncio.Event()

    async def stream(http: httpx.AsyncClient, i: int) -> None:
        body = {"model": "", "prompt": f"Stream {i}: tell a long story about the sea.",
                "max_tokens": args.stream_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                    arrivals[i].append(time.monotonic())
                    if all(len(a) >= args.warm for a in arrivals):
                        warm.set()

    async with httpx.AsyncClient(timeout=600) as http:
        streams = [asyncio.ensure_future(stream(http, i)) for i in range(args.streams)]
        await warm.wait()
        t0 = time.monotonic()
        words = "the" + " the" * (args.long_tokens - 1)  # one token per word
        r = await http.post(url + "/v1/completions", json={
            "model": "", "prompt": words, "max_tokens": 1, "temperature": 0})
        t1 = time.monotonic()
        assert r.status_code == 200, r.text[:300]
        long_window = [t0, t1]
        long_tokens = r.json()["usage"]["prompt_tokens"]
        await asyncio.gather(*streams)
    idle, during = [], []
    for a in arrivals:
        for p, q in zip(a, a[1:], strict=False):
            if q <= long_window[0]:
                idle.append((q - p) * 1e3)
            elif p >= long_window[0] and q <= long_window[1] + 0.05:
                during.append((q - p) * 1e3)
    return idle, during, long_window[1] - long_window[0], long_tokens


def run_mode(mode: str, args) -> dict:
    up = (["--prefill", "1", "--decode", "1"] if mode == "epd" else [])
    cl = LocalCluster(args.model, encoders=1, languages=1, up_args=up,
                      language_args=f"--kv-staging-pages {args.long_tokens // 16 + 64} "
                                    f"--max-prefill-tokens {args.chunk}",
                      router_args="--load-refresh-s 0.5")
    cl.start()
    try:
        if mode == "epd":
            _pin(cl.instances["prefill-0"].pid, "0")
            _pin(cl.instances["decode-0"].pid, "1")
        else:
            _pin(cl.instances["language-0"].pid, "0-1")
        idle, during, long_s, long_tokens = asyncio.run(_workload(cl.http_url, args))
    finally:
        cl.stop()
    return {"idle50": _pct(idle, 0.5), "idle99": _pct(idle, 0.99),
            "dur50": _pct(during, 0.5), "dur99": _pct(during, 0.99), "long_s": long_s,
            "long_tokens": long_tokens, "n_idle": len(idle), "n_during": len(during)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="checkpoint (default: the tiny Qwen2.5-VL)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=400)
    p.add_argument("--warm", type=int, default=8)
    p.add_argument("--long-tokens", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=4096, help="--max-prefill-tokens")
    args = p.parse_args()
    if not args.model:
        from tandem.launch.plan import default_model

        args.model = str(default_model("qwen2_5_vl"))
    rows: dict[str, list[dict]] = {"both": [], "epd": []}
    for k in range(args.runs):
        for mode in (("both", "epd") if k % 2 == 0 else ("epd", "both")):
            r = run_mode(mode, args)
            rows[mode].append(r)
            print(mode, {k: round(v, 2) for k, v in r.items()}, flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[mode])

    lines = [
        "# Decode TPOT while a long prompt is prefilled (bench/pd_interference.py)", "",
        f"Host: {_cpu()}, {os.cpu_count()} cores (shared). Model: {args.model}. "
        f"{args.streams} streams of {args.stream_tokens} tokens; one prompt of "
        f"{statistics.median(r['long_tokens'] for r in rows['both']):.0f} tokens "
        f"(--max-prefill-tokens {args.chunk}) sent once every stream has {args.warm}. "
        f"Medians of {args.runs} runs, modes alternating. Inter-token gaps in ms, "
        "client side.", "",
        "| mode | cores | idle p50 | idle p99 | during p50 | during p99 | during p99 / idle "
        "p99 | long prompt s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, cores in (("both", "language 0-1"), ("epd", "prefill 0, decode 1")):
        lines.append(f"| {mode} | {cores} | {med(mode, 'idle50'):.1f} | "
                     f"{med(mode, 'idle99'):.1f} | {med(mode, 'dur50'):.1f} | "
                     f"{med(mode, 'dur99'):.1f} | "
                     f"{statistics.median(r['dur99'] / r['idle99'] for r in rows[mode]):.2f} | "
                     f"{med(mode, 'long_s'):.2f} |")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
