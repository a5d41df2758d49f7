"""The Dockerfile does what `make` does (it cannot be built here: no Docker engine).

The image is built in a dry run (tests/dockersim.py): every stage's RUN steps really run, in
a shell, against a stand-in filesystem and stand-in tools that record each call; so does
`make setup` on a stand-in development machine. The tests compare what the two *do* (the
packages apt installs; what pip installs into which venv, in which order, under which
constraints file) and the config the build leaves (USER, ENTRYPOINT, PATH, EXPOSE), never
the text of either file: reflowing a line, reordering flags or rewording a comment changes
nothing here. What can run here for real does: a wheel built from the image's context
(.dockerignore applied) is installed into clean venvs, where the stages' own import checks
run and `tandem router` from the router image's install serves /health.
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
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
from dockersim import (
    Build,
    Image,
    Pip,
    apt_installed,
    option,
    parse_dockerfile,
    pip_call,
    pip_calls,
    python_checks,
)
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = canonicalize_name(PYPROJECT["project"]["name"])
CONSTRAINTS = (ROOT / "constraints.txt").read_text()
VALUES = yaml.safe_load((ROOT / "deploy/k8s/tandem/values.yaml").read_text())
VARIANTS = ("cuda", "cpu")


# ---- the dry run ---------------------------------------------------------------------------


def _ignored(rel: str, patterns: list[str]) -> bool:
    return any(
        fnmatch.fnmatch(rel, p)
        or rel.startswith(p.rstrip("/") + "/")
        or fnmatch.fnmatch(Path(rel).name, p.removeprefix("**/"))
        for p in patterns
    )


@pytest.fixture(scope="module")
def context(tmp_path_factory) -> Path:
    """The build context as Docker sends it: what the COPY lines take from it, filtered by
    .dockerignore (generated files and local venvs never leak in)."""
    patterns = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    for gen in ("tandem/v1", ".venv", ".stamps"):
        assert _ignored(gen, patterns), f"{gen} would leak into the build context"
    dst = tmp_path_factory.mktemp("ctx")
    for ins in parse_dockerfile(DOCKERFILE.read_text()):
        if ins.op not in ("COPY", "ADD") or "from" in ins.flags:
            continue
        *srcs, _ = shlex.split(ins.args)
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


@dataclass
class Sim:
    default: Build  # `docker build .`
    builds: dict[str, Build]  # by VARIANT
    dev: Image  # a development machine after `make setup`

    def runtime(self, variant: str) -> Image:
        return self.builds[variant].target()

    def image(self, name: str) -> Image:
        """runtime-<variant>, or a stage of the default build (`--target <name>`)."""
        if name.startswith("runtime-"):
            return self.runtime(name.removeprefix("runtime-"))
        return self.default.target(name)


@pytest.fixture(scope="module")
def sim(context, tmp_path_factory) -> Sim:
    work = tmp_path_factory.mktemp("sim")
    wheel = f"{PROJECT.replace('-', '_')}-{PYPROJECT['project']['version']}-py3-none-any.whl"
    default = Build(DOCKERFILE, context, work / "default", wheel=wheel)
    variant = default.globals.get("VARIANT")
    assert variant in VARIANTS, f"default VARIANT {variant!r}"
    builds = {variant: default}
    for other in set(VARIANTS) - {variant}:
        builds[other] = Build(DOCKERFILE, context, work / other, {"VARIANT": other}, wheel=wheel)
    dev = default.host()
    default.run(dev, "make setup")
    return Sim(default, builds, dev)


# ---- reading what the steps did -------------------------------------------------------------


def requirement(arg: str) -> tuple[str, frozenset[str], str]:
    """(name, extras, version specifier) of a pip argument: a requirement, a wheel file, or
    the project's own directory."""
    path, _, extras = arg.partition("[")
    extras = frozenset(e.strip() for e in extras.rstrip("]").split(",") if e.strip())
    if path.endswith(".whl"):
        return canonicalize_name(posixpath.basename(path).split("-")[0]), extras, ""
    if path == "." or path.startswith(("./", "/")):
        return PROJECT, extras, ""
    r = Requirement(arg)
    return canonicalize_name(r.name), frozenset(r.extras), str(r.specifier)


def installs(img: Image, venv: str) -> list[Pip]:
    """The venv's `pip install`s, pip's own upgrade left out."""
    return [p for p in pip_calls(img, venv, "install")
            if {requirement(r)[0] for r in p.reqs} != {"pip"}]


