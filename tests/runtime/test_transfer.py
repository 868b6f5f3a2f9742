"""TransferEngine on the CPU twin: bit-exact copies on every link, chunking, priorities, deadlines, failures.

Ordering is asserted through `on_done` callbacks and gates (unsignalled `HostEvent`s passed as `after`, which
hold a link's worker), never through wall-clock durations; time-based accounting uses a fake clock.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from runtime.device import Device, HostEvent, completed_event
from runtime.errors import AlignmentError, ConfigError, TransferError
from runtime.nvme import DirectFile
from runtime.transfer import (
    ClassStats,
    Link,
    LinkStats,
    Priority,
    TrafficClass,
    TransferEngine,
    TransferRequest,
)
from tests.conftest import FakeClock, host_copy, start_thread, wait_until

MiB = 1 << 20
CHUNK = 2 * MiB
T = 10.0  # bound on every wait: a hang fails the test instead of freezing the suite


@pytest.fixture(params=[False, True], ids=["inline-retire", "retire-thread"])
def retire_thread(request: pytest.FixtureRequest) -> bool:
    """Finished chunks accounted on the link's worker, or in order on the link's retire thread."""
    return request.param


@pytest.fixture
def engine(cpu: Device, retire_thread: bool) -> Iterator[TransferEngine]:
    eng = TransferEngine(cpu, chunk_bytes=CHUNK, retire_thread=retire_thread)
    yield eng
    eng.close()


@pytest.fixture
def gate(engine: TransferEngine) -> Iterator[Callable[[], HostEvent]]:
    """Unsignalled events that hold a worker; all set at teardown (before the engine closes), so no hang."""
    made: list[HostEvent] = []

    def make() -> HostEvent:
        made.append(HostEvent())
        return made[-1]

    yield make
    for ev in made:
        ev.set()


def class_stats(eng: TransferEngine, tc: TrafficClass) -> ClassStats:
    return ClassStats(**eng.stats()["classes"][tc.value])


def link_stats(eng: TransferEngine, link: Link) -> LinkStats:
    return LinkStats(**eng.stats()["links"][link.value])


def req(link: Link, src, dst, **kw) -> TransferRequest:
    return TransferRequest(link, kw.pop("traffic", TrafficClass.EXPERT), src, dst, **kw)


# ---- bit-exact copies ------------------------------------------------------------------------------
@pytest.mark.parametrize("link", [Link.H2D, Link.D2H])
@pytest.mark.parametrize("num_bytes", [1, 4097, 3 * MiB + 5, 9 * MiB])
def test_memory_links_copy_bit_exact(engine, rand, link, num_bytes):
    src = rand(num_bytes)
    dst = rand(num_bytes)  # random, not zeros: an untouched byte would show
    h = engine.submit(req(link, src, dst))
    assert h.wait(T) is h and h.ok and h.done()
    assert torch.equal(dst, src)
    assert h.num_bytes == num_bytes


def test_copy_between_dtypes_is_bytewise(engine, rand):
    src = rand(4 * 1000).view(torch.float32)  # [1000] random bit patterns, NaNs included
    dst = torch.empty(2000, dtype=torch.int16)
    engine.submit(req(Link.H2D, src, dst)).wait(T)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


@pytest.mark.parametrize("num_bytes", [4096, 9 * MiB])
def test_disk_links_round_trip_bit_exact(engine, cpu, rand, tmp_path, num_bytes):
    with DirectFile(tmp_path / "x.tpnvme", 16 * MiB) as f:
        assert f.direct_io
        data = rand(num_bytes)
        region = f.region(4096, num_bytes)
        engine.submit(req(Link.H2DISK, host_copy(cpu, data), region, traffic=TrafficClass.KV)).wait(T)
        on_disk = cpu.alloc_host(num_bytes).tensor
        f.read_into(4096, on_disk)
        assert torch.equal(on_disk, data)
        back = host_copy(cpu, rand(num_bytes))
        engine.submit(req(Link.DISK2H, region, back, traffic=TrafficClass.KV)).wait(T)
        assert torch.equal(back, data)
    assert link_stats(engine, Link.H2DISK).bytes == num_bytes == link_stats(engine, Link.DISK2H).bytes


# ---- chunking --------------------------------------------------------------------------------------
class ChunkRecorder(Device):
    """CPU twin that records each copy's size and skips the bytes (so 1 GiB tensors stay untouched, unbacked)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.sizes: list[int] = []

    def copy(self, dst, src, stream=None, stream_is_current=False):
        self.sizes.append(src.numel())
        return completed_event()


