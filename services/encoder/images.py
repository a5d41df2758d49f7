"""Image sources -> decoded RGB images, with the encoder's input limits.

Sources (of images, and of videos: `source_bytes`): raw bytes, `data:<mime>;base64,` URLs,
and http(s) URLs whose host is on the allow-list (`allowed_url_hosts`), fetched with a
timeout and a byte cap, refused when the host resolves to a private, loopback, link-local
or reserved address unless `allow_private_urls`. Every refusal is a ChatError naming the
content part (INVALID_ARGUMENT; a video over its byte cap is a VideoError).

A fetch also stops when its request's `Budget` ends (deadline passed, or the request
gone): TimeoutError, which the servicer reports as DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import ipaddress
import math
import socket
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image

from tandem.chat import ChatError, ImageInput, invalid

# Formats the encoder decodes; others (TIFF, ICO, PSD, EPS, ...) are refused by name.
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class ImageLimits:
    max_image_bytes: int
    max_source_pixels: int
    allowed_url_hosts: tuple[str, ...] = ()
    allow_private_urls: bool = False
    url_timeout_s: float = 5.0


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
    """Whether a part's `url` is one this encoder downloads (http or https)."""
    return (url or "").startswith(("http://", "https://"))


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
    if fetched_url(url):
        return _fetch(url, field, lim, rules, budget or Budget())
    scheme = url.split(":", 1)[0] if ":" in url else url[:16]
    raise invalid(field, f"unsupported {rules.noun} url scheme {scheme!r} (data:, http(s):)")


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


def _check_host(host: str, port: int, field: str, lim: ImageLimits) -> None:
    if host.lower() not in {h.lower() for h in lim.allowed_url_hosts}:
        raise invalid(field, f"url host {host!r} is not in the encoder's allowed_url_hosts")
    if lim.allow_private_urls:
        return
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except OSError as e:
        raise invalid(field, f"url host {host!r} does not resolve: {e}") from None
    for info in infos:
        ip = ipaddress.ip_address(info[4][0])
        if not ip.is_global:
            raise invalid(field, f"url host {host!r} resolves to non-public address {ip}")


def _fetch(url: str, field: str, lim: ImageLimits, rules: SourceRules, budget: Budget) -> bytes:
    import httpx

    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    _check_host(host, port, field, lim)
    buf = bytearray()
    # NOTE: the whole fetch is bounded, not just each read: a server trickling a byte per
    # read timeout would otherwise hold a preprocessing worker for as long as it likes.
    start = time.monotonic()
    end = start + lim.url_timeout_s
    timeout = max(0.001, min(end, budget.deadline) - start)
    noun = rules.noun
    try:
        # NOTE: redirects are not followed: a redirect could leave the allow-list.
        with httpx.stream("GET", url, timeout=timeout, follow_redirects=False) as r:
            if r.status_code != 200:
                raise invalid(field, f"fetching the {noun} url gave HTTP {r.status_code}")
            for chunk in r.iter_bytes():
                buf += chunk
                if len(buf) > rules.max_bytes:
                    raise rules.oversize(field, f"{noun} is over the limit of {rules.max_bytes} "
                                         "bytes")
                budget.check()
                if time.monotonic() > end:
                    raise httpx.ReadTimeout("total fetch time exceeded")
    except httpx.TimeoutException:
        budget.check()  # the request's own end, not the url's slowness: TimeoutError
        raise invalid(
            field, f"fetching the {noun} url timed out after {lim.url_timeout_s}s"
        ) from None
    except httpx.HTTPError as e:
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
