"""`tandem up --ray`: the tiers as Ray actors on a local Ray instance, end to end.

The test owns the Ray instance (so it can look inside after the launcher is gone); the
launcher runs as a real process connected to it, serves one chat with an image through the
router, and after SIGINT must leave no named actor, no placement group and no service
process behind. Everything binds to loopback.
"""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from waiting import process_alive, wait_until

from tandem.launch.procs import free_port

# Ray's switch for "no cluster networking": every node address becomes 127.0.0.1.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def _image_data_url() -> str:
    from PIL import Image

    img = Image.new("RGB", (64, 48), (200, 40, 40))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _ours(ray, namespace: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == namespace]


@pytest.mark.timeout(300)
def test_ray_launcher_serves_a_chat_and_leaves_nothing_behind(checkpoint, monkeypatch):
    # NOTE: before Ray is imported: it reads the loopback switch at import time.
    for k, v in LOOPBACK_ENV.items():
        monkeypatch.setenv(k, v)
    if "ray" in sys.modules:
        pytest.skip("ray was imported earlier in this process; cannot confine it to loopback")
    ray = pytest.importorskip("ray")
    from ray.util import placement_group_table

    model = checkpoint("qwen2_5_vl")
    ctx = ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False,
                   namespace="tandem-test", log_to_driver=False)
    namespace = "tandem-ray-e2e"
    http_port, grpc_port = free_port(), free_port()
    argv = [sys.executable, "-m", "tandem.cli", "up", "--ray", ctx.address_info["gcs_address"],
            "--ray-namespace", namespace, "--encoder-gpus", "0", "--language-gpus", "0",
            "--model", str(model), "--http-port", str(http_port), "--grpc-port", str(grpc_port),
            "--ready-timeout", "180", "--stop-timeout", "20"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines: list[str] = []
    ready = threading.Event()

    def pump():
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            lines.append(line)
            if line.startswith("[up] pids:"):
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        def up() -> bool:
            assert proc.poll() is None, "\n".join(lines[-60:])
            return ready.is_set()

        wait_until(up, timeout_s=240, poll_s=0.5, what="`tandem up --ray` printing its pids",
                   state=lambda: "\n".join(lines[-60:]))
        pids = {k: int(v) for k, v in (p.split("=") for p in lines[-1].split()[2:])}
        assert set(pids) == {"encoder-0", "language-0", "router"}
        assert all(process_alive(p) for p in pids.values())
        addrs = [
            ln.split()[3] for ln in lines if re.match(r"^\[up\] (encoder|language)-\d+ +ready", ln)
        ]
        assert len(addrs) == 2 and all(a.startswith("127.0.0.1:") for a in addrs), addrs
        assert sorted(_ours(ray, namespace)) == ["tandem-encoder-0", "tandem-language-0"]

        base = f"http://127.0.0.1:{http_port}/v1"
        (served,) = httpx.get(f"{base}/models", timeout=10).json()["data"]
        body = {
            "model": served["id"],
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _image_data_url()}},
                {"type": "text", "text": "What colour is this?"},
            ]}],
            "max_tokens": 8,
            "temperature": 0,
        }
        r = httpx.post(f"{base}/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["completion_tokens"] > 0
        # The image went through the encoder actor: its tokens count in the prompt.
        assert out["usage"]["prompt_tokens"] > 8
        assert out["choices"][0]["message"]["content"]

        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(120) == 0, "\n".join(lines[-60:])
        assert lines[-1] == "[up] stopped"
        assert _ours(ray, namespace) == []
        pgs = [pg for pg in placement_group_table().values()
               if pg["name"] == f"tandem-{proc.pid}"]
        assert pgs and all(pg["state"] == "REMOVED" for pg in pgs)
        # the reaper of a killed actor's child may lag (a hang guard: the claim is none left)
        wait_until(lambda: not any(process_alive(p) for p in pids.values()), timeout_s=60, poll_s=0.2,
                   what="no service process left behind",
                   state=lambda: [n for n, p in pids.items() if process_alive(p)])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        ray.shutdown()


@pytest.mark.timeout(300)
def test_ray_launcher_with_token_auth_against_ray_start(checkpoint, tmp_path):
    """A Ray cluster as an operator starts it (`ray start --head`) with token
    authentication on (`RAY_AUTH_MODE=token`, Ray's token in $HOME/.ray/auth_token):
    `tandem up --ray ADDRESS --demo` connects with that token, serves the demo chat (the
    tiers under their throwaway mTLS, each actor handed its certificate as PEM text in the
    environment, the API key by the environment) and exits 0. No secret on a command line."""
    import tempfile

    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    temp = tempfile.mkdtemp(prefix="tr-", dir="/tmp")  # NOTE: Ray's socket paths must stay short
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # HOME is the test's (Ray keeps its token in $HOME/.ray); the CPU kernels already built
    # for this machine stay where they are (rebuilding them would take a minute)
    kernels = os.environ.get("TANDEM_KERNEL_DIR") or os.path.expanduser("~/.cache/tandem/kernels")
    env.update(LOOPBACK_ENV, HOME=str(tmp_path), RAY_AUTH_MODE="token", PYTHONUNBUFFERED="1",
               TANDEM_KERNEL_DIR=kernels)
    start = [ray_bin, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
             "--num-cpus=2", "--num-gpus=0", "--include-dashboard=false",
             "--disable-usage-stats", f"--temp-dir={temp}"]
    gen = subprocess.run([ray_bin, "get-auth-token", "--generate"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert gen.returncode == 0 and (tmp_path / ".ray" / "auth_token").exists(), gen.stderr
    r = subprocess.run(start, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        argv = [sys.executable, "-m", "tandem.cli", "up", "--ray", f"127.0.0.1:{port}",
                "--encoder-gpus", "0", "--language-gpus", "0", "--model", str(checkpoint("qwen2_5_vl")),
                "--http-port", str(free_port()), "--grpc-port", str(free_port()),
                "--api-key", "s3cret", "--demo", "--ready-timeout", "180"]
        out = subprocess.run(argv, env={**env, "DEMO_ONLY": "1"}, capture_output=True,
                             text=True, timeout=240)
        log = out.stdout + out.stderr
        assert out.returncode == 0, log[-3000:]
        assert "[demo] answer" in log and "internal mTLS" in log, log[-3000:]
        for pid in re.findall(r"(?:encoder|language)-\d=(\d+)", log):
            cmdline = open(f"/proc/{pid}/cmdline").read() if process_alive(int(pid)) else ""
            assert "s3cret" not in cmdline and "BEGIN" not in cmdline
    finally:
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=60)
        import shutil

        shutil.rmtree(temp, ignore_errors=True)
