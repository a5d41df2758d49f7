"""Encoder scheduler: images and videos from many requests -> batched ViT calls under a
patch budget.

    request A ─┐  cache hit ─────────────────────────────▶ features
               ├─ miss ─▶ ImageJob ─┐
    request B ─┘  same key in flight: shares the job     ├─▶ FIFO queue ─▶ batch (<= budget)
                                                          │     ─▶ lb_assign over devices
    request C ─── miss ─▶ ImageJob ─┘                     │     ─▶ runner threads ─▶ cache

A ViT input is an image or a whole video (its frames are segments of their own in the
tower, as an image is one); an input over the budget runs alone. A request awaits only its
own inputs' jobs, so it leaves as soon as they are done, never behind a slower request.
Identical inputs (one cache key) in flight are encoded once. A job whose every waiter went
away (cancelled, deadline) before its batch started is dropped.

`features` = `lookup` (the cache, counted) + `encode` (the ViT for the misses). The
pipeline calls the two apart for videos: a hit must be known before a video is decoded.

A stall watch: each device's ViT call reports progress after each block (a graph replay
as one step); a call that goes `stall_s` without any is taken for a hang (`stalled`),
which the encoder acts on (server.py: no heartbeats, new work refused, health
NOT_SERVING).

For traces, each job records when it was queued and the batch it ran in (`VitRun`, Unix
ns: two clock reads per batch); `encode` hands each input's run back and the request's
own coroutine makes its spans from them (the batcher never touches a span).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tandem.services.encoder.cache import CachedFeatures, EmbeddingCache
from tandem.services.encoder.vit.runner import VisionRunner

log = logging.getLogger(__name__)


class VisionInput(Protocol):
    """One ViT input: an image (`PreparedImage`) or a decoded video (`PreparedVideo`)."""

    pixel_values: torch.Tensor  # [num_patches, C * T * P * P]

    @property
    def key(self) -> str: ...  # the embedding cache key

    @property
    def grid(self) -> tuple[int, int, int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_patches(self) -> int: ...


def lb_assign(patches: list[int], num_devices: int) -> list[list[int]]:
    """Largest image first onto the least-loaded device (SGLang's ViT-DP balancing).

    Returns, per device, the indices it runs, in ascending index order. With one device
    every image lands on it in input order.
    """
    loads = [0] * num_devices
    out: list[list[int]] = [[] for _ in range(num_devices)]
    for i in sorted(range(len(patches)), key=lambda i: (-patches[i], i)):
        d = min(range(num_devices), key=lambda d: (loads[d], d))
        out[d].append(i)
        loads[d] += patches[i]
    return [sorted(ix) for ix in out]


@dataclass(frozen=True)
class VitRun:
    """Where one input went through the ViT: queued, its batch's start and end (Unix ns),
    the batch's size; `shared` when another request's identical input was its job."""

    queued_ns: int
    start_ns: int
    end_ns: int
    batch_inputs: int
    batch_patches: int
    shared: bool = False


@dataclass
class ImageJob:
    key: str
    image: VisionInput
    future: asyncio.Future
    waiters: int = 1
    started: bool = False
    queued_ns: int = field(default_factory=time.time_ns)
    run: VitRun | None = None  # set by the batcher once its batch ran


@dataclass
class FeatureResult:
    features: list[CachedFeatures]
    cached_tokens: int = 0
    vit_s: float = 0.0
    hits: list[bool] = field(default_factory=list)
    runs: list[VitRun | None] = field(default_factory=list)  # `encode`: None = taken cached


class DeviceThread:
    """One device's ViT thread: runs the calls submitted to it one at a time, in order.

    A daemon thread, unlike a ThreadPoolExecutor's (which the interpreter joins at exit): a
    call that never returns (a hung device) must not keep a stopping encoder from exiting."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn, *args) -> asyncio.Future:
        """`fn(*args)` on this thread; its result (or exception) on the running loop."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((done, fn, args))
        return asyncio.wrap_future(done)

    def shutdown(self, wait: bool) -> None:
        """No more calls: the thread ends after those submitted (joined if `wait`)."""
        self._calls.put(None)
        if wait:
            self.thread.join()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            done, fn, args = call
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001  (handed to the awaiting coroutine)
                done.set_exception(e)


class EncoderScheduler:
    def __init__(
        self, runners: list[VisionRunner], cache: EmbeddingCache, patch_budget: int, metrics=None,
        stall_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`stall_s`: a ViT call that goes this long without progress is a hang
        (`stalled`; EncoderConfig.vit_stall_s); `clock`: monotonic seconds (tests pass
        their own). Each ViT call reports its progress to the scheduler (the runner's
        `run(on_progress=...)`)."""
        self.runners = runners
        self.stall_s = stall_s
        self._clock = clock
        # Per device: when its ViT call in progress last progressed (a block finished, a
        # replay returned; monotonic s), None while it runs none. Written by the device's
        # thread, read by the loop (a float store: no lock).
        self._progress: list[float | None] = [None] * len(runners)
        self.cache = cache
        self.patch_budget = patch_budget
        self.metrics = metrics
        self.queue: collections.deque[ImageJob] = collections.deque()
        self.inflight: dict[str, ImageJob] = {}
        self.queued_patches = 0
        self.vit_patches = 0  # in the ViT now (the batch being run)
        self.batches = 0
        # One thread per device: a runner is driven by one thread at a time.
        self.devices = [DeviceThread(f"vit{d}") for d in range(len(runners))]
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="vit-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        stuck = self.stalled()
        if stuck:
            log.error("stopping with a ViT call stalled (%.0f s without progress): not "
                      "waiting for it", self.stalled_s())
        for d in self.devices:
            d.shutdown(wait=not stuck)

    def stalled_s(self) -> float:
        """How long the most stuck device has been in its ViT call without progress; 0
        while every device is idle."""
        now = self._clock()
        # NOTE: a device thread may store a time later than `now`: never below 0
        return max([0.0, *(now - t for t in self._progress if t is not None)])

    def stalled(self) -> bool:
        """A device's ViT call went `stall_s` without progress: taken for a hang (a
        wedged kernel, a deadlocked library). The encoder then stops vouching for its
        rooms (no heartbeats: the language side fails them at the transfer timeout and the
        router retries them elsewhere), refuses new work, and answers health checks
        NOT_SERVING, until the call progresses again. A blocking call that never ends
        cannot be cancelled from Python: the process stays out of service until restarted
        (Kubernetes' health probe restarts it)."""
        return self.stalled_s() > self.stall_s

    def _progressed(self, device: int) -> None:  # on the device's thread
        self._progress[device] = self._clock()

    def lookup(self, key: str) -> CachedFeatures | None:
        """The cache's entry for `key`, counted as a hit or a miss."""
        hit = self.cache.get(key)
        if self.metrics:
            self.metrics.cache(hit is not None)
        return hit

    async def features(self, images: list[VisionInput]) -> FeatureResult:
        """Features of each input in order, from the cache or the ViT."""
        res = FeatureResult(features=[None] * len(images))  # type: ignore[list-item]
        misses = []
        for i, img in enumerate(images):
            hit = self.lookup(img.key)
            res.hits.append(hit is not None)
            if hit is not None:
                res.features[i] = hit
                res.cached_tokens += img.num_tokens
            else:
                misses.append(i)
        got = await self.encode([images[i] for i in misses])
        for i, f in zip(misses, got.features, strict=True):
            res.features[i] = f
        res.vit_s = got.vit_s
        return res

    async def encode(self, images: list[VisionInput]) -> FeatureResult:
        """Features of each input in order from the ViT (inputs looked up and missed: an
        entry cached since is taken, uncounted, rather than computed again)."""
        res = FeatureResult(features=[None] * len(images))  # type: ignore[list-item]
        res.runs = [None] * len(images)
        waits: list[tuple[int, ImageJob]] = []
        shared: set[int] = set()
        for i, img in enumerate(images):
            cached = self.cache.peek(img.key)
            if cached is not None:
                res.features[i] = cached
                continue
            job = self.inflight.get(img.key)
            if job is not None:
                job.waiters += 1
                shared.add(i)
            else:
                job = ImageJob(img.key, img, asyncio.get_running_loop().create_future())
                self.inflight[img.key] = job
                self.queue.append(job)
                self.queued_patches += img.num_patches
                self._wake.set()
                self._gauge()
            waits.append((i, job))
        pending = list(waits)
        try:
            for i, job in waits:
                # NOTE: shield: a shared job must survive one waiter's cancellation.
                feats, vit_s = await asyncio.shield(job.future)
                res.features[i] = feats
                res.vit_s = max(res.vit_s, vit_s)
                if job.run is not None and i in shared:
                    res.runs[i] = dataclasses.replace(job.run, shared=True)
                else:
                    res.runs[i] = job.run
                pending.remove((i, job))
        finally:
            for _, job in pending:  # cancelled or failed: let go of what we still wait on
                job.waiters -= 1
        return res

    # -------------------------------------------------------------- batching
    def _take_batch(self) -> list[ImageJob]:
        batch, patches = [], 0
        while self.queue:
            job = self.queue[0]
            if job.waiters <= 0:  # nobody wants it any more
                self.queue.popleft()
                self.queued_patches -= job.image.num_patches
                self.inflight.pop(job.key, None)
                job.future.cancel()
                continue
            n = job.image.num_patches
            if batch and patches + n > self.patch_budget:
                break
            self.queue.popleft()
            self.queued_patches -= n
            job.started = True
            batch.append(job)
            patches += n
        return batch

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            batch = self._take_batch()
            self.vit_patches = sum(j.image.num_patches for j in batch)
            self._gauge()
            if not batch:
                self._wake.clear()
                continue
            groups = lb_assign([j.image.num_patches for j in batch], len(self.runners))
            start_ns = time.time_ns()
            t0 = time.perf_counter()
            try:
                outs = await asyncio.gather(
                    *[
                        self.devices[d].submit(self._run, d, [batch[i].image for i in ix])
                        for d, ix in enumerate(groups)
                        if ix
                    ]
                )
            except Exception as e:  # a ViT failure fails this batch's jobs, not the loop
                for job in batch:
                    self.inflight.pop(job.key, None)
                    if not job.future.done():
                        job.future.set_exception(e)
                self.vit_patches = 0
                self._gauge()
                continue
            vit_s = time.perf_counter() - t0
            end_ns = time.time_ns()
            self.vit_patches = 0
            self._gauge()
            self.batches += 1
            if self.metrics:
                self.metrics.batch(len(batch), sum(j.image.num_patches for j in batch), vit_s)
            done = [i for _, ix in ((d, ix) for d, ix in enumerate(groups) if ix) for i in ix]
            feats = [f for out in outs for f in out]
            patches = sum(j.image.num_patches for j in batch)
            for i, f in zip(done, feats, strict=True):
                job = batch[i]
                job.run = VitRun(job.queued_ns, start_ns, end_ns, len(batch), patches)
                self.cache.put(job.key, f)
                self.inflight.pop(job.key, None)
                if not job.future.done():
                    job.future.set_result((f, vit_s))

    def _gauge(self) -> None:
        if self.metrics:
            self.metrics.queue_patches.set(self.queued_patches)
            self.metrics.pending_patches.set(self.queued_patches + self.vit_patches)

    def _run(self, device: int, images: list[VisionInput]) -> list[CachedFeatures]:
        """On runner `device`'s thread: one ViT call over `images`, split per input."""
        runner = self.runners[device]
        self._progress[device] = self._clock()
        try:
            pixels = torch.cat([im.pixel_values for im in images])
            out = runner.run(pixels, [im.grid for im in images],
                             on_progress=functools.partial(self._progressed, device))
            sizes = [im.num_tokens for im in images]
            embeds = out.embeds.cpu().split(sizes)  # NOTE: a hung device blocks here
            deep = [d.cpu().split(sizes) for d in out.deepstack]
        finally:
            self._progress[device] = None
        # clone: a cached entry must not pin the whole batch's output tensor
        return [
            CachedFeatures(embeds[k].clone(), tuple(d[k].clone() for d in deep))
            for k in range(len(images))
        ]
