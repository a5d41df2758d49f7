"""The step scheduler: which chunks run next, on which KV pages.

One step is `schedule() -> runner.forward(step.batch) -> commit(step, tokens)`, all on the
engine thread. `schedule()` builds a mixed batch:

    1. decode  every RUNNING request gets one token (and a page when it crosses one);
               when pages run out the newest scheduled request is retracted
    2. chunks  PREFILLING requests continue their prompt under the token budget
    3. admit   waiting requests in queue order while budget, slots and headroom allow
               (FCFS: the head blocks the queue; no skipping ahead)

Streamed prompts (docs/architecture.md, "Streamed rows"; `PromptPayload.arrived`): a request may be
submitted with only its first rows. Its chunks end at its rows (`Request.rows_end`), so it
never samples before the whole prompt is in (a chunk samples only at the sequence's end).
With every arrived row computed it becomes WAITING_FOR_ROWS: it keeps its KV pages (they
count as committed), is not a running slot, takes no step, and goes back to PREFILLING
(taking a slot) once rows have arrived. A waiting request whose next row has not arrived
is skipped by admission without blocking the queue (it is not there yet, as it were), and
takes cached pages only below its arrived rows. Nothing here waits: when every request
waits for rows, `schedule()` returns None and the engine sleeps until the receiver's
watermark wakes it. Retraction, pins, page keys and deadlines are the same for a partial
prompt (its rows only grow; pages are keyed once computed, from verified rows).

A retracted request frees its pages (all but its pinned prefix, see below) and goes back
to the waiting queue with its generated tokens kept; when readmitted it recomputes its
prompt (embeddings) and then its generated tokens (ids) before decoding on. Sampling state
(the request's generator) is not touched, so its output is the same as without the
retraction.

Prefix cache (`prefix_cache.py`): at admission a request takes the longest run of cached
pages matching its sequence (capped so at least its last token is computed: it needs
logits) and its chunked prefill starts after them; after each step the pages a request
has filled get their keys (`_offer_pages`). A request whose prompt came without the
cached prefix's rows (`prompt.start` > 0) holds that prefix's pages for its whole life
(`num_pinned_pages`), retraction included: nothing else could recompute it. So the one
exception to FCFS: with nothing running, a waiter holding such a prefix may be admitted
ahead of a head that does not fit, and a lone running request short of pages that such a
waiter holds steps aside (at most MAX_YIELDS times) instead of failing.

Admission: `check()` is the one rule for "can this request ever run here" (empty prompt,
max_model_len, embedding width, KV pages for prompt + 1 token). The engine calls it in
`submit()` on the caller's thread to fail fast, and `add()` calls it again; it reads only
limits fixed at construction, so it is safe from any thread.

Ownership: the scheduler is the one writer of a request's status (through
`Request.transition`, which checks the order), its output (`Request.append_output`, in
`commit`) and its KV state (`req.kv`: the policy's `PrefillAdder` only answers with a
`Grant`, the engine hands a pinned prefix over with `adopt_pin`). A request it ends here
comes back in `Step.failed` as a `Failure` with its message: nothing is parked on it.

NOTE: every path that ends a request goes through `finish()`, which frees its pages.
Everything here runs under the page cache's lock (`PrefixCache.lock`): the language
server pins cached prefixes from its own thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tandem.errors import ServiceError
from tandem.services.language.engine.policy import (
    Grant,
    NewTokenRatio,
    PrefillAdder,
    WaitingQueue,
)
from tandem.services.language.engine.prefix_cache import (
    PrefixCache,
    namespace_root,
    page_keys,
    shareable_pages,
)
from tandem.services.language.engine.request import Request, RequestStatus
from tandem.services.language.runner.forward_batch import ForwardBatch, SeqChunk, decode_positions
from tandem.units import ceil_div


class AdmissionError(ServiceError):
    """A request that can never run here (too long for the model or the KV pool);
    `field` names the request field at fault when one is (the wire's ErrorInfo.field)."""

    code = "INVALID_ARGUMENT"

    def __init__(self, message: str, code: str | None = None, field: str = "") -> None:
        super().__init__(message, code)
        self.field = field


@dataclass
class ScheduledChunk:
    req: Request
    start: int
    num_tokens: int
    samples: bool  # reaches the end of the known sequence: its logits give a new token


@dataclass(frozen=True)
class Failure:
    """A request the scheduler ended (FINISHED_ERROR) this step, and why."""

    req: Request
    message: str
    code: str  # a gRPC code name


@dataclass
class Step:
    chunks: list[ScheduledChunk]
    batch: ForwardBatch
    failed: list[Failure] = field(default_factory=list)  # ended by the scheduler this step

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True)
class ScheduleLimits:
    """What the scheduler admits and how much it batches (the engine's config, read once)."""

    max_prefill_tokens: int  # prompt tokens one step may compute
    max_running_requests: int
    policy: str = "fcfs"  # or "priority"
    clip_max_new_tokens: int = 4096  # the largest budget a request counts for admission
    max_model_len: int | None = None  # None: no length check at admission
    embed_dims: tuple[int, ...] = ()  # widths a prompt's embeddings may have; (): no check


