"""Reuse end to end: `tandem up` with 1 encoder + 1 language instance on the tiny
Qwen2.5-VL, metrics scraped from both tiers.

Proves: a repeated ~3K-token prompt with an image computes at most one KV page of prompt
tokens the second time (the language tier's own counter), reports it as
`usage.prompt_tokens_details.cached_tokens`, skips the image's ViT run and carries only the
uncached tokens' embeddings over the transfer (the encoder's byte counter); greedy answers
equal transformers `generate()` both times. A text-only chat never reaches the encoder
(its request and byte counters stay still), its next turn comes from the prefix cache, and
its answers equal `generate()`.
"""

from __future__ import annotations

import json
import re
import time
from typing import Literal

import httpx
import pytest
import torch
from language_oracle import generate, load, make_chat_inputs, make_image, make_inputs
from test_e2e_cluster import data_url, openai_client, png, strip_eos

from tandem.launch.cluster import LocalCluster
from tandem.launch.procs import free_port

ARCH = "qwen2_5_vl"
PAGE = 16
BLOCK = 1024  # the language tier's embedding block size (its default)
LONG = "Tell me everything about this picture and the words around it. " * 230

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint(ARCH)


@pytest.fixture(scope="module")
def cluster(ckpt):
    enc_m, lang_m = free_port(), free_port()
    cl = LocalCluster(
        str(ckpt), encoders=1, languages=1,
        encoder_args=f"--metrics-port {enc_m}",
        language_args=f"--metrics-port {lang_m} --kv-page-size {PAGE}",
        router_args="--load-refresh-s 0.2",
    )
    cl.metrics = {"encoder": enc_m, "language": lang_m}
    cl.start()
    yield cl
    cl.stop()


def scrape(cluster, tier: str) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{cluster.metrics[tier]}/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_repeated_long_prompt_computes_one_page_and_sends_only_the_rest(cluster, ckpt):
    model, processor = load(ckpt)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list | tuple) else [eos])
    inputs = make_inputs(processor, LONG, [make_image(21, (112, 112))])
    n_prompt = inputs["input_ids"].shape[1]
    assert n_prompt > 3000
    want, _ = generate(model, inputs, 8)
    client = openai_client(cluster)
    msgs = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png(21, (112, 112)))}},
        {"type": "text", "text": LONG}]}]
    figures = []
    for _ in range(2):
        enc0, lang0 = scrape(cluster, "encoder"), scrape(cluster, "language")
        r = client.chat.completions.create(model="", messages=msgs, max_tokens=8, temperature=0)
        time.sleep(0.3)  # counters are updated right after the response
        enc1, lang1 = scrape(cluster, "encoder"), scrape(cluster, "language")
        figures.append(dict(
            text=r.choices[0].message.content, usage=r.usage, ext=r.model_extra["tandem"],
            computed=delta(lang0, lang1, "tandem_language_prompt_tokens_total"),
            sent=delta(enc0, enc1, 'tandem_transfer_bytes_total{side="encoder"}'),
            vit_images=delta(enc0, enc1, "tandem_encoder_images_encoded_total")))
    first, second = figures
    assert first["usage"].prompt_tokens == second["usage"].prompt_tokens == n_prompt
    assert first["text"] == second["text"]
    tok = processor.tokenizer
    assert first["usage"].prompt_tokens_details.cached_tokens == 0
    assert first["computed"] == n_prompt and first["vit_images"] == 1
    cached = second["usage"].prompt_tokens_details.cached_tokens
    assert n_prompt - PAGE <= cached < n_prompt
    assert second["computed"] == n_prompt - cached <= PAGE
    assert second["vit_images"] == 0 and second["ext"]["timings"]["skipped_images"] == 1
    # bytes written: per token its embedding row and fill id; per destination block of
    # BLOCK tokens its MRoPE row (written whole) and its aux row
    hidden = model.config.text_config.hidden_size

    def wire_bytes(n: int) -> int:
        return n * (hidden * 4 + 4) + -(-n // BLOCK) * (3 * BLOCK * 4 + 16 * 4)

    assert first["sent"] == wire_bytes(n_prompt)
    assert second["sent"] == wire_bytes(n_prompt - cached)
    # and the answer is still transformers' (decoded text of the greedy tokens)
    assert first["text"] == tok.decode(strip_eos(want, eos), skip_special_tokens=True)


def test_text_only_chat_skips_the_encoder_and_equals_generate(cluster, ckpt):
    model, processor = load(ckpt)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list | tuple) else [eos])
    client = openai_client(cluster)
    history = [{"role": "system", "content": "You answer briefly. " * 20},
               {"role": "user", "content": "Name three colours."}]
    enc0 = scrape(cluster, "encoder")
    first_len = 0
    for turn in range(2):
        hf = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
              for m in history]
        inputs = make_chat_inputs(processor, hf, [])
        want, _ = generate(model, inputs, 8)
        r = client.chat.completions.create(model="", messages=history, max_tokens=8,
                                           temperature=0)
        ext = r.model_extra["tandem"]
        assert ext["timings"]["encoder_bypassed"] is True and ext["encoder"] == ""
        assert r.usage.prompt_tokens == inputs["input_ids"].shape[1]
        text = r.choices[0].message.content
        assert text == processor.tokenizer.decode(strip_eos(want, eos), skip_special_tokens=True)
        if turn:  # the system prompt and the first turn come from the prefix cache
            assert r.usage.prompt_tokens_details.cached_tokens >= first_len - PAGE
        first_len = r.usage.prompt_tokens
        history += [{"role": "assistant", "content": text},
                    {"role": "user", "content": "And three more?"}]
    enc1 = scrape(cluster, "encoder")
    encodes = [k for k in enc1 if k.startswith("tandem_encoder_requests_total")]
    assert all(delta(enc0, enc1, k) == 0 for k in encodes)
    assert delta(enc0, enc1, 'tandem_transfer_bytes_total{side="encoder"}') == 0


