"""Every path of csrc/vec16.h computes the same bits (tests/vec16_check.cpp, standalone).

All instruction-set-specific code of the CPU kernels lives in vec16.h; the kernels are
written once over its 16-lane type. Here its operations run on fixed inputs, built for
each path this host can run (native, AVX2 where the native path is AVX-512, generic) and
for aarch64 NEON under qemu where the cross compiler and qemu-user are installed (Debian
`g++-aarch64-linux-gnu qemu-user`; `make check-neon` installs them and runs this file).
The outputs must be identical. (test_cpu_kernels.py checks the whole kernels the same way
across the paths the host can run.)
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tandem.cpu_kernels import cpu_flags

SRC = Path(__file__).with_name("vec16_check.cpp")
FLAGS = ["-O2", "-std=c++17", "-ffp-contract=off", "-fno-math-errno"]


def _run(tmp: Path, name: str, compiler: str, flags: list[str], runner: list[str]) -> list[str]:
    exe = tmp / name
    subprocess.run([compiler, *FLAGS, *flags, str(SRC), "-o", str(exe)], check=True,
                   capture_output=True, timeout=300)
    out = subprocess.run([*runner, str(exe)], check=True, capture_output=True, text=True,
                         timeout=300).stdout.splitlines()
    return out


def _builds() -> dict[str, tuple[str, list[str], list[str], str]]:
    """name -> (compiler, flags, runner prefix, the path the build must report)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return {}
    flags = cpu_flags()
    native = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else None
    if native is None:
        native = "neon" if "asimd" in flags else "generic"
    builds = {"native": (cxx, ["-march=native"], [], native),
              "generic": (cxx, ["-march=native", "-DTANDEM_FORCE_GENERIC"], [], "generic")}
    if native == "avx512":
        builds["avx2"] = (cxx, ["-march=native", "-mno-avx512f"], [], "avx2")
    cross, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if native != "neon" and cross and qemu:
        builds["neon"] = (cross, [], [qemu, "-L", "/usr/aarch64-linux-gnu"], "neon")
    return builds


@pytest.mark.parametrize("path", ["generic", "avx2", "neon"])
def test_vec16_path_gives_the_native_bits(tmp_path, path):
    builds = _builds()
    if "native" not in builds:
        pytest.skip("no C++ compiler")
    if path not in builds:
        pytest.skip(f"{path}: not runnable here (native path {builds['native'][3]}; "
                    "neon needs g++-aarch64-linux-gnu and qemu-user)")
    got = {}
    for name in ("native", path):
        cxx, flags, runner, want = builds[name]
        lines = _run(tmp_path, name, cxx, flags, runner)
        assert lines[0] == f"path {want}", (name, lines[0])
        got[name] = lines[1:]
    assert len(got["native"]) > 20_000
    diff = [(i, a, b) for i, (a, b) in enumerate(zip(got["native"], got[path], strict=True))
            if a != b]
    assert diff == [], f"{path} differs from native at {len(diff)} values, first {diff[:5]}"


def test_every_x86_path_compiles(tmp_path):
    """Where a path cannot run here (AVX-512 on an AVX2 host), it must still compile: a
    syntax or intrinsic error in its branch of vec16.h shows here, not on a user's CPU."""
    import platform

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None or platform.machine() != "x86_64":
        pytest.skip("needs an x86-64 C++ compiler")
    for name, flags in {"avx512": ["-march=x86-64-v4"], "avx2": ["-march=x86-64-v3"],
                        "generic": ["-march=x86-64"]}.items():
        exe = tmp_path / name
        r = subprocess.run([cxx, *FLAGS, *flags, str(SRC), "-o",
                            str(exe)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (name, r.stderr[-2000:])
        strings = exe.read_bytes()
        assert b"path %s" in strings and name.encode() in strings, name
