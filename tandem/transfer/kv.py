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
per run of slots whatever the layer count (`KVStaging.reserve` hands out the lowest free
run it can, so a request's slots are usually one run: one descriptor).

The sender (the prefill instance):
    rows = pack(cache, pages)                 # private copy, page-major
    keys = KVKeys.derive(secret, room, generation, n)  # None without protection
    tag = keys.tag(rows)                      # over the private plaintext, never staging
    keys.encrypt_into(rows, out) / out.copy_(rows)   # into its registered send staging
    engine.write(peer, *runs(...))            # one descriptor per run of slots

The receiver (the decode instance), which made `secret` and handed it to the sender over
the authenticated stream (as the embedding rooms do: AttachInit.protection_key):
    rows = staging.take(owner)                # private copy of its slots; slots wiped, freed
    keys.open(rows, tag)                      # decrypt, then verify: DATA_LOSS on any change
    unpack_into(cache, pages, rows)           # only verified rows reach the cache

Invariant: a page of the cache only ever holds rows that were verified in private memory
(`open` before `unpack_into`); a write into a staging slot after `take` reaches nothing.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.poly1305 import Poly1305

from tandem.transfer.buffers import KEY_BYTES, TAG_BYTES, RowProtection, feed_mac, host_bytes
from tandem.transfer.errors import TransferError


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


def pack(cache, pages: list[int]) -> torch.Tensor:
    """A private, page-major copy of `pages` of `cache`: [len(pages), 2 * layers, ...]."""
    layout = KVPageLayout.of_cache(cache)
    idx = torch.tensor(pages, dtype=torch.long, device=cache.k[0].device)
    out = torch.empty((len(pages), *layout.slot_shape), dtype=layout.dtype,
                      device=cache.k[0].device)
    for layer in range(layout.layers):
        torch.index_select(cache.k[layer], 0, idx, out=out[:, 2 * layer])
        torch.index_select(cache.v[layer], 0, idx, out=out[:, 2 * layer + 1])
    return out


def unpack_into(cache, pages: list[int], rows: torch.Tensor) -> None:
    """Write page-major `rows` ([len(pages), 2 * layers, ...], verified) into `pages` of
    `cache`, in order."""
    if rows.shape[0] != len(pages):
        raise ValueError(f"{rows.shape[0]} pages of rows for {len(pages)} pages")
    idx = torch.tensor(pages, dtype=torch.long, device=cache.k[0].device)
    rows = rows.to(cache.k[0].device)
    for layer in range(len(cache.k)):
        cache.k[layer].index_copy_(0, idx, rows[:, 2 * layer])
        cache.v[layer].index_copy_(0, idx, rows[:, 2 * layer + 1])


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

    Invariant: a slot is free or held by exactly one owner; `take` copies an owner's slots
    out, wipes them (registered memory other processes may read) and frees them, so nothing
    of a request stays readable or in use there after its transfer. `reserve` gives the
    lowest run of free consecutive slots that fits (one descriptor on the wire), else the
    lowest free slots (one descriptor per run)."""

    def __init__(self, layout: KVPageLayout, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a KV staging area needs at least one slot, got {slots}")
        self.layout = layout
        self.rows = torch.zeros((slots, *layout.slot_shape), dtype=layout.dtype)
        self._free = bytearray(b"\1" * slots)  # 1 where the slot is free
        self._owned: dict[Hashable, list[int]] = {}

    @property
    def base(self) -> int:
        return self.rows.data_ptr()

    @property
    def num_free(self) -> int:
        return self._free.count(1)

    def register(self, engine) -> None:
        engine.register(self.rows)

    def reserve(self, pages: int, owner: Hashable) -> list[int] | None:
        """Slots for `pages` pages, or None (nothing taken) when too few are free."""
        if pages < 1:
            raise ValueError(f"reserve of {pages} pages for {owner!r}")
        if owner in self._owned:
            raise KeyError(f"owner {owner!r} already holds slots")
        if pages > self.num_free:
            return None
        at = self._free.find(b"\1" * pages)
        got = (list(range(at, at + pages)) if at >= 0
               else [i for i, f in enumerate(self._free) if f][:pages])
        for i in got:
            self._free[i] = 0
        self._owned[owner] = got
        return list(got)

    def held(self, owner: Hashable) -> list[int]:
        return list(self._owned.get(owner, ()))

    def _release(self, owner: Hashable) -> torch.Tensor:
        try:
            held = self._owned.pop(owner)
        except KeyError:
            raise KeyError(f"free of unknown or already freed owner {owner!r}") from None
        for i in held:
            self._free[i] = 1
        return torch.tensor(held, dtype=torch.long)

    def take(self, owner: Hashable) -> torch.Tensor:
        """A private copy of `owner`'s slots (in slot order), which are wiped and freed."""
        idx = self._release(owner)
        out = self.rows.index_select(0, idx)
        self.rows.index_fill_(0, idx, 0)
        return out

    def drop(self, owner: Hashable) -> None:
        """Wipe and free `owner`'s slots unread (a failed or cancelled transfer)."""
        self.rows.index_fill_(0, self._release(owner), 0)


@dataclass(frozen=True)
class KVKeys:
    """The keys of one KV transfer: pages of room `room` under reservation `generation`
    (a retry gets a new generation, so no key is used for two messages)."""

    mac: bytes
    cipher: bytes = b""

    @classmethod
    def derive(cls, protection: RowProtection, room: int, generation: int,
               pages: int) -> KVKeys | None:
        """None when the transfer is unprotected (--transfer.protect none)."""
        if not protection.on:
            return None
        header = struct.pack("<QIq", room, generation, pages)

        def key(label: bytes) -> bytes:
            return hashlib.blake2b(label + header, key=protection.key, digest_size=KEY_BYTES,
                                   person=b"tandem-kv-v1").digest()

        return cls(key(b"mac"), key(b"cipher") if protection.mode == "encrypt" else b"")

    def _cipher(self):
        return Cipher(algorithms.ChaCha20(self.cipher, b"\0" * 16), mode=None).encryptor()

    def tag(self, rows: torch.Tensor) -> bytes:
        """Poly1305 over private plaintext rows."""
        m = Poly1305(self.mac)
        feed_mac(m, rows)
        return m.finalize()

    def sealer(self) -> KVSealer:
        """Stages one transfer's pages in order (`KVSealer.put`): encrypted under
        `encrypt`, as one ChaCha20 stream over the pages in order (never restarted per
        page: a restarted stream would reuse the keystream), else copied."""
        return KVSealer(self._cipher() if self.cipher else None)

    def open(self, rows: torch.Tensor, tag: bytes) -> None:
        """Decrypt (when encrypted) and verify private `rows` in place; DATA_LOSS when
        they do not carry `tag`."""
        if self.cipher:
            buf = host_bytes(rows)
            self._cipher().update_into(buf, buf)
        m = Poly1305(self.mac)
        feed_mac(m, rows)
        try:
            if len(tag) != TAG_BYTES:
                raise InvalidSignature
            m.verify(tag)
        except InvalidSignature:
            raise TransferError("KV pages do not carry the prefill instance's tag (written "
                                "by another process, or changed on the way)",
                                "DATA_LOSS") from None


class KVSealer:
    """One transfer's staging of its pages, in page order (made by `KVKeys.sealer`)."""

    def __init__(self, cipher) -> None:
        self._cipher = cipher

    def put(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """out = rows (the next page), encrypted when the transfer is: `out` is registered
        send staging, so plaintext never lands there under `encrypt`."""
        if self._cipher is not None:
            self._cipher.update_into(host_bytes(rows), host_bytes(out))
        else:
            out.copy_(rows)


@dataclass(frozen=True)
class KVSent:
    """What one `send_pages` did: the tag the receiver must verify (b"" unprotected), and
    the descriptors and bytes it put on the wire."""

    tag: bytes
    descriptors: int
    bytes: int


def send_pages(engine, peer: str, rows: torch.Tensor, keys: KVKeys | None,
               outbox: KVStaging, dst_base: int, dst_slots: list[int]) -> KVSent:
    """Write page-major private `rows` into slots `dst_slots` of the peer's staging area at
    `dst_base`, through this side's registered `outbox` (blocking: an executor thread).
    The tag is taken over `rows` before they are staged, so a change to the outbox by
    another process fails the receiver's check. Raises TransferError (RESOURCE_EXHAUSTED
    when the outbox has too few free slots: retry later)."""
    n = rows.shape[0]
    if n != len(dst_slots):
        raise ValueError(f"{n} pages of rows for {len(dst_slots)} destination slots")
    owner = object()  # NOTE: this call's own slots, freed on every path below
    slots = outbox.reserve(n, owner)
    if slots is None:
        raise TransferError(f"KV outbox: {n} slots asked, {outbox.num_free} free",
                            "RESOURCE_EXHAUSTED")
    try:
        tag = keys.tag(rows) if keys is not None else b""
        sealer = keys.sealer() if keys is not None else KVSealer(None)
        for i, s in enumerate(slots):
            sealer.put(rows[i], outbox.rows[s])
        srcs, dsts, lens = runs(outbox.base, slots, dst_base, dst_slots,
                                outbox.layout.page_bytes)
        engine.write(peer, srcs, dsts, lens)
        return KVSent(tag, len(srcs), sum(lens))
    finally:
        outbox.drop(owner)
