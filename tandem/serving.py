"""gRPC server scaffolding every Tandem service shares: process start, health, reflection,
bind, signals, drain, deadlines.

    def serve(cfg):                     # logging, CPU threads, event loop, one-line errors
        return run_service("tandem encoder", run(cfg), cfg.cpu_threads)

    async def run(cfg, ready=None, stop=None):
        tls = load_internal_tls(cfg, "tandem encoder", "encoder")  # None: --insecure-internal
        server = grpc_server(tls, ...)                             # + RoleGate under mTLS
        add_XServicer_to_server(servicer, server)
        health = await start_serving(server, SERVICE, address, "tandem encoder", tls)
            # = add_health_and_reflection (grpc.health.v1 + reflection), bind (exits with
            #   one line on failure), server.start(), set_serving
        stop = stop_on_signals(stop)                         # SIGTERM / SIGINT set it
        await stop.wait()
        left = await drain(servicer, health, timeout_s, log) # new calls get UNAVAILABLE

Request deadlines arrive as `deadline_unix_ms` (0 = the service's default timeout);
`deadline_from_proto` is the one reading of that field.

NOTE: health answers for "" (the process) and for the full service name; the Helm
chart's probes and the router's probes ask for these exact names.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.internal_tls import InternalTLS, RoleGate
from tandem.tracing import TracingConfig, TracingError
from tandem.tracing import setup as trace_setup

log = logging.getLogger("tandem")

# `kill -USR1 PID` prints every thread's Python stack on the process's stderr: how to see
# where a tier or `tandem up` is stuck. faulthandler writes from the signal itself, so the
# dump comes even when the event loop or the main thread is blocked.
STACKS_SIGNAL = signal.SIGUSR1


def dump_stacks_on_signal() -> None:
    faulthandler.register(STACKS_SIGNAL, all_threads=True)

# NOTE: gRPC servers set SO_REUSEPORT by default, so a second process binding a taken port
# succeeds and the kernel splits connections between the two (seen: an encoder and a
# language instance on one port, half the calls "Method not found"). Off: a taken port is
# a bind error (`bind` below).
_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (("grpc.so_reuseport", 0),)


def grpc_server(internal: InternalTLS | None = None, **limits: int) -> grpc.aio.Server:
    """Every service's gRPC server: _SERVER_OPTIONS plus `grpc.<name>` channel limits, e.g.
    grpc_server(tls, max_send_message_length=16 << 20). An internal tier's server with
    mTLS (`internal`) checks each caller's role before any handler (RoleGate)."""
    options = [*_SERVER_OPTIONS, *((f"grpc.{k}", v) for k, v in limits.items())]
    return grpc.aio.server(options=options, interceptors=[RoleGate()] if internal else None)


def run_service(prog: str, main: Coroutine[None, None, None], cpu_threads: int = 0,
                log_format: str = "text", log_level: str = "info",
                tracing: TracingConfig | None = None) -> int:
    """The body of `tandem <service>`: log lines on stderr (a level on each; text or
    JSON), traces (`tracing`: the service's settings; its spans are named for `prog`,
    "tandem-encoder", unless configured otherwise; tandem/tracing.py), torch's CPU threads
    (0 keeps torch's default), the event loop until `main` returns. A start-up error (a
    tracing setting or a checkpoint that cannot be used: exit code 2; bad TLS material, a
    taken port: exit code 1) is one logged line naming the problem, in the chosen format,
    not a traceback."""
    from tandem.logs import configure_logging
    from tandem.models.checkpoint import CheckpointError

    configure_logging(log_format, getattr(logging, log_level.upper()))
    dump_stacks_on_signal()
    try:
        trace_setup(tracing or TracingConfig(), prog.replace(" ", "-"))
    except TracingError as e:
        main.close()  # never started
        log.error("%s: invalid tracing setting: %s", prog, e)
        return 2
    if cpu_threads:
        import torch

        torch.set_num_threads(cpu_threads)
    try:
        asyncio.run(main)
    except CheckpointError as e:
        log.error("%s: %s", prog, e)
        return 2
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        log.error("%s", e.code)  # NOTE: the message already names the program
        return 1
    return 0


class Health(health.aio.HealthServicer):
    """gRPC's health servicer, holding the server of the plaintext probe port that also
    serves it (None: no probe port): given at construction, kept alive with the servicer."""

    def __init__(self, probe_server: grpc.aio.Server | None = None) -> None:
        super().__init__()
        self.probe_server = probe_server


