"""Encoder parts on their own: cache budget and LRU, device assignment, scheduler batching,
independence and cancellation, image fetching rules, per-image pixel bounds, the
graph-safe ViT path (and, on CUDA, graph replay against eager), the preprocessing threads'
fair share per client and a request's budget letting its thread go."""

from __future__ import annotations

import asyncio
import http.server
import random
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from encoder_peers.chats import chat, png  # noqa: E402
from waiting import wait_until  # noqa: E402

from tandem.chat import ChatError, ImageInput, Message  # noqa: E402
from tandem.services.encoder.cache import CachedFeatures, EmbeddingCache  # noqa: E402
from tandem.services.encoder.config import EncoderConfig  # noqa: E402
from tandem.services.encoder.media.images import ImageLimits, image_bytes  # noqa: E402
from tandem.services.encoder.pipeline import EncodePipeline  # noqa: E402
from tandem.services.encoder.scheduler import lb_assign  # noqa: E402
from tandem.services.encoder.vit.runner import VisionRunner  # noqa: E402


def feats(rows: int, width: int = 8, deep: int = 0) -> CachedFeatures:
    return CachedFeatures(
        torch.zeros(rows, width), tuple(torch.zeros(rows, width) for _ in range(deep))
    )


def test_cache_never_exceeds_budget_and_evicts_lru():
    rng = random.Random(0)
    cap = 10_000
    c = EmbeddingCache(cap)
    for _ in range(500):
        key = f"k{rng.randrange(60)}"
        if rng.random() < 0.5:
            c.get(key)
        else:
            c.put(key, feats(rng.randrange(1, 120), deep=rng.randrange(0, 3)))
        assert c.bytes_used <= cap
        assert c.bytes_used == sum(v.nbytes for v in c.entries.values())
    assert c.evictions > 0 and c.hits > 0 and c.misses > 0
    # LRU: a touched entry survives the next eviction, the untouched oldest does not
    c = EmbeddingCache(3 * feats(10).nbytes)
    for k in "abc":
        c.put(k, feats(10))
    assert c.get("a") is not None
    c.put("d", feats(10))
    assert "b" not in c and "a" in c and c.evictions == 1
    assert not c.put("huge", feats(1000)) and "a" in c  # too big for the budget: refused


def test_lb_assign_largest_first():
    assert lb_assign([1250, 100, 200, 50], 4) == [[0], [2], [1], [3]]
    assert lb_assign([5, 9, 1, 7], 1) == [[0, 1, 2, 3]]
    # greedy LPT: 100->d0, 90->d1, 80->d1 (90 < 100), 20->d0, 10->d0
    assert lb_assign([100, 90, 80, 20, 10], 2) == [[0, 3, 4], [1, 2]]


@pytest.fixture(scope="module")
def tiny_pipe(checkpoint):
    torch.set_num_threads(1)
    cfg = EncoderConfig(model=str(checkpoint("qwen2_5_vl")), device="cpu", dtype="float32")
    return EncodePipeline.from_config(cfg)


def test_scheduler_budget_independence_and_cancel(tiny_pipe):
    pipe = tiny_pipe
    pre = pipe.preprocessor
    a = pre(chat(3, seed=60)).images
    b = pre(chat(1, seed=70)).images
    c = pre(chat(1, seed=80)).images
    sched = pipe.scheduler

    async def go():
        pipe.cache.entries.clear()
        pipe.cache.bytes_used = 0
        sched.patch_budget = max(im.num_patches for im in a + b)  # one image per batch
        sched.batches = 0
        pipe.start()
        try:
            tb = asyncio.ensure_future(sched.features(b))
            ta = asyncio.ensure_future(sched.features(a))
            tc = asyncio.ensure_future(sched.features(c))
            await asyncio.sleep(0)  # all three enqueued: b1, a1, a2, a3, c1
            tc.cancel()  # c leaves before its batch: its job is dropped, never encoded
            await tb
            assert not ta.done()  # b left as soon as its own image was done
            await ta
            with pytest.raises(asyncio.CancelledError):
                await tc
            assert sched.batches == 4 and c[0].hash not in pipe.cache
            assert sched.queued_patches == 0 and not sched.inflight
        finally:
            await pipe.scheduler.stop()
            pipe.scheduler.__init__(sched.runners, pipe.cache, 16384, None)

    asyncio.run(go())


