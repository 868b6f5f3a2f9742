"""A submitted transfer and its chunks (inference process): `TransferHandle`, the queue entries, and how a
transfer is cut into chunks. Used by `runtime.transfer`'s engine and its link workers, which change a handle
only through its methods (`start`, `chunk_issued`, `chunk_retired`, `finish`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tierplan.runtime.device import Event, byte_range
from tierplan.runtime.errors import TransferError
from tierplan.runtime.future import Latch
from tierplan.runtime.nvme import DIRECT_ALIGN_BYTES, FileRegion
from tierplan.runtime.transfer_types import Buffer, TransferRequest


class TransferHandle:
    """A submitted transfer: poll with `done()`, block with `wait()`, order a stream with `device_event()`."""

    def __init__(self, request: TransferRequest, num_bytes: int, num_chunks: int, submit_s: float,
                 segment_chunks: list[int] | None = None) -> None:
        self.request = request
        self.num_bytes = num_bytes
        self.submit_s = submit_s
        self.start_s: float | None = None
        self.end_s: float | None = None
        self.error: BaseException | None = None  # the whole transfer failed (a copy): later chunks are skipped
        self.segment_errors: dict[int, BaseException] = {}  # segments that failed on their own (their hook)
        self._remaining = num_chunks
        self._seg_left = segment_chunks  # chunks not yet retired, per segment (None: one segment, no callbacks)
        self._seg_failures: dict[int, BaseException] = {}  # segments with a chunk that failed or was skipped
        self._unissued = num_chunks
        self._last_event: Event | None = None
        self._issued = Latch()
        self._done = Latch()

    @property
    def ok(self) -> bool:
        """True once finished without error in any segment; already valid inside `on_done`."""
        return self.end_s is not None and self.error is None and not self.segment_errors

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> TransferHandle:
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"transfer on {self.request.link.value} not done within {timeout_s} s")
        if self.error is not None:
            raise TransferError(f"transfer on {self.request.link.value} failed: {self.error}") from self.error
        if self.segment_errors:
            i = min(self.segment_errors)
            err = self.segment_errors[i]
            raise TransferError(f"transfer on {self.request.link.value}: segments {sorted(self.segment_errors)} "
                                f"failed; segment {i}: {err}") from err
        return self

    def device_event(self, timeout_s: float | None = None) -> Event | None:
        """The event of the last chunk once every chunk is issued (stream order makes it cover all)."""
        if not self._issued.wait(timeout_s):
            raise TimeoutError("transfer not fully issued in time")
        return self._last_event

    # ---- what a link worker calls (with the engine's stats lock held where it says so) ------------------
    def start(self, now_s: float) -> bool:
        """The first chunk is being issued: records the start time; True for the first call (stats lock held)."""
        first = self.start_s is None
        if first:
            self.start_s = now_s
        return first

    def chunk_issued(self, event: Event | None) -> None:
        """One more chunk issued; the last one's event covers the whole transfer (stats lock held)."""
        self._unissued -= 1
        if self._unissued == 0:
            self._last_event = event
            self._issued.set()

    def chunk_failed(self, seg: int, failed: BaseException) -> None:
        """A chunk of segment `seg` failed or was skipped: the transfer fails, and the segment reports it."""
        if self.error is None:
            self.error = failed
        self._seg_failures.setdefault(seg, failed)

    def chunk_retired(self, segs: range) -> tuple[bool, list[int]]:
        """One more chunk accounted, of segments `segs` (one, or a group's): (the transfer's last, the segments it
        finished) (stats lock held)."""
        self._remaining -= 1
        last = self._remaining == 0
        if self._seg_left is None:
            return last, list(segs) if last else []
        done = []
        for s in segs:
            self._seg_left[s] -= 1
            if self._seg_left[s] == 0:
                done.append(s)
        return last, done

    def segment_error(self, seg: int) -> BaseException | None:
        """What segment `seg` reports when done: a failed chunk's error, else its own hook's."""
        return self._seg_failures.get(seg) or self.segment_errors.get(seg)

    def finish(self, now_s: float) -> None:
        """Every chunk is accounted: fully issued, with an end time (before `on_done` runs)."""
        self.end_s = now_s
        self._issued.set()

    def settle(self) -> None:
        """`on_done` ran and the statistics are in: `done()` and `wait()` return from now on."""
        self._done.set()

    @property
    def queue_delay_s(self) -> float | None:
        return None if self.start_s is None else self.start_s - self.submit_s

    @property
    def latency_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.submit_s


@dataclass(slots=True)
class Chunk:
    """One copy a worker issues: `length_bytes` from `src_offset_bytes` of the request's src to `dst_offset_bytes`
    of its dst (absolute), the chunk of segment `seg` that comes `first` and/or `last` in it; `key` is its
    transfer's queue key (priority, deadline, arrival); it belongs to segments [seg, seg_end). A group (`parts`
    set) is whole segments of a list, each (src_offset_bytes, dst_offset_bytes, num_bytes), copied back to back
    under one event."""

    key: tuple[int, float, int]
    handle: TransferHandle
    seg: int
    src_offset_bytes: int
    dst_offset_bytes: int
    length_bytes: int
    first: bool
    last: bool
    seg_end: int
    parts: list[tuple[int, int, int]] | None = None

    @property
    def segs(self) -> range:
        return range(self.seg, self.seg_end)


