"""A real router (gRPC + uvicorn on loopback) without tiers, driven by the SDK, httpx and
grpc health; and a real pool ejecting a dead address and probing it back."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.client import (
    AsyncClient,
    AuthenticationError,
    Client,
    InvalidRequestError,
    NotFoundError,
    UnavailableError,
    image,
)
from tandem.launch.procs import free_port
from tandem.services.router.config import RouterConfig
from tandem.services.router.dispatch.health import InstanceState
from tandem.services.router.dispatch.registry import Pool, Registry, resolve
from tandem.services.router.main import run_router

sys.path.insert(0, str(Path(__file__).parent))
from waiting import async_wait_until, wait_until  # noqa: E402


def _serve_router(**overrides):
    cfg = RouterConfig(http_port=free_port(), grpc_port=free_port(), api_key="k3y",
                       encoders=[f"127.0.0.1:{free_port()}"], languages=[f"127.0.0.1:{free_port()}"],
                       load_refresh_s=0.1, model="tiny", insecure_internal=True, **overrides)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    t = threading.Thread(target=loop.run_until_complete, args=(run_router(cfg, stop),))
    t.start()

    def answers() -> bool:
        try:
            httpx.get(f"http://127.0.0.1:{cfg.http_port}/health", timeout=5)
            return True
        except httpx.HTTPError:
            return False

    wait_until(answers, timeout_s=60, what="the router answering /health")
    yield cfg
    loop.call_soon_threadsafe(stop.set)
    t.join(30)
    assert not t.is_alive()


@pytest.fixture(scope="module")
def router():
    yield from _serve_router()


IMPATIENT_S = 2.0  # the impatient router's http_request_timeout_s


@pytest.fixture(scope="module")
def impatient_router():
    yield from _serve_router(http_request_timeout_s=IMPATIENT_S)


def test_sdk_typed_errors(router):
    addr = f"127.0.0.1:{router.grpc_port}"
    with Client(addr) as c:
        with pytest.raises(AuthenticationError):
            c.chat("hi")
        with pytest.raises(AuthenticationError):
            c.models()
    with Client(addr, api_key="k3y", retries=2, backoff=0.01) as c:
        assert c.models() == ["tiny"]
        with pytest.raises(UnavailableError, match="no healthy"):
            c.chat([{"role": "user", "content": [image(b"\x89PNG..."), "what?"]}])
        with pytest.raises(NotFoundError):
            c.chat("hi", model="other")
        with pytest.raises(InvalidRequestError, match="role") as e:
            c.chat([{"role": "wizard", "content": "x"}])
        assert e.value.field == "messages[0].role"  # carried in the call's trailing metadata
        with pytest.raises(InvalidRequestError) as e:
            list(c.stream_chat("hi", temperature=-1))
        assert e.value.field == "sampling.temperature"


def test_async_sdk_and_unreachable_router(router):
    async def go():
        async with AsyncClient(f"127.0.0.1:{router.grpc_port}", api_key="k3y", retries=1,
                               backoff=0.01) as c:
            assert await c.models() == ["tiny"]
            with pytest.raises(UnavailableError):
                await c.chat("hi")
            with pytest.raises(InvalidRequestError) as e:
                await c.chat([{"role": "wizard", "content": "x"}])
            assert e.value.field == "messages[0].role"
        async with AsyncClient(f"127.0.0.1:{free_port()}", retries=2, backoff=0.01,
                               timeout=5) as c:
            with pytest.raises(UnavailableError):
                await c.chat("hi")

    asyncio.run(go())


def test_http_and_grpc_health_reflection(router):
    base = f"http://127.0.0.1:{router.http_port}"
    assert httpx.get(f"{base}/health").status_code == 503
    assert httpx.get(f"{base}/v1/models").status_code == 401
    r = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer k3y"})
    assert r.json()["data"][0]["id"] == "tiny"
    assert "tandem_router_healthy_instances" in httpx.get(f"{base}/metrics").text
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as ch:
        h = health_pb2_grpc.HealthStub(ch)
        S = health_pb2.HealthCheckResponse
        assert h.Check(health_pb2.HealthCheckRequest(service="")).status == S.SERVING
        ready = h.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Router")).status
        assert ready == S.NOT_SERVING  # no healthy tiers behind it
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        names = [s.name for r in refl.ServerReflectionInfo(iter([req]))
                 for s in r.list_services_response.service]
        assert "tandem.v1.Router" in names


def test_pool_ejects_dead_instance_and_probes_it_back():
    async def go():
        port = free_port()
        pool = Pool("encoder", eject_after=2, rpc_timeout_s=0.5)
        await pool.set_addresses([f"127.0.0.1:{port}"])
        inst = pool.instances[f"127.0.0.1:{port}"]
        pool.record_success(inst.address)  # as if it had answered before dying
        for _ in range(2):
            await pool.poll()
        assert inst.tracker.state is InstanceState.EJECTED and pool.candidates() == []
        server = grpc.aio.server()
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await hs.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await pool.poll()
        assert inst.tracker.state is InstanceState.EJECTED
        await hs.set("", health_pb2.HealthCheckResponse.SERVING)

        async def probed_back() -> bool:
            await pool.poll()
            return inst.tracker.healthy

        await async_wait_until(probed_back, timeout_s=60, poll_s=0.1,
                               what="the ejected instance probed back to healthy",
                               state=lambda: inst.tracker.state)
        assert inst.tracker.healthy and [c.address for c in pool.candidates()] == [inst.address]
        # A failed request on an instance that still answers health checks is not its fault.
        for _ in range(3):
            await pool.verify(inst.address)
        assert inst.tracker.healthy and inst.tracker.consecutive_failures == 0
        await server.stop(None)
        for _ in range(2):  # ... but once it is gone, failed requests eject it
            await pool.verify(inst.address)
        assert inst.tracker.state is InstanceState.EJECTED
        await pool.set_addresses([])
        assert pool.instances == {}
        await pool.close()

    asyncio.run(go())


def test_dns_resolution():
    async def go():
        assert await resolve("localhost:50061") in (["127.0.0.1:50061"],
                                                    ["127.0.0.1:50061", "[::1]:50061"])
        assert await resolve("no-such-host.invalid:1") == []
        with pytest.raises(ValueError):
            await resolve("nohostport")
        # The registry merges the static list with what the DNS name resolves to, and a
        # failed re-resolution keeps the instances it had.
        cfg = RouterConfig(encoders=["10.1.1.1:50061"], encoder_dns="localhost:50061",
                           language_dns="localhost:50071", insecure_internal=True)
        reg = Registry(cfg)
        await reg.refresh_membership()
        assert "10.1.1.1:50061" in reg.encoders.instances
        assert "127.0.0.1:50061" in reg.encoders.instances
        assert "127.0.0.1:50071" in reg.languages.instances
        reg.cfg = cfg.model_copy(update={"language_dns": "no-such-host.invalid:50071"})
        await reg.refresh_membership()
        assert "127.0.0.1:50071" in reg.languages.instances
        await reg.stop()

    asyncio.run(go())


def test_client_import_is_light():
    code = ("import sys, tandem.client; heavy = [m for m in ('torch', 'transformers', 'numpy') "
            "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _self_signed(tmp_path):
    from datetime import datetime, timedelta, timezone

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.now(timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1)).not_valid_after(now + timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return cert_pem


def test_tls_on_the_grpc_port(tmp_path):
    pytest.importorskip("cryptography")
    cert_pem = _self_signed(tmp_path)
    cfg = RouterConfig(http_port=free_port(), grpc_port=free_port(), host="127.0.0.1",
                       tls_cert=str(tmp_path / "cert.pem"), tls_key=str(tmp_path / "key.pem"),
                       model="tiny", insecure_internal=True)

    async def accepts() -> bool:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", cfg.grpc_port)
        except OSError:
            return False
        w.close()
        return True

    async def go():
        stop = asyncio.Event()
        task = asyncio.create_task(run_router(cfg, stop))
        await async_wait_until(accepts, timeout_s=60, what="the router's TLS gRPC port open",
                               state=lambda: task)
        async with AsyncClient(f"127.0.0.1:{cfg.grpc_port}", tls=True, root_certificates=cert_pem,
                               tls_server_name="localhost") as c:
            assert await c.models() == ["tiny"]
        async with AsyncClient(f"127.0.0.1:{cfg.grpc_port}", retries=0) as c:
            with pytest.raises(UnavailableError):  # plaintext is refused on a TLS port
                await c.models()
        stop.set()
        await asyncio.wait_for(task, 30)

    asyncio.run(go())


def test_idle_keep_alive_outlives_client_pools(router):
    """A connection idle for 6 s still serves (uvicorn's default 5 s equals common clients'
    pool expiry, so under load a reused connection met the router closing it)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", router.http_port, timeout=5)
    try:
        for idle in (0, 6):
            time.sleep(idle)
            conn.request("GET", "/health")  # http.client never reconnects by itself
            r = conn.getresponse()
            r.read()
            assert r.status in (200, 503) and not r.will_close
    finally:
        conn.close()