def test_the_scaling_signal_rises_with_queued_images_and_falls_to_zero_when_idle(tiny_pipe):
    """tandem_encoder_pending_patches (the encoder tier's autoscaling signal) counts the
    patches waiting for or in the ViT: all of them once the images are queued, fewer as
    batches finish, 0 when idle."""
    from prometheus_client import CollectorRegistry

    from tandem.services.encoder.metrics import EncoderMetrics
    from tandem.services.encoder.scheduler import EncoderScheduler

    pipe = tiny_pipe
    images = pipe.preprocessor(chat(4, seed=90)).images
    metrics = EncoderMetrics(CollectorRegistry())
    sched = EncoderScheduler(pipe.scheduler.runners, type(pipe.cache)(0),
                             max(im.num_patches for im in images), metrics)  # one per batch

    def signal() -> float:
        return metrics.pending_patches._value.get()

    seen = []

    async def go():
        sched.start()
        try:
            task = asyncio.ensure_future(sched.features(images))
            await asyncio.sleep(0)  # queued: the first batch may have been taken already
            seen.append(signal())
            while not task.done():
                seen.append(signal())
                await asyncio.sleep(0.001)
            await task
        finally:
            await sched.stop()

    asyncio.run(go())
    assert seen[0] == sum(im.num_patches for im in images)  # queued + in the ViT
    assert seen == sorted(seen, reverse=True)  # it only falls while the batches run
    assert signal() == 0


def test_per_image_pixel_bounds_are_clamped(tiny_pipe):
    pre = tiny_pipe.preprocessor
    lim = pre.limits
    data = png(300, 200, 5)
    base = pre([Message("user", (ImageInput(data=data),))]).images[0]
    small = pre([Message("user", (ImageInput(data=data, max_pixels=lim.min_pixels * 2),))])
    big = pre([Message("user", (ImageInput(data=data, min_pixels=lim.max_pixels * 50),))])
    assert small.images[0].num_tokens < base.num_tokens
    at_max = pre([Message("user", (ImageInput(data=data, min_pixels=lim.max_pixels),))])
    assert big.images[0].grid == at_max.images[0].grid  # clamped: cannot loosen the server
    assert big.images[0].num_tokens > base.num_tokens
    assert small.images[0].hash != base.hash  # identity is the processed pixels


@pytest.mark.parametrize("size", [(2000, 8), (5, 1200)])
def test_an_image_too_narrow_for_the_processor_is_a_refusal_naming_it(tiny_pipe, size):
    """transformers' smart_resize refuses an aspect ratio over 200 with a ValueError (once
    a 500); the encoder refuses it first, naming the image."""
    chat = [Message("user", ("Look:", ImageInput(data=png(*size, 3))))]
    with pytest.raises(ChatError) as e:
        tiny_pipe.preprocessor(chat)
    assert (e.value.code, e.value.field) == ("INVALID_ARGUMENT", "messages[0].content[1].image")
    assert "aspect ratio" in e.value.message
    at_the_limit = [Message("user", (ImageInput(data=png(2000, 10, 3)),))]  # 200: served
    assert tiny_pipe.preprocessor(at_the_limit).images[0].num_tokens > 0


# /endless.png?<key>: how each such fetch went, seen from the server; a callable in
# _ON_FIRST_BYTE[key] runs once its first byte is out
_ENDLESS: dict[str, dict] = {}
_ON_FIRST_BYTE: dict[str, object] = {}
ENDLESS_BYTES = 300  # a byte every 0.2 s: the server gives up after about a minute