def test_sampling_parameters_through_http_and_the_sdk(cluster, ckpt):
    from tandem.client import Client

    model, processor = load(ckpt)
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list | tuple) else eos
    client = openai_client(cluster)
    msgs = [{"role": "user", "content": "Count to ten."}]
    r = client.chat.completions.create(model="", messages=msgs, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for c in content:  # greedy: the chosen token is the most likely one
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob
    with Client(cluster.grpc_address) as sdk:
        free = sdk.chat(msgs, max_tokens=6)
        forced = sdk.chat(msgs, max_tokens=6, logit_bias={100: 100.0})
        assert forced.token_ids == [100] * 6
        first = free.token_ids[0]
        stopped = sdk.chat(msgs, max_tokens=6, stop_token_ids=[first])
        assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
        held = sdk.chat(msgs, max_tokens=6, min_tokens=6, logit_bias={eos: 100.0})
        assert len(held.token_ids) == 6 and eos not in held.token_ids
        assert held.finish_reason == "length"
        pen = sdk.chat(msgs, max_tokens=6, repetition_penalty=2.0, presence_penalty=2.0,
                       frequency_penalty=2.0, min_p=0.1, logprobs=True, top_logprobs=2)
        assert len(pen.top_logprobs) == len(pen.token_ids)
        assert all(len(t) == 2 and isinstance(t[0][2], str) for t in pen.top_logprobs)
        # typical_p, the knob added through tandem/sampling.py alone: a mass this small
        # keeps one token a step, so two seeds agree where they otherwise differ
        sampled = [sdk.chat(msgs, max_tokens=6, temperature=1.0, seed=s).token_ids
                   for s in (1, 2)]
        typical = sdk.chat(msgs, max_tokens=6, temperature=1.0, typical_p=1e-6, seed=1)
    over_http = openai_client(cluster).chat.completions.create(
        model="", messages=msgs, max_tokens=6, temperature=1.0, seed=2,
        extra_body={"typical_p": 1e-6})
    assert sampled[0] != sampled[1]
    assert over_http.choices[0].message.content == typical.text


def test_structured_output_parses_for_every_seed_through_the_openai_client(cluster):
    from pydantic import BaseModel, Field

    class Point(BaseModel):
        x: int = Field(ge=-100, le=100)
        y: int = Field(ge=-100, le=100)

    class Answer(BaseModel):
        kind: str = Field(pattern=r"^[a-z]{1,6}$")
        mood: Literal["calm", "busy", "odd"]
        points: list[Point] = Field(max_length=3)
        sure: bool

    client = openai_client(cluster)
    msgs = [{"role": "user", "content": "Answer as JSON."}]
    for seed in range(20):
        r = client.chat.completions.parse(model="", messages=msgs, response_format=Answer,
                                          temperature=1.0, seed=seed, max_tokens=300)
        assert isinstance(r.choices[0].message.parsed, Answer), r.choices[0].message.content
    for stream in (False, True):
        body = dict(model="", messages=msgs, temperature=1.0, seed=3, max_tokens=40,
                    extra_body={"guided_regex": "[a-z]{2}-[0-9]{3}"})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(stream=True, **body) if c.choices)
        else:
            text = client.chat.completions.create(**body).choices[0].message.content
        assert re.fullmatch("[a-z]{2}-[0-9]{3}", text), text
    r = client.chat.completions.create(model="", messages=msgs, temperature=1.0, seed=1,
                                       extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].message.content in ("left", "right")
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="", messages=msgs,
                                       extra_body={"guided_regex": "([a-z"})
    # Tandem's words ("<kind> does not compile: " and xgrammar's own after them)
    assert e.value.body["param"] == "response_format"
    assert "does not compile" in e.value.body["message"], e.value.body


