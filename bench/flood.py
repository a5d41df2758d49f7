"""One client floods, another is served: the calm client's latency with and without a flood
(issue 16: other clients' p99 within 2x of the unloaded p99). Run by `make bench`, or
`python bench/flood.py [--requests 20] [--rounds 2]`; the table goes to bench/results/flood.md.

A `tandem up` cluster (1 encoder with 2 preprocessing workers, 1 language instance, the
tiny qwen2_5_vl). Two HTTP clients told apart by source address (127.0.0.1, 127.0.0.2):
- the flooder (a process of its own) keeps `--flood` requests in flight, each sent as soon
  as the last ended: with `--mix both`, two of three with an image URL on an allow-listed
  host that trickles one byte every 0.5 s (each holds a fetch for the whole URL timeout),
  one of three with ~2 MB of text and a small image (`--mix url` / `text`: one kind);
  with `--mix schema`, structured-output chats whose JSON schemas cost the grammar
  compiler most, new each time (no cache helps): 4,000 enum values of 45 characters and
  a pattern repeating 4,000 times (each just under a limit; about a second of compiling
  each on the tiny vocabulary), a 100,000-value enum (over the limit) and a schema that
  only refers to itself, in turn;
- the calm client sends `--requests` chats one after another (one 48x40 image, 4 output
  tokens; with `--mix schema`, a text chat with a small JSON schema, 8 output tokens) and
  we time each.
Phases alternate (calm alone, calm under the flood, ...) for `--rounds` rounds; p50/p99 of
the calm client's latency per phase and the ratio flooded / unloaded are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from encoder_peers.chats import png  # noqa: E402
from encoder_peers.trickle import start_trickle  # noqa: E402

from tandem.launch.cluster import LocalCluster  # noqa: E402
from tandem.launch.plan import default_model  # noqa: E402

OUT = Path(__file__).parent / "results" / "flood.md"
MIXES = {"both": "2 of 3 with a slow image URL, 1 of 3 with ~2 MB of text and an image",
         "url": "each with a slow image URL", "text": "each with ~2 MB of text and an image",
         "schema": "structured output with new schemas just under the limits (4,000 enum "
         "values of 45 characters; a pattern repeating 4,000 times), one over them and a "
         "self-referencing one, in turn"}


def calm_schema(i: int) -> dict:
    """The calm client's i-th schema: small, and new each time (it waits for a compile)."""
    return {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {
        "type": "integer", "minimum": 0, "maximum": 9 + i}}, "required": ["ok", "n"]}


