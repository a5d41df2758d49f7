"""Build Tandem's images with buildah and run them (`make image`, `make image-check`; issue 40).

    python3 deploy/scripts/image.py build [--base IMAGE] [--torch-cpu-index URL] [--context DIR]
    python3 deploy/scripts/image.py check          # the built images, run
    python3 deploy/scripts/image.py check-cuda     # the cuda variant's steps, without CUDA

build: the CPU image (`--build-arg VARIANT=cpu`) and the router image (`--target router`)
from the Dockerfile as it is, with `buildah bud --isolation chroot --layers` (no Docker
engine needed; the two builds share the base and build stages through the layer cache),
tagged localhost/tandem:<version>-cpu and -router. What this script adds is only what the
build host needs, each detected, so a networked builder passes nothing but the base:

- the base (CPU_IMAGE): the Dockerfile's default when it can be pulled; else a Debian 12
  base made once with `debootstrap --variant=minbase bookworm` (localhost/debian-bookworm-min,
  reused when present; bookworm, -updates and -security in its sources, apt's caches empty);
- the host's pip configuration (index-url, extra-index-url, find-links, trusted-host,
  cert; from the files pip reads and PIP_* variables; its `constraint` is not passed, the
  build has its own lock): written as a pip.conf bound at /etc/pip.conf, its local paths
  (the CA file, find-links directories, file:// indexes with their parent) bound read-only
  under /run/tandem-build. Build-time binds leave their empty mount points in the image
  (a 0-byte /etc/pip.conf, empty directories under /run/tandem-build);
- TORCH_CPU_INDEX, when the Dockerfile's default index host does not resolve: the host's
  own extra indexes (as bound), once the `+cpu` wheel of TORCH_SPEC is found among the
  host's local pip sources (pip.conf's find-links serve it).

check: the CPU image's entrypoint (from the image's config) run with `buildah run
--isolation chroot` (host network, the image's user): `tiny-model` writes a checkpoint
inside the container, `up` serves it, and one OpenAI chat with an image goes to the router
over HTTP (200, content, the encoder used); then SIGTERM to the entrypoint's tini, and no
process is left in the container. The router image: its entrypoint and CMD (`router
--help`) as uid 10001, and no torch in its venv.

check-cuda: what a machine without CUDA can check of the cuda variant (see its docstring).
"""

from __future__ import annotations

import argparse
import configparser
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import zipfile
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
WORK = ROOT / ".cache" / "image"
LOCAL_BASE = "localhost/debian-bookworm-min:latest"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
IN_BUILD = "/run/tandem-build"  # where the host's pip sources are bound during the build
PIP_KEYS = ("index-url", "extra-index-url", "find-links", "trusted-host", "cert")


def version() -> str:
    return re.search(r'(?m)^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text())[1]


def tag(kind: str) -> str:
    return f"localhost/tandem:{version()}-{kind}"


def dockerfile_arg(name: str) -> str:
    """The first default the Dockerfile gives build argument `name`."""
    m = re.search(rf'(?m)^ARG {name}="?([^"\n]*)"?$', DOCKERFILE.read_text())
    if m is None:
        raise SystemExit(f"Dockerfile: no default for ARG {name}")
    return m[1]


def say(msg: str) -> None:
    print(f"[image] {msg}", flush=True)


def run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, text=True, **kw)


def apt_install(*pkgs: str) -> None:
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    say(f"installing Debian {' '.join(pkgs)}")
    run([*sudo, "apt-get", "update", "-qq"])
    run([*sudo, "apt-get", "install", "-y", "-qq", *pkgs])


def image_exists(ref: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", ref],
                          capture_output=True).returncode == 0


def image_config(ref: str) -> dict:
    out = run(["buildah", "inspect", "--type", "image", ref], capture_output=True).stdout
    return json.loads(out)


# -- the base --------------------------------------------------------------------------------

def choose_base(requested: str | None) -> str:
    if requested:
        return requested
    default = dockerfile_arg("CPU_IMAGE")
    if image_exists(default):
        return default
    pull = subprocess.run(["buildah", "pull", "-q", default], capture_output=True, text=True)
    if pull.returncode == 0:
        return default
    say(f"{default} cannot be pulled ({pull.stderr.strip().splitlines()[-1][:160]})")
    if image_exists(LOCAL_BASE):
        say(f"base: {LOCAL_BASE} (made earlier by debootstrap)")
    else:
        make_debian_base()
    return LOCAL_BASE


