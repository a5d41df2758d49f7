"""Encoder throughput and cache benchmark (prints markdown tables).

    .venv/bin/python bench/encoder.py [--arch qwen2_5_vl] [--size small] [--runs 3]
        [--device auto|cpu|cuda[:N]] [--dtype auto|float32|bfloat16|float16] [--model DIR]

1. Images per second, each request one image of mixed sizes, for 1, 8 and 32 concurrent
   requests through `EncodePipeline.encode` (preprocess + batched ViT + merge; cache off),
   against transformers' `get_image_features` called one image at a time (with the same
   image preprocessing) in the same run, on the same device and dtype (`--device auto`: the
   GPU where there is one; `--dtype auto`: bfloat16 there, float32 on the CPU). Median of
   `--runs` rounds.
2. Encode latency of a repeated image (cache hit) against its first sight (miss).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import statistics
import sys
import time
from pathlib import Path

# The encoder process's own setting (services/encoder/main.py), before torch loads MKL: this
# benchmark runs the pipeline in its own process.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from latency import checkpoint  # noqa: E402  (bench/, the script's own folder)

from tandem.chat import ImageInput, Message  # noqa: E402
from tandem.devices import DTYPES, resolve_device, resolve_dtype  # noqa: E402
from tandem.services.encoder.chat import EncodeJob  # noqa: E402
from tandem.services.encoder.config import EncoderConfig  # noqa: E402
from tandem.services.encoder.pipeline import EncodePipeline  # noqa: E402

SIZES = [(224, 224), (448, 336), (640, 480), (320, 320), (512, 256), (160, 400), (384, 384)]


def make_png(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def request(data: bytes) -> list[Message]:
    return [Message("user", ("Describe this image.", ImageInput(data=data)))]


class Baseline:
    """transformers, one image at a time: image processor + get_image_features, its
    features copied to the host as the encoder's are (so a GPU's work is inside the time)."""

    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        import tandem  # noqa: F401

        self.device, self.dtype = device, dtype
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device)
        self.model.eval()
        self.proc = AutoProcessor.from_pretrained(path)

    @torch.inference_mode()
    def one(self, data: bytes) -> None:
        pil = Image.open(io.BytesIO(data)).convert("RGB")
        x = self.proc.image_processor(images=[pil], return_tensors="pt")
        pixels = x["pixel_values"].to(self.device, self.dtype)
        out = self.model.model.get_image_features(pixels, x["image_grid_thw"].to(self.device),
                                                  return_dict=True)
        torch.cat(out.pooler_output).cpu()

    def images_per_s(self, images: list[bytes]) -> float:
        t0 = time.perf_counter()
        for data in images:
            self.one(data)
        return len(images) / (time.perf_counter() - t0)


async def ours(pipe: EncodePipeline, images: list[bytes], concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(data):
        async with sem:
            await pipe.encode(EncodeJob(request(data)))

    t0 = time.perf_counter()
    await asyncio.gather(*[one(d) for d in images])
    return len(images) / (time.perf_counter() - t0)


async def hit_vs_miss(pipe: EncodePipeline, runs: int) -> tuple[float, float]:
    miss, hit = [], []
    for k in range(runs):
        data = make_png(448, 336, 10_000 + k)
        t0 = time.perf_counter()
        await pipe.encode(EncodeJob(request(data)))
        miss.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        r = await pipe.encode(EncodeJob(request(data)))
        hit.append(time.perf_counter() - t0)
        assert r.cached_image_tokens > 0
    return statistics.median(miss), statistics.median(hit)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
    ap.add_argument("--size", default="small")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--images", type=int, default=32, help="images per round")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda[:N]")
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                    help="auto: bfloat16 on CUDA, float32 on the CPU (both sides)")
    ap.add_argument("--model", help="checkpoint directory (default: a tiny-model --size one)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device here")
    dtype = resolve_dtype(args.dtype, device)
    path = Path(args.model) if args.model else checkpoint(args.arch, args.size)
    images = [make_png(*SIZES[i % len(SIZES)], seed=i) for i in range(args.images)]

    base_model = Baseline(path, device, dtype)
    base_model.one(images[0])  # warm-up
    cfg = EncoderConfig(
        model=str(path),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        cache_bytes=0,
        cpu_threads=args.threads,
        preprocess_workers=2,
    )
    pipe = EncodePipeline.from_config(cfg)
    base: list[float] = []
    ours_by_c: dict[int, list[float]] = {1: [], 8: [], 32: []}

    async def run_all():
        pipe.start()
        try:
            await pipe.encode(EncodeJob(request(images[0])))  # warm-up
            for _ in range(args.runs):  # NOTE: interleaved, so load drift hits both sides
                base.append(base_model.images_per_s(images))
                for c, out in ours_by_c.items():
                    out.append(await ours(pipe, images, c))
            cached = EncodePipeline.from_config(cfg.model_copy(update={"cache_bytes": 1 << 28}))
            cached.start()
            try:
                return await hit_vs_miss(cached, max(3, args.runs))
            finally:
                await cached.stop()
        finally:
            await pipe.stop()

    miss, hit = asyncio.run(run_all())
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    what = args.model or f"{args.arch}, {args.size}"
    print(
        f"\n### Encoder throughput ({what}, {dev}, {str(dtype).removeprefix('torch.')}, "
        f"{args.threads} torch threads, {args.images} images of {len(SIZES)} sizes, "
        f"median of {args.runs})\n"
    )
    print("| concurrent requests | images/s | vs transformers one-at-a-time |")
    print("|---:|---:|---:|")
    b = statistics.median(base)
    print(f"| baseline (get_image_features, 1 by 1) | {b:.2f} | 1.00x |")
    for c, runs in ours_by_c.items():
        ips = statistics.median(runs)
        print(f"| {c} | {ips:.2f} | {ips / b:.2f}x |")
    print("\n### Cache hit vs first sight (one 448x336 image, whole encode)\n")
    print("| | latency ms | ratio |")
    print("|---|---:|---:|")
    print(f"| first sight (miss) | {miss * 1e3:.1f} | 1.00 |")
    print(f"| repeat (hit) | {hit * 1e3:.1f} | {hit / miss:.3f} |")


if __name__ == "__main__":
    main()
