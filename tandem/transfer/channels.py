"""The language side's gRPC channels to encoders, one per address, bounded.

An address named once (a departed pod, a bad caller) is not kept open forever: beyond
`max_channels` the least recently used channel is closed with a grace of `grace_s`, so
calls still on it finish. Tasks that end calls or channels gracefully are tracked here
(`track`) and awaited at `close()`.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import grpc

from tandem.internal_tls import aio_channel


class EncoderChannels:
    def __init__(self, grace_s: float, max_channels: int = 64, tls=None) -> None:
        self.grace_s, self.max_channels, self.tls = grace_s, max_channels, tls
        self.open: OrderedDict[str, grpc.aio.Channel] = OrderedDict()  # LRU order
        self._closing: set[asyncio.Task] = set()

    def get(self, address: str) -> grpc.aio.Channel:
        ch = self.open.get(address)
        if ch is not None:
            self.open.move_to_end(address)
            return ch
        if len(self.open) >= self.max_channels:
            _, old = self.open.popitem(last=False)
            self.track(asyncio.ensure_future(old.close(grace=self.grace_s)))
        ch = self.open[address] = aio_channel(address, self.tls)
        return ch

    def track(self, task: asyncio.Task) -> None:
        """Keep a graceful ending (a call or a channel) alive until it is done."""
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._closing, return_exceptions=True)
        for ch in self.open.values():
            await ch.close()
        self.open.clear()