class Scheduler:
    # A lone running request that lacks pages a pinned waiter holds steps aside at most
    # this many times before it is failed instead (no endless ping-pong).
    MAX_YIELDS = 3

    def __init__(self, pool: PrefixCache, page_size: int, limits: ScheduleLimits,
                 ratio: NewTokenRatio | None = None) -> None:
        if limits.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown schedule policy {limits.policy!r}")
        self.pool = pool
        self.page_size = page_size
        self.max_prefill_tokens = limits.max_prefill_tokens
        self.max_running = limits.max_running_requests
        self.by_priority = limits.policy == "priority"
        self.clip = limits.clip_max_new_tokens
        self.ratio = ratio or NewTokenRatio()
        self.waiting = WaitingQueue(self.by_priority)
        self.running: list[Request] = []  # PREFILLING and RUNNING, i.e. may hold pages
        self.num_retractions = 0
        self.max_model_len = limits.max_model_len
        self.embed_dims = limits.embed_dims  # widths a prompt's embeddings may have

    # ---- requests in and out ----------------------------------------------------------

    def check(self, req: Request) -> None:
        """Raise AdmissionError when `req` can never run here (see the module docstring)."""
        if req.prompt_len == 0:
            raise AdmissionError("empty prompt")
        n = req.prompt_len
        if self.max_model_len is not None and n >= self.max_model_len:
            raise AdmissionError(f"prompt of {n} tokens reaches max_model_len {self.max_model_len}")
        dim = req.prompt.embed_dim  # None: a text-only prompt (embedded from its ids)
        if dim is not None and self.embed_dims and dim not in self.embed_dims:
            raise AdmissionError(
                f"prompt embed_dim {req.prompt.embed_dim} does not match the model's "
                f"{self.embed_dims[0]}"
            )
        need = ceil_div(n + 1, self.page_size)
        if need > self.pool.num_total:
            raise AdmissionError(
                f"prompt of {n} tokens needs {need} KV pages; the pool has {self.pool.num_total}",
                "RESOURCE_EXHAUSTED",
            )

    def add(self, req: Request) -> None:
        """Queue a request whose prompt is complete."""
        self.check(req)
        req.transition(RequestStatus.WAITING)
        req.times.queued = req.times.queued or time.monotonic()
        self.waiting.push(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request at any stage; frees its pages. Idempotent."""
        assert status.finished
        if req.status.finished:
            return
        with self.pool.lock:
            if req in self.running:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            if status is RequestStatus.FINISHED_HANDED_OFF:
                self._hold_prompt_pages(req)
            else:
                self._free_pages(req)
        req.transition(status)

    def await_grammar(self, req: Request) -> None:
        """A submitted request whose grammar compiles first (`add` once it has)."""
        req.transition(RequestStatus.WAITING_FOR_GRAMMAR)

    def adopt_pin(self, req: Request, pages: list[int]) -> None:
        """Hand a new request the pinned pages of its cached prefix (the room's pin, taken
        at submit): it holds them for its whole life and computes from `prompt.start`."""
        assert req.status is RequestStatus.NEW and not req.kv.block_table
        req.kv.block_table = list(pages)
        req.kv.num_pinned_pages = req.kv.num_keyed_pages = len(pages)
        req.kv.num_computed_tokens = req.prompt.start

    def adopt_handoff(self, req: Request, pages: list[int], first: int,
                      logprob: float | None, cached_tokens: int) -> None:
        """E/P/D, a decode instance: a new request whose whole prompt's KV (tokens
        [0, prompt.start), landed and checked in `pages`, the room's reservation) the
        prefill instance computed, and its first token, sampled there. It holds the pages
        for its whole life (a retraction recomputes only its output) and its next step
        computes the first token's K/V and samples the second; `cached_tokens` is what the
        prefill side's prefix cache held (its usage)."""
        self.adopt_pin(req, pages)
        req.kv.cached_tokens = cached_tokens
        req.append_output(first, logprob)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        """Something could run now if pages allowed (a request waiting for rows cannot)."""
        return any(not (r.status is RequestStatus.WAITING_FOR_ROWS and r.rows_pending)
                   for r in self.running) or any(not r.rows_pending for r in self.waiting)

    def _slots_held(self) -> int:
        """Running slots in use: a request waiting for rows holds none."""
        return sum(r.status is not RequestStatus.WAITING_FOR_ROWS for r in self.running)

    # ---- one step ---------------------------------------------------------------------

    def schedule(self) -> Step | None:
        with self.pool.lock:
            return self._schedule()

    def _schedule(self) -> Step | None:
        chunks: dict[Request, int] = {}
        failed: list[Failure] = []
        for _ in range(len(self.running) + len(self.waiting) + 1):
            self._schedule_decode(chunks, failed)
            self._schedule_prefill(chunks)
            if chunks or not self.has_work():
                break
            # Nothing could run: requests hold pages but none can grow (or the head of the
            # queue cannot fit). Retract the newest holder and try again.
            if self.running:
                self._retract(self._newest())
            else:
                head = next(r for r in self.waiting if not r.rows_pending)  # has_work()
                need = ceil_div(head.seq_len + 1, self.page_size) - len(head.kv.block_table)
                if need <= self.pool.num_free + self.pool.num_pinned_for_rooms:
                    break  # rooms in transfer hold the pages it needs: they come back soon
                self.finish(head, RequestStatus.FINISHED_ERROR)
                failed.append(Failure(head, "KV pool too small for this prompt",
                                      "RESOURCE_EXHAUSTED"))
        if not chunks:
            return Step([], ForwardBatch(), failed) if failed else None
        if any(r.status is RequestStatus.RUNNING for r in chunks):
            self.ratio.decay()
        now = time.monotonic()
        scheduled = []
        for req, n in chunks.items():
            req.times.first_scheduled = req.times.first_scheduled or now
            start = req.kv.num_computed_tokens
            scheduled.append(ScheduledChunk(req, start, n, start + n == req.seq_len))
        return Step(scheduled, ForwardBatch([self._seq_chunk(c) for c in scheduled]), failed)

    def commit(self, step: Step, new_tokens: list[int | None],
               logprobs: list[float | None] | None = None) -> None:
        """Advance counters after the forward; `new_tokens[i]` (and its logprob, None when
        not asked) for chunks that sample."""
        logprobs = logprobs or [None] * len(step.chunks)
        with self.pool.lock:
            for chunk, token, logprob in zip(step.chunks, new_tokens, logprobs, strict=True):
                req = chunk.req
                if req.status.finished:
                    continue
                req.kv.num_computed_tokens = chunk.start + chunk.num_tokens
                if chunk.samples:
                    assert token is not None
                    req.append_output(token, logprob)
                    if req.status is not RequestStatus.RUNNING:
                        req.transition(RequestStatus.RUNNING)
                assert req.kv.num_computed_tokens <= len(req.kv.block_table) * self.page_size
                self._offer_pages(req)

    # ---- prefix cache -----------------------------------------------------------------

    def _keys(self, req: Request, n_pages: int) -> list[bytes]:
        """The first `n_pages` page keys of `req`'s sequence (fewer when its content is not
        known or not that long), computed once and kept on the request."""
        content = req.cache_content()
        if content is None or not self.pool.enabled:
            return []
        n_pages = min(n_pages, req.seq_len // self.page_size)
        have = len(req.kv.page_keys)
        if n_pages > have:
            ids, images = content
            seq = list(ids) + req.output_ids
            parent = req.kv.page_keys[-1] if have else namespace_root(req.cache_salt)
            req.kv.page_keys += page_keys(seq[: n_pages * self.page_size], images, self.page_size,
                                       first=have, parent=parent)
        return req.kv.page_keys[:n_pages]

    def cached_pages(self, req: Request) -> list[int]:
        """Cached pages extending what `req` holds (no reference taken): at most up to the
        page before its last token, which must be computed for its logits."""
        held = len(req.kv.block_table)
        # NOTE: at least one arrived row is left to compute (a streamed prompt's rows)
        limit = shareable_pages(min(req.seq_len, req.rows_end), self.page_size)
        if limit <= held:
            return []
        return self.pool.match(self._keys(req, limit)[held:])

    def _offer_pages(self, req: Request) -> None:
        """Key the pages `req` has filled since the last call (it never writes them again)."""
        full = req.kv.num_computed_tokens // self.page_size
        if full <= req.kv.num_keyed_pages:
            return
        keys = self._keys(req, full)
        for i in range(req.kv.num_keyed_pages, len(keys)):
            self.pool.insert(req.kv.block_table[i], keys[i])
        req.kv.num_keyed_pages = full

    # ---- policy pieces ----------------------------------------------------------------

    def _schedule_decode(self, chunks: dict[Request, int], failed: list[Failure]) -> None:
        retracted = False
        for req in sorted(self.running, key=lambda r: r.sort_key(self.by_priority)):
            if req.status is not RequestStatus.RUNNING or req in chunks:
                continue
            need = ceil_div(req.kv.num_computed_tokens + 1, self.page_size) - len(req.kv.block_table)
            while need > 0 and not self.pool.can_alloc(need) and req in self.running:
                victim = self._newest()
                if victim is req and len(self.running) == 1 and self._pinned_waiters() and \
                        req.kv.num_retractions < self.MAX_YIELDS:
                    # NOTE: the pages it lacks are a waiting request's pinned prefix, which
                    # only that request's run frees: step aside (bounded, no ping-pong)
                    self._retract(req)
                    chunks.pop(req, None)
                    retracted = True
                    break
                if victim is req and len(self.running) == 1:
                    self.finish(req, RequestStatus.FINISHED_ERROR)
                    failed.append(Failure(req, "KV pool exhausted by a single request",
                                          "RESOURCE_EXHAUSTED"))
                    break
                self._retract(victim)
                chunks.pop(victim, None)
                retracted = True
            if req not in self.running:
                continue
            if need > 0:
                req.kv.block_table.extend(self.pool.alloc(need))
            chunks[req] = 1
        if retracted:
            self.ratio.on_retract(self.running)

    def _schedule_prefill(self, chunks: dict[Request, int]) -> None:
        for req in self.running:  # every arrived row computed: wait, holding no slot
            if req.status is RequestStatus.PREFILLING and req.rows_pending:
                req.transition(RequestStatus.WAITING_FOR_ROWS)
        adder = PrefillAdder(
            self.pool,
            self.page_size,
            token_budget=self.max_prefill_tokens,
            headroom_pages=self.pool.num_free - sum(self._committed(r) for r in self.running),
            free_slots=self.max_running - self._slots_held(),
            nothing_scheduled=not self.running,
        )
        for req in sorted(self.running, key=lambda r: r.sort_key(self.by_priority)):
            if req in chunks:
                continue
            if req.status is RequestStatus.PREFILLING:
                grant = adder.add_continuing(req)
                if grant:
                    chunks[req] = self._apply(req, grant)
            elif (req.status is RequestStatus.WAITING_FOR_ROWS and not req.rows_pending
                    and adder.free_slots > 0):  # rows arrived: on, in a slot again
                grant = adder.add_continuing(req)
                if grant:
                    req.transition(RequestStatus.PREFILLING)
                    adder.free_slots -= 1
                    chunks[req] = self._apply(req, grant)
        blocked = False
        for req in list(self.waiting):
            if req.rows_pending:  # a streamed prompt whose next row has not arrived
                continue
            if blocked and not (req.kv.num_pinned_pages and not chunks and not self.running):
                continue
            cached = self.cached_pages(req)
            grant = adder.try_admit(req, self.ratio.reserve_tokens(req, self.clip), cached)
            if grant is None:
                if chunks or self.running:
                    break  # FCFS: the head of the queue blocks the rest
                # NOTE: with nothing running, the one exception to FCFS: a waiter holding a
                # pinned prefix may go first, since only its run frees those pages
                blocked = True
                continue
            chunks[req] = self._apply(req, grant)
            self._admitted(req)
            if blocked:
                break

    def _apply(self, req: Request, grant: Grant) -> int:
        """Put a grant's pages in `req`'s table (its cached ones count as computed)."""
        req.kv.block_table.extend(grant.pages)
        req.kv.num_computed_tokens += grant.num_cached * self.page_size
        return grant.num_tokens

    def _admitted(self, req: Request) -> None:
        req.transition(RequestStatus.PREFILLING)
        if req.kv.cached_tokens is None:  # first admission: what the cache saved it
            req.kv.cached_tokens = req.kv.num_computed_tokens
            self.pool.count_query(shareable_pages(req.seq_len, self.page_size),
                                  req.kv.num_computed_tokens // self.page_size)
        self.waiting.remove(req)
        self.running.append(req)

    def _pinned_waiters(self) -> bool:
        return any(r.kv.num_pinned_pages for r in self.waiting)

    def _committed(self, req: Request) -> int:
        """Pages a scheduled request is still expected to need."""
        total = req.seq_len + self.ratio.reserve_tokens(req, self.clip)
        return max(ceil_div(total, self.page_size) - len(req.kv.block_table), 0)

    def _newest(self) -> Request:
        """Retraction victim: lowest priority (when honoured), then latest arrival."""
        return max(self.running, key=lambda r: r.sort_key(self.by_priority))

    def _retract(self, req: Request) -> None:
        """Back to the waiting queue, keeping only its pinned prefix's pages."""
        self.running.remove(req)
        keep = req.kv.num_pinned_pages
        self.pool.free(req.kv.block_table[keep:])
        del req.kv.block_table[keep:]
        # NOTE: the pinned pages hold exactly the tokens before the prompt's first row (a
        # cached prefix: whole pages; a handed-off prompt: all of it, its last page part)
        assert ceil_div(req.prompt.start, self.page_size) == keep
        req.kv.num_computed_tokens = req.prompt.start
        req.kv.num_keyed_pages = min(req.kv.num_keyed_pages, keep)
        req.kv.num_retractions += 1
        self.num_retractions += 1
        req.transition(RequestStatus.WAITING)
        self.waiting.push(req)

    def _hold_prompt_pages(self, req: Request) -> None:
        """A handed-off request's prompt pages move to its room's hold (the rest, if any,
        freed): the prefill instance sends them from there."""
        n = ceil_div(req.prompt_len, self.page_size)
        assert req.kv.num_computed_tokens >= req.prompt_len, "handed off before its prompt"
        self.pool.free(req.kv.block_table[n:])
        self.pool.hold(req.room, req.kv.block_table[:n])
        req.kv.block_table = []
        req.kv.num_computed_tokens = req.kv.num_pinned_pages = req.kv.num_keyed_pages = 0

    def _free_pages(self, req: Request) -> None:
        if req.kv.block_table:
            self.pool.free(req.kv.block_table)
            req.kv.block_table = []
        req.kv.num_computed_tokens = req.kv.num_pinned_pages = req.kv.num_keyed_pages = 0

    def _seq_chunk(self, c: ScheduledChunk) -> SeqChunk:
        req, s, e = c.req, c.start, c.start + c.num_tokens
        prompt = req.prompt
        pages = req.kv.block_table[: ceil_div(e, self.page_size)]
        L = req.prompt_len
        if s < L and prompt.input_embeds is not None:  # prompt rows: embeddings, MRoPE
            a, b = s - prompt.start, e - prompt.start
            assert a >= 0, "a chunk before the prompt's first row (its pinned prefix)"
            return SeqChunk(
                seq_id=req.room,
                start=s,
                positions=prompt.mrope_positions[:, a:b].to(torch.int64),
                block_table=pages,
                input_embeds=prompt.input_embeds[a:b],
                embeds_key=prompt.ranks_key,
                embeds_row=a,
            )
        # generated tokens (or a text-only prompt's): ids, text positions shifted by the
        # prompt's MRoPE delta (0 without images)
        if s < L:
            ids = prompt.fill_ids[s - prompt.start : e - prompt.start].to(torch.int64)
        else:
            ids = torch.tensor(req.output_ids[s - L : e - L], dtype=torch.int64)
        return SeqChunk(
            seq_id=req.room,
            start=s,
            positions=decode_positions(s, prompt.mrope_delta, e - s),
            block_table=pages,
            token_ids=ids,
        )
