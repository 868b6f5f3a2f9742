"""TransferEngine on the CPU twin: malformed requests, lists (`submit_many`), byte ranges and segments (a prefetch
list as one transfer, a callback per segment, failures confined to the segments they hit)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import wait_until
from tests.runtime.conftest import CHUNK, T, class_stats, fail_copy_at, link_stats, req
from tierplan.runtime.device import HostEvent
from tierplan.runtime.errors import ConfigError, TransferError
from tierplan.runtime.nvme import DirectFile
from tierplan.runtime.transfer import (
    ClassStats,
    Link,
    LinkStats,
    TrafficClass,
    TransferEngine,
    TransferRequest,
)


# ---- malformed requests ------------------------------------------------------------------------------
def _malformed(a: torch.Tensor, f: DirectFile) -> list[TransferRequest]:
    meta = torch.empty(8192, dtype=torch.uint8, device="meta")
    return [
        req(Link.H2D, a, torch.empty(8191, dtype=torch.uint8)),  # size mismatch
        req(Link.DISK2H, f.region(0, 4096), a),  # size mismatch, file side
        req(Link.H2D, a[:0], a[:0]),  # zero bytes
        req(Link.H2D, f.region(0, 8192), a),  # file where host memory belongs
        req(Link.DISK2H, a, f.region(0, 8192)),  # link direction reversed
        req(Link.H2DISK, a, torch.empty_like(a)),  # tensor where the file belongs
        req(Link.D2H, meta, a),  # wrong device
        req(Link.H2D, a, meta),
        req(Link.H2D, a.view(64, 128).t(), torch.empty_like(a)),  # non-contiguous src
        req(Link.D2H, a[:4096], torch.empty(8192, dtype=torch.uint8)[::2]),  # non-contiguous dst
    ]


def test_malformed_requests_raise_and_queue_nothing(cpu, rand, tmp_path):
    eng = TransferEngine(cpu)
    with DirectFile(tmp_path / "m.tpnvme", 8192) as f:
        for r in _malformed(rand(8192), f):
            with pytest.raises(ConfigError):
                eng.submit(r)
            assert all(eng.pending_chunks(lk) == 0 for lk in Link)
        eng.close()  # would drain and count anything that had been queued
    assert all(ClassStats(**s) == ClassStats() for s in eng.stats()["classes"].values())
    assert all(LinkStats(**s) == LinkStats() for s in eng.stats()["links"].values())


def test_submit_many_queues_a_list_in_order_and_refuses_a_bad_list_whole(engine, gate, rand):
    """A prefetch list in one call: copies exact, issued in list order at equal priority; a list with one
    malformed request, or requests on two links, queues none of them."""
    hold = gate()
    blocker = rand(4096)
    h0 = engine.submit(req(Link.H2D, blocker, torch.empty_like(blocker), after=hold))
    wait_until(lambda: h0.start_s is not None, T, "worker held")
    done: list[int] = []
    srcs = [rand(4096 * (i + 1)) for i in range(5)]
    dsts = [torch.empty_like(s) for s in srcs]
    handles = engine.submit_many([req(Link.H2D, s, d, on_done=lambda _h, i=i: done.append(i))
                                  for i, (s, d) in enumerate(zip(srcs, dsts, strict=True))])
    good = req(Link.H2D, rand(4096), torch.empty(4096, dtype=torch.uint8))
    for bad, match in (([good, req(Link.H2D, rand(4096), torch.empty(8, dtype=torch.uint8))], "src has 4096"),
                       ([good, req(Link.D2H, rand(4096), torch.empty(4096, dtype=torch.uint8))], "one link")):
        with pytest.raises(ConfigError, match=match):
            engine.submit_many(bad)
        assert engine.pending_chunks(Link.H2D) == 5
    assert engine.submit_many([]) == []
    hold.set()
    for h in handles:
        h.wait(T)
    assert done == [0, 1, 2, 3, 4]
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts, strict=True))


@pytest.mark.parametrize("link", [Link.H2D, Link.D2H])
def test_byte_ranges_copy_exactly_into_place_and_bad_ranges_are_refused(engine, rand, link):
    """num_bytes with offsets moves a range of one buffer into a range of another (chunked when large); every
    byte outside the destination range is untouched. Ranges that do not fit, or offsets without num_bytes,
    are refused before anything is queued."""
    src, dst = rand(5 * CHUNK + 777), rand(6 * CHUNK)
    before = dst.clone()
    n, s_off, d_off = 4 * CHUNK + 123, 333, CHUNK + 4096
    h = engine.submit(req(link, src, dst, num_bytes=n, src_offset_bytes=s_off, dst_offset_bytes=d_off))
    assert h.wait(T).ok and h.num_bytes == n
    assert torch.equal(dst[d_off : d_off + n], src[s_off : s_off + n])
    assert torch.equal(dst[:d_off], before[:d_off]) and torch.equal(dst[d_off + n :], before[d_off + n :])
    for kw, match in ((dict(num_bytes=n, src_offset_bytes=CHUNK + 800), "src bytes"),
                      (dict(num_bytes=n, dst_offset_bytes=-1), "dst bytes"),
                      (dict(num_bytes=0), "num_bytes > 0"), (dict(src_offset_bytes=4), "offsets need num_bytes")):
        with pytest.raises(ConfigError, match=match):
            engine.submit(req(link, src, dst, **kw))
        assert engine.pending_chunks(link) == 0


@pytest.mark.parametrize("link", [Link.H2D, Link.D2H])
def test_segments_move_a_list_as_one_transfer_with_a_callback_each(engine, rand, link):
    """A list of (src, dst, bytes) segments, some chunked: each lands exactly, nothing else in dst changes, and
    each segment reports issued, then done, exactly once, in list order, before the transfer's on_done."""
    src, dst = rand(9 * CHUNK), rand(10 * CHUNK)
    before = dst.clone()
    segs = [(5 * CHUNK, 0, 3 * CHUNK + 5), (0, 4 * CHUNK, 4097), (4096, 6 * CHUNK, 2 * CHUNK)]
    log: list[tuple[str, int]] = []
    h = engine.submit(req(link, src, dst, segments=segs, on_segment_issued=lambda i, ev: log.append(("issued", i)),
                          on_segment_done=lambda i, err: log.append(("done", i) if err is None else ("failed", i)),
                          on_done=lambda h: log.append(("all", -1))))
    assert h.wait(T).ok and h.num_bytes == sum(n for *_x, n in segs)
    mask = torch.ones_like(dst, dtype=torch.bool)
    for s_off, d_off, n in segs:
        assert torch.equal(dst[d_off : d_off + n], src[s_off : s_off + n])
        mask[d_off : d_off + n] = False
    assert torch.equal(dst[mask], before[mask])
    assert [e for e in log if e[0] == "done"] == [("done", 0), ("done", 1), ("done", 2)] and log[-1] == ("all", -1)
    assert [e for e in log if e[0] == "issued"] == [("issued", 0), ("issued", 1), ("issued", 2)]
    for i in range(3):
        assert log.index(("issued", i)) < log.index(("done", i))
    assert class_stats(engine, TrafficClass.EXPERT).transfers == 1 and link_stats(engine, link).chunks == 3 + 1 + 2


