"""KV pages between two caches through Mooncake (tandem/transfer/kv.py), in this process's
one engine writing to itself over loopback TCP: page-major staging (one descriptor per run
of slots, whatever the layer count), exact pages on arrival, a keyed tag checked in
private memory before a page is used, ciphertext on the wire under `encrypt`, and caches
that no Mooncake peer can write. Tags taken ahead, as the prefill completes pages
(`KVTagger`), serve only the pages, keys and epoch they were taken over; staging wiped
after the pages may be used is no one's until then and comes back free as zeros."""

from __future__ import annotations

import pytest
import torch
from transfer_peers.harness import make_engine

from tandem.services.language.runner.kv_cache import KVCache
from tandem.transfer.buffers import RowProtection
from tandem.transfer.errors import TransferError
from tandem.transfer.kv import (
    KVDestination,
    KVKeys,
    KVPageLayout,
    KVStaging,
    chunk_plan,
    pack,
    runs,
    send_pages,
    unpack_into,
)

LAYERS, PAGE, HEADS, DIM, PAGES = 6, 4, 2, 8, 16


def cache(seed: int | None = None, dtype=torch.float32) -> KVCache:
    c = KVCache(LAYERS, PAGES, PAGE, HEADS, DIM, dtype, "cpu")
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for t in c.k + c.v:
            t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    return c


def to(engine, inbox: KVStaging, slots: list[int], room: int, secret: RowProtection,
       base: int | None = None) -> KVDestination:
    return KVDestination(engine.session_id, inbox.base if base is None else base, slots, room,
                         1, secret)


def land_and_check(inbox, owner, dst, pages, sent, secret, room) -> None:
    """The decode side, chunk by chunk as `on_chunk` reports them."""
    for c in sent.chunks:
        part = pages[c.first : c.first + c.pages]
        inbox.land(owner, dst, part, first=c.first)
        keys = KVKeys.derive(secret, room, 1, c.first, c.pages)
        if keys is not None:
            keys.open_pages(dst, part, c.tag)  # decrypts in place under encrypt
        else:
            assert c.tag == b""


def same_pages(a: KVCache, pa: list[int], b: KVCache, pb: list[int]) -> bool:
    return all(torch.equal(x[pa], y[pb]) for x, y in zip(a.k + a.v, b.k + b.v, strict=True))


@pytest.fixture
def wire():
    """This process's engine, a registered outbox (prefill side) and inbox (decode side)."""
    engine, _cfg = make_engine()
    layout = KVPageLayout(LAYERS, PAGE, HEADS, DIM, torch.float32)
    outbox, inbox = KVStaging(layout, 8), KVStaging(layout, 8)
    outbox.register(engine)
    inbox.register(engine)
    yield engine, outbox, inbox
    engine.unregister(outbox.rows)
    engine.unregister(inbox.rows)


def test_pack_then_unpack_moves_pages_exactly_between_caches():
    src, dst = cache(1), cache()
    scratch = torch.empty((4, *KVPageLayout.of_cache(src).slot_shape))
    unpack_into(dst, [5, 0, 11], pack(src, [2, 9, 3], scratch))
    assert same_pages(src, [2, 9, 3], dst, [5, 0, 11])
    assert not dst.k[0][[1, 2, 3]].any()  # nothing else written
    unpack_into(dst, [1, 2, 3], pack(src, [4, 5, 6], scratch))  # one run: slice copies
    assert same_pages(src, [4, 5, 6], dst, [1, 2, 3]) and not dst.k[0][4].any()


def test_the_tag_covers_the_same_bytes_whatever_the_pages_hold_them():
    """`tag_order` is one byte order (layer by layer, K then V, pages in order): pages
    that are one run on one side and scattered on the other carry the same tag, and the
    same pages in another order do not."""
    src, dst = cache(11), cache()
    scratch = torch.empty((4, *KVPageLayout.of_cache(src).slot_shape))
    unpack_into(dst, [9, 2, 14, 0], pack(src, [3, 4, 5, 6], scratch))
    keys = KVKeys.derive(RowProtection.new("mac"), 1, 1, 0, 4)
    tag = keys.tag(src, [3, 4, 5, 6])
    assert keys.tag(dst, [9, 2, 14, 0]) == tag
    keys.open_pages(dst, [9, 2, 14, 0], tag)
    assert keys.tag(src, [4, 3, 5, 6]) != tag