def make_debian_base() -> None:
    """Debian 12 minbase into a scratch container, committed as LOCAL_BASE."""
    if shutil.which("debootstrap") is None:
        apt_install("debootstrap")
    say(f"making {LOCAL_BASE}: debootstrap --variant=minbase bookworm")
    t0 = time.monotonic()
    ctr = run(["buildah", "from", "scratch"], capture_output=True).stdout.strip()
    try:
        mnt = Path(run(["buildah", "mount", ctr], capture_output=True).stdout.strip())
        run(["debootstrap", "--variant=minbase", "bookworm", str(mnt), DEBIAN_MIRROR])
        (mnt / "etc/apt/sources.list").write_text(
            f"deb {DEBIAN_MIRROR} bookworm main\ndeb {DEBIAN_MIRROR} bookworm-updates main\n"
            "deb http://deb.debian.org/debian-security bookworm-security main\n")
        for d in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (mnt / d).glob("*"):
                if p.is_file():
                    p.unlink()
        run(["buildah", "umount", ctr])
        run(["buildah", "config", "--cmd", "/bin/bash", ctr])
        run(["buildah", "commit", "-q", "--rm", ctr, LOCAL_BASE])
    except BaseException:
        subprocess.run(["buildah", "rm", ctr], capture_output=True)
        raise
    say(f"made {LOCAL_BASE} in {time.monotonic() - t0:.0f} s")


# -- the host's pip configuration ------------------------------------------------------------

def pip_config_files() -> list[Path]:
    """The files pip reads, in its order (later ones override earlier ones)."""
    xdg = os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":")
    home = Path.home()
    files = [Path(os.environ["PIP_CONFIG_FILE"])] if os.environ.get("PIP_CONFIG_FILE") else []
    files += [Path(d) / "pip" / "pip.conf" for d in reversed(xdg)] + [Path("/etc/pip.conf")]
    files += [home / ".pip" / "pip.conf",
              Path(os.environ.get("XDG_CONFIG_HOME", home / ".config")) / "pip" / "pip.conf"]
    return files


def host_pip_settings() -> dict[str, list[str]]:
    """What the host's pip uses of PIP_KEYS: its config files' [global] and [install], then
    PIP_* variables (space-separated lists)."""
    out: dict[str, list[str]] = {}
    if os.environ.get("PIP_CONFIG_FILE") == os.devnull:
        files = []
    else:
        files = [f for f in pip_config_files() if f.is_file()]
    for f in files:
        cp = configparser.ConfigParser()
        cp.read(f)
        for section in ("global", "install"):
            for key in PIP_KEYS:
                if cp.has_option(section, key):
                    out[key] = cp.get(section, key).split()
    for key in PIP_KEYS:
        env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if env:
            out[key] = env.split()
    return out


def _local_path(value: str) -> Path | None:
    if value.startswith("file://"):
        return Path(urllib.parse.unquote(urllib.parse.urlparse(value).path))
    return Path(value) if value.startswith("/") else None


