"""The build hook: a wheel or sdist built from a clean checkout carries the gRPC stubs.

`tandem/v1` (the generated `*_pb2*.py` and `.pyi`) is never committed; `make proto` writes
it for development. Any build (`pip wheel .`, `python -m build`, `pip install .`) runs this
file first, which generates the stubs from `protos/` when they are missing or older than
the protos — before setuptools looks for packages, so `tandem.v1` is found and shipped.

It also names the packages: the repository keeps the tiers at the top (`services/encoder`,
`services/language`, `services/router`: one folder per process), while the distribution
installs them as `tandem.services.*`, so a wheel puts exactly one import name, `tandem`,
into site-packages (a top-level `services` would collide with any user's own). Everything
else about the package is in pyproject.toml.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent


def generate_stubs() -> None:
    protos = sorted((HERE / "protos" / "tandem" / "v1").glob("*.proto"))
    if not protos:  # an sdist unpacked elsewhere: its stubs came with it
        return
    out = HERE / "tandem" / "v1"
    newest = max(p.stat().st_mtime for p in protos)
    stubs = [out / f"{p.stem}_pb2.py" for p in protos]
    if all(s.exists() and s.stat().st_mtime >= newest for s in stubs):
        return
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    cwd = os.getcwd()
    os.chdir(HERE)  # NOTE: protoc writes paths relative to the -I root
    try:
        rc = protoc.main(["protoc", "-Iprotos", f"-I{include}", "--python_out=.",
                          "--pyi_out=.", "--grpc_python_out=.",
                          *(str(p.relative_to(HERE / "protos").as_posix()) for p in protos)])
    finally:
        os.chdir(cwd)
    if rc != 0:
        raise SystemExit(f"setup.py: generating the gRPC stubs from protos/ failed ({rc})")
    (out / "__init__.py").touch()


def packages() -> tuple[list[str], dict[str, str]]:
    """(package names, package_dir): `tandem*` from tandem/, `tandem.services*` from services/,
    and tandem/csrc (the kernels' sources: data, no __init__.py)."""
    tiers = ["tandem.services"] + [f"tandem.services.{p}" for p in find_packages("services")]
    shared = find_packages(include=["tandem", "tandem.*"]) + ["tandem.csrc"]
    return shared + tiers, {"tandem.services": "services"}


generate_stubs()
_packages, _package_dir = packages()
setup(packages=_packages, package_dir=_package_dir)
