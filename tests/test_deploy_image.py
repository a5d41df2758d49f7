"""`make image`'s view of the build host (deploy/scripts/image.py; issue 40).

The build itself is opt-in (`make image`, root and buildah, minutes, installs torch) and
`make image-check` runs what it built; here, without building, what the script passes to
`buildah bud` for a given host: nothing on a networked builder with no pip configuration of
its own; on a host like the development machine (a pip.conf naming a CA, local wheel
indexes and find-links, PyTorch's index unresolvable) the pip.conf rewritten to the bound
paths, every local source bound read-only, and TORCH_CPU_INDEX replaced only when its host
does not resolve and the `+cpu` wheel is among the local sources.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "deploy" / "scripts"))
import image  # noqa: E402


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A host whose only pip configuration is the file this fixture writes (`conf`)."""
    conf = tmp_path / "pip.conf"
    monkeypatch.setattr(image, "pip_config_files", lambda: [conf])
    for k in list(os.environ):
        if k.startswith("PIP_"):
            monkeypatch.delenv(k)
    monkeypatch.setattr(image, "WORK", tmp_path / "work")
    return conf


def _resolves(ok: bool):
    def getaddrinfo(name, *a, **k):
        if not ok:
            raise socket.gaierror(f"{name}: no such host")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.1", 443))]
    return getaddrinfo


def _binds(args: list[str]) -> dict[str, str]:
    out = {}
    for flag, val in zip(args, args[1:], strict=False):
        if flag == "-v":
            src, dst, mode = val.split(":")
            assert mode == "ro", val
            out[src] = dst
    return out


def test_a_networked_builder_passes_nothing(host, monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", _resolves(True))
    b = image.BuildHost("torch==2.13.0", None)
    assert b.bud_args() == [] and b.notes == []


def test_this_kind_of_host_passes_its_pip_sources_and_ca(host, tmp_path, monkeypatch):
    wheels, index = tmp_path / "wheels", tmp_path / "pypi" / "simple"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    (index / "numpy").mkdir(parents=True)
    (tmp_path / "pypi" / "files").mkdir()
    ca = tmp_path / "ca.crt"
    ca.write_text("CA")
    host.write_text(f"[global]\ncert = {ca}\nconstraint = /etc/xdg/pip/constraints.txt\n"
                    f"extra-index-url = file://{index} https://mirror.example/simple\n"
                    f"[install]\nfind-links = {wheels}\n")
    monkeypatch.setattr(socket, "getaddrinfo", _resolves(False))
    b = image.BuildHost("torch==2.13.0", None)
    args = b.bud_args()
    binds = _binds(args)
    inside = image.IN_BUILD
    assert binds == {
        str(ca): f"{inside}/ca.crt",
        str(tmp_path / "pypi"): f"{inside}{tmp_path}/pypi",  # the index with its files beside
        str(wheels): f"{inside}{wheels}",
        str(image.WORK / "pip.conf"): "/etc/pip.conf",
    }
    conf = (image.WORK / "pip.conf").read_text().splitlines()
    assert conf[0] == "[global]"
    assert sorted(conf[1:]) == sorted([
        f"cert = {inside}/ca.crt",
        f"extra-index-url = file://{inside}{index} https://mirror.example/simple",
        f"find-links = {inside}{wheels}",
    ])  # the host's constraint (its torch cap) is not passed
    torch_index = args[args.index("--build-arg") + 1]
    assert torch_index == f"TORCH_CPU_INDEX=file://{inside}{index} https://mirror.example/simple"

    # PyPI's torch index resolves: the Dockerfile's default stays
    monkeypatch.setattr(socket, "getaddrinfo", _resolves(True))
    assert "--build-arg" not in image.BuildHost("torch==2.13.0", None).bud_args()
    # named by the caller: passed as given
    given = image.BuildHost("torch==2.13.0", "https://idx.example/cpu").bud_args()
    assert given[:2] == ["--build-arg", "TORCH_CPU_INDEX=https://idx.example/cpu"]


def test_no_local_cpu_torch_and_no_index_is_refused_by_name(host, tmp_path, monkeypatch):
    (tmp_path / "wheels").mkdir()
    host.write_text(f"[global]\nfind-links = {tmp_path / 'wheels'}\n")
    monkeypatch.setattr(socket, "getaddrinfo", _resolves(False))
    with pytest.raises(SystemExit, match="download.pytorch.org does not resolve.*TORCH_CPU_INDEX"):
        image.BuildHost("torch==2.13.0", None)


def test_the_cuda_checks_read_the_dockerfiles_own_stages():
    """check-cuda follows the cuda build's chain of stages and the Dockerfile's own specs."""
    stages = image.dockerfile_stages()
    assert image._stage_chain(stages, "runtime", "cuda") == ["base-cuda", "base", "runtime"]
    assert stages["base-cuda"][0] == "FROM ${CUDA_IMAGE}"
    assert image.dockerfile_arg("MOONCAKE_CUDA_SPEC").startswith("mooncake-transfer-engine")
    assert image.dockerfile_arg("TORCH_SPEC").startswith("torch==")


def test_make_passes_what_it_is_given():
    out = subprocess.run(["make", "-n", "image", "CPU_IMAGE=debian:12",
                          "TORCH_CPU_INDEX=file:///idx", "IMAGE_CONTEXT=/ctx"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    line = " ".join(out.replace("\\\n", " ").split())
    assert "deploy/scripts/image.py build --torch-spec" in line, line
    assert "--base debian:12 --torch-cpu-index file:///idx --context /ctx" in line, line
    plain = subprocess.run(["make", "-n", "image"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout
    assert "--base" not in plain and "--torch-cpu-index" not in plain
