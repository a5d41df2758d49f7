"""Host syncs: where code makes the host wait for the device, counted op by op, on a CUDA
device or on a fake one (no GPU needed).

A host sync is an op after which the host holds a value of the device's, so it waits for
every kernel queued before it; inside a CUDA graph capture it is an error. By kind:

    READ        a value read on the host: .item(), int()/bool() of a tensor, .equal()
    TO_HOST     a device tensor copied to host memory (.cpu(), .tolist(), .to("cpu"))
    UPLOAD      a host->device copy that is not non_blocking (torch.tensor(..., device=),
                .to(cuda)): torch synchronises the stream after it
    DATA_SHAPE  an output whose size is read from the values: nonzero, torch.where(cond),
                unique, masked_select, boolean-mask indexing, bincount, repeat_interleave
    CHECKED     a kernel that reads its input back itself: multinomial (its validity
                checks), grouped_mm except its sm90/sm100 bfloat16 kernel (torch 2.13's
                fallback reads the group offsets on the host)

    with HostSyncCounter(regions={"graph": GraphRunner._step}) as counter:
        ...                       # any torch code, real or fake CUDA tensors
    counter.events                # [HostSync(op, kind, region, where)]

`region` names the first of `regions` whose function is on the Python stack when the op
runs (None: none is); `where` is the innermost frame of the project (module:function:line).
An op on CPU tensors is never a sync. The counter is a TorchDispatchMode: it sees every
aten op below Python, and nothing else (a CUDA event's or stream's synchronize is no op;
`torch.cuda.set_sync_debug_mode` is the runtime's own check on a real GPU).

Fake CUDA (`fake_cuda()`): a FakeTensorMode in which "cuda" tensors have shapes, dtypes and
a device but no data, so a CUDA-only code path runs on a machine without a GPU. A torch
built without CUDA has no device guard for CUDA, and its Python bindings open one to index
or move a tensor, so a one-line library registering a no-op guard is compiled once per
machine and environment (csrc/fake_cuda_guard.cpp, where cpu_kernels.py builds). Under
fake tensors an op that needs values cannot run: a READ returns 0 (the count goes on), a
DATA_SHAPE op raises `IncompleteCount` after it is counted (so a count with it is "at
least"). torch's CUDA runtime objects a CPU build lacks are stood in for while the context
is open: `torch.cuda.Event` (record, wait and synchronize do nothing),
`torch.cuda.current_stream`, `torch.cuda.get_device_capability` (9, 0: the fake device is
an H100) and `torch.Generator` (one for "cuda" is a CPU generator; a fake tensor's random
fill ignores it: there are no values to draw). NOTE: a `.tolist()` of a fake device tensor reads it element
by element (one READ each); a real one is one TO_HOST copy. Both are syncs; `.cpu()`
first counts the same on both.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import functools
import hashlib
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
GUARD_SOURCE = Path(__file__).with_name("csrc") / "fake_cuda_guard.cpp"


class SyncKind(enum.Enum):
    """Why an op makes the host wait (the module docstring's table)."""

    READ = "read"
    TO_HOST = "to_host"
    UPLOAD = "upload"
    DATA_SHAPE = "data_shape"
    CHECKED = "checked"


@dataclass(frozen=True)
class HostSync:
    op: str  # the aten op, e.g. "aten._local_scalar_dense.default"
    kind: SyncKind
    region: str | None  # the first `regions` function on the stack, None if none is
    where: str  # the innermost project frame: "module:function:line"

    def __str__(self) -> str:
        inside = f" in region {self.region}" if self.region else ""
        return f"{self.op} ({self.kind.value}) at {self.where}{inside}"


class IncompleteCount(RuntimeError):
    """Raised under fake CUDA by an op whose output size needs the values (it has been
    counted): what follows it cannot run, so the count so far is a lower bound."""


# NOTE: composite ops (item, argwhere, where(cond), to) reach the counter whole under
# torch.inference_mode and decomposed (_local_scalar_dense, nonzero, _to_copy) outside it.
_READS = {aten._local_scalar_dense, aten.item, aten.equal, aten.is_nonzero}
_DATA_SHAPES = {aten.nonzero, aten.nonzero_numpy, aten.argwhere, aten.masked_select,
                aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive,
                aten.bincount}
_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _kind(func, args, kwargs) -> SyncKind | None:
    """The sync `func(*args, **kwargs)` makes, None if it makes none."""
    packet = func.overloadpacket
    first = args[0] if args else None
    on_device = isinstance(first, torch.Tensor) and first.device.type != "cpu"
    if packet in _READS:
        return SyncKind.READ if on_device else None
    if packet in _DATA_SHAPES or func is aten.where.default:  # where(cond): nonzero
        return SyncKind.DATA_SHAPE if on_device else None
    if packet is aten.repeat_interleave:  # repeats as a tensor: the length is their sum
        a = _bind(func, args, kwargs)
        by_tensor = isinstance(a.get("repeats"), torch.Tensor)
        return (SyncKind.DATA_SHAPE if on_device and by_tensor and a.get("output_size") is None
                else None)
    if packet in _INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        masks = any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                    for i in indices or ())
        return SyncKind.DATA_SHAPE if on_device and masks else None
    if packet is aten.multinomial:
        return SyncKind.CHECKED if on_device else None
    if packet is aten._grouped_mm:
        bf16 = all(t.dtype == torch.bfloat16 for t in args[:2])
        return SyncKind.CHECKED if on_device and not bf16 else None
    if packet in (aten._to_copy, aten.to, aten.copy_):
        a = _bind(func, args, kwargs)
        non_blocking = bool(a.get("non_blocking", False))
        if packet is aten.copy_:  # copy_(self=dst, src)
            return _copy_kind(a["src"].device, first.device, non_blocking)
        other = a.get("other")  # to.other: to the device of `other`
        dst = other.device if isinstance(other, torch.Tensor) else a.get("device")
        return _copy_kind(first.device, torch.device(dst or first.device), non_blocking)
    return None


