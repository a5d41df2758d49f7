"""`RouterChannel`: what `Client` and `AsyncClient` share, their constructor.

It turns the router address and the caller's options into call metadata (the API key),
channel credentials (TLS) and channel options, and opens the channel with the subclass's
gRPC flavour (`grpc` for `Client`, `grpc.aio` for `AsyncClient`); and the retry policy
both follow (which errors are retried, the backoff between attempts).
"""

from __future__ import annotations

import random

import grpc

from tandem.client.errors import TandemError
from tandem.v1 import router_pb2_grpc

_OPTIONS = [("grpc.max_send_message_length", 256 << 20),
            ("grpc.max_receive_message_length", 256 << 20)]  # fmt: skip


class RouterChannel:
    """The constructor of both clients (its options are documented on `Client`)."""

    _grpc = grpc  # the module whose channels the subclass uses: grpc or grpc.aio

    def __init__(self, address: str = "127.0.0.1:50051", *, api_key: str | None = None,
                 timeout: float = 120.0, retries: int = 3, backoff: float = 0.2,
                 tls: bool = False, root_certificates: bytes | None = None,
                 tls_server_name: str = "") -> None:  # fmt: skip
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        opts = _OPTIONS + ([("grpc.ssl_target_name_override", tls_server_name)]
                           if tls_server_name else [])  # fmt: skip
        if tls:
            creds = grpc.ssl_channel_credentials(root_certificates)
            self._channel = self._grpc.secure_channel(address, creds, options=opts)
        else:
            self._channel = self._grpc.insecure_channel(address, options=opts)
        self._stub = router_pb2_grpc.RouterStub(self._channel)


def call_metadata(base: tuple, traceparent: str | None) -> tuple:
    """A Generate call's metadata: the channel's (the API key) and, when given, the W3C
    `traceparent` whose trace the request joins (the router's spans become its children)."""
    return base + ((("traceparent", traceparent),) if traceparent else ())


def backoff_s(attempt: int, base: float, cap: float = 5.0) -> float:
    """Exponential backoff with full jitter."""
    return random.uniform(0, min(cap, base * (2**attempt)))


def retryable(err: TandemError) -> bool:
    """Only a router that could not take the call is retried (nothing ran)."""
    return err.code == "UNAVAILABLE"
