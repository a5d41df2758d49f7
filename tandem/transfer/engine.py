"""MooncakeEngine: the one Mooncake `TransferEngine` of a process, as tandem uses it.

    engine = MooncakeEngine(config)          # initialize(host, metadata, protocol, device)
    engine.session_id                        # "host:rpc_port", what peers write to
    engine.register(tensor)                  # once per buffer, at start-up
    engine.unregister(tensor)                # NOTE: before the tensor's memory is freed
    engine.write(peer, srcs, dsts, lengths)  # blocking (run it in an executor thread)
    started = engine.submit(peer, ...); engine.wait(peer, started)  # the same, split;
    engine.drain(err.pending)                # after a failure, before reusing the source

Mooncake facts this wrapper handles (checked against mooncake-transfer-engine 0.3.13):
- Its RPC/handshake ports listen on all interfaces; MC_MIN_RPC_PORT / MC_MAX_RPC_PORT
  confine them, but Mooncake reads them once per process, when its library loads (the
  first `import mooncake.engine`): later engines keep that range. `port_range` is the
  range in force when this wrapper set it before the load, None when Mooncake was loaded
  earlier (range unknown). Services make one engine per process before anything else
  imports Mooncake, so their configured range applies. A range reaching past 32767 is
  ignored by Mooncake (it falls back to 15000-17000); TransferConfig refuses one.
- A submit returns a batch id; 0 means the submit failed and an unopenable peer comes back
  as -1 cast to uint64. Polling either id crashes the process: both are failures, never
  polled.
- NOTE: `get_batch_transfer_status` and the sync writes busy-poll in C++ until the batch
  ends or MC_TRANSFER_TIMEOUT (30 s default) passes: one core spinning per wait. On a
  2-core host that spin cost more than the whole transfer (56 MiB over loopback: 54 ms
  wall / 32 ms CPU for transfer_sync_write, 32 ms / 10 ms submitted and sleep-polled).
  So writes go out as one async transfer per coalesced region (runs of consecutive blocks
  are one region: a few per chunk, never one per block) and are sleep-polled with
  `transfer_check_status`, which is exact for single-request transfers (it looks at
  request 0 only, so it must never be used on a multi-request batch).
- A write rejected by the peer (address outside its registered memory) can leave the
  other transfers of that session pending until Mooncake's timeout: wait() fails the
  caller at the first failure, and drain() waits the leftovers out separately.
- A transfer to a frozen peer can outlive the room; callers race waits against the
  control stream and keep the source memory untouched until the wait returns.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from tandem.config import TransferConfig
from tandem.transfer.errors import TransferError, TransferStuck

log = logging.getLogger(__name__)

_BAD_BATCH_IDS = (0, (1 << 64) - 1, -1)
# The RPC port range this wrapper applied before Mooncake's library loaded in this process.
_process_port_range: tuple[int, int] | None = None
STUCK_MARGIN_S = 5.0


def _transfer_timeout_s() -> float:
    return max(5.0, float(os.environ.get("MC_TRANSFER_TIMEOUT", "30")))


class MooncakeEngine:
    """Thin, checked wrapper; every failure is a TransferError naming the peer."""

    def __init__(self, config: TransferConfig) -> None:
        if config.min_port > config.max_port:
            raise ValueError(f"transfer min_port {config.min_port} > max_port {config.max_port}")
        # NOTE: process-wide env, read by the first initialize() only.
        global _process_port_range
        wanted = (config.min_port, config.max_port)
        if "mooncake.engine" not in sys.modules:
            os.environ["MC_MIN_RPC_PORT"] = str(config.min_port)
            os.environ["MC_MAX_RPC_PORT"] = str(config.max_port)
            _process_port_range = wanted
        elif _process_port_range != wanted:
            log.warning("transfer port range %s-%s not applied: Mooncake was loaded in this "
                        "process with range %s", *wanted, _process_port_range or "unknown")
        self.port_range = _process_port_range
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        from mooncake.engine import TransferEngine

        self.config = config
        self._te = TransferEngine()
        rc = self._te.initialize(
            config.host, config.metadata_server, config.protocol, config.device_name
        )
        if rc != 0:  # NOTE: also what an exhausted port range gives (see `close`)
            raise TransferError(
                f"Mooncake initialize({config.host!r}, {config.metadata_server!r}, "
                f"{config.protocol!r}, {config.device_name!r}) returned {rc}", "UNAVAILABLE")
        self.session_id = f"{config.host}:{self._te.get_rpc_port()}"
        self._regions: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._opened: set[str] = set()  # peers whose segment `open` fetched (never emptied)
        self._opening: set[str] = set()  # peers `open_soon` is opening now
        self._opener = ThreadPoolExecutor(2, thread_name_prefix="tandem-open")

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

    def close(self, wait: bool = True) -> None:
        """Free Mooncake's engine (its listening ports and threads) once nothing uses it:
        what is still registered is unregistered first. The engine is unusable at once;
        idempotent. `wait=False`: the freeing (Mooncake's destructor takes ~1 s, joining
        its threads) goes on in a daemon thread. NOTE: a stopped service's engine would
        otherwise hold two ports of the transfer range until its process exits, so a
        process that starts and stops services (the test suite, an application embedding
        them) ran out of the range after ~500 (every later initialize returned -1)."""
        with self._lock:
            te, self._te = self._te, None
            regions, self._regions = self._regions, []
        if te is None:
            return
        self._opener.shutdown(wait=False, cancel_futures=True)

        def free() -> None:
            for addr, _ in regions:
                te.unregister_memory(addr)
            # NOTE: the last reference goes with this frame: its destructor closes the ports

        if wait:
            free()
        else:
            threading.Thread(target=free, name="transfer-close", daemon=True).start()

    def owns(self, addr: int, length: int) -> bool:
        """True when [addr, addr+length) lies inside one registered region."""
        return any(a <= addr and addr + length <= a + n for a, n in self._regions)

    def open(self, peer: str) -> bool:
        """Fetch `peer`'s segment (Mooncake's handshake) now, once per peer; True when it is
        open. Blocking: call it off the event loop, as soon as the peer is known alive (it
        just named itself, in an Init). NOTE: measured with the non-CUDA 0.3 build over
        TCP: the first write to a peer does this handshake inside `transfer_submit_write`,
        and to a frozen (SIGSTOPped) peer it blocks ~60 s while holding a lock every other
        submit of this engine waits on, to every peer; once a peer's segment is open, a
        write to it while it is frozen blocks nothing else (tests/test_transfer_frozen_peer.py)."""
        with self._lock:
            te = self._te
            if peer in self._opened:
                return True
        if te is None or te.get_first_buffer_address(peer) == 0:  # closed; or unreachable
            return False
        with self._lock:
            self._opened.add(peer)
        return True

    def open_soon(self, peer: str) -> None:
        """`open(peer)` on a thread of the engine's own, unless it is open or being opened:
        what a writer calls as soon as a peer names itself. A failure is logged, and the
        next call tries again."""
        with self._lock:
            if peer in self._opened or peer in self._opening:
                return
            self._opening.add(peer)

        def opened(f) -> None:
            with self._lock:
                self._opening.discard(peer)
            if f.cancelled() or f.exception() is not None or not f.result():
                log.warning("transfer segment of %s not opened: %s", peer,
                            "cancelled" if f.cancelled() else f.exception() or "unreachable")

        self._opener.submit(self.open, peer).add_done_callback(opened)

    def is_open(self, peer: str) -> bool:
        with self._lock:
            return peer in self._opened

    def submit(self, peer: str, srcs: list[int], dsts: list[int], lengths: list[int]
               ) -> list[tuple[int, int]]:
        """Start writes to `peer`, one Mooncake transfer per (already coalesced) region;
        returns [(transfer id, bytes)]. NOTE: started transfers read their source until
        they end: pass them to wait()/drain() before reusing it. A failed submit raises
        TransferError whose `pending` lists the ones already started."""
        started: list[tuple[int, int]] = []
        for s, d, n in zip(srcs, dsts, lengths, strict=True):
            bid = self._te.transfer_submit_write(peer, s, d, n)
            if bid in _BAD_BATCH_IDS:
                err = TransferError(f"transfer submit to {peer} failed ({n} bytes): peer "
                                    f"unreachable or address rejected", "UNAVAILABLE")
                err.pending = started
                raise err
            started.append((bid, n))
        return started

    def _poll(self, pending: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], int]:
        still, failed = [], 0
        for bid, n in pending:
            rc = self._te.transfer_check_status(bid)  # frees the id once it ends
            if rc == 0:
                still.append((bid, n))
            elif rc != 1:  # -1 failed, -2 timed out: both final
                failed += n
        return still, failed

    def wait(self, peer: str, started: list[tuple[int, int]]) -> None:
        """Sleep-poll until every transfer ended well. On the first failure raises
        TransferError at once, its `pending` listing transfers that have not ended (NOTE:
        a failed write can leave its siblings on the same session pending until Mooncake
        times them out; drain() them before reusing their source)."""
        pending, nap = list(started), 0.0001
        give_up = time.monotonic() + _transfer_timeout_s() + STUCK_MARGIN_S
        while pending:
            pending, failed = self._poll(pending)
            if failed or (pending and time.monotonic() > give_up):
                err = TransferError(
                    f"transfer write to {peer} failed ({failed} of "
                    f"{sum(n for _, n in started)} bytes): peer gone, timed out, or "
                    f"destination outside its registered memory", "UNAVAILABLE")
                err.pending = pending
                raise err
            if pending:
                time.sleep(nap)
                nap = min(nap * 2, 0.001)

    def drain(self, pending: list[tuple[int, int]]) -> bool:
        """Wait for transfers to end, well or not; False if some outlive Mooncake's own
        timeout by STUCK_MARGIN_S (their source memory must then never be reused)."""
        give_up = time.monotonic() + _transfer_timeout_s() + STUCK_MARGIN_S
        while pending:
            pending, _ = self._poll(pending)
            if pending:
                if time.monotonic() > give_up:
                    return False
                time.sleep(0.001)
        return True

    def write(self, peer: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> None:
        """Write and wait (draining leftovers on failure). Raises TransferError."""
        started: list[tuple[int, int]] = []
        try:
            started = self.submit(peer, srcs, dsts, lengths)
            self.wait(peer, started)
        except TransferError as e:
            if not self.drain(getattr(e, "pending", [])):
                raise TransferStuck(f"writes to {peer} never finished", "UNAVAILABLE") from e
            raise

    def raw_write(self, peer: str, src: int, dst: int, length: int) -> None:
        """One plain `transfer_sync_write` (the benchmark's baseline)."""
        if self._te.transfer_sync_write(peer, src, dst, length) != 0:
            raise TransferError(f"raw write of {length} bytes to {peer} failed", "UNAVAILABLE")
