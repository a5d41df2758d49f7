"""URL fetches are pinned to the addresses their check passed (issue 41, point 3).

The encoder resolves a URL's host once (`images.resolve`, over `socket.getaddrinfo`),
checks every address, and dials those addresses only. These tests replace
`socket.getaddrinfo`, the resolver Tandem itself calls (and the one any second lookup in
the process would go through), with one whose answer changes between calls (DNS
rebinding), and serve the URL from a real HTTP(S) server on 127.0.0.1:

- a host that answers a public address first and 127.0.0.1 after is never fetched from
  127.0.0.1, whether it is an image, a video or a video's frame (one lookup, no request
  reaching the local server);
- a host whose one answer is 127.0.0.1 (private addresses allowed) is fetched from there,
  with the URL's host in the Host header;
- over https the certificate is checked against the URL's host name, not the address
  dialed: a certificate for pinned.test serves https://pinned.test, and the same server
  reached as https://other.test is refused.
"""

from __future__ import annotations

import http.server
import socket
import ssl
import threading
from collections import Counter

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from encoder_peers.chats import png

from tandem import pki
from tandem.chat import ChatError, ImageInput, VideoOptions
from tandem.services.encoder.media import images
from tandem.services.encoder.media.images import ImageLimits, SourceRules, image_bytes, source_bytes
from tandem.services.encoder.media.video import VideoLimits
from tandem.services.encoder.media.video_frames import plan_frames_source
from tandem.services.encoder.media.video_rules import VideoSettings

BODY = png(32, 24, 5)
PUBLIC = "93.184.216.34"  # a global address: passes the check, never dialed (`dialed`)


class _Handler(http.server.BaseHTTPRequestHandler):
    requests: list[tuple[str, str]] = []  # (path, Host header) of every request served
    agents: list[str] = []  # their User-Agent headers

    def do_GET(self):
        type(self).requests.append((self.path, self.headers.get("Host", "")))
        type(self).agents.append(self.headers.get("User-Agent", ""))
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *a):
        pass


def _serve(srv: http.server.HTTPServer):
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    return srv


@pytest.fixture
def server():
    _Handler.requests = []
    srv = _serve(http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler))
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


class Resolver:
    """`socket.getaddrinfo` answering `answers[host]` in turn (the last one repeated), and
    the real resolver for any other name (address literals included); counts lookups."""

    def __init__(self, real, answers: dict[str, list[str]]) -> None:
        self.real, self.answers, self.calls = real, answers, Counter()

    def __call__(self, host, port, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host
        if name not in self.answers:
            return self.real(host, port, *args, **kwargs)
        turn = self.answers[name]
        ip = turn[min(self.calls[name], len(turn) - 1)]
        self.calls[name] += 1
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (ip, port))]


@pytest.fixture
def dialed(monkeypatch):
    """Every address the fetch dials (httpcore's TCP connect, under the pinned backend).
    Only loopback is really connected: any other address is recorded and refused here, so
    no test traffic ever leaves this machine (the public address stands for one only)."""
    import httpcore

    real = httpcore.SyncBackend.connect_tcp
    seen: list[str] = []

    def connect_tcp(self, host, port, *args, **kwargs):
        seen.append(host)
        if host != "127.0.0.1":
            raise httpcore.ConnectError(f"test: {host} is not dialed from this machine")
        return real(self, host, port, *args, **kwargs)

    monkeypatch.setattr(httpcore.SyncBackend, "connect_tcp", connect_tcp)
    return seen


@pytest.fixture
def rebinding(monkeypatch, dialed):
    resolver = Resolver(socket.getaddrinfo, {"rebind.test": [PUBLIC, "127.0.0.1"],
                                             "pinned.test": ["127.0.0.1"],
                                             "other.test": ["127.0.0.1"]})
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    resolver.dialed = dialed
    return resolver


def _limits(host: str, private: bool) -> ImageLimits:
    return ImageLimits(1 << 20, 1 << 24, (host,), allow_private_urls=private, url_timeout_s=2.0)


def _read_image(url: str, lim: ImageLimits) -> bytes:
    return image_bytes(ImageInput(url=url), "f", lim)


def _read_video(url: str, lim: ImageLimits) -> bytes:
    return source_bytes(None, url, "f", lim, SourceRules("video", 1 << 20))


def _read_frame(url: str, lim: ImageLimits) -> bytes:
    """Frame 1 of a video given as frames (frame 0 is inline): fetched while planning."""
    frames = (ImageInput(data=BODY), ImageInput(url=url))
    planned = plan_frames_source(frames, VideoSettings.defaults("qwen2_vl"),
                                 VideoOptions(fps=2.0),
                                 VideoLimits(), lim, "f")
    return planned.frames[1]