def test_a_failing_segment_hook_fails_that_segment_only(engine, rand):
    """before_segment raising for segment 1: its bytes never move and it reports the error; segments 0 and 2
    land; wait() raises naming the segment; the class counts one failed transfer and only the moved bytes."""
    src, dst = rand(3 * CHUNK), rand(3 * CHUNK)
    before = dst.clone()
    segs = [(0, 0, CHUNK), (CHUNK, CHUNK, CHUNK), (2 * CHUNK, 2 * CHUNK, CHUNK)]
    boom = RuntimeError("map failed (injected)")
    hooked: list[int] = []
    done: dict[int, BaseException | None] = {}

    def hook(i: int) -> None:
        hooked.append(i)
        if i == 1:
            raise boom

    h = engine.submit(req(Link.H2D, src, dst, segments=segs, before_segment=hook,
                          on_segment_done=lambda i, err: done.__setitem__(i, err)))
    with pytest.raises(TransferError, match=r"segments \[1\] failed; segment 1: map failed") as ei:
        h.wait(T)
    assert ei.value.__cause__ is boom and not h.ok and h.error is None and h.segment_errors == {1: boom}
    assert hooked == [0, 1, 2] and done == {0: None, 1: boom, 2: None}
    assert torch.equal(dst[CHUNK : 2 * CHUNK], before[CHUNK : 2 * CHUNK])
    assert torch.equal(dst[:CHUNK], src[:CHUNK]) and torch.equal(dst[2 * CHUNK :], src[2 * CHUNK :])
    cs = class_stats(engine, TrafficClass.EXPERT)
    assert cs.failures == 1 and cs.bytes == 2 * CHUNK and link_stats(engine, Link.H2D).bytes == 2 * CHUNK


