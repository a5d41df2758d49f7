"""The prefix cache with the real decoder: multi-turn chats with images, `generate()` as
the oracle, for both architectures.

Turn k+1 of a chat repeats turn k's prompt and reply, so it finds their KV pages cached;
its greedy tokens must still equal transformers' `generate()` on the whole chat. Chunk
sizes put chunk boundaries inside and at the end of the cached prefix; a pool too small
for everyone forces retractions while requests share pages. After every test each page is
free or idle in the cache.
"""

from __future__ import annotations

import language_oracle as oracle
import pytest
from test_language_engine import collect

from tandem.models.split import load_text_weights
from tandem.sampling import SamplingParams
from tandem.services.language.engine.core import Engine, EngineConfig
from tandem.services.language.engine.request import Request, RequestSpec
from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings

SYSTEM = "You are a careful assistant. " * 6


class Chat:
    """A model and its oracle, and a chat that grows turn by turn."""

    def __init__(self, ckpt):
        self.model, self.processor = oracle.load(ckpt)
        self.tokenizer = self.processor.tokenizer
        self.weights = load_text_weights(ckpt)

    def engine(self, num_pages=512, **cfg) -> Engine:
        runner = ModelRunner(self.weights.copy(), RunnerSettings(page_size=4), num_pages=num_pages)
        return Engine(runner, self.tokenizer, EngineConfig(**cfg)).start()

    def request(self, rid: int, messages, images, keys, max_tokens=8):
        """(Request with an announced prompt, generate()'s tokens) for a chat."""
        inputs = oracle.make_chat_inputs(self.processor, messages, images)
        payload = oracle.payload(self.model, inputs)
        payload.info = oracle.prompt_info(self.model, inputs, keys)
        ref, _ = oracle.generate(self.model, inputs, max_tokens)
        return Request(RequestSpec(rid, SamplingParams(max_tokens=max_tokens), payload)), ref


_chats: dict[str, Chat] = {}


@pytest.fixture(params=["qwen2_5_vl", "qwen3_vl"])
def chat(request, checkpoint):
    if request.param not in _chats:
        _chats[request.param] = Chat(checkpoint(request.param))
    return _chats[request.param]


def user(text, n_images=0):
    return {"role": "user",
            "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}


def tokens(stream) -> list[int]:
    return [t for d in stream for t in d.token_ids]


def assert_pages_settled(engine: Engine) -> None:
    engine.pool.check()
    assert engine.pool.num_free == engine.pool.num_total  # free or idle: none referenced


@pytest.mark.parametrize("chunk", [5, 64])  # 5: boundaries fall inside the cached prefix
def test_multi_turn_chat_with_image_equals_generate(chat, chunk):
    engine = chat.engine(max_prefill_tokens=chunk)
    try:
        image = oracle.make_image(7, (56, 84))
        messages = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                    user("What is in this picture?", 1)]
        prev_len = 0
        for turn in range(3):
            req, ref = chat.request(10 + turn, messages, [image], ["img7"])
            out = collect(engine, [req])[req.room]
            assert tokens(out) == ref, f"turn {turn}"
            assert out[-1].cached_tokens == req.kv.cached_tokens
            if turn:  # the previous turn's prompt (and reply) is cached, a page at least
                assert req.kv.cached_tokens >= prev_len - 4, (turn, req.kv.cached_tokens, prev_len)
            prev_len = req.prompt_len
            reply = chat.tokenizer.decode(ref, skip_special_tokens=True)
            messages += [{"role": "assistant", "content": [{"type": "text", "text": reply}]},
                         user(f"And then {turn}?")]
            assert_pages_settled(engine)
    finally:
        engine.stop()


def test_same_text_other_image_or_place_shares_no_image_page(chat):
    engine = chat.engine()
    try:
        a_img, b_img = oracle.make_image(1, (56, 56)), oracle.make_image(2, (56, 56))
        text = "Describe it in detail, please."
        base = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}]
        a, ref_a = chat.request(1, base + [user(text, 1)], [a_img], ["a"])
        b, ref_b = chat.request(2, base + [user(text, 1)], [b_img], ["b"])
        moved = base + [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                                     {"type": "image"},
                                                     {"type": "text", "text": text}]}]
        c, ref_c = chat.request(3, moved, [a_img], ["a"])
        for req, ref in ((a, ref_a), (b, ref_b), (c, ref_c)):
            assert tokens(collect(engine, [req])[req.room]) == ref
        first_pad = a.prompt.info.images[0].start
        assert b.kv.cached_tokens == first_pad // 4 * 4  # only pages wholly before the image
        assert c.kv.cached_tokens <= first_pad // 4 * 4 + 4  # "Look: " differs from there on
        # no page key of the image's pages is shared between a, b and c
        image_pages = slice(first_pad // 4, None)
        assert not set(a.kv.page_keys[image_pages]) & set(b.kv.page_keys[image_pages])
        assert not set(a.kv.page_keys[image_pages]) & set(c.kv.page_keys[image_pages])
        assert_pages_settled(engine)
    finally:
        engine.stop()


def test_sharers_run_concurrently_through_retractions(chat):
    # 6 chats share the system prompt and one image; a pool of 60 pages of 4 tokens
    # cannot hold them all, so requests are retracted while others read shared pages.
    engine = chat.engine(num_pages=60, max_prefill_tokens=32, init_new_token_ratio=0.05)
    try:
        image = oracle.make_image(3, (56, 56))
        sys = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}]
        warm, ref = chat.request(1, sys + [user("Hi.", 1)], [image], ["img3"], max_tokens=4)
        assert tokens(collect(engine, [warm])[warm.room]) == ref
        pairs = [chat.request(10 + i, sys + [user(f"Question {i}: " + "why? " * i, 1)],
                              [image], ["img3"], max_tokens=12) for i in range(6)]
        streams = collect(engine, [r for r, _ in pairs])
        for r, ref in pairs:
            assert tokens(streams[r.room]) == ref, f"request {r.room}"
            assert r.kv.cached_tokens > 0
        assert engine.scheduler.num_retractions > 0
        assert_pages_settled(engine)
    finally:
        engine.stop()