def test_chunks_cover_the_transfer_in_order_and_ramp_up_and_down():
    for n, m in [(1, 64), (5, 2), (100, 64), (192, 64), (256, 64), (1024, 64), (1000, 64)]:
        plan = chunk_plan(n, m)
        assert plan[0][0] == 0 and plan[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(plan, plan[1:], strict=False))
        assert all(0 < e - f <= m for f, e in plan)
    assert [e - f for f, e in chunk_plan(256, 64)] == [16, 32, 54, 53, 53, 32, 16]
    assert [e - f for f, e in chunk_plan(100, 64)] == [64, 36]  # too short to ramp


def test_one_descriptor_per_run_of_slots_whatever_the_layer_count():
    bs = KVPageLayout(LAYERS, PAGE, HEADS, DIM, torch.float32).page_bytes
    srcs, dsts, lens = runs(1000, [0, 1, 2, 3], 5000, [4, 5, 6, 7], bs)
    assert (srcs, dsts, lens) == ([1000], [5000 + 4 * bs], [4 * bs])
    srcs, dsts, lens = runs(1000, [0, 1, 2, 3], 5000, [4, 5, 9, 10], bs)
    assert len(srcs) == 2 and lens == [2 * bs, 2 * bs]
    # a direct write into a per-layer cache would cost 2 x layers descriptors per run
    assert 2 * LAYERS > len(srcs)


@pytest.mark.parametrize("mode", ["none", "mac", "encrypt"])
def test_pages_arrive_exact_and_verified(wire, mode):
    engine, outbox, inbox = wire
    src, dst = cache(2), cache()
    pages_src, pages_dst = [3, 8, 1, 14, 6], [0, 1, 2, 3, 4]
    secret = RowProtection.new(mode)  # the decode side's, sent over the control stream
    slots = inbox.reserve(len(pages_src), "room-7")
    assert slots == [0, 1, 2, 3, 4]  # lowest free run: one descriptor
    rows = pack(src, pages_src, torch.empty((5, *inbox.layout.slot_shape)))
    reported, free_at_report = [], []

    def on_chunk(c):
        reported.append(c)
        free_at_report.append(outbox.num_free)
        assert not outbox.rows[: c.first].any()  # the chunks before: wiped

    sent = send_pages(engine, src, pages_src, outbox, to(engine, inbox, slots, 7, secret),
                      on_chunk=on_chunk, chunk_pages=2)  # 3 chunks, pipelined
    assert sent.descriptors == 3 and sent.bytes == len(slots) * inbox.layout.page_bytes
    assert reported == sent.chunks and [(c.first, c.pages) for c in reported] == [
        (0, 2), (2, 2), (4, 1)]
    # each chunk's outbox slots wiped and freed once its write ended (the next report)
    assert free_at_report == [3, 5, 7]
    assert outbox.num_free == 8 and not outbox.rows.any()  # the outbox wiped, freed
    on_wire = inbox.rows[slots].clone()
    assert torch.equal(on_wire, rows) == (mode != "encrypt")  # ciphertext under encrypt
    land_and_check(inbox, "room-7", dst, pages_dst, sent, secret, 7)
    assert inbox.num_free == 8 and not inbox.rows.any()  # landed: wiped and freed
    assert same_pages(src, pages_src, dst, pages_dst)


@pytest.mark.parametrize("mode", ["mac", "encrypt"])
def test_a_page_overwritten_in_staging_by_another_writer_is_data_loss(wire, mode):
    """Another Mooncake writer (here a registered buffer of this process, through the
    engine as any peer would) overwrites one staged page between the transfer and the
    landing: the check of the landed pages fails (the caller then frees them unread)."""
    engine, outbox, inbox = wire
    src, dst = cache(3), cache()
    secret = RowProtection.new(mode)
    slots = inbox.reserve(3, "room-8")
    sent = send_pages(engine, src, [0, 1, 2], outbox, to(engine, inbox, slots, 8, secret))
    rogue = torch.full(inbox.layout.slot_shape, 7.0)
    engine.register(rogue)
    try:
        bs = inbox.layout.page_bytes
        engine.write(engine.session_id, [rogue.data_ptr()], [inbox.base + slots[1] * bs], [bs])
    finally:
        engine.unregister(rogue)
    with pytest.raises(TransferError) as e:
        land_and_check(inbox, "room-8", dst, [4, 5, 6], sent, secret, 8)
    assert e.value.code == "DATA_LOSS"
    assert inbox.num_free == 8 and not inbox.rows.any()


