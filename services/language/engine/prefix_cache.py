"""KV pages shared between requests: a prefix cache over whole pages, with reference counts.

Every page of the pool is in exactly one of three states:

    free        in the KVPagePool's free list
    referenced  held by >= 1 request (or a room's pin); `_refs[page]` counts its holders
    idle        held by nobody but cached (it has a key); LRU-ordered in `_idle`, evicted
                (key dropped, page back to the free list) only when an allocation needs it

A page gets a key once all its `page_size` tokens have their K/V written (`insert`); from
then on nobody writes it again, so any request whose sequence starts with the same content
may read it. A key chains the parent page's key with the page's content (`page_keys`), so
one key names the whole prefix up to the end of its page: the same text after a different
image, or the same image at another place, gives other keys from that page on.

Lookups (`match`) stop at the first missing key. Two requests computing the same page at
once both keep their own copy; the second `insert` finds the key taken and its page stays
private (freed, not cached, when released).

Thread-safety: one re-entrant lock guards everything. The scheduler holds it for a whole
schedule/commit (its read-then-allocate sequences must see no concurrent change); the
language server's receiver takes it briefly to pin a room's cached prefix
(`Engine.pin_prefix`). With `enabled=False` it is a plain page allocator: nothing is
ever cached, matched or evicted.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.services.language.engine.kv_pages import KVPagePool
from tandem.transfer.payload import ImageSpan
from tandem.units import ceil_div

PageKey = bytes


def page_keys(
    token_ids: Sequence[int],
    images: Sequence[ImageSpan],
    page_size: int,
    first: int = 0,
    parent: PageKey = b"",
) -> list[PageKey]:
    """Keys of the whole pages `first`, `first + 1`, ... of a sequence.

    Page i's key hashes the parent key (page i-1's, or `parent` for page `first`), the
    page's token ids, and for each image overlapping the page its content hash and where
    it starts relative to the page (so the image's pad tokens are told apart by image and
    by position inside the image). Only pages wholly inside `token_ids` get a key.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    keys: list[PageKey] = []
    for i in range(first, len(ids) // page_size):
        a = i * page_size
        b = a + page_size
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(ids[a:b].tobytes())
        for im in images:
            if im.start < b and im.start + im.length > a:
                h.update(f"|{im.hash}@{im.start - a}".encode())
        parent = h.digest()
        keys.append(parent)
    return keys


def namespace_root(cache_salt: str) -> PageKey:
    """The parent of a sequence's first page in the cache namespace `cache_salt` (the
    router's, hex): b"" for the shared namespace, so keys there are what they always were."""
    if not cache_salt:
        return b""
    return hashlib.blake2b(b"namespace|" + cache_salt.encode(), digest_size=16).digest()


def shareable_pages(num_tokens: int, page_size: int) -> int:
    """Whole pages a sequence of `num_tokens` may take from the cache: all of them but the
    one holding its last token, which must be computed (its logits give the next token)."""
    return max((num_tokens - 1) // page_size, 0)


@dataclass
class CacheStats:
    """Counters since start (read by the engine for its metrics)."""

    query_tokens: int = 0  # tokens looked up (whole pages offered to match)
    hit_tokens: int = 0  # tokens found cached
    evictions: int = 0  # idle cached pages given back to the free list


class PrefixCache:
    """The scheduler's page source (the `PagePool` protocol) plus the prefix cache."""

    def __init__(self, pool: KVPagePool, enabled: bool = True) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.enabled = enabled
        self.lock = threading.RLock()
        self._refs = [0] * pool.num_total
        self._page: dict[PageKey, int] = {}  # key -> page
        self._key: dict[int, PageKey] = {}  # page -> key (cached pages only)
        self._idle: OrderedDict[int, None] = OrderedDict()  # idle cached pages, LRU first
        self._pins: dict[int, list[int]] = {}  # room -> pages pinned for its prompt
        self.stats = CacheStats()

    # ---- the PagePool protocol: idle cached pages count as free ---------------------------

    @property
    def num_total(self) -> int:
        return self.pool.num_total

    @property
    def num_free(self) -> int:
        return self.pool.num_free + len(self._idle)

    @property
    def num_cached(self) -> int:
        """Pages with a key (idle or referenced)."""
        return len(self._key)

    def can_alloc(self, n_pages: int) -> bool:
        return 0 <= n_pages <= self.num_free

    def alloc(self, n_pages: int) -> list[int]:
        """Fresh pages (referenced once), evicting least recently used idle pages as needed;
        raises MemoryError (and takes nothing) when free + idle pages are too few."""
        with self.lock:
            if n_pages > self.num_free:
                raise MemoryError(f"KV pool: asked for {n_pages} pages, {self.num_free} free")
            while self.pool.num_free < n_pages:
                self._evict_one()
            pages = self.pool.alloc(n_pages)
            for p in pages:
                self._refs[p] = 1
            return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page. A page nobody holds goes idle if cached (the
        last pages first, so a sequence's tail is evicted before its head), else free."""
        with self.lock:
            for p in pages:
                if self._refs[p] <= 0:
                    raise ValueError(f"KV pool: page {p} released but not held")
            uncached = []
            for p in reversed(pages):
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    if p in self._key:
                        self._idle[p] = None
                    else:
                        uncached.append(p)
            self.pool.free(uncached)

    # ---- the cache ---------------------------------------------------------------------

    def match(self, keys: Sequence[PageKey]) -> list[int]:
        """Pages holding `keys[0], keys[1], ...` until the first miss; takes no reference."""
        if not self.enabled:
            return []
        with self.lock:
            out = []
            for k in keys:
                p = self._page.get(k)
                if p is None:
                    break
                out.append(p)
            return out

    def count_query(self, query_pages: int, hit_pages: int) -> None:
        self.stats.query_tokens += query_pages * self.page_size
        self.stats.hit_tokens += hit_pages * self.page_size

    def num_idle_in(self, pages: Sequence[int]) -> int:
        """How many of `pages` are idle (acquiring them takes them out of `num_free`)."""
        return sum(1 for p in pages if p in self._idle)

    def acquire(self, pages: Sequence[int]) -> None:
        """Take one more reference to each (cached) page."""
        with self.lock:
            for p in pages:
                if p not in self._key:
                    raise ValueError(f"KV pool: page {p} is not cached")
                self._idle.pop(p, None)
                self._refs[p] += 1

    def insert(self, page: int, key: PageKey) -> bool:
        """Give a full, referenced page its key; False when the key (or page) has one."""
        if not self.enabled:
            return False
        with self.lock:
            if self._refs[page] <= 0:
                raise ValueError(f"KV pool: page {page} inserted but not held")
            if key in self._page or page in self._key:
                return False
            self._page[key] = page
            self._key[page] = key
            return True

    # ---- pins: a room's cached prefix, held while the rest of its prompt is on its way ---

    def pin(self, room: int, token_ids: Sequence[int], images: Sequence[ImageSpan],
            cache_salt: str = "") -> int:
        """Reference the cached pages that start this prompt in namespace `cache_salt` for
        `room` (replacing an earlier pin of it) and return how many leading tokens they
        hold (at most up to the page before the last token, which must be computed for its
        logits)."""
        P = self.page_size
        limit = shareable_pages(len(token_ids), P)
        keys = page_keys(token_ids[: limit * P], images, P, parent=namespace_root(cache_salt))
        with self.lock:
            self.unpin(room)
            pages = self.match(keys)
            self.acquire(pages)
            self._pins[room] = pages
        return len(pages) * P

    def reserve(self, room: int, n_pages: int) -> list[int] | None:
        """E/P/D, a decode instance: `n_pages` fresh pages held for `room` (as its pin)
        while its KV is on the way from the prefill instance; None (nothing taken) when too
        few are free. Taken by `take_pin` (all of them) or released by `unpin`."""
        with self.lock:
            if room in self._pins:
                raise ValueError(f"room {room} already holds pages")
            if not self.can_alloc(n_pages):
                return None
            pages = self._pins[room] = self.alloc(n_pages)
            return list(pages)

    def hold(self, room: int, pages: list[int]) -> None:
        """E/P/D, a prefill instance: a handed-off request's referenced prompt pages, now
        held by `room` (its references move, none is taken) until `unpin(room)`, once the
        decode instance has them."""
        with self.lock:
            if room in self._pins:
                raise ValueError(f"room {room} already holds pages")
            self._pins[room] = list(pages)

    def held(self, room: int) -> list[int]:
        """The pages `room` holds (a copy)."""
        with self.lock:
            return list(self._pins.get(room, []))

    @property
    def num_pinned_for_rooms(self) -> int:
        """Pages rooms hold for prompts still in transfer (they return or move to a request
        within the transfer's timeout)."""
        return sum(len(p) for p in self._pins.values())

    def unpin(self, room: int) -> None:
        """Release `room`'s pin, if it still has one (no-op once taken)."""
        with self.lock:
            pages = self._pins.pop(room, None)
            if pages:
                self.free(pages)

    def take_pin(self, room: int, tokens: int) -> list[int]:
        """The pages pinned for `room`, now the caller's; they must hold exactly `tokens`
        (the prompt's first row; pages reserved for a KV transfer hold the page-rounded-up
        tokens) or the pin is released and ValueError raised."""
        with self.lock:
            pages = self._pins.pop(room, [])
            if len(pages) != ceil_div(tokens, self.page_size):
                self.free(pages)
                raise ValueError(f"its prompt starts at token {tokens} but {len(pages)} "
                                 f"cached pages are pinned")
            return pages

    def _evict_one(self) -> None:
        page, _ = self._idle.popitem(last=False)
        del self._page[self._key.pop(page)]
        self.pool.free([page])
        self.stats.evictions += 1

    def check(self) -> None:
        """Assert the invariant (tests): every page is free, idle, or referenced, once."""
        with self.lock:
            free = set(self.pool._free)  # noqa: SLF001  (a test-only look inside)
            for p in range(self.num_total):
                states = [p in free, p in self._idle, self._refs[p] > 0]
                assert sum(states) == 1, f"page {p}: free/idle/referenced = {states}"
                assert (p in self._idle) <= (p in self._key), f"idle page {p} has no key"
                assert self._refs[p] >= 0
            assert all(self._page[k] == p for p, k in self._key.items())
