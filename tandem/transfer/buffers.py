"""EmbeddingBuffers: the language side's block-allocated, once-registered prompt buffers.

One row per block; block b of each buffer starts at `base + b * row_bytes`:

    embeddings      [num_blocks, block_size * embed_dim]  model dtype  token-major rows
    fill_ids        [num_blocks, block_size]              int32
    mrope_positions [num_blocks, 3 * block_size]          int32  row = t[bs] | h[bs] | w[bs]
    aux             [num_blocks, 16]                      int32  see AUX_* below

A request's blocks need not be contiguous; token i of a piece lives in block ids[i // bs]
at slot i % bs. Every block written carries an aux row naming its room, the generation of
the room's reservation (one per Attach attempt) and its piece, so a gather can prove each
block holds this attempt's data: a stale write (an encoder frozen mid-write that wakes after
its room moved to another encoder, or ended) or a misdirected one fails the room with
DATA_LOSS instead of feeding another request's, or another attempt's, data to the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.devices import DTYPES
from tandem.transfer.errors import TransferError
from tandem.units import ceil_div
from tandem.v1 import encoder_pb2

AUX_WIDTH = 16
AUX_TOTAL = 0  # tokens of the whole prompt
AUX_MROPE_DELTA = 1  # decode position of token i is i + delta
AUX_PIECE_START = 2  # first token of the piece this block belongs to
AUX_PIECE_TOKENS = 3  # tokens of that piece
AUX_BLOCK_INDEX = 4  # index of this block within the piece
AUX_BLOCK_TOKENS = 5  # valid tokens in this block
AUX_ROOM_LO = 6  # room id, low 32 bits (int32 bit pattern)
AUX_ROOM_HI = 7  # room id, high 32 bits
AUX_EMBED_DIM = 8  # embedding width the writer used
AUX_GENERATION = 9  # the reservation's generation (AttachInit.generation: attempt + 1)
# aux[10:16] reserved, written as 0.


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def room_words(room: int) -> tuple[int, int]:
    """The room id as two int32 bit patterns (low, high)."""
    lo, hi = room & 0xFFFFFFFF, (room >> 32) & 0xFFFFFFFF
    as_i32 = lambda v: v - (1 << 32) if v >= (1 << 31) else v  # noqa: E731
    return as_i32(lo), as_i32(hi)


@dataclass(frozen=True)
class BufferLayout:
    """Plain-data mirror of the `BufferLayout` proto."""

    block_size: int
    embed_dim: int
    dtype: str
    embeddings_addr: int
    fill_ids_addr: int
    mrope_positions_addr: int
    aux_addr: int
    num_blocks: int

    def to_proto(self) -> encoder_pb2.BufferLayout:
        return encoder_pb2.BufferLayout(**self.__dict__)

    @classmethod
    def from_proto(cls, p: encoder_pb2.BufferLayout) -> BufferLayout:
        return cls(**{f: getattr(p, f) for f in cls.__dataclass_fields__})

    @property
    def elem_size(self) -> int:
        if self.dtype not in DTYPES:
            raise TransferError(f"unknown dtype {self.dtype!r}", "INVALID_ARGUMENT")
        return DTYPES[self.dtype].itemsize

    @property
    def embed_row_bytes(self) -> int:
        return self.block_size * self.embed_dim * self.elem_size

    def check_destination(self, room: int, ids: list[int], allocated: int) -> None:
        """Raise INVALID_ARGUMENT unless `ids` are distinct blocks of this pool that hold
        the `allocated` tokens a peer says it reserved for `room`."""
        bs = self.block_size
        if allocated <= 0 or not ids or allocated > len(ids) * bs:
            raise TransferError(f"room {room}: {allocated} tokens reserved in {len(ids)} blocks "
                                f"of {bs}", "INVALID_ARGUMENT")
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad or len(set(ids)) != len(ids):
            raise TransferError(f"room {room}: bad destination block ids {bad or 'duplicates'} "
                                f"(pool of {self.num_blocks})", "INVALID_ARGUMENT")


class EmbeddingBuffers:
    """The four per-block tensors, allocated (and pre-faulted) once; register them once."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        embed_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
    ) -> None:
        if dtype_name(dtype) not in DTYPES:
            raise ValueError(f"unsupported embedding dtype {dtype}")
        self.num_blocks, self.block_size, self.embed_dim, self.dtype = (
            num_blocks, block_size, embed_dim, dtype,
        )
        # NOTE: zero_() touches every page now; Mooncake writes into untouched pages run
        # several times slower (page faults on the receiving side).
        mk = lambda shape, dt: torch.empty(shape, dtype=dt, device=device).zero_()  # noqa: E731
        self.embeddings = mk((num_blocks, block_size * embed_dim), dtype)
        self.fill_ids = mk((num_blocks, block_size), torch.int32)
        self.mrope_positions = mk((num_blocks, 3 * block_size), torch.int32)
        self.aux = mk((num_blocks, AUX_WIDTH), torch.int32)
        self._engine = None  # set by register()

    def tensors(self) -> list[torch.Tensor]:
        return [self.embeddings, self.fill_ids, self.mrope_positions, self.aux]

    def clear(self, block_ids: list[int]) -> None:
        """Zero the blocks' rows in all four buffers. NOTE: called as a room lets its
        blocks go, so a prompt's tokens and embeddings do not stay readable in registered
        memory (another Mooncake peer can read registered memory) after its room ended."""
        if block_ids:
            idx = torch.tensor(block_ids, dtype=torch.long, device=self.embeddings.device)
            for t in self.tensors():
                t.index_fill_(0, idx, 0)

    def register(self, engine) -> None:
        """Register the four buffers with `engine` (a MooncakeEngine); once per instance."""
        if self._engine is not None:
            raise RuntimeError("EmbeddingBuffers are already registered")
        for t in self.tensors():
            engine.register(t)
        self._engine = engine

    def unregister(self) -> None:
        """Undo register(); NOTE: required before dropping the tensors, or Mooncake keeps a
        registration over memory that the allocator may hand out again (overlap error)."""
        if self._engine is not None:
            for t in self.tensors():
                self._engine.unregister(t)
            self._engine = None

    def layout(self) -> BufferLayout:
        return BufferLayout(
            block_size=self.block_size,
            embed_dim=self.embed_dim,
            dtype=dtype_name(self.dtype),
            embeddings_addr=self.embeddings.data_ptr(),
            fill_ids_addr=self.fill_ids.data_ptr(),
            mrope_positions_addr=self.mrope_positions.data_ptr(),
            aux_addr=self.aux.data_ptr(),
            num_blocks=self.num_blocks,
        )

    def check_piece(
        self, block_ids: list[int], room: int, generation: int, total: int, start: int,
        piece_tokens: int, n_tokens: int, first_index: int = 0,
    ) -> None:
        """Raise DATA_LOSS unless the blocks holding `n_tokens` tokens (from block
        `first_index` of the piece starting at token `start`) carry this piece's aux row."""
        nb = ceil_div(n_tokens, self.block_size)
        aux = self.aux[torch.tensor(block_ids[:nb], dtype=torch.long)]
        lo, hi = room_words(room)
        for i, row in enumerate(aux.tolist()):
            want = {AUX_TOTAL: total, AUX_PIECE_START: start, AUX_PIECE_TOKENS: piece_tokens,
                    AUX_BLOCK_INDEX: first_index + i, AUX_ROOM_LO: lo, AUX_ROOM_HI: hi,
                    AUX_EMBED_DIM: self.embed_dim, AUX_GENERATION: generation}
            bad = {k: row[k] for k, v in want.items() if row[k] != v}
            if bad:
                raise TransferError(
                    f"room {room}: block {block_ids[i]} (piece at token {start}, index "
                    f"{first_index + i}) does not hold this piece's data: aux mismatch {bad} "
                    f"(stale or misdirected write)", "DATA_LOSS")

    def gather_into(
        self,
        block_ids: list[int],
        n_tokens: int,
        out_embeds: torch.Tensor,
        out_fill: torch.Tensor | None,
        out_mrope: torch.Tensor | None,
        start: int,
    ) -> None:
        """Copy `n_tokens` tokens out of `block_ids` (token order) into out[start:start+n]
        (fill ids and positions only where an output for them is given)."""
        bs, d = self.block_size, self.embed_dim
        nb = ceil_div(n_tokens, bs)
        ids = block_ids[:nb]
        i = 0
        while i < nb:  # runs of consecutive block ids are one copy each
            j = i + 1
            while j < nb and ids[j] == ids[j - 1] + 1:
                j += 1
            t0, t1 = i * bs, min(j * bs, n_tokens)
            n, b0, b1 = t1 - t0, ids[i], ids[i] + (j - i)
            a = start + t0
            out_embeds[a : a + n].copy_(self.embeddings[b0:b1].view(-1, d)[:n])
            if out_fill is not None:
                out_fill[a : a + n].copy_(self.fill_ids[b0:b1].reshape(-1)[:n])
            if out_mrope is not None:
                rows = self.mrope_positions[b0:b1].view(j - i, 3, bs).permute(1, 0, 2)
                out_mrope[:, a : a + n].copy_(rows.reshape(3, -1)[:, :n])
            i = j
