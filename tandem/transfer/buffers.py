"""EmbeddingBuffers: the language side's block-allocated, once-registered prompt buffers.

One row per block; block b of each buffer starts at `base + b * row_bytes`:

    embeddings      [num_blocks, block_size * embed_dim]  model dtype  token-major rows
    fill_ids        [num_blocks, block_size]              int32
    mrope_positions [num_blocks, 3 * block_size]          int32  row = t[bs] | h[bs] | w[bs]
    aux             [num_blocks, 16]                      int32  see AUX_* below

A request's blocks need not be contiguous; token i of a piece lives in block ids[i // bs]
at slot i % bs. Every block written carries an aux row naming its room, the generation of
the room's reservation (one per Attach attempt) and its piece, so a gather can prove each
block holds this attempt's data: a stale write (an encoder frozen mid-write that wakes after
its room moved to another encoder, or ended) or a misdirected one fails the room with
DATA_LOSS instead of feeding another request's, or another attempt's, data to the model.

The aux fence stops stale writes of honest encoders, not a hostile peer: Mooncake serves
reads and writes of registered memory to any process that reaches its ports. So the rows
are protected (`RowProtection`, below): the encoder sends keyed tags over the rows of each
range it reports, on the authenticated Attach stream, and the language side verifies them
over its private copy, after the copy-out and before the payload exists.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass

import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.poly1305 import Poly1305

from tandem.devices import DTYPES, host_empty
from tandem.transfer.errors import TransferError
from tandem.units import ceil_div
from tandem.v1 import encoder_pb2

AUX_WIDTH = 16
AUX_TOTAL = 0  # tokens of the whole prompt
AUX_MROPE_DELTA = 1  # decode position of token i is i + delta
AUX_PIECE_START = 2  # first token of the piece this block belongs to
AUX_PIECE_TOKENS = 3  # tokens of that piece
AUX_BLOCK_INDEX = 4  # index of this block within the piece
AUX_BLOCK_TOKENS = 5  # valid tokens in this block
AUX_ROOM_LO = 6  # room id, low 32 bits (int32 bit pattern)
AUX_ROOM_HI = 7  # room id, high 32 bits
AUX_EMBED_DIM = 8  # embedding width the writer used
AUX_GENERATION = 9  # the reservation's generation (AttachInit.generation: attempt + 1)
# aux[10:16] reserved, written as 0.


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def room_words(room: int) -> tuple[int, int]:
    """The room id as two int32 bit patterns (low, high)."""
    lo, hi = room & 0xFFFFFFFF, (room >> 32) & 0xFFFFFFFF
    as_i32 = lambda v: v - (1 << 32) if v >= (1 << 31) else v  # noqa: E731
    return as_i32(lo), as_i32(hi)


@dataclass(frozen=True)
class BufferLayout:
    """Plain-data mirror of the `BufferLayout` proto."""

    block_size: int
    embed_dim: int
    dtype: str
    embeddings_addr: int
    fill_ids_addr: int
    mrope_positions_addr: int
    aux_addr: int
    num_blocks: int

    def to_proto(self) -> encoder_pb2.BufferLayout:
        return encoder_pb2.BufferLayout(**self.__dict__)

    @classmethod
    def from_proto(cls, p: encoder_pb2.BufferLayout) -> BufferLayout:
        return cls(**{f: getattr(p, f) for f in cls.__dataclass_fields__})

    @property
    def elem_size(self) -> int:
        if self.dtype not in DTYPES:
            raise TransferError(f"unknown dtype {self.dtype!r}", "INVALID_ARGUMENT")
        return DTYPES[self.dtype].itemsize

    @property
    def embed_row_bytes(self) -> int:
        return self.block_size * self.embed_dim * self.elem_size

    def check_destination(self, room: int, ids: list[int], allocated: int) -> None:
        """Raise INVALID_ARGUMENT unless `ids` are distinct blocks of this pool that hold
        the `allocated` tokens a peer says it reserved for `room`."""
        bs = self.block_size
        if allocated <= 0 or not ids or allocated > len(ids) * bs:
            raise TransferError(f"room {room}: {allocated} tokens reserved in {len(ids)} blocks "
                                f"of {bs}", "INVALID_ARGUMENT")
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad or len(set(ids)) != len(ids):
            raise TransferError(f"room {room}: bad destination block ids {bad or 'duplicates'} "
                                f"(pool of {self.num_blocks})", "INVALID_ARGUMENT")



@dataclass(frozen=True)
class PieceCheck:
    """What a copy-out checks the blocks against: `n_tokens` tokens in `block_ids` (from
    block `first_index` of the piece that starts at prompt token `start` and has
    `piece_tokens` tokens) must carry the aux row their writer stamped for this room's
    attempt (`generation`) of a `total`-token payload. Plain data: it crosses to the
    tensor-parallel ranks as JSON (`asdict`)."""

    block_ids: list[int]
    room: int
    generation: int
    total: int
    start: int
    piece_tokens: int
    n_tokens: int
    first_index: int = 0

class EmbeddingBuffers:
    """The four per-block tensors, allocated (and pre-faulted) once; register them once."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        embed_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        upload_device: str | torch.device = "cpu",
    ) -> None:
        """`upload_device`: where the model runs, which the private rows (`private_embeds`)
        are uploaded to; on CUDA they are page-locked, so the upload is asynchronous."""
        if dtype_name(dtype) not in DTYPES:
            raise ValueError(f"unsupported embedding dtype {dtype}")
        self.num_blocks, self.block_size, self.embed_dim, self.dtype = (
            num_blocks, block_size, embed_dim, dtype,
        )
        self.upload_device = torch.device(upload_device)
        # NOTE: zero_() touches every page now; Mooncake writes into untouched pages run
        # several times slower (page faults on the receiving side).
        mk = lambda shape, dt: torch.empty(shape, dtype=dt, device=device).zero_()  # noqa: E731
        self.embeddings = mk((num_blocks, block_size * embed_dim), dtype)
        self.fill_ids = mk((num_blocks, block_size), torch.int32)
        self.mrope_positions = mk((num_blocks, 3 * block_size), torch.int32)
        self.aux = mk((num_blocks, AUX_WIDTH), torch.int32)
        self._engine = None  # set by register()

    def tensors(self) -> list[torch.Tensor]:
        return [self.embeddings, self.fill_ids, self.mrope_positions, self.aux]

    def private_embeds(self, total: int) -> torch.Tensor:
        """A request's private embedding rows [total, embed_dim], which `gather_into` fills
        and the model's prefill uploads: page-locked when the model runs on CUDA.
        NOTE: the registered blocks stay pageable: they are only ever copied on the host
        (into these rows), never uploaded."""
        if self.embeddings.device.type != "cpu":
            return torch.empty((total, self.embed_dim), dtype=self.dtype,
                               device=self.embeddings.device)
        return host_empty((total, self.embed_dim), self.dtype, self.upload_device)

    def clear(self, block_ids: list[int]) -> None:
        """Zero the blocks' rows in all four buffers. NOTE: called as a room lets its
        blocks go, so a prompt's tokens and embeddings do not stay readable in registered
        memory (another Mooncake peer can read registered memory) after its room ended."""
        if block_ids:
            idx = torch.tensor(block_ids, dtype=torch.long, device=self.embeddings.device)
            for t in self.tensors():
                t.index_fill_(0, idx, 0)

    def register(self, engine) -> None:
        """Register the four buffers with `engine` (a MooncakeEngine); once per instance."""
        if self._engine is not None:
            raise RuntimeError("EmbeddingBuffers are already registered")
        for t in self.tensors():
            engine.register(t)
        self._engine = engine

    def unregister(self) -> None:
        """Undo register(); NOTE: required before dropping the tensors, or Mooncake keeps a
        registration over memory that the allocator may hand out again (overlap error)."""
        if self._engine is not None:
            for t in self.tensors():
                self._engine.unregister(t)
            self._engine = None

    def layout(self) -> BufferLayout:
        return BufferLayout(
            block_size=self.block_size,
            embed_dim=self.embed_dim,
            dtype=dtype_name(self.dtype),
            embeddings_addr=self.embeddings.data_ptr(),
            fill_ids_addr=self.fill_ids.data_ptr(),
            mrope_positions_addr=self.mrope_positions.data_ptr(),
            aux_addr=self.aux.data_ptr(),
            num_blocks=self.num_blocks,
        )

    def aux_rows(self, block_ids: list[int], n_tokens: int) -> torch.Tensor:
        """A private copy of the aux rows of the blocks holding `n_tokens` tokens."""
        nb = ceil_div(n_tokens, self.block_size)
        return self.aux[torch.tensor(block_ids[:nb], dtype=torch.long)]  # (a gather: a copy)

    def check_piece(self, piece: PieceCheck, rows: torch.Tensor | None = None) -> None:
        """Raise DATA_LOSS unless the blocks holding the piece's `n_tokens` tokens carry its
        aux row (in `rows`, a private copy from `aux_rows`, when given; else read now)."""
        p = piece
        aux = rows if rows is not None else self.aux_rows(p.block_ids, p.n_tokens)
        lo, hi = room_words(p.room)
        for i, row in enumerate(aux.tolist()):
            want = {AUX_TOTAL: p.total, AUX_PIECE_START: p.start,
                    AUX_PIECE_TOKENS: p.piece_tokens, AUX_BLOCK_INDEX: p.first_index + i,
                    AUX_ROOM_LO: lo, AUX_ROOM_HI: hi, AUX_EMBED_DIM: self.embed_dim,
                    AUX_GENERATION: p.generation}
            bad = {k: row[k] for k, v in want.items() if row[k] != v}
            if bad:
                raise TransferError(
                    f"room {p.room}: block {p.block_ids[i]} (piece at token {p.start}, index "
                    f"{p.first_index + i}) does not hold this piece's data: aux mismatch {bad} "
                    f"(stale or misdirected write)", "DATA_LOSS")

    def gather_into(
        self,
        block_ids: list[int],
        n_tokens: int,
        out_embeds: torch.Tensor,
        out_fill: torch.Tensor | None,
        out_mrope: torch.Tensor | None,
        start: int,
    ) -> None:
        """Copy `n_tokens` tokens out of `block_ids` (token order) into out[start:start+n]
        (fill ids and positions only where an output for them is given)."""
        bs, d = self.block_size, self.embed_dim
        nb = ceil_div(n_tokens, bs)
        ids = block_ids[:nb]
        i = 0
        while i < nb:  # runs of consecutive block ids are one copy each
            j = i + 1
            while j < nb and ids[j] == ids[j - 1] + 1:
                j += 1
            t0, t1 = i * bs, min(j * bs, n_tokens)
            n, b0, b1 = t1 - t0, ids[i], ids[i] + (j - i)
            a = start + t0
            out_embeds[a : a + n].copy_(self.embeddings[b0:b1].view(-1, d)[:n])
            if out_fill is not None:
                out_fill[a : a + n].copy_(self.fill_ids[b0:b1].reshape(-1)[:n])
            if out_mrope is not None:
                rows = self.mrope_positions[b0:b1].view(j - i, 3, bs).permute(1, 0, 2)
                out_mrope[:, a : a + n].copy_(rows.reshape(3, -1)[:, :n])
            i = j


