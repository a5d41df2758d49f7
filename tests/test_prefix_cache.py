"""The prefix cache on plain data: page keys, the page states, and the scheduler using it.

`ContentModel` writes, for every position, a digest of the whole sequence up to it (as the
request that computes it sees it) into the slot its block table names, and checks on every
read that the slot holds the digest of *the reader's* sequence. A page shared between two
requests whose prefixes differ anywhere before or inside it fails that check, so equal
outputs plus no failed check prove the sharing is sound. The real model runs in
test_language_engine.py.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from language_engine_helpers import num_idle

from tandem.sampling import SamplingParams
from tandem.services.language.engine.kv_pages import KVPagePool
from tandem.services.language.engine.prefix_cache import PrefixCache, page_keys
from tandem.services.language.engine.request import Request, RequestSpec, RequestStatus
from tandem.services.language.engine.scheduler import ScheduleLimits, Scheduler
from tandem.services.language.runner.forward_batch import ForwardBatch
from tandem.transfer.payload import ImageSpan, PromptInfo, PromptPayload

PAGE = 4
_rid = iter(range(1, 1 << 30))


def make_request(ids: list[int], max_tokens: int = 6, images=(), info=True) -> Request:
    t = torch.tensor(ids, dtype=torch.int32)
    embeds = t.to(torch.float32)[:, None].repeat(1, 4)  # column 0 carries the token id
    pos = torch.arange(len(ids), dtype=torch.int32).expand(3, -1).clone()
    payload = PromptPayload(embeds, t, pos, 0, info=PromptInfo(list(ids), list(images))
                            if info else None)
    return Request(RequestSpec(next(_rid), SamplingParams(max_tokens=max_tokens), payload))


class ContentModel:
    def __init__(self) -> None:
        self.slots: dict[int, tuple[int, bytes]] = {}
        self.computed = 0  # tokens computed (prompt and recomputed outputs)

    @staticmethod
    def content(req: Request, p: int) -> tuple:
        if p < req.prompt_len:
            info = req.prompt.info
            img = [im.hash for im in (info.images if info else []) if im.start <= p < im.start + im.length]
            return (req.prompt.info.token_ids[p] if info else int(req.prompt.fill_ids[p]), img)
        return (req.output_ids[p - req.prompt_len], [])

    def digest(self, req: Request, upto: int) -> bytes:
        return hashlib.sha256(repr([self.content(req, p) for p in range(upto + 1)]).encode()).digest()

    def forward(self, batch: ForwardBatch, reqs: dict[int, Request]) -> list[int]:
        out = []
        for c in batch.chunks:
            req = reqs[c.seq_id]
            end = c.start + c.num_tokens
            self.computed += c.num_tokens
            for j in range(c.num_tokens):
                p = c.start + j
                self.slots[c.block_table[p // PAGE] * PAGE + p % PAGE] = (p, self.digest(req, p))
            for p in range(end):
                slot = self.slots[c.block_table[p // PAGE] * PAGE + p % PAGE]
                assert slot == (p, self.digest(req, p)), f"request {req.room} reads foreign KV at {p}"
            out.append(int.from_bytes(self.digest(req, end - 1)[:4], "little") % 1000)
        return out


def run(sched: Scheduler, reqs: list[Request]) -> ContentModel:
    model = sched.model  # one per scheduler: it is the KV the scheduler's pages name
    by_id = {r.room: r for r in reqs}
    for _ in range(5000):
        step = sched.schedule()
        if step is None:
            break
        assert not step.failed
        tokens = model.forward(step.batch, by_id)
        sched.commit(step, [t if c.samples else None for c, t in zip(step.chunks, tokens, strict=True)])
        for c in step.chunks:
            if c.samples and len(c.req.output_ids) >= c.req.sampling.max_tokens:
                sched.finish(c.req, RequestStatus.FINISHED_LENGTH)
        sched.pool.check()
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    return model


def make_sched(pages=64, budget=32, enabled=True, max_running=64):
    cache = PrefixCache(KVPagePool(pages, PAGE), enabled=enabled)
    sched = Scheduler(cache, PAGE, ScheduleLimits(budget, max_running))
    sched.model = ContentModel()
    return sched, cache


def all_idle_or_free(cache: PrefixCache) -> None:
    cache.check()
    assert cache.num_free == cache.num_total, "a page is still referenced"


# ---- keys ----------------------------------------------------------------------------------

def test_keys_chain_tokens_and_images():
    ids = list(range(100, 116))  # 4 pages
    img = ImageSpan(4, 8, "a" * 64)
    base = page_keys(ids, [img], PAGE)
    assert len(base) == 4 and len(set(base)) == 4
    assert page_keys(ids, [img], PAGE) == base  # deterministic
    other_image = page_keys(ids, [ImageSpan(4, 8, "b" * 64)], PAGE)
    assert other_image[0] == base[0] and not set(other_image[1:]) & set(base)
    moved = page_keys(ids, [ImageSpan(5, 8, "a" * 64)], PAGE)  # same image one token later
    assert moved[0] == base[0] and not set(moved[1:]) & set(base)
    text_changed = page_keys(ids[:1] + [999] + ids[2:], [img], PAGE)
    assert not set(text_changed) & set(base)  # a change in page 0 changes every key after
    assert page_keys(ids[:7], [img], PAGE) == base[:1]  # only whole pages get a key
    assert page_keys(ids, [img], PAGE, first=2, parent=base[1]) == base[2:]


# ---- page states ---------------------------------------------------------------------------

def test_pages_are_free_idle_or_referenced_and_evicted_lru():
    cache = PrefixCache(KVPagePool(4, PAGE))
    a = cache.alloc(2)
    assert cache.insert(a[0], b"k0") and cache.insert(a[1], b"k1")
    assert not cache.insert(a[1], b"other")  # a page has one key
    b = cache.alloc(2)
    assert not cache.insert(b[0], b"k0")  # a key has one page: b[0] stays private
    cache.free(a)
    assert num_idle(cache) == 2 and cache.num_free == 2 and cache.num_cached == 2
    cache.free(b)
    assert cache.pool.num_free == 2 and cache.num_free == 4  # uncached pages: free
    assert cache.match([b"k0", b"k1", b"k2"]) == a
    cache.acquire(a[:1])  # a request takes the first; the second stays idle
    assert cache.num_free == 3
    got = cache.alloc(3)  # needs one idle page: evicts a[1] (the only idle one)
    assert a[1] in got and cache.stats.evictions == 1
    assert cache.match([b"k0", b"k1"]) == a[:1]
    with pytest.raises(MemoryError):
        cache.alloc(1)
    cache.free(got)
    cache.free(a[:1])
    all_idle_or_free(cache)
    with pytest.raises(ValueError):
        cache.free(a[:1])  # not held any more


def test_disabled_cache_is_a_plain_allocator():
    cache = PrefixCache(KVPagePool(4, PAGE), enabled=False)
    p = cache.alloc(1)
    assert not cache.insert(p[0], b"k") and cache.match([b"k"]) == []
    cache.free(p)
    assert cache.pool.num_free == 4


# ---- the scheduler with the cache ----------------------------------------------------------

PROMPT = list(range(200, 230))  # 30 tokens: 7 whole pages + 2


def test_repeated_prompt_reuses_pages_and_outputs_equal_cache_off():
    outs = {}
    for enabled in (False, True):
        sched, cache = make_sched(enabled=enabled)
        model = sched.model
        first = make_request(PROMPT)
        sched.add(first)
        run(sched, [first])
        before = model.computed
        second = make_request(PROMPT)
        sched.add(second)
        run(sched, [second])
        outs[enabled] = (first.output_ids, second.output_ids, model.computed - before,
                         second.kv.cached_tokens)
        all_idle_or_free(cache)
        # looked up: 7 pages each time; found: none the first time, all 7 the second
        assert cache.stats.query_tokens == (56 if enabled else 56)
        assert cache.stats.hit_tokens == (28 if enabled else 0)
    assert outs[True][:2] == outs[False][:2] and outs[True][0] == outs[True][1]
    assert outs[False][2] == 30 + 5 and outs[False][3] == 0
    assert outs[True][3] == 28  # 7 pages of 4: at most one page is recomputed
    assert outs[True][2] == 30 - 28 + 5  # prompt tail + 5 decode steps (6th token sampled)


def test_next_turn_reuses_the_prompt_and_the_generated_pages():
    sched, cache = make_sched()
    first = make_request(PROMPT, max_tokens=10)
    sched.add(first)
    run(sched, [first])
    turn = PROMPT + first.output_ids + [7, 8, 9]
    second = make_request(turn)
    sched.add(second)
    run(sched, [second])
    # first's KV: 30 prompt + 9 fed outputs = 39 tokens -> 9 whole pages are cached
    assert second.kv.cached_tokens == 36
    all_idle_or_free(cache)


def test_same_text_other_image_shares_nothing_from_the_image_on():
    sched, cache = make_sched()
    a = make_request(PROMPT, images=[ImageSpan(8, 12, "a" * 64)])
    b = make_request(PROMPT, images=[ImageSpan(8, 12, "b" * 64)])
    c = make_request(PROMPT, images=[ImageSpan(12, 12, "a" * 64)])  # same image, moved
    for r in (a, b, c):
        sched.add(r)
        run(sched, [r])
    # only the two pages before the first image's start (token 8) are shared
    assert b.kv.cached_tokens == 8 and c.kv.cached_tokens == 8
    assert b.output_ids != a.output_ids and c.output_ids != a.output_ids
    all_idle_or_free(cache)


def test_prompt_without_announced_images_is_never_shared():
    sched, cache = make_sched()
    a, b = make_request(PROMPT, info=False), make_request(PROMPT, info=False)
    for r in (a, b):
        sched.add(r)
        run(sched, [r])
    assert b.kv.cached_tokens == 0 and cache.num_cached == 0


def test_concurrent_sharers_retraction_and_a_pool_full_of_cached_pages():
    # 24 pages of 4 = 96 tokens: six 30-token prompts growing to 38 cannot all run at once
    # without retraction; they share the first 7 pages when admitted after the first.
    sched, cache = make_sched(pages=24, budget=64)
    reqs = [make_request(PROMPT + [i], max_tokens=8) for i in range(6)]
    for r in reqs:
        sched.add(r)
    run(sched, reqs)
    ref_sched, _ = make_sched(pages=256, enabled=False)
    refs = [make_request(PROMPT + [i], max_tokens=8) for i in range(6)]
    for r in refs:
        ref_sched.add(r)
    run(ref_sched, refs)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in refs]
    all_idle_or_free(cache)
    assert num_idle(cache) > 0
    # the pool is now full of idle cached pages: a new, unrelated prompt still gets in
    other = make_request(list(range(500, 590)), max_tokens=2)  # 23 pages
    sched.add(other)
    run(sched, [other])
    assert cache.stats.evictions > 0
    all_idle_or_free(cache)


def test_a_head_blocked_by_rooms_pins_waits_instead_of_failing():
    # 24 pages: a room in transfer pins 7 cached pages; a new 70-token request needs 18
    # while 17 are free: it waits for the pin (soon a request's, or released), not failed
    sched, cache = make_sched(pages=24)
    first = make_request(PROMPT)
    sched.add(first)
    run(sched, [first])  # its 7 prompt pages are now cached (idle)
    assert cache.pin(room=99, token_ids=PROMPT, images=[]) == 28
    assert cache.num_pinned_for_rooms == 7 and cache.num_free == 17
    big = make_request(list(range(600, 670)))
    sched.add(big)
    assert sched.schedule() is None and big.status is RequestStatus.WAITING
    cache.unpin(99)
    run(sched, [big])
    all_idle_or_free(cache)
    assert cache.num_pinned_for_rooms == 0


def pinned_request(sched: Scheduler, cache: PrefixCache, ids: list[int],
                   max_tokens: int) -> Request:
    """A request as the engine submits one whose cached prefix was pinned during its
    transfer: it holds the pinned pages, its payload's rows start after them."""
    full = make_request(ids, max_tokens=max_tokens)
    start = cache.pin(full.room, ids, [])
    assert start > 0
    req = Request(RequestSpec(full.room, full.sampling, full.prompt.rows_from(start)))
    sched.adopt_pin(req, cache.take_pin(req.room, start))
    return req


