"""Embeddings delivered to every tensor-parallel rank (docs/architecture.md, "N destinations").

Each rank of a `--tp N` instance has its own Mooncake engine and its own
`EmbeddingBuffers`, a mirror of rank 0's pool (same block count, block size, width and
dtype). Rank 0's receiver names every rank in the Attach Init (`AttachInit.ranks`), and the
encoder writes each piece into the same block ids of every rank. Rank 0 alone runs the
room (reservations, Progress, Resume, Done, the prefix cache); over one data socket per
rank (beside the step socket, see ranks.py) it tells the others what to do with their copy:

    rank 0 ─▶ rank r   gather {key, ids, n, at, total, room, generation, start,
                               piece_tokens, first_index, seals}
                       rank r checks its blocks' aux rows (the fence holds per rank),
                       copies the rows into its copy of payload `key` ([total, embed_dim])
                       at row `at`, checks again, and opens its copy of each reported
                       range in `seals` (decrypts, verifies the encoder's embeddings tag:
                       tandem/transfer/buffers.py RangeSeal.for_rank; none unprotected)
                                                  ─▶ {"ok": true} | {"error", "code"}
    rank 0 ─▶ rank r   clear {ids}   zero the blocks: their room let them go ─▶ {"ok": true}
    rank 0 ─▶ rank r   drop {key}    the payload's request ended: forget its rows

Invariants: a gather is answered before rank 0 frees the blocks, and a clear before they
are handed out again, so no later room's write can land in blocks a rank has yet to copy
or clear. A drop is sent only once no step can name the key (the request ended in the
engine, or never reached it). Steps name rows by (key, row) (`SeqChunk.embeds_key`)
instead of carrying them. One lock serialises the socket's calls (the receiver's copies
run in executor threads, drops come from the engine thread).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.connection import Connection

import torch

from tandem import tracing
from tandem.services.language.tp import wire
from tandem.transfer import EmbeddingBuffers, TransferError
from tandem.transfer.buffers import BufferLayout, PieceCheck, RangeSeal, open_range
from tandem.v1 import encoder_pb2

log = logging.getLogger("tandem.language.tp")


class RankBuffers:
    """Rank 0's handle on the other ranks' embedding buffers."""

    def __init__(self, conns: list[Connection], ready: list[dict],
                 fail: Callable[[str], None], timeout_s: float = 60.0) -> None:
        self.conns, self._fail, self.timeout_s = conns, fail, timeout_s
        self.destinations = [
            encoder_pb2.RankDestination(
                session_id=m["session_id"], layout=BufferLayout(**m["layout"]).to_proto())
            for m in ready
        ]
        self._lock = threading.Lock()

    def check_mirror(self, layout: BufferLayout) -> None:
        """Every rank's pool must mirror rank 0's (`layout`): one list of block ids for all."""
        for r, d in enumerate(self.destinations, start=1):
            got = BufferLayout.from_proto(d.layout)
            if (got.block_size, got.num_blocks, got.embed_dim, got.dtype) != (
                    layout.block_size, layout.num_blocks, layout.embed_dim, layout.dtype):
                self._fail(f"rank {r}'s embedding buffers {got} do not mirror rank 0's {layout}")

    def _call(self, msg: dict, answer: bool, local: Callable[[], None] | None = None) -> None:
        data = wire.encode_json(msg)
        with self._lock:
            try:
                for c in self.conns:
                    c.send_bytes(data)
                if local is not None:  # rank 0's own copy, while the others make theirs
                    local()
                replies = [self._answer(r, c) for r, c in enumerate(self.conns, 1)] if answer else []
            except (OSError, EOFError) as e:
                self._fail(f"a tensor-parallel rank's data socket broke ({e})")
                raise
        for r, rep in enumerate(replies, start=1):
            if not rep.get("ok"):
                raise TransferError(f"rank {r}: {rep.get('error')}", rep.get("code", "INTERNAL"))

    def _answer(self, rank: int, c: Connection) -> dict:
        # NOTE: bounded like a collective: a hung rank must not hold this lock (and with
        # it every room's copy and the engine thread's drops) forever.
        if not c.poll(self.timeout_s):
            self._fail(f"rank {rank} did not answer within {self.timeout_s:g} s")
        return wire.decode_json(c.recv_bytes())

    def gather(self, key: int, piece: PieceCheck, at: int, local: Callable[[], None],
               seals: list[dict] = (), trace: dict[str, str] | None = None) -> None:
        """Every rank (rank 0 through `local`) checks and copies the piece's tokens into its
        rows of payload `key` at row `at`, and opens its copy of each range in `seals`
        (`RangeSeal.for_rank`). Raises TransferError (DATA_LOSS). `trace`: the room's trace
        context (tracing.carrier), for each rank's `tp.gather` span."""
        self._call({"op": "gather", "key": key, "piece": asdict(piece), "at": at,
                    "seals": list(seals), "trace": trace or {}}, answer=True, local=local)

    def clear(self, ids: list[int]) -> None:
        if ids:
            self._call({"op": "clear", "ids": ids}, answer=True)

    def drop(self, key: int) -> None:
        self._call({"op": "drop", "key": key}, answer=False)


