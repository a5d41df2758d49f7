"""The two servers of the peer benchmark: the checkpoint, the peer's install, start/stop,
readiness and the peak RSS of each server's process tree."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tandem.launch.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the project venv's bin/
# torchaudio and torchcodec: the peer's wheel asks for them, they do not import beside this
# torch, and serving Qwen2.5-VL images needs neither (docs/benchmarks.md, "Peer").
SKIP_REQS = {"torch", "torchvision", "torchaudio", "torchcodec"}
TORCH_PINS = ["torch==2.13.0", "torchvision==0.28.0"]


def say(msg: str) -> None:
    print(f"[peer] {msg}", flush=True)


# --- the checkpoint --------------------------------------------------------------------------


def checkpoint(arch: str, size: str, seed: int) -> Path:
    """A `tandem tiny-model` checkpoint under .cache/peer/, built once (the bench's own copy,
    outside the tests' cache)."""
    out = ROOT / ".cache" / "peer" / f"{arch}-{size}-s{seed}"
    if not (out / ".complete").exists():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        say(f"building the checkpoint into {out}")
        subprocess.run([str(BIN / "tandem"), "tiny-model", str(tmp), "--arch", arch,
                        "--size", size, "--seed", str(seed)], check=True)
        (tmp / ".complete").touch()
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


# --- the peer's virtual environment -----------------------------------------------------------


def pip_env() -> dict[str, str]:
    """This machine's pip settings minus the local wheel folder, extra indexes and the torch
    cap: no config files (PIP_CONFIG_FILE=/dev/null) and no PIP_* overrides of those."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_EXTRA_INDEX_URL",
                        "PIP_NO_INDEX")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


# The peer venv's lock (deploy/scripts/lock.py --peer): every install step resolves under it,
# so two machines benchmark the same peer; a venv made under another lock is made again.
PEER_LOCK = ROOT / "bench" / "peer-constraints.txt"


def _stamp(spec: str) -> str:
    import hashlib

    return f"{spec} {hashlib.sha256(PEER_LOCK.read_bytes()).hexdigest()[:16]}"


def peer_ready(venv: Path, spec: str) -> bool:
    stamp = venv / ".tandem-peer"
    return stamp.exists() and stamp.read_text().strip() == _stamp(spec)


def install_peer(venv: Path, spec: str) -> None:
    """The peer in its own venv: PyPI's torch and torchvision, then `spec` without its
    dependencies (it pins a `+cpu` torch build that PyPI does not serve), then its other
    requirements, every step under the peer's lock (PEER_LOCK). About 5 GB of downloads."""
    if peer_ready(venv, spec):
        return
    t0 = time.time()
    say(f"installing {spec} into {venv} (several GB, minutes)")
    py, env = venv / "bin" / "python", {**pip_env(), "PIP_CONSTRAINT": str(PEER_LOCK)}
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)

    def pip(*args: str) -> None:
        subprocess.run([str(py), "-m", "pip", "install", *args], check=True, env=env)

    pip("--upgrade", "pip", "packaging")
    pip(*TORCH_PINS)
    pip("--no-deps", spec)
    name = spec.split("=")[0].split("<")[0].split(">")[0].strip()
    script = (
        "import sys\nfrom importlib.metadata import requires\n"
        "from packaging.requirements import Requirement\n"
        "for r in requires(sys.argv[1]) or []:\n"
        "    q = Requirement(r)\n"
        "    if q.marker and not q.marker.evaluate({'extra': ''}): continue\n"
        "    if q.name not in sys.argv[2].split(','): q.marker = None; print(q)\n")
    reqs = subprocess.run([str(py), "-c", script, name, ",".join(SKIP_REQS)], check=True,
                          capture_output=True, text=True).stdout.splitlines()
    pip(*reqs, *TORCH_PINS)
    subprocess.run([str(py), "-c", "import vllm, torchvision"], check=True)
    (venv / ".tandem-peer").write_text(_stamp(spec) + "\n")
    say(f"peer installed in {time.time() - t0:.0f} s")


# --- servers ----------------------------------------------------------------------------------


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants (psutil, else /proc)."""
    try:
        import psutil

        root = psutil.Process(pid)
        total = 0
        for p in [root, *root.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total
    except ImportError:
        pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return total


class Server:
    """One system's server, its own process group, ready when GET /v1/models answers."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict, log: Path):
        self.name, self.argv, self.port, self.env, self.log = name, argv, port, env, log
        self.proc: subprocess.Popen | None = None
        self.peak_rss = 0
        self.startup_s = 0.0
        self.model = ""
        self.grpc_address = ""  # Tandem's SDK endpoint (token ids for the agreement check)
        self._stop = threading.Event()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float) -> None:
        import httpx

        self.log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
        threading.Thread(target=self._sample, daemon=True).start()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n"
                                   + self.tail())
            try:
                r = httpx.get(self.base_url + "/models", timeout=2)
                if r.status_code == 200 and r.json().get("data"):
                    self.model = r.json()["data"][0]["id"]
                    self.startup_s = time.time() - t0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s:\n" + self.tail())

    def _sample(self) -> None:
        while not self._stop.is_set() and self.proc and self.proc.poll() is None:
            self.peak_rss = max(self.peak_rss, tree_rss(self.proc.pid))
            self._stop.wait(0.25)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 30.0) -> None:
        self._stop.set()
        if self.proc is None or self.proc.poll() is not None:
            return
        try:  # NOTE: the group this Server created (start_new_session), nothing else
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass


def tandem_server(ckpt: Path, dtype: str, log: Path, language_args: str = "",
                  env: dict[str, str] | None = None, name: str = "tandem",
                  split: bool = False, encoder_nice: int | None = None) -> Server:
    """`tandem up` (1 encoder + 1 language; `split`: 1 prefill + 1 decode instance, E/P/D);
    `env`: variables added to its environment (the traced variant's OTEL_*), `name` the
    system's name in the tables, `encoder_nice` the encoders' `--encoder-nice` (None:
    `tandem up`'s default)."""
    port, grpc_port = free_port(), free_port()
    dt = f"--dtype {dtype}"
    argv = [str(BIN / "tandem"), "up", "--model", str(ckpt), "--host", "127.0.0.1",
            "--http-port", str(port), "--grpc-port", str(grpc_port), "--encoders", "1",
            *(["--prefill", "1", "--decode", "1"] if split else ["--languages", "1"]),
            *(["--encoder-nice", str(encoder_nice)] if encoder_nice is not None else []),
            "--encoder-args", dt,
            "--language-args", f"{dt} {language_args}".strip()]
    srv = Server(name, argv, port, dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})), log)
    srv.grpc_address = f"127.0.0.1:{grpc_port}"
    return srv


def vllm_server(venv: Path, ckpt: Path, dtype: str, kv_gib: int, log: Path,
                videos: int = 0) -> Server:
    """vLLM's OpenAI server: at most one image and `videos` videos per prompt (0: its video
    path off, which spares the video encoder's start-up profiling)."""
    port = free_port()
    argv = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(ckpt), "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
            "--limit-mm-per-prompt", json.dumps({"image": 1, "video": videos})]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_gib), PYTHONUNBUFFERED="1")
    return Server("vllm", argv, port, env, log)
