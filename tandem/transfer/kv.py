"""KV pages from one language instance to another (E/P/D, issue 39): the layout on the
wire, the staging on both sides, the keyed tags, and the verified copy into private pages.

The KV cache (services/language/runner/kv_cache.py) is one K and one V tensor per layer,
[pages + 1, page_size, kv_heads, head_dim]. Writing a run of pages straight from one such
cache into another costs 2 x layers descriptors per run of pages, and would leave the
receiving cache registered with Mooncake: writable, for its whole life, by any process
that reaches the instance's transfer port. So neither cache is ever registered. Pages
travel through staging areas laid out *page-major*:

    slot s   [2 * layers, page_size, kv_heads, head_dim]    K of layer 0, V of layer 0,
                                                             K of layer 1, ... (one page)

A run of consecutive slots is one contiguous region, so a transfer costs one descriptor
per run of slots within a chunk (`chunk_plan`), whatever the layer count;
`KVStaging.reserve` hands out the lowest free run that fits, so a request's slots are
usually one run.

The sender (the prefill instance): the tag of each chunk's pages is taken where they lie
in its cache (Poly1305 under keys derived for that chunk, over `tag_order`: private
memory, which no peer can reach and no step writes once computed), ahead, as the prefill
completes them (`KVTagger`: the decode side names the room, hence the keys, before
anything is computed), else in the transfer. `send_pages`, per chunk of pages while the
previous chunk is on the wire: pack them from the cache straight into its registered
outbox (encrypted on the way under `encrypt`: one ChaCha20 stream per chunk, in
`tag_order`, under the chunk's own key, so plaintext never lies there), write (one
descriptor per run of slots), and, once that write ended, report the chunk with its tag
(`KVChunk`); once every write ended and the transfer is reported complete, the outbox
slots are wiped and freed (or each chunk's as the next is on the wire, without
`on_written`).

The receiver (the decode instance), which made the secret and handed it to the sender over
the authenticated stream (as the embedding rooms do: AttachInit.protection_key), per chunk
as it is reported, while later chunks are still on the wire:
    inbox.land(room, cache, pages[c.first:c.first + c.pages], first=c.first, wipe=False)
    KVKeys.derive(secret, room, generation, c.first, c.pages).open_pages(cache, part, c.tag)
and once every chunk passed and the pages may be used, `inbox.sweep(room)` wipes and frees
the slots (beside the pages' first use, not before it; `drop` or `retire` on other paths).

Invariant: no step reads a page landed from the wire before `open_pages` passed on it (a
failed check frees the pages unread); the cache is never registered, so once landed a
page is out of every Mooncake peer's reach, and a write into a staging slot after `land`
reaches nothing. The tag is taken over the sender's private pages (its cache), never over
its outbox, and checked over the receiver's private pages (its cache, after the copy out
of the inbox), so a write into either staging area by another process, at any time, fails
the check. `tag_order` (layer by layer, K then V, the chunk's pages in order) is the one
byte order both tags and the cipher stream follow, whatever the slots and pages: each
side feeds it as runs of consecutive pages (one view per run, not one per page).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.poly1305 import Poly1305

from tandem.transfer.buffers import TAG_BYTES, RowProtection, host_bytes
from tandem.transfer.errors import TransferError, TransferStuck


@dataclass(frozen=True)
class KVPageLayout:
    """The shape of one page on the wire; both instances must agree on it (same model,
    page size and KV dtype; tensor-parallel sizes are a later step: a rank's heads)."""

    layers: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of_cache(cls, cache) -> KVPageLayout:
        _, page_size, kv_heads, head_dim = cache.k[0].shape
        return cls(len(cache.k), page_size, kv_heads, head_dim, cache.k[0].dtype)

    @property
    def slot_shape(self) -> tuple[int, int, int, int]:
        return (2 * self.layers, self.page_size, self.kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        n = 2 * self.layers * self.page_size * self.kv_heads * self.head_dim
        return n * torch.empty((), dtype=self.dtype).element_size()

    def check(self, other: KVPageLayout) -> None:
        if self != other:
            raise TransferError(f"KV page layouts differ: {self} here, {other} there",
                                "FAILED_PRECONDITION")


def _spans(items: list[int]) -> list[tuple[int, int, int]]:
    """(position in `items`, first item, count) of each maximal run of consecutive items."""
    out: list[tuple[int, int, int]] = []
    for i, x in enumerate(items):
        if out and x == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, x, 1))
    return out