def test_9mib_with_2mib_chunks_is_four_even_chunks(engine, rand):
    # Module docstring: >= 2 x chunk_bytes is cut into even chunks of chunk_bytes..2 x chunk_bytes, so 9 MiB at
    # 2 MiB is 4 x 2.25 MiB (an earlier design cut 2+2+2+2+1 = 5 chunks).
    src = rand(9 * MiB)
    dst = rand(9 * MiB)
    engine.submit(req(Link.H2D, src, dst)).wait(T)
    assert torch.equal(dst, src)
    assert link_stats(engine, Link.H2D) == LinkStats(bytes=9 * MiB, chunks=4, transfers=1)
    cs = class_stats(engine, TrafficClass.EXPERT)
    assert (cs.transfers, cs.bytes, cs.failures) == (1, 9 * MiB, 0)
    assert class_stats(engine, TrafficClass.KV) == ClassStats()


@pytest.mark.parametrize(
    "num_bytes",
    [CHUNK, 2 * CHUNK - 4096, 2 * CHUNK, 9 * MiB, 64 * CHUNK,
     2 * CHUNK + 1, 512 * CHUNK + 1],
)
def test_chunks_are_page_aligned_and_between_one_and_two_chunk_bytes(num_bytes):
    dev = ChunkRecorder()
    with TransferEngine(dev, chunk_bytes=CHUNK) as eng:
        src, dst = torch.empty(num_bytes, dtype=torch.uint8), torch.empty(num_bytes, dtype=torch.uint8)
        eng.submit(req(Link.H2D, src, dst)).wait(T)
    assert sum(dev.sizes) == num_bytes
    assert link_stats(eng, Link.H2D).chunks == len(dev.sizes)
    if num_bytes < 2 * CHUNK:
        assert dev.sizes == [num_bytes]
    else:
        assert all(s % 4096 == 0 for s in dev.sizes[:-1]), "chunk offsets must stay O_DIRECT aligned"
        assert all(CHUNK <= s <= 2 * CHUNK for s in dev.sizes), (min(dev.sizes), max(dev.sizes))


def test_no_chunking_is_one_chunk(cpu, rand):
    with TransferEngine(cpu, chunk_bytes=None) as eng:
        src = rand(9 * MiB)
        dst = torch.empty_like(src)
        eng.submit(req(Link.D2H, src, dst)).wait(T)
        assert torch.equal(dst, src)
        assert link_stats(eng, Link.D2H) == LinkStats(bytes=9 * MiB, chunks=1, transfers=1)


@pytest.mark.parametrize(
    "kw",
    [{"chunk_bytes": MiB}, {"chunk_bytes": CHUNK + 1}, {"max_inflight_chunks": 0}, {"disk_workers": 0},
     {"max_inflight_bytes": 0}],
)
def test_bad_engine_config_raises(cpu, kw):
    with pytest.raises(ConfigError):
        TransferEngine(cpu, **kw)


# ---- priorities and deadlines ---------------------------------------------------------------------
def test_urgent_small_transfer_overtakes_a_large_low_stream(engine, gate, rand):
    done: list[str] = []
    pending_at_urgent: list[int] = []
    big = rand(32 * CHUNK)
    hold = gate()
    h_big = engine.submit(
        req(Link.H2D, big, torch.empty_like(big), priority=Priority.LOW, after=hold,
            on_done=lambda h: done.append("big"))
    )
    wait_until(lambda: h_big.start_s is not None, T, "worker holding the big stream's first chunk")

    def urgent_done(_h) -> None:
        done.append("urgent")
        pending_at_urgent.append(engine.pending_chunks(Link.H2D))

    small = rand(4096)
    small_dst = torch.empty_like(small)
    h_small = engine.submit(req(Link.H2D, small, small_dst, priority=Priority.URGENT, on_done=urgent_done))
    hold.set()
    h_small.wait(T)
    h_big.wait(T)
    assert done == ["urgent", "big"]
    assert pending_at_urgent[0] > 0, "the urgent transfer finished while the big stream still had chunks queued"
    assert torch.equal(small_dst, small)
    assert torch.equal(h_big.request.dst, big)


