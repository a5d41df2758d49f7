"""Reference checkpoints: `tandem tiny-model` output loads with transformers' Auto classes and
generates on an image chat; builds are reproducible; the tokenizer carries Qwen's special
tokens at the ids the config names; `import tandem` stays light yet enables AutoProcessor."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import tandem  # noqa: F401  (installs the processor hook before transformers is used)
from tandem.models import tokenizer as tk
from tandem.models.tiny import build_tiny_model

ARCHS = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
ROOT = Path(__file__).resolve().parent.parent


def make_image(w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def image_chat(text: str = "What is in this picture? 中文 😀") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def run_py(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """A fresh interpreter (import side effects must not leak from this process)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.parametrize("size", ["tiny", "small"])
@pytest.mark.parametrize("arch", ARCHS)
def test_auto_classes_generate_on_image_chat(checkpoint, arch, size):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = checkpoint(arch, size)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert model.config.model_type == arch
    n_params = sum(p.numel() for p in model.parameters())
    assert (n_params < 1_000_000) if size == "tiny" else (40e6 < n_params < 70e6), n_params

    prompt = processor.apply_chat_template(image_chat(), add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in prompt
    inputs = processor(text=[prompt], images=[make_image(90, 60)], return_tensors="pt")
    assert "mm_token_type_ids" in inputs  # get_rope_index needs it in transformers 5
    grid = inputs["image_grid_thw"][0]
    n_image = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert n_image == int(grid.prod()) // 4  # merge 2 x 2 patches per token
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    assert 1 <= new.numel() <= 5
    assert isinstance(processor.decode(new), str)


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_same_weight_file(tmp_path, arch):
    a = build_tiny_model(tmp_path / "a", arch=arch, size="tiny", seed=7)
    b = build_tiny_model(tmp_path / "b", arch=arch, size="tiny", seed=7)
    c = build_tiny_model(tmp_path / "c", arch=arch, size="tiny", seed=8)
    weights = [(p / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert weights[0] == weights[1]
    assert weights[0] != weights[2]
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    # readable by all, as a downloaded checkpoint (a pod's user reads it from a volume)
    assert {f.name: f.stat().st_mode & 0o777 for f in a.iterdir() if f.is_file()} == {
        f.name: 0o644 for f in a.iterdir() if f.is_file()}


def test_cli_builds_the_same_checkpoint_in_another_process(tmp_path):
    """The console script writes a complete checkpoint, byte-identical to an in-process build."""
    script = Path(sys.executable).with_name("tandem")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "tandem.cli"]
    out = tmp_path / "cli"
    res = subprocess.run(
        cmd + ["tiny-model", str(out), "--arch", "qwen3_vl", "--size", "tiny", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip().splitlines()[-1]) == out
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "processor_config.json",
        "chat_template.jinja",
    ):
        assert (out / name).is_file(), name
    here = build_tiny_model(tmp_path / "here", arch="qwen3_vl", size="tiny", seed=3)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (out / name).read_bytes() == (here / name).read_bytes(), name
    bad = subprocess.run(
        cmd + ["tiny-model", str(tmp_path / "x"), "--arch", "llama"], capture_output=True, text=True
    )
    # a usage error (exit 2), before anything is written; argparse's words are its own
    assert bad.returncode == 2 and not (tmp_path / "x").exists(), bad.stderr


@pytest.mark.parametrize("arch", ARCHS)
def test_special_tokens_match_config(checkpoint, arch):
    from transformers import AutoTokenizer

    path = checkpoint(arch)
    config = json.loads((path / "config.json").read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.convert_tokens_to_ids
    assert ids("<|image_pad|>") == config["image_token_id"] == tk.IMAGE_PAD_ID
    assert ids("<|video_pad|>") == config["video_token_id"] == tk.VIDEO_PAD_ID
    assert ids("<|vision_start|>") == config["vision_start_token_id"] == tk.VISION_START_ID
    assert ids("<|vision_end|>") == config["vision_end_token_id"] == tk.VISION_END_ID
    assert gen["eos_token_id"] == [ids("<|im_end|>"), ids("<|endoftext|>")]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert len(tok) <= config["text_config"]["vocab_size"]
    # Specials are single tokens inside text, and survive a round trip.
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>"
    enc = tok(text)["input_ids"]
    assert enc[0] == tk.IM_START_ID and tk.IMAGE_PAD_ID in enc
    assert tok.decode(enc) == text
    assert "<|im_end|>" not in tok.decode(enc, skip_special_tokens=True)


def test_tokenizer_round_trips_and_splits_multibyte_characters(checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint("qwen2_5_vl"))
    for text in ["Café crème, 中文测试, 😀🎉, Übermäßig!", "  spaces\tand\nnewlines ", "ĀĀ ꙮ 𝔘"]:
        assert tok.decode(tok(text)["input_ids"]) == text
    # Some character spans several byte-level tokens: a partial decode is not valid UTF-8,
    # which is what streaming detokenizers must handle.
    for char in ("🙂", "ꙮ"):  # kept out of the corpus on purpose (other tests rely on it)
        pieces = [tok.decode([i]) for i in tok(char)["input_ids"]]
        assert len(pieces) > 1 and all("\ufffd" in p for p in pieces), (char, pieces)


def test_import_tandem_is_light(checkpoint):
    path = checkpoint("qwen3_vl")
    client = "import tandem.client" if (ROOT / "tandem" / "client").exists() else ""
    res = run_py(
        f"""
        import sys
        import tandem
        {client}
        from tandem.models.checkpoint import read_spec
        spec = read_spec({str(path)!r})
        assert spec.embed_dim == spec.hidden_size * 3, spec
        heavy = [m for m in ("torch", "transformers") if m in sys.modules]
        assert not heavy, heavy
        print("ok")
        """
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_import_tandem_enables_auto_processor(checkpoint):
    """In a fresh interpreter: without `import tandem` AutoProcessor fails (no torchvision for
    the stock video processor); with it (imported before or after transformers) it loads the
    image-only processor."""
    from transformers.utils import is_torchvision_available

    path = str(checkpoint("qwen2_5_vl"))
    code = """
        {imp}
        from transformers import AutoProcessor

        def load():
            try:
                p = AutoProcessor.from_pretrained({path!r})
            except Exception as e:
                return "FAIL " + type(e).__name__
            return " ".join(["OK", type(p).__module__, *sorted(p.get_attributes())])

        print(load())
        import tandem  # late: transformers' auto-mapping is already loaded
        print(load())
    """
    ok = "OK tandem.models.processor image_processor tokenizer"
    with_hook = run_py(code.format(imp="import tandem", path=path))
    assert with_hook.returncode == 0, with_hook.stderr
    assert with_hook.stdout.splitlines() == [ok, ok]
    if not is_torchvision_available():
        late = run_py(code.format(imp="", path=path))
        assert late.returncode == 0, late.stderr
        first, second = late.stdout.splitlines()
        assert first.startswith("FAIL") and second == ok


def test_hub_style_processor_files_load(checkpoint, tmp_path):
    """A real Qwen2.5-VL snapshot's layout: preprocessor_config.json naming the stock
    `Qwen2_5_VLProcessor` / `Qwen2VLImageProcessor` with min/max pixels, chat_template.json."""
    from transformers import AutoProcessor

    src = checkpoint("qwen2_5_vl")
    dst = tmp_path / "hub"
    shutil.copytree(src, dst)
    proc_cfg = json.loads((dst / "processor_config.json").read_text())
    (dst / "processor_config.json").unlink()
    template = (dst / "chat_template.jinja").read_text()
    (dst / "chat_template.jinja").unlink()
    (dst / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    ip = proc_cfg["image_processor"]
    legacy = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": ip["image_mean"],
        "image_std": ip["image_std"],
        "min_pixels": 3136,
        "max_pixels": 28 * 28 * 64,
        "merge_size": 2,
        "patch_size": 14,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "temporal_patch_size": 2,
    }
    (dst / "preprocessor_config.json").write_text(json.dumps(legacy))
    proc = AutoProcessor.from_pretrained(dst)
    assert type(proc).__name__ == "Qwen2_5_VLProcessor"
    assert type(proc).__module__ == "tandem.models.processor"
    prompt = proc.apply_chat_template(image_chat(), add_generation_prompt=True)
    out = proc(text=[prompt], images=[make_image(600, 400)], return_tensors="pt")
    t, h, w = out["image_grid_thw"][0].tolist()
    assert t == 1 and h * w * 14 * 14 <= legacy["max_pixels"]  # max_pixels honoured


@pytest.mark.parametrize("arch", ARCHS)
def test_stock_transformers_with_torchvision_loads_the_processor(checkpoint, arch):
    """The checkpoint carries a video processor config whose patching equals the image
    processor's, so stock transformers (which builds a video processor wherever torchvision
    is installed) loads it. Where the peer benchmark's venv exists (stock transformers +
    torchvision), load it there for real."""
    ckpt = checkpoint(arch)
    video = json.loads((ckpt / "video_preprocessor_config.json").read_text())
    image = json.loads((ckpt / "processor_config.json").read_text())["image_processor"]
    for key in ("patch_size", "temporal_patch_size", "merge_size", "size", "image_mean"):
        assert video[key] == image[key], key
    peer = Path(__file__).resolve().parent.parent / ".venv-peer" / "bin" / "python"
    if not peer.exists():
        pytest.skip("no .venv-peer (make bench-peer installs it): config checked only")
    code = ("import sys; from transformers import AutoProcessor; "
            "p = AutoProcessor.from_pretrained(sys.argv[1]); print(type(p.video_processor).__name__)")
    r = subprocess.run([str(peer), "-c", code, str(ckpt)], capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "VideoProcessor" in r.stdout