def add_health_and_reflection(server: grpc.aio.Server, service: str,
                              probe_server: grpc.aio.Server | None = None) -> Health:
    """Serve grpc.health.v1 and server reflection beside `service` (a full name);
    `probe_server`: the probe port's server, which the caller has serve the same servicer."""
    servicer = Health(probe_server)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        (service, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return servicer


def require_free_ports(prog: str, host: str, ports: dict[str, int]) -> None:
    """Stop now, in one line naming the port, when a port this process will listen on is
    taken: called first thing, so a second server on a taken port says so in seconds, not
    after its model loaded (SO_REUSEADDR as the real binds: a port in TIME_WAIT is free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for flag, port in ports.items():
        if not port:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                raise SystemExit(f"{prog}: cannot listen on {host}:{port} ({flag}): "
                                 f"{e.strerror}") from None


def bind(server: grpc.aio.Server, address: str, prog: str,
         internal: InternalTLS | None = None) -> int:
    """Bind a port (mTLS with `internal`, else plaintext); a port already taken stops the
    service with one line."""
    try:  # NOTE: older grpc returns 0 on failure, newer raises RuntimeError
        if internal is not None:
            port = server.add_secure_port(address, internal.server_credentials())
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise SystemExit(f"{prog}: cannot bind {address} ({e})") from None
    if port == 0:
        raise SystemExit(f"{prog}: cannot bind {address}")
    return port


async def set_serving(servicer: health.aio.HealthServicer, service: str) -> None:
    for name in ("", service):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


async def start_serving(
    server: grpc.aio.Server, service: str, address: str, prog: str,
    internal: InternalTLS | None = None, health_port: int = 0,
) -> Health:
    """Health and reflection beside `service`, bind `address` (mTLS with `internal`),
    start, and turn SERVING; the health servicer, for the drain. `health_port` > 0 also
    serves that servicer alone, plaintext, on the same host: a Kubernetes gRPC probe
    cannot present a client certificate, and health is all that port answers."""
    probe = grpc.aio.server(options=list(_SERVER_OPTIONS)) if health_port else None
    servicer = add_health_and_reflection(server, service, probe)
    bind(server, address, prog, internal)
    if probe is not None:
        health_pb2_grpc.add_HealthServicer_to_server(servicer, probe)
        bind(probe, f"{address.rsplit(':', 1)[0]}:{health_port}", prog)
        await probe.start()
    await server.start()
    await set_serving(servicer, service)
    return servicer


async def follow_health(servicer: health.aio.HealthServicer, service: str,
                        out_of_service: Callable[[], str | None], period_s: float,
                        log: logging.Logger) -> None:
    """Until cancelled: every health name NOT_SERVING while `out_of_service()` gives a
    reason, SERVING again once it gives None; each change logged. (After the drain's
    graceful shutdown the servicer ignores both: it stays NOT_SERVING.)"""
    was = None
    while True:
        why = out_of_service()
        if (why is None) != (was is None):
            status = (health_pb2.HealthCheckResponse.SERVING if why is None
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for name in ("", service):
                await servicer.set(name, status)
            if why is None:
                log.warning("back in service (health SERVING)")
            else:
                log.error("out of service (health NOT_SERVING): %s", why)
        was = why
        await asyncio.sleep(period_s)


def stop_on_signals(stop: asyncio.Event | None = None) -> asyncio.Event:
    """An event that SIGTERM / SIGINT set (handlers only install on the main thread)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    return stop


async def wait_idle(active: Callable[[], int], timeout_s: float, poll_s: float = 0.05) -> int:
    """Wait up to `timeout_s` for `active()` to reach 0; what is still active then."""
    end = time.monotonic() + timeout_s
    while active() and time.monotonic() < end:
        await asyncio.sleep(poll_s)
    return active()


class Drainable(Protocol):
    """A servicer the drain can stop: it refuses new calls (UNAVAILABLE) once `draining`
    is set, and counts the calls in progress."""

    draining: bool

    @property
    def num_active(self) -> int: ...


async def drain(
    servicer: Drainable,
    health_servicer: health.aio.HealthServicer,
    timeout_s: float,
    log: logging.Logger,
) -> int:
    """Refuse new calls, turn every health name NOT_SERVING (load balancers and the router
    stop sending), then wait up to `timeout_s` for the calls in progress; returns how many
    are left (the caller ends those its own way)."""
    log.info("draining: %d calls in progress", servicer.num_active)
    servicer.draining = True  # set first: from here `num_active` only falls
    await health_servicer.enter_graceful_shutdown()
    left = await wait_idle(lambda: servicer.num_active, timeout_s)
    if left:
        log.warning("drain timeout: %d calls still in progress", left)
    return left


def deadline_from_proto(deadline_unix_ms: int, default_timeout_s: float, now: float) -> float:
    """A request's absolute deadline in Unix seconds.

    0 means "none given": the service's default timeout from `now` (Unix seconds). Any
    other value is an absolute time, so a negative one has already passed; the caller
    refuses a deadline `<= now` with DEADLINE_EXCEEDED."""
    if deadline_unix_ms == 0:
        return now + default_timeout_s
    return deadline_unix_ms / 1e3
