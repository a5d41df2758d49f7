"""The paged KV cache's memory: per-layer K/V tensors (runner side; no page bookkeeping).

Ownership: the scheduler owns *which* pages a sequence holds (`engine/kv_pages.py`,
`KVPagePool(runner.num_pages, runner.page_size)`, built by the `Engine` and handed to its
`Scheduler`, which builds block tables from `alloc`). The runner owns the memory
(`KVCache`: tensors only, it never hands out pages). So a runner serves one engine at a
time: two live pools over one `KVCache` would give the same page to two sequences.

A page holds `page_size` consecutive tokens of one sequence; token p of a sequence lives
in slot (see `forward_batch.slot_of`)

    block_table[p // page_size] * page_size + p % page_size

How many pages: `kv_pages`, or on CUDA as many as the memory left holds, sized after
everything else on the device (`kv_sizing.py`).

Tensor layout, one K and one V tensor per decoder layer:

    k[layer]  [num_pages + 1, page_size, num_kv_heads, head_dim]
               ^^^^^^^^^^^^^
               pages 0 .. num_pages-1 are handed out by the pool;
               page `num_pages` is the DUMMY page: never allocated, padded rows of a
               decode batch point at it so their writes touch no real KV.
"""

from __future__ import annotations

import torch


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
