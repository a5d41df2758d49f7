"""Runs the vision tower over a batch of images: eager, or CUDA graphs over patch buckets.

The tower is split as in SGLang's ViTCudaGraphRunner:

    pixels ─▶ patch_embed (+ learned pos_embed, Qwen3-VL) ─▶ window permute (Qwen2.5-VL)
           ─▶ rotary cos/sin, cu_seqlens                          [outside the graph]
           ─▶ blocks ─▶ merger (+ deepstack mergers, Qwen3-VL)    [inside the graph]
           ─▶ un-permute windows, split per image                 [outside]

Three paths (`RunMode`):
- `eager`: transformers' own block modules with their per-segment attention. Bit-exact with
  `get_image_features` in float32 (the serving path on CPU, and the fallback on CUDA).
- `static`: the block loop a graph records (`_step`), over static buffers, run eagerly on
  any device: the CPU tests of the graph path, and on CUDA the reference a replay equals.
- `graph`: the same step captured as one CUDA graph per `GraphKey`, all at start-up (in the
  constructor), then replayed. Nothing is captured, evicted or retried while serving.

Buckets. A batch of n patches runs in the smallest patch bucket N >= n (`patch_buckets`:
256, 384, 512, 768, ... up to `max_patches`). Rows [n, N) of the buffers are padding: zeros,
cut into segments of merge**2 rows of their own, so no real row attends to a padded one and
the merger's groups of merge**2 rows never mix the two; the features are the first
n / merge**2 merged rows, equal to the unpadded run's. A batch over the largest bucket, or in
a bucket whose capture failed, runs eagerly.

Attention in the step (`StepAttention`, chosen per device and dtype):
- `varlen`: flash attention over the cumulative lengths (torch.nn.attention.varlen; CUDA,
  bf16/fp16). It launches ceil(max_q / block) blocks per segment, so max_q = max_k bound the
  longest segment, known on the host from the grids (no sync): for full attention the
  longest frame, rounded up to a `longest_buckets` bound that is part of the key; for
  Qwen2.5-VL's window attention the patches of one window, a constant of the model.
  NOTE: the cumulative lengths have one length per bucket (N / merge**2 + 1, the most
  segments N patches can make); the unused tail is empty segments, whose blocks exit at once.
- `masked`: one SDPA with a block-diagonal mask built on the device (CUDA otherwise).
- `per_segment`: transformers' own attention module, one SDPA per segment (the CPU, where
  nothing is captured): not capturable (it reads the lengths on the host), and bit-exact
  with the eager path, so the CPU checks the step's buffers, padding and slicing exactly.
Only `varlen` has a bound in its key; the others have one key per patch bucket.

Capture (`graph` mode): every key, largest first, into one memory pool, on a side stream made
on the runner's device, under `torch.cuda.device(runner's device)` and `_CAPTURE_LOCK`, which
one runner at a time holds in the process. A key whose capture fails is logged once, counted
(`stats.failed`) and runs eagerly from then on; the other keys keep their graphs.

Row invariance: in float32 on CPU with one intra-op thread, each output row of the eager path
does not depend on what else is in the batch, so batched results equal one-at-a-time ones.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import functools
import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.utils.generic import get_max_seqlen
from transformers.vision_utils import (
    get_vision_attention_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
    get_vision_window_index,
)

log = logging.getLogger("tandem.encoder")

SMALLEST_BUCKET = 256  # patches: the smallest patch bucket and the smallest longest-segment bound
# NOTE: one capture at a time in the process, whatever the device: two device threads
# capturing at once would each see the other's allocations and syncs inside its capture.
_CAPTURE_LOCK = threading.Lock()


class RunMode(enum.Enum):
    EAGER = "eager"
    STATIC = "static"
    GRAPH = "graph"


class StepAttention(enum.Enum):
    """How the static step attends within segments (module doc)."""

    VARLEN = "varlen"
    MASKED = "masked"
    PER_SEGMENT = "per_segment"


def patch_buckets(max_patches: int, unit: int) -> list[int]:
    """The patch counts a batch is padded up to: each power of two from SMALLEST_BUCKET and
    1.5 times it (padding adds under 50%) below `max_patches`, then `max_patches` rounded up
    to `unit` (merge**2: every image's patch count is a multiple of it)."""
    if max_patches < 1 or unit < 1:
        raise ValueError(f"patch buckets need max_patches >= 1 and unit >= 1, got {max_patches}, {unit}")
    top = -(-max_patches // unit) * unit
    out, p = [], SMALLEST_BUCKET
    while p < top:
        out += [b for b in (p, p * 3 // 2) if b < top and b % unit == 0]
        p *= 2
    return out + [top]


def longest_buckets(patches: int) -> list[int]:
    """Bounds of the longest attention segment in a bucket of `patches`: each power of two
    from SMALLEST_BUCKET below it, then `patches` itself (no segment is longer)."""
    out, p = [], SMALLEST_BUCKET
    while p < patches:
        out.append(p)
        p *= 2
    return out + [patches]


@dataclass(frozen=True, order=True)
class GraphKey:
    """What one graph (one recorded step) is specialised to."""

    patches: int  # rows of the static buffers the step reads (a patch bucket)
    longest: int  # max_q = max_k of full attention (varlen); 0 on the masked path


@dataclass
class GraphStats:
    """What the static and graph paths did; read by tests, bench/vit_graphs.py and metrics."""

    captured: int = 0  # keys recorded: CUDA graphs in `graph` mode, the step in `static` mode
    failed: int = 0  # keys whose capture failed: their batches run eagerly
    replays: int = 0  # batches run through a recorded key
    eager: int = 0  # batches run eagerly: over the largest bucket, or in a failed key
    capture_bytes: int = 0  # device memory reserved while capturing, warm-ups too (CUDA)


@dataclass
class VisionOutput:
    """Features of a batch, image after image in input order."""

    embeds: torch.Tensor  # [tokens, out_hidden]
    deepstack: list[torch.Tensor]  # per deepstack layer [tokens, out_hidden] (Qwen3-VL)


@dataclass
class _Prepared:
    hidden: torch.Tensor  # [N, D] after patch (+pos) embedding, window-permuted
    cos: torch.Tensor
    sin: torch.Tensor
    cu: torch.Tensor  # per-frame segments, int32, on the host
    cu_window: torch.Tensor | None  # Qwen2.5-VL windows, int32, on the host
    max_len: int | None
    max_window_len: int | None
    reverse: torch.Tensor | None  # undoes the window permutation of merged tokens


def _nothing() -> None:
    pass


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` rows of `t`: a view (a graph reads fixed addresses)."""
    return t.narrow(0, 0, n)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope(q, k, cos, sin):
    """Vision rotary embedding, as transformers applies it (in float32)."""
    dq, dk = q.dtype, k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    return (q * cos + _rotate_half(q) * sin).to(dq), (k * cos + _rotate_half(k) * sin).to(dk)


Outputs = tuple[torch.Tensor, list[torch.Tensor]]  # merged features, deepstack features


class _Buffers:
    """The static inputs and outputs of every key's step, sized for the largest bucket: key
    (N, _) reads rows [:N] and cumulative lengths [:N // unit + 1] and writes merged rows
    [:N // unit] (views: fixed addresses). NOTE: a graph keeps no output of its own: what it
    leaves in the shared pool is scratch that any other graph's replay may overwrite."""

    def __init__(self, n: int, d: int, hd: int, unit: int, out: int, deep: int, device,
                 dtype) -> None:
        self.hidden = torch.zeros(n, d, device=device, dtype=dtype)
        self.cos = torch.zeros(n, hd, device=device, dtype=torch.float32)
        self.sin = torch.zeros(n, hd, device=device, dtype=torch.float32)
        self.cu = torch.zeros(n // unit + 1, device=device, dtype=torch.int32)
        self.cu_window = torch.zeros(n // unit + 1, device=device, dtype=torch.int32)
        self.merged = torch.zeros(n // unit, out, device=device, dtype=dtype)
        self.deep = [torch.zeros(n // unit, out, device=device, dtype=dtype) for _ in range(deep)]


class _EagerRecorder:
    """`static` mode: a key's recording is its step itself, run again at every replay."""

    def session(self):
        return contextlib.nullcontext()

    def reserved(self) -> int:
        return 0

    def record(self, step: Callable[[], Outputs]) -> Callable[[], Outputs]:
        step()  # a first run, as a capture's warm-up: a key that cannot run fails here
        return step


class _CudaRecorder:
    """`graph` mode: one CUDA graph per key, on the runner's device, into one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # NOTE: made under the runner's device: a stream made on another device would
        # record nothing of the tower's kernels, and every replay would return the
        # capture's features.
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
            self.pool = torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def session(self):
        with _CAPTURE_LOCK, torch.cuda.device(self.device):
            yield
            torch.cuda.synchronize(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def record(self, step: Callable[[], Outputs]) -> Callable[[], Outputs]:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):  # warm-up (lazy inits, allocator), not recorded
            step()
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        # NOTE: "thread_local": only this thread's unsafe CUDA calls end the capture. Other
        # threads run no GPU work of ours during it (captures happen at start-up, one runner
        # at a time under _CAPTURE_LOCK; the preprocessing threads look text embeddings up on
        # the CPU: pipeline.py), and whatever else does (a library's own thread) works on
        # other streams, which a capture of this stream neither records nor waits on; in the
        # default "global" mode such a call would fail the capture.
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                              capture_error_mode="thread_local"):
            out = step()

        def replay() -> Outputs:
            graph.replay()
            return out

        return replay


class VisionRunner:
    """Owns one vision tower on one device. `run` is called from one thread at a time.

    `max_patches`: the largest patch bucket of the static and graph paths (unused by the
    eager one); `mode`: "eager", "static", "graph", or "auto" (graph on CUDA when
    max_patches > 0, else eager); `attention`: the step's (None: varlen on CUDA in bf16/fp16
    where torch has it, masked elsewhere on CUDA, per_segment on the CPU)."""

    def __init__(self, visual: torch.nn.Module, max_patches: int = 0, mode: str = "auto",
                 attention: StepAttention | None = None,
                 out_dtype: torch.dtype | None = None) -> None:
        self.visual = visual.eval()
        p = next(visual.parameters())
        self.device, self.dtype = p.device, p.dtype
        # the rows' dtype (the payload's); the tower's own when None. A bfloat16 model whose
        # tower was widened to float32 (`cpu_bf16_compute`: a CPU without AMX) runs in
        # float32 and rounds its rows once, here
        self.out_dtype = out_dtype or self.dtype
        self.cfg = visual.config
        self.merge = int(self.cfg.spatial_merge_size)
        self.unit = self.merge * self.merge  # patches per merged token
        self.is_qwen3 = hasattr(visual, "deepstack_merger_list")
        self.deepstack_layers = list(getattr(visual, "deepstack_visual_indexes", []) or [])
        self.full_layers = set(getattr(visual, "fullatt_block_indexes", []) or [])
        # Qwen2.5-VL: a window holds at most (window / merge / patch)**2 merged tokens.
        self.window_patches = 0 if self.is_qwen3 else (
            (visual.window_size // self.merge // visual.patch_size) ** 2 * self.unit)
        cuda = self.device.type == "cuda"
        if mode == "auto":
            mode = "graph" if cuda and max_patches > 0 else "eager"
        try:
            self.mode = RunMode(mode)
        except ValueError:
            raise ValueError(f"mode {mode!r}: one of auto, eager, static, graph") from None
        if self.mode is RunMode.GRAPH and not cuda:
            raise ValueError(f"mode 'graph' is not possible on {self.device}")
        if self.mode is not RunMode.EAGER and max_patches < 1:
            raise ValueError(f"mode {mode!r} needs max_patches >= 1 (its largest bucket)")
        self._lock = threading.Lock()
        # The running call's progress report (`run`'s `on_progress`; none while capturing
        # at construction): written at each call's start, under the lock, by `run` alone
        self._report: Callable[[], None] = _nothing
        self._varlen, self._varlen_kw = None, {}
        if cuda and self.dtype in (torch.bfloat16, torch.float16):
            try:
                from torch.nn.attention.varlen import varlen_attn
            except ImportError:  # an older torch: the masked path
                pass
            else:
                self._varlen = varlen_attn
                # NOTE: one split: a segment's features must not depend on the key's bound
                # (max_k picks the split count otherwise), so a replay equals the static run
                # and a cached image equals a freshly encoded one, whatever its batch.
                if "num_splits" in inspect.signature(varlen_attn).parameters:
                    self._varlen_kw = {"num_splits": 1}
        if attention is None:
            attention = (StepAttention.PER_SEGMENT if not cuda else
                         StepAttention.VARLEN if self._varlen else StepAttention.MASKED)
        if attention is StepAttention.VARLEN and self._varlen is None:
            raise ValueError(f"varlen attention needs CUDA in bf16/fp16 and torch's "
                             f"torch.nn.attention.varlen ({self.device}, {self.dtype})")
        if attention is StepAttention.PER_SEGMENT and self.mode is RunMode.GRAPH:
            raise ValueError("per_segment attention reads lengths on the host: not capturable")
        self.attention = attention
        self.stats = GraphStats()
        self.buckets = [] if self.mode is RunMode.EAGER else patch_buckets(max_patches, self.unit)
        varlen = attention is StepAttention.VARLEN
        self.keys = [GraphKey(n, bound) for n in self.buckets
                     for bound in (longest_buckets(n) if varlen else [0])]
        self.failed_keys: set[GraphKey] = set()
        self._replays: dict[GraphKey, Callable[[], Outputs]] = {}
        if self.keys:
            hd = self.cfg.hidden_size // self.cfg.num_heads
            self._buf = _Buffers(self.buckets[-1], self.cfg.hidden_size, hd, self.unit,
                                 self.cfg.out_hidden_size, len(self.deepstack_layers),
                                 self.device, self.dtype)
            self._record_all(_CudaRecorder(self.device) if self.mode is RunMode.GRAPH
                             else _EagerRecorder())

    # ------------------------------------------------------------------ public
    @torch.inference_mode()
    def run(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]],
            on_progress: Callable[[], None] = _nothing) -> VisionOutput:
        """`on_progress`: called on the running thread after each block (eager and static
        runs) and after each graph replay: the encoder's stall watch
        (EncoderScheduler.stalled_s) takes a call that goes long without one for a hang.
        Must be cheap and never block."""
        with self._lock, self._on_device():
            self._report = on_progress
            prep = self._prepare(pixel_values, grids)
            key = self.key_for(grids)
            replay = self._replays.get(key) if key is not None else None
            if replay is None:
                merged, deep = self._blocks_eager(prep)
                if self.mode is not RunMode.EAGER:
                    self.stats.eager += 1
            else:
                self._load(key, prep)
                merged, deep = replay()
                self._report()
                self.stats.replays += 1
                # clone: the next batch overwrites the buffers; rows past these are padding
                rows = prep.hidden.shape[0] // self.unit
                merged, deep = _rows(merged, rows).clone(), [_rows(d, rows).clone() for d in deep]
            if prep.reverse is not None:
                merged = merged.index_select(0, prep.reverse)
            if self.out_dtype != self.dtype:
                merged, deep = merged.to(self.out_dtype), [d.to(self.out_dtype) for d in deep]
            return VisionOutput(embeds=merged, deepstack=deep)

    def key_for(self, grids: list[tuple[int, int, int]]) -> GraphKey | None:
        """The key a batch of `grids` runs in (None: over the largest bucket, or eager mode),
        from the grids alone: no device sync."""
        n = sum(t * h * w for t, h, w in grids)
        i = bisect.bisect_left(self.buckets, n)
        if i == len(self.buckets):
            return None
        bucket = self.buckets[i]
        if self.attention is not StepAttention.VARLEN:
            return GraphKey(bucket, 0)
        bounds = longest_buckets(bucket)
        longest = max(h * w for _, h, w in grids)  # each frame is a segment of its own
        return GraphKey(bucket, bounds[bisect.bisect_left(bounds, longest)])

    def _on_device(self):
        return torch.cuda.device(self.device) if self.device.type == "cuda" else \
            contextlib.nullcontext()

    # ----------------------------------------------------------- outside graph
    def _prepare(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> _Prepared:
        v, dev = self.visual, self.device
        # The integer layout (positions, segments, windows) is computed on the host, as
        # transformers computes it from a host grid: equal values, and no device sync.
        grid = torch.tensor(grids, dtype=torch.long)
        pos_ids = get_vision_position_ids(grid, self.merge).to(dev)
        cu, max_len = get_vision_attention_seqlens(grid, self.cfg)
        pixels = pixels.to(dev).type(self.dtype)
        hidden = v.patch_embed(pixels)
        n = hidden.shape[0]
        if self.is_qwen3:
            idx, w = get_vision_interpolation_indices_and_weights(
                grid.to(dev),  # NOTE: float weights: on the device, as transformers' tower
                num_grid_per_side=v.num_grid_per_side,
                mode=v.interpolation_mode,
                align_corners=v.interpolation_align_corners,
                spatial_merge_size=self.merge,
            )
            hidden = hidden + (v.pos_embed(idx) * w[:, :, None]).sum(1).to(hidden.dtype)
            cos, sin = v.rotary_pos_emb(hidden, pos_ids)
            return _Prepared(hidden.reshape(n, -1), cos, sin, cu, None, max_len, None, None)
        window_index, cu_window = get_vision_window_index(
            grid,
            spatial_merge_size=self.merge,
            window_size=v.window_size,
            patch_size=v.patch_size,
        )
        max_window = get_max_seqlen(cu_window, self.cfg, kwarg_name="max_window_seqlen")
        hidden = v.permute_input_for_window_attn(hidden, window_index, seq_len=n)
        cos, sin = v.rotary_pos_emb(hidden, pos_ids)
        cos = v.permute_input_for_window_attn(cos, window_index, seq_len=n)
        sin = v.permute_input_for_window_attn(sin, window_index, seq_len=n)
        reverse = torch.argsort(window_index).to(dev)
        return _Prepared(hidden, cos, sin, cu, cu_window, max_len, max_window, reverse)

    # ------------------------------------------------------------ eager blocks
    def _blocks_eager(self, prep: _Prepared) -> Outputs:
        v, h, dev = self.visual, prep.hidden, self.device
        cu = prep.cu.to(dev)
        cu_window = prep.cu_window.to(dev) if prep.cu_window is not None else None
        deep = []
        for i, blk in enumerate(v.blocks):
            if self.is_qwen3 or i in self.full_layers:
                seg, mx = cu, prep.max_len
            else:
                seg, mx = cu_window, prep.max_window_len
            h = blk(h, cu_seqlens=seg, max_seqlen=mx, position_embeddings=(prep.cos, prep.sin))
            self._report()
            if i in self.deepstack_layers:
                deep.append(v.deepstack_merger_list[self.deepstack_layers.index(i)](h))
        return v.merger(h), deep

    # ----------------------------------------------------------- static blocks
    def _cu_len(self, n: int) -> int:
        # Every segment (a frame, a window, a padding segment) holds >= unit patches.
        return n // self.unit + 1

    def _padded_cu(self, cu: torch.Tensor, n: int, bucket: int) -> torch.Tensor:
        """Host cumulative lengths of `n` real patches in a `bucket`: the real segments,
        then padding segments of `unit` rows up to `bucket`, then empty ones (fixed length)."""
        out = torch.full((self._cu_len(bucket),), bucket, dtype=torch.int32)
        out[: cu.numel()] = cu
        pads = torch.arange(n, bucket, self.unit, dtype=torch.int32) + self.unit  # their ends
        out[cu.numel() : cu.numel() + pads.numel()] = pads
        return out

    def _load(self, key: GraphKey, prep: _Prepared) -> None:
        """Copy one batch's inputs into the buffers key `key` reads; zero its padding."""
        b, n, bucket = self._buf, prep.hidden.shape[0], key.patches
        c = self._cu_len(bucket)
        for buf, src in ((b.hidden, prep.hidden), (b.cos, prep.cos), (b.sin, prep.sin)):
            _rows(buf, n).copy_(src)
            buf.narrow(0, n, bucket - n).zero_()
        windows = prep.cu_window if prep.cu_window is not None else prep.cu
        # NOTE: small uploads from pageable memory, which CUDA orders after the stream's
        # earlier work; the stream is idle here (the last batch's features were read back).
        _rows(b.cu, c).copy_(self._padded_cu(prep.cu, n, bucket))
        _rows(b.cu_window, c).copy_(self._padded_cu(windows, n, bucket))

    def _load_dummy(self, key: GraphKey) -> None:
        """A valid layout to record with: segments of `unit` rows over the whole bucket."""
        c = self._cu_len(key.patches)
        segments = torch.arange(0, key.patches + 1, self.unit, dtype=torch.int32)
        _rows(self._buf.cu, c).copy_(segments)
        _rows(self._buf.cu_window, c).copy_(segments)

    def _attention(self, attn, x, cos, sin, cu, longest: int):
        if self.attention is StepAttention.PER_SEGMENT:  # transformers' module (module doc)
            end = int(torch.searchsorted(cu, cu[-1])) + 1  # without the empty tail segments
            return attn(x, cu_seqlens=cu[:end], position_embeddings=(cos, sin))
        n = x.shape[0]
        q, k, val = attn.qkv(x).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = _rope(q, k, cos, sin)
        if self.attention is StepAttention.VARLEN:
            o = self._varlen(q, k, val, cu, cu, longest, longest, scale=attn.scaling,
                             **self._varlen_kw)
        else:  # block-diagonal mask from the (padded) cumulative lengths; graph-safe
            seg = torch.searchsorted(cu[1:], torch.arange(n, device=x.device), right=True)
            mask = (seg[:, None] == seg[None, :])[None, None]
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                val.transpose(0, 1)[None],
                attn_mask=mask,
                scale=attn.scaling,
            )[0].transpose(0, 1)
        return attn.proj(o.reshape(n, -1))

    def _step(self, key: GraphKey) -> Outputs:
        """Features of rows [0, key.patches) of the buffers, into the output buffers: what a
        graph records. Capture-safe: fixed shapes and addresses, no host sync, no host
        tensor."""
        v, n, b = self.visual, key.patches, self._buf
        c = self._cu_len(n)
        h, cos, sin = _rows(b.hidden, n), _rows(b.cos, n), _rows(b.sin, n)
        cu, cu_window = _rows(b.cu, c), _rows(b.cu_window, c)
        deep = []
        for i, blk in enumerate(v.blocks):
            if self.is_qwen3 or i in self.full_layers:
                seg, longest = cu, key.longest
            else:
                seg, longest = cu_window, self.window_patches
            h = h + self._attention(blk.attn, blk.norm1(h), cos, sin, seg, longest)
            h = h + blk.mlp(blk.norm2(h))
            self._report()  # NOTE: host code: a capture runs it once, a replay never
            if i in self.deepstack_layers:
                deep.append(v.deepstack_merger_list[self.deepstack_layers.index(i)](h))
        rows = n // self.unit
        outs = [_rows(b.merged, rows)] + [_rows(d, rows) for d in b.deep]
        for out, got in zip(outs, [v.merger(h), *deep], strict=True):
            out.copy_(got)
        return outs[0], outs[1:]

    # ----------------------------------------------------------------- capture
    @torch.inference_mode()
    def _record_all(self, recorder: _EagerRecorder | _CudaRecorder) -> None:
        """Record every key, largest first (smaller captures reuse the pool's memory)."""
        with recorder.session():
            before = recorder.reserved()
            for key in sorted(self.keys, reverse=True):
                self._load_dummy(key)
                try:
                    self._replays[key] = recorder.record(functools.partial(self._step, key))
                except Exception as e:  # noqa: BLE001  (any failure: this key runs eagerly)
                    self.failed_keys.add(key)
                    self.stats.failed += 1
                    log.warning("ViT graph %s on %s: capture failed (%s: %s); its batches run "
                                "eagerly", key, self.device, type(e).__name__, e)
                else:
                    self.stats.captured += 1
            self.stats.capture_bytes = recorder.reserved() - before
