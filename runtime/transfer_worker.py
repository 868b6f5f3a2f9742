"""The link workers of the transfer engine (inference process): each link's worker thread pops chunks, issues
copies (memory links: CUDA streams, at most `max_inflight_bytes` in flight) or does disk I/O, runs idle jobs in
its waits, and retires finished chunks, in order, here or on the link's retire thread. `TransferEngine`
(runtime/transfer.py) owns the queues, the submission side and the statistics; this mixin is its worker half.

Never decides what to move.
"""

from __future__ import annotations

import heapq
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from runtime.device import Device, Event
from runtime.transfer_handle import TransferHandle, _Chunk, _Queued, _slice
from runtime.transfer_types import ClassStats, Link, LinkStats, Priority, TrafficClass

URGENT_POLL_S = 100e-6  # with an urgent stream: how often a worker waiting on bulk copies looks at them


class _SegmentFailed(Exception):
    """A segment's before_segment hook raised: that segment fails alone (the error is in h.segment_errors)."""


class _LinkQueue:
    def __init__(self) -> None:
        self.heap: list[_Queued] = []  # transfers; each gives its chunks one at a time (`_Queued.take`)
        self.idle: list[tuple[int, float, int, Callable[[], None]]] = []  # (priority, deadline, seq, job)
        self.cv = threading.Condition()


