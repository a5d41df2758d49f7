"""StagingArea: the encoder's registered memory for outgoing pieces, and the write plan.

`slots` independent slots (one in-flight round each), each laid out so a round of whole
destination blocks maps onto few, large writes:

    embeds [slots, slot_tokens, embed_dim]   dtype  token-major: a token range is contiguous
    fill   [slots, slot_tokens]              int32
    mrope  [slots, 3 * slot_tokens]          int32  per round: [nb, 3, bs] = destination rows
    aux    [slots, max_round_blocks, 16]     int32  one aux row per destination block

A round covers whole destination blocks (bs = the language's block size, <= slot_tokens),
so each block is written exactly once; runs of consecutive destination blocks coalesce
into one write per buffer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tandem.transfer import buffers as B
from tandem.transfer.buffers import BufferLayout, RangeSeal, RangeTag, RowProtection, dtype_name
from tandem.transfer.errors import TransferError, TransferStuck
from tandem.transfer.payload import PromptPayload
from tandem.units import ceil_div


def coalesce(entries: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge (src, dst, len) writes that continue each other on both ends."""
    out: list[list[int]] = []
    for s, d, n in entries:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n])
    return [tuple(e) for e in out]


class StagingArea:
    def __init__(
        self,
        slots: int,
        slot_tokens: int,
        embed_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        max_round_blocks: int = 256,
    ) -> None:
        if slots < 1 or slot_tokens < 1:
            raise ValueError(f"staging needs slots >= 1 and slot_tokens >= 1, got {slots}, {slot_tokens}")
        self.slots, self.slot_tokens, self.embed_dim, self.dtype = slots, slot_tokens, embed_dim, dtype
        self.max_round_blocks = max_round_blocks
        mk = lambda shape, dt: torch.empty(shape, dtype=dt).zero_()  # noqa: E731  (pre-fault)
        self.embeds = mk((slots, slot_tokens, embed_dim), dtype)
        self.fill = mk((slots, slot_tokens), torch.int32)
        self.mrope = mk((slots, 3 * slot_tokens), torch.int32)
        self.aux = mk((slots, max_round_blocks, B.AUX_WIDTH), torch.int32)
        self._free = list(range(slots))
        self.used = [0] * slots  # tokens of each slot written since it was last wiped
        self.retired: set[int] = set()  # slots whose writes never ended
        self._changed = asyncio.Event()
        self._engine = None  # set by register()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def register(self, engine) -> None:
        if self._engine is not None:
            raise RuntimeError("StagingArea is already registered")
        for t in (self.embeds, self.fill, self.mrope, self.aux):
            engine.register(t)
        self._engine = engine

    def unregister(self) -> None:
        """Undo register(); NOTE: required before dropping the tensors, or Mooncake keeps a
        registration over memory that the allocator may hand out again (overlap error)."""
        if self._engine is not None:
            for t in (self.embeds, self.fill, self.mrope, self.aux):
                self._engine.unregister(t)
            self._engine = None

    async def acquire(self) -> int:
        """A free slot; waits while all are busy (callers bound the wait)."""
        while not self._free:
            ev = self._changed
            await ev.wait()
        return self._free.pop()

    def retire(self, slot: int) -> None:
        """Never hand `slot` out again: a write from it never finished (frozen peer). Its
        room has failed, so its data is wiped anyway (a stale write it still feeds is
        fenced by the destination's aux check)."""
        self.retired.add(slot)
        self._wipe(slot)

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.slots:
            raise KeyError(f"release of staging slot {slot} that is not held")
        self._wipe(slot)
        self._free.append(slot)
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    def _wipe(self, slot: int) -> None:
        """Zero what the slot holds of a prompt: staging is registered memory that any
        process reaching this instance's transfer port could read (issue 16, finding 1)."""
        n, self.used[slot] = self.used[slot], 0
        self.embeds[slot][:n].zero_()
        self.fill[slot][:n].zero_()
        self.mrope[slot][: 3 * n].zero_()
        self.aux[slot].zero_()

    def round_tokens(self, block_size: int) -> int:
        return min(self.slot_tokens // block_size, self.max_round_blocks) * block_size

    def stage(
        self,
        slot: int,
        payload: PromptPayload,
        piece: PieceTarget,
        layout: BufferLayout,
        t0: int,
        t1: int,
        at: int = 0,
        seal: RangeSeal | None = None,
    ) -> tuple[tuple[list[int], list[int], list[int]], torch.Tensor]:
        """Copy payload tokens [t0, t1) of `piece` into `slot` at token offset `at`;
        return the writes (srcs, dsts, lengths) into `layout`'s buffers (`writes` gives
        those into any other rank's) and a private copy of the aux rows staged (what the
        range's tags cover, `tag_range`). An encrypting `seal` (the range's keys) puts
        ciphertext in the slot: plaintext never lands in registered memory.

        t0 - piece.start and `at` are multiples of the block size (whole blocks only).
        """
        room, generation, block_ids = piece.room, piece.generation, piece.block_ids
        piece_start, piece_tokens = piece.start, piece.tokens
        bs, d = layout.block_size, self.embed_dim
        n, i0 = t1 - t0, (t0 - piece_start) // bs
        nb = ceil_div(n, bs)
        if at % bs or at + nb * bs > self.slot_tokens or at // bs + nb > self.max_round_blocks:
            raise ValueError(f"staging range at {at} for {n} tokens does not fit the slot")
        self.used[slot] = max(self.used[slot], at + nb * bs)
        e, f = self.embeds[slot][at:], self.fill[slot][at:]
        src_e, src_f = payload.input_embeds[t0:t1], payload.fill_ids[t0:t1]
        src = src_m = payload.mrope_positions[:, t0:t1]
        if seal is not None and seal.cipher:
            seal.encrypt_into(B.PART_EMBEDS, src_e, e[:n])
            seal.encrypt_into(B.PART_FILL, src_f, f[:n])
            src = torch.empty((3, n), dtype=torch.int32)  # private, then laid out below
            for k in range(3):
                seal.encrypt_into(B.PART_MROPE + k, src_m[k], src[k])
        else:
            e[:n].copy_(src_e)
            f[:n].copy_(src_f)
        m = self.mrope[slot][3 * at : 3 * at + nb * 3 * bs].view(nb, 3, bs)
        full = n // bs
        if full:
            m[:full].copy_(src[:, : full * bs].reshape(3, full, bs).permute(1, 0, 2))
        if n % bs:
            m[full, :, : n % bs].copy_(src[:, full * bs :])
        # NOTE: the aux rows are built in private memory (tagged from there), then staged.
        a = torch.zeros((nb, B.AUX_WIDTH), dtype=torch.int32)
        lo, hi = B.room_words(room)
        total = payload.num_tokens
        a[:, B.AUX_TOTAL], a[:, B.AUX_MROPE_DELTA] = total, payload.mrope_delta
        a[:, B.AUX_PIECE_START], a[:, B.AUX_PIECE_TOKENS] = piece_start, piece_tokens
        a[:, B.AUX_BLOCK_INDEX] = torch.arange(i0, i0 + nb, dtype=torch.int32)
        a[:, B.AUX_BLOCK_TOKENS] = torch.clamp(n - torch.arange(nb, dtype=torch.int32) * bs, max=bs)
        a[:, B.AUX_ROOM_LO], a[:, B.AUX_ROOM_HI], a[:, B.AUX_EMBED_DIM] = lo, hi, d
        a[:, B.AUX_GENERATION] = generation
        self.aux[slot][at // bs : at // bs + nb].copy_(a)
        return self.writes(slot, layout, block_ids, i0, n, at), a

    def writes(self, slot: int, layout: BufferLayout, block_ids: list[int], i0: int, n: int,
               at: int) -> tuple[list[int], list[int], list[int]]:
        """The writes (srcs, dsts, lengths) that put the `n` tokens staged at `at` in `slot`
        into blocks `block_ids[i0:]` of the buffers `layout` describes. NOTE: one staging,
        many destinations: each tensor-parallel rank's pool has its own `layout`."""
        bs, d, es = layout.block_size, self.embed_dim, self.embeds.element_size()
        nb = ceil_div(n, bs)
        e, f = self.embeds[slot][at:], self.fill[slot][at:]
        m = self.mrope[slot][3 * at : 3 * at + nb * 3 * bs]
        a = self.aux[slot][at // bs : at // bs + nb]
        plans: list[list[tuple[int, int, int]]] = [[], [], [], []]
        row_e, row_f, row_m, row_a = bs * d * es, bs * 4, 3 * bs * 4, B.AUX_WIDTH * 4
        for k in range(nb):
            b, valid = block_ids[i0 + k], min(bs, n - k * bs)
            plans[0].append((e.data_ptr() + k * row_e, layout.embeddings_addr + b * row_e, valid * d * es))
            plans[1].append((f.data_ptr() + k * row_f, layout.fill_ids_addr + b * row_f, valid * 4))
            plans[2].append((m.data_ptr() + k * row_m, layout.mrope_positions_addr + b * row_m, row_m))
            plans[3].append((a.data_ptr() + k * row_a, layout.aux_addr + b * row_a, row_a))
        srcs, dsts, lens = [], [], []
        for plan in plans:
            for s, dd, ln in coalesce(plan):
                srcs.append(s)
                dsts.append(dd)
                lens.append(ln)
        return srcs, dsts, lens

    def check_layout(self, layout: BufferLayout, payload: PromptPayload) -> str | None:
        """Why this layout cannot take this payload from this staging area, or None."""
        if layout.embed_dim != payload.embed_dim:
            return f"embed_dim mismatch: language buffers {layout.embed_dim}, payload {payload.embed_dim}"
        if layout.dtype != dtype_name(payload.input_embeds.dtype):
            return f"dtype mismatch: language buffers {layout.dtype}, payload {dtype_name(payload.input_embeds.dtype)}"
        if payload.embed_dim != self.embed_dim or payload.input_embeds.dtype != self.dtype:
            return (f"payload [{payload.embed_dim}] {payload.input_embeds.dtype} does not match the "
                    f"staging area [{self.embed_dim}] {self.dtype}")
        if not 1 <= layout.block_size <= self.slot_tokens:
            return f"block_size {layout.block_size} outside [1, staging slot {self.slot_tokens}]"
        if layout.num_blocks < 1:
            return f"num_blocks {layout.num_blocks} < 1"
        return None


def tag_range(seal: RangeSeal, payload: PromptPayload, t0: int, t1: int,
              aux: torch.Tensor) -> RangeTag:
    """The tags of payload tokens [t0, t1), staged with the aux rows `aux`: over the
    payload's own (private, plaintext) rows, never the staging slot (registered memory,
    which another process could change between the copy and the tag)."""
    return seal.tag(payload.input_embeds[t0:t1], payload.fill_ids[t0:t1],
                    payload.mrope_positions[:, t0:t1], aux)


@dataclass(frozen=True)
class PieceTarget:
    """A piece of a room's prompt and where it lands: prompt tokens [start, start + tokens)
    into the blocks `block_ids` (token order; the same ids in every destination: the ranks'
    pools mirror each other), under the reservation `generation` of `room` (AttachInit)."""

    room: int
    generation: int
    block_ids: list[int]
    start: int
    tokens: int


@dataclass(frozen=True)
class Destination:
    """One rank's buffers: where a piece goes (every rank gets every piece)."""

    peer: str  # its transfer session id
    layout: BufferLayout


@dataclass
class WriteRound:
    """One staging round of a room's piece, handed to a writer thread: tokens [t0, t1)
    of the piece `target`, into every destination's buffers (rank 0 first)."""

    engine: Any  # MooncakeEngine
    staging: StagingArea
    dests: list[Destination]
    slot: int  # staging slot this round stages into (held by the caller)
    payload: PromptPayload
    target: PieceTarget
    t0: int
    t1: int
    chunk: int  # tokens per staged chunk
    room_ended: Callable[[], bool]  # true once the room ended: submit nothing more
    on_chunk: Callable[[int, RangeTag | None], object]  # each completed chunk: end, tags
    on_fail: Callable[[TransferError], object]  # the first failure, before draining
    # the attempt's protection (AttachInit.protection): each chunk is one reported range,
    # sealed under keys of its own
    protection: RowProtection = RowProtection()


def write_round(w: WriteRound) -> int:
    """Thread side of one staging round, in chunks of `w.chunk` tokens, each staged once
    then submitted to every destination (one transfer per coalesced region), two deep
    (chunk k+1 is copied while chunk k is on the wire). `on_chunk(end, tags)` runs as each
    chunk has reached every destination (a chunk is one reported range: its tags go with
    its Progress, or the piece's partial Progress or Done); `on_fail` runs at the first
    failure, before the leftovers are drained, so the room ends at once. Stops submitting once the room ended. Returns
    the bytes written (all destinations); raises TransferStuck when writes from the slot
    never ended (the caller must retire it)."""
    engine, room, generation, t0, t1 = w.engine, w.target.room, w.target.generation, w.t0, w.t1
    first, bs = w.dests[0].layout, w.dests[0].layout.block_size
    # (per destination: (peer, started transfers)), bytes, end token, the chunk's tags
    pending: list[tuple[list[tuple[str, list]], int, int, RangeTag | None]] = []
    leftovers: list[tuple[int, int]] = []
    written = 0
    try:
        for c0 in range(t0, t1, w.chunk):
            if w.room_ended():  # the room ended: write nothing more
                raise TransferError(f"room {room}: ended during the write", "ABORTED", room)
            c1 = min(c0 + w.chunk, t1)
            at = c0 - t0
            seal = w.protection.seal(room, generation, c0, c1)
            plan, aux = w.staging.stage(w.slot, w.payload, w.target, first, c0, c1, at=at,
                                        seal=seal)
            plans = [plan]
            i0 = (c0 - w.target.start) // bs
            plans += [w.staging.writes(w.slot, d.layout, w.target.block_ids, i0, c1 - c0, at)
                      for d in w.dests[1:]]
            started_all: list[tuple[str, list]] = []
            try:
                for d, (srcs, dsts, lens) in zip(w.dests, plans, strict=True):
                    started_all.append((d.peer, engine.submit(d.peer, srcs, dsts, lens)))
            except TransferError as e:
                leftovers += e.pending + [t for _, st in started_all for t in st]
                raise
            nbytes = sum(sum(p[2]) for p in plans)
            pending.append((started_all, nbytes, c1, None))  # NOTE: now, for the drain
            if seal is not None:  # tagged while the chunk is on the wire
                pending[-1] = (started_all, nbytes, c1, tag_range(seal, w.payload, c0, c1, aux))
            while len(pending) > 1 or (pending and c1 == t1):
                started_all, n, c_end, c_tag = pending[0]
                for k, (peer, started) in enumerate(started_all):
                    try:
                        engine.wait(peer, started)
                    except TransferError as e:
                        pending.pop(0)
                        leftovers += e.pending + [t for _, st in started_all[k + 1:] for t in st]
                        raise
                pending.pop(0)
                written += n
                w.on_chunk(c_end, c_tag)
    except TransferError as e:
        w.on_fail(e.for_room(room))
        raise
    finally:
        # NOTE: never reuse the slot while a started write may still read from it.
        rest = leftovers + [t for started_all, _, _, _ in pending for _, st in started_all
                            for t in st]
        if rest and not engine.drain(rest):
            raise TransferStuck(f"room {room}: writes from staging slot {w.slot} never "
                                f"finished", "UNAVAILABLE", room)
    return written
