"""Child processes of `tandem up`: start, forward logs, wait for readiness, stop.

Each child runs in its own session (process group), so a terminal Ctrl-C reaches only
`tandem up`, which then stops the children in order (router first, so no new work
arrives; then the instances) with SIGTERM, and SIGKILLs each child's whole process group
after `stop_timeout_s`. On Linux the children also get PR_SET_PDEATHSIG, so even a
`kill -9` of `tandem up` leaves nothing behind.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_PRINT = threading.Lock()


def say(line: str) -> None:
    with _PRINT:
        print(line, flush=True)


_HANDED_OUT: set[int] = set()
# Service ports come from a window of their own, below the kernel's ephemeral range: a port
# the kernel offers for bind(0) lies in that range, where any process's outgoing connection
# may take it as a source port before the child binds it (seen in CI: an encoder's metrics
# port "already in use"); outside it only an explicit bind can. The window also stays clear
# of the Mooncake RPC windows (plan.MOONCAKE_WINDOW; Mooncake's own default 15000-17000)
# and of Ray's worker ports (10002-19999), which `ray start` refuses to share.
def port_window(name: str, default: tuple[int, int]) -> tuple[int, int]:
    """[lo, hi) of a window of ports, narrowed by the environment variable `name`
    ("LO-HI", inclusive): launchers that share a host (or the test suite's workers) each
    take a share, so no two pick the same port. A share outside the default is refused."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    lo, _, hi = text.partition("-")
    try:
        window = (int(lo), int(hi) + 1)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected LO-HI") from None
    if not default[0] <= window[0] < window[1] <= default[1]:
        raise ValueError(f"{name}={text!r}: must lie within {default[0]}-{default[1] - 1}")
    return window


SERVICE_WINDOW = port_window("TANDEM_SERVICE_PORTS", (28000, 32768))


@functools.cache
def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (read once)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # the Linux default


def port_bindable(host: str, port: int) -> bool:
    """Whether `port` on `host` can be bound now (nothing listens on or holds it)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def reserve_ports(*ports: int | None) -> None:
    """Ports this process was told to use (flags): free_port never hands them out, so an
    instance's port cannot land on the router's (they are free until the router binds)."""
    _HANDED_OUT.update(p for p in ports if p)


# `tandem up --port-range` puts a child's own port range here (tandem/launch/plan.py): a port
# the child picks itself with free_port (a tensor-parallel instance's rendezvous port) then
# comes from the block the launcher set aside for it.
PORT_RANGE_ENV = "TANDEM_PORT_RANGE"


class PortsExhausted(RuntimeError):
    """No free port is left where one was asked for (a --port-range too crowded)."""


@dataclass(frozen=True)
class PortRange:
    """Ports lo..hi, both included (`--port-range 30000-30999`)."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1024 <= self.lo <= self.hi <= 65535:
            raise ValueError(f"{self}: wants LO-HI with 1024 <= LO <= HI <= 65535")

    @classmethod
    def parse(cls, text: str) -> PortRange:
        m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
        if m is None:
            raise ValueError(f"{text!r}: wants LO-HI, e.g. 30000-30999")
        return cls(int(m.group(1)), int(m.group(2)))

    @property
    def size(self) -> int:
        return self.hi - self.lo + 1

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.lo <= port <= self.hi

    def __str__(self) -> str:
        return f"{self.lo}-{self.hi}"


def env_port_range() -> PortRange | None:
    """The range this process was started with by `tandem up --port-range`, if any."""
    text = os.environ.get(PORT_RANGE_ENV, "")
    return PortRange.parse(text) if text else None


def free_port(host: str = "127.0.0.1", within: PortRange | None = None) -> int:
    """A port free now, never handed out before by this process, and (where the kernel's
    ephemeral range allows) outside it, so no outgoing connection can take it before the
    child binds it. Random, so two processes picking at once rarely meet; the bind check
    catches a port already bound.

    `within` (default: this process's TANDEM_PORT_RANGE, if set): only from that range;
    PortsExhausted when none of it is free."""
    within = within or env_port_range()
    if within is not None:
        candidates = [p for p in range(within.lo, within.hi + 1) if p not in _HANDED_OUT]
        random.shuffle(candidates)
        for port in candidates:
            if port_bindable(host, port):
                _HANDED_OUT.add(port)
                return port
        raise PortsExhausted(f"no free port left in {within} ({within.size} ports: the "
                             "others are handed out or taken by other processes)")
    lo, hi = SERVICE_WINDOW[0], min(SERVICE_WINDOW[1], _ephemeral_low())
    # an unusual ephemeral range (starting below the window's upper part): the kernel's choice
    for _ in range(200 if hi - lo >= 1000 else 0):
        port = random.randrange(lo, hi)
        if port not in _HANDED_OUT and port_bindable(host, port):
            _HANDED_OUT.add(port)
            return port
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def free_block(host: str, width: int, within: PortRange) -> PortRange:
    """`width` consecutive ports of `within`, none handed out before, the first two free
    now (Mooncake binds two of its range; a free pair shows the block is not in use);
    handed out as a whole. Random among the aligned blocks; PortsExhausted if none is."""
    starts = list(range(within.lo, within.hi - width + 2, width))
    random.shuffle(starts)
    for lo in starts:
        block = range(lo, lo + width)
        if (not any(p in _HANDED_OUT for p in block)
                and all(port_bindable(host, p) for p in block[:2])):
            _HANDED_OUT.update(block)
            return PortRange(lo, lo + width - 1)
    raise PortsExhausted(f"no {width} consecutive free ports left in {within}")


# A child started here dies with the process that started it (PR_SET_PDEATHSIG) and may
# run at a lower priority. NOTE: both are set by programs exec'd in front of the command
# (util-linux's `setpriv --pdeathsig`, coreutils' `nice`), not by Python code run between
# fork and exec (`preexec_fn`): the launcher probes over gRPC (so does the test suite), and
# a child forked from a process with gRPC's threads aborted (SIGABRT, gRPC's poller:
# epoll_wait EBADF) before its exec, once in CI. Without `preexec_fn` subprocess forks
# with vfork and runs no Python in the child. Where setpriv is missing, the hook below
# does it (libc is loaded here, in the parent: the hook runs between fork and exec while
# log-forwarding threads exist, so it must not import, dlopen or take locks).
#
# The death signal only covers a parent that dies *after* it is set: a launcher killed
# between fork and setpriv's prctl (a CI failure, 1 run in ~25 of a kill -9 right after
# the start) leaves the child orphaned, with no signal to come. So right after the prctl
# the child checks that its parent is still the launcher (a parent that dies sooner has
# already re-parented it) and exits if not; a parent that dies later sends the signal.
_SETPRIV = shutil.which("setpriv")
_NICE = shutil.which("nice")
_SH = shutil.which("sh")
try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _PRCTL = None
_PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int, parent: int) -> None:  # runs in the child between fork and exec
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:
            os._exit(128 + sig)


