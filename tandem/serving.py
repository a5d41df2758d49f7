"""gRPC server scaffolding every Tandem service shares: health, reflection, bind, signals,
drain, deadlines.

    server = grpc.aio.server(...)
    add_XServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, SERVICE)   # grpc.health.v1 + reflection
    bind(server, address, "tandem encoder")                # exits with one line on failure
    await server.start(); await set_serving(health, SERVICE)
    stop = stop_on_signals(stop)                           # SIGTERM / SIGINT set it
    await stop.wait()
    servicer.draining = True                               # new calls get UNAVAILABLE
    left = await drain(health, lambda: servicer.num_active, timeout_s)

Request deadlines arrive as `deadline_unix_ms` (0 = the service's default timeout);
`deadline_from_proto` is the one reading of that field.

NOTE: health answers for "" (the process) and for the full service name; the Helm
chart's probes and the router's probes ask for these exact names.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


def add_health_and_reflection(server: grpc.aio.Server, service: str) -> health.aio.HealthServicer:
    """Serve grpc.health.v1 and server reflection beside `service` (a full name)."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        (service, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return servicer


def bind(server: grpc.aio.Server, address: str, prog: str) -> int:
    """Bind an insecure port; a port already taken stops the service with one line."""
    port = server.add_insecure_port(address)
    if port == 0:
        raise SystemExit(f"{prog}: cannot bind {address}")
    return port


async def set_serving(servicer: health.aio.HealthServicer, service: str) -> None:
    for name in ("", service):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


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


async def drain(
    health_servicer: health.aio.HealthServicer, active: Callable[[], int], timeout_s: float
) -> int:
    """Every health name turns NOT_SERVING (load balancers and the router stop sending),
    then wait up to `timeout_s` for the calls in progress; returns how many are left.

    The caller refuses new calls (its `draining` flag) before this, so `active()` only
    falls."""
    await health_servicer.enter_graceful_shutdown()
    return await wait_idle(active, timeout_s)


def deadline_from_proto(deadline_unix_ms: int, default_timeout_s: float, now: float) -> float:
    """A request's absolute deadline in Unix seconds.

    0 means "none given": the service's default timeout from `now` (Unix seconds). Any
    other value is an absolute time, so a negative one has already passed; the caller
    refuses a deadline `<= now` with DEADLINE_EXCEEDED."""
    if deadline_unix_ms == 0:
        return now + default_timeout_s
    return deadline_unix_ms / 1e3