def installing(steps: list[Pip], name: str) -> list[int]:
    return [i for i, p in enumerate(steps) if any(requirement(r)[0] == name for r in p.reqs)]


def the_package(img: Image) -> Pip:
    """The install of the project itself (its wheel, or the source tree in development)."""
    (pkg,) = [p for p in pip_calls(img, action="install")
              if any(requirement(r)[0] == PROJECT for r in p.reqs)]
    return pkg


def spec_of(step: Pip, name: str) -> str:
    (spec,) = [requirement(r)[2] for r in step.reqs if requirement(r)[0] == name]
    return spec


def constraints_in(img: Image, step: Pip) -> str | None:
    return img.path(step.constraint).read_text() if step.constraint else None


def dev_venv(sim: Sim) -> str:
    return the_package(sim.dev).venv


def build_stage(sim: Sim, variant: str) -> Image:
    """The stage the runtime image takes its files from (where the wheel is built)."""
    (name,) = {c.from_stage for c in sim.runtime(variant).copies if c.from_stage}
    return sim.builds[variant].stage(name)


def chowned(img: Image) -> list[tuple[int, list[str]]]:
    """(owner uid, paths) of each recursive chown."""
    out = []
    for c in img.calls:
        if c.tool == "chown" and ({"-R", "--recursive"} & set(c.argv)):
            owner, *paths = [a for a in c.argv[1:] if not a.startswith("-")]
            user = owner.split(":")[0]
            if not user.isdigit():
                (user,) = [option(u.argv[1:], "-u", "--uid") for u in img.calls
                           if u.tool == "useradd" and u.argv[-1] == user]
            out.append((int(user), paths))
    return out


# ---- the image's config --------------------------------------------------------------------


def test_default_build_is_the_full_image_on_the_variants_base(sim):
    """A plain `docker build` makes the full image (the server install, torch); VARIANT picks
    a CUDA base or a plain one; the runtime image takes only the wheel from the build stage
    (no build venv, no sources)."""
    default = sim.default.target()
    assert requirement(the_package(default).reqs[0])[1] == {"server"}
    assert installing(installs(default, the_package(default).venv), "torch")
    assert "cuda" in sim.runtime("cuda").base and "cuda" not in sim.runtime("cpu").base
    for variant in VARIANTS:
        img, build = sim.runtime(variant), build_stage(sim, variant)
        taken = [f for c in img.copies if c.from_stage for f in c.files]
        assert taken and all(f.endswith(".whl") for f in taken), taken
        (wheel,) = pip_calls(build, action="wheel")
        assert not img.exists(wheel.venv), "the build venv is in the runtime image"
        assert not img.exists(posixpath.join(build.workdir, "protos"))


@pytest.mark.parametrize("name", ["runtime-cuda", "runtime-cpu", "router"])
def test_runs_as_the_charts_non_root_user(sim, name):
    """The image's USER is the chart's podSecurityContext user (and group), created by the
    build; the runtime's writable caches (HF_HOME, the kernel dir) belong to it."""
    img = sim.image(name)
    uid = img.uid()
    assert uid != 0, f"{name} runs as root"
    assert uid == VALUES["podSecurityContext"]["runAsUser"]
    if ":" in img.user:
        assert int(img.user.split(":")[1]) == VALUES["podSecurityContext"]["runAsGroup"]
    created = [int(option(c.argv[1:], "-u", "--uid") or -1) for c in img.calls
               if c.tool == "useradd"]
    assert uid in created, f"user {uid} is never created"
    for var in ("HF_HOME", "TANDEM_KERNEL_DIR") if name.startswith("runtime") else ():
        path = img.env[var]
        assert any(owner == uid and any(path == p or path.startswith(p.rstrip("/") + "/")
                                        for p in paths)
                   for owner, paths in chowned(img)), f"{var}={path} is not {uid}'s"