# ---- row protection -------------------------------------------------------------------
# Keys: the language side picks a fresh 32-byte secret for each Attach attempt and sends it
# in the Init (the internal mTLS stream: never on the data plane). Every range the encoder
# reports (tokens [previous report, sent) of the payload; a few thousand tokens, one chunk)
# gets keys of its own, derived with keyed BLAKE2b over (label, room, generation, start,
# end). Poly1305 keys must never serve two messages: each token is written once per attempt,
# so an attempt never reports one range twice.
#
# The bytes each tag covers (native byte order; every supported platform is little-endian):
#   embeds  embedding rows [n, embed_dim], model dtype, row-major
#   rows    token ids [n] int32 | positions t[n] | h[n] | w[n] int32 | aux rows [nb, 16]
#           int32 of the range's blocks (nb = ceil(n / block_size); a range starts a block)
# The tags are over plaintext: the encoder computes them over its private payload (never
# over its staging copy, which is registered memory too), the language side over its
# private copy after decrypting. `encrypt` adds ChaCha20 under the range's cipher key, one
# nonce per part (embeddings, token ids, each position axis); aux rows stay in the clear
# (no prompt content).
PROTECT_MODES = ("none", "mac", "encrypt")  # in increasing strength
_MODE_PROTO = {"none": encoder_pb2.ROW_PROTECTION_UNSPECIFIED, "mac": encoder_pb2.ROW_PROTECTION_MAC,
               "encrypt": encoder_pb2.ROW_PROTECTION_ENCRYPT}