def _planes(cache) -> list:
    """K of layer 0, V of layer 0, K of layer 1, ...: each [pages + 1, page bytes of one
    layer] uint8, a numpy view of the cache's own memory (a CPU cache only: a CUDA cache's
    bytes would be a host copy, which decrypting in place would not reach; landing on a
    GPU through a host copy is not built)."""
    if cache.k[0].device.type != "cpu":
        raise ValueError(f"KV pages are checked in a CPU cache, not {cache.k[0].device}")
    return [host_bytes(t).reshape(t.shape[0], -1)
            for layer in zip(cache.k, cache.v, strict=True) for t in layer]


# Pages per view fed to Poly1305 / ChaCha20 at once: pyca holds the GIL while one runs, so
# a view is at most ~1 MiB (~0.2 ms); a view per page instead cost ~30% more (one call each)
_VIEW_BYTES = 1 << 20


def tag_order(cache, pages: list[int]):
    """The bytes of `pages` of `cache` in the order the tag covers and the cipher stream
    runs (layer by layer, K then V, `pages` in order), as numpy views of the cache's own
    memory: a run of consecutive pages is one view (at most `_VIEW_BYTES`), so the byte
    sequence is the same whatever the pages, and a side whose pages are consecutive feeds
    it in 2 x layers calls, not 2 x layers per page."""
    planes = _planes(cache)
    per = max(1, _VIEW_BYTES // planes[0].shape[1])
    parts = [(p0 + j, min(per, n - j)) for _, p0, n in _spans(pages) for j in range(0, n, per)]
    for plane in planes:
        for p0, n in parts:
            yield plane[p0 : p0 + n].reshape(-1)


def pack(cache, pages: list[int], out: torch.Tensor) -> torch.Tensor:
    """Copy `pages` of `cache` page-major into `out` ([>= len(pages), 2 * layers, ...]);
    returns the filled part."""
    idx = torch.tensor(pages, dtype=torch.long, device=cache.k[0].device)
    out = out[: len(pages)]
    for layer in range(len(cache.k)):
        torch.index_select(cache.k[layer], 0, idx, out=out[:, 2 * layer])
        torch.index_select(cache.v[layer], 0, idx, out=out[:, 2 * layer + 1])
    return out


def pack_into_slots(cache, pages: list[int], rows: torch.Tensor, slots: list[int]) -> None:
    """rows[slots[i]] = page pages[i] of `cache`, page-major: one `pack` per run of
    consecutive slots."""
    for i, s0, n in _spans(slots):
        pack(cache, pages[i : i + n], rows[s0 : s0 + n])


def unpack_into(cache, pages: list[int], rows: torch.Tensor) -> None:
    """Write page-major `rows` ([len(pages), 2 * layers, ...]) into `pages` of `cache`, in
    order. NOTE: rows from the wire are checked after, in the cache (`KVStaging.land`).
    A run of consecutive pages is one slice copy per layer (index_copy_ ran ~2x slower
    here); pages scattered over many runs, one index_copy_ per layer."""
    if rows.shape[0] != len(pages):
        raise ValueError(f"{rows.shape[0]} pages of rows for {len(pages)} pages")
    rows = rows.to(cache.k[0].device)
    spans = _spans(pages)
    if 4 * len(spans) > len(pages):
        idx = torch.tensor(pages, dtype=torch.long, device=cache.k[0].device)
        for layer in range(len(cache.k)):
            cache.k[layer].index_copy_(0, idx, rows[:, 2 * layer])
            cache.v[layer].index_copy_(0, idx, rows[:, 2 * layer + 1])
        return
    for layer in range(len(cache.k)):
        for i, p0, n in spans:
            cache.k[layer][p0 : p0 + n].copy_(rows[i : i + n, 2 * layer])
            cache.v[layer][p0 : p0 + n].copy_(rows[i : i + n, 2 * layer + 1])


def runs(src_base: int, src_slots: list[int], dst_base: int, dst_slots: list[int],
         slot_bytes: int) -> tuple[list[int], list[int], list[int]]:
    """The writes (srcs, dsts, lengths) of slot i of a source area to slot i of a
    destination area, one per maximal run where both sides are consecutive."""
    if len(src_slots) != len(dst_slots):
        raise ValueError(f"{len(src_slots)} source slots for {len(dst_slots)} destinations")
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    prev: tuple[int, int] | None = None
    for s, d in zip(src_slots, dst_slots, strict=True):
        if prev is not None and (s, d) == (prev[0] + 1, prev[1] + 1):
            lens[-1] += slot_bytes
        else:
            srcs.append(src_base + s * slot_bytes)
            dsts.append(dst_base + d * slot_bytes)
            lens.append(slot_bytes)
        prev = (s, d)
    return srcs, dsts, lens


class KVStaging:
    """`slots` page-sized slots of registered memory, handed out per owner (a room).

    Invariant: a slot is free, held by exactly one owner, or retired, and a slot comes
    back free only wiped (zeros); `land` copies a part of an owner's slots into cache
    pages, then wipes them (registered memory other processes may read) and frees them, or,
    `wipe=False`, keeps them the owner's as *landed* (never landed again) until `sweep`
    wipes and frees them once the pages they fed are in use (the wipe off the transfer's
    critical path, not skipped); `wipe` wipes and frees a part unread (the sender's, once
    its write ended), `drop` wipes and frees the rest, landed or not, so nothing of a
    request stays readable or in use there after its transfer. Every mode wipes: under `mac` and `none` the slots
    hold the prompt's K/V in the clear; under `encrypt` they hold ciphertext under a key
    used once, which a wipe does not make safer, but one rule for every mode (a slot
    comes back free as zeros, as docs/deploy.md promises of the embedding staging) is
    kept rather than an exception that would save a pass per side under `encrypt` only.
    A transfer that ended before every chunk was reported may still have writes on the
    way (a peer's bytes already sent are written after it died or was cut off): `retire`
    keeps those slots from every owner until a deadline, then wipes and frees them, so a
    late write never lands in another request's slots. `reserve` gives the lowest run of
    free consecutive slots that fits (one descriptor on the wire), else the lowest free
    slots (one descriptor per run)."""

    def __init__(self, layout: KVPageLayout, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a KV staging area needs at least one slot, got {slots}")
        self.layout = layout
        self.rows = torch.zeros((slots, *layout.slot_shape), dtype=layout.dtype)
        self._free = bytearray(b"\1" * slots)  # 1 where the slot is free
        # owner -> {page index in its transfer: slot}, the slots not landed or dropped yet
        self._owned: dict[Hashable, dict[int, int]] = {}
        # owner -> slots landed with `wipe=False`: read by no one any more, not wiped yet
        self._landed: dict[Hashable, list[int]] = {}
        # (time.monotonic() after which they are free, slots): `retire`d transfers' slots
        self._retired: list[tuple[float, list[int]]] = []
        # NOTE: slots change hands on the event loop (reserve, drop, retire) and on
        # executor threads (land): every change of `_free`, `_owned`, `_retired` under it
        self._state = threading.RLock()

    @property
    def base(self) -> int:
        return self.rows.data_ptr()

    @property
    def num_free(self) -> int:
        return self._free.count(1)

    @property
    def num_slots(self) -> int:
        return len(self._free)

    def free_slots(self) -> list[int]:
        """The free slots (each zeros: the invariant)."""
        with self._state:
            return [i for i, f in enumerate(self._free) if f]

    def register(self, engine) -> None:
        engine.register(self.rows)

    def reserve(self, pages: int, owner: Hashable) -> list[int] | None:
        """Slots for `pages` pages, or None (nothing taken) when too few are free."""
        if pages < 1:
            raise ValueError(f"reserve of {pages} pages for {owner!r}")
        with self._state:
            if owner in self._owned or owner in self._landed:
                raise KeyError(f"owner {owner!r} already holds slots")
            self._reclaim()
            if pages > self.num_free:
                return None
            at = self._free.find(b"\1" * pages)
            got = (list(range(at, at + pages)) if at >= 0
                   else [i for i, f in enumerate(self._free) if f][:pages])
            for i in got:
                self._free[i] = 0
            self._owned[owner] = dict(enumerate(got))
            return list(got)

    def held(self, owner: Hashable) -> list[int]:
        """`owner`'s slots not landed yet (a write may still be on the way to them)."""
        with self._state:
            return list(self._owned.get(owner, {}).values())

    def landed(self, owner: Hashable) -> list[int]:
        """`owner`'s slots landed and not wiped yet (`land(wipe=False)`)."""
        with self._state:
            return list(self._landed.get(owner, []))

    def holds(self, owner: Hashable) -> bool:
        """Whether `owner` holds any slot, landed or not (or has a landing under way with
        `wipe=False`): `drop` or `retire` it on every path."""
        with self._state:
            return owner in self._owned or owner in self._landed

    def _take(self, owner: Hashable, first: int, count: int, keep: bool = False
              ) -> list[int]:
        """Slots [first, first + count) of `owner`'s transfer, no longer held (not free
        yet: the caller frees them once done with them, or keeps them landed); the owner
        goes from `_owned` when it holds none."""
        with self._state:
            held = self._owned.get(owner)
            if held is None:
                raise KeyError(f"free of unknown or already freed owner {owner!r}")
            part = range(first, first + count)
            if any(i not in held for i in part):
                raise KeyError(f"{owner!r}: pages [{first}, {first + count}) not all held")
            slots = [held.pop(i) for i in part]
            if not held:
                del self._owned[owner]
            if keep:  # landing with wipe=False: the owner holds them again once copied
                self._landed.setdefault(owner, [])
            return slots

    def _wipe_and_free(self, slots: list[int]) -> None:
        if slots and slots == list(range(slots[0], slots[0] + len(slots))):
            self.rows[slots[0] : slots[0] + len(slots)].zero_()
        elif slots:
            self.rows.index_fill_(0, torch.tensor(slots, dtype=torch.long), 0)
        with self._state:
            for s in slots:
                self._free[s] = 1

    def land(self, owner: Hashable, cache, pages: list[int], first: int = 0,
             wipe: bool = True) -> None:
        """Copy the slots of pages [first, first + len(pages)) of `owner`'s transfer into
        `pages` of `cache`, then wipe and free them (no one else holds them meanwhile);
        `wipe=False`: they stay `owner`'s, landed, until `sweep` (or `drop`) wipes and
        frees them. NOTE: the rows are not checked yet: the caller checks them in the cache
        (`KVKeys.open_pages`) before any step reads those pages, and frees the pages when
        the check fails. A write into the slots after this reaches nothing. Any thread."""
        slots = self._take(owner, first, len(pages), keep=not wipe)
        run = slots == list(range(slots[0], slots[0] + len(slots)))
        try:
            rows = (self.rows[slots[0] : slots[0] + len(slots)] if run
                    else self.rows.index_select(0, torch.tensor(slots, dtype=torch.long)))
            unpack_into(cache, pages, rows)
        except BaseException:  # taken from the owner: no path but this one frees them
            self._wipe_and_free(slots)
            raise
        if not wipe:
            with self._state:
                kept = self._landed.get(owner)
                if kept is not None:
                    kept.extend(slots)
                    return
            # NOTE: dropped, retired or swept while this copied (a cancelled hand-off's
            # release): wiped and freed here, so none is left to no one
        self._wipe_and_free(slots)

    def sweep(self, owner: Hashable) -> int:
        """Wipe and free `owner`'s landed slots (after the pages they fed passed their check
        and may be used: off the transfer's critical path); the number swept, 0 when a
        `drop` or `retire` took them first. Any thread."""
        with self._state:
            slots = self._landed.pop(owner, [])
        self._wipe_and_free(sorted(slots))
        return len(slots)

    def wipe(self, owner: Hashable, first: int, count: int) -> None:
        """Wipe and free the slots of pages [first, first + count) of `owner`'s transfer,
        unread (the sender's slots of a chunk whose write ended). Any thread."""
        self._wipe_and_free(self._take(owner, first, count))

    def drop(self, owner: Hashable) -> None:
        """Wipe and free what `owner` still holds, landed or not (a failed or cancelled
        transfer, the rest after a failed check, or landed slots not swept yet)."""
        with self._state:
            held, landed = self._owned.pop(owner, None), self._landed.pop(owner, None)
        if held is None and landed is None:
            raise KeyError(f"free of unknown or already freed owner {owner!r}")
        self._wipe_and_free(sorted([*(held or {}).values(), *(landed or [])]))

    def retire(self, owner: Hashable, seconds: float) -> None:
        """`owner`'s slots not landed go to no one for `seconds`, then are wiped and freed
        (a transfer that ended with writes possibly still on the way); its landed ones are
        wiped and freed now."""
        with self._state:
            held, landed = self._owned.pop(owner, None), self._landed.pop(owner, None)
            if held is None and landed is None:
                raise KeyError(f"retire of unknown or already freed owner {owner!r}")
            if held:
                self._retired.append((time.monotonic() + seconds, sorted(held.values())))
        # landed slots: their writes ended before they were reported, so none is on the way
        self._wipe_and_free(sorted(landed or []))

    @property
    def num_retired(self) -> int:
        with self._state:
            return sum(len(s) for _, s in self._retired)

    def _reclaim(self) -> None:
        """Retired slots past their deadline: wiped and freed (under `_state`)."""
        now, keep = time.monotonic(), []
        for until, slots in self._retired:
            if until > now:
                keep.append((until, slots))
            else:
                self._wipe_and_free(slots)
        self._retired = keep


@dataclass(frozen=True)
class KVKeys:
    """The keys of one chunk of a KV transfer: pages [first, first + pages) of room
    `room` under reservation `generation` (a retry gets a new generation, so no key is
    used for two messages)."""

    mac: bytes
    cipher: bytes = b""

    @classmethod
    def derive(cls, protection: RowProtection, room: int, generation: int, first: int,
               pages: int) -> KVKeys | None:
        """None when the transfer is unprotected (--transfer.protect none)."""
        if not protection.on:
            return None
        header = struct.pack("<QIqq", room, generation, first, pages)
        mac = protection.derive(b"tandem-kv-v1", b"mac", header)
        if protection.mode != "encrypt":
            return cls(mac)
        return cls(mac, protection.derive(b"tandem-kv-v1", b"cipher", header))

    def _cipher(self):
        return Cipher(algorithms.ChaCha20(self.cipher, b"\0" * 16), mode=None).encryptor()

    def tag(self, cache, pages: list[int]) -> bytes:
        """The tag of `pages` of `cache` (the sender's private pages, in `tag_order`)."""
        m = Poly1305(self.mac)
        for part in tag_order(cache, pages):
            m.update(part)
        return m.finalize()

    def seal_into(self, cache, pages: list[int], rows: torch.Tensor, slots: list[int]
                  ) -> None:
        """rows[slots[i]] = page pages[i] of `cache`, ChaCha20-encrypted straight from the
        cache (plaintext never lands in `rows`, registered send staging): one stream over
        the chunk in `tag_order`, never restarted (a restarted stream would reuse the
        keystream). One call per page and layer: the slots are page-major, the order is
        not."""
        cipher = self._cipher()
        out = host_bytes(rows).reshape(rows.shape[0], len(cache.k) * 2, -1)
        for j, plane in enumerate(_planes(cache)):
            for p, s in zip(pages, slots, strict=True):
                cipher.update_into(plane[p], out[s, j])

    def open_pages(self, cache, pages: list[int], tag: bytes) -> None:
        """Decrypt (when encrypted) and verify `pages` of `cache` in place, in
        `tag_order`; DATA_LOSS when they do not carry `tag` (the caller then frees the
        pages: no step has read them)."""
        cipher = self._cipher() if self.cipher else None
        m = Poly1305(self.mac)
        for part in tag_order(cache, pages):
            if cipher is not None:
                cipher.update_into(part, part)
            m.update(part)
        try:
            if len(tag) != TAG_BYTES:
                raise InvalidSignature
            m.verify(tag)
        except InvalidSignature:
            raise TransferError("KV pages do not carry the prefill instance's tag (written "
                                "by another process, or changed on the way)",
                                "DATA_LOSS") from None


@dataclass(frozen=True)
class KVDestination:
    """Where one transfer's pages go: the peer's transfer session, its inbox's base
    address and the slots reserved there (page order), under the room's reservation
    (`room`, `generation`) and the secret its receiver made (`protection`)."""

    peer: str
    base: int
    slots: list[int]
    room: int
    generation: int
    protection: RowProtection


@dataclass(frozen=True)
class KVChunk:
    """One chunk written: pages [first, first + pages) of the transfer, and its tag (b""
    unprotected). The receiver lands and checks it (`KVStaging.land`,
    `KVKeys.open_pages` under `KVKeys.derive(..., first, pages)`) while later chunks are
    still on the wire."""

    first: int
    pages: int
    tag: bytes


@dataclass(frozen=True)
class KVSent:
    """What one `send_pages` did: its chunks, and the descriptors and bytes it put on the
    wire."""

    chunks: list[KVChunk]
    descriptors: int
    bytes: int


# Pages per staged chunk: chunk k+1 is staged (and tagged, unless `KVTagger` took its tag
# ahead) while chunk k is on the wire, and the receiver lands and checks chunk k meanwhile. 64 pages of a 7B-class model
# (16-token pages) are 56 MiB: a 16K-token prompt goes as ~19 descriptors (`chunk_plan`),
# where per-layer tensors would take 56 per run of pages.
CHUNK_PAGES = 64


def chunk_plan(n: int, chunk_pages: int = CHUNK_PAGES) -> list[tuple[int, int]]:
    """The chunks [first, end) of an `n`-page transfer. The first chunk's staging runs
    before anything is on the wire and the last chunk's landing and check after it, so
    both are short: a long transfer (n >= 3 x chunk_pages) ramps up and down (1/4, 1/2,
    then chunks of at most `chunk_pages` of equal size, then 1/2, 1/4); a short one is
    cut in chunks of `chunk_pages`."""
    if n < 3 * chunk_pages or chunk_pages < 4:
        return [(c0, min(n, c0 + chunk_pages)) for c0 in range(0, n, chunk_pages)]
    head = [chunk_pages // 4, chunk_pages // 2]
    rest = n - 2 * sum(head)
    k = -(-rest // chunk_pages)
    sizes = head + [rest // k + (i < rest % k) for i in range(k)] + head[::-1]
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    return list(zip([0, *ends[:-1]], ends, strict=True))


class KVTagger:
    """The sender's tags of one transfer's chunks, taken ahead, as the prefill completes
    their pages (`progress`, from the engine thread after each step of the prompt), on
    `pool` (a thread beside the engine), instead of in `send_pages` on the transfer's
    critical path. The decode side names the room (its secret, `generation`) before the
    prefill instance computes anything, so each chunk's keys are known from the start.

    Invariant (why a tag taken early is the tag of what is sent): a chunk is tagged once
    every position of its pages is computed (`computed` >= its last token); the runner
    writes K/V only at the positions of a step's chunks (`slot_mapping`, from
    [start, start + tokens)), so such a page is written by no later step while the request
    holds it, and a handed-off request's pages move to its room's hold unchanged
    (`Scheduler._hold_prompt_pages`), written by no step until the decode side closes. A
    retraction frees the pages beyond the pinned prefix and computes them again, maybe
    elsewhere: it changes `epoch` (the request's retraction count), which drops every tag
    taken before, and `get` gives a tag only for exactly the pages it was taken over. If
    this invariant broke anyway, the decode side's check would fail (DATA_LOSS): a tag over
    other bytes than those sent is refused there, never passed.
    """

    def __init__(self, cache, protection: RowProtection, room: int, generation: int,
                 prompt_tokens: int, page_size: int, pool,
                 chunk_pages: int = CHUNK_PAGES) -> None:
        self.cache, self.protection = cache, protection
        self.room, self.generation = room, generation
        self.prompt_tokens, self.page_size, self.pool = prompt_tokens, page_size, pool
        self.plan = chunk_plan(-(-prompt_tokens // page_size), chunk_pages)
        # chunk index -> (its pages, epoch, the future of its tag)
        self._jobs: dict[int, tuple[tuple[int, ...], int, object]] = {}
        self._epoch = 0
        self._lock = threading.Lock()
        self.closed = False

    def matches(self, dest: KVDestination, n: int, chunk_pages: int) -> bool:
        """Whether these tags are for `dest`'s keys and the same chunks."""
        return (self.protection.on and (self.protection, self.room, self.generation)
                == (dest.protection, dest.room, dest.generation)
                and self.plan == chunk_plan(n, chunk_pages))

    def progress(self, pages: list[int], computed: int, epoch: int) -> None:
        """The request's pages (its block table, in order) and how many leading positions
        are computed, after a step: queue the tag of every chunk now complete. Cheap (the
        engine thread): the tags run on `pool`."""
        if not self.protection.on or self.closed:
            return
        with self._lock:
            if epoch != self._epoch:  # retracted: what was tagged may be computed again
                self._epoch = epoch
                for _, _, f in self._jobs.values():
                    f.cancel()
                self._jobs.clear()
            for i, (c0, c1) in enumerate(self.plan):
                if min(c1 * self.page_size, self.prompt_tokens) > computed or c1 > len(pages):
                    break  # chunks complete in order
                if i in self._jobs:
                    continue
                part = tuple(pages[c0:c1])
                keys = KVKeys.derive(self.protection, self.room, self.generation, c0, c1 - c0)
                self._jobs[i] = (part, epoch,
                                 self.pool.submit(keys.tag, self.cache, list(part)))

    def get(self, first: int, end: int, pages: list[int]) -> bytes | None:
        """The tag of chunk [first, end) if it was taken over exactly `pages` (waits for it
        when it is being taken), else None (the sender takes it then)."""
        with self._lock:
            try:
                i = self.plan.index((first, end))
            except ValueError:
                return None
            job = self._jobs.get(i)
        if job is None or job[0] != tuple(pages) or job[1] != self._epoch:
            return None
        try:
            return job[2].result()
        except Exception:  # cancelled, or failed: taken again in the transfer
            return None

    def close(self) -> None:
        """The hand-off ended (sent or failed): tags not started are not taken."""
        with self._lock:
            self.closed = True
            for _, _, f in self._jobs.values():
                f.cancel()


def send_pages(engine, cache, pages: list[int], outbox: KVStaging, dest: KVDestination,
               on_chunk: Callable[[KVChunk], object] | None = None,
               chunk_pages: int = CHUNK_PAGES, tags: KVTagger | None = None,
               on_written: Callable[[KVSent], object] | None = None) -> KVSent:
    """Write `pages` of `cache` into `dest`'s slots through this side's registered
    `outbox`, in chunks (`chunk_plan`) pipelined with the wire (blocking: an executor
    thread); `on_chunk` as each chunk's write completes (in order). Each chunk is tagged in
    `cache` (private; by `tags` ahead, at the prefill, when it has the chunk's tag over
    exactly these pages, else here) and packed (or encrypted) from there into the outbox,
    so a change to the outbox by another process fails the receiver's check.
    The outbox slots are wiped and freed before this returns, on every path: without
    `on_written`, each chunk's once its write ended, while the next one is on the wire;
    with it, all at once after every write ended and `on_written` (the caller's report
    that the transfer is complete: the decode side may then use the pages) returned, so
    the wipe runs beside the decode side's last check and first use, not before them.
    NOTE: `pages` must not change until this returns (a handed-off request's pages: held
    by its room, written by no step); one that did would fail the receiver's check, never
    pass it changed. Raises TransferError
    (RESOURCE_EXHAUSTED when the outbox has too few free slots: retry later;
    TransferStuck when writes never ended: their slots stay held, retired, so nothing
    reuses memory a transfer may still read)."""
    n = len(pages)
    if n != len(dest.slots) or n < 1:
        raise ValueError(f"{n} pages for {len(dest.slots)} destination slots")
    if tags is not None and not tags.matches(dest, n, chunk_pages):
        tags = None
    owner = object()  # NOTE: this call's own slots, freed on every path but a stuck one
    slots = outbox.reserve(n, owner)
    if slots is None:
        raise TransferError(f"KV outbox: {n} slots asked, {outbox.num_free} free",
                            "RESOURCE_EXHAUSTED")
    # NOTE: `in_flight` always lists what was started and is not being waited for, and a
    # failed submit or wait puts its own leftovers in `e.pending`: the two never overlap,
    # so the drain below polls no transfer id twice
    in_flight: list[tuple[int, int]] = []
    chunks: list[KVChunk] = []
    pending: KVChunk | None = None  # written once `in_flight` ends
    descriptors = nbytes = 0
    try:
        for c0, c1 in chunk_plan(n, chunk_pages):
            keys = KVKeys.derive(dest.protection, dest.room, dest.generation, c0, c1 - c0)
            tag = b""
            if keys is None:  # unprotected: nothing to tag
                pack_into_slots(cache, pages[c0:c1], outbox.rows, slots[c0:c1])
            else:  # NOTE: the tag over the cache (private), never over the outbox
                tag = ((tags.get(c0, c1, pages[c0:c1]) if tags is not None else None)
                       or keys.tag(cache, pages[c0:c1]))
                if keys.cipher:
                    keys.seal_into(cache, pages[c0:c1], outbox.rows, slots[c0:c1])
                else:
                    pack_into_slots(cache, pages[c0:c1], outbox.rows, slots[c0:c1])
            srcs, dsts, lens = runs(outbox.base, slots[c0:c1], dest.base,
                                    dest.slots[c0:c1], outbox.layout.page_bytes)
            started = engine.submit(dest.peer, srcs, dsts, lens)
            descriptors, nbytes = descriptors + len(srcs), nbytes + sum(lens)
            waiting, in_flight = in_flight, started
            if waiting:  # the previous chunk, on the wire while this one was staged
                engine.wait(dest.peer, waiting)
                _written(chunks, pending, on_chunk)
                if on_written is None:  # read by no write now
                    outbox.wipe(owner, pending.first, pending.pages)
            pending = KVChunk(c0, c1 - c0, tag)
        waiting, in_flight = in_flight, []
        engine.wait(dest.peer, waiting)
        _written(chunks, pending, on_chunk)
        sent = KVSent(chunks, descriptors, nbytes)
        if on_written is not None:
            on_written(sent)
        return sent
    except TransferError as e:
        if not engine.drain(in_flight + list(getattr(e, "pending", []))):
            for c in chunks:  # their writes ended: wiped and freed (held, with on_written)
                if on_written is not None:
                    outbox.wipe(owner, c.first, c.pages)
            owner = None  # the rest retired: never freed
            raise TransferStuck(f"KV writes to {dest.peer} never finished",
                                "UNAVAILABLE") from e
        raise
    finally:
        if owner is not None and outbox.held(owner):
            outbox.drop(owner)


def _written(chunks: list[KVChunk], chunk: KVChunk | None,
             on_chunk: Callable[[KVChunk], object] | None) -> None:
    if chunk is not None:
        chunks.append(chunk)
        if on_chunk is not None:
            on_chunk(chunk)