def _waiting_for_more(sock) -> bool:
    """Whether the server, right after what the client sent, has neither answered nor
    closed: a short peek finds nothing to read yet (it neither returns bytes nor b"")."""
    sock.settimeout(0.1)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except TimeoutError:
        return True
    return False


def _read_until_closed(sock) -> bytes:
    """Everything the server sends until it closes the connection. The socket's timeout
    is a hang guard (a server holding the connection for ever), not a bound."""
    sock.settimeout(60)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        pytest.fail(f"the server held the stalled connection open (hang guard), after {got!r}")
    return got


@pytest.mark.parametrize("sent", [
    b"",  # opened, never spoke
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le",  # half the headers
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k3y\r\n"
    b"Content-Type: application/json\r\nContent-Length: 400\r\n\r\n{\"model\": ",  # half a body
], ids=["silent", "half-headers", "half-body"])
def test_stalled_connections_are_closed_at_the_request_deadline(impatient_router, sent):
    """A client that stalls before its request is whole (slowloris) is first waited for
    (the connection stays open, unanswered), then loses the connection at its request
    deadline (`http_request_timeout_s`, IMPATIENT_S here): a 408 with an OpenAI timeout
    error when it had started a request, a plain close when it never spoke. Before, uvicorn
    held such connections for ever. A normal request on a fresh connection is served after.
    What ended the wait is the deadline's answer (408, timeout_error), not a duration."""
    import json

    with socket.create_connection(("127.0.0.1", impatient_router.http_port)) as sock:
        sock.sendall(sent)
        assert _waiting_for_more(sock)  # not refused or cut off on the spot...
        got = _read_until_closed(sock)  # ...but closed once its deadline passes
    if sent:
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), got
        error = json.loads(body)["error"]
        assert (error["type"], error["code"]) == ("timeout_error", "request_timeout"), error
    else:
        assert got == b""
    r = httpx.get(f"http://127.0.0.1:{impatient_router.http_port}/health", timeout=5)
    assert r.status_code in (200, 503)