KEY_BYTES, TAG_BYTES = 32, 16
_MAC_SLICE = 4 << 20
PART_EMBEDS, PART_FILL, PART_MROPE = 0, 1, 2  # cipher nonces; positions axis k uses 2 + k


def host_bytes(t: torch.Tensor):
    """The bytes of `t` in row-major order, as a flat uint8 array: a view of a contiguous
    CPU tensor's own memory (no copy), else a private host copy."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(torch.uint8).reshape(-1).numpy()


def feed_mac(mac: Poly1305, t: torch.Tensor) -> None:
    """mac.update over t's bytes in slices: pyca's Poly1305 holds the GIL while it runs
    (~14 GB/s here), so no single hold outlasts a few hundred microseconds."""
    mem = host_bytes(t)
    for i in range(0, len(mem), _MAC_SLICE):
        mac.update(mem[i : i + _MAC_SLICE])


def _tamper(what: str) -> TransferError:
    return TransferError(f"{what}: the rows do not carry the encoder's tag (written by "
                         f"another process, or changed after the encoder wrote them)",
                         "DATA_LOSS")


@dataclass(frozen=True)
class RangeTag:
    """Plain-data mirror of the `RangeTag` proto: Poly1305 tags of one reported range."""

    embeds: bytes
    rows: bytes

    def to_proto(self) -> encoder_pb2.RangeTag:
        return encoder_pb2.RangeTag(embeds=self.embeds, rows=self.rows)

    @classmethod
    def from_proto(cls, p: encoder_pb2.RangeTag) -> RangeTag | None:
        """The tags, or None unless both have a tag's length (absent or malformed)."""
        if len(p.embeds) != TAG_BYTES or len(p.rows) != TAG_BYTES:
            return None
        return cls(bytes(p.embeds), bytes(p.rows))