def test_a_failing_first_segment_keeps_the_transfers_after_and_before_issue(engine, rand):
    """Regression (review): a failing hook on segment 0 used the transfer's "first chunk" turn, so `after` and
    `before_issue` were skipped for every other segment, which then read src before `after`'s work ended."""
    src, dst = rand(2 * CHUNK), rand(2 * CHUNK)
    before = dst.clone()
    after, prologue = HostEvent(), []

    def hook(i: int) -> None:
        if i == 0:
            raise RuntimeError("map failed (injected)")

    h = engine.submit(req(Link.H2D, src, dst, segments=[(0, 0, CHUNK), (CHUNK, CHUNK, CHUNK)], after=after,
                          before_issue=lambda: prologue.append(1), before_segment=hook))
    with pytest.raises(TimeoutError):
        h.wait(0.2)
    assert torch.equal(dst, before)  # nothing moved before `after`
    after.set()
    with pytest.raises(TransferError, match=r"segments \[0\] failed"):
        h.wait(T)
    assert prologue == [1] and torch.equal(dst[CHUNK:], src[CHUNK:]) and torch.equal(dst[:CHUNK], before[:CHUNK])


def test_a_failed_copy_fails_only_the_segments_it_did_not_move(engine, rand, monkeypatch: pytest.MonkeyPatch):
    """Regression (review): a copy failing in segment 1 made segment 0, already moved, report that error too
    (and its loaded expert was then evicted). Segment 1 reports it, segment 2 (skipped) too; 0 is fine."""
    src, dst = rand(3 * CHUNK), rand(3 * CHUNK)
    boom = RuntimeError("copy failed (injected)")
    fail_copy_at(monkeypatch, engine.device, 2, boom)
    done: dict[int, BaseException | None] = {}
    h = engine.submit(req(Link.H2D, src, dst, segments=[(i * CHUNK, i * CHUNK, CHUNK) for i in range(3)],
                          on_segment_done=lambda i, err: done.__setitem__(i, err)))
    with pytest.raises(TransferError, match="copy failed"):
        h.wait(T)
    assert done == {0: None, 1: boom, 2: boom} and torch.equal(dst[:CHUNK], src[:CHUNK])


