"""Start a real `tandem encoder` process on loopback and wait until it serves."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.launch.plan import MOONCAKE_WINDOW
from tandem.launch.procs import free_port

ROOT = Path(__file__).resolve().parents[2]


def port_range(width: int = 40) -> tuple[int, int]:
    # NOTE: the launcher's Mooncake window (below 32768: Mooncake ignores RPC port ranges
    # that reach past 32767; below the service ports that free_port hands out)
    lo, hi = MOONCAKE_WINDOW
    base = random.randrange(lo, hi - width, width)
    return base, base + width - 1


class EncoderProcess:
    def __init__(self, model: Path, log: Path, *args: str) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        lo, hi = port_range()
        cmd = [
            sys.executable,
            "-m",
            "tandem.cli",
            "encoder",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--transfer.min-port",
            str(lo),
            "--transfer.max-port",
            str(hi),
            "--insecure-internal",  # the test's language side is a plaintext peer
            *args,
        ]
        self.log = log
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT
        )

    def wait_serving(self, timeout: float = 90.0) -> None:
        from waiting import wait_until

        with grpc.insecure_channel(self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            def serving() -> bool:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"encoder exited: {self.log.read_text()[-3000:]}")
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                except grpc.RpcError:
                    return False
                return r.status == health_pb2.HealthCheckResponse.SERVING

            wait_until(serving, timeout_s=timeout, what="encoder serving", poll_s=0.2,
                       state=lambda: self.log.read_text()[-3000:])

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: graceful drain
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
