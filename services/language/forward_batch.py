"""One model step as plain data: the contract between the scheduler and the model runner.

The scheduler decides *what* runs (which requests, which token ranges, which KV pages);
the runner decides *how* (eager or CUDA graph, attention kernel). Neither reaches into
the other's state.

A step mixes prompt chunks and decode tokens:

    chunks = [ prompt chunk of A: tokens [start, start+n) from input_embeds,
               decode token of B: one token id,
               ... ]

Invariants (checked by the runner):
- `block_table` covers positions [0, start + n) with pages of `page_size` tokens:
  len(block_table) >= ceil((start + n) / page_size). The runner writes this step's K/V
  into slots block_table[p // page_size] * page_size + p % page_size for p in the range.
- A prompt chunk has `input_embeds` [n, embed_dim] (embed_dim = hidden * (1 +
  num_deepstack); the deepstack part is added after the first layers) and no token ids.
  A decode chunk has `token_ids` [n] and no embeddings (n == 1 for plain decode).
- `positions` is [3, n] MRoPE positions (t, h, w); for text-only ranges the three rows
  are equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    def is_pure_decode(self) -> bool:
        """Every chunk is a single decode token: the CUDA-graph runner may serve it."""
        return bool(self.chunks) and all(c.is_decode and c.num_tokens == 1 for c in self.chunks)


@dataclass
class ForwardOutput:
    """Logits of the last position of every chunk, and prompt logits where asked."""

    last_logits: torch.Tensor  # [num_chunks, vocab] float32
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> [n, vocab]
