"""Text embeddings + image features -> the prompt payload (embeddings, ids, MRoPE positions).

Layout of `input_embeds` ([L, hidden * (1 + num_deepstack)]):

    columns  [0, H)          text embeddings, image features at image-pad tokens
             [H, 2H)         deepstack layer 0 features at image-pad tokens, zeros elsewhere
             ...             (Qwen3-VL only; Qwen2.5-VL has width H)

MRoPE positions follow transformers' `get_rope_index` for images: text runs count up by
one; an image of grid (t, h, w) patches covers (t, h/m, w/m) tokens placed at
(start + t_i, start + h_i, start + w_i); the next run starts at start + max(h, w) / m.
The delta is max(position) + 1 - L, so decode token i sits at i + delta.
"""

from __future__ import annotations

import itertools

import torch

from tandem.services.encoder.cache import CachedFeatures
from tandem.transfer.payload import PromptPayload


def rope_index(
    mm_token_type_ids: torch.Tensor, grids: list[tuple[int, int, int]], merge: int
) -> tuple[torch.Tensor, int]:
    """MRoPE positions [3, L] (int64) and the position delta of one prompt (images only)."""
    types = mm_token_type_ids.tolist()
    n = len(types)
    pieces, cur, it = [], 0, iter(grids)
    for kind, group in itertools.groupby(types):
        length = sum(1 for _ in group)
        if kind == 0:
            pieces.append(torch.arange(length).view(1, -1).expand(3, -1) + cur)
            cur += length
            continue
        if kind != 1:
            raise ValueError(f"token type {kind} (video/audio) is not supported by the encoder")
        t, h, w = next(it)
        gt, gh, gw = t, h // merge, w // merge
        if gt * gh * gw != length:
            raise ValueError(f"image run of {length} tokens does not match grid {(t, h, w)}")
        tt, hh, ww = torch.meshgrid(
            torch.arange(gt), torch.arange(gh) + cur, torch.arange(gw) + cur, indexing="ij"
        )
        pos = torch.stack([tt, hh, ww]).reshape(3, -1)
        pos[0] += cur
        pieces.append(pos)
        cur += max(h, w) // merge
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    delta = int(positions.max()) + 1 - n if n else 0
    return positions, delta


def build_payload(
    embed_tokens: torch.nn.Embedding,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    features: list[CachedFeatures | None],
    grids: list[tuple[int, int, int]],
    *,
    image_token_id: int,
    merge: int,
    num_deepstack: int,
) -> PromptPayload:
    """Splice each image's features into the prompt's text embeddings, in image order.

    A None entry is an image whose features are not needed (it lies wholly inside the
    prefix the language side already holds, which is cut off after): zeros stand in."""
    dev = embed_tokens.weight.device
    with torch.inference_mode():
        text = embed_tokens(input_ids.to(dev)).cpu()
    mask = input_ids == image_token_id
    n_img = int(mask.sum())
    hidden = text.shape[1]
    feats = [
        f if f is not None else CachedFeatures(
            torch.zeros(n, hidden), tuple(torch.zeros(n, hidden) for _ in range(num_deepstack)))
        for f, n in zip(features, [g[0] * g[1] * g[2] // (merge * merge) for g in grids],
                        strict=True)
    ]
    have = sum(int(f.embeds.shape[0]) for f in feats)
    if n_img != have:
        raise ValueError(f"{n_img} image tokens but {have} image feature rows")
    cols = [text]
    if feats:
        img = torch.cat([f.embeds for f in feats]).to(text.dtype)
        cols[0] = text.masked_scatter(mask[:, None], img)
    for k in range(num_deepstack):
        z = torch.zeros_like(text)
        if feats:
            z[mask] = torch.cat([f.deepstack[k] for f in feats]).to(text.dtype)
        cols.append(z)
    positions, delta = rope_index(mm_token_type_ids, grids, merge)
    return PromptPayload(
        input_embeds=torch.cat(cols, dim=1) if len(cols) > 1 else cols[0],
        fill_ids=input_ids.to(torch.int32),
        mrope_positions=positions.to(torch.int32),
        mrope_delta=delta,
    )
