"""ViT graphs over a mix of image sizes: captures counted, replay equal to eager, speed-up,
capture memory (the `make gpu-check` row for services/encoder/vit/runner.py).

    .venv/bin/python bench/vit_graphs.py [--dry-run] [--arch qwen2_5_vl] [--size small]
        [--dtype bfloat16] [--max-patches 4096] [--repeats 5]

or, from another script with bench/ on sys.path (bench/gpu_check.py, `make gpu-check`):

    from vit_graphs import check_vit_graphs
    rows = check_vit_graphs(model_dir, "cuda", torch.bfloat16, dry_run=False)  # [dict]
    # each row: "case", "ok" and the figures; `vit_graph_check` gives the whole report

One vision tower (random weights, `tandem tiny-model`), three runners over it:
- graph: CUDA graphs, every key captured when the runner is built (timed; the device
  memory the captures reserved is `stats.capture_bytes`);
- static: the same step run eagerly over the same buffers: a replay must equal it bit for bit;
- eager: transformers' blocks: a replay must be within `tolerance` x (1 + |eager|) of it.
The mix is batches of one to four images of assorted sizes, plus one batch over the largest
bucket (it must run eagerly). The batches in buckets run `repeats` times on the graph and the
eager runner after one warm-up; the speed-up is eager time / graph time over them.

Dry run (CI, or no CUDA): the tiny checkpoint in float32 on the CPU, `static` standing in
for `graph` (the CPU captures nothing), smaller images; the speed-up and capture memory rows
say "skipped (CUDA only)". It checks that this script works before a GPU ever runs it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from latency import checkpoint  # noqa: E402  (bench/, the script's own folder)

from tandem.devices import DTYPES  # noqa: E402
from tandem.services.encoder.vit.runner import VisionRunner  # noqa: E402

# Batches of images (width, height); the last one is over the largest bucket.
MIX = [[(448, 336)], [(224, 224)], [(640, 480), (224, 224)], [(320, 320), (512, 256), (160, 400)],
       [(384, 384)], [(448, 336), (640, 480), (320, 320), (224, 224)]]
DRY_MIX = [[(64, 48)], [(200, 130)], [(120, 90), (40, 150)], [(300, 260)],
           [(400, 300), (64, 48)]]
SKIPPED = "skipped (CUDA only)"


@dataclass
class VitGraphCheck:
    """What one run found; `ok()` is the pass/fail of the row."""

    device: str
    dtype: str
    model: str  # the checkpoint's directory name
    dry_run: bool
    keys: int  # keys the graph runner has (patch buckets x longest-segment bounds)
    captured: int  # recorded at start-up
    failed: int  # captures that failed (their buckets run eagerly)
    captured_after_mix: int  # must equal `captured`: nothing is captured while serving
    batches: int
    replays: int
    eager_batches: int  # must be 1: the batch over the largest bucket
    replay_equals_static: bool
    max_diff_vs_eager: float
    # every output x of a replay within tolerance * (1 + |eager's x|) of eager's: the `gpu`
    # test's rule (assert_close, rtol = atol = tolerance). An absolute bound alone is a
    # few bfloat16 steps at the 7B tower's largest outputs, where the graph's padded
    # matrix sizes round differently.
    within_tolerance: bool
    tolerance: float
    capture_s: float  # building the graph runner (all captures)
    capture_bytes: int | None  # None: skipped (CPU)
    eager_ms: float | None  # the whole mix, median of repeats; None: skipped
    graph_ms: float | None

    @property
    def speedup(self) -> float | None:
        return None if self.graph_ms is None else self.eager_ms / self.graph_ms

    def ok(self) -> bool:
        return (self.captured == self.keys and self.failed == 0
                and self.captured_after_mix == self.captured and self.eager_batches == 1
                and self.replays == self.batches - 1 and self.replay_equals_static
                and self.within_tolerance)

    def markdown(self) -> str:
        mode = "dry run, static step for graphs" if self.dry_run else "CUDA graphs"
        rows = [
            ("keys captured at start-up", f"{self.captured} of {self.keys} ({self.failed} failed)"),
            ("captures after the mix", f"{self.captured_after_mix} (none while serving)"),
            ("batches: replayed / eager", f"{self.replays} / {self.eager_batches} of "
                                          f"{self.batches}"),
            ("replay equal to the static step", "yes" if self.replay_equals_static else "NO"),
            ("max abs diff to eager", f"{self.max_diff_vs_eager:.3g}, "
                                      + ("within" if self.within_tolerance else "NOT within")
                                      + f" {self.tolerance:g} x (1 + |eager|)"),
            ("capture time", f"{self.capture_s:.2f} s"),
            ("capture memory", SKIPPED if self.capture_bytes is None
                else f"{self.capture_bytes / 2**20:.1f} MiB"),
            ("mix time eager / graph", SKIPPED if self.graph_ms is None
                else f"{self.eager_ms:.1f} ms / {self.graph_ms:.1f} ms"),
            ("speed-up", SKIPPED if self.speedup is None else f"{self.speedup:.2f}x"),
            ("row", "pass" if self.ok() else "FAIL"),
        ]
        head = (f"### ViT graphs over a mix of image sizes ({self.model}, {self.dtype}, "
                f"{self.device}; {mode})\n\n| check | result |\n|---|---|\n")
        return head + "\n".join(f"| {a} | {b} |" for a, b in rows) + "\n"


def _batches(path: Path, mix) -> list[tuple[torch.Tensor, list[tuple[int, int, int]]]]:
    """Pixels and grids of each batch, through the checkpoint's image processor."""
    from PIL import Image
    from transformers import AutoProcessor

    import tandem  # noqa: F401  (registers the image-only processors)

    proc = AutoProcessor.from_pretrained(path).image_processor
    rng = np.random.default_rng(0)
    out = []
    for sizes in mix:
        images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
                  for w, h in sizes]
        x = proc(images=images, return_tensors="pt")
        out.append((x["pixel_values"], [tuple(g) for g in x["image_grid_thw"].tolist()]))
    return out


