"""Image sources -> decoded RGB images, with the encoder's input limits.

Sources (of images, and of videos: `source_bytes`): raw bytes, `data:<mime>;base64,` URLs,
and http(s) URLs whose host is on the allow-list (`allowed_url_hosts`), fetched with a
timeout and a byte cap, refused when the host resolves to a private, loopback, link-local
or reserved address unless `allow_private_urls`. Every refusal is a ChatError naming the
content part (INVALID_ARGUMENT; a video over its byte cap is a VideoError).

A fetch is pinned: the host's name is resolved once (`resolve`), those addresses checked,
and the connection dialed to them only (`_PinnedBackend`), never to a second answer of the
resolver (DNS rebinding); the Host header, TLS SNI and the certificate check keep the
URL's host name (tests/test_media_fetch_pinned.py). Environment proxies are not used.

`file://` URLs (vLLM's --allowed-local-media-path) are read only when the encoder has a
`local_media_root`, and only for a file whose real path (every symlink resolved) lies
under it, as a regular file, under the same byte caps as a data URL; off by default.

A fetch also stops when its request's `Budget` ends (deadline passed, or the request
gone): TimeoutError, which the servicer reports as DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import io
import ipaddress
import math
import os
import socket
import ssl
import stat
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpcore
from PIL import Image

from tandem import version as _version
from tandem.chat import ChatError, ImageInput, invalid

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Formats the encoder decodes; others (TIFF, ICO, PSD, EPS, ...) are refused by name.
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class ImageLimits:
    max_image_bytes: int
    max_source_pixels: int
    allowed_url_hosts: tuple[str, ...] = ()
    allow_private_urls: bool = False
    url_timeout_s: float = 5.0
    # file:// URLs are read under this resolved directory only; None refuses them
    local_media_root: Path | None = None


def local_media_root(path: str) -> Path | None:
    """The resolved directory of the encoder's `allowed_local_media_path` ("" = None: no
    file:// media); a ValueError at start-up when it is not an existing directory."""
    if not path:
        return None
    root = Path(path).resolve()
    if not root.is_dir():
        raise ValueError(f"allowed_local_media_path {path!r} is not an existing directory")
    return root


@dataclass
class Budget:
    """What one request's preprocessing may still spend: its deadline (`time.monotonic()`
    seconds) and `stop`, set once the request is gone (cancelled, failed, out of time).
    Checked before each image and during a URL fetch, so a worker thread is let go as soon
    as its request ends rather than when the work would have."""

    deadline: float = math.inf
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)

    def check(self) -> None:
        if self.stop.is_set() or time.monotonic() >= self.deadline:
            raise TimeoutError("the request ended while preprocessing")


@dataclass(frozen=True)
class SourceRules:
    """How one kind of input (an image, a video) is read from its source: the word its
    refusals use, its byte cap, the type a data URL must declare ("" = any), and the
    refusal of a file over the cap (a ChatError naming the field)."""

    noun: str
    max_bytes: int
    mime: str = ""
    oversize: Callable[[str, str], ChatError] = invalid


def image_bytes(img: ImageInput, field: str, lim: ImageLimits,
                budget: Budget | None = None) -> bytes:
    """The encoded image file of one part (decoding base64 or fetching a URL)."""
    raw = source_bytes(img.data, img.url, field, lim, SourceRules("image", lim.max_image_bytes),
                       budget)
    if not raw:
        raise invalid(field, "image is empty (0 bytes)")
    if len(raw) > lim.max_image_bytes:
        raise invalid(field, f"image is {len(raw)} bytes, over the limit of {lim.max_image_bytes}")
    return raw


def fetched_url(url: str | None) -> bool:
    """Whether a part's `url` is one this encoder reads from outside the request (http(s)
    or file): a split's lead passes such bytes on, so a helper neither fetches them again
    nor needs the file."""
    return (url or "").startswith(("http://", "https://", "file:"))


def source_bytes(data: bytes | None, url: str | None, field: str, lim: ImageLimits,
                 rules: SourceRules, budget: Budget | None = None) -> bytes:
    """The file of one part: `data` as given, a data URL decoded, an http(s) URL fetched
    (allow-list, private addresses, time and byte caps: `lim`). A data URL or a download
    over `rules.max_bytes` is refused without being held whole; `data` given as bytes is
    returned as is (the caller checks its size)."""
    if data is not None:
        return data
    url = url or ""
    if url.startswith("data:"):
        return _data_url(url, field, rules)
    if url.startswith("file:"):
        return _local_file(url, field, lim, rules)
    if fetched_url(url):
        return _fetch(url, field, lim, rules, budget or Budget())
    scheme = url.split(":", 1)[0] if ":" in url else url[:16]
    raise invalid(field, f"unsupported {rules.noun} url scheme {scheme!r} (data:, http(s):"
                  f"{', file:' if lim.local_media_root else ''})")