def test_urgent_stream_engine_still_overtakes_and_copies_exactly(cpu, rand):
    """urgent_stream=True (URGENT chunks outside the in-flight bound, on their own stream): same guarantees."""
    eng = TransferEngine(cpu, chunk_bytes=CHUNK, max_inflight_bytes=64 * MiB, urgent_stream=True)
    hold = HostEvent()
    try:
        done: list[str] = []
        big = rand(16 * CHUNK)
        h_big = eng.submit(req(Link.H2D, big, torch.empty_like(big), priority=Priority.LOW, after=hold,
                               on_done=lambda h: done.append("big")))
        wait_until(lambda: h_big.start_s is not None, T, "worker holding the big stream's first chunk")
        small = rand(3 * CHUNK)  # a multi-chunk urgent transfer: its chunks stay in order on the urgent path
        small_dst = torch.empty_like(small)
        h_small = eng.submit(req(Link.H2D, small, small_dst, priority=Priority.URGENT, traffic=TrafficClass.KV,
                                 on_done=lambda h: done.append("urgent")))
        hold.set()
        h_small.wait(T)
        h_big.wait(T)
        assert done == ["urgent", "big"] and torch.equal(small_dst, small) and torch.equal(h_big.request.dst, big)
        assert class_stats(eng, TrafficClass.KV).bytes == small.numel()
    finally:
        hold.set()
        eng.close()


def test_same_priority_pops_earliest_deadline_first(engine, gate, rand):
    done: list[str] = []
    hold = gate()
    blocker = rand(4096)
    h0 = engine.submit(req(Link.H2D, blocker, torch.empty_like(blocker), after=hold))
    wait_until(lambda: h0.start_s is not None, T, "worker held")
    handles = []
    for name, deadline in [("none", None), ("d30", 30.0), ("d10", 10.0), ("d20", 20.0)]:
        src = rand(4096)
        handles.append(engine.submit(req(Link.H2D, src, torch.empty_like(src), deadline_s=deadline,
                                         on_done=lambda _h, n=name: done.append(n))))
    hi = rand(4096)
    handles.append(engine.submit(req(Link.H2D, hi, torch.empty_like(hi), priority=Priority.HIGH,
                                     deadline_s=99.0, on_done=lambda _h: done.append("high"))))
    hold.set()
    for h in handles:
        h.wait(T)
    assert done == ["high", "d10", "d20", "d30", "none"]


def test_deadline_misses_and_delays_on_a_fake_clock(cpu, rand):
    clock = FakeClock()
    hold = HostEvent()
    eng = TransferEngine(cpu, chunk_bytes=CHUNK, clock=clock)
    try:
        blocker = rand(4096)
        hb = eng.submit(req(Link.H2D, blocker, torch.empty_like(blocker), traffic=TrafficClass.KV, after=hold))
        wait_until(lambda: hb.start_s is not None, T, "worker held")
        clock.now_s = 1.0
        hs = []
        for deadline in (5.0, 10.0, 100.0, None):  # 10.0 == end time: on time, not a miss
            src = rand(4096)
            hs.append(eng.submit(req(Link.H2D, src, torch.empty_like(src), deadline_s=deadline)))
        clock.now_s = 10.0
        hold.set()
        for h in hs:
            h.wait(T)
            assert (h.queue_delay_s, h.latency_s) == (9.0, 9.0)
        cs = class_stats(eng, TrafficClass.EXPERT)
        assert cs == ClassStats(transfers=4, bytes=4 * 4096, queue_delay_s_sum=36.0, queue_delay_s_max=9.0,
                                latency_s_sum=36.0, latency_s_max=9.0, deadline_misses=1, failures=0)
        kv = class_stats(eng, TrafficClass.KV)
        assert (kv.queue_delay_s_max, kv.latency_s_max, kv.deadline_misses) == (0.0, 10.0, 0)
    finally:
        hold.set()
        eng.close()


def test_wait_times_out_while_held_then_completes(engine, gate, rand):
    hold = gate()
    src = rand(4096)
    h = engine.submit(req(Link.D2H, src, torch.empty_like(src), after=hold))
    with pytest.raises(TimeoutError):
        h.wait(0.01)
    assert not h.done() and not h.ok
    hold.set()
    assert h.wait(T).ok


