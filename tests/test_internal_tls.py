"""mTLS between the tiers (tandem/internal_tls.py), on a real `tandem up` cluster (1 encoder,
1 language instance), which makes a throwaway CA and a certificate per tier at start.

For every method of the encoder and language tiers:
- without a certificate (plaintext, or TLS with no client certificate, or a certificate
  from another CA) the call fails with UNAVAILABLE (the handshake is refused);
- with a valid certificate of a role the method is not for, PERMISSION_DENIED before the
  handler runs;
and after all of it nothing was allocated (no room, no block, no KV page, no request), no
buffer layout went to the address a caller named, and a chat through the router (which
holds the router certificate) still works. A tier without TLS material and without
--insecure-internal, or with another role's certificate, stops at start with one line.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.internal_tls import InternalTLS, from_files, sync_channel
from tandem.launch.cluster import LocalCluster
from tandem.launch.procs import free_port
from tandem.pki import INTERNAL_NAME, PKIPaths, make_pki
from tandem.v1 import (
    common_pb2,
    encoder_pb2,
    encoder_pb2_grpc,
    language_pb2,
    language_pb2_grpc,
)

pytestmark = pytest.mark.timeout(300)
HEALTH_PORT = free_port()


@pytest.fixture(scope="module")
def cluster(checkpoint, tmp_path_factory):
    pki = tmp_path_factory.mktemp("pki")
    cl = LocalCluster(str(checkpoint("qwen2_5_vl")), pki_dir=str(pki),
                      encoder_args=f"--health-port {HEALTH_PORT}").start()
    yield cl, PKIPaths(pki)
    cl.stop()


def test_the_health_only_port_answers_health_and_nothing_else(cluster):
    """The plaintext port a kubelet probes: grpc.health.v1 without a certificate, and no
    other service (the encoder's methods are not there)."""
    cl, _ = cluster
    with grpc.insecure_channel(f"127.0.0.1:{HEALTH_PORT}") as ch:
        for service in ("", "tandem.v1.Encoder"):
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        assert code_of(lambda: encoder_pb2_grpc.EncoderStub(ch).GetLoad(
            encoder_pb2.EncoderGetLoadRequest(), timeout=5)) == grpc.StatusCode.UNIMPLEMENTED


def as_role(pki: PKIPaths, role: str) -> InternalTLS:
    return from_files(pki.ca, pki.cert(role), pki.key(role), role)


def channels(pki: PKIPaths, foreign: PKIPaths, address: str) -> dict[str, grpc.Channel]:
    """Every way a caller without the right to call may try."""
    ca = pki.ca.read_bytes()
    no_client_cert = grpc.ssl_channel_credentials(ca)
    return {
        "plaintext": grpc.insecure_channel(address),
        "tls, no client certificate": grpc.secure_channel(
            address, no_client_cert, [("grpc.ssl_target_name_override", INTERNAL_NAME)]),
        "another CA's router certificate": sync_channel(address, InternalTLS(
            ca, foreign.cert("router").read_bytes(), foreign.key("router").read_bytes(),
            "router")),
    }


def encoder_calls(stub):
    return {
        "Encode": lambda: stub.Encode(encoder_pb2.EncodeRequest(room=11, messages=[
            common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="hi")])]),
            timeout=5),
        "Attach": lambda: list(stub.Attach(iter([encoder_pb2.AttachRequest(
            init=encoder_pb2.AttachInit(room=12, session_id="127.0.0.1:1", block_ids=[0],
                                        allocated_tokens=1))]), timeout=5)),
        "GetLoad": lambda: stub.GetLoad(encoder_pb2.EncoderGetLoadRequest(), timeout=5),
    }


def language_calls(stub, encoder_address: str):
    return {
        "Generate": lambda: list(stub.Generate(language_pb2.LanguageGenerateRequest(
            room=13, encoder_address=encoder_address), timeout=5)),
        "Reattach": lambda: stub.Reattach(language_pb2.ReattachRequest(
            room=13, encoder_address=encoder_address), timeout=5),
        "Abort": lambda: stub.Abort(language_pb2.AbortRequest(room=13), timeout=5),
        "GetLoad": lambda: stub.GetLoad(language_pb2.LanguageGetLoadRequest(), timeout=5),
        "Tokenize": lambda: stub.Tokenize(language_pb2.TokenizeRequest(prompt="hi"), timeout=5),
        "Detokenize": lambda: stub.Detokenize(language_pb2.DetokenizeRequest(token_ids=[1]),
                                              timeout=5),
        # E/P/D: a decode instance's call of a prefill instance (language role only)
        "Prefill": lambda: list(stub.Prefill(iter([language_pb2.PrefillRequest(
            open=language_pb2.PrefillOpen(request=language_pb2.LanguageGenerateRequest(
                room=14, encoder_address=encoder_address)))]), timeout=5)),
    }


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


