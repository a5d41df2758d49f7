"""Tier services in this process: their `run(cfg, ready, stop)`s in one background event
loop, so a test can patch what runs inside them (a ViT gate, a spy) and drive them as the
router does.

    services = Services().start([lambda r, s: run_encoder(enc_cfg, r, s), ...])
    services.call(some_coroutine())      # on the services' loop, under the hang guard
    services.stop()
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine

HANG_GUARD_S = 120.0

Run = Callable[[asyncio.Event, asyncio.Event], Coroutine]  # (ready, stop) -> a service's run


class Services:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.tasks: list[asyncio.Future] = []

    def start(self, runs: list[Run]) -> Services:
        """Start every service and return once each said it is ready (a service that
        failed to start raises here, saying why)."""
        self.thread.start()

        async def boot():
            self.stop_ev = asyncio.Event()
            ready = [asyncio.Event() for _ in runs]
            self.tasks = [asyncio.ensure_future(run(r, self.stop_ev))
                          for run, r in zip(runs, ready, strict=True)]
            waits = {asyncio.ensure_future(r.wait()) for r in ready}
            while waits:
                done, _ = await asyncio.wait([*waits, *self.tasks], timeout=HANG_GUARD_S,
                                             return_when=asyncio.FIRST_COMPLETED)
                assert done, "services did not start (hang guard)"
                for t in self.tasks:
                    if t.done():
                        t.result()  # a service that failed to start says why
                waits = {w for w in waits if not w.done()}

        self.call(boot())
        return self

    def call(self, coro, timeout_s: float = HANG_GUARD_S + 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        async def down():
            self.stop_ev.set()
            await asyncio.gather(*self.tasks, return_exceptions=True)

        self.call(down())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