def _data_url(url: str, field: str, rules: SourceRules) -> bytes:
    head, sep, body = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise invalid(field, "data url must be data:<mime>;base64,<data>")
    if rules.mime and not head.startswith(f"data:{rules.mime}"):
        raise invalid(field, f"a {rules.noun} data url must have a {rules.mime}* type")
    # NOTE: check the size before decoding so a huge string is never materialised twice.
    if len(body) * 3 // 4 > rules.max_bytes + 3:
        raise rules.oversize(field, f"{rules.noun} is over the limit of {rules.max_bytes} bytes")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(field, "data url is not valid base64") from None


def resolve(host: str, port: int) -> tuple[IPAddress, ...]:
    """The addresses `host` resolves to for TCP, in the resolver's order, each once: the one
    name lookup of a fetch (`_fetch` dials these addresses and no other)."""
    out: list[IPAddress] = []
    for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP):
        ip = ipaddress.ip_address(info[4][0])
        if ip not in out:
            out.append(ip)
    return tuple(out)


def _local_file(url: str, field: str, lim: ImageLimits, rules: SourceRules) -> bytes:
    """The file a file:// URL names, when its real path lies under `lim.local_media_root`.
    A path outside is refused whether or not it exists (nothing is said of files outside);
    the opened file's own path is checked again, so a directory swapped for a symlink
    between the check and the open is refused too."""
    root = lim.local_media_root
    if root is None:
        raise invalid(field, f"file:// {rules.noun} urls are not read by this encoder (its "
                      "allowed_local_media_path is unset)")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise invalid(field, "a file url is file:///<absolute path> (no host, query or "
                      "fragment)")
    path = urllib.parse.unquote(parts.path)
    if not path.startswith("/") or "\0" in path:
        raise invalid(field, "a file url is file:///<absolute path>")
    try:
        real = Path(path).resolve()  # NOTE: every symlink that exists is followed
    except (OSError, RuntimeError):  # a symlink loop
        raise _outside(field) from None
    if not real.is_relative_to(root):
        raise _outside(field)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
                     | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        raise invalid(field, "file url names no readable file under the encoder's "
                      "allowed_local_media_path") from None
    try:
        opened = Path(f"/proc/self/fd/{fd}")  # Linux: the opened file's own path
        if opened.is_symlink() and not Path(os.readlink(opened)).is_relative_to(root):
            raise _outside(field)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise invalid(field, "file url names no regular file")
        if info.st_size > rules.max_bytes:
            raise rules.oversize(field, f"{rules.noun} is over the limit of {rules.max_bytes} "
                                 "bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(rules.max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > rules.max_bytes:  # grew since fstat
        raise rules.oversize(field, f"{rules.noun} is over the limit of {rules.max_bytes} bytes")
    return data


def _outside(field: str) -> ChatError:
    return invalid(field, "file url is outside the encoder's allowed_local_media_path")


def _check_host(host: str, port: int, field: str, lim: ImageLimits) -> tuple[IPAddress, ...]:
    """The addresses a fetch from `host` may connect to: the host allow-listed, its name
    resolved once, and (unless `allow_private_urls`) every address public, else a refusal."""
    if host.lower() not in {h.lower() for h in lim.allowed_url_hosts}:
        raise invalid(field, f"url host {host!r} is not in the encoder's allowed_url_hosts")
    if not host.isascii():
        raise invalid(field, f"url host {host!r} must be written in ASCII (its IDNA form)")
    try:
        addresses = resolve(host, port)
    except (OSError, UnicodeError) as e:
        raise invalid(field, f"url host {host!r} does not resolve: {e}") from None
    if not addresses:
        raise invalid(field, f"url host {host!r} does not resolve")
    if not lim.allow_private_urls:
        for ip in addresses:
            if not all(a.is_global for a in _routes_to(ip)):
                raise invalid(field, f"url host {host!r} resolves to non-public address {ip}")
    return addresses


# NAT64's well-known prefix: its addresses reach the IPv4 address in their low 32 bits
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _routes_to(ip: IPAddress) -> tuple[IPAddress, ...]:
    """`ip` and every IPv4 address it carries to (IPv4-mapped, 6to4, NAT64): an IPv6 form
    counts as global however private the IPv4 address it reaches, so each is checked."""
    if ip.version == 4:
        return (ip,)
    embedded = [ip.ipv4_mapped, ip.sixtofour]
    if ip in _NAT64:
        embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return (ip, *(a for a in embedded if a is not None))


# httpcore sends no User-Agent of its own (httpx did), and some media hosts refuse a
# request without one (HTTP 403)
_USER_AGENT = (b"User-Agent", f"tandem/{_version()}".encode())


class _PinnedBackend(httpcore.SyncBackend):
    """httpcore's network backend, dialing only `addresses` (the ones `_check_host` let
    through) whatever name the connection is for: nothing resolves the host again, so a DNS
    answer that changes after the check (rebinding) is never followed. TLS is unaffected:
    httpcore starts it with the URL's host as SNI and as the name the certificate must
    match, and the request's Host header is the URL's."""

    def __init__(self, addresses: tuple[IPAddress, ...]) -> None:
        self._addresses = addresses

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options=None) -> httpcore.NetworkStream:
        # NOTE: `host` is the URL's (the pool serves one URL: redirects are not followed);
        # each checked address is tried in the resolver's order within one connect timeout.
        # An address literal never goes to a resolver.
        end = math.inf if timeout is None else time.monotonic() + timeout
        error: Exception = httpcore.ConnectError(f"no address to connect to for {host}")
        for ip in self._addresses:
            left = None if timeout is None else max(0.001, end - time.monotonic())
            try:
                return super().connect_tcp(str(ip), port, left, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                error = e
                if time.monotonic() >= end:
                    break
        raise error

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options=None) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("unix sockets are not dialed")


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """The TLS context of https fetches: httpx's default (certifi's CAs, or SSL_CERT_FILE /
    SSL_CERT_DIR), certificates verified against the URL's host name. Built once."""
    import httpx

    return httpx.create_ssl_context()


