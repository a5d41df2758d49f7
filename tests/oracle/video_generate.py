"""transformers' own answer to a chat with videos (and images and text), run inside
`.oracle-venv` (never imported by the suite: the video tests run it as a subprocess).

    .oracle-venv/bin/python tests/oracle/video_generate.py JOB.json OUT_DIR

JOB.json is a list of cases {"id", "arch", "checkpoint", "messages", "init", "call",
"max_new_tokens", "payload"}. `messages` are chat messages whose content parts are
{"type": "text", "text"}, {"type": "image", "path"} (a PNG), {"type": "video", "path"} or
{"type": "video", "frames": [image paths], "fps"} (a video given as frames:
video_oracle.given_frames; its case's `call` has do_sample_frames=False).
Each case goes through the stock processor of its architecture (video_oracle.CLASSES: the
video processor built with `from_pretrained(checkpoint, **init)`, the image processor
with transformers' PIL backend, which is what the project's venv, without torchvision,
gets): `apply_chat_template` with {"type": "image"} / {"type": "video"} parts, then the
processor on the text, the images and every frame of each video as transformers' PyAV
loader decodes it (video_oracle.decode), with `**call`; then greedy `generate()` on the
checkpoint in float32. Written back, OUT_DIR/results.json: {id: {"input_ids",
"positions" [3][L], "delta" (get_rope_index's), "tokens", "decode_deltas" (per decode
step, the (t, h, w) position minus the token's index that generate() fed the model),
"video_grid_thw", "second_per_grid_ts"} or {"error"}}; with "payload": true also OUT_DIR/<id>.npy, the prompt's input embeddings as
the encoder must make them ([L, hidden * (1 + num_deepstack)], float32: image and video
features spliced in, deepstack features at their positions, zeros elsewhere).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

# NOTE: first: video_oracle declares torchvision's ops, which transformers' import needs
from video_oracle import CLASSES, decode, given_frames

# isort: split
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer


def load(ckpt: str):
    return AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()


@torch.inference_mode()
def payload(model, inputs: dict) -> np.ndarray:
    """The prompt's embeddings as the encoder sends them (language_oracle.payload's rule,
    for images and videos)."""
    inner = model.model
    ids = inputs["input_ids"]
    embeds = inner.get_input_embeddings()(ids)[0].clone()
    hidden = embeds.shape[-1]
    nd = len(getattr(model.config.vision_config, "deepstack_visual_indexes", None) or ())
    extra = torch.zeros(embeds.shape[0], hidden * nd, dtype=embeds.dtype)
    for kind, pix, grid, token in (
        ("image", "pixel_values", "image_grid_thw", model.config.image_token_id),
        ("video", "pixel_values_videos", "video_grid_thw", model.config.video_token_id),
    ):
        if pix not in inputs:
            continue
        fn = inner.get_image_features if kind == "image" else inner.get_video_features
        out = fn(inputs[pix], inputs[grid], return_dict=True)
        mask = ids[0] == token
        embeds[mask] = torch.cat(out.pooler_output, dim=0).to(embeds.dtype)
        for k in range(nd):
            extra[mask, k * hidden : (k + 1) * hidden] = torch.cat(out.deepstack_features[k])
    return torch.cat([embeds, extra], dim=1).numpy()


@contextlib.contextmanager
def decode_deltas(model):
    """The MRoPE delta generate() decodes with: per decode step, each position row minus
    the token's index ([4, batch, 1] position ids: the index, then the t, h, w rows)."""
    lm = model.model.language_model
    forward, out = lm.forward, []

    def spy(*args, **kwargs):
        pos = kwargs.get("position_ids")
        if pos is not None and pos.dim() == 3 and pos.shape[0] == 4 and pos.shape[-1] == 1:
            out.append([int(pos[r, 0, 0] - pos[0, 0, 0]) for r in (1, 2, 3)])
        return forward(*args, **kwargs)

    lm.forward = spy
    try:
        yield out
    finally:
        lm.forward = forward


def run(case: dict, out: Path, models: dict) -> dict:
    from PIL import Image

    vp_cls, proc_cls = CLASSES[case["arch"]]
    ckpt = case["checkpoint"]
    proc = proc_cls(
        image_processor=AutoImageProcessor.from_pretrained(ckpt, backend="pil"),
        tokenizer=AutoTokenizer.from_pretrained(ckpt),
        video_processor=vp_cls.from_pretrained(ckpt, **case["init"]),
        chat_template=(Path(ckpt) / "chat_template.jinja").read_text(),
    )
    images, videos, metadata, messages = [], [], [], []
    for m in case["messages"]:
        content = []
        for p in m["content"]:
            if p["type"] == "text":
                content.append(p)
            elif p["type"] == "image":
                images.append(Image.open(p["path"]).convert("RGB"))
                content.append({"type": "image"})
            elif "frames" in p:  # a video given as frames: PIL images and their rate
                frames, md = given_frames(p["frames"], p["fps"])
                videos.append(frames)
                metadata.append(md)
                content.append({"type": "video"})
            else:
                frames, md = decode(p["path"])
                md.frames_indices = None  # the processor's sampling sets it
                videos.append(frames)
                metadata.append(md)
                content.append({"type": "video"})
        messages.append({"role": m["role"], "content": content})
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = dict(
        proc(
            text=[text],
            images=images or None,
            videos=videos or None,
            video_metadata=metadata or None,
            return_tensors="pt",
            **case["call"],
        )
    )
    if ckpt not in models:
        models[ckpt] = load(ckpt)
    model = models[ckpt]
    pos, delta = model.model.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"),
        second_per_grid_ts=inputs.get("second_per_grid_ts"),
    )
    with torch.inference_mode(), decode_deltas(model) as deltas:
        seq = model.generate(**inputs, max_new_tokens=case["max_new_tokens"], do_sample=False)
    if case.get("payload"):
        np.save(out / f"{case['id']}.npy", payload(model, inputs))
    r = {
        "input_ids": inputs["input_ids"][0].tolist(),
        "positions": pos[:, 0].tolist(),
        "delta": int(delta.reshape(-1)[0]),
        "tokens": seq[0, inputs["input_ids"].shape[1] :].tolist(),
        "decode_deltas": deltas,
    }
    if "video_grid_thw" in inputs:
        r["video_grid_thw"] = inputs["video_grid_thw"].tolist()
    if "second_per_grid_ts" in inputs:
        r["second_per_grid_ts"] = inputs["second_per_grid_ts"].tolist()
    return r


def main() -> None:
    torch.set_num_threads(1)  # the encoder's and language tier's float32 CPU runs
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    results, models = {}, {}
    for case in cases:
        try:
            results[case["id"]] = run(case, out, models)
        except Exception as e:  # reported per case: the test names it
            results[case["id"]] = {"error": f"{type(e).__name__}: {e}"}
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
