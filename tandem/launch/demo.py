"""`tandem up --demo`: one chat with a generated image through the official `openai`
client, then the answer and the time spent in each stage."""

from __future__ import annotations

import base64
import io
import time

from tandem.launch.procs import say

STAGES = ("preprocess_ms", "vit_ms", "transfer_ms", "queue_ms", "prefill_ms", "decode_ms")


def demo_image_data_url(size: int = 224) -> str:
    """A PNG with a gradient, a red square and a blue disc, as a data URL."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size))
    px = img.load()
    for y in range(size):
        for x in range(size):
            px[x, y] = (x * 255 // size, y * 255 // size, 128)
    d = ImageDraw.Draw(img)
    d.rectangle([size // 8, size // 8, size // 2, size // 2], fill=(220, 30, 30))
    d.ellipse([size // 2, size // 2, size - size // 8, size - size // 8], fill=(30, 60, 220))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def run_demo(host: str, http_port: int, api_key: str = "") -> int:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{host}:{http_port}/v1", api_key=api_key or "none",
                    max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    say("[demo] sending one chat with a generated 224x224 image")
    t0 = time.perf_counter()
    try:
        resp = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": demo_image_data_url()}},
                {"type": "text", "text": "Describe this image in one sentence."},
            ]}],
            max_tokens=32,
            temperature=0,
        )
    except Exception as e:  # report any client error plainly and fail the demo
        say(f"[demo] request failed: {e}")
        return 1
    wall_ms = (time.perf_counter() - t0) * 1000
    ext = (resp.model_extra or {}).get("tandem") or {}
    timings = ext.get("timings") or {}
    say(f"[demo] answer ({resp.choices[0].finish_reason}): {resp.choices[0].message.content!r}")
    u = resp.usage
    say(f"[demo] tokens: prompt {u.prompt_tokens}, completion {u.completion_tokens}; "
        f"cached image tokens {ext.get('cached_image_tokens', 0)}")
    say("[demo] time per stage (ms):")
    for stage in STAGES:
        say(f"[demo]   {stage[:-3]:<11}{timings.get(stage, 0.0):10.1f}")
    say(f"[demo]   {'total':<11}{wall_ms:10.1f}  (client wall clock)")
    return 0
