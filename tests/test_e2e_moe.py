"""Qwen3-VL-MoE through the whole cluster: `tandem up` (1 encoder + 1 language, float32
CPU) serving the tiny MoE checkpoint (sparse and dense layers, deepstack); greedy answers
through the official `openai` client equal transformers `generate()`, with an image and
without (the encoder bypass), and a transfer that needs resumes."""

from __future__ import annotations

import pytest
from language_oracle import generate, load, make_image, make_inputs
from test_e2e_cluster import openai_client, openai_messages, strip_eos

from tandem.launch.cluster import LocalCluster

pytestmark = pytest.mark.timeout(240)
TEXT_LONG = "Look carefully at the picture and describe every colour and shape you see. "


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("qwen3_vl_moe")


@pytest.fixture(scope="module")
def cluster(ckpt):
    cl = LocalCluster(str(ckpt), encoders=1, languages=1,
                      language_args="--embedding-block-size 16 --default-reservation-tokens 48")
    cl.start()
    yield cl
    cl.stop()


@pytest.mark.parametrize("text,images", [
    ("Describe the picture.", [(41, (64, 64))]),
    ("Hello there, who are you?", []),
    (TEXT_LONG * 2, [(42, (224, 192))]),  # longer than the 48 reserved tokens: resumed
], ids=["image", "text", "resumed"])
def test_greedy_equals_transformers(cluster, ckpt, text, images):
    model, processor = load(ckpt)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list | tuple) else [eos])
    inputs = make_inputs(processor, text, [make_image(s, sz) for s, sz in images])
    want, _ = generate(model, inputs, 10)
    r = openai_client(cluster).chat.completions.create(
        model="", messages=openai_messages(text, images), max_tokens=10, temperature=0)
    got = r.choices[0].message.content
    assert got == processor.tokenizer.decode(strip_eos(want, eos), skip_special_tokens=True)
    assert r.usage.prompt_tokens == inputs["input_ids"].shape[1]
