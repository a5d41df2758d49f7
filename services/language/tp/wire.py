"""The tensor-parallel control channel's messages, as plain bytes (no pickle).

Rank 0 and its workers talk over one authenticated local socket per worker
(`multiprocessing.connection`, used for framing only: every message is `send_bytes`):

    worker ─▶ rank 0   hello     {"rank": r, "channel": "step"}     (JSON)
    worker ─▶ rank 0   ready     {"ready": true, "num_pages": n, "session_id": s,
                                  "layout": {BufferLayout}}   (its runner built: n KV
                                 pages, agreed with rank 0 in the runners' start-up)
    rank 0 ─▶ worker   step      a ForwardBatch: safetensors bytes whose metadata holds
                                 the chunks' scalars, block tables and, for prompt rows
                                 the rank holds, their (embeds_key, embeds_row); tensors
                                 "<chunk>.positions" / ".input_embeds" / ".token_ids"
                                 (input_embeds only for rows the ranks do not hold)
    rank 0 ─▶ worker   stop      b"" (an empty message)

A second socket per worker (hello {"rank": r, "channel": "data"}) carries the embedding
buffers' calls (buffers.py), JSON both ways.

`RankArgs` travels on the worker's command line as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tandem.services.language.runner.forward_batch import ForwardBatch, SeqChunk

STOP = b""
_TENSORS = ("positions", "input_embeds", "token_ids")


def encode_json(obj: dict) -> bytes:
    return json.dumps(obj).encode()


def decode_json(data: bytes) -> dict:
    return json.loads(data.decode())


def encode_step(batch: ForwardBatch) -> bytes:
    chunks, tensors = [], {}
    for i, c in enumerate(batch.chunks):
        chunks.append({"seq_id": c.seq_id, "start": c.start, "block_table": list(c.block_table),
                       "want_prompt_logits": c.want_prompt_logits,
                       "embeds_key": c.embeds_key, "embeds_row": c.embeds_row})
        for name in _TENSORS:
            t = getattr(c, name)
            if name == "input_embeds" and c.embeds_key is not None:
                continue  # the ranks hold these rows (the encoder wrote them to each)
            if t is not None:  # NOTE: safetensors wants contiguous CPU tensors of their own
                tensors[f"{i}.{name}"] = t.detach().to("cpu").contiguous()
    return st_save(tensors, metadata={"chunks": json.dumps(chunks)})


def decode_step(data: bytes, take: Callable[[int, int, int], torch.Tensor]) -> ForwardBatch:
    """The step; `take(key, row, n)` gives held prompt rows (WorkerBuffers.take)."""
    tensors = st_load(data)
    meta = json.loads(_metadata(data)["chunks"])
    chunks = []
    for i, m in enumerate(meta):
        c = SeqChunk(**m, **{name: tensors.get(f"{i}.{name}") for name in _TENSORS})
        if c.embeds_key is not None:
            c.input_embeds = take(c.embeds_key, c.embeds_row, c.num_tokens)
        chunks.append(c)
    return ForwardBatch(chunks)


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's `__metadata__` (8-byte little-endian length, then JSON)."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n].decode())["__metadata__"]
