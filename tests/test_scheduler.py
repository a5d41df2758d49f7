"""Scheduler on plain data: budgets, chunking, ordering, admission, retraction, aborts.

The model stand-in here is `SlotModel`: it writes every position's input into the slot
the block table names and derives the next token from the whole sequence *read back
through the block tables*. A wrong page, position, chunk boundary or recompute input
changes the tokens or trips an assertion, so output equality across pool sizes proves
the scheduler hands the runner a consistent view. The real model runs in
test_language_engine.py.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from tandem.sampling import SamplingParams
from tandem.services.language.engine.kv_pages import KVPagePool
from tandem.services.language.engine.policy import NewTokenRatio
from tandem.services.language.engine.prefix_cache import PrefixCache
from tandem.services.language.engine.request import Request, RequestSpec, RequestStatus
from tandem.services.language.engine.scheduler import AdmissionError, ScheduleLimits, Scheduler
from tandem.services.language.runner.forward_batch import ForwardBatch
from tandem.transfer.payload import PromptPayload

PAGE = 4
_rid = iter(range(1, 1 << 30))


def make_request(prompt_len: int, max_tokens: int = 8, priority: int = 0, delta: int = 5):
    ids = torch.arange(prompt_len, dtype=torch.int32) % 50 + 100
    embeds = ids.to(torch.float32)[:, None].repeat(1, 4)  # column 0 carries the token id
    pos = torch.arange(prompt_len, dtype=torch.int32).expand(3, -1).clone()
    payload = PromptPayload(embeds, ids, pos, delta)
    return Request(RequestSpec(next(_rid), SamplingParams(max_tokens=max_tokens), payload, priority=priority))


class SlotModel:
    def __init__(self) -> None:
        self.slots: dict[int, tuple[int, int, int]] = {}

    def forward(self, batch: ForwardBatch, reqs: dict[int, Request]) -> list[int]:
        out = []
        for c in batch.chunks:
            req = reqs[c.seq_id]
            end = c.start + c.num_tokens
            assert len(c.block_table) >= -(-end // PAGE)
            for j in range(c.num_tokens):
                p = c.start + j
                if c.is_decode:
                    assert c.input_embeds is None and p >= req.prompt_len
                    val = int(c.token_ids[j])
                    assert c.positions[:, j].tolist() == [p + req.prompt.mrope_delta] * 3
                else:
                    assert c.token_ids is None and p < req.prompt_len
                    val = int(c.input_embeds[j, 0])
                    assert c.positions[:, j].tolist() == req.prompt.mrope_positions[:, p].tolist()
                self.slots[c.block_table[p // PAGE] * PAGE + p % PAGE] = (c.seq_id, p, val)
            seq = []
            for p in range(end):
                sid, pp, val = self.slots[c.block_table[p // PAGE] * PAGE + p % PAGE]
                assert (sid, pp) == (c.seq_id, p), "block table points at someone else's KV"
                seq.append(val)
            digest = hashlib.sha256(repr(seq).encode()).digest()
            out.append(int.from_bytes(digest[:4], "little") % 1000)
        return out


def run(sched: Scheduler, reqs: list[Request], max_steps: int = 2000, on_step=None):
    """Drive the loop until every request finishes by length; return the steps."""
    model, by_id, steps = SlotModel(), {r.room: r for r in reqs}, []
    for _ in range(max_steps):
        step = sched.schedule()
        if step is None:
            break
        assert not step.failed
        steps.append(step)
        tokens = model.forward(step.batch, by_id)
        sched.commit(
            step, [t if c.samples else None for c, t in zip(step.chunks, tokens, strict=True)]
        )
        for c in step.chunks:
            if c.samples and len(c.req.output_ids) >= c.req.sampling.max_tokens:
                sched.finish(c.req, RequestStatus.FINISHED_LENGTH)
        if on_step:
            on_step(step)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    return steps


def make_sched(pages=256, budget=32, max_running=64, policy="fcfs", ratio=None):
    pool = PrefixCache(KVPagePool(pages, PAGE), enabled=False)
    return Scheduler(pool, PAGE, ScheduleLimits(budget, max_running, policy=policy),
                     ratio=ratio), pool


def test_chunked_prefill_respects_budget_then_decodes():
    sched, pool = make_sched(budget=16)
    req = make_request(40, max_tokens=3)
    sched.add(req)
    steps = run(sched, [req])
    sizes = [[c.num_tokens for c in s.chunks] for s in steps]
    assert sizes == [[16], [16], [8], [1], [1]]
    assert [c.samples for s in steps for c in s.chunks] == [False, False, True, True, True]
    assert steps[0].chunks[0].req.status is RequestStatus.FINISHED_LENGTH
    assert pool.num_free == pool.num_total


def test_prefill_chunks_and_decodes_share_a_step():
    sched, pool = make_sched(budget=16)
    a, b = make_request(8, max_tokens=6), make_request(30, max_tokens=2)
    sched.add(a)
    first = sched.schedule()
    sched.commit(first, [7])  # a is now RUNNING
    sched.add(b)
    step = sched.schedule()
    assert [(c.req.room, c.num_tokens) for c in step.chunks] == [(a.room, 1), (b.room, 16)]
    assert step.batch.chunks[0].is_decode and not step.batch.chunks[1].is_decode
    assert not step.batch.is_pure_decode
    sched.finish(a, RequestStatus.FINISHED_ABORT)
    sched.finish(b, RequestStatus.FINISHED_ABORT)
    assert pool.num_free == pool.num_total


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_queue_order(policy):
    sched, _ = make_sched(max_running=1, budget=64, policy=policy)
    low, high = make_request(8, max_tokens=1, priority=0), make_request(8, max_tokens=1, priority=5)
    sched.add(low)
    sched.add(high)
    order = []
    run(sched, [low, high], on_step=lambda s: order.extend(c.req.room for c in s.chunks))
    expected = [low.room, high.room] if policy == "fcfs" else [high.room, low.room]
    assert order == expected


def test_admission_reserves_pages_for_expected_output_and_ratio_decays():
    # 40 pages = 160 tokens. Each request: 16 prompt tokens + 200 max output tokens.
    sched, pool = make_sched(pages=40, budget=64)
    a, b = make_request(16, max_tokens=200), make_request(16, max_tokens=200)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    # a alone is admitted on its prompt; b would need 16 + 0.7*200 tokens = 39 pages of
    # headroom while a is expected to take 35 more.
    assert [c.req for c in step.chunks] == [a]
    assert sched.num_waiting == 1
    r0 = sched.ratio.value
    sched.commit(step, [1])
    for _ in range(5):
        s = sched.schedule()
        sched.commit(s, [1] * len(s.chunks))
    assert sched.ratio.value < r0  # decays with every decode step
    sched.finish(a, RequestStatus.FINISHED_ABORT)
    step = sched.schedule()  # a's pages are back: b fits now
    assert [c.req for c in step.chunks] == [b]
    sched.finish(b, RequestStatus.FINISHED_ABORT)
    assert pool.num_free == pool.num_total


def _workload():
    lens = [(13, 20), (7, 25), (22, 12), (5, 30), (18, 18), (9, 22)]
    return [make_request(p, max_tokens=m) for p, m in lens]


def test_retraction_keeps_outputs_identical():
    big, _ = make_sched(pages=512, budget=24)
    ref = _workload()
    for r in ref:
        big.add(r)
    run(big, ref)
    assert big.num_retractions == 0

    # 96 tokens for ~200 needed at peak, and an optimistic ratio that overcommits them
    small, pool = make_sched(pages=24, budget=24, ratio=NewTokenRatio(init=0.1))
    reqs = _workload()
    for r in reqs:
        small.add(r)
    steps = run(small, reqs)
    assert small.num_retractions > 0
    # generated tokens were recomputed from their ids (a multi-token id chunk)
    assert any(c.is_decode and c.num_tokens > 1 for s in steps for c in s.batch.chunks)
    assert any(r.kv.num_retractions for r in reqs)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]
    assert pool.num_free == pool.num_total
    assert small.ratio.value > small.ratio.min  # raised again by the retraction


def test_too_long_prompt_is_rejected():
    sched, _ = make_sched(pages=4)
    with pytest.raises(AdmissionError, match="needs 5 KV pages"):
        sched.add(make_request(16))


def test_lone_request_that_outgrows_the_pool_fails_and_frees():
    sched, pool = make_sched(pages=4)
    req = make_request(10, max_tokens=100)
    sched.add(req)
    model = SlotModel()
    for _ in range(50):
        step = sched.schedule()
        if step.failed:
            break
        toks = model.forward(step.batch, {req.room: req})
        sched.commit(
            step, [t if c.samples else None for c, t in zip(step.chunks, toks, strict=True)]
        )
    assert [f.req for f in step.failed] == [req] and req.status is RequestStatus.FINISHED_ERROR
    assert step.failed[0].code == "RESOURCE_EXHAUSTED"  # returned, not parked on the request
    assert len(req.output_ids) == 16 - 10 + 1 and pool.num_free == pool.num_total


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "running", "retracted"])
def test_abort_at_every_stage_frees_pages(stage):
    sched, pool = make_sched(pages=12, budget=8, ratio=NewTokenRatio(init=0.1))
    reqs = [make_request(12, max_tokens=30) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    model, by_id = SlotModel(), {r.room: r for r in reqs}
    target = None
    for _ in range(200):
        wanted = {
            "waiting": lambda r: r.status is RequestStatus.WAITING and not r.kv.num_retractions,
            "prefilling": lambda r: r.status is RequestStatus.PREFILLING and r.kv.block_table,
            "running": lambda r: r.status is RequestStatus.RUNNING,
            "retracted": lambda r: r.status is RequestStatus.WAITING and r.kv.num_retractions,
        }[stage]
        target = next((r for r in reqs if wanted(r)), None)
        if target:
            break
        step = sched.schedule()
        assert step is not None and not step.failed
        toks = model.forward(step.batch, by_id)
        sched.commit(
            step, [t if c.samples else None for c, t in zip(step.chunks, toks, strict=True)]
        )
    assert target is not None, f"never reached stage {stage}"
    sched.finish(target, RequestStatus.FINISHED_ABORT)
    assert target.kv.block_table == [] and target.status is RequestStatus.FINISHED_ABORT
    sched.finish(target, RequestStatus.FINISHED_ABORT)  # idempotent
    for r in reqs:
        sched.finish(r, RequestStatus.FINISHED_ABORT)
    assert pool.num_free == pool.num_total
    assert sched.num_running == 0 and sched.num_waiting == 0


# ---- streamed prompts (PromptPayload.arrived) ------------------------------------------


def streamed(req: Request, first: int) -> Request:
    """`req` with a streamed prompt of which only rows [0, first) have arrived."""
    from tandem.transfer.payload import RowWatermark

    req.prompt.arrived = RowWatermark(req.prompt.num_tokens)
    req.prompt.arrived.advance(first)
    return req


def test_streamed_prompt_prefills_arrived_rows_waits_without_a_slot_then_resumes():
    """Chunks end at the watermark (never sampling before the whole prompt); with every
    arrived row computed the request is WAITING_FOR_ROWS: it keeps its pages, frees its
    running slot (another request is admitted into it: max_running 1), takes no step
    (schedule() is None while nothing else can run: no spinning), and goes on once rows
    arrive. The tokens equal those of the same prompt given whole."""
    ref_sched, _ = make_sched(budget=6)
    ref = [make_request(22, max_tokens=3), make_request(9, max_tokens=2)]
    for r in ref:
        ref_sched.add(r)
    run(ref_sched, ref)

    sched, pool = make_sched(budget=6, max_running=1)
    a, b = streamed(make_request(22, max_tokens=3), 5), make_request(9, max_tokens=2)
    model, by_id = SlotModel(), {a.room: a, b.room: b}

    def step():
        s = sched.schedule()
        if s is None:
            return None
        for c in s.chunks:  # nothing past the rows that have arrived, no early sample
            if c.req is a and c.start < a.prompt_len:
                assert c.start + c.num_tokens <= a.rows_end
                assert not c.samples or a.prompt.arrived.complete
        toks = model.forward(s.batch, by_id)
        sched.commit(s, [t if c.samples else None for c, t in zip(s.chunks, toks, strict=True)])
        for c in s.chunks:
            if c.samples and len(c.req.output_ids) >= c.req.sampling.max_tokens:
                sched.finish(c.req, RequestStatus.FINISHED_LENGTH)
        return s

    sched.add(a)
    s = step()
    assert [(c.req, c.start, c.num_tokens) for c in s.chunks] == [(a, 0, 5)]
    assert sched.schedule() is None  # every arrived row computed, nothing else: no step
    assert a.status is RequestStatus.WAITING_FOR_ROWS and a.kv.block_table
    sched.add(b)  # the slot a does not hold goes to b
    s = step()
    assert [c.req for c in s.chunks] == [b] and b.status is RequestStatus.PREFILLING
    a.prompt.arrived.advance(22)  # the rest arrives while b holds the only slot
    while b.status is not RequestStatus.FINISHED_LENGTH:
        s = step()
        assert all(c.req is b for c in s.chunks)  # a waits for a slot, not for pages
    while a.status is not RequestStatus.FINISHED_LENGTH:
        assert step() is not None
    assert a.kv.num_retractions == 0
    assert [a.output_ids, b.output_ids] == [r.output_ids for r in ref]
    assert pool.num_free == pool.num_total


def test_streamed_prompts_trickling_in_under_retraction_keep_outputs_identical():
    """Every prompt streamed, its rows arriving a few per step (chunk boundaries fall
    anywhere in it), in a pool so small that requests are retracted: the same tokens as
    whole prompts in a roomy pool, and every page free at the end."""
    big, _ = make_sched(pages=512, budget=24)
    ref = _workload()
    for r in ref:
        big.add(r)
    run(big, ref)

    small, pool = make_sched(pages=24, budget=24, ratio=NewTokenRatio(init=0.1))
    reqs = [streamed(r, 1) for r in _workload()]
    for r in reqs:
        small.add(r)
    def trickle(_step):
        for r in reqs:
            r.prompt.arrived.advance(min(r.prompt.arrived.rows + 3, r.prompt_len))

    waits = []

    def drive():
        model, by_id = SlotModel(), {r.room: r for r in reqs}
        for _ in range(4000):
            s = small.schedule()
            if s is None:
                if all(r.status.finished for r in reqs):
                    return
                waits.append(len(waits))
                trickle(None)  # nothing to run: the engine would sleep until rows come
                continue
            toks = model.forward(s.batch, by_id)
            small.commit(s, [t if c.samples else None
                             for c, t in zip(s.chunks, toks, strict=True)])
            for c in s.chunks:
                assert c.start + c.num_tokens <= c.req.rows_end or c.start >= c.req.prompt_len
                if c.samples and len(c.req.output_ids) >= c.req.sampling.max_tokens:
                    small.finish(c.req, RequestStatus.FINISHED_LENGTH)
            trickle(s)
        raise AssertionError("did not finish")

    drive()
    assert small.num_retractions > 0
    assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]
    assert pool.num_free == pool.num_total


def test_a_partial_prompt_is_retracted_and_recomputed_from_its_rows():
    """A decoding request outgrows a 12-page pool while a newer streamed prompt waits for
    rows on 3 pages: the partial one is retracted (pages freed, back to the queue), later
    readmitted on the rows it has and finished once the rest arrives, with the tokens of
    a roomy run."""
    ref_sched, _ = make_sched(pages=512, budget=8)
    ref = [make_request(8, max_tokens=30), make_request(20, max_tokens=3)]
    for r in ref:
        ref_sched.add(r)
    run(ref_sched, ref)

    sched, pool = make_sched(pages=12, budget=8, ratio=NewTokenRatio(init=0.1))
    a, b = make_request(8, max_tokens=30), streamed(make_request(20, max_tokens=3), 12)
    by_id, model = {a.room: a, b.room: b}, SlotModel()
    sched.add(a)
    sched.add(b)
    seen = set()
    for _ in range(500):
        s = sched.schedule()
        if s is None:
            assert b.status is RequestStatus.WAITING or b.rows_pending
            b.prompt.arrived.advance(20)  # nothing runs until the rest arrives
            continue
        toks = model.forward(s.batch, by_id)
        sched.commit(s, [t if c.samples else None for c, t in zip(s.chunks, toks, strict=True)])
        for c in s.chunks:
            if c.samples and len(c.req.output_ids) >= c.req.sampling.max_tokens:
                sched.finish(c.req, RequestStatus.FINISHED_LENGTH)
        seen.add((b.status, b.prompt.arrived.complete))
        if a.status.finished and b.status.finished:
            break
    assert (RequestStatus.WAITING_FOR_ROWS, False) in seen  # it waited, partial, on pages
    assert b.kv.num_retractions > 0 and (RequestStatus.WAITING, False) in seen
    assert [a.output_ids, b.output_ids] == [r.output_ids for r in ref]
    assert pool.num_free == pool.num_total
