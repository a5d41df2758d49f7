"""Text embeddings + image and video features -> the prompt payload (embeddings, ids, MRoPE
positions).

Layout of `input_embeds` ([L, hidden * (1 + num_deepstack)]):

    columns  [0, H)          text embeddings, image/video features at their pad tokens
             [H, 2H)         deepstack layer 0 features at image/video pads, zeros elsewhere
             ...             (Qwen3-VL only; Qwen2.5-VL has width H)

MRoPE positions follow transformers' `get_rope_index`: text runs count up by one; an image
(or a video) of grid (t, h, w) patches covers (t, h/m, w/m) tokens placed at
(start + t_i * interval, start + h_i, start + w_i); the next run starts at
start + max(h, w) / m. The interval is 1, except for a Qwen2.5-VL video:
tokens_per_second * second_per_grid_t (float32, truncated). Qwen3-VL writes each temporal
group of a video as a run of its own between timestamp texts: each is a (1, h, w) grid.

The delta puts decode token i at position i + delta, one past the prompt's last token
(the last position + 1 - L): where transformers' generate() continues the positions, and
where `get_rope_index` puts text that follows in a longer prompt, so a reply's KV pages are
the next turn's prefix. NOTE: `get_rope_index`'s own delta is max(position) + 1 - L; the
two differ only where a Qwen2.5-VL video's scaled time axis reaches past the text after it
(the prompt always ends with text: the generation prompt, or a message's text).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import torch

from tandem.services.encoder.cache import CachedFeatures
from tandem.transfer.payload import PromptPayload, RowWatermark


class MediaKind(enum.IntEnum):
    """A pad token's kind: transformers' `mm_token_type_ids` values."""

    IMAGE = 1
    VIDEO = 2


@dataclass(frozen=True)
class VisionGrid:
    """One image's or video's place in the MRoPE layout: its kind, its grid (t, h, w) in
    patches, and for a Qwen2.5-VL video the seconds per temporal patch (the processor's
    `second_per_grid_ts` entry)."""

    kind: MediaKind
    grid: tuple[int, int, int]
    second_per_grid_t: float = 1.0

    def num_tokens(self, merge: int) -> int:
        t, h, w = self.grid
        return t * h * w // (merge * merge)


@dataclass(frozen=True)
class RopeRule:
    """How an architecture lays videos out. `timestamps`: Qwen3-VL (its temporal groups are
    runs of their own); otherwise Qwen2.5-VL's time axis, scaled by `tokens_per_second`."""

    merge: int
    timestamps: bool = False
    tokens_per_second: int = 1


def _runs(items: list[VisionGrid], rule: RopeRule) -> list[VisionGrid]:
    """Each run of pad tokens the prompt holds, in order."""
    out: list[VisionGrid] = []
    for it in items:
        t, h, w = it.grid
        if it.kind is MediaKind.VIDEO and rule.timestamps:
            out += [VisionGrid(it.kind, (1, h, w))] * t
        else:
            out.append(it)
    return out


def _interval(run: VisionGrid, rule: RopeRule) -> torch.Tensor | int:
    """The temporal position step of a run's patches."""
    if run.kind is MediaKind.VIDEO and not rule.timestamps:
        # NOTE: float32, as transformers multiplies the processor's float32 tensor.
        return rule.tokens_per_second * torch.tensor(run.second_per_grid_t, dtype=torch.float32)
    return 1


def rope_index(
    mm_token_type_ids: torch.Tensor, items: list[VisionGrid], rule: RopeRule
) -> tuple[torch.Tensor, int]:
    """MRoPE positions [3, L] (int64) and the position delta of one prompt."""
    types = mm_token_type_ids.tolist()
    n, merge = len(types), rule.merge
    pieces, cur, runs = [], 0, iter(_runs(items, rule))
    for kind, group in itertools.groupby(types):
        length = sum(1 for _ in group)
        if kind == 0:
            pieces.append(torch.arange(length).view(1, -1).expand(3, -1) + cur)
            cur += length
            continue
        run = next(runs, None)
        if run is None or run.kind != kind:
            raise ValueError(f"a run of token type {kind} where the media give "
                             f"{run.kind if run else 'none'}")
        t, h, w = run.grid
        gt, gh, gw = t, h // merge, w // merge
        if gt * gh * gw != length:
            raise ValueError(f"a run of {length} pad tokens does not match grid {(t, h, w)}")
        tt, hh, ww = torch.meshgrid(
            (torch.arange(gt) * _interval(run, rule)).long(), torch.arange(gh) + cur,
            torch.arange(gw) + cur,
            indexing="ij",
        )
        pos = torch.stack([tt, hh, ww]).reshape(3, -1)
        pos[0] += cur
        pieces.append(pos)
        cur += max(h, w) // merge
    if next(runs, None) is not None:
        raise ValueError("more media than pad runs in the prompt")
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    delta = int(positions[:, -1].max()) + 1 - n if n else 0
    return positions, delta


