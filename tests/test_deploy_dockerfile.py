"""The Dockerfile runs the same steps as `make` (it cannot be built here: no Docker engine).

Parses the Dockerfile and checks it against the Makefile and pyproject.toml it mirrors, then
runs what can run here for real: `make -n proto` with the Dockerfile's overrides inside a
build context filtered by .dockerignore (the commands make would run in the image), and the
wheel build step on that context (the image's package must carry the generated stubs and the
`tandem` entry point).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
MAKEFILE = (ROOT / "Makefile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@dataclass
class Instr:
    stage: str
    op: str
    args: str


def parse_dockerfile(text: str) -> list[Instr]:
    """Instructions with continuation lines joined and comments dropped, tagged by stage."""
    out, stage, buf = [], "", ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        full = (buf + line).strip()
        buf = ""
        op, _, args = full.partition(" ")
        op = op.upper()
        if op == "FROM":
            m = re.search(r"\bAS\s+(\S+)$", args, re.I)
            stage = m.group(1) if m else args
        out.append(Instr(stage, op, args.strip()))
    assert not buf, "Dockerfile ends inside a continuation"
    return out


INSTR = parse_dockerfile(DOCKERFILE.read_text())


def runs(stage: str) -> list[str]:
    return [i.args for i in INSTR if i.stage == stage and i.op == "RUN"]


def arg_default(name: str, stage: str | None = None) -> str | None:
    for i in INSTR:
        if i.op == "ARG" and (stage is None or i.stage == stage):
            key, _, val = i.args.partition("=")
            if key == name and val:
                return val.strip('"')
    return None


def commands(body: str) -> list[list[str]]:
    """The simple commands of a RUN body, split on && ; || (each with its leading VAR=x)."""
    out, cur = [], []
    for w in shlex.split(body.replace(";", " ; ")):
        if w in ("&&", "||", ";"):
            out.append(cur)
            cur = []
        else:
            cur.append(w)
    out.append(cur)
    return [c for c in out if c]


def make_invocation() -> list[str]:
    """argv of the build stage's one `make` command, without leading env assignments."""
    found = []
    for body in runs("build"):
        for cmd in commands(body):
            argv = list(cmd)
            while argv and re.match(r"^[A-Z_]+=", argv[0]):
                argv.pop(0)
            if argv and argv[0] == "make":
                found.append(argv)
    assert len(found) == 1, found
    return found[0]


def make_var(name: str) -> str:
    m = re.search(rf"^{name}\s*\?=\s*(.+)$", MAKEFILE, re.M)
    assert m, f"Makefile has no overridable {name}"
    return m.group(1).strip()


def make_recipe(target: str) -> list[str]:
    m = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n?)*)", MAKEFILE, re.M)
    assert m, f"Makefile has no {target} rule"
    return [ln.strip() for ln in m.group(1).splitlines()]


# ---- structure -----------------------------------------------------------------------------


def test_multi_stage_with_both_variants():
    froms = [i for i in INSTR if i.op == "FROM"]
    stages = [i.stage for i in froms]
    assert {"base-cuda", "base-cpu", "base", "build", "runtime"} <= set(stages)
    assert stages[-1] == "runtime", "the last stage is the image"
    assert any(i.args.startswith("base-${VARIANT}") for i in froms)
    assert arg_default("VARIANT") in ("cuda", "cpu")
    # The runtime stage copies only the built wheel from the build stage, no build venv.
    copies = [i.args for i in INSTR if i.stage == "runtime" and i.op == "COPY"]
    assert any(c.startswith("--from=build /wheels") for c in copies)
    assert not any("/opt/build" in c for c in copies)


def test_runs_as_the_charts_non_root_user():
    users = [i.args for i in INSTR if i.stage == "runtime" and i.op == "USER"]
    assert users, "runtime stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid not in ("root", "0")
    values = yaml.safe_load((ROOT / "deploy/k8s/tandem/values.yaml").read_text())
    assert int(uid) == values["podSecurityContext"]["runAsUser"]
    assert any(f"--uid {uid}" in r for r in runs("runtime")), "user is never created"


@pytest.mark.parametrize("stage", ["runtime", "router"])
def test_entrypoint_is_the_tandem_console_script(stage):
    (ep,) = [i.args for i in INSTR if i.stage == stage and i.op == "ENTRYPOINT"]
    argv = json.loads(ep)  # exec form: the service is PID 1's child under tini, gets SIGTERM
    assert argv[-1] == "tandem"
    assert argv[:-1] in ([], ["/usr/bin/tini", "--"])
    assert PYPROJECT["project"]["scripts"]["tandem"] == "tandem.cli:main"
    env = " ".join(i.args for i in INSTR if i.stage == stage and i.op == "ENV")
    assert "PATH=/opt/venv/bin:" in env


# ---- the steps make runs -------------------------------------------------------------------