def test_an_older_head_blocked_by_a_pinned_waiter_lets_it_go_first():
    # 24 pages: W holds 7 pinned pages, so the older 70-token head (18 pages) cannot fit
    # in the 17 left; only W's run frees them: W goes first, then the head, none failed
    sched, cache = make_sched(pages=24)
    warm = make_request(PROMPT)
    sched.add(warm)
    run(sched, [warm])
    head = make_request(list(range(600, 670)), max_tokens=2)
    sched.add(head)
    waiter = pinned_request(sched, cache, PROMPT + [1, 2], max_tokens=2)
    sched.add(waiter)
    order = []
    model = sched.model
    for _ in range(200):
        step = sched.schedule()
        if step is None:
            break
        assert not step.failed, step.failed
        order += [c.req.room for c in step.chunks if c.req.room not in order]
        tokens = model.forward(step.batch, {r.room: r for r in (head, waiter)})
        sched.commit(step, [t if c.samples else None for c, t in zip(step.chunks, tokens, strict=True)])
        for c in step.chunks:
            if c.samples and len(c.req.output_ids) >= c.req.sampling.max_tokens:
                sched.finish(c.req, RequestStatus.FINISHED_LENGTH)
    assert order == [waiter.room, head.room]
    assert head.status is waiter.status is RequestStatus.FINISHED_LENGTH
    all_idle_or_free(cache)


def test_a_lone_runner_short_of_a_pinned_waiters_pages_steps_aside():
    # 12 pages: B (waiting) holds 7 pinned pages; A (16 tokens) takes the 5 left and
    # outgrows them:
    # A steps aside (instead of failing "exhausted by a single request"), B runs and ends,
    # then A finishes
    sched, cache = make_sched(pages=12, budget=64)
    warm = make_request(PROMPT)
    sched.add(warm)
    run(sched, [warm])
    a = make_request(list(range(700, 716)), max_tokens=12)
    sched.add(a)
    b = pinned_request(sched, cache, PROMPT + [3], max_tokens=2)
    sched.add(b)
    run(sched, [a, b])
    assert a.kv.num_retractions >= 1 and a.kv.num_retractions <= sched.MAX_YIELDS
    all_idle_or_free(cache)
