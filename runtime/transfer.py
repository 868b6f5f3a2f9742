"""One transfer engine for all byte movement: expert weights and KV blocks (inference process).

Four links, one queue each: host->device, device->host, disk->host, host->disk. A request names its
traffic class (expert or kv), a priority and an optional deadline; queues pop by (priority, deadline,
arrival). A transfer of at least 2 x chunk_bytes is cut into even chunks of chunk_bytes (>= 2 MiB) to
2 x chunk_bytes, each cut by its link's worker as it reaches it (submitting a list costs O(1) per segment), so
an urgent small transfer waits behind at most the chunks already in flight, never behind a whole 1 GiB stream.
On a GPU each memory link owns a CUDA stream and keeps issued at most `max_inflight_bytes` (always at least two
chunks) and `max_inflight_chunks`, so many small KV copies pipeline deeply while an urgent one never waits
behind more than ~16 MiB (`submit_now` issues a list its caller waits for in full whole, on the caller's thread,
ahead of the queue); on the CPU twin a worker thread does the queued copies.
Disk links are worker threads doing aligned O_DIRECT I/O.

Memory-link copies go by address (`Device.copy_range`: one cuMemcpyAsync on a GPU). A memory link's finished
chunks are accounted, and `on_done` callbacks run, in order on its worker (the default, as in the reference
engine's `EngineConfig.transfer_retire_thread`) or on its retire thread (`retire_thread=True`); a `submit_now`
chunk that is done when issued (the CPU twin, or a failure) is accounted right there, on the caller's thread
(or handed to the retire thread). `submit_many` queues a list of one link's transfers with one lock and one
wake-up.

Accounting per traffic class: transfers, bytes, queueing delay (submit -> first chunk issued), latency
(submit -> done), deadline misses, failures. Accounting per link: bytes and chunks. Nothing is dropped: a
failed transfer completes with `ok=False`, its error kept, and is counted.

Never decides what to move: callers (the agent, the KV handler, the expert loader) do.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from operator import index
from typing import Any

import torch

from tierplan.runtime.device import Device
from tierplan.runtime.errors import ConfigError, TransferError
from tierplan.runtime.nvme import DIRECT_ALIGN_BYTES, FileRegion
from tierplan.runtime.transfer_handle import QueuedTransfer, TransferHandle, nbytes, num_chunks, segment_groups
from tierplan.runtime.transfer_types import Buffer, ClassStats, Link, LinkStats, Priority, TrafficClass, TransferRequest
from tierplan.runtime.transfer_worker import MEMORY_LINKS, LinkQueue, LinkWorker, TransferStats

__all__ = ["Buffer", "ClassStats", "Link", "LinkStats", "Priority", "TrafficClass", "TransferEngine", "TransferHandle",
           "TransferRequest"]

MIN_CHUNK_BYTES = 2 << 20
DEFAULT_CHUNK_BYTES = 8 << 20  # expert loads of 9-24 MiB pipeline best at this size (bench/results/design_notes.md)
# A list of small segments with no per-segment hook (a KV list) goes in groups of whole segments, each group one
# chunk: its copies back to back under one event, retired together. A chunk a segment paid the worker's issue and
# retire a block, ~31 us of the 57 a 256 KiB KV block took on the H100 host (bench/results/h200/kvmoves_run01).
MAX_GROUP_PARTS = 64
DEFAULT_INFLIGHT_BYTES = 16 << 20  # ~0.3 ms of PCIe Gen5: the most an urgent transfer waits behind


def _groups_segments(req: TransferRequest) -> bool:
    """A memory-link KV list whose segments have no hook of their own: its segments may go in groups (a group's
    first segment is done only when its last is; an expert list wants each load as soon as it lands)."""
    return (req.segments is not None and len(req.segments) > 1 and req.link in MEMORY_LINKS
            and req.traffic is TrafficClass.KV and req.before_segment is None and req.segment_after is None
            and req.on_segment_issued is None)


class TransferEngine:
    """Per-link priority queues with chunking, one `LinkWorker` per link (runtime/transfer_worker.py: its
    threads, CUDA streams and in-flight bound), and per-class accounting."""

    def __init__(
        self,
        device: Device,
        chunk_bytes: int | None = DEFAULT_CHUNK_BYTES,
        max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
        max_inflight_chunks: int = 64,
        disk_workers: int = 2,
        clock: Callable[[], float] = time.monotonic,
        urgent_stream: bool = False,
        retire_thread: bool = False,
    ) -> None:
        if chunk_bytes is not None and (chunk_bytes < MIN_CHUNK_BYTES or chunk_bytes % DIRECT_ALIGN_BYTES):
            raise ConfigError(
                f"chunk_bytes must be None (no chunking) or a multiple of {DIRECT_ALIGN_BYTES} that is "
                f">= {MIN_CHUNK_BYTES}, got {chunk_bytes}"
            )
        if max_inflight_chunks < 1 or disk_workers < 1 or max_inflight_bytes < 1:
            raise ConfigError("max_inflight_bytes, max_inflight_chunks and disk_workers must be >= 1")
        self.max_inflight_bytes = max_inflight_bytes
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.max_inflight_chunks = max_inflight_chunks
        self.clock = clock
        self._seq = itertools.count()
        self._stats = TransferStats()
        self._queues = {lk: LinkQueue() for lk in Link}
        dev = device.torch_device.type  # where each link's src and dst must be
        self._sides = {Link.H2D: ("cpu", dev), Link.D2H: (dev, "cpu"), Link.DISK2H: ("file", "cpu"),
                       Link.H2DISK: ("cpu", "file")}
        self._closing = False
        # urgent_stream: URGENT KV chunks of the memory links go on their own high-priority stream, outside the
        # in-flight bound, so they never queue behind bulk copies and the bound can be raised for bulk loads.
        # retire_thread: a memory link's finished chunks are accounted (and their on_done run) on a second thread,
        # in order, which runs while the worker waits in GIL-free driver calls (slot remaps, copies); False keeps it
        # on the worker, where it does not contend for the GIL (figures: bench/results/design_notes.md).
        self._workers: dict[Link, LinkWorker] = {}
        for lk in Link:
            memory = lk in MEMORY_LINKS
            self._workers[lk] = LinkWorker(
                lk, self._queues[lk], device, self._stats, clock, max_inflight_bytes, max_inflight_chunks,
                num_threads=1 if memory else disk_workers, stream=device.new_stream() if memory else None,
                urgent_stream=device.new_stream(priority=-1) if memory and urgent_stream else None,
                retire_thread=retire_thread)
        for worker in self._workers.values():
            worker.start()

    @property
    def last_idle_error(self) -> BaseException | None:
        """The last exception an idle job raised (each is also counted in its link's `idle_job_errors`)."""
        return self._stats.last_idle_error

    # ---- submission -------------------------------------------------------------------------------
    def _validate(self, req: TransferRequest, checked: set[tuple[int, int]] | None = None
                  ) -> list[tuple[int, int, int]]:
        """The request's segments as (src_offset, dst_offset, bytes), or ConfigError. `checked` holds (id(src),
        id(dst)) pairs whose sides were already found right in this call (a prefetch list reads one buffer into
        one range): only the byte ranges are checked again."""
        if checked is None or (id(req.src), id(req.dst)) not in checked:
            want = self._sides[req.link]
            for side, buf, where in (("src", req.src, want[0]), ("dst", req.dst, want[1])):
                got = "file" if isinstance(buf, FileRegion) else buf.device.type
                if got != where:
                    raise ConfigError(f"{req.link.value} transfer: {side} must be on {where}, got {got}")
                if isinstance(buf, torch.Tensor) and not buf.is_contiguous():
                    raise ConfigError(f"{req.link.value} transfer: {side} tensor must be contiguous")
            if checked is not None:
                checked.add((id(req.src), id(req.dst)))
        n_src, n_dst = nbytes(req.src), nbytes(req.dst)
        if req.segments is not None:
            if req.num_bytes is not None or req.src_offset_bytes or req.dst_offset_bytes:
                raise ConfigError(f"{req.link.value} transfer: segments replace num_bytes and the byte offsets")
            if not req.segments:
                raise ConfigError(f"{req.link.value} transfer: segments is empty")
            try:  # a copy: the worker cuts chunks from it later, whatever the caller does with its list meanwhile
                segs = [(index(s), index(d), index(n)) for s, d, n in req.segments]
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{req.link.value} transfer: segments must be (src_offset, dst_offset, num_bytes) "
                                  f"integer triples: {exc}") from None
        elif req.num_bytes is None:
            if req.src_offset_bytes or req.dst_offset_bytes:
                raise ConfigError(f"{req.link.value} transfer: byte offsets need num_bytes")
            if n_src != n_dst or n_src <= 0:
                raise ConfigError(f"{req.link.value} transfer: src has {n_src} bytes, dst {n_dst}; "
                                  "need equal and > 0")
            return [(0, 0, n_src)]
        else:
            segs = [(req.src_offset_bytes, req.dst_offset_bytes, req.num_bytes)]
        for i, (src_off, dst_off, n) in enumerate(segs):
            if n <= 0 or src_off < 0 or dst_off < 0 or src_off + n > n_src or dst_off + n > n_dst:
                where = f"segment {i}: " if req.segments is not None else ""
                raise ConfigError(f"{req.link.value} transfer: {where}src bytes [{src_off}, {src_off + n}) of "
                                  f"{n_src}, dst bytes [{dst_off}, {dst_off + n}) of {n_dst}; need num_bytes > 0 "
                                  "and both ranges inside their buffers")
        return segs

    def submit(self, req: TransferRequest) -> TransferHandle:
        """Queue a transfer; raises ConfigError (nothing queued) for a malformed request."""
        return self.submit_many([req])[0]

    def submit_many(self, reqs: list[TransferRequest]) -> list[TransferHandle]:
        """Queue transfers of one link at once (a prefetch list: one lock, one wake-up, in list order at equal
        priority). Every request is checked first: a malformed one raises ConfigError and none is queued."""
        if self._closing:
            raise TransferError("transfer engine is closed")
        if not reqs:
            return []
        prepared = self._prepare(reqs)
        q = self._queues[reqs[0].link]
        with q.cv:
            if self._closing:  # re-checked under the queue lock: a worker may be exiting on an empty queue
                raise TransferError("transfer engine is closed")
            for _h, qt in prepared:
                heapq.heappush(q.heap, qt)
            q.cv.notify_all()  # disk links have several workers: a multi-chunk transfer should wake them all
        return [h for h, _qt in prepared]

    def _prepare(self, reqs: list[TransferRequest]) -> list[tuple[TransferHandle, QueuedTransfer]]:
        """Check every request of one link (ConfigError, nothing made, for a malformed one); a handle and a queue
        entry each."""
        if self._closing:
            raise TransferError("transfer engine is closed")
        link = reqs[0].link
        all_segs: list[list[tuple[int, int, int]]] = []
        checked: set[tuple[int, int]] = set()
        for i, req in enumerate(reqs):
            if req.link is not link:
                raise ConfigError(f"submit_many: request {i} is on {req.link.value}, request 0 on {link.value}; "
                                  "one link per call")
            if link in (Link.DISK2H, Link.H2DISK) and (req.before_issue is not None or req.before_segment is not None
                                                       or req.on_segment_issued is not None
                                                       or req.segment_after is not None):
                raise ConfigError("before_issue, before_segment, on_segment_issued and segment_after are only "
                                  "ordered on memory links (disk links run parallel workers)")
            if req.segment_after is not None and len(req.segment_after) != len(req.segments or [None]):
                raise ConfigError(f"submit_many: request {i} has {len(req.segment_after)} segment_after lists for "
                                  f"{len(req.segments or [None])} segment(s)")
            all_segs.append(self._validate(req, checked))
        now, cb = self.clock(), self.chunk_bytes
        group_bytes = cb if cb is not None else DEFAULT_CHUNK_BYTES
        out = []
        for req, segs in zip(reqs, all_segs, strict=True):
            groups = None
            if _groups_segments(req) and all(n <= group_bytes for _s, _d, n in segs):
                groups = segment_groups(segs, group_bytes, MAX_GROUP_PARTS)
                seg_chunks = [1] * len(segs)
                total_chunks = len(groups)
            else:
                seg_chunks = [num_chunks(n, cb) for _s, _d, n in segs]
                total_chunks = sum(seg_chunks)
            h = TransferHandle(req, sum(n for _s, _d, n in segs), total_chunks, now,
                               seg_chunks if req.segments is not None else None)
            key = (int(req.priority), float("inf") if req.deadline_s is None else req.deadline_s, next(self._seq))
            out.append((h, QueuedTransfer(key, h, segs, cb, total_chunks, groups)))
        return out

    def submit_now(self, req: TransferRequest) -> TransferHandle:
        """Issue a memory-link transfer on the calling thread, every chunk at once on the link's bulk stream (an
        urgent KV chunk too), ahead of what is queued (`LinkWorker.issue_now`; the worker retires what is still
        copying): for a list the caller waits for in full, whose hand-off to the worker would cost a wake-up per
        list. On the CPU twin the caller does the copies (and waits for `segment_after` events), and the chunks are
        retired before this returns. ConfigError (nothing issued) for a malformed request."""
        if req.link not in MEMORY_LINKS:
            raise ConfigError(f"submit_now: {req.link.value} is not a memory link (disk links run parallel workers)")
        h, qt = self._prepare([req])[0]
        self._workers[req.link].issue_now(qt)
        return h

    def submit_idle(self, link: Link, job: Callable[[], None], priority: Priority = Priority.NORMAL,
                    deadline_s: float | None = None) -> None:
        """Queue `job` for a memory link's worker to run when it cannot issue a copy (the in-flight bound is
        reached or nothing is queued) and its oldest copy is still running: host work such as a slot map then
        fills the worker's waits instead of delaying copies or contending on another thread. Jobs run in
        (priority, deadline, arrival) order, all before close() returns; one must report its own outcome (an
        exception is counted in the link's `idle_job_errors` and kept in `last_idle_error`)."""
        if link not in MEMORY_LINKS:
            raise ConfigError(f"submit_idle: {link.value} is not a memory link (disk links run parallel workers)")
        q = self._queues[link]
        with q.cv:
            if self._closing:
                raise TransferError("transfer engine is closed")
            deadline = float("inf") if deadline_s is None else deadline_s
            heapq.heappush(q.idle, (int(priority), deadline, next(self._seq), job))
            q.cv.notify()

    # ---- introspection ----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return self._stats.snapshot()

    def pending_chunks(self, link: Link) -> int:
        """Chunks queued on `link` and not yet taken by a worker."""
        with self._queues[link].cv:
            return sum(e.left for e in self._queues[link].heap)

    def close(self) -> None:
        """Finish everything queued, then stop the workers; later submits (also from callbacks) are refused."""
        for q in self._queues.values():
            with q.cv:
                self._closing = q.closing = True
                q.cv.notify_all()
        for worker in self._workers.values():
            worker.join()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
