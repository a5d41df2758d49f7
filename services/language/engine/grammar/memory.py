"""The grammars' memory: the C heap's bytes in use (what a compile grew it by), handing
freed pages back to the OS, and the releaser, where compiled grammars die outside the GIL."""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def heap_bytes() -> int | None:
    """Bytes the C heap holds in use (glibc's mallinfo2: small blocks and mmapped ones);
    None where there is no mallinfo2 (musl, glibc < 2.33)."""
    libc = _libc()
    f = getattr(libc, "mallinfo2", None)
    if f is None:
        return None
    f.restype = _MallInfo2
    m = f()
    return m.uordblks + m.hblkhd


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; else a no-op)."""
    f = getattr(_libc(), "malloc_trim", None)
    if f is not None:
        f(0)


@functools.cache
def _tvm_ffi():
    """xgrammar's object runtime (tvm_ffi) through ctypes, whose calls release the GIL; None
    where it cannot be loaded (the compiled grammars are then freed where they drop)."""
    try:
        import tvm_ffi.libinfo

        lib = ctypes.CDLL(tvm_ffi.libinfo.find_libtvm_ffi())
    except (ImportError, OSError, RuntimeError):
        return None
    for f in (lib.TVMFFIObjectIncRef, lib.TVMFFIObjectDecRef):
        f.argtypes, f.restype = [ctypes.c_void_p], ctypes.c_int
    return lib


def strong_refs(chandle: int) -> int:
    """The strong count of a live tvm_ffi object: the low half of the 64-bit counter that
    heads every object (tvm/ffi/c_api.h, TVMFFIObject.combined_ref_count)."""
    return ctypes.c_uint64.from_address(chandle).value & 0xFFFFFFFF


@dataclass(frozen=True)
class _Held:
    chandle: int  # the C++ object, with a strong reference of the releaser's
    bytes: int  # what the cache charged it (0: never cached)


class Releaser:
    """Where compiled grammars die: on a thread of its own, outside the GIL.

    Freeing a compiled grammar is C++ work in proportion to its size (an 8 MB grammar: 3-4
    ms here, up to 20 ms with the cores contended). Where its last Python reference drops,
    that work runs inside the wrapper's dealloc with the GIL held, so every other thread
    of the process (the engine's step, the gRPC handlers) stops for it; the cache drops
    grammars on the thread that asked for a compile, and a request's end can drop the last
    one on the engine's. So the cache hands each grammar it lets go of here instead
    (`hand`): this thread takes a strong reference to the C++ object through tvm_ffi's C
    API, the Python wrappers then die cheaply (the object outlives them), and once that
    reference is the only one left (no future, matcher or cache holds the grammar) it is
    dropped with a ctypes call, which releases the GIL: the destructor runs beside the
    engine, not in front of it. Measured (a 1,500-value enum's grammar): the longest GIL
    gap another thread saw was 3.6-4.7 ms when the grammar was dropped in Python, 0.1 ms
    when freed here.

    It also hands the freed memory back to the OS (`malloc_trim`, a ctypes call too) once
    `trim_every_bytes()` of charged grammars have been freed since the last time."""

    POLL_S = 0.05  # how often grammars still held elsewhere are looked at again

    def __init__(self, trim_every_bytes: Callable[[], int]) -> None:
        self._trim_every_bytes = trim_every_bytes
        self._lib = _tvm_ffi()
        self._cond = threading.Condition()
        self._held: list[_Held] = []
        self._freed_bytes = 0  # since the last trim
        self._closed = False
        self._thread: threading.Thread | None = None
        self.freed = 0  # grammars freed here
        self.trims = 0

    def hand(self, compiled, charged: int) -> None:
        """Take `compiled` over: from now on this thread frees it, once nothing else holds
        it. The caller may drop its references at once."""
        if self._lib is None or compiled is None:
            return  # freed where the last reference drops
        chandle = compiled._handle.__chandle__()
        self._lib.TVMFFIObjectIncRef(chandle)
        with self._cond:
            self._held.append(_Held(chandle, charged))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="grammar-release",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    @property
    def held(self) -> int:
        """Grammars handed here and not yet freed (some request may still use them)."""
        with self._cond:
            return len(self._held)

    def close(self) -> None:
        """Let go of every grammar held (each freed where its last reference drops)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._closed:
                    self._cond.wait(self.POLL_S if self._held else None)
                ready, kept = [], []
                for h in self._held:  # ours the only reference left: nothing can take one
                    free = self._closed or strong_refs(h.chandle) == 1
                    (ready if free else kept).append(h)
                self._held, closed = kept, self._closed
            for h in ready:  # NOTE: ctypes: the destructor runs without the GIL
                self._lib.TVMFFIObjectDecRef(h.chandle)
                self._freed_bytes += h.bytes
                self.freed += 1
            if self._freed_bytes and self._freed_bytes >= self._trim_every_bytes():
                self._freed_bytes = 0
                trim_heap()
                self.trims += 1
            if closed:
                return