class _OutboxWriter:
    """This process's engine, as the sender uses it, except that just before each submit
    another writer overwrites the staged outbox slots (after the chunk was tagged and
    staged, before the wire reads them): what any process reaching the prefill
    instance's transfer port could do."""

    def __init__(self, engine, outbox: KVStaging) -> None:
        self._engine, self._outbox = engine, outbox

    def submit(self, peer, srcs, dsts, lengths):
        for s, n in zip(srcs, lengths, strict=True):
            self._outbox.rows.view(-1).view(torch.uint8)[s - self._outbox.base :][:n].fill_(7)
        return self._engine.submit(peer, srcs, dsts, lengths)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.mark.parametrize("mode", ["mac", "encrypt"])
def test_a_write_into_the_senders_outbox_after_the_tag_is_taken_is_data_loss(wire, mode):
    """The tag is taken over the sender's cache, never its (registered) outbox: a write
    into the outbox between staging and the wire reaches the decode side's pages and
    fails their check there (DATA_LOSS), chunk by chunk."""
    engine, outbox, inbox = wire
    src, dst = cache(12), cache()
    secret = RowProtection.new(mode)
    slots = inbox.reserve(3, "room-9")
    sent = send_pages(_OutboxWriter(engine, outbox), src, [0, 1, 2], outbox,
                      to(engine, inbox, slots, 9, secret))
    assert outbox.num_free == 8 and not outbox.rows.any()
    # the tag is the cache's, whatever the outbox held (not taken there, before or after)
    assert sent.chunks[0].tag == KVKeys.derive(secret, 9, 1, 0, 3).tag(src, [0, 1, 2])
    with pytest.raises(TransferError) as e:
        land_and_check(inbox, "room-9", dst, [4, 5, 6], sent, secret, 9)
    assert e.value.code == "DATA_LOSS"


def test_a_write_refused_midway_frees_the_outbox_and_the_error_names_the_peer(wire):
    """The second chunk's destination lies outside the peer's registered memory: the
    transfer fails (UNAVAILABLE), its leftovers are drained and the outbox freed."""
    engine, outbox, inbox = wire
    with pytest.raises(TransferError) as e:
        send_pages(engine, cache(4), [0, 1, 2, 3], outbox,
                   to(engine, inbox, [0, 1, 1 << 30, (1 << 30) + 1], 1,
                      RowProtection.new("none")), chunk_pages=2)
    assert e.value.code == "UNAVAILABLE" and outbox.num_free == 8 and not outbox.rows.any()


def test_a_change_in_any_page_or_a_wrong_tag_fails_the_check(wire):
    """Every byte of every layer of every page is covered, in order: one flipped value in
    the last layer's V of the middle page, or pages checked in another order, fails."""
    engine, outbox, inbox = wire
    src = cache(5)
    secret = RowProtection.new("mac")
    for change in ("value", "order", "tag"):
        dst = cache()
        inbox.reserve(3, change)
        sent = send_pages(engine, src, [0, 1, 2], outbox,
                          to(engine, inbox, [0, 1, 2], 9, secret))
        inbox.land(change, dst, [0, 1, 2])
        pages, tag = [0, 1, 2], sent.chunks[0].tag
        if change == "value":
            dst.v[-1][1, -1, -1, -1] += 1.0
        elif change == "order":
            pages = [1, 0, 2]
        else:
            tag = bytes(16)
        with pytest.raises(TransferError):
            KVKeys.derive(secret, 9, 1, 0, 3).open_pages(dst, pages, tag)


