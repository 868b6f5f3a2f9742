"""The link workers of the transfer engine (inference process): one `LinkWorker` per link pops its chunks,
issues copies (memory links: CUDA streams, at most `max_inflight_bytes` in flight; a caller's `issue_now` list
goes outside that bound) or does disk I/O, runs idle jobs in its waits, and retires finished chunks, in order, on
its thread(s) or on its retire thread.
`TransferEngine` (runtime/transfer.py) owns the submission side; the two share a `LinkQueue` per link (the
engine pushes, the worker pops) and one `TransferStats` (the workers write, the engine reads). A worker
changes a `TransferHandle` only through the handle's methods.

Never decides what to move.
"""

from __future__ import annotations

import contextlib
import heapq
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tierplan.runtime.device import Device, Event
from tierplan.runtime.errors import TransferError
from tierplan.runtime.transfer_handle import Chunk, QueuedTransfer, TransferHandle, byte_slice
from tierplan.runtime.transfer_types import ClassStats, Link, LinkStats, Priority, TrafficClass

URGENT_POLL_S = 100e-6  # with an urgent stream: how often a worker waiting on bulk copies looks at them
MEMORY_LINKS = (Link.H2D, Link.D2H)


class _SegmentFailed(Exception):
    """A segment's before_segment hook raised: that segment fails alone (the error is in h.segment_errors)."""


class _PartFailed(Exception):
    """Part `index` of a group's copies raised (its cause): the parts before it were copied, it and the rest not."""

    def __init__(self, index: int) -> None:
        super().__init__(f"part {index} of a group")
        self.index = index


class LinkQueue:
    """One link's queue: transfers by (priority, deadline, arrival), idle jobs, the chunks callers issued
    themselves (`direct`, for the worker to retire; `direct_busy`: callers issuing now), and the closing flag."""

    def __init__(self) -> None:
        self.heap: list[QueuedTransfer] = []  # transfers; each gives its chunks one at a time (`take`)
        self.idle: list[tuple[int, float, int, Callable[[], None]]] = []  # (priority, deadline, seq, job)
        self.cv = threading.Condition()
        self.closing = False  # set under cv by the engine: finish what is queued, then stop
        self.direct: deque[tuple[Chunk, Event]] = deque()  # chunks callers issued (`issue_now`): the worker retires
        self.direct_busy = 0  # callers issuing now: the worker does not stop before they hand their chunks over