def test_structured_output_through_the_sdk(cluster):
    from tandem.client import Client

    with Client(cluster.grpc_address) as sdk:
        msgs = [{"role": "user", "content": "Pick."}]
        r = sdk.chat(msgs, temperature=1.0, seed=2, choice=["north", "south"])
        assert r.text in ("north", "south")
        r = sdk.chat(msgs, temperature=1.0, seed=2, regex="[0-9]{4}", max_tokens=20)
        assert re.fullmatch("[0-9]{4}", r.text)
        r = sdk.chat(msgs, temperature=1.0, seed=2, max_tokens=200, json_schema={
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
        assert isinstance(json.loads(r.text)["ok"], bool)
        with pytest.raises(ValueError):
            sdk.chat(msgs, regex="a", choice=["a"])


def test_tool_calls_forced_auto_and_in_the_history(cluster):
    from tool_checks import check_forced_calls, check_history_and_auto

    client = openai_client(cluster)
    check_forced_calls(client)
    check_history_and_auto(client)


def test_n_choices_are_the_seeded_samples_streaming_and_not(cluster):
    client = openai_client(cluster)
    msgs = [{"role": "user", "content": "Say something."}]
    kw = dict(model="", messages=msgs, temperature=1.0, max_tokens=6)
    r = client.chat.completions.create(n=3, seed=5, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(seed=5 + i, **kw) for i in range(3)]
    assert [c.message.content for c in r.choices] == [s.choices[0].message.content
                                                      for s in singles]
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    texts, finished, usage = {0: "", 1: ""}, set(), None
    for chunk in client.chat.completions.create(n=2, seed=5, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
        usage = chunk.usage or usage
    assert finished == {0, 1} and [texts[0], texts[1]] == [c.message.content
                                                           for c in r.choices[:2]]
    assert usage.completion_tokens == sum(s.usage.completion_tokens for s in singles[:2])


def test_completions_tokenize_and_detokenize(cluster, ckpt):
    import openai

    model, processor = load(ckpt)
    tok = processor.tokenizer
    client = openai_client(cluster)
    prompt = "Once upon a time there was a"
    ids = tok(prompt)["input_ids"]
    want, _ = generate(model, {"input_ids": torch.tensor([ids]),
                               "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}, 8)
    r = client.completions.create(model="", prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.usage.prompt_tokens == len(ids)
    text = tok.decode(want, skip_special_tokens=True)
    assert r.choices[0].text == text
    echo = client.completions.create(model="", prompt=[prompt], max_tokens=8, temperature=0,
                                     echo=True)
    assert echo.choices[0].text == prompt + text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="", prompt=prompt, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == text
    lp = client.completions.create(model="", prompt=prompt, max_tokens=4, temperature=0,
                                   logprobs=3)
    got = lp.choices[0].logprobs
    assert len(got.token_logprobs) == lp.usage.completion_tokens
    assert all(len(t) <= 3 for t in got.top_logprobs) and got.text_offset[0] == 0
    n = client.completions.create(model="", prompt=prompt, max_tokens=4, temperature=1.0,
                                  seed=3, n=2)
    assert [c.index for c in n.choices] == [0, 1]
    for bad, param in (({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of"),
                       ({"echo": True, "logprobs": 1}, "echo")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="", prompt=prompt, max_tokens=4, **bad)
        assert e.value.body["param"] == param
    http = httpx.Client(base_url=cluster.http_url, timeout=30)
    t = http.post("/tokenize", json={"prompt": prompt}).json()
    assert t["tokens"] == ids and t["count"] == len(ids) and t["max_model_len"] > 0
    chat_ids = http.post("/tokenize", json={"messages": [
        {"role": "user", "content": "hi"}]}).json()["tokens"]
    assert chat_ids == make_chat_inputs(processor, [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}], [])["input_ids"][0].tolist()
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == prompt
    assert http.post("/tokenize", json={}).status_code == 400
    # over the gRPC default message size (4 MiB): the tier's own check answers, by name
    huge = http.post("/tokenize", json={"messages": [{"role": "user",
                                                      "content": "ab " * 1_500_000}]})
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "messages", huge.text
    assert "characters" in huge.json()["error"]["message"]
    assert http.post("/detokenize", json={"tokens": [10 ** 9]}).status_code == 400


def test_langchain_bind_tools_and_with_structured_output(cluster):
    langchain_openai = pytest.importorskip("langchain_openai")  # the dev extra installs it
    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        """A thermometer reading."""

        celsius: int = Field(ge=-50, le=50)
        place: Literal["garden", "kitchen"]

    llm = langchain_openai.ChatOpenAI(base_url=cluster.http_url + "/v1", api_key="none",
                                      model=openai_client(cluster).models.list().data[0].id,
                                      temperature=1.0, max_tokens=200,
                                      seed=4, max_retries=0, timeout=60)
    from tool_checks import TOOLS

    msg = llm.bind_tools(TOOLS, tool_choice="required").invoke("Book a table for two.")
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] in ("book_table",
                                                                       "get_weather")
    out = llm.with_structured_output(Reading, method="json_schema").invoke("Read it.")
    assert isinstance(out, Reading)


def test_tools_through_the_sdk(cluster):
    from tool_checks import MODELS, TOOLS

    from tandem.client import Client, InvalidRequestError

    with Client(cluster.grpc_address) as sdk:
        msgs = [{"role": "user", "content": "Book a table."}]
        for seed in range(5):
            r = sdk.chat(msgs, tools=TOOLS, tool_choice="get_weather", temperature=1.0,
                         seed=seed, max_tokens=200)
            assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1
            call = r.tool_calls[0]
            assert call.name == "get_weather" and call.id.startswith("call_")
            MODELS[call.name].model_validate_json(call.arguments)
        history = msgs + [
            {"role": "assistant", "content": "", "tool_calls": [call]},  # as the SDK gave it
            {"role": "tool", "tool_call_id": call.id, "content": "done"}]
        r = sdk.chat(history, tools=TOOLS, max_tokens=4)
        assert r.usage.prompt_tokens > 100
        assert r.finish_reason in ("stop", "length", "tool_calls")
        with pytest.raises(InvalidRequestError):
            sdk.chat(msgs, tools=TOOLS, tool_choice="nope")


def test_n_choices_through_the_sdk(cluster):
    from tandem.client import AsyncClient, Client

    msgs = [{"role": "user", "content": "Say something."}]
    with Client(cluster.grpc_address) as sdk:
        many = sdk.chat_choices(msgs, 3, temperature=1.0, seed=9, max_tokens=6)
        singles = [sdk.chat(msgs, temperature=1.0, seed=9 + i, max_tokens=6) for i in range(3)]
        assert [r.token_ids for r in many] == [r.token_ids for r in singles]
        assert all(r.finish_reason for r in many)
        with pytest.raises(ValueError):
            sdk.chat(msgs, n=2)

    async def run():
        async with AsyncClient(cluster.grpc_address) as c:
            return await c.chat_choices(msgs, 2, temperature=1.0, seed=9, max_tokens=6)

    import asyncio

    assert [r.token_ids for r in asyncio.run(run())] == [r.token_ids for r in singles[:2]]


def test_vllm_extras_end_to_end(cluster, ckpt):
    """vLLM's request extras through both tiers, each against transformers: the template's
    own kwarg and per-request resize bounds on an image chat (the encoder's render), a
    continued final message with echo on a text chat (the language tier's), special tokens
    kept in the text, usage on every streamed chunk, logprob tokens as ids, and the SDK's
    keywords over gRPC."""
    from tandem.client import Client

    model, processor = load(ckpt)
    tok = processor.tokenizer
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list | tuple) else [eos])
    client = openai_client(cluster)
    # an image chat: add_vision_id (the checkpoint's template reads it) and max_pixels
    lo = processor.image_processor.size["shortest_edge"]
    hf = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
    prompt = processor.apply_chat_template(hf, tokenize=False, add_generation_prompt=True,
                                           add_vision_id=True)
    inputs = dict(processor(text=[prompt], images=[make_image(31, (112, 112))],
                            size={"shortest_edge": lo, "longest_edge": 2 * lo},
                            return_tensors="pt"))
    want, _ = generate(model, inputs, 6)
    r = client.chat.completions.create(
        model="", max_tokens=6, temperature=0, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(png(31, (112, 112)))}},
            {"type": "text", "text": "What?"}]}],
        extra_body={"chat_template_kwargs": {"add_vision_id": True},
                    "mm_processor_kwargs": {"max_pixels": 2 * lo}})
    assert r.usage.prompt_tokens == inputs["input_ids"].shape[1]
    assert r.choices[0].message.content == tok.decode(strip_eos(want, eos),
                                                      skip_special_tokens=True)
    # a text chat whose last message the model continues, echoed before the reply
    prefilled = [{"role": "user", "content": "Name a colour."},
                 {"role": "assistant", "content": "The colour is"}]
    ids = processor.apply_chat_template(
        [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
         for m in prefilled], tokenize=True, continue_final_message=True)
    ids = list(ids[0] if isinstance(ids[0], list) else ids)
    want, _ = generate(model, {"input_ids": torch.tensor([ids]),
                               "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}, 6)
    extras = {"continue_final_message": True}
    r = client.chat.completions.create(model="", messages=prefilled, max_tokens=6,
                                       temperature=0, extra_body={**extras, "echo": True})
    assert r.usage.prompt_tokens == len(ids)
    text = tok.decode(strip_eos(want, eos), skip_special_tokens=True)
    assert r.choices[0].message.content == "The colour is" + text
    http = httpx.Client(base_url=cluster.http_url, timeout=30)
    assert http.post("/tokenize", json={"messages": prefilled, **extras}).json()["tokens"] == ids
    # special tokens kept in the text when asked (forced, past EOS)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    force = {"logit_bias": {str(end): 100}, "ignore_eos": True, "max_tokens": 3, "temperature": 0}
    kept = http.post("/v1/chat/completions", json={
        "model": "", "messages": prefilled[:1], "skip_special_tokens": False, **force}).json()
    assert kept["choices"][0]["message"]["content"] == "<|im_end|>" * 3
    dropped = http.post("/v1/chat/completions", json={
        "model": "", "messages": prefilled[:1], **force}).json()
    assert dropped["choices"][0]["message"]["content"] == ""
    # usage on every chunk, logprob tokens as ids
    chunks = list(client.chat.completions.create(
        model="", messages=prefilled[:1], max_tokens=5, temperature=0, stream=True,
        logprobs=True, top_logprobs=2,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"return_tokens_as_token_ids": True}))
    assert all(c.usage is not None for c in chunks)
    assert chunks[-1].usage.completion_tokens == 5
    assert [c.usage.completion_tokens for c in chunks] == sorted(
        c.usage.completion_tokens for c in chunks)
    tokens = [lp.token for c in chunks if c.choices and c.choices[0].logprobs
              for lp in c.choices[0].logprobs.content]
    assert len(tokens) == 5 and all(re.fullmatch(r"token_id:\d+", t) for t in tokens)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert tok.decode([int(t.split(":")[1]) for t in tokens], skip_special_tokens=True) == streamed
    # the SDK: the same continued message over gRPC
    with Client(cluster.grpc_address) as sdk:
        got = sdk.chat(prefilled, max_tokens=6, continue_final_message=True)
        assert got.text == text and got.usage.prompt_tokens == len(ids)
        assert sdk.chat(prefilled[:1], skip_special_tokens=False, ignore_eos=True, max_tokens=3,
                        logit_bias={end: 100}).text == "<|im_end|>" * 3


def test_sigusr1_prints_each_threads_stack_and_stops_nothing(cluster):
    """`kill -USR1` on `tandem up` and on a tier prints every thread's Python stack on its
    stderr (tandem.serving.STACKS_SIGNAL: how a stuck process is read; LocalCluster.stop
    does so before it kills a `tandem up` that does not stop), and both serve on."""
    import os

    from waiting import wait_until

    from tandem.serving import STACKS_SIGNAL

    def new_lines() -> list[str]:
        return list(cluster.lines)[before:]

    def up_stacks() -> bool:  # `tandem up`'s own output comes unprefixed
        return any(ln.startswith(("Current thread 0x", "Thread 0x")) for ln in new_lines()) \
            and any('File "' in ln and "launch/up.py" in ln for ln in new_lines())

    def encoder_stacks() -> bool:  # a tier's, prefixed with its name
        mine = [ln for ln in new_lines() if ln.startswith("encoder-0")]
        return any("Thread 0x" in ln for ln in mine) and any('File "' in ln for ln in mine)

    before = len(cluster.lines)
    os.kill(cluster.proc.pid, STACKS_SIGNAL)
    os.kill(cluster.instances["encoder-0"].pid, STACKS_SIGNAL)
    wait_until(up_stacks, timeout_s=30, what="tandem up's own stacks", state=new_lines)
    wait_until(encoder_stacks, timeout_s=30, what="the encoder's stacks", state=new_lines)
    assert cluster.proc.poll() is None
    r = openai_client(cluster).chat.completions.create(
        model="", max_tokens=2, temperature=0, messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].message.content is not None
