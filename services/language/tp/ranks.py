"""Tensor parallelism at run time: the ranks, their process group, and the step each runs.

`tandem language --tp N` is one instance of N processes. Rank 0 is the service (gRPC, the
transfer receiver, scheduler, sampling, detokenization); ranks 1..N-1 are worker processes
it starts itself (`python -m tandem.services.language.tp.worker`), each holding its shard of the
weights (shard.py) and of the KV cache (its KV heads, the same page ids as rank 0).

    rank 0 (cuda:b)                            rank r (cuda:b+r, rank_device)
    start_ranks(): spawn workers ─────────────▶ set_device, init_process_group
    set_device, init_process_group (gloo on    connect to rank 0's control socket
      CPU, NCCL bound to the rank's device) ◀─▶
    load its shard                             load its shard
    ModelRunner(): the same phases on every rank, at once (runner/kv_sizing.py):
      measured steps (collectives) ◀─────────▶ measured steps (collectives)
      KV pages (kv_pages 0): the smallest ◀───▶ (all_reduce MIN)
      KV cache, then the graphs captured ◀────▶ KV cache, graphs (collectives in warm-up)
    ranks.wait_ready(num_pages) ◀──("ready")── its buffers registered; its page count
    every step: runner.forward(batch):
      send the ForwardBatch (plain data,        recv ─▶ runner.forward(batch)
      wire.py: JSON + safetensors, embeddings
      included) ─────────────────────────────▶
      the same forward; all-reduces after o_proj / down_proj / MoE; logits gathered to 0

Embeddings reach every rank straight from the encoder: the Attach Init names each rank's
buffers and the encoder writes every piece to all of them (buffers.py: rank 0 runs the
room and tells the others, over a second socket per rank, when to copy their rows out,
clear blocks, or drop rows); a step then names the rows instead of carrying them. A
payload the ranks do not hold (an engine driven without the receiver: tests, benchmarks)
travels with the step instead.

Failure: a worker that exits (kill -9, crash) or a collective that times out
(`timeout_s`, a hung rank) ends the whole instance: rank 0 logs one line, kills the other
ranks and exits non-zero, so its streams break (the router sees UNAVAILABLE and ejects it)
and its encoders' Attach streams end (their rooms are freed). A worker whose rank 0 is
gone (its control socket closes, or a collective fails) exits. Workers ignore SIGINT and
SIGTERM: rank 0 drains and then stops them.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, Listener
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tandem.services.language.tp import wire

if TYPE_CHECKING:  # NOTE: not imported at run time: a worker imports this module before
    # it joins the process group, so its imports count against the rank's start-up bound
    from tandem.services.language.model.shard import Shard
    from tandem.services.language.tp.buffers import RankBuffers

log = logging.getLogger("tandem.language.tp")


@dataclass(frozen=True)
class RankArgs:
    """What a worker needs to build the same runner as rank 0 (its shard of it)."""

    model: str
    dtype: str  # torch dtype name
    device: str  # rank 0's device; CUDA rank r takes the r-th after it (rank_device)
    runner: dict  # RunnerSettings fields: rank 0's, the same on every rank
    kv_pages: int  # 0: sized from free memory, agreed by the ranks (the smallest)
    kv_memory_fraction: float
    size: int
    dist_address: str  # host:port of the process group's rendezvous
    control_address: str  # host:port of rank 0's control socket
    timeout_s: float
    threads: int
    # Each rank's own embedding buffers, a mirror of rank 0's pool (buffers.py).
    transfer: dict  # TransferConfig fields
    embedding_blocks: int
    embedding_block_size: int
    tracing: dict | None = None  # TracingConfig fields: the ranks' spans (tp.gather)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: on CUDA the rank-th GPU from rank 0's (`--device cuda:2
    --tp 2`: cuda:2 and cuda:3), one GPU per rank; the CPU is shared."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def check_devices(device: torch.device, size: int) -> None:
    """Refuse, before any rank starts, a --tp whose GPUs this host does not have."""
    if device.type != "cuda":
        return
    last, have = rank_device(device, size - 1).index, torch.cuda.device_count()
    if last >= have:
        raise ValueError(f"--tp {size} from {rank_device(device, 0)} needs GPUs "
                         f"{rank_device(device, 0).index}..{last}; this host has {have}")


class TensorParallel:
    """This process's place among the ranks, and the collectives the decoder uses."""

    def __init__(self, rank: int, shard: Shard, device: torch.device) -> None:
        self.rank, self.size, self.shard, self.device = rank, shard.size, shard, device
        self.workers: Ranks | None = None  # rank 0 only

    def agree_min(self, n: int) -> int:
        """The smallest `n` over the ranks (a collective: every rank calls it at once)."""
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """[T, V/N] on each rank -> [T, V] on rank 0 (other ranks get their own slice)."""
        per = self.shard.vocab_per_rank
        if local.shape[1] < per:  # the last rank's slice may be short: pad to equal sizes
            local = torch.nn.functional.pad(local, (0, per - local.shape[1]))
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local.contiguous(), parts, dst=0)
        if self.rank != 0:
            return local
        return torch.cat(parts, dim=1)[:, : self.shard.vocab_size]


