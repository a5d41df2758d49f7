"""gRPC server scaffolding every Tandem service shares: health, reflection, bind, signals.

    server = grpc.aio.server(...)
    add_XServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, SERVICE)   # grpc.health.v1 + reflection
    bind(server, address, "tandem encoder")                # exits with one line on failure
    await server.start(); await set_serving(health, SERVICE)
    stop = stop_on_signals(stop)                           # SIGTERM / SIGINT set it

NOTE: health answers for "" (the process) and for the full service name; the Helm
chart's probes and the router's probes ask for these exact names.
"""

from __future__ import annotations

import asyncio
import signal

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
