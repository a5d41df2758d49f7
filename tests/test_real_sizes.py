"""Real sizes for `tandem tiny-model` (7b, 8b, 30b-a3b) without writing 16-62 GB here.

- Each real size has its released model's parameter count to the unit (Qwen2.5-VL-7B
  8,292,166,656; Qwen3-VL-8B 8,767,123,696; Qwen3-VL-30B-A3B 31,070,754,032) and its shapes.
- A dry run writes every file but the shards: the config on disk builds, in transformers on
  the meta device, the same tensors the plan lists; the language tier reads the spec, finds
  every decoder tensor it needs, and builds its decoder from them on the meta device.
- The streamed writer writes what `save_pretrained` writes (names, shapes, dtypes, config)
  and transformers loads it with nothing missing or unexpected; same seed, same bytes;
  norms start at one, biases at zero, the rest at N(0, initializer_range).
- It streams: writing the small preset (206 MB) and one 128 MB tensor raise the process's
  peak memory by a few blocks, not by what they write (a child process, its peak reset
  once the plan is made).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tandem.models.random_weights import Init
from tandem.models.tiny import REAL_SIZES, build_tiny_model, plan_tiny_model

ROOT = Path(__file__).resolve().parent.parent
# The released checkpoints' counts (their safetensors index: total_parameters).
RELEASED = {"7b": 8_292_166_656, "8b": 8_767_123_696, "30b-a3b": 31_070_754_032}
SHAPES = {  # a few tensors of each, as the released files hold them
    "7b": {
        "model.embed_tokens.weight": (152064, 3584),
        "lm_head.weight": (152064, 3584),
        "model.layers.27.self_attn.k_proj.weight": (512, 3584),
        "model.layers.0.self_attn.q_proj.bias": (3584,),
        "model.layers.0.mlp.gate_proj.weight": (18944, 3584),
        "visual.blocks.31.attn.qkv.weight": (3840, 1280),
        "visual.merger.mlp.0.weight": (5120, 5120),
        "visual.merger.mlp.2.weight": (3584, 5120),
    },
    "8b": {
        "model.language_model.layers.35.self_attn.k_proj.weight": (1024, 4096),
        "model.language_model.layers.0.self_attn.q_norm.weight": (128,),
        "model.language_model.layers.0.mlp.down_proj.weight": (4096, 12288),
        "model.visual.blocks.26.mlp.linear_fc1.weight": (4304, 1152),
        "model.visual.deepstack_merger_list.2.linear_fc2.weight": (4096, 4608),
        "model.visual.pos_embed.weight": (2304, 1152),
    },
    "30b-a3b": {
        "model.language_model.layers.47.mlp.gate.weight": (128, 2048),
        "model.language_model.layers.0.self_attn.q_proj.weight": (4096, 2048),
        "model.visual.merger.linear_fc2.weight": (2048, 4608),
    },
}


@pytest.mark.parametrize("size", list(REAL_SIZES))
def test_real_size_plan_has_the_released_shapes(size):
    plan = plan_tiny_model(None, size)
    assert plan.num_parameters == RELEASED[size]
    assert plan.dtype == torch.bfloat16 and plan.total_bytes == 2 * RELEASED[size]
    shapes = {t.name: t.shape for t in plan.tensors}
    for name, shape in SHAPES[size].items():
        assert shapes[name] == shape, name
    files = [f for names in plan.shards.values() for f in names]
    assert sorted(files) == sorted(shapes)  # every tensor in exactly one shard
    if size == "30b-a3b":
        experts = [n for n in shapes if n.endswith("mlp.experts.gate_up_proj")]
        assert len(experts) == 48 and {shapes[n][0] for n in experts} == {128}


def _saved_by_transformers_meta(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes `save_pretrained` would write for the config on disk (no weights)."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(ckpt))
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    return {n: tuple(t.shape) for n, t in revert_weight_conversion(model, state).items()}


@pytest.mark.parametrize("size", ["7b", "30b-a3b"])
def test_dry_run_is_what_transformers_and_the_language_tier_build(size, tmp_path):
    from tandem.models.checkpoint import read_spec
    from tandem.models.split import _normalize_experts, text_tensor_names
    from tandem.services.language.model import DecoderConfig, QwenVLDecoder

    ckpt = build_tiny_model(tmp_path / size, size=size, dry_run=True)
    assert not list(ckpt.glob("*.safetensors"))  # nothing of the 16-62 GB written
    plan = plan_tiny_model(None, size)
    listed = {t.name: t.shape for t in plan.tensors}
    assert _saved_by_transformers_meta(ckpt) == listed
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(listed)
    assert index["metadata"]["total_size"] == plan.total_bytes

    spec = read_spec(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert spec.torch_dtype == cfg["dtype"] == "bfloat16" and spec.vocab_size == listed[
        "lm_head.weight"][0]
    names = text_tensor_names(spec)
    tensors = {n: torch.empty(listed[s], dtype=torch.bfloat16, device="meta")
               for n, s in names.items()}
    for i in spec.moe_layers:
        _normalize_experts(tensors, spec, f"layers.{i}.mlp.", spec.moe_intermediate_size)
    dcfg = DecoderConfig.from_weights(spec, tensors)
    n_text = sum(t.numel() for t in tensors.values())
    decoder = QwenVLDecoder.build(dcfg, tensors, torch.device("meta"), torch.bfloat16)
    assert sum(p.numel() for p in decoder.parameters()) == n_text
    want = dict(hidden_size=spec.hidden_size, num_heads=spec.num_attention_heads,
                num_kv_heads=spec.num_key_value_heads, head_dim=128)
    assert {k: getattr(dcfg, k) for k in want} == want


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_streamed_tiny_is_what_save_pretrained_writes(arch, checkpoint, tmp_path):
    from transformers import AutoModelForImageTextToText

    def header(ckpt):
        with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
                    for k in f.keys()}

    ref = checkpoint(arch)
    a = build_tiny_model(tmp_path / "a", arch, "tiny", seed=3, stream=True)
    assert header(a) == header(ref)
    drop = {"transformers_version"}
    conf = [{k: v for k, v in json.loads((c / "config.json").read_text()).items() if k not in drop}
            for c in (a, ref)]
    assert conf[0] == conf[1]
    model, info = AutoModelForImageTextToText.from_pretrained(a, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))

    plan = {t.name: t for t in plan_tiny_model(arch, "tiny").tensors}
    with safe_open(str(a / "model.safetensors"), "pt") as f:
        for name, t in plan.items():
            x = f.get_tensor(name)
            if t.init is Init.ONES:
                assert torch.all(x == 1), name
            elif t.init is Init.ZEROS:
                assert torch.all(x == 0), name
            elif x.numel() >= 4096:  # the std of a big enough sample
                assert abs(x.std().item() / t.std - 1) < 0.1, name
    assert {t.init for t in plan.values()} == set(Init)
    b = build_tiny_model(tmp_path / "b", arch, "tiny", seed=3, stream=True)
    c = build_tiny_model(tmp_path / "c", arch, "tiny", seed=4, stream=True)
    data = [(x / "model.safetensors").read_bytes() for x in (a, b, c)]
    assert data[0] == data[1] != data[2]


def test_the_writer_streams(tmp_path):
    """Peak memory while writing grows by a few blocks, not by the bytes written."""
    small = plan_tiny_model("qwen2_5_vl", "small")  # made here: the child needs no transformers
    plans = {
        "small": [[[t.name, t.shape, t.init.value, t.std] for t in small.tensors], small.shards],
        "big": [[["w", (4096, 8192), "normal", 0.02]], {"model.safetensors": ["w"]}],
    }
    code = textwrap.dedent(f"""
        import json, re
        from pathlib import Path
        import torch
        from tandem.models import random_weights as rw

        def kb(field):
            return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read())[1])

        rw.BLOCK = 1 << 18  # 1 MB of float32: smaller than the largest tensors
        for name, (tensors, shards) in json.loads({json.dumps(plans)!r}).items():
            plan = rw.WeightPlan(
                torch.float32, tuple(rw.TensorPlan(n, tuple(s), rw.Init(i), d) for n, s, i, d in tensors),
                {{f: tuple(ns) for f, ns in shards.items()}}, "none")
            out = Path({str(tmp_path)!r}) / name
            out.mkdir()
            open("/proc/self/clear_refs", "w").write("5")  # peak := now
            start = kb("VmRSS")
            rw.write_weights(plan, out)
            print(name, plan.total_bytes, (kb("VmHWM") - start) * 1024)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.split()
    assert lines[0::3] == ["small", "big"], p.stdout
    for written, peak in zip(lines[1::3], lines[2::3], strict=True):
        assert int(written) > 100e6 and int(peak) < 40e6, p.stdout
    with safe_open(str(tmp_path / "small" / "model.safetensors"), "pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == {
            t.name: t.shape for t in small.tensors}
    with safe_open(str(tmp_path / "big" / "model.safetensors"), "pt") as f:
        w = f.get_tensor("w")
    assert w.shape == (4096, 8192) and abs(w.std().item() - 0.02) < 1e-3


def test_cli_dry_run_lists_tensors_and_refuses_a_wrong_arch(tmp_path, capsys):
    from tandem.cli import main

    assert main(["tiny-model", str(tmp_path / "m"), "--size", "8b", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == str(tmp_path / "m")
    assert out[-2].startswith("750 tensors, 8,767,123,696 parameters, 17.53 GB in bfloat16")
    row = next(r for r in out if r.startswith("model.language_model.layers.0.self_attn.k_proj"))
    assert row.split("\t")[1:3] == ["[1024, 4096]", "normal"]
    with pytest.raises(SystemExit):
        main(["tiny-model", str(tmp_path / "x"), "--size", "8b", "--arch", "qwen2_5_vl"])
    assert "8b is qwen3_vl's shape" in capsys.readouterr().err
    with pytest.raises(ValueError, match="only written streamed"):
        build_tiny_model(tmp_path / "y", size="7b", stream=False)
