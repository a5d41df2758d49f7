"""`RouterChannel`: what `Client` and `AsyncClient` share, their constructor.

It turns the router address and the caller's options into call metadata (the API key),
channel credentials (TLS) and channel options, and opens the channel with the subclass's
gRPC flavour (`grpc` for `Client`, `grpc.aio` for `AsyncClient`); and the retry policy
both follow (which errors are retried, the backoff between attempts), and the arguments
of a chat's Generate call (`_generate_call`), the same on every attempt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import grpc

from tandem.client.errors import TandemError
from tandem.client.results import build_request
from tandem.v1 import router_pb2, router_pb2_grpc

_OPTIONS = [("grpc.max_send_message_length", 256 << 20),
            ("grpc.max_receive_message_length", 256 << 20)]


@dataclass(frozen=True)
class GenerateCall:
    """The arguments of one chat's Generate call, the same on every attempt."""

    request: router_pb2.RouterGenerateRequest
    timeout: float  # seconds: the gRPC deadline, and the request's timeout_ms
    metadata: tuple  # the API key, and the caller's traceparent when it gave one


class RouterChannel:
    """The constructor of both clients (its options are documented on `Client`)."""

    _grpc = grpc  # the module whose channels the subclass uses: grpc or grpc.aio

    def __init__(self, address: str = "127.0.0.1:50051", *, api_key: str | None = None,
                 timeout: float = 120.0, retries: int = 3, backoff: float = 0.2,
                 tls: bool = False, root_certificates: bytes | None = None,
                 tls_server_name: str = "") -> None:
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        opts = _OPTIONS + ([("grpc.ssl_target_name_override", tls_server_name)]
                           if tls_server_name else [])
        if tls:
            creds = grpc.ssl_channel_credentials(root_certificates)
            self._channel = self._grpc.secure_channel(address, creds, options=opts)
        else:
            self._channel = self._grpc.insecure_channel(address, options=opts)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def _generate_call(self, messages, timeout: float | None, kw: dict) -> GenerateCall:
        """The Generate call of a chat: `kw` are `build_request`'s keyword arguments and
        `traceparent`; `timeout` None is the client's."""
        timeout = timeout or self.timeout
        metadata = call_metadata(self._metadata, kw.pop("traceparent", None))
        return GenerateCall(build_request(messages, timeout=timeout, **kw), timeout, metadata)

    def _retries(self, err: TandemError, got_any: bool, attempt: int) -> bool:
        """Whether a Generate call that failed with `err` on `attempt` (0 the first) is
        tried again: only before any output, only when retryable, at most `retries` times."""
        return not got_any and retryable(err) and attempt < self.retries


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
