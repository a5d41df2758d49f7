"""The peer benchmark's workload, its load generator and its greedy-agreement check.

Everything goes through the official `openai` client (AsyncOpenAI, streaming), the same
requests to both systems: a workload is a pure function of its seed.
"""

from __future__ import annotations

import asyncio
import base64
import io
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import latency  # bench/, on the path of every bench script

PROMPTS = [
    "What is in this picture?",
    "Name the main colour.",
    "Write a short story about a lighthouse keeper and a storm.",
    "Please describe the scene in detail, including colours, shapes, layout and mood. " * 3,
    "List three facts about the moon.",
]


@dataclass(frozen=True)
class Req:
    text: str
    image: tuple[int, int] | None  # (width, height) of a noise PNG, or no image
    image_seed: int
    max_tokens: int


def workload(kind: str, n: int, seed: int, tokens: tuple[int, int] = (16, 64)) -> list[Req]:
    """`n` requests: `mixed` = half of them (chosen at random) with one image of 112-448 px
    per side; `text` = none. Output lengths uniform in `tokens` (forced by ignore_eos)."""
    rng = random.Random(seed)
    with_image = set(rng.sample(range(n), n // 2)) if kind == "mixed" else set()
    out = []
    for i in range(n):
        size = (rng.randint(112, 448), rng.randint(112, 448)) if i in with_image else None
        out.append(Req(rng.choice(PROMPTS), size, rng.getrandbits(32), rng.randint(*tokens)))
    return out


def png(seed: int, size: tuple[int, int]) -> bytes:
    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def messages(r: Req) -> list[dict]:
    content: list[dict] = [{"type": "text", "text": r.text}]
    if r.image is not None:
        url = "data:image/png;base64," + base64.b64encode(png(r.image_seed, r.image)).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return [{"role": "user", "content": content}]


def client(base_url: str):
    import httpx
    from openai import AsyncOpenAI

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    return AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=900,
                       http_client=httpx.AsyncClient(limits=limits, timeout=900))


@dataclass(frozen=True)
class Sampling:
    """What every request of a load asks: greedy (temperature 0) or sampled."""

    temperature: float = 0.0
    top_p: float = 1.0

    def describe(self) -> str:
        if self.temperature == 0:
            return "temperature 0"
        return f"temperature {self.temperature:g}, top-p {self.top_p:g}"


async def _run(base_url: str, model: str, reqs: list[Req], concurrency: int,
               sampling: Sampling = Sampling()) -> dict:  # noqa: B008 (frozen)
    bodies = [messages(r) for r in reqs]  # NOTE: built before the clock starts
    sem = asyncio.Semaphore(concurrency)
    ttft, tpot, errors = [], [], []
    tokens = 0

    async def one(api, r: Req, msgs: list[dict]):
        nonlocal tokens
        async with sem:
            t0 = time.perf_counter()
            first = last = None
            n = 0
            try:
                stream = await api.chat.completions.create(
                    model=model, messages=msgs, max_tokens=r.max_tokens,
                    temperature=sampling.temperature, top_p=sampling.top_p, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True})
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        last = time.perf_counter()
                        first = first or last
                    if chunk.usage:
                        n = chunk.usage.completion_tokens
            except Exception as e:  # noqa: BLE001  (any failure counts, the run goes on)
                errors.append(f"{type(e).__name__}: {e}"[:200])
                return
        if first is None or n == 0:
            errors.append("no tokens")
            return
        tokens += n
        ttft.append(first - t0)
        if n > 1:
            tpot.append((last - first) / (n - 1))

    async with client(base_url) as api:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(api, r, m) for r, m in zip(reqs, bodies, strict=True)))
        wall = time.perf_counter() - t0
    return {"rps": (len(reqs) - len(errors)) / wall, "tok_s": tokens / wall, "ttft": ttft,
            "tpot": tpot, "failures": len(errors), "errors": errors[:3]}