@dataclass(frozen=True)
class RangeSeal:
    """The keys of one reported range, payload tokens [start, end) of one attempt.
    `mac_rows` is empty on a tensor-parallel rank > 0 (it holds embeddings only), `cipher`
    unless the rows are encrypted."""

    start: int
    end: int
    mac_embeds: bytes
    mac_rows: bytes = b""
    cipher: bytes = b""

    def tag(self, embeds: torch.Tensor, fill: torch.Tensor, mrope: torch.Tensor,
            aux: torch.Tensor) -> RangeTag:
        """Tags over plaintext rows: embeds [n, D], fill [n], mrope [3, n], aux [nb, 16]."""
        e = Poly1305(self.mac_embeds)
        feed_mac(e, embeds)
        return RangeTag(e.finalize(), self._rows_mac(fill, mrope, aux).finalize())

    def _rows_mac(self, fill: torch.Tensor, mrope: torch.Tensor, aux: torch.Tensor) -> Poly1305:
        m = Poly1305(self.mac_rows)
        for part in (fill, mrope[0], mrope[1], mrope[2], aux):
            feed_mac(m, part)
        return m

    def verify(self, tag: RangeTag, embeds: torch.Tensor, fill: torch.Tensor | None = None,
               mrope: torch.Tensor | None = None, aux: torch.Tensor | None = None,
               where: str = "") -> None:
        """Raise DATA_LOSS unless the private rows carry `tag` (the embeddings alone when
        `fill` is None: a rank > 0). Constant-time comparisons."""
        what = f"{where}tokens [{self.start}, {self.end})"
        e = Poly1305(self.mac_embeds)
        feed_mac(e, embeds)
        try:
            e.verify(tag.embeds)
            if fill is not None:
                self._rows_mac(fill, mrope, aux).verify(tag.rows)
        except InvalidSignature:
            raise _tamper(what) from None

    def _cipher(self, part: int):
        nonce = struct.pack("<IIQ", 0, part, 0)  # block counter 0, then the part
        return Cipher(algorithms.ChaCha20(self.cipher, nonce), mode=None).encryptor()

    def encrypt_into(self, part: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """dst = encrypted src (same bytes count); `dst` a contiguous CPU tensor (staging),
        so plaintext never lands in it."""
        if dst.device.type != "cpu" or not dst.is_contiguous():
            raise ValueError("encrypt_into writes a contiguous CPU tensor")
        self._cipher(part).update_into(host_bytes(src), host_bytes(dst))

    def decrypt_(self, part: int, t: torch.Tensor) -> None:
        """Decrypt `t` in place (a contiguous private tensor)."""
        if t.device.type == "cpu" and t.is_contiguous():
            buf = host_bytes(t)
            self._cipher(part).update_into(buf, buf)
        else:  # NOTE: e.g. CUDA rows: through a host copy
            host = t.cpu().contiguous()
            self.decrypt_(part, host)
            t.copy_(host)

    def for_rank(self, tag: RangeTag) -> dict:
        """What a tensor-parallel rank > 0 needs to open its copy of the range's embeddings
        (JSON-able; sent over the instance's own socket, never the data plane)."""
        return {"start": self.start, "end": self.end, "mac": self.mac_embeds.hex(),
                "cipher": self.cipher.hex(), "tag": tag.embeds.hex()}

    @classmethod
    def of_rank(cls, d: dict) -> tuple[RangeSeal, RangeTag]:
        return (cls(d["start"], d["end"], bytes.fromhex(d["mac"]), b"",
                    bytes.fromhex(d["cipher"])), RangeTag(bytes.fromhex(d["tag"]), b""))


@dataclass(frozen=True)
class RowProtection:
    """One Attach attempt's protection: the mode and the secret (AttachInit.protection,
    .protection_key)."""

    mode: str = "none"
    key: bytes = b""

    @classmethod
    def new(cls, mode: str) -> RowProtection:
        """A fresh secret for one attempt (the language side, at each Init)."""
        if mode not in PROTECT_MODES:
            raise ValueError(f"unknown protection {mode!r} (one of {PROTECT_MODES})")
        return cls(mode, os.urandom(KEY_BYTES) if mode != "none" else b"")

    @classmethod
    def of_init(cls, init: encoder_pb2.AttachInit) -> RowProtection:
        mode = next((m for m, v in _MODE_PROTO.items() if v == init.protection), None)
        if mode is None or (mode != "none") != (len(init.protection_key) == KEY_BYTES):
            raise TransferError(f"room {init.room}: bad protection {init.protection} with a "
                                f"{len(init.protection_key)}-byte key", "INVALID_ARGUMENT")
        return cls(mode, bytes(init.protection_key))

    def init_fields(self) -> dict:
        return {"protection": _MODE_PROTO[self.mode], "protection_key": self.key}

    @property
    def on(self) -> bool:
        return self.mode != "none"

    def at_least(self, mode: str) -> bool:
        return PROTECT_MODES.index(self.mode) >= PROTECT_MODES.index(mode)

    def seal(self, room: int, generation: int, start: int, end: int) -> RangeSeal | None:
        """The keys of payload tokens [start, end) of this attempt (None: unprotected)."""
        if not self.on:
            return None
        header = struct.pack("<QIqq", room, generation, start, end)

        def derive(label: bytes) -> bytes:
            return self.derive(b"tandem-rows-v1", label, header)

        return RangeSeal(start, end, derive(b"mac-embeds"), derive(b"mac-rows"),
                         derive(b"cipher") if self.mode == "encrypt" else b"")

    def derive(self, person: bytes, label: bytes, header: bytes) -> bytes:
        """A one-use key from this attempt's secret: BLAKE2b keyed by it, personalised per
        use (`person`: embedding rows, KV pages), over the key's role (`label`) and what it
        covers (`header`: room, generation, range). The one rule for every derived key."""
        return hashlib.blake2b(label + header, key=self.key, digest_size=KEY_BYTES,
                               person=person).digest()


def open_range(seal: RangeSeal, tag: RangeTag, embeds: torch.Tensor,
               fill: torch.Tensor | None = None, mrope: torch.Tensor | None = None,
               aux: torch.Tensor | None = None, where: str = "") -> None:
    """Decrypt (when encrypted) and verify the private copy of the range's rows: tokens
    [seal.start, seal.end) of `embeds` [L, D], `fill` [L] and `mrope` [3, L] (payload
    token order; fill and mrope None on a rank > 0) and `aux`, the range's blocks' aux rows.
    Raises DATA_LOSS. NOTE: only private memory is read: a write into the registered blocks
    after this cannot reach a prefill."""
    a, b = seal.start, seal.end
    e = embeds[a:b]
    f = fill[a:b] if fill is not None else None
    m = mrope[:, a:b] if mrope is not None else None
    if seal.cipher:
        seal.decrypt_(PART_EMBEDS, e)
        if f is not None:
            seal.decrypt_(PART_FILL, f)
            for k in range(3):
                seal.decrypt_(PART_MROPE + k, m[k])
    seal.verify(tag, e, f, m, aux, where)
