"""Shared fixtures: tiny checkpoints built once per source version and cached on disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The suite's xdist workers pick ports at random from the same windows: a port one worker
# found free could be bound by the other before its child bound it (seen in CI: a language
# instance's "address already in use"). Each worker takes its own share of the service
# and Mooncake windows (tandem/launch/procs.port_window, read at import by this process
# and by every launcher and tier it starts).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw"):
    _i, _n = int(_WORKER[2:]), max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))

    def _share(lo: int, hi: int) -> str:
        step = (hi - lo) // _n
        return f"{lo + _i * step}-{lo + (_i + 1) * step - 1}"

    os.environ.setdefault("TANDEM_SERVICE_PORTS", _share(28000, 32768))
    os.environ.setdefault("TANDEM_MOONCAKE_PORTS", _share(20000, 28000))

# NOTE: set before torch is imported anywhere in the session. The suite runs several
# processes at once (servers under test, the test process) on a 2-core machine; torch's
# default of one OpenMP thread per core oversubscribes it and slows index/SDPA kernels
# by orders of magnitude. Subprocesses inherit the setting, so cross-process bit-exact
# comparisons run with the same thread count on both sides.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# MKL picks GEMM kernels by matrix size on AVX-512 CPUs, so a row of a batched product
# need not equal the same row computed alone; strict reproducibility mode makes rows
# batch-invariant (the encoder's batched == alone property). Same value as the encoder
# process sets for itself (services/encoder/main.py).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "test-models"
# The compiled flex-attention kernels (torch.compile) in the checkout's own cache, not
# torch's default /tmp/torchinductor_$USER, where every fresh clone (CI's runs) left
# ~160 MB that nothing removed: here they go with the clone, and a developer's repeated
# runs still find them warm. Inductor's precompiled header (150 MB, keyed by the
# compiler's include paths, so one per clone's venv) always goes to /tmp whatever the
# cache dir: it is switched off; the few kernels the suite compiles cost ~10 s more.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "torchinductor"))
os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")


def build_checkpoint(arch: str, size: str = "tiny", seed: int = 0) -> Path:
    """Path of a `tandem tiny-model` checkpoint, built on first use (process-safe)."""
    from tandem.models.tiny import cached_tiny_model

    return cached_tiny_model(CACHE, arch, size, seed)


@pytest.fixture(scope="session")
def checkpoint():
    """`checkpoint(arch, size="tiny", seed=0) -> Path` of a cached tiny checkpoint."""
    return build_checkpoint


def _cuda_devices() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def pytest_report_header(config):
    """Which vector path of the CPU kernels this run tests (csrc/vec16.h), on which CPU."""
    from tandem.cpu_kernels import cpu_model, isa

    return f"cpu kernels: path {isa() or 'unavailable (torch ops)'} on {cpu_model()}"


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow", action="store_true",
        help="also run the tests marked `slow` (`make test-slow` runs only those): variants "
             "that repeat what a faster test already shows, kept out of CI's time",
    )
    parser.addoption(
        "--device", default=None,
        help="run the exactness tests' runner on this device (cpu, cuda, cuda:N); "
             "sets TANDEM_TEST_DEVICE (tests/language_oracle.py), which subprocesses inherit",
    )


def pytest_configure(config):
    import language_oracle

    device = config.getoption("--device")
    if device is not None:
        os.environ[language_oracle.DEVICE_ENV] = device
    try:
        language_oracle.test_device()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


# The longest files, longest first (the totals of a whole run's --durations, which `make
# test` prints): collected first, so that on pytest-xdist workers (`--dist loadfile
# --no-loadscope-reorder`, the Makefile's) they start first and the many short files fill
# in behind them; xdist's own order (most tests first) left a one-minute cluster file for
# last on one worker while the other stood idle. Order only: nothing here is timed.
LONGEST_FIRST = (
    "test_e2e_tp", "test_e2e_video", "test_tensor_parallel", "test_gpu_check",
    "test_e2e_frozen_encoder", "test_deploy_ray", "test_split", "test_language_integrity",
    "test_tp_transfer", "test_split_faults", "test_transfer_faults", "test_up_procs",
    "test_vit_stall", "test_deploy_dockerfile", "test_grammar_memory", "test_e2e_cluster",
    "test_e2e_split", "test_e2e_qwen3_auth", "test_e2e_reuse", "test_e2e_tracing",
    "test_internal_tls", "test_paged_attention", "test_up_restart", "test_hostile_flood",
)


def _longest_first(item) -> int:
    name = item.path.stem
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    slow = None if config.getoption("--run-slow") else pytest.mark.skip(
        reason="slow: run with --run-slow (make test-slow)")
    gpus = _cuda_devices()
    gpu = None if gpus else pytest.mark.skip(reason="needs CUDA")
    two = None if gpus >= 2 else pytest.mark.skip(reason="needs a second GPU")
    for item in items:
        if slow is not None and "slow" in item.keywords:
            item.add_marker(slow)
        if gpu is not None and "gpu" in item.keywords:
            item.add_marker(gpu)
        if two is not None and "multi_gpu" in item.keywords:
            item.add_marker(two)
    items.sort(key=_longest_first)  # stable: each file's own order is kept


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch at one intra-op thread for a whole module (`pytestmark =
    pytest.mark.usefixtures("one_torch_thread")`). NOTE: float32 rows are batch-invariant
    on the CPU only with one thread (MKL splits rows across threads): the encoder runs so
    by default (cpu_threads=1), the transformers oracle must too, so the ViT's sums are
    taken in the same order, and a split's helper (its share alone in the ViT) gives the
    rows of the unsplit encode (all in one batch)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