class _Handler(http.server.BaseHTTPRequestHandler):
    body = png(64, 48, 9)

    def do_GET(self):  # noqa: N802
        path, _, key = self.path.partition("?")
        if path == "/endless.png":
            self._endless(key)
            return
        if self.path == "/slow.png":
            time.sleep(1.5)
        if self.path == "/trickle.png":  # a byte every 0.2 s: no single read ever times out
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.body)))
            self.end_headers()
            for b in self.body:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                time.sleep(0.2)
            return
        if self.path == "/redirect.png":
            self.send_response(302)
            self.send_header("Location", "http://example.com/x.png")
            self.end_headers()
            return
        if self.path == "/missing.png":
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def _endless(self, key: str) -> None:
        """A byte every 0.2 s of a body that never completes, until the client hangs up
        or (a hang guard) ENDLESS_BYTES are out and the server hangs up itself; records
        the bytes sent and which side ended it."""
        seen = _ENDLESS[key] = {"sent": 0, "ended_by": None}
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.body)))
            self.end_headers()
            for b in self.body[:ENDLESS_BYTES]:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                seen["sent"] += 1
                if seen["sent"] == 1 and (hook := _ON_FIRST_BYTE.pop(key, None)):
                    hook()
                time.sleep(0.2)
            seen["ended_by"] = "server"
        except OSError:
            seen["ended_by"] = "client"
        self.close_connection = True

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def http_server():
    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):  # the timed-out client hung up
            pass

    srv = Server(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_url_fetch_rules(http_server):
    ok = ImageLimits(10**6, 10**7, ("127.0.0.1",), allow_private_urls=True, url_timeout_s=0.5)
    assert image_bytes(ImageInput(url=http_server + "/a.png"), "f", ok) == _Handler.body
    cases = [
        (ok, "/slow.png", "timed out"),
        (ok, "/trickle.png", "timed out"),  # bounded in total, not per read
        (ok, "/redirect.png", "HTTP 302"),
        (ok, "/missing.png", "HTTP 404"),
        (ImageLimits(100, 10**7, ("127.0.0.1",), True), "/a.png", "over the limit of 100"),
        (ImageLimits(10**6, 10**7, ("127.0.0.1",), False), "/a.png", "non-public address"),
        (ImageLimits(10**6, 10**7, (), True), "/a.png", "not in the encoder's allowed"),
    ]
    for lim, path, text in cases:
        with pytest.raises(ChatError) as ei:
            image_bytes(ImageInput(url=http_server + path), "messages[0].content[0].image", lim)
        assert text in ei.value.message and ei.value.field == "messages[0].content[0].image"


def _images(path, n):
    from transformers import AutoProcessor

    import tandem  # noqa: F401

    proc = AutoProcessor.from_pretrained(path)
    out = proc.image_processor(
        images=[_pil(w, h, i) for i, (w, h) in enumerate(n)], return_tensors="pt"
    )
    return out["pixel_values"], [tuple(g) for g in out["image_grid_thw"].tolist()]


def _pil(w, h, seed):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(png(w, h, seed))).convert("RGB")


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_static_path_matches_eager_on_cpu(checkpoint, arch):
    from tandem.models.split import load_vision_part

    path = checkpoint(arch)
    part = load_vision_part(path, torch.float32, "cpu")
    pixels, grids = _images(path, [(64, 48), (120, 90), (40, 150)])
    eager = VisionRunner(part.visual, mode="eager").run(pixels, grids)
    runner = VisionRunner(part.visual, max_patches=1024, mode="static")
    static = runner.run(pixels, grids)
    assert runner.stats.replays == 1  # the batch fits a bucket: the static step ran
    # the CPU's step attends per segment, as transformers: bit-exact, padding and all
    assert torch.equal(static.embeds, eager.embeds)
    assert len(static.deepstack) == len(eager.deepstack) == (2 if arch == "qwen3_vl" else 0)
    for s, e in zip(static.deepstack, eager.deepstack, strict=True):
        assert torch.equal(s, e)
    full = part.encode_images(pixels, torch.tensor(grids))
    assert torch.equal(eager.embeds, full[0])  # eager is transformers' own tower, bit for bit


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_cuda_graph_replay_matches_eager(checkpoint, arch, dtype):
    from tandem.models.split import load_vision_part

    path = checkpoint(arch)
    part = load_vision_part(path, dtype, "cuda")
    tol = 2e-3 if dtype == torch.float32 else 5e-2
    graph = VisionRunner(part.visual, max_patches=1024, mode="graph")
    static = VisionRunner(part.visual, max_patches=1024, mode="static", attention=graph.attention)
    eager = VisionRunner(part.visual, mode="eager")
    assert graph.stats.captured == len(graph.keys) and not graph.failed_keys  # at start-up
    sets = [[(64, 48)], [(120, 90), (40, 150)], [(64, 48)], [(200, 130)]]
    for sizes in sets:
        pixels, grids = _images(path, sizes)
        g, s, e = graph.run(pixels, grids), static.run(pixels, grids), eager.run(pixels, grids)
        assert torch.equal(g.embeds, s.embeds)  # a replay is the same step, run eagerly
        torch.testing.assert_close(g.embeds, e.embeds, rtol=tol, atol=tol)
        for a, b, c in zip(g.deepstack, s.deepstack, e.deepstack, strict=True):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, c, rtol=tol, atol=tol)
    assert graph.stats.captured == len(graph.keys)  # nothing captured while serving
    assert (graph.stats.replays, graph.stats.eager) == (len(sets), 0)