# ---- failures --------------------------------------------------------------------------------------
def _assert_failed(eng: TransferEngine, h, cause: type[BaseException]) -> None:
    with pytest.raises(TransferError) as ei:
        h.wait(T)
    assert isinstance(ei.value.__cause__, cause)
    assert h.done() and not h.ok and isinstance(h.error, cause)


def test_read_from_closed_file_fails_cleanly_and_engine_keeps_working(engine, cpu, rand, tmp_path):
    f = DirectFile(tmp_path / "gone.tpnvme", 8 * MiB)
    f.close()
    dst = cpu.alloc_host(6 * MiB).tensor
    h = engine.submit(req(Link.DISK2H, f.region(0, 6 * MiB), dst, traffic=TrafficClass.KV))
    _assert_failed(engine, h, Exception)  # the closed file's refusal, chained
    kv = class_stats(engine, TrafficClass.KV)
    assert (kv.transfers, kv.failures, kv.bytes) == (1, 1, 0)
    assert link_stats(engine, Link.DISK2H) == LinkStats(bytes=0, chunks=3, transfers=1)
    with DirectFile(tmp_path / "ok.tpnvme", 8 * MiB) as g:  # same link, after the failure
        data = rand(6 * MiB)
        g.write_from(0, host_copy(cpu, data))
        engine.submit(req(Link.DISK2H, g.region(0, 6 * MiB), dst, traffic=TrafficClass.KV)).wait(T)
        assert torch.equal(dst, data)
    kv = class_stats(engine, TrafficClass.KV)
    assert (kv.transfers, kv.failures, kv.bytes) == (2, 1, 6 * MiB)


@pytest.mark.parametrize(("link", "cause"), [(Link.DISK2H, ConfigError), (Link.H2DISK, AlignmentError)])
def test_bad_file_io_fails_cleanly(engine, cpu, rand, tmp_path, link, cause):
    with DirectFile(tmp_path / "short.tpnvme", 4096) as f:
        assert f.direct_io
        if link is Link.DISK2H:  # reads past the end of the file
            h = engine.submit(req(link, f.region(0, 8192), cpu.alloc_host(8192).tensor))
        else:  # right length, buffer address off by one
            h = engine.submit(req(link, host_copy(cpu, rand(8192))[1:4097], f.region(0, 4096)))
        _assert_failed(engine, h, cause)
    assert class_stats(engine, TrafficClass.EXPERT).failures == 1


def test_on_done_exception_makes_wait_raise(engine, rand):
    boom = RuntimeError("callback broke")

    def bad(_h) -> None:
        raise boom

    src = rand(4096)
    dst = torch.empty_like(src)
    h = engine.submit(req(Link.H2D, src, dst, on_done=bad))
    with pytest.raises(TransferError) as ei:
        h.wait(T)
    assert ei.value.__cause__ is boom and h.error is boom and not h.ok
    assert class_stats(engine, TrafficClass.EXPERT).failures == 1
    h2 = engine.submit(req(Link.H2D, src, dst))  # the worker survived its callback
    assert h2.wait(T).ok


def test_on_done_sees_the_outcome(engine, cpu, rand, tmp_path):
    # Regression: `ok` used to read the done flag, which is set only after on_done ran (always False there).
    seen: list[tuple[bool, bool]] = []
    src = rand(4096)
    good = engine.submit(req(Link.H2D, src, torch.empty_like(src),
                             on_done=lambda h: seen.append((h.ok, h.end_s is None))))
    f = DirectFile(tmp_path / "closed.tpnvme", 4096)
    f.close()
    bad = engine.submit(req(Link.DISK2H, f.region(0, 4096), cpu.alloc_host(4096).tensor,
                            on_done=lambda h: seen.append((h.ok, h.end_s is None))))
    with pytest.raises(TransferError):
        bad.wait(T)
    good.wait(T)  # another link: its callback may still be running when `bad` is done
    assert sorted(seen) == [(False, False), (True, False)]