@pytest.mark.parametrize("name", ["runtime-cuda", "runtime-cpu", "router"])
def test_entrypoint_is_the_tandem_console_script(sim, name):
    """Exec form (no shell in between: the service gets SIGTERM, through tini when there is
    one), running the `tandem` console script of the venv the wheel went into."""
    img = sim.image(name)
    argv = list(img.entrypoint or [])
    assert argv and argv[:2] != ["/bin/sh", "-c"], f"{name}: ENTRYPOINT is not in exec form"
    if posixpath.basename(argv[0]) == "tini":
        assert img.which(argv[0]), "tini is not installed"
        argv = argv[argv.index("--") + 1:] if "--" in argv else argv[1:]
    assert argv == ["tandem"]
    assert img.which("tandem") == posixpath.join(the_package(img).venv, "bin", "tandem")
    assert PYPROJECT["project"]["scripts"]["tandem"] == "tandem.cli:main"


def test_exposed_ports_are_the_services_defaults(sim):
    """The ports the images declare include the services' own defaults (the router's HTTP
    and gRPC; each tier's gRPC in the full image)."""
    from tandem.services.encoder.config import EncoderConfig
    from tandem.services.language.config import LanguageConfig
    from tandem.services.router.config import RouterConfig

    router = {RouterConfig.model_fields[f].default for f in ("http_port", "grpc_port")}
    tiers = {c.model_fields["port"].default for c in (EncoderConfig, LanguageConfig)}
    for variant in VARIANTS:
        assert router | tiers <= sim.runtime(variant).exposed
    assert router <= sim.image("router").exposed


# ---- the steps, against make's -------------------------------------------------------------


def test_build_stage_generates_the_stubs_with_make_setups_chain(sim):
    """The build stage runs make (as development does): a venv, the pinned torch first (its
    CPU build: stubs need no GPU, from the CPU wheel index), the project with its dev extra
    under constraints.txt, the grammar engine as make installs it, then protoc over every
    proto; the wheel is built after that, by that venv (so make's overrides took effect)."""
    build = build_stage(sim, "cuda")
    assert [c.tool for c in build.calls].count("make") == 1
    (wheel,) = pip_calls(build, action="wheel")
    steps, dev = installs(build, wheel.venv), installs(sim.dev, dev_venv(sim))
    assert installing(steps, "torch") == installing(dev, "torch") == [0]
    assert spec_of(steps[0], "torch") == spec_of(dev[0], "torch") + "+cpu"
    cpu = installs(sim.runtime("cpu"), the_package(sim.runtime("cpu")).venv)
    (cpu_torch,) = [cpu[i] for i in installing(cpu, "torch")]
    assert steps[0].extra_index and steps[0].extra_index == cpu_torch.extra_index
    for a, b in zip(steps[1:], dev[1:], strict=True):
        assert ([requirement(r) for r in a.reqs], a.no_deps, constraints_in(build, a)) == (
            [requirement(r) for r in b.reqs], b.no_deps, constraints_in(sim.dev, b))
    (pkg_at,) = installing(steps, PROJECT)
    assert constraints_in(build, steps[pkg_at]) == CONSTRAINTS
    calls = build.calls
    (protoc,) = [i for i, c in enumerate(calls) if c.argv[1:3] == ["-m", "grpc_tools.protoc"]]
    c = calls[protoc]
    assert c.argv[0] == posixpath.join(wheel.venv, "bin", posixpath.basename(c.argv[0]))
    compiled = {posixpath.relpath(posixpath.join(c.cwd, a), build.workdir) for a in c.argv
                if a.endswith(".proto")}
    protos = {p.relative_to(ROOT).as_posix() for p in (ROOT / "protos").rglob("*.proto")}
    assert protos and compiled == protos
    assert protoc < next(i for i, c in enumerate(calls)
                         if (p := pip_call(c)) and p.action == "wheel")


@pytest.mark.parametrize("variant", VARIANTS)
def test_runtime_installs_torch_first_then_the_package_under_constraints(sim, variant):
    """Same order and constraints as make's deps: the pinned torch (make's version; the cpu
    variant its +cpu build), then the package with constraints.txt in force, and no later
    step installs torch again."""
    img = sim.runtime(variant)
    steps, dev = installs(img, the_package(img).venv), installs(sim.dev, dev_venv(sim))
    for s in (steps, dev):
        assert installing(s, "torch") == [0], "torch is not installed first, once"
        (pkg_at,) = installing(s, PROJECT)
        assert pkg_at > 0
    local = "+cpu" if variant == "cpu" else ""
    assert spec_of(steps[0], "torch") == spec_of(dev[0], "torch") + local
    if variant == "cpu":
        assert steps[0].extra_index, "the +cpu build is only on PyTorch's CPU index"
    (pkg_at,) = installing(steps, PROJECT)
    assert requirement(steps[pkg_at].reqs[0])[1] == {"server"}
    assert constraints_in(img, steps[pkg_at]) == CONSTRAINTS
    assert constraints_in(sim.dev, dev[installing(dev, PROJECT)[0]]) == CONSTRAINTS