def test_two_devices_give_the_same_features(checkpoint, tiny_pipe):
    """Two runners (two 'devices', here both CPU): images split largest-first, same result."""
    from tandem.models.split import load_vision_part
    from tandem.services.encoder.scheduler import EncoderScheduler

    path = checkpoint("qwen2_5_vl")
    runners = [VisionRunner(load_vision_part(path, torch.float32, "cpu").visual) for _ in range(2)]
    images = [im for s in (61, 62, 63) for im in tiny_pipe.preprocessor(chat(2, seed=s)).images]

    async def go(rs):
        sched = EncoderScheduler(rs, EmbeddingCache(0), 1 << 20)
        sched.start()
        try:
            return await sched.features(images), sched
        finally:
            await sched.stop()

    (two, s2), (one, s1) = asyncio.run(go(runners)), asyncio.run(go(runners[:1]))
    assert s2.batches == s1.batches == 1
    for a, b in zip(two.features, one.features, strict=True):
        assert torch.equal(a.embeds, b.embeds)


# ---------------------------------------------------------------- fair preprocessing pool
def _recorder():
    """A job that notes its start and blocks until its gate opens."""
    started: list[str] = []

    def job(name: str, gate: threading.Event | None = None) -> str:
        started.append(name)
        if gate is not None:
            assert gate.wait(10), f"{name}: gate never opened"
        return name

    return started, job


def test_fair_pool_one_clients_flood_leaves_a_thread_for_another():
    """Two threads, default share (1 per client): client A's six blocked jobs hold one
    thread; B's job runs at once on the other and is done while all of A's still wait.
    (A plain FIFO pool ran A's first two jobs on both threads: B waited for them.)"""
    from tandem.services.encoder.fair_pool import FairPool

    async def go():
        pool = FairPool(2)
        started, job = _recorder()
        gate = threading.Event()
        try:
            flood = [asyncio.ensure_future(pool.run("A", job, f"a{i}", gate)) for i in range(6)]
            await asyncio.sleep(0.05)
            assert await asyncio.wait_for(pool.run("B", job, "b0"), 2.0) == "b0"
            assert started == ["a0", "b0"] and not any(f.done() for f in flood)
            assert pool.busy == 1 and pool.queued == 5  # A: one running, five waiting
        finally:
            gate.set()
        assert await asyncio.gather(*flood) == [f"a{i}" for i in range(6)]
        assert pool.busy == 0 and pool.queued == 0 and not pool._running
        pool.shutdown()

    asyncio.run(go())


def test_fair_pool_serves_clients_in_turn_and_drops_cancelled_jobs():
    """share = workers: A's jobs fill both threads, but the next free thread goes to B
    (round-robin over clients, not the oldest job). A job cancelled while waiting never
    runs; an exception reaches its caller; None is a client of its own."""
    from tandem.services.encoder.fair_pool import FairPool, share_of

    assert [share_of(w, 0) for w in (1, 2, 3, 8)] == [1, 1, 1, 4]
    assert share_of(2, 5) == 2 and share_of(4, 3) == 3

    async def go():
        pool = FairPool(2, share=2)
        started, job = _recorder()
        gates = {f"a{i}": threading.Event() for i in range(4)}
        a = [asyncio.ensure_future(pool.run("A", job, n, g)) for n, g in gates.items()]
        await asyncio.sleep(0.05)
        b = asyncio.ensure_future(pool.run("B", job, "b0", threading.Event()))
        c = asyncio.ensure_future(pool.run("C", job, "c0"))
        await asyncio.sleep(0.05)
        c.cancel()  # waiting: dropped
        await asyncio.sleep(0)
        assert started == ["a0", "a1"]
        gates["a0"].set()  # one thread frees: B's turn, not a2
        await a[0]
        await asyncio.sleep(0.05)
        assert started == ["a0", "a1", "b0"]
        b.cancel()  # running: it holds its thread until it returns
        await asyncio.sleep(0.05)
        assert pool.busy == 2 and started == ["a0", "a1", "b0"]
        for g in gates.values():
            g.set()
        await asyncio.gather(*a[1:])
        assert "c0" not in started

        def boom():
            raise ValueError("bad image")

        with pytest.raises(ValueError, match="bad image"):
            await pool.run(None, boom)
        pool.shutdown()

    asyncio.run(go())