def test_bad_segments_are_refused_and_queue_nothing(engine, cpu, rand, tmp_path):
    src, dst = rand(4 * CHUNK), rand(4 * CHUNK)
    for kw, match in ((dict(segments=[]), "segments is empty"),
                      (dict(segments=[(0, 0, 10)], num_bytes=10), "segments replace num_bytes"),
                      (dict(segments=[(0, 0, 10), (0, 4 * CHUNK - 5, 10)]), "segment 1: src bytes"),
                      (dict(segments=[(0, 0, 0)]), "segment 0: .*num_bytes > 0"),
                      (dict(segments=[(0, 0, 10.0)]), "integer triples"),
                      (dict(segments=[(0, 10)]), "integer triples")):
        with pytest.raises(ConfigError, match=match):
            engine.submit(req(Link.H2D, src, dst, **kw))
        assert engine.pending_chunks(Link.H2D) == 0
    with DirectFile(tmp_path / "d.tpnvme", 4 * CHUNK) as f:
        with pytest.raises(ConfigError, match="only ordered on memory links"):
            engine.submit(req(Link.DISK2H, f.region(0, 4 * CHUNK), cpu.alloc_host(4 * CHUNK).tensor,
                              segments=[(0, 0, 4096)], before_segment=lambda i: None))
        assert engine.pending_chunks(Link.DISK2H) == 0


def test_a_queued_transfer_cuts_its_segments_into_the_chunks_chunk_spans_gives_in_order() -> None:
    """Submission only counts chunks (`_num_chunks`); the worker cuts them one at a time (`_Queued.take`): the
    same chunks, offsets and first/last flags as cutting every segment up front."""
    from tierplan.runtime.transfer_handle import _chunk_spans, _num_chunks, _Queued

    mib = 1 << 20
    for cb in (None, 2 * mib, 8 * mib):
        for n in (1, 4096, 2 * mib - 1, 2 * mib, 4 * mib - 4096, 4 * mib, 9 * mib, 16 * mib, 16 * mib + 7,
                  1 << 30):
            assert _num_chunks(n, cb) == len(_chunk_spans(n, cb)), (n, cb)
    segs = [(0, 100, 9 * mib), (1 << 30, 0, 2 * mib), (5, 7, 40 * mib + 4096), (3, 3, 17 * mib)]
    cb = 8 * mib
    want = [(s, src + off, dst + off, length, j == 0, j == len(spans) - 1)
            for s, (src, dst, n) in enumerate(segs) for spans in [_chunk_spans(n, cb)]
            for j, (off, length) in enumerate(spans)]
    q = _Queued((0, float("inf"), 0), None, segs, cb, len(want))  # type: ignore[arg-type]
    got = []
    while q.left:
        ch = q.take()
        got.append((ch.seg, ch.src_offset_bytes, ch.dst_offset_bytes, ch.length_bytes, ch.first, ch.last))
    assert got == want


def test_a_queued_list_moves_the_segments_it_was_submitted_with(engine, gate, rand) -> None:
    """The engine keeps its own copy of a list's segments (numpy integers taken as ints): a caller that reuses or
    edits its list while the transfer waits in the queue changes nothing that moves."""
    import numpy as np

    hold = gate()
    blocker = rand(4096)
    h0 = engine.submit(req(Link.H2D, blocker, torch.empty_like(blocker), after=hold))
    wait_until(lambda: h0.start_s is not None, T, "worker held")
    src, dst = rand(3 * CHUNK), rand(3 * CHUNK)
    before = dst.clone()
    segs = [(0, 0, 4096), (np.int64(4096), np.int32(CHUNK), np.int64(CHUNK + 5))]
    h = engine.submit(req(Link.H2D, src, dst, segments=segs))
    segs[1] = (0, 2 * CHUNK, 4096)  # edited after submit: must not matter
    segs.pop(0)
    hold.set()
    assert h.wait(T).ok and h.num_bytes == CHUNK + 4101 and type(h.num_bytes) is int
    assert torch.equal(dst[:4096], src[:4096]) and torch.equal(dst[CHUNK : 2 * CHUNK + 5], src[4096 : CHUNK + 4101])
    assert torch.equal(dst[4096:CHUNK], before[4096:CHUNK])
    assert torch.equal(dst[2 * CHUNK + 5 :], before[2 * CHUNK + 5 :])