def test_keys_differ_per_room_generation_and_chunk():
    secret = RowProtection.new("mac")
    keys = {KVKeys.derive(secret, r, g, f, n).mac for r, g, f, n in
            [(1, 1, 0, 4), (2, 1, 0, 4), (1, 2, 0, 4), (1, 1, 0, 5), (1, 1, 4, 4)]}
    assert len(keys) == 5
    assert KVKeys.derive(RowProtection.new("none"), 1, 1, 0, 4) is None


def test_the_cache_itself_is_not_writable_by_a_peer(wire):
    """Only staging is registered: a write aimed at a page of a cache is refused by
    Mooncake (outside the registered memory), whoever sends it."""
    engine, outbox, _inbox = wire
    dst = cache()
    target = dst.k[0][2]
    assert not engine.owns(target.data_ptr(), target.numel() * target.element_size())
    with pytest.raises(TransferError):
        engine.write(engine.session_id, [outbox.base],
                     [target.data_ptr()], [target.numel() * target.element_size()])
    assert not dst.k[0].any()


def test_a_dropped_reservation_is_wiped_and_freed_and_a_full_inbox_refuses(wire):
    engine, outbox, inbox = wire
    assert inbox.reserve(8, "a") is not None
    assert inbox.reserve(1, "b") is None  # full: the caller waits or refuses
    with pytest.raises(KeyError):
        inbox.reserve(1, "a")  # one reservation per owner
    inbox.rows[0].fill_(1.0)
    inbox.drop("a")
    assert inbox.num_free == 8 and not inbox.rows.any()
    # a transfer failed after its first chunk landed: the rest is dropped, unread
    inbox.reserve(4, "c")
    inbox.rows[:4].fill_(1.0)
    inbox.land("c", cache(), [0, 1], first=0)
    assert inbox.held("c") == [2, 3] and inbox.num_free == 6
    with pytest.raises(KeyError):
        inbox.land("c", cache(), [5, 6], first=0)  # landed already
    inbox.drop("c")
    assert inbox.num_free == 8 and not inbox.rows.any()
    with pytest.raises(KeyError):
        inbox.drop("a")  # a double free is caught where it happens
    big = KVCache(LAYERS, 9, PAGE, HEADS, DIM, torch.float32, "cpu")
    with pytest.raises(TransferError) as e:
        send_pages(engine, big, list(range(9)), outbox,
                   to(engine, inbox, list(range(9)), 1, RowProtection.new("none")))
    assert e.value.code == "RESOURCE_EXHAUSTED" and outbox.num_free == 8


def test_slots_come_as_the_lowest_run_that_fits_else_the_lowest_free():
    s = KVStaging(KVPageLayout(LAYERS, PAGE, HEADS, DIM, torch.float32), 8)
    assert s.reserve(2, "a") == [0, 1] and s.reserve(3, "b") == [2, 3, 4]
    s.drop("a")
    assert s.reserve(3, "c") == [5, 6, 7]  # [0, 1] is too short: the run after b
    assert s.reserve(2, "d") == [0, 1]
    s.drop("b")
    s.drop("d")
    s.drop("c")
    s.reserve(1, "e")  # [0]
    s.reserve(1, "f")  # [1]
    s.drop("e")
    assert s.reserve(7, "g") == [0, 2, 3, 4, 5, 6, 7]  # no run of 7: fragmented, 2 runs


def test_layouts_must_agree():
    a = KVPageLayout.of_cache(cache())
    assert a == KVPageLayout(LAYERS, PAGE, HEADS, DIM, torch.float32)
    with pytest.raises(TransferError) as e:
        a.check(KVPageLayout(LAYERS, PAGE, HEADS, DIM, torch.bfloat16))
    assert e.value.code == "FAILED_PRECONDITION"


def test_landed_pages_are_checked_in_a_cpu_cache_only():
    """A cache on another device is refused by name (its bytes would be a host copy that
    an in-place decrypt could not reach), not checked wrongly."""
    meta = KVCache(LAYERS, PAGES, PAGE, HEADS, DIM, torch.float32, "meta")
    keys = KVKeys.derive(RowProtection.new("encrypt"), 1, 1, 0, 1)
    with pytest.raises(ValueError, match="CPU cache"):
        keys.open_pages(meta, [0], bytes(16))


