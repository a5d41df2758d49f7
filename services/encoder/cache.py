"""Embedding cache: image and video features by cache key, LRU under a byte budget.

An entry holds one image's (or video's) merged features and (Qwen3-VL) its deepstack
features, on the CPU in the model dtype. Invariant: `bytes_used <= capacity` at every moment — an entry
larger than the whole budget is never stored, and room is made by evicting the least
recently used entries before an insert. Hits move an entry to the most-recent end.
Single-threaded: only the event loop touches it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CachedFeatures:
    embeds: torch.Tensor  # [tokens, out_hidden]
    deepstack: tuple[torch.Tensor, ...]  # per deepstack layer [tokens, out_hidden]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embeds, *self.deepstack))


class EmbeddingCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.bytes_used = 0
        self.entries: OrderedDict[str, CachedFeatures] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def get(self, key: str) -> CachedFeatures | None:
        """The entry, counted as a hit (and made most recent), or None counted as a miss."""
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return entry

    def peek(self, key: str) -> CachedFeatures | None:
        """The entry, neither counted nor made most recent (a second look at a key whose
        lookup was counted already)."""
        return self.entries.get(key)

    def put(self, key: str, value: CachedFeatures) -> bool:
        """Store `value`; False when it cannot fit the budget at all (nothing evicted then)."""
        size = value.nbytes
        if size > self.capacity:
            return False
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes_used -= old.nbytes
        while self.bytes_used + size > self.capacity:
            _, victim = self.entries.popitem(last=False)
            self.bytes_used -= victim.nbytes
            self.evictions += 1
        self.entries[key] = value
        self.bytes_used += size
        return True
