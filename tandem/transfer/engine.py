"""MooncakeEngine: the one Mooncake `TransferEngine` of a process, as tandem uses it.

    engine = MooncakeEngine(config)          # initialize(host, metadata, protocol, device)
    engine.session_id                        # "host:rpc_port", what peers write to
    engine.register(tensor)                  # once per buffer, at start-up
    engine.unregister(tensor)                # NOTE: before the tensor's memory is freed
    engine.write(peer, srcs, dsts, lengths)  # one batch, blocking: run it in an executor
    bid = engine.submit(peer, ...); engine.wait(peer, bid, nbytes)   # the same, split

Mooncake facts this wrapper handles (checked against mooncake-transfer-engine 0.3.13):
- Its RPC/handshake ports listen on all interfaces; MC_MIN_RPC_PORT / MC_MAX_RPC_PORT,
  read at initialize(), confine them to the configured range.
- `batch_transfer_async_write` returns a batch id; 0 means the submit failed and an
  unopenable peer comes back as -1 cast to uint64. Polling either id crashes the process,
  so both are failures and are never polled.
- NOTE: `get_batch_transfer_status` and the sync writes busy-poll in C++ (GIL released)
  until the batch completes, fails, or MC_TRANSFER_TIMEOUT (default 30 s, min 5) passes.
  A write to a frozen peer therefore holds one spinning thread for that long; callers
  must race the write against the control stream and never await it blindly.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from tandem.config import TransferConfig
from tandem.transfer.errors import TransferError

log = logging.getLogger(__name__)

_BAD_BATCH_IDS = (0, (1 << 64) - 1, -1)


class MooncakeEngine:
    """Thin, checked wrapper; every failure is a TransferError naming the peer."""

    def __init__(self, config: TransferConfig) -> None:
        if config.min_port > config.max_port:
            raise ValueError(f"transfer min_port {config.min_port} > max_port {config.max_port}")
        # NOTE: process-wide env, read by initialize(); set before the engine exists.
        os.environ["MC_MIN_RPC_PORT"] = str(config.min_port)
        os.environ["MC_MAX_RPC_PORT"] = str(config.max_port)
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        from mooncake.engine import TransferEngine

        self.config = config
        self._te = TransferEngine()
        rc = self._te.initialize(
            config.host, config.metadata_server, config.protocol, config.device_name
        )
        if rc != 0:
            raise TransferError(
                f"Mooncake initialize({config.host!r}, {config.metadata_server!r}, "
                f"{config.protocol!r}, {config.device_name!r}) returned {rc}", "UNAVAILABLE")
        self.session_id = f"{config.host}:{self._te.get_rpc_port()}"
        self._regions: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def register(self, tensor: torch.Tensor) -> None:
        """Register a contiguous tensor's memory (once per tensor, at start-up)."""
        if not tensor.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
        addr, n = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        location = "cpu:0" if tensor.device.type == "cpu" else f"cuda:{tensor.device.index or 0}"
        with self._lock:
            if any(a == addr for a, _ in self._regions):
                raise RuntimeError(f"memory at {addr:#x} is already registered")
            rc = self._te.register_memory(addr, n, location)
            if rc != 0:
                raise TransferError(f"Mooncake register_memory({addr:#x}, {n}) returned {rc}")
            self._regions.append((addr, n))

    def unregister(self, tensor: torch.Tensor) -> None:
        """Unregister memory registered with `register` (before the tensor is freed)."""
        addr = tensor.data_ptr()
        with self._lock:
            region = next((r for r in self._regions if r[0] == addr), None)
            if region is None:
                raise KeyError(f"memory at {addr:#x} is not registered")
            rc = self._te.unregister_memory(addr)
            if rc != 0:
                raise TransferError(f"Mooncake unregister_memory({addr:#x}) returned {rc}")
            self._regions.remove(region)

    def owns(self, addr: int, length: int) -> bool:
        """True when [addr, addr+length) lies inside one registered region."""
        return any(a <= addr and addr + length <= a + n for a, n in self._regions)

    def submit(self, peer: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> int:
        """Start one batch of writes to `peer`; returns its batch id (never a bad one).
        NOTE: every id returned must be passed to wait() exactly once, or it leaks and the
        source memory stays in use."""
        bid = self._te.batch_transfer_async_write(peer, srcs, dsts, lengths)
        if bid in _BAD_BATCH_IDS:
            raise TransferError(
                f"transfer submit to {peer} failed ({len(srcs)} writes, "
                f"{sum(lengths)} bytes): peer unreachable or addresses rejected", "UNAVAILABLE")
        return bid

    def wait(self, peer: str, bid: int, nbytes: int) -> None:
        """Block until batch `bid` completes; TransferError if it failed or timed out."""
        if self._te.get_batch_transfer_status([bid]) != 0:
            raise TransferError(
                f"transfer write to {peer} failed ({nbytes} bytes): peer gone, timed out, "
                f"or destination outside its registered memory", "UNAVAILABLE")

    def write(self, peer: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> None:
        """One batch of writes to `peer`; blocks until done. Raises TransferError."""
        if srcs:
            self.wait(peer, self.submit(peer, srcs, dsts, lengths), sum(lengths))

    def raw_write(self, peer: str, src: int, dst: int, length: int) -> None:
        """One plain `transfer_sync_write` (the benchmark's baseline)."""
        if self._te.transfer_sync_write(peer, src, dst, length) != 0:
            raise TransferError(f"raw write of {length} bytes to {peer} failed", "UNAVAILABLE")