def run_load(base_url: str, model: str, reqs: list[Req], concurrency: int,
             sampling: Sampling = Sampling()) -> dict:  # noqa: B008 (frozen)
    return asyncio.run(_run(base_url, model, reqs, concurrency, sampling))


def summary(runs: list[dict]) -> dict:
    """Medians over runs of each run's figures (latencies in ms)."""
    return latency.summary(runs, medians=("rps", "tok_s"))


# --- greedy agreement with transformers' generate() ----------------------------------------


def agreement_prompts(n: int, seed: int = 77) -> list[Req]:
    """`n` prompts, alternately with and without an image; they stop at EOS or `max_tokens`."""
    rng = random.Random(seed)
    return [Req(rng.choice(PROMPTS),
                (rng.randint(112, 448), rng.randint(112, 448)) if i % 2 == 0 else None,
                rng.getrandbits(32), 24) for i in range(n)]


def oracle(model_dir: Path, prompts: list[Req]) -> list[list[int]]:
    """transformers `generate()` (float32, greedy) on each prompt: the expected token ids.

    Reuses the language tier tests' oracle (tests/language_oracle.py): the same model load,
    processor and `generate()` call the exactness tests compare against."""
    from PIL import Image

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    import language_oracle as lo

    model, proc = lo.load(Path(model_dir))
    out = []
    for r in prompts:
        images = [] if r.image is None else [
            Image.open(io.BytesIO(png(r.image_seed, r.image))).convert("RGB")]
        out.append(lo.generate(model, lo.make_inputs(proc, r.text, images), r.max_tokens)[0])
    lo.load.cache_clear()
    return out


def ids_openai(base_url: str, model: str, prompts: list[Req]) -> list[list[int] | None]:
    """Generated token ids through the OpenAI API (vLLM: `return_token_ids`)."""

    async def go():
        out: list[list[int] | None] = []
        async with client(base_url) as api:
            for r in prompts:  # one at a time: the reference is a batch of one
                try:
                    resp = await api.chat.completions.create(
                        model=model, messages=messages(r), max_tokens=r.max_tokens,
                        temperature=0, extra_body={"return_token_ids": True})
                    out.append(list((resp.choices[0].model_extra or {})["token_ids"]))
                except Exception:  # noqa: BLE001
                    out.append(None)
        return out

    return asyncio.run(go())


def ids_tandem(grpc_address: str, prompts: list[Req]) -> list[list[int] | None]:
    """Generated token ids through Tandem's SDK (its HTTP API returns text only)."""
    from tandem.client import Client, image

    out: list[list[int] | None] = []
    with Client(grpc_address, timeout=600) as c:
        for r in prompts:
            content = [r.text] if r.image is None else [image(png(r.image_seed, r.image)), r.text]
            try:
                res = c.chat([{"role": "user", "content": content}], max_tokens=r.max_tokens,
                             temperature=0.0)
                out.append(list(res.token_ids))
            except Exception:  # noqa: BLE001
                out.append(None)
    return out


def eos_ids(model_dir: Path) -> set[int]:
    import json

    eos = json.loads((Path(model_dir) / "generation_config.json").read_text()).get("eos_token_id")
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def agreement(got: list[list[int] | None], expected: list[list[int]], eos: set[int]) -> dict:
    """Prompts whose generated ids equal generate()'s (a trailing EOS is not compared: one
    side may report it, the other not)."""

    def strip(ids: list[int]) -> list[int]:
        while ids and ids[-1] in eos:
            ids = ids[:-1]
        return ids

    bad = []
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        g2, e2 = (None if g is None else strip(g)), strip(e)
        if g2 != e2:
            at = None if g2 is None else next(
                (k for k, (a, b) in enumerate(zip(g2, e2, strict=False)) if a != b),
                min(len(g2), len(e2)))
            bad.append({"prompt": i, "image": i % 2 == 0, "first_diff": at})
    return {"agree": len(got) - len(bad), "total": len(got), "mismatches": bad}