@pytest.mark.parametrize("variant", VARIANTS)
def test_system_packages_cover_the_makefiles_sysdeps(sim, variant):
    """What `make setup` apt-installs on a host without libibverbs, the image has."""
    wanted = apt_installed(sim.dev)
    assert wanted, "make setup installed no system package on a bare host"
    assert wanted <= apt_installed(sim.runtime(variant))


def test_cuda_variant_swaps_in_the_cuda_mooncake_from_pyproject(sim):
    """The cuda image removes the server extra's CPU Mooncake after installing the package
    and only then installs the cuda extra's (the two share a module); the cpu image keeps
    the CPU one."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    (cpu_name,) = [requirement(d)[0] for d in extras["server"] if d.startswith("mooncake")]
    (cuda_req,) = [requirement(d) for d in extras["cuda"] if d.startswith("mooncake")]
    for variant in VARIANTS:
        img = sim.runtime(variant)
        venv = the_package(img).venv
        seq = [(p.action, requirement(r)) for p in pip_calls(img, venv) for r in p.reqs]
        pkg = next(i for i, (a, r) in enumerate(seq) if a == "install" and r[0] == PROJECT)
        removed = [i for i, (a, r) in enumerate(seq) if a == "uninstall" and r[0] == cpu_name]
        cuda = [i for i, (a, r) in enumerate(seq) if a == "install" and r[0] == cuda_req[0]]
        if variant == "cuda":
            assert len(removed) == 1 and len(cuda) == 1, seq
            assert pkg < removed[0] < cuda[0], "remove the CPU build first, then install"
            assert seq[cuda[0]][1] == cuda_req
        else:
            assert not removed and not cuda, seq


def test_grammar_engine_spec_is_one_version_everywhere(sim):
    """The cuda extra's xgrammar: whole (with triton) in the cuda image, without its
    dependencies in the cpu image and in make's setup."""
    (extra,) = [requirement(d) for d in PYPROJECT["project"]["optional-dependencies"]["cuda"]
                if d.startswith("xgrammar")]
    for img, venv, no_deps in (
        (sim.runtime("cuda"), the_package(sim.runtime("cuda")).venv, False),
        (sim.runtime("cpu"), the_package(sim.runtime("cpu")).venv, True),
        (sim.dev, dev_venv(sim), True),
    ):
        steps = installs(img, venv)
        (at,) = installing(steps, extra[0])
        assert spec_of(steps[at], extra[0]) == extra[2]
        assert steps[at].no_deps is no_deps, img.name


RUN_STAGES = sorted({i.stage for i in parse_dockerfile(DOCKERFILE.read_text()) if i.op == "RUN"})


@pytest.mark.parametrize("stage", RUN_STAGES)
def test_run_steps_are_valid_shell(stage):
    """Every RUN step parses, branches the dry run does not take included."""
    sh = shutil.which("dash") or "/bin/sh"
    for ins in parse_dockerfile(DOCKERFILE.read_text()):
        if ins.stage == stage and ins.op == "RUN" and not ins.args.startswith("["):
            r = subprocess.run([sh, "-n", "-c", ins.args], capture_output=True, text=True)
            assert r.returncode == 0, f"{ins.args}\n{r.stderr}"


# ---- run what can run here -----------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(context, tmp_path_factory) -> Path:
    """The package's wheel, built from the image's context (no stubs in it: the build hook
    makes them)."""
    assert not (context / "tandem" / "v1").exists()
    wheels = tmp_path_factory.mktemp("wheels")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "--wheel-dir", str(wheels), "."],
                       cwd=context, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (whl,) = wheels.glob(f"{PROJECT.replace('-', '_')}-*.whl")
    return whl