def test_segment_groups_end_at_the_part_or_byte_bound() -> None:
    from tierplan.runtime.transfer_handle import segment_groups

    segs = [(0, 0, 4096)] * 10
    assert segment_groups(segs, 1 << 20, 4) == [4, 8, 10]
    assert segment_groups(segs, 3 * 4096, 64) == [3, 6, 9, 10]
    assert segment_groups([(0, 0, 1 << 20), (0, 0, 1), (0, 0, 1 << 20)], 1 << 20, 64) == [1, 2, 3]
    assert segment_groups([(0, 0, 5)], 1, 64) == [1]  # one segment a group at least


@pytest.mark.parametrize("link", [Link.H2D, Link.D2H])
def test_a_list_of_small_segments_without_hooks_goes_in_groups(engine, rand, link):
    """A KV-style list (small segments, no per-segment hook) is issued as groups of whole segments, one chunk
    each (MAX_GROUP_PARTS segments at most): every segment lands exactly and reports done once, in list order;
    the same list with an on_segment_issued hook goes a chunk a segment."""
    from tierplan.runtime.transfer import MAX_GROUP_PARTS

    n = MAX_GROUP_PARTS + 6
    src, dst = rand(n * 4096), rand(2 * n * 4096)
    before = dst.clone()
    segs = [(i * 4096, (2 * n - 1 - 2 * i) * 4096, 4096) for i in range(n)]  # scattered, out of order
    done: list[tuple[int, BaseException | None]] = []
    h = engine.submit(req(link, src, dst, traffic=TrafficClass.KV, segments=segs,
                          on_segment_done=lambda i, err: done.append((i, err))))
    assert h.wait(T).ok and done == [(i, None) for i in range(n)]
    mask = torch.ones_like(dst, dtype=torch.bool)
    for s_off, d_off, k in segs:
        assert torch.equal(dst[d_off : d_off + k], src[s_off : s_off + k])
        mask[d_off : d_off + k] = False
    assert torch.equal(dst[mask], before[mask])
    ls = link_stats(engine, link)
    assert (ls.chunks, ls.bytes) == (2, n * 4096)
    engine.submit(req(link, src, dst, traffic=TrafficClass.KV, segments=segs,
                      on_segment_issued=lambda i, ev: None)).wait(T)
    assert link_stats(engine, link).chunks == 2 + n
    engine.submit(req(link, src, dst, segments=segs)).wait(T)  # an expert list: each segment done as it lands
    assert link_stats(engine, link).chunks == 2 + 2 * n


def test_a_copy_failing_mid_group_lands_the_parts_before_it_and_fails_the_rest(
        engine, rand, monkeypatch: pytest.MonkeyPatch):
    """Part 3 of a group fails its copy: segments 0-2 land and report done, 3 and every later one (the rest of
    its group, the next group skipped) report the copy's error and leave dst as it was; only landed bytes count."""
    from tierplan.runtime.transfer import MAX_GROUP_PARTS

    n = MAX_GROUP_PARTS + 6
    src, dst = rand(n * 4096), rand(n * 4096)
    before = dst.clone()
    boom = RuntimeError("copy failed (injected)")
    calls = fail_copy_at(monkeypatch, engine.device, 4, boom)
    done: dict[int, BaseException | None] = {}
    h = engine.submit(req(Link.D2H, src, dst, traffic=TrafficClass.KV,
                          segments=[(i * 4096, i * 4096, 4096) for i in range(n)],
                          on_segment_done=lambda i, err: done.__setitem__(i, err)))
    with pytest.raises(TransferError, match="copy failed"):
        h.wait(T)
    assert done == {i: (None if i < 3 else boom) for i in range(n)} and len(calls) == 4
    assert torch.equal(dst[: 3 * 4096], src[: 3 * 4096]) and torch.equal(dst[3 * 4096 :], before[3 * 4096 :])
    assert link_stats(engine, Link.D2H).bytes == 3 * 4096 and class_stats(engine, TrafficClass.KV).failures == 1
