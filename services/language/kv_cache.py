"""Paged KV cache: a page allocator (scheduler side) and the K/V tensors (runner side).

Ownership: the scheduler owns *which* pages a sequence holds — the `Engine` builds one
`KVPagePool(runner.num_pages, runner.page_size)` and hands it to its `Scheduler`, which
builds block tables from `alloc`. The runner owns the memory (`KVCache`: tensors only,
it never hands out pages). So a runner serves one engine at a time: two live pools over
one `KVCache` would give the same page to two sequences.

A page holds `page_size` consecutive tokens of one sequence; token p of a sequence lives
in slot (see `forward_batch.slot_of`)

    block_table[p // page_size] * page_size + p % page_size

Tensor layout, one K and one V tensor per decoder layer:

    k[layer]  [num_pages + 1, page_size, num_kv_heads, head_dim]
               ^^^^^^^^^^^^^
               pages 0 .. num_pages-1 are handed out by the pool;
               page `num_pages` is the DUMMY page: never allocated, padded rows of a
               decode batch point at it so their writes touch no real KV.
"""

from __future__ import annotations

import math

import torch


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


class KVCache:
    """Per-layer K/V tensors for `num_pages` pages (+1 dummy page); no page bookkeeping."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"bad KV cache: num_pages={num_pages}, page_size={page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.dummy_page = num_pages
        shape = (num_pages + 1, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem

    @staticmethod
    def pages_for_memory(
        fraction: float,
        device: torch.device,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """Pages that fit in `fraction` of the device's free memory (CUDA only)."""
        if device.type != "cuda":
            raise ValueError("sizing the KV pool by memory fraction needs CUDA; set kv_pages")
        free, _total = torch.cuda.mem_get_info(device)
        per_page = KVCache.bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype)
        return max(1, math.floor(free * fraction / per_page) - 1)  # -1: the dummy page
