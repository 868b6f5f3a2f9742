"""TransferEngine on the CPU twin: bit-exact copies on every link, chunking, priorities, deadlines, failures.

Ordering is asserted through `on_done` callbacks and gates (unsignalled `HostEvent`s passed as `after`, which
hold a link's worker), never through wall-clock durations; time-based accounting uses a fake clock.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.conftest import FakeClock, host_copy, wait_until
from tests.runtime.conftest import CHUNK, MiB, T, class_stats, link_stats, req
from tierplan.runtime.device import Device, HostEvent, completed_event
from tierplan.runtime.errors import AlignmentError, ConfigError, TransferError
from tierplan.runtime.nvme import DirectFile
from tierplan.runtime.transfer import (
    ClassStats,
    Link,
    LinkStats,
    Priority,
    TrafficClass,
    TransferEngine,
)


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