def test_retired_slots_go_to_no_one_until_their_deadline_then_come_back_wiped():
    """A transfer cut before every chunk was reported may still have writes on the way:
    its slots are retired, reused by no other owner before the deadline, and wiped when
    they come back (at the next reserve past it)."""
    area = KVStaging(KVPageLayout.of_cache(cache()), 4)
    assert area.reserve(2, "cut") == [0, 1]
    area.retire("cut", 3600.0)
    assert area.num_retired == 2 and area.num_free == 2
    assert area.reserve(2, "next") == [2, 3]  # not the retired ones
    assert area.reserve(1, "more") is None
    area.rows[2:4].fill_(7.0)  # a late write into a transfer retired with no wait left
    area.retire("next", 0.0)
    assert area.reserve(2, "again") == [2, 3]
    assert not area.rows[2:4].any()
    assert area.num_retired == 2  # the hour-long one holds


class _Pool:
    """An executor that runs each job when asked (`run`), so a test sees what is queued."""

    def __init__(self) -> None:
        self.jobs: list = []

    def submit(self, fn, *args):
        from concurrent.futures import Future
        f = Future()
        self.jobs.append((f, fn, args))
        return f

    def run(self) -> None:
        for f, fn, args in self.jobs:
            if f.set_running_or_notify_cancel():
                f.set_result(fn(*args))
        self.jobs = []


def _tagger(src, secret, room, tokens, pool, chunk_pages):
    from tandem.transfer.kv import KVTagger
    return KVTagger(src, secret, room, 1, tokens, PAGE, pool, chunk_pages)


@pytest.mark.parametrize("mode", ["mac", "encrypt"])
def test_tags_taken_ahead_as_the_prefill_completes_pages_are_the_transfers(wire, mode,
                                                                          monkeypatch):
    """A chunk is tagged once every position of its pages is computed (not before), the
    transfer then takes no tag itself, and the decode side's checks pass."""
    engine, outbox, inbox = wire
    src, dst = cache(21), cache()
    pages = [3, 8, 1, 14, 6]
    secret, pool = RowProtection.new(mode), _Pool()
    tokens = 5 * PAGE - 1  # the last page part full
    tagger = _tagger(src, secret, 5, tokens, pool, 2)  # chunks [0, 2) [2, 4) [4, 5)
    tagger.progress(pages[:2], 2 * PAGE - 1, 0)  # page 1 not complete: nothing yet
    assert pool.jobs == []
    tagger.progress(pages[:4], 3 * PAGE, 0)  # chunk 0 complete, chunk 1 not
    assert len(pool.jobs) == 1
    tagger.progress(pages, tokens, 0)  # the prompt computed: the rest
    assert len(pool.jobs) == 3
    pool.run()
    taken = []
    real = KVKeys.tag
    monkeypatch.setattr(KVKeys, "tag", lambda *a: taken.append(a) or real(*a))
    slots = inbox.reserve(5, "ahead")
    sent = send_pages(engine, src, pages, outbox, to(engine, inbox, slots, 5, secret),
                      chunk_pages=2, tags=tagger)
    assert taken == []  # every tag came from the tagger
    land_and_check(inbox, "ahead", dst, [0, 1, 2, 3, 4], sent, secret, 5)
    assert same_pages(src, pages, dst, [0, 1, 2, 3, 4])