class QueuedTransfer:
    """A submitted transfer in its link's queue, ordered by `key`. Its chunks are cut one at a time as a worker
    reaches them (`head` is the next one), so submitting a prefetch list of many segments costs O(1) per segment
    and the link starts copying sooner. Chunks of one transfer leave in order, back to back at equal key."""

    __slots__ = ("chunk_bytes", "groups", "handle", "head", "key", "left", "seg", "segs", "span", "spans")

    def __init__(self, key: tuple[int, float, int], handle: TransferHandle, segs: list[tuple[int, int, int]],
                 chunk_bytes: int | None, num_chunks: int, groups: list[int] | None = None) -> None:
        """groups: the list's segments as group chunks, each group's end (`segment_groups`); None: chunks cut
        from each segment (`chunk_spans`)."""
        self.key, self.handle, self.segs, self.chunk_bytes = key, handle, segs, chunk_bytes
        self.groups = groups
        self.left = num_chunks  # chunks not yet taken, head included
        self.seg, self.span = 0, 0
        self.spans = chunk_spans(segs[0][2], chunk_bytes) if groups is None else []
        self.head = self._cut()

    def __lt__(self, other: QueuedTransfer) -> bool:
        return self.key < other.key

    def _cut(self) -> Chunk:
        if self.groups is not None:
            end = self.groups[self.span]
            parts = self.segs[self.seg:end]
            src, dst, _n = parts[0]
            return Chunk(self.key, self.handle, self.seg, src, dst, sum(n for _s, _d, n in parts), True, True,
                         end, parts)
        src, dst, _n = self.segs[self.seg]
        off, length = self.spans[self.span]
        return Chunk(self.key, self.handle, self.seg, src + off, dst + off, length, self.span == 0,
                      self.span == len(self.spans) - 1, self.seg + 1)

    def take(self) -> Chunk:
        """The head chunk; the next one becomes the head (check `left` before taking: 0 means none is left)."""
        ch = self.head
        self.left -= 1
        if self.left and self.groups is not None:
            self.seg, self.span = self.groups[self.span], self.span + 1
            self.head = self._cut()
        elif self.left:
            if self.span + 1 < len(self.spans):
                self.span += 1
            else:
                self.seg, self.span = self.seg + 1, 0
                self.spans = chunk_spans(self.segs[self.seg][2], self.chunk_bytes)
            self.head = self._cut()
        return ch


def nbytes(buf: Buffer) -> int:
    return buf.length_bytes if isinstance(buf, FileRegion) else buf.numel() * buf.element_size()


def num_chunks(n: int, chunk_bytes: int | None) -> int:
    """How many chunks `chunk_spans` cuts n bytes into (O(1): submission counts them without cutting)."""
    return 1 if chunk_bytes is None or n < 2 * chunk_bytes else n // chunk_bytes


def segment_groups(segs: list[tuple[int, int, int]], group_bytes: int, max_parts: int) -> list[int]:
    """Consecutive segments in groups of at most `max_parts` and `group_bytes` (one segment at least): each
    group's end index (exclusive)."""
    ends, size, count = [], 0, 0
    for i, (_s, _d, n) in enumerate(segs):
        if count and (count == max_parts or size + n > group_bytes):
            ends.append(i)
            size, count = 0, 0
        size, count = size + n, count + 1
    ends.append(len(segs))
    return ends


def chunk_spans(n: int, chunk_bytes: int | None) -> list[tuple[int, int]]:
    """(offset, length) of each chunk: k = n // chunk_bytes even chunks of whole pages, each in
    [chunk_bytes, 2 * chunk_bytes); the sub-page remainder goes to the last. A 9 MiB expert at 4 MiB is
    2 x 4.5 MiB, never 4 + 4 + 1. Fewer than 2 * chunk_bytes moves whole."""
    k = num_chunks(n, chunk_bytes)
    if k == 1:
        return [(0, n)]
    pages, tail = divmod(n, DIRECT_ALIGN_BYTES)
    spans, off = [], 0
    for i in range(k):
        length = (pages // k + (1 if i < pages % k else 0)) * DIRECT_ALIGN_BYTES + (tail if i == k - 1 else 0)
        spans.append((off, length))
        off += length
    return spans


def byte_slice(buf: Buffer, off: int, n: int) -> Buffer:
    """Bytes [off, off + n) of a buffer: a file sub-region, or a byte view (the tensor itself if it is that)."""
    return buf.sub(off, n) if isinstance(buf, FileRegion) else byte_range(buf, off, n)


# The names these had while they were private (older imports, e.g. tests/runtime/test_transfer_lists.py).
_Queued, _chunk_spans, _num_chunks = QueuedTransfer, chunk_spans, num_chunks