class _LinkWorkers:
    """The worker half of `TransferEngine`: its threads run `_run` (one per memory link, `disk_workers` per disk
    link) and `_retire_loop`."""

    device: Device
    clock: Callable[[], float]
    max_inflight_bytes: int
    max_inflight_chunks: int
    last_idle_error: BaseException | None
    _closing: bool
    _queues: dict[Link, _LinkQueue]
    _stats_lock: threading.Lock
    _class_stats: dict[TrafficClass, ClassStats]
    _link_stats: dict[Link, LinkStats]
    _streams: dict[Link, Any]
    _urgent_streams: dict[Link, Any]
    _retire_queues: dict[Link, queue.SimpleQueue[tuple[_Chunk, BaseException | None] | None]]

    def _run_idle(self, link: Link, q: _LinkQueue) -> None:
        with q.cv:
            job = heapq.heappop(q.idle)[-1]
        t0 = time.perf_counter()
        try:
            job()
        except Exception as exc:
            with self._stats_lock:
                self._link_stats[link].idle_job_errors += 1
            self.last_idle_error = exc
        finally:
            dt = time.perf_counter() - t0
            with self._stats_lock:
                ls = self._link_stats[link]
                ls.idle_jobs += 1
                ls.idle_s += dt

    # ---- workers ----------------------------------------------------------------------------------
    def _issue(self, link: Link, ch: _Chunk, first: bool) -> Event | None:
        req = ch.handle.request
        if first and req.before_issue is not None:
            t0 = time.perf_counter()
            try:
                req.before_issue()
            finally:
                self._add_time(link, "hook_s", time.perf_counter() - t0)
        if link is Link.H2D or link is Link.D2H:  # by address on a GPU: no views made per chunk
            urgent = self._bypasses(link, ch)
            stream = self._urgent_streams[link] if urgent else self._streams[link]
            if first and req.after is not None:
                self.device.stream_wait(req.after, stream)
            if ch.first and req.before_segment is not None:  # after the transfer's own prologue, whatever it does
                self._segment_hook(link, ch)
            ev = self.device.copy_range(req.dst, ch.dst_offset_bytes, req.src, ch.src_offset_bytes, ch.length_bytes,
                                        stream, stream_is_current=not urgent)  # _run made the bulk stream current
            return ev if self.device.is_cuda else None
        src = _slice(req.src, ch.src_offset_bytes, ch.length_bytes)
        dst = _slice(req.dst, ch.dst_offset_bytes, ch.length_bytes)
        if link in (Link.DISK2H, Link.H2DISK) and req.after is not None:
            req.after.synchronize()  # every chunk: disk workers run in parallel, so "first" proves nothing
        if link is Link.DISK2H:
            src.file.read_into(src.offset_bytes, dst)
            return None
        dst.file.write_from(dst.offset_bytes, src)  # H2DISK
        return None

    def _bypasses(self, link: Link, ch: _Chunk) -> bool:
        """An URGENT KV chunk of a memory link with an urgent stream: issued at once, outside the bound (urgent
        expert loads, e.g. a plan's, stay in the bounded bulk queue: they are large)."""
        return (link in self._urgent_streams and ch.key[0] == int(Priority.URGENT)
                and ch.handle.request.traffic is TrafficClass.KV)

    def _add_time(self, link: Link, phase: str, dt_s: float) -> None:
        with self._stats_lock:
            ls = self._link_stats[link]
            setattr(ls, phase, getattr(ls, phase) + dt_s)

    def _retire(self, ch: _Chunk, event: Event | None, failed: BaseException | None) -> None:
        """Account a chunk (here, or in order on the link's retire thread); `event` (None if the copy is known
        done) is waited for first, on the worker."""
        link = ch.handle.request.link
        if event is not None and failed is None:
            t0 = time.perf_counter()
            try:
                event.synchronize()
            except Exception as exc:  # a CUDA error surfaces here
                failed = exc
            self._add_time(link, "blocked_s", time.perf_counter() - t0)
        rq = self._retire_queues.get(link)
        if rq is not None:
            if failed is not None and ch.handle.error is None:
                ch.handle.error = failed  # now, on the worker: the transfer's later chunks must not be issued
            rq.put((ch, failed))
            return
        self._account_timed(ch, failed)

    def _account_timed(self, ch: _Chunk, failed: BaseException | None) -> None:
        t0 = time.perf_counter()
        try:
            self._account(ch, failed)
        finally:
            self._add_time(ch.handle.request.link, "retire_s", time.perf_counter() - t0)

    def _retire_loop(self, rq: queue.SimpleQueue[tuple[_Chunk, BaseException | None] | None]) -> None:
        """A memory link's retire thread: accounts finished chunks in the order its worker handed them over."""
        self.device.bind_thread()  # on_done callbacks may make driver calls
        while (item := rq.get()) is not None:
            self._account_timed(*item)

    def _segment_hook(self, link: Link, ch: _Chunk) -> None:
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
            self._add_time(link, "hook_s", time.perf_counter() - t0)

    def _account(self, ch: _Chunk, failed: BaseException | None) -> None:
        h = ch.handle
        if failed is not None and h.error is None:
            h.error = failed
        seg_error = h.segment_errors.get(ch.seg) if h.segment_errors else None
        if failed is not None:  # this chunk failed or was skipped: its segment reports it (not those already moved)
            h._seg_failures.setdefault(ch.seg, failed)
        with self._stats_lock:
            ls = self._link_stats[h.request.link]
            ls.chunks += 1
            ls.bytes += ch.length_bytes if failed is None and seg_error is None else 0
            h._remaining -= 1
            last = h._remaining == 0
            if h._seg_left is None:
                seg_last = last
            else:
                h._seg_left[ch.seg] -= 1
                seg_last = h._seg_left[ch.seg] == 0
        if seg_last and h.request.on_segment_done is not None:
            error = h._seg_failures.get(ch.seg) or h.segment_errors.get(ch.seg)
            try:
                h.request.on_segment_done(ch.seg, error)
            except Exception as exc:
                if error is None:
                    h.segment_errors[ch.seg] = exc
                else:
                    error.add_note(f"on_segment_done({ch.seg}) also failed: {exc!r}")
        if last:
            self._finish(h)

    def _finish(self, h: TransferHandle) -> None:
        h.end_s = self.clock()
        h._issued.set()
        if h.request.on_done is not None:
            try:
                h.request.on_done(h)
            except Exception as exc:
                if h.error is None:
                    h.error = exc
                else:  # keep both: the callback's failure must not vanish behind the transfer's
                    h.error.add_note(f"on_done also failed: {exc!r}")
        req = h.request
        with self._stats_lock:
            cs = self._class_stats[req.traffic]
            ls = self._link_stats[req.link]
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
        h._done.set()

    def _run(self, link: Link) -> None:
        self.device.bind_thread(self._streams.get(link))  # hooks' driver calls need the context; bulk copies
        q = self._queues[link]
        inflight: deque[tuple[_Chunk, Event]] = deque()
        urgent: deque[tuple[_Chunk, Event]] = deque()  # on the urgent stream: retired on their own
        inflight_bytes = 0
        while True:
            ch: _Chunk | None = None
            with q.cv:
                while not q.heap and not inflight and not urgent and not q.idle and not self._closing:
                    q.cv.wait()
                # Always two in flight: the next request's before_issue hook (a slot remap, ~60 µs) then runs
                # while the link is still busy with the previous one.
                if q.heap and (
                    self._bypasses(link, q.heap[0].head)
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
                    if link in self._retire_queues:
                        self._retire_queues[link].put(None)  # the retire thread ends after what is queued
                    return  # closing and drained
            if ch is None:
                if q.idle and not urgent and (not inflight or not inflight[0][1].query()):
                    self._run_idle(link, q)  # nothing to issue and the oldest copy still runs: do host work
                    continue
                if self._urgent_streams and not urgent and not inflight[0][1].query():
                    # Never block on a bulk copy here: an urgent KV chunk submitted meanwhile (submit notifies
                    # the queue) is issued at once instead of after the oldest bulk chunk.
                    with q.cv:
                        if not (q.heap and self._bypasses(link, q.heap[0].head)):
                            q.cv.wait(URGENT_POLL_S)
                    continue
                done_ch, ev = (urgent or inflight).popleft()  # an urgent copy is short: wait for it first
                if not self._bypasses(link, done_ch):
                    inflight_bytes -= done_ch.length_bytes
                self._retire(done_ch, ev, None)
                continue
            h = ch.handle
            if h.error is not None or (h.segment_errors and ch.seg in h.segment_errors):
                self._retire(ch, None, h.error)  # an earlier chunk failed: skip the copy, still account
                continue
            with self._stats_lock:
                first = h.start_s is None
                if first:
                    h.start_s = self.clock()
            t0 = time.perf_counter()
            req = h.request
            try:
                ev = self._issue(link, ch, first)
            except _SegmentFailed:
                self._add_time(link, "issue_s", time.perf_counter() - t0)
                self._retire(ch, None, None)  # the segment failed alone: its error is in h.segment_errors
                continue
            except Exception as exc:
                self._add_time(link, "issue_s", time.perf_counter() - t0)
                self._retire(ch, None, exc)
                continue
            if ch.last and req.on_segment_issued is not None:
                try:
                    req.on_segment_issued(ch.seg, ev)
                except Exception as exc:  # the bytes still move; the segment reports the error when done
                    h.segment_errors.setdefault(ch.seg, exc)
            self._add_time(link, "issue_s", time.perf_counter() - t0)  # hooks included; hook_s says how much
            with self._stats_lock:
                h._unissued -= 1
                if h._unissued == 0:
                    h._last_event = ev
                    h._issued.set()
            if ev is None:
                self._retire(ch, None, None)
            elif self._bypasses(link, ch):
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