class BuildHost:
    """The binds (`-v`) and build arguments this host needs: the host's pip sources under
    IN_BUILD, a pip.conf naming them there, the torch index when its host does not resolve."""

    def __init__(self, torch_spec: str, torch_cpu_index: str | None) -> None:
        self.binds: dict[Path, str] = {}  # host path -> path in the build
        self.args: dict[str, str] = {}
        self.notes: list[str] = []
        WORK.mkdir(parents=True, exist_ok=True)
        settings = host_pip_settings()
        conf: dict[str, list[str]] = {}
        for key, values in settings.items():
            conf[key] = [self._inside(key, v) for v in values]
        if conf:
            pip_conf = WORK / "pip.conf"
            pip_conf.write_text("[global]\n" + "".join(
                f"{k} = {' '.join(v)}\n" for k, v in conf.items()))
            self.binds[pip_conf] = "/etc/pip.conf"
            self.notes.append(f"the host's pip configuration ({', '.join(conf)}), as /etc/pip.conf")
        if torch_cpu_index:
            self.args["TORCH_CPU_INDEX"] = torch_cpu_index
        else:
            self._torch_index(torch_spec, settings, conf)

    def _bind(self, host: Path) -> str:
        """`host` (a directory or file) bound at IN_BUILD + its path, unless it already lies
        in a bound directory; its path in the build."""
        host = Path(os.path.realpath(host))
        for h, inside in self.binds.items():
            if h.is_dir() and host.is_relative_to(h):
                return inside + "/" + str(host.relative_to(h)) if host != h else inside
        self.binds[host] = IN_BUILD + str(host)
        return self.binds[host]

    def _inside(self, key: str, value: str) -> str:
        path = _local_path(value)
        if path is None or not path.exists():
            return value  # a remote URL (or a path that does not exist here) as it is
        if key == "cert":
            self.binds[Path(os.path.realpath(path))] = f"{IN_BUILD}/ca.crt"
            return f"{IN_BUILD}/ca.crt"
        if key == "find-links":
            inside = self._bind(path)
            return "file://" + inside if value.startswith("file://") else inside
        # a file:// index: its pages may link files beside it (../../files/...)
        parent = self._bind(path.parent)
        return "file://" + parent + "/" + path.name

    def _torch_index(self, torch_spec: str, settings: dict[str, list[str]],
                     conf: dict[str, list[str]]) -> None:
        """Where the Dockerfile's TORCH_CPU_INDEX does not resolve, the torch steps take the
        host's own extra indexes instead (TORCH_CPU_INDEX is PIP_EXTRA_INDEX_URL there, so
        nothing else changes): the `+cpu` wheel of TORCH_SPEC must lie in the host's local
        pip sources (find-links directories, file:// indexes), checked here."""
        default = dockerfile_arg("TORCH_CPU_INDEX")
        host = urllib.parse.urlparse(default).hostname
        try:
            socket.getaddrinfo(host, 443)
            return  # the Dockerfile's default serves
        except OSError:
            pass
        want = torch_spec.split("==", 1)[1] + "+cpu" if "==" in torch_spec else "?"
        wheels: list[Path] = []
        for v in settings.get("find-links", []):
            p = _local_path(v)
            if p and p.is_dir():
                wheels += sorted(p.glob(f"torch-{want}-*.whl"))
        for v in settings.get("index-url", []) + settings.get("extra-index-url", []):
            p = _local_path(v)
            if p and (p / "torch" / "index.html").is_file():
                if f"torch-{want}-" in (p / "torch" / "index.html").read_text():
                    wheels.append(p / "torch")
        if not wheels or not conf.get("extra-index-url"):
            raise SystemExit(f"{host} does not resolve here and this host's pip configuration "
                             f"has no extra index and torch-{want} wheel to use instead: set "
                             "TORCH_CPU_INDEX to an index that has it")
        self.args["TORCH_CPU_INDEX"] = " ".join(conf["extra-index-url"])
        self.notes.append(f"{host} does not resolve: TORCH_CPU_INDEX is the host's extra "
                          f"indexes; torch {want} from {', '.join(str(w) for w in wheels)}")

    def bud_args(self) -> list[str]:
        out = []
        for k, v in self.args.items():
            out += ["--build-arg", f"{k}={v}"]
        for h, inside in self.binds.items():
            out += ["-v", f"{h}:{inside}:ro"]
        return out


# -- build -----------------------------------------------------------------------------------

def size_and_layers(ref: str) -> tuple[str, int]:
    """The image's size as buildah states it (uncompressed), and its layer count."""
    layers = len(image_config(ref)["OCIv1"]["rootfs"]["diff_ids"])
    out = run(["buildah", "images", "--json", ref], capture_output=True).stdout
    return json.loads(out)[0]["size"], layers


def _containers() -> set[str]:
    out = run(["buildah", "containers", "-q", "--notruncate"], capture_output=True).stdout
    return set(out.split())


