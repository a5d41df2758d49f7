"""Admission control and access: a bounded in-flight count and an optional API key."""

from __future__ import annotations

import hashlib
import hmac
from contextlib import contextmanager

from tandem.services.router.errors import RouterError
from tandem.services.router.metrics import RouterMetrics


class Admission:
    """At most `limit` requests in flight; the next one is refused at once (429) rather
    than queued without end. `acquire`/`release` are synchronous: no await between the
    check and the increment, so the bound holds on one event loop."""

    def __init__(self, limit: int, metrics: RouterMetrics | None = None) -> None:
        self.limit = limit
        self.inflight = 0
        self.metrics = metrics

    def acquire(self) -> None:
        if self.inflight >= self.limit:
            if self.metrics:
                self.metrics.rejected.inc()
            raise RouterError("OVERLOADED", f"router at capacity ({self.limit} requests in flight)")
        self.inflight += 1
        if self.metrics:
            self.metrics.inflight.set(self.inflight)

    def release(self) -> None:
        assert self.inflight > 0, "release without acquire"
        self.inflight -= 1
        if self.metrics:
            self.metrics.inflight.set(self.inflight)

    @contextmanager
    def slot(self):
        self.acquire()
        try:
            yield
        finally:
            self.release()


def check_api_key(expected: str, authorization: str | None) -> None:
    """Raise UNAUTHENTICATED unless `authorization` is `Bearer <expected>` (when a key is
    configured). Constant-time comparison."""
    if not expected:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), expected):
        raise RouterError("UNAUTHENTICATED", "missing or invalid API key")


def client_id(remote_host: str | None, forwarded: str | None = None) -> str:
    """The caller's key for the encoders' fair share of preprocessing (ChatRequest /
    EncodeRequest `client_id`), opaque (hashed): its address, which is `forwarded` (the
    first address in the `client_id_header` a trusted proxy in front sets) when given,
    else the connection's remote host.

    NOTE: not the API key: the router has one key, shared by every caller (it would make
    them all one client), and without a key any token passes, so a flood could pose as
    many clients by changing its token. An address costs a flood more to multiply."""
    who = (forwarded or "").split(",")[0].strip() or remote_host or "unknown"
    return "c-" + hashlib.sha256(who.encode()).hexdigest()[:16]