class AttachTrap(encoder_pb2_grpc.EncoderServicer):
    """A caller's own 'encoder': records every Attach that reaches it (a buffer layout)."""

    def __init__(self) -> None:
        self.inits = []

    async def Attach(self, request_iterator, context):  # noqa: N802
        async for req in request_iterator:
            self.inits.append(req)


def test_no_method_without_the_right_certificate(cluster, tmp_path):
    cl, pki = cluster
    foreign = make_pki(tmp_path / "foreign")
    enc, lang = cl.addresses("encoder")[0], cl.addresses("language")[0]
    trap = AttachTrap()
    loop = asyncio.new_event_loop()

    async def serve():
        server = grpc.aio.server()
        encoder_pb2_grpc.add_EncoderServicer_to_server(trap, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, f"127.0.0.1:{port}"

    _server, trap_address = loop.run_until_complete(serve())
    import threading

    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        for how, ch in channels(pki, foreign, enc).items():
            for method, call in encoder_calls(encoder_pb2_grpc.EncoderStub(ch)).items():
                assert code_of(call) == grpc.StatusCode.UNAVAILABLE, (how, method)
            assert code_of(lambda: health_pb2_grpc.HealthStub(ch).Check(  # noqa: B023
                health_pb2.HealthCheckRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE
        for how, ch in channels(pki, foreign, lang).items():
            for method, call in language_calls(language_pb2_grpc.LanguageStub(ch),
                                               trap_address).items():
                assert code_of(call) == grpc.StatusCode.UNAVAILABLE, (how, method)
        # valid certificates of roles the methods are not for
        wrong = {"encoder": ("operator", "language", "encoder"),
                 "language": ("operator", "encoder", "language")}
        for role in wrong["encoder"]:
            with sync_channel(enc, as_role(pki, role)) as ch:
                for method, call in encoder_calls(encoder_pb2_grpc.EncoderStub(ch)).items():
                    if (method, role) in (("GetLoad", "operator"), ("Attach", "language")):
                        continue  # theirs (Attach here carries a bad Init: refused in-band)
                    assert code_of(call) == grpc.StatusCode.PERMISSION_DENIED, (role, method)
        for role in wrong["language"]:
            with sync_channel(lang, as_role(pki, role)) as ch:
                calls = language_calls(language_pb2_grpc.LanguageStub(ch), trap_address)
                for method, call in calls.items():
                    if (method, role) == ("GetLoad", "operator"):
                        continue
                    if (method, role) == ("Prefill", "language"):  # theirs: this instance
                        (answer,) = call()  # is no prefill instance, refused in-band
                        assert answer.finished.error.code == "FAILED_PRECONDITION", answer
                        continue
                    assert code_of(call) == grpc.StatusCode.PERMISSION_DENIED, (role, method)
        with sync_channel(lang, as_role(pki, "router")) as ch:  # the router never calls it
            assert code_of(language_calls(language_pb2_grpc.LanguageStub(ch), trap_address)[
                "Prefill"]) == grpc.StatusCode.PERMISSION_DENIED
        # nothing was allocated, and no buffer layout went to the caller's address
        (lload,) = cl.loads("language").values()
        assert lload.free_embedding_blocks == lload.total_embedding_blocks
        assert lload.free_kv_pages == lload.total_kv_pages
        assert lload.transferring == lload.waiting == lload.running == 0
        (eload,) = cl.loads("encoder").values()
        assert eload.queued_requests == 0
        assert trap.inits == []
    finally:
        loop.call_soon_threadsafe(loop.stop)
    # the router, holding its certificate, serves a chat through both tiers
    model = httpx.get(f"{cl.http_url}/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(f"{cl.http_url}/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 4,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Describe."},
            {"type": "image_url", "image_url": {"url": _png_data_url()}}]}]})
    assert r.status_code == 200, r.text
    assert "mTLS" in cl.log_text() and "PLAINTEXT" not in cl.log_text()


def _png_data_url() -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("kind", ["encoder", "language", "router"])
def test_a_tier_without_tls_material_stops_with_one_line(kind, checkpoint, tmp_path):
    pki = make_pki(tmp_path / "pki")
    ckpt = str(checkpoint("qwen2_5_vl"))
    base = [sys.executable, "-m", "tandem.cli", kind, "--model", ckpt]
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("TANDEM_")}
    out = subprocess.run(base, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert "internal TLS is not configured" in lines[-1] and "--insecure-internal" in lines[-1]
    assert not any("Traceback" in line for line in lines), out.stderr
    other = "router" if kind != "router" else "encoder"
    out = subprocess.run(base + ["--internal-tls.ca", str(pki.ca), "--internal-tls.cert",
                                 str(pki.cert(other)), "--internal-tls.key", str(pki.key(other))],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode != 0
    assert f"certificate is for role '{other}', not '{kind}'" in out.stderr.strip().splitlines()[-1]
