"""A submitted transfer and its chunks (inference process): `TransferHandle`, the queue entries, and how a
transfer is cut into chunks. Used by `runtime.transfer`'s engine and its link workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.device import Event, byte_range
from runtime.errors import TransferError
from runtime.future import Latch
from runtime.nvme import DIRECT_ALIGN_BYTES, FileRegion
from runtime.transfer_types import Buffer, TransferRequest


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

    @property
    def queue_delay_s(self) -> float | None:
        return None if self.start_s is None else self.start_s - self.submit_s

    @property
    def latency_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.submit_s


@dataclass(order=True, slots=True)
class _Chunk:
    """A queue entry: `length_bytes` from `src_offset_bytes` of the request's src to `dst_offset_bytes` of its dst
    (absolute), the chunk of segment `seg` that comes `first` and/or `last` in it."""

    key: tuple[int, float, int]
    handle: TransferHandle = field(compare=False)
    seg: int = field(compare=False)
    src_offset_bytes: int = field(compare=False)
    dst_offset_bytes: int = field(compare=False)
    length_bytes: int = field(compare=False)
    first: bool = field(compare=False)
    last: bool = field(compare=False)


def _nbytes(buf: Buffer) -> int:
    return buf.length_bytes if isinstance(buf, FileRegion) else buf.numel() * buf.element_size()


def _chunk_spans(n: int, chunk_bytes: int | None) -> list[tuple[int, int]]:
    """(offset, length) of each chunk: k = n // chunk_bytes even chunks of whole pages, each in
    [chunk_bytes, 2 * chunk_bytes); the sub-page remainder goes to the last. A 9 MiB expert at 4 MiB is
    2 x 4.5 MiB, never 4 + 4 + 1. Fewer than 2 * chunk_bytes moves whole."""
    if chunk_bytes is None or n < 2 * chunk_bytes:
        return [(0, n)]
    k = n // chunk_bytes
    pages, tail = divmod(n, DIRECT_ALIGN_BYTES)
    spans, off = [], 0
    for i in range(k):
        length = (pages // k + (1 if i < pages % k else 0)) * DIRECT_ALIGN_BYTES + (tail if i == k - 1 else 0)
        spans.append((off, length))
        off += length
    return spans


def _slice(buf: Buffer, off: int, n: int) -> Buffer:
    """Bytes [off, off + n) of a buffer: a file sub-region, or a byte view (the tensor itself if it is that)."""
    return buf.sub(off, n) if isinstance(buf, FileRegion) else byte_range(buf, off, n)
