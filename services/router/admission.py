"""Admission control: bounded in-flight counts (the router's, each tenant's) and the
client key of the fair shares (API keys and tenants: tenants.py)."""

from __future__ import annotations

import collections
import hashlib
from contextlib import contextmanager

from tandem.services.router.errors import RouterError
from tandem.services.router.metrics import RouterMetrics
from tandem.services.router.tenants import Tenants


class Admission:
    """At most `limit` requests in flight, and at most its `max_inflight` of a tenant's;
    the next one is refused at once (429) rather than queued without end. `acquire` /
    `release` are synchronous: no await between the check and the increment, so the bounds
    hold on one event loop."""

    def __init__(self, limit: int, metrics: RouterMetrics | None = None,
                 tenants: Tenants | None = None) -> None:
        self.limit = limit
        self.inflight = 0
        self.metrics = metrics
        self.tenants = tenants
        self.per_tenant: collections.Counter[str] = collections.Counter()

    def acquire(self, tenant: str = "") -> None:
        cap = self.tenants.max_inflight(tenant) if self.tenants else None
        if self.inflight >= self.limit or (cap is not None and self.per_tenant[tenant] >= cap):
            if self.metrics:
                self.metrics.rejected.inc()
            if self.inflight >= self.limit:
                raise RouterError("OVERLOADED",
                                  f"router at capacity ({self.limit} requests in flight)")
            raise RouterError("OVERLOADED", f"tenant {tenant!r} at its capacity ({cap} "
                              "requests in flight)")
        self.inflight += 1
        self.per_tenant[tenant] += 1
        if self.metrics:
            self.metrics.inflight.set(self.inflight)

    def release(self, tenant: str = "") -> None:
        assert self.inflight > 0 and self.per_tenant[tenant] > 0, "release without acquire"
        self.inflight -= 1
        self.per_tenant[tenant] -= 1
        if not self.per_tenant[tenant]:
            del self.per_tenant[tenant]
        if self.metrics:
            self.metrics.inflight.set(self.inflight)

    @contextmanager
    def slot(self, tenant: str = ""):
        self.acquire(tenant)
        try:
            yield
        finally:
            self.release(tenant)


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