def _bind(func, args, kwargs) -> dict:
    """`func`'s arguments by name (its schema's), defaults left out."""
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _copy_kind(src: torch.device, dst: torch.device, non_blocking: bool) -> SyncKind | None:
    if src.type != "cpu" and dst.type == "cpu":
        return SyncKind.TO_HOST  # even non_blocking: the host waits before it reads it
    if src.type == "cpu" and dst.type != "cpu" and not non_blocking:
        return SyncKind.UPLOAD
    return None


def _dummy_scalar(t: torch.Tensor):
    """What a READ of a fake tensor returns (no value exists)."""
    if t.dtype == torch.bool:
        return False
    return 0.0 if t.dtype.is_floating_point or t.dtype.is_complex else 0


def _project_frame(frame) -> str:
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("tandem.") and name != __name__:
            return f"{name}:{frame.f_code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class HostSyncCounter(TorchDispatchMode):
    """Counts the host syncs of the code run inside it (module docstring)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compiled code runs compiled under the counter, its insides unseen (torch >= 2.9).
        Without this dynamo compiles no frame while the mode is active, and the decode
        step's flex attention would run uncompiled, which no dispatch mode can take (make
        gpu-check's host_syncs would fail so; its CPU dry run takes the gather path). Nothing is missed: a
        host read in compiled code is a graph break, and the code at a break runs eagerly,
        counted; a fullgraph compile (flex's) has none."""
        return True

    def __init__(self, regions: Mapping[str, Callable] | None = None) -> None:
        super().__init__()
        self._regions = {getattr(f, "__func__", f).__code__: name
                         for name, f in (regions or {}).items()}
        self.events: list[HostSync] = []

    def in_region(self, region: str | None) -> list[HostSync]:
        return [e for e in self.events if e.region == region]

    def _region(self, frame) -> str | None:
        found = None
        while frame is not None:  # the outermost region wins: it holds the inner ones
            found = self._regions.get(frame.f_code, found)
            frame = frame.f_back
        return found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func, args, kwargs)
        if kind is not None:
            frame = sys._getframe(1)
            self.events.append(HostSync(str(func), kind, self._region(frame),
                                        _project_frame(frame)))
        if "generator" in kwargs and any(isinstance(a, FakeTensor) for a in args):
            kwargs = {k: v for k, v in kwargs.items() if k != "generator"}  # no values to draw
        try:
            return func(*args, **kwargs)
        except DataDependentOutputException:  # a READ of a fake tensor
            return _dummy_scalar(args[0])
        except DynamicOutputShapeException as e:
            raise IncompleteCount(f"{func} needs the values of a fake tensor") from e


# -- fake CUDA ----------------------------------------------------------------------------


@functools.cache
def _load_cuda_guard() -> None:
    """Build (once per machine and environment) and load the no-op CUDA guard."""
    from torch.utils.cpp_extension import load

    from tandem.cpu_kernels import build_dir, ninja_on_path

    ninja_on_path()
    source = GUARD_SOURCE.read_bytes()
    key = hashlib.sha256(source + torch.__version__.encode() + sys.prefix.encode()).hexdigest()
    name = f"tandem_fake_cuda_guard_{key[:16]}"
    build = build_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    copy = build / GUARD_SOURCE.name
    # NOTE: under an flock (one process builds at a time; the kernel drops it with a dead
    # holder), and a `lock` of torch's left by a killed build is stale (cpu_kernels.py).
    with open(build / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        if not copy.exists() or copy.read_bytes() != source:
            copy.write_bytes(source)
        load(name=name, sources=[str(copy)], build_directory=str(build),
             is_python_module=False, verbose=False)


class _FakeEvent:
    """torch.cuda.Event where torch has no CUDA: records nothing, waits for nothing."""

    def __init__(self, **_kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Generator(torch.Generator):
    """torch.Generator where torch has no CUDA: a CPU one stands in for "cuda" (a type,
    so annotations such as `torch.Generator | None` still evaluate)."""

    def __new__(cls, device="cpu"):
        return _TORCH_GENERATOR("cpu" if torch.device(device).type == "cuda" else device)


_TORCH_GENERATOR = torch.Generator


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """A FakeTensorMode in which tensors made on "cuda" act as CUDA tensors (module
    docstring). On a machine with CUDA the tensors are fake all the same."""
    stand_ins = contextlib.ExitStack()
    if not torch.backends.cuda.is_built():
        _load_cuda_guard()
        stand_ins.enter_context(mock.patch.object(torch.cuda, "Event", _FakeEvent))
        stand_ins.enter_context(mock.patch.object(torch.cuda, "current_stream",
                                                  lambda device=None: None))
        stand_ins.enter_context(mock.patch.object(torch.cuda, "get_device_capability",
                                                  lambda device=None: (9, 0)))
        stand_ins.enter_context(mock.patch.object(torch, "Generator", _Generator))
    with stand_ins, FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode
