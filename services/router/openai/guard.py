"""The router's HTTP guard: what every request passes before any parsing (an ASGI
middleware; `app.build_app` installs it)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from tandem.services.router.admission import client_id
from tandem.services.router.config import RouterConfig
from tandem.services.router.errors import RouterError
from tandem.services.router.openai.errors import openai_body
from tandem.services.router.refusals import HeldTooLong, RefusalBudget
from tandem.services.router.tenants import Tenants


def error_response(err: RouterError, close: bool = False) -> JSONResponse:
    """`close`: the request was not read to its end, so the connection cannot carry
    another one: the response says so and the server closes it after sending."""
    headers = {"connection": "close"} if close else None
    return JSONResponse(openai_body(err), status_code=err.http_status, headers=headers)


def _held(held: HeldTooLong) -> JSONResponse:
    """429 for a client held past `refusal_max_hold_s` (its body unread: close)."""
    err = RouterError("OVERLOADED", str(held))
    return JSONResponse(openai_body(err), status_code=err.http_status, headers={
        "connection": "close", "retry-after": str(held.retry_after_s)})


# The probes' and the scraper's requests: never held for their address's refusal debt,
# never charged, their (absent) bodies never read, no key asked. A kubelet or balancer
# that shares an address with a misbehaving client must still get its answer at once, or
# it restarts a healthy router (issue 41).
UNTHROTTLED = frozenset({("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics"),
                         ("HEAD", "/health"), ("HEAD", "/ready"), ("HEAD", "/metrics")})


@dataclass
class _Size:
    """The bytes of a request's body read so far."""

    bytes: int


class Guard:
    """Before any parsing: the hold of a client whose refused requests are over its budget
    (refusals.py; 429 past the hold), the body-size limit (413, on the declared length and
    on the bytes read), the time to receive the body (408) and the API key on /v1/* (401).
    Every answer's status is reported to the client's refusal budget with the request's
    size. Health checks and metrics scrapes (`UNTHROTTLED`) pass none of it. The client's key (admission.client_id) is computed here, once, and left in
    `request.state.client_id` for the handlers."""

    def __init__(self, app, cfg: RouterConfig, refusals: RefusalBudget, tenants: Tenants) -> None:
        self.app = app
        self.cfg = cfg
        self.refusals = refusals
        self.tenants = tenants

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        forwarded = headers.get(self.cfg.client_id_header.lower()) if self.cfg.client_id_header else None
        host = scope["client"][0] if scope.get("client") else None
        who = client_id(host, forwarded)
        state = scope.setdefault("state", {})  # the handlers' `request.state`
        state["client_id"], state["tenant"] = who, ""
        if (scope.get("method", ""), scope.get("path", "")) in UNTHROTTLED:
            await self.app(scope, receive, send)
            return
        try:
            ticket = await self.refusals.enter(who)
        except HeldTooLong as held:
            await _held(held)(scope, receive, send)
            return
        size = _Size(0)  # what was read is what it cost (a 413 on its declared length: none)

        async def reporting_send(message):
            if message["type"] == "http.response.start":
                ticket.answered(message["status"], size.bytes)
            await send(message)

        try:
            await self._guarded(scope, receive, reporting_send, headers, size)
        finally:
            ticket.close()

    async def _guarded(self, scope, receive, send, headers: dict[str, str], size: _Size):
        length = headers.get("content-length", "")
        err = None
        if length.isdigit() and int(length) > self.cfg.max_request_bytes:
            err = self._too_large()
        elif scope.get("path", "").startswith("/v1/"):
            try:  # the handlers read the tenant from `request.state.tenant`
                scope["state"]["tenant"] = self.tenants.authenticate(headers.get("authorization"))
            except RouterError as e:
                err = e
        if err is not None:  # NOTE: the body is left unread: close the connection
            await error_response(err, close=True)(scope, receive, send)
            return
        receive = await self._bounded_body(scope, receive, send, size)
        if receive is not None:
            await self.app(scope, receive, send)

    def _too_large(self) -> RouterError:
        return RouterError("TOO_LARGE", f"request body over {self.cfg.max_request_bytes} bytes")

    async def _bounded_body(self, scope, receive, send, read: _Size):
        """Read the whole body, counting bytes: a chunked upload has no content-length, so
        the limit holds on what arrives (413 past it), within `http_request_timeout_s` (408
        past it: a client that stalls or trickles its body cannot hold the connection).
        Either answer closes the connection. Returns a receive that replays the body and
        then hands over to the client's (disconnects stay visible), or None when the request
        was answered or the client left."""
        limit, size, chunks = self.cfg.max_request_bytes, 0, []
        err = None
        try:
            async with asyncio.timeout(self.cfg.http_request_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    read.bytes = max(read.bytes, size)
                    if size > limit:
                        err = self._too_large()
                        break
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            err = RouterError("REQUEST_TIMEOUT", f"request body not received within "
                              f"{self.cfg.http_request_timeout_s:g}s")
        if err is not None:
            await error_response(err, close=True)(scope, receive, send)
            return None
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        return replay
