"""TransferEngine on the CPU twin under concurrency: many threads, delayed completions, idle jobs, latches."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tests.conftest import host_copy, start_thread, wait_until
from tests.runtime.conftest import CHUNK, MiB, T, link_stats, req
from tierplan.runtime.device import Device, HostEvent
from tierplan.runtime.errors import ConfigError, TransferError
from tierplan.runtime.nvme import DirectFile
from tierplan.runtime.transfer import (
    ClassStats,
    Link,
    LinkStats,
    Priority,
    TrafficClass,
    TransferEngine,
    TransferRequest,
)


class _GateEvent:
    """A copy that lands only once its gate is set (or at once, while the gate's `hold` is off)."""

    def __init__(self, gate) -> None:
        self.gate = gate

    def query(self) -> bool:
        return self.gate.is_set()

    def synchronize(self) -> None:
        self.gate.wait(T)


class _FakeGPU(Device):
    """The CPU twin posing as a GPU: a copy is done on the host at once and returns `landing()`, the event that
    says when it "lands" (chunks then really sit in flight); its copies in issue order (the stream's order)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.copies: list[tuple[int, int]] = []  # (dst, src) addresses

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def new_stream(self, priority: int = 0):
        return object()

    def bind_thread(self, stream=None) -> None:
        pass

    def stream_wait(self, ev, stream=None) -> None:
        pass

    def landing(self) -> Any:
        return HostEvent(done=True)

    def copy(self, dst, src, stream=None, stream_is_current=False):
        self.copies.append((dst.data_ptr(), src.data_ptr()))
        dst.copy_(src)
        return self.landing()


class _GateDevice(_FakeGPU):
    """Copies that land when a gate opens (at once while `hold` is off)."""

    def __init__(self, gate) -> None:
        super().__init__()
        self.gate, self.hold = gate, True

    def landing(self) -> Any:
        return _GateEvent(self.gate) if self.hold else HostEvent(done=True)


@pytest.fixture()
def gated(monkeypatch: pytest.MonkeyPatch):
    """(device, gate): the gate is set at teardown, so no copy is left waiting on a failed test."""
    import threading

    monkeypatch.setattr(torch.cuda, "set_device", lambda *a: None)
    gate = threading.Event()
    yield _GateDevice(gate), gate
    gate.set()


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

    class LateDevice(_FakeGPU):
        def landing(self) -> Any:
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
            r = TransferRequest(rng.choice([Link.H2D, Link.D2H]), rng.choice(list(TrafficClass)), src, dst,
                                rng.choice(list(Priority)))
            h = eng.submit_now(r) if i % 4 == 1 else eng.submit(r)  # some issued on this thread, among the queue
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


@pytest.mark.parametrize("now", [False, True])
def test_a_queued_list_keeps_the_inflight_bound_and_submit_now_issues_it_whole(gated, monkeypatch: pytest.MonkeyPatch,
                                                                              now: bool) -> None:
    """Copies that complete only when a gate opens: a queued list has its first two chunks issued (the bound's
    floor) and the rest only as those land; through `submit_now` (a step's misses, which its caller waits for in
    full) every chunk is issued while none has landed. Both complete byte-exact once the gate opens."""
    import time as _time

    dev, gate = gated
    eng = TransferEngine(dev, chunk_bytes=CHUNK, max_inflight_bytes=CHUNK)
    monkeypatch.setattr(eng, "_validate", lambda r, _checked=None: r.segments)
    num = 6
    src = torch.randint(0, 255, (num * CHUNK,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    issued: list[int] = []
    try:
        r = TransferRequest(Link.H2D, TrafficClass.EXPERT, src, dst,
                            segments=[(i * CHUNK, i * CHUNK, CHUNK) for i in range(num)],
                            on_segment_issued=lambda i, _ev: issued.append(i))
        h = eng.submit_now(r) if now else eng.submit(r)
        want = num if now else 2
        wait_until(lambda: len(issued) >= want, T)
        _time.sleep(0.05)  # the worker had time to issue more, were it allowed to
        assert sorted(issued) == list(range(want))
        gate.set()
        h.wait(T)
        assert h.error is None and torch.equal(src, dst) and sorted(issued) == list(range(num))
    finally:
        gate.set()
        eng.close()


def test_submit_now_issues_every_chunk_on_the_callers_thread_and_the_worker_retires_them(
        gated, monkeypatch: pytest.MonkeyPatch, retire_thread: bool) -> None:
    """`submit_now` (a step's misses on a GPU): every chunk is issued, its `on_segment_issued` run, on the calling
    thread before it returns, while none has landed and past the in-flight bound; the link's worker retires them
    once they land (byte-exact, counted). After close it raises and issues nothing."""
    import threading

    dev, gate = gated
    eng = TransferEngine(dev, chunk_bytes=CHUNK, max_inflight_bytes=CHUNK, retire_thread=retire_thread)
    monkeypatch.setattr(eng, "_validate", lambda r, _checked=None: r.segments)
    num = 6
    src = torch.randint(0, 255, (num * CHUNK,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    issued_on: list[tuple[int, str]] = []
    done: list[int] = []
    segs = [(i * CHUNK, i * CHUNK, CHUNK) for i in range(num)]
    try:
        h = eng.submit_now(TransferRequest(
            Link.H2D, TrafficClass.EXPERT, src, dst, segments=segs,
            on_segment_issued=lambda i, _ev: issued_on.append((i, threading.current_thread().name)),
            on_segment_done=lambda i, _err: done.append(i)))
        me = threading.current_thread().name
        assert issued_on == [(i, me) for i in range(num)] and not done and not h.done()
        gate.set()
        h.wait(T)
        assert h.error is None and torch.equal(src, dst) and sorted(done) == list(range(num))
        assert link_stats(eng, Link.H2D).bytes == num * CHUNK
    finally:
        gate.set()
        eng.close()
    with pytest.raises(TransferError):
        eng.submit_now(TransferRequest(Link.H2D, TrafficClass.EXPERT, src, dst, segments=segs))


def test_submit_now_on_the_cpu_twin_copies_on_the_callers_thread(cpu, rand, retire_thread) -> None:
    """On the CPU twin `submit_now` does the copies on the calling thread and the transfer is done (retired, its
    callbacks run, counted) once it returns, or once the retire thread has it; disk links are refused by name."""
    import threading

    eng = TransferEngine(cpu, chunk_bytes=CHUNK, retire_thread=retire_thread)
    src, dst = rand(3 * CHUNK), torch.zeros(3 * CHUNK, dtype=torch.uint8)
    names: list[str] = []
    try:
        h = eng.submit_now(req(Link.H2D, src, dst, on_segment_issued=lambda _i, _ev: names.append(
            threading.current_thread().name)))
        assert names == [threading.current_thread().name] and torch.equal(src, dst)
        h.wait(T)
        assert h.error is None and link_stats(eng, Link.H2D).bytes == 3 * CHUNK
        with pytest.raises(ConfigError, match="not a memory link"):
            eng.submit_now(req(Link.DISK2H, src, dst))
    finally:
        eng.close()


def test_urgent_kv_through_submit_now_goes_on_the_bulk_stream_and_leaves_the_bound_whole(gated) -> None:
    """A caller's chunks all go on the bulk stream, an URGENT KV one too, and once retired they take nothing off
    the in-flight bound: a queued list then still gets its whole bound (4 chunks) issued before any lands. (An
    urgent chunk handed back as a bulk one used to keep its bytes counted: the bound shrank to its floor of 2.)"""
    import time as _time

    dev, gate = gated
    eng = TransferEngine(dev, chunk_bytes=CHUNK, max_inflight_bytes=4 * CHUNK, urgent_stream=True)
    eng._validate = lambda r, _checked=None: r.segments  # type: ignore[method-assign]
    streams: list[object] = []
    real_copy_range = dev.copy_range

    def copy_range(*a, **kw):
        streams.append(a[5] if len(a) > 5 else kw.get("stream"))
        return real_copy_range(*a, **kw)

    dev.copy_range = copy_range  # type: ignore[method-assign]

    def depth() -> int:  # chunks of a queued 8-chunk list issued while none has landed
        gate.clear()
        dev.hold = True
        issued: list[int] = []
        src = torch.zeros(8 * CHUNK, dtype=torch.uint8)
        h = eng.submit(TransferRequest(Link.H2D, TrafficClass.EXPERT, src, torch.zeros_like(src),
                                       segments=[(i * CHUNK, i * CHUNK, CHUNK) for i in range(8)],
                                       on_segment_issued=lambda i, _ev: issued.append(i)))
        wait_until(lambda: len(issued) >= 4, T)
        _time.sleep(0.05)  # the worker had time to issue more, were the bound wider
        n = len(issued)
        gate.set()
        h.wait(T)
        return n

    try:
        assert depth() == 4
        dev.hold = False
        for _ in range(4):
            src = torch.zeros(CHUNK, dtype=torch.uint8)
            streams.clear()
            eng.submit_now(TransferRequest(Link.H2D, TrafficClass.KV, src, torch.zeros_like(src), Priority.URGENT,
                                           segments=[(0, 0, CHUNK)])).wait(T)
            assert streams == [eng._workers[Link.H2D].stream]
        assert depth() == 4
    finally:
        gate.set()
        eng.close()


def test_copies_are_numbered_in_stream_order_when_callers_issue_beside_the_worker(gated) -> None:
    """The worker and `submit_now` callers issue on one bulk stream; each segment's `on_segment_issued` (where the
    expert loader numbers its copies for `ReadyOrder`) runs in the order the copies entered the stream, whatever
    the interleaving: the link's issue lock covers the copy and its callback together."""
    import threading

    dev, _gate = gated
    dev.hold = False
    eng = TransferEngine(dev, chunk_bytes=CHUNK, max_inflight_bytes=2 * CHUNK)
    eng._validate = lambda r, _checked=None: r.segments  # type: ignore[method-assign]
    seg = 4096
    numbered: list[tuple[int, int]] = []
    handles = []

    def make(n: int) -> TransferRequest:
        src = torch.arange(n * seg, dtype=torch.int32).to(torch.uint8)
        dst = torch.zeros_like(src)

        def issued(i: int, _ev: object, s=src, d=dst) -> None:
            threading.Event().wait(0)  # a switch point between the copy and its number
            numbered.append((d.data_ptr() + i * seg, s.data_ptr() + i * seg))

        handles.append((src, dst))
        return TransferRequest(Link.H2D, TrafficClass.EXPERT, src, dst, segments=[(i * seg, i * seg, seg)
                                                                                   for i in range(n)],
                               on_segment_issued=issued)

    try:
        hs = []
        for _ in range(150):
            hs.append(eng.submit(make(8)))
            hs.append(eng.submit_now(make(8)))
        for h in hs:
            h.wait(T)
    finally:
        eng.close()
    assert len(dev.copies) == 150 * 16 and numbered == dev.copies
    assert all(torch.equal(s, d) for s, d in handles)


def test_on_the_cpu_twin_a_worker_blocked_on_a_host_event_does_not_hold_submit_now_back(cpu, rand) -> None:
    """The CPU twin's worker waits for a request's `after` event on the host; a caller's `submit_now` meanwhile
    copies at once (the twin keeps no stream order, so there is no issue lock to wait for)."""
    eng = TransferEngine(cpu, chunk_bytes=CHUNK)
    gate = HostEvent()
    try:
        held = eng.submit(req(Link.H2D, rand(4096), torch.zeros(4096, dtype=torch.uint8), after=gate))
        wait_until(lambda: eng.pending_chunks(Link.H2D) == 0, T)  # the worker took it and waits on the gate
        src, dst = rand(4096), torch.zeros(4096, dtype=torch.uint8)
        import threading

        threading.Timer(5.0, gate.set).start()  # a caller held back would return only after this
        h = eng.submit_now(req(Link.H2D, src, dst))
        assert not gate.query() and torch.equal(src, dst) and not held.done()  # the worker still waits
        h.wait(T)
        gate.set()
        held.wait(T)
    finally:
        gate.set()
        eng.close()


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
    from tierplan.runtime.future import Latch

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