def test_before_issue_runs_once_in_the_worker_before_any_byte_moves(engine, rand):
    src, dst = rand(3 * CHUNK), rand(3 * CHUNK)
    dst_before = dst.clone()
    calls: list[tuple[str, bool, int]] = []

    def hook() -> None:  # what the expert loader uses to map a reserved slot
        moved = link_stats(engine, Link.H2D).chunks
        calls.append((threading.current_thread().name, torch.equal(dst, dst_before), moved))

    engine.submit(req(Link.H2D, src, dst, before_issue=hook)).wait(T)
    assert torch.equal(dst, src)
    assert len(calls) == 1
    name, untouched, chunks_done = calls[0]
    assert name.startswith("tierplan-h2d") and untouched and chunks_done == 0


def test_before_issue_failure_fails_the_transfer_and_moves_nothing(engine, rand):
    boom = RuntimeError("map_reserved failed")

    def hook() -> None:
        raise boom

    src, dst = rand(3 * CHUNK), rand(3 * CHUNK)
    dst_before = dst.clone()
    h = engine.submit(req(Link.H2D, src, dst, before_issue=hook))
    _assert_failed(engine, h, RuntimeError)
    assert h.error is boom and torch.equal(dst, dst_before)
    assert link_stats(engine, Link.H2D) == LinkStats(bytes=0, chunks=3, transfers=1)
    assert engine.submit(req(Link.H2D, src, dst)).wait(T).ok


def test_before_issue_is_refused_on_disk_links(engine, cpu, rand, tmp_path):
    """Regression: disk links run parallel workers, so a hook could not precede every chunk; refuse it."""
    with DirectFile(tmp_path / "h.tpnvme", 3 * CHUNK) as f:
        with pytest.raises(ConfigError, match="before_issue"):
            engine.submit(req(Link.DISK2H, f.region(0, 3 * CHUNK), cpu.alloc_host(3 * CHUNK).tensor,
                              before_issue=lambda: None))
        assert engine.pending_chunks(Link.DISK2H) == 0


def test_one_multi_chunk_disk_transfer_keeps_every_disk_worker_busy(engine, gate, cpu, tmp_path):
    with DirectFile(tmp_path / "q.tpnvme", 4 * CHUNK) as f:
        hold = gate()  # `after` is waited per chunk, so each worker that takes a chunk parks on it
        h = engine.submit(req(Link.DISK2H, f.region(0, 4 * CHUNK), cpu.alloc_host(4 * CHUNK).tensor, after=hold))
        try:
            wait_until(lambda: engine.pending_chunks(Link.DISK2H) == 4 - 2, 1.0, "both disk workers holding a chunk")
        finally:
            hold.set()
            h.wait(T)


def test_submit_after_close_raises(cpu, rand):
    eng = TransferEngine(cpu)
    eng.close()
    src = rand(16)
    with pytest.raises(TransferError):
        eng.submit(req(Link.H2D, src, torch.empty_like(src)))


def test_close_finishes_everything_queued(cpu, rand, retire_thread):
    eng = TransferEngine(cpu, chunk_bytes=CHUNK, retire_thread=retire_thread)
    hold = HostEvent()
    hs = []
    for i in range(5):
        src = rand(3 * MiB)
        hs.append(eng.submit(req(Link.H2D, src, torch.empty_like(src), after=hold if i == 0 else None)))
    hold.set()
    eng.close()
    assert all(h.ok and torch.equal(h.request.dst, h.request.src) for h in hs)


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
    dev, calls, boom = engine.device, [], RuntimeError("copy failed (injected)")
    real = dev.copy_range

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise boom
        return real(*a, **kw)

    monkeypatch.setattr(dev, "copy_range", flaky)
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
                      (dict(segments=[(0, 0, 0)]), "segment 0: .*num_bytes > 0")):
        with pytest.raises(ConfigError, match=match):
            engine.submit(req(Link.H2D, src, dst, **kw))
        assert engine.pending_chunks(Link.H2D) == 0
    with DirectFile(tmp_path / "d.tpnvme", 4 * CHUNK) as f:
        with pytest.raises(ConfigError, match="only ordered on memory links"):
            engine.submit(req(Link.DISK2H, f.region(0, 4 * CHUNK), cpu.alloc_host(4 * CHUNK).tensor,
                              segments=[(0, 0, 4096)], before_segment=lambda i: None))
        assert engine.pending_chunks(Link.DISK2H) == 0


