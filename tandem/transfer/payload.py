"""The prompt payload: what the encoder produces and the language tier consumes.

Plain data, one per request. The transfer layer moves it block by block; both ends see
this same shape.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ImageSpan:
    """An image's pad tokens in a prompt, tokens [start, start + length), and its identity
    (sha256 hex of its grid and processed patches). A video is one span too: from its first
    pad to its last (for Qwen3-VL its frames' timestamp text between), named by its
    `VideoPlan.cache_key` (its file, sampled frames, size and normalization)."""

    start: int
    length: int
    hash: str


@dataclass
class PromptInfo:
    """What the encoder knows of a prompt before the ViT runs: its token ids (image and
    video pads included) and its images and videos, in prompt order. The language side
    keys its prefix cache with it."""

    token_ids: list[int]
    images: list[ImageSpan] = field(default_factory=list)

    def check(self) -> str:
        """Why the spans do not fit the tokens ("" when they do)."""
        n, end = len(self.token_ids), 0
        for i, im in enumerate(self.images):
            if im.start < end or im.length <= 0 or im.start + im.length > n or not im.hash:
                return f"image {i} spans [{im.start}, {im.start + im.length}) of {n} tokens"
            end = im.start + im.length
        return ""


class RowWatermark:
    """How many leading rows of a payload are final: a streamed prompt (docs/architecture.md, "Streamed
    rows") is handed on before all its rows exist, and this count says how far it may be
    read. It only grows; `rows == total` once every row is in.

    Encoder side: the pipeline raises it as each image's features are spliced in (prompt
    order); the sender writes only rows below it (`reach`, on the event loop). Language
    side: the receiver raises it after each range is copied out and verified; the engine
    thread reads `rows` (one attribute read) and prefills no further. `on_advance` runs on
    the raising thread after each raise (the language side wakes its engine with it).

    NOTE: the rows below the count are written before the count moves (the raise is the
    last thing the writer does), so a reader that sees `rows` sees the rows."""

    def __init__(self, total: int, on_advance: Callable[[], None] | None = None) -> None:
        self.total = total
        self.rows = 0
        self.on_advance = on_advance
        self._lock = threading.Lock()
        self._waiters: list[tuple[int, asyncio.Future]] = []

    @property
    def complete(self) -> bool:
        return self.rows >= self.total

    def advance(self, rows: int) -> None:
        """Rows [0, rows) are final (a smaller count than the current one is a no-op)."""
        if rows > self.total:
            raise ValueError(f"watermark {rows} past the payload's {self.total} rows")
        with self._lock:
            if rows <= self.rows:
                return
            self.rows = rows
            ready = [f for n, f in self._waiters if n <= rows]
            self._waiters = [(n, f) for n, f in self._waiters if n > rows]
        for f in ready:
            f.get_loop().call_soon_threadsafe(_resolve, f)
        if self.on_advance is not None:
            self.on_advance()

    async def reach(self, rows: int) -> None:
        """Return once rows [0, rows) are final."""
        with self._lock:
            if self.rows >= rows:
                return
            f = asyncio.get_running_loop().create_future()
            self._waiters.append((rows, f))
        try:
            await f
        finally:
            with self._lock:
                self._waiters = [(n, g) for n, g in self._waiters if g is not f]


def _resolve(f: asyncio.Future) -> None:
    if not f.done():
        f.set_result(None)


@dataclass
class PromptPayload:
    """A prompt as the language model's input: its rows from token `start` on.

    `start` > 0 when the language side already held tokens [0, start) in its prefix cache
    and the encoder sent only the rest; `info` (the whole prompt's ids and images) is set
    when the encoder announced the prompt (cache-aware transfer), else None.

    A text-only prompt (tokenized by the language tier itself) is the same type without
    embeddings (`input_embeds` None, see `of_token_ids`): its rows are embedded from
    `fill_ids` by the model, at text positions.

    input_embeds    [L, embed_dim]  model dtype; embed_dim = hidden * (1 + num_deepstack):
                    columns [0, hidden) are the input embeddings (text embeddings with
                    image features spliced in at image-pad tokens); for Qwen3-VL, columns
                    [hidden*(k+1), hidden*(k+2)) are deepstack layer k's features at image
                    positions (zeros elsewhere).
    fill_ids        [L]     int32   token ids of the prompt (image pads included).
    mrope_positions [3, L]  int32   MRoPE (temporal, height, width) positions.
    mrope_delta     int             decode position of token i is i + mrope_delta.
    (L rows: tokens [start, start + L) of the prompt.)

    `arrived` (a streamed payload, docs/architecture.md, "Streamed rows"): only rows [0, arrived.rows)
    are final yet; the tensors have every row's place, the rest fill in order. None: every
    row is there. On the language side `mrope_delta` is set once the last row is in (it
    is read only past the prompt).
    """

    input_embeds: torch.Tensor | None
    fill_ids: torch.Tensor
    mrope_positions: torch.Tensor
    mrope_delta: int
    start: int = 0
    info: PromptInfo | None = None
    # The name under which the language instance's other tensor-parallel ranks hold these
    # rows (the encoder wrote the prompt to every rank); None when they do not (rank 0 then
    # ships the rows with each step). Set by the receiver; never crosses a process.
    ranks_key: int | None = None
    arrived: RowWatermark | None = None

    def __post_init__(self) -> None:
        if self.fill_ids.dim() != 1:
            raise ValueError(f"fill_ids must be [L], got {tuple(self.fill_ids.shape)}")
        n = self.fill_ids.shape[0]
        if self.input_embeds is not None and (
                self.input_embeds.dim() != 2 or self.input_embeds.shape[0] != n):
            raise ValueError(f"input_embeds must be [{n}, D], got "
                             f"{tuple(self.input_embeds.shape)}")
        if tuple(self.mrope_positions.shape) != (3, n):
            raise ValueError(
                f"mrope_positions must be [3, {n}], got {tuple(self.mrope_positions.shape)}"
            )

    @classmethod
    def of_token_ids(cls, ids: list[int]) -> PromptPayload:
        """A text-only prompt: ids, text positions (the same on all three MRoPE axes), no
        embeddings and no images."""
        positions = torch.arange(len(ids), dtype=torch.int32).expand(3, -1)
        return cls(None, torch.tensor(ids, dtype=torch.int32), positions, 0,
                   info=PromptInfo(list(ids)))

    @property
    def num_tokens(self) -> int:
        """Rows held (tokens [start, start + num_tokens) of the prompt)."""
        return int(self.fill_ids.shape[0])

    @property
    def end(self) -> int:
        """Length of the whole prompt."""
        return self.start + self.num_tokens

    @property
    def ready_end(self) -> int:
        """End of the prompt's final rows: tokens [0, ready_end) may be read (the whole
        prompt unless it is streamed and still arriving)."""
        return self.start + (self.arrived.rows if self.arrived is not None else self.num_tokens)

    def rows_from(self, start: int) -> PromptPayload:
        """The same prompt holding only tokens [start, end) (views, no copy). NOTE: not for
        a streamed payload (its watermark counts rows from its own start)."""
        if self.arrived is not None:
            raise ValueError("rows_from of a streamed payload")
        k = start - self.start
        if not 0 <= k <= self.num_tokens:
            raise ValueError(f"rows_from({start}) outside [{self.start}, {self.end}]")
        embeds = self.input_embeds[k:] if self.input_embeds is not None else None
        return PromptPayload(embeds, self.fill_ids[k:], self.mrope_positions[:, k:],
                             self.mrope_delta, start, self.info)

    @property
    def embed_dim(self) -> int | None:
        """Width of its embedding rows (None: a text-only prompt)."""
        return int(self.input_embeds.shape[1]) if self.input_embeds is not None else None