@dataclass(frozen=True)
class MergeModel:
    """What merging needs of the model: its text embedding table, its pad token ids, its
    MRoPE rule and how many deepstack levels ride beside each row."""

    embed_tokens: torch.nn.Embedding
    image_token_id: int
    video_token_id: int
    rule: RopeRule
    num_deepstack: int


def build_payload(
    model: MergeModel,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    features: list[CachedFeatures | None],
    items: list[VisionGrid],
) -> PromptPayload:
    """Splice each image's and video's features into the prompt's text embeddings: images
    in order at the image pads, videos in order at the video pads (transformers'
    `masked_scatter` of each kind).

    A None entry is a medium whose features are not needed (it lies wholly inside the
    prefix the language side already holds, which is cut off after): zeros stand in.
    `embed_tokens` is on the CPU: this runs on the preprocessing threads, which run no GPU
    work (EncodePipeline keeps the table there)."""
    rule, num_deepstack = model.rule, model.num_deepstack
    with torch.inference_mode():
        text = model.embed_tokens(input_ids)
    hidden = text.shape[1]
    feats = [
        f if f is not None else CachedFeatures(
            torch.zeros(n, hidden), tuple(torch.zeros(n, hidden) for _ in range(num_deepstack)))
        for f, n in zip(features, [it.num_tokens(rule.merge) for it in items], strict=True)
    ]
    cols = [text] + [torch.zeros_like(text) for _ in range(num_deepstack)]
    for kind, token_id in ((MediaKind.IMAGE, model.image_token_id),
                           (MediaKind.VIDEO, model.video_token_id)):
        mask = input_ids == token_id
        mine = [f for f, it in zip(feats, items, strict=True) if it.kind is kind]
        have = sum(int(f.embeds.shape[0]) for f in mine)
        if int(mask.sum()) != have:
            raise ValueError(f"{int(mask.sum())} {kind.name.lower()} tokens but {have} "
                             "feature rows")
        if not mine:
            continue
        cols[0] = cols[0].masked_scatter(mask[:, None],
                                         torch.cat([f.embeds for f in mine]).to(text.dtype))
        for k in range(num_deepstack):
            cols[k + 1][mask] = torch.cat([f.deepstack[k] for f in mine]).to(text.dtype)
    positions, delta = rope_index(mm_token_type_ids, items, rule)
    return PromptPayload(
        input_embeds=torch.cat(cols, dim=1) if len(cols) > 1 else cols[0],
        fill_ids=input_ids.to(torch.int32),
        mrope_positions=positions.to(torch.int32),
        mrope_delta=delta,
    )


def media_rows(input_ids: torch.Tensor, counts: list[int], image_token_id: int,
               video_token_id: int) -> list[torch.Tensor]:
    """Each medium's pad rows (int64 indices into the prompt), in prompt order: the pads of
    both kinds, taken `counts[i]` at a time (pipeline.media_spans checked the layout)."""
    pads = torch.nonzero((input_ids == image_token_id) | (input_ids == video_token_id))[:, 0]
    if sum(counts) != int(pads.numel()):
        raise ValueError(f"{int(pads.numel())} pad tokens for {sum(counts)} media tokens")
    return list(pads.split(counts)) if counts else []


