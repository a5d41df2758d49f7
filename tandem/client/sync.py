"""Blocking gRPC client of the Tandem router."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc

from tandem.client.errors import TandemError, error_from_rpc
from tandem.client.results import ChatResult, add, backoff_s, build_request, check, retryable
from tandem.v1 import router_pb2, router_pb2_grpc

_OPTIONS = [("grpc.max_send_message_length", 256 << 20),
            ("grpc.max_receive_message_length", 256 << 20)]


def make_channel_args(address, api_key, tls, root_certificates, tls_server_name=""):
    """(call metadata, channel credentials or None, channel options) for both clients."""
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    creds = grpc.ssl_channel_credentials(root_certificates) if tls else None
    opts = _OPTIONS + ([("grpc.ssl_target_name_override", tls_server_name)]
                       if tls_server_name else [])
    return metadata, creds, opts


class Client:
    """`Client("127.0.0.1:50051").chat("Hello")`.

    timeout: default per-request deadline in seconds (sent to the router, and the gRPC
    deadline). retries: how often a request failing with UNAVAILABLE before any output is
    retried, with exponential backoff from `backoff` seconds. tls / root_certificates /
    tls_server_name: TLS to the router (PEM roots for a private CA; the name the
    certificate was issued for, when it differs from the address's host).
    """

    def __init__(self, address: str = "127.0.0.1:50051", *, api_key: str | None = None,
                 timeout: float = 120.0, retries: int = 3, backoff: float = 0.2,
                 tls: bool = False, root_certificates: bytes | None = None,
                 tls_server_name: str = "") -> None:
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self._metadata, creds, opts = make_channel_args(
            address, api_key, tls, root_certificates, tls_server_name)
        self._channel = (grpc.secure_channel(address, creds, options=opts) if creds
                         else grpc.insecure_channel(address, options=opts))
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _stream(self, messages, timeout, kw) -> Iterator[router_pb2.RouterGenerateResponse]:
        timeout = timeout or self.timeout
        request = build_request(messages, timeout=timeout, **kw)
        attempt = 0
        while True:
            got_any = False
            try:
                call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
                try:
                    for msg in call:
                        got_any = True
                        yield msg
                finally:
                    call.cancel()  # no-op when done; frees the server side when abandoned
                return
            except grpc.RpcError as e:
                err = error_from_rpc(e)
                if got_any or not retryable(err) or attempt >= self.retries:
                    raise err from None
            time.sleep(backoff_s(attempt, self.backoff))
            attempt += 1

    def chat(self, messages, *, timeout: float | None = None, **kw) -> ChatResult:
        """Run one chat to completion. Keyword arguments: model, max_tokens, temperature
        (0 = greedy, the default), top_p, top_k, seed, stop, logprobs, request_id, priority."""
        result = ChatResult()
        for msg in self._stream(messages, timeout, kw):
            add(result, msg)
        return result

    def stream_chat(self, messages, *, timeout: float | None = None, **kw) -> Iterator[str]:
        """Yield text pieces as they are generated."""
        for msg in self._stream(messages, timeout, kw):
            check(msg)
            if msg.text:
                yield msg.text

    def models(self) -> list[str]:
        try:
            r = self._stub.ListModels(router_pb2.ListModelsRequest(), timeout=self.timeout,
                                      metadata=self._metadata)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return [m.id for m in r.models]


__all__ = ["Client", "TandemError"]