# A rank's start (process spawn, torch's import, the group's rendezvous) is bounded by
# max(tp_timeout_s, this): it is seconds of imports that a loaded host stretches, not a
# collective, so a tp_timeout_s sized for hung collectives (a few seconds) must not fail it.
START_TIMEOUT_FLOOR_S = 120.0


def start_timeout_s(timeout_s: float) -> float:
    return max(timeout_s, START_TIMEOUT_FLOOR_S)


def init_group(rank: int, size: int, address: str, device: torch.device, timeout_s: float) -> None:
    """Join the process group from `device` (this rank's, `rank_device`): the rendezvous
    waits start_timeout_s for every rank, the group's collectives then timeout_s. On CUDA
    the process is bound to the device first (set_device: torch.cuda.graph, streams and
    NCCL's own calls use the current device) and NCCL gets it as `device_id` (its
    communicator is made for that GPU, at once)."""
    kw = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kw["device_id"] = device
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=start_timeout_s(timeout_s)))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store,
                            rank=rank, world_size=size, **kw)


class Ranks:
    """Rank 0's handle on the workers: start them, send each step, notice deaths."""

    def __init__(self, args: RankArgs, procs: list[subprocess.Popen], conns: list[Connection],
                 data_conns: list[Connection]) -> None:
        self.args, self.procs, self.conns, self.data_conns = args, procs, conns, data_conns
        self.buffers: RankBuffers | None = None  # set by wait_ready()
        self._stopping = False
        self._watch = threading.Thread(target=self._watch_procs, name="tp-watch", daemon=True)
        self._watch.start()

    def wait_ready(self, num_pages: int) -> None:
        """Returns once every worker has built its runner (they build it while rank 0
        builds its own: the phases meet in collectives) with rank 0's `num_pages`."""
        ready = []
        for r, c in enumerate(self.conns, start=1):
            # NOTE: unbounded, as loading is (a worker that dies is seen by _watch_procs;
            # the collectives on the way are bounded by tp_timeout_s)
            ready.append(wire.decode_json(c.recv_bytes()))
            if not ready[-1].get("ready"):
                self.fail(f"rank {r} did not start")
            if ready[-1]["num_pages"] != num_pages:
                self.fail(f"rank {r} has {ready[-1]['num_pages']} KV pages, rank 0 {num_pages}")
        from tandem.services.language.tp.buffers import RankBuffers

        self.buffers = RankBuffers(self.data_conns, ready, self.fail, self.args.timeout_s)

    def send_step(self, batch) -> None:
        data = wire.encode_step(batch)
        try:
            for c in self.conns:
                c.send_bytes(data)
        except OSError as e:
            self.fail(f"a tensor-parallel rank is gone ({e})")

    def stop(self) -> None:
        """Normal shutdown (after the drain): workers leave their loop and exit."""
        self._stopping = True
        for c in self.conns:
            try:
                c.send_bytes(wire.STOP)
            except OSError:
                pass
        for c in self.data_conns:
            c.close()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()

    def fail(self, reason: str) -> None:
        """End the whole instance: one line, every rank killed, exit non-zero."""
        log.error("tensor parallelism failed: %s; ending this instance (all %d ranks)",
                  reason, self.args.size)
        for p in self.procs:
            p.kill()
        logging.shutdown()
        os._exit(1)

    def _watch_procs(self) -> None:
        while True:
            for r, p in enumerate(self.procs, start=1):
                try:
                    code = p.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    continue
                if not self._stopping:
                    self.fail(f"rank {r} exited with code {code}")
                return


def start_ranks(args: RankArgs, device: torch.device, shard: Shard) -> TensorParallel:
    """Rank 0: spawn ranks 1..N-1, join the process group with them; the caller builds its
    runner with the returned `TensorParallel` (the workers build theirs at the same time)
    and then calls `tp.workers.wait_ready(runner.num_pages)`."""
    check_devices(device, args.size)
    authkey = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    host, port = listener.address
    args = RankArgs(**{**asdict(args), "control_address": f"{host}:{port}"})
    env = {**os.environ, "TANDEM_TP_AUTHKEY": authkey.hex()}  # NOTE: not on the command line
    procs = [
        subprocess.Popen([sys.executable, "-m", "tandem.services.language.tp.worker", str(r),
                          json.dumps(asdict(args))], env=env)
        for r in range(1, args.size)
    ]
    try:
        init_group(0, args.size, args.dist_address, device, args.timeout_s)
        # bounded accept: a rank connects right after it joined the group
        listener._listener._socket.settimeout(start_timeout_s(args.timeout_s))
        conns: list[Connection | None] = [None] * (args.size - 1)
        data_conns: list[Connection | None] = [None] * (args.size - 1)
        for _ in range(2 * (args.size - 1)):  # a step socket and a data socket per rank
            c = listener.accept()
            hello = wire.decode_json(c.recv_bytes())
            (data_conns if hello["channel"] == "data" else conns)[hello["rank"] - 1] = c
    except Exception:
        for p in procs:
            p.kill()
        raise
    finally:
        listener.close()
    tp = TensorParallel(0, shard, device)
    tp.workers = Ranks(args, procs, conns, data_conns)
    return tp