READERS = {"image": _read_image, "video": _read_video, "frame": _read_frame}


@pytest.mark.parametrize("kind", READERS)
def test_a_rebinding_host_never_reaches_the_private_address(server, rebinding, kind):
    url = f"http://rebind.test:{server}/{kind}.png"
    got = None
    try:
        got = READERS[kind](url, _limits("rebind.test", private=False))
    except ChatError as e:  # the public address is not dialed here (`dialed`): a 400
        assert e.field.startswith("f") and e.message.startswith("fetching the ")
    assert _Handler.requests == []  # 127.0.0.1 never served the fetch
    assert got != BODY
    assert rebinding.calls["rebind.test"] == 1  # one lookup: the one checked
    assert rebinding.dialed == [PUBLIC]  # the checked address, and nothing else


@pytest.mark.parametrize("kind", READERS)
def test_the_checked_address_is_the_one_dialed_and_the_host_is_kept(server, rebinding, kind):
    url = f"http://pinned.test:{server}/{kind}.png"
    assert READERS[kind](url, _limits("pinned.test", private=True)) == BODY
    assert _Handler.requests == [(f"/{kind}.png", f"pinned.test:{server}")]
    assert rebinding.calls["pinned.test"] == 1


def test_a_private_answer_is_refused_before_any_connection(server, rebinding):
    with pytest.raises(ChatError) as e:
        _read_image(f"http://pinned.test:{server}/x.png", _limits("pinned.test", private=False))
    assert "non-public address 127.0.0.1" in e.value.message and e.value.field == "f"
    assert _Handler.requests == []


@pytest.fixture
def tls_server(tmp_path, monkeypatch):
    """An https server on 127.0.0.1 whose certificate names pinned.test only, signed by a
    test CA the fetch trusts (images._ssl_context patched); records the SNI it was sent."""
    ca, ca_key = pki.new_ca(1)
    key = pki.ec.generate_private_key(pki.ec.SECP256R1())
    start, end = pki._validity(1)
    cert = (x509.CertificateBuilder().subject_name(pki._name("pinned.test"))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("pinned.test")]),
                           critical=False)
            .sign(ca_key, pki.hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(pki._pem_key(key))
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    sni: list[str | None] = []
    server_ctx.sni_callback = lambda sock, name, ctx: sni.append(name)
    client_ctx = ssl.create_default_context(
        cadata=ca.public_bytes(serialization.Encoding.PEM).decode())
    monkeypatch.setattr(images, "_ssl_context", lambda: client_ctx)
    _Handler.requests = []

    class Server(http.server.ThreadingHTTPServer):
        def get_request(self):
            sock, addr = super().get_request()
            return server_ctx.wrap_socket(sock, server_side=True), addr

        def handle_error(self, request, client_address):  # the refused handshake
            pass

    srv = _serve(Server(("127.0.0.1", 0), _Handler))
    yield srv.server_address[1], sni
    srv.shutdown()
    srv.server_close()


def test_https_checks_the_certificate_against_the_host_name(tls_server, rebinding):
    port, sni = tls_server
    got = _read_image(f"https://pinned.test:{port}/a.png", _limits("pinned.test", private=True))
    assert got == BODY and sni == ["pinned.test"]
    assert _Handler.requests == [("/a.png", f"pinned.test:{port}")]
    with pytest.raises(ChatError) as e:  # same address, a name the certificate lacks
        _read_image(f"https://other.test:{port}/a.png", _limits("other.test", private=True))
    assert e.value.message.startswith("fetching the image url failed: ")  # TLS refused it
    assert _Handler.requests == [("/a.png", f"pinned.test:{port}")]


@pytest.mark.parametrize("ip", ["::ffff:10.0.0.1", "64:ff9b::a00:1", "2002:a00:1::1",
                                "64:ff9b::7f00:1"])
def test_an_ipv6_form_of_a_private_ipv4_address_is_refused(server, monkeypatch, dialed, ip):
    """IPv4-mapped, NAT64 and 6to4 addresses reach the IPv4 address they carry: each is
    checked as that address (private here), though the IPv6 form alone counts as global."""
    def answer(host, port, *a, **k):
        return [(socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (ip, port, 0, 0))]

    monkeypatch.setattr(socket, "getaddrinfo", answer)
    with pytest.raises(ChatError) as e:
        _read_image(f"http://v6.test:{server}/x.png", _limits("v6.test", private=False))
    assert e.value.message.startswith("url host 'v6.test' resolves to non-public address")
    assert dialed == [] and _Handler.requests == []


def test_the_fetch_names_itself(server, rebinding):
    _read_image(f"http://pinned.test:{server}/ua.png", _limits("pinned.test", private=True))
    assert _Handler.agents[-1].startswith("tandem/")
