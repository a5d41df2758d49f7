"""The prompt payload: what the encoder produces and the language tier consumes.

Plain data, one per request. The transfer layer moves it block by block; both ends see
this same shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PromptPayload:
    """A prompt as the language model's input.

    input_embeds    [L, embed_dim]  model dtype; embed_dim = hidden * (1 + num_deepstack):
                    columns [0, hidden) are the input embeddings (text embeddings with
                    image features spliced in at image-pad tokens); for Qwen3-VL, columns
                    [hidden*(k+1), hidden*(k+2)) are deepstack layer k's features at image
                    positions (zeros elsewhere).
    fill_ids        [L]     int32   token ids of the prompt (image pads included).
    mrope_positions [3, L]  int32   MRoPE (temporal, height, width) positions.
    mrope_delta     int             decode position of token i is i + mrope_delta.
    """

    input_embeds: torch.Tensor
    fill_ids: torch.Tensor
    mrope_positions: torch.Tensor
    mrope_delta: int

    def __post_init__(self) -> None:
        n = self.input_embeds.shape[0]
        if self.input_embeds.dim() != 2:
            raise ValueError(f"input_embeds must be [L, D], got {tuple(self.input_embeds.shape)}")
        if tuple(self.fill_ids.shape) != (n,):
            raise ValueError(f"fill_ids must be [{n}], got {tuple(self.fill_ids.shape)}")
        if tuple(self.mrope_positions.shape) != (3, n):
            raise ValueError(
                f"mrope_positions must be [3, {n}], got {tuple(self.mrope_positions.shape)}"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.input_embeds.shape[0])

    @property
    def embed_dim(self) -> int:
        return int(self.input_embeds.shape[1])
