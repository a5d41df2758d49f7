"""`tandem up --demo` as `make run` starts it, on a fresh cache: builds the tiny default
checkpoint, starts 1 encoder + 1 language + router as processes, sends one chat with a
generated image through the `openai` client, prints the answer and the time per stage,
with no line at warning level or above, and with DEMO_ONLY=1 stops every child and exits 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import psutil
import pytest

from tandem.launch.procs import free_port

pytestmark = pytest.mark.timeout(240)


def test_up_demo_only_on_fresh_cache(tmp_path):
    env = dict(os.environ, DEMO_ONLY="1", TANDEM_CACHE_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "tandem.cli", "up", "--demo",
            "--http-port", str(free_port()), "--grpc-port", str(free_port())]
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=220)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert (tmp_path / "tiny-qwen2_5_vl" / ".complete").exists()  # built once, cached
    assert re.search(r"\[demo\] answer \((stop|length)\): '", out), out[-3000:]
    for stage in ("preprocess", "vit", "transfer", "queue", "prefill", "decode"):
        assert re.search(rf"\[demo\]\s+{stage}\s+\d+\.\d", out), stage
    for name in ("encoder-0", "language-0", "router"):
        assert re.search(rf"\[up\] {name}\s+ready", out)
        assert re.search(rf"^{name}\s*\| ", out, re.M)  # its log lines, prefixed
    assert "[up] stopped" in out
    # a healthy start says nothing at warning level or above (Mooncake's benign start-up
    # lines included: the launcher shows them only at --log-level debug)
    loud = [ln for ln in out.splitlines() if re.search(
        r"\| (\S+ \S+ (WARNING|ERROR|CRITICAL) |mooncake (WARNING|ERROR|CRITICAL) )", ln)]
    assert loud == [], loud
    pids = [int(p) for p in re.findall(r"=(\d+)", re.search(r"\[up\] pids: (.*)", out).group(1))]
    assert len(pids) == 3
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
