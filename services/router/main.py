"""Router process: gRPC Router (+ health, reflection) and OpenAI HTTP on one event loop.

Health (services/router/health.py): the overall service "" is SERVING while the process
runs (liveness); "tandem.v1.Router" is SERVING only while at least one instance of every
tier is healthy and the router is not draining (readiness for every tier, as HTTP /ready;
`tandem up` waits for it). HTTP /health answers 200 on less: a language instance.
On SIGTERM/SIGINT: stop admitting, wait up to `drain_timeout_s` for in-flight requests,
then stop both servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from pathlib import Path

import grpc
import uvicorn
from grpc_health.v1 import health_pb2

from tandem import serving
from tandem.services.router.core import RouterCore
from tandem.services.router.grpc_api import RouterServicer
from tandem.services.router.openai.app import build_app
from tandem.services.router.openai.server import http_config
from tandem.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger("tandem.router")
ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


def http_socket(host: str, port: int) -> socket.socket:
    """The HTTP listening socket (bound here so the printed port is the real one).
    NOTE: proto IPPROTO_TCP, not the default 0: accepted sockets inherit it, and asyncio
    sets TCP_NODELAY only on sockets whose proto says TCP. Without it Nagle holds each SSE
    chunk behind the client's delayed ACK (measured: +40 ms on every streamed TTFT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:  # taken since the start-up check: still one line
        sock.close()
        raise SystemExit(f"tandem router: cannot listen on {host}:{port} (--http-port): "
                         f"{e.strerror}") from None
    return sock


class _HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: the router drains first."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def build_grpc_server(core: RouterCore):
    cfg = core.cfg
    server = serving.grpc_server(
        max_receive_message_length=cfg.max_request_bytes,
        max_send_message_length=cfg.max_request_bytes,
    )
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(core), server)
    health_servicer = serving.add_health_and_reflection(server, ROUTER_SERVICE)
    address = f"{cfg.host}:{cfg.grpc_port}"
    if cfg.tls_cert or cfg.tls_key:
        if not (cfg.tls_cert and cfg.tls_key):
            raise SystemExit("tandem router: tls_cert and tls_key must be given together")
        creds = grpc.ssl_server_credentials(
            [(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())]
        )
        port = server.add_secure_port(address, creds)
    else:
        port = serving.bind(server, address, "tandem router")
    return server, health_servicer, port


async def _health_loop(core: RouterCore, servicer) -> None:
    S = health_pb2.HealthCheckResponse
    while True:
        status = S.SERVING if core.ready() else S.NOT_SERVING
        await servicer.set(ROUTER_SERVICE, status)
        await asyncio.sleep(0.25)


async def run_router(cfg, stop: asyncio.Event) -> None:
    """Serve until `stop` is set, then drain and shut down."""
    serving.require_free_ports("tandem router", cfg.host, {"--http-port": cfg.http_port,
                                                           "--grpc-port": cfg.grpc_port})
    core = RouterCore(cfg)
    await core.registry.start()
    server, health_servicer, grpc_port = build_grpc_server(core)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(ROUTER_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    sock = http_socket(cfg.host, cfg.http_port)
    http = _HttpServer(http_config(build_app(core), cfg))
    http_task = asyncio.create_task(http.serve(sockets=[sock]))
    health_task = asyncio.create_task(_health_loop(core, health_servicer))
    log.info("router ready: http://%s:%d grpc %s:%d encoders=%d languages=%d", cfg.host,
             sock.getsockname()[1], cfg.host, grpc_port, len(core.registry.encoders.instances),
             len(core.registry.languages.instances))
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.wait({stop_task, http_task}, return_when=asyncio.FIRST_COMPLETED)
    # Drain: refuse new work, let in-flight requests finish.
    core.draining = True
    health_task.cancel()
    await health_servicer.enter_graceful_shutdown()
    await serving.wait_idle(lambda: core.admission.inflight, cfg.drain_timeout_s)
    http.should_exit = True
    with contextlib.suppress(BaseException):
        await asyncio.wait_for(http_task, timeout=5)
    await server.stop(grace=1.0)
    stop_task.cancel()
    await core.registry.stop()
    sock.close()


def serve(cfg) -> int:
    async def main() -> None:
        await run_router(cfg, serving.stop_on_signals())

    return serving.run_service("tandem router", main(), log_format=cfg.log_format,
                               log_level=cfg.log_level, tracing=cfg.tracing)