def test_build_stage_runs_make_proto_with_overridable_vars():
    words = make_invocation()
    target = words[1]
    assert target == "proto"
    assert make_recipe("proto") == [], "proto is an alias of the stubs rule"
    assert re.search(r"^proto:\s*tandem/v1/__init__\.py\s*$", MAKEFILE, re.M)
    for override in (w for w in words[2:] if "=" in w):
        make_var(override.split("=")[0])  # every override names a `?=` variable
    assert arg_default("TORCH_SPEC", "build") == make_var("TORCH_SPEC")
    assert arg_default("TORCH_SPEC", "runtime") == make_var("TORCH_SPEC")


def test_runtime_installs_torch_first_then_the_package_under_constraints():
    """Same order and constraint as the Makefile's deps rule: the pinned torch, then the
    package with PIP_CONSTRAINT=constraints.txt (a later step can never swap torch)."""
    deps = make_recipe("$(STAMPS)/deps")
    assert deps.index('$(PIP) install -q "$(TORCH_SPEC)"') < next(
        i for i, ln in enumerate(deps) if ln.startswith("PIP_CONSTRAINT=constraints.txt")
    )
    rs = runs("runtime")
    torch_at = next(i for i, r in enumerate(rs) if "TORCH_SPEC" in r)
    pkg_at = next(i for i, r in enumerate(rs) if "/wheels/tandem-" in r)
    assert torch_at < pkg_at
    assert "PIP_CONSTRAINT=/opt/constraints.txt" in rs[pkg_at]
    assert any(i.args == "constraints.txt /opt/constraints.txt" for i in INSTR if i.op == "COPY")
    assert "python3 -m venv /opt/venv" in rs[torch_at - 1]


def test_system_packages_cover_the_makefiles_sysdeps():
    sysdeps = " ".join(make_recipe("$(STAMPS)/sysdeps"))
    wanted = re.search(r"apt-get install -y -qq ([a-z0-9 .+-]+?);", sysdeps).group(1).split()
    base = " ".join(runs("base"))
    installed = set(re.search(r"--no-install-recommends (.+?) &&", base).group(1).split())
    assert set(wanted) <= installed, f"missing: {set(wanted) - installed}"


def test_cuda_variant_swaps_in_the_cuda_mooncake_from_pyproject():
    server = PYPROJECT["project"]["optional-dependencies"]["server"]
    cpu_pkg = next(d for d in server if d.startswith("mooncake"))
    (cuda_spec,) = [d for d in PYPROJECT["project"]["optional-dependencies"]["cuda"]
                    if d.startswith("mooncake")]
    assert arg_default("MOONCAKE_CUDA_SPEC", "runtime") == cuda_spec
    (swap,) = [r for r in runs("runtime") if "MOONCAKE_CUDA_SPEC" in r]
    uninstall = swap.index(f"uninstall -y -q {re.split(r'[<>=; ]', cpu_pkg)[0]}")
    assert uninstall < swap.index('"$MOONCAKE_CUDA_SPEC"'), "remove the CPU build first"
    assert '[ "$VARIANT" = cuda ]' in swap