# ---- concurrency ------------------------------------------------------------------------------------
def test_four_threads_two_hundred_random_transfers_each(cpu, tmp_path, retire_thread):
    slot = 64 << 10
    num_threads, per_thread = 4, 200
    eng = TransferEngine(cpu, chunk_bytes=CHUNK, disk_workers=2, retire_thread=retire_thread)
    f = DirectFile(tmp_path / "c.tpnvme", num_threads * per_thread * slot)
    totals = {lk: [0] * num_threads for lk in Link}
    gates: list[HostEvent] = []  # set in `finally`, so a failed write cannot leave a read parked forever

    def worker(tid: int) -> None:
        r = random.Random(tid)
        gen = torch.Generator().manual_seed(100 + tid)
        checks: list[tuple[torch.Tensor, torch.Tensor]] = []
        handles = []
        for i in range(per_thread):
            link = r.choice(list(Link))
            big = r.random() < 0.03 and link in (Link.H2D, Link.D2H)
            n = r.randrange(CHUNK + 1, 2 * CHUNK + 7) if big else r.randrange(1, 16) * 4096
            data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
            prio = r.choice(list(Priority))
            tc = r.choice(list(TrafficClass))
            if link in (Link.H2D, Link.D2H):
                dst = torch.empty(n, dtype=torch.uint8)
                handles.append(eng.submit(TransferRequest(link, tc, data, dst, prio)))
                checks.append((dst, data))
                totals[link][tid] += n
            else:  # write a fresh region, then read it back ordered by an event the write's on_done sets
                region = f.region((tid * per_thread + i) * slot, n)
                written = HostEvent()
                gates.append(written)
                src = host_copy(cpu, data)
                handles.append(eng.submit(TransferRequest(Link.H2DISK, tc, src, region, prio,
                                                          on_done=lambda _h, ev=written: ev.set())))
                back = cpu.alloc_host(n).tensor
                handles.append(eng.submit(TransferRequest(Link.DISK2H, tc, region, back, prio, after=written)))
                checks.append((back, data))
                totals[Link.H2DISK][tid] += n
                totals[Link.DISK2H][tid] += n
        for h in handles:
            h.wait(T)
        for got, want in checks:
            assert torch.equal(got, want)

    try:
        runs = [start_thread(lambda t=t: worker(t)) for t in range(num_threads)]
        for th, _ in runs:
            th.join(60)
            assert not th.is_alive()
        errors = [e for _, errs in runs for e in errs]
        assert not errors, errors[0]
        stats = eng.stats()
        for lk in Link:
            assert stats["links"][lk.value]["bytes"] == sum(totals[lk])
        cls = [ClassStats(**s) for s in stats["classes"].values()]
        assert sum(c.failures for c in cls) == 0
        assert sum(c.bytes for c in cls) == sum(sum(v) for v in totals.values())
        assert sum(c.transfers for c in cls) == sum(LinkStats(**s).transfers for s in stats["links"].values())
    finally:
        for ev in gates:
            ev.set()
        eng.close()
        f.close()


def test_after_event_orders_a_disk_read_behind_its_write(engine, gate, cpu, rand, tmp_path):
    with DirectFile(tmp_path / "o.tpnvme", 4 * MiB) as f:
        data = rand(3 * MiB)
        written = gate()
        back = host_copy(cpu, rand(3 * MiB))
        h_read = engine.submit(req(Link.DISK2H, f.region(0, 3 * MiB), back, after=written))
        with pytest.raises(TimeoutError):
            h_read.wait(0.01)
        h_write = engine.submit(req(Link.H2DISK, host_copy(cpu, data), f.region(0, 3 * MiB),
                                    on_done=lambda _h: written.set()))
        h_write.wait(T)
        h_read.wait(T)
        assert torch.equal(back, data)