def build(args: argparse.Namespace) -> None:
    if shutil.which("buildah") is None:
        apt_install("buildah")
    base = choose_base(args.base)
    host = BuildHost(args.torch_spec, args.torch_cpu_index)
    for n in host.notes:
        say(f"this host: {n}")
    common = ["buildah", "bud", "--isolation", "chroot", "--layers", "-f", str(DOCKERFILE),
              "--build-arg", "VARIANT=cpu", "--build-arg", f"CPU_IMAGE={base}",
              "--build-arg", f"TORCH_SPEC={args.torch_spec}", *host.bud_args()]
    results = []
    for kind, extra in (("router", ["--target", "router"]), ("cpu", [])):
        say(f"building {tag(kind)} on {base}")
        t0 = time.monotonic()
        before = _containers()
        try:
            run([*common, *extra, "-t", tag(kind), str(args.context)])
        finally:
            # NOTE: buildah 1.28 leaves a working container behind for a stage that is only
            # a FROM (base-cpu): the containers that appeared during the build are removed
            for ctr in _containers() - before:
                subprocess.run(["buildah", "rm", ctr], capture_output=True)
        took = time.monotonic() - t0
        size, layers = size_and_layers(tag(kind))
        results.append(f"{tag(kind)}: {size}, {layers} layers, built in {took:.0f} s")
    for r in results:
        say(r)


# -- check -----------------------------------------------------------------------------------

def _png(w: int = 64, h: int = 48, rgb: tuple[int, int, int] = (200, 40, 40)) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    raw = b"".join(b"\0" + bytes(rgb) * w for _ in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(method: str, url: str, body: dict | None = None, timeout: float = 10) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Container:
    """A working container of an image, run with `buildah run --isolation chroot`."""

    def __init__(self, image: str) -> None:
        if not image_exists(image):
            raise SystemExit(f"{image} is not built: run `make image` first")
        self.config = image_config(image)["OCIv1"]["config"]
        self.entrypoint = list(self.config.get("Entrypoint") or [])
        self.cmd = list(self.config.get("Cmd") or [])
        self.id = run(["buildah", "from", "-q", image], capture_output=True).stdout.strip()

    def argv(self, *command: str) -> list[str]:
        return ["buildah", "run", "--isolation", "chroot", self.id, "--", *command]

    def run(self, *command: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*command), capture_output=True, text=True,
                              timeout=timeout)

    def pids(self, mnt_ns: str) -> list[int]:
        """Processes on this host in the given mount namespace (the container's)."""
        out = []
        for p in Path("/proc").iterdir():
            try:
                if p.name.isdigit() and os.readlink(p / "ns" / "mnt") == mnt_ns:
                    out.append(int(p.name))
            except OSError:
                pass
        return out

    def close(self) -> None:
        subprocess.run(["buildah", "rm", self.id], capture_output=True)


def _must(ok: bool, what: str, detail: str = "") -> None:
    if not ok:
        raise SystemExit(f"image-check FAILED: {what}\n{detail[-4000:]}")
    say(f"ok: {what}")


def check_router() -> None:
    c = Container(tag("router"))
    try:
        r = c.run("id", "-u")
        _must(r.stdout.strip() == "10001", f"{tag('router')} runs as uid 10001",
              r.stdout + r.stderr)
        r = c.run(*c.entrypoint, *c.cmd)
        _must(r.returncode == 0 and "usage" in r.stdout.lower(),
              f"{tag('router')}: {' '.join(c.entrypoint + c.cmd)} prints the router's help",
              r.stdout + r.stderr)
        r = c.run("python", "-c", "import importlib.util as u; print(u.find_spec('torch'))")
        _must(r.stdout.strip() == "None", "no torch in the router image", r.stdout + r.stderr)
    finally:
        c.close()