@dataclass(frozen=True)
class ChildLaunch:
    """How to start `argv` as a child of this process that dies with it (by signal
    `death`) at niceness `nice`: the argv to exec and the hook to run before it (None:
    none). Started from any other process, the command does not run."""

    argv: list[str]
    preexec: Callable[[], None] | None = None

    @classmethod
    def of(cls, argv: list[str], death: signal.Signals = signal.SIGTERM,
           nice: int = 0) -> ChildLaunch:
        parent = os.getpid()
        if _SETPRIV is not None and _SH is not None and (_NICE is not None or not nice):
            # sh's $PPID is read when it starts, after setpriv's prctl (see above)
            alive = f'[ "$PPID" = {parent} ] || exit {128 + int(death)}; exec "$@"'
            front = [_SETPRIV, f"--pdeathsig={death.name.removeprefix('SIG')}", "--",
                     _SH, "-c", alive, "tandem-child"]
            if nice:
                front += [_NICE, "-n", str(nice)]
            return cls(front + list(argv))

        def setup() -> None:
            _die_with_parent(int(death), parent)
            if nice:
                os.nice(nice)

        return cls(list(argv), setup)


# Mooncake's transfer engine logs through glog, straight to the tier's stderr: a line like
# "W1125 17:33:10.823 28818 topology.cpp:201] No RDMA devices found". On every healthy start
# over TCP it prints these, at warning and even error level; they say nothing is wrong.
_GLOG = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ([\w.]+:\d+)\] (.*)$")
_GLOG_LEVEL = {"I": "INFO", "W": "WARNING", "E": "ERROR", "F": "CRITICAL"}
BENIGN_NATIVE = (
    "WARNING: Logging before InitGoogleLogging() is written to STDERR",
    "Using default malloc/free for protocol: tcp",  # the protocol asked for
    "No RDMA devices found",  # TCP needs none
    "Local segment descriptor not found",  # looked up once before it is registered
)


