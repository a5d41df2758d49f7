"""Blocking gRPC client of the Tandem router."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc

from tandem.client.channel import RouterChannel, backoff_s
from tandem.client.errors import TandemError, error_from_rpc
from tandem.client.results import ChatResult, add, check, collect
from tandem.v1 import router_pb2


class Client(RouterChannel):
    """`Client("127.0.0.1:50051").chat("Hello")`.

    timeout: default per-request deadline in seconds (sent to the router, and the gRPC
    deadline). retries: how often a request failing with UNAVAILABLE before any output is
    retried, with exponential backoff from `backoff` seconds. tls / root_certificates /
    tls_server_name: TLS to the router (PEM roots for a private CA; the name the
    certificate was issued for, when it differs from the address's host).
    """

    _grpc = grpc

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _stream(self, messages, timeout, kw) -> Iterator[router_pb2.RouterGenerateResponse]:
        c = self._generate_call(messages, timeout, kw)
        attempt = 0
        while True:
            got_any = False
            try:
                call = self._stub.Generate(c.request, timeout=c.timeout, metadata=c.metadata)
                try:
                    for msg in call:
                        got_any = True
                        yield msg
                finally:
                    call.cancel()  # no-op when done; frees the server side when abandoned
                return
            except grpc.RpcError as e:
                err = error_from_rpc(e)
                if not self._retries(err, got_any, attempt):
                    raise err from None
            time.sleep(backoff_s(attempt, self.backoff))
            attempt += 1

    def chat(self, messages, *, timeout: float | None = None, **kw) -> ChatResult:
        """Run one chat to completion. Keyword arguments: model, max_tokens, temperature
        (0 = greedy, the default), top_p, top_k, min_p, seed, stop, stop_token_ids,
        include_stop_str_in_output, min_tokens, presence_penalty, frequency_penalty,
        repetition_penalty, logit_bias, logprobs, top_logprobs, structured output (one of
        json_schema, json_object, regex, choice, grammar), tools and tool_choice (the
        calls come back in ChatResult.tool_calls), skip_special_tokens,
        spaces_between_special_tokens, chat_template_kwargs, add_generation_prompt,
        continue_final_message, request_id, priority (`build_request`); traceparent (a W3C
        trace context the request's spans join, docs/deploy.md "Tracing")."""
        if kw.get("n", 1) != 1:
            raise ValueError("n > 1 returns several results: use chat_choices(messages, n)")
        result = ChatResult()
        for msg in self._stream(messages, timeout, kw):
            add(result, msg)
        return result

    def chat_choices(self, messages, n: int, *, timeout: float | None = None,
                     **kw) -> list[ChatResult]:
        """n independent samples of one chat (choice i uses seed + i when a seed is given),
        with `chat`'s keyword arguments."""
        return collect(self._stream(messages, timeout, dict(kw, n=n)), n)

    def stream_chat(self, messages, *, timeout: float | None = None, **kw) -> Iterator[str]:
        """Yield the text as it is generated, one fragment per message."""
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
