"""Shared by the transfer tests and their peer processes: payloads, digests, JSON lines."""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from tandem.transfer.buffers import DTYPES
from tandem.transfer.payload import PromptPayload


def make_payload(n_tokens: int, embed_dim: int, dtype: str, seed: int) -> PromptPayload:
    """A deterministic random payload: both processes build the same one from the seed."""
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(n_tokens, embed_dim, generator=g).to(DTYPES[dtype])
    fill = torch.randint(0, 1 << 30, (n_tokens,), generator=g, dtype=torch.int32)
    mrope = torch.randint(-(1 << 20), 1 << 20, (3, n_tokens), generator=g, dtype=torch.int32)
    delta = int(torch.randint(-5000, 5000, (1,), generator=g))
    return PromptPayload(embeds, fill, mrope, delta)


def digest(p: PromptPayload) -> str:
    h = hashlib.sha256()
    for t in (p.input_embeds, p.fill_ids, p.mrope_positions):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    h.update(str(p.mrope_delta).encode())
    return h.hexdigest()


def emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()
