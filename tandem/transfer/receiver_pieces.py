"""The receiver's answers to the encoder's messages on a room's Attach stream: the
prompt's content (AttachPrompt -> AttachCached), each finished chunk (copy it out while the
next flies), a partial piece (reserve for the rest, Resume), Done (the payload).

A mixin of `EmbeddingReceiver` (receiver.py), split out by role: it uses the receiver's
`buffers`, `allocator`, `blocks`, `config`, `ranks`, `max_prompt_tokens`, `on_prompt`,
`_keys`, `_write`, `_interrupt`, `_timeout` and `_drop_rows`. Every check here raises
TransferError (INVALID_ARGUMENT for a message that does not fit the room, DATA_LOSS for
blocks that do not hold this attempt's data).
"""

from __future__ import annotations

import asyncio
import functools
import time

import torch

from tandem.transfer.buffers import AUX_MROPE_DELTA
from tandem.transfer.errors import TransferError
from tandem.transfer.payload import ImageSpan, PromptInfo, PromptPayload
from tandem.transfer.room import ReceiverRoom, ReceiverState
from tandem.v1 import encoder_pb2


class PieceHandlers:
    async def _on_prompt(self, r: ReceiverRoom, p: encoder_pb2.AttachPrompt) -> None:
        """The prompt's content, before any data: answer how much of it we hold."""
        info = PromptInfo(list(p.token_ids),
                          [ImageSpan(im.start, im.length, im.hash) for im in p.images])
        n = len(info.token_ids)
        why = ("sent twice" if r.info is not None else "after data" if r.out is not None
               else f"{n} tokens (limit {self.max_prompt_tokens})"
               if not 0 < n <= self.max_prompt_tokens else info.check())
        if why:
            raise TransferError(f"room {r.room}: bad AttachPrompt: {why}", "INVALID_ARGUMENT")
        r.info = info
        r.cached = self.on_prompt(r.room, info) if self.on_prompt else 0
        await self._write(r, encoder_pb2.AttachRequest(cached=encoder_pb2.AttachCached(
            room=r.room, cached_tokens=r.cached)))

    def _announce(self, r: ReceiverRoom, sent: int, total: int, final: bool) -> None:
        """Validate a Progress/Done against the room; allocate the output on first sight.
        `r.sent` is where the current piece starts; it holds `r.allocated` tokens."""
        expect = r.total or (len(r.info.token_ids) - r.cached if r.info is not None else None)
        if not 0 < total <= self.max_prompt_tokens or (expect is not None and total != expect):
            raise TransferError(f"room {r.room}: bad total_tokens {total} (expected "
                                f"{expect or f'<= {self.max_prompt_tokens}'})", "INVALID_ARGUMENT")
        if not r.copied < sent <= min(total, r.sent + r.allocated) or (final and sent != total):
            raise TransferError(f"room {r.room}: encoder reports {sent}/{total} tokens; piece "
                                f"at {r.sent} holds {r.allocated}, {r.copied} copied out",
                                "INVALID_ARGUMENT")
        if r.out is None:
            r.total = total
            b, dev = self.buffers, self.buffers.embeddings.device
            r.out = (torch.empty((total, b.embed_dim), dtype=b.dtype, device=dev),
                     torch.empty(total, dtype=torch.int32, device=dev),
                     torch.empty((3, total), dtype=torch.int32, device=dev))
            if self.ranks is not None:  # a new attempt's rows: under a new name
                self._drop_rows(r)
                r.ranks_key = next(self._keys)
        r.state = ReceiverState.TRANSFERRING

    async def _copy_out(self, r: ReceiverRoom, ids: list[int], start: int, upto: int) -> None:
        """Check and gather tokens [r.copied, upto) of the piece at `start` in `ids`."""
        a, bs = r.copied, self.buffers.block_size
        i0 = (a - start) // bs
        piece_tokens = min(r.total - start, len(ids) * bs)
        check = (ids[i0:], r.room, r.attempt + 1, r.total, start, piece_tokens, upto - a, i0)
        self.buffers.check_piece(*check)
        copy = functools.partial(self.buffers.gather_into, ids[i0:], upto - a, *r.out, a)
        if self.ranks is not None:  # every rank copies its own blocks (and checks them)
            copy = functools.partial(
                self.ranks.gather, r.ranks_key, ids[i0:], upto - a, a, r.total, r.room,
                r.attempt + 1, start, piece_tokens, i0, local=copy)
        await asyncio.get_running_loop().run_in_executor(None, copy)
        # NOTE: and again after the copy: a stale write whose aux row lands while we copy is
        # caught too (one landing wholly inside the copy, aux first, is what this narrows).
        self.buffers.check_piece(*check)
        r.copied = upto

    async def _on_progress(self, r: ReceiverRoom, p: encoder_pb2.AttachProgress) -> None:
        """A chunk of the current piece is written: copy it out while the rest flies."""
        self._announce(r, p.sent_tokens, p.total_tokens, final=False)
        if (p.sent_tokens - r.sent) % self.buffers.block_size == 0:
            await self._copy_out(r, r.ids, r.sent, p.sent_tokens)

    async def _on_partial(self, r: ReceiverRoom, p: encoder_pb2.AttachProgress, deadline) -> None:
        self._announce(r, p.sent_tokens, p.total_tokens, final=False)
        old_key, old_ids, start, sent = r.key, r.ids, r.sent, p.sent_tokens
        cap = self.allocator.num_total * self.allocator.block_size
        if self.resume_tokens:
            cap = min(cap, self.resume_tokens)
        want = min(p.total_tokens - sent, cap)
        got = self.blocks.try_alloc(r, want)
        if got is None:  # pool busy: free this piece first, then wait for blocks
            await self._copy_out(r, old_ids, start, sent)
            self.blocks.free(r, old_key)
            bounded_by_deadline = (deadline is not None
                                   and deadline - time.time() <= self.config.timeout_s)
            got = await self.blocks.alloc(
                r, want, self._timeout(deadline), lambda ev: self._interrupt(r, ev),
                resume=True,
                timeout_code="DEADLINE_EXCEEDED" if bounded_by_deadline else "UNAVAILABLE")
        r.key, r.ids = got
        r.allocated = len(r.ids) * self.buffers.block_size
        r.resumes += 1
        await self._write(r, encoder_pb2.AttachRequest(resume=encoder_pb2.AttachResume(
            room=r.room, block_ids=r.ids, sent_tokens=sent, allocated_tokens=r.allocated)))
        if old_key in r.keys:  # NOTE: Resume first, so this copy overlaps the next write
            await self._copy_out(r, old_ids, start, sent)
            self.blocks.free(r, old_key)
        r.sent = sent

    async def _on_done(self, r: ReceiverRoom, d: encoder_pb2.AttachDone) -> PromptPayload:
        self._announce(r, d.total_tokens, d.total_tokens, final=True)
        delta = int(self.buffers.aux[r.ids[0], AUX_MROPE_DELTA])
        if delta != d.mrope_position_delta:
            raise TransferError(f"room {r.room}: Done says mrope delta {d.mrope_position_delta}, "
                                f"blocks say {delta}", "DATA_LOSS")
        await self._copy_out(r, r.ids, r.sent, d.total_tokens)
        self.blocks.free(r, r.key)
        r.sent = d.total_tokens
        e, f, m = r.out
        if r.info is not None and f.tolist() != r.info.token_ids[r.cached:]:
            raise TransferError(f"room {r.room}: the token ids written differ from the "
                                f"announced prompt's", "DATA_LOSS")
        return PromptPayload(input_embeds=e, fill_ids=f, mrope_positions=m,
                             mrope_delta=d.mrope_position_delta, start=r.cached, info=r.info)