def schema_body(schema: dict, max_tokens: int, timeout_ms: int) -> dict:
    return {"model": "", "messages": [{"role": "user", "content": "answer as JSON"}],
            "max_tokens": max_tokens, "temperature": 0, "timeout_ms": timeout_ms,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


def pathological(i: int) -> bytes:
    """The schema flood's i-th body (a new enum each time: no compile cache helps)."""
    kind = i % 4
    if kind == 0:
        schema = {"enum": [f"{i:08d}-{k:05d}-" + "abcdefghij" * 3 for k in range(4000)]}
    elif kind == 1:
        schema = {"type": "string", "pattern": f"^{i}[a-z]{{0,4000}}$"}
    elif kind == 2:
        schema = {"enum": list(range(100_000))}
    else:
        schema = {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}
    return json.dumps(schema_body(schema, 4, 120_000)).encode()


URL_TIMEOUT_S = 3.0
HUGE_TEXT = "lorem ipsum dolor sit amet " * 75_000  # ~2 MB


def image(data: bytes) -> dict:
    return {"type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def body(content: list, timeout_ms: int) -> dict:
    return {"model": "", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0, "timeout_ms": timeout_ms}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def flood_forever(url: str, trickle: str, flood: int, mix: str) -> None:
    """The flooder (its own process: its CPU is not the calm client's event loop): `flood`
    loops, each sending its next request as soon as the last one ended. Bodies are
    serialized once, as an attacker would."""
    bodies = [json.dumps(body([image(png(32, 32, 1)), {"type": "text", "text": HUGE_TEXT}],
                              120_000)).encode(),
              json.dumps(body([{"type": "image_url", "image_url": {"url": trickle}},
                               {"type": "text", "text": "what is this?"}], 120_000)).encode()]
    pick = {"text": [0], "url": [1], "both": [1, 1, 0], "schema": []}[mix]
    headers = {"content-type": "application/json"}
    serial = itertools.count()  # every schema body is new: no compile cache helps
    async with httpx.AsyncClient(timeout=120, transport=httpx.AsyncHTTPTransport(
            local_address="127.0.0.1")) as flooder:
        async def loop(k: int) -> None:
            i = k
            while True:
                content = (pathological(next(serial)) if mix == "schema"
                           else bodies[pick[i % len(pick)]])
                try:
                    await flooder.post(url, content=content, headers=headers)
                except httpx.HTTPError:
                    pass
                i += 1
                print("sent", flush=True)

        await asyncio.gather(*(loop(k) for k in range(flood)))


async def calm_phase(url: str, n: int, mix: str, seen: int) -> tuple[list[float], int]:
    """The calm client's latencies (s) and failures; `seen`: its requests so far."""
    async with httpx.AsyncClient(timeout=120, transport=httpx.AsyncHTTPTransport(
            local_address="127.0.0.2")) as calm:
        lat, failed = [], 0
        for i in range(n):
            t0 = time.monotonic()
            r = await calm.post(url, json=schema_body(calm_schema(i + seen), 8, 60_000)
                                if mix == "schema" else
                                body([image(png(48, 40, i % 7)),
                                      {"type": "text", "text": "describe"}], 60_000))
            lat.append(time.monotonic() - t0)
            failed += r.status_code != 200
    return lat, failed


def phase(url: str, trickle: str, n: int, flood: int, mix: str, seen: int = 0
          ) -> tuple[list[float], int, int]:
    """The calm client's latencies and failures, with a flooder process running (flood >
    0), and the flood requests it sent meanwhile."""
    proc = None
    if flood:
        proc = subprocess.Popen([sys.executable, __file__, "--flooder", url, trickle,
                                 str(flood), mix], stdout=subprocess.PIPE, text=True)
        time.sleep(3.0)  # the flood is under way
    try:
        lat, failed = asyncio.run(calm_phase(url, n, mix, seen))
    finally:
        sent = 0
        if proc is not None:
            proc.kill()
            sent = proc.stdout.read().count("sent")
            proc.wait()
    return lat, failed, sent


def main() -> None:
    if sys.argv[1:2] == ["--flooder"]:
        url, trickle, flood, mix = sys.argv[2:6]
        asyncio.run(flood_forever(url, trickle, int(flood), mix))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20, help="Calm requests per phase.")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--flood", type=int, default=12, help="Flood requests kept in flight.")
    ap.add_argument("--mix", choices=["both", "url", "text", "schema"], default="both",
                    help="The flood's requests: slow URLs and huge texts (2:1), one kind, "
                    "or pathological JSON schemas.")
    ap.add_argument("--router-args", default="",
                    help="Extra router flags, e.g. '--refusal-bytes-per-s 0' (the refused-"
                    "bytes budget off: the flood's CPU cost alone).")
    a = ap.parse_args()

    trickle, stop_trickle = start_trickle()
    cluster = LocalCluster(
        str(default_model("qwen2_5_vl")), encoders=1, languages=1,
        encoder_args=f"--allowed-url-hosts 127.0.0.1 --allow-private-urls "
        f"--url-timeout-s {URL_TIMEOUT_S} --preprocess-workers 2", router_args=a.router_args)
    runs: dict[str, list[float]] = {"unloaded": [], "flooded": []}
    fails = {"unloaded": 0, "flooded": 0}
    flood_sent = 0
    with cluster:
        url = cluster.http_url + "/v1/chat/completions"
        phase(url, trickle, 3, 0, a.mix, 10_000)  # warm-up (its own schemas)
        seen = 0
        for _ in range(a.rounds):
            for name, flood in (("unloaded", 0), ("flooded", a.flood)):
                lat, failed, sent = phase(url, trickle, a.requests, flood, a.mix, seen)
                seen += a.requests
                runs[name] += lat
                fails[name] += failed
                flood_sent += sent
    stop_trickle()
    ms = {k: (statistics.median(v) * 1e3, pct(v, 0.99) * 1e3) for k, v in runs.items()}
    calm = ("text chats with a small JSON schema, new each time (8 output tokens)"
            if a.mix == "schema" else "image chats")
    slow = "" if a.mix == "schema" else (f"; the URL trickles one byte per 0.5 s, URL "
                                         f"timeout {URL_TIMEOUT_S:g} s")
    lines = [
        f"## One client floods, another is served (bench/flood.py --mix {a.mix})", "",
        f"`tandem up` (1 encoder, 2 preprocessing workers, 1 language instance, tiny "
        f"qwen2_5_vl). The calm client (127.0.0.2) sends {a.requests} {calm} one after "
        f"another per phase; under the flood, the flooder (127.0.0.1) keeps {a.flood} requests "
        f"in flight ({MIXES[a.mix]}{slow}). Phases alternate, {a.rounds} rounds "
        f"({flood_sent} flood requests answered while the calm client ran). Host: "
        f"{os.cpu_count()} cores (shared). Router flags: `{a.router_args or '(defaults)'}`.", "",
        "| phase | calm requests | failed | p50 ms | p99 ms |", "|---|---|---|---|---|"]
    for k in ("unloaded", "flooded"):
        lines.append(f"| {k} | {len(runs[k])} | {fails[k]} | {ms[k][0]:.0f} | {ms[k][1]:.0f} |")
    lines += ["", f"Calm client's p99 under the flood / unloaded: "
              f"**{ms['flooded'][1] / ms['unloaded'][1]:.2f}x** "
              f"(p50 {ms['flooded'][0] / ms['unloaded'][0]:.2f}x)."]
    text = "\n".join(lines) + "\n"
    OUT.parent.mkdir(parents=True, exist_ok=True)
    out = OUT if a.mix == "both" else OUT.with_name(f"flood-{a.mix}.md")
    if a.router_args:
        out = out.with_name(out.stem + "-custom.md")
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