def test_fair_pool_shares_thread_time_between_clients():
    """Issue 41 (a per-client decode time share): among clients waiting with as many
    threads, the one that used the threads least lately goes first. One thread: A's long
    job runs (30 s on the pool's clock) while A's next job and B's wait, A's first in turn;
    when the thread frees it goes to B (before: A again, job for job). A client's time
    decays with a half-life of USAGE_HALF_LIFE_S."""
    from tandem.services.encoder.fair_pool import USAGE_HALF_LIFE_S, FairPool

    now = [1000.0]

    async def go():
        pool = FairPool(1, clock=lambda: now[0])
        started, job = _recorder()
        gate = threading.Event()
        a0 = asyncio.ensure_future(pool.run("A", job, "a0", gate))
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(pool.run(c, job, n)) for c, n in (("A", "a1"), ("B", "b0"))]
        await asyncio.sleep(0.05)
        assert started == ["a0"] and pool.queued == 2
        now[0] += 30.0  # a0's decode took 30 s
        gate.set()
        await a0
        await asyncio.gather(*rest)
        assert started == ["a0", "b0", "a1"]
        assert pool.usage("A") == pytest.approx(30.0) and pool.usage("B") == 0.0
        now[0] += 2 * USAGE_HALF_LIFE_S
        assert pool.usage("A") == pytest.approx(7.5)
        pool.shutdown()

    asyncio.run(go())


def test_budget_stops_a_fetch_once_the_request_has_ended(http_server):
    """A worker fetching a trickling URL for a request that has gone (its Encode
    cancelled) or run out of time is let go by the request's Budget, not by the fetch
    timeout. The URL's timeout (an hour) cannot fire here and the body never completes, so
    only the budget can end the fetch: TimeoutError (the url's own timeout would be a
    ChatError, and the server giving up, at ENDLESS_BYTES, a ChatError for the cut body),
    and it is the client that hung up, mid-body."""
    from tandem.services.encoder.media.images import Budget

    lim = ImageLimits(10**6, 10**7, ("127.0.0.1",), allow_private_urls=True,
                      url_timeout_s=3600)

    def fetch(key: str, budget: Budget) -> dict:
        url = f"{http_server}/endless.png?{key}"
        with pytest.raises(TimeoutError):
            image_bytes(ImageInput(url=url), "f", lim, budget)
        # the server sees the hang-up at its next write: a hang guard, not a bound
        wait_until(lambda: _ENDLESS[key]["ended_by"], timeout_s=60,
                   what=f"the {key} fetch's server side ended", state=lambda: _ENDLESS[key])
        return _ENDLESS[key]

    # the request is gone (its stop set once the first byte is out): let go at a next byte
    budget = Budget()
    _ON_FIRST_BYTE["stopped"] = budget.stop.set
    seen = fetch("stopped", budget)
    assert seen["ended_by"] == "client" and seen["sent"] < ENDLESS_BYTES, seen
    # the request's deadline passes mid-fetch (0.5 s builds the scenario, nothing is timed)
    seen = fetch("deadline", Budget(deadline=time.monotonic() + 0.5))
    assert seen["ended_by"] == "client" and seen["sent"] < ENDLESS_BYTES, seen