def check_cpu(deadline_s: float) -> None:
    import base64

    c = Container(tag("cpu"))
    proc = None
    try:
        r = c.run("id", "-u")
        _must(r.stdout.strip() == "10001", f"{tag('cpu')} runs as uid 10001", r.stdout + r.stderr)
        t0 = time.monotonic()
        r = c.run(*c.entrypoint, "tiny-model", "tiny")
        _must(r.returncode == 0, f"tiny-model wrote a checkpoint in the image ({time.monotonic() - t0:.0f} s)",
              r.stdout + r.stderr)
        http, grpc = _free_port(), _free_port()
        log = open(WORK / "image-check-up.log", "w")
        t0 = time.monotonic()
        proc = subprocess.Popen(c.argv(*c.entrypoint, "up", "--model", "tiny", "--http-port",
                                       str(http), "--grpc-port", str(grpc)),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        base = f"http://127.0.0.1:{http}"
        end = time.monotonic() + deadline_s
        while True:
            try:
                if _http("GET", base + "/ready", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > end:
                _must(False, "tandem up in the image became ready",
                      (WORK / "image-check-up.log").read_text())
            time.sleep(2)
        _must(True, f"tandem up in the image ready in {time.monotonic() - t0:.0f} s")
        model = json.loads(_http("GET", base + "/v1/models")[1])["data"][0]["id"]
        url = "data:image/png;base64," + base64.b64encode(_png()).decode()
        body = {"model": model, "max_tokens": 16, "temperature": 0, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What colour is this?"}]}]}
        status, text = _http("POST", base + "/v1/chat/completions", body, timeout=300)
        _must(status == 200, "the chat answered 200", text)
        got = json.loads(text)
        content = got["choices"][0]["message"]["content"]
        say(f"the answer: {content!r} (usage {got.get('usage')}, "
            f"encoder {got.get('tandem', {}).get('encoder')})")
        _must(isinstance(content, str) and content != "", "the answer has content", text)
        _must(not got["tandem"]["timings"]["encoder_bypassed"],
              "the image went through the encoder tier", text)
    finally:
        if proc is not None:
            _stop(c, proc)
        c.close()


def _stop(c: Container, proc: subprocess.Popen) -> None:
    """SIGTERM to the entrypoint's tini (it forwards it to `tandem up`, which stops its
    tiers); then no process may be left in the container's mount namespace."""
    kids = [p for p in Path("/proc").iterdir() if p.name.isdigit()]
    tini = None
    for p in kids:
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
            if argv[0] == c.entrypoint[0].encode() and str(proc.pid) in _ancestors(int(p.name)):
                tini = int(p.name)
        except OSError:
            pass
    if tini is None:
        os.killpg(proc.pid, signal.SIGKILL)
        _must(False, "the entrypoint's process found to stop it")
    ns = os.readlink(f"/proc/{tini}/ns/mnt")
    os.kill(tini, signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pass
    end = time.monotonic() + 60
    while (left := c.pids(ns)) and time.monotonic() < end:
        time.sleep(1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    _must(not left and proc.returncode is not None,
          "SIGTERM stopped tandem up and every tier: no process left in the container",
          f"left: {left}")


def _ancestors(pid: int) -> list[str]:
    out = []
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        out.append(str(pid))
    return out


def check(args: argparse.Namespace) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    check_router()
    check_cpu(args.deadline)


# -- the cuda variant, without CUDA ---------------------------------------------------------

CUDA_PYTHON = "3.12"  # Ubuntu 24.04's, the CUDA base's (CUDA_IMAGE)
CUDA_GLIBC = 39  # Ubuntu 24.04's glibc 2.39: manylinux_2_17 .. _2_39 wheels install there
UBUNTU = "http://archive.ubuntu.com/ubuntu"


def dockerfile_stages() -> dict[str, list[str]]:
    """stage name -> its RUN lines (continuations joined)."""
    stages: dict[str, list[str]] = {}
    cur, buf = None, ""
    for raw in DOCKERFILE.read_text().splitlines():
        buf += raw.rstrip("\\").strip() + " "
        if raw.rstrip().endswith("\\"):
            continue
        line, buf = buf.strip(), ""
        m = re.match(r"(?i)^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line)
        if m:
            cur = m[2] or m[1]
            stages[cur] = [f"FROM {m[1]}"]
        elif cur and line.upper().startswith("RUN "):
            stages[cur].append(line[4:])
    return stages


def _stage_chain(stages: dict[str, list[str]], name: str, variant: str) -> list[str]:
    """`name` and the stages it is built FROM, base first."""
    chain = []
    while name in stages:
        chain.insert(0, name)
        name = stages[name][0].split()[1].replace("${VARIANT}", variant)
    return chain


def _pip_for_cuda(action: list[str], reqs: list[str], extra: list[str], cache: Path) -> None:
    """pip `action` for CPython CUDA_PYTHON on manylinux x86_64 (the cuda image's
    interpreter and glibc), wheels only, with the host's pip sources but not its files'
    other settings (a torch cap, say)."""
    plats = [f"--platform=manylinux_2_{v}_x86_64" for v in range(CUDA_GLIBC, 16, -1)]
    host = host_pip_settings()
    opts = [f"--{k}={v}" for k in PIP_KEYS for v in host.get(k, [])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    r = subprocess.run([sys.executable, "-m", "pip", *action, "-q", "--cache-dir", str(cache),
                        "--only-binary=:all:", f"--python-version={CUDA_PYTHON}",
                        "--implementation=cp", *plats, "--platform=manylinux2014_x86_64",
                        *opts, *extra, *reqs], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"check-cuda FAILED: pip {action[0]} {reqs} {extra}\n{r.stderr[-3000:]}")


def _dry_run(reqs: list[str], extra: list[str], report: Path, cache: Path) -> dict[str, str]:
    """name -> version `pip install` would install (nothing installed)."""
    with tempfile.TemporaryDirectory() as target:
        _pip_for_cuda(["install", "--dry-run", "--ignore-installed", "--report", str(report),
                       "--target", target], reqs, extra, cache)
    return {_canon(i["metadata"]["name"]): i["metadata"]["version"]
            for i in json.loads(report.read_text())["install"]}


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _needed(so: Path) -> list[str]:
    out = run(["readelf", "-d", str(so)], capture_output=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def check_cuda_pip(work: Path) -> None:
    """The runtime stage's pip steps for VARIANT=cuda, resolved (not installed) in order:
    the pinned torch alone (PyPI's default build), then the package's `server` extra with
    the grammar engine whole under constraints.txt, then the CUDA Mooncake --no-deps
    (downloaded: its engine's CUDA runtime must be the base's)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_spec = dockerfile_arg("TORCH_SPEC")
    lock = ROOT / "constraints.txt"
    pins = {_canon(ln.split("==")[0]): ln.split("==")[1].strip()
            for ln in lock.read_text().splitlines() if "==" in ln and not ln.startswith("#")}
    t0 = time.monotonic()
    cache = work / "pip-cache"  # the wheels pip fetches for their metadata, once; removed
    try:
        alone = _dry_run([torch_spec], [], work / "torch.json", cache)
        server = project["dependencies"] + project["optional-dependencies"]["server"]
        full = _dry_run([torch_spec, *server, dockerfile_arg("XGRAMMAR_SPEC")],
                        ["-c", str(lock)], work / "server.json", cache)
        shutil.rmtree(work / "mooncake", ignore_errors=True)
        _pip_for_cuda(["download", "-d", str(work / "mooncake")],
                      [dockerfile_arg("MOONCAKE_CUDA_SPEC")], ["-c", str(lock), "--no-deps"], cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    say(f"pip resolved the cuda runtime's steps for cp{CUDA_PYTHON.replace('.', '')} "
        f"manylinux x86_64 in {time.monotonic() - t0:.0f} s (wheels fetched for their "
        "metadata, nothing installed)")
    off = {n: (v, pins[n]) for n, v in full.items() if n in pins and pins[n] != v}
    _must(not off, "every locked package the server step takes resolves at its pin", str(off))
    _must(full.get("torch") == alone["torch"] == torch_spec.split("==")[1],
          f"torch {alone['torch']} (PyPI's default build) stays after the server extra")
    changed = {n: (alone[n], full[n]) for n in alone if n in full and alone[n] != full[n]}
    if changed:
        say(f"the server step moves torch's own dependencies to the lock's pins: {changed}")
    cuda = alone.get("nvidia-cuda-runtime") or alone.get("nvidia-cuda-runtime-cu12")
    say(f"torch {alone['torch']} brings its own CUDA runtime {cuda} (nvidia-* wheels) and "
        f"triton {full.get('triton')}")
    say(f"not in the lock (they follow from torch and xgrammar): "
        f"{' '.join(sorted(n for n in full if n not in pins))}")
    (whl,) = (work / "mooncake").glob("*.whl")
    version = whl.name.split("-")[1]
    _must(version == pins["mooncake-transfer-engine"],
          f"the CUDA Mooncake resolves --no-deps at the lock's pin ({whl.name})")
    with zipfile.ZipFile(whl) as z:
        z.extract("mooncake/engine.so", work / "mooncake")
    needed = _needed(work / "mooncake" / "mooncake" / "engine.so")
    shutil.rmtree(work / "mooncake")
    cudart = [n for n in needed if n.startswith("libcudart.so.")]
    base = dockerfile_arg("CUDA_IMAGE")
    major = re.search(r":(\d+)\.", base)[1]
    _must(cudart == [f"libcudart.so.{major}"],
          f"the CUDA Mooncake's engine.so links {cudart}, the CUDA {major} runtime of {base}",
          " ".join(needed))
    say(f"engine.so's other system libraries: "
        f"{' '.join(n for n in needed if n.startswith(('libibverbs', 'libmlx5', 'libnuma', 'libcurl', 'libcuda.')))}"
        " (libcuda.so.1: the driver, mounted at run time)")


def check_cuda_apt(work: Path) -> None:
    """The apt-get installs of the cuda image's stages (base, build, runtime), simulated
    against Ubuntu 24.04's own indexes (noble, -updates, -security; main and universe, as
    ubuntu:24.04 lists them) from an empty package set: every name exists and its
    dependencies resolve. The indexes are read unsigned ([trusted=yes]: no Ubuntu keyring
    on a Debian host); nothing is downloaded beyond them."""
    stages = dockerfile_stages()
    apt = work / "apt"
    for d in ("state/lists/partial", "cache/archives/partial", "parts"):
        (apt / d).mkdir(parents=True, exist_ok=True)
    (apt / "status").write_text("")
    (apt / "sources.list").write_text(
        "".join(f"deb [trusted=yes arch=amd64] {UBUNTU} {s} main universe\n"
                for s in ("noble", "noble-updates", "noble-security")))
    opts = [f"-oDir::State={apt}/state", f"-oDir::State::status={apt}/status",
            f"-oDir::Cache={apt}/cache", f"-oDir::Etc::SourceList={apt}/sources.list",
            f"-oDir::Etc::SourceParts={apt}/parts", f"-oDir::Etc::PreferencesParts={apt}/parts",
            f"-oDir::Etc::Preferences={apt}/none", "-oAPT::Architecture=amd64",
            "-oAPT::Architectures::=amd64", "-oDebug::NoLocking=1", "-oAPT::Sandbox::User=root"]
    r = subprocess.run(["apt-get", *opts, "update", "-qq"], capture_output=True, text=True)
    _must(r.returncode == 0, f"Ubuntu 24.04's indexes read from {UBUNTU}", r.stdout + r.stderr)
    pkgs: list[str] = []
    for stage in _stage_chain(stages, "runtime", "cuda") + ["build"]:
        for line in stages[stage][1:]:
            for m in re.finditer(r"apt-get install\s+((?:-\S+\s+)*)([^&|;]+)", line):
                pkgs += [p for p in m[2].split() if p not in pkgs]
    r = subprocess.run(["apt-get", *opts, "install", "-s", "--no-install-recommends", *pkgs],
                       capture_output=True, text=True)
    got = dict(re.findall(r"(?m)^Inst (\S+) \((\S+)", r.stdout))
    _must(r.returncode == 0 and set(pkgs) <= set(got),
          f"apt resolves {' '.join(pkgs)} on Ubuntu 24.04 ({len(got)} packages with "
          f"dependencies; python3 {got.get('python3')})", r.stdout[-2000:] + r.stderr)


def check_cuda(args: argparse.Namespace) -> None:
    """What a machine without CUDA (and without the CUDA base image) can check of the cuda
    variant: its pip steps resolved for the base's Python and glibc against the lock, its
    apt steps against Ubuntu 24.04's indexes. Its RUN steps' shell and order are the dry
    run's (tests/test_deploy_dockerfile.py). Not checked: the CUDA base image itself, any
    install (the CUDA torch and its nvidia-* wheels are fetched for their metadata, never
    installed), the CUDA Mooncake's engine loading, anything on a GPU."""
    work = WORK / "cuda-check"
    work.mkdir(parents=True, exist_ok=True)
    check_cuda_pip(work)
    check_cuda_apt(work)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the CPU and router images")
    b.add_argument("--base", default=None,
                   help="CPU_IMAGE (default: the Dockerfile's, else a debootstrap Debian 12)")
    b.add_argument("--torch-spec", default=dockerfile_arg("TORCH_SPEC"))
    b.add_argument("--torch-cpu-index", default=None,
                   help="TORCH_CPU_INDEX (default: the Dockerfile's where its host resolves)")
    b.add_argument("--context", type=Path, default=ROOT, help="the build context (the checkout)")
    c = sub.add_parser("check", help="run the built images")
    c.add_argument("--deadline", type=float, default=900,
                   help="seconds `tandem up` may take to become ready (the CPU kernels compile)")
    sub.add_parser("check-cuda", help="the cuda variant's steps, as far as no CUDA allows")
    args = p.parse_args()
    {"build": build, "check": check, "check-cuda": check_cuda}[args.cmd](args)


if __name__ == "__main__":
    main()
