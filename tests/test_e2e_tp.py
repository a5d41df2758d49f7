"""Tensor parallelism through the whole cluster: `tandem up --language-args "--tp 2"`
(1 encoder + 1 language instance of 2 rank processes, float32 CPU, gloo) for qwen3_vl in
CI and for every architecture under `make test-slow` (the cluster's path is the same for
each; tests/test_tensor_parallel.py shows tp 2 exact for every architecture in CI); greedy answers through the official `openai` client equal transformers
`generate()`: an image, text only (the bypass), a transfer that needs resumes, and a
concurrent round on a KV pool small enough that the scheduler retracts."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from language_oracle import generate, load, make_image, make_inputs
from test_e2e_cluster import openai_client, openai_messages, strip_eos

from tandem.launch.cluster import LocalCluster

pytestmark = pytest.mark.timeout(300)
TEXT_LONG = "Look carefully at the picture and describe every colour and shape you see. "
CHATS = [
    ("Describe the picture.", [(41, (64, 64))]),
    ("Hello there, who are you?", []),
    (TEXT_LONG * 2, [(42, (224, 192))]),  # longer than the 48 reserved tokens: resumed
    ("Compare the two pictures.", [(43, (56, 84)), (44, (84, 56))]),
    ("Name three colours, then three shapes, then three animals.", []),
]


@pytest.fixture(scope="module", params=[pytest.param("qwen2_5_vl", marks=pytest.mark.slow),
                                        "qwen3_vl",
                                        pytest.param("qwen3_vl_moe", marks=pytest.mark.slow)])
def setup(request, checkpoint):
    ckpt = checkpoint(request.param)
    # 40 pages x 4 tokens: the five chats (and their replies) do not fit at once
    cl = LocalCluster(str(ckpt), encoders=1, languages=1,
                      language_args="--tp 2 --kv-pages 40 --kv-page-size 4 --init-new-token-ratio 0.05 "
                      "--embedding-block-size 16 --default-reservation-tokens 48")
    cl.start()
    model, processor = load(ckpt)
    yield cl, model, processor
    cl.stop()


def expected(model, processor, text, images) -> str:
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list | tuple) else [eos])
    inputs = make_inputs(processor, text, [make_image(s, sz) for s, sz in images])
    want, _ = generate(model, inputs, 12)
    return processor.tokenizer.decode(strip_eos(want, eos), skip_special_tokens=True)


def retractions(cluster) -> float:
    url = next(m.group(1) for ln in cluster.lines
               if "language-0" in ln and (m := re.search(r"metrics (http\S+)", ln)))
    text = httpx.get(url, timeout=5).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines()
               if ln.startswith("tandem_language_retractions_total"))


def test_tp2_greedy_equals_transformers_through_the_cluster(setup):
    cluster, model, processor = setup
    client = openai_client(cluster)

    def ask(chat):
        text, images = chat
        return client.chat.completions.create(
            model="", messages=openai_messages(text, images), max_tokens=12, temperature=0,
        ).choices[0].message.content

    want = [expected(model, processor, t, im) for t, im in CHATS]
    assert [ask(c) for c in CHATS] == want  # one at a time
    # All at once: the small pool retracts when enough of them overlap, which depends on
    # when each prompt arrives (image chats pass an encoder first): up to 4 rounds, every
    # round's answers equal generate(), and at least one retraction among them.
    for _ in range(4):
        with ThreadPoolExecutor(len(CHATS)) as pool:
            assert list(pool.map(ask, CHATS)) == want
        if retractions(cluster) > 0:
            break
    assert retractions(cluster) > 0


def test_kill9_of_rank_1_mid_stream_fails_over_to_the_other_instance(checkpoint):
    """Two language instances of 2 ranks each: kill -9 of rank 1 of the one serving a
    stream ends that stream with an error event (rank 0 ends the instance; the stream
    ends rather than stalls past its client's read timeout), the next requests succeed on
    the other instance, and the encoder holds no room after."""
    import asyncio

    import psutil
    from test_e2e_cluster import _many, _ok, stream_and_kill
    from waiting import wait_until

    cl = LocalCluster(str(checkpoint("qwen2_5_vl")), encoders=1, languages=2,
                      language_args="--tp 2 --kv-pages 256 --kv-page-size 4")

    def rank1(pid: int) -> int:  # the instance's tensor-parallel worker
        (worker,) = [p for p in psutil.Process(pid).children()
                     if "tandem.services.language.tp.worker" in " ".join(p.cmdline())]
        return worker.pid

    with cl:
        data = stream_and_kill(cl, rank1)
        assert data[-1] == "data: [DONE]" and '"error"' in data[-2], data[-3:]
        after = asyncio.run(_many(cl, 6, 30_000))  # served by the surviving instance
        assert all(_ok(r) for r in after), after
        wait_until(lambda: all(e.open_rooms == 0 and e.queued_requests == 0
                               for e in cl.loads("encoder").values()),
                   timeout_s=60, what="the encoder holds no room and no request",
                   state=lambda: cl.loads("encoder"))
