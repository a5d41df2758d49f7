"""Refresh constraints.txt, the lock every install of Tandem resolves against.

    python3 deploy/scripts/lock.py [--check]      (`make lock` runs it, then the suite)

What is locked: every distribution that `make setup` puts into the project's venv (the
package's `dev` extra, which holds `server`, `router` and the test tools), resolved afresh
to the newest versions pyproject.toml allows, plus the tools that build and install them
(pip, setuptools, wheel, grpcio-tools) and the few installed beside the resolver's view:
xgrammar (installed `--no-deps`, see the Makefile), the CUDA build of Mooncake (the GPU
image's swap, at the CPU build's version). Everything is pinned with `==`, so the versions
a green CI used are the versions every fresh machine, the oracle venv, the images and the
GPU wheels install (each of them reads this one file).

torch keeps the version the Makefile pins (TORCH_SPEC), without its local label: `==2.13.0`
matches both the `+cpu` build and PyPI's CUDA build, so one lock serves both images.

Nothing is installed: pip resolves with `--dry-run --report` into a throwaway file. The
script prints what changed against the lock it replaces; `--check` only says whether the
lock is complete for what pyproject.toml asks (exit 1 if a direct dependency is unpinned).
`--peer SPEC` locks the peer benchmark's venv (vLLM's CPU build) into its own file instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "constraints.txt"
# Build and install tools: what builds the package (pyproject's build-system) and pip itself.
TOOLS = ["pip", "setuptools>=77", "wheel", "grpcio-tools>=1.70,<2"]
HEADER = """\
# The lock: every distribution a Tandem install resolves, pinned (`make lock` refreshes it
# and runs the suite; deploy/scripts/lock.py says what it covers). Read by `make setup`, the
# oracle venv, the Dockerfile's images and `make gpu-wheels`. Never edit a pin by hand:
# change pyproject.toml's range, then `make lock`, and commit the two with the suite's result.
# torch: the Makefile's TORCH_SPEC, local label dropped (matches the +cpu and CUDA builds).
"""
PEER_LOCK = ROOT / "bench" / "peer-constraints.txt"
PEER_HEADER = """\
# The peer benchmark's lock (vLLM's CPU build in .venv-peer, bench/peer_bench/systems.py):
# `python3 deploy/scripts/lock.py --peer SPEC` refreshes it. Its own file, not constraints.txt:
# the peer takes PyPI's CUDA torch and its own versions of shared packages (transformers...).
"""


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[_canon(name)] = version.strip()
    return pins


def _dry_run(args: list[str], env: dict[str, str]) -> list[dict]:
    """What `pip install --dry-run --ignore-installed ARGS` would install, as pip's report
    lists it (each entry's `metadata`: name, version, requires_dist)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run",
                        "--ignore-installed", "--report", str(report), *args],
                       check=True, env=env)
        return json.loads(report.read_text())["install"]


def _pins(installs: list[dict]) -> dict[str, str]:
    return {_canon(p["metadata"]["name"]): p["metadata"]["version"] for p in installs}


def resolve(torch_spec: str, beside: list[str]) -> dict[str, str]:
    """{name: version} pip picks today for `.[dev]` + the tools, with torch at `torch_spec`,
    and for each spec in `beside` alone (installed `--no-deps`: its dependencies are not
    followed)."""
    with tempfile.TemporaryDirectory() as tmp:
        only_torch = Path(tmp) / "torch.txt"
        only_torch.write_text(torch_spec + "\n")
        # NOTE: the machine's own pip configuration (indexes, a torch cap) stays in force:
        # it is what `make setup` runs under too; only the project's lock is left out.
        env = {**os.environ, "PIP_CONSTRAINT": str(only_torch)}
        pins = _pins(_dry_run([f"{ROOT}[dev]", torch_spec, *TOOLS], env))
        for spec in beside:
            pins.update(_pins(_dry_run(["--no-deps", spec], env)))
    pins.pop("tandem-vlm", None)
    pins = {n: v.split("+", 1)[0] for n, v in pins.items()}  # local labels (+cpu) off
    # the GPU image swaps Mooncake's CPU build for the CUDA one (same module, same release)
    if "mooncake-transfer-engine-non-cuda" in pins:
        pins["mooncake-transfer-engine"] = pins["mooncake-transfer-engine-non-cuda"]
    return pins


def resolve_peer(spec: str) -> dict[str, str]:
    """{name: version} of the peer's venv (bench/peer_bench/systems.py `install_peer`): its
    torch pins, the peer itself, and its requirements less the ones the install skips,
    resolved as that install resolves them (PyPI alone: no local wheels, no torch cap)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from packaging.requirements import Requirement
    from peer_bench.systems import SKIP_REQS, TORCH_PINS, pip_env

    env = pip_env()
    (peer,) = _dry_run(["--no-deps", spec], env)
    reqs = []
    for r in peer["metadata"].get("requires_dist", []):
        q = Requirement(r)
        if q.marker and not q.marker.evaluate({"extra": ""}):
            continue
        if _canon(q.name) not in SKIP_REQS:
            q.marker = None
            reqs.append(str(q))
    pins = _pins(_dry_run(["pip", "packaging", *reqs, *TORCH_PINS], env))
    pins.update(_pins([peer]))
    return pins


def write_lock(pins: dict[str, str], path: Path, header: str = HEADER) -> None:
    path.write_text(header + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))


def changes(old: dict[str, str], new: dict[str, str]) -> list[str]:
    out = []
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        out.append(f"  {name}: " + ("added " + b if a is None else
                                     "removed (was " + a + ")" if b is None else
                                     f"{a} -> {b}"))
    return out


def direct_dependencies() -> list[str]:
    """Every distribution pyproject.toml names (all extras), canonical names."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    names = {_canon(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) for r in reqs}
    return sorted(names - {"tandem-vlm"})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--torch", default="torch==2.13.0", help="the Makefile's TORCH_SPEC")
    p.add_argument("--beside", action="append", default=[], metavar="SPEC",
                   help="a spec make installs with --no-deps (the Makefile's XGRAMMAR_SPEC)")
    p.add_argument("--peer", metavar="SPEC",
                   help="lock the peer benchmark's venv instead (bench/peer-constraints.txt), "
                        "for the peer SPEC (bench/peer.py's --peer-spec)")
    p.add_argument("--check", action="store_true",
                   help="only check that every direct dependency is pinned")
    args = p.parse_args()
    old = read_lock(LOCK)
    if args.check:
        missing = [n for n in direct_dependencies() if n not in old]
        for n in missing:
            print(f"lock: {n} is a dependency of pyproject.toml but has no pin in {LOCK.name}")
        return 1 if missing else 0
    if args.peer:
        path, old = PEER_LOCK, read_lock(PEER_LOCK)
        new = resolve_peer(args.peer)
        write_lock(new, path, PEER_HEADER)
    else:
        path, new = LOCK, resolve(args.torch, args.beside)
        write_lock(new, path)
    diff = changes(old, new)
    print(f"lock: {len(new)} pins in {path.name}; " +
          (f"{len(diff)} changed:" if diff else "nothing changed"))
    print("\n".join(diff))
    return 0


if __name__ == "__main__":
    sys.exit(main())