class StreamedPayload:
    """A prompt payload filled in as its media's features come (docs/architecture.md, "Streamed rows").

    Built before any ViT runs: the text rows (token embeddings), every token id, the MRoPE
    positions and the delta (from the grids alone), and zeros where features go. `place(i,
    features)` splices medium i's features in (the same values `build_payload` puts there:
    a streamed payload equals the whole one bit for bit) and raises the watermark to the
    first pad of the first medium still missing: rows before it are final.

    It holds tokens [start, L) of the prompt (the language side holds [0, start)); a medium
    wholly before `start` is never needed, one that straddles it keeps only its rows past it.
    """

    def __init__(
        self,
        model: MergeModel,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        items: list[VisionGrid],
        rows: list[torch.Tensor],
        *,
        start: int,
        groups: list[int] | None = None,
        only: set[tuple[int, int]] | None = None,
    ) -> None:
        """`groups[i]`: medium i's temporal groups (default 1 each), each filled on its own
        (units.py); `only`: the (medium, group) units this writer fills (a helper's range
        of a split prompt); the others' rows are another writer's, never waited for (left
        zero here)."""
        num_deepstack = model.num_deepstack
        dev = model.embed_tokens.weight.device
        with torch.inference_mode():
            text = model.embed_tokens(input_ids[start:].to(dev)).cpu()
        self.hidden, self.start, self.num_deepstack = int(text.shape[1]), start, num_deepstack
        positions, delta = rope_index(mm_token_type_ids, items, model.rule)
        embeds = torch.zeros((text.shape[0], self.hidden * (1 + num_deepstack)), dtype=text.dtype)
        embeds[:, : self.hidden] = text
        n = int(input_ids.shape[0]) - start
        self.payload = PromptPayload(
            input_embeds=embeds,
            fill_ids=input_ids[start:].to(torch.int32),
            mrope_positions=positions[:, start:].to(torch.int32),
            mrope_delta=delta,
            start=start,
            arrived=RowWatermark(n),
        )
        # each medium's rows in payload coordinates (negative: before `start`, held by the
        # language side), its rows per group, and the groups still waiting for features
        self.rows = [r - start for r in rows]
        self.groups = list(groups) if groups is not None else [1] * len(rows)
        self.per = [r.numel() // g for r, g in zip(rows, self.groups, strict=True)]
        self.missing: dict[int, set[int]] = {}
        for i, r in enumerate(self.rows):
            gs = {g for g in range(self.groups[i]) if int(r[(g + 1) * self.per[i] - 1]) >= 0
                  and (only is None or (i, g) in only)}
            if gs:
                self.missing[i] = gs
        self._raise()

    def expect(self, units: set[tuple[int, int]]) -> None:
        """These (medium, group) units' rows are this writer's after all (a split prompt's
        lead taking back a lost helper's range): they wait for features again (`needs`).
        NOTE: the watermark never goes back; the caller writes those rows only after
        placing them (the sender awaits the whole fall back)."""
        for i, g in units:
            if int(self.rows[i][(g + 1) * self.per[i] - 1]) >= 0:
                self.missing.setdefault(i, set()).add(g)

    def needs(self, i: int, g: int | None = None) -> bool:
        """Medium i (group g of it) still waits for features here."""
        return i in self.missing and (g is None or g in self.missing[i])

    def place(self, i: int, features: CachedFeatures, g0: int = 0, g1: int | None = None) -> None:
        """The features of medium i's groups [g0, g1) (default: all) into their rows; the
        watermark moves past what is complete.
        NOTE: call it on one thread at a time (the pipeline awaits each)."""
        g1 = self.groups[i] if g1 is None else g1
        rows, h = self.rows[i][g0 * self.per[i] : g1 * self.per[i]], self.hidden
        keep = rows >= 0  # rows before `start`: cut
        rows = rows[keep]
        e = self.payload.input_embeds
        e[rows, :h] = features.embeds[keep].to(e.dtype)
        for k in range(self.num_deepstack):
            e[rows, h * (k + 1) : h * (k + 2)] = features.deepstack[k][keep].to(e.dtype)
        left = self.missing.get(i, set()) - set(range(g0, g1))
        if left:
            self.missing[i] = left
        else:
            self.missing.pop(i, None)
        self._raise()

    def _raise(self) -> None:
        first = min((max(0, int(self.rows[i][min(gs) * self.per[i]]))
                     for i, gs in self.missing.items()), default=None)
        self.payload.arrived.advance(self.payload.num_tokens if first is None else first)