def test_wheel_carries_the_stubs_and_the_entry_point(wheel):
    """A wheel built from the image's context, which has no stubs (tandem/v1 is never
    copied, nor committed): the build hook (setup.py) generates them from protos/, so the
    wheel holds tandem/v1, the tiers under tandem/services, the console script, and every
    source the CPU kernels are compiled from on the serving machine (headers included: an
    image without csrc/vec16.h would serve with torch's ops only)."""
    names = zipfile.ZipFile(wheel).namelist()
    for mod in ("encoder", "language", "router", "common"):
        assert f"tandem/v1/{mod}_pb2.py" in names and f"tandem/v1/{mod}_pb2_grpc.py" in names
    assert "tandem/services/encoder/config.py" in names
    sources = {f"tandem/csrc/{f.name}" for f in (ROOT / "tandem" / "csrc").iterdir()}
    assert sources and sources <= set(names), sorted(sources - set(names))
    ep = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt")))
    assert "tandem = tandem.cli:main" in ep.decode()


def test_wheel_installs_one_top_level_name_and_passes_the_images_import_check(
        wheel, sim, tmp_path):
    """`pip install --no-deps` of the wheel into an empty venv adds exactly one top-level
    import name, `tandem` (the tiers come as tandem.services.*, no top-level `services`);
    the runtime stage's own import check (its `python -c`) passes against that install."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)
    (site,) = venv.glob("lib/python*/site-packages")
    before = set(os.listdir(site))
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                        "install", "-q", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    added = set(os.listdir(site)) - before
    top = {n.removesuffix(".py") for n in added
           if not n.endswith((".dist-info", ".pth")) and n != "__pycache__"}
    assert top == {"tandem"}, added
    assert not [n for n in added if n.endswith(".pth")], added
    for f in ("tandem/services/router/main.py", "tandem/services/language/engine/core.py",
              "tandem/v1/encoder_pb2.py"):
        assert (site / f).is_file(), f
    assert (venv / "bin" / "tandem").exists()
    # The runtime stage's check, with this install's `tandem` (dependencies from the dev venv).
    checks = {code for v in VARIANTS
              for code in python_checks(sim.runtime(v), the_package(sim.runtime(v)).venv)}
    assert checks, "the runtime stage checks nothing after installing"
    guard = ("import sys; bad = [n for n, m in list(sys.modules.items()) if n.split('.')[0] == "
             "'tandem' and getattr(m, '__file__', None) and not m.__file__.startswith(S)]; "
             "assert not bad, bad")
    env = {**os.environ, "PYTHONPATH": str(site)}
    for code in checks:
        r = subprocess.run([sys.executable, "-c", f"{code}\nS = {str(site)!r}\n{guard}"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{code}\n{r.stderr[-2000:]}"


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
    assert r.returncode == 2 and "make setup" in r.stderr and "'.[server]'" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.timeout(600)
def test_router_image_install_serves_without_torch(wheel, sim, tmp_path):
    """The router image's install (the package with the extras its Dockerfile stage names)
    into an empty venv: no torch, transformers or Mooncake; the stage's own import check
    passes; `tandem router` starts and answers /health (503: no tier is up)."""
    import httpx

    from tandem.launch.procs import free_port

    router = sim.image("router")
    extras = requirement(the_package(router).reqs[0])[1]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                        f"{wheel}[{','.join(sorted(extras))}]"], capture_output=True, text=True,
                       timeout=400)
    assert r.returncode == 0, r.stderr
    code = ("import importlib.util as u; print([n for n in ('torch', 'transformers', "
            "'mooncake', 'numpy') if u.find_spec(n)])")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True,
                       text=True, timeout=60)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr
    checks = python_checks(router, the_package(router).venv)
    assert checks, "the router stage checks nothing after installing"
    for check in checks:
        r = subprocess.run([str(venv / "bin" / "python"), "-c", check], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{check}\n{r.stderr[-2000:]}"
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


def test_router_target_is_the_router_alone_and_runtime_stays_the_default(sim):
    """`--target router` installs the package's `router` extra on the plain CPU base, and
    nothing in it installs torch, Mooncake or the server stack; a plain build is still the
    full image (checked in test_default_build_is_the_full_image_on_the_variants_base)."""
    router = sim.image("router")
    pkg = the_package(router)
    assert requirement(pkg.reqs[0])[1] == {"router"}
    names = {requirement(r)[0] for p in pip_calls(router) for r in p.reqs}
    assert not {n for n in names if n == "torch" or n.startswith("mooncake")}, names
    assert router.base == sim.runtime("cpu").base and "cuda" not in router.base
