"""Small scheduling managers, each answering one question.

- `WaitingQueue`: who is next? (FCFS, or priority then FCFS)
- `NewTokenRatio`: how much of a running request's remaining output do we expect to need?
- `PrefillAdder`: which prompt chunks fit this step's token budget and the KV headroom?
  It answers with a `Grant` (tokens, pages taken from the pool) and never writes the
  request: the scheduler applies the grant to the request's KV state (its one writer).

Page accounting (all in pages of `page_size` tokens):

    free pages ──┬── committed: pages scheduled requests will still need, estimated as
                 │   ceil_div(seq_len + remaining_output * ratio, page_size) - pages held
                 └── headroom: what a new admission may claim (prompt + its own reserve)

The ratio starts conservative (0.7), decays each decode step towards ~0.1 and is raised
again on a retraction, as in SGLang's scheduler.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from tandem.services.language.engine.request import Request
from tandem.units import ceil_div


class PagePool(Protocol):
    """What the scheduler needs from the KV page allocator (`PrefixCache`)."""

    def can_alloc(self, n_pages: int) -> bool: ...
    def alloc(self, n_pages: int) -> list[int]: ...
    def free(self, pages: list[int]) -> None: ...
    def acquire(self, pages: list[int]) -> None: ...
    def num_idle_in(self, pages: list[int]) -> int: ...

    @property
    def num_free(self) -> int: ...

    @property
    def num_total(self) -> int: ...


class WaitingQueue:
    """Requests ready for prefill, kept sorted by (priority?, arrival)."""

    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self._items: list[tuple[tuple[int, int], Request]] = []

    def push(self, req: Request) -> None:
        # NOTE: a retracted request keeps its arrival number, so it goes back ahead of
        # everything that arrived after it (FCFS is preserved across retraction).
        key = req.sort_key(self.by_priority)
        bisect.insort(self._items, (key, req))  # keys are unique: req is never compared

    def remove(self, req: Request) -> bool:
        for i, (_, r) in enumerate(self._items):
            if r is req:
                del self._items[i]
                return True
        return False

    def __iter__(self) -> Iterator[Request]:
        return iter([r for _, r in self._items])

    def __len__(self) -> int:
        return len(self._items)


class NewTokenRatio:
    """Expected share of a request's remaining max_tokens that it will really generate."""

    RETRACT_DECODE_STEPS = 20  # steps of headroom granted after a retraction

    def __init__(self, init: float = 0.7, min_factor: float = 0.14, decay_steps: int = 600):
        self.init = min(init, 1.0)
        self.min = self.init * min_factor
        self.step = (self.init - self.min) / decay_steps
        self.value = self.init

    def decay(self) -> None:
        self.value = max(self.value - self.step, self.min)

    def on_retract(self, running: list[Request]) -> None:
        decoded = sum(len(r.output_ids) for r in running)
        total = sum(r.max_new_tokens for r in running)
        estimate = (decoded + self.RETRACT_DECODE_STEPS * len(running)) / (total + 1)
        self.value = min(1.0, max(estimate, self.value))

    def reserve_tokens(self, req: Request, clip: int) -> int:
        return int(min(req.remaining_tokens, clip) * self.value)


@dataclass(frozen=True)
class Grant:
    """One chunk `PrefillAdder` fitted in this step: `num_tokens` from the request's
    computed end, on `pages` already taken from the pool for it; the first `num_cached`
    of them are cached pages (their positions count as computed). The scheduler appends
    `pages` to the request's block table."""

    num_tokens: int
    pages: list[int]
    num_cached: int = 0


class PrefillAdder:
    """Fills one step's prompt budget: first continuing chunks, then new admissions.

    A chunk never crosses the prompt/output boundary L (the runner takes a chunk either
    from embeddings or from token ids, not both), and one request gets one chunk per step.
    """

    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        token_budget: int,
        headroom_pages: int,
        free_slots: int,
        nothing_scheduled: bool,
    ) -> None:
        self.pool = pool
        self.page_size = page_size
        self.budget = token_budget
        self.headroom = headroom_pages
        self.free_slots = free_slots
        # With nothing holding pages, admit on the prompt alone (ignore the reserve) so a
        # large request can always make progress in an otherwise idle pool.
        self.nothing_scheduled = nothing_scheduled

    def chunk_len(self, req: Request, start: int) -> int:
        """Its next chunk from `start`: to the end of its prompt's arrived rows (a streamed
        prompt), of its prompt, or of its sequence, within the budget (0: nothing to
        compute yet)."""
        end = req.seq_len if start >= req.prompt_len else min(req.prompt_len, req.rows_end)
        return max(min(end - start, self.budget), 0)

    def _grow(self, start: int, held: int, n_tokens: int) -> tuple[int, list[int]]:
        """Allocate pages for `n_tokens` more after `start` on `held` pages; shrink to
        what free pages allow. Returns the tokens granted and the new pages."""
        need = ceil_div(start + n_tokens, self.page_size) - held
        if need > 0 and not self.pool.can_alloc(need):
            n_tokens = min(n_tokens, (held + self.pool.num_free) * self.page_size - start)
            if n_tokens <= 0:
                return 0, []
            need = ceil_div(start + n_tokens, self.page_size) - held
        pages = self.pool.alloc(need) if need > 0 else []
        self.budget -= n_tokens
        return n_tokens, pages

    def add_continuing(self, req: Request) -> Grant | None:
        """Next chunk of an admitted request; None when no budget or no pages are left."""
        if self.budget <= 0:
            return None
        start = req.kv.num_computed_tokens
        n, pages = self._grow(start, len(req.kv.block_table), self.chunk_len(req, start))
        return Grant(n, pages) if n else None

    def try_admit(self, req: Request, reserve_tokens: int, cached: list[int]) -> Grant | None:
        """Admit a waiting request with its first chunk, or return None (caller stops:
        FCFS).

        `cached` are cached pages extending the pages `req` already holds (its pinned
        prefix, if any); on admission it takes them and computes only what follows. An
        idle cached page it takes stops counting as free, so it costs headroom too."""
        if self.budget <= 0 or self.free_slots <= 0:
            return None
        held = len(req.kv.block_table) + len(cached)
        revived = self.pool.num_idle_in(cached)
        if self.nothing_scheduled:
            need = ceil_div(req.seq_len + 1, self.page_size) - held + revived
            fits = need <= self.pool.num_free
        else:
            need = ceil_div(req.seq_len + reserve_tokens, self.page_size) - held + revived
            fits = need <= self.headroom
        if not fits:
            return None
        # NOTE: it holds whole computed pages, but for a handed-off prompt (E/P/D), whose
        # last page is part-filled and which takes no cached pages
        done, table = req.kv.num_computed_tokens, len(req.kv.block_table)
        assert done == table * self.page_size or (
            not cached and ceil_div(done, self.page_size) == table), (done, table, cached)
        self.pool.acquire(cached)
        start = done + len(cached) * self.page_size
        n, pages = self._grow(start, held, self.chunk_len(req, start))
        if n == 0:  # no page for the first chunk after all: give the cached pages back
            self.pool.free(cached)
            return None
        self.headroom -= need
        self.free_slots -= 1
        self.nothing_scheduled = False
        return Grant(n, cached + pages, len(cached))
