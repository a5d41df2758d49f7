"""Tensor parallelism at run time: the ranks, their process group, and the step each runs.

`tandem language --tp N` is one instance of N processes. Rank 0 is the service (gRPC, the
transfer receiver, scheduler, sampling, detokenization); ranks 1..N-1 are worker processes
it starts itself (`python -m tandem.services.language.tp.worker`), each holding its shard of the
weights (shard.py) and of the KV cache (its KV heads, the same page ids as rank 0).

    rank 0                                     rank r (worker.py)
    start_ranks(): spawn workers ─────────────▶ init_process_group
    init_process_group (gloo on CPU, NCCL) ◀──▶ connect to rank 0's control socket
    load its shard, size the KV pool           load its shard
    ranks.start(num_pages) ────("init")───────▶ build its runner ──("ready")──▶
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

import torch
import torch.distributed as dist

from tandem.services.language.model.shard import Shard
from tandem.services.language.tp import wire
from tandem.services.language.tp.buffers import RankBuffers

log = logging.getLogger("tandem.language.tp")


@dataclass(frozen=True)
class RankArgs:
    """What a worker needs to build the same runner as rank 0 (its shard of it)."""

    model: str
    dtype: str  # torch dtype name
    device: str  # rank 0's device; CUDA ranks take cuda:rank
    runner: dict  # RunnerSettings fields: rank 0's, the same on every rank
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
    return torch.device("cuda", rank) if device.type == "cuda" else device


class TensorParallel:
    """This process's place among the ranks, and the collectives the decoder uses."""

    def __init__(self, rank: int, shard: Shard, device: torch.device) -> None:
        self.rank, self.size, self.shard, self.device = rank, shard.size, shard, device
        self.workers: Ranks | None = None  # rank 0 only

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


def init_group(rank: int, size: int, address: str, device: torch.device, timeout_s: float) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))


class Ranks:
    """Rank 0's handle on the workers: start them, send each step, notice deaths."""

    def __init__(self, args: RankArgs, procs: list[subprocess.Popen], conns: list[Connection],
                 data_conns: list[Connection]) -> None:
        self.args, self.procs, self.conns, self.data_conns = args, procs, conns, data_conns
        self.buffers: RankBuffers | None = None  # set by start()
        self._stopping = False
        self._watch = threading.Thread(target=self._watch_procs, name="tp-watch", daemon=True)
        self._watch.start()

    def start(self, num_pages: int) -> None:
        """Every worker builds its runner with `num_pages` KV pages; returns once all have."""
        for c in self.conns:
            c.send_bytes(wire.encode_json({"num_pages": num_pages}))
        ready = []
        for r, c in enumerate(self.conns, start=1):
            ready.append(wire.decode_json(c.recv_bytes()))
            if not ready[-1].get("ready"):
                self.fail(f"rank {r} did not start")
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
    runner with the returned `TensorParallel` and then calls `tp.workers.start(num_pages)`."""
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
        listener._listener._socket.settimeout(args.timeout_s)  # bounded accept
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