class TransferStats:
    """Accounting per traffic class and per link, under one lock; the last idle job error."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.classes = {c: ClassStats() for c in TrafficClass}
        self.links = {lk: LinkStats() for lk in Link}
        self.last_idle_error: BaseException | None = None

    def add_time(self, link: Link, phase: str, dt_s: float) -> None:
        with self.lock:
            ls = self.links[link]
            setattr(ls, phase, getattr(ls, phase) + dt_s)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"classes": {c.value: vars(s).copy() for c, s in self.classes.items()},
                    "links": {lk.value: vars(s).copy() for lk, s in self.links.items()}}


class LinkWorker:
    """Moves one link's chunks. `start()` runs its thread(s) (`num_threads`: one per memory link, several for a
    disk link) and, with `retire_thread` on a memory link, the thread that accounts finished chunks in order;
    `join()` waits for them once the queue is closing and drained."""

    def __init__(self, link: Link, q: LinkQueue, device: Device, stats: TransferStats, clock: Callable[[], float],
                 max_inflight_bytes: int, max_inflight_chunks: int, num_threads: int = 1, stream: Any = None,
                 urgent_stream: Any = None, retire_thread: bool = False) -> None:
        self.link, self.queue, self.device, self.stats, self.clock = link, q, device, stats, clock
        self.max_inflight_bytes, self.max_inflight_chunks = max_inflight_bytes, max_inflight_chunks
        self.num_threads, self.stream, self.urgent_stream = num_threads, stream, urgent_stream
        self._retire_queue: queue.SimpleQueue[tuple[Chunk, BaseException | None, int] | None] | None = (
            queue.SimpleQueue() if retire_thread and link in MEMORY_LINKS else None)
        self._threads: list[threading.Thread] = []
        # One issuer at a time on the bulk stream (the worker, or a caller's `issue_now`): copies leave in the order
        # their `on_segment_issued` sees them, which numbers loads in stream order (`ReadyOrder`). The CPU twin has
        # no stream to keep in order (its copies are done when issued, its loads unnumbered), and there a worker
        # blocked on a host event must not hold a caller back.
        self.issue_lock: Any = threading.Lock() if device.is_cuda else contextlib.nullcontext()

    def start(self) -> None:
        jobs: list[tuple[Callable[[], None], str]] = [(self._run, f"tierplan-{self.link.value}-{i}")
                                                      for i in range(self.num_threads)]
        if self._retire_queue is not None:
            jobs.append((self._retire_loop, f"tierplan-{self.link.value}-retire"))
        for target, name in jobs:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def join(self) -> None:
        for t in self._threads:
            t.join()

    def _run_idle(self) -> None:
        link, q = self.link, self.queue
        with q.cv:
            job = heapq.heappop(q.idle)[-1]
        t0 = time.perf_counter()
        try:
            job()
        except Exception as exc:
            with self.stats.lock:
                self.stats.links[link].idle_job_errors += 1
            self.stats.last_idle_error = exc
        finally:
            dt = time.perf_counter() - t0
            with self.stats.lock:
                ls = self.stats.links[link]
                ls.idle_jobs += 1
                ls.idle_s += dt

    # ---- workers ----------------------------------------------------------------------------------
    def _issue(self, ch: Chunk, first: bool, caller: bool = False) -> Event | None:
        """One chunk's hooks, waits and copy; caller: on a caller's thread (`issue_now`), whose current stream is
        not the link's."""
        link, req = self.link, ch.handle.request
        if first and req.before_issue is not None:
            t0 = time.perf_counter()
            try:
                req.before_issue()
            finally:
                self.stats.add_time(link, "hook_s", time.perf_counter() - t0)
        if link is Link.H2D or link is Link.D2H:  # by address on a GPU: no views made per chunk
            urgent = self._bypasses(ch) and not caller  # a caller's chunks all go on the bulk stream
            stream = self.urgent_stream if urgent else self.stream
            if first and req.after is not None:
                self.device.stream_wait(req.after, stream)
            if ch.first and req.before_segment is not None:  # after the transfer's own prologue, whatever it does
                self._segment_hook(ch)
            if ch.first and req.segment_after is not None:
                for ev in req.segment_after[ch.seg]:
                    self.device.stream_wait(ev, stream)
            if ch.parts is not None:
                ev = self._issue_parts(ch, stream, not urgent and not caller)
            else:
                ev = self.device.copy_range(req.dst, ch.dst_offset_bytes, req.src, ch.src_offset_bytes,
                                            ch.length_bytes, stream, stream_is_current=not urgent and not caller)
            return ev if self.device.is_cuda else None  # _run made the bulk stream current
        assert ch.parts is None, "segment groups are cut on memory links only"  # a group's bytes are not one range
        src = byte_slice(req.src, ch.src_offset_bytes, ch.length_bytes)
        dst = byte_slice(req.dst, ch.dst_offset_bytes, ch.length_bytes)
        if link in (Link.DISK2H, Link.H2DISK) and req.after is not None:
            req.after.synchronize()  # every chunk: disk workers run in parallel, so "first" proves nothing
        if link is Link.DISK2H:
            src.file.read_into(src.offset_bytes, dst)
            return None
        dst.file.write_from(dst.offset_bytes, src)  # H2DISK
        return None

    def _issue_parts(self, ch: Chunk, stream: Any, current: bool) -> Event:
        """A group's copies back to back on `stream`, an event recorded after the last only (stream order makes it
        cover them all). _PartFailed(i) when part i's copy raised: the parts before it are waited for first, so
        they have landed when the group is retired with it and the rest failed."""
        req, parts = ch.handle.request, ch.parts
        assert parts is not None
        last = len(parts) - 1
        ev: Event | None = None
        for i, (src, dst, n) in enumerate(parts):
            try:
                ev = self.device.copy_range(req.dst, dst, req.src, src, n, stream, stream_is_current=current,
                                            record=i == last)
            except Exception as exc:
                if i and self.device.is_cuda:
                    self.device.record_event(stream).synchronize()
                raise _PartFailed(i) from exc
        assert ev is not None
        return ev

    def _bypasses(self, ch: Chunk) -> bool:
        """An URGENT KV chunk of a memory link with an urgent stream: issued at once, outside the bound (urgent
        expert loads, e.g. a plan's, stay in the bounded bulk queue: they are large)."""
        return (self.urgent_stream is not None and ch.key[0] == int(Priority.URGENT)
                and ch.handle.request.traffic is TrafficClass.KV)

    def _retire(self, ch: Chunk, event: Event | None, failed: BaseException | None, failed_from: int = 0) -> None:
        """Account a chunk (here, or in order on the link's retire thread); `event` (None if the copy is known
        done) is waited for first, on the worker. `failed_from`: of a group, the first part `failed` fails (the
        parts before it landed)."""
        if event is not None and failed is None:
            t0 = time.perf_counter()
            try:
                event.synchronize()
            except Exception as exc:  # a CUDA error surfaces here
                failed = exc
            self.stats.add_time(self.link, "blocked_s", time.perf_counter() - t0)
        rq = self._retire_queue
        if rq is not None:
            if failed is not None and ch.handle.error is None:
                ch.handle.error = failed  # now, on the worker: the transfer's later chunks must not be issued
            rq.put((ch, failed, failed_from))
            return
        self._account_timed(ch, failed, failed_from)

    def _account_timed(self, ch: Chunk, failed: BaseException | None, failed_from: int = 0) -> None:
        t0 = time.perf_counter()
        try:
            self._account(ch, failed, failed_from)
        finally:
            self.stats.add_time(self.link, "retire_s", time.perf_counter() - t0)

    def _retire_loop(self) -> None:
        """A memory link's retire thread: accounts finished chunks in the order its worker handed them over."""
        rq = self._retire_queue
        assert rq is not None
        self.device.bind_thread()  # on_done callbacks may make driver calls
        while (item := rq.get()) is not None:
            self._account_timed(*item)

    def _segment_hook(self, ch: Chunk) -> None:
        """Run the request's before_segment hook for the chunk's segment; _SegmentFailed (error kept in
        h.segment_errors) if it raised."""
        h = ch.handle
        t0 = time.perf_counter()
        try:
            h.request.before_segment(ch.seg)  # type: ignore[misc]
        except Exception as exc:
            h.segment_errors.setdefault(ch.seg, exc)
            raise _SegmentFailed from exc
        finally:
            self.stats.add_time(self.link, "hook_s", time.perf_counter() - t0)

    def _account(self, ch: Chunk, failed: BaseException | None, failed_from: int = 0) -> None:
        h, segs = ch.handle, ch.segs
        if failed is not None:  # failed or skipped: its segments report it (not those already moved)
            for s in segs[failed_from:]:
                h.chunk_failed(s, failed)
        if ch.parts is None:
            seg_error = h.segment_errors.get(ch.seg) if h.segment_errors else None
            moved = ch.length_bytes if failed is None and seg_error is None else 0
        else:  # a group's segments have no hook of their own: only a failed copy fails them
            moved = sum(n for _s, _d, n in (ch.parts if failed is None else ch.parts[:failed_from]))
        with self.stats.lock:
            ls = self.stats.links[self.link]
            ls.chunks += 1
            ls.bytes += moved
            last, done = h.chunk_retired(segs)
        if h.request.on_segment_done is not None:
            for s in done:
                error = h.segment_error(s)
                try:
                    h.request.on_segment_done(s, error)
                except Exception as exc:
                    if error is None:
                        h.segment_errors[s] = exc
                    else:
                        error.add_note(f"on_segment_done({s}) also failed: {exc!r}")
        if last:
            self._finish(h)

    def _finish(self, h: TransferHandle) -> None:
        h.finish(self.clock())
        if h.request.on_done is not None:
            try:
                h.request.on_done(h)
            except Exception as exc:
                if h.error is None:
                    h.error = exc
                else:  # keep both: the callback's failure must not vanish behind the transfer's
                    h.error.add_note(f"on_done also failed: {exc!r}")
        req = h.request
        with self.stats.lock:
            cs = self.stats.classes[req.traffic]
            ls = self.stats.links[req.link]
            ls.transfers += 1
            cs.transfers += 1
            if h.error is not None or h.segment_errors:
                cs.failures += 1
                if h.error is None:  # the segments that did move count
                    cs.bytes += sum(n for i, (_s, _d, n) in enumerate(req.segments or [])
                                    if i not in h.segment_errors)
            else:
                cs.bytes += h.num_bytes
            qd = (h.start_s if h.start_s is not None else h.end_s) - h.submit_s
            lat = h.end_s - h.submit_s
            cs.queue_delay_s_sum += qd
            cs.queue_delay_s_max = max(cs.queue_delay_s_max, qd)
            ls.queue_delay_s_sum += qd
            ls.queue_delay_s_max = max(ls.queue_delay_s_max, qd)
            cs.latency_s_sum += lat
            cs.latency_s_max = max(cs.latency_s_max, lat)
            if req.deadline_s is not None and h.end_s > req.deadline_s:
                cs.deadline_misses += 1
        h.settle()

    def _issue_chunk(self, ch: Chunk, caller: bool = False) -> Event | None:
        """Issue one chunk (under `issue_lock`): its event, or None once the chunk is retired here (skipped after an
        earlier failure, failed, or copied already: the CPU twin)."""
        h = ch.handle
        if h.error is not None or (h.segment_errors and ch.seg in h.segment_errors):
            # An earlier chunk failed: skip the copy, still account. A group has no hook of its own to fail a
            # segment alone, but if one had, its parts report that error, never a move that did not happen.
            self._retire(ch, None, h.error if h.error is not None or ch.parts is None else h.segment_errors[ch.seg])
            return None
        with self.stats.lock:
            first = h.start(self.clock())
        t0 = time.perf_counter()
        req = h.request
        try:
            ev = self._issue(ch, first, caller)
        except _PartFailed as exc:
            self.stats.add_time(self.link, "issue_s", time.perf_counter() - t0)
            self._retire(ch, None, exc.__cause__ or exc, exc.index)
            return None
        except _SegmentFailed:
            self.stats.add_time(self.link, "issue_s", time.perf_counter() - t0)
            self._retire(ch, None, None)  # the segment failed alone: its error is in h.segment_errors
            return None
        except Exception as exc:
            self.stats.add_time(self.link, "issue_s", time.perf_counter() - t0)
            self._retire(ch, None, exc)
            return None
        if ch.last and req.on_segment_issued is not None:
            try:
                req.on_segment_issued(ch.seg, ev)
            except Exception as exc:  # the bytes still move; the segment reports the error when done
                h.segment_errors.setdefault(ch.seg, exc)
        self.stats.add_time(self.link, "issue_s", time.perf_counter() - t0)  # hooks included; hook_s says how much
        with self.stats.lock:
            h.chunk_issued(ev)
        if ev is None:
            self._retire(ch, None, None)
        return ev

    def issue_now(self, qt: QueuedTransfer) -> None:
        """Issue every chunk of a memory-link transfer on the calling thread, on the link's bulk stream, ahead of
        its queue and outside the in-flight bound (the caller waits for the whole list: a step's misses), then hand
        them to the worker, which retires them in its waits. The caller's thread needs no hand-off to the worker
        (one wake-up and the GIL back and forth per list). TransferError, nothing issued, once the link closes."""
        q = self.queue
        with q.cv:
            if q.closing:
                raise TransferError("transfer engine is closed")
            q.direct_busy += 1
        issued: list[tuple[Chunk, Event]] = []
        try:
            with self.issue_lock:
                while qt.left:
                    ch = qt.take()
                    if (ev := self._issue_chunk(ch, caller=True)) is not None:
                        issued.append((ch, ev))
        finally:
            with q.cv:
                q.direct.extend(issued)
                q.direct_busy -= 1
                q.cv.notify_all()

    def _run(self) -> None:
        q = self.queue
        self.device.bind_thread(self.stream)  # hooks' driver calls need the context; bulk copies
        inflight: deque[tuple[Chunk, Event]] = deque()
        urgent: deque[tuple[Chunk, Event]] = deque()  # on the urgent stream: retired on their own
        inflight_bytes = 0
        while True:
            ch: Chunk | None = None
            with q.cv:
                while not q.heap and not inflight and not urgent and not q.idle and not q.closing and not q.direct:
                    q.cv.wait()
                while q.direct:  # issued by a caller, in stream order after what it found in flight
                    done_ch, ev = q.direct.popleft()
                    inflight.append((done_ch, ev))
                    inflight_bytes += done_ch.length_bytes
                # Always two in flight: the next request's before_issue hook (a slot remap, ~60 µs) then runs
                # while the link is still busy with the previous one.
                if q.heap and (
                    self._bypasses(q.heap[0].head)
                    or len(inflight) < 2
                    or (
                        len(inflight) < self.max_inflight_chunks
                        and inflight_bytes + q.heap[0].head.length_bytes <= self.max_inflight_bytes
                    )
                ):
                    top = q.heap[0]
                    ch = top.take()
                    if not top.left:
                        heapq.heappop(q.heap)
                elif not q.heap and not inflight and not urgent and not q.idle:
                    if q.direct_busy:  # closing while a caller still issues: its chunks come next
                        q.cv.wait()
                        continue
                    if self._retire_queue is not None:
                        self._retire_queue.put(None)  # the retire thread ends after what is queued
                    return  # closing and drained
            if ch is None:
                if q.idle and not urgent and (not inflight or not inflight[0][1].query()):
                    self._run_idle()  # nothing to issue and the oldest copy still runs: do host work
                    continue
                if self.urgent_stream is not None and not urgent and not inflight[0][1].query():
                    # Never block on a bulk copy here: an urgent KV chunk submitted meanwhile (submit notifies
                    # the queue) is issued at once instead of after the oldest bulk chunk.
                    with q.cv:
                        if not (q.heap and self._bypasses(q.heap[0].head)):
                            q.cv.wait(URGENT_POLL_S)
                    continue
                from_urgent = bool(urgent)  # an urgent copy is short: wait for it first
                done_ch, ev = (urgent or inflight).popleft()
                if not from_urgent:  # what counts against the bound is what sits in `inflight`
                    inflight_bytes -= done_ch.length_bytes
                self._retire(done_ch, ev, None)
                continue
            with self.issue_lock:
                ev = self._issue_chunk(ch)
            if ev is None:
                continue
            if self._bypasses(ch):
                urgent.append((ch, ev))
            else:
                inflight.append((ch, ev))
                inflight_bytes += ch.length_bytes
            while urgent and urgent[0][1].query():  # done: no wait (None) in _retire
                self._retire(urgent.popleft()[0], None, None)
            while inflight and inflight[0][1].query():
                done_ch = inflight.popleft()[0]
                inflight_bytes -= done_ch.length_bytes
                self._retire(done_ch, None, None)

