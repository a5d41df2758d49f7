"""transformers' own video processing of clips, run inside `.oracle-venv` (never imported by
the suite: tests/test_video_preprocess.py runs it as a subprocess).

    .oracle-venv/bin/python tests/oracle/video_oracle.py JOB.json OUT_DIR

JOB.json is a list of cases {"id", "clip", "arch", "checkpoint", "init", "call"} (or, for a
video given as frames, "frames": [image paths] and "fps" instead of "clip": the PIL images
go to the processor as `videos=[[frame, ...]]` with `video_metadata` {"total_num_frames":
n, "fps": fps, "frames_indices": range(n)}; `call` then holds do_sample_frames=False, as
`Sampling.processor_kwargs(frames=True)` says). Each clip is
decoded by transformers' PyAV loader (`load_video(..., backend="pyav")`, every frame) and
goes through the stock processor of its architecture (Qwen2_5_VLProcessor with
Qwen2VLVideoProcessor, Qwen3VLProcessor with Qwen3VLVideoProcessor) built from the
checkpoint with `from_pretrained(checkpoint, **init)` and called with `**call` and the
loader's metadata: the processor samples, resizes, normalizes and patchifies. Written back:
OUT_DIR/<id>.npy (pixel_values_videos, float32) and OUT_DIR/results.json ({id: grid,
frames_indices, second_per_grid_ts, timestamps, text} or {id: {"error": ...}}).

The one departure from a stock install: torchvision's C++ ops (nms, roi_align; detection
only) are built for CUDA torch and cannot load beside the CPU torch, and torchvision's
import registers fake kernels for `torchvision::nms` / `qnms` unconditionally. Their schemas
are declared below (no kernel) so the import gets through; the video path uses only
torchvision's Python transforms over torch's own CPU kernels (asserted below).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

for _op in ("nms", "qnms"):
    torch.library.define(
        f"torchvision::{_op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
    )

import torchvision  # noqa: E402
from transformers import (  # noqa: E402
    AutoImageProcessor,
    AutoTokenizer,
    Qwen2_5_VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)
from transformers.video_utils import VideoMetadata, load_video  # noqa: E402

assert not torchvision.extension._has_ops()  # the video path never needs them
CLASSES = {
    "qwen2_5_vl": (Qwen2VLVideoProcessor, Qwen2_5_VLProcessor),
    "qwen3_vl": (Qwen3VLVideoProcessor, Qwen3VLProcessor),
    "qwen3_vl_moe": (Qwen3VLVideoProcessor, Qwen3VLProcessor),
}
PROMPT = "<|vision_start|><|video_pad|><|vision_end|>"


def decode(clip: str):
    """Every frame and the metadata, by transformers' PyAV loader. A container without a
    frame count in its header (WebM) gives that loader nothing; there the frames are read
    with PyAV the same way (rgb24) and counted."""
    import av

    with av.open(clip) as c:
        counted = c.streams.video[0].frames > 0
    if counted:
        return load_video(
            clip,
            backend="pyav",
            sample_indices_fn=lambda metadata, **_: np.arange(metadata.total_num_frames),
        )
    with av.open(clip) as c:
        s = c.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(s)])
        fps = float(s.average_rate)
    md = VideoMetadata(
        total_num_frames=len(frames),
        fps=fps,
        width=frames.shape[2],
        height=frames.shape[1],
        duration=len(frames) / fps,
        video_backend="pyav",
    )
    return frames, md


def given_frames(paths: list[str], fps: float):
    """A video given as frames (image files): the PIL images as opened, and the metadata
    that states their rate (`do_sample_frames=False` keeps every frame)."""
    from PIL import Image

    frames = [Image.open(p) for p in paths]
    # NOTE: an array, as sampling makes it: Qwen3VLProcessor pads a list of indices in place
    md = VideoMetadata(total_num_frames=len(frames), fps=fps,
                       frames_indices=np.arange(len(frames)))
    return frames, md


def run(case: dict, out: Path) -> dict:
    vp_cls, proc_cls = CLASSES[case["arch"]]
    ckpt = case["checkpoint"]
    vp = vp_cls.from_pretrained(ckpt, **case["init"])
    proc = proc_cls(
        image_processor=AutoImageProcessor.from_pretrained(ckpt),
        tokenizer=AutoTokenizer.from_pretrained(ckpt),
        video_processor=vp,
    )
    if "frames" in case:  # a video given as frames: PIL images, their rate as metadata
        frames, md = given_frames(case["frames"], case["fps"])
    else:
        frames, md = decode(case["clip"])
        md.frames_indices = None  # the processor's sampling sets it
    res = proc(
        text=[PROMPT],
        videos=[frames],
        video_metadata=[md],
        return_tensors="pt",
        return_metadata=True,
        **case["call"],
    )
    np.save(out / f"{case['id']}.npy", res["pixel_values_videos"].numpy())
    md = res["video_metadata"][0]
    indices = [int(i) for i in md.frames_indices]
    r = {
        "grid": res["video_grid_thw"][0].tolist(),
        "frames_indices": indices,
        "total_num_frames": md.total_num_frames,
        "fps": md.fps,
        "text": proc.tokenizer.decode(res["input_ids"][0]),
    }
    if "second_per_grid_ts" in res:
        r["second_per_grid_ts"] = float(res["second_per_grid_ts"][0])
    if hasattr(proc, "_calculate_timestamps"):
        r["timestamps"] = proc._calculate_timestamps(list(indices), md.fps, vp.temporal_patch_size)
    return r


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    results = {}
    for case in cases:
        try:
            results[case["id"]] = run(case, out)
        except Exception as e:  # a case transformers refuses: reported, not fatal
            results[case["id"]] = {"error": f"{type(e).__name__}: {e}"}
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