@dataclass(frozen=True)
class NativeRecord:
    """A Mooncake glog line as a log record: its level (logging's names) and its text."""

    level: str  # "DEBUG" for a benign start-up line, else glog's own level
    text: str  # "topology.cpp:201 No RDMA devices found, ..." (a benign line as written)


def native_record(line: str) -> NativeRecord | None:
    """The record of a Mooncake glog line; None for any other line."""
    if any(b in line for b in BENIGN_NATIVE):
        return NativeRecord("DEBUG", line)
    m = _GLOG.match(line)
    if m is None:
        return None
    return NativeRecord(_GLOG_LEVEL[m.group(1)], f"{m.group(2)} {m.group(3)}")


def native_line(line: str, log_level: str) -> str | None:
    """A child's output line as the launcher shows it: Mooncake's glog lines in our shape
    ("mooncake WARNING topology.cpp:201 ..."), its benign start-up lines only at debug
    (None: not shown); every other line as it is."""
    rec = native_record(line)
    if rec is None:
        return line
    if rec.level == "DEBUG" and log_level != "debug":
        return None
    return f"mooncake {rec.level} {rec.text}"


# Set in a tier's environment by whatever already filters its output (`tandem up`, or
# `filtered` below around a tier started on its own): the tier then runs as it is.
FILTERED_ENV = "TANDEM_NATIVE_LOG_FILTERED"
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
              signal.SIGUSR2)