def _timed(runner: VisionRunner, batches, repeats: int, device: torch.device) -> float:
    """Milliseconds for the whole mix, median of `repeats` (after one warm-up pass)."""
    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for pixels, grids in batches:
            runner.run(pixels, grids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e3

    once()
    return statistics.median(once() for _ in range(repeats))


def vit_graph_check(path: Path, device: str | torch.device, dtype: torch.dtype, dry_run: bool,
                    max_patches: int | None = None, repeats: int = 5) -> VitGraphCheck:
    """The row's figures (module doc) for the checkpoint at `path`. Without `dry_run`,
    `device` is a CUDA device."""
    from tandem.models.split import load_vision_part

    device = torch.device(device)
    if not dry_run and device.type != "cuda":
        raise ValueError(f"vit_graph_check runs CUDA graphs: {device} needs dry_run=True")
    visual = load_vision_part(path, dtype, device).visual
    batches = _batches(path, DRY_MIX if dry_run else MIX)
    patches = [sum(t * h * w for t, h, w in g) for _, g in batches]
    # the largest bucket holds every batch of the mix; one more batch holds them all
    limit = max_patches or max(patches)
    batches.append((torch.cat([p for p, _ in batches]), [g for _, gs in batches for g in gs]))
    if sum(patches) <= limit:
        raise ValueError(f"max_patches {limit} holds the whole mix ({sum(patches)} patches)")
    t0 = time.perf_counter()
    graph = VisionRunner(visual, max_patches=limit, mode="static" if dry_run else "graph")
    capture_s = time.perf_counter() - t0
    static = VisionRunner(visual, max_patches=limit, mode="static", attention=graph.attention)
    eager = VisionRunner(visual, mode="eager")
    captured = graph.stats.captured
    tol = 2e-3 if dtype == torch.float32 else 5e-2
    equal, within, diff = True, True, 0.0
    for pixels, grids in batches:
        g, s, e = graph.run(pixels, grids), static.run(pixels, grids), eager.run(pixels, grids)
        for a, b, c in zip([g.embeds, *g.deepstack], [s.embeds, *s.deepstack],
                           [e.embeds, *e.deepstack], strict=True):
            equal &= torch.equal(a, b)
            diff = max(diff, (a.float() - c.float()).abs().max().item())
            within &= torch.allclose(a.float(), c.float(), rtol=tol, atol=tol)
    replays, eager_batches = graph.stats.replays, graph.stats.eager
    eager_ms = graph_ms = None
    if not dry_run:
        eager_ms = _timed(eager, batches[:-1], repeats, device)  # the mix in buckets
        graph_ms = _timed(graph, batches[:-1], repeats, device)
    return VitGraphCheck(
        device=str(device) if dry_run else torch.cuda.get_device_name(device),
        dtype=str(dtype).removeprefix("torch."), model=Path(path).name, dry_run=dry_run,
        keys=len(graph.keys),
        captured=captured, failed=graph.stats.failed,
        captured_after_mix=graph.stats.captured, batches=len(batches), replays=replays,
        eager_batches=eager_batches, replay_equals_static=equal, max_diff_vs_eager=diff,
        within_tolerance=within, tolerance=tol, capture_s=capture_s,
        capture_bytes=None if dry_run else graph.stats.capture_bytes,
        eager_ms=eager_ms, graph_ms=graph_ms,
    )


def check_vit_graphs(model: Path, device: str, dtype: torch.dtype, dry_run: bool) -> list[dict]:
    """bench/gpu_check.py's row: one dict with "case", "ok" and the figures."""
    r = vit_graph_check(model, device, dtype, dry_run)
    mib = None if r.capture_bytes is None else round(r.capture_bytes / 2**20, 1)
    return [{
        "case": f"{r.batches} batches of 1-4 images ({r.model})", "ok": r.ok(),
        "keys": r.keys, "captured": r.captured, "failed": r.failed,
        "captured_after_mix": r.captured_after_mix, "replays": r.replays,
        "eager_batches": r.eager_batches, "replay_equals_static": r.replay_equals_static,
        "max_diff_vs_eager": r.max_diff_vs_eager, "within_tolerance": r.within_tolerance,
        "tolerance": r.tolerance,
        "capture_s": round(r.capture_s, 2),
        "capture_mib": SKIPPED if mib is None else mib,
        "eager_ms": SKIPPED if r.eager_ms is None else round(r.eager_ms, 2),
        "graph_ms": SKIPPED if r.graph_ms is None else round(r.graph_ms, 2),
        "speedup": SKIPPED if r.speedup is None else round(r.speedup, 2),
    }]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (CI)")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: tiny-model)")
    ap.add_argument("--arch", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl"])
    ap.add_argument("--size", default=None, help="tiny-model size (default: small; tiny dry)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    ap.add_argument("--max-patches", type=int, default=None,
                    help="largest bucket (default: the largest batch but the last)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    path = Path(args.model) if args.model else \
        checkpoint(args.arch, args.size or ("tiny" if args.dry_run else "small"))
    dtype = DTYPES[args.dtype or ("float32" if args.dry_run else "bfloat16")]
    report = vit_graph_check(path, "cpu" if args.dry_run else args.device, dtype, args.dry_run,
                             args.max_patches, args.repeats)
    print(report.markdown())
    sys.exit(0 if report.ok() else 1)


if __name__ == "__main__":
    main()