def test_a_tag_taken_ahead_is_used_only_for_the_pages_and_keys_it_was_taken_over(wire):
    """A retraction (a new epoch) drops the tags taken before; tags over other pages or
    for another room are not used (the transfer tags those chunks itself); and a page
    changed after its tag was taken ahead fails the decode side's check, never passes."""
    engine, outbox, inbox = wire
    src = cache(22)
    secret, pool = RowProtection.new("mac"), _Pool()
    tagger = _tagger(src, secret, 6, 4 * PAGE, pool, 2)
    tagger.progress([0, 1, 2, 3], 4 * PAGE, 0)
    tagger.progress([0, 1, 9, 10], 2 * PAGE, 1)  # retracted, then chunk 0 again
    pool.run()
    assert tagger.get(0, 2, [0, 1]) is not None and tagger.get(2, 4, [2, 3]) is None
    assert tagger.get(0, 2, [0, 5]) is None  # not the pages it was taken over
    other = _tagger(src, secret, 7, 4 * PAGE, pool, 2)  # room 7's tags
    other.progress([0, 1, 2, 3], 4 * PAGE, 0)
    pool.run()
    slots = inbox.reserve(4, "other")
    sent = send_pages(engine, src, [0, 1, 2, 3], outbox, to(engine, inbox, slots, 6, secret),
                      chunk_pages=2, tags=other)  # not room 6's: taken here
    land_and_check(inbox, "other", cache(), [0, 1, 2, 3], sent, secret, 6)
    # the invariant broken (a page written after its tag was taken ahead): DATA_LOSS
    late = _tagger(src, secret, 8, 4 * PAGE, pool, 2)
    late.progress([0, 1, 2, 3], 4 * PAGE, 0)
    pool.run()
    src.k[3][1, 0, 0, 0] += 1.0
    slots = inbox.reserve(4, "late")
    sent = send_pages(engine, src, [0, 1, 2, 3], outbox, to(engine, inbox, slots, 8, secret),
                      chunk_pages=2, tags=late)
    with pytest.raises(TransferError) as e:
        land_and_check(inbox, "late", cache(), [0, 1, 2, 3], sent, secret, 8)
    assert e.value.code == "DATA_LOSS"
    inbox.drop("late")  # the failed check's caller frees the rest
    assert inbox.num_free == 8 and not inbox.rows.any()


@pytest.mark.parametrize("mode", ["mac", "encrypt"])
def test_a_write_into_the_outbox_after_a_tag_taken_ahead_is_data_loss(wire, mode):
    engine, outbox, inbox = wire
    src, dst = cache(23), cache()
    secret, pool = RowProtection.new(mode), _Pool()
    tagger = _tagger(src, secret, 9, 3 * PAGE, pool, 64)
    tagger.progress([0, 1, 2], 3 * PAGE, 0)
    pool.run()
    slots = inbox.reserve(3, "room-9")
    sent = send_pages(_OutboxWriter(engine, outbox), src, [0, 1, 2], outbox,
                      to(engine, inbox, slots, 9, secret), tags=tagger,
                      on_written=lambda s: None)
    assert outbox.num_free == 8 and not outbox.rows.any()
    with pytest.raises(TransferError) as e:
        land_and_check(inbox, "room-9", dst, [4, 5, 6], sent, secret, 9)
    assert e.value.code == "DATA_LOSS"


def test_the_outbox_is_wiped_after_every_write_ended_and_the_report_of_it(wire):
    """With `on_written` the sender's slots stay held (read by no write any more) until
    the transfer is reported complete, then all are wiped and freed; also when the report
    fails."""
    engine, outbox, inbox = wire
    src = cache(24)
    secret = RowProtection.new("mac")
    seen = []

    def on_written(sent):
        seen.append((outbox.num_free, bool(outbox.rows.any()), len(sent.chunks)))

    slots = inbox.reserve(5, "w")
    send_pages(engine, src, [0, 1, 2, 3, 4], outbox, to(engine, inbox, slots, 1, secret),
               chunk_pages=2, on_written=on_written)
    assert seen == [(3, True, 3)]  # every chunk written, none wiped yet
    assert outbox.num_free == 8 and not outbox.rows.any()

    def broken(sent):
        raise RuntimeError("the stream is gone")

    with pytest.raises(RuntimeError):
        send_pages(engine, src, [0, 1, 2], outbox, to(engine, inbox, [5, 6, 7], 2, secret),
                   on_written=broken)
    assert outbox.num_free == 8 and not outbox.rows.any()
    inbox.drop("w")


