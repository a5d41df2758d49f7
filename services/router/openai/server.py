"""The router's uvicorn settings, with a deadline on receiving each request's headers.

uvicorn bounds only the idle time between requests (`timeout_keep_alive`, armed after a
response). A connection that sends nothing, or half its headers, and stalls is otherwise
held for ever (slowloris). The protocol here adds one timer:

    connection opens ──▶ armed ──▶ headers complete ──▶ disarmed (the app bounds the body:
                                                        guard.Guard, 408)
    response sent, keep-alive idle (uvicorn's timer) ──▶ first byte of the next request
                     ──▶ armed ──▶ headers complete ──▶ disarmed
    timer fires ──▶ 408 (when some bytes came) and the connection is closed
"""

from __future__ import annotations

import asyncio
import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tandem.services.router.config import RouterConfig
from tandem.services.router.errors import RouterError
from tandem.services.router.openai.errors import openai_body


class _RequestDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on a request's headers (class attribute
    `timeout_s`, set by `request_deadline_protocol`)."""

    timeout_s: float = 60.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._deadline = self.loop.call_later(self.timeout_s, self._expired)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _track(self) -> None:
        """Armed while a request's headers are partly in (bytes buffered, no request yet);
        disarmed once they are complete. Idle between requests is uvicorn's keep-alive."""
        partial = self.conn.their_state is h11.IDLE and bool(self.conn.trailing_data[0])
        if partial and self._deadline is None:
            self._deadline = self.loop.call_later(self.timeout_s, self._expired)
        elif self.conn.their_state is not h11.IDLE:
            self._disarm()

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # half a request: say why before closing
            err = RouterError("REQUEST_TIMEOUT",
                              f"request headers not received within {self.timeout_s:g}s")
            body = json.dumps(openai_body(err)).encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()


def request_deadline_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol closing a connection whose request headers take longer than
    `timeout_s` (from its opening, or from the first byte of a request after another)."""
    return type("RequestDeadlineH11", (_RequestDeadline,), {"timeout_s": timeout_s})


def http_config(app, cfg: RouterConfig) -> uvicorn.Config:
    """The router's HTTP server settings: keep-alive longer than clients' pools, the
    request deadline (headers here, the body in the app)."""
    return uvicorn.Config(
        # log_config None: uvicorn's loggers go through the service's own handler (one
        # format, a level on every line; tandem/logs.py)
        app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1,
        log_config=None,
        timeout_keep_alive=cfg.http_keep_alive_s,
        http=request_deadline_protocol(cfg.http_request_timeout_s),
    )
