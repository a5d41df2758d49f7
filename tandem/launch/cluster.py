"""`LocalCluster`: run `tandem up` as a child process and learn its endpoints (tests, bench).

    with LocalCluster(model, encoders=2, languages=2) as cl:
        cl.http_url, cl.grpc_address, cl.instances["encoder-0"].address / .pid
        cl.metrics_url                        # the launcher's: restarts, instance states

`tandem up` runs in its own session; `stop()` sends it SIGINT (as a terminal Ctrl-C
would) or SIGTERM and returns its exit code.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from tandem.launch.procs import free_port

_READY = re.compile(r"^\[up\] (\S+)\s+ready\s+(\S+)")
_PIDS = re.compile(r"^\[up\] pids: (.*)$")
_RESTARTED = re.compile(r"^\[up\] (\S+)\s+restarted \S+ pid=(\d+)")
_METRICS = re.compile(r"^\[up\] launcher metrics (\S+)")


@dataclass
class InstanceInfo:
    name: str
    address: str = ""
    pid: int = 0


@dataclass
class LocalCluster:
    model: str
    encoders: int = 1
    languages: int = 1
    api_key: str = ""
    encoder_args: str = ""
    language_args: str = ""
    router_args: str = ""
    up_args: list[str] = field(default_factory=list)  # more `tandem up` flags, as they are
    echo: bool = False  # copy the cluster's log lines to our stdout
    env: dict[str, str] | None = None
    insecure_internal: bool = False  # default: mTLS between the tiers, as `tandem up` does
    pki_dir: str = ""  # where `tandem up` writes the CA and certificates (default: a temp dir)
    http_port: int = 0
    grpc_port: int = 0
    metrics_url: str = ""  # the launcher's own /metrics (instance states, restarts)
    instances: dict[str, InstanceInfo] = field(default_factory=dict)
    # The reader thread appends while tests read: every read goes through `lines`, a copy
    # taken under the lock (iterating the deque itself raced the reader: "deque mutated").
    _lines: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4000))
    _lines_lock: threading.Lock = field(default_factory=threading.Lock)
    proc: subprocess.Popen | None = None
    _own_pki: str = ""

    @property
    def lines(self) -> list[str]:
        """The cluster's last 4,000 log lines, as a snapshot."""
        with self._lines_lock:
            return list(self._lines)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def operator_tls(self):
        """Credentials to call the tiers as the operator (health, GetLoad); None when the
        cluster runs plaintext."""
        from tandem.launch.plan import operator_tls
        from tandem.pki import PKIPaths

        return operator_tls(None if self.insecure_internal else PKIPaths(Path(self.pki_dir)))

    def channel(self, address: str):
        """A sync channel to one of the cluster's tiers, as the operator."""
        from tandem.internal_tls import sync_channel

        return sync_channel(address, self.operator_tls())

    def addresses(self, kind: str) -> list[str]:
        return [i.address for n, i in sorted(self.instances.items()) if n.startswith(kind + "-")]

    def start(self, timeout_s: float = 300.0) -> LocalCluster:
        self.http_port = self.http_port or free_port()
        self.grpc_port = self.grpc_port or free_port()
        if not self.insecure_internal and not self.pki_dir:
            self.pki_dir = self._own_pki = tempfile.mkdtemp(prefix="tandem-pki-")
        # E/P/D (`up_args` with --prefill/--decode): those counts replace --languages
        split = "--prefill" in self.up_args
        argv = [sys.executable, "-m", "tandem.cli", "up", "--model", self.model,
                "--encoders", str(self.encoders),
                *([] if split else ["--languages", str(self.languages)]),
                "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)]
        argv += ["--insecure-internal"] if self.insecure_internal else ["--pki-dir", self.pki_dir]
        for flag, value in (("--api-key", self.api_key), ("--encoder-args", self.encoder_args),
                            ("--language-args", self.language_args),
                            ("--router-args", self.router_args)):
            if value:
                argv += [flag, value]
        argv += self.up_args
        env = dict(os.environ if self.env is None else self.env, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        ready = threading.Event()
        threading.Thread(target=self._read, args=(ready,), daemon=True).start()
        end = time.monotonic() + timeout_s
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop(signal.SIGTERM)
                tail = "\n".join(self.lines[-60:])
                raise RuntimeError(f"tandem up did not get ready:\n{tail}")
        return self

    def _read(self, ready: threading.Event) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            with self._lines_lock:
                self._lines.append(line)
            if self.echo:
                print(line, flush=True)
            if m := _READY.match(line):
                self.instances.setdefault(m.group(1), InstanceInfo(m.group(1))).address = m.group(2)
            elif m := _RESTARTED.match(line):
                self.instances.setdefault(m.group(1), InstanceInfo(m.group(1))).pid = int(
                    m.group(2))
            elif m := _METRICS.match(line):
                self.metrics_url = m.group(1)
            elif m := _PIDS.match(line):
                for item in m.group(1).split():
                    name, _, pid = item.partition("=")
                    self.instances.setdefault(name, InstanceInfo(name)).pid = int(pid)
                ready.set()

    def loads(self, kind: str, timeout_s: float = 2.0) -> dict[str, object]:
        """GetLoad of every live instance of `kind` ("encoder", "language"; E/P/D:
        "prefill", "decode")."""
        import grpc

        from tandem.v1 import encoder_pb2, encoder_pb2_grpc, language_pb2, language_pb2_grpc

        out = {}
        for addr in self.addresses(kind):
            with self.channel(addr) as ch:
                try:
                    if kind == "encoder":
                        r = encoder_pb2_grpc.EncoderStub(ch).GetLoad(
                            encoder_pb2.EncoderGetLoadRequest(), timeout=timeout_s)
                    else:
                        r = language_pb2_grpc.LanguageStub(ch).GetLoad(
                            language_pb2.LanguageGetLoadRequest(), timeout=timeout_s)
                except grpc.RpcError:
                    continue  # a dead instance has no load
            out[addr] = r
        return out

    def log_text(self) -> str:
        return "\n".join(self.lines)

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 90.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                # NOTE: a warning, not an error: pytest lists it under a passing run, so a
                # rare hang of `tandem up`'s own stop shows with what it was doing.
                warnings.warn(f"tandem up did not stop {timeout_s:.0f} s after "
                              f"{signal.Signals(sig).name}; killing it.\n{self._hang_report()}",
                              RuntimeWarning, stacklevel=2)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._own_pki:
            shutil.rmtree(self._own_pki, ignore_errors=True)
        return self.proc.returncode

    def _hang_report(self) -> str:
        """Every thread's stack of `tandem up` and of its tiers (SIGUSR1:
        tandem.serving.STACKS_SIGNAL; they print into the log, read a second later), the
        last lines, and the state of up's children (`ps`: STAT D is a wait in the kernel,
        WCHAN the call)."""
        from tandem.serving import STACKS_SIGNAL

        for pid in [self.proc.pid] + [i.pid for i in self.instances.values() if i.pid]:
            try:
                os.kill(pid, STACKS_SIGNAL)
            except ProcessLookupError:
                pass
        time.sleep(1.0)
        ps = subprocess.run(["ps", "-o", "pid,stat,wchan:24,etime,args", "-p", str(self.proc.pid),
                             "--ppid", str(self.proc.pid)], capture_output=True, text=True).stdout
        return "\n".join(self.lines[-200:]) + "\n" + ps

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
