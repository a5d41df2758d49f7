"""BlockAllocator: a fixed pool of fixed-size blocks handed out per owner (a room).

An owner gets every block it asks for or none; blocks need not be contiguous. Freeing an
owner that holds nothing is an error (a double free or a bookkeeping bug), never silent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

from tandem.units import ceil_div


class BlockAllocator:
    """`can_alloc(n_tokens)` / `alloc(n_tokens, owner)` / `free(owner)` over `num_total` blocks.

    Invariant: every block id is either in the free deque or in exactly one owner's list,
    so `num_free + sum(len(held)) == num_total` at all times.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self._total = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._owned: dict[Hashable, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_total(self) -> int:
        return self._total

    @property
    def owners(self) -> list[Hashable]:
        return list(self._owned)

    def can_alloc(self, n_tokens: int) -> bool:
        return 0 < n_tokens and ceil_div(n_tokens, self.block_size) <= len(self._free)

    def alloc(self, n_tokens: int, owner: Hashable) -> list[int] | None:
        """Blocks for `n_tokens` in token order, or None when the pool cannot cover them."""
        if n_tokens <= 0:
            raise ValueError(f"alloc of {n_tokens} tokens for {owner!r}")
        if owner in self._owned:
            raise KeyError(f"owner {owner!r} already holds {len(self._owned[owner])} blocks")
        need = ceil_div(n_tokens, self.block_size)
        if need > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(need)]
        self._owned[owner] = blocks
        return blocks

    def held(self, owner: Hashable) -> list[int]:
        return list(self._owned.get(owner, ()))

    def free(self, owner: Hashable) -> int:
        """Return `owner`'s blocks to the pool; KeyError if it holds none (double free)."""
        try:
            blocks = self._owned.pop(owner)
        except KeyError:
            raise KeyError(f"free of unknown or already freed owner {owner!r}") from None
        self._free.extend(blocks)
        return len(blocks)
