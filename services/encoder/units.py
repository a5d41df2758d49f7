"""Units of ViT work: an image, or a run of a video's temporal groups.

A video's temporal groups are independent in the tower: each frame group is an attention
segment of its own (full and windowed attention alike), its rotary and position
embeddings depend on (h, w) only, and the merger works on 2x2 patches within a group. So
groups [g0, g1) of a video through the ViT give the rows [g0, g1) of the whole video's
features (bit for bit where the linears are batch-invariant: the packed CPU kernels;
tests/test_video_units.py), and a long video can stream its rows group by group and be
split across encoders like a run of images (docs/architecture.md, "Streamed rows").

    units(media, rows, start)      every group of every medium past the cached prefix
    vit_inputs(picked, media, cap) the units to run, coalesced: one input per contiguous
                                   run of one medium's groups (at most `cap` patches
                                   each; a whole video stays the video, cached whole)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.services.encoder.preprocess import PreparedImage


@dataclass(frozen=True)
class Unit:
    """Temporal groups [g0, g1) of medium `medium` (an image: its one group)."""

    medium: int
    g0: int
    g1: int
    first_pad: int  # prompt index of its first pad token
    patches: int


def groups_of(m) -> int:
    """Temporal groups of a medium (1 for an image)."""
    return 1 if isinstance(m, PreparedImage) else int(m.grid[0])


def units(media: list, rows: list[torch.Tensor], start: int) -> list[Unit]:
    """One unit per temporal group of every medium with a pad at or past prompt token
    `start` (the language side's cached prefix), in prompt order; `rows[i]`: medium i's
    pad rows (merge.media_rows)."""
    out = []
    for i, (m, r) in enumerate(zip(media, rows, strict=True)):
        t, per = groups_of(m), r.numel() // groups_of(m)
        patches = (m.grid[0] * m.grid[1] * m.grid[2]) // t
        for g in range(t):
            if int(r[(g + 1) * per - 1]) >= start:
                out.append(Unit(i, g, g + 1, int(r[g * per]), patches))
    return out


@dataclass
class VideoSlice:
    """Temporal groups [g0, g1) of a decoded video as one ViT input (scheduler.VisionInput):
    its own cache key, so a slice is computed and cached once."""

    video: object  # PreparedVideo
    g0: int
    g1: int

    @property
    def _hw(self) -> int:
        _, h, w = self.video.grid
        return h * w

    @property
    def pixel_values(self) -> torch.Tensor:
        return self.video.pixel_values[self.g0 * self._hw : self.g1 * self._hw]

    @property
    def key(self) -> str:
        return f"{self.video.key}#t{self.g0}-{self.g1}"

    @property
    def grid(self) -> tuple[int, int, int]:
        _, h, w = self.video.grid
        return (self.g1 - self.g0, h, w)

    @property
    def num_tokens(self) -> int:
        return self.video.num_tokens // self.video.grid[0] * (self.g1 - self.g0)

    @property
    def num_patches(self) -> int:
        return (self.g1 - self.g0) * self._hw


@dataclass(frozen=True)
class VitInput:
    """One input to run and where its rows go: groups [g0, g1) of medium `medium`."""

    medium: int
    g0: int
    g1: int
    whole: bool  # every group of the medium: the medium itself is the input


def vit_inputs(picked: list[Unit], media: list, cap: int = 0) -> list[VitInput]:
    """`picked` (in prompt order) coalesced into inputs: a contiguous run of one medium's
    groups is one input, cut every `cap` patches when `cap` > 0 (streamed rows: each
    input's rows go out when it ends)."""
    out: list[VitInput] = []
    for u in picked:
        m = media[u.medium]
        last = out[-1] if out else None
        if (last is not None and last.medium == u.medium and last.g1 == u.g0
                and (cap <= 0 or (last.g1 - last.g0 + 1) * u.patches <= cap)):
            g0 = last.g0
            out[-1] = VitInput(u.medium, g0, u.g1, g0 == 0 and u.g1 == groups_of(m))
        else:
            out.append(VitInput(u.medium, u.g0, u.g1, u.g0 == 0 and u.g1 == groups_of(m)))
    return out