def test_urgent_stream_worker_under_delayed_completions(monkeypatch: pytest.MonkeyPatch, retire_thread: bool) -> None:
    """A device whose copies finish later (events that complete after a random delay), so chunks really sit
    in flight: mixed priorities and classes on both memory links, a small in-flight bound, urgent KV chunks
    bypassing it. Every transfer completes, byte-exact, and nothing deadlocks."""
    import time as _time

    rng = random.Random(7)

    class LateEvent:
        def __init__(self, at_s: float) -> None:
            self.at_s = at_s

        def query(self) -> bool:
            return _time.monotonic() >= self.at_s

        def synchronize(self) -> None:
            _time.sleep(max(0.0, self.at_s - _time.monotonic()))

    class LateDevice(Device):
        def __init__(self) -> None:
            super().__init__("cpu")

        @property
        def is_cuda(self) -> bool:  # type: ignore[override]
            return True

        def new_stream(self, priority: int = 0):
            return object()

        def bind_thread(self, stream=None) -> None:
            pass

        def stream_wait(self, ev, stream=None) -> None:
            pass

        def copy(self, dst, src, stream=None, stream_is_current=False):
            dst.copy_(src)
            return LateEvent(_time.monotonic() + rng.random() * 0.002)

    monkeypatch.setattr(torch.cuda, "set_device", lambda *a: None)
    dev = LateDevice()
    eng = TransferEngine(dev, chunk_bytes=CHUNK, max_inflight_bytes=4 * CHUNK, urgent_stream=True,
                         retire_thread=retire_thread)
    # CPU tensors stand in for both sides
    monkeypatch.setattr(eng, "_validate", lambda r, _checked=None: [(0, 0, r.src.numel())])
    ran: list[int] = []
    try:
        jobs = []
        for i in range(120):
            n = rng.choice([4096, 3 * MiB, 9 * MiB])
            src = torch.randint(0, 255, (n,), dtype=torch.uint8)
            dst = torch.empty_like(src)
            h = eng.submit(TransferRequest(rng.choice([Link.H2D, Link.D2H]), rng.choice(list(TrafficClass)), src,
                                           dst, rng.choice(list(Priority))))
            jobs.append((h, src, dst))
            if i % 3 == 0:  # host work for the workers' waits, among the copies
                eng.submit_idle(rng.choice([Link.H2D, Link.D2H]), lambda i=i: ran.append(i), rng.choice(list(Priority)))
        for h, src, dst in jobs:
            h.wait(T)
            assert h.error is None and torch.equal(src, dst)
    finally:
        eng.close()
    assert sum(link_stats(eng, lk).transfers for lk in (Link.H2D, Link.D2H)) == 120
    assert sorted(ran) == list(range(0, 120, 3))  # every idle job ran once, all before close() returned


def test_idle_jobs_run_in_priority_order_are_counted_and_refused_after_close(cpu, rand, retire_thread):
    eng = TransferEngine(cpu, chunk_bytes=CHUNK, retire_thread=retire_thread)
    gate = HostEvent()
    src, dst = rand(4096), rand(4096)
    eng.submit(req(Link.H2D, src, dst, after=gate))  # holds the worker while the jobs are queued
    ran: list[str] = []
    boom = RuntimeError("job failed (injected)")

    def failing() -> None:
        ran.append("failing")
        raise boom

    eng.submit_idle(Link.H2D, lambda: ran.append("low"), Priority.LOW)
    eng.submit_idle(Link.H2D, failing, Priority.NORMAL)
    eng.submit_idle(Link.H2D, lambda: ran.append("urgent"), Priority.URGENT)
    eng.submit_idle(Link.H2D, lambda: ran.append("high, late"), Priority.HIGH, deadline_s=2.0)
    eng.submit_idle(Link.H2D, lambda: ran.append("high, soon"), Priority.HIGH, deadline_s=1.0)
    with pytest.raises(ConfigError, match="not a memory link"):
        eng.submit_idle(Link.DISK2H, lambda: None)
    gate.set()
    wait_until(lambda: len(ran) == 5, T)
    assert ran == ["urgent", "high, soon", "high, late", "failing", "low"] and torch.equal(src, dst)
    ls = link_stats(eng, Link.H2D)
    assert ls.idle_jobs == 5 and ls.idle_job_errors == 1 and eng.last_idle_error is boom
    eng.close()
    with pytest.raises(TransferError, match="closed"):
        eng.submit_idle(Link.H2D, lambda: None)


def test_latch_is_one_shot_and_wakes_every_waiter() -> None:
    from runtime.future import Latch

    latch = Latch()
    assert not latch.is_set() and latch.wait(0.01) is False
    woke: list[int] = []
    threads = [start_thread(lambda i=i: woke.append(i) if latch.wait(T) else None) for i in range(4)]
    latch.set()
    latch.set()  # a second set does nothing
    for t, errors in threads:
        t.join(T)
        assert not errors
    assert sorted(woke) == [0, 1, 2, 3] and latch.is_set() and latch.wait(0) and latch.wait()
