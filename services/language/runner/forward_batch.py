"""One model step as plain data: the contract between the scheduler and the model runner.

The scheduler decides *what* runs (which requests, which token ranges, which KV pages);
the runner decides *how* (eager or CUDA graph, attention kernel). Neither reaches into
the other's state.

A step mixes prompt chunks and decode tokens:

    chunks = [ prompt chunk of A: tokens [start, start+n) from input_embeds,
               decode token of B: one token id,
               ... ]

Invariants (`ChunkLimits.check`, called by both the eager and the graph path):
- `block_table` covers positions [0, start + n) with pages of `page_size` tokens:
  len(block_table) >= ceil((start + n) / page_size), every page id in [0, num_pages).
  The runner writes this step's K/V into slot `slot_of(block_table, p, page_size)` =
  block_table[p // page_size] * page_size + p % page_size for p in the range.
- A prompt chunk has `input_embeds` [n, embed_dim] (embed_dim = hidden * (1 +
  num_deepstack); the deepstack part is added after the first layers) and no token ids.
  A decode chunk has `token_ids` [n] in [0, vocab) and no embeddings (n == 1 for plain
  decode).
- `positions` is [3, n] MRoPE positions (t, h, w). The scheduler builds them; the runner
  never invents positions:
  - a prompt chunk carries its MRoPE positions straight from the payload
    (`PromptPayload.mrope_positions[:, start:start + n]`);
  - a generated token at sequence index i (i = tokens already in the KV cache) has
    position i + mrope_delta in all three rows (`decode_positions`).

Single-token rows (decode tokens and 1-token prompt chunks) attend through a block table
padded to a common width; `decode_rows` lays those tables out, once for both paths:

    row i < len(chunks): block_tables[i, :ceil((start+1)/page_size)] = its pages,
                         seq_lens[i] = start + 1, slot_mapping[i] = slot of `start`
    padding rows / cols: the dummy page, seq_len 1, the dummy page's first slot
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.units import ceil_div


@dataclass
class SeqChunk:
    """A contiguous range [start, start + n) of one sequence to run this step."""

    seq_id: int
    start: int  # tokens of this sequence already in the KV cache
    positions: torch.Tensor  # [3, n] int64
    block_table: list[int]  # KV page ids, in order, covering [0, start + n)
    input_embeds: torch.Tensor | None = None  # [n, embed_dim] (prompt chunks)
    token_ids: torch.Tensor | None = None  # [n] int64 (decode)
    want_prompt_logits: bool = False  # return logits of every position, not just the last
    # Where the other tensor-parallel ranks hold these prompt rows (the transfer wrote them
    # to every rank): rows [embeds_row, embeds_row + n) of their payload `embeds_key`.
    # None: they do not, and `input_embeds` travels with the step (tp/wire.py).
    embeds_key: int | None = None
    embeds_row: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[1])

    @property
    def is_decode(self) -> bool:
        return self.token_ids is not None


@dataclass
class ForwardBatch:
    """All chunks of one step, in the order their logits come back."""

    chunks: list[SeqChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_pure_decode(self) -> bool:
        """Every chunk is a single decode token: the CUDA-graph runner may serve it."""
        return bool(self.chunks) and all(c.is_decode and c.num_tokens == 1 for c in self.chunks)


@dataclass
class ForwardOutput:
    """Logits of the last position of every chunk, and prompt logits where asked."""

    last_logits: torch.Tensor  # [num_chunks, vocab] float32
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> [n, vocab]


def decode_positions(index: int, mrope_delta: int, n: int = 1) -> torch.Tensor:
    """Positions [3, n] of generated tokens at sequence indices [index, index + n)."""
    pos = torch.arange(index, index + n, dtype=torch.int64) + mrope_delta
    return pos.expand(3, n).contiguous()


def slot_of(block_table, p, page_size: int):
    """Cache slot of token `p`: ints (a list table) or element-wise (tensor table and `p`)."""
    return block_table[p // page_size] * page_size + p % page_size


def chunk_slots(c: SeqChunk, page_size: int) -> torch.Tensor:
    """Slots [n] int64 of the chunk's tokens [start, start + n)."""
    end = c.start + c.num_tokens
    table = torch.tensor(c.block_table[: ceil_div(end, page_size)], dtype=torch.int64)
    return slot_of(table, torch.arange(c.start, end), page_size)


@dataclass
class DecodeRows:
    """Attention inputs of single-token rows (host tensors, int64), padding included."""

    block_tables: torch.Tensor  # [rows, width]
    seq_lens: torch.Tensor  # [rows]
    slot_mapping: torch.Tensor  # [rows]


def decode_rows(
    chunks: list[SeqChunk],
    page_size: int,
    dummy_page: int,
    rows: int | None = None,
    width: int | None = None,
) -> DecodeRows:
    """Tables of single-token `chunks`, padded to `rows` x `width` (default: just enough)."""
    pages = [ceil_div(c.start + 1, page_size) for c in chunks]
    rows = len(chunks) if rows is None else rows
    width = max(pages, default=0) if width is None else width
    tables = torch.full((rows, width), dummy_page, dtype=torch.int64)
    lens = torch.ones(rows, dtype=torch.int64)
    slots = torch.full((rows,), dummy_page * page_size, dtype=torch.int64)
    for i, (c, n) in enumerate(zip(chunks, pages, strict=True)):
        tables[i, :n] = torch.as_tensor(c.block_table[:n])
        lens[i] = c.start + 1
        slots[i] = slot_of(c.block_table, c.start, page_size)
    return DecodeRows(tables, lens, slots)


@dataclass(frozen=True)
class ChunkLimits:
    """What a chunk must fit: the model's vocabulary and input widths, the KV cache's pages."""

    vocab_size: int
    embed_dim: int  # hidden * (1 + num_deepstack)
    hidden_size: int  # embeddings without the deepstack part are accepted too
    num_pages: int
    page_size: int

    def check(self, c: SeqChunk) -> None:
        """Raise ValueError naming the sequence when `c` breaks an invariant above."""
        n = c.num_tokens
        if c.positions.dim() != 2 or c.positions.shape[0] != 3 or n < 1:
            raise ValueError(
                f"seq {c.seq_id}: positions must be [3, n>=1], got {tuple(c.positions.shape)}"
            )
        if (c.input_embeds is None) == (c.token_ids is None):
            raise ValueError(f"seq {c.seq_id}: exactly one of input_embeds / token_ids")
        if c.token_ids is not None:
            if tuple(c.token_ids.shape) != (n,):
                raise ValueError(f"seq {c.seq_id}: token_ids must be [{n}]")
            lo, hi = int(c.token_ids.min()), int(c.token_ids.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"seq {c.seq_id}: token id out of [0, {self.vocab_size})")
        if c.input_embeds is not None:
            shape = tuple(c.input_embeds.shape)
            if shape not in ((n, self.embed_dim), (n, self.hidden_size)):
                raise ValueError(
                    f"seq {c.seq_id}: input_embeds must be [{n}, {self.embed_dim}], got {shape}"
                )
        need = ceil_div(max(c.start + n, 0), self.page_size)
        if c.start < 0 or len(c.block_table) < need:
            raise ValueError(
                f"seq {c.seq_id}: block table has {len(c.block_table)} pages, "
                f"positions [0, {c.start + n}) need {need}"
            )
        bad = [p for p in c.block_table[:need] if not 0 <= p < self.num_pages]
        if bad:
            raise ValueError(f"seq {c.seq_id}: page ids {bad[:4]} out of range")
