"""Multimodal rotary embedding (MRoPE) from [3, T] (temporal, height, width) positions.

Each of the head_dim/2 rotary frequencies takes its angle from ONE of the three position
rows. Which row feeds which frequency is the only difference between the two layouts:

    chunked (Qwen2.5-VL), mrope_section = (s0, s1, s2):
        freq index:  0 .. s0-1 | s0 .. s0+s1-1 | .. head_dim/2 - 1
        row:         t         | h             | w
    interleaved (Qwen3-VL):
        freq index:  0  1  2  3  4  5 ...  (h at 1 mod 3 below 3*s1, w at 2 mod 3 below 3*s2)
        row:         t  h  w  t  h  w ...  t t t (tail beyond the interleave is t)

The per-frequency row map is built once; a step does one gather, so the computation is
capture-safe and matches transformers' `recomposition_frequencies` bit for bit.
"""

from __future__ import annotations

import torch


class MRope:
    def __init__(
        self,
        head_dim: int,
        theta: float,
        section: tuple[int, int, int],
        interleaved: bool,
        device: torch.device | str,
    ) -> None:
        # NOTE: built on the CPU explicitly (then moved), so a decoder constructed under
        # `torch.device("meta")` still gets real rotary tables.
        half = head_dim // 2
        self.inv_freq = 1.0 / (
            theta
            ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
        )
        if interleaved:
            row = torch.zeros(half, dtype=torch.int64, device="cpu")
            row[1 : section[1] * 3 : 3] = 1
            row[2 : section[2] * 3 : 3] = 2
        else:
            row = torch.cat(
                [
                    torch.full((s,), i % 3, dtype=torch.int64, device="cpu")
                    for i, s in enumerate(section)
                ]
            )
        self.inv_freq = self.inv_freq.to(device)
        self.row = row.to(device)  # [half]: which position row feeds each frequency

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] int -> cos, sin [T, head_dim] in `dtype`."""
        pos = positions.float()  # [3, T]
        # Pick each frequency's row first, then multiply: same float ops as transformers.
        picked = pos[self.row]  # [half, T]
        freqs = picked.t() * self.inv_freq  # [T, half]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D] (rotate-half convention)."""
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat((-x2, x1), dim=-1) * s
