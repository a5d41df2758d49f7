"""asyncio gRPC client of the Tandem router (same API as `Client`, awaitable)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from tandem.client.channel import RouterChannel, backoff_s
from tandem.client.errors import error_from_rpc
from tandem.client.results import ChatResult, add, check, collect
from tandem.v1 import router_pb2


class AsyncClient(RouterChannel):
    """`async with AsyncClient("127.0.0.1:50051") as c: r = await c.chat("Hello")`
    (the options are `Client`'s)."""

    _grpc = grpc.aio

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _stream(self, messages, timeout, kw) -> AsyncIterator:
        c = self._generate_call(messages, timeout, kw)
        attempt = 0
        while True:
            got_any = False
            call = self._stub.Generate(c.request, timeout=c.timeout, metadata=c.metadata)
            try:
                async for msg in call:
                    got_any = True
                    yield msg
                return
            except grpc.RpcError as e:
                err = error_from_rpc(e)
                if not self._retries(err, got_any, attempt):
                    raise err from None
            finally:
                call.cancel()  # no-op when done; cancels the server side when abandoned
            await asyncio.sleep(backoff_s(attempt, self.backoff))
            attempt += 1

    async def chat(self, messages, *, timeout: float | None = None, **kw) -> ChatResult:
        if kw.get("n", 1) != 1:
            raise ValueError("n > 1 returns several results: use chat_choices(messages, n)")
        result = ChatResult()
        async for msg in self._stream(messages, timeout, kw):
            add(result, msg)
        return result

    async def chat_choices(self, messages, n: int, *, timeout: float | None = None,
                           **kw) -> list[ChatResult]:
        """n independent samples of one chat (see `Client.chat_choices`)."""
        return collect([m async for m in self._stream(messages, timeout, dict(kw, n=n))], n)

    async def stream_chat(self, messages, *, timeout: float | None = None,
                          **kw) -> AsyncIterator[str]:
        async for msg in self._stream(messages, timeout, kw):
            check(msg)
            if msg.text:
                yield msg.text

    async def models(self) -> list[str]:
        try:
            r = await self._stub.ListModels(router_pb2.ListModelsRequest(),
                                            timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return [m.id for m in r.models]