def test_grammar_engine_spec_is_one_version_everywhere():
    # the Makefile and the CPU image install it without triton, the cuda extra whole
    (extra,) = [d for d in PYPROJECT["project"]["optional-dependencies"]["cuda"]
                if d.startswith("xgrammar")]
    make = re.search(r"^XGRAMMAR_SPEC := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert arg_default("XGRAMMAR_SPEC", "runtime") == extra == make
    (step,) = [r for r in runs("runtime") if "XGRAMMAR_SPEC" in r]
    assert '--no-deps "$XGRAMMAR_SPEC"' in step and '[ "$VARIANT" = cuda ]' in step


@pytest.mark.parametrize("stage", ["base", "build", "runtime"])
def test_run_steps_are_valid_shell(stage):
    sh = shutil.which("dash") or "/bin/sh"
    for body in runs(stage):
        r = subprocess.run([sh, "-n", "-c", body], capture_output=True, text=True)
        assert r.returncode == 0, f"{body}\n{r.stderr}"


# ---- run what can run here -----------------------------------------------------------------


def _ignored(rel: str, patterns: list[str]) -> bool:
    return any(
        fnmatch.fnmatch(rel, p)
        or rel.startswith(p.rstrip("/") + "/")
        or fnmatch.fnmatch(Path(rel).name, p.removeprefix("**/"))
        for p in patterns
    )


@pytest.fixture(scope="module")
def context(tmp_path_factory) -> Path:
    """The build stage's /src: what its COPY lines take, filtered by .dockerignore."""
    patterns = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    for gen in ("tandem/v1", ".venv", ".stamps"):
        assert _ignored(gen, patterns), f"{gen} would leak into the build context"
    dst = tmp_path_factory.mktemp("ctx")
    for ins in (i for i in INSTR if i.stage == "build" and i.op == "COPY"):
        *srcs, _ = ins.args.split()
        for src in srcs:
            assert not _ignored(src, patterns), f"COPY {src} is excluded by .dockerignore"
            path = ROOT / src
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            for f in files:
                rel = f.relative_to(ROOT).as_posix()
                if not _ignored(rel, patterns):
                    (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(f, dst / rel)
    return dst


def test_make_runs_the_setup_chain_in_the_image_context(context):
    """`make -n` of the Dockerfile's own make line, in the filtered context: the venv, the
    pinned torch first, the package under constraints, then protoc over every proto."""
    args = make_invocation()[1:]
    torch = arg_default("TORCH_SPEC", "build")
    args = [a.replace("${TORCH_SPEC}", torch) for a in args]
    r = subprocess.run(["make", "-n", *args], cwd=context, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    steps = [
        "python3 -m venv /opt/build",
        f'/opt/build/bin/pip install -q "{torch}+cpu"',
        "PIP_CONSTRAINT=constraints.txt /opt/build/bin/pip install -q -e '.[dev]'",
        "/opt/build/bin/python -m grpc_tools.protoc",
    ]
    at = [next(i for i, ln in enumerate(lines) if ln.startswith(s)) for s in steps]
    assert at == sorted(at), r.stdout
    protos = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "protos").rglob("*.proto"))
    assert protos and all(p in lines[at[-1]] for p in protos)


def test_wheel_carries_the_stubs_and_the_entry_point(context, tmp_path):
    """A wheel built from the image's context, which has no stubs (tandem/v1 is never
    copied, nor committed): the build hook (setup.py) generates them from protos/, so the
    wheel holds tandem/v1 and the console script."""
    assert not (context / "tandem" / "v1").exists()
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path), "."],
        cwd=context, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    (whl,) = tmp_path.glob("tandem-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    for mod in ("encoder", "language", "router", "common"):
        assert f"tandem/v1/{mod}_pb2.py" in names and f"tandem/v1/{mod}_pb2_grpc.py" in names
    assert "services/encoder/config.py" in names
    ep = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith("entry_points.txt")))
    assert "tandem = tandem.cli:main" in ep.decode()


@pytest.fixture(scope="module")
def wheel(context, tmp_path_factory) -> Path:
    """The package's wheel, built from the image's context (no stubs in it: the build hook
    makes them)."""
    wheels = tmp_path_factory.mktemp("wheels")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "--wheel-dir", str(wheels), "."],
                       cwd=context, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (whl,) = wheels.glob("tandem-*.whl")
    return whl


@pytest.mark.timeout(600)
def test_client_only_install_imports_no_server_stack(wheel, tmp_path):
    """`pip install tandem` (a wheel built from a clean context) into an empty venv: the
    SDK imports and builds a request without torch, transformers, Mooncake or pydantic
    installed; a server command says, in one line, which install it needs."""
    whl = wheel
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", f"{whl}[client]"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    code = ("import importlib.util as u, sys; import tandem.client as c; "
            "(m,) = c.to_messages([{'role': 'user', 'content': ['hi', c.image(b'png')]}]); "
            "assert m.role == 'user' and len(m.content) == 2; c.Client('127.0.0.1:1').close(); "
            "print([n for n in ('torch', 'transformers', 'mooncake', 'pydantic', 'numpy') "
            "if u.find_spec(n) or n in sys.modules])")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    r = subprocess.run([str(venv / "bin" / "tandem"), "encoder", "--model", "m"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "pip install 'tandem[server]'" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.timeout(600)
def test_router_image_install_serves_without_torch(wheel, tmp_path):
    """The router image's install (`tandem[router]`, the Dockerfile's `router` target) into
    an empty venv: no torch, transformers or Mooncake, and `tandem router` starts and
    answers /health (503: no tier is up)."""
    import httpx

    from tandem.launch.procs import free_port

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                        f"{wheel}[router]"], capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr
    code = ("import importlib.util as u; print([n for n in ('torch', 'transformers', "
            "'mooncake', 'numpy') if u.find_spec(n)])")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True,
                       text=True, timeout=60)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr
    http = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    proc = subprocess.Popen([str(venv / "bin" / "tandem"), "router", "--insecure-internal",
                             "--encoders", "127.0.0.1:1", "--languages", "127.0.0.1:2",
                             "--http-port", str(http), "--grpc-port", str(free_port())],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for _ in range(100):
            try:
                h = httpx.get(f"http://127.0.0.1:{http}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stdout.read().decode()
                time.sleep(0.2)
        assert h.status_code == 503 and h.json()["status"] == "unavailable", h.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_router_target_is_the_router_alone_and_runtime_stays_the_default():
    """`--target router` installs the `router` extra on the plain CPU base (no torch step);
    the full image is still the last stage, what a plain `docker build` makes."""
    stages = [i.stage for i in INSTR]
    assert stages[-1] == "runtime" and "router" in stages
    router_runs = " ".join(runs("router"))
    assert "[router]" in router_runs and "torch" not in router_runs.replace(
        "'torch' not in sys.modules", "")
