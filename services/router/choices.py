"""`n` > 1: one request, n independent samples of the same prompt.

Each choice is its own request through the dispatcher (its own room, its own seed: the
request's seed + i when it has one, so choice i is reproducible), all admitted as one
request. Conversation affinity sends them to the same language instance, whose prefix
cache can share the prompt's KV pages between them. Their Outputs are merged in arrival
order, each tagged with its choice index; when any choice fails, the others are closed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from tandem.services.router.request import ChatRequest, Output
from tandem.v1 import common_pb2


def choice_requests(req: ChatRequest, n: int) -> list[ChatRequest]:
    """The n requests of a request asking for n choices."""
    out = []
    for i in range(n):
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(req.sampling)
        if i and req.sampling.HasField("seed"):
            sampling.seed = (req.sampling.seed + i) % (1 << 63)
        out.append(dataclasses.replace(req, sampling=sampling))
    return out


_END = object()


async def merged(generators: list[AsyncIterator[Output]]) -> AsyncIterator[tuple[int, Output]]:
    """(choice index, Output) from all generators as they come; the first error is raised
    (after the other generators are closed)."""
    if len(generators) == 1:  # the common case, without tasks
        async for output in generators[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[Output]) -> None:
        try:
            async for output in gen:
                await queue.put((i, output))
            await queue.put((i, _END))
        except BaseException as e:  # noqa: BLE001  (handed to the consumer)
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generators)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in generators:
            await g.aclose()