def filtered(argv: list[str], log_level: str, log_format: str) -> int:
    """Run a tier started on its own (a pod's `tandem encoder ...`) as a child whose
    Mooncake glog lines on stderr become log records of logger `mooncake`, in the tier's
    own --log-format (text or JSON) and filtered by its --log-level: a benign start-up
    line is a DEBUG record, so a healthy start prints no WARNING or ERROR. Every other
    line passes as it is. Returns the child's exit code (128 + N after signal N).

    This process stays until the child's stderr closes, so the child's last words (a
    traceback, a fatal glog line) are forwarded too. The child runs in a session of its
    own, so a terminal's Ctrl-C reaches it once, forwarded from here with every other
    stop signal; if this process is killed outright, the child is SIGKILLed with it
    (PR_SET_PDEATHSIG), as a pod's whole container would be. The child's stdout is this
    process's own."""
    launch = ChildLaunch.of(argv, death=signal.SIGKILL)
    proc = subprocess.Popen(launch.argv, stderr=subprocess.PIPE,
                            env={**os.environ, FILTERED_ENV: "1"},
                            start_new_session=True, preexec_fn=launch.preexec)
    for sig in _FORWARDED:
        signal.signal(sig, lambda s, _frame: proc.send_signal(s))
    import logging

    from tandem.logs import configure_logging

    configure_logging(log_format, getattr(logging, log_level.upper(), logging.INFO))
    native = logging.getLogger("mooncake")
    for raw in iter(proc.stderr.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        rec = native_record(line)
        if rec is None:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        else:
            native.log(getattr(logging, rec.level), "%s", rec.text)
    code = proc.wait()
    return code if code >= 0 else 128 - code


@dataclass
class Child:
    """One service process. `health_service` is the grpc.health.v1 service name whose
    SERVING status means ready ("" for the tiers, "tandem.v1.Router" for the router)."""

    name: str
    argv: list[str]
    grpc_address: str
    health_service: str = ""
    env_extra: dict[str, str] = field(default_factory=dict)  # e.g. secrets kept out of argv
    metrics_url: str = ""  # its Prometheus endpoint, printed with its ready line
    nice: int = 0  # scheduling priority below the launcher's (`tandem up --encoder-nice`)
    probe_tls: object | None = None  # InternalTLS (role operator) for a tier under mTLS
    log_level: str = "info"  # its --log-level: Mooncake's benign start-up lines below debug
    proc: subprocess.Popen | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))
    started_at: float = 0.0
    ready_after_s: float | None = None
    _pump: threading.Thread | None = None

    def start(self, env: dict[str, str]) -> None:
        self.started_at = time.monotonic()
        launch = ChildLaunch.of(self.argv, nice=self.nice)
        self.proc = subprocess.Popen(
            launch.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # its output is filtered here (_forward): the tier need not filter it again
            env={**(os.environ if env is None else env), **self.env_extra, FILTERED_ENV: "1"},
            start_new_session=True,
            preexec_fn=launch.preexec,
        )
        self._pump = threading.Thread(target=self._forward, name=f"log-{self.name}", daemon=True)
        self._pump.start()

    def _forward(self) -> None:
        width = 11
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            self.tail.append(line)
            shown = native_line(line, self.log_level)
            if shown is not None:
                say(f"{self.name:<{width}}| {shown}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill_group(self) -> None:
        """Last resort: SIGKILL the child's whole process group."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

    def join_logs(self, timeout: float = 2.0) -> None:
        if self._pump is not None:
            self._pump.join(timeout)


def probe(child: Child, timeout: float = 1.0) -> bool:
    """True when the child's health service answers SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tandem.internal_tls import sync_channel

    with sync_channel(child.grpc_address, child.probe_tls) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=child.health_service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


def wait_ready(children: list[Child], timeout_s: float, stop: threading.Event) -> None:
    """Block until every child is SERVING; one progress line per child as it gets there.
    Raises RuntimeError naming the child that died or did not become ready."""
    pending = list(children)
    end = time.monotonic() + timeout_s
    last_note = time.monotonic()
    while pending:
        if stop.is_set():
            raise KeyboardInterrupt
        for c in list(pending):
            if not c.alive:
                tail = "\n  ".join(list(c.tail)[-15:])
                raise RuntimeError(
                    f"{c.name} exited with code {c.proc.returncode} before it was ready:\n  {tail}"
                )
            if probe(c, timeout=0.5):
                c.ready_after_s = time.monotonic() - c.started_at
                metrics = f"   metrics {c.metrics_url}" if c.metrics_url else ""
                say(f"[up] {c.name:<11} ready   {c.grpc_address:<21} ({c.ready_after_s:.1f} s)"
                    f"{metrics}")
                pending.remove(c)
        if time.monotonic() > end:
            names = ", ".join(c.name for c in pending)
            raise RuntimeError(f"not ready after {timeout_s:.0f} s: {names}")
        if pending and time.monotonic() - last_note > 5:
            last_note = time.monotonic()
            say("[up] waiting for " + ", ".join(c.name for c in pending))
        stop.wait(0.2)


def stop_all(groups: list[list[Child]], timeout_s: float) -> None:
    """SIGTERM group by group (each gets up to `timeout_s` to drain), then SIGKILL the
    process groups of whatever is left. Returns once every child has exited."""
    for group in groups:
        for c in group:
            c.signal(signal.SIGTERM)
        end = time.monotonic() + timeout_s
        for c in group:
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"[up] {c.name} did not stop in {timeout_s:.0f} s; killing it")
            # NOTE: kill the group even after a clean exit: a grandchild must not survive.
            c.kill_group()
    for group in groups:
        for c in group:
            c.join_logs()


def stop_event_on_signals() -> threading.Event:
    """An event SIGINT / SIGTERM set (once announced): the launchers' main loops wait on it."""
    stop = threading.Event()

    def on_signal(signum, _frame):
        if not stop.is_set():
            say(f"[up] {signal.Signals(signum).name}: stopping the cluster")
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stop