# httpcore's errors of a failed exchange (its exceptions share no base class)
_FETCH_ERRORS = (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol,
                 httpcore.ProxyError, httpcore.ConnectionNotAvailable)


def _fetch(url: str, field: str, lim: ImageLimits, rules: SourceRules, budget: Budget) -> bytes:
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise invalid(field, "url has an invalid port") from None
    addresses = _check_host(host, port, field, lim)
    buf = bytearray()
    # NOTE: the whole fetch is bounded, not just each read: a server trickling a byte per
    # read timeout would otherwise hold a preprocessing worker for as long as it likes.
    start = time.monotonic()
    end = start + lim.url_timeout_s
    timeout = max(0.001, min(end, budget.deadline) - start)
    noun = rules.noun
    # NOTE: httpcore's pool over the pinned backend, not httpx's client: httpx's transport
    # takes no network backend. No proxy (HTTP(S)_PROXY) is used: a proxy would resolve
    # the name again. One connection, no retry.
    pool = httpcore.ConnectionPool(ssl_context=_ssl_context(), max_connections=1,
                                   network_backend=_PinnedBackend(addresses))
    timeouts = {"connect": timeout, "read": timeout, "write": timeout, "pool": timeout}
    try:
        # NOTE: redirects are not followed: a redirect could leave the allow-list.
        with pool, pool.stream("GET", url, headers=[(b"Accept", b"*/*"), _USER_AGENT],
                               extensions={"timeout": timeouts}) as r:
            if r.status != 200:
                raise invalid(field, f"fetching the {noun} url gave HTTP {r.status}")
            for chunk in r.iter_stream():
                buf += chunk
                if len(buf) > rules.max_bytes:
                    raise rules.oversize(field, f"{noun} is over the limit of {rules.max_bytes} "
                                         "bytes")
                budget.check()
                if time.monotonic() > end:
                    raise httpcore.ReadTimeout("total fetch time exceeded")
    except httpcore.TimeoutException:
        budget.check()  # the request's own end, not the url's slowness: TimeoutError
        raise invalid(
            field, f"fetching the {noun} url timed out after {lim.url_timeout_s}s"
        ) from None
    except _FETCH_ERRORS as e:
        raise invalid(field, f"fetching the {noun} url failed: {e}") from None
    return bytes(buf)


def decode_image(raw: bytes, field: str, lim: ImageLimits) -> Image.Image:
    """Encoded bytes -> RGB image; refuses unknown, unsupported, oversized, truncated files."""
    img = open_image(raw, field, lim)
    try:
        img.load()  # NOTE: PIL decodes lazily; truncation only shows here.
        return to_rgb(img)
    except Exception as e:
        raise invalid(field, f"image data is truncated or corrupt ({img.format}: {e})") from None


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB as transformers' image processors make it (`image_transforms.convert_to_rgb`):
    transparent pixels (an alpha band, or a palette/grey image's transparency colour) are
    composited onto white, not dropped (dropping shows what lies under the transparency)."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def open_image(raw: bytes, field: str, lim: ImageLimits) -> Image.Image:
    """Encoded bytes -> the image with its header read and checked (format, pixel count),
    not decoded yet (PIL decodes on `load`)."""
    try:
        with warnings.catch_warnings():
            # NOTE: PIL's own bomb check is looser than ours; ours runs on the header below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(raw))
    except Image.DecompressionBombError:
        raise invalid(
            field, f"image has far more pixels than the limit of {lim.max_source_pixels}"
        ) from None
    except Exception:  # UnidentifiedImageError and whatever a broken header raises
        raise invalid(field, _not_decodable()) from None
    if img.format not in SUPPORTED_FORMATS:
        raise invalid(
            field, f"image format {img.format} is not supported ({', '.join(SUPPORTED_FORMATS)})"
        )
    w, h = img.size
    if w < 1 or h < 1 or w * h > lim.max_source_pixels:
        raise invalid(
            field, f"image is {w}x{h} = {w * h} pixels, over the limit of {lim.max_source_pixels}"
        )
    return img


def _not_decodable() -> str:
    return f"image is not a decodable {'/'.join(SUPPORTED_FORMATS)} file"
