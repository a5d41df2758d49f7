"""The KV page allocator (scheduler side): which of the runner's pages each sequence holds.

The memory itself is the runner's (`runner/kv_cache.py`, which also states the page
layout); the `Engine` builds one pool over `runner.num_pages` pages of `runner.page_size`
tokens and hands it to its `Scheduler` (through the prefix cache).
"""

from __future__ import annotations


class KVPagePool:
    """Free list of KV page ids. Not thread-safe: only the scheduler loop calls it.

    Invariant: every page id is either free (in `_free`) or held by exactly one owner;
    `free()` of a page that is not held raises, so a double free is caught where it happens.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.page_size = page_size
        self._num_total = num_pages
        # Low ids first out (a stack popped from the end): keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._held = bytearray(num_pages)  # 1 where the page is allocated

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_total(self) -> int:
        return self._num_total

    def can_alloc(self, n_pages: int) -> bool:
        return 0 <= n_pages <= len(self._free)

    def alloc(self, n_pages: int) -> list[int]:
        """Take `n_pages` pages; raises MemoryError (and takes nothing) if too few are free."""
        if n_pages < 0:
            raise ValueError(f"n_pages must be >= 0, got {n_pages}")
        if n_pages > len(self._free):
            raise MemoryError(f"KV pool: asked for {n_pages} pages, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n_pages)]
        for p in out:
            self._held[p] = 1
        return out

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool; a page that is not held (double free) raises."""
        # Validate everything first so a bad call frees nothing (no half-applied state).
        seen: set[int] = set()
        for p in pages:
            if not 0 <= p < self._num_total:
                raise ValueError(f"KV pool: page {p} out of range [0, {self._num_total})")
            if not self._held[p] or p in seen:
                raise ValueError(f"KV pool: double free of page {p}")
            seen.add(p)
        for p in pages:
            self._held[p] = 0
            self._free.append(p)
