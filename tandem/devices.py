"""Device and dtype names from the config (`--device`, `--dtype`) to torch objects.

The one place both model tiers (and the transfer buffers' layout names) turn a name into
a `torch.device` / `torch.dtype`:

    resolve_device("auto")             cuda if available, else cpu
    resolve_dtype("auto", device)      bfloat16 on CUDA, float32 elsewhere
    DTYPES["bfloat16"]                 the dtypes a payload or a model may have
    host_empty(shape, dtype, device)   host rows uploaded to `device` (pinned for CUDA)
"""

from __future__ import annotations

import torch

# NOTE: the set the configs' `dtype` pattern and the transfer layout accept; a new entry
# must be one that Mooncake can move byte for byte (fixed itemsize, no packing).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    """'auto' is the first CUDA device when there is one, else the CPU; any other name is
    torch's ('cpu', 'cuda', 'cuda:1')."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on CUDA and float32 elsewhere (CPU kernels are fastest and exact
    in float32); any other name is a key of `DTYPES`."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, for_device: torch.device | str
               ) -> torch.Tensor:
    """Host memory for rows that are uploaded to `for_device`: page-locked when that is a
    CUDA device, so a `non_blocking` copy from it is asynchronous (from pageable memory
    CUDA stages the copy and the host waits for the stream); pageable elsewhere (pinning
    needs CUDA). NOTE: page-locked blocks come from torch's caching host allocator, which
    keeps a freed block until the copies recorded on it are done."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.device(for_device).type == "cuda")
