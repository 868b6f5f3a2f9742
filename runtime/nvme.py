"""A file on local NVMe read and written with O_DIRECT (inference process).

O_DIRECT bypasses the page cache so disk bandwidth is real and host memory is not double-booked. Every
offset, length and buffer address must be aligned to `DIRECT_ALIGN_BYTES`. Where the filesystem refuses
O_DIRECT (tmpfs, some overlays) the file falls back to buffered I/O, and says so in `direct_io` and
`fallback_reason`: the fallback is never silent. Inference process; it must never decide what lives where.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from tierplan.runtime.errors import AlignmentError, ConfigError

DIRECT_ALIGN_BYTES = 4096


def align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class FileRegion:
    """`length_bytes` bytes at `offset_bytes` of a `DirectFile` (the disk side of a transfer)."""

    file: DirectFile
    offset_bytes: int
    length_bytes: int

    def sub(self, start_bytes: int, length_bytes: int) -> FileRegion:
        return FileRegion(self.file, self.offset_bytes + start_bytes, length_bytes)


class DirectFile:
    """A fixed-size file opened for aligned positional I/O; thread-safe (pread/pwrite carry their offset)."""

    def __init__(self, path: str | os.PathLike[str], size_bytes: int, direct: bool = True) -> None:
        if size_bytes <= 0 or size_bytes % DIRECT_ALIGN_BYTES:
            raise AlignmentError(
                f"DirectFile {path}: size_bytes must be a positive multiple of {DIRECT_ALIGN_BYTES}, got {size_bytes}"
            )
        self.path = Path(path)
        self.size_bytes = size_bytes
        self.fallback_reason: str | None = None
        self._lock = threading.Condition()
        self._io_in_flight = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT
        self.direct_io = False
        if direct:
            try:
                self._fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
                self.direct_io = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.fallback_reason = f"O_DIRECT refused by the filesystem of {self.path} ({exc.strerror})"
        else:
            self.fallback_reason = "O_DIRECT disabled by the caller"
        if not self.direct_io:
            self._fd = os.open(self.path, flags, 0o600)
        os.ftruncate(self._fd, size_bytes)

    def _check(self, op: str, offset_bytes: int, buf: torch.Tensor) -> memoryview:
        if buf.device.type != "cpu" or buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise ConfigError(f"{op} {self.path}: buffer must be a contiguous uint8 CPU tensor")
        n = buf.numel()
        if offset_bytes < 0 or offset_bytes + n > self.size_bytes:
            raise ConfigError(
                f"{op} {self.path}: range [{offset_bytes}, {offset_bytes + n}) outside file of {self.size_bytes} bytes"
            )
        if self.direct_io:
            for what, v in (("offset", offset_bytes), ("length", n), ("buffer address", buf.data_ptr())):
                if v % DIRECT_ALIGN_BYTES:
                    raise AlignmentError(
                        f"{op} {self.path}: {what} {v} is not a multiple of {DIRECT_ALIGN_BYTES} (O_DIRECT)"
                    )
        return memoryview(buf.numpy())

    def _io(self, op: str, offset_bytes: int, buf: torch.Tensor) -> None:
        mv = self._check(op, offset_bytes, buf)
        with self._lock:  # close() waits for I/O in flight: a reused fd number must never get our bytes
            if self._fd < 0:
                raise ValueError(f"{op} {self.path}: file is closed")
            self._io_in_flight += 1
        try:
            call = os.preadv if op == "read" else os.pwritev
            done = 0
            while done < len(mv):
                n = call(self._fd, [mv[done:]], offset_bytes + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"short {op} at {offset_bytes + done} of {self.path}")
                done += n
        finally:
            with self._lock:
                self._io_in_flight -= 1
                self._lock.notify_all()

    def read_into(self, offset_bytes: int, dst: torch.Tensor) -> None:
        self._io("read", offset_bytes, dst)

    def write_from(self, offset_bytes: int, src: torch.Tensor) -> None:
        self._io("write", offset_bytes, src)

    def region(self, offset_bytes: int, length_bytes: int) -> FileRegion:
        return FileRegion(self, offset_bytes, length_bytes)

    def close(self) -> None:
        with self._lock:
            while self._io_in_flight:
                self._lock.wait()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
