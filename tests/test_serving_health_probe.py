"""The plaintext health probe port (start_serving's `health_port`): it answers the same
health servicer as the service's port, and the servicer holds its server from its
construction on (tandem/serving.py `Health`), so the probe lives as long as it does."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem import serving
from tandem.launch.procs import free_port


def test_the_probe_port_serves_the_same_health_and_is_held_from_construction():
    async def run():
        server = grpc.aio.server()
        probe_port = free_port()
        servicer = await serving.start_serving(server, "tandem.test.Probe", "127.0.0.1:0",
                                               "test", health_port=probe_port)
        try:
            assert isinstance(servicer.probe_server, grpc.aio.Server)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{probe_port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                before = await stub.Check(health_pb2.HealthCheckRequest(
                    service="tandem.test.Probe"))
                await servicer.enter_graceful_shutdown()
                after = await stub.Check(health_pb2.HealthCheckRequest(service=""))
            return before.status, after.status
        finally:
            await servicer.probe_server.stop(None)
            await server.stop(None)

    before, after = asyncio.run(run())
    assert before == health_pb2.HealthCheckResponse.SERVING
    assert after == health_pb2.HealthCheckResponse.NOT_SERVING


def test_without_a_probe_port_the_servicer_holds_none():
    assert serving.Health().probe_server is None