def test_landed_slots_wiped_later_are_no_ones_until_then_and_come_back_as_zeros():
    """`land(wipe=False)`: the slots stay the owner's (no reserve gets them, landing them
    again fails) until `sweep`, `drop` or `retire`; a slot that comes back free is zeros."""
    area = KVStaging(KVPageLayout.of_cache(cache()), 4)
    assert area.reserve(3, "a") == [0, 1, 2]
    area.rows[:3].fill_(3.0)
    dst = cache()
    area.land("a", dst, [5, 6], first=0, wipe=False)
    assert area.held("a") == [2] and area.landed("a") == [0, 1] and area.holds("a")
    assert area.num_free == 1 and area.rows[:2].all()  # not wiped yet, not free
    assert area.reserve(2, "b") is None
    with pytest.raises(KeyError):
        area.reserve(1, "a")  # still its
    with pytest.raises(KeyError):
        area.land("a", dst, [5], first=0, wipe=False)  # landed already
    area.land("a", dst, [7], first=2, wipe=False)
    assert area.held("a") == [] and area.landed("a") == [0, 1, 2] and area.holds("a")
    assert bool((dst.k[0][[5, 6, 7]] == 3.0).all())
    assert area.sweep("a") == 3
    assert area.num_free == 4 and not area.rows.any() and not area.holds("a")
    assert area.free_slots() == [0, 1, 2, 3]
    assert area.sweep("a") == 0  # nothing left: a drop or a sweep took them
    # a hand-off released before its sweep: drop takes the landed slots too
    area.reserve(2, "c")
    area.rows[:2].fill_(4.0)
    area.land("c", dst, [1], first=0, wipe=False)
    area.drop("c")
    assert area.num_free == 4 and not area.rows.any() and area.sweep("c") == 0
    # retired after a part landed: the landed slot wiped and freed at once (no write is
    # on its way to it), the rest no one's until the deadline, then wiped
    area.reserve(2, "d")
    area.rows[:2].fill_(5.0)
    area.land("d", dst, [1], first=0, wipe=False)
    area.retire("d", 3600.0)
    assert area.num_free == 3 and area.num_retired == 1 and not area.rows[0].any()
    assert area.rows[1].all()  # not landed: retired as it is


def test_a_landing_whose_owner_was_dropped_meanwhile_frees_its_own_slots(monkeypatch):
    """A hand-off released (cancelled) while a chunk is being copied out with
    `wipe=False`: the copy's slots are wiped and freed by the landing, not left to no
    one."""
    import tandem.transfer.kv as kv

    area = KVStaging(KVPageLayout.of_cache(cache()), 4)
    area.reserve(2, "a")
    area.rows[:2].fill_(6.0)

    def dropped_meanwhile(*args):
        area.drop("a")  # the release, on another thread, during the copy
        unpack_into(*args)

    monkeypatch.setattr(kv, "unpack_into", dropped_meanwhile)
    area.land("a", cache(), [0], first=0, wipe=False)
    assert area.num_free == 4 and not area.rows.any() and not area.holds("a")


class _StuckAfter:
    """This process's engine, except that the writes of the `n`th submit never end."""

    def __init__(self, engine, n: int) -> None:
        self._engine, self._n, self._calls = engine, n, 0

    def submit(self, peer, srcs, dsts, lengths):
        self._calls += 1
        if self._calls == self._n:
            return [(-7, sum(lengths))]
        return self._engine.submit(peer, srcs, dsts, lengths)

    def wait(self, peer, started):
        if any(bid == -7 for bid, _ in started):
            e = TransferError("stuck", "UNAVAILABLE")
            e.pending = started
            raise e
        return self._engine.wait(peer, started)

    def drain(self, pending):
        return not any(bid == -7 for bid, _ in pending)


@pytest.mark.parametrize("late", [False, True])
def test_stuck_writes_keep_only_their_own_outbox_slots(wire, late):
    """Writes that never end: their slots stay held for good (a write may still read
    them), and the slots of chunks whose writes ended are wiped and freed, also when the
    wipe waits for the end of the transfer (`on_written`)."""
    from tandem.transfer.errors import TransferStuck

    engine, outbox, inbox = wire
    slots = inbox.reserve(5, "stuck")
    with pytest.raises(TransferStuck):
        send_pages(_StuckAfter(engine, 2), cache(25), [0, 1, 2, 3, 4], outbox,
                   to(engine, inbox, slots, 1, RowProtection.new("mac")), chunk_pages=2,
                   on_written=(lambda s: None) if late else None)
    # chunk 0 written, then wiped and freed; chunk 1 stuck and chunk 2 in flight with it
    # when the transfer gave up (3 slots): held for good
    assert outbox.num_free == 8 - 3 and not outbox.rows[:2].any()
    inbox.drop("stuck")