def test_a_huge_text_is_refused_after_tokenizing_about_a_legal_prompts_worth(tiny_pipe):
    """Refusing a text far over the token limit costs about what a legal prompt does, not
    what its length would (issue 16: a flood of 2 MB texts took the CPU from other
    clients): the tokenizer sees a few pieces, then the chat is refused by name. A legal
    long text (more than one piece) still gets exactly the ids of one whole tokenization."""
    from tandem.chat import COUNT_SLICE_CHARS, ChatTemplate

    template = ChatTemplate(tiny_pipe.preprocessor.processor)
    tok = template.processor.tokenizer
    seen: list[int] = []

    class Counting:
        def __call__(self, text, **kw):
            seen.append(len(text))
            return tok(text, **kw)

        def __getattr__(self, name):
            return getattr(tok, name)

    template.processor.tokenizer = Counting()
    try:
        huge = [Message("user", ("lorem ipsum dolor sit amet " * 75_000,))]  # ~2 MB
        hf, _ = template.split(huge)
        with pytest.raises(ChatError, match="375000 words, more than a prompt of at most 32768") as e:
            template.token_ids(huge, hf, [], 32768)
        assert e.value.field == "messages" and seen == []  # counted in words: no tokenizing
        # words under the limit but tokens over it (one word, many tokens): counted in
        # pieces, refused after about a legal prompt's worth of tokenizing
        dense = [Message("user", (("x" * 2_000 + " ") * 1_000,))]  # 2 MB, 1000 words
        hf, _ = template.split(dense)
        with pytest.raises(ChatError, match="over the limit of 32768 tokens"):
            template.token_ids(dense, hf, [], 32768)
        assert sum(seen) <= 3 * COUNT_SLICE_CHARS < 2_000_000 // 5, seen
        seen.clear()
        legal = [Message("user", ("the quick brown fox jumps. " * 12_000,))]  # 324K chars
        hf, _ = template.split(legal)
        ids = template.token_ids(legal, hf, [], 200_000)
        assert len(seen) > 2  # counted in pieces first, then tokenized whole
        text = template.processor.apply_chat_template(hf, tokenize=False,
                                                      add_generation_prompt=True)
        assert ids == tok(text)["input_ids"]
    finally:
        template.processor.tokenizer = tok


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "RGB"])
def test_transparency_is_composited_onto_white_as_transformers_does(mode):
    """A transparent PNG: what lies under the transparent pixels must not show (it did: the
    alpha band was dropped), the image is what transformers' processors see after their
    `convert_to_rgb` (composited onto white)."""
    import io

    import numpy as np
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    from tandem.services.encoder.media.images import decode_image

    rng = np.random.default_rng(7)
    rgba = rng.integers(0, 256, (24, 40, 4), dtype=np.uint8)
    rgba[:8, :, 3] = 0  # wholly transparent rows over random colours
    img = Image.fromarray(rgba, "RGBA")
    if mode == "LA":
        img = img.convert("LA")
    elif mode == "P":  # a palette image whose colour 0 is transparent
        img = img.convert("RGB").quantize(16)
        img.info["transparency"] = 0
    elif mode == "RGB":
        img = img.convert("RGB")
    buf = io.BytesIO()
    img.save(buf, "PNG", **({"transparency": 0} if mode == "P" else {}))
    ours = decode_image(buf.getvalue(), "image", ImageLimits(1 << 20, 1 << 20))
    want = convert_to_rgb(Image.open(io.BytesIO(buf.getvalue())), return_numpy=True)
    assert ours.mode == "RGB" and np.array_equal(np.asarray(ours), want)
    if mode in ("RGBA", "LA"):
        assert (np.asarray(ours)[:8] == 255).all()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_a_bfloat16_tower_widened_on_the_cpu_rounds_its_rows_once(checkpoint, arch):
    """A bfloat16 encoder on the CPU with cpu_bf16_compute float32 (`auto` where the CPU has
    no bfloat16 matrix instructions): the tower is loaded in float32 (the checkpoint's
    bfloat16 weights widened, its rotary tables computed in float32) and rounds its rows to
    bfloat16 once, so they lie within a bfloat16 step of transformers' float32 tower, nearer
    than transformers' bfloat16 tower comes; the text table stays bfloat16."""
    from tandem.models.split import load_vision_part

    path = checkpoint(arch)
    pipe = EncodePipeline.from_config(EncoderConfig(
        model=str(path), device="cpu", dtype="bfloat16", cpu_bf16_compute="float32"))
    (runner,) = pipe.scheduler.runners
    assert (runner.dtype, runner.out_dtype) == (torch.float32, torch.bfloat16)
    assert pipe.embed_tokens.weight.dtype == torch.bfloat16  # the payload's rows
    pixels, grids = _images(path, [(64, 48), (120, 90)])
    ours = runner.run(pixels, grids)
    wide = load_vision_part(path, torch.float32, "cpu").encode_images(pixels, torch.tensor(grids))
    hf = load_vision_part(path, torch.bfloat16, "cpu").encode_images(pixels, torch.tensor(grids))
    for got, ref, theirs in zip([ours.embeds, *ours.deepstack], [wide[0], *wide[1]],
                                [hf[0], *hf[1]], strict=True):
        assert got.dtype == torch.bfloat16
        # one rounding (2**-8 relative), or two where the packed kernels' float32 sum and
        # torch's land on either side of a bfloat16 boundary
        torch.testing.assert_close(got.float(), ref, rtol=2**-7, atol=1e-6)
        assert (got.float() - ref).abs().max() <= (theirs.float() - ref).abs().max()
