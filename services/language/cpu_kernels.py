"""Kernels of our own for the CPU, compiled once per machine with torch's extension builder.

    paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale) -> out
        decode attention that reads KV pages in place (csrc/paged_decode.cpp), instead of
        gathering every row's pages into a workspace in every layer of every step.

The build is keyed by the source, the torch version and this CPU's flags (it is compiled
with -march=native), and cached in $TANDEM_KERNEL_DIR (default ~/.cache/tandem/kernels):
`make setup` builds it ahead (`python -m services.language.cpu_kernels`, ~45 s on two
cores), so no request ever waits for the compiler. Where it cannot be built (no compiler,
no ninja), `paged_decode_op()` returns None once with a warning and the runner keeps the
gather + SDPA path: slower, same results.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import sysconfig
from pathlib import Path

import torch

log = logging.getLogger("tandem.language.kernels")

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build_dir() -> Path:
    root = os.environ.get("TANDEM_KERNEL_DIR") or Path.home() / ".cache" / "tandem" / "kernels"
    return Path(root)


@functools.cache
def paged_decode_op():
    """The compiled `paged_decode_attention`, or None where it cannot be built."""
    # NOTE: torch's builder runs `ninja` from PATH; the venv's own (the `ninja` package)
    # is not on PATH when the interpreter is called by its full path.
    scripts = sysconfig.get_path("scripts")
    if scripts and scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    try:  # no source (an install without it), no compiler, no ninja: keep the SDPA path
        key = hashlib.sha256(
            SOURCE.read_bytes() + Path(__file__).read_bytes() + torch.__version__.encode()
            + _cpu_flags().encode()
        ).hexdigest()[:16]
        name = f"tandem_paged_decode_{key}"
        build = _build_dir() / name
        build.mkdir(parents=True, exist_ok=True)
        from torch.utils.cpp_extension import load

        mod = load(
            name=name,
            sources=[str(SOURCE)],
            build_directory=str(build),
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:
        log.warning("CPU paged-decode kernel unavailable (%s); using gather + SDPA", e)
        return None
    return mod.paged_decode_attention


BACKENDS = ("auto", "gather", "paged_cpu")


def decode_attention_op(backend: str, device: torch.device):
    """The decode attention the runner uses (`AttentionMetadata.decode_op`), by config:

    auto       the in-place kernel on CPU where it builds; gather + SDPA otherwise
    gather     gather + SDPA everywhere (None)
    paged_cpu  the in-place kernel; refused on CUDA or where it cannot be built
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "gather" or (backend == "auto" and device.type != "cpu"):
        return None
    if device.type != "cpu":
        raise ValueError(f"attention_backend paged_cpu runs on the CPU, not on {device}")
    op = paged_decode_op()
    if op is None and backend == "paged_cpu":
        raise ValueError("attention_backend paged_cpu: the kernel could not be built (see log)")
    return op


if __name__ == "__main__":  # `make setup`: build ahead of the first request
    op = paged_decode_op()
    print("paged decode kernel:", "built" if op is not None else "UNAVAILABLE")
    sys.exit(0 if op is not None else 1)