@contextlib.contextmanager
def _rank_span(m: dict):
    """This rank's `tp.gather` span of a gather rank 0 traces (none otherwise)."""
    parent = tracing.from_carrier(m.get("trace") or {})
    if parent is None:
        yield
        return
    span = tracing.start("tp.gather", parent, attributes={
        tracing.ROOM: m["piece"]["room"], "tandem.transfer.tokens": m["piece"]["n_tokens"]})
    try:
        yield
    except TransferError as e:
        tracing.fail(span, e.code, e.reason)
        raise
    finally:
        span.end()


class WorkerBuffers:
    """A rank's own embedding buffers and the payload rows it holds, served to rank 0."""

    def __init__(self, conn: Connection, buffers: EmbeddingBuffers) -> None:
        self.conn, self.buffers = conn, buffers
        self.rows: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self._serve, name="tp-buffers", daemon=True).start()

    def take(self, key: int, row: int, n: int) -> torch.Tensor:
        """Rows [row, row + n) of payload `key` (a step's prompt chunk)."""
        with self._lock:
            rows = self.rows.get(key)
        if rows is None or row + n > rows.shape[0]:
            raise RuntimeError(f"rows [{row}, {row + n}) of payload {key} are not held here")
        return rows[row : row + n]

    def _serve(self) -> None:
        while True:
            try:
                msg = wire.decode_json(self.conn.recv_bytes())
            except (EOFError, OSError):
                return  # rank 0 is gone; the step loop notices and exits
            op = msg["op"]
            if op == "drop":
                with self._lock:
                    self.rows.pop(msg["key"], None)
                continue
            try:
                if op == "gather":
                    with _rank_span(msg):
                        self._gather(msg)
                elif op == "clear":
                    self.buffers.clear(msg["ids"])
                reply = {"ok": True}
            except TransferError as e:
                reply = {"error": e.reason, "code": e.code}
            self.conn.send_bytes(wire.encode_json(reply))

    def _gather(self, m: dict) -> None:
        b = self.buffers
        piece = PieceCheck(**m["piece"])
        b.check_piece(piece)
        with self._lock:
            out = self.rows.get(m["key"])
            if out is None:
                out = self.rows[m["key"]] = b.private_embeds(piece.total)
        b.gather_into(piece.block_ids, piece.n_tokens, out, None, None, m["at"])
        b.check_piece(piece)  # NOTE: and after: a stale write landing during the copy
        for d in m.get("seals", ()):  # NOTE: on the private copy: what this rank's steps use
            open_range(*RangeSeal.of_rank(d), out)
